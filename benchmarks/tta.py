"""What ``--tta flip`` and ``--tta flip+crop`` change: accuracy, log loss and calibration of one run's val split.

Two data sets, each one short training (resnet18 from scratch, random flips and
crops in training) and then ``visiontune evaluate`` on the run's validation
split three times: without TTA, with ``flip`` and with ``flip+crop``. Changes are
against the no-TTA row of the same model and images.

- ``synthetic``: the Kaggle-layout cats/dogs stand-in at 16 px, one epoch
  (mirror-invariant classes; at 64 px it is learnt perfectly in an epoch);
- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10
  classes) written as 32 px PNG class folders, trained at 16 px for 6 epochs at lr 0.05. A mirrored digit is
  another glyph, so this shows what TTA does when its assumption fails.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from common import WORK, run, sample_data, write_result

COMMON = ["--model", "resnet18", "--weights", "none", "--batch-size", "32", "--lr", "0.01", "--augment",
          "--no-progress"]
SETS = {"synthetic": ["--image-size", "16", "--epochs", "1"], "digits": ["--image-size", "16", "--epochs", "6", "--lr", "0.05"]}


def digits() -> Path:
    """scikit-learn's digits as class folders of 32 px greyscale PNGs (made once)."""
    from sklearn.datasets import load_digits

    out = WORK / "digits"
    if not (out / ".done").exists():
        d = load_digits()
        for i, (img, label) in enumerate(zip(d.images, d.target)):
            folder = out / f"digit {label}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (img / 16 * 255).astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32), Image.BILINEAR).save(folder / f"{i:04d}.png")
        (out / ".done").touch()
    return out


def measure(name: str, data: Path) -> dict:
    run_dir = WORK / f"tta-{name}"
    if not (run_dir / "summary.json").exists():
        run([sys.executable, "-m", "visiontune", "train", "--data", str(data), "--output-dir", str(run_dir),
             *COMMON, *SETS[name]])
    rows = {}
    for mode in ("none", "flip", "flip+crop"):
        out = run_dir / f"eval-{mode}.json"
        start = time.perf_counter()
        run([sys.executable, "-m", "visiontune", "evaluate", "--run", str(run_dir), "--data", str(data),
             "--out", str(out), "--tta", mode, "--no-progress"])
        ev = json.loads(out.read_text())
        rows[mode] = {k: ev[k] for k in ("images", "accuracy", "log_loss", "ece", "balanced_accuracy")}
        rows[mode]["seconds"] = time.perf_counter() - start
    return rows


def main() -> None:
    results = {"synthetic": measure("synthetic", sample_data(300)), "digits": measure("digits", digits())}
    print(f"{'data':<10} {'tta':<10} {'images':>6} {'accuracy':>9} {'change':>8} {'log loss':>9} {'change':>8} "
          f"{'ECE':>7} {'s':>6}")
    for name, rows in results.items():
        base = rows["none"]
        for mode, r in rows.items():
            r["accuracy_change"] = r["accuracy"] - base["accuracy"]
            r["log_loss_change"] = r["log_loss"] - base["log_loss"]
            print(f"{name:<10} {mode:<10} {r['images']:>6} {r['accuracy']:>9.4f} {r['accuracy_change']:>+8.4f} "
                  f"{r['log_loss']:>9.4f} {r['log_loss_change']:>+8.4f} {r['ece']:>7.4f} {r['seconds']:>6.1f}")
    write_result("tta", {"common": COMMON, "sets": SETS, "results": results})


if __name__ == "__main__":
    main()
