"""The test tiers, enforced: a test that is not marked `slow` or `distributed` may not start a process or train.

The rule (docs/development.md): a test that trains a model, starts a subprocess or takes more than about 2 s
on 2 cores is marked `@pytest.mark.slow` at the test; one that starts several processes (torch.distributed.run,
gloo) `@pytest.mark.distributed`. What is left is the fast tier, `make test-fast`. The markers sit on the
tests themselves, so a renamed test keeps its tier, and this plugin fails an unmarked test that starts a
process or a training run, in its body or in a fixture it uses (also one made earlier for another test),
with a line saying to mark it.

``VISIONTUNE_TEST_LAUNCH_LOG=FILE``: every Python process the suite starts, at any depth (DDP workers and
their launchers included), appends a line to FILE (``tests/launchlog/sitecustomize.py``), for counting
launches and torch imports.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

HEAVY = ("slow", "distributed")
MARK = "mark it @pytest.mark.slow (or @pytest.mark.distributed when it starts several processes)"


class _Guard:
    """What the running test may do, and what it (or a fixture being made) did."""

    def __init__(self) -> None:
        self.heavy = True  # outside tests (collection, session set-up) anything goes
        self.did: list[str] = []  # what the current phase did that only a marked test may do
        self.making: list[str] = []  # the fixtures being set up, innermost last
        self.heavy_fixtures: dict[str, str] = {}  # fixture name -> what its set-up did

    def saw(self, what: str) -> None:
        for name in self.making:
            self.heavy_fixtures.setdefault(name, what)
        if not self.heavy:
            self.did.append(what)
            # Stop it here too: the process or run would cost the time the fast tier exists to save.
            raise TierError(f"an unmarked (fast-tier) test {what}: {MARK}")


class TierError(BaseException):
    """A BaseException, so that code under test catching Exception does not swallow it."""


GUARD = _Guard()


def _wrap(owner, name: str, what: str) -> None:
    original = getattr(owner, name)

    def guarded(*args, **kwargs):
        GUARD.saw(what)
        return original(*args, **kwargs)

    guarded.__wrapped__ = original
    setattr(owner, name, guarded)


def pytest_configure(config) -> None:
    _wrap(subprocess.Popen, "__init__", "started a subprocess")
    _wrap(multiprocessing.process.BaseProcess, "start", "started a process (multiprocessing)")
    for name in ("fork", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            _wrap(os, name, f"started a process (os.{name})")
    log = os.environ.get("VISIONTUNE_TEST_LAUNCH_LOG")
    if log:
        here = str(Path(__file__).parent / "launchlog")
        os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])


def pytest_collection_finish(session) -> None:
    # A run's epoch loop and the lr sweep: a run stopped by a user error before its first step stays fast.
    # Wrapped after collection: unit tests of the loop (test_engine.py) import the function itself.
    from visiontune.training import engine, lrfind

    _wrap(engine, "train_one_epoch", "trained a model (a run's training epoch)")
    _wrap(lrfind, "sweep", "trained a model (an lr sweep)")


def _marked(item) -> bool:
    return any(item.get_closest_marker(m) for m in HEAVY)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    GUARD.making.append(fixturedef.argname)
    try:
        return (yield)
    finally:
        GUARD.making.pop()


def _guarded(item, phase):
    GUARD.heavy, GUARD.did = _marked(item), []
    try:
        if not GUARD.heavy:
            used = sorted(set(item.fixturenames) & GUARD.heavy_fixtures.keys())
            if used:
                pytest.fail(
                    f"an unmarked (fast-tier) test uses the fixture {used[0]!r}, whose set-up "
                    f"{GUARD.heavy_fixtures[used[0]]}: {MARK}",
                    pytrace=False,
                )
        try:
            result = yield
        except TierError:
            result = None  # reported below, also when the code under test caught it
        if GUARD.did:
            pytest.fail(f"an unmarked (fast-tier) test {GUARD.did[0]} ({phase}): {MARK}", pytrace=False)
        return result
    finally:
        GUARD.heavy, GUARD.did = True, []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item, "in its set-up"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item, "in its body"))
