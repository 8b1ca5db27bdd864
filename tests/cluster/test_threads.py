"""The thread budget: --threads, then OMP_NUM_THREADS, then the cores the affinity and the cgroup quota allow,
cut to those that the machine's other running tasks leave free (read from a /proc/loadavg the tests write)."""

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


def _machine(monkeypatch, tmp_path, cores: int, running: int, own: int = 1) -> None:
    """A machine of ``cores`` cores whose /proc/loadavg says ``running`` tasks are runnable, ``own`` of them
    this process's threads (its /proc/self/task)."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text(f"{running + 0.5:.2f} 1.00 0.50 {running}/321 4242\n")
    tasks = tmp_path / "task"
    for i in range(own + 2):  # and two sleeping threads
        (tasks / str(100 + i)).mkdir(parents=True, exist_ok=True)
        state = "R" if i < own else "S"
        (tasks / str(100 + i) / "stat").write_text(f"{100 + i} (pt main) {state} 1 2 3\n")
    monkeypatch.setattr(host, "LOADAVG", str(loadavg))
    monkeypatch.setattr(host, "OWN_TASKS", str(tasks))
    monkeypatch.setattr(launch, "machine_cores", lambda: cores)
    monkeypatch.setattr(launch, "available_cores", lambda: cores)
    monkeypatch.setattr(launch, "core_limits", lambda: {"affinity": cores, "cgroup_quota": None})
    monkeypatch.setattr(launch, "ENV", {})


def test_the_tasks_running_elsewhere_are_read_from_loadavg_less_this_process_s_own(monkeypatch, tmp_path):
    _machine(monkeypatch, tmp_path, 2, running=4, own=2)
    assert host.running_elsewhere(interval=0) == 2
    _machine(monkeypatch, tmp_path, 2, running=1, own=1)  # only the reader itself
    assert host.running_elsewhere(interval=0) == 0
    (tmp_path / "loadavg").write_text("garbage\n")
    assert host.running_elsewhere(interval=0) is None
    monkeypatch.setattr(host, "LOADAVG", str(tmp_path / "absent"))  # no /proc (macOS, Windows)
    assert host.running_elsewhere(interval=0) is None


@pytest.mark.parametrize(
    "cores, running, threads, cut",
    [
        (2, 1, 2, False),  # a quiet machine: every core
        (2, 2, 1, True),  # one busy process beside this one: one thread, none waiting for a descheduled peer
        (2, 3, 1, True),  # two busy processes
        (16, 3, 14, True),  # two busy processes on 16 cores: the 14 they leave
        (16, 1, 16, False),
    ],
)
def test_the_default_threads_are_cut_to_the_cores_other_running_tasks_leave(
    monkeypatch, tmp_path, cores, running, threads, cut
):
    _machine(monkeypatch, tmp_path, cores, running)
    chosen, why = launch.threads_choice()
    assert chosen == threads
    assert ("cut to" in why and "/proc/loadavg" in why) == cut
    assert f"{running - 1} other task" in why
    # What the user asks wins, whatever the load.
    assert launch.threads_choice(cores) == (cores, "--threads")
    launch.ENV["OMP_NUM_THREADS"] = str(cores)
    assert launch.threads_choice() == (cores, "OMP_NUM_THREADS")


@pytest.mark.parametrize(
    "cores, running, decoders, workers, threads",
    [
        (2, 1, 2, 1, 1),  # serve's default on 2 cores: its 2 decoding processes keep theirs
        (16, 1, 2, 1, 14),
        (16, 1, 2, 2, 7),
        (16, 3, 2, 1, 12),  # two busy processes: the 12 they and the decoders leave
        (2, 1, 0, 1, 2),  # decoding in the server's own threads: every core
        (2, 2, 0, 1, 1),  # ... cut by one busy process
    ],
)
def test_a_servers_default_threads_leave_its_decoders_their_cores_and_are_cut_by_the_load(
    monkeypatch, tmp_path, cores, running, decoders, workers, threads
):
    _machine(monkeypatch, tmp_path, cores, running)
    chosen, why = launch.threads_choice(None, workers, reserved=decoders)
    assert chosen == threads
    assert (f"less {decoders} for decoding processes" in why) == bool(decoders)
    assert launch.threads_choice(3, workers, reserved=decoders) == (3, "--threads")


@pytest.mark.parametrize(
    "running, extra, threads, why",
    [
        (1, [], 1, "less 2 for decoding processes"),  # 2 cores, 2 decoders: 1 thread, quiet or not
        (1, ["--decoders", "0"], 2, "0 other tasks running"),  # decoding in its own threads: both cores
        (2, ["--decoders", "0"], 1, "cut to 1: 1 other task running"),  # ... beside a busy process
        (2, ["--threads", "2"], 2, "--threads"),  # what the user asks, whatever the load
    ],
)
def test_serve_chooses_its_threads_from_the_cores_its_decoders_leave_and_the_load(
    monkeypatch, tmp_path, running, extra, threads, why
):
    from visiontune.inference import serve

    _machine(monkeypatch, tmp_path, 2, running)
    started = []
    monkeypatch.setattr(serve, "serve", lambda options: started.append(options) or 0)
    assert main(["serve", "--run", str(tmp_path), *extra]) == 0
    (options,) = started
    # Before, serve took the cores / --workers whatever the load and its decoders: 2 in every case here.
    assert options.threads == threads and why in options.threads_from


def test_threads_come_from_the_flag_then_omp_num_threads_then_the_cores(monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 8)
    monkeypatch.setattr(launch, "core_limits", lambda: {"affinity": 64, "cgroup_quota": 8.0})
    monkeypatch.setattr(launch, "running_elsewhere", lambda: None)  # a system that does not say its load
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


@pytest.mark.slow
def test_a_default_run_beside_a_busy_process_records_one_thread_and_why(tmp_path, monkeypatch, capsys):
    import json

    import torch

    from trainrun import SQUEEZENET, flags
    from visiontune.data.sample import make_sample_data

    data = tmp_path / "data"
    make_sample_data(data, per_class=6, test_count=0, seed=0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _machine(monkeypatch, tmp_path, 2, running=2)  # one busy process beside this one, on 2 cores
    before = torch.get_num_threads()
    out = tmp_path / "run"
    argv = ["train", *flags(data=data, output_dir=out, epochs=1, batch_size=4, no_progress=True), *SQUEEZENET]
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    said = capsys.readouterr().out
    assert "  threads " in said and "cut to 1: 1 other task running on the machine's 2 cores (/proc/loadavg)" in said
    for record in (
        json.loads((out / "summary.json").read_text()),
        json.loads((out / "config.json").read_text())["setup"],
    ):
        assert (record["threads"], record["decode_threads"]) == (1, 1)
        assert "cut to 1" in record["threads_from"]
    assert json.loads((out / "history.json").read_text())[0]["threads"] == 1


def test_loader_workers_and_decoding_threads_share_the_process_s_budget(monkeypatch):
    import torch

    from visiontune.cluster.strategy import ProcessSettings, Threads, resolve_threads

    monkeypatch.setattr(launch, "ENV", {})
    monkeypatch.setattr(launch, "available_cores", lambda: 6)
    monkeypatch.setattr(launch, "local_world_size", lambda: 1)
    monkeypatch.setattr(launch, "running_elsewhere", lambda: 0)  # a quiet machine
    monkeypatch.setattr(launch, "machine_cores", lambda: 6)
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


def test_a_far_slower_epoch_makes_visiontune_choose_its_threads_again(monkeypatch, tmp_path):
    import torch

    from visiontune.cluster.strategy import ProcessSettings, ThreadWatch, resolve_threads

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.get_num_threads()
    try:
        _machine(monkeypatch, tmp_path, 2, running=1)  # quiet at the start
        cores = resolve_threads(ProcessSettings(), None)
        assert (cores.intra_op, cores.adaptive) == (2, True)
        torch.set_num_threads(cores.intra_op)  # as make_accelerator does
        watch = ThreadWatch(cores)
        assert watch.after_epoch(100.0) is None  # the first epoch: nothing to compare with
        assert watch.after_epoch(80.0) is None  # a little slower: not worth a look
        _machine(monkeypatch, tmp_path, 2, running=3)  # two neighbours started
        said = watch.after_epoch(30.0)
        assert torch.get_num_threads() == 1
        assert said.startswith("1 intra-op threads from the next epoch, not 2 (the epoch ran 2.7x slower")
        # Held below the cores' share, the count is looked at after every epoch: the neighbours left.
        assert watch.after_epoch(30.0) is None and torch.get_num_threads() == 1  # still busy
        _machine(monkeypatch, tmp_path, 2, running=1)
        assert watch.after_epoch(40.0).startswith("2 intra-op threads from the next epoch, not 1")
        assert torch.get_num_threads() == 2
        # A count the user chose is never changed.
        _machine(monkeypatch, tmp_path, 2, running=3)
        fixed = ThreadWatch(resolve_threads(ProcessSettings(threads=2), None))
        assert fixed.after_epoch(100.0) is None and fixed.after_epoch(10.0) is None
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_start_up_block_says_the_threads_and_why(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from visiontune.cluster.strategy import resolve_threads
    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import validate
    from visiontune.tasks import SINGLE_LABEL
    from visiontune.training import overview
    from visiontune.training.plan import Plan

    _machine(monkeypatch, tmp_path, 2, running=2)  # one busy neighbour
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    setup = SimpleNamespace(world_size=1, per_process_batch=4, global_batch=4, lr=0.1, devices=["cpu"])
    cfg = validate(TrainConfig(data="d", epochs=1, image_size=32))
    rows = dict(
        overview.rows(
            Plan(cfg, cfg, resolve_threads(cfg, None), setup, SINGLE_LABEL), 8, 2, ["a", "b"], 8, 2, "torchvision"
        )
    )
    assert rows["threads"].startswith(
        "1 for the model (cores (affinity 2) / 1 local process = 2, cut to 1: 1 other task running on the machine's "
        "2 cores (/proc/loadavg)"
    )
    assert "chosen again after an epoch far slower" in rows["threads"]
    assert rows["threads"].endswith("1 thread(s) decode each batch in this process, between steps")
    asked = cfg.replace(threads=2)
    rows = dict(
        overview.rows(
            Plan(asked, asked, resolve_threads(asked, None), setup, SINGLE_LABEL), 8, 2, ["a", "b"], 8, 2, "torchvision"
        )
    )
    assert rows["threads"].startswith("2 for the model (--threads); 2 thread(s) decode")


def test_the_python_api_chooses_its_threads_once_when_the_model_is_loaded(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from visiontune.inference.api import Predictor

    _machine(monkeypatch, tmp_path, 2, running=1)  # quiet when the model is loaded
    predictor = Predictor(SimpleNamespace(batch_size=8))
    _machine(monkeypatch, tmp_path, 2, running=3)  # a call need not look again: each would pay for the look
    assert predictor._config(None).threads == 2
    assert Predictor(SimpleNamespace(batch_size=8))._config(None).threads == 1  # loaded beside two busy processes
    launch.ENV["OMP_NUM_THREADS"] = "2"
    assert Predictor(SimpleNamespace(batch_size=8))._config(None).threads == 2


@pytest.mark.parametrize(
    "files, none",
    [
        ((), True),
        (("null", "tty0", "shm"), True),
        (("nvidiactl", "nvidia0"), False),
        (("kfd",), False),
        (("dxg",), False),
    ],
)
def test_a_machine_without_a_gpus_device_files_has_no_gpu_without_asking_torch(tmp_path, monkeypatch, files, none):
    import sys

    monkeypatch.setattr(sys, "platform", "linux")
    for name in files:
        (tmp_path / name).touch()
    monkeypatch.setattr(host, "DEVICES", str(tmp_path))
    assert host.no_gpu_here() is none
    monkeypatch.setattr(host, "DEVICES", str(tmp_path / "absent"))  # no /dev to read: torch is asked
    assert host.no_gpu_here() is False


def test_the_gpus_counted_are_torchs_count():
    import torch

    assert host.gpus() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
