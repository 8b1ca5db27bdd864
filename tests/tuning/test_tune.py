"""``visiontune tune``: one 4-trial SQLite study (pruning, results, best.toml), shared by the tests that read it,
then the multi-process cases (``--parallel 2`` killed with -9 and run again; two tuners on one journal file)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

import trainrun
from visiontune.cli.commands import main
from zygote import LAUNCH_LOG

optuna.logging.set_verbosity(optuna.logging.WARNING)

PYTHON = sys.executable
# timm's test_resnet: a ResNet (BatchNorm, as resnet18) of 0.4M parameters, which learns at ENQUEUED's good rate in
# a tiny run; resnet18's 11M made its checkpoints most of this module's time.
TINY = [
    "--model",
    "timm/test_resnet",
    "--weights",
    "none",
    "--image-size",
    "32",
    "--batch-size",
    "8",
    "--num-workers",
    "0",
    "--no-progress",
    "--threads",
    "1",
]
# lr only: the other settings stay the recipe's, so the trials differ by one number each.
SPACE = "[lr]\nlow = 1e-8\nhigh = 0.1\nlog = true\n"
# A good setting twice, a hopeless one (lr 1e-8: its first epoch's val loss stays the untrained one, far above
# the median of the two complete trials before it, so the median pruner stops it), then the good one a third
# time: its first epoch is the same as theirs, so it is not above their median and it runs to the end. (Two
# different good settings would make the fourth trial's fate depend on which of them a tiny run favours.)
ENQUEUED = [0.005, 0.005, 1e-8, 0.005]
# The multi-process cases test the scheduling of trials, not what they learn: the smaller model, at rates it
# trains at (a diverged trial would fail instead of completing).
SCHEDULING = ["--model", "squeezenet1_1"]
SCHEDULING_SPACE = "[lr]\nlow = 1e-4\nhigh = 1e-2\nlog = true\n"


def _argv(data: Path, out: Path, space: Path, *extra: str) -> list[str]:
    return ["tune", "--data", str(data), "--out", str(out), "--space", str(space), *TINY, *extra]


def load(out: Path, name: str = "visiontune", storage: str | None = None) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=storage or f"sqlite:///{out / 'study.db'}")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, small_data):
    """The study: 4 trials of 2 epochs on ``small_data``, minimising the val loss, one of them pruned."""
    out = tmp_path_factory.mktemp("tune") / "tune"
    out.mkdir()
    space = out.parent / "space.toml"
    space.write_text(SPACE)
    # The trials a user would queue with Optuna's own API before the tuner runs them.
    study = optuna.create_study(study_name="visiontune", storage=f"sqlite:///{out / 'study.db'}", direction="minimize")
    for lr in ENQUEUED:
        study.enqueue_trial({"lr": lr})
    argv = _argv(small_data, out, space, "--trials", "4", "--epochs", "2", "--best-metric", "loss")
    assert main(argv) == 0
    return out, argv


def _history(run_dir: str | Path) -> list[dict]:
    return json.loads(Path(run_dir, "history.json").read_text())


@pytest.mark.slow
def test_a_study_in_sqlite_with_a_trial_pruned_at_an_epoch_boundary(tuned, capsys):
    out, argv = tuned
    trials = load(out).get_trials()
    complete, pruned = TrialState.COMPLETE, TrialState.PRUNED
    assert [t.state for t in trials] == [complete, complete, pruned, complete]
    assert [t.params["lr"] for t in trials] == ENQUEUED
    for t in trials:
        run_dir = Path(t.user_attrs["run_dir"])
        assert run_dir == out / f"trial-{t.number:04d}"
        history, summary = _history(run_dir), json.loads((run_dir / "summary.json").read_text())
        # What Optuna was told after each epoch is the run's own record of that epoch.
        assert t.intermediate_values == {r["epoch"] - 1: r["val"]["loss"] for r in history}  # Optuna's steps: from 0
        if t.state == TrialState.PRUNED:
            assert len(history) == 1 and summary["epochs"] == 1
            assert summary["stopped"]["reason"].startswith("pruned by the tuner (median pruner) after epoch 1")
            assert summary["stopped"]["epochs_done"] == 1
            median = (trials[0].intermediate_values[0] + trials[1].intermediate_values[0]) / 2
            assert t.intermediate_values[0] > median
        else:
            assert len(history) == 2 and "stopped" not in summary
            assert t.value == summary["best_val_loss"] == min(r["val"]["loss"] for r in history)
    assert trials[3].intermediate_values == trials[1].intermediate_values  # the same settings, the same run
    # The results: the table, trials.json and best.toml name the trial with the lowest loss.
    best = min((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    rows = json.loads((out / "trials.json").read_text())
    assert [r["state"] for r in rows] == ["complete", "complete", "pruned", "complete"]
    assert f"trial {best.number}, best val loss" in (out / "best.toml").read_text()
    # The same command again: the study has its 4 trials, so nothing runs and nothing is added.
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert len(load(out).trials) == 4
    assert f"best trial {best.number}: val loss {best.value:.4f}" in printed
    line = next(s for s in printed.splitlines() if s.split()[:2] == ["*", str(best.number)])
    assert "complete" in line


@pytest.mark.slow
def test_best_toml_trains_the_best_trial_again_to_the_same_metrics(tuned, tmp_path):
    out, _ = tuned
    best = load(out).best_trial
    assert main(["train", "--config", str(out / "best.toml"), "--output-dir", str(tmp_path / "again")]) == 0
    again, before = _history(tmp_path / "again"), _history(best.user_attrs["run_dir"])
    metrics = lambda rows: [(r["train"]["loss"], r["train"]["accuracy"], r["val"]) for r in rows]  # noqa: E731
    for rows in (again, before):  # what a second run cannot repeat: its times
        for r in rows:
            r["val"] = {k: v for k, v in r["val"].items() if "seconds" not in k and "per_s" not in k}
    assert len(again) == 2 and metrics(again) == metrics(before)
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["best_val_loss"] == best.value


CHECK = """<script>window.addEventListener("load", () => {
  const bad = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).length;
  document.body.setAttribute("data-images", document.images.length);
  document.body.setAttribute("data-broken", bad);
  const rows = [...document.querySelectorAll("#trials tr[data-trial]")];
  document.body.setAttribute("data-rows", rows.map(r => r.dataset.trial + ":" + r.className).join(","));
  document.body.setAttribute("data-values",
    rows.map(r => r.children[2].dataset.value || "").join(","));
});</script>"""


@pytest.mark.slow
@pytest.mark.browser
def test_tune_html_in_a_headless_browser(tuned, tmp_path):
    import re

    out, _ = tuned
    trials = load(out).get_trials()
    from browser import dump_dom

    page = out / "check.html"  # beside tune.html, so that its relative links resolve alike
    page.write_text((out / "tune.html").read_text().replace("</body>", CHECK + "</body>"))
    done = dump_dom(page, tmp_path / "profile", "--enable-logging=stderr", "--v=0")
    page.unlink()
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line for line in done.stderr.splitlines() if ":CONSOLE" in line] == []
    assert re.search(r'data-images="2"', done.stdout) and re.search(r'data-broken="0"', done.stdout)
    best = load(out).best_trial.number
    kinds = ["pruned" if t.state == TrialState.PRUNED else "best" if t.number == best else "" for t in trials]
    assert f'data-rows="{",".join(f"{t.number}:{k}" for t, k in zip(trials, kinds))}"' in done.stdout
    values = [t.value if t.state == TrialState.COMPLETE else t.intermediate_values[0] for t in trials]
    assert f'data-values="{",".join(repr(v) for v in values)}"' in done.stdout
    assert re.search(r'<table id="importances">.*<th>lr</th>', done.stdout, re.S)


def _env(tmp: Path) -> dict:
    from trainrun import env_for

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    return env_for({**env, "OMP_NUM_THREADS": "1"}, tmp)


def _owners(trials) -> set[int]:
    """The tuner processes that recorded themselves as the trials' owners (a trial asked for by a tuner killed
    before it recorded itself has none: ``study.fail_stale`` fails it after three heartbeats)."""
    return {t.system_attrs["visiontune:owner"]["pid"] for t in trials if "visiontune:owner" in t.system_attrs}


def _wait_gone(pids: set[int], limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < end, f"processes {sorted(pids)} outlived their tuner's kill -9"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# In the tuner that is killed (and its forks): a trial that has trained its epoch waits until the test has seen
# two trials running at once (the file RELEASE), and the third trial waits until it is killed. Neither that
# sight nor the kill can then come too late, however far apart a busy machine puts the test's looks.
HOLD = """
import os, time
from visiontune.tuning import trialjob

