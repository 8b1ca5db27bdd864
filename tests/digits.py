"""sklearn's real scanned digits (1,797 8x8 scans) written as image files, with planted faults for the audit:
a seeded share of files moved to another class's folder (flipped labels) and near copies (resized,
re-encoded as JPEG) of some images put in other classes' folders."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass
class Planted:
    root: Path
    flipped: set[str] = field(default_factory=set)  # the moved files, named as audit.csv names them
    copies: list[tuple[str, str]] = field(default_factory=list)  # (original, copy)


def write_digits(
    root: Path, *, seed: int = 0, flip: float = 0.05, copies: int = 20, per_class: int | None = None, hostile: str = ""
) -> Planted:
    """The digits as 16 px PNGs in class folders (``per_class``: the first N of each class), a seeded ``flip``
    share of them in another class's folder, and ``copies`` near copies in other classes' folders
    (``hostile``: a name for the first copy, to see it escaped)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    pixels, target = (d.images * (255 / 16)).astype(np.uint8), d.target
    keep = np.arange(len(target))
    if per_class:
        keep = np.concatenate([np.flatnonzero(target == c)[:per_class] for c in range(10)])
    rng = np.random.default_rng(seed)
    moved = set(rng.choice(keep, round(flip * len(keep)), replace=False).tolist())
    planted = Planted(root)
    names = {}
    for i in keep.tolist():
        label = int(target[i])
        if i in moved:  # another class, chosen at random
            label = int((label + rng.integers(1, 10)) % 10)
        name = f"{label}/{i:04d}.png"
        names[i] = name
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[i]).resize((16, 16), Image.NEAREST).save(root / name)
        if i in moved:
            planted.flipped.add(name)
    sources = rng.choice(np.array(sorted(set(keep.tolist()) - moved)), copies, replace=False)
    for k, i in enumerate(sources.tolist()):
        label = int((target[i] + rng.integers(1, 10)) % 10)
        copy = f"{label}/{hostile if k == 0 and hostile else f'copy-{k:02d}'}.jpg"
        img = Image.open(root / names[i]).convert("RGB").resize((14, 14), Image.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=85)
        (root / copy).write_bytes(buf.getvalue())
        planted.copies.append((names[i], copy))
    return planted
