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


def test_onnx_round_trip(run, batches, tmp_path):
    import onnx
    import onnxruntime

    out = tmp_path / "model.onnx"
    assert main(["export", "--run", str(run), "--format", "onnx", "--out", str(out)]) == 0
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    for x, eager in batches:
        got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        assert got.shape == eager.shape
        assert (got - eager).abs().max().item() <= TOL
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(props["visiontune"]) == json.loads((run / "config.json").read_text())["model"]


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


def test_torchscript_points_to_its_successor(run, tmp_path, capsys):
    assert main(["export", "--run", str(run), "--format", "torchscript", "--out", str(tmp_path / "m.pt")]) == 2
    assert "--format pt2" in capsys.readouterr().err and not (tmp_path / "m.pt").exists()


def test_missing_onnx_says_how_to_install(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # makes `import onnx` raise ImportError
    out = tmp_path / "model.onnx"
    assert main(["export", "--run", str(run), "--format", "onnx", "--out", str(out)]) == 2
    assert "pip install 'visiontune[onnx]'" in capsys.readouterr().err
    assert not out.exists()
