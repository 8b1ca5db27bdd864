"""One process of ``memory.py``: build MODEL as ``visiontune train`` does (``--lora R``, ``--grad-checkpointing``),
take STEPS AdamW steps on random batches, and print one JSON line: the bytes of the parameters, the
gradients and the optimizer state this process holds, the trainable parameters, and the peak RSS.

STRATEGY ``ddp`` or ``fsdp``: one of the processes torchrun starts (gloo), the model wrapped in
DistributedDataParallel, or sharded block by block as ``--strategy fsdp`` shards it (FSDP2
``fully_shard`` on ``strategies.fsdp.blocks``, then the whole); the bytes are this process's own (a
sharded tensor's local shard)."""

import json
import resource
import sys
import time
from types import SimpleNamespace

import torch

from visiontune.models import checkpointing, lora
from visiontune.models.build import build_model, head_names
from visiontune.training.optim import build_optimizer

model_name, rank, grad_ckpt, batch, size, steps = sys.argv[1], *map(int, sys.argv[2:7])
strategy = sys.argv[7] if len(sys.argv) > 7 else "single"
torch.manual_seed(0)
model = build_model(model_name, 10, "none")
if grad_ckpt:
    checkpointing.enable(model, model_name)
heads = head_names(model)
if rank:
    model = lora.add_adapters(model, rank, heads, targets=lora.default_targets(model, heads))
cfg = SimpleNamespace(optimizer="adamw", weight_decay=0.05, backbone_lr_mult=1.0, momentum=0.9)
if strategy == "ddp":
    torch.distributed.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(model)
elif strategy == "fsdp":
    from torch.distributed.fsdp import fully_shard

    from visiontune.cluster.strategies.fsdp import blocks

    torch.distributed.init_process_group("gloo")
    for block in blocks(model):
        fully_shard(block)
    fully_shard(model)
optimizer = build_optimizer(getattr(model, "module", model), cfg, 1e-4, tuple(heads))
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
    local = [getattr(t, "_local_tensor", t) for t in tensors]  # a DTensor: this process's shard
    return sum(t.numel() * t.element_size() for t in local)


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
            "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        }
    )
)
