"""Shared fixtures: tiny data sets made in tmp folders, and the CLI in-process."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from visiontune.sample_data import make_sample_data

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="session", autouse=True)
def _scan_cache_in_tmp(tmp_path_factory):
    """Keep the bad-file scan's cache out of the user's home during tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("scan-cache")))
        yield
