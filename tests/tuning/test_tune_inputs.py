"""``visiontune tune``'s bad inputs (one line, exit 2, before any trial), the space, and its Slurm job."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from visiontune.cli.commands import main
from visiontune.errors import UserError
from visiontune.tasks import AUTO
from visiontune.tuning import space as space_mod
from visiontune.tuning.tune import duration

optuna.logging.set_verbosity(optuna.logging.WARNING)

FLAGS = ["--model", "resnet18", "--weights", "none", "--image-size", "32", "--epochs", "1"]


def _tune(data: Path, out: Path, *extra: str) -> list[str]:
    return ["tune", "--data", str(data), "--out", str(out), "--trials", "2", *FLAGS, *extra]


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("visiontune: error: "), err
    return err[0]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[lr\nlow = 1", "cannot parse space file"),
        ("[learning_rate]\nlow = 0.1\nhigh = 1.0\n", "[learning_rate] is not a training setting"),
        ("[lr]\nlow = 0.1\nhigh = 0.01\n", "low must be below high"),
        ("[lr]\nlow = 0.0\nhigh = 0.1\nlog = true\n", "a log range must start above 0"),
        ("[epochs]\nlow = 1.5\nhigh = 3\n", "epochs is an integer setting"),
        ("[data]\nchoices = ['a', 'b']\n", "is not a setting a study searches"),
        ("[augment]\nchoices = ['light', 'strong']\n", "the search space's [augment] value 'strong'"),
        ("[label_smoothing]\nlow = 0.0\nhigh = 2.0\n", "the search space's [label_smoothing] value 2.0"),
        ("[augment]\nchoices = []\n", "choices must be a non-empty list"),
        ("[lr]\nlow = 1e-4\nhigh = 0.1\nsteps = 3\n", "unknown key(s) steps"),
        ("", "searches nothing"),
    ],
)
def test_a_bad_space_file_is_one_line_before_anything_is_listed(tmp_path, capsys, text, says):
    bad = tmp_path / "space.toml"
    bad.write_text(text)
    assert main(_tune(tmp_path / "no-data", tmp_path / "t", "--space", str(bad))) == 2
    assert says in _error(capsys)
    assert not (tmp_path / "t").exists()


def test_a_setting_fixed_and_searched_is_refused(tmp_path, capsys):
    both = tmp_path / "space.toml"
    both.write_text("[lr]\nlow = 1e-4\nhigh = 0.1\nlog = true\n")
    assert main(_tune(tmp_path, tmp_path / "t", "--space", str(both), "--lr", "0.01")) == 2
    assert "--lr fixed on the command line and searched in" in _error(capsys)


def test_the_default_space_leaves_out_what_is_fixed_and_adds_the_models():
    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import validate

    cfg = validate(TrainConfig(data="d", recipe="modern", image_size=32))
    found = space_mod.resolve(cfg, {"image_size", "lr"}, None, ["resnet18", "mobilenet_v3_small"])
    names = [p.name for p in found]
    assert "lr" not in names and "image_size" not in names and "weight_decay" in names
    assert found[-1].choices == ("resnet18", "mobilenet_v3_small")
    lr = space_mod.resolve(cfg, {"image_size"}, None, None)[0]
    assert (lr.name, lr.log, lr.low, lr.high) == ("lr", True, 1e-5, 3e-3)


def test_the_default_space_leaves_out_what_the_task_refuses_and_a_space_file_searching_it_is_one_line(tmp_path):
    """A regression refuses label smoothing and CutMix: the recipe's space searches neither (as ``train``
    drops the recipe's label smoothing there); classification keeps the whole space."""
    from visiontune import tasks
    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import validate

    for task, left_out in (("regress", {"label_smoothing", "cutmix"}), ("classify", set())):
        cfg = validate(TrainConfig(data="d", recipe="modern", task=task), tasks.get)
        whole = space_mod.resolve(cfg, set(), None, None)
        kept = space_mod.for_task(whole, cfg, tasks.get(task), None)
        assert {p.name for p in whole} - {p.name for p in kept} == left_out and "mixup" in {p.name for p in kept}
    f = tmp_path / "space.toml"
    f.write_text("[lr]\nlow = 1e-4\nhigh = 1e-2\n[label_smoothing]\nlow = 0.0\nhigh = 0.2\n")
    cfg = validate(TrainConfig(data="d", task="regress"), tasks.get)
    with pytest.raises(UserError) as e:
        space_mod.for_task(space_mod.resolve(cfg, set(), str(f), None), cfg, tasks.get("regress"), str(f))
    assert f"{f} searches [label_smoothing], which regression data refuses: --label-smoothing" in str(e.value)


