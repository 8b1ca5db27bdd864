"""The train/val split: seeded, identical in every process and rerun, hashed.

By default (``--split-method stratified``) each class is held out at
``--val-fraction`` (``make_stratified_split``): a balanced folder of 20 images a
class gives each class 4 validation images, where a shuffle of all the images
gave some classes none and others 8. ``--split-method random`` is that shuffle
(``make_split``), the split of every run before the stratified one, kept so that
such runs reproduce. How the stratified split strata are drawn is the task's to
say (``Task.split``: by class with ``make_stratified_split``, by label sets with
``make_multilabel_split``, by quantile bins of a target...), handed down as the
listing's reader. ``"method"`` in ``split.json`` says which; a record without one
is a shuffle's (``method_of``).

The permutations come from a private ``torch.Generator`` so that they neither
read nor advance the global RNG; the same seed and file list give the same
split on any machine. ``split.json`` is the complete record of the split at any
size: the file lists (relative to the data root) with a sha256 of them, which
resume compares against, on one compact JSON line. Both the hash and the file
are produced a chunk of paths at a time, so a 1.28M-file split never exists as
one big string in memory, and its indices are two int64 arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from visiontune.data import multilabel
from visiontune.data.pathlist import PathList, root_prefixes
from visiontune.errors import UserError

_CHUNK = 16384  # paths turned into JSON at a time


@dataclass(frozen=True, eq=False)
class Split:
    train: np.ndarray  # int64 indices into the ImageSet, ascending
    val: np.ndarray
    method: str = ""  # how the split was made (recorded in split.json); "": the data's own, or grouped

    def __eq__(self, other) -> bool:
        if not isinstance(other, Split):
            return NotImplemented
        return np.array_equal(self.train, other.train) and np.array_equal(self.val, other.val)


RANDOM = "random: a seeded shuffle of all the images (data/split.py)"
STRATIFIED = "stratified by class: each class held out at --val-fraction in a seeded order (data/split.py)"
ITERATIVE = "iterative stratification (Sechidis et al. 2011), data/multilabel.py"


def method_of(record: dict) -> str:
    """The ``--split-method`` that made a ``split.json`` record: a record without a method is a shuffle's
    (every single-label run before the stratified split); multi-label runs recorded theirs."""
    return "random" if record.get("method", RANDOM) == RANDOM else "stratified"


def _sizes(n: int, val_fraction: float) -> int:
    """The train size of a split of ``n`` (``int(n * (1 - val_fraction))``); one line when a side is empty."""
    n_train = int(n * (1.0 - val_fraction))
    if n_train < 1 or n_train >= n:
        raise UserError(
            f"a {1 - val_fraction:.0%}/{val_fraction:.0%} split of {n} images leaves an empty "
            "train or val set; add images or change --val-fraction"
        )
    return n_train


def make_split(n: int, val_fraction: float, seed: int) -> Split:
    """Shuffle ``range(n)`` with ``seed``; the first ``int(n * (1 - val_fraction))`` train."""
    n_train = _sizes(n, val_fraction)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return Split(perm[:n_train].sort().values.numpy(), perm[n_train:].sort().values.numpy(), RANDOM)


def val_counts(counts: np.ndarray, n_val: int, order: np.ndarray) -> np.ndarray:
    """How many images of each class (``counts`` of them) go to validation, ``n_val`` in all: each class's
    share ``counts * n_val / n`` rounded down, then one more to the classes furthest below their share
    (ties in the seeded class ``order``) until ``n_val`` are taken. A class keeps one training image while
    any other class can give one instead (a class wholly in validation cannot be learnt)."""
    counts = np.asarray(counts, np.int64)
    n = int(counts.sum())
    take = np.minimum(counts * n_val // n, np.maximum(counts - 1, 0))  # integers: no rounding drift
    rank = np.empty(len(counts), np.int64)
    rank[order] = np.arange(len(counts))
    for cap in (np.maximum(counts - 1, 0), counts):  # the second only when every class is down to one
        while take.sum() < n_val:
            room = np.flatnonzero(take < cap)
            if not len(room):
                break
            below = counts[room] * n_val - take[room] * n  # n times the shortfall
            first = room[np.lexsort((rank[room], -below))][: n_val - int(take.sum())]
            take[first] += 1
    return take


def make_stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> Split:
    """The images of each class in a seeded order, its first ``val_counts`` to validation: the sizes of
    ``make_split``, each class's share of validation as near ``val_fraction`` as whole images allow."""
    labels = np.asarray(labels, np.int64)
    n = len(labels)
    n_train = _sizes(n, val_fraction)
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=generator).numpy()
    ranked = perm[np.argsort(labels[perm], kind="stable")]  # class by class, a seeded order within each
    counts = np.bincount(labels)
    take = val_counts(counts, n - n_train, torch.randperm(len(counts), generator=generator).numpy())
    within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # each ranked image's place in its class
    held = within < np.repeat(take, counts)
    return Split(np.sort(ranked[~held]), np.sort(ranked[held]), STRATIFIED)


