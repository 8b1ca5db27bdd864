"""The search space: which training settings a study samples, and from what.

A space file is TOML, one table per ``TrainConfig`` setting::

    [lr]
    low = 1e-4
    high = 0.1
    log = true          # log-uniform

    [weight_decay]
    low = 0.0
    high = 0.1

    [augment]
    choices = ["none", "light", "trivial"]

A table with ``choices`` is a categorical; one with ``low`` and ``high`` a range, of integers when the setting
is an integer (``step`` optional) and of floats otherwise (``log`` or ``step`` optional). Without a file each
recipe has a default space (``default_space``); a setting fixed on the command line (or in ``--config``) is
left out of it, and ``--model a,b,c`` adds the model as a choice. Every value a space can yield is checked
against the setting's own rules before the first trial (the range's ends, every choice), so a bad space is
one line before any training.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from visiontune.cluster.host import user_cache_dir
from visiontune.errors import UserError
from visiontune.models.names import check_model
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import check_types, validate
from visiontune.tasks import Task
from visiontune.text import printable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Settings that say where and how a trial runs, not how it learns: never searched.
NOT_SEARCHED = frozenset(
    {
        "data",
        "output_dir",
        "resume",
        "init_from",
        "strategy",
        "nproc",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "rdzv_endpoint",
        "max_restarts",
        "timeout",
        "threads",
        "num_workers",
        "cache",
        "log_with",
        "progress",
        "timing_warmup",
        "save_every_steps",
        "keep_last",
        "save_pth",
        "image_column",
        "label_column",
        "task",
        "multi_label",
        "folds",
        "fold",
        "best_metric",
        "limit_images",
        "max_bad_fraction",
    }
)


@dataclass(frozen=True)
class Param:
    """One searched setting: ``choices``, or a range ``low``..``high`` of ``kind`` int or float."""

    name: str
    kind: str  # "categorical", "int" or "float"
    choices: tuple = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None

    def suggest(self, trial) -> Any:
        """The value for ``trial`` (an optuna ``Trial``; a retried one already holds it)."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is one this setting can take in the space (a choice, or within the range)."""
        if self.kind == "categorical":
            return value in self.choices
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high

    def extremes(self) -> list[Any]:
        """The values to check a setting's rules with: every choice, or the range's ends (integers for an int)."""
        if self.kind == "categorical":
            return list(self.choices)
        return [int(self.low), int(self.high)] if self.kind == "int" else [self.low, self.high]

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"{self.name} in {{{', '.join(printable(c) for c in self.choices)}}}"
        return f"{self.name} in [{self.low:g}, {self.high:g}]{' log' if self.log else ''}"


_TYPES = {f.name: f.type for f in fields(TrainConfig)}
SEARCHABLE = frozenset(_TYPES) - NOT_SEARCHED


def _param(name: str, table: Any, where: str) -> Param:
    def bad(what: str) -> UserError:
        return UserError(f"{where}: [{name}] {what}")

    if name not in _TYPES:
        raise UserError(f"{where}: [{name}] is not a training setting (see `visiontune train --help`)")
    if name in NOT_SEARCHED:
        raise bad("is not a setting a study searches (it says where or how a trial runs); fix it with its flag")
    if not isinstance(table, dict):
        raise bad("must be a table: choices = [...], or low = ... and high = ...")
    extra = set(table) - {"choices", "low", "high", "log", "step"}
    if extra:
        raise bad(f"has unknown key(s) {', '.join(sorted(extra))}; use choices, or low, high, log and step")
    if "choices" in table:
        if set(table) != {"choices"}:
            raise bad("has choices and a range: give one of them")
        values = table["choices"]
        if not isinstance(values, list) or not values or len({repr(v) for v in values}) != len(values):
            raise bad("choices must be a non-empty list of distinct values")
        if name == "crop_scale":
            raise bad("crop_scale is a pair; it cannot be searched")
        return Param(name, "categorical", tuple(values))
    if "low" not in table or "high" not in table:
        raise bad("needs choices = [...], or both low and high")
    kind = "int" if _TYPES[name] in ("int", "int | None") else "float"
    if _TYPES[name] not in ("int", "int | None", "float", "float | None", "float | str | None"):
        raise bad("is not a number: give choices = [...]")
    low, high, log, step = table["low"], table["high"], table.get("log", False), table.get("step")
    numbers = [low, high] + ([] if step is None else [step])
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in numbers):
        raise bad("low, high and step must be finite numbers")
    if kind == "int" and any(isinstance(v, float) for v in numbers):
        raise bad(f"{name} is an integer setting: low, high and step must be integers")
    if not isinstance(log, bool):
        raise bad("log must be true or false")
    if not low < high:
        raise bad(f"low must be below high, got {low} and {high}")
    if log and low <= 0:
        raise bad(f"a log range must start above 0, got low = {low}")
    if log and step is not None:
        raise bad("give log or step, not both")
    if step is not None and step <= 0:
        raise bad(f"step must be positive, got {step}")
    return Param(name, kind, (), float(low), float(high), log, None if step is None else float(step))


