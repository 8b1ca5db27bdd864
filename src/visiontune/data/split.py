"""The train/val split: seeded, identical in every process and rerun, hashed.

The permutation comes from a private ``torch.Generator`` so that it neither
reads nor advances the global RNG; the same seed and file list give the same
split on any machine. ``split.json`` stores the file lists (relative to the
data root) with a sha256 of them, which resume compares against.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from visiontune.config import UserError


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
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Split(sorted(perm[:n_train]), sorted(perm[n_train:]))


def split_record(split: Split, paths: list[str], root: str, seed: int, val_fraction: float) -> dict:
    """The content of ``split.json``: relative file lists and their sha256."""
    lists = {name: [os.path.relpath(paths[i], root) for i in idx]
             for name, idx in (("train", split.train), ("val", split.val))}
    digest = hashlib.sha256(json.dumps(lists, sort_keys=True).encode()).hexdigest()
    return {"seed": seed, "val_fraction": val_fraction, "sha256": digest,
            "counts": {k: len(v) for k, v in lists.items()}, **lists}
