"""Every torchvision classifier gets a working head; weights load safely."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torchvision
from torch.overrides import TorchFunctionMode
from torchvision.models import regnet

from visiontune.errors import UserError
from visiontune.models.build import build_model, load_state_file
from visiontune.models.names import model_names

_from_init_params = regnet.BlockParams.from_init_params.__func__


def _cpu_block_params(cls, *args, **kwargs):
    # RegNet computes its widths with tensors and reads them back: do that on the CPU.
    with torch.device("cpu"):
        return _from_init_params(cls, *args, **kwargs)


class _ShapesOnly(TorchFunctionMode):
    """On the meta device only shapes are computed: skip what cannot change one (in-place fills and
    initialisations, batch norm), whose Python reference implementations take half the time."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.startswith("_") and name != "resize_") or name == "batch_norm":
            return args[0] if args else kwargs.get("input", kwargs.get("tensor"))
        return func(*args, **kwargs)


@pytest.mark.slow
def test_every_model_gets_a_new_head_of_the_right_shape():
    names = torchvision.models.list_models(module=torchvision.models)
    assert len(names) > 70 and set(names) == set(model_names())
    patch = mock.patch.object(regnet.BlockParams, "from_init_params", classmethod(_cpu_block_params))
    with patch, torch.device("meta"), torch.no_grad(), _ShapesOnly():
        for name in names:
            model = build_model(name, 3, "none").eval()
            size = 299 if name == "inception_v3" else 224
            out = model(torch.empty(2, 3, size, size))
            assert out.shape == (2, 3), name


def test_vgg16_head_is_classifier_6_and_freeze_trains_only_it():
    with torch.device("meta"):
        model = build_model("vgg16", 2, "none", freeze_backbone=True)
    assert model.classifier[6].out_features == 2
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["classifier.6.weight", "classifier.6.bias"]


def test_state_dict_file_round_trip(tmp_path):
    src = build_model("resnet18", 4, "none")
    torch.save(src.state_dict(), tmp_path / "w.pth")
    loaded = build_model("resnet18", 4, str(tmp_path / "w.pth"))
    for k, v in src.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    from safetensors.torch import save_file

    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    assert torch.equal(load_state_file(str(tmp_path / "w.safetensors"))["fc.weight"], src.fc.weight)


def test_head_of_another_size_is_reinitialised_and_named(tmp_path, capsys):
    src = build_model("resnet18", 4, "none")
    torch.save(src.state_dict(), tmp_path / "w.pth")
    torch.manual_seed(7)
    loaded = build_model("resnet18", 2, str(tmp_path / "w.pth"))
    torch.manual_seed(7)
    fresh = build_model("resnet18", 2, "none")
    for k, v in loaded.state_dict().items():  # the body is the file's, the head a fresh one of 2 classes
        assert torch.equal(v, fresh.state_dict()[k] if k.startswith("fc.") else src.state_dict()[k]), k
    assert "left out: fc.bias, fc.weight" in capsys.readouterr().out
    with pytest.raises(UserError, match="head is for other classes"):  # inference: the head must fit
        build_model("resnet18", 2, str(tmp_path / "w.pth"), head_may_differ=False)


def test_mismatch_outside_the_head_is_a_user_error(tmp_path):
    state = build_model("resnet18", 4, "none").state_dict()
    state["layer1.0.conv1.weight"] = state["layer1.0.conv1.weight"][:32]
    torch.save(state, tmp_path / "w.pth")
    with pytest.raises(UserError, match=r"does not fit this model: 1 key\(s\) differ, e.g. layer1.0.conv1.weight"):
        build_model("resnet18", 2, str(tmp_path / "w.pth"))
    torch.save(build_model("resnet34", 2, "none").state_dict(), tmp_path / "other.pth")
    with pytest.raises(UserError, match="same --model"):
        build_model("resnet18", 2, str(tmp_path / "other.pth"))


def test_broken_and_non_state_dict_files_are_user_errors(tmp_path):
    (tmp_path / "cut.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":')
    with pytest.raises(UserError, match="cannot load weights from .*cut.safetensors safely"):
        build_model("resnet18", 2, str(tmp_path / "cut.safetensors"))
    torch.save({"epoch": 3}, tmp_path / "meta.pth")
    with pytest.raises(UserError, match="not a state_dict"):
        build_model("resnet18", 2, str(tmp_path / "meta.pth"))


@pytest.mark.parametrize(
    "name,weights,msg",
    [
        ("notamodel", "none", "unknown model"),
        ("resnet18", "IMAGENET9K", "unknown weights"),
        ("resnet18", "/nope/w.pth", "not found"),
    ],
)
def test_bad_model_or_weights_names(name, weights, msg):
    with pytest.raises(UserError, match=msg):
        build_model(name, 2, weights)


def test_offline_download_names_file_and_cache(monkeypatch, tmp_path):
    import urllib.error

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def offline(*a, **k):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline, raising=False)
    with contextlib.suppress(AttributeError):
        monkeypatch.setattr(torchvision.models.resnet, "load_state_dict_from_url", offline)
    with pytest.raises(UserError) as err:
        build_model("resnet18", 2, "DEFAULT")
    text = str(err.value)
    assert "resnet18-f37072fd.pth" in text and str(tmp_path / "hub" / "checkpoints") in text
    assert "--weights none" in text
