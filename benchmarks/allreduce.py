"""Under torchrun: seconds per gloo all-reduce of a model's gradients (prints JSON on rank 0)."""

import json
import sys
import time

import torch
import torch.distributed as dist

from visiontune.models.build import build_model

dist.init_process_group("gloo")
grads = [torch.randn_like(p) for p in build_model(sys.argv[1], 2, "none").parameters()]
# DDP buckets gradients (25 MiB each) and reduces bucket by bucket; time the same bytes that way.
flat = torch.cat([g.flatten() for g in grads])
buckets = flat.split(25 * 2**20 // 4)
for b in buckets:
    dist.all_reduce(b)
times = []
for _ in range(5):
    dist.barrier()
    t0 = time.perf_counter()
    for b in buckets:
        dist.all_reduce(b)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(json.dumps({"params": flat.numel(), "seconds": sorted(times)[2]}))
dist.destroy_process_group()
