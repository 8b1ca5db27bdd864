"""A trial's pruning hook, and a trial that is a job of several processes (``--strategy ddp --nproc N``).

In one process the tuner hands ``pruning(...)`` to ``train`` as its ``on_epoch``. A trial whose settings
ask for several processes runs as ``visiontune train --config OUT/.trial-NNNN.toml`` under its own launcher
(``run_as_job``), with ``VISIONTUNE_TUNE_TRIAL`` naming the storage, the study, the trial and the pruner:
in the job, ``on_epoch_from_env`` gives every process the same hook, which only the main process calls
(``training.hooks`` hands its answer to the others, so every process stops after the same epoch). The
tuner then reads the run's ``summary.json``. The job is stopped as the tuner is: SIGTERM and SIGUSR1 are
passed on (it checkpoints and stops), and a tuner killed outright takes the job with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from visiontune.cluster import launch
from visiontune.errors import UserError
from visiontune.tuning import TRIAL_ENV


def pruner(name: str, epochs: int):
    import optuna

    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(1, epochs))
    # Two finished trials to compare with, from the first epoch on: tuning budgets are a few epochs.
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)


def epoch_value(row: dict, metric: str) -> float:
    """An epoch's value of the metric, as the run's best model picks it (raw or EMA weights)."""
    from visiontune.runs.records import best_of

    best, which = best_of([row], metric)
    return float(best[which][metric])


def pruning(trial, metric: str, epochs: int, pruner_name: str):
    """``train``'s ``on_epoch`` for ``trial``: report the epoch's value, and end the run where the pruner says."""

    def on_epoch(epoch: int, row: dict) -> str | None:
        trial.report(epoch_value(row, metric), epoch)
        if epoch + 1 < epochs and trial.should_prune():
            return f"pruned by the tuner ({pruner_name} pruner) after epoch {epoch + 1}, trial {trial.number}"
        return None

    return on_epoch


def was_pruned(summary: dict) -> bool:
    return str((summary.get("stopped") or {}).get("reason", "")).startswith("pruned by the tuner")


def on_epoch_from_env():
    """In a trial's job: the pruning hook of the trial ``VISIONTUNE_TUNE_TRIAL`` names (None outside one). The
    study is opened at the first call, in the one process that makes it."""
    spec = os.environ.get(TRIAL_ENV)
    if not spec:
        return None
    made = []

    def on_epoch(epoch: int, row: dict) -> str | None:
        if not made:
            import optuna

            from visiontune.tuning import study

            s = json.loads(spec)
            the_study = optuna.load_study(
                study_name=s["study"], storage=study.open_storage(s["storage"]), pruner=pruner(s["pruner"], s["epochs"])
            )
            made.append(pruning(optuna.trial.Trial(the_study, s["trial_id"]), s["metric"], s["epochs"], s["pruner"]))
        return made[0](epoch, row)

    return on_epoch


def die_with_tuner() -> None:
    """In a trial's job, the process the tuner started: SIGKILLed when the tuner dies (as a launcher, it takes
    its workers with it: they die with their launcher)."""
    spec = os.environ.get(TRIAL_ENV)
    if not spec or launch.is_worker() or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != json.loads(spec).get("tuner"):
        os._exit(128 + signal.SIGKILL)  # the tuner died before the line above took effect


def run_as_job(
    settings_toml: str, run_dir: str, out: str, number: int, spec: dict, quiet=contextlib.nullcontext
) -> int:
    """Train the trial as a job of its own; its exit code. ``settings_toml``: the trial's settings (best.toml's
    form), written to ``OUT/.trial-NNNN.toml`` for the job's ``--config``. ``quiet()``: the tuner's own thread
    (the trial's heartbeat) paused while the job starts, so that on a CPU machine the job can be a fork of
    the tuner (``launch.can_fork_workers``), started holding its imports; otherwise a new interpreter."""
    config = Path(out, f".trial-{number:04d}.toml")
    config.write_text(settings_toml)
    argv = ["train", "--config", str(config), "--output-dir", run_dir]
    # A job of this machine alone, whatever allocation the tuner runs in (``launch.this_machine_only``).
    env = {**launch.this_machine_only(os.environ), TRIAL_ENV: json.dumps({**spec, "tuner": os.getpid()})}
    with quiet():
        forked = launch.can_fork_workers()
        job = (
            launch.ForkedCommand(argv, env)
            if forked
            else subprocess.Popen([sys.executable, "-m", "visiontune", *argv], env=env)
        )
    # Ctrl-C reaches the job itself (one process group); a signal sent to the tuner alone is passed on.
    forward = lambda signum, _frame: job.send_signal(signum)  # noqa: E731
    before = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return job.wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if job.poll() is None:
            job.kill()


def outcome(code: int, number: int) -> None:
    """A job's exit code as the in-process trial's would end: nothing (0), a non-finite loss, a signal or an error."""
    from visiontune.cluster.signals import RunStopped
    from visiontune.training.engine import NonFiniteLoss

    if code == 0:
        return
    if code == 3:
        raise NonFiniteLoss(f"trial {number}: the training loss became non-finite (its output is above)")
    if code > 128 or code < 0:
        raise RunStopped(f"trial {number}: its job was stopped by a signal", code if code > 0 else 128 - code)
    raise UserError(f"trial {number}: its training job ended with exit code {code} (its output is above)")
