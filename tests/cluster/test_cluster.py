"""Clusters: Slurm allocations, Kubernetes variables, c10d rendezvous, batch scripts, workers that die with
their launcher, and a run folder that is not shared.

The multi-process tests run real torch.distributed.run with gloo on this one machine: a "node" is a
launcher process with the variables Slurm or an operator would set, pinned to cores of its own (so its
thread budget is that of a machine of its own), and the nodes meet on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

import zygote
from trainrun import assert_same_weights, checkpoints, env_for, flags, pids_alive, train_argv, wait_for
from visiontune import cli
from visiontune.cli import commands
from visiontune.cluster import launch, slurm
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.training import elastic

# 1 epoch, 8 steps of global batch 4 (2 processes x 2), a checkpoint every 3 steps.
RUN = ["--epochs", "1", "--batch-size", "2", "--save-every-steps", "3", "--strategy", "ddp"]
CORES = sorted(os.sched_getaffinity(0))
PAIR = set(CORES[:2])


def _clean(env: dict) -> dict:
    """The test's environment less any cluster variable of the machine the tests run on."""
    cluster = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {k: v for k, v in env.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_")) and k not in cluster}


def _free_port(lo: int = 15000, hi: int = 25000) -> int:
    for port in range(lo + os.getpid() % 5000, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise AssertionError("no free port")


def _job_id_for_free_port() -> str:
    return f"9{_free_port() - 15000:04d}"  # slurm.port_for_job: 15000 + the last four digits


def _slurm_env(job: str, node: int, nnodes: int, tasks: int = 1, local: int = 0, gpus: int | None = None) -> dict:
    """What Slurm sets in a task of ``srun`` on ``nnodes`` nodes with ``tasks`` per node."""
    env = {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NAME": "visiontune",
        "SLURM_JOB_NUM_NODES": str(nnodes),
        "SLURM_NNODES": str(nnodes),
        "SLURM_JOB_NODELIST": f"127.0.0.[1-{nnodes}]",
        "SLURM_NODELIST": f"127.0.0.[1-{nnodes}]",
        "SLURM_NODEID": str(node),
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": str(nnodes * tasks),
        "SLURM_TASKS_PER_NODE": f"{tasks}(x{nnodes})",
        "SLURM_PROCID": str(node * tasks + local),
        "SLURM_LOCALID": str(local),
    }
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def _start(argv: list[str], env: dict, log: Path, cores: set[int], cwd: Path | None = None) -> subprocess.Popen:
    if zygote.forkable(argv, env):
        log.write_text("")
        return zygote.Forked(argv, env, str(log), str(log), str(cwd) if cwd else None, cores)
    with open(log, "w") as f:  # the child keeps its own copy of the descriptor
        # The cores are set before exec so the launcher sizes its thread budget by them (no threads here yet).
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )  # noqa: PLW1509


def _finish(procs: list[subprocess.Popen], logs: list[Path]) -> list[int]:
    try:
        return [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            print(log.read_text()[-3000:])


def _weights(run_dir: Path):
    from trainrun import final_weights

    return final_weights(run_dir, epochs=1)


@pytest.fixture(scope="module")
def base_env(tmp_path_factory):
    from conftest import _worker_env

    return env_for(_clean(_worker_env()), tmp_path_factory.mktemp("cluster-cache"))


@pytest.fixture(scope="module")
def cluster_reference(tmp_path_factory, small_data, base_env) -> Path:
    """One machine, ``--nproc 2``: what every two-node run below must reproduce exactly."""
    out = tmp_path_factory.mktemp("cluster_reference") / "run"
    proc = _start([*train_argv(small_data, out), *RUN, "--nproc", "2"], base_env, out.parent / "log", PAIR)
    assert _finish([proc], [out.parent / "log"]) == [0]
    return out


# --- the allocation, read ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2]-ib,login5", ["a1-ib", "a2-ib", "login5"]),
        ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
        ("single", ["single"]),
    ],
)
def test_hostlists_expand_as_slurm_writes_them(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


def test_tasks_per_node_and_the_port_of_a_job():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.port_for_job("4711234") == 16234 and slurm.port_for_job("12") == 15012


def _plan(env: dict, **flags) -> launch.Plan:
    return launch.plan(TrainConfig(data="d", strategy="ddp", **flags), env)


def test_one_task_per_node_reads_nodes_rank_address_port_and_gpus():
    p = _plan(
        {
            **_slurm_env("4711234", node=1, nnodes=2, gpus=4),
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_NODELIST": "gpu[07-08]",
        }
    )
    assert (p.source, p.nnodes, p.node_rank, p.nproc, p.master_addr, p.master_port, p.join) == (
        "Slurm",
        "2",
        1,
        4,
        "gpu07",
        16234,
        None,
    )
    # Explicit flags win where they contradict nothing.
    p = _plan(_slurm_env("4711234", node=1, nnodes=2, gpus=4), nproc=2, master_port=23456, master_addr="ib0")
    assert (p.nproc, p.master_port, p.master_addr) == (2, 23456, "ib0")


def test_one_task_per_gpu_joins_with_the_ranks_slurm_gave():
    p = _plan(_slurm_env("4711234", node=1, nnodes=2, tasks=4, local=3, gpus=4))
    assert p.join == {
        "RANK": "7",
        "LOCAL_RANK": "3",
        "GROUP_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "16234",
    }


@pytest.mark.parametrize(
    "flags,env,named",
    [
        ({"nnodes": "3"}, _slurm_env("1", node=0, nnodes=2), ["--nnodes 3", "SLURM_NNODES"]),
        ({"node_rank": 0}, _slurm_env("1", node=1, nnodes=2), ["--node-rank 0", "SLURM_NODEID=1"]),
        ({"nproc": 8}, _slurm_env("1", node=0, nnodes=2, gpus=4), ["--nproc 8", "4 GPU(s)"]),
        ({"nproc": 2}, _slurm_env("1", node=0, nnodes=1, tasks=4), ["--nproc 2", "4 task(s)"]),
        ({"nnodes": "2"}, {"MASTER_ADDR": "h", "WORLD_SIZE": "3", "RANK": "0"}, ["--nnodes 2", "WORLD_SIZE"]),
    ],
)
def test_a_flag_that_contradicts_the_cluster_is_an_error_naming_both(flags, env, named):
    with pytest.raises(UserError) as e:
        _plan(env, **flags)
    assert all(n in str(e.value) for n in named), str(e.value)


def test_kubernetes_variables_need_no_flags():
    classic = _plan({"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}, nproc=1)
    assert (classic.nnodes, classic.node_rank, classic.master_addr, classic.master_port) == (
        "3",
        2,
        "job-master-0",
        23456,
    )
    # PyTorchJob with nprocPerNode: WORLD_SIZE counts processes, PET_* are torchrun's own settings.
    modern = _plan(
        {
            "MASTER_ADDR": "m",
            "MASTER_PORT": "1",
            "WORLD_SIZE": "8",
            "RANK": "1",
            "PET_NNODES": "2",
            "PET_NODE_RANK": "1",
            "PET_NPROC_PER_NODE": "4",
        }
    )
    assert (modern.source, modern.nnodes, modern.node_rank, modern.nproc) == ("Kubernetes", "2", 1, 4)


def test_elastic_nodes_need_the_c10d_rendezvous():
    from torch.distributed.run import get_args_parser

    with pytest.raises(UserError, match="--rdzv-endpoint"):
        _plan({}, nnodes="1:2")
    cfg = TrainConfig(data="d", strategy="ddp", nproc=1, nnodes="1:2", rdzv_endpoint="10.0.0.1:29400")
    args = get_args_parser().parse_args(launch.launcher_argv(cfg, ["--data", "d"]))
    assert (args.rdzv_backend, args.rdzv_endpoint, args.nnodes, args.standalone) == (
        "c10d",
        "10.0.0.1:29400",
        "1:2",
        False,
    )


def test_an_elastic_world_keeps_the_global_batch_of_max_nodes_or_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = TrainConfig(data="d", strategy="ddp", batch_size=2, nnodes="1:4", rdzv_endpoint="h:1")
    for world, accum in ((1, 4), (2, 2), (4, 1)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        assert elastic.global_batch_accumulation(cfg) == accum
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match="the global batch is 8, set by --nnodes 1:4 at 4 nodes; 3 processes"):
        elastic.global_batch_accumulation(cfg)
    # A checkpoint's position is kept in samples: 3 batches of 2 processes are 6 batches of one
    # process accumulating 2 (the same global batch of 4 at --batch-size 2).
    from visiontune.runs.checkpoint import Checkpoint
    from visiontune.runs.resume import compatible

    same = {"split_sha256": "s", "model": "m", "num_classes": 2, "global_batch": 4}
    saved = Checkpoint(
        "runs/x/checkpoints/epoch0001-batch0000003",
        {**same, "epoch": 0, "batch": 3, "world_size": 2, "samples": 12, "config": {"batch_size": 2}},
    )
    assert compatible(saved, {**same, "batch_samples": 2, "grad_accum": 2}).batch == 6


def test_several_slurm_tasks_without_ddp_are_refused(monkeypatch):
    for k, v in _slurm_env("1", node=0, nnodes=1, tasks=2).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(UserError, match="--strategy ddp"):
        launch.join_cluster(TrainConfig(data="d"))


# --- the batch script -------------------------------------------------------------------------------


@pytest.mark.slow
def test_batch_script_parses_requests_the_resources_and_requeues_on_usr1(tmp_path, small_data, capsys):
    out = tmp_path / "job.sbatch"
    assert (
        cli.main(
            [
                "slurm",
                *flags(
                    data=small_data,
                    model="resnet18",
                    epochs=3,
                    nodes=2,
                    gpus_per_node=4,
                    time="4:00:00",
                    partition="gpu",
                    out=out,
                ),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert subprocess.run(["bash", "-n", str(out)], check=False).returncode == 0
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, re.MULTILINE))
    assert sbatch == {
        "job-name": "visiontune",
        "nodes": "2",
        "ntasks-per-node": "1",
        "gpus-per-node": "4",
        "cpus-per-task": "16",
        "time": "4:00:00",
        "partition": "gpu",
        "signal": "USR1@120",
        "requeue": "",
        "open-mode": "append",
        "output": "%x-%j.out",
    }
    # The srun line is a train command visiontune itself accepts, with --resume auto in a fixed folder.
    words = shlex.split(next(line for line in text.splitlines() if line.startswith("srun ")))
    train = words[words.index("train") + 1 :]
    cfg = commands.config_from_args(commands.build_parser().parse_args(["train", *train]))
    assert (cfg.data, cfg.model, cfg.epochs, cfg.strategy, cfg.resume, cfg.output_dir) == (
        str(small_data),
        "resnet18",
        3,
        "ddp",
        "auto",
        "runs/slurm-$SLURM_JOB_ID",
    )
    # Run it with stand-ins for srun and scontrol: exit 138 (stopped by USR1) requeues the job, 0 does not.
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    for code, requeued in ((0, False), (138, True)):
        (bin_ / "srun").write_text(f"#!/bin/sh\nexit {code}\n")
        for f in bin_.iterdir():
            f.chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
        assert subprocess.run(["bash", str(out)], env=env, cwd=tmp_path, check=False).returncode == code
        log = tmp_path / "scontrol.log"
        assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else "")
    common = ["slurm", "--data", str(small_data), "--nodes", "2", "--gpus-per-node", "4"]
    capsys.readouterr()
    assert cli.main([*common, "--time", "1:00"]) == 2
    assert cli.main([*common, "--time", "1:00:00", "--node-rank", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "--time 1:00 leaves no time" in err[0] and "--node-rank has no place" in err[1] and len(err) == 2


# --- real processes -----------------------------------------------------------------------------------


@pytest.mark.distributed
def test_slurm_two_nodes_preempted_by_usr1_and_run_again_end_like_one_uninterrupted_run(
    tmp_path, small_data, base_env, cluster_reference
):
    """One task per node, as the generated script runs: srun starts visiontune on each node, which starts
    the node's process under torch.distributed.run; USR1 to every task, exit 138, the same command again."""
    job, out = _job_id_for_free_port(), tmp_path / "run"
    argv = [*train_argv(small_data, out), *RUN, "--resume", "auto"]
    envs = [{**base_env, **_slurm_env(job, node=n, nnodes=2, gpus=1)} for n in (0, 1)]
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [_start(argv, envs[n], logs[n], {CORES[n % len(CORES)]}) for n in (0, 1)]
    wait_for(out / "checkpoints" / "epoch0001-batch0000003", nodes[0])
    for p in nodes:
        p.send_signal(signal.SIGUSR1)  # Slurm's --signal=USR1@120 signals every task of the step
    assert _finish(nodes, logs) == [138, 138]
    assert not (out / "checkpoints" / "epoch0001-end").exists()
    logs2 = [tmp_path / f"again{n}.log" for n in (0, 1)]
    again = [_start(argv, envs[n], logs2[n], {CORES[n % len(CORES)]}) for n in (0, 1)]
    assert _finish(again, logs2) == [0, 0]
    assert "resuming from" in logs2[0].read_text()
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert_same_weights(_weights(out), _weights(cluster_reference))


@pytest.mark.distributed
def test_slurm_one_task_per_gpu_processes_join_without_a_launcher(tmp_path, small_data, base_env, cluster_reference):
    job, out = _job_id_for_free_port(), tmp_path / "run"
    argv = [*train_argv(small_data, out), *RUN]
    logs = [tmp_path / f"task{t}.log" for t in (0, 1)]
    tasks = [
        _start(argv, {**base_env, **_slurm_env(job, node=0, nnodes=1, tasks=2, local=t, gpus=2)}, logs[t], PAIR)
        for t in (0, 1)
    ]
    end = time.monotonic() + 300  # a harness limit; the check waits for a checkpoint: the tasks are training
    while not checkpoints(out) and all(p.poll() is None for p in tasks):
        assert time.monotonic() < end, "no checkpoint"
        time.sleep(0.05)
    assert all(not psutil.Process(p.pid).children() for p in tasks if p.poll() is None)  # Slurm's processes train
    assert _finish(tasks, logs) == [0, 0]
    assert_same_weights(_weights(out), _weights(cluster_reference))


@pytest.mark.distributed
def test_kubernetes_pods_train_as_one_job_without_flags(tmp_path, small_data, base_env, cluster_reference):
    """Each pod has a working folder of its own and pod 1 reads its own copy of the data at another path (the
    split must still agree); both write into the one shared run folder, and only the first says so."""
    out, port = tmp_path / "run", _free_port(30000, 40000)
    logs = [tmp_path / f"pod{n}.log" for n in (0, 1)]
    data = [small_data, shutil.copytree(small_data, tmp_path / "copy")]
    cwds = [tmp_path / f"pod{n}" for n in (0, 1)]
    pods = []
    for n in (0, 1):
        cwds[n].mkdir()
        env = {
            **base_env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(n),
            "PET_NNODES": "2",
            "PET_NODE_RANK": str(n),
            "PET_NPROC_PER_NODE": "1",
        }
        pods.append(_start([*train_argv(data[n], out), *RUN], env, logs[n], {CORES[n % len(CORES)]}, cwds[n]))
    assert _finish(pods, logs) == [0, 0]
    assert_same_weights(_weights(out), _weights(cluster_reference))
    assert not any(p.is_file() for cwd in cwds for p in cwd.rglob("*"))
    newest = checkpoints(out)[-1]  # each process's share of a checkpoint (its RNG state) is in the run folder
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in newest.iterdir()}
    said = [log.read_text() for log in logs]
    assert "visiontune: outputs in" in said[0] and "visiontune: outputs in" not in said[1]


@pytest.mark.distributed
def test_elastic_job_that_loses_a_node_goes_on_with_a_smaller_world_and_the_same_global_batch(
    tmp_path, small_data, base_env
):
    """c10d rendezvous, --nnodes 1:2. Node B's launcher is killed with SIGKILL after a checkpoint of the
    2-process world: its worker dies with it; node A's worker fails, A restarts it, and the run goes on
    alone with twice the accumulation (same global batch and lr), from the same sample position."""
    out, port = tmp_path / "run", _free_port(40000, 50000)
    argv = [
        *train_argv(small_data, out),
        *RUN,
        "--nproc",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--nnodes",
        "1:2",
        "--max-restarts",
        "3",
    ]
    # torchrun's own settings: A hosts the rendezvous store (it survives); a round waits 2 s for late nodes
    # (one that comes later joins the next round), and a node missing 2 heartbeats 1 s apart is dropped.
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
    envs = [{**base_env, "PET_RDZV_CONF": f"is_host={host},{conf}"} for host in ("true", "false")]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    a, b = (_start(argv, envs[n], logs[n], {CORES[n % len(CORES)]}) for n in (0, 1))
    try:
        end = time.monotonic() + 300
        while not any(
            json.loads((c / "visiontune.json").read_text())["world_size"] == 2
            for c in checkpoints(out)
            if (c / "visiontune.json").exists()
        ):
            assert time.monotonic() < end and a.poll() is None, "no checkpoint of the 2-process world"
            time.sleep(0.05)
        b_workers = [p.pid for p in psutil.Process(b.pid).children(recursive=True)]
        assert b_workers
        b.kill()
        deadline = time.monotonic() + 30
        while pids_alive(b_workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_alive(b_workers) == []  # died with their launcher
    finally:
        rc = _finish([a, b], logs)
    assert rc[0] == 0
    worlds = [json.loads(line) for line in (out / "world.jsonl").read_text().splitlines()]
    assert [w["world_size"] for w in worlds][-2:] == [2, 1], worlds
    assert [(w["grad_accum"], w["global_batch"], w["lr"]) for w in worlds[-2:]] == [(1, 4, 1e-3), (2, 4, 1e-3)]
    assert worlds[-1]["checkpoint_world_size"] == 2 and worlds[-1]["restart"] > worlds[-2]["restart"]
    history = json.loads((out / "history.json").read_text())
    assert history[0]["train"]["images"] == 32  # every sample of the epoch once: the position was converted
    assert json.loads((out / "summary.json").read_text())["world_size"] == 1


@pytest.mark.distributed
def test_a_run_folder_that_is_not_shared_stops_before_training(tmp_path, small_data, base_env):
    """Two machines, each with its own disk: the same relative --output-dir names two different folders."""
    port = _free_port(50000, 60000)
    machines = [tmp_path / "machine0", tmp_path / "machine1"]
    logs = [tmp_path / "m0.log", tmp_path / "m1.log"]
    procs = []
    for n, cwd in enumerate(machines):
        cwd.mkdir()
        argv = [
            *train_argv(small_data, Path("run")),
            *RUN,
            *flags(nproc=1, nnodes=2, node_rank=n, master_addr="127.0.0.1", master_port=port),
        ]
        procs.append(_start(argv, base_env, logs[n], {CORES[n % len(CORES)]}, cwd=cwd))
    assert _finish(procs, logs) == [2, 2]
    text = logs[0].read_text() + logs[1].read_text()
    assert "the run folder run is not shared: rank 1 on" in text and "Epoch 1/" not in text
    assert not any((m / "run" / "checkpoints").exists() for m in machines)
