"""A model file from someone else: its description (safetensors metadata) is checked field by field before it
sizes an allocation or shapes an output, and a file that is not safetensors at all is one line naming it.

Each bad file goes through ``visiontune predict --weights FILE`` in-process: exit 2, one line on stderr naming
the file and the field, no traceback, and no output file.
"""

from __future__ import annotations

import csv
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from fuzzing import fuzz_settings
from trainrun import flags
from visiontune.cli.commands import main
from visiontune.data.sample import make_sample_data
from visiontune.models.build import build_model
from visiontune.runs.runinfo import MAX_DESCRIPTION, describe

MODEL = "squeezenet1_1"  # 1.2 M parameters: a small real file


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in build_model(MODEL, 2, "none").state_dict().items()}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("untrusted") / "data"
    make_sample_data(out, per_class=1, test_count=3, seed=0)
    return out / "test"


def _description(**changes) -> dict:
    good = describe(MODEL, "torchvision", ["cat", "dog"], 32, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bilinear")
    return {**good.to_dict(), **changes}


def _model_file(path: Path, state, description: dict | str) -> Path:
    text = description if isinstance(description, str) else json.dumps(description)
    save_file(state, str(path), metadata={"visiontune": text})
    return path


def _predict(weights: Path, images: Path, capsys) -> tuple[int, list[str], Path]:
    out = weights.with_suffix(".csv")
    capsys.readouterr()
    code = main(["predict", *flags(weights=weights, data=images, out=out, no_progress=True)])
    return code, capsys.readouterr().err.splitlines(), out


def _refused(weights: Path, images: Path, capsys, *words: str) -> str:
    code, err, out = _predict(weights, images, capsys)
    assert code == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert str(weights) in err[0] and all(w in err[0] for w in words), err[0]
    assert not out.exists()  # nothing half-written
    return err[0]


def test_a_valid_model_file_predicts(tmp_path, state, images, capsys):
    weights = _model_file(tmp_path / "good.safetensors", state, _description())
    code, err, out = _predict(weights, images, capsys)
    assert code == 0, err
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["id", "label"] and len(rows) == 4
    assert all(0 <= float(p) <= 1 for _, p in rows[1:])  # NaN fails both comparisons


@pytest.mark.parametrize(
    "field,value",
    [
        ("image_size", 10**9),  # predict would allocate 3 x 10^18 bytes per batch
        ("image_size", 0),
        ("image_size", True),  # JSON true is an int to Python
        ("image_size", "32"),
        ("image_size", 32.5),
        ("classes", "abc"),  # once three classes a, b and c
        ("classes", ["a", "a"]),
        ("classes", ["cat", ""]),
        ("classes", ["cat", 7]),
        ("classes", ["only"]),
        ("classes", {"cat": 0, "dog": 1}),
        ("mean", [math.nan, 0.4, 0.4]),  # once NaN for every image, exit 0
        ("mean", [0.5, 0.5]),
        ("mean", [1e308, 0.5, 0.5]),
        ("mean", "0.5"),
        ("std", [0.0, 0.2, 0.2]),
        ("std", [-0.2, 0.2, 0.2]),
        ("std", [math.inf, 0.2, 0.2]),
        ("crop_pct", 0),
        ("crop_pct", -1),
        ("crop_pct", 1e-5),  # 32 / 1e-5: every image resized to 3.2 million px a side
        ("interpolation", "lanczos"),
        ("source", "pickle"),
        ("model", ""),
        ("model", ["resnet18"]),
        ("version", {"x": 1}),
    ],
)
def test_a_damaged_description_is_one_line_naming_the_file_and_the_field(tmp_path, state, images, capsys, field, value):
    weights = _model_file(tmp_path / "m.safetensors", state, _description(**{field: value}))
    _refused(weights, images, capsys, field)


@pytest.mark.parametrize(
    "text,words",
    [
        ("[1, 2]", ["not a visiontune model description"]),
        (json.dumps({"model": MODEL}), ["expected fields"]),
        ("{not json", ["not JSON"]),
        ("[" * 100_000 + "]" * 100_000, ["not JSON"]),  # deep enough to exhaust the parser's stack
        (json.dumps(_description(padding="x" * MAX_DESCRIPTION)), ["over"]),
    ],
)
def test_a_description_that_is_not_one_is_refused(tmp_path, state, images, capsys, text, words):
    _refused(_model_file(tmp_path / "m.safetensors", state, text), images, capsys, *words)


def test_a_size_the_model_cannot_take_is_refused_before_any_image_is_read(tmp_path, state, images, capsys):
    weights = _model_file(tmp_path / "m.safetensors", state, _description(image_size=8))
    _refused(weights, images, capsys, "image size 8", MODEL)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"this is not a model at all, only text",  # its first 8 bytes read as a header of 10^18 bytes
        struct.pack("<Q", 10) + b"{broken",
        struct.pack("<Q", 2**40) + b"{}",  # claims a header larger than the file
    ],
)
def test_a_file_that_is_not_safetensors_is_one_line_naming_it(tmp_path, images, capsys, content):
    weights = tmp_path / "x.safetensors"
    weights.write_bytes(content)
    _refused(weights, images, capsys, "safetensors")


def test_a_truncated_model_file_is_one_line_naming_it(tmp_path, state, images, capsys):
    good = _model_file(tmp_path / "good.safetensors", state, _description())
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _refused(cut, images, capsys)


# Any JSON value, to depth 3: what a damaged or hostile description may hold in any field.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@fuzz_settings(50)
@given(st.lists(st.tuples(st.sampled_from([*_description(), "task_state", "multi_label"]), JSON), max_size=3))
def test_fuzz_any_model_description_is_checked_or_one_line(changes):
    """``runinfo.read_file`` on a description with any field replaced by any JSON value: a description within
    the model file's bounds, or one line naming the file."""
    import tempfile

    from visiontune.errors import UserError
    from visiontune.runs.runinfo import read_file

    with tempfile.TemporaryDirectory() as folder:
        path = _model_file(Path(folder) / "m.safetensors", {"w": torch.zeros(1)}, _description(**dict(changes)))
        try:
            info = read_file(str(path))
        except UserError as e:
            assert "\n" not in str(e) and str(path) in str(e)
            return
    assert 2 <= len(info.classes) <= 100_000 and len(set(info.classes)) == len(info.classes)
    assert 1 <= info.image_size <= 4096 and all(math.isfinite(x) for x in (*info.mean, *info.std))
