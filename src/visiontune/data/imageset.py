"""What every data source is and lists into: a ``Source``, an ``ImageSet`` and its ``Reader``.

A ``Source`` is one kind of data ``--data`` may name (the folder layouts, ``hf:`` data
sets, tar shards, shards at a URL): how it is recognised from the ``--data`` string,
read into an ``ImageSet``, its reader reopened in another process, and described (in
``--help``, the run records, the model card). Each source module declares one;
``data/sources.py`` holds them in the order they are tried and is what the rest of
visiontune asks (timm's ``create_reader`` is the model).

An ``ImageSet`` holds a data source's labelled images: absolute paths (or, with a
``reader``, the samples' stable names) with class indices, class names in index order,
the unlabelled test files and the files the source itself had to reject. The folder
layouts (``data/layouts.py``), ``hf:`` data sets (``data/hfdata.py``) and tar shards
(``data/shards.py``) all produce one, so the split, sampler, sharding, resume, the
bad-file screen and the cache treat every source alike. Data kept in a container (``hf:``
rows, shard members) has a ``Reader``: ``paths`` are then the samples' stable names and
``reader[i]`` sample i's encoded bytes, read at random by index. This module imports no
other of ``data/`` but ``pathlist``: every source can import it.

A source does not read its labels: it lists each image's raw label cells (``Cells``: a manifest row's cells
after the file name, an ``hf:`` column's value, a class folder's index) and hands them to the
``LabelReader`` it was given, which parses and validates them (one line naming the file and row) and later
says how to split them. The tasks (``visiontune.tasks``, a wing above this one) are the readers: a task with
a new kind of label needs no reader here. The reader that read a listing goes with it (``ImageSet.reading``),
by name where the listing is written to a file (``data/listing.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from visiontune.data.pathlist import PathList

# The suffixes of image files (predict lists a folder by them, shards name a sample's image by them).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})


class Reader(Protocol):
    """Sample i's encoded bytes, for data kept in a container; picklable (a loader worker gets a copy)."""

    fingerprint: str  # the content's identity, for the scan and image caches

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> bytes: ...

    def take(self, idx) -> Reader:
        """The samples at ``idx`` (an int array), in that order."""
        ...

    def spec(self) -> dict:
        """JSON that reopens this reader in another process: ``{"kind": <its Source's name>, ...}``."""
        ...


@dataclass(frozen=True)
class Cells:
    """A source's label cells, before a ``LabelReader`` reads them: one entry per listed image."""

    # Image i's cells: with ``per_row`` a manifest row's text cells after the file name (a list of str), else
    # one value: an hf: column's, or with ``names`` a class index into them (-1: none) or a list of them
    # (an int array when every image has one index). None: the data has no label column.
    rows: Any
    count: int  # how many images
    where: Callable[[int], str]  # image i's place in words, for a one-line error: "DATA/train.csv row 4"
    origin: str  # the data in words, for an error about all of it: "DATA/train.csv", "DATA (imagefolder layout)"
    per_row: bool = False
    line: Callable[[int], str] = lambda i: ""  # image i's row as written (file name and cells), for an error
    header: list[str] | None = None  # the label columns' names, when the source has them
    names: list[str] | None = None  # the class names the cells index, when the source holds classes as indices
    optional: bool = False  # an image may have no label (predict lists a data set's unlabelled rows)
    column: str | None = None  # the label column's name (hf:), for the errors
    files: list[str] | None = None  # each image's file name as the source gives it (a manifest's), for the errors


@dataclass(frozen=True)
class Labelled:
    """What a ``LabelReader`` reads a source's cells as."""

    reader: LabelReader  # the one that read them (``auto``: the task the cells say they are)
    labels: np.ndarray  # int32 per image: its class index (a task without classes: its first class, or 0)
    classes: list[str]  # the class names in index order (a regression's: its targets' names)
    targets: np.ndarray | None = None  # [N, ...] the reader's own rows per image (multi-hot, numbers), or None


class LabelReader(Protocol):
    """What a source hands its label cells to (a task, or ``auto``): parsing, validation and the split."""

    name: str  # what a listing file records it by
    min_classes: int  # the classes (a regression: targets) its data needs at least

    def names_columns(self, row: list[str]) -> bool:
        """Whether a manifest's first row (all its cells) is a header naming its columns."""
        ...

    def parse(self, cells: Cells) -> Labelled:
        """The cells read; one line (``UserError``) naming the file and row of the first that is wrong."""
        ...

    def read_as(self, name: str) -> LabelReader:
        """The reader a listing file names (``auto``: the task it came to)."""
        ...

    def split(self, images: ImageSet, val_fraction: float, seed: int):
        """The stratified train/val ``Split`` (``data/split.py``) of its images: by class, label sets, bins..."""
        ...

    def describe(self, images: ImageSet) -> str:
        """One line naming the labels found (classes and their counts, a target's range)."""
        ...

    def class_counts(self, images: ImageSet, idx) -> dict[str, int]:
        """Images of each class among ``images`` at ``idx`` (None: all); {} for labels without classes."""
        ...

    def relabelled(self, images: ImageSet, cells: dict[int, str], where: str) -> ImageSet:
        """``images`` with image i given the label of its cell ``cells[i]`` (``--relabel``: audit's suggestions,
        written as predict writes labels); one line naming ``where`` and the file of a cell it cannot read."""
        ...


