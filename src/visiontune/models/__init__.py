"""models: model specs per source (torchvision, timm, the Hub), building, heads and loading weights.

Owns: turning a model name and weights into an ``nn.Module`` with the right head, and the
preprocessing its weights expect. Imports only the foundation (``errors``).
"""
