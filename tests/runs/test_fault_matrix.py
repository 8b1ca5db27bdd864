"""kill -9 at a random step, resume, and end with every tensor of the run nobody interrupted.

Four cases cover {no augmentation, --augment} x {one process, ddp x2} x {0, 1 loader worker} pairwise
(a Latin square: every two of the three factors meet in all their combinations): the run
checkpoints every optimizer step, is SIGKILLed (the launcher's process group; DDP workers, which
torch.distributed.run starts in sessions of their own, must die with it) as soon as the checkpoint
of a seeded random step is on disk -- so the kill lands anywhere in the steps after it, checkpoint
writes included -- and ``--resume auto`` finishes it. Every tensor of the final model and optimizer
must equal the uninterrupted run's. The uninterrupted runs use no loader worker, so the 1-worker cases
also show that where the samples come from does not change the numbers. 16 train images at 32 px, 4 steps an
epoch, 2 epochs. More cases: a single DDP worker killed, which ends the job (--max-restarts 0), continued
by hand, and in that continued job killed again and restarted by the agent (--max-restarts 1); a kill
after the unfreeze of --freeze-epochs with --augment trivial, mixup, cutmix and --grad-accum 2; a DDP
checkpoint resumed on one process (the same sample, not the same bits); and one run stopped by a signal
in each phase (start-up, a step, validation, a checkpoint write, the report), resumed each time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from trainrun import PYTHON, SQUEEZENET, checkpoints, env_for, flags, pids_alive, run, start, wait_for, worker_of
from visiontune import cli
from visiontune.data.sample import make_sample_data
from visiontune.runs import checkpoint, runlock
from visiontune.tasks import SINGLE_LABEL

STEPS_PER_EPOCH, EPOCHS = 4, 2
RUN = [*SQUEEZENET, *flags(timeout=60, epochs=EPOCHS, save_every_steps=1)]
STRATEGY = {"single": flags(batch_size=4), "ddp": flags(strategy="ddp", nproc=2, batch_size=2)}
CASES = [("plain", "single", 0), ("plain", "ddp", 1), ("augment", "single", 1), ("augment", "ddp", 0)]


@pytest.fixture(scope="module")
def matrix_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix") / "data"
    make_sample_data(out, per_class=10, test_count=0, seed=3)  # 16 train / 4 val
    return out


def _argv(data, out, aug: str, strategy: str, workers: int) -> list[str]:
    run = [*RUN, *STRATEGY[strategy], *flags(num_workers=workers), *(["--augment"] if aug == "augment" else [])]
    return [PYTHON, "-m", "visiontune", "train", *flags(data=data, output_dir=out), *run]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, matrix_data, worker_env_module):
    """The final checkpoint folder of an uninterrupted run per (augmentation, strategy), made on first use."""
    done: dict = {}

    def get(aug: str, strategy: str):
        if (aug, strategy) not in done:
            tmp = tmp_path_factory.mktemp(f"ref-{aug}-{strategy}")
            result = run(_argv(matrix_data, tmp / "run", aug, strategy, 0), env_for(dict(os.environ), tmp))
            assert result.returncode == 0, result.stderr[-3000:]
            done[aug, strategy] = _final(tmp / "run")
        return done[aug, strategy]

    return get


def _final(run_dir):
    return run_dir / "checkpoints" / checkpoint.name(EPOCHS, 0)


def _tensors(ckpt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and of the optimizer state, by a flat name."""
    flat = {f"model.{k}": v for k, v in load_file(str(ckpt / "model.safetensors")).items()}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)

    walk("optimizer", torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=True)["state"])
    return flat


