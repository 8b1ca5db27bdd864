"""hf: data whose labels are missing in places (None, NaN) or whose train/validation split is empty: one line
saying which column and row and what to do, or for an empty validation split the seeded split of train."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image as PILImage

import trainrun
from visiontune.cli.commands import main
from visiontune.data.sources import discover
from visiontune.data.split import make_split, make_stratified_split, split_of
from visiontune.errors import UserError
from visiontune.tasks import AUTO

datasets = pytest.importorskip("datasets")


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(np.full((6, 5, 3), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _set(labels, dtype: str):
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value(dtype)})
    images = [{"bytes": _png(20 * i), "path": None} for i in range(len(labels))]
    return datasets.Dataset.from_dict({"img": images, "label": list(labels)}, features=features)


@pytest.mark.parametrize(
    "labels, dtype",
    [
        (["cat", "dog", "cat", None, "dog", None], "string"),  # was: TypeError ... NoneType
        ([1.5, 2.0, 1.5, float("nan"), 2.0, 2.0], "float64"),  # was: KeyError: nan
        ([3, 7, 3, None, 7, 7], "int64"),  # (Arrow's null in an int column)
    ],
)
def test_rows_without_a_label_are_one_line_naming_column_and_row(tmp_path, capsys, labels, dtype):
    _set(labels, dtype).save_to_disk(str(tmp_path / "hf"))
    capsys.readouterr()  # (datasets' progress bars)
    assert main(["check", f"hf:{tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    missing = sum(v is None or v != v for v in labels)
    assert len(err) == 1 and f"{missing} rows have no label in column 'label'" in err[0]
    assert f"the first hf:{tmp_path / 'hf'}/train row 3;" in err[0] and "Dataset.filter" in err[0]
    # predict does not use labels: it lists every row, the classes from the labelled ones.
    found = discover(f"hf:{tmp_path / 'hf'}", every_split=True, task=AUTO)
    assert len(found) == 6 and found.classes == sorted({str(v) for v in labels if v is not None and v == v})


def test_labels_are_the_sorted_values_through_arrow(tmp_path):
    """Text and integers (not read through numpy, which turns an int column with nulls into floats)."""
    _set(["dog", "cat", "emu", "cat"], "string").save_to_disk(str(tmp_path / "s"))
    found = discover(f"hf:{tmp_path / 's'}", task=AUTO)
    assert found.classes == ["cat", "dog", "emu"] and found.labels.tolist() == [1, 0, 2, 0]
    _set([10, 2, 10, 2], "int64").to_parquet(str(tmp_path / "pq" / "train.parquet"))
    found = discover(f"hf:{tmp_path / 'pq'}", task=AUTO)
    assert found.classes == ["2", "10"] and found.labels.tolist() == [1, 0, 1, 0]


def test_a_classlabel_value_past_its_names_is_refused(tmp_path):
    features = datasets.Features({"img": datasets.Image(), "y": datasets.ClassLabel(names=["a", "b"])})
    rows = {"img": [{"bytes": _png(i), "path": None} for i in range(3)], "y": [0, 1, 1]}
    table = datasets.Dataset.from_dict(rows, features=features)
    table = table.cast(datasets.Features({"img": datasets.Image(), "y": datasets.Value("int64")}))
    table = table.map(lambda r: {"y": r["y"] * 5}).cast(features)  # 5 > 1: past the names, as a hand edit
    table.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(UserError, match="column 'y' holds class 5 of a ClassLabel of 2"):
        discover(f"hf:{tmp_path / 'hf'}", task=AUTO)


@pytest.mark.parametrize("saved", ["save_to_disk", "parquet"])
def test_an_empty_validation_split_leaves_the_seeded_split_of_train(tmp_path, saved):
    train, empty = _set(["a", "b"] * 5, "string"), _set([], "string")
    if saved == "save_to_disk":  # datasets writes an empty split no Arrow file, and load_from_disk fails on it
        datasets.DatasetDict({"train": train, "validation": empty}).save_to_disk(str(tmp_path / "hf"))
    else:  # load_dataset refuses an empty split's file: 'Instruction "validation" corresponds to no data!'
        train.to_parquet(str(tmp_path / "hf" / "train-0.parquet"))
        empty.to_parquet(str(tmp_path / "hf" / "validation-0.parquet"))
    found = discover(f"hf:{tmp_path / 'hf'}", task=AUTO)
    assert len(found) == 10 and found.val_mask is None and found.labels.tolist() == [0, 1] * 5
    assert found.split_note == "its validation split is empty: the seeded split of train"  # start line, split.json
    assert split_of(found, 0.2, seed=4) == make_stratified_split(found.labels, 0.2, 4)  # the default
    assert split_of(found, 0.2, seed=4, method="random") == make_split(10, 0.2, 4)
    assert [found.reader[i] for i in range(10)] == [_png(20 * i) for i in range(10)]


@pytest.mark.parametrize("splits", [("train", "validation"), ("train",)])
def test_an_empty_train_split_is_one_line(tmp_path, capsys, splits):
    sets = {"train": _set([], "string"), "validation": _set(["a", "b"], "string")}
    datasets.DatasetDict({s: sets[s] for s in splits}).save_to_disk(str(tmp_path / "hf"))
    capsys.readouterr()
    assert main(["check", f"hf:{tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"hf:{tmp_path / 'hf'}: its train split has no rows" in err[0]


@pytest.mark.slow
def test_an_arrow_row_holding_the_png_that_crashed_torchvision_is_a_bad_file(tmp_path, worker_env):
    """The 69-byte PNG (half its rows) as an Arrow row: ``check hf:`` lists it as a bad file instead of dying
    with SIGSEGV inside torchvision's decode_png. A subprocess, so a crash would show as its exit code."""

    from badfiles import short_png
    from conftest import PYTHON

    rows = [{"bytes": short_png() if i == 2 else _png(20 * i), "path": None} for i in range(4)]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"img": rows, "label": ["cat", "dog", "cat", "dog"]}, features=features)
    ds.save_to_disk(str(tmp_path / "hf"))
    done = trainrun.run(  # a fork of a process holding the imports: a crash is its exit code all the same
        [PYTHON, "-m", "visiontune", "check", f"hf:{tmp_path / 'hf'}", "--report", str(tmp_path / "bad.csv")],
        worker_env,
    )
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])  # 1: bad files found; -11 was the crash
    assert "Traceback" not in done.stderr
    bad = (tmp_path / "bad.csv").read_text().splitlines()
    assert len(bad) == 2 and bad[1].startswith(f"hf:{tmp_path / 'hf'}/train/2,truncated PNG"), bad
