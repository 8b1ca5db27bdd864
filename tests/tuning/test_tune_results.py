"""What ``visiontune tune`` shows: one line a trial after the first one's start-up block, settings to 3
significant digits, ``best.toml`` as the recipe without the search's budget (and ``none`` to unset a setting),
and ``tune.html`` in the pages' one stylesheet: whole epochs, a caveat on importances from few trials, and a
trials table that fits a 1280 px window."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import create_trial

from conftest import TINY_RESNET
from visiontune.cli.commands import build_parser, main
from visiontune.cli.flags import config_from_args
from visiontune.settings.config import TrainConfig, choices
from visiontune.tuning import results, store

optuna.logging.set_verbosity(optuna.logging.WARNING)

LR = FloatDistribution(1e-5, 0.1, log=True)


def _study(*trials) -> optuna.Study:
    s = optuna.create_study(study_name="s", direction="maximize")
    for t in trials:
        s.add_trial(t)
    return s


def test_trial_settings_are_shown_to_3_significant_digits():
    values = {"lr": 2.8523642713266232e-05, "weight_decay": 0.123456, "augment": "light", "epochs": 3, "ema": 0.0}
    assert results.describe(values) == "lr=2.85e-05, weight_decay=0.123, augment=light, epochs=3, ema=0"
    (row,) = store.trials(
        _study(create_trial(value=0.5, params={"lr": 2.8523642713266232e-05}, distributions={"lr": LR}))
    )
    line = results.table([row], row, "accuracy").splitlines()[1].split()
    assert line[:4] == ["*", "0", "complete", "0.5"] and line[-1] == "2.85e-05"


def test_every_optional_setting_takes_none_to_unset_it_over_the_config_file(tmp_path):
    parser = build_parser()
    allowed = choices()
    unsettable = [
        f.name
        for f in fields(TrainConfig)
        if f.default is None and f.type.endswith("| None") and f.name != "crop_scale"  # a pair: MIN MAX
    ]
    assert {"limit_images", "max_steps", "lr", "image_size", "interpolation", "threads"} <= set(unsettable)
    for name in unsettable:
        args = parser.parse_args(["train", "--data", "d", f"--{name.replace('_', '-')}", "none"])
        # `none` is itself a choice of some (--augment none, --lr-schedule none): there it keeps that meaning.
        assert getattr(args, name) == ("none" if "none" in allowed.get(name, ()) else None), name
    config = tmp_path / "best.toml"
    config.write_text('data = "d"\nlimit_images = 600\nmax_steps = 5\nimage_size = 64\n')
    cfg = config_from_args(
        parser.parse_args(["train", "--config", str(config), "--limit-images", "none", "--max-steps", "none"])
    )
    assert (cfg.limit_images, cfg.max_steps, cfg.image_size) == (None, None, 64)


def test_best_toml_leaves_out_the_search_s_budget_and_says_so(tmp_path):
    import tomllib

    from visiontune.settings.validation import validate

    cfg = validate(TrainConfig(data="d", model="resnet18", weights="none", limit_images=600, max_steps=40))
    (best,) = store.trials(_study(create_trial(value=0.5, params={"lr": 0.002}, distributions={"lr": LR})))
    text = results.best_toml(best, "accuracy", cfg)
    written = tomllib.loads(text)
    assert "limit_images" not in written and "max_steps" not in written and written["lr"] == 0.002
    assert "limit_images = 600, max_steps = 40 (--limit-images 600 --max-steps 40 repeats it)" in text


def test_the_three_pages_share_one_stylesheet():
    from visiontune.reports import compare, report, style

    assert report.CSS is style.CSS and compare.CSS is style.CSS
    page = results.page(_study(), [], None, "accuracy", Path("."))
    assert f"<style>{style.CSS}</style>" in page
    assert '<div class="wide"><table id="trials">' in page and ".wide{max-width:100%;overflow-x:auto}" in style.CSS


def test_the_epoch_axis_is_ticked_at_whole_epochs_and_few_trials_get_a_caveat(monkeypatch):
    ticks = []
    real = results._png

    def keep(fig):
        ticks.append([t for ax in fig.axes for t in ax.get_xticks()])
        return real(fig)

    monkeypatch.setattr(results, "_png", keep)
    trials = [
        create_trial(
            value=0.1 * i, params={"lr": 1e-3 * i}, distributions={"lr": LR}, intermediate_values={0: 0.1, 1: 0.2}
        )
        for i in (1, 2, 3)
    ]
    s = _study(*trials)
    page = results.page(s, store.trials(s), None, "accuracy", Path("."))
    epochs = ticks[1]  # the second figure: each trial's epochs (1 and 2)
    assert epochs and all(float(t).is_integer() for t in epochs), epochs
    assert re.search(r'<p class="note" id="caveat">from 3 finished trials only', page)
    assert '<table id="importances">' in page


def _wide_study(out: Path) -> optuna.Study:
    """Twelve searched settings with long names and values: the trials table is wider than any window."""
    names = [f"a_rather_long_setting_name_{i}" for i in range(12)]
    choice = CategoricalDistribution(["a-long-categorical-value-of-some-width", "short"])
    s = optuna.create_study(study_name="wide", storage=f"sqlite:///{out / 'study.db'}", direction="maximize")
    for i in range(3):
        params = {n: "a-long-categorical-value-of-some-width" for n in names}
        s.add_trial(create_trial(value=0.1 * i, params=params, distributions=dict.fromkeys(names, choice)))
    return s


@pytest.mark.slow
@pytest.mark.browser
def test_the_trials_table_does_not_widen_the_page_at_1280_px(tmp_path):
    from browser import dump_dom

    s = _wide_study(tmp_path)
    page = results.page(s, store.trials(s), None, "accuracy", tmp_path)
    check = """<script>window.addEventListener("load", () => {
      document.body.setAttribute("data-page", document.documentElement.scrollWidth + "/" + window.innerWidth);
      document.body.setAttribute("data-table", document.getElementById("trials").scrollWidth);
    });</script>"""
    (tmp_path / "tune.html").write_text(page.replace("</body>", check + "</body>"))
    done = dump_dom(tmp_path / "tune.html", tmp_path / "profile", "--window-size=1280,900", budget_ms=3000)
    assert done.returncode == 0, done.stderr[-2000:]
    width, window = map(int, re.search(r'data-page="(\d+)/(\d+)"', done.stdout).groups())
    table = int(re.search(r'data-table="(\d+)"', done.stdout).group(1))
    assert table > window  # the table is wider than the window: it scrolls in its own box
    assert width <= window == 1280  # and the page does not


@pytest.mark.slow
def test_the_start_up_block_is_printed_once_then_one_line_a_trial(small_data, tmp_path, capsys):
    space = tmp_path / "space.toml"
    space.write_text("[lr]\nlow = 1e-4\nhigh = 1e-2\nlog = true\n")
    out = tmp_path / "t"
    argv = ["tune", "--data", str(small_data), "--out", str(out), "--space", str(space), "--trials", "2"]
    argv += [*TINY_RESNET, "--epochs", "1"]  # the model is not the subject
    argv += ["--batch-size", "8", "--num-workers", "0", "--threads", "1", "--pruner", "none"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("Running training") == 1  # the first trial's start-up block, once
    second = [line for line in printed.splitlines() if line.startswith("visiontune: trial 1:")]
    assert len(second) == 1, second
    lr = re.fullmatch(
        r"visiontune: trial 1: lr=(\S+) \(output: trial-0001\.log\) \.\.\. val accuracy [0-9.]+", second[0]
    )
    assert lr and f"{float(lr[1]):.3g}" == lr[1], second  # 3 significant digits
    assert "Running training" in (out / "trial-0001.log").read_text()
