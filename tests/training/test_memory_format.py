"""--channels-last's default: on for a model with depthwise convolutions and BatchNorm on a CPU, off otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision

from trained import independent_eval
from visiontune.cli.commands import main
from visiontune.models.build import depthwise_with_batchnorm
from visiontune.settings.config import TrainConfig
from visiontune.training import plan

# What benchmarks/channels_last.py measured on a CPU (train step, channels-last vs contiguous): the first list
# 1.1-1.5x faster, the second as fast or slower (ConvNeXt: depthwise with LayerNorm; ResNeXt: grouped).
FASTER = [
    "mobilenet_v2",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "mnasnet0_5",
    "efficientnet_b0",
    "shufflenet_v2_x0_5",
]
NOT_FASTER = ["resnet18", "resnet50", "resnext50_32x4d", "convnext_tiny", "vgg16"]


@pytest.mark.parametrize("name", FASTER + NOT_FASTER)
def test_the_models_that_train_faster_channels_last_on_a_cpu_are_told_by_their_layers(name):
    with torch.device("meta"):  # the layers alone: no memory, no init
        model = torchvision.models.get_model(name, num_classes=2)
    assert depthwise_with_batchnorm(model) is (name in FASTER)


def _plan(asked: bool | None, name: str, device: str) -> bool:
    cfg = TrainConfig(data="x", model=name, weights="none", image_size=32, channels_last=asked)
    with torch.device("meta"):
        model = torchvision.models.get_model(name, num_classes=2)
    resolved = plan.Plan(cfg, cfg, threads=None)
    return plan.laid_out(resolved, model, torch.device(device)).cfg.channels_last


def test_the_default_is_resolved_from_the_model_and_the_device_and_a_users_choice_is_kept():
    assert _plan(None, "mobilenet_v3_small", "cpu") is True
    assert _plan(None, "resnet18", "cpu") is False
    assert _plan(None, "mobilenet_v3_small", "cuda") is False  # not measured on a GPU: unchanged there
    assert _plan(False, "mobilenet_v3_small", "cpu") is False
    assert _plan(True, "resnet18", "cpu") is True
    assert _plan(True, "mobilenet_v3_small", "cuda") is True


@pytest.mark.slow
@pytest.mark.parametrize("flag", [[], ["--no-channels-last"]])
def test_a_mobilenet_run_trains_channels_last_by_default_records_it_and_its_model_scores_as_recorded(
    sample_data, tmp_path, capsys, flag
):
    out = tmp_path / "run"
    argv = ["train", "--data", str(sample_data), "--model", "mobilenet_v3_small", "--weights", "none"]
    argv += ["--image-size", "32", "--epochs", "1", "--batch-size", "8", "--no-progress", "--output-dir", str(out)]
    assert main([*argv, *flag]) == 0
    said = capsys.readouterr().out
    on = not flag
    assert json.loads((out / "config.json").read_text())["config"]["channels_last"] is on
    assert ("memory format    channels-last" in said) is on
    # The saved weights, evaluated contiguous by plain torchvision code, give the val figures the run recorded.
    history = json.loads((out / "history.json").read_text())
    loss, acc, n = independent_eval(out, Path(sample_data))
    assert n == history[-1]["val"]["images"]
    assert acc == pytest.approx(history[-1]["val"]["accuracy"], abs=1e-9)
    assert loss == pytest.approx(history[-1]["val"]["loss"], rel=1e-3, abs=1e-4)
