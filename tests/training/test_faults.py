"""Faults: signals stop at a checkpoint, non-finite losses.

A dead DDP worker, restarted or not, and signals in each phase of a run are cases of the kill -9 matrix
(test_fault_matrix.py)."""

from __future__ import annotations

import json
import math
import os
import signal

import psutil
import pytest
import torch
from safetensors.torch import load_file

from trainrun import (
    assert_same_weights,
    checkpoints,
    env_for,
    final_weights,
    pids_alive,
    start,
    train_argv,
    wait_for,
)
from visiontune import cli
from visiontune.runs import checkpoint
from visiontune.tasks import SINGLE_LABEL


def _on_train_call(monkeypatch, n: int, action) -> None:
    """Run ``action(loss)`` on the n-th training loss (the run's default criterion, wrapped)."""
    real, calls = SINGLE_LABEL.mean_loss, {"n": 0}

    def wrapped(logits, labels):
        loss = real(logits, labels)
        calls["n"] += 1
        return action(loss) if calls["n"] == n else loss

    monkeypatch.setattr(SINGLE_LABEL, "mean_loss", wrapped)


def _args(small_data, out, *extra):
    # One thread, as baseline_run's OMP_NUM_THREADS=1: sums in another order would differ in the last bit.
    return train_argv(small_data, out, "--threads", "1", *extra)[3:]


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 138)])
def test_signal_finishes_the_step_checkpoints_it_and_exits(
    tmp_path, small_data, baseline_run, monkeypatch, capsys, sig, code
):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"

    def send(loss):
        os.kill(os.getpid(), sig)  # arrives during step 3 (batch index 2), like a scheduler's signal
        return loss

    _on_train_call(monkeypatch, 3, send)
    assert cli.main(_args(small_data, out, "--save-every-steps", "100")) == code
    err = capsys.readouterr().err
    assert f"stopped by {sig.name}" in err and "--resume" in err
    # The step in flight was finished and saved: nothing trained is lost, nothing more was trained.
    assert [p.name for p in checkpoints(out)] == ["epoch0001-batch0000003"]
    assert checkpoint.verify(str(out / "checkpoints" / "epoch0001-batch0000003"))["optimizer_steps"] == 3
    if sig == signal.SIGTERM:  # the resume completes, to the weights of the run nobody stopped
        monkeypatch.undo()
        monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
        assert cli.main([*_args(small_data, out, "--save-every-steps", "100"), "--resume", "auto"]) == 0
        assert_same_weights(final_weights(out), final_weights(baseline_run))


@pytest.mark.slow
def test_nan_loss_stops_with_code_3_and_keeps_the_last_good_checkpoint(tmp_path, small_data, monkeypatch, capsys):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    _on_train_call(monkeypatch, 5, lambda loss: loss * float("nan"))
    assert cli.main(_args(small_data, out, "--save-every-steps", "2")) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite" in err[0], err
    assert [p.name for p in checkpoints(out)] == ["epoch0001-batch0000002", "epoch0001-batch0000004"]
    weights = load_file(str(out / "checkpoints" / "epoch0001-batch0000004" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow
def test_nan_loss_skip_skips_the_step_and_counts_it(tmp_path, small_data, monkeypatch, capsys):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    _on_train_call(monkeypatch, 5, lambda loss: loss * float("nan"))
    assert cli.main(_args(small_data, out, "--on-nan", "skip", "--epochs", "1")) == 0
    history = json.loads((out / "history.json").read_text())
    assert history[0]["train"]["skipped"] == 1
    assert history[0]["train"]["images"] == 28  # 8 batches of 4, less the skipped one
    assert math.isfinite(history[0]["train"]["loss"])
    assert "skipped 1 optimizer step" in capsys.readouterr().out
    weights = final_weights(out, epochs=1)
    assert all(torch.isfinite(w).all() for w in weights.values())


# --- DDP: 2 gloo processes on the CPU under torch.distributed.run -------------------------------------------

DDP = ["--strategy", "ddp", "--nproc", "2", "--batch-size", "2", "--save-every-steps", "3"]  # global batch 4


@pytest.mark.distributed
@pytest.mark.parametrize("sig,code", [(signal.SIGUSR1, 138)])
def test_signal_to_the_launcher_stops_every_worker_at_the_same_step(tmp_path, small_data, worker_env, sig, code):
    env = env_for(worker_env, tmp_path)
    out = tmp_path / "run"
    proc = start([*train_argv(small_data, out), *DDP], env, tmp_path / "run.log")
    wait_for(out / "checkpoints" / "epoch0001-batch0000003", proc)
    workers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(sig)  # what a batch scheduler does: signal the job's main process
    assert proc.wait(timeout=300) == code
    log = (tmp_path / "run.log").read_text()
    newest = checkpoints(out)[-1]
    assert log.count(f"stopped by {sig.name}: checkpoint {newest};") == 1  # said once, by rank 0
    # One checkpoint, both processes' RNG states in it: at the next step, or at step 3's own when the signal came
    # while that one was written (which then stops the job with no second write: hooks.RunHooks.on_step).
    meta = checkpoint.verify(str(newest))
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(meta["files"]) and meta["batch"] >= 3
    assert pids_alive(workers) == []


@pytest.mark.parametrize(
    "output_dir,resume,says",
    [
        ("runs/a", "auto", "continue with --resume auto --output-dir runs/a"),  # the README's way
        (None, "runs/a", "continue with --resume runs/a"),  # no --output-dir: --resume auto would not find it
    ],
)
def test_a_stopped_run_suggests_resume_auto_when_that_continues_it_else_its_folder(output_dir, resume, says):
    from visiontune.settings.config import TrainConfig
    from visiontune.training.hooks import Checkpointer

    cfg = TrainConfig(data="d", output_dir=output_dir, resume=resume)
    stop = Checkpointer(None, cfg, "runs/a", None, None, {}, []).stopped(signal.SIGINT, "runs/a/checkpoints/x")
    assert str(stop) == f"stopped by SIGINT: checkpoint runs/a/checkpoints/x; {says}" and stop.exit_code == 130
