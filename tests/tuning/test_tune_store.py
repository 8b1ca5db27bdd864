"""``visiontune tune`` against a study store someone else wrote: every value read back goes through the store's
schema (one line, exit 2, for a value of the wrong type), text from it is escaped wherever it is shown (the
terminal, ``tune.html``, ``best.toml``), and nothing in it steers a later ``train --config best.toml``.

Most cases are studies whose trials are all finished already, so the command reads, writes its results and
trains nothing."""

from __future__ import annotations

import re
import sqlite3
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from visiontune.cli.commands import build_parser, main
from visiontune.cli.flags import config_from_args
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import load_config_file, validate
from visiontune.tuning import results, study

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

optuna.logging.set_verbosity(optuna.logging.WARNING)

FLAGS = ["--weights", "none", "--image-size", "32", "--epochs", "1", "--no-progress"]  # the model: resnet18
LR = FloatDistribution(1e-4, 0.1, log=True)


def _tune(data: Path, out: Path, *extra: str) -> list[str]:
    return ["tune", "--data", str(data), "--out", str(out), "--trials", "1", *FLAGS, *extra]


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("visiontune: error: "), err
    return err[0]


def _store(out: Path, *trials, direction: str = "maximize") -> optuna.Study:
    """A study in OUT/study.db holding ``trials`` (``create_trial``s), as anyone with Optuna's API can write it."""
    out.mkdir(parents=True, exist_ok=True)
    s = optuna.create_study(study_name="visiontune", storage=f"sqlite:///{out / 'study.db'}", direction=direction)
    for t in trials:
        s.add_trial(t)
    return s


def _done(value: float = 0.5, lr: float = 0.01, **attrs) -> optuna.trial.FrozenTrial:
    """A finished trial of ``lr``, with its settings recorded as a tuner records them (``config``) unless
    ``attrs`` say otherwise (``config=None``: none recorded, as a trial added with Optuna's API)."""
    attrs = {"config": {"lr": lr}, **attrs}
    user_attrs = {k: v for k, v in attrs.items() if v is not None}
    return create_trial(value=value, params={"lr": lr}, distributions={"lr": LR}, user_attrs=user_attrs)


def _space(tmp_path: Path) -> str:
    f = tmp_path / "space.toml"
    f.write_text("[lr]\nlow = 1e-4\nhigh = 0.1\nlog = true\n")
    return str(f)


# --- links, TOML and the terminal -------------------------------------------------------------------------


def test_a_stored_run_folder_becomes_a_link_only_to_a_folder_of_the_tune_folder(sample_data, tmp_path):
    out = tmp_path / "t"
    (out / "trial-0002").mkdir(parents=True)
    hostile = ["javascript:alert(document.domain)", "https://evil.example/x", "/etc", "//evil.example"]
    _store(
        out, *(_done(0.1 * i, run_dir=d) for i, d in enumerate(hostile)), _done(0.9, run_dir="/elsewhere/trial-0002")
    )
    assert main(_tune(sample_data, out, "--space", _space(tmp_path))) == 0
    page = (out / "tune.html").read_text()
    hrefs = re.findall(r'href="([^"]*)"', page)
    assert hrefs == ["best.toml", "./trial-0002/"]  # the one folder that is in the tune folder, relative
    assert "javascript:" not in "".join(hrefs) and "evil" not in "".join(hrefs)


def test_best_toml_from_a_hostile_store_parses_back_to_the_trial_s_settings_and_steers_nothing(
    sample_data, tmp_path, capsys
):
    out = tmp_path / "t"
    run_dir = 'x\noutput_dir = "/tmp/evil"\n[evil]\nk = 1'
    config = {"lr": 0.01, "output_dir": "/tmp/evil", "data": "/tmp/evil-data"}  # a record, never written back
    _store(out, _done(0.75, lr=0.0123, run_dir=run_dir, config=config))
    assert main(_tune(sample_data, out, "--space", _space(tmp_path), "--limit-images", "100")) == 0
    printed = capsys.readouterr().out
    written = tomllib.loads((out / "best.toml").read_text())
    # Exactly this tuner's settings with the trial's lr, on all the data (the search's subset is its budget).
    fixed = ["--data", str(sample_data), *FLAGS]
    expected = results.settings_of(config_from_args(build_parser().parse_args(["train", *fixed, "--lr", "0.0123"])))
    assert written == {k: v for k, v in expected.items() if k != "best_metric"} | {"best_metric": "accuracy"}
    assert "output_dir" not in written and "evil" not in written and "limit_images" not in written
    assert written["data"] == str(sample_data) and written["lr"] == 0.0123
    assert (
        "# the search's budget, left out to train on all the data: limit_images = 100"
        in (out / "best.toml").read_text()
    )
    # `train --config best.toml`, as tune says to run it, trains where the user says, on the user's data.
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(out / "best.toml")]))
    assert cfg.output_dir is None and cfg.data == str(sample_data) and cfg.limit_images is None
    assert "\n[evil]" not in (out / "best.toml").read_text()
    assert not any(line.startswith(("output_dir", "[evil]", "k = ")) for line in printed.splitlines())


