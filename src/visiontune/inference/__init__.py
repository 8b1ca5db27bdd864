"""inference: a trained model loaded once, and what is done with it -- predict, evaluate, TTA, export, serve.

Owns: reading a run folder or a self-describing model file back into a model and its
preprocessing (``loaded``), and the commands that use it. May import training (the shared
forward pass), runs, reports, data, cluster, settings, models and the foundation.
"""
