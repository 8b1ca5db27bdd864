"""A synthetic stand-in for Kaggle's Dogs vs Cats, for demos and tests without the download.

The files are laid out exactly like the Kaggle archive (``train/cat.<n>.jpg``,
``train/dog.<n>.jpg``, unlabelled ``test/<id>.jpg``) and sized like it (300 to
500 px each way, independently), so every layout, decode and resize path runs
as it would on the real data. The classes differ the way a small CNN notices
quickly and a 64 px resize keeps: cats sit on a warm background with
horizontal stripes and a bright blob, dogs on a cool one with vertical stripes
and a dark blob. Random tone, brightness, stripe period and phase, blob
position and pixel noise keep it from being one constant picture per class.
Each image draws from its own seeded generator, so output is byte-identical
for a seed and images can be built in parallel.
"""

from __future__ import annotations

import io
import itertools
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from visiontune.cluster.host import available_cores
from visiontune.errors import UserError

CLASSES = ("cat", "dog")
_TONES = {"cat": (200.0, 135.0, 80.0), "dog": (80.0, 135.0, 200.0)}  # warm vs cool mean RGB
_MIN_SIDE, _MAX_SIDE = 300, 500
_QUALITY = 85
_CHUNK = 256  # images handed to the writing threads at a time


def _picture(label: str, rng: np.random.Generator) -> np.ndarray:
    """One uint8 [h, w, 3] image of ``label``."""
    w, h = (int(v) for v in rng.integers(_MIN_SIDE, _MAX_SIDE + 1, size=2))
    tone = np.asarray(_TONES[label], np.float32) + rng.normal(0, 15, 3).astype(np.float32)
    brightness = np.float32(rng.uniform(0.7, 1.2))

    # Stripes 30-70 px apart are still 4-11 px apart after a 64 px resize, so they survive it.
    period, phase = rng.uniform(30, 70), rng.uniform(0, 2 * np.pi)
    along = np.arange(h if label == "cat" else w, dtype=np.float32)
    wave = (25 * np.sin(2 * np.pi * along / period + phase)).astype(np.float32)
    stripes = wave[:, None] if label == "cat" else wave[None, :]

    # A separable Gaussian blob: two 1-D profiles instead of an h x w distance map.
    cy, cx = rng.uniform(0.2, 0.8) * h, rng.uniform(0.2, 0.8) * w
    radius = rng.uniform(0.08, 0.15) * min(w, h)
    gy = np.exp(-(((np.arange(h) - cy) / radius) ** 2)).astype(np.float32)
    gx = np.exp(-(((np.arange(w) - cx) / radius) ** 2)).astype(np.float32)
    blob = (70 if label == "cat" else -70) * gy[:, None] * gx[None, :]

    luma = stripes + blob  # [h, w] after broadcasting
    img = brightness * (tone[None, None, :] + luma[:, :, None])
    img += rng.normal(0, 12, (h, w, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _write(path: Path, label: str, seed_key: list[int]) -> None:
    buf = io.BytesIO()
    Image.fromarray(_picture(label, np.random.default_rng(seed_key))).save(buf, "JPEG", quality=_QUALITY)
    path.write_bytes(buf.getvalue())


# What sample-data (and `visiontune prepare`) write: --force removes these and nothing else.
WRITTEN = ("train", "test", "train.csv")


def clear_folder(out_dir: str | os.PathLike, force: bool) -> None:
    """Refuse a folder that already holds files (old images would sit beside the new ones) unless
    ``force``, which removes the data set there first."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; give a folder to write the data set into")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise UserError(
            f"{out} is not empty; choose an empty or new folder, or pass --force to replace the data set there"
        )
    for name in WRITTEN:
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)


def make_sample_data(
    out_dir: str | os.PathLike,
    *,
    per_class: int = 200,
    test_count: int | None = None,
    seed: int = 0,
) -> dict:
    """Write a synthetic Dogs-vs-Cats set into ``out_dir``; returns counts and the test labels."""
    if per_class < 1:
        raise ValueError(f"per_class must be at least 1, got {per_class}")
    test_count = per_class // 2 if test_count is None else test_count
    if test_count < 0:
        raise ValueError(f"test_count must not be negative, got {test_count}")
    train_dir, test_dir = Path(out_dir) / "train", Path(out_dir) / "test"
    train_dir.mkdir(parents=True, exist_ok=True)
    test_dir.mkdir(parents=True, exist_ok=True)

    # Test labels come from their own generator so the train images do not depend on test_count.
    test_rng = np.random.default_rng([seed, 2])
    test_labels = {i: CLASSES[int(test_rng.integers(2))] for i in range(1, test_count + 1)}
    jobs = itertools.chain(
        (
            (train_dir / f"{label}.{n}.jpg", label, [seed, 0, c, n])
            for c, label in enumerate(CLASSES)
            for n in range(per_class)
        ),
        ((test_dir / f"{i}.jpg", label, [seed, 1, i]) for i, label in test_labels.items()),
    )
    # numpy and PIL's encoder release the GIL for the heavy parts, so threads use both cores. The jobs go to
    # the pool a chunk at a time (``Executor.map`` takes its whole input at once): memory stays one chunk's.
    with ThreadPoolExecutor(max_workers=min(4, available_cores())) as pool:
        while chunk := list(itertools.islice(jobs, _CHUNK)):
            list(pool.map(lambda job: _write(*job), chunk))
    return {
        "train": per_class * len(CLASSES),
        "test": test_count,
        "classes": list(CLASSES),
        "test_labels": test_labels,
    }


# A multi-label stand-in (docs/data.md): each image holds any of these coloured shapes, or none.
SHAPES = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 220, 50)}


def _shapes_picture(present: list[str], size: int, rng: np.random.Generator) -> np.ndarray:
    img = rng.normal(60, 12, (size, size, 3))
    side = max(3, size // 4)
    for name in present:
        y, x = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        img[y : y + side, x : x + side] = np.asarray(SHAPES[name], np.float64) + rng.normal(0, 8, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_multilabel_data(out_dir: str | os.PathLike, *, count: int = 64, size: int = 32, seed: int = 0) -> dict:
    """Write ``count`` PNG images of ``size`` px into ``out_dir/train`` and ``out_dir/train.csv``
    (``filename,labels``, the labels separated by ``;``): each of the four colours of ``SHAPES`` is in an
    image with probability 0.4, as a square a quarter of its side (later ones may cover earlier ones in
    part), so about one image in eight has no label. Returns the label sets by file name."""
    train = Path(out_dir) / "train"
    train.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 3])
    sets, lines = {}, ["filename,labels"]
    for i in range(count):
        present = [name for name in SHAPES if rng.random() < 0.4]
        name = f"img{i:04d}.png"
        Image.fromarray(_shapes_picture(present, size, rng)).save(train / name)
        sets[name] = present
        lines.append(f"{name},{';'.join(present)}")
    (Path(out_dir) / "train.csv").write_text("\n".join(lines) + "\n")
    return {"classes": sorted(SHAPES), "labels": sets}  # in the order a run lists them


def overlapping_classes(out: Path, counts: dict[str, int], seed: int) -> None:
    """Class folders of 16 px noisy squares whose brightness differs by class but overlaps (means 100 and
    130, spread 20): no model tells every image apart, so where it puts the boundary shows; a plain run
    on 95/5 data puts it deep in the rare class, as the prior tells it to."""
    rng = np.random.default_rng(seed)
    for name, n in counts.items():
        (out / name).mkdir(parents=True)
        for i in range(n):
            level = rng.normal({"cat": 100.0, "dog": 130.0}[name], 20.0)
            pixels = np.clip(level + rng.normal(0, 10, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(out / name / f"{i}.png")


def make_regression_data(out_dir: str | os.PathLike, *, count: int = 200, size: int = 32, seed: int = 0) -> dict:
    """Write ``count`` PNG images of ``size`` px into ``out_dir/train`` and ``out_dir/train.csv``
    (``filename,value``) for ``--task regress``: each image is a bright square on a dark noisy ground, and
    its value is the square's side as a fraction of the image's (drawn from 0.2 to 0.8, rounded to 1/size):
    a known function of the pixels, which a small CNN learns. Returns the values by file name."""
    train = Path(out_dir) / "train"
    train.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 5])
    values, lines = {}, ["filename,value"]
    for i in range(count):
        side = int(rng.integers(round(0.2 * size), round(0.8 * size) + 1))
        pixels = rng.normal(40, 12, (size, size, 3))
        y, x = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        pixels[y : y + side, x : x + side] = rng.normal(210, 12, (side, side, 3))
        name = f"img{i:04d}.png"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(train / name)
        values[name] = side / size
        lines.append(f"{name},{side / size!r}")
    (Path(out_dir) / "train.csv").write_text("\n".join(lines) + "\n")
    return {"values": values}
