"""timm and Hugging Face Hub models: specs, heads by the library's own name, preprocessing, offline errors."""

from __future__ import annotations

import json

import pytest
import timm
import torch

from trainrun import flags
from visiontune.cli.commands import main
from visiontune.errors import UserError
from visiontune.models import build, timm_models
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

    def missing(model_id, filename, cache_dir=None):
        err = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response
        Exception.__init__(err, "404 Client Error: Repository Not Found")
        raise err

    monkeypatch.setattr(_hub, "download_from_hf", missing)
    monkeypatch.setattr(timm_models, "_probe", lambda *a: None)  # as if the Hub answered
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
    monkeypatch.setattr(timm_models, "_probe", lambda *a: None)  # the Hub answered, the download failed
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


def _closed_hub(monkeypatch, cache):
    """An empty Hugging Face cache and a Hub at a closed port: every connection is refused at once."""
    from huggingface_hub import constants

    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(cache.parent / "torch"))
    monkeypatch.delenv("HF_HUB_ETAG_TIMEOUT", raising=False)


def test_unreachable_hub_fails_in_seconds_naming_weights_none_and_the_cache(tmp_path, sample_data, monkeypatch, capsys):
    """The first natural command, offline: one line within seconds, not a minute of the client's retries."""
    import time

    from huggingface_hub import constants

    _closed_hub(monkeypatch, tmp_path / "hf" / "hub")
    get_spec("timm/resnet18")  # timm imported and its configs read: only the command is timed
    argv = ["train", "--data", str(sample_data), "--model", "timm/resnet18", "--output-dir", str(tmp_path / "run")]
    # Not the wall time (a busy machine stretches it): the client's retries are its back-off sleeps.
    slept, real_sleep = [], time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(s))[1])
    rc = main([*argv, "--image-size", "32", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and sum(slept) < 1, (rc, slept, err)
    assert len(err.splitlines()) == 1 and err.startswith("visiontune: error: cannot fetch timm/resnet18 (")
    assert "--weights none" in err and str(tmp_path / "hf" / "hub") in err and not (tmp_path / "run").exists()
    # HF_HUB_OFFLINE: no request at all, the same line.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    slept.clear()
    with pytest.raises(UserError, match=r"cannot fetch timm/resnet18 \(HF_HUB_OFFLINE is set\).*--weights none"):
        build_model("timm/resnet18", 2, "DEFAULT")
    assert slept == []


def test_cached_weights_are_used_without_asking_the_hub(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    cache = tmp_path / "hf" / "hub"
    _closed_hub(monkeypatch, cache)
    repo = cache / "models--timm--resnet18.a1_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    reference = timm.create_model("resnet18", pretrained=False)
    save_file(reference.state_dict(), str(repo / "snapshots" / ("0" * 40) / "model.safetensors"))

    def no_probe(*a):
        raise AssertionError("asked the Hub for cached weights")

    monkeypatch.setattr(timm_models, "_probe", no_probe)
    model = build_model("timm/resnet18", 2, "DEFAULT")  # the Hub is unreachable: this came from the cache
    assert torch.equal(model.conv1.weight, reference.conv1.weight) and model.get_classifier().out_features == 2


def test_models_lists_prefix_matches_first_and_answers_from_its_cache_without_timm(tmp_path, monkeypatch, capsys):
    from visiontune.models import names

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path))
    assert main(["models", "--source", "all", "--filter", "resnet1"]) == 0  # lists once, into the cache
    first = capsys.readouterr().out.split()
    assert first[:2] == ["resnet101", "timm/resnet101"] and "timm/resnet18" in first  # by name
    starting = [n for n in first if n.removeprefix("timm/").startswith("resnet1")]
    assert first[: len(starting)] == starting and "timm/seresnet101" in first[len(starting) :]

    def no_listing(source):
        raise AssertionError(f"listed {source} again instead of reading the cache")

    monkeypatch.setattr(names, "_listed", no_listing)
    assert main(["models", "--source", "all", "--filter", "resnet1"]) == 0  # no_listing: from the cache
    assert capsys.readouterr().out.split() == first


@pytest.mark.slow
def test_models_imports_neither_torch_nor_timm(tmp_path, worker_env):
    """What makes `visiontune models` answer in well under a second: a cached listing, no torch."""
    import subprocess
    import sys

    code = (
        "import sys; from visiontune.cli.commands import main; main(['models', '--source', 'all']); "
        "print(sorted(m for m in ('torch', 'torchvision', 'timm', 'accelerate') if m in sys.modules), file=sys.stderr)"
    )
    from visiontune.models import names

    for source in ("torchvision", "timm"):  # listed here (this process has imported both), as by any earlier run
        names.all_names(source, tmp_path)
    env = {**worker_env, "VISIONTUNE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[]" and "timm/resnet18" in done.stdout.split()


@pytest.mark.slow  # builds ViTs of 5.7M parameters
def test_a_fixed_size_model_is_built_for_the_asked_size():
    """A ViT asked at 32 px is built for 32 px (timm's img_size), as timm's train.py builds it; a model that
    takes any size (a convnet, or timm's test_vit, built with dynamic_img_size) is built as before, its
    weights in the shapes timm.create_model(arch) loads."""
    model = build_model("timm/vit_tiny_patch16_224", 3, "none", image_size=32).eval()
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)
    assert model.pos_embed.shape[1] == (32 // 16) ** 2 + 1  # 16 px patches, one class token
    assert build.resized_from("timm/vit_tiny_patch16_224", 32) == 224
    assert build.resized_from("timm/vit_tiny_patch16_224", 224) is None
    for name in ("timm/test_vit", "timm/test_convnext", "resnet18"):
        assert build.resized_from(name, 32) is None
    assert build_model("timm/test_vit", 3, "none", image_size=32).pos_embed.shape[1] == 101  # 10 x 10 + 1


@pytest.mark.slow  # builds ViTs of 5.7M parameters
def test_pretrained_position_embeddings_are_resampled_to_the_asked_size(tmp_path, monkeypatch):
    """Pretrained weights (here a local file standing in for the download) reach a ViT built at another
    size through timm's own loader, their position embeddings resampled; so do a --weights file's."""
    from safetensors.torch import save_file
    from timm.layers import resample_abs_pos_embed

    native = timm.create_model("vit_tiny_patch16_224").eval()  # 224 px, 1000 classes: the published shapes
    path = tmp_path / "pretrained.safetensors"
    save_file({k: v.contiguous() for k, v in native.state_dict().items()}, str(path))
    expected = resample_abs_pos_embed(native.pos_embed, (2, 2), num_prefix_tokens=1)
    real = timm.create_model
    monkeypatch.setattr(timm_models, "_weight_files", lambda arch: None)  # no Hub probe for a local file
    monkeypatch.setattr(timm, "create_model", lambda *a, **k: real(*a, pretrained_cfg_overlay={"file": str(path)}, **k))
    pretrained = build_model("timm/vit_tiny_patch16_224", 3, "DEFAULT", image_size=32)
    assert torch.allclose(pretrained.pos_embed, expected)
    assert torch.equal(pretrained.blocks[0].attn.qkv.weight, native.blocks[0].attn.qkv.weight)
    monkeypatch.setattr(timm, "create_model", real)
    said: list[str] = []
    from_file = build_model("timm/vit_tiny_patch16_224", 3, str(path), image_size=32, say=said.append)
    assert torch.allclose(from_file.pos_embed, expected) and "position embeddings resampled to 32 px" in said[0]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["--lora", "8"]])