def test_a_stored_parameter_that_is_no_setting_never_reaches_best_toml(sample_data, tmp_path, capsys):
    out = tmp_path / "t"
    key = "zz = 1\n[evil]\nk"
    s = _store(out)
    s.add_trial(create_trial(value=0.5, params={key: 0.01}, distributions={key: LR}))
    assert main(_tune(sample_data, out, "--space", _space(tmp_path))) == 2
    line = _error(capsys)
    assert "trial 0 (the best in the study store)" in line and "is not a setting a study searches" in line
    assert "\\n[evil]" in line  # shown escaped, on the one line
    assert not (out / "best.toml").exists() and not (out / "tune.html").exists()


def test_terminal_escapes_and_newlines_from_the_store_are_printed_escaped(sample_data, tmp_path, capsys):
    out = tmp_path / "t"
    title = "\x1b]0;owned\x07"
    aug = CategoricalDistribution(["light", title])
    s = _store(out)
    s.add_trial(
        create_trial(
            value=0.5,
            params={"augment": "light"},
            distributions={"augment": aug},
            user_attrs={"run_dir": "/x/trial-0000\nvisiontune: best trial 9: val accuracy 1.0000"},
        )
    )
    s.add_trial(create_trial(value=0.25, params={"augment": title}, distributions={"augment": aug}))
    space = tmp_path / "space.toml"
    space.write_text('[augment]\nchoices = ["none", "light"]\n')
    assert main(_tune(sample_data, out, "--space", str(space))) == 0
    printed = capsys.readouterr()
    assert "\x1b" not in printed.out + printed.err and "\x07" not in printed.out + printed.err
    assert "\\x1b]0;owned\\x07" in printed.out
    assert [line for line in printed.out.splitlines() if "best trial" in line] == [
        "visiontune: best trial 0: val accuracy 0.5000 (/x/trial-0000\\nvisiontune: best trial 9: val accuracy 1.0000)"
    ]
    assert "\x1b" not in (out / "tune.html").read_text()


def test_a_storage_password_is_masked_in_the_error_line(sample_data, tmp_path, capsys):
    url = "postgresql://u:SeCrEtPw@127.0.0.1:1/db"
    assert main(_tune(sample_data, tmp_path / "t", "--storage", url)) == 2
    line = _error(capsys)
    assert "SeCrEtPw" not in line and "postgresql://u:***@127.0.0.1:1/db" in line


def test_a_data_url_password_is_masked_in_every_line(tmp_path, capsys):
    """The same helper masks a data URL's password: the download line and the error line alike."""
    url = "https://u:SeCrEtPw@127.0.0.1:1/shards-{0..1}.tar"
    assert main(["train", "--data", url, "--output-dir", str(tmp_path / "run")]) == 2
    printed = capsys.readouterr()
    assert "SeCrEtPw" not in printed.out + printed.err
    assert "https://u:***@127.0.0.1:1/shards-{0..1}.tar" in printed.out and len(printed.err.splitlines()) == 1


def test_masking_urls_and_escaping_control_characters():
    from visiontune.text import mask_urls, printable, shown

    assert mask_urls("x postgresql+psycopg://user:p@ss:w@db.example:5432/s?x=1 y") == (
        "x postgresql+psycopg://user:***@db.example:5432/s?x=1 y"
    )
    for kept in ("sqlite:////tmp/a@b.db", "http://host:8080/a@b", "https://host/x", "/data/u:v@w", "mysql://u@h/d"):
        assert mask_urls(kept) == kept
    assert printable("a\nb\x1b]0;t\x07\u202ec d") == "a\\nb\\x1b]0;t\\x07\\u202ec d"
    assert shown("https://a:b@h/\n") == "https://a:***@h/\\n"


# --- values of the wrong type: one line, exit 2 --------------------------------------------------------------


