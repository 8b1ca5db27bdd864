"""Shared fixtures: tiny data sets made in tmp folders, and the CLI in-process."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path

import pytest

from visiontune.data.sample import make_sample_data

ROOT = Path(__file__).resolve().parents[1]

# The tiers (`slow`, `distributed`, `browser`) are marked at each test; tests/tiers.py fails an unmarked test
# that starts a process or trains, and can log every process the suite starts.
pytest_plugins = ("tiers", "pytester")


def pytest_configure(config) -> None:
    """Under pytest-xdist every process the suite starts runs one thread, on any core.

    visiontune gives a run as many threads as it has cores; two workers that each thought they had
    all of them would run twice as many OpenMP threads as cores, and OpenMP threads that wait for a
    descheduled peer spin: the tests would take several times their CPU time. One thread each
    (``OMP_NUM_THREADS``, which visiontune reads before the cores and subprocesses inherit) leaves
    no thread waiting on another, and no core pinned to a worker: while one worker's test waits (a
    timeout, a subprocess starting) the other's processes use both cores.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and int(count) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        if "torch" in sys.modules:  # imported before this hook (by a plugin): its pool is sized already
            sys.modules["torch"].set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    # Longest modules first (a rough cost from the tiers), each module's tests together and in order:
    # under pytest-xdist, no worker is then left with a long module at the end while the others idle.
    cost: dict[str, float] = {}
    for item in items:
        weight = 20 if item.get_closest_marker("distributed") else 4 if item.get_closest_marker("slow") else 0.2
        cost[item.module.__name__] = cost.get(item.module.__name__, 0) + weight
    items.sort(key=lambda it: -cost[it.module.__name__])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N`: a module's tests run in one worker, so its module fixtures are made once.

    The fault matrix is the exception: each (augmentation, strategy) pair has its own reference run,
    so its four pairs (the ``[aug-strategy...]`` of a test's id) are spread over the workers.
    """
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, _, test = nodeid.partition("::")
            pair = "-".join(test.partition("[")[2].rstrip("]").split("-")[:2])
            return module + pair if module.endswith("test_fault_matrix.py") else module

    config.option.loadscopereorder = False  # keep the longest-first order above, not most-tests-first
    return ByModule(config, log)


# Small runs: every test trains at this size so the suite stays fast on 2 cores.
FAST = ["--model", "resnet18", "--weights", "none", "--image-size", "32", "--no-progress"]
# Where the model is not the subject (a schedule, a stop, a record): timm's test_resnet, 0.4M parameters.
TINY_RESNET = ["--model", "timm/test_resnet", "--weights", "none", "--image-size", "32", "--no-progress"]


def once(tmp_path_factory, name: str, make, heavy: str | None = None) -> Path:
    """``make(folder)`` once per test session, shared by the pytest-xdist workers (their temporary folders
    share a parent): the first worker to ask makes it while the others wait on its lock, then all read it.
    ``heavy``: what making it does (starts a process, trains), for the tier check in tests/tiers.py, which
    must see it also in the workers that found it made."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed making it left
            folder.mkdir()
            make(folder)
            done.touch()
        elif heavy:
            from tiers import GUARD  # the plugin (pytest_plugins above), imported by pytest

            GUARD.saw(heavy)
    return folder


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> Path:
    """A synthetic Kaggle-layout set: 60 cats, 60 dogs, 30 test images (read-only for tests)."""
    make = lambda out: make_sample_data(out / "data", per_class=60, test_count=30, seed=0)  # noqa: E731
    return once(tmp_path_factory, "sample", make) / "data"


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


@pytest.fixture
def no_scan(monkeypatch):
    """Fail the test if training gets as far as screening the files (the bad-file scan, or the image cache
    that replaces it): the problem must be found before it."""
    from visiontune.loading import jobdata

    def scan(*a, **kw):
        raise AssertionError("the files were screened (scan or image cache): the problem was found too late")

    monkeypatch.setattr(jobdata, "scan", scan)
    monkeypatch.setattr(jobdata, "choose", scan)


PYTHON = sys.executable


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """40 synthetic images (32 train / 8 val): 8 steps per epoch at batch 4, for kill-and-resume runs."""
    make = lambda out: make_sample_data(out / "data", per_class=20, test_count=0, seed=1)  # noqa: E731
    return once(tmp_path_factory, "small", make) / "data"


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory, small_data) -> Path:
    """An uninterrupted single-process run on ``small_data`` (the reference for resumed runs)."""
    from trainrun import env_for, run, train_argv

    def make(tmp: Path) -> None:
        env = env_for(
            {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                "OMP_NUM_THREADS": "1",
            },
            tmp,
        )
        argv = train_argv(small_data, tmp / "run", "--save-every-steps", "3")
        done = run(argv, env, timeout=600)
        assert done.returncode == 0, done.stderr

    return once(tmp_path_factory, "baseline", make, heavy="started a subprocess (baseline_run)") / "run"


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, sample_data) -> Path:
    """Two epochs of resnet18 at 32 px on ``sample_data`` (``trained.train_run``), shared by the train,
    predict, evaluate, export and pipeline tests: read it, never write into it (copy it first)."""
    from trained import train_run

    make = lambda tmp: train_run(tmp / "run", sample_data)  # noqa: E731
    return once(tmp_path_factory, "trained", make, heavy="trained a model (trained_run)") / "run"


def _export(trained_run: Path, out: Path, *extra: str) -> None:
    from visiontune.cli.commands import main

    assert main(["export", "--run", str(trained_run), "--format", "onnx", *extra, "--out", str(out)]) == 0


@pytest.fixture(scope="session")
def exported_onnx(tmp_path_factory, trained_run) -> Path:
    """``visiontune export --format onnx`` of ``trained_run``, made once for the export, deploy, int8 and evaluate
    tests that read a plain ONNX file back (an export takes seconds): read it, never write beside it. Exported
    without ``--out`` from a copy of the run (no checkpoints), so it is that copy's ``best.onnx``."""
    from visiontune.cli.commands import main

    def make(tmp: Path) -> None:
        run = shutil.copytree(trained_run, tmp / "run", ignore=shutil.ignore_patterns("checkpoints"))
        assert main(["export", "--run", str(run), "--format", "onnx"]) == 0

    return once(tmp_path_factory, "onnx", make) / "run" / "best.onnx"


@pytest.fixture(scope="session")
def exported_int8(tmp_path_factory, trained_run) -> Path:
    """``export --format onnx --int8`` of ``trained_run`` on 40 calibration images, any accuracy drop allowed
    (read only, as ``exported_onnx``)."""
    flags = ("--int8", "--max-accuracy-drop", "100", "--calibration-images", "40")
    make = lambda tmp: _export(trained_run, tmp / "model.int8.onnx", *flags)  # noqa: E731
    return once(tmp_path_factory, "int8", make) / "model.int8.onnx"


@pytest.fixture(scope="session", autouse=True)
def _scan_cache_in_tmp(tmp_path_factory):
    """Keep the bad-file scan's cache and the default image cache (``--cache fit``) out of the user's home
    during tests: one folder for the session, so runs on the same data share one image cache. The model
    names are listed in it as on any machine that ran visiontune before (a DDP job's launching process
    reads them)."""
    from visiontune.models.names import all_names

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("scan-cache")))
        all_names("torchvision", os.environ["VISIONTUNE_CACHE_DIR"])
        yield
