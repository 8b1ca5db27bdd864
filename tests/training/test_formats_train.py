"""Training on hf: data and on shards keeps a folder's guarantees: the same split and numbers, bad samples
skipped and counted, exact resume after kill -9, every validation image counted once under DDP."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST
from trainrun import PYTHON, SQUEEZENET, assert_same_weights, env_for, flags, run, start, wait_for
from visiontune.cli.commands import main
from visiontune.data.layouts import discover
from visiontune.data.sample import make_sample_data
from visiontune.runs import checkpoint

datasets = pytest.importorskip("datasets")
pytest.importorskip("webdataset")

ONE_EPOCH = [*FAST, *flags(num_workers=0, batch_size=4, epochs=1, timeout=60, max_bad_fraction=0.1)]


def _hf_copy(folder: Path, out: Path, validation: slice | None = None) -> str:
    """The folder's listing (bad file included) as a datasets set saved with save_to_disk, rows in its order."""
    images = discover(str(folder))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=images.classes)})
    rows = {
        "image": [{"bytes": Path(p).read_bytes(), "path": None} for p in images.paths],
        "label": images.labels.tolist(),
    }
    whole = datasets.Dataset.from_dict(rows, features=features)
    if validation is None:
        whole.save_to_disk(str(out))
    else:
        val = set(range(len(whole))[validation])
        parts = {
            "train": whole.select([i for i in range(len(whole)) if i not in val]),
            "validation": whole.select(sorted(val)),
        }
        datasets.DatasetDict({k: v.flatten_indices() for k, v in parts.items()}).save_to_disk(str(out))
    return f"hf:{out}"


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """One data set three ways: a Kaggle folder with a corrupt file, its shards, and a datasets copy."""
    tmp = tmp_path_factory.mktemp("formats-train")
    make_sample_data(tmp / "data", per_class=10, test_count=0, seed=4)
    (tmp / "data" / "train" / "cat.5.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")
    assert main(["shard", str(tmp / "data"), "--out", str(tmp / "shards"), "--shard-size", "60KB"]) == 0
    return {"folder": str(tmp / "data"), "shards": str(tmp / "shards"), "hf": _hf_copy(tmp / "data", tmp / "hf")}


def _summary(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in s.items() if "accuracy" in k or "loss" in k or "counted" in k}


def test_shards_and_hf_data_train_exactly_like_the_folder_they_were_made_from(tmp_path, formats, capsys):
    runs = {}
    for name, data in formats.items():
        runs[name] = tmp_path / name
        extra = ["--cache", str(tmp_path / "cache")] if name == "hf" else []
        assert main(["train", "--data", data, "--output-dir", str(runs[name]), *ONE_EPOCH, *extra]) == 0
    said = capsys.readouterr()
    assert "the split recorded in index.json" in said.out and "building the image cache" in said.out
    weights = {name: load_file(str(r / "best.safetensors")) for name, r in runs.items()}
    assert_same_weights(weights["shards"], weights["folder"])
    assert_same_weights(weights["hf"], weights["folder"])
    assert _summary(runs["shards"]) == _summary(runs["hf"]) == _summary(runs["folder"])
    splits = {name: json.loads((r / "split.json").read_text()) for name, r in runs.items()}
    # Shards keep the folder's names, so the split record is the folder's to the hash; hf rows are named by row.
    assert splits["shards"]["train"] == splits["folder"]["train"] and splits["shards"]["val"] == splits["folder"]["val"]
    assert splits["shards"]["sha256"] == splits["folder"]["sha256"]
    assert splits["hf"]["counts"] == splits["folder"]["counts"] == {"train": 15, "val": 4}
    # The corrupt file: left out when sharding, skipped and reported when training on the folder and the hf rows.
    for name, row in (("folder", "cat.5.jpg"), ("hf", "train/5")):
        report = (runs[name] / "bad_files.csv").read_text().splitlines()
        assert len(report) == 2 and report[1].split(",")[0].endswith(row) and "JPEG" in report[1]
    # The same bad row is more than --max-bad-fraction allows by default: the run stops before training.
    assert main(["train", "--data", formats["hf"], "--output-dir", str(tmp_path / "stop"), *FAST]) == 2
    assert "1 of 20 files are bad" in capsys.readouterr().err


STEPS, EPOCHS = 3, 2  # 15 train images at batch 4
KILL_RUN = [*SQUEEZENET, *flags(timeout=60, epochs=EPOCHS, batch_size=4, save_every_steps=1, max_bad_fraction=0.1)]


@pytest.fixture(scope="module")
def augmented_reference(tmp_path_factory, formats):
    """An uninterrupted --augment run on the folder: what every format's killed-and-resumed run must end with."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--data", formats["folder"], "--output-dir", str(out), *KILL_RUN, "--augment"]) == 0
    return out / "checkpoints" / checkpoint.name(EPOCHS, 0)


@pytest.mark.parametrize("fmt", ["shards", "hf"])
def test_kill_9_mid_epoch_then_resume_ends_with_the_folder_runs_tensors(
    tmp_path, formats, augmented_reference, worker_env, monkeypatch, capsys, fmt
):
    env = env_for(worker_env, tmp_path)
    out = tmp_path / "run"
    argv = [PYTHON, "-m", "visiontune", "train", "--data", formats[fmt], "--output-dir", str(out), *KILL_RUN]
    argv.append("--augment")
    step = random.Random(fmt).randint(1, EPOCHS * STEPS - 2)
    proc = start(argv, env, tmp_path / "killed.log")
    wait_for(out / "checkpoints" / checkpoint.name(*divmod(step, STEPS)), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "checkpoints" / checkpoint.name(EPOCHS, 0)).exists(), "the run ended before the kill"
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", env["VISIONTUNE_CACHE_DIR"])
    assert main([*argv[3:], "--resume", "auto"]) == 0
    assert "resuming from" in capsys.readouterr().out
    final = out / "checkpoints" / checkpoint.name(EPOCHS, 0)
    assert_same_weights(
        load_file(str(final / "model.safetensors")), load_file(str(augmented_reference / "model.safetensors"))
    )
    got, want = (torch.load(c / "optimizer.bin", weights_only=True)["state"] for c in (final, augmented_reference))
    assert got.keys() == want.keys()
    for k in want:
        assert all(torch.equal(got[k][n], want[k][n]) for n in want[k] if isinstance(want[k][n], torch.Tensor))


def test_ddp_on_hf_data_with_its_own_odd_validation_split_counts_each_image_once(tmp_path, formats, worker_env):
    """2 processes, 5 validation rows (the data's own split): each counted once, none padded in."""
    data = _hf_copy(Path(formats["folder"]), tmp_path / "hf", validation=slice(0, 20, 4))
    out = tmp_path / "run"
    argv = [PYTHON, "-m", "visiontune", "train", "--data", data, "--output-dir", str(out), *SQUEEZENET]
    argv += flags(timeout=60, epochs=1, batch_size=2, strategy="ddp", nproc=2, max_bad_fraction=0.1)
    done = run(argv, env_for(worker_env, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "its own train/validation splits" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    split = json.loads((out / "split.json").read_text())
    # Row 5 of the folder's order (the corrupt cat.5.jpg) is train row 4 here: skipped, so 14 train, 5 val.
    assert split["counts"] == {"train": 14, "val": 5} and split["val"] == [f"validation/{i}" for i in range(5)]
    assert summary["val_images_counted"] == 5