def test_a_categorical_index_out_of_range_is_one_line(sample_data, tmp_path, capsys):
    out = tmp_path / "t"
    s = _store(out)
    s.add_trial(
        create_trial(
            value=0.5,
            params={"augment": "light"},
            distributions={"augment": CategoricalDistribution(["none", "light"])},
        )
    )
    with sqlite3.connect(out / "study.db") as db:
        db.execute("UPDATE trial_params SET param_value = 7")
    assert main(_tune(sample_data, out, "--space", _space(tmp_path))) == 2
    line = _error(capsys)
    assert "study 'visiontune': a trial record Optuna cannot read (IndexError" in line


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda s: s.set_user_attr(study.ATTR_DATA, "all of it"), "its record of the data (visiontune:data)"),
        (
            lambda s: s.add_trial(
                create_trial(
                    state=TrialState.WAITING,
                    params={"lr": 0.01},
                    distributions={"lr": LR},
                    system_attrs={"retry_history": 5},
                )
            ),
            "trial 0: its retry history (retry_history) is 5",
        ),
        (lambda s: s.add_trial(_done(config=[1, 2])), "trial 0: its settings (config) is [1, 2]"),
        (lambda s: s.add_trial(_done(config={"epochs": "many"})), "epochs = 'many' is not of type int"),
        (lambda s: s.add_trial(_done(run_dir=7)), "trial 0: its run folder (run_dir) is 7"),
    ],
)
def test_a_store_value_of_the_wrong_type_is_one_line(sample_data, tmp_path, capsys, make, says):
    out = tmp_path / "t"
    make(_store(out))
    assert main(_tune(sample_data, out, "--space", _space(tmp_path))) == 2
    line = _error(capsys)
    assert says in line and "study store was changed by something else" in line
    assert not list(out.glob("trial-*")) and not (out / "tune.html").exists()


def test_a_best_trial_without_recorded_settings_gives_this_tuner_s_settings_with_its_values(sample_data, tmp_path):
    out = tmp_path / "t"
    _store(out, _done(0.5, lr=0.002, config=None))  # a trial added with Optuna's API: no config, no run folder
    assert main(_tune(sample_data, out, "--space", _space(tmp_path))) == 0
    written = load_config_file(str(out / "best.toml"))
    assert written["lr"] == 0.002 and written["data"] == str(sample_data)


def test_a_queued_trial_outside_the_space_is_one_line_and_left_failed(sample_data, tmp_path, capsys):
    out = tmp_path / "t"
    s = _store(out)
    s.enqueue_trial({"augment": "evil\x1b[2J"})
    space = tmp_path / "space.toml"
    space.write_text('[augment]\nchoices = ["none", "light"]\n')
    assert main(_tune(sample_data, out, "--space", str(space))) == 2
    line = _error(capsys)
    assert "trial 0 (queued in the study store)" in line and "marked failed" in line and "\x1b" not in line
    assert [t.state for t in s.get_trials()] == [TrialState.FAIL]
    assert not list(out.glob("trial-*"))


def test_a_trial_value_of_inf_is_never_the_best(sample_data, tmp_path, capsys):
    out = tmp_path / "t"
    _store(out, _done(float("inf"), lr=0.05), _done(0.6, lr=0.01), _done(0.4, lr=0.02))
    assert main(_tune(sample_data, out, "--space", _space(tmp_path), "--trials", "2")) == 0
    printed = capsys.readouterr().out
    assert "visiontune: best trial 1: val accuracy 0.6000" in printed
    assert "val accuracy inf" not in printed and load_config_file(str(out / "best.toml"))["lr"] == 0.01
    row = next(line for line in printed.splitlines() if line.split()[:1] == ["0"])
    assert "failed (its value inf is not a finite number)" in row
    from visiontune.tuning import store

    rows = store.trials(optuna.load_study(study_name="visiontune", storage=f"sqlite:///{out / 'study.db'}"))
    assert store.best(rows, "maximize").number == 1 and store.best(rows, "minimize").number == 2


# --- the owner record, the space, --parallel -----------------------------------------------------------------


