"""Ultralytics' classifier as a peer in benchmarks/transfer.py, run with an interpreter that has ultralytics.

Fine-tunes Ultralytics' resnet18 classifier (torchvision's resnet18 body through its ``TorchVision``
module, under Ultralytics' own Classify head) from the benchmark's backbone: the model yaml names
torchvision's ``DEFAULT`` weights, which torchvision loads from ``$TORCH_HOME/hub/checkpoints``, the file
transfer.py saved there. ``yolo classify train`` with Ultralytics' default recipe but for flips (digits
are not mirror-symmetric): optimizer "auto", its warm-up, RandAugment, random erasing, gradients
accumulated to its nominal batch of 64. Only what every tool of the benchmark shares is set: epochs,
batch, image size, seed, the CPU, the threads, no loader workers, fp32.

Before the first step, every tensor of the body Ultralytics trains is checked equal to the file's; its
best epoch (on ``ROOT/validation``) is then loaded from ``best.pt`` and predicts every image of ``TEST``
(class folders) with Ultralytics' own inference transform; the right answers are counted here and
written to ``OUT``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import peer_args
from recipe_ultralytics import prepare


def backbone_file() -> Path:
    """The file torchvision loads resnet18's DEFAULT weights from: transfer.py's backbone."""
    import torch
    import torchvision

    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name
    if not path.is_file():  # torchvision would download ImageNet's weights instead
        raise SystemExit(f"no backbone at {path}: run this through benchmarks/transfer.py")
    return path


def check_body(body, path: Path) -> int:
    """How many tensors the body has, each equal to the file's (torchvision's names, less ``fc``)."""
    import torch
    import torchvision

    # TorchVision unwraps resnet18 into a Sequential of its children, less avgpool and fc: index -> name.
    children = [name for name, _ in torchvision.models.resnet18().named_children()]
    ours = {}
    for key, value in body.state_dict().items():
        index, _, rest = key.partition(".")
        ours[f"{children[int(index)]}.{rest}"] = value
    file = {k: v for k, v in torch.load(path, map_location="cpu", weights_only=True).items() if not k.startswith("fc.")}
    if set(ours) != set(file):
        raise SystemExit(f"Ultralytics' body and {path.name} name their tensors differently")
    unequal = [k for k in file if not torch.equal(ours[k].cpu(), file[k])]
    if unequal:
        raise SystemExit(f"Ultralytics' body differs from {path.name} in {len(unequal)} tensors, {unequal[0]} first")
    return len(file)


def main() -> None:
    args = peer_args(__doc__)
    out = Path(args.out).parent
    data, yaml = prepare(Path(args.root), Path(args.test), out, "DEFAULT")
    os.environ.setdefault("YOLO_OFFLINE", "1")
    path = backbone_file()

    import ultralytics
    import ultralytics.utils.torch_utils
    from ultralytics import YOLO

    # Ultralytics sets torch's threads to its own count on the CPU; the benchmark gives every tool the same.
    ultralytics.utils.torch_utils.NUM_THREADS = int(os.environ.get("OMP_NUM_THREADS", "1"))
    checked = {}

    def check(trainer) -> None:  # the model train() rebuilt from the yaml, as it starts training
        checked["tensors"] = check_body(trainer.model.model[0].m, path)

    model = YOLO(str(yaml), task="classify")
    model.add_callback("on_pretrain_routine_end", check)
    model.train(
        data=str(data),
        epochs=args.epochs,
        batch=args.batch,
        imgsz=args.size,
        seed=args.seed,
        fliplr=0.0,
        deterministic=True,
        device="cpu",
        workers=0,
        amp=False,
        plots=False,
        project=str(out),
        name="run",
        exist_ok=True,
        verbose=False,
    )
    if "tensors" not in checked:
        raise SystemExit("Ultralytics trained without the body being checked against the backbone's file")
    best = YOLO(str(out / "run" / "weights" / "best.pt"))
    files = sorted((data / "test").rglob("*.png"))
    right = 0
    for result in best.predict(
        [str(f) for f in files], imgsz=args.size, batch=256, device="cpu", stream=True, verbose=False
    ):
        right += result.names[result.probs.top1] == Path(result.path).parent.name
    Path(args.out).write_text(
        json.dumps(
            {
                "test_accuracy": right / len(files),
                "test_count": len(files),
                "backbone_tensors_equal": checked["tensors"],
                "ultralytics": ultralytics.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
