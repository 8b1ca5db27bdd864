"""Regression data: one or more numbers an image (``--task regress``), float32 rows [N, T].

A manifest gives them as columns after the file name (``filename,value`` or ``filename,age,score``: a header
names them, else they are ``value`` or ``value1``, ``value2``...); an ``hf:`` data set as a numeric label
column. Every cell must be a finite number: an empty, NaN or non-numeric one is one line naming its file and
row. The split holds out the same share of each quantile bin of the (first) target, so that the val split
spans the range as the train split does.
"""

from __future__ import annotations

import math

import numpy as np

from visiontune.errors import UserError

BINS = 10  # quantile bins the split stratifies by (fewer when there are few images)


def target_names(header: list[str] | None, count: int) -> list[str]:
    """The targets' names: a header's, else ``value`` (one) or ``value1``.. (several)."""
    if header is not None:
        return [c.strip() for c in header]
    return ["value"] if count == 1 else [f"value{i + 1}" for i in range(count)]


def is_header(cells: list[str]) -> bool:
    """Whether a manifest's first row names its columns: its target cells are not numbers."""
    return any(_number(c) is None for c in cells)


def _number(cell: str) -> float | None:
    try:
        v = float(cell.strip())
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse(cells: list[str], where: str) -> list[float]:
    """A row's target cells as numbers; else one line naming ``where`` (the file and row)."""
    out = []
    for cell in cells:
        v = _number(cell)
        if v is None:
            what = "empty" if not cell.strip() else f"{cell.strip()[:40]!r}, not a finite number"
            raise UserError(f"{where}: target {what}; give every image a number (regression data)")
        out.append(v)
    return out


def checked(values, where: str) -> np.ndarray:
    """float32 [N, T] of ``values``; a NaN, infinite or missing one is one line naming ``where`` and its row."""
    arr = np.asarray(values, np.float64)
    arr = arr.reshape(len(arr), -1)
    bad = ~np.isfinite(arr).all(1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise UserError(f"{where} row {row}: target {arr[row].tolist()} is not a finite number; fix or drop that row")
    return arr.astype(np.float32)


def quantile_bins(values: np.ndarray, val_fraction: float) -> np.ndarray:
    """int per image: its quantile bin of the first target (as many bins as keep two val images in each)."""
    first = np.asarray(values, np.float64).reshape(len(values), -1)[:, 0]
    bins = max(1, min(BINS, int(len(first) * val_fraction) // 2))
    edges = np.quantile(first, np.linspace(0, 1, bins + 1)[1:-1]) if bins > 1 else np.array([])
    return np.searchsorted(edges, first, side="right").astype(np.int64)
