"""Smoke runs: `--max-steps N` stops after N optimizer steps with a run folder that loads, and
`--limit-images N` trains on a seeded subset recorded in split.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import TINY_RESNET
from visiontune import load
from visiontune.cli.commands import main
from visiontune.data.sources import discover
from visiontune.loading.jobdata import limit
from visiontune.runs import checkpoint
from visiontune.tasks import AUTO


@pytest.mark.slow
def test_max_steps_stops_mid_epoch_with_a_valid_run_folder_and_limit_images_records_its_subset(
    sample_data, tmp_path, monkeypatch, capsys
):
    steps = []
    step = torch.optim.SGD.step
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, *a, **kw: (steps.append(1), step(self, *a, **kw))[1])
    run = tmp_path / "smoke"
    argv = [
        "train",
        "--data",
        str(sample_data),
        *TINY_RESNET,
        "--batch-size",
        "16",
        "--epochs",
        "3",
        "--num-workers",
        "0",
    ]
    # 80 of the 120 images: 64 train = 4 steps an epoch; 6 steps = epoch 1 and half of epoch 2.
    argv += ["--limit-images", "80", "--max-steps", "6", "--output-dir", str(run)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(steps) == 6
    assert "visiontune: stopped after 6 optimizer steps (--max-steps)" in out and "Epoch 3/3" not in out
    assert "4 per epoch x 3 epochs = 12; --max-steps 6: stops there" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"] == {"reason": "max-steps", "optimizer_steps": 6, "epochs_done": 2}
    history = json.loads((run / "history.json").read_text())
    assert [row["train"]["images"] for row in history] == [64, 32]  # 4 and 2 steps of 16
    assert all(row["val"]["images"] == 16 for row in history)
    # The run folder is a finished one: its best model loads and predicts, its last checkpoint closes epoch 2.
    predictor = load(run)
    probs = predictor.predict(sorted((sample_data / "test").iterdir())[:3])
    assert len(probs) == 3 and all(abs(sum(p["probabilities"].values()) - 1) < 1e-5 for p in probs)
    assert checkpoint.latest(str(run), say=lambda *a: None).epoch == 2
    # The subset: 80 images drawn with the seed, recorded, and the same when drawn again.
    split = json.loads((run / "split.json").read_text())
    assert split["limit_images"] == {"images": 80, "of": 120, "seed": 42}
    listed = discover(str(sample_data), task=AUTO)
    again, _ = limit(listed, 80, 42)
    rel = sorted(p.split("/data/", 1)[-1].removeprefix("train/") for p in again.paths)
    recorded = sorted(p.removeprefix("train/") for p in split["train"] + split["val"])
    assert len(recorded) == 80 and recorded == rel


def test_limit_images_is_a_seeded_subset_in_listing_order(sample_data):
    listed = discover(str(sample_data), task=AUTO)
    first, rec = limit(listed, 30, 5)
    second, _ = limit(listed, 30, 5)
    other, _ = limit(listed, 30, 6)
    assert rec == {"images": 30, "of": 120, "seed": 5}
    assert list(first.paths) == list(second.paths) and list(first.paths) != list(other.paths)
    index = {p: i for i, p in enumerate(listed.paths)}
    positions = [index[p] for p in first.paths]
    assert positions == sorted(positions) and len(set(positions)) == 30
    assert np.array_equal(first.labels, listed.labels[positions])
    everything, rec = limit(listed, 500, 5)
    assert len(everything) == 120 and rec["images"] == 120
    assert limit(listed, None, 5) == (listed, None)


def test_max_steps_and_limit_images_below_one_are_refused_in_one_line(sample_data, capsys):
    for flag in ("--max-steps", "--limit-images"):
        assert main(["train", "--data", str(sample_data), flag, "0"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"argument {flag}: must be a positive integer" in err


def test_max_steps_below_one_from_the_api_or_a_config_file_is_refused_before_the_run_folder(sample_data, tmp_path):
    from visiontune import TrainConfig, UserError, train

    run = tmp_path / "never"
    with pytest.raises(UserError, match="--max-steps must be a positive integer, got 0"):
        train(TrainConfig(data=str(sample_data), model="resnet18", weights="none", max_steps=0, output_dir=str(run)))
    with pytest.raises(UserError, match="--limit-images must be a positive integer, got -3"):
        limit(discover(str(sample_data), task=AUTO), -3, 0)
    assert not run.exists()
