"""One process of ``memory.py``: build MODEL as ``visiontune train`` does (``--lora R``, ``--grad-checkpointing``),
take STEPS AdamW steps on random batches, and print one JSON line: the bytes of the parameters, the
gradients and the optimizer state this process holds, the trainable parameters, and the peak RSS."""

import json
import resource
import sys
import time
from types import SimpleNamespace

import torch

from visiontune.models import checkpointing, lora
from visiontune.models.build import build_model, head_names
from visiontune.training.optim import build_optimizer

model_name, rank, grad_ckpt, batch, size, steps = sys.argv[1], *map(int, sys.argv[2:])
torch.manual_seed(0)
model = build_model(model_name, 10, "none")
if grad_ckpt:
    checkpointing.enable(model, model_name)
heads = head_names(model)
if rank:
    model = lora.add_adapters(model, rank, heads, targets=lora.default_targets(model, heads))
cfg = SimpleNamespace(optimizer="adamw", weight_decay=0.05, backbone_lr_mult=1.0, momentum=0.9)
optimizer = build_optimizer(model, cfg, 1e-4, tuple(heads))
built_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
model.train()
x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
t0 = time.perf_counter()
for _ in range(steps):
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
seconds = time.perf_counter() - t0


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


params = list(model.parameters())
state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
print(
    "MEM "
    + json.dumps(
        {
            "params": nbytes(params),
            "trainable_params": nbytes(p for p in params if p.requires_grad),
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_state": nbytes(state),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_after_build_mib": built_mib,
            "seconds_per_step": seconds / steps,
        }
    )
)
