"""What ``--tta flip`` and ``--tta flip+crop`` change: accuracy, log loss and calibration of one run's val split.

One short training (resnet18 from scratch at 16 px, random flips and crops, one
epoch: at 64 px this synthetic set is learnt perfectly and confidently in an
epoch, leaving TTA nothing to change; at 16 px every val image is still right,
but less confidently, so TTA can move the log loss and the calibration), then
``visiontune evaluate`` on the run's validation split three times: without TTA,
with ``flip`` and with ``flip+crop``. The figures are differences against the
no-TTA row of the same command, on the same model and images. Data: the
synthetic Kaggle-layout set (``VT_TTA_PER_CLASS`` images per class, default 300).
"""

from __future__ import annotations

import json
import os
import sys
import time

from common import WORK, run, sample_data, write_result

PER_CLASS = int(os.environ.get("VT_TTA_PER_CLASS", "300"))
SIZE = os.environ.get("VT_TTA_SIZE", "16")
TRAIN = [
    "--model",
    "resnet18",
    "--weights",
    "none",
    "--image-size",
    SIZE,
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--lr",
    "0.01",
    "--augment",
    "--no-progress",
]


def main() -> None:
    data = sample_data(PER_CLASS)
    run_dir = WORK / f"tta-run-{PER_CLASS}-{SIZE}px"
    if not (run_dir / "summary.json").exists():
        run([sys.executable, "-m", "visiontune", "train", "--data", str(data), "--output-dir", str(run_dir), *TRAIN])
    rows = {}
    for mode in ("none", "flip", "flip+crop"):
        out = run_dir / f"eval-{mode}.json"
        start = time.perf_counter()
        run(
            [
                sys.executable,
                "-m",
                "visiontune",
                "evaluate",
                "--run",
                str(run_dir),
                "--data",
                str(data),
                "--out",
                str(out),
                "--tta",
                mode,
                "--no-progress",
            ]
        )
        ev = json.loads(out.read_text())
        rows[mode] = {k: ev[k] for k in ("images", "accuracy", "log_loss", "ece", "balanced_accuracy")}
        rows[mode]["seconds"] = time.perf_counter() - start
    base = rows["none"]
    print(f"{'tta':<10} {'images':>6} {'accuracy':>9} {'change':>8} {'log loss':>9} {'change':>8} {'ECE':>7} {'s':>6}")
    for mode, r in rows.items():
        r["accuracy_change"], r["log_loss_change"] = r["accuracy"] - base["accuracy"], r["log_loss"] - base["log_loss"]
        print(
            f"{mode:<10} {r['images']:>6} {r['accuracy']:>9.4f} {r['accuracy_change']:>+8.4f} {r['log_loss']:>9.4f} "
            f"{r['log_loss_change']:>+8.4f} {r['ece']:>7.4f} {r['seconds']:>6.1f}"
        )
    write_result("tta", {"per_class": PER_CLASS, "image_size": int(SIZE), "train": TRAIN, "rows": rows})


if __name__ == "__main__":
    main()