@pytest.mark.slow
def test_a_regression_study_on_the_recipes_default_space_runs_its_trials(tmp_path, capsys):
    """``tune --task regress`` without --space: each trial draws from the recipe's space, less what a
    regression refuses (drawn, a label smoothing stopped the study at its second trial)."""
    from visiontune.data.sample import make_regression_data

    make_regression_data(tmp_path / "data", count=24)
    vit = ["--model", "timm/test_vit", "--weights", "none", "--image-size", "32", "--epochs", "1", "--batch-size", "8"]
    argv = ["tune", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "t"), "--task", "regress"]
    assert main([*argv, *vit, "--recipe", "modern", "--trials", "2", "--num-workers", "0", "--no-progress"]) == 0
    study = optuna.load_study(study_name="visiontune", storage=f"sqlite:///{tmp_path / 't' / 'study.db'}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert all("mixup" in t.params and not {"label_smoothing", "cutmix"} & set(t.params) for t in study.trials)


def test_values_sampled_from_a_space_file_are_of_each_setting_s_type(tmp_path):
    f = tmp_path / "space.toml"
    f.write_text(
        "[epochs]\nlow = 1\nhigh = 3\n[lr]\nlow = 1e-4\nhigh = 1e-2\nlog = true\n"
        '[augment]\nchoices = ["none", "light"]\n'
    )
    params = space_mod.load_space(str(f))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        values = space_mod.sample(params, study.ask())
        assert isinstance(values["epochs"], int) and 1 <= values["epochs"] <= 3
        assert 1e-4 <= values["lr"] <= 1e-2 and values["augment"] in ("none", "light")


def test_durations():
    assert [duration(t) for t in ("90", "90s", "30m", "2h", "1h30m", "1d")] == [90, 90, 1800, 7200, 5400, 86400]
    for bad in ("", "2 h", "h", "-5", "1x"):
        with pytest.raises(UserError, match="is not a duration"):
            duration(bad)


def test_an_unreachable_database_is_one_line(sample_data, tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/no/such/folder/study.db"
    assert main(_tune(sample_data, tmp_path / "t", "--storage", url)) == 2
    line = _error(capsys)
    assert f"cannot open the study storage {url}" in line and "unable to open database file" in line
    assert main(_tune(sample_data, tmp_path / "t", "--storage", "nosuchdriver://host/db")) == 2
    assert "cannot open the study storage nosuchdriver://host/db" in _error(capsys)


def test_a_study_of_another_data_set_is_refused(sample_data, small_data, tmp_path, capsys):
    from visiontune.data.sources import discover
    from visiontune.tuning import study

    out = tmp_path / "t"
    out.mkdir()
    made = optuna.create_study(study_name="visiontune", storage=f"sqlite:///{out / 'study.db'}", direction="maximize")
    made.set_user_attr(study.ATTR_DATA, study.data_identity(discover(str(small_data), task=AUTO)))
    assert main(_tune(sample_data, out)) == 2
    line = _error(capsys)
    assert "study 'visiontune' in sqlite:///" in line and "is of another data set (40 images" in line
    assert made.trials == [] and not list(out.glob("trial-*"))
    # The study of the right data, with other fixed settings: refused too, saying which.
    made.set_user_attr(study.ATTR_DATA, study.data_identity(discover(str(sample_data), task=AUTO)))
    made.set_user_attr(study.ATTR_DIRECTION, "maximize")
    made.set_user_attr(study.ATTR_FIXED, {"epochs": 3})
    assert main(_tune(sample_data, out)) == 2
    assert "was run with other fixed settings (epochs 3 -> 1" in _error(capsys)


def test_a_stale_trial_is_failed_and_queued_again_once(tmp_path):
    import os
    import socket
    import time

    from visiontune.tuning import study

    storage = study.open_storage(str(tmp_path / "journal.log"))
    s = optuna.create_study(storage=storage, study_name="s")
    here, started, long_ago = socket.gethostname(), study._started(os.getpid()), time.time() - 3600
    assert started is not None and started != study._started(1)
    owners = {  # (owner, last heartbeat) -> failed?
        "live, its heartbeat an hour old (a busy machine)": ({"pid": os.getpid(), "started": started}, long_ago),
        "no such process": ({"pid": 2**22 + 12345}, time.time()),
        "its pid now another process's": ({"pid": os.getpid(), "started": started - 1}, time.time()),
        "another host, beating": ({"host": "elsewhere", "pid": 1}, time.time()),
        "another host, silent for three beats": ({"host": "elsewhere", "pid": 1}, time.time() - 91),
        # Records no tuner of this make writes (a shared storage is anyone's): judged by the heartbeat, or left.
        "a pid too large for the OS, beating": ({"pid": 2**70}, time.time()),
        "a pid too large for the OS, silent": ({"pid": 2**70}, long_ago),
        "pid 0 (a process group), silent": ({"pid": 0}, long_ago),
        "no pid, silent": ({"pid": "x"}, long_ago),
        "a heartbeat that is no time": ({"pid": "x"}, "soon"),
    }
    trials = {}
    for what, (owner, beat) in owners.items():
        trials[what] = t = s.ask()
        storage.set_trial_system_attr(t._trial_id, study.OWNER, {"host": here, "heartbeat": 30.0, **owner})
        storage.set_trial_system_attr(t._trial_id, study.BEAT, beat)
    not_a_record = s.ask()
    storage.set_trial_system_attr(not_a_record._trial_id, study.OWNER, [1, 2])
    unowned = s.ask()  # no owner: a trial another program runs, never judged
    stale = ["no such process", "its pid now another process's", "another host, silent for three beats"]
    stale += ["a pid too large for the OS, silent", "pid 0 (a process group), silent", "no pid, silent"]
    assert study.fail_stale(s, storage, 30.0) == [trials[what].number for what in stale]
    assert study.fail_stale(s, storage, 30.0) == []  # once
    now = s.get_trials()
    for what, t in trials.items():
        assert now[t.number].state == (TrialState.FAIL if what in stale else TrialState.RUNNING), what
    assert now[unowned.number].state == now[not_a_record.number].state == TrialState.RUNNING
    retries = now[unowned.number + 1 :]
    assert [t.state for t in retries] == [TrialState.WAITING] * len(stale)
    assert [t.system_attrs["failed_trial"] for t in retries] == [trials[what].number for what in stale]


def test_a_tuner_that_lost_the_race_to_make_a_new_database_opens_it_again(tmp_path, monkeypatch):
    """Two tuners on a new SQLite file: the one that lost the race saw the other's schema version row (a
    ``tune --parallel 2`` under load ended with it) or its tables; it opens the database made meanwhile."""
    from visiontune.tuning import study

    real, lost = (
        optuna.storages.RDBStorage,
        [
            "(sqlite3.IntegrityError) UNIQUE constraint failed: alembic_version.version_num",
            "(sqlite3.OperationalError) table studies already exists",
        ],
    )

    def racing(*args, **kwargs):
        if lost:
            raise RuntimeError(lost.pop(0))
        return real(*args, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert isinstance(study.open_storage(url), real) and lost == []
    lost.append("(sqlite3.OperationalError) unable to open database file")  # not the race: one line
    with pytest.raises(UserError, match="cannot open the study storage .* unable to open database file"):
        study.open_storage(url)


def test_a_trial_asked_for_by_a_tuner_killed_before_it_recorded_itself_is_failed_after_three_beats(
    tmp_path, monkeypatch
):
    """Optuna's ask makes the trial RUNNING; the tuner records itself as its owner a moment later. A kill -9
    in between left a trial that counted as running for ever, so the same command waited for it without end."""
    import time
    import types

    from visiontune.tuning import study

    storage = study.open_storage(str(tmp_path / "journal.log"))
    s = optuna.create_study(storage=storage, study_name="s")
    s.set_user_attr(study.ATTR_DATA, {"images": 2})  # a study visiontune made
    orphan = s.ask()
    assert study.fail_stale(s, storage, 30.0) == []  # just asked for: its tuner may be recording itself now
    later = time.time() + 3 * 30.0 + 5  # three heartbeats on
    monkeypatch.setattr(study, "time", types.SimpleNamespace(time=lambda: later))
    assert study.fail_stale(s, storage, 30.0) == [orphan.number]
    assert study.fail_stale(s, storage, 30.0) == []  # once
    now = s.get_trials()
    assert now[orphan.number].state == TrialState.FAIL and now[orphan.number].system_attrs["visiontune:failed"]
    assert [(t.state, t.system_attrs["failed_trial"]) for t in now[orphan.number + 1 :]] == [
        (TrialState.WAITING, orphan.number)
    ]


def test_a_new_studys_first_trial_is_the_recipes_own_settings_those_the_space_can_hold():
    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import validate

    cfg = validate(TrainConfig(data="d", recipe="modern", model="resnet18", weights="none", image_size=32))
    modern = space_mod.default_space("modern")
    assert space_mod.recipe_values(modern, cfg) == {  # the modern recipe (docs/training.md); 32 px is no choice
        "lr": 0.001,
        "weight_decay": 0.05,
        "label_smoothing": 0.1,
        "augment": "none",
        "mixup": 0.0,
        "cutmix": 0.0,
        "ema": 0.0,
        "warmup_epochs": 1.0,
    }
    narrow = [space_mod.Param("lr", "float", low=0.01, high=0.1), space_mod.Param("ema", "categorical", (0.9,))]
    assert space_mod.recipe_values(narrow, cfg) == {}  # outside the range, not a choice: drawn as any other
    assert not space_mod.Param("epochs", "int", low=0, high=5).holds(True)


@pytest.mark.slow
def test_a_trial_whose_tuner_was_killed_but_not_yet_reaped_is_stale(tmp_path):
    import socket
    import time

    from visiontune.tuning import study

    storage = study.open_storage(str(tmp_path / "journal.log"))
    s = optuna.create_study(storage=storage, study_name="s")
    zombie = subprocess.Popen(["true"])  # exits, and stays a zombie until waited for (as under an init that
    started = study._started(zombie.pid)  # does not reap); its pid still answers kill(pid, 0)
    while study._stat(zombie.pid)[0] != "Z":
        time.sleep(0.01)
    t = s.ask()
    owner = {"host": socket.gethostname(), "pid": zombie.pid, "started": started, "heartbeat": 30.0}
    storage.set_trial_system_attr(t._trial_id, study.OWNER, owner)
    storage.set_trial_system_attr(t._trial_id, study.BEAT, time.time())
    assert study.fail_stale(s, storage, 30.0) == [t.number]
    zombie.wait()


def test_a_slurm_job_of_ddp_trials_gives_each_trial_nproc_gpus_of_its_node(sample_data, tmp_path, capsys):
    job = tmp_path / "tune.sbatch"
    argv = _tune(sample_data, tmp_path / "t", "--storage", "/shared/s.log", "--slurm-script", str(job))
    argv += ["--strategy", "ddp", "--nproc", "2", "--nodes", "3", "--time", "1:00:00"]
    assert main([*argv, "--gpus-per-node", "4"]) == 0
    script = job.read_text()
    words = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    assert words[-2:] == ["--parallel", "2"]  # 4 GPUs, 2 for each trial's job
    assert words[words.index("--nproc") + 1] == "2" and words[words.index("--strategy") + 1] == "ddp"
    assert "runs 2 trial(s) at once, each a job of 2 processes on its node" in script
    assert "#SBATCH --gpus-per-node=4\n" in script and "#SBATCH --ntasks-per-node=1\n" in script
    job.unlink()
    capsys.readouterr()
    assert main([*argv, "--gpus-per-node", "1"]) == 2  # a trial of 2 processes on a node of 1 GPU
    assert "a job of 2 processes, one GPU each, but --gpus-per-node is 1" in _error(capsys)
    assert not job.exists()


def test_the_slurm_job_runs_one_tuner_per_node_on_the_journal_file(sample_data, tmp_path, capsys):
    job = tmp_path / "tune.sbatch"
    journal = "/shared/studies/pets.log"
    argv = _tune(sample_data, tmp_path / "t", "--storage", journal, "--slurm-script", str(job))
    assert main([*argv, "--nodes", "4", "--gpus-per-node", "2", "--time", "4:00:00", "--partition", "gpu"]) == 0
    script = job.read_text()
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --gpus-per-node=2\n" in script
    assert "#SBATCH --partition=gpu\n" in script and "#SBATCH --signal=USR1@120\n" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    words = shlex.split(srun)
    assert words[words.index("tune") - 2 :][:3] == ["-m", "visiontune", "tune"]
    assert words[words.index("--storage") + 1] == journal and words.count("--storage") == words.count(journal) == 1
    assert words[-2:] == ["--parallel", "2"]
    for own in ("--slurm-script", "--nodes", "--gpus-per-node", "--time", "--partition"):
        assert own not in words
    assert words[words.index("--trials") + 1] == "2" and words[words.index("--data") + 1] == str(sample_data)
    assert not (tmp_path / "t").exists()  # nothing tuned
    capsys.readouterr()
    # A database URL or no storage: not a job for a shared file system.
    assert main([*argv[:-4], "--slurm-script", str(job), "--nodes", "1", "--gpus-per-node", "0", "--time", "60"]) == 2
    assert "needs --storage FILE, a journal file" in _error(capsys)
