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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

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
    # Multi-label data (data/multilabel.py): uint8 [N, K] multi-hot, and ``labels`` each image's first class.
    targets: np.ndarray | None = None
    # Regression data (data/targets.py): float32 [N, T], one number per target; ``classes`` names the targets.
    values: np.ndarray | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", PathList.from_paths(self.paths, self.root))
        object.__setattr__(self, "labels", np.asarray(self.labels, np.int32).reshape(-1))
        if self.val_mask is not None:
            object.__setattr__(self, "val_mask", np.asarray(self.val_mask, bool).reshape(-1))
        if self.targets is not None:
            object.__setattr__(self, "targets", np.asarray(self.targets, np.uint8).reshape(len(self.labels), -1))
        if self.values is not None:
            object.__setattr__(self, "values", np.asarray(self.values, np.float32).reshape(len(self.labels), -1))

    @property
    def task(self) -> str:
        """What its labels are, as ``--task`` names it: classify, multilabel (multi-hot ``targets``) or regress
        (numeric ``values``)."""
        return "regress" if self.values is not None else "classify" if self.targets is None else "multilabel"

    @property
    def label_array(self) -> np.ndarray:
        """What a dataset hands out per image: the class index, the multi-hot row of a multi-label set, or the
        numbers of a regression set."""
        return self.values if self.values is not None else self.labels if self.targets is None else self.targets

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
            values=None if self.values is None else self.values[idx],
        )

    def __len__(self) -> int:
        return len(self.paths)

    def class_counts(self, idx=None) -> dict[str, int]:
        """Images of each class (of the images at ``idx``, or all); multi-label: images that have the class;
        regression: none (it has no classes)."""
        if self.values is not None:
            return {}
        if self.targets is not None:
            counts = (self.targets if idx is None else self.targets[idx]).sum(0, dtype=np.int64).tolist()
        else:
            labels = self.labels if idx is None else self.labels[idx]
            counts = np.bincount(labels, minlength=len(self.classes)).tolist()
        return {name: counts[i] for i, name in enumerate(self.classes)}

    def describe(self) -> str:
        """One line naming the classes found and how many images each has (regression: its targets' range)."""
        if self.values is not None:
            ranges = ", ".join(
                f"{name} {lo:g} to {hi:g}" for name, lo, hi in zip(self.classes, self.values.min(0), self.values.max(0))
            )
            return f"visiontune: {len(self.paths)} images, regression ({self.layout}): {ranges}"
        counts = ", ".join(f"{name} {n}" for name, n in self.class_counts().items())
        if self.targets is not None:
            none = int((self.targets.sum(1) == 0).sum())
            return (
                f"visiontune: {len(self.paths)} images, multi-label, {len(self.classes)} classes ({self.layout}): "
                f"{counts}; {none} with no label"
            )
        return f"visiontune: {len(self.paths)} images in {len(self.classes)} classes ({self.layout}): {counts}"
