"""On ``PYTHONPATH`` only when ``VISIONTUNE_TEST_LAUNCH_LOG`` is set (tests/tiers.py): each Python process
appends ``start PID PPID ARGV`` to that file when its interpreter starts, ``fork PID PPID`` when it is a fork of
one (a zygote's run, a forked DDP worker, a loader worker), and ``end PID torch=0|1`` when an interpreter exits
normally."""

import atexit
import os
import sys

_LOG = os.environ.get("VISIONTUNE_TEST_LAUNCH_LOG")


def _write(line: str) -> None:
    with open(_LOG, "a") as f:  # one short write per line: appends from many processes do not interleave
        f.write(line + "\n")


if _LOG:
    _write(f"start {os.getpid()} {os.getppid()} {' '.join(getattr(sys, 'orig_argv', sys.argv))[:300]}")
    os.register_at_fork(after_in_child=lambda: _write(f"fork {os.getpid()} {os.getppid()}"))
    atexit.register(lambda: _write(f"end {os.getpid()} torch={int('torch' in sys.modules)}"))
