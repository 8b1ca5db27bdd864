"""How the `visiontune` process ends: what an exit promises is kept, the interpreter's teardown is not run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from visiontune.cli.commands import main

# A command line run as `python -m visiontune` runs it, beside what an exit must honour (a thread that is not a
# daemon still writing, an atexit handler), with os._exit recorded.
_SCRIPT = textwrap.dedent(
    """
    import atexit, os, runpy, sys, threading, time
    out = sys.argv.pop(1)

    real_exit = os._exit

    def recorded_exit(code):  # the process's end, without the interpreter's teardown
        with open(out + "/os_exit", "w") as f:
            f.write(str(code))
        real_exit(code)

    os._exit = recorded_exit

    def atexit_handler():
        with open(out + "/atexit", "w") as f:
            f.write("ran")

    atexit.register(atexit_handler)

    def late():
        time.sleep(0.5)
        with open(out + "/thread", "w") as f:
            f.write("done")

    threading.Thread(target=late).start()
    runpy.run_module("visiontune", run_name="__main__", alter_sys=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "code"),
    [(["models"], 0), (["predict", "--data", "/nonexistent", "--model", "/nonexistent"], 2)],
    ids=["ok", "refused"],
)
def test_a_command_ends_without_the_teardown_yet_with_its_code_its_output_its_threads_and_atexit(
    argv, code, tmp_path, capsys
):
    in_process = main(argv)
    expected = capsys.readouterr()
    assert in_process == code
    with open(tmp_path / "stdout", "w") as stdout:  # a file: block-buffered, so a missing flush loses it all
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(tmp_path), *argv],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == code, proc.stderr
    assert (tmp_path / "stdout").read_text() == expected.out
    assert proc.stderr == expected.err
    assert (tmp_path / "thread").read_text() == "done"  # joined before the process ended
    assert (tmp_path / "atexit").read_text() == "ran"
    # Ended by os._exit, after all of the above: the interpreter's teardown (every module's objects deleted,
    # torch's C++ state destroyed) is the time saved. Before, the process returned into that teardown.
    assert (tmp_path / "os_exit").read_text() == str(code)


@pytest.mark.slow
def test_a_profiler_that_runs_visiontune_as_a_module_still_writes_its_profile(tmp_path):
    """`python -m cProfile -m visiontune`: the profiler, not visiontune, owns the process, and writes after it."""
    stats = tmp_path / "models.prof"
    proc = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(stats), "-m", "visiontune", "models"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    import pstats

    assert any(func[2] == "cmd_models" for func in pstats.Stats(str(stats)).stats)