def test_a_running_trial_whose_owner_record_cannot_be_judged_is_failed_after_the_heartbeat_window(
    tmp_path, monkeypatch
):
    import socket
    import time
    import types

    storage = study.open_storage(str(tmp_path / "journal.log"))
    s = optuna.create_study(storage=storage, study_name="s")
    s.set_user_attr(study.ATTR_DATA, {"images": 2})  # a study visiontune made
    t = s.ask()
    owner = {"host": socket.gethostname(), "pid": "1; touch /tmp/x", "heartbeat": float("inf"), "since": 1e309}
    storage.set_trial_system_attr(t._trial_id, study.OWNER, owner)
    storage.set_trial_system_attr(t._trial_id, study.BEAT, float("inf"))
    assert study.fail_stale(s, storage, 30.0) == []  # just started: within its window
    later = time.time() + 3 * 30.0 + 5
    monkeypatch.setattr(study, "time", types.SimpleNamespace(time=lambda: later))
    assert study.fail_stale(s, storage, 30.0) == [t.number]
    # A live process of this host named without its start time (pid 1) is no sign that the owner lives.
    t1 = s.ask()
    storage.set_trial_system_attr(t1._trial_id, study.OWNER, {"host": socket.gethostname(), "pid": 1})
    monkeypatch.setattr(study, "time", types.SimpleNamespace(time=lambda: later + 3 * 30.0 + 5))
    assert study.fail_stale(s, storage, 30.0) == [t1.number]
    # A heartbeat from far in the future (1e300 s) keeps nothing alive either.
    t2 = s.ask()
    storage.set_trial_system_attr(t2._trial_id, study.OWNER, {"host": "elsewhere", "pid": 5, "heartbeat": 30.0})
    storage.set_trial_system_attr(t2._trial_id, study.BEAT, 1e300)
    monkeypatch.setattr(study, "time", types.SimpleNamespace(time=lambda: later + 6 * 30.0 + 10))
    assert study.fail_stale(s, storage, 30.0) == [t2.number]


def test_a_hub_model_name_that_is_no_repository_is_refused_before_any_trial(sample_data, tmp_path, capsys):
    space = tmp_path / "space.toml"
    space.write_text('[model]\nchoices = ["resnet18", "hf-hub:../../etc/passwd"]\n')
    assert main(_tune(sample_data, tmp_path / "t", "--space", str(space))) == 2
    line = _error(capsys)
    assert "the search space's [model] value 'hf-hub:../../etc/passwd'" in line and "hf-hub:ORG/NAME" in line
    assert not (tmp_path / "t").exists()


def test_every_value_of_the_space_is_checked_before_any_trial(sample_data, tmp_path, capsys):
    from visiontune.tuning import space as space_mod

    cfg = validate(TrainConfig(data="d", model="resnet18", weights="none"))
    sizes = tmp_path / "sizes.toml"
    sizes.write_text("[image_size]\nlow = 32\nhigh = 64\nstep = 32\n")
    (size,) = space_mod.resolve(cfg, set(), str(sizes), None)  # refused before: "32.0 is not of type int"
    assert (size.kind, size.extremes()) == ("int", [32, 64])
    models = tmp_path / "models.toml"
    models.write_text('[model]\nchoices = ["resnet18", "resnet_nosuch"]\n')
    assert main(_tune(sample_data, tmp_path / "t", "--space", str(models))) == 2
    assert "the search space's [model] value 'resnet_nosuch'" in _error(capsys)
    assert not (tmp_path / "t").exists()


def test_parallel_is_bounded_by_the_trials_left_and_the_machine(sample_data, tmp_path, capsys, monkeypatch):
    from visiontune.tuning import tune as tune_mod

    out = tmp_path / "t"
    _store(out, _done(0.5))  # the one trial asked for is done: no tuner process is needed at all
    assert main(_tune(sample_data, out, "--space", _space(tmp_path), "--parallel", "100000")) == 0
    assert "visiontune: --parallel 100000: 1 tuner(s), for 0 trial(s) left to run on" in capsys.readouterr().out
    # 30 asked for, 1 trial left on a machine of 2 cores: one tuner; 3 left: 2.
    monkeypatch.setattr(tune_mod, "available_cores", lambda: 2)
    monkeypatch.setattr(tune_mod, "_gpu_count", lambda: 0)
    s = optuna.load_study(study_name="visiontune", storage=f"sqlite:///{out / 'study.db'}")
    tuner = tune_mod.Tuner(
        tune_mod.TuneOptions(trials=2, out=str(out), parallel=30),
        validate(TrainConfig(data="d")),
        [],
        None,
        "accuracy",
        "",
        None,
        s,
    )
    assert tune_mod._tuners(tuner) == 1
    assert "--parallel 30: 1 tuner(s), for 1 trial(s) left to run on 2 cores" in capsys.readouterr().out
    tuner.opts = tune_mod.TuneOptions(trials=4, out=str(out), parallel=30)
    assert tune_mod._tuners(tuner) == 2
