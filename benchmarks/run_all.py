"""``make bench``: every CPU benchmark, each in its own process, then the README table from the JSON results."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import python_env  # noqa: E402
from table import write_table  # noqa: E402

start = time.perf_counter()
for name in sys.argv[1:] or (
    "loader",
    "overhead",
    "contention",
    "epoch_end",
    "e2e",
    "ddp",
    "rss",
    "startup",
    "tta",
    "recipe",
    "transfer",
    "process",
    "shards",
    "deploy",
):
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    subprocess.run([sys.executable, str(HERE / f"{name}.py")], env=python_env(), cwd=HERE, check=True)
    print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
write_table()
print(f"all benchmarks: {time.perf_counter() - start:.0f} s, load average {os.getloadavg()}")
