"""Peak memory per process of a training run, with and without ``--cache``, at two data set sizes.

One epoch of shufflenet_v2_x0_5 at 128 px on 600 and on 2,400 JPEGs, twice:
as a CPU run decodes by default (no loader workers: a thread pool in the
training process) and with one loader worker process (as on a GPU machine).
Peak RSS comes from ``getrusage``: the main process's own, and the largest of
its children (the loader worker; without one, the ``ldconfig -p`` that
``ctypes.util.find_library`` runs at import, forked from the main process
before it reads any data). The cache files are 4x larger for the
larger set; the cached runs' peaks should not follow them, because the cache
is memory-mapped and each read's pages are dropped from the process again.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from common import ROOT, WORK, run, sample_data, write_result
from visiontune.data.sources import discover
from visiontune.loading.cache import open_or_build
from visiontune.tasks import AUTO

# 128 px: the larger set's cache is 84 MiB bigger, well above the few MiB that peaks vary by run to run.
SIZE, SETS, WORKERS = 128, (300, 1200), ("0", "1")


def peak(data, extra) -> dict:
    with tempfile.TemporaryDirectory() as out:
        res = run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "_rss_run.py"),
                "--data",
                str(data),
                "--output-dir",
                out,
                "--model",
                "shufflenet_v2_x0_5",
                "--weights",
                "none",
                "--image-size",
                str(SIZE),
                "--epochs",
                "1",
                "--batch-size",
                "32",
                "--no-progress",
                *extra,
            ]
        )
    return json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("RSS ")][-1][4:])


def main() -> None:
    rows = []
    for per_class in SETS:
        data = sample_data(per_class)
        cache = open_or_build(str(WORK / "cache"), discover(str(data), task=AUTO).paths, SIZE)
        for workers in WORKERS:
            for label, extra in (("no cache", []), ("cache", ["--cache", str(WORK / "cache")])):
                rows.append(
                    {
                        "images": 2 * per_class,
                        "workers": workers,
                        "mode": label,
                        "cache_file_mib": os.path.getsize(cache.array_path) / 2**20 if extra else 0.0,
                        **peak(data, ["--num-workers", workers, *extra]),
                    }
                )
                print(f"rss: {rows[-1]}")
    by = {(r["images"], r["workers"], r["mode"]): r for r in rows}
    small, large = 2 * SETS[0], 2 * SETS[1]
    growth = {
        f"{m}, {w} workers": {
            k: by[(large, w, m)][k] - by[(small, w, m)][k] for k in ("main_mib", "largest_worker_mib")
        }
        for w in WORKERS
        for m in ("no cache", "cache")
    }
    write_result(
        "rss",
        {
            "what": f"peak RSS per process, 1 epoch, shufflenet_v2_x0_5 {SIZE} px, "
            "0 (a CPU run's default) and 1 loader worker",
            "rows": rows,
            "growth_small_to_large_mib": growth,
            "cache_file_growth_mib": by[(large, "0", "cache")]["cache_file_mib"]
            - by[(small, "0", "cache")]["cache_file_mib"],
        },
    )


if __name__ == "__main__":
    sys.exit(main())
