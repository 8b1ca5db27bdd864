"""The one job entry (training/job.py): what a job started from Python gives its workers, and how it ends.
The job itself, started from Python against the command line's: tests/training/test_strategies.py."""

from __future__ import annotations

import argparse

import pytest
import torch

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


# Run in a fresh interpreter: each refusal, then which of the heavy modules had been imported when it came.
_REFUSALS = r"""
import contextlib, io, json, sys
from visiontune.cli.commands import main

HEAVY = ("torch", "torchvision", "timm", "accelerate", "matplotlib")
seen = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *argv])
    seen.append([code, err.getvalue(), sorted(m for m in HEAVY if m in sys.modules)])
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_a_refused_run_is_refused_before_any_model_code_loads(sample_data, tmp_path, worker_env):
    """A run that cannot start is told so before the model code's imports (torchvision pulls in
    torch.compile's machinery: seconds, and 23 s on a busy machine), and flags or data wrong in themselves
    before torch's (seconds more). Checked by what the process had imported when the one line came, not by a clock."""
    import json
    import subprocess
    import sys

    regress = tmp_path / "regress"
    from visiontune.data.sample import make_regression_data

    make_regression_data(regress, count=8, seed=0)
    out = ["--output-dir", str(tmp_path / "run"), "--weights", "none"]
    cases = [  # in this order: the modules a refusal may import only grow
        (["--data", str(tmp_path / "missing"), *out], "data folder not found", []),
        (["--data", str(sample_data), "--strategy", "fsdp", "--nproc", "2", "--compile", *out], "--compile", []),
        (["--data", str(sample_data), "--fsdp-offload", *out], "--fsdp-offload is an option of", []),
        (["--data", str(regress), "--task", "regress", "--cutmix", "0.5", *out], "--cutmix has no meaning", []),
        (["--data", str(regress), "--task", "regress", "--best-metric", "accuracy", *out], "is not measured on", []),
        (["--data", str(sample_data), "--model", "no_such_model", *out], "unknown model 'no_such_model'", []),
        (["--data", str(sample_data), "--model", "no_such_model", *out[:2]], "unknown model 'no_such_model'", []),
    ]
    if not torch.cuda.is_available():
        # Is there a GPU? The machine's device files answer where they say no; elsewhere torch is asked.
        from visiontune.cluster import host

        asked = [] if host.no_gpu_here() else ["torch"]
        data = ["--data", str(sample_data), *out]
        cases += [
            ([*data, "--mixed-precision", "fp16"], "needs a GPU", asked),
            ([*data, "--strategy", "fsdp", "--fsdp-offload"], "without a GPU", asked),
            ([*data, "--strategy", "ddp", "--sync-batchnorm"], "needs GPUs", asked),
            ([*data, "--strategy", "ddp", "--mixed-precision", "fp16"], "needs a GPU", asked),  # --nproc not given
        ]
    done = subprocess.run(
        [sys.executable, "-c", _REFUSALS, json.dumps([c[0] for c in cases])],
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    for (argv, message, imported), (code, err, heavy) in zip(cases, json.loads(done.stdout.splitlines()[-1])):
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (argv, err)
        assert heavy == imported, (argv, heavy)
    assert not (tmp_path / "run").exists()


# A job of several processes: the workers wrote summary.json, and the launching process reads it back as any
# other run folder's record (runs.runrecords): bounded, each field checked, one line when it is damaged.
@pytest.mark.parametrize(
    "text,says",
    [
        ("[" * 100_000, "is not JSON"),  # before: RecursionError out of json.loads
        ('{"epochs": "two"}', "epochs is 'two'"),  # before: handed to the caller as the run's summary
        ("[]", "expected a JSON object"),
        ('{"epochs": 2}' + " " * 300_000, "more than any run writes"),  # (the bound lowered)
    ],
)
def test_a_damaged_summary_json_after_a_launched_job_is_one_line(tmp_path, monkeypatch, sample_data, text, says):
    from visiontune.cluster import launch
    from visiontune.models import names
    from visiontune.runs import runrecords

    run = tmp_path / "run"
    cfg = validate(TrainConfig(data=str(sample_data), model="resnet18", strategy="ddp", nproc=2))
    cfg = cfg.replace(output_dir=str(run))

    def workers(cfg, argv):  # what the workers left: a summary.json, and exit 0
        (run / "summary.json").write_text(text)
        return 0

    monkeypatch.setattr(names, "check_model", lambda *a: None)
    monkeypatch.setattr(launch, "needs_launcher", lambda *a: True)
    monkeypatch.setattr(launch, "can_fork_workers", lambda: False)
    monkeypatch.setattr(launch, "relaunch", workers)
    monkeypatch.setattr(runrecords, "MAX_RECORD", 200_000)
    with pytest.raises(UserError) as e:
        job.summary_of(job.run(cfg))
    assert str(run / "summary.json") in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_a_launched_jobs_summary_reads_back_checked(tmp_path, monkeypatch, sample_data):
    from visiontune.cluster import launch
    from visiontune.models import names

    run = tmp_path / "run"
    cfg = validate(TrainConfig(data=str(sample_data), model="resnet18", strategy="ddp", nproc=2))
    cfg = cfg.replace(output_dir=str(run))
    monkeypatch.setattr(names, "check_model", lambda *a: None)
    monkeypatch.setattr(launch, "needs_launcher", lambda *a: True)
    monkeypatch.setattr(launch, "can_fork_workers", lambda: False)
    monkeypatch.setattr(launch, "relaunch", lambda cfg, argv: (run / "summary.json").write_text('{"epochs": 2}') and 0)
    assert job.summary_of(job.run(cfg)) == {"epochs": 2}
    (run / "summary.json").unlink()
    monkeypatch.setattr(launch, "relaunch", lambda cfg, argv: 0)  # the workers ended with none written here
    with pytest.raises(UserError, match="without a summary.json"):
        job.summary_of(job.run(cfg))