@pytest.mark.distributed
@pytest.mark.parametrize("aug,strategy,workers", CASES, ids=[f"{a}-{s}-{w}w" for a, s, w in CASES])
def test_kill_9_at_a_random_step_then_resume_gives_the_uninterrupted_tensors(
    tmp_path, matrix_data, worker_env, uninterrupted, monkeypatch, capsys, aug, strategy, workers
):
    reference = uninterrupted(aug, strategy)
    env = env_for(worker_env, tmp_path)
    out = tmp_path / "run"
    argv = _argv(matrix_data, out, aug, strategy, workers)
    step = random.Random(f"{aug}/{strategy}/{workers}").randint(1, EPOCHS * STEPS_PER_EPOCH - 2)
    proc = start(argv, env, tmp_path / "killed.log")
    wait_for(out / "checkpoints" / checkpoint.name(*divmod(step, STEPS_PER_EPOCH)), proc)
    workers = []
    if strategy == "ddp":  # the launcher holds the run folder; its restartable workers do not
        assert (out / runlock.LOCK_FILE).read_text().split()[0] == str(proc.pid)
        workers = [p.pid for p in psutil.Process(proc.pid).children()]  # the agent's (loader workers are theirs)
        assert len(workers) == 2
    # The launcher's process group. torch.distributed.run starts each worker in a session of its own, so a
    # worker dies with its launcher (a parent-death signal) or trains on as an orphan.
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    end = time.monotonic() + 60  # a harness limit: they die at once, when the loaded machine runs them
    while pids_alive(workers) and time.monotonic() < end:
        time.sleep(0.05)
    orphans = pids_alive(workers)
    for pid in orphans:
        psutil.Process(pid).kill()
    assert orphans == []
    # ...and not because they had finished: orphans that trained on would have written the last checkpoint.
    assert not _final(out).exists(), "the run ended: before the kill, or its workers trained on after it"

    if strategy == "single":  # resumed in this process: it starts from what is on disk, as a new one would
        monkeypatch.setenv("VISIONTUNE_CACHE_DIR", env["VISIONTUNE_CACHE_DIR"])
        assert cli.main([*argv[3:], "--resume", "auto"]) == 0
        said = capsys.readouterr().out
    else:
        resumed = run([*argv, "--resume", "auto"], env)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        said = resumed.stdout
    assert "resuming from" in said
    got, want = _tensors(_final(out)), _tensors(reference)
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ after a kill at step {step}: {differ[:5]}"
    # The per-epoch record continues too, and --keep-last (2) leaves the two newest beside the best model.
    history, expected = (json.loads((d / "history.json").read_text()) for d in (out, reference.parent.parent))
    assert [(h["train"]["images"], h["val"]["accuracy"]) for h in history] == [
        (h["train"]["images"], h["val"]["accuracy"]) for h in expected
    ]
    assert [p.name for p in checkpoints(out)] == [checkpoint.name(1, STEPS_PER_EPOCH - 1), checkpoint.name(EPOCHS, 0)]
    assert (out / "best.safetensors").is_file()


# --- Signals in each phase of a run: one run stopped five times, then ended; its tensors are the uninterrupted ones --


def _signal_on(monkeypatch, owner, name: str, sig: signal.Signals, call: int = 1) -> None:
    """Send ``sig`` to this process as the ``call``-th call of ``owner.name`` begins."""
    real, calls = getattr(owner, name), {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), sig)  # the handler runs before the next line: the signal lands in this phase
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


