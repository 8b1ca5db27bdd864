"""Bad data: train skips exactly the bad files and lists them, stops over the threshold; manifests; pickles."""

from __future__ import annotations

import csv
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import visiontune.data.check as check
from badfiles import make_bad_files, make_odd_mode_images, natural_ish
from trainrun import TINY, flags
from visiontune import cli
from visiontune.data.sample import make_sample_data
from visiontune.loading.pipeline import ImageDataset
from visiontune.tasks import UNREADABLE


def _report(path: Path) -> dict[str, str]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["path", "problem"]
    return {r[0]: r[1] for r in rows[1:]}


@pytest.fixture(scope="module")
def dirty_data(tmp_path_factory):
    """120 good images, 11 odd-mode ones, 5 bad ones (4%) of every kind and the OS's metadata files, in the
    Kaggle layout."""
    root = tmp_path_factory.mktemp("dirty") / "data"
    make_sample_data(root, per_class=60, test_count=0, seed=2)
    train = root / "train"
    scratch = root.parent / "scratch"
    bad, odd = make_bad_files(scratch / "bad"), make_odd_mode_images(scratch / "odd")
    injected = {}
    for i, name in enumerate(sorted(bad)):
        if name == "big.jpg":  # a real decompression bomb: 90 Mpx of one bit, a few kB on disk
            target = train / "dog.5000.png"
            Image.new("1", (10_000, 9_000)).save(target)
        else:  # image-like names get Kaggle names; Thumbs.db, notes.txt, .DS_Store keep theirs
            keep = not name.endswith(".jpg")
            target = train / (name if keep else f"cat.{5001 + i}.jpg")
            shutil.copy(scratch / "bad" / name, target)
        if name not in ("Thumbs.db", ".DS_Store"):  # the OS's metadata files are ignored, not bad
            injected[str(target)] = bad[name]
    odd_files = []
    for i, name in enumerate(sorted(odd)):
        target = train / f"dog.{6000 + i}{Path(name).suffix}"
        shutil.copy(scratch / "odd" / name, target)
        odd_files.append(str(target))
    return root, injected, odd_files


@pytest.mark.slow
def test_run_skips_exactly_the_bad_files_and_trains_on_odd_modes(tmp_path, dirty_data, monkeypatch, capsys):
    root, injected, odd_files = dirty_data
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["train", *flags(data=root, output_dir=out), *TINY, *flags(epochs=1, batch_size=8, max_bad_fraction=0.06)]
    assert cli.main(args) == 0
    assert set(_report(out / "bad_files.csv")) == set(injected)
    split = json.loads((out / "split.json").read_text())
    used = {str(root / p) for p in split["train"] + split["val"]}
    assert used.isdisjoint(injected) and set(odd_files) <= used and len(used) == 131
    assert not (out / "load_failures.csv").exists()  # nothing failed after the scan
    # Every odd-mode file reaches the model as a 3-channel image of the training size.
    for img, _ in ImageDataset(odd_files, [0] * len(odd_files), 32):
        assert img.shape == (3, 32, 32) and img.dtype == torch.uint8

    # A second run over the unchanged folder decodes nothing to scan it, and with the default
    # --max-bad-fraction (1%) it stops before training, pointing at the report.
    decoded = []
    real = check.read_image
    monkeypatch.setattr(check, "read_image", lambda p, **kw: decoded.append(p) or real(p, **kw))
    out2 = tmp_path / "run2"
    capsys.readouterr()
    assert cli.main([*args[:-2], "--output-dir", str(out2)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "5 of 136 files are bad" in err[0] and str(out2 / "bad_files.csv") in err[0]
    assert decoded == []
    assert set(_report(out2 / "bad_files.csv")) == set(injected)
    assert not (out2 / "checkpoints").exists() and not (out2 / "history.json").exists()


def test_check_command_reports_the_bad_files_and_exits_1(tmp_path, dirty_data, capsys):
    root, injected, _ = dirty_data
    report = tmp_path / "report.csv"
    assert cli.main(["check", str(root), "--report", str(report)]) == 1
    found = _report(report)
    assert set(found) == set(injected)
    assert "image too large" in found[str(root / "train" / "dog.5000.png")]
    assert "5 bad of 136 files" in capsys.readouterr().out


def test_check_command_on_clean_data_exits_0(tmp_path, small_data):
    report = tmp_path / "report.csv"
    assert cli.main(["check", str(small_data), "--report", str(report)]) == 0
    assert _report(report) == {}


def test_file_failing_at_load_time_is_skipped_and_recorded(tmp_path):
    good = tmp_path / "good.jpg"
    Image.fromarray(natural_ish()).save(good)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(good.read_bytes()[:100])  # went bad after the scan
    log = tmp_path / "load_failures.csv"
    ds = ImageDataset([str(good), str(broken)], [0, 1], 16, failures_csv=str(log))
    assert ds[0][0].shape == (3, 16, 16)
    image, label = ds[1]  # keeps its slot, labelled so every metric leaves it out
    assert label == UNREADABLE and image.shape == (3, 16, 16) and image.sum() == 0
    rows = list(csv.reader(open(log)))
    assert [r[0] for r in rows] == [str(broken)]


# --- manifest CSVs -----------------------------------------------------------------------------------------


@pytest.fixture
def manifest_root(tmp_path):
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        Image.fromarray(natural_ish()).save(root / "train" / name)
    Image.fromarray(natural_ish()).save(tmp_path / "outside.jpg")
    return root


@pytest.mark.parametrize(
    "rows,expected",
    [
        (["a.jpg,cat", "b.jpg,", "c.jpg,dog"], "row 3: expected 'filename,label'"),
        (["a.jpg,cat", "b.jpg,dog", "missing.jpg,dog"], "row 4: file not found"),
        (["a.jpg,cat", "b.jpg,dog", "a.jpg,dog"], "row 4: duplicate row for 'a.jpg'"),
        (["a.jpg,cat", "../outside.jpg,dog"], "row 3: path '../outside.jpg' leaves the image root"),
        (["a.jpg,cat", "b.jpg,dog", "{outside},cat"], "row 4: path"),
    ],
)
def test_manifest_errors_name_the_row(manifest_root, capsys, rows, expected):
    outside = str(manifest_root.parent / "outside.jpg")
    (manifest_root / "train.csv").write_text("\n".join(["filename,label", *rows]).format(outside=outside) + "\n")
    assert cli.main(["check", str(manifest_root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "train.csv" in err[0], err


def test_escaping_manifest_path_is_rejected_without_touching_it(manifest_root, monkeypatch, capsys):
    (manifest_root / "train.csv").write_text("filename,label\na.jpg,cat\n../outside.jpg,dog\n")
    touched = []
    real_is_file = Path.is_file

    def is_file(self):
        touched.append(str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    assert cli.main(["check", str(manifest_root)]) == 2
    assert "leaves the image root" in capsys.readouterr().err
    assert not [p for p in touched if "outside" in p]


# --- weights that run code when unpickled ------------------------------------------------------------------


class _Sentinel:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_weights_file_that_runs_code_is_refused_without_running_it(tmp_path, small_data, monkeypatch, capsys):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    sentinel = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    evil.write_bytes(pickle.dumps({"features.0.weight": _Sentinel(str(sentinel))}))
    args = ["train", "--data", str(small_data), "--output-dir", str(tmp_path / "run"), *TINY]
    args[args.index("--weights") + 1] = str(evil)
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot load weights" in err[0] and "evil.pth" in err[0]
    assert not sentinel.exists()
    # The same file opened the unsafe way would have created it: the test can tell.
    pickle.loads(evil.read_bytes())
    assert sentinel.exists()
