"""The end-of-epoch files are written in the background; a run killed while they are written resumes to the
same files, and the writer never runs two jobs at once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from trainrun import PYTHON, TINY, env_for, run, start, wait_for
from visiontune.data.sample import make_sample_data
from visiontune.errors import UserError
from visiontune.runs.records import BackgroundWrites

# Loaded by the killed run only: saving best.safetensors takes a minute, long after the epoch's checkpoint.
SLOW_SAVE = """
from visiontune.runs import records
_save = records.save_model
def save_model(*args, **kw):
    import time
    time.sleep(60)
    return _save(*args, **kw)
records.save_model = save_model
"""


def _numbers(path) -> list:
    if path.suffix == ".json":
        return [
            (r["epoch"], *(r[p][k] for p in ("train", "val") for k in ("loss", "accuracy", "images")))
            for r in json.loads(path.read_text())
        ]
    return [line.split(",")[:5] for line in path.read_text().splitlines()]


def test_jobs_run_one_at_a_time_in_order_and_errors_surface():
    writes, log, running = BackgroundWrites(), [], []

    def job(i):
        def go():
            running.append(i)
            assert len(running) == 1  # never two at once
            time.sleep(0.02)
            log.append(i)
            running.remove(i)

        return go

    for i in range(5):
        writes.submit(job(i))
    writes.wait()
    assert log == [0, 1, 2, 3, 4]
    assert threading.current_thread().name != "visiontune-writes_0"

    def full():
        raise UserError("no space left")

    writes.submit(full)
    with pytest.raises(UserError, match="no space left"):
        writes.close()


@pytest.mark.slow
def test_a_kill_while_the_epoch_files_are_written_resumes_to_the_same_files(tmp_path, worker_env):
    data = tmp_path / "data"
    make_sample_data(data, per_class=8, test_count=0, seed=2)
    argv = [PYTHON, "-m", "visiontune", "train", "--data", str(data), *TINY, "--epochs", "1"]
    env = env_for(worker_env, tmp_path)
    done = run([*argv, "--output-dir", str(tmp_path / "whole")], env)
    assert done.returncode == 0, done.stderr[-2000:]

    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_SAVE)
    killed = tmp_path / "killed"
    slow_env = {**env, "PYTHONPATH": os.pathsep.join([str(slow), env["PYTHONPATH"]])}
    proc = start([*argv, "--output-dir", str(killed)], slow_env, tmp_path / "killed.log")
    # The epoch's checkpoint is published while best.safetensors is still being written: kill -9 then.
    wait_for(killed / "checkpoints" / "epoch0001-end", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "best.safetensors").exists() and not (killed / "summary.json").exists()

    resumed = run([*argv, "--output-dir", str(killed), "--resume", "auto"], env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = load_file(str(tmp_path / "whole" / "best.safetensors")), load_file(str(killed / "best.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The same numbers in history.json and metrics.csv (timings aside), written by the resumed run.
    for name in ("history.json", "metrics.csv"):
        assert _numbers(killed / name) == _numbers(tmp_path / "whole" / name), name
    assert (killed / "training_results.png").stat().st_size > 0 and (killed / "summary.json").exists()
