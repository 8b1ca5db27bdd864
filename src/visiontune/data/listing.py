"""The job's one listing of its data, handed from the launching command to its workers.

``visiontune train`` lists the data folder once, in the command itself; when it starts
workers it leaves the listing in a temp file named by an environment variable
(``shared_listing``), and each worker reads it back (``listed``) instead of listing the
folder again. Apart from ``jobdata`` (the screen and the split), so that the launching
process imports neither the decoders nor torchvision.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from visiontune.data import sources
from visiontune.data.imageset import ImageSet, LabelReader
from visiontune.data.pathlist import PathList
from visiontune.files import atomic_file

LISTING_ENV = "VISIONTUNE_IMAGE_LIST"  # {"data": abs path, "file": listing} set by the launching command


def save_listing(images: ImageSet, path: str, extra: dict | None = None) -> None:
    """Write ``images`` (and a small JSON-able ``extra``) compactly: a JSON header line, then the
    paths' bytes, their int64 end offsets, the int32 labels, when the data has its own split one
    byte per image for it, and the rows its label reader keeps (``targets``: their dtype and shape in the
    header). A reader travels as its ``spec()``, reopened on loading, and the label reader by name."""
    paths = images.paths.compact()
    head = {
        "root": images.root,
        "layout": images.layout,
        "classes": images.classes,
        "count": len(paths),
        "prefix": paths.prefix,
        "paths_bytes": len(paths.blob),
        "test_files": images.test_files,
        "rejects": images.rejects,
        "extra": extra or {},
        "reader": None if images.reader is None else images.reader.spec(),
        "val_mask": images.val_mask is not None,
        "split_note": images.split_note,
        "reading": None if images.reading is None else images.reading.name,
        "targets": None if images.targets is None else [images.targets.dtype.str, list(images.targets.shape[1:])],
    }
    arrays = [paths.blob, paths.ends.astype("<i8"), images.labels.astype("<i4")]
    if images.val_mask is not None:
        arrays.append(images.val_mask.astype(np.uint8))
    if images.targets is not None:
        arrays.append(images.targets)
    with atomic_file(path) as f:
        f.write(json.dumps(head).encode() + b"\n")
        for array in arrays:
            f.write(memoryview(np.ascontiguousarray(array)).cast("B"))


def load_listing(path: str, task: LabelReader) -> tuple[ImageSet, dict]:
    """The ``ImageSet`` and ``extra`` that ``save_listing`` wrote; ``task``: the reader the job's listing was
    read with (``auto`` finds the task it came to by the name written)."""
    with open(path, "rb") as f:
        head = json.loads(f.readline())
        raw = f.read()
    n, size, has_mask = head["count"], head["paths_bytes"], head.get("val_mask", False)
    dtype, shape = head["targets"] if head.get("targets") else (None, [])
    row_bytes = np.dtype(dtype).itemsize * int(np.prod(shape)) if dtype else 0
    end = size + (13 if has_mask else 12) * n
    if len(raw) != end + row_bytes * n:
        raise ValueError(f"{path}: truncated image list")
    blob = np.frombuffer(raw, np.uint8, size)
    ends = np.frombuffer(raw, "<i8", n, size).astype(np.int64, copy=False)
    labels = np.frombuffer(raw, "<i4", n, size + 8 * n).astype(np.int32, copy=False)
    mask = np.frombuffer(raw, np.uint8, n, size + 12 * n).astype(bool) if has_mask else None
    targets = np.frombuffer(raw, dtype, n * int(np.prod(shape)), end).reshape(n, *shape).copy() if dtype else None
    return ImageSet(
        head["root"],
        head["layout"],
        PathList(head["prefix"], blob, ends),
        labels,
        head["classes"],
        head["test_files"],
        [tuple(r) for r in head["rejects"]],
        reader=sources.reopen(head.get("reader")),
        val_mask=mask,
        split_note=head.get("split_note", ""),
        targets=targets,
        reading=None if head.get("reading") is None else task.read_as(head["reading"]),
    ), head["extra"]


def _data_key(data: str) -> str:
    return os.path.abspath(os.path.expanduser(data))


@contextmanager
def shared_listing(images: ImageSet, data: str) -> Iterator[None]:
    """While the body runs (the launcher and its workers), ``listed(data)`` reads ``images`` from a file."""
    with tempfile.TemporaryDirectory(prefix="visiontune-") as folder:
        path = os.path.join(folder, "images.bin")
        save_listing(images, path)
        before = os.environ.get(LISTING_ENV)
        os.environ[LISTING_ENV] = json.dumps({"data": _data_key(data), "file": path})
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(LISTING_ENV, None)
            else:
                os.environ[LISTING_ENV] = before


def listed(data: str, image_column: str | None, label_column: str | None, task: LabelReader) -> ImageSet:
    """The listing the launching command shared, else ``discover(data, image_column, label_column, ...)``."""
    try:
        spec = json.loads(os.environ.get(LISTING_ENV) or "null")
        if spec and spec["data"] == _data_key(data):
            return load_listing(spec["file"], task)[0]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # gone or damaged: list again
    return sources.discover(data, image_column, label_column, task=task)
