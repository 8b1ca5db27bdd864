"""`visiontune show DATA`: a PNG of the first training batch as the model sees it, checked against the
batch made again by the loading code (split, loaders, normalisation), tile by tile."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from visiontune.cli.commands import main
from visiontune.data.groups import split_for
from visiontune.data.sources import discover
from visiontune.loading.jobdata import JobData
from visiontune.loading.loaders import loaders
from visiontune.loading.pipeline import DeviceNormalize
from visiontune.settings import presets
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import AUTO, SINGLE_LABEL
from visiontune.training import plan

FLAGS = ["--model", "resnet18", "--weights", "none", "--image-size", "32", "--batch-size", "8"]


def _batch(data, **kw) -> tuple[torch.Tensor, torch.Tensor, TrainConfig]:
    """The first batch of epoch 0 as trainer's pieces make it, normalised as the model gets it."""
    asked = TrainConfig(data=str(data), model="resnet18", weights="none", image_size=32, batch_size=8, **kw)
    shown = plan.view(validate(asked.replace(cache="off", num_workers=0)))
    cfg = shown.cfg
    images = discover(str(data), task=AUTO)
    split, _ = split_for(images, cfg)
    stats, train_loader, _ = loaders(cfg, JobData(images, []), split, "/nonexistent", shown.threads, SINGLE_LABEL)
    cfg = cfg.replace(mean=stats[0], std=stats[1]) if stats else cfg
    train_loader.sampler.set_epoch(0)
    u8, labels = next(iter(train_loader))
    mean, std = presets.mean_std(cfg)
    return DeviceNormalize(torch.device("cpu"), False, mean, std)(u8), labels, cfg


@pytest.mark.parametrize("augment", ["light", "none"])
def test_show_draws_the_first_training_batch_with_its_labels(small_data, tmp_path, capsys, augment):
    out = tmp_path / "batch.png"
    assert main(["show", str(small_data), *FLAGS, "--augment", augment, "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"visiontune: wrote {out}: 8 of the first training batch's 8 images")
    x, labels, cfg = _batch(small_data, augment=augment)
    with Image.open(out) as im:
        assert im.format == "PNG"
        drawn = json.loads(im.text["visiontune"])
        picture = np.asarray(im.convert("RGB"))
    classes = discover(str(small_data), task=AUTO).classes
    assert [t["label"] for t in drawn["tiles"]] == [classes[y] for y in labels.tolist()]  # 8 tiles, the batch's
    mean, std = (torch.tensor(v, dtype=torch.float64).view(3, 1, 1) * 255 for v in presets.mean_std(cfg))
    scale = drawn["scale"]
    for i in (0, 7):
        left, top, right, bottom = drawn["tiles"][i]["box"]
        tile = torch.from_numpy(picture[top:bottom:scale, left:right:scale].copy()).permute(2, 0, 1)
        expected = (x[i].double() * std + mean).round().clamp(0, 255)  # the model's input, de-normalised
        assert torch.equal(tile.double(), expected)
    if augment == "light":  # the augmented view, not the plain resize: some tile differs from it
        plain, _, _ = _batch(small_data, augment="none")
        assert not torch.equal(plain, x)


def test_show_takes_data_once_and_refuses_none(small_data, tmp_path, capsys):
    assert main(["show", *FLAGS, "--out", str(tmp_path / "a.png")]) == 2
    assert "give the data to show" in capsys.readouterr().err
    assert main(["show", str(small_data), "--data", "/elsewhere", *FLAGS, "--out", str(tmp_path / "b.png")]) == 2
    assert "give the data once" in capsys.readouterr().err and not (tmp_path / "b.png").exists()
