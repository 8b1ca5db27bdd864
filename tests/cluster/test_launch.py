"""visiontune's hand-over to torch.distributed.run: what the elastic agent and the workers are given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from trainrun import TINY, env_for, flags, run
from visiontune.cluster.jobplan import LaunchSettings
from visiontune.cluster.launch import launcher_argv, needs_launcher, plan, this_machine_only, without_flags
from visiontune.settings.config import TrainConfig

ARGV = [
    "--data",
    "d",
    "--nproc",
    "1",
    "--batch-size",
    "5",
    "--nnodes=2",
    "--node-rank",
    "1",
    "--master-addr",
    "10.0.0.1",
    "--master-port=29999",
    "--max-restarts",
    "0",
    "--strategy",
    "ddp",
]


def test_without_flags_drops_both_spellings_and_their_values():
    flags = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--max-restarts")
    assert without_flags(ARGV, flags) == ["--data", "d", "--batch-size", "5", "--strategy", "ddp"]


def test_torchrun_reads_a_two_machine_command_as_meant():
    cfg = TrainConfig(
        data="d", strategy="ddp", nproc=1, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29999
    )
    args = get_args_parser().parse_args(launcher_argv(cfg, ARGV))
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        "1",
        "2",
        1,
        "10.0.0.1",
        29999,
    )
    assert not args.standalone and args.module and args.training_script == "visiontune"
    # The workers get the flags as typed: torchrun alone would reject `--nproc` as an ambiguous
    # abbreviation of its `--nproc-per-node`.
    assert args.training_script_args == ["train", *ARGV]


def test_one_machine_rendezvous_on_a_free_port():
    args = get_args_parser().parse_args(launcher_argv(TrainConfig(data="d", strategy="ddp", nproc=3), []))
    assert args.standalone and args.nproc_per_node == "3" and args.nnodes == "1"


@pytest.mark.parametrize(
    "changes,env,expected",
    [
        ({"strategy": "ddp", "nproc": 2}, {}, True),
        ({"strategy": "ddp", "nproc": 1, "nnodes": 2}, {}, True),
        ({"strategy": "ddp", "nproc": 1}, {}, False),
        ({"strategy": "single"}, {}, False),
        ({"strategy": "ddp", "nproc": 2}, {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, False),  # already launched
        ({"strategy": "ddp"}, {"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, False),  # `torchrun --nproc-per-node 1`
    ],
)
def test_needs_launcher(monkeypatch, changes, env, expected):
    for k in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert needs_launcher(TrainConfig(data="d", **changes)) is expected
    # The same answer from the launch settings alone: what they are made of is all the launch reads.
    assert needs_launcher(LaunchSettings.of(TrainConfig(data="d", **changes))) is expected


def test_a_job_of_this_machine_only_plans_from_its_flags_whatever_cluster_it_runs_in():
    """A tuner's trial under a Slurm job or a Kubernetes operator: the allocation's nodes are not the trial's."""
    cfg = TrainConfig(data="d", strategy="ddp", nproc=2)
    slurm = {"SLURM_JOB_ID": "4711", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "1"}
    slurm |= {"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "1"}
    operator = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1", "PET_NNODES": "2"}
    for cluster in (slurm, operator):
        env = {**cluster, "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3", "OMP_NUM_THREADS": "4"}
        assert (plan(cfg, env).nnodes, plan(cfg, env).node_rank) == ("2", 1)  # as the cluster's job
        alone = this_machine_only(env)
        assert alone == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3", "OMP_NUM_THREADS": "4"}
        p = plan(cfg, alone)
        assert (p.nnodes, p.node_rank, p.nproc) == ("1", 0, 2)


def test_a_job_started_from_python_leaves_the_callers_environment_as_it_was(monkeypatch):
    """The agent's thread count and rendezvous opt-out are the workers'; the caller keeps its own values."""
    import torch.distributed.run as torchrun

    from visiontune.cluster import launch

    seen = {}
    monkeypatch.setattr(torchrun, "run", lambda args: seen.update(os.environ))  # the workers would see this
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    before = dict(os.environ)
    settings = LaunchSettings(nproc=2, threads=3, rdzv_endpoint="127.0.0.1:29400", nnodes="1:2")
    assert launch.relaunch(settings, ["--data", "d"]) == 0
    assert seen["OMP_NUM_THREADS"] == "3" and launch.LAUNCHER_PID in seen
    assert seen["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"  # the caller's choice, not overridden
    assert dict(os.environ) == before


@pytest.mark.parametrize(("local", "waits"), [("2", True), ("1", False)])
def test_a_worker_whose_peer_died_waits_for_its_agent_only_beside_local_peers(monkeypatch, local, waits):
    """The agent stops the workers of its machine once it sees one exit; the only worker on its machine lost a
    peer on another one, whose exit no agent here sees: its wait would end only at the time limit."""
    import signal

    from visiontune.cluster import launch

    waited = []
    monkeypatch.setattr(signal, "sigtimedwait", lambda sigs, seconds: waited.append(seconds))
    monkeypatch.setattr(launch, "ENV", {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": local})
    launch.outlast_peer()
    assert waited == ([10.0] if waits else [])


def test_the_launch_settings_of_a_run_are_its_flags_that_place_processes(monkeypatch):
    for k in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    placed = {"nproc": 3, "nnodes": "2", "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29501}
    cfg = TrainConfig(data="d", strategy="ddp", max_restarts=2, threads=4, **placed)
    assert LaunchSettings.of(cfg) == LaunchSettings(True, **placed, max_restarts=2, threads=4)
    assert not LaunchSettings.of(TrainConfig(data="d", strategy="single")).several_processes
    # predict's and evaluate's own --nproc (no training config): one process runs here, two are a job.
    assert not needs_launcher(LaunchSettings(nproc=1), "predict")
    assert needs_launcher(LaunchSettings(nproc=2), "predict")
    assert launcher_argv(LaunchSettings(nproc=2), ["x"], "predict")[:3] == [
        "--nproc-per-node=2",
        "--nnodes=1",
        "--max-restarts=0",
    ]


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--resume", "RESUMED"], "RESUMED"),  # a resumed ddp run goes on writing the folder it resumes
        (["--output-dir", "CHOSEN"], "CHOSEN"),
        ([], None),  # a new timestamped folder, the same for every worker
    ],
)
def test_the_launcher_hands_every_worker_one_run_folder(sample_data, tmp_path, monkeypatch, extra, expected):
    from visiontune import cli
    from visiontune.cluster import launch

    seen = {}
    monkeypatch.setattr(launch, "relaunch", lambda cfg, argv, command="train": seen.update(cfg=cfg, argv=argv) or 0)
    monkeypatch.chdir(tmp_path)
    extra = [str(tmp_path / e) if e.isupper() else e for e in extra]
    assert (
        cli.main(["train", *flags(data=sample_data, model="resnet18", weights="none", strategy="ddp", nproc=2), *extra])
        == 0
    )
    folder = seen["argv"][seen["argv"].index("--output-dir") + 1]
    assert folder == seen["cfg"].output_dir
    if expected:
        assert folder == str(tmp_path / expected)
    else:
        assert folder.startswith("runs/") and len(folder) > len("runs/")


@pytest.mark.parametrize(
    "extra,msg",
    [(["--model", "resnet999"], "unknown model 'resnet999'"), (["--weights", "IMAGENET9K"], "unknown weights")],
)
def test_the_launching_process_refuses_a_bad_model_in_one_line_before_any_worker(
    sample_data, tmp_path, monkeypatch, capsys, extra, msg
):
    from visiontune import cli
    from visiontune.cluster import launch

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "relaunch", lambda *a, **kw: pytest.fail("a worker was started"))
    argv = ["train", *flags(data=sample_data, model="resnet18", weights="none", strategy="ddp", nproc=2), *extra]
    for _ in range(2):  # the first lists torchvision's names, the second reads them from the cache
        assert cli.main([*argv, "--output-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_the_cached_names_are_the_models_the_workers_build(tmp_path):
    from visiontune.models import build, names

    for _ in range(2):  # listed, then read back
        assert names.all_names("torchvision", tmp_path) == build.torchvision_names()
    names.check_model("squeezenet1_1", "none", tmp_path)
    names.check_model("resnet18", str(tmp_path / "weights.safetensors"), tmp_path)  # a file: checked by the workers


# What the launching process of `train --strategy ddp` imports before torch.distributed.run starts the workers.
_LAUNCHER_IMPORTS = """
import sys
from visiontune.cli.commands import main
from visiontune.cluster import launch
launch.relaunch = lambda *a, **kw: print(sorted(m for m in ("torchvision", "timm") if m in sys.modules))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_launching_process_imports_no_model_code(sample_data, tmp_path, worker_env):
    """Each DDP job starts a launching process beside its workers: torchvision's import (seconds) is kept out."""
    import subprocess
    import sys

    from visiontune.models import names

    names.all_names("torchvision", tmp_path)  # listed once on this machine, as after any earlier run
    argv = ["train", *flags(data=sample_data, model="resnet18", weights="none", strategy="ddp", nproc=2)]
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCHER_IMPORTS, *argv, "--output-dir", str(tmp_path / "run")],
        env={**worker_env, "VISIONTUNE_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.distributed
def test_the_workers_of_a_cpu_job_are_forks_of_the_launching_process(small_data, tmp_path, worker_env):
    """One interpreter starts for a DDP job of two: its workers begin holding what it imported (torch)."""
    import json
    import subprocess
    import sys

    log, out = tmp_path / "launches.log", tmp_path / "run"
    argv = [sys.executable, "-m", "visiontune", "train", *TINY, *flags(data=small_data, strategy="ddp", nproc=2)]
    env = {**env_for(worker_env, tmp_path), "VISIONTUNE_TEST_LAUNCH_LOG": str(log)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "launchlog"), env["PYTHONPATH"]])
    done = subprocess.run([*argv, "--output-dir", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    starts = [line for line in log.read_text().splitlines() if line.startswith("start ")]
    assert len(starts) == 1, starts  # the launching process; its two workers started no interpreter
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


# A bug (an exception nothing expects) in rank 1 of a job whose workers are forks of this process.
_A_BUG_IN_RANK_1 = """
import os
import sys
from visiontune.cli.commands import entry
from visiontune.training import engine
real = engine.train_one_epoch
def train_one_epoch(*args, **kwargs):
    if os.environ["RANK"] == "1":
        raise ZeroDivisionError("a bug in rank 1")
    return real(*args, **kwargs)
engine.train_one_epoch = train_one_epoch
sys.exit(entry())
"""


@pytest.mark.distributed
def test_a_bug_in_a_forked_worker_prints_its_traceback_and_the_job_names_the_worker(small_data, tmp_path, worker_env):
    """Raised in a forked worker, an exception reaches only torch's error file: the worker prints it itself."""
    import sys

    argv = ["train", *TINY, *flags(data=small_data, strategy="ddp", nproc=2, output_dir=tmp_path / "run")]
    # `python -c`, forked from a process holding the imports where it can be (tests/zygote.py)
    done = run([sys.executable, "-c", _A_BUG_IN_RANK_1, *argv], env_for(worker_env, tmp_path), timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback (most recent call last)" in done.stderr
    assert "ZeroDivisionError: a bug in rank 1" in done.stderr
    assert "visiontune: worker rank 1 failed with exit code 1 (its output is above)" in done.stderr


# In a process of one thread (a fork of the tests' preloaded process), as the `visiontune` command: which
# threads keep its workers from being forks. Prints the answers, one per line.
_THREADS_AT_THE_FORK = """
import os, threading
import pyarrow as pa
from tqdm import tqdm
from visiontune.cluster import launch
launch.started_by_command_line()
def names():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
pa.array(list(range(100000)))  # pyarrow's allocator (what hf: data uses) has its background thread
bar = tqdm(total=1, file=open(os.devnull, "w"))  # a progress bar starts tqdm's monitor thread
print(sorted(t.name for t in threading.enumerate()), names())
print(launch.can_fork_workers(), sorted(t.name for t in threading.enumerate()), names())
stop = threading.Event()
other = threading.Thread(target=stop.wait, name="other")
other.start()
print(launch.can_fork_workers())
stop.set()
launch.ended(other)  # joined, and its system thread gone
print(launch.can_fork_workers())
"""


@pytest.mark.slow
def test_workers_are_forks_after_hf_data_and_a_progress_bar_but_not_beside_another_thread(tmp_path, worker_env):
    """jemalloc's background thread takes its locks around a fork, and tqdm's monitor (a bar's, which
    ``datasets`` shows while it loads) is ended first; any other thread could hold a lock the child needs."""
    import sys

    from trainrun import run

    done = run([sys.executable, "-c", _THREADS_AT_THE_FORK], env_for(worker_env, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "'tqdm_monitor'" in lines[0] and "'jemalloc_bg_thd'" in lines[0]  # both threads were there
    assert lines[1:] == ["True ['MainThread'] ['jemalloc_bg_thd', 'python']", "False", "True"]
