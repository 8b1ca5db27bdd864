"""An evaluation of a run's saved model that shares no code with visiontune.

Tests compare what a run reports against this: ``best.pth`` loaded into the
plain torchvision model, the val files named in ``split.json`` decoded and
resized with torchvision, normalised and scored with plain torch.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torchvision.transforms import v2

from visiontune.config import MEAN, STD


def independent_eval(run_dir: Path, data_root: Path) -> tuple[float, float, int]:
    """(mean loss, accuracy, images) of ``run_dir/best.pth`` over the val files of ``split.json``."""
    cfg = json.loads((run_dir / "config.json").read_text())["config"]
    classes = json.loads((run_dir / "classes.json").read_text())
    model = torchvision.models.get_model(cfg["model"], num_classes=len(classes))
    model.load_state_dict(torch.load(run_dir / "best.pth", weights_only=True))
    model.eval()
    files = json.loads((run_dir / "split.json").read_text())["val"]
    size = cfg["image_size"]
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    xs, ys = [], []
    for rel in files:
        img = torchvision.io.decode_image(str(data_root / rel), mode=torchvision.io.ImageReadMode.RGB)
        img = v2.functional.resize(img, [size, size], antialias=True)
        xs.append((img.float() / 255 - mean) / std)
        ys.append(classes.index(rel.split("/")[-1].split(".")[0]))
    with torch.no_grad():
        logits = model(torch.stack(xs))
    y = torch.tensor(ys)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).sum().item() / len(ys), len(ys)
