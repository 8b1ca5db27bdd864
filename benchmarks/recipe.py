"""Accuracy of the recipes: `--recipe blog`, `--recipe modern` and timm's train.py, same data, model, epochs.

Real images that need no download: scikit-learn's digits (1,797 8x8 scans, 10
classes), written as 32 px PNGs in class folders; and the synthetic sample set.
Every tool trains resnet18 from scratch at 32 px, batch 32, for the same epochs
on visiontune's own train/val split (timm gets it as train/ and validation/
folders of links). timm's train.py is not shipped with the timm package: pass
its path with ``--timm-train PATH`` (from a clone of pytorch-image-models) or it
is left out. timm runs its best recipe on this data (AdamW lr 1e-3, one warm-up
epoch, label smoothing 0.1, a mild random-resized crop; its defaults reach
about half the accuracy). Reported: best validation accuracy over the epochs,
and wall seconds per epoch (whole command / epochs, start-up included, the
same threads for every tool).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

from common import WORK, python_env, run, write_result

MODEL, SIZE, BATCH = "resnet18", 32, 32
TIMM_RECIPE = [
    "--opt",
    "adamw",
    "--lr",
    "1e-3",
    "--weight-decay",
    "0.05",
    "--sched",
    "cosine",
    "--warmup-epochs",
    "1",
    "--smoothing",
    "0.1",
    "--scale",
    "0.35",
    "1",
]


def digits(out: Path) -> Path:
    """sklearn's digits as 32 px RGB PNGs, one folder per class."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    if not (out / ".done").exists():
        d = load_digits()
        for i, (img, label) in enumerate(zip(d.images, d.target)):
            (out / str(label)).mkdir(parents=True, exist_ok=True)
            pixels = (img * (255 / 16)).astype(np.uint8)
            Image.fromarray(pixels).resize((SIZE, SIZE), Image.BILINEAR).convert("RGB").save(out / f"{label}/{i}.png")
        (out / ".done").touch()
    return out


def synthetic(out: Path) -> Path:
    from visiontune.data.sample import make_sample_data

    if not (out / ".done").exists():
        make_sample_data(out, per_class=150, test_count=0, seed=0)
        (out / ".done").touch()
    return out


def timm_folders(data: Path, out: Path) -> tuple[Path, int]:
    """visiontune's split of ``data`` as timm's train/ and validation/ class folders (symlinks)."""
    from visiontune.data.layouts import discover
    from visiontune.data.split import make_split

    images = discover(str(data))
    split = make_split(len(images), 0.2, 42)
    for part, idx in (("train", split.train), ("validation", split.val)):
        for i in idx:
            link = out / part / images.classes[images.labels[i]] / f"{i}{Path(images.paths[i]).suffix}"
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(images.paths[i])
    return out, len(images.classes)


def visiontune(data: Path, recipe: str, epochs: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "visiontune",
        "train",
        "--data",
        str(data),
        "--model",
        MODEL,
        "--weights",
        "none",
        "--image-size",
        str(SIZE),
        "--batch-size",
        str(BATCH),
        "--epochs",
        str(epochs),
        "--recipe",
        recipe,
        "--no-progress",
        "--output-dir",
        str(out),
    ]
    start = time.perf_counter()
    run(cmd)
    seconds = time.perf_counter() - start
    summary = json.loads((out / "summary.json").read_text())
    return {
        "accuracy": summary["best_val_accuracy"],
        "seconds_per_epoch": seconds / epochs,
        "best_weights": summary.get("best_weights", "raw"),
    }


def timm(train_py: Path, data: Path, epochs: int, out: Path) -> dict:
    root, classes = timm_folders(data, out / "data")
    cmd = [
        sys.executable,
        str(train_py),
        "--data-dir",
        str(root),
        "--train-split",
        "train",
        "--val-split",
        "validation",
        "--model",
        MODEL,
        "--num-classes",
        str(classes),
        "--input-size",
        "3",
        str(SIZE),
        str(SIZE),
        "-b",
        str(BATCH),
        "--epochs",
        str(epochs),
        "--workers",
        "0",
        "--device",
        "cpu",
        "--no-prefetcher",
        "--output",
        str(out / "out"),
        "--experiment",
        "run",
        "--checkpoint-hist",
        "1",
        *TIMM_RECIPE,
    ]
    start = time.perf_counter()
    run(cmd, cwd=str(train_py.parent))
    seconds = time.perf_counter() - start
    with open(out / "out" / "run" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    return {"accuracy": max(float(r["eval_top1"]) for r in rows) / 100, "seconds_per_epoch": seconds / epochs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timm-train", default=os.environ.get("VT_TIMM_TRAIN"), help="path of timm's train.py")
    p.add_argument("--epochs", type=int, default=10, help="epochs on digits (the synthetic set: half)")
    p.add_argument("--sets", default="digits,synthetic", help="comma-separated: digits, synthetic")
    args = p.parse_args()
    work = WORK / "recipe"
    makers = {"digits": (digits, args.epochs), "synthetic": (synthetic, max(1, args.epochs // 2))}
    sets = {name: (makers[name][0](work / name), makers[name][1]) for name in args.sets.split(",")}
    results: dict = {}
    for name, (data, epochs) in sets.items():
        stamp = f"{name}-{int(time.time())}"
        row = {r: visiontune(data, r, epochs, work / "runs" / f"{stamp}-{r}") for r in ("blog", "modern")}
        if args.timm_train:
            row["timm"] = timm(Path(args.timm_train).resolve(), data, epochs, work / "runs" / f"{stamp}-timm")
        results[name] = {"epochs": epochs, **row}
        for tool, r in row.items():
            print(f"{name:9s} {tool:7s} acc {r['accuracy']:.3f}  {r['seconds_per_epoch']:.1f} s/epoch", flush=True)
    argv = ["PATH" if a == args.timm_train else a for a in sys.argv[1:]]  # no local paths in the record
    write_result(
        "recipe",
        {
            "model": MODEL,
            "image_size": SIZE,
            "batch": BATCH,
            "results": results,
            "timm_recipe": " ".join(TIMM_RECIPE) if args.timm_train else None,
            "command": " ".join(["python benchmarks/recipe.py", *argv]),
        },
    )


if __name__ == "__main__":
    os.environ.update({k: v for k, v in python_env().items() if k == "PYTHONPATH"})
    main()