def make_multilabel_split(targets: np.ndarray, val_fraction: float, seed: int) -> Split:
    """Iterative stratification of a multi-hot ``targets`` (``multilabel.iterative_split``), checked as
    ``make_split`` checks its sizes."""
    n = len(targets)
    n_train = _sizes(n, val_fraction)
    train, val = multilabel.iterative_split(targets, n - n_train, seed)
    if not len(train) or not len(val):
        raise UserError(
            f"the stratified {1 - val_fraction:.0%}/{val_fraction:.0%} split of {n} images leaves an empty "
            "train or val set; add images or change --val-fraction"
        )
    return Split(train.astype(np.int64), val.astype(np.int64), ITERATIVE)


def split_of(images, val_fraction: float, seed: int, method: str = "stratified") -> Split:
    """The data's own train/validation split when it brings one (an ``ImageSet``'s ``val_mask``), else by
    ``method``: stratified as the reader of its labels says (``LabelReader.split``; class indices alone:
    ``make_stratified_split``) or the shuffle ``make_split`` (``random``)."""
    if images.val_mask is None and method == "random":
        return make_split(len(images), val_fraction, seed)
    if images.val_mask is None and images.reading is not None:
        return images.reading.split(images, val_fraction, seed)
    if images.val_mask is None:
        return make_stratified_split(images.labels, val_fraction, seed)
    split = Split(np.flatnonzero(~images.val_mask), np.flatnonzero(images.val_mask))
    if not len(split.train) or not len(split.val):
        raise UserError(f"{images.root}: {images.split_note} leave an empty train or val set")
    return split


def relative_paths(paths: Sequence[str], idx: list[int], root: str) -> list[str]:
    """The paths at ``idx`` relative to ``root``, as ``os.path.relpath`` gives them."""
    # Slicing a known prefix off costs a fraction of os.path.relpath per path (seconds at ImageNet size).
    # Layouts list files under the root as given, or under its resolved form (manifests); a PathList
    # already holds them without that prefix.
    prefixes = root_prefixes(root)
    if isinstance(paths, PathList) and paths.prefix in prefixes:
        return paths.rels(idx)
    chosen = [paths[i] for i in idx]
    for prefix in prefixes:
        if all(p.startswith(prefix) for p in chosen):
            return [p[len(prefix) :] for p in chosen]
    return [os.path.relpath(p, root) for p in chosen]


def _json_list(idx: Sequence[int], paths: Sequence[str], root: str, sep: str) -> Iterator[str]:
    """The JSON text of the relative paths of ``idx``, in pieces; ``sep`` is json's item separator."""
    yield "["
    for start in range(0, len(idx), _CHUNK):
        chunk = np.asarray(idx[start : start + _CHUNK], np.int64).tolist()
        yield (sep if start else "") + json.dumps(relative_paths(paths, chunk, root), separators=(sep, ":"))[1:-1]
    yield "]"


def _hash_pieces(split: Split, paths: Sequence[str], root: str) -> Iterator[str]:
    # Exactly json.dumps({"train": [...], "val": [...]}, sort_keys=True): the hash every release wrote.
    yield '{"train": '
    yield from _json_list(split.train, paths, root, ", ")
    yield ', "val": '
    yield from _json_list(split.val, paths, root, ", ")
    yield "}"


def split_summary(
    split: Split, paths: Sequence[str], root: str, seed: int, val_fraction: float, note: str = ""
) -> dict:
    """``split.json`` less its lists: seed, fraction, sha256 of the lists, counts (and ``from``: the data's own
    split, when it brought one)."""
    h = hashlib.sha256()
    for piece in _hash_pieces(split, paths, root):
        h.update(piece.encode("utf-8", "surrogateescape"))
    return {
        "seed": seed,
        "val_fraction": val_fraction,
        "sha256": h.hexdigest(),
        "counts": {"train": len(split.train), "val": len(split.val)},
        **({"from": note} if note else {}),
        **({"method": split.method} if split.method else {}),
    }


def split_hash(train: list[str], val: list[str]) -> str:
    """sha256 of two relative file lists, as ``split_summary`` computes it."""
    return hashlib.sha256(
        json.dumps({"train": train, "val": val}, sort_keys=True).encode("utf-8", "surrogateescape")
    ).hexdigest()


def split_record(split: Split, paths: Sequence[str], root: str, seed: int, val_fraction: float) -> dict:
    """The whole content of ``split.json``, in memory (small splits, tests)."""
    lists = {
        name: relative_paths(paths, np.asarray(idx, np.int64).tolist(), root)
        for name, idx in (("train", split.train), ("val", split.val))
    }
    return {**split_summary(split, paths, root, seed, val_fraction), **lists}


def write_split(path: str, summary: dict, split: Split, paths: Sequence[str], root: str) -> None:
    """``split.json``: ``summary`` and the two lists on one compact line, streamed to a temp file, then renamed."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(json.dumps(summary, separators=(",", ":"))[:-1] + ',"train":')
            f.writelines(_json_list(split.train, paths, root, ","))
            f.write(',"val":')
            f.writelines(_json_list(split.val, paths, root, ","))
            f.write("}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
