"""One pass over the images: a content hash, a perceptual fingerprint and what makes an image degenerate.

Exact duplicates share the SHA-256 of their bytes. Near duplicates (a copy resized, re-encoded, slightly
recoloured) have nearly the same thumbnail: the grey image shrunk to ``THUMB`` x ``THUMB``, its mean taken
away and scaled to unit length, so that the cosine of two thumbnails is their pixels' correlation,
blind to brightness and contrast. A difference hash (dHash) was tried first and rejected: on scanned
digits, where most of a thumbnail is flat black, it gives distinct scans of one digit the same bits,
while the correlation of 8 x 8 thumbnails keeps every copy (>= 0.999, whether the scans are 16 or 32 px
and the copies 75-90% of that) above every pair of distinct scans (<= 0.9963); 16 x 16 ones let a
16 px scan's 14 px copy fall to 0.94 (the pixel grid no longer lines up).
The pixels are decoded and shrunk by the training pipeline's own code (``data.decode``), so what is
compared is what a model would see. Groups are the connected components of "exact, or at least
``similarity`` alike" (scipy's), so a chain of near copies is one group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from visiontune.data.decode import read_source, resize_uint8

THUMB = 8  # 64 grey levels an image: the classic perceptual hashes' size, and the digits' own
CHUNK = 1024  # rows of the pairwise similarities computed at once: bounded memory (CHUNK x N floats)
FLAT_STD = 2.0  # grey levels: an image whose pixels vary less than this is blank or nearly constant
MAX_ASPECT = 5.0  # an image this many times wider than high (or higher than wide) is a strip, not a view


@dataclass(frozen=True)
class Hashes:
    """Per image: SHA-256 of the bytes, the unit thumbnail, the grey-level spread, the aspect ratio
    (long side over short), and why it could not be read (None when it could)."""

    sha: list[str]
    thumb: np.ndarray  # float32 [N, THUMB * THUMB], each row of unit length (zeros: flat or unreadable)
    spread: np.ndarray  # float32 [N]
    aspect: np.ndarray  # float32 [N]
    failed: list[str | None]


def _bytes_of(source) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    with open(source, "rb") as f:
        return f.read()


def thumbnail(img: torch.Tensor) -> tuple[np.ndarray, float]:
    """The unit thumbnail of a uint8 [3, H, W] image, and its grey levels' spread."""
    grey = resize_uint8(img, THUMB).float().mean(0).reshape(-1)
    centred = grey - grey.mean()
    spread = float(centred.norm()) / THUMB  # the standard deviation of the thumbnail's grey levels
    unit = centred / centred.norm() if spread > 1e-3 else torch.zeros_like(centred)
    return unit.numpy().astype(np.float32), spread


def hash_one(source) -> tuple[str, np.ndarray, float, float, str | None]:
    """The hashes of one image (a path or its bytes); an unreadable one gets zeros and its reason."""
    from visiontune.data.decode import BadImage

    data = _bytes_of(source)
    sha = hashlib.sha256(data).hexdigest()
    try:
        img = read_source(data)
    except BadImage as e:
        return sha, np.zeros(THUMB * THUMB, np.float32), 0.0, 1.0, str(e)
    h, w = img.shape[1:]
    unit, spread = thumbnail(img)
    return sha, unit, spread, max(h, w) / max(1, min(h, w)), None


def hash_all(sources) -> Hashes:
    """``hash_one`` of every source, in order."""
    rows = [hash_one(s) for s in sources]
    n = len(rows)
    return Hashes(
        [r[0] for r in rows],
        np.stack([r[1] for r in rows]) if n else np.zeros((0, THUMB * THUMB), np.float32),
        np.asarray([r[2] for r in rows], np.float32),
        np.asarray([r[3] for r in rows], np.float32),
        [r[4] for r in rows],
    )


def near_pairs(thumbs: np.ndarray, similarity: float, usable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i < j) of usable images whose thumbnails' cosine is at least ``similarity``."""
    idx = np.flatnonzero(usable)
    rows = thumbs[idx]
    left, right = [], []
    for start in range(0, len(idx), CHUNK):
        # The block against every row from it on: the upper triangle, CHUNK rows at a time.
        alike = rows[start : start + CHUNK] @ rows[start:].T
        a, b = np.nonzero(alike >= similarity)
        keep = start + a < start + b
        left.append(idx[start + a[keep]])
        right.append(idx[start + b[keep]])
    if not left:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(left), np.concatenate(right)


def groups(hashes: Hashes, similarity: float) -> list[list[int]]:
    """Groups of two or more images that are exact or near copies of one another (connected components),
    each sorted, the groups in order of their first member."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(hashes.sha)
    usable = np.asarray([f is None for f in hashes.failed], bool)
    first: dict[str, int] = {}
    exact_a, exact_b = [], []
    for i, sha in enumerate(hashes.sha):  # identical bytes, readable or not
        if sha in first:
            exact_a.append(first[sha])
            exact_b.append(i)
        else:
            first[sha] = i
    near_a, near_b = near_pairs(hashes.thumb, similarity, usable & (hashes.spread > 1e-3))
    a = np.concatenate([np.asarray(exact_a, np.int64), near_a])
    b = np.concatenate([np.asarray(exact_b, np.int64), near_b])
    graph = coo_matrix((np.ones(len(a), np.int8), (a, b)), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(label.tolist()):
        members.setdefault(g, []).append(i)
    return sorted((m for m in members.values() if len(m) > 1), key=lambda m: m[0])
