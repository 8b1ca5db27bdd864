"""The run folder: one run at a time holds it, a crash frees it, and it is made or refused before any work."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from trainrun import TINY
from visiontune import cli
from visiontune.errors import UserError
from visiontune.loading import jobdata
from visiontune.runs import runlock

HOLD = (
    "import os, sys, time; from visiontune.runs import runlock\n"
    "with runlock.hold(sys.argv[1]):\n"
    # a forked child that outlives the holder, as a DataLoader worker does for a few seconds after a kill -9;
    # 'held' is said once the child runs (its fork handlers have run)
    " ready, up = os.pipe()\n"
    " child = os.fork()\n"
    " if child == 0:\n  os.write(up, b'1'); time.sleep(120); os._exit(0)\n"
    " os.read(ready, 1); print('held', child, flush=True); time.sleep(120)"
)


def _train(data, out, *extra):
    return ["train", "--data", str(data), "--output-dir", str(out), *TINY, *extra]


@pytest.fixture
def no_scan(monkeypatch):
    """Fail the test if training gets as far as the bad-file scan."""

    def scan(*a, **kw):
        raise AssertionError("the scan ran before the run folder was checked")

    monkeypatch.setattr(jobdata, "scan", scan)


def test_a_second_run_into_a_held_folder_is_refused_naming_the_holder(tmp_path, small_data, capsys, no_scan):
    out = tmp_path / "run"
    with runlock.hold(str(out)):  # another open of the lock file, as a second run's would be
        assert cli.main(_train(small_data, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{out} is in use by another visiontune run (pid {os.getpid()} on host {socket.gethostname()})" in err[0]


@pytest.mark.slow
def test_the_lock_of_a_killed_holder_is_free_at_once(tmp_path, worker_env):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=worker_env, stdout=subprocess.PIPE, text=True)
    said, child = holder.stdout.readline().split()
    assert said == "held"
    try:
        with pytest.raises(UserError, match=f"pid {holder.pid} on host"):
            with runlock.hold(str(out)):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(int(child), 0)  # the forked child is still alive...
        with runlock.hold(str(out)):  # ...yet the lock went with the holder: no stale lock, no wait
            assert (out / runlock.LOCK_FILE).read_text().split()[0] == str(os.getpid())
    finally:
        os.kill(int(child), signal.SIGKILL)


@pytest.mark.slow
def test_the_lock_is_released_when_a_run_fails(tmp_path, small_data, capsys):
    out = tmp_path / "run"
    assert cli.main(_train(small_data, out, "--val-fraction", "0.99")) == 2  # refused after the lock was taken
    with runlock.hold(str(out)):
        pass


def test_an_output_dir_that_is_a_file_is_refused_before_the_scan(tmp_path, small_data, capsys, no_scan):
    out = tmp_path / "taken"
    out.write_text("not a folder")
    assert cli.main(_train(small_data, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--output-dir {out} is a file" in err[0], err
    assert cli.main(_train(small_data, out / "sub")) == 2
    assert "cannot create it" in capsys.readouterr().err


def _mount_tmpfs(path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    )


@pytest.mark.slow
def test_a_read_only_output_dir_is_refused_before_the_scan(tmp_path, small_data, capsys, no_scan):
    out = tmp_path / "ro"
    mounted = _mount_tmpfs(out, "ro,size=1m")  # read-only for root too
    if not mounted:
        out.chmod(0o555)  # read-only for anyone but root
        if os.access(out, os.W_OK):
            pytest.skip("cannot make a folder read-only here (root without mount)")
    try:
        assert cli.main(_train(small_data, out)) == 2
    finally:
        if mounted:
            subprocess.run(["umount", str(out)], check=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0] and "choose another --output-dir" in err[0], err
