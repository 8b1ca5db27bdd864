"""``--exclude CSV`` and ``--relabel CSV``: files dropped from the data, and new labels for files kept.

The CSV is any with a ``file`` column (``visiontune audit``'s ``audit.csv``, or one a user wrote), each
file named as ``split.json`` names it (relative to the data's root) or by its full path. ``--relabel``
takes the ``suggested`` column of the rows that have one: a class name, for a multi-label set the
classes joined by ``;``, for a regression set its numbers joined by ``;``. The CSV comes from
elsewhere, so it has one reader (``read``) with bounds: its size, its rows, each cell's length, UTF-8
text, the columns it must have; a file that is not in the data, or a label that is not a class, is one
line naming the row. What was done is recorded (``split.json``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import os

import numpy as np

from visiontune.data.imageset import ImageSet
from visiontune.data.split import relative_paths
from visiontune.errors import UserError
from visiontune.text import byte_size, printable

MAX_BYTES = 64 << 20  # an audit of millions of images fits; a runaway file does not
MAX_CELL = 4096  # a path or a label set longer than this is not one
MAX_ROWS = 10_000_000


def read(path: str, flag: str, column: str | None = None) -> tuple[list[tuple[int, str, str]], str]:
    """(row number, file, ``column``'s cell) of every row, and the file's SHA-256; one line when it is not a
    readable CSV with a ``file`` column (and ``column``)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_BYTES:
        raise UserError(f"{flag} {path}: larger than {byte_size(MAX_BYTES)}; give a CSV of file names")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 text (byte {e.start}); give a CSV of file names") from None
    rows = []
    try:
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)  # an open quote is an error, not a cell
        header = next(reader, None)
        wanted = ["file", *([column] if column else [])]
        if header is None or any(w not in header for w in wanted):
            raise UserError(f"{flag} {path}: needs a header with {' and '.join(wanted)} columns")
        at = [header.index(w) for w in wanted]
        for number, row in enumerate(reader, 2):
            if len(rows) >= MAX_ROWS:
                raise UserError(f"{flag} {path}: more than {MAX_ROWS} rows")
            if not row:
                continue
            cells = [row[i] if i < len(row) else "" for i in at]
            if any(len(c) > MAX_CELL for c in cells) or "\x00" in "".join(cells):
                raise UserError(f"{flag} {path}: row {number} has a cell longer than {MAX_CELL} or a NUL byte")
            rows.append((number, _unquoted(cells[0]), _unquoted(cells[1]) if column else ""))
    except csv.Error as e:
        raise UserError(f"{flag} {path}: not a CSV ({e})") from None
    return rows, hashlib.sha256(data).hexdigest()


FORMULA = ("=", "+", "-", "@", "\t", "\r")


def _unquoted(cell: str) -> str:
    """A cell as audit.csv's writer had it: a leading ``'`` that kept a name a spreadsheet would run as a
    formula as text is taken off (``audit.pages``), so the CSV comes back to the names it was written from."""
    return cell[1:] if cell[:1] == "'" and cell[1:2] in FORMULA else cell


def _index(images: ImageSet, rows, flag: str, path: str) -> dict[int, str]:
    """Each row's image index -> its cell; a file that is not in the data is one line."""
    rel = relative_paths(images.paths, range(len(images)), images.root)
    where = {name: i for i, name in enumerate(rel)}
    found: dict[int, str] = {}
    for number, file, cell in rows:
        i = where.get(file)
        if i is None and os.path.isabs(file):
            i = where.get(os.path.relpath(file, images.root))
        if i is None:
            raise UserError(
                f"{flag} {path}: row {number} names '{printable(file)[:200]}', which is not in {images.root}"
            )
        found[i] = cell
    return found


def edit(images: ImageSet, exclude: str | None, relabel: str | None) -> tuple[ImageSet, dict | None]:
    """``images`` less the ``exclude`` CSV's files, with the ``relabel`` CSV's suggested labels, and what
    ``split.json`` records of it (None when neither is given)."""
    if not exclude and not relabel:
        return images, None
    record: dict = {}
    if relabel:
        rows, digest = read(relabel, "--relabel", "suggested")
        cells = {i: c for i, c in _index(images, rows, "--relabel", relabel).items() if c}
        images = images.reading.relabelled(images, cells, f"--relabel {relabel}")  # the task reads the cells
        record["relabel"] = {"file": relabel, "sha256": digest, "images": len(cells)}
    if exclude:
        rows, digest = read(exclude, "--exclude")
        drop = _index(images, rows, "--exclude", exclude)
        keep = np.setdiff1d(np.arange(len(images)), np.fromiter(drop, np.int64, len(drop)))
        images = images.take(keep)
        record["exclude"] = {"file": exclude, "sha256": digest, "images": len(drop)}
    return images, record
