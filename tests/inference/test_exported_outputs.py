"""An exported file's output held to its own description (``inference.formats``): a graph that gives another
number of outputs than the classes it describes, or non-finite outputs (NaN weights), is one line naming the
file in predict, evaluate and serve -- before any image is read, and nothing is written.

The files are made here, small: the images' mean colour times a weight matrix (ONNX, and OpenVINO IR)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from fuzzing import fuzz_settings
from visiontune.cli.commands import main
from visiontune.errors import UserError
from visiontune.inference import formats
from visiontune.inference.runtime import load_runtime
from visiontune.runs.runinfo import RunInfo

SIZE = 32  # trained_run's
INFO = RunInfo("resnet18", "torchvision", ("cat", "dog"), SIZE, (0.5,) * 3, (0.25,) * 3, "bilinear", "0")


def _weights(outputs: int, nan: bool) -> np.ndarray:
    w = np.arange(3 * outputs, dtype=np.float32).reshape(3, outputs) / 10
    if nan:
        w[1, 0] = np.nan
    return w


def _onnx(path: Path, outputs: int = 2, nan: bool = False) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["n", 3, SIZE, SIZE])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", outputs])
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("MatMul", ["m", "w"], ["logits"]),
    ]
    w = numpy_helper.from_array(_weights(outputs, nan), "w")
    graph = helper.make_graph(nodes, "mean-colour", [x], [y], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    helper.set_model_props(model, INFO.metadata())
    path.write_bytes(model.SerializeToString())
    return path


def _ir(path: Path, outputs: int = 2, nan: bool = False) -> Path:
    ov = formats.import_openvino()
    images = ov.opset13.parameter([-1, 3, SIZE, SIZE], np.float32, name="images")
    mean = ov.opset13.reduce_mean(images, ov.opset13.constant(np.array([2, 3])), keep_dims=False)
    model = ov.Model([ov.opset13.matmul(mean, ov.opset13.constant(_weights(outputs, nan)), False, False)], [images])
    for key, value in INFO.metadata().items():
        model.set_rt_info(value, [key])
    ov.save_model(model, str(path), compress_to_fp16=False)  # the NaN kept as it is
    return path


@pytest.fixture
def image(tmp_path) -> Path:
    path = tmp_path / "x.png"
    Image.new("RGB", (40, 36), (200, 100, 50)).save(path)
    return path


def test_a_file_true_to_its_description_predicts_one_row_per_image_of_its_classes(tmp_path, image):
    out = tmp_path / "p.csv"
    assert main(["predict", "--weights", str(_onnx(tmp_path / "m.onnx")), str(image), "--out", str(out)]) == 0
    rows = list(csv.reader(out.open()))
    mean = (np.array([200, 100, 50]) / 255 - 0.5) / 0.25  # the image's one colour, normalised
    logits = mean @ _weights(2, False)
    assert rows[0][-2:] == ["prob_cat", "prob_dog"] and len(rows) == 2 and len(rows[1]) == len(rows[0])
    want = np.exp(logits) / np.exp(logits).sum()
    assert [float(v) for v in rows[1][-2:]] == pytest.approx(want, abs=1e-3)


CASES = [
    (5, False, "gives outputs of shape (1, 5) for 1 image(s), but its description names 2 classes"),
    (1, False, "gives outputs of shape (1, 1) for 1 image(s), but its description names 2 classes"),
    (2, True, "gives non-finite outputs (NaN or infinity): its weights are damaged"),
]
AGAIN = "; export the model again with `visiontune export`"


@pytest.mark.parametrize("make", [_onnx, _ir], ids=["onnx", "openvino"])
@pytest.mark.parametrize(("outputs", "nan", "said"), CASES)
def test_a_file_whose_output_is_not_its_descriptions_is_one_line_in_predict_and_serve(
    tmp_path, image, capsys, make, outputs, nan, said
):
    path = make(tmp_path / f"m{'.onnx' if make is _onnx else '.xml'}", outputs, nan)
    out = tmp_path / "p.csv"
    assert main(["predict", "--weights", str(path), str(image), "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"visiontune: error: {path} {said}{AGAIN}"]
    assert not out.exists()
    with pytest.raises(UserError, match=f"{path} gives"):  # serve's loading: before it listens
        load_runtime(weights=str(path))


@pytest.mark.slow
@pytest.mark.parametrize(("outputs", "nan", "said"), [CASES[0], CASES[2]])
def test_a_file_whose_output_is_not_its_descriptions_is_one_line_in_evaluate(
    trained_run, tmp_path, capsys, outputs, nan, said
):
    path, report = _onnx(tmp_path / "m.onnx", outputs, nan), tmp_path / "eval.json"
    argv = ["evaluate", "--run", str(trained_run), "--weights", str(path), "--out", str(report), "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"visiontune: error: {path} {said}{AGAIN}"]
    assert not report.exists()


SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
VALUES = st.floats(allow_nan=True, allow_infinity=True, width=32)


@fuzz_settings(100)
@given(st.lists(hnp.arrays(np.float32, SHAPES, elements=VALUES) | st.none() | st.integers(), min_size=1, max_size=3))
def test_fuzz_any_output_of_an_exported_file_is_its_descriptions_or_one_line(outputs):
    """Whatever the graph gives (any shape, NaN, infinity, no array at all), on opening and on later batches:
    a one-line ``UserError`` or one finite row per image and class."""
    answers = iter(outputs * 2)
    exported = formats.Exported(INFO, lambda x: next(answers), False, "onnx")
    batch = np.ones((1, 3, SIZE, SIZE), np.float32)
    try:
        held = formats._held_to_description("m.onnx", exported)
        for _ in outputs[1:]:
            out = held.forward(batch)
            assert out.shape == (1, 2) and np.isfinite(out).all()
    except UserError as e:
        assert len(str(e).splitlines()) == 1 and str(e).startswith("m.onnx ")


def test_a_description_with_a_number_beyond_a_float_is_one_line(tmp_path, image, capsys):
    """JSON's integers have no bound: a mean of 10**400 is a damaged description, not an OverflowError."""
    import json

    from onnx import load, save

    path = _onnx(tmp_path / "m.onnx")
    model = load(str(path))
    described = json.loads(model.metadata_props[0].value)
    model.metadata_props[0].value = json.dumps({**described, "mean": [10**400, 0.5, 0.5]})
    save(model, str(path))
    assert main(["predict", "--weights", str(path), str(image), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}: damaged model description: mean is [1000000000" in err[0]
