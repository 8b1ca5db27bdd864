"""End to end: ``visiontune train`` against the blog's script, each a fresh command.

Same data (2,400 synthetic Kaggle-layout JPEGs, 300-500 px), model (shufflenet_v2_x0_5,
no pretrained weights: the smallest torchvision model that learns the task, so
that on a CPU the input pipeline is a visible share of the work, as it is on a
GPU), image size (64 px), batch, threads (each side's default: all cores) and two epochs.
Two figures per side: the whole command's wall time (start-up, listing, both epochs,
the saved files), and the epochs (train + val phases) as each side times them.
visiontune runs three ways: as a CPU run does by default (each batch decoded by a
thread pool in the training process, ``--decode exact``), the same with ``--decode
fast`` (JPEGs decoded at a DCT scale), and with a warm ``--cache`` (built once
beforehand; the build time is reported). ``VT_E2E_PER_CLASS`` and ``VT_E2E_EPOCHS``
make it smaller.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from common import ROOT, WARMUP, WORK, interleave, run, sample_data, write_result

MODEL, SIZE, BATCH = "shufflenet_v2_x0_5", 64, 32
PER_CLASS, EPOCHS = int(os.environ.get("VT_E2E_PER_CLASS", "1200")), int(os.environ.get("VT_E2E_EPOCHS", "2"))
COMMON = ["--model", MODEL, "--image-size", str(SIZE), "--batch-size", str(BATCH), "--epochs", str(EPOCHS)]


def blog(data, rec) -> float:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "blog_script.py"),
                "--data",
                str(data),
                "--out",
                out,
                *COMMON,
                "--lr",
                "0.01",
            ]
        )
        wall = time.perf_counter() - t0
        with open(os.path.join(out, "timing.json")) as f:
            t = json.load(f)
    rec["blog"].append({"wall": wall, "epoch": t["train"] + t["val"]})
    return 1 / wall


def visiontune(data, rec, name, extra=()) -> float:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        run(
            [
                sys.executable,
                "-m",
                "visiontune",
                "train",
                "--data",
                str(data),
                "--output-dir",
                out,
                *COMMON,
                "--weights",
                "none",
                "--lr",
                "0.01",
                "--no-progress",
                *extra,
            ]
        )
        wall = time.perf_counter() - t0
        with open(os.path.join(out, "history.json")) as f:
            h = json.load(f)
    rec[name].append({"wall": wall, "epoch": sum(e["train"]["seconds"] + e["val"]["seconds"] for e in h)})
    return 1 / wall


def main() -> None:
    load_at_start = os.getloadavg()
    data = sample_data(PER_CLASS)
    cache = ["--cache", str(WORK / "cache")]
    t0 = time.perf_counter()
    run(
        [
            sys.executable,
            "-c",
            "import sys; from visiontune.data.cache import open_or_build; "
            "from visiontune.data.layouts import discover; "
            f"open_or_build(sys.argv[1], discover(sys.argv[2]).paths, {SIZE})",
            cache[1],
            str(data),
        ]
    )
    cache_build = time.perf_counter() - t0
    rec = {"blog": [], "visiontune": [], "visiontune_fast": [], "visiontune_cache": []}
    interleave(
        {
            "blog": lambda: blog(data, rec),
            "visiontune": lambda: visiontune(data, rec, "visiontune"),
            "visiontune_fast": lambda: visiontune(data, rec, "visiontune_fast", ["--decode", "fast"]),
            "visiontune_cache": lambda: visiontune(data, rec, "visiontune_cache", cache),
        }
    )
    rec = {k: v[WARMUP:] for k, v in rec.items()}  # the warm-up rounds left out
    med = {k: {m: sorted(r[m] for r in v)[len(v) // 2] for m in ("wall", "epoch")} for k, v in rec.items()}
    ratios = {
        f"{k}_vs_blog_{m}": med["blog"][m] / med[k][m]
        for k in ("visiontune", "visiontune_fast", "visiontune_cache")
        for m in ("epoch", "wall")
    }
    out = {
        "what": f"{EPOCHS} epochs, {2 * PER_CLASS} JPEGs (80/20 split), {MODEL} {SIZE} px, batch {BATCH}",
        "load_average_at_start": load_at_start,
        "median_seconds": med,
        "runs": rec,
        "ratios": ratios,
        "cache_build_seconds": cache_build,
        "target": 1.5,
    }
    print("e2e: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_result("e2e", out)


if __name__ == "__main__":
    sys.exit(main())
