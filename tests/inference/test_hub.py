"""visiontune export --format hub: a folder timm loads with ``local-dir:`` whose outputs, through timm's own
transforms, equal visiontune's predictions; its model card; and ``visiontune push``.

The images compared are PNGs already at the model's size, so neither side resizes (PIL's resize and
torch's differ by a grey level): what is compared is the weights, the head, the class order and the
normalisation that config.json hands to timm.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from trained import one_thread  # noqa: F401  (autouse: one thread)
from visiontune import load
from visiontune.cli.commands import main
from visiontune.cluster import strategy
from visiontune.data.sample import make_multilabel_data, make_regression_data
from visiontune.inference import hub
from visiontune.inference.loaded import LoadedModel
from visiontune.models.build import build_model
from visiontune.runs import runinfo, runrecords

TOL = 1e-5


def _pngs(sample_data: Path, folder: Path, size: int = 32, count: int = 6) -> list[Path]:
    """Test images as lossless PNGs of exactly size x size."""
    folder.mkdir()
    out = []
    for i, f in enumerate(sorted((sample_data / "test").iterdir())[:count]):
        out.append(folder / f"{i}.png")
        Image.open(f).convert("RGB").resize((size, size)).save(out[-1])
    return out


def _timm_probabilities(folder: Path, paths: list[Path], multi_label: bool = False, identity: bool = False):
    """What a timm user gets: the folder loaded by timm, fed by timm's transforms from its config."""
    import timm
    from timm.data import create_transform, resolve_data_config

    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    transform = create_transform(**resolve_data_config(model=model))
    with torch.no_grad():
        logits = model(torch.stack([transform(Image.open(p).convert("RGB")) for p in paths]))
    return model, (logits if identity else logits.sigmoid() if multi_label else logits.softmax(1))


def _assert_same_as_visiontune(run: Path, folder: Path, paths: list[Path], multi_label: bool = False):
    model, got = _timm_probabilities(folder, paths, multi_label)
    for source in (run, folder / "model.safetensors"):  # the run, and the folder's own file read by visiontune
        rows = load(source).predict([str(p) for p in paths])
        classes = list(rows[0]["probabilities"])
        assert model.pretrained_cfg["label_names"] == classes
        want = torch.tensor([[r["probabilities"][c] for c in classes] for r in rows], dtype=torch.float32)
        assert (got - want).abs().max().item() <= TOL
    return model, rows


def _config_matches(folder: Path, info: runinfo.RunInfo) -> dict:
    config = json.loads((folder / "config.json").read_text())
    cfg = config["pretrained_cfg"]
    assert config["num_classes"] == len(info.classes) and config["label_names"] == list(info.classes)
    assert cfg["input_size"] == [3, info.image_size, info.image_size]
    assert cfg["mean"] == list(info.mean) and cfg["std"] == list(info.std)
    assert cfg["interpolation"] == info.interpolation
    assert (cfg["crop_mode"], cfg["crop_pct"]) == (
        ("squash", 1.0) if info.crop_pct is None else ("center", info.crop_pct)
    )
    assert "tag" not in cfg and "license" not in cfg  # timm's own weights' tag and licence are not ours
    return config


@pytest.fixture(scope="module")
def hub_export(trained_run, tmp_path_factory) -> tuple[Path, str]:
    """``export --format hub`` of the shared run, once for the tests that read the folder (read only), and
    what the command printed."""
    out = tmp_path_factory.mktemp("hub") / "hub"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(printed):
        mp.setattr(strategy, "cpu_budget", lambda *_: 1)  # one thread, as the tests' own calls (trained.py)
        assert main(["export", "--run", str(trained_run), "--format", "hub", "--out", str(out)]) == 0
    return out, printed.getvalue()


@pytest.mark.slow
def test_a_torchvision_resnet_converted_loads_in_timm_and_equals_predict(
    trained_run, sample_data, tmp_path, hub_export
):
    out, printed = hub_export
    assert "local-dir:" in printed
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md", "training_results.png"}
    info = runrecords.read_run(str(trained_run))
    config = _config_matches(out, info)
    assert config["architecture"] == "resnet18" and config["visiontune"] == info.to_dict()
    _assert_same_as_visiontune(trained_run, out, _pngs(sample_data, tmp_path / "images"))


