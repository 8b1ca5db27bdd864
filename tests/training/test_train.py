"""End to end: `visiontune train` in-process on tiny synthetic data."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import re
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image
from safetensors.torch import load_file

from conftest import FAST, TINY_RESNET
from trained import independent_eval
from trainrun import flags
from visiontune import TrainConfig, train
from visiontune.cli.commands import main
from visiontune.tasks import AUTO
from visiontune.training import trainer


@pytest.fixture(scope="module")
def run(trained_run):
    return trained_run  # 2 epochs, batch 8, lr 0.005 (read-only)


@pytest.mark.slow
def test_every_output_exists_and_loads(run):
    for name in [
        "best.safetensors",
        "classes.json",
        "config.json",
        "split.json",
        "history.json",
        "metrics.csv",
        "training_results.png",
        "summary.json",
    ]:
        assert (run / name).is_file(), name
    assert not (run / "best.pth").exists()  # the same tensors twice only with --save-pth
    assert json.loads((run / "classes.json").read_text()) == ["cat", "dog"]
    state = load_file(str(run / "best.safetensors"))
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)
    torchvision.models.get_model("resnet18", num_classes=2).load_state_dict(state)  # strict: every key fits
    with Image.open(run / "training_results.png") as im:
        assert im.format == "PNG" and im.size[0] > 400
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    # Counted from 1, as the console's "Epoch 1/2" and every other file count.
    assert [(r["epoch"], r["phase"]) for r in rows] == [("1", "train"), ("1", "val"), ("2", "train"), ("2", "val")]
    for r in rows:
        # seconds are written to the millisecond: the rate lies between the images over its bounds
        seconds, rate = float(r["seconds"]), float(r["images_per_s"])
        assert int(r["images"]) / (seconds + 5e-4) - 0.01 <= rate <= int(r["images"]) / max(seconds - 5e-4, 1e-9) + 0.01


@pytest.mark.slow
def test_best_model_reproduces_recorded_val_accuracy_and_learns(run, sample_data):
    summary = json.loads((run / "summary.json").read_text())
    history = json.loads((run / "history.json").read_text())
    loss, acc, n = independent_eval(run, sample_data)
    [best] = [row["val"] for row in history if row["epoch"] == summary["best_epoch"]]  # both counted from 1
    assert n == summary["val_images_counted"] == summary["val_split_size"] == 24
    assert acc == pytest.approx(best["accuracy"], abs=1e-9)
    assert loss == pytest.approx(best["loss"], rel=1e-3, abs=1e-4)
    assert summary["best_val_accuracy"] >= 0.9
    # Train metrics count exactly the samples trained on: 96 images, batch 8, full batches only.
    assert [h["train"]["images"] for h in history] == [96, 96]
    assert summary["strategy"] == "single" and summary["world_size"] == 1 and summary["global_batch"] == 8


@dataclass
class Logged:
    summary: dict
    out: str  # stdout
    err: str  # stderr
    run_dir: Path


@pytest.fixture(scope="module")
def logged(sample_data, tmp_path_factory) -> Logged:
    """One epoch through the Python API with progress on, stderr not a terminal (a line every step),
    the tensorboard tracker when it is installed, and --save-pth."""
    out, err, run_dir = io.StringIO(), io.StringIO(), tmp_path_factory.mktemp("logged") / "r"
    tracker = "tensorboard" if importlib.util.find_spec("tensorboard") else None
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err):
        mp.setenv("VISIONTUNE_PROGRESS_SECONDS", "0")
        summary = train(
            TrainConfig(
                data=str(sample_data),
                model="squeezenet1_1",
                weights="none",
                image_size=32,
                epochs=1,
                batch_size=16,
                output_dir=str(run_dir),
                log_with=tracker,
                save_pth=True,
            )
        )
    return Logged(summary, out.getvalue(), err.getvalue(), run_dir)


@pytest.mark.slow
def test_two_runs_make_the_same_split_and_the_api_returns_the_summary(run, logged, sample_data):
    # Each run's split.json is the split its seed and --split-method make, computed again here: the shared
    # run keeps the shuffle (tests/trained.py), the API run has the stratified default.
    from visiontune.data.sources import discover
    from visiontune.data.split import relative_paths, split_of, split_summary

    images = discover(str(sample_data), task=AUTO)
    for folder, method in ((run, "random"), (logged.run_dir, "stratified")):
        record = json.loads((folder / "split.json").read_text())
        split = split_of(images, 0.2, 42, method)
        assert record["sha256"] == split_summary(split, images.paths, images.root, 42, 0.2)["sha256"]
        assert record["val"] == relative_paths(images.paths, split.val.tolist(), images.root)
    assert logged.summary == json.loads((logged.run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_save_pth_writes_the_same_tensors_for_torch_load(logged):
    pth = torch.load(logged.run_dir / "best.pth", weights_only=True)
    st = load_file(str(logged.run_dir / "best.safetensors"))
    assert pth.keys() == st.keys() and all(torch.equal(pth[k], st[k]) for k in st)


@pytest.mark.slow
def test_epoch_lines_in_the_reference_format(logged):
    out = logged.out
    assert "Epoch 1/1\n----------\n" in out and "global batch 16" in out  # counted from 1
    assert [h["epoch"] for h in json.loads((logged.run_dir / "history.json").read_text())] == [1]  # files: from 1
    assert re.search(r"^train Loss: \d+\.\d{4} Acc: \d\.\d{4}$", out, re.M)
    assert re.search(r"^val Loss: \d+\.\d{4} Acc: \d\.\d{4}$", out, re.M)
    assert re.search(r"^Training complete in \d+m \d+s$", out, re.M)
    assert re.search(r"^Best val Acc: \d\.\d{6}$", out, re.M)


@pytest.mark.slow
def test_the_start_says_the_resolved_setup_and_the_recipe_s_weak_spot(logged):
    start = logged.out.split("Running training\n", 1)[1].split("Epoch ", 1)[0]
    assert "  train images     96\n" in start  # 6 full batches of 16: nothing dropped, nothing said
    for row in (
        "  optimizer steps  6 per epoch x 1 epoch = 6\n",
        "  optimizer        SGD, lr 0.001, momentum 0.9, weight decay 0\n",
        "  lr schedule      constant\n",
        "  augmentation     none\n",
        "  normalisation    blog: mean 0.4883,0.4551,0.417, std 0.2257,0.2211,0.2214\n",
        "  recipe           blog\n",
        # Where each resize choice came from: the size given, squeezenet1_1's own bilinear, no crop.
        "  resize           32 px (--image-size), bilinear interpolation (the torchvision weights' transforms), "
        "no crop: the whole image squashed to the input size (the default for torchvision models)\n",
    ):
        assert row in start
    # From scratch with the blog recipe: one line that names the better one.
    assert start.endswith("from scratch (--weights none) it does worse than --recipe modern (benchmarks/recipe.py)\n")
    recorded = json.loads((logged.run_dir / "config.json").read_text())["overview"]
    assert recorded["optimizer steps"] == "6 per epoch x 1 epoch = 6" and recorded["recipe"] == "blog"
    assert recorded["resize"].startswith("32 px (--image-size), bilinear interpolation")


@pytest.mark.slow
def test_progress_without_a_terminal_is_plain_lines_showing_the_latest_numbers(logged):
    out, err = logged.out, logged.err
    assert "\r" not in err  # no carriage-return redraws in a log file
    train = [line for line in err.splitlines() if line.startswith("train")]
    # 96 images in batches of 16: a line after each of the 6 steps (every 0 s), none before the first.
    assert [re.search(r" (\d)/6 ", line).group(1) for line in train] == list("123456")
    # The last line's running numbers are the epoch's final ones, not those of an earlier step.
    loss, acc = re.search(r"^train Loss: (\S+) Acc: (\S+)$", out, re.M).groups()
    assert f"acc={acc}," in train[-1] and f"loss={loss}]" in train[-1]
    # Beside the phase's lines, the whole run's: epoch, step of all the run's steps, elapsed<ETA.
    run = [line for line in err.splitlines() if line.startswith("run:")]
    assert [
        re.fullmatch(r"run: epoch 1/1, step (\d)/6 \[\d\d:\d\d<\d\d:\d\d\]", line).group(1) for line in run
    ] == list("123456")
    assert len([line for line in err.splitlines() if line.startswith("val")]) == 2  # 24 images, batch 16


@pytest.mark.slow
def test_config_file_then_flags(run, sample_data, tmp_path, monkeypatch):
    # What `train` is handed; no training is needed to see it (train's own config.json: `run`).
    given = []
    monkeypatch.setattr(trainer, "train", lambda cfg, images=None, on_epoch=None: given.append(cfg))
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "resnet18"\nweights = "none"\nimage_size = 32\nepochs = 1\nbatch_size = 32\n'
        "lr = 0.05\nprogress = false\n"
    )
    assert main(["train", "--data", str(sample_data), "--config", str(toml), "--lr", "0.02"]) == 0
    cfg = given[-1]
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.lr, cfg.image_size) == ("resnet18", 1, 32, 0.02, 32)
    # An earlier run's config.json works as --config too, and holds what that run was given.
    written = json.loads((run / "config.json").read_text())["config"]
    assert (written["epochs"], written["batch_size"], written["lr"]) == (2, 8, 0.005)
    assert main(["train", *flags(data=sample_data, config=run / "config.json", output_dir=tmp_path / "r2")]) == 0
    assert given[-1] == TrainConfig(**{**written, "output_dir": str(tmp_path / "r2")})
    assert not (tmp_path / "r2").exists()


@pytest.mark.parametrize("augment,expected", [(True, "flip-crop"), (False, "none")])
def test_an_earlier_version_s_config_json_reads_in_today_s_forms(sample_data, tmp_path, monkeypatch, augment, expected):
    given = []
    monkeypatch.setattr(trainer, "train", lambda cfg, images=None, on_epoch=None: given.append(cfg))
    old = tmp_path / "config.json"  # --augment was a switch and --nnodes a count
    # (no weights to fetch: a run's named weights are fetched before the trainer, whose stand-in this test holds)
    old.write_text(json.dumps({"config": {"model": "resnet18", "weights": "none", "augment": augment, "nnodes": 1}}))
    assert main(["train", *flags(data=sample_data, config=old)]) == 0
    assert (given[-1].augment, given[-1].nnodes) == (expected, "1")


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--data", "/nonexistent/x"], "data folder not found"),
        (["--model", "resnet999"], "unknown model"),
        (["--weights", "IMAGENET9K"], "unknown weights"),
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--epochs", "-1"], "--epochs must be a positive integer"),
        (["--val-fraction", "0.999"], "empty"),
        (["--batch-size", "500"], "fewer than one global batch"),
        (["--strategy", "horovod"], "argument --strategy: invalid choice"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(sample_data, tmp_path, capsys, args, msg):
    base = ["train", "--data", str(sample_data), *FAST, "--epochs", "1", "--output-dir", str(tmp_path / "r")]
    assert main(base + args) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_tensorboard_tracker_logs_the_metrics_and_every_steps_loss_and_lr(logged):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(logged.run_dir.rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent)).Reload()
    hist = json.loads((logged.run_dir / "history.json").read_text())
    # 96 train images / 16 = 6 steps; the epoch's figures are logged at its last step.
    [val] = acc.Scalars("val/accuracy")
    assert val.step == 6 and val.value == pytest.approx(hist[0]["val"]["accuracy"])
    losses, lrs = acc.Scalars("train/step_loss"), acc.Scalars("train/lr")
    assert [s.step for s in losses] == [s.step for s in lrs] == [1, 2, 3, 4, 5, 6]
    # Full batches: the epoch's loss is the mean of its steps' losses.
    assert sum(s.value for s in losses) / 6 == pytest.approx(hist[0]["train"]["loss"], rel=1e-5)
    assert [s.value for s in lrs] == pytest.approx([1e-3] * 6)


@pytest.mark.slow
def test_cosine_schedule_steps_per_optimizer_step_with_accumulation(sample_data, tmp_path):
    out = tmp_path / "r"
    assert (
        main(
            [
                "train",
                *flags(data=sample_data),
                *TINY_RESNET,  # the schedule is the subject, not the model
                *flags(epochs=2, batch_size=16, grad_accum=2, lr=0.1, lr_schedule="cosine", output_dir=out),
            ]
        )
        == 0
    )
    history = json.loads((out / "history.json").read_text())
    # 96 images / 16 = 6 batches = 3 optimizer steps per epoch; T_max = 6 steps.
    assert history[0]["lr"] == pytest.approx(0.1 * (1 + math.cos(math.pi * 3 / 6)) / 2)
    assert history[1]["lr"] == pytest.approx(0.0, abs=1e-12)
    setup = json.loads((out / "config.json").read_text())["setup"]
    assert setup["global_batch"] == 32 and setup["per_process_batch"] == 16


def test_a_choice_from_a_config_file_is_checked_like_the_flag(sample_data, tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text('strategy = "horovod"\n')
    assert main(["train", "--data", str(sample_data), "--config", str(conf)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--strategy must be one of single, dp, ddp, fsdp" in err and len(err.splitlines()) == 1
