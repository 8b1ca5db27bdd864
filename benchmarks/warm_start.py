"""Warm start with the image cache built: seconds to ``train``'s first line and to its run-folder line.

Data: a Kaggle-layout folder (``train/cat.N.jpg``, ``train/dog.N.jpg``) of N files that are hard links to
64 random 64 px JPEGs: real files for the listing and each file's ``stat``, made in seconds. A first,
unrecorded run builds the default image cache (``--cache fit``) in a temp ``VISIONTUNE_CACHE_DIR``; each
recorded run then starts ``visiontune train`` (squeezenet1_1, weights none) again and is stopped at its
run-folder line (the start-up table follows it: the start is done). Three runs a size, each with the
load average beside it and the command's user + system CPU seconds (``RUSAGE_CHILDREN``): on a shared
machine wall seconds wait for a core, CPU seconds are the work.

    PYTHONPATH=src python benchmarks/warm_start.py [N ...]   # default 250000; e.g. 250000 1280000

``VT_WARM_SIZE`` is the image size (default 64; 1.28M files at 64 px is 15 GiB, over ``--cache fit``'s
8 GiB cap, so that size is run at 32 px), ``VT_WARM_PROFILE=1`` adds a ``cProfile`` of one more run
(its top entries printed), ``VT_WARM_OUT`` names the result files (``warm_start``), ``VT_WARM_KEEP=1``
keeps the files and the cache for the next call (they are deleted otherwise), ``VT_WARM_SRC`` adds runs of another
version's ``src`` folder (``git archive REV src | tar -x -C DIR``), interleaved with this one's: a before/after.
"""

from __future__ import annotations

import io
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from common import RESULTS, WORK, python_env, write_result

SOURCES = 64  # ext4 allows 65,000 links to a file: 1.28M files need 20 or more
OUT = os.environ.get("VT_WARM_OUT", "warm_start")
RUNS = 3


def image_size(n: int) -> int:
    return int(os.environ.get("VT_WARM_SIZE", "64" if n <= 500_000 else "32"))


def make_folder(n: int) -> Path:
    """``n`` hard links in the Kaggle layout, made once per size (reused by a ``VT_WARM_KEEP`` call)."""
    out = WORK / f"warm-{n}"
    if (out / ".done").exists():
        return out / "data"
    shutil.rmtree(out, ignore_errors=True)
    (out / "src").mkdir(parents=True)
    (out / "data" / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for s in range(SOURCES):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
        (out / "src" / f"{s}.jpg").write_bytes(buf.getvalue())
    for i in range(n // 2):
        for c, label in enumerate(("cat", "dog")):
            os.link(out / "src" / f"{(2 * i + c) % SOURCES}.jpg", out / "data" / "train" / f"{label}.{i}.jpg")
    (out / ".done").touch()
    return out / "data"


def command(data: Path, n: int, out: Path, profile: Path | None = None) -> list[str]:
    head = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m"] if profile else [sys.executable, "-m"]
    return [
        *head,
        "visiontune",
        "train",
        "--data",
        str(data),
        "--model",
        "squeezenet1_1",
        "--weights",
        "none",
        "--image-size",
        str(image_size(n)),
        "--batch-size",
        "32",
        "--epochs",
        "1",
        "--max-steps",
        "1",
        "--no-progress",
        "--num-workers",
        "0",
        "--output-dir",
        str(out),
    ]


def start(
    data: Path, n: int, cache: Path, stop: bool = True, profile: Path | None = None, src: str | None = None
) -> dict:
    """One ``train``: seconds to its first line and its run-folder line, then stopped (unless ``stop`` is off)."""
    out = WORK / f"warm-run-{n}"
    shutil.rmtree(out, ignore_errors=True)
    env = python_env()
    if src:  # another version's src folder (a `git archive` of it), for a before/after
        env["PYTHONPATH"] = src
    env.update(VISIONTUNE_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        command(data, n, out, profile), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first = folder = None
    lines = []
    for line in proc.stdout:
        now = time.perf_counter() - t0
        lines.append(line)
        first = first if first is not None else now
        if "| run folder " in line:
            folder = now
            if stop:
                proc.terminate() if profile is None else proc.send_signal(2)  # SIGINT: cProfile still writes
                break
    proc.stdout.close()
    proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if folder is None:
        sys.stderr.write("".join(lines[-30:]))
        raise SystemExit("the run printed no run-folder line")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {
        "first_line_s": round(first, 2),
        "run_folder_s": round(folder, 2),
        "cpu_s": round(cpu, 2),
        "load_1min": round(load, 2),
        "first_line": lines[0].rstrip(),
    }


def main(sizes: list[int]) -> None:
    rows = []
    for n in sizes:
        t = time.time()
        data = make_folder(n)
        cache = WORK / f"warm-cache-{n}"
        cache.mkdir(mode=0o700, exist_ok=True)
        print(f"warm_start: {n} files ready ({time.time() - t:.0f} s)", flush=True)
        if not any(cache.glob("*.u8")):
            t = time.time()
            start(data, n, cache)  # builds the image cache (and the scan's records), then stopped
            print(f"warm_start: cache built ({time.time() - t:.0f} s)", flush=True)
        before = os.environ.get("VT_WARM_SRC")
        codes = [("before", before), ("after", None)] if before else [("this checkout", None)]
        for _, src in codes:  # unrecorded: a first open after a build hashes the array and stamps it
            start(data, n, cache, src=src)
        for _ in range(RUNS):  # interleaved, so that a machine getting busier or quieter affects both alike
            for code, src in codes:
                r = {"files": n, "image_size": image_size(n), "code": code, **start(data, n, cache, src=src)}
                rows.append(r)
                shown = {k: v for k, v in r.items() if k != "first_line"}
                print(f"warm_start: {shown}", flush=True)
        if os.environ.get("VT_WARM_PROFILE"):
            import pstats

            prof = WORK / f"warm-{n}.prof"
            start(data, n, cache, profile=prof)
            pstats.Stats(str(prof)).sort_stats("cumulative").print_stats(35)
        if not os.environ.get("VT_WARM_KEEP"):
            shutil.rmtree(WORK / f"warm-{n}", ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
    result = {
        "what": "warm `visiontune train` with the image cache built: seconds to its first line and to its "
        "run-folder line, CPU seconds (user + system) of the command until stopped there",
        "command": " ".join(command(Path("DATA"), sizes[0], Path("OUT"))[1:]),
        "src": os.environ.get("VT_WARM_SRC", "this checkout"),
        "rows": rows,
    }
    write_result(OUT, result)
    (RESULTS / f"{OUT}.md").write_text(table(rows) + "\n")
    print(table(rows))


def table(rows: list[dict]) -> str:
    lines = [
        "| code | files | px | first line | run-folder line | CPU | load (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["files"], r["code"] != "before")):
        lines.append(
            f"| {r['code']} | {r['files']:,} | {r['image_size']} | {r['first_line_s']:.1f} s "
            f"| {r['run_folder_s']:.1f} s | {r['cpu_s']:.1f} s | {r['load_1min']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [250_000])
