"""The fuzz target of the study store's reader (``tuning/store.py``): any trial rows anyone could write with
Optuna's API give checked rows or one line, and what ``tune`` shows of them (the terminal table, ``tune.html``,
``best.toml``) stays escaped: no control character on the terminal, no link but to a folder of the tune
folder, no TOML but the settings' own."""

from __future__ import annotations

import math
import sys

import optuna
import pytest
from hypothesis import given
from hypothesis import strategies as st
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from fuzzing import fuzz_settings
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tuning import results, store, study

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

optuna.logging.set_verbosity(optuna.logging.ERROR)

CFG = validate(TrainConfig(data="d", model="resnet18", weights="none", image_size=32))
TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["javascript:alert(1)", "x\nlr = 9\n[evil]", "\x1b]0;t\x07", "trial-0001", "../..", "https://e.example"]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
ATTRS = st.dictionaries(
    st.sampled_from(["run_dir", "config", "error", "epochs_done"]) | TEXT,
    JSON | st.dictionaries(st.sampled_from(["lr", "epochs", "augment", "output_dir", "zz"]), JSON, max_size=3),
    max_size=3,
)
SYSTEM = st.dictionaries(
    st.sampled_from([study.OWNER, study.BEAT, study.FAILED, "retry_history", "failed_trial"]),
    JSON
    | st.fixed_dictionaries(
        {},
        optional={"host": JSON, "pid": JSON, "started": JSON, "since": JSON, "heartbeat": JSON},
    ),
    max_size=4,
)
CHOICES = ["none", "light", "\x1b[2J", "x\ny"]


@st.composite
def trial_rows(draw):
    state = draw(st.sampled_from([TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING]))
    params, dists = {}, {}
    if draw(st.booleans()):
        params["lr"], dists["lr"] = draw(st.floats(1e-4, 0.1)), FloatDistribution(1e-4, 0.1, log=True)
    if draw(st.booleans()):
        params["augment"], dists["augment"] = draw(st.sampled_from(CHOICES)), CategoricalDistribution(CHOICES)
    value = draw(st.floats(allow_nan=False)) if state == TrialState.COMPLETE else None
    steps = draw(st.dictionaries(st.integers(0, 5), st.floats(allow_nan=False), max_size=3))
    return create_trial(
        state=state,
        value=value,
        params=params,
        distributions=dists,
        user_attrs=draw(ATTRS),
        system_attrs=draw(SYSTEM),
        intermediate_values=steps,
    )


def _printable_lines(text: str) -> bool:
    return all(line.isprintable() for line in text.split("\n"))


def _read(rows, direction: str):
    """The study of ``rows`` and its rows read through the store, or None where the store refused them in one line."""
    s = optuna.create_study(direction=direction)
    for t in rows:
        s.add_trial(t)
    try:
        return s, store.trials(s)
    except UserError as e:
        assert "\n" not in str(e) and _printable_lines(str(e))
        return s, None


ROWS = st.lists(trial_rows(), max_size=4)
DIRECTION = st.sampled_from(["minimize", "maximize"])


@fuzz_settings(60)
@given(rows=ROWS, direction=DIRECTION)
def test_fuzz_any_study_rows_give_checked_rows_or_one_line(rows, direction):
    _, read = _read(rows, direction)
    if read is None:
        return
    for r in read:
        assert r.value is None or math.isfinite(r.value)
        assert all(isinstance(k, str) for k in r.params) and all(math.isfinite(v) for v in r.reported.values())
        assert r.config is None or isinstance(r.config, dict)
        assert r.owner is None or r.owner.heartbeat is None or 0 < r.owner.heartbeat <= store.MAX_HEARTBEAT
    best = store.best(read, direction)
    assert best is None or (best.state == TrialState.COMPLETE and math.isfinite(best.value))
    assert _printable_lines(results.table(read, best, "accuracy"))
    if best is None:
        return
    try:
        written = results.best_toml(best, "accuracy", CFG)
    except UserError as e:
        assert "\n" not in str(e)
        return
    parsed = tomllib.loads(written)  # only the settings' own keys and values: no table, no stray line
    assert set(parsed) <= set(TrainConfig.__dataclass_fields__) - {"output_dir", "resume"} and parsed["data"] == "d"
    lines = written.splitlines()  # (tomli_w writes an array over several lines)
    assert not any(line.startswith("[") for line in lines) and all(line.isprintable() for line in lines)


@pytest.mark.slow  # the page draws its figures and Optuna's importances for each example: seconds
@fuzz_settings(30)
@given(rows=ROWS, direction=DIRECTION)
def test_fuzz_tune_html_from_any_study_rows_links_only_folders_of_the_tune_folder(tmp_path_factory, rows, direction):
    s, read = _read(rows, direction)
    if read is None:
        return
    out = tmp_path_factory.mktemp("fuzz")
    (out / "trial-0001").mkdir()
    page = results.page(s, read, store.best(read, direction), "accuracy", out)
    assert "\x1b" not in page and "\x07" not in page
    for href in page.split('href="')[1:]:
        assert href.startswith(("best.toml", "./trial-0001/")), href[:40]
