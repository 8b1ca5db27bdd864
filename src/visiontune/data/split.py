"""The train/val split: seeded, identical in every process and rerun, hashed.

The permutation comes from a private ``torch.Generator`` so that it neither
reads nor advances the global RNG; the same seed and file list give the same
split on any machine. ``split.json`` is the complete record of the split at any
size: the file lists (relative to the data root) with a sha256 of them, which
resume compares against, written without indentation (at 1.28M files the
indented form was a third larger and slower to write and read).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from visiontune.config import UserError
from visiontune.outputs import atomic_write


@dataclass(frozen=True)
class Split:
    train: list[int]  # indices into the ImageSet
    val: list[int]


def make_split(n: int, val_fraction: float, seed: int) -> Split:
    """Shuffle ``range(n)`` with ``seed``; the first ``int(n * (1 - val_fraction))`` train."""
    n_train = int(n * (1.0 - val_fraction))
    if n_train < 1 or n_train >= n:
        raise UserError(f"a {1 - val_fraction:.0%}/{val_fraction:.0%} split of {n} images leaves an empty "
                        "train or val set; add images or change --val-fraction")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return Split(perm[:n_train].sort().values.tolist(), perm[n_train:].sort().values.tolist())


def _relative(paths: list[str], root: str) -> list[str]:
    """``paths`` relative to ``root``, as ``os.path.relpath`` gives them."""
    # Slicing a known prefix off costs a fraction of os.path.relpath per path (seconds at ImageNet size).
    # Layouts list files under the root as given, or under its resolved form (manifests).
    for prefix in dict.fromkeys(os.path.join(r, "") for r in (root, os.path.realpath(root)) if r != "."):
        if all(p.startswith(prefix) for p in paths):
            return [p[len(prefix):] for p in paths]
    return [os.path.relpath(p, root) for p in paths]


def split_hash(train: list[str], val: list[str]) -> str:
    """sha256 of the two relative file lists; the definition resume compares, unchanged since the first release."""
    return hashlib.sha256(json.dumps({"train": train, "val": val}, sort_keys=True).encode()).hexdigest()


def split_record(split: Split, paths: list[str], root: str, seed: int, val_fraction: float) -> dict:
    """The content of ``split.json``: relative file lists and their sha256."""
    lists = {name: _relative([paths[i] for i in idx], root) for name, idx in (("train", split.train),
                                                                              ("val", split.val))}
    return {"seed": seed, "val_fraction": val_fraction, "sha256": split_hash(lists["train"], lists["val"]),
            "counts": {k: len(v) for k, v in lists.items()}, **lists}


def write_record(path: str, record: dict) -> None:
    """``split.json``, compact and atomic."""
    atomic_write(path, json.dumps(record, separators=(",", ":")) + "\n")


def read_record(path: str) -> dict:
    """``split.json`` back, its hash checked against its lists."""
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    if split_hash(record["train"], record["val"]) != record["sha256"]:
        raise UserError(f"{path}: its file lists do not match its sha256; the file was edited or damaged")
    return record
