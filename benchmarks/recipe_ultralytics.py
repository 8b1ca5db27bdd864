"""Ultralytics' classifier as a peer in benchmarks/recipe.py, run with an interpreter that has ultralytics.

Trains Ultralytics' ``yolo11-cls-resnet18`` model (torchvision's resnet18 body under Ultralytics' own
Classify head) from scratch, built from a yaml written here with no weights, so nothing is downloaded:
``yolo classify train`` with Ultralytics' default recipe (optimizer "auto", its warm-up, RandAugment,
random erasing, flips), on ``ROOT/train`` with ``ROOT/validation`` for its best epoch, then scores that
epoch's weights on ``TEST`` (class folders) and writes the accuracy to ``OUT``. Only what every tool of
the benchmark shares is set: epochs, batch, image size, seed, the CPU, no loader workers, fp32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import peer_args

MODEL_YAML = """\
nc: {nc}
backbone:
  - [-1, 1, TorchVision, [512, resnet18, {weights}, True, 2]]
head:
  - [-1, 1, Classify, [nc]]
"""


def prepare(root: Path, test: Path, out: Path, weights: str) -> tuple[Path, Path]:
    """The data folder Ultralytics reads and the model yaml (torchvision's resnet18 with ``weights``)."""
    # Ultralytics reads a classification set as DIR/{train,val,test}: links to the benchmark's folders.
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for part, src in (("train", root / "train"), ("val", root / "validation"), ("test", test)):
        if not (data / part).exists():
            (data / part).symlink_to(src.resolve())
    classes = sorted(d.name for d in (data / "train").iterdir() if d.is_dir())
    yaml = out / "resnet18-cls.yaml"
    yaml.write_text(MODEL_YAML.format(nc=len(classes), weights=weights))
    return data, yaml


def main() -> None:
    args = peer_args(__doc__)
    out = Path(args.out).parent
    data, yaml = prepare(Path(args.root), Path(args.test), out, "null")
    os.environ.setdefault("YOLO_OFFLINE", "1")

    from ultralytics import YOLO

    model = YOLO(str(yaml), task="classify")
    model.train(
        data=str(data),
        epochs=args.epochs,
        batch=args.batch,
        imgsz=args.size,
        seed=args.seed,
        deterministic=True,
        device="cpu",
        workers=0,
        amp=False,
        pretrained=False,
        plots=False,
        project=str(out),
        name="run",
        exist_ok=True,
        verbose=False,
    )
    best = YOLO(str(out / "run" / "weights" / "best.pt"))
    metrics = best.val(
        data=str(data),
        split="test",
        imgsz=args.size,
        batch=args.batch,
        device="cpu",
        workers=0,
        plots=False,
        project=str(out),
        name="test",
        exist_ok=True,
    )
    test_count = sum(1 for c in (data / "test").iterdir() for _ in c.iterdir())
    Path(args.out).write_text(json.dumps({"test_accuracy": float(metrics.top1), "test_count": test_count}))


if __name__ == "__main__":
    main()
