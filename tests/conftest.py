"""Shared fixtures: tiny data sets made in tmp folders, and the CLI in-process."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from visiontune.sample_data import make_sample_data

ROOT = Path(__file__).resolve().parents[1]

# Test tiers. The rule: a test is `distributed` when it starts several processes (torch.distributed.run,
# gloo), and `slow` when it trains a model or runs a subprocess, i.e. takes more than about 2 s on 2
# cores. The hook below marks every test named here, and every test that uses a fixture named here
# (directly or through another fixture); whatever is left is the fast tier, `make test-fast`.
DISTRIBUTED = {
    "jobs", "ddp_baseline", "bench_dir",  # fixtures
    "test_ddp_with_batch_b_matches_one_process_with_batch_2b",
    "test_two_ddp_processes_share_one_cache_built_once",
    "test_two_processes_write_the_same_bytes",
    "test_two_processes_give_exactly_the_same_numbers",
    "test_signal_to_the_launcher_stops_every_worker_at_the_same_step",
}
SLOW = {
    "trained_run", "baseline_run", "logged", "_finished",  # fixtures that train
    "test_run_skips_exactly_the_bad_files_and_trains_on_odd_modes",
    "test_kill_while_writing_a_checkpoint_leaves_a_resumable_run",
    "test_signal_finishes_the_step_checkpoints_it_and_exits",
    "test_nan_loss_stops_with_code_3_and_keeps_the_last_good_checkpoint",
    "test_nan_loss_skip_skips_the_step_and_counts_it",
    "test_dp_on_a_cpu_says_so_and_saves_the_plain_model",
    "test_cosine_schedule_steps_per_optimizer_step_with_accumulation",
    "test_gpu_script_says_there_is_no_gpu_and_exits_0",
    "test_gpu_benchmark_code_runs_tiny_on_a_cpu",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        names = {item.originalname, *item.fixturenames}
        for marker, listed in (("distributed", DISTRIBUTED), ("slow", SLOW)):
            if names & listed:
                item.add_marker(marker)
# Small runs: every test trains at this size so the suite stays fast on 2 cores.
FAST = ["--model", "resnet18", "--weights", "none", "--image-size", "32", "--no-progress"]


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> Path:
    """A synthetic Kaggle-layout set: 60 cats, 60 dogs, 30 test images (read-only for tests)."""
    out = tmp_path_factory.mktemp("sample") / "data"
    make_sample_data(out, per_class=60, test_count=30, seed=0)
    return out


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def worker_env() -> dict[str, str]:
    """Environment for subprocesses: the package importable, one thread each."""
    return _worker_env()


@pytest.fixture(scope="module")
def worker_env_module():
    """The same for this process, for tests whose code starts subprocesses itself."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _worker_env().items():
            mp.setenv(k, v)
        yield


PYTHON = sys.executable


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """40 synthetic images (32 train / 8 val): 8 steps per epoch at batch 4, for kill-and-resume runs."""
    out = tmp_path_factory.mktemp("small") / "data"
    make_sample_data(out, per_class=20, test_count=0, seed=1)
    return out


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory, small_data) -> Path:
    """An uninterrupted single-process run on ``small_data`` (the reference for resumed runs)."""
    import subprocess

    from trainrun import env_for, train_argv

    tmp = tmp_path_factory.mktemp("baseline")
    env = env_for({**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                   "OMP_NUM_THREADS": "1"}, tmp)
    out = tmp / "run"
    done = subprocess.run(train_argv(small_data, out, "--save-every-steps", "3"), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, sample_data) -> Path:
    """Two epochs of resnet18 at 32 px on ``sample_data`` (``trained.train_run``), shared by the train,
    predict, evaluate, export and pipeline tests: read it, never write into it (copy it first)."""
    from trained import train_run

    return train_run(tmp_path_factory.mktemp("trained") / "run", sample_data)


@pytest.fixture(scope="session", autouse=True)
def _scan_cache_in_tmp(tmp_path_factory):
    """Keep the bad-file scan's cache out of the user's home during tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("scan-cache")))
        yield
