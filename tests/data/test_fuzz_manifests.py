"""Fuzz: whatever ``train.csv`` holds (any bytes, odd CSV, hostile paths and label cells), single- or
multi-label, listing the data gives a ``UserError`` (one line) or a valid listing, never another exception.
The fuzz tier's rules are in tests/fuzzing.py."""

from __future__ import annotations

import csv
import io
import os
import tempfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bounded import past_and_under
from fuzzing import fuzz_settings
from visiontune.data import imageset, layouts, sources
from visiontune.errors import UserError
from visiontune.tasks import reader

FILES = ("a.jpg", "b.jpg", "sub/c.png", "x y.jpg", "é.jpg", "7.jpg")


@pytest.fixture(scope="module")
def root():
    """A data folder with a few (empty) image files: the listing checks they exist, it does not decode."""
    with tempfile.TemporaryDirectory() as folder:
        for name in FILES:
            os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
            open(os.path.join(folder, name), "wb").close()
        yield folder


NAMES = (
    st.sampled_from(FILES)
    | st.sampled_from(
        ["./a.jpg", "sub//c.png", "missing.jpg", "../a.jpg", "/etc/passwd", "", " ", "a.jpg\x00", "sub", "."]
    )
    | st.text(max_size=12)
)
LABEL = st.sampled_from(["cat", "dog", "golden retriever", "7", "-1", "007", "", ";", " ; ", "a;b", "a; ;b"])
CELLS = LABEL | st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
HEADER = st.sampled_from([[], ["filename", "label"], ["path", "labels"], ["id", "tags"], ["file", "class"]])


@st.composite
def manifests(draw) -> bytes:
    """A manifest as csv writes one (any quoting, BOM or none), or text or bytes of any kind."""
    kind = draw(st.sampled_from(["rows", "rows", "text", "bytes", "long"]))
    if kind == "long":  # a cell over csv's field limit (128 KiB)
        return f"a.jpg,cat\nb.jpg,{'x' * draw(st.integers(131_000, 132_000))}\n".encode()
    if kind == "bytes":
        return draw(st.binary(max_size=400))
    if kind == "text":
        alphabet = st.sampled_from(list(',;"\n\r \t\x00\ufeff') + ["a.jpg", "b.jpg", "cat", "dog", "é"])
        text = "".join(draw(st.lists(alphabet, max_size=60)))
    else:
        # Mostly a file name then a label cell: a listing is then within reach, and so are the label cells'
        # corner cases (all empty, only ';', digits and names mixed).
        rows = draw(st.lists(st.tuples(NAMES, LABEL | CELLS, st.lists(CELLS, max_size=2)), max_size=8))
        rows = [[name, label, *more][: draw(st.sampled_from([1, 2, 2, 2, 3]))] for name, label, more in rows]
        buf = io.StringIO()
        quoting = draw(st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL, csv.QUOTE_NONNUMERIC]))
        csv.writer(buf, quoting=quoting, lineterminator=draw(st.sampled_from(["\n", "\r\n"]))).writerows(
            [draw(HEADER), *rows]
        )
        text = buf.getvalue()
    return (draw(st.sampled_from(["", "\ufeff"])) + text).encode("utf-8", "surrogatepass")


def assert_valid(found: imageset.ImageSet, root: str, multi_label: bool) -> None:
    n, k = len(found.paths), len(found.classes)
    assert n == len(found.labels) > 0 and k >= 2 and len(set(found.classes)) == k
    assert found.labels.min() >= 0 and found.labels.max() < k
    for path in found.paths:
        assert os.path.isfile(path) and os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)
    assert len({os.path.realpath(p) for p in found.paths}) == n  # each file listed once
    if multi_label:
        assert found.targets.shape == (n, k) and set(np.unique(found.targets)) <= {0, 1}
        assert found.targets.any(0).all()  # every class is some image's


@fuzz_settings(100)
@given(manifests(), st.booleans())
def test_any_manifest_is_a_listing_or_one_user_error(root, manifest, multi_label):
    with open(os.path.join(root, "train.csv"), "wb") as f:
        f.write(manifest)
    try:
        found = sources.discover(root, task=reader("multilabel" if multi_label else "auto"))
    except UserError as e:
        assert str(e) and "\n" not in str(e).strip()
        return
    assert_valid(found, root, multi_label or found.task == "multilabel")


