"""hf:PATH of a folder written by ``save_to_disk``: its JSON records (``dataset_dict.json``, each split's
``state.json`` and ``dataset_info.json``) are read by ``data.hfdata`` first, bounded, with the names in them
plain names inside the folder; anything else is one line naming the file, exit 2, before datasets reads it."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from fuzzing import fuzz_settings
from trainrun import one_line
from visiontune.cli.commands import main
from visiontune.data import hfdata
from visiontune.data.sources import discover
from visiontune.errors import UserError
from visiontune.tasks import AUTO

datasets = pytest.importorskip("datasets")


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((6, 5, 3), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def save(folder: Path, labels=("cat", "dog", "cat", "dog")) -> Path:
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])})
    rows = {"img": [{"bytes": _png(30 * i), "path": None} for i in range(len(labels))], "label": list(labels)}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("hf") / "set")


def _arrow(folder: Path) -> str:
    return json.loads((folder / "train" / "state.json").read_text())["_data_files"][0]["filename"]


@pytest.mark.parametrize(
    "file,record,says",
    [
        ("dataset_dict.json", {"splits": ["../other"]}, "its splits are ['../other'], expected a list of the names"),
        ("dataset_dict.json", {"splits": "train"}, "its splits are 'train'"),
        ("dataset_dict.json", ["train"], "is ['train'], not a JSON object"),
        ("train/state.json", {"_data_files": [{"filename": "../../other/train/ARROW"}]}, "its _data_files are"),
        ("train/state.json", {"_data_files": [{"filename": "/etc/hostname"}]}, "its _data_files are"),
        ("train/dataset_info.json", "[" * 100_000, "is not JSON"),
    ],
)
def test_a_damaged_saved_record_is_one_line_before_datasets_reads_it(saved, tmp_path, capsys, file, record, says):
    """Two of them name a set outside the folder, which datasets read (and trained on) before."""
    shutil.copytree(saved, folder := tmp_path / "set")
    shutil.copytree(saved, tmp_path / "other")
    text = record if isinstance(record, str) else json.dumps(record).replace("ARROW", _arrow(saved))
    if file == "train/state.json":  # the rest of the record as datasets wrote it
        whole = json.loads((folder / file).read_text())
        text = json.dumps({**whole, **json.loads(text)})
    (folder / file).write_text(text)
    capsys.readouterr()
    assert main(["check", f"hf:{folder}"]) == 2
    one_line(capsys, str(folder / file), says)


def test_a_saved_record_larger_than_any_datasets_writes_is_refused_unread(saved, tmp_path, capsys):
    shutil.copytree(saved, folder := tmp_path / "set")
    listing = folder / "dataset_dict.json"
    listing.write_text(listing.read_text() + " " * hfdata.MAX_RECORD)  # valid JSON, one record too large
    capsys.readouterr()
    assert main(["check", f"hf:{folder}"]) == 2
    one_line(capsys, str(listing), "is larger than a datasets record is (16 MiB)")


def test_a_saved_set_reads_back_whole(saved):
    found = discover(f"hf:{saved}", task=AUTO)
    assert len(found) == 4 and found.classes == ["cat", "dog"]


# Any JSON value, to depth 3.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
FIELDS = {"dataset_dict.json": ["splits"], "train/state.json": ["_data_files", "_split", "_fingerprint"],
          "train/dataset_info.json": ["features", "splits"]}  # fmt: skip


@fuzz_settings(40)
@given(st.data())
def test_fuzz_any_saved_record_gives_a_listing_or_one_line(saved, data):
    file = data.draw(st.sampled_from(sorted(FIELDS)))
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(saved, folder := Path(tmp) / "set")
        if data.draw(st.booleans()):
            (folder / file).write_bytes(data.draw(st.binary(max_size=80)))
        else:
            record = json.loads((folder / file).read_text())
            record[data.draw(st.sampled_from(FIELDS[file]))] = data.draw(JSON)
            (folder / file).write_text(json.dumps(record))
        try:
            found = discover(f"hf:{folder}", task=AUTO)
        except UserError as e:
            assert "\n" not in str(e) and len(str(e)) < 1000
        else:
            assert len(found) <= 4