@dataclass(frozen=True)
class Source:
    """One kind of data: how it is recognised, read, reopened in a worker and described."""

    name: str  # a reader's spec()["kind"] names its source by this
    recognises: Callable[[str], bool]  # from the --data string (and, for paths, what is there)
    # read(data, image_column, label_column, every_split=, task=): the labelled images, unchecked (``task``:
    # --task, the labels' kind the reader is asked for, or auto)
    read: Callable[..., ImageSet]
    reopen: Callable[[dict], Reader] | None = None  # a reader from its spec(), in this process
    help: str = ""  # how `train --help` names it ("" : told with another source)
    short: str = ""  # how `check --help` and `shard --help` name it
    named: bool = False  # --data is a name (hf:, a URL), not a path: recorded as given, never made absolute
    container: bool = False  # samples come through a reader: predict lists them as train does
    lists_unlabelled: bool = False  # every_split lists rows with no label too (predict on a test split)
    exists: Callable[[str], bool] = lambda data: True  # whether what ``data`` names is still there
    fetch: Callable[[str], object] | None = None  # a copy made before listing, once per machine
    # The local copy of a plain folder of images ``data`` names, or None: predict lists its images, unlabelled,
    # as a local folder's, named below ``data`` (a store's folder, which train reads in a labelled layout).
    folder_copy: Callable[[str], str | None] | None = None
    hub_id: Callable[[str], str] | None = None  # the data set's id on the Hugging Face Hub


@dataclass(frozen=True)
class ImageSet:
    root: str
    layout: str
    paths: PathList  # given as any sequence of str: stored as a PathList
    labels: np.ndarray  # int32, one per path (given as any sequence of int)
    classes: list[str]
    test_files: list[str] = field(default_factory=list)
    rejects: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    # With a reader, ``paths`` are names and ``reader[i]`` is sample i's encoded bytes.
    reader: Reader | None = None
    val_mask: np.ndarray | None = None  # bool per image: in the data's own validation split (None: ours)
    split_note: str = ""  # where the split comes from when the data brings one, for the start line and split.json
    # The rows its reader keeps per image beyond a class index ([N, ...]: a multi-label set's uint8 multi-hot
    # rows, a regression's float32 numbers); None: ``labels`` are all there is.
    targets: np.ndarray | None = None
    reading: LabelReader | None = None  # what read its label cells (None: class indices, read as classes)

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", PathList.from_paths(self.paths, self.root))
        object.__setattr__(self, "labels", np.asarray(self.labels, np.int32).reshape(-1))
        if self.val_mask is not None:
            object.__setattr__(self, "val_mask", np.asarray(self.val_mask, bool).reshape(-1))
        if self.targets is not None:
            targets = np.asarray(self.targets)
            object.__setattr__(self, "targets", targets.reshape(len(self.labels), *(targets.shape[1:] or (1,))))

    @classmethod
    def of(cls, root: str, layout: str, paths, labelled: Labelled, **more) -> ImageSet:
        """The images at ``paths`` with the labels a reader read (``Labelled``)."""
        return cls(root, layout, paths, **_labelled(labelled), **more)

    @property
    def task(self) -> str:
        """The name of what read its labels (``--task``'s): classify when nothing but class indices did."""
        return "classify" if self.reading is None else self.reading.name

    @property
    def label_array(self) -> np.ndarray:
        """What a dataset hands out per image: its reader's row (multi-hot, numbers), else the class index."""
        return self.labels if self.targets is None else self.targets

    def source(self, i: int) -> str | bytes:
        """What ``decode.try_read`` reads for image i: its path, or its bytes from the reader."""
        return self.paths[i] if self.reader is None else self.reader[i]

    def take(self, idx) -> ImageSet:
        """The images at ``idx`` (an int array), in that order: views, no file names or bytes copied."""
        idx = np.asarray(idx, np.int64)
        return replace(
            self,
            paths=self.paths.take(idx),
            labels=self.labels[idx],
            reader=None if self.reader is None else self.reader.take(idx),
            val_mask=None if self.val_mask is None else self.val_mask[idx],
            targets=None if self.targets is None else self.targets[idx],
        )

    def __len__(self) -> int:
        return len(self.paths)

    def class_counts(self, idx=None) -> dict[str, int]:
        """Images of each class (of the images at ``idx``, or all), as its reader counts them (class indices:
        their counts; a multi-label set: the images that have the class; a regression: none)."""
        if self.reading is not None:
            return self.reading.class_counts(self, idx)
        labels = self.labels if idx is None else self.labels[idx]
        counts = np.bincount(labels, minlength=len(self.classes)).tolist()
        return {name: counts[i] for i, name in enumerate(self.classes)}

    def describe(self) -> str:
        """One line naming the labels found, as its reader words them (class indices: each class's count)."""
        if self.reading is not None:
            return self.reading.describe(self)
        counts = ", ".join(f"{name} {n}" for name, n in self.class_counts().items())
        return f"visiontune: {len(self.paths)} images in {len(self.classes)} classes ({self.layout}): {counts}"


def read_classes(found: ImageSet, reading: LabelReader, origin: str) -> ImageSet:
    """``found``'s class indices (a layout of class folders, tar shards) read by ``reading``: a task whose labels
    are not classes refuses them in one line. ``origin``: what holds them, in words ("DATA: tar shards")."""
    cells = Cells(found.labels, len(found.labels), lambda i: found.paths[i], origin, names=found.classes)
    return replace(found, **_labelled(reading.parse(cells)))


def _labelled(labelled: Labelled) -> dict:
    return {
        "labels": labelled.labels,
        "classes": labelled.classes,
        "targets": labelled.targets,
        "reading": labelled.reader,
    }


def refuse_unless_classes(reading: LabelReader, origin: str) -> None:
    """One line before anything is read, when ``reading`` cannot read a class an image (``read_classes``)."""
    reading.parse(Cells(np.zeros(0, np.int64), 0, str, origin, names=[]))
