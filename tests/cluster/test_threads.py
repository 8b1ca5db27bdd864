"""The thread budget: --threads, then OMP_NUM_THREADS, then the cores the affinity and the cgroup quota allow."""

from __future__ import annotations

import os

import pytest

from visiontune.cli import main
from visiontune.cluster import host, launch


def _tree(tmp_path, files: dict[str, str], own: str = "/") -> tuple[str, str]:
    """A fake /sys/fs/cgroup and /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{own}\n")
    return str(root), str(proc)


@pytest.mark.parametrize(
    "files, own, cores",
    [
        ({"cpu.max": "max 100000\n"}, "/", None),  # v2, no limit
        ({"cpu.max": "200000 100000\n"}, "/", 2.0),  # docker --cpus 2
        ({"cpu.max": "150000 100000\n"}, "/", 1.5),  # Kubernetes limits.cpu: 1500m
        # The smallest limit along the process's path wins (a pod in a node slice, say).
        (
            {"cpu.max": "max 100000", "kubepods/cpu.max": "800000 100000", "kubepods/pod1/cpu.max": "300000 100000"},
            "/kubepods/pod1",
            3.0,
        ),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "/", None),  # v1, no limit
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "/", 0.5),  # v1, half a core
        ({}, "/", None),  # no cgroup file system at all
        ({"cpu.max": "garbage\n"}, "/", None),
    ],
)
def test_the_cgroup_quota_is_read_from_v2_and_v1_files(tmp_path, files, own, cores):
    root, proc = _tree(tmp_path, files, own)
    assert host.cgroup_cpu_limit(root, proc) == cores


def test_a_quota_below_the_affinity_bounds_the_cores(monkeypatch):
    monkeypatch.setattr(host, "cgroup_cpu_limit", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert host.core_limits() == {"affinity": 64, "cgroup_quota": 1.5}
    assert host.available_cores() == 2  # 64 cores in the affinity, 1.5 CPUs of quota: two threads
    monkeypatch.setattr(host, "cgroup_cpu_limit", lambda: None)
    assert host.available_cores() == 64


def test_threads_come_from_the_flag_then_omp_num_threads_then_the_cores(monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 8)
    monkeypatch.setattr(launch, "core_limits", lambda: {"affinity": 64, "cgroup_quota": 8.0})
    env = {"LOCAL_WORLD_SIZE": "2"}
    monkeypatch.setattr(launch, "ENV", env)
    assert launch.threads_choice() == (4, "cores (affinity 64, cgroup quota 8) / 2 local processes")
    env["OMP_NUM_THREADS"] = "3"  # a user sharing the machine
    assert launch.threads_choice() == (3, "OMP_NUM_THREADS")
    assert launch.threads_choice(5) == (5, "--threads")
    env["OMP_NUM_THREADS"] = "lots"  # not a count: ignored, as OpenMP itself ignores it
    assert launch.threads_choice()[0] == 4


@pytest.mark.slow
def test_the_run_records_its_threads_and_what_chose_them(tmp_path, monkeypatch):
    import json

    from trainrun import SQUEEZENET, flags
    from visiontune.data.sample import make_sample_data

    data = tmp_path / "data"
    make_sample_data(data, per_class=6, test_count=0, seed=0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "run"
    argv = ["train", *flags(data=data, output_dir=out, epochs=1, batch_size=4, threads=1, no_progress=True)]
    assert main([*argv, *SQUEEZENET]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["threads"], summary["threads_from"], summary["decode_threads"]) == (1, "--threads", 1)
    assert main([*argv, *SQUEEZENET, "--threads", "0"]) == 2


def test_loader_workers_and_decoding_threads_share_the_process_s_budget(monkeypatch):
    import torch

    from visiontune.cluster.strategy import ProcessSettings, Threads, resolve_threads

    monkeypatch.setattr(launch, "ENV", {})
    monkeypatch.setattr(launch, "available_cores", lambda: 6)
    monkeypatch.setattr(launch, "local_world_size", lambda: 1)
    asked = ProcessSettings(threads=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # On a CPU the model's threads decode the batch in this process: no workers to fight them for the cores.
    assert resolve_threads(asked, None) == Threads(4, "--threads", 0, 4)
    assert resolve_threads(asked, 2) == Threads(4, "--threads", 2, 1)  # each worker decodes with one thread
    assert resolve_threads(ProcessSettings(), 0).intra_op == 6
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # With a GPU the cores decode while it computes: all but one, at most 8.
    assert resolve_threads(asked, None) == Threads(4, "--threads", 3, 1)
    assert resolve_threads(ProcessSettings(threads=32), None).loader_workers == 8
