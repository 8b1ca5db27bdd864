"""The run's self-description: written into safetensors metadata, read back, older runs described, damage named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from visiontune.errors import UserError
from visiontune.runs.runinfo import RunInfo, describe, read_file, reconcile
from visiontune.runs.runrecords import read_run
from visiontune.settings.config import MEAN, STD


def _info() -> RunInfo:
    return describe("timm/test_vit", "timm", ["cat", "dog"], 32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), "bicubic")


def test_safetensors_metadata_round_trip(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(1)}, str(path), metadata=_info().metadata())
    assert read_file(str(path)) == _info()
    save_file({"w": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    assert read_file(str(tmp_path / "plain.safetensors")) is None  # saved elsewhere: no description
    damaged = {"visiontune": json.dumps({**_info().to_dict(), "classes": ["only"]})}
    save_file({"w": torch.zeros(1)}, str(tmp_path / "bad.safetensors"), metadata=damaged)
    with pytest.raises(UserError, match="damaged model description"):
        read_file(str(tmp_path / "bad.safetensors"))


def test_a_run_from_before_descriptions_is_described_from_its_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"config": {"model": "resnet18", "image_size": 64}}))
    (tmp_path / "classes.json").write_text(json.dumps(["cat", "dog"]))
    info = read_run(str(tmp_path))
    assert (info.model, info.source, info.classes, info.image_size) == ("resnet18", "torchvision", ("cat", "dog"), 64)
    assert (info.mean, info.std) == (MEAN, STD)


def test_reconcile_names_both_values():
    reconcile(_info(), "w.safetensors", model="timm/test_vit", classes=("cat", "dog"), image_size=None)
    with pytest.raises(UserError, match="--image-size 64 contradicts w.safetensors, which says image size 32"):
        reconcile(_info(), "w.safetensors", image_size=64)