# A run in a subprocess whose SIGTERM lands while the report is being built, after the last checkpoint:
# there the handlers of the training loop are gone and the signal ends the process as it would any program.
_REPORT_KILLED = """
import os, signal, sys
from visiontune import cli
from visiontune.reports import report
real = report.build
def build(*args, **kwargs):
    html = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return html
report.build = build
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("aug,strategy", [("plain", "single")], ids=["plain-single-signals"])
def test_signals_in_every_phase_stop_resumably_and_the_run_ends_with_the_uninterrupted_tensors(
    tmp_path, matrix_data, worker_env, uninterrupted, monkeypatch, capsys, aug, strategy
):
    from visiontune.training import engine, trainer

    env, out = env_for(worker_env, tmp_path), tmp_path / "run"
    argv = _argv(matrix_data, out, aug, strategy, 0)
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", env["VISIONTUNE_CACHE_DIR"])

    def stopped_run(owner, name: str, sig: signal.Signals, code: int, call: int = 1) -> str:
        """One in-process run of ``--resume auto`` stopped by ``sig`` at a call of ``owner.name``; its stderr."""
        with monkeypatch.context() as m:
            _signal_on(m, owner, name, sig, call)
            # Python's own Ctrl-C handler, as in a terminal: a shell's background job (CI run with `&`,
            # nohup) starts with SIGINT ignored, and a process that starts so keeps ignoring it.
            previous = signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                assert cli.main([*argv[3:], "--resume", "auto"]) == code
            finally:
                signal.signal(signal.SIGINT, previous)
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        return err

    # 1. SIGINT (Ctrl-C) during start-up, as the data screen begins: exit 130, no checkpoint, the folder's lock freed.
    assert stopped_run(trainer, "prepare_data", signal.SIGINT, 130) == ""
    assert checkpoints(out) == []
    # 2. SIGTERM as validation begins: it is finished, the epoch's end saved, and the run says where it stopped.
    err = stopped_run(engine, "evaluate", signal.SIGTERM, 143)
    assert [p.name for p in checkpoints(out)][-1] == checkpoint.name(1, 0)
    assert (
        err.strip() == f"visiontune: stopped by SIGTERM: checkpoint {out / 'checkpoints' / 'epoch0001-end'}; "
        f"continue with --resume auto --output-dir {out}"
    )
    # 3. SIGUSR1 (Slurm's warning) during the second step of epoch 1: that step is finished and saved.
    err = stopped_run(SINGLE_LABEL, "mean_loss", signal.SIGUSR1, 138, call=2)  # the run's plain loss
    assert "stopped by SIGUSR1" in err and checkpoints(out)[-1].name == checkpoint.name(1, 2)
    # 4. SIGTERM while that run writes its next checkpoint: the run exits once that checkpoint is published.
    err = stopped_run(checkpoint, "_fsync_tree", signal.SIGTERM, 143)
    assert f"checkpoint {out / 'checkpoints' / 'epoch0002-batch0000003'};" in err
    assert checkpoint.verify(str(checkpoints(out)[-1]))["optimizer_steps"] == STEPS_PER_EPOCH + 3
    # 5. SIGTERM while the report is built, after the last checkpoint: the process ends by the signal, with
    # the training and summary.json on disk whole and no report (it is built, then written whole, or not at all).
    killed = run([PYTHON, "-c", _REPORT_KILLED, *argv[3:], "--resume", "auto"], env)
    assert killed.returncode == -signal.SIGTERM and "Traceback" not in killed.stderr, killed.stderr
    assert _final(out).is_dir() and json.loads((out / "summary.json").read_text())["epochs"] == EPOCHS
    assert not (out / "report.html").exists()
    # 6. The same command again writes the report and ends, with the uninterrupted run's every tensor and history.
    assert cli.main([*argv[3:], "--resume", "auto"]) == 0
    assert "resuming from" in capsys.readouterr().out and (out / "report.html").is_file()
    got, want = _tensors(_final(out)), _tensors(uninterrupted(aug, strategy))
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []
    assert _record(out) == _record(uninterrupted(aug, strategy).parents[1])


def _record(run_dir) -> list[tuple]:
    """The per-epoch numbers of a run's history.json (its times aside)."""
    history = json.loads((run_dir / "history.json").read_text())
    return [
        (h["lr"], h["train"]["images"], h["train"]["loss"], h["val"]["loss"], h["val"]["accuracy"]) for h in history
    ]


# --- kill -9 with the options that change what a step does, and of one DDP worker -------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("aug,strategy", [("plain", "ddp")], ids=["plain-ddp-killed-workers"])
def test_a_killed_worker_ends_the_job_without_restarts_and_is_restarted_with_them_to_the_uninterrupted_tensors(
    tmp_path, matrix_data, worker_env, uninterrupted, aug, strategy
):
    """One DDP worker SIGKILLed, not the job. With --max-restarts 0 the job ends, nothing left running, and
    --resume auto by hand goes on; in that resumed job (--max-restarts 1) a worker is killed again, and the
    agent starts the workers again, which resume from the newest checkpoint. The run ends exact."""
    env, out, log = env_for(worker_env, tmp_path), tmp_path / "run", tmp_path / "run.log"
    argv = _argv(matrix_data, out, aug, strategy, 0)
    proc = start([*argv, "--max-restarts", "0"], env, log)
    wait_for(out / "checkpoints" / checkpoint.name(0, 2), proc)
    launcher = psutil.Process(proc.pid)
    everyone = [proc.pid] + [p.pid for p in launcher.children(recursive=True)]
    worker_of(launcher, 1).kill()
    rc = proc.wait(timeout=120)  # the agent stops the others (SIGTERM, then SIGKILL after 30 s)
    assert rc != 0 and "visiontune: worker rank 1 failed with exit code -9" in log.read_text()
    assert pids_alive(everyone) == [] and not _final(out).exists()
    # The kill lands during some step after the one waited for: the job may have published a later checkpoint.
    newest = checkpoints(out)[-1]
    assert newest.name >= checkpoint.name(0, 2)

    resumed_log = tmp_path / "resumed.log"  # by hand, as after a job that failed; this time restartable
    proc = start([*argv, "--resume", "auto", "--max-restarts", "1"], env, resumed_log)
    wait_for(out / "checkpoints" / checkpoint.name(1, 1), proc)
    worker_of(psutil.Process(proc.pid), 1).kill()
    assert proc.wait(timeout=600) == 0, resumed_log.read_text()[-3000:]
    said = resumed_log.read_text()
    assert said.count("resuming from") == 2, said[-3000:]  # the job, then its restarted workers
    assert f"resuming from {newest}" in said  # the ended job's newest checkpoint, by hand
    got, want = _tensors(_final(out)), _tensors(uninterrupted(aug, strategy))
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []
    assert _record(out) == _record(uninterrupted(aug, strategy).parents[1])


