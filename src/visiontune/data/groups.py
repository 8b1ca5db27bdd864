"""Grouped and k-fold splits: every group of images (one patient, one video, one product) on one side.

A random split per image puts a group's near-duplicates on both sides, and validation then measures
recall of the group rather than generalisation. ``--group-by`` names each image's group, by a regex
over its path relative to the data root (the first capturing group, or the whole match) or by a
column of the manifest CSV or the ``hf:`` data set; ``--folds K --fold I`` makes fold I of a K-fold
cross-validation on the same rules.

The assignment is a seeded greedy in the manner of scikit-learn's ``StratifiedGroupKFold``: the groups
are taken largest first (ties in a seeded random order) and each goes to the side (or fold) where the
per-class shares come nearest their targets. It reads nothing but the labels, the group names and the
seed, so every process of a job and every resume computes the same split. Without groups, a fold split
deals each class's images, in a seeded order, round the folds: a stratified k-fold.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import re2
import torch

from visiontune.data.imageset import ImageSet
from visiontune.data.layouts import read_rows
from visiontune.data.split import Split, relative_paths, split_of, split_summary
from visiontune.errors import UserError

_REGEX_HINT = "pass a regex whose first group names the group, such as '^([^/]+)/' or '(patient\\d+)_'"


def _column(images: ImageSet, data: str, column: str) -> list[str] | None:
    """Each image's value in the manifest's or hf: data set's column ``column``; None when there is none."""
    if images.layout == "hf" and images.reader is not None:
        parts = images.reader.parts
        if column not in parts[0].features:
            return None
        values = [list(part[column]) for part in parts]  # one column read per split, not per row
        return [str(values[int(p)][int(r)]) for p, r in zip(images.reader.part, images.reader.row)]
    if images.layout != "manifest":
        return None
    root = Path(data).expanduser()
    # The manifest: DATA itself, DATA/train.csv, or (DATA being the images' folder DATA/train) the one above.
    found = [
        p for p in (root, root / "train.csv", root.parent / "train.csv") if p.suffix.lower() == ".csv" and p.is_file()
    ]
    if not found:
        return None
    rows = [row for _, row in read_rows(found[0])]  # the manifest's one reader, bounded
    header = [c.strip() for c in rows[0]] if rows else []
    if column not in header:
        return None
    at = header.index(column)
    by_name = {os.path.normpath(row[0].strip()): row[at].strip() if at < len(row) else "" for row in rows[1:]}
    names = relative_paths(images.paths, range(len(images)), images.root)
    return [by_name.get(os.path.normpath(n), "") for n in names]


def group_names(images: ImageSet, group_by: str, data: str = "") -> list[str]:
    """Each image's group: the column ``group_by`` of a manifest or hf: data set, else the regex's match."""
    values = _column(images, data or images.root, group_by)
    if values is not None:
        empty = [i for i, v in enumerate(values) if not v]
        if empty:
            raise UserError(
                f"--group-by {group_by}: {len(empty)} rows have an empty {group_by!r}, the first "
                f"{images.paths[empty[0]]}; give every row a group"
            )
        return values
    pattern = _compile(group_by, data or images.root)
    names = []
    for rel in relative_paths(images.paths, range(len(images)), images.root):
        m = pattern.search(_text(rel.replace(os.sep, "/")))
        name = (m.group(1) if pattern.groups else m.group(0)) if m else None
        if m is None:
            raise UserError(f"--group-by {group_by} does not match {rel}; {_REGEX_HINT}")
        if not name:  # it matched: the fix is a group that cannot be empty, not another pattern
            what = "its first group captures nothing" if pattern.groups else "it matches an empty string"
            raise UserError(
                f"--group-by {group_by} matches {rel}, but {what} there; make the group take at least one "
                "character (+ rather than *, no optional parts), as '^([^/]+)/' does"
            )
        names.append(name)
    return names


