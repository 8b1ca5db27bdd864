"""The tier rule is enforced: an unmarked test that starts a process or trains fails, saying to mark it."""

from __future__ import annotations

import os

import pytest

import trainrun
from conftest import ROOT

INNER = """
import subprocess

import pytest

from visiontune.training import engine


@pytest.fixture(scope="module")
def made_by_a_process():
    return subprocess.run(["true"]).returncode


@pytest.mark.slow
def test_marked_may_start_a_process(made_by_a_process):
    assert subprocess.run(["true"]).returncode == 0


def test_unmarked_using_a_fixture_made_by_a_process(made_by_a_process):
    pass


def test_unmarked_starting_a_process():
    subprocess.run(["true"])


def test_unmarked_hiding_the_refusal():
    try:
        subprocess.run(["true"])
    except BaseException:
        pass


def test_unmarked_training():
    engine.train_one_epoch()


def test_unmarked_and_quiet():
    assert 1 + 1 == 2
"""


@pytest.mark.slow
def test_an_unmarked_test_that_starts_a_process_or_trains_fails_saying_to_mark_it(pytester):
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\npytest_plugins = ('tiers',)\n")
    pytester.makeini("[pytest]\nmarkers =\n    slow: trains\n")
    pytester.makepyfile(test_inner=INNER)
    # A pytest of its own, forked from the tests' process that has imported visiontune and torch (tests/zygote.py)
    # rather than a new interpreter, whose imports were most of this test's time.
    argv = [trainrun.PYTHON, "-c", "import sys, pytest; sys.exit(pytest.main())", "-p", "no:cacheprovider"]
    argv += ["-p", "no:xdist", "-rf", f"--basetemp={pytester.path / 'basetemp'}"]
    done = trainrun.run(argv, dict(os.environ), cwd=pytester.path)
    lines = done.stdout.splitlines()
    outcomes = pytest.RunResult.parse_summary_nouns(lines)
    outcomes.pop("warnings", None)  # as assert_outcomes: (a plugin the fork imported before pytest cannot be rewritten)
    assert outcomes == {"passed": 2, "failed": 3, "errors": 1}, done.stdout[-3000:]  # the fixture's: at set-up
    mark = "mark it @pytest.mark.slow (or @pytest.mark.distributed when it starts several processes)"
    for test, why in [
        ("test_unmarked_using_a_fixture_made_by_a_process", "uses the fixture 'made_by_a_process', whose set-up"),
        ("test_unmarked_starting_a_process", "started a subprocess (in its body)"),
        ("test_unmarked_hiding_the_refusal", "started a subprocess (in its body)"),
        ("test_unmarked_training", "trained a model (a run's training epoch) (in its body)"),
    ]:
        header = next(i for i, x in enumerate(lines) if x.startswith("_") and f" {test} " in x)
        said = lines[header + 1]  # the one line the test failed with, no traceback
        assert said.startswith("an unmarked (fast-tier) test ") and why in said and said.endswith(mark), said
