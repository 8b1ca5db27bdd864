"""What the image cache's content check costs: ``digest_file`` (xxh3-128 over the array) in GB/s, and what
that comes to for 1.28M images (ImageNet-1k) at 64 and 224 px. Not part of ``make bench`` (no table row).

    PYTHONPATH=src python benchmarks/cache_digest.py [MiB, default 1024]

The array is hashed once to bring it into the page cache (as right after a build), then timed five times.
CPU time is the figure to read on a shared machine: wall time there is mostly waiting for a core.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

from visiontune.loading.cache import digest_file

mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
n = mib * 2**20
fd, path = tempfile.mkstemp(suffix=".u8")
try:
    with os.fdopen(fd, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())
    digest_file(path)
    runs = []
    for _ in range(5):
        wall, cpu = time.perf_counter(), time.process_time()
        digest_file(path)
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
finally:
    os.unlink(path)
wall, cpu = (n / min(r[i] for r in runs) / 1e9 for i in (0, 1))
print(f"{mib} MiB from the page cache, best of 5: {wall:.2f} GB/s wall, {cpu:.2f} GB/s of one core's CPU time")
for size in (64, 224):
    total = 1_281_167 * 3 * size * size / 1e9
    print(f"1.28M images at {size} px: {total:.1f} GB, {total / cpu:.1f} s of one core (load {os.getloadavg()[0]:.0f})")
