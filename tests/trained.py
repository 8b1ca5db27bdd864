"""A trained run folder and an independent forward pass, shared by the predict/evaluate/export tests.

``train_run`` trains two epochs of resnet18 at 32 px (``FAST``, batch 8, lr 0.005) through the CLI: 24 steps,
enough for the batch norms' running statistics to settle, so its val accuracy does not hang on the last
bits of the float sums (at batch 16 and lr 0.02 it swung from 0.54 to 1.0 with the thread count).
``reference_probs`` recomputes the model's class probabilities without any
visiontune code: a plain torchvision resnet18 loaded from ``best.safetensors``,
torchvision's decoder and resize, and the blog's normalisation written out
here, so a preprocessing or loading mistake in visiontune shows up as a
difference. ``independent_eval`` scores a run's ``best.safetensors`` over its recorded
validation files the same way (a ``timm/`` model built by timm, resized as its pretrained
config says), for comparison with the metrics the run reports.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from safetensors.torch import load_file
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2.functional import center_crop, resize

from conftest import FAST
from visiontune.cli.commands import main
from visiontune.cluster import strategy

SIZE = 32
MEAN = torch.tensor([0.4883, 0.4551, 0.4170]).view(3, 1, 1)
STD = torch.tensor([0.2257, 0.2211, 0.2214]).view(3, 1, 1)


def train_run(out: Path, data: Path) -> Path:
    # One thread: on a shared 2-core machine two threads contend and run several times slower.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(strategy, "cpu_budget", lambda *_: 1)
        rc = main(
            [
                "train",
                "--data",
                str(data),
                "--output-dir",
                str(out),
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--lr",
                "0.005",
                "--num-workers",
                "0",
                # The shuffle these tests' figures were set on (the 0.9 accuracy bar among them): the
                # stratified default is tested in tests/data/test_split.py and by every other run.
                "--split-method",
                "random",
                *FAST,
            ]
        )
    assert rc == 0
    return out


def reference_model(run: Path) -> torch.nn.Module:
    model = torchvision.models.resnet18(num_classes=2)
    model.load_state_dict(load_file(str(run / "best.safetensors")))
    return model.eval()


def hand_resize(img: torch.Tensor, size: int, interpolation: str = "bilinear", crop_pct: float | None = None):
    """torchvision's transforms: a squash to size x size, or timm's eval view (shorter side to
    floor(size / crop_pct), centre crop)."""
    mode = InterpolationMode(interpolation)
    if crop_pct is None:
        return resize(img, [size, size], interpolation=mode, antialias=True)
    return center_crop(resize(img, math.floor(size / crop_pct), interpolation=mode, antialias=True), [size, size])


def preprocess(
    paths: list[Path | str], size: int = SIZE, interpolation: str = "bilinear", crop_pct: float | None = None
) -> torch.Tensor:
    """Normalised float batch, computed the textbook way (x / 255 - mean) / std."""
    out = []
    for p in paths:
        img = decode_image(str(p), mode=ImageReadMode.RGB)
        out.append((hand_resize(img, size, interpolation, crop_pct).float() / 255 - MEAN) / STD)
    return torch.stack(out)


@torch.no_grad()
def reference_probs(run: Path, paths: list[Path | str]) -> torch.Tensor:
    return reference_model(run)(preprocess(paths)).softmax(1)


@torch.no_grad()
def plain_model(name: str, classes: int) -> tuple[torch.nn.Module, str, float | None]:
    """The model a run names, built by its own library (no visiontune code), and the eval view it was made for:
    torchvision's squash, or a ``timm/`` model's pretrained config (interpolation and centre crop)."""
    if name.startswith("timm/"):
        import timm

        model = timm.create_model(name.removeprefix("timm/"), num_classes=classes)
        return model, model.pretrained_cfg["interpolation"], model.pretrained_cfg["crop_pct"]
    return torchvision.models.get_model(name, num_classes=classes), "bilinear", None


def independent_eval(run: Path, data_root: Path) -> tuple[float, float, int]:
    """(mean loss, accuracy, images) of ``run/best.safetensors`` over the val files of ``split.json``."""
    cfg = json.loads((run / "config.json").read_text())["config"]
    classes = json.loads((run / "classes.json").read_text())
    model, interpolation, crop_pct = plain_model(cfg["model"], len(classes))
    model.load_state_dict(load_file(str(run / "best.safetensors")))
    files = json.loads((run / "split.json").read_text())["val"]
    batch = preprocess([data_root / f for f in files], cfg["image_size"], interpolation, crop_pct)
    logits = model.eval()(batch)
    y = torch.tensor([classes.index(Path(f).name.split(".")[0]) for f in files])  # Kaggle names: cat.12.jpg
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).sum().item() / len(files), len(files)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """In-process runs use one thread, as ``train_run`` does (imported by the test modules)."""
    monkeypatch.setattr(strategy, "cpu_budget", lambda *_: 1)