real = trialjob.pruning

def pruning(trial, *args):
    report = real(trial, *args)

    def held(epoch, row):
        while trial.number >= 2 or not os.path.exists(RELEASE):
            time.sleep(0.05)
        return report(epoch, row)

    return held

trialjob.pruning = pruning
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_parallel_2_killed_with_9_then_the_same_command_continues_the_study(small_data, tmp_path):
    out, space = tmp_path / "tune", tmp_path / "space.toml"
    space.write_text(SCHEDULING_SPACE)
    argv = [PYTHON, "-m", "visiontune", *_argv(small_data, out, space, "--trials", "3", "--epochs", "1", *SCHEDULING)]
    argv += ["--parallel", "2", "--pruner", "none", "--heartbeat", "1"]
    env = _env(tmp_path)
    hooks, release = tmp_path / "hooks", tmp_path / "release"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(f"RELEASE = {str(release)!r}\n{HOLD}")
    held = {**env, "PYTHONPATH": os.pathsep.join([str(hooks), env["PYTHONPATH"]])}
    proc = trainrun.start(argv, held, tmp_path / "tuner.log")  # a fork of a process holding the imports
    # Kill once two trials have run at once (the --parallel) and one has finished while another runs.
    end, together = time.monotonic() + 300, False
    while True:
        assert proc.poll() is None, "the tuner ended before it was killed"
        assert time.monotonic() < end, "no trial finished"
        try:  # the tuner may still be creating the database's tables
            states = [t.state for t in load(out).get_trials()]
        except Exception:
            states = []
        together = together or states.count(TrialState.RUNNING) == 2
        if together:
            release.touch()
        if together and TrialState.COMPLETE in states and TrialState.RUNNING in states:
            break
        time.sleep(0.1)
    # On a CPU machine the two tuners are forks of the one started (its command line, not a new interpreter's).
    tuners = psutil.Process(proc.pid).children()
    assert len(tuners) == 2 and all(t.cmdline() == psutil.Process(proc.pid).cmdline() for t in tuners)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {t.number: t for t in load(out).get_trials()}
    interrupted = [n for n, t in before.items() if t.state == TrialState.RUNNING]
    assert interrupted, "no trial was running when the tuner was killed"
    _wait_gone(_owners(before[n] for n in interrupted))  # the workers die with their tuner (PR_SET_PDEATHSIG)
    again = trainrun.run(argv, env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = load(out).get_trials()
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == 3  # the budget, each trial counted once
    for n in interrupted:  # failed, and run again once from its start with the same settings
        assert trials[n].state == TrialState.FAIL and trials[n].system_attrs["visiontune:failed"]
        retries = [t for t in trials if t.system_attrs.get("failed_trial") == n]
        assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
        assert "visiontune:failed" not in retries[0].system_attrs
        if before[n].params:  # killed after its settings were drawn (else the retry draws its own)
            assert retries[0].params == before[n].params
    for n, t in before.items():  # finished before the kill: kept as they were
        if t.state == TrialState.COMPLETE:
            assert trials[n].state == TrialState.COMPLETE and trials[n].value == t.value
    folders = [t.user_attrs["run_dir"] for t in finished]
    assert len(set(folders)) == 3 and all(Path(f, "summary.json").is_file() for f in folders)
    assert len(_owners(trials)) >= 3  # two workers before the kill, and at least one after it
    assert trials[0].params == {"lr": 0.001}  # the new study's first trial: the recipe's own (blog's lr)
    assert sorted(p.name for p in out.glob("tuner-*.log")) == ["tuner-0.log", "tuner-1.log"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_tuners_on_one_journal_file_share_the_study(small_data, tmp_path):
    out, space, journal = tmp_path / "tune", tmp_path / "space.toml", tmp_path / "shared" / "study.log"
    space.write_text(SCHEDULING_SPACE)
    argv = [PYTHON, "-m", "visiontune", *_argv(small_data, out, space, "--trials", "2", "--epochs", "1", *SCHEDULING)]
    argv += ["--storage", str(journal), "--study", "shared", "--pruner", "none"]
    env = _env(tmp_path)
    procs = [trainrun.start(argv, env, tmp_path / f"tuner-{i}.log") for i in range(2)]
    codes = [p.wait(600) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"tuner-{i}.log").read_text()[-3000:] for i in range(2)]
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    trials = load(out, "shared", JournalStorage(JournalFileBackend(str(journal)))).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert len({t.user_attrs["run_dir"] for t in trials}) == 2
    assert _owners(trials) == {p.pid for p in procs}  # both ran trials of the one study
    assert not (out / "study.db").exists()


# The tuner as the Slurm tune script starts it: one task on node 0 of a 2-node allocation.
SLURM_NODE_0_OF_2 = {
    "SLURM_JOB_ID": "4711",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


@pytest.mark.slow
@pytest.mark.distributed
def test_trials_that_are_ddp_jobs_report_from_their_main_process_and_all_stop_when_pruned(small_data, tmp_path):
    """--strategy ddp --nproc 2: each trial a job of 2 processes under its own launcher. Two good settings,
    then the hopeless one, pruned after its first epoch: every process of its job stops there. The tuner runs
    as one node's task of a Slurm job: its trials are jobs of this machine alone, not of the allocation's
    two nodes (which would wait for a second node that never joins)."""
    out, space = tmp_path / "tune", tmp_path / "space.toml"
    out.mkdir()
    space.write_text(SPACE)
    study = optuna.create_study(study_name="visiontune", storage=f"sqlite:///{out / 'study.db'}", direction="minimize")
    for lr in ENQUEUED[:3]:
        study.enqueue_trial({"lr": lr})
    argv = [PYTHON, "-m", "visiontune", *_argv(small_data, out, space, "--trials", "3", "--epochs", "2")]
    argv += ["--best-metric", "loss", "--strategy", "ddp", "--nproc", "2"]
    env = {**_env(tmp_path), **SLURM_NODE_0_OF_2}
    # Every interpreter that starts logs itself (tests/launchlog): on a CPU the jobs are forks of the tuner.
    launches = tmp_path / "launches.log"
    env |= {"VISIONTUNE_TEST_LAUNCH_LOG": str(launches), "PYTHONPATH": f"{LAUNCH_LOG}{os.pathsep}{env['PYTHONPATH']}"}
    done = trainrun.run(argv, env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [x for x in (launches.read_text() if launches.exists() else "").splitlines() if x.startswith("start")] == []
    trials = load(out).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    for t in trials:
        run_dir = Path(t.user_attrs["run_dir"])
        summary, history = json.loads((run_dir / "summary.json").read_text()), _history(run_dir)
        assert summary["world_size"] == 2  # a job of two processes
        # reported once an epoch, Optuna's steps counted from 0 (history.json's epochs from 1)
        assert t.intermediate_values == {r["epoch"] - 1: r["val"]["loss"] for r in history}
        if t.state == TrialState.PRUNED:
            assert len(history) == 1 and summary["stopped"]["reason"].startswith("pruned by the tuner (median")
            assert not (run_dir / "checkpoints" / "epoch0002-end").exists()  # no process trained on
        else:
            assert len(history) == 2 and t.value == summary["best_val_loss"]
    settings = (out / ".trial-0002.toml").read_text()  # what the third job was started with
    assert "trial 2" in settings and 'strategy = "ddp"' in settings and "lr = 1e-08" in settings