# Cases the fuzz found (or issue 35 reported), kept as plain tests.
@pytest.mark.parametrize(
    "manifest, multi_label, said",
    [
        # issue 35 #12: every label cell empty or ';' (argmax of an empty sequence)
        ("a.jpg,\nb.jpg,;\n", True, "no image has a label; a classifier needs at least two classes"),
        ("a.jpg,;\nb.jpg, ; \n", False, "no image has a label"),  # a ';' makes it multi-label by itself
        # a cell over csv's 128 KiB field limit (_csv.Error)
        (f"a.jpg,cat\nb.jpg,{'x' * 140_000}\n", False, "line 2: not a CSV row (field larger than field limit"),
        # a name with a newline in it (quoted in the CSV): the one-line error shows it quoted
        ('a.jpg,cat\n"b\n.jpg",dog\n', False, "file not found: '"),
    ],
)
def test_what_the_fuzz_found_is_one_user_error(root, manifest, multi_label, said):
    with open(os.path.join(root, "train.csv"), "w", encoding="utf-8", newline="") as f:
        f.write(manifest)
    with pytest.raises(UserError) as e:
        sources.discover(root, task=reader("multilabel" if multi_label else "auto"))
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)[:300]


@fuzz_settings(100)
@given(manifests())
def test_any_manifest_read_as_numbers_is_finite_targets_or_one_user_error(root, manifest):
    """``--task regress``: every target cell a finite number, one column a target, or one line."""
    with open(os.path.join(root, "train.csv"), "wb") as f:
        f.write(manifest)
    try:
        found = sources.discover(root, task=reader("regress"))
    except UserError as e:
        assert str(e) and "\n" not in str(e).strip()
        return
    n, t = len(found.paths), len(found.classes)
    assert found.task == "regress" and n > 0 and t >= 1 and found.targets.shape == (n, t)
    assert found.targets.dtype == np.float32 and np.isfinite(found.targets).all()
    for path in found.paths:
        assert os.path.isfile(path) and os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def test_a_regression_row_naming_a_file_with_a_newline_is_still_one_line(root):
    # Found by the fuzz target: the row's file name went into the message raw, newline and all.
    with open(os.path.join(root, "train.csv"), "w", encoding="utf-8", newline="") as f:
        f.write('filename,value\n"0\n0",cat\n')
    with pytest.raises(UserError) as e:
        sources.discover(root, task=reader("regress"))
    assert "not a finite number" in str(e.value) and "\n" not in str(e.value), str(e.value)


# The manifest's bounds (data/layouts.py: bytes, rows, characters a line), each one line naming the file and
# the bound. Before them, a line of millions of cells was read whole (the extra cells ignored), and a manifest
# of any size became Python rows.
def test_a_manifest_line_longer_than_any_file_name_and_labels_is_one_line(root):
    with open(os.path.join(root, "train.csv"), "w", encoding="utf-8", newline="") as f:
        f.write("a.jpg,cat\nb.jpg,dog" + "," * (2 << 20) + "\n")
    with pytest.raises(UserError) as e:
        sources.discover(root, task=reader("auto"))
    said = str(e.value)
    assert f"train.csv line 2: longer than {layouts.MAX_MANIFEST_LINE:,} characters" in said and "\n" not in said


@pytest.mark.parametrize(
    "bound,value,says",
    [
        ("MAX_MANIFEST_ROWS", 3, "more than the 3 rows of a manifest visiontune reads"),
        ("MAX_MANIFEST_BYTES", 40, "is 46 bytes, more than the 40 of a manifest visiontune reads"),
        ("MAX_MANIFEST_LINE", 8, "line 1: longer than 8 characters"),
    ],
)
def test_a_manifest_past_a_bound_is_one_line_naming_it(root, monkeypatch, bound, value, says):
    with open(os.path.join(root, "train.csv"), "w", encoding="utf-8", newline="") as f:
        f.write("a.jpg,cat\nb.jpg,dog\n\n\nsub/c.png,cat\n7.jpg,dog\n")  # 4 rows (blank lines are none), 46 bytes
    listed = past_and_under(monkeypatch, layouts, bound, value, lambda: sources.discover(root, task=reader("auto")),
                            "train.csv", says)  # fmt: skip
    assert len(listed.paths) == 4


@fuzz_settings(100)
@given(manifests(), st.booleans(), st.integers(1, 400), st.integers(1, 8), st.integers(1, 200))
def test_any_manifest_past_small_bounds_is_a_listing_or_one_user_error(root, manifest, multi, size, rows, line):
    """The bounds lowered so that the fuzz's manifests reach them: still a listing or one line."""
    with open(os.path.join(root, "train.csv"), "wb") as f:
        f.write(manifest)
    bounds = {"MAX_MANIFEST_BYTES": size, "MAX_MANIFEST_ROWS": rows, "MAX_MANIFEST_LINE": line}
    saved = {k: getattr(layouts, k) for k in bounds}
    try:
        for k, v in bounds.items():
            setattr(layouts, k, v)
        found = sources.discover(root, task=reader("multilabel" if multi else "auto"))
    except UserError as e:
        assert str(e) and "\n" not in str(e).strip()
        return
    finally:
        for k, v in saved.items():
            setattr(layouts, k, v)
    assert len(manifest) <= size and len(found.paths) <= rows
    assert_valid(found, root, multi or found.task == "multilabel")
