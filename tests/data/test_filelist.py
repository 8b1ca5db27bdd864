"""``--exclude CSV`` / ``--relabel CSV``: the files dropped and relabelled, a file not in the data and a
malformed CSV each one line, and any bytes given as the CSV read or refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bounded import past_and_under
from fuzzing import fuzz_settings
from visiontune import tasks
from visiontune.data import filelist
from visiontune.data.filelist import edit
from visiontune.data.imageset import ImageSet
from visiontune.errors import UserError


def _images() -> ImageSet:
    names = [f"{c}/{i}.png" for c in ("cat", "dog") for i in range(3)]
    paths = [f"/d/{n}" for n in names]
    return ImageSet("/d", "imagefolder", paths, [0, 0, 0, 1, 1, 1], ["cat", "dog"], reading=tasks.SINGLE_LABEL)


def _multi() -> ImageSet:
    targets = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0]], np.uint8)
    paths = ["/d/a.png", "/d/b.png", "/d/c.png"]
    return ImageSet("/d", "manifest", paths, [0, 1, 0], ["x", "y", "z"], targets=targets, reading=tasks.MULTI_LABEL)


def test_exclude_drops_the_files_and_says_how_many(tmp_path):
    csv = tmp_path / "audit.csv"
    csv.write_text("file,kind,score\ncat/1.png,label,0.1\n/d/dog/2.png,duplicate,1\n")
    kept, record = edit(_images(), str(csv), None)
    assert list(kept.paths) == ["/d/cat/0.png", "/d/cat/2.png", "/d/dog/0.png", "/d/dog/1.png"]
    assert kept.labels.tolist() == [0, 0, 1, 1]
    assert record["exclude"]["images"] == 2 and len(record["exclude"]["sha256"]) == 64


def test_names_audit_csv_kept_as_text_come_back(tmp_path):
    from visiontune.audit.pages import csv_text

    names = ["=1+2.png", "-x.png", "@a.png", "+b.png"]
    paths = [f"/d/{n}" for n in names]
    images = ImageSet("/d", "imagefolder", paths, [0, 1, 0, 1], ["cat", "dog"], reading=tasks.SINGLE_LABEL)
    csv = tmp_path / "audit.csv"
    csv.write_text(csv_text([{"file": n, "kind": "label", "suggested": "dog"} for n in names[:2]]))
    assert "'=1+2.png" in csv.read_text()  # a spreadsheet shows it as text, not a formula
    kept, _ = edit(images, str(csv), None)
    assert list(kept.paths) == ["/d/@a.png", "/d/+b.png"]
    relabelled, _ = edit(images, None, str(csv))
    assert relabelled.labels.tolist() == [1, 1, 0, 1]


def test_relabel_takes_the_suggested_labels_of_rows_that_have_one(tmp_path):
    csv = tmp_path / "audit.csv"
    csv.write_text("file,suggested\ncat/1.png,dog\ndog/0.png,\n")
    relabelled, record = edit(_images(), None, str(csv))
    assert relabelled.labels.tolist() == [0, 1, 0, 1, 1, 1] and record["relabel"]["images"] == 1
    multi = tmp_path / "multi.csv"
    multi.write_text("file,suggested\na.png,y;z\n")
    out, _ = edit(_multi(), None, str(multi))
    assert out.targets.tolist() == [[0, 1, 1], [0, 1, 0], [1, 1, 0]] and out.labels.tolist() == [1, 1, 0]


@pytest.mark.parametrize(
    "flag, text, says",
    [
        ("exclude", "file\ncat/9.png\n", "row 2 names 'cat/9.png', which is not in /d"),
        ("exclude", "name\ncat/1.png\n", "needs a header with file columns"),
        ("relabel", "file\ncat/1.png\n", "needs a header with file and suggested columns"),
        ("relabel", "file,suggested\ncat/1.png,bird\n", "'bird' (for /d/cat/1.png) is not a class of /d"),
        ("exclude", 'file\n"cat/1.png\n', "not a CSV"),
    ],
)
def test_bad_csv_is_one_line_naming_the_flag(tmp_path, flag, text, says):
    csv = tmp_path / "x.csv"
    csv.write_text(text)
    args = (str(csv), None) if flag == "exclude" else (None, str(csv))
    with pytest.raises(UserError, match=rf"^--{flag} {csv}: ") as e:
        edit(_images(), *args)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "bound, value, says",
    [
        ("MAX_BYTES", 20, "larger than 20 bytes;"),  # its unit: "0 MiB" before
        ("MAX_ROWS", 2, "more than 2 rows"),
        ("MAX_CELL", 5, "row 2 has a cell longer than 5 or a NUL byte"),
    ],
)
def test_a_csv_past_a_bound_is_one_line_naming_it(tmp_path, monkeypatch, bound, value, says):
    csv = tmp_path / "x.csv"
    csv.write_text("file\ncat/1.png\ncat/2.png\ndog/1.png\n")  # 35 bytes, 3 rows, 9 characters a cell
    kept, _ = past_and_under(monkeypatch, filelist, bound, value, lambda: edit(_images(), str(csv), None),
                             f"--exclude {csv}: ", says)  # fmt: skip
    assert len(kept) == 3


def test_a_size_bound_is_said_exactly_in_its_unit():
    from visiontune.text import byte_size

    sizes = [filelist.MAX_BYTES, 20, 512 << 10, 1536, 3 << 29, 1 << 20]
    assert [byte_size(n) for n in sizes] == ["64 MiB", "20 bytes", "512 KiB", "1,536 bytes", "1,536 MiB", "1 MiB"]


@fuzz_settings(200)
@given(st.binary(max_size=400))
def test_fuzz_any_bytes_as_the_csv_are_rows_or_one_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "x.csv"
    path.write_bytes(data)
    try:
        kept, _ = edit(_images(), str(path), None)
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert set(kept.paths) <= set(_images().paths)


@pytest.mark.slow
def test_train_with_exclude_and_relabel_records_them(tmp_path, sample_data, capsys):
    from trainrun import TINY
    from visiontune.cli.commands import main

    audit = tmp_path / "audit.csv"
    audit.write_text("file,kind,suggested\ntrain/cat.0.jpg,label,dog\ntrain/dog.1.jpg,duplicate,\n")
    run = tmp_path / "run"
    argv = ["train", "--data", str(sample_data), "--output-dir", str(run), *TINY, "--epochs", "1"]
    assert main([*argv, "--exclude", str(audit)]) == 0
    said = capsys.readouterr().out
    assert f"--exclude {audit}: its files left out" in said
    split = json.loads((run / "split.json").read_text())
    listed = {*split["train"], *split["val"]}
    assert "train/dog.1.jpg" not in listed and "train/cat.0.jpg" not in listed
    assert split["exclude"]["images"] == 2 and len(listed) == 118
    # --relabel on a file not in the data: one line, before any training.
    bad = tmp_path / "bad.csv"
    bad.write_text("file,suggested\ntrain/bird.1.jpg,dog\n")
    assert main([*argv[:4], str(tmp_path / "run2"), *argv[5:], "--relabel", str(bad)]) == 2
    assert "row 2 names 'train/bird.1.jpg', which is not in" in capsys.readouterr().err