@pytest.mark.slow
def test_a_timm_model_folder_loads_in_timm_and_equals_predict(small_data, sample_data, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hub"
    argv = ["train", "--data", str(small_data), "--output-dir", str(run), "--model", "timm/test_resnet"]
    argv += ["--weights", "none", "--image-size", "32", "--crop-pct", "1.0", "--epochs", "1", "--batch-size", "8"]
    assert main([*argv, "--num-workers", "0", "--no-progress"]) == 0
    assert main(["export", "--run", str(run), "--format", "hub", "--out", str(out)]) == 0
    info = runrecords.read_run(str(run))
    assert info.source == "timm" and info.crop_pct == 1.0
    assert _config_matches(out, info)["architecture"] == "test_resnet"
    _assert_same_as_visiontune(run, out, _pngs(sample_data, tmp_path / "images"))


@pytest.mark.slow
def test_a_multi_label_folder_carries_its_thresholds(tmp_path, monkeypatch):
    monkeypatch.setattr(strategy, "cpu_budget", lambda *_: 1)
    make_multilabel_data(tmp_path / "data", count=40, size=32, seed=0)
    run, out = tmp_path / "run", tmp_path / "hub"
    argv = ["train", "--data", str(tmp_path / "data"), "--output-dir", str(run), "--model", "resnet18"]
    argv += ["--weights", "none", "--image-size", "32", "--epochs", "1", "--batch-size", "8", "--num-workers", "0"]
    assert main([*argv, "--no-progress"]) == 0
    assert main(["export", "--run", str(run), "--format", "hub", "--out", str(out)]) == 0
    thresholds = json.loads((run / "summary.json").read_text())["thresholds"]
    config = json.loads((out / "config.json").read_text())
    assert config["visiontune"]["task"] == "multilabel" and config["visiontune"]["thresholds"] == thresholds
    paths = sorted((tmp_path / "data" / "train").glob("*.png"))[:6]
    _, rows = _assert_same_as_visiontune(run, out, paths, multi_label=True)
    from_run = load(run).predict([str(p) for p in paths])
    assert [r["labels"] for r in rows] == [r["labels"] for r in from_run]  # the folder's thresholds, applied
    summary = json.loads((run / "summary.json").read_text())
    meta, body = _front_matter((out / "README.md").read_text())
    metrics = {m["type"]: m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]}
    assert metrics["map"] == summary["best_val_map"] and "map" in meta["metrics"]
    assert f"| validation mAP | {summary['best_val_map']:.4f} |" in body and "thresholds" in body


