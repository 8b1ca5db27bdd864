"""The one job entry (training/job.py): what a job started from Python gives its workers, and how it ends.
The job itself, started from Python against the command line's: tests/training/test_strategies.py."""

from __future__ import annotations

import argparse

import pytest

from visiontune.cli.flags import config_from_args
from visiontune.data import remote
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.training import job


def _parsed(words: list[str]) -> argparse.Namespace:
    from visiontune.cli.commands import build_parser

    return build_parser().parse_args(["train", *words])


@pytest.mark.parametrize("data", ["some/folder", "pipe:cat shards/a.tar"])
def test_the_workers_of_a_job_started_from_python_read_back_its_settings(data, tmp_path, monkeypatch):
    cfg = validate(TrainConfig(data=data, model="resnet18", epochs=3, lr=0.003, strategy="ddp", nproc=2))
    cfg = cfg.replace(output_dir=str(tmp_path / "run"), mean="0.5,0.4,0.3", class_weights="auto")
    for allowed in (None, data):
        monkeypatch.setattr(remote, "_allowed_commands", set())
        remote.allow_command(allowed)
        with job._workers_argv(cfg, None, given_folder=True) as argv:
            # What a worker's command line gives: the same settings, and a command only where this
            # process may run it.
            assert ("--allow-pipe" in argv) == (allowed is not None and data.startswith("pipe:"))
            words = [w for w in argv if w != "--allow-pipe"]
            assert words[words.index("--data") + 1] == data
            assert config_from_args(_parsed(words)) == cfg
            settings = words[words.index("--config") + 1]
        assert not __import__("os").path.exists(settings)  # gone with the job


def test_the_command_lines_workers_get_its_own_arguments_and_the_folder_fixed_for_them():
    cfg = TrainConfig(data="d", output_dir="runs/x")
    with job._workers_argv(cfg, ["--data", "d"], given_folder=False) as argv:
        assert argv == ["--data", "d", "--output-dir", "runs/x"]
    with job._workers_argv(cfg, ["--data", "d", "--output-dir", "runs/x"], given_folder=True) as argv:
        assert argv == ["--data", "d", "--output-dir", "runs/x"]


def test_a_job_from_python_that_failed_raises_and_one_that_ended_gives_its_summary():
    assert job.summary_of(job.Ended(0, {"epochs": 1})) == {"epochs": 1}
    with pytest.raises(UserError, match="ended with exit code 1 "):
        job.summary_of(job.Ended(1, None))
    with pytest.raises(UserError, match="stopped by signal 15 "):
        job.summary_of(job.Ended(143, None))
