"""Hub repositories from someone else, read from the Hugging Face cache: a config.json whose fields timm
would act on (an architecture that is no timm model, an interpolation or an input size out of bounds) and
weights that ``weights_only`` refuses are one line naming the model and the field, exit 2; nothing runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import timm
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from visiontune.cli.commands import main
from visiontune.errors import UserError
from visiontune.models import timm_models
from visiontune.models.build import build_model, get_spec
from visiontune.models.spec import INTERPOLATIONS, MAX_IMAGE_SIZE

NAME = "hf-hub:someone/net"
CONFIG = {
    "architecture": "test_convnext",
    "num_classes": 2,
    "pretrained_cfg": {
        "input_size": [3, 32, 32],
        "interpolation": "bilinear",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
        "crop_pct": 1.0,
        "crop_mode": "squash",
    },
}


class Command:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An offline Hugging Face cache holding ``someone/net``'s snapshot folder (empty: each test fills it)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--someone--net"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def _config(hub: Path, **pretrained) -> None:
    cfg = json.loads(json.dumps(CONFIG))
    for top in ("architecture", "model_args"):
        if top in pretrained:
            cfg[top] = pretrained.pop(top)
    cfg["pretrained_cfg"].update(pretrained)
    (hub / "config.json").write_text(json.dumps(cfg))


def test_a_hub_config_within_bounds_gives_its_preprocessing_and_builds(hub):
    _config(hub)
    p = get_spec(NAME).preprocess
    assert (p.size, p.mean, p.std, p.interpolation, p.crop_pct) == (32, (0.5,) * 3, (0.25,) * 3, "bilinear", 1.0)
    model = build_model(NAME, 3, "none")
    assert model.get_classifier().out_features == 3 and model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize(
    ("field", "said"),
    [
        ({"architecture": "os.system"}, "has architecture 'os.system', expected the name of a timm model"),
        ({"interpolation": "os.system"}, "has pretrained_cfg.interpolation 'os.system', expected one of bilinear"),
        (
            {"input_size": [3, 100_000, 100_000]},
            "has pretrained_cfg.input_size [3, 100000, 100000], expected [3, H, W] with H and W from 1 to "
            f"{MAX_IMAGE_SIZE}",
        ),
        ({"model_args": {"depths": [10**9]}}, "has model_args {'depths': [1000000000]}, expected keyword arguments"),
        ({"crop_pct": 10**400}, "has pretrained_cfg.crop_pct 1000000000"),
        ({"mean": [0.5, float("nan"), 0.5]}, "has pretrained_cfg.mean [0.5, nan, 0.5], expected three finite numbers"),
    ],
)
def test_a_hub_config_out_of_bounds_is_one_line_exit_2(hub, sample_data, tmp_path, capsys, field, said):
    _config(hub, **field)
    out = tmp_path / "run"
    argv = ["train", "--data", str(sample_data), "--model", NAME, "--weights", "none", "--output-dir", str(out)]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"visiontune: error: {NAME}: its config.json {said}")
    assert err.endswith("use a Hub model saved by timm (or remove it from the cache)") and not out.exists()


def test_hub_weights_that_weights_only_refuses_are_one_line_and_never_run(hub, sample_data, tmp_path, capsys):
    _config(hub)
    marker = tmp_path / "ran"
    torch.save({"stem.0.weight": Command(marker)}, hub / "pytorch_model.bin")
    out = tmp_path / "run"
    assert main(["train", "--data", str(sample_data), "--model", NAME, "--output-dir", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        f"visiontune: error: cannot build {NAME} from its Hub files: they hold Python objects other than tensors, "
        "which visiontune never unpickles; use a Hub model saved by timm"
    ]
    assert not marker.exists() and not out.exists()


def test_hub_weights_of_another_shape_are_one_line(hub):
    _config(hub)
    other = timm.create_model("test_vit", pretrained=False, num_classes=2)
    torch.save(other.state_dict(), hub / "pytorch_model.bin")
    with pytest.raises(UserError, match=rf"cannot build {NAME} from its Hub files: its weights do not fit its arch"):
        build_model(NAME, 2, "DEFAULT")


def test_a_hub_config_that_is_not_json_or_too_large_is_one_line(hub, monkeypatch):
    (hub / "config.json").write_text("{" * 100_000)
    with pytest.raises(UserError, match=f"{NAME}: its config.json is not JSON"):
        get_spec(NAME)
    monkeypatch.setattr(timm_models, "MAX_CONFIG_BYTES", 100)
    _config(hub)
    with pytest.raises(UserError, match=f"{NAME}: its config.json is larger than 100 bytes"):
        get_spec(NAME)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode", "architecture", "num_classes"]
VALUES = (
    JSON
    | st.sampled_from([*INTERPOLATIONS, "lanczos", "os.system", "test_vit", "resnet18.a1_in1k", "__import__", 10**400])
    | st.lists(st.integers(-5, 10_000), min_size=3, max_size=3)
    | st.lists(st.floats(-1, 2), min_size=3, max_size=3)
)
TOP = ["architecture", "num_classes", "model_args", "pretrained_cfg", "label_names"]


@fuzz_settings(100)
@given(
    st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4),
    st.dictionaries(st.sampled_from(TOP), VALUES, max_size=2),
    st.booleans(),
)
def test_fuzz_any_hub_config_gives_checked_preprocessing_or_one_line(pretrained, top, legacy):
    """Any config.json (fields of any JSON value, the old single-object form too) is a one-line
    ``UserError`` or a config whose preprocessing is within the bounds a model file is held to."""
    cfg = json.loads(json.dumps(CONFIG))
    cfg["pretrained_cfg"].update(pretrained)
    cfg.update(top)
    if legacy and isinstance(cfg.get("pretrained_cfg"), dict):
        cfg = {**cfg.pop("pretrained_cfg"), **cfg}
    try:
        parsed, arch, args = timm_models.check_hub_config(NAME, cfg)
    except UserError as e:
        assert len(str(e).splitlines()) == 1
        return
    assert timm.is_model(arch) and isinstance(args, dict)
    p = timm_models._preprocess(parsed, arch, args)
    assert 1 <= p.size <= MAX_IMAGE_SIZE and p.interpolation in INTERPOLATIONS