def test_vit_trains_and_predicts_at_another_size(tmp_path, sample_data, capsys, lora):
    """`--model timm/vit... --image-size 32` (with or without --lora) trains, says the model was built for
    32 px in the start-up block, and its run loads back at 32 px for predict."""
    out = tmp_path / "run"
    model = "timm/vit_tiny_patch16_224"  # timm asserts its 224 px input unless it is built for another size
    argv = flags(data=sample_data, output_dir=out, model=model, weights="none", image_size=32)
    argv += flags(epochs=1, batch_size=8, limit_images=40, cache="off", no_progress=True, num_workers=0)
    assert main(["train", *argv, *lora]) == 0
    said = capsys.readouterr().out
    assert f"{model} (timm), weights none, 32 px (built for 32 px, not its pretrained 224 px)" in said
    assert main(["predict", "--run", str(out), str(next((sample_data / "test").iterdir()))]) == 0
    assert capsys.readouterr().out.splitlines()[1].count(",") == 3  # path, prediction, two probabilities
    if not lora:  # the timm Hub folder builds it at 32 px too: its config says so, and the export's check passed
        assert main(["export", "--run", str(out), "--format", "hub", "--out", str(tmp_path / "hub")]) == 0
        config = json.loads((tmp_path / "hub" / "config.json").read_text())
        assert config["model_args"]["img_size"] in (32, [32, 32]) and config["pretrained_cfg"]["input_size"] == [
            3,
            32,
            32,
        ]