def load_space(path: str) -> list[Param]:
    """The space in a TOML file; any problem is one line naming the file and the table."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"space file not found: {path}")
    try:
        raw = tomllib.loads(p.read_text())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot parse space file {path}: {e}") from None
    if not raw:
        raise UserError(f"{path} searches nothing: add a table per setting, such as [lr] with low, high and log = true")
    return [_param(name, table, path) for name, table in raw.items()]


# Each recipe's default space: what the recipe benchmark found to matter most on small data sets.
_DEFAULTS: dict[str, dict[str, dict]] = {
    "blog": {
        "lr": {"low": 1e-4, "high": 0.1, "log": True},
        "weight_decay": {"choices": [0.0, 1e-5, 1e-4, 1e-3]},
        "label_smoothing": {"low": 0.0, "high": 0.2},
        "augment": {"choices": ["none", "light", "trivial"]},
        "warmup_epochs": {"choices": [0.0, 1.0]},
    },
    "modern": {
        "lr": {"low": 1e-5, "high": 3e-3, "log": True},
        "weight_decay": {"low": 1e-3, "high": 0.2, "log": True},
        "label_smoothing": {"low": 0.0, "high": 0.2},
        "augment": {"choices": ["none", "light", "trivial", "randaugment"]},
        "mixup": {"choices": [0.0, 0.2]},
        "cutmix": {"choices": [0.0, 1.0]},
        "ema": {"choices": [0.0, 0.999]},
        "warmup_epochs": {"choices": [0.0, 1.0]},
        "image_size": {"choices": [160, 192, 224]},
    },
}


def default_space(recipe: str) -> list[Param]:
    return [_param(name, table, f"the {recipe} recipe's default space") for name, table in _DEFAULTS[recipe].items()]


def resolve(cfg: TrainConfig, fixed: set[str], path: str | None, models: list[str] | None) -> list[Param]:
    """The study's space: the file's (or the recipe's default without the settings in ``fixed``), the models
    of ``--model a,b,c`` as a choice; each value checked on ``cfg``. A setting both fixed and in the file: one line."""
    if path:
        space = load_space(path)
        both = sorted({p.name for p in space} & fixed)
        if both:
            flags = ", ".join("--" + n.replace("_", "-") for n in both)
            raise UserError(f"{flags} fixed on the command line and searched in {path}: drop one of them")
    else:
        space = [p for p in default_space(cfg.recipe) if p.name not in fixed]
    if models:
        space = [p for p in space if p.name != "model"] + [Param("model", "categorical", tuple(models))]
    _not_empty(space)
    for p in space:
        for value in p.extremes():
            where = f"the search space's [{p.name}] value {printable(repr(value))}"
            check_types({p.name: value}, where)
            try:
                validate(cfg.replace(**{p.name: value}))
                if p.name == "model":  # a name that exists: found now, not at the trial that draws it
                    check_model(value, "none", user_cache_dir())  # (its weights are fetched by its trials)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
    return space


def for_task(space: list[Param], cfg: TrainConfig, task: Task, path: str | None) -> list[Param]:
    """``space`` less what the run's task refuses at some value it holds (``Task.refusal``: a regression's
    label smoothing and CutMix), once the data has told the task: the recipe's default space leaves such a
    setting out, as ``train`` leaves out the recipe's label smoothing; a space file's is one line."""
    kept = []
    for p in space:
        problem = next(filter(None, (task.refusal(cfg.replace(**{p.name: v})) for v in p.extremes())), None)
        if problem is None:
            kept.append(p)
        elif path:
            raise UserError(f"{path} searches [{p.name}], which {task.title} data refuses: {problem}")
    return _not_empty(kept)


def _not_empty(space: list[Param]) -> list[Param]:
    if not space:
        raise UserError(
            "the search space is empty: every setting it would search is fixed (or refused on this data); "
            "pass --space FILE"
        )
    return space


def check_values(space: list[Param], values: dict[str, Any], where: str) -> None:
    """Refuse, in one line, a value outside ``space`` (a trial queued in the store by anyone can hold one)."""
    for p in space:
        if not p.holds(values.get(p.name)):
            shown = printable(repr(values.get(p.name)))
            raise UserError(f"{where}: {p.name} = {shown[:80]} is outside the search space ({p.describe()})")


def recipe_values(space: list[Param], cfg: TrainConfig) -> dict[str, Any]:
    """What ``cfg`` (validated: its recipe filled in) sets for each searched setting the space holds: a new
    study's first trial, so that the search starts from what `visiontune train` would run and its best is
    never below that run's validation score (Ultralytics' tuner also starts from its defaults)."""
    return {p.name: getattr(cfg, p.name) for p in space if p.holds(getattr(cfg, p.name))}


def sample(space: list[Param], trial) -> dict[str, Any]:
    return {p.name: p.suggest(trial) for p in space}