def _text(name: str) -> str:
    """``name`` as RE2 can take it: a file name's undecodable bytes (surrogate escapes) as U+FFFD."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _compile(group_by: str, where: str):
    """``group_by`` as an RE2 pattern: matched in time linear in the path, whatever the pattern (the trust
    boundary: a regex from a command line or a run's config.json must not hang the job, as ``(a+)+$`` does
    Python's backtracking ``re``). RE2 refuses backreferences and look-arounds, which need backtracking."""
    options = re2.Options()
    options.log_errors = False  # the refusal is the one line below, not RE2's own log on stderr
    try:
        return re2.compile(group_by, options=options)
    except (re2.error, UnicodeEncodeError) as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise UserError(
            f"--group-by {group_by} is neither a column of {where} nor a regex visiontune accepts ({reason}; "
            "RE2 syntax: no backreferences or look-arounds)"
        ) from None


def _codes(names: list[str]) -> np.ndarray:
    """Group names as ints 0..G-1 in sorted-name order (so the codes do not depend on listing order)."""
    _, codes = np.unique(np.asarray(names, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int64)


def assign(labels: np.ndarray, groups: np.ndarray, targets: list[float], seed: int) -> np.ndarray:
    """The bin (0..len(targets)-1) of each group, each bin's per-class share near its target share.

    The groups go largest first (equal sizes in a seeded random order), each to the bin where, over
    the classes it holds, the bins' shares of each class (as multiples of their targets) spread least;
    a tie goes to the bin furthest below its target size.
    """
    labels, groups = np.asarray(labels, np.int64), np.asarray(groups, np.int64)
    n_groups, n_classes, n_bins = int(groups.max()) + 1, int(labels.max()) + 1, len(targets)
    # Each group's classes and counts as (group, class) pairs: no groups x classes table, which at a
    # group per image of ImageNet would be 10 GB.
    pairs, pair_count = np.unique(groups * n_classes + labels, return_counts=True)
    pair_class = pairs % n_classes
    bounds = np.searchsorted(pairs // n_classes, np.arange(n_groups + 1))
    size = np.bincount(groups, minlength=n_groups)
    per_class = np.bincount(labels, minlength=n_classes).astype(np.float64)
    target = np.asarray(targets, np.float64)
    shuffled = torch.randperm(n_groups, generator=torch.Generator().manual_seed(seed)).numpy()
    order = shuffled[np.argsort(-size[shuffled], kind="stable")]
    counts = np.zeros((n_bins, n_classes), np.float64)
    sizes = np.zeros(n_bins, np.float64)
    where = np.empty(n_groups, np.int64)
    eye = np.eye(n_bins)
    for g in order:
        held = pair_class[bounds[g] : bounds[g + 1]]
        add = pair_count[bounds[g] : bounds[g + 1]].astype(np.float64)
        # shares[b, b', c]: bin b''s share of class c (relative to its target) if the group went to bin b
        shares = (counts[None, :, held] + eye[:, :, None] * add) / (per_class[held] * target[None, :, None])
        spread = shares.std(axis=1).sum(axis=1)
        fill = (sizes + size[g]) / target
        best = np.flatnonzero(np.isclose(spread, spread.min(), rtol=0, atol=1e-12))
        b = int(best[np.argmin(fill[best])])
        where[g] = b
        counts[b, held] += add
        sizes[b] += size[g]
    return where


def grouped_split(labels: np.ndarray, names: list[str], val_fraction: float, seed: int) -> tuple[Split, dict]:
    """Train/val with every group on one side, each class about ``val_fraction`` validation; and the counts."""
    codes = _codes(names)
    n_groups = int(codes.max()) + 1
    if n_groups < 2:
        raise UserError(f"--group-by finds only one group ({names[0]}); a grouped split needs two or more")
    side = assign(labels, codes, [1.0 - val_fraction, val_fraction], seed)[codes]
    split = Split(np.flatnonzero(side == 0), np.flatnonzero(side == 1))
    if not len(split.train) or not len(split.val):
        raise UserError(
            f"a {1 - val_fraction:.0%}/{val_fraction:.0%} split of {n_groups} groups leaves an empty train or val "
            "set; add groups or change --val-fraction"
        )
    return split, _group_counts(codes, split)


def fold_split(labels: np.ndarray, names: list[str] | None, folds: int, fold: int, seed: int) -> tuple[Split, dict]:
    """Fold ``fold`` of ``folds`` as validation, the others as training (groups kept whole when ``names``)."""
    labels = np.asarray(labels, np.int64)
    if names is None:  # each class dealt round the folds in a seeded order: a stratified k-fold
        if len(labels) < folds:
            raise UserError(f"--folds {folds} needs at least {folds} images, got {len(labels)}")
        perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).numpy()
        ranked = perm[np.argsort(labels[perm], kind="stable")]  # class by class, seeded order within each
        of = np.empty(len(labels), np.int64)
        of[ranked] = np.arange(len(labels)) % folds  # continuing across classes keeps the folds' sizes level
        return Split(np.flatnonzero(of != fold), np.flatnonzero(of == fold)), {}
    codes = _codes(names)
    n_groups = int(codes.max()) + 1
    if n_groups < folds:
        raise UserError(f"--folds {folds} needs at least {folds} groups; --group-by finds {n_groups}")
    of = assign(labels, codes, [1.0 / folds] * folds, seed)[codes]
    split = Split(np.flatnonzero(of != fold), np.flatnonzero(of == fold))
    if not len(split.val):
        raise UserError(f"fold {fold} of {folds} holds no group; use fewer --folds")
    return split, _group_counts(codes, split)


def _group_counts(codes: np.ndarray, split: Split) -> dict:
    return {
        "groups": {
            "train": int(len(np.unique(codes[split.train]))),
            "val": int(len(np.unique(codes[split.val]))),
        }
    }


def split_images(
    images: ImageSet, val_fraction: float, seed: int, group_by: str | None, folds: int, fold: int, data: str = ""
) -> tuple[Split, dict] | None:
    """The grouped or k-fold split ``--group-by``/``--folds`` ask for, with what ``split.json`` records of it;
    None when they ask for neither (the plain seeded split)."""
    if not group_by and folds < 2:
        return None
    if images.val_mask is not None:
        raise UserError(
            f"{images.root} brings its own validation split ({images.split_note}); --group-by and --folds "
            "make one of their own: use data without a validation split"
        )
    names = group_names(images, group_by, data) if group_by else None
    if folds >= 2:
        split, counts = fold_split(images.labels, names, folds, fold, seed)
        extra = {"folds": folds, "fold": fold}
    else:
        split, counts = grouped_split(images.labels, names, val_fraction, seed)
        extra = {}
    return split, {**({"group_by": group_by} if group_by else {}), **extra, **counts}


def split_for(images: ImageSet, cfg) -> tuple[Split, dict]:
    """A run's split of ``images`` (a ``TrainConfig``'s --val-fraction, --split-method, --seed, --group-by,
    --folds, --fold) and ``split.json`` less its lists."""
    grouped = split_images(images, cfg.val_fraction, cfg.seed, cfg.group_by, cfg.folds, cfg.fold, cfg.data)
    split, extra = grouped or (split_of(images, cfg.val_fraction, cfg.seed, cfg.split_method), {})
    summary = split_summary(split, images.paths, images.root, cfg.seed, cfg.val_fraction, images.split_note)
    return split, {**summary, **extra}