# What a step does changes with each: head-only steps, then all; a policy of random ops per image; mixed
# images and soft targets; two batches per optimizer step (2 steps an epoch, checkpoints at batches 2 and 4).
CHANGING = flags(freeze_epochs=1, augment="trivial", mixup=0.2, cutmix=1.0, grad_accum=2, keep_last=10)


@pytest.mark.slow
@pytest.mark.parametrize("aug,strategy", [("augment", "single")], ids=["augment-single-unfreeze-mix-accum"])
def test_kill_9_after_the_unfreeze_with_trivial_augment_mixing_and_accumulation_resumes_exactly(
    tmp_path, matrix_data, worker_env, monkeypatch, capsys, aug, strategy
):
    env, out = env_for(worker_env, tmp_path), tmp_path / "run"
    argv = [*_argv(matrix_data, out, "plain", strategy, 0), *CHANGING]
    proc = start(argv, env, tmp_path / "killed.log")
    wait_for(out / "checkpoints" / checkpoint.name(1, 2), proc)  # the first optimizer step after the unfreeze
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not _final(out).exists(), "the run ended before the kill"

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", env["VISIONTUNE_CACHE_DIR"])
    assert cli.main([*argv[3:], "--resume", "auto"]) == 0
    assert "resuming from" in capsys.readouterr().out
    ref = tmp_path / "uninterrupted"
    assert cli.main([*_argv(matrix_data, ref, "plain", strategy, 0)[3:], *CHANGING]) == 0
    got, want = _tensors(_final(out)), _tensors(_final(ref))
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []
    assert _record(out) == _record(ref)
    # The case is what it says: the backbone held still through epoch 0's two steps, and trained after.
    names = {"epoch 0": checkpoint.name(0, 2), "unfrozen": checkpoint.name(1, 0), "end": checkpoint.name(EPOCHS, 0)}
    weights = {k: load_file(str(ref / "checkpoints" / n / "model.safetensors")) for k, n in names.items()}
    backbone = [k for k in weights["end"] if k.startswith("features.")]
    assert backbone and all(torch.equal(weights["epoch 0"][k], weights["unfrozen"][k]) for k in backbone)
    assert not any(torch.equal(weights["unfrozen"][k], weights["end"][k]) for k in backbone)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("aug,strategy", [("plain", "ddp")], ids=["plain-ddp-then-one-process"])
def test_a_ddp_checkpoint_resumed_on_one_process_goes_on_from_the_same_sample(
    tmp_path, matrix_data, uninterrupted, monkeypatch, capsys, aug, strategy
):
    """Same global batch, other world size (2 x 2 -> 1 x 4): promised is the same sample and schedule, not
    the same bits (the sums are taken in another order, and dropout draws from one process's generator)."""
    reference = uninterrupted(aug, strategy).parents[1]
    out, at = tmp_path / "run", checkpoint.name(1, STEPS_PER_EPOCH - 1)  # 12 of the 16 samples of epoch 1
    shutil.copytree(reference / "checkpoints" / at, out / "checkpoints" / at)
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main([*_argv(matrix_data, out, aug, "single", 0)[3:], "--resume", "auto"]) == 0
    assert f"resuming from {out / 'checkpoints' / at} (Epoch 2/{EPOCHS}, after batch 3)" in capsys.readouterr().out
    world = json.loads((out / "world.jsonl").read_text().splitlines()[-1])
    assert (world["world_size"], world["checkpoint_world_size"], world["global_batch"], world["grad_accum"]) == (
        1,
        2,
        4,
        1,
    )
    final = checkpoint.verify(str(_final(out)))
    assert final["optimizer_steps"] == checkpoint.verify(str(_final(reference)))["optimizer_steps"] == 8
    got, want = _record(out), _record(reference)
    assert got[0] == want[0]  # the epoch the checkpoint carried
    assert (got[1][0], got[1][1]) == (want[1][0], want[1][1])  # epoch 1: the same lr, every sample once
