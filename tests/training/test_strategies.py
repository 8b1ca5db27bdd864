"""single | dp | ddp: real torch.distributed.run with gloo on the CPU, checked against plain torch.

The module fixture ``jobs`` starts, all at once, the same tiny DDP run (2 processes) through every
way of launching it on one machine -- visiontune's own ``--nproc``, ``torchrun``, ``accelerate launch``
-- and the tests read what each left behind (several machines: tests/cluster/test_cluster.py). The split is sized
so that nothing divides evenly: 101 val images (batch 5 per process, 2 processes) and 19 train
images, i.e. 3 full batches of 5 of which the third has no partner on the other rank.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import load_file

import zygote
from conftest import FAST, PYTHON, _worker_env
from trained import independent_eval
from trainrun import SQUEEZENET, flags
from visiontune.cli.commands import main
from visiontune.cluster import checks
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.training import trainer

PER_PROCESS, WORLD, TRAIN, VAL = 5, 2, 19, 101
LR, REFERENCE = 0.01, 5
# timm's test_resnet (a 0.4M-parameter ResNet, BatchNorm and all) in place of FAST's resnet18: the jobs test
# launching, and resnet18's 11M parameters made most of their work (its initialisation, checkpoint and files).
MODEL = "timm/test_resnet"
RUN = [
    *FAST,
    *flags(model=MODEL),
    *flags(epochs=1, batch_size=PER_PROCESS, val_fraction=0.84, lr=LR, scale_lr=True, reference_batch=REFERENCE),
]
CORES = len(os.sched_getaffinity(0))
ACCELERATE = [PYTHON, "-m", "accelerate.commands.accelerate_cli"]  # what the `accelerate` command runs


@dataclass
class Job:
    code: int
    log: str
    run_dir: Path

    def read(self, name: str):
        return json.loads((self.run_dir / name).read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # No OMP_NUM_THREADS: each worker must size its threads as its share of the cores (cores / local processes).
    env = _worker_env()
    env.pop("OMP_NUM_THREADS")
    return env


def _run_all(commands: dict[str, tuple[list[str], Path]], logs: Path, timeout: float = 900) -> dict[str, tuple]:
    """Start every command at once (each in its own process group), wait for all, return (code, log)."""
    procs = {}
    for name, (cmd, cwd) in commands.items():
        cwd.mkdir(parents=True, exist_ok=True)
        log, env = logs / f"{name}.log", _env()
        log.write_text("")
        if zygote.forkable(cmd, env):  # `python -m visiontune`: a fork of a process holding its imports
            procs[name] = zygote.Forked(cmd, env, str(log), str(log), cwd=str(cwd))
            continue
        with open(log, "w") as f:
            procs[name] = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
    out = {}
    for name, proc in procs.items():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent and the workers it started
            proc.wait()
        out[name] = (proc.returncode, (logs / f"{name}.log").read_text())
    return out


API_JOB = f"""
import json, sys
import visiontune
config = visiontune.TrainConfig(
    data=sys.argv[1], output_dir=sys.argv[2], model="{MODEL}", weights="none", image_size=32, progress=False,
    epochs=1, batch_size={PER_PROCESS}, val_fraction=0.84, lr={LR}, scale_lr=True, reference_batch={REFERENCE},
    strategy="ddp", nproc={WORLD},
)
summary = visiontune.train(config)
open(sys.argv[2] + ".returned.json", "w").write(json.dumps(summary))
"""


@pytest.fixture(scope="module")
def jobs(sample_data, tmp_path_factory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("launch")
    train = ["train", "--data", str(sample_data), *RUN]
    commands = {
        "visiontune": (
            [PYTHON, "-m", "visiontune", *train, *flags(strategy="ddp", nproc=WORLD, output_dir=root / "visiontune")],
            root,
        ),
        "torchrun": (
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(WORLD),
                "-m",
                "visiontune",
                *train,
                "--output-dir",
                str(root / "torchrun"),
            ],
            root,
        ),
        # `--cpu` would start one process (Accelerate's multi-CPU mode needs mpirun); `--multi_gpu` runs
        # torch.distributed.run, and visiontune's Accelerator(cpu=True) then joins the processes with gloo.
        "accelerate": (
            [
                *ACCELERATE,
                "launch",
                "--multi_gpu",
                "--num_processes",
                str(WORLD),
                "--num_machines",
                "1",
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                "--main_process_port",
                str(_free_port()),
                "-m",
                "visiontune",
                *train,
                *flags(output_dir=root / "accelerate"),
            ],
            root,
        ),
        # The Python API: the same job, started as the command line starts it (visiontune.train's summary
        # written beside the run folder, to be compared with its summary.json).
        "python": ([PYTHON, "-c", API_JOB, str(sample_data), str(root / "python")], root),
    }
    done = _run_all(commands, root)
    dirs = {
        "visiontune": root / "visiontune",
        "torchrun": root / "torchrun",
        "accelerate": root / "accelerate",
        "python": root / "python",
    }
    return {name: Job(code, log, dirs[name]) for name, (code, log) in done.items()}


@pytest.mark.distributed
def test_ddp_val_metrics_equal_a_single_process_evaluation_of_the_saved_model(jobs, sample_data):
    job = jobs["visiontune"]
    assert job.code == 0, job.log
    summary, history = job.read("summary.json"), job.read("history.json")
    loss, acc, n = independent_eval(job.run_dir, sample_data)
    # Neither 5 per process nor 2 processes divide 101: padding would count 110 (or 105) images.
    assert n == VAL == job.read("split.json")["counts"]["val"]
    assert summary["val_images_counted"] == summary["val_split_size"] == history[0]["val"]["images"] == VAL
    assert summary["best_val_accuracy"] == pytest.approx(acc, abs=1e-9)
    assert summary["best_val_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.distributed
def test_ddp_train_metrics_cover_every_process_and_full_global_batches_only(jobs):
    job = jobs["visiontune"]
    assert job.code == 0, job.log
    history = job.read("history.json")
    # 19 images = 3 full batches of 5; the third has no partner batch, so it is dropped, not run by
    # one rank alone (which would hang the other in the gradient all-reduce).
    steps = (TRAIN // PER_PROCESS) // WORLD
    assert history[0]["train"]["images"] == steps * PER_PROCESS * WORLD == 10
    assert job.read("summary.json")["train_split_size"] == TRAIN


@pytest.mark.distributed
def test_setup_is_printed_and_recorded(jobs):
    job = jobs["visiontune"]
    assert job.code == 0, job.log
    assert f"batch {PER_PROCESS} per process, global batch {PER_PROCESS * WORLD}, lr 0.02 " in job.log
    setup, summary = job.read("config.json")["setup"], job.read("summary.json")
    expected = {
        "strategy": "ddp",
        "world_size": WORLD,
        "per_process_batch": PER_PROCESS,
        "global_batch": PER_PROCESS * WORLD,
        "lr": LR * PER_PROCESS * WORLD / REFERENCE,
    }
    for record in (setup, summary):
        assert {k: record[k] for k in expected} == expected
        assert len(record["devices"]) == WORLD and all(d.startswith("cpu") for d in record["devices"])
    # Threads: cores / processes on this machine, set by visiontune's launcher for its workers; fewer when
    # other work was running on the machine as the launcher chose (launch.threads_choice).
    assert 1 <= setup["threads"] <= max(1, CORES // WORLD)
    # On a CPU no loader processes compete with the model: each process decodes with its own budget.
    assert (setup["loader_workers"], setup["decode_threads"]) == (0, setup["threads"])


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "python"])
def test_every_launcher_gives_the_same_run(jobs, launcher):
    base, job = jobs["visiontune"], jobs[launcher]
    assert base.code == 0 and job.code == 0, job.log
    a, b = base.read("summary.json"), job.read("summary.json")
    assert (b["strategy"], b["world_size"], b["global_batch"], b["val_images_counted"]) == ("ddp", WORLD, 10, VAL)
    assert b["best_val_accuracy"] == a["best_val_accuracy"]
    assert b["best_val_loss"] == pytest.approx(a["best_val_loss"], rel=1e-5)
    ta, tb = base.read("history.json")[0]["train"], job.read("history.json")[0]["train"]
    assert (tb["images"], tb["accuracy"]) == (ta["images"], ta["accuracy"])
    assert tb["loss"] == pytest.approx(ta["loss"], rel=1e-5)


@pytest.mark.distributed
def test_visiontune_train_in_python_starts_the_job_the_command_line_starts(jobs):
    base, job = jobs["visiontune"], jobs["python"]
    assert job.code == 0, job.log
    returned = json.loads(job.run_dir.with_name("python.returned.json").read_text())
    assert returned == job.read("summary.json") and returned["world_size"] == WORLD  # not one process
    ours, theirs = (load_file(str(j.run_dir / "best.safetensors")) for j in (job, base))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    a, b = base.read("config.json"), job.read("config.json")
    assert {**a["config"], "output_dir": None} == {**b["config"], "output_dir": None}
    assert a["setup"] == b["setup"]


@pytest.mark.slow
def test_dp_on_a_cpu_says_so_and_saves_the_plain_model(sample_data, tmp_path, capsys):
    out = tmp_path / "dp"
    argv = [*flags(data=sample_data), *SQUEEZENET, *flags(epochs=1, batch_size=16, strategy="dp", output_dir=out)]
    assert main(["train", *argv]) == 0
    notices = [line for line in capsys.readouterr().out.splitlines() if "DataParallel" in line]
    assert len(notices) == 1 and "gives no parallelism here" in notices[0]
    state = load_file(str(out / "best.safetensors"))
    assert not any(k.startswith("module.") for k in state)
    torchvision.models.get_model("squeezenet1_1", num_classes=2).load_state_dict(state)  # strict: every key fits
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["devices"]) == ("dp", 1, ["cpu"])
    loss, acc, n = independent_eval(out, sample_data)
    assert (summary["best_val_accuracy"], summary["val_images_counted"]) == (pytest.approx(acc, abs=1e-9), n)
    assert summary["best_val_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="SyncBatchNorm is refused on CPU-only machines only")
def test_sync_batchnorm_on_a_cpu_is_one_line_before_any_worker(sample_data, tmp_path, capsys):
    out = tmp_path / "r"
    assert (
        main(["train", *flags(data=sample_data), *FAST, *flags(strategy="ddp", sync_batchnorm=True, output_dir=out)])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sync-batchnorm needs GPUs" in err[0]
    assert not out.exists()


def test_a_launcher_that_overrides_a_flag_says_so(monkeypatch, capsys):
    cfg = TrainConfig(data="d", nproc=4)
    for k, v in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    checks.check(cfg)
    assert "--nproc 4 ignored: the launcher started 2 process(es)" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    checks.check(cfg)
    assert capsys.readouterr().out == ""  # one note per job


def test_accelerate_cpu_launch_of_one_process_is_pointed_out(monkeypatch, capsys):
    # What `accelerate launch --cpu --num_processes 2` gives a script when mpirun is not used.
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    checks.check(TrainConfig(data="d"))
    assert "accelerate launch started one process" in capsys.readouterr().out
    checks.check(TrainConfig(data="d", strategy="ddp"))  # visiontune then starts the processes itself
    assert capsys.readouterr().out == ""


def test_machines_whose_data_differ_stop_instead_of_training_on_different_splits(monkeypatch):
    monkeypatch.setattr(trainer, "gather_object", lambda mine: [*mine, "f" * 64])  # what rank 1 would send
    two_processes = type("Accelerator", (), {"num_processes": 2})()
    with pytest.raises(UserError, match="the processes see different data"):
        trainer._same_split_everywhere(two_processes, {"sha256": "0" * 64})
    trainer._same_split_everywhere(two_processes, {"sha256": "f" * 64})  # the same everywhere: goes on
