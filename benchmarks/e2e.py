"""End to end: ``visiontune train`` against the blog's script, each a fresh command.

Same data (2,400 synthetic Kaggle-layout JPEGs, 300-500 px), model (mobilenet_v3_small,
no pretrained weights: a small torchvision model, so that on a CPU the input pipeline and
start-up are a visible share of the work, as they are on a GPU; ``VT_E2E_MODEL`` names
another), image size (64 px), batch, threads (each side's default: all cores) and two epochs.
Two figures per side: the whole command's wall time (start-up, listing, both epochs,
the saved files), and the epochs (train + val phases) as each side times them.
visiontune runs three ways, each with a user cache folder of its own under the bench's
work folder: the default command (``--cache fit``: the image cache is built in the
warm-up round and reused after, as on a user's second run on the same data), a cold
first run (its cache folder removed before each run, so the command builds the cache,
which replaces the bad-file scan), and ``--cache off`` (the bad-file scan, remembered
across runs, then every batch decoded in every epoch). ``VT_E2E_PER_CLASS`` and
``VT_E2E_EPOCHS`` make it smaller; ``VT_E2E_ROWS`` (comma-separated) runs only some of the
visiontune rows. Each run records the machine's load average when it started: on a shared
machine the blog script's threads, which spin while waiting for one another, slow down far
more than visiontune's, so a ratio means little without the load it was measured at.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from common import ROOT, WARMUP, WORK, interleave, python_env, run, sample_data, write_result

MODEL, SIZE, BATCH = os.environ.get("VT_E2E_MODEL", "mobilenet_v3_small"), 64, 32
PER_CLASS, EPOCHS = int(os.environ.get("VT_E2E_PER_CLASS", "1200")), int(os.environ.get("VT_E2E_EPOCHS", "2"))
COMMON = ["--model", MODEL, "--image-size", str(SIZE), "--batch-size", str(BATCH), "--epochs", str(EPOCHS)]


def blog(data, rec) -> float:
    load = os.getloadavg()[0]  # the 1-minute load average as the command starts
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
    rec["blog"].append({"wall": wall, "epoch": t["train"] + t["val"], "load": load})
    return 1 / wall


def visiontune(data, rec, name, extra=(), cold=False) -> float:
    user_cache = WORK / f"user-cache-{name}"  # VISIONTUNE_CACHE_DIR: the image cache and the scan's verdicts
    if cold:
        shutil.rmtree(user_cache, ignore_errors=True)
    env = {**python_env(), "VISIONTUNE_CACHE_DIR": str(user_cache)}
    load = os.getloadavg()[0]
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
            ],
            env=env,
        )
        wall = time.perf_counter() - t0
        with open(os.path.join(out, "history.json")) as f:
            h = json.load(f)
        with open(os.path.join(out, "summary.json")) as f:
            cache = json.load(f)["image_cache"]["why"]  # built, reused, or off: the row says what it measured
    rec[name].append(
        {
            "wall": wall,
            "epoch": sum(e["train"]["seconds"] + e["val"]["seconds"] for e in h),
            "cache": cache,
            "load": load,
        }
    )
    return 1 / wall


ROWS = tuple(os.environ.get("VT_E2E_ROWS", "visiontune,visiontune_cold,visiontune_off").split(","))


def main() -> None:
    load_at_start = os.getloadavg()
    data = sample_data(PER_CLASS)
    rec = {"blog": [], **{k: [] for k in ROWS}}
    runs = {
        "blog": lambda: blog(data, rec),
        "visiontune": lambda: visiontune(data, rec, "visiontune"),
        "visiontune_cold": lambda: visiontune(data, rec, "visiontune_cold", cold=True),
        "visiontune_off": lambda: visiontune(data, rec, "visiontune_off", ["--cache", "off"]),
    }
    interleave({k: runs[k] for k in ("blog", *ROWS)}, alternate=True)
    rec = {k: v[WARMUP:] for k, v in rec.items()}  # the warm-up rounds left out
    med = {k: {m: sorted(r[m] for r in v)[len(v) // 2] for m in ("wall", "epoch")} for k, v in rec.items()}
    ratios = {f"{k}_vs_blog_{m}": med["blog"][m] / med[k][m] for k in ROWS for m in ("epoch", "wall")}
    out = {
        "what": f"{EPOCHS} epochs, {2 * PER_CLASS} JPEGs (80/20 split), {MODEL} {SIZE} px, batch {BATCH}",
        "rows": {
            k: v
            for k, v in {
                "visiontune": "the default command, --cache fit, the cache built in the warm-up round and reused",
                "visiontune_cold": "the default command on a first run: the cache built in the command",
                "visiontune_off": "--cache off: the bad-file scan (remembered), every image decoded every epoch",
            }.items()
            if k in ROWS
        },
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "median_seconds": med,
        "runs": rec,
        "ratios": ratios,
        "target": {"visiontune_cold_vs_blog_wall": 2.0},  # a first run, its cache built in the command
    }
    loads = [r["load"] for v in rec.values() for r in v]
    print(
        "e2e: "
        + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
        + f" (load average {min(loads):.1f}-{max(loads):.1f} as the timed commands started)"
    )
    write_result("e2e", out)


if __name__ == "__main__":
    sys.exit(main())
