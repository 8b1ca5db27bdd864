"""visiontune export: ONNX and torch.export .pt2 files that take normalised images of any batch size,
give the eager model's logits within 1e-4 when run back with onnxruntime / torch.export.load, and carry
the run's description."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from trained import one_thread, preprocess, reference_model  # noqa: F401  (one_thread: autouse)
from visiontune.cli.commands import main

TOL = 1e-4


@pytest.fixture(scope="module")
def run(trained_run) -> Path:
    return trained_run  # one training for the predict, evaluate and export tests (read-only)


@pytest.fixture(scope="module")
def batches(run, sample_data) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Real preprocessed test images in batches of 1 and 5, with the eager model's logits."""
    files = sorted((sample_data / "test").iterdir())
    model = reference_model(run)
    with torch.no_grad():
        return [(x, model(x)) for x in (preprocess(files[:1]), preprocess(files[1:6]))]


@pytest.mark.slow
def test_onnx_round_trip(run, batches, exported_onnx):
    import onnx
    import onnxruntime

    out = exported_onnx  # `export --run RUN --format onnx`, exit 0 (conftest.py)
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    for x, eager in batches:
        got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        assert got.shape == eager.shape
        assert (got - eager).abs().max().item() <= TOL
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(props["visiontune"]) == json.loads((run / "config.json").read_text())["model"]


@pytest.mark.slow
def test_pt2_round_trip(run, batches, tmp_path):
    out = tmp_path / "model.pt2"
    assert main(["export", "--run", str(run), "--format", "pt2", "--out", str(out)]) == 0
    extra = {"visiontune.json": ""}
    loaded = torch.export.load(str(out), extra_files=extra).module()
    with torch.no_grad():
        for x, eager in batches:
            got = loaded(x)
            assert got.shape == eager.shape
            assert (got - eager).abs().max().item() <= TOL
    described = json.loads(extra["visiontune.json"])
    assert described["classes"] == ["cat", "dog"] and described["image_size"] == 32


@pytest.mark.slow
def test_torchscript_points_to_its_successor(run, tmp_path, capsys):
    assert main(["export", "--run", str(run), "--format", "torchscript", "--out", str(tmp_path / "m.pt")]) == 2
    assert "--format pt2" in capsys.readouterr().err and not (tmp_path / "m.pt").exists()


@pytest.mark.slow
def test_missing_onnx_says_how_to_install(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # makes `import onnx` raise ImportError
    out = tmp_path / "model.onnx"
    assert main(["export", "--run", str(run), "--format", "onnx", "--out", str(out)]) == 2
    assert "pip install 'visiontune[onnx]'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_onnx_with_preprocessing_takes_uint8_images_of_any_size_and_equals_predict(run, sample_data, tmp_path, capsys):
    import csv

    import onnxruntime

    from visiontune.data.decode import read_image

    out = tmp_path / "with-pre.onnx"
    assert main(["export", "--run", str(run), "--format", "onnx", "--with-preprocessing", "--out", str(out)]) == 0
    assert "input uint8 [N, H, W, 3] RGB images of any size" in capsys.readouterr().out
    files = sorted((sample_data / "test").iterdir())[:6]
    predicted = tmp_path / "p.csv"
    paths = [str(f) for f in files]
    assert main(["predict", "--run", str(run), *paths, "--out", str(predicted), "--no-progress"]) == 0
    rows = {r["path"]: r for r in csv.DictReader(predicted.open())}
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    sizes = set()
    for path in paths:  # one image at a time: the files differ in size, the graph takes each as it is
        image = read_image(path).permute(1, 2, 0)[None]
        sizes.add(tuple(image.shape[1:3]))
        probs = torch.from_numpy(session.run(["logits"], {"images": image.numpy()})[0]).softmax(1)[0]
        expected = torch.tensor([float(rows[path]["prob_cat"]), float(rows[path]["prob_dog"])])
        assert (probs - expected).abs().max().item() < TOL, path  # the CSV has 6 decimals
    # A batch of one size (the second file, twice) gives the same as the file alone.
    image = read_image(paths[1]).permute(1, 2, 0)[None]
    batch = session.run(["logits"], {"images": torch.cat([image, image]).numpy()})[0]
    single = session.run(["logits"], {"images": image.numpy()})[0]
    assert abs(batch - single).max() < 1e-5 and batch.shape == (2, 2)
    assert len(sizes) == len(paths)  # every file its own size: nothing was resized before the graph
    pt2 = tmp_path / "m.pt2"
    assert main(["export", "--run", str(run), "--format", "pt2", "--with-preprocessing", "--out", str(pt2)]) == 2
    assert "--with-preprocessing is for --format onnx" in capsys.readouterr().err and not pt2.exists()


@pytest.mark.slow
def test_onnx_with_probabilities_gives_the_softmax_and_serves_the_runs_probabilities(
    run, batches, sample_data, tmp_path, exported_onnx
):
    import onnx
    import onnxruntime

    from visiontune.inference.runtime import load_runtime

    out, plain = tmp_path / "probs.onnx", exported_onnx  # the same run exported without --probabilities
    assert main(["export", "--run", str(run), "--format", "onnx", "--probabilities", "--out", str(out)]) == 0
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["probabilities"]
    for x, eager in batches:
        got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        assert (got - eager.softmax(1)).abs().max().item() <= 1e-5
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert props["visiontune_output"] == "probabilities"
    assert {p.key: p.value for p in onnx.load(str(plain)).metadata_props}["visiontune_output"] == "logits"
    # What serve computes from each file (decode, resize, normalise, forward, its softmax or none): the run's.
    files = sorted((sample_data / "test").iterdir())[:6]
    runtimes = [load_runtime(run=str(run)), load_runtime(weights=str(out)), load_runtime(weights=str(plain))]
    prepared = [runtimes[0].prepare(f.read_bytes()) for f in files]
    expected, from_probs, from_logits = (r.probabilities(prepared) for r in runtimes)
    assert runtimes[1].gives_probabilities and not runtimes[2].gives_probabilities
    assert (from_probs - expected).abs().max().item() <= 1e-5 and (from_logits - expected).abs().max().item() <= 1e-5
    # A second softmax would flatten the probabilities towards 1/2: these are far enough from it to show one.
    assert (expected - 0.5).abs().max().item() > 0.05


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--format", "onnx", "--int8", "--with-preprocessing"], "--int8 quantizes the network alone"),
        (["--format", "pt2", "--with-preprocessing"], "--with-preprocessing is for --format onnx"),
        (["--format", "hub", "--with-preprocessing"], "--with-preprocessing is for --format onnx"),
        (["--format", "pt2", "--int8"], "--int8 is for --format onnx or openvino"),
        (["--format", "onnx", "--int8", "--probabilities"], "--probabilities is for fp32 --format onnx or pt2"),
        (["--format", "hub", "--probabilities"], "--probabilities is for fp32 --format onnx or pt2"),
    ],
)
def test_refused_export_combinations_answer_before_any_model_code_is_imported(
    tmp_path, capsys, monkeypatch, extra, said
):
    """A combination the flags alone rule out is refused before the run is read or the exporters imported
    (a None in sys.modules makes any import of them fail): at once, whatever the model's size."""
    for name in ("visiontune.inference.export", "visiontune.inference.loaded", "visiontune.inference.quantize", "onnx"):
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "m.onnx"
    assert main(["export", "--run", str(tmp_path / "no-run"), *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and not out.exists()


def test_export_help_says_int8_and_with_preprocessing_do_not_go_together(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(not with --int8)" in text and "(not with --with-preprocessing" in text
