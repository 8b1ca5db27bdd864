"""Tests for visiontune.data.sample: Kaggle layout, sizes, determinism, and a real class signal."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from visiontune.data.sample import make_sample_data

PER_CLASS = 20


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    return out, make_sample_data(out, per_class=PER_CLASS, test_count=7, seed=3)


def test_layout_and_counts_follow_kaggle(sample):
    out, info = sample
    train = sorted(p.name for p in (out / "train").iterdir())
    test = sorted(p.name for p in (out / "test").iterdir())
    assert train == sorted(f"{c}.{n}.jpg" for c in ("cat", "dog") for n in range(PER_CLASS))
    assert test == sorted(f"{i}.jpg" for i in range(1, 8))
    assert info["train"] == 2 * PER_CLASS and info["test"] == 7 and info["classes"] == ["cat", "dog"]
    assert sorted(info["test_labels"]) == list(range(1, 8))
    assert set(info["test_labels"].values()) <= {"cat", "dog"}


def test_default_test_count_is_half_per_class(tmp_path):
    info = make_sample_data(tmp_path, per_class=3)
    assert info["test"] == 1 and [p.name for p in (tmp_path / "test").iterdir()] == ["1.jpg"]


def test_images_are_jpegs_of_varied_size_within_bounds(sample):
    out, _ = sample
    sizes = []
    for path in (out / "train").iterdir():
        with Image.open(path) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            sizes.append(im.size)
    assert all(300 <= w <= 500 and 300 <= h <= 500 for w, h in sizes)
    assert len(set(sizes)) > len(sizes) // 2  # varied, and width and height independently
    assert any(w != h for w, h in sizes)


def test_same_seed_gives_identical_bytes_and_another_seed_does_not(tmp_path):
    a = make_sample_data(tmp_path / "a", per_class=3, test_count=2, seed=7)
    b = make_sample_data(tmp_path / "b", per_class=3, test_count=2, seed=7)
    make_sample_data(tmp_path / "c", per_class=3, test_count=2, seed=8)
    assert a == b
    for path in sorted((tmp_path / "a").rglob("*.jpg")):
        rel = path.relative_to(tmp_path / "a")
        assert path.read_bytes() == (tmp_path / "b" / rel).read_bytes()
        assert path.read_bytes() != (tmp_path / "c" / rel).read_bytes()


def test_per_class_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="per_class"):
        make_sample_data(tmp_path, per_class=0)
    assert not (tmp_path / "train").exists()


def pixels(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB").resize((32, 32), Image.BILINEAR), np.float32).ravel()


def test_class_signal_survives_downsampling(sample):
    """A nearest-class-mean classifier fit on half the images labels the other half."""
    out, _ = sample
    paths = sorted((out / "train").iterdir())
    labels = np.array([re.match(r"(cat|dog)\.", p.name).group(1) == "dog" for p in paths])
    x = np.stack([pixels(p) for p in paths])
    fit = np.arange(len(paths)) % 2 == 0
    means = np.stack([x[fit & (labels == k)].mean(0) for k in (False, True)])
    dist = ((x[~fit, None, :] - means[None]) ** 2).sum(-1)
    accuracy = ((dist.argmin(1) == 1) == labels[~fit]).mean()
    assert accuracy >= 0.9


def test_test_images_carry_the_signal_of_their_recorded_label(sample):
    out, info = sample
    train = sorted((out / "train").iterdir())
    means = {}
    for c in ("cat", "dog"):
        means[c] = np.stack([pixels(p) for p in train if p.name.startswith(c + ".")]).mean(0)
    hits = [
        min(means, key=lambda c: ((pixels(out / "test" / f"{i}.jpg") - means[c]) ** 2).sum()) == label
        for i, label in info["test_labels"].items()
    ]
    assert all(hits)


def test_sample_data_per_class_is_bounded_in_one_line_before_anything_is_written(tmp_path, capsys):
    from visiontune.cli.commands import main

    assert main(["sample-data", str(tmp_path / "d"), "--per-class", "99999999999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--per-class" in err[0] and "1 to 100,000" in err[0], err
    assert not (tmp_path / "d").exists()
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as help_text, pytest.raises(SystemExit):
        main(["sample-data", "--help"])
    assert "1 to 100,000" in help_text.getvalue()


def test_sample_data_hands_the_writers_one_chunk_at_a_time(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from visiontune.data import sample

    seen = []
    real_map = ThreadPoolExecutor.map

    def recording_map(self, fn, jobs):
        jobs = list(jobs)
        seen.append(len(jobs))
        return real_map(self, fn, jobs)

    monkeypatch.setattr(sample, "_CHUNK", 4)
    monkeypatch.setattr(ThreadPoolExecutor, "map", recording_map)
    make_sample_data(tmp_path, per_class=5, test_count=3, seed=0)
    assert max(seen) <= 4 and sum(seen) == 13  # never the whole list at once, and every image written
    assert len(list((tmp_path / "train").iterdir())) == 10 and len(list((tmp_path / "test").iterdir())) == 3
