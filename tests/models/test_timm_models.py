"""timm and Hugging Face Hub models: specs, heads by the library's own name, preprocessing, offline errors."""

from __future__ import annotations

import pytest
import timm
import torch

from trainrun import flags
from visiontune.cli.commands import main
from visiontune.errors import UserError
from visiontune.models import build
from visiontune.models.build import build_model, get_spec, head_names

# A convnet, a transformer and a model whose classifier is not called fc: timm's tiny test models.
FAMILIES = {"timm/test_convnext": "head.fc", "timm/test_vit": "head", "timm/test_efficientnet": "classifier"}


@pytest.mark.parametrize("name,head", FAMILIES.items())
def test_timm_head_is_sized_by_timm_and_found_by_its_name(name, head):
    model = build_model(name, 3, "none", freeze_backbone=True)
    reference = timm.create_model(name[5:], num_classes=3)
    assert head_names(model) == [head] == [reference.pretrained_cfg["classifier"]]
    assert model.get_classifier() is model.get_submodule(head)
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()
    }
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{head}.{p}" for p, _ in model.get_submodule(head).named_parameters())
    assert model.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 3)


def test_preprocessing_comes_from_the_pretrained_config():
    from timm.data import resolve_data_config

    p = get_spec("timm/vit_tiny_patch16_224").preprocess
    cfg = resolve_data_config(model=timm.create_model("vit_tiny_patch16_224", pretrained=False))
    assert (
        (p.size, p.mean, p.std, p.interpolation)
        == (224, cfg["mean"], cfg["std"], "bicubic")
        == (cfg["input_size"][-1], (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), cfg["interpolation"])
    )
    import torchvision

    t = torchvision.models.Inception_V3_Weights.DEFAULT.transforms()
    p = get_spec("inception_v3").preprocess
    assert (p.size, list(p.mean), p.interpolation) == (299, t.mean, "bilinear")
    # A pretrained tag picks that tag's config.
    assert get_spec("timm/convnext_nano.in12k_ft_in1k").preprocess.size == 224


@pytest.mark.parametrize(
    "name,msg",
    [
        ("timm/not_a_model", "unknown timm model 'not_a_model'"),
        ("timm/convnext_nano.nosuchtag", "Invalid pretrained tag"),
        ("notamodel", "hf-hub:ORG/NAME"),
    ],
)
def test_unknown_names(name, msg):
    with pytest.raises(UserError, match=msg):
        get_spec(name)


def test_models_command_lists_and_filters(capsys):
    assert main(["models", "--source", "timm", "--filter", "ConvNeXt_nano"]) == 0
    listed = capsys.readouterr().out.split()
    assert "timm/convnext_nano" in listed and all("convnext_nano" in n for n in listed)
    assert main(["models", "--source", "all", "--filter", "resnet18"]) == 0
    listed = capsys.readouterr().out.split()
    assert "resnet18" in listed and "timm/resnet18" in listed
    assert main(["models"]) == 0
    assert len(capsys.readouterr().out.split()) == len(build.torchvision_names())
    assert main(["models", "--filter", "zzz"]) == 2


def test_unknown_hub_repository_names_it(monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError
    from timm.models import _hub

    def missing(model_id, cache_dir=None):
        err = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response
        Exception.__init__(err, "404 Client Error: Repository Not Found")
        raise err

    monkeypatch.setattr(_hub, "load_model_config_from_hf", missing)
    with pytest.raises(
        UserError,
        match=r"no model 'hf-hub:someone/nothing' on the Hugging Face Hub.*"
        r"huggingface.co/someone/nothing",
    ):
        get_spec("hf-hub:someone/nothing")


def test_offline_pretrained_timm_weights_say_where_the_cache_is(monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*a, **k):
        raise LocalEntryNotFoundError("cannot find the requested files in the local cache")

    monkeypatch.setattr(timm.models._builder, "load_pretrained", offline)
    with pytest.raises(UserError) as err:
        build_model("timm/test_vit", 2, "DEFAULT")
    text = str(err.value)
    assert "cannot fetch timm/test_vit (LocalEntryNotFoundError)" in text
    assert constants.HF_HUB_CACHE in text and "HF_HOME" in text and "--weights none" in text


def test_offline_hub_model_is_one_line_and_exit_2(tmp_path, sample_data, monkeypatch, capsys):
    """The real hub client in offline mode (HF_HUB_OFFLINE=1) with an empty cache: nothing reaches the network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    rc = main(
        [
            "train",
            *flags(
                data=sample_data, output_dir=tmp_path / "run", model="hf-hub:timm/test_vit.r160_in1k", weights="none"
            ),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "hf-hub:timm/test_vit.r160_in1k" in err and str(tmp_path / "hf" / "hub") in err
    assert "network access" in err and not (tmp_path / "run").exists()