@pytest.mark.slow
def test_a_regression_folder_answers_in_the_targets_units_through_timm_as_predict_does(tmp_path, monkeypatch):
    """The map back from the standardised targets is folded into the last layer: timm's model, fed by timm's
    own transforms, outputs the values predict writes; visiontune reading the folder's file applies no map
    again; the card's snippet uses the output as it is."""
    import csv

    monkeypatch.setattr(strategy, "cpu_budget", lambda *_: 1)
    data, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "hub"
    truth = make_regression_data(data, count=40, size=32, seed=1)["values"]
    argv = ["train", "--data", str(data), "--task", "regress", "--output-dir", str(run), "--model", "timm/test_vit"]
    argv += ["--weights", "none", "--image-size", "32", "--epochs", "1", "--batch-size", "8", "--num-workers", "0"]
    assert main([*argv, "--no-progress"]) == 0
    assert main(["export", "--run", str(run), "--format", "hub", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    scale = json.loads((run / "config.json").read_text())["model"]["task_state"]
    assert config["visiontune"]["task_state"] == {**scale, "folded": True}
    paths = sorted((data / "train").glob("*.png"))[:8]
    assert main(["predict", "--run", str(run), "--data", str(data / "train"), "--out", str(tmp_path / "p.csv")]) == 0
    with open(tmp_path / "p.csv", newline="") as f:
        predicted = {Path(r["path"]).name: float(r["value"]) for r in csv.DictReader(f)}
    model, got = _timm_probabilities(out, paths, identity=True)
    assert model.pretrained_cfg["label_names"] == ["value"]
    want = torch.tensor([[predicted[p.name]] for p in paths], dtype=torch.float64)
    spread = float(np.std(list(truth.values())))  # the values are in the targets' units, not standardised
    # (timm's transforms and visiontune's decode round the input differently: about 1e-5, as for ONNX)
    assert (got.double() - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    assert abs(float(got.mean()) - float(np.mean([truth[p.name] for p in paths]))) < 5 * spread
    rows = load(out / "model.safetensors").predict([str(p) for p in paths])
    assert [r["value"] for r in rows] == pytest.approx(want[:, 0].tolist(), abs=1e-5)
    assert "logits[0].tolist()" in (out / "README.md").read_text()


def _squeezenet(monkeypatch) -> None:
    info = runinfo.describe("squeezenet1_1", "torchvision", ["cat", "dog"], 32, (0.5,) * 3, (0.25,) * 3, "bilinear")
    loaded = LoadedModel(build_model("squeezenet1_1", 2, "none").eval(), info, 8)
    monkeypatch.setattr("visiontune.inference.loaded.load_model", lambda *a, **k: loaded)


def test_another_architecture_is_one_line_naming_the_formats_that_fit(tmp_path, monkeypatch, capsys):
    _squeezenet(monkeypatch)
    assert main(["export", "--run", str(tmp_path), "--format", "hub", "--out", str(tmp_path / "hub")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "squeezenet1_1" in err
    assert "--format onnx" in err and "--format pt2" in err
    assert not (tmp_path / "hub").exists() and not list(tmp_path.glob(".hub.*"))


def test_a_folder_with_files_in_it_is_not_written_into(tmp_path, monkeypatch, capsys):
    _squeezenet(monkeypatch)
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "mine.txt").write_text("kept")
    assert main(["export", "--run", str(tmp_path), "--format", "hub", "--out", str(tmp_path / "hub")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "hub").iterdir()] == ["mine.txt"]


@pytest.mark.slow
def test_every_timm_twin_has_torchvisions_keys_and_logits():
    import timm
    import torchvision

    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for name in sorted(hub.TIMM_TWINS):
        # Both built without their own random initialisation (torchvision's draws every weight twice: seconds
        # for the wide ones); torchvision's then gets cheap random tensors of its kind, and timm's those tensors.
        with torch.device("meta"):
            tv = torchvision.models.get_model(name, num_classes=3).eval()
            tm = timm.create_model(name, num_classes=3).eval()
        a, b = tv.state_dict(), tm.state_dict()
        assert list(a) == list(b) and all(a[k].shape == b[k].shape for k in a), name
        tv = _random_tensors(tv.to_empty(device="cpu"))
        tm.load_state_dict(tv.state_dict(), assign=True)
        assert not any(t.is_meta for t in (*tm.parameters(), *tm.buffers())), name  # every tensor was given
        with torch.no_grad():
            want = tv(x)
            assert want.abs().max().item() > 0.1, name  # logits that TOL tells apart
            assert (want - tm(x)).abs().max().item() <= TOL, name


@torch.no_grad()
def _random_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """Weights drawn as kaiming's, and batch norms whose every statistic and affine term differs from
    channel to channel (so a twin that mixed any of them up, or left one out, would give other logits)."""
    g = torch.Generator().manual_seed(1)
    for key, t in model.state_dict().items():
        if t.dim() > 1:
            torch.nn.init.kaiming_uniform_(t, mode="fan_out", nonlinearity="relu", generator=g)
        elif t.is_floating_point():
            # Scales under 1 and variances over 1: the logits of the deepest stay within tens.
            low, high = (
                (1.0, 2.0) if key.endswith("running_var") else (0.2, 0.5) if key.endswith("weight") else (-0.1, 0.1)
            )
            t.uniform_(low, high, generator=g)
        else:
            t.zero_()  # num_batches_tracked
    return model


# The model card


def _front_matter(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def _section(body: str, title: str) -> str:
    return body.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow
def test_the_card_has_hub_front_matter_and_summary_numbers(trained_run, sample_data, tmp_path, hub_export):
    out = hub_export[0]
    summary = json.loads((trained_run / "summary.json").read_text())
    config = json.loads((trained_run / "config.json").read_text())
    meta, body = _front_matter((out / "README.md").read_text())
    assert meta["library_name"] == "timm" and {"image-classification", "timm", "visiontune"} <= set(meta["tags"])
    metrics = {m["type"]: m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]}
    assert metrics == {"accuracy": summary["best_val_accuracy"], "loss": summary["best_val_loss"]}
    # Every number of the data and results sections is one of summary.json's, as it is there (4 decimals).
    data = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", _section(body, "Data"))]
    assert data == [summary["train_split_size"], summary["val_split_size"]]
    results = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", _section(body, "Validation results"))]
    want = [summary["best_epoch"], 1, summary["epochs"], summary["val_images_counted"]]  # "counting from 1"
    assert results == [*want, round(summary["best_val_accuracy"], 4), round(summary["best_val_loss"], 4)]
    recipe = _section(body, "Recipe")
    for k in ("optimizer", "batch", "lr schedule", "normalisation"):
        assert f"| {k} | {config['overview'][k]} |" in recipe
    assert "/" not in _section(body, "Data").split("(")[0]  # the folder's name, not the machine's path
    assert (out / "training_results.png").read_bytes() == (trained_run / "training_results.png").read_bytes()
    assert "![training curves](training_results.png)" in body
    # The card's own loading snippets -- timm, transformers' timm wrapper, visiontune -- run as a reader
    # would, give visiontune's predictions.
    image = _pngs(sample_data, tmp_path / "images", count=1)[0]
    want = load(trained_run).predict(str(image))["probabilities"]
    snippets = re.findall(r"```python\n(.*?)```", body, re.S)
    assert len(snippets) == 3 and "timm.create_model" in snippets[0] and "visiontune.load" in snippets[2]
    assert "AutoModelForImageClassification.from_pretrained" in snippets[1]
    for code in snippets:
        code = code.replace("PATH/TO/THIS/FOLDER", str(out)).replace("image.jpg", str(image))
        scope: dict = {}
        exec(code.replace("print(predictor.predict(", "probabilities = (predictor.predict("), scope)
        got = scope["probabilities"]
        got = got["probabilities"] if "probabilities" in got else got
        assert got.keys() == want.keys() and max(abs(got[c] - want[c]) for c in want) <= TOL


# push


def test_push_without_a_token_says_so_and_uploads_nothing(tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi, constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    # A Hugging Face home with no login in it (the token file is looked up when the token is asked for).
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf" / "stored_tokens"))
    calls = []
    for method in ("create_repo", "create_branch", "upload_folder"):
        monkeypatch.setattr(HfApi, method, lambda *a, _m=method, **k: calls.append(_m))
    assert main(["push", str(tmp_path / "run"), "--repo", "org/name"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF_TOKEN" in err[0] and "nothing was uploaded" in err[0]
    assert calls == []


def test_push_offline_says_so_before_loading_anything(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["push", str(tmp_path / "no-run"), "--repo", "org/name"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF_HUB_OFFLINE" in err[0] and "nothing was uploaded" in err[0]


def test_push_to_a_bad_repo_name_is_one_line(tmp_path, capsys):
    assert main(["push", str(tmp_path), "--repo", "just-a-name"]) == 2
    assert "ORG/NAME" in capsys.readouterr().err


@pytest.mark.slow
def test_push_to_an_unreachable_hub_says_so(trained_run, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # loopback, a port nothing listens on
    assert main(["push", str(trained_run), "--repo", "org/name"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "127.0.0.1:9" in err[0] and "nothing was uploaded" in err[0]
    assert "pushed" not in capsys.readouterr().out


@pytest.mark.slow
def test_push_uploads_the_hub_folder_in_one_commit(trained_run, tmp_path, monkeypatch, capsys, hub_export):
    from huggingface_hub import HfApi, RepoUrl
    from safetensors.torch import load_file

    calls: list = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw, self.token))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, **kw):
        calls.append(("create_branch", repo_id, kw))

    def upload_folder(self, **kw):
        folder = Path(kw["folder_path"])
        files = {p.name: p.read_bytes() for p in folder.iterdir()}
        calls.append(("upload_folder", kw, files))
        return "https://huggingface.co/org/name/commit/abc"

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_branch", create_branch)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    argv = ["push", str(trained_run), "--repo", "org/name", "--private", "--revision", "v1"]
    assert main(argv) == 0
    assert "commit/abc" in capsys.readouterr().out
    assert calls[0] == ("create_repo", "org/name", {"private": True, "exist_ok": True, "repo_type": "model"}, "hf_test")
    assert calls[1] == ("create_branch", "org/name", {"branch": "v1", "exist_ok": True})
    ((_, kw, files),) = calls[2:]
    assert kw["repo_id"] == "org/name" and kw["revision"] == "v1"
    assert set(files) == {"config.json", "model.safetensors", "README.md", "training_results.png"}
    # The same folder export writes, named for the repository in its card.
    out = hub_export[0]
    assert files["config.json"] == (out / "config.json").read_bytes()
    (tmp_path / "pushed.safetensors").write_bytes(files["model.safetensors"])
    pushed, local = load_file(str(tmp_path / "pushed.safetensors")), load_file(str(out / "model.safetensors"))
    assert pushed.keys() == local.keys() and all(torch.equal(pushed[k], local[k]) for k in local)
    card = files["README.md"].decode()
    assert 'timm.create_model("hf-hub:org/name", pretrained=True)' in card
    assert 'hf_hub_download("org/name", "model.safetensors")' in card
    assert _front_matter(card)[0]["model-index"][0]["name"] == "name"


# export --format onnx --int8


@pytest.mark.slow
def test_int8_onnx_records_the_accuracies_onnxruntime_gives_on_the_val_split(
    trained_run, sample_data, exported_onnx, exported_int8
):
    import onnxruntime

    from trained import preprocess
    from visiontune.inference import quantize

    out = exported_int8  # `export --format onnx --int8 --max-accuracy-drop 100 --calibration-images 40` (conftest.py)
    record = quantize.record_of(out)
    summary = json.loads((trained_run / "summary.json").read_text())
    assert record["calibration_images"] == 40 and record["val_images"] == summary["val_split_size"]
    # Recomputed without visiontune's loader: the val files of split.json, torchvision's resize, both files.
    val = json.loads((trained_run / "split.json").read_text())["val"]
    x = preprocess([sample_data / f for f in val]).numpy()
    y = np.array([["cat", "dog"].index(Path(f).name.split(".")[0]) for f in val])
    fp32 = exported_onnx
    for path, key in ((fp32, "val_accuracy_fp32"), (out, "val_accuracy_int8")):
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert (session.run(None, {"images": x})[0].argmax(1) == y).mean() == pytest.approx(record[key], abs=1e-9)
    assert record["accuracy_drop_points"] == pytest.approx(
        (record["val_accuracy_fp32"] - record["val_accuracy_int8"]) * 100
    )
    assert (
        json.loads({p.key: p.value for p in __import__("onnx").load(str(out)).metadata_props}["visiontune"])
        == (json.loads((trained_run / "config.json").read_text())["model"])
    )
    # serve takes the file as it takes any exported .onnx: the same probabilities as onnxruntime's.
    from visiontune.inference.runtime import load_runtime

    served = load_runtime(weights=str(out))
    images = [served.prepare((sample_data / f).read_bytes()) for f in val[:4]]
    direct = session.run(None, {"images": served.normalize(torch.stack(images)).numpy()})[0]
    assert (served.probabilities(images) - torch.from_numpy(direct).softmax(1)).abs().max().item() <= TOL


@pytest.mark.slow
def test_int8_is_refused_when_it_loses_more_than_the_allowed_accuracy(trained_run, tmp_path, monkeypatch, capsys):
    from visiontune.inference import quantize

    # Calibrated on images a thousand times too bright, each quantization step is wider than the whole
    # range of real activations: every image gets about the same output, and the accuracy falls to chance.
    real = quantize._Calibration.get_next
    monkeypatch.setattr(quantize._Calibration, "get_next", lambda self: _brightened(real(self)))
    out = tmp_path / "int8.onnx"
    argv = ["export", "--run", str(trained_run), "--format", "onnx", "--int8", "--out", str(out)]
    assert main([*argv, "--max-accuracy-drop", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than --max-accuracy-drop 1" in err[0] and "nothing written" in err[0]
    assert not out.exists()


def _brightened(feed):
    return None if feed is None else {"images": feed["images"] * 1000}


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--format", "pt2", "--int8"], "--int8 is for --format onnx"),
        (["--format", "onnx", "--int8", "--max-accuracy-drop", "-1"], "--max-accuracy-drop must be 0 or more"),
        (["--format", "onnx", "--int8", "--calibration-images", "0"], "--calibration-images must be at least 1"),
    ],
)
def test_int8_options_are_checked_before_the_model_is_loaded(tmp_path, capsys, extra, said):
    assert main(["export", "--run", str(tmp_path / "no-run"), *extra, "--out", str(tmp_path / "m.onnx")]) == 2
    assert said in capsys.readouterr().err and not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_a_damaged_summary_is_one_line_and_no_folder(trained_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "best_val_accuracy": "high"}))
    assert main(["export", "--run", str(run), "--format", "hub", "--out", str(tmp_path / "hub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "summary.json" in err[0]
    assert not (tmp_path / "hub").exists() and not list(tmp_path.glob(".hub.*"))
