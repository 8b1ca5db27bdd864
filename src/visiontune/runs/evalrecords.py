"""An evaluation's ``eval.json`` (and ``eval-NAME.json``) and a bench's ``bench.json`` read back, checked first.

These are written into a run folder by later commands (``visiontune evaluate``, ``visiontune bench``) and
read back by the run's page (``reports.report``) and by ``evaluate --nproc N``'s launching process, which
counts the images its workers skipped. A run folder may come from anyone, so they are read as
``runs.runrecords`` reads the training's records, through its bounded ``_load`` and its ``_checked``: each
field the page shows checked -- an evaluation's by the schema of the evaluation that wrote it
(``EVALUATIONS``, and those registered beside them in ``reports.evaluations``) -- and a field that fails is
one line naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from visiontune.errors import UserError
from visiontune.runs.runrecords import (
    _checked,
    _count,
    _load,
    _optional_real,
    _optional_text,
    _real,
    _reals,
    _shown,
    _table,
    _text,
    _texts,
)
from visiontune.tasks import MULTI_LABEL, REGRESSION, SINGLE_LABEL, recorded


def _items(required: tuple[str, ...], **fields: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A list of JSON objects, each with the ``required`` fields and each of ``fields`` it has passing its check."""
    return lambda v: (
        isinstance(v, list)
        and all(
            isinstance(x, dict) and set(required) <= set(x) and all(ok(x[k]) for k, ok in fields.items() if k in x)
            for x in v
        )
    )


FIGURES = _table(_table(_optional_real))  # per class (or average, or target): its figures by name

# What every evaluation writes (``inference.evaluate``) and the run page shows: what it scored, and how.
EVALUATION: dict[str, tuple[Callable[[Any], bool], str]] = {
    "report": (_optional_text, "an evaluation's name"),
    "task": (_optional_text, "a task's name"),
    "data": (_text, "a data folder"),
    "layout": (_optional_text, "a layout's name"),
    "scored": (_text, "a text"),
    "tta": (_text, "a test-time augmentation's name"),
    "classes": (_texts, "a list of class names"),
    "model_file": (
        lambda v: v is None or isinstance(v, dict) and all(_optional_text(v.get(k)) for k in ("name", "sha256")),
        'null or an object with the texts "name" and "sha256"',
    ),
    "averages": (FIGURES, "an object of averages, each an object of numbers"),
}
# Each built-in evaluation's own fields (its writer in ``inference.evaluate``, its page section in
# ``reports.report``), and the fields its section cannot do without.
SINGLE_LABEL_EVALUATION = {
    **{k: (_optional_real, "a number or null") for k in ("accuracy", "balanced_accuracy", "top_k_accuracy")},
    **{k: (_optional_real, "a number or null") for k in ("macro_average_precision", "log_loss", "ece")},
    "images": (_count, "a whole number"),
    "top_k": (lambda v: v is None or _count(v), "a whole number or null"),
    "ece_bins": (_count, "a whole number"),
    "per_class": (FIGURES, "an object of classes, each an object of numbers"),
    "top_losses": (
        _items(("path", "true", "predicted"), path=_text, true=_count, predicted=_count, probability=_real, loss=_real),
        "a list of objects with a path, the true and predicted class indices, a probability and a loss",
    ),
}
MULTI_LABEL_EVALUATION = {
    **{k: (_optional_real, "a number or null") for k in ("map", "map_micro", "exact_match", "hamming_accuracy")},
    "images": (_count, "a whole number"),
    "thresholds_from": (_text, "a text"),
    "per_class": (FIGURES, "an object of classes, each an object of numbers"),
    "worst_per_class": (
        _table(_items(("path", "positive"), path=_text, positive=lambda v: isinstance(v, bool), probability=_real)),
        "an object of classes, each a list of objects with a path, positive (true or false) and a probability",
    ),
}
REGRESSION_EVALUATION = {
    **{k: (_optional_real, "a number or null") for k in ("mae", "rmse", "r2", "baseline_mae")},
    "count": (_count, "a whole number"),
    "per_target": (FIGURES, "an object of targets, each an object of numbers"),
    "largest_residuals": (
        _items(("path",), path=_text, error=_real, true=_reals, predicted=_reals),
        "a list of objects with a path, an error and the true and predicted values",
    ),
}
# By the evaluation's name (eval.json's "report"): its schema, and the fields its page section cannot do without.
EVALUATIONS: dict[str, tuple[dict, tuple[str, ...]]] = {
    SINGLE_LABEL.name: (SINGLE_LABEL_EVALUATION, ("data", "scored", "tta", "classes", "ece_bins", "per_class")),
    MULTI_LABEL.name: (MULTI_LABEL_EVALUATION, ("data", "scored", "tta", "thresholds_from", "per_class")),
    REGRESSION.name: (REGRESSION_EVALUATION, ()),
}

# bench.json (``reports.bench``): the load line and a row per strategy, run or not (then why).
BENCH: dict[str, tuple[Callable[[Any], bool], str]] = {
    "load_note": (_text, "a text"),
    "rows": (
        _items(
            ("strategy",),
            strategy=_text,
            **{k: _optional_real for k in ("processes", "global_batch", "images_per_s", "spread", "speedup")},
            **{k: _optional_real for k in ("data_stall", "val_accuracy")},
            **{k: _text for k in ("skipped", "failed", "note", "unreliable", "run_dir")},
        ),
        "a list of objects, each with its strategy's name, its figures as numbers and its notes as texts",
    ),
}

# The images an evaluation left out, unreadable, each with why (``inference.evaluate``).
SKIPPED = (
    _items(("path", "reason"), path=_text, reason=_text),
    "a list of objects with a path and a reason",
)


def read_evaluation(path: str | Path, schemas: dict[str, tuple[dict, tuple[str, ...]]] | None = None) -> dict | None:
    """An ``eval.json`` (at ``path``) checked by the schema of the evaluation that wrote it (its ``"report"``; a
    file from before it was named: its task's), from ``EVALUATIONS`` and ``schemas`` (those registered beside
    them). None without a file, or for a file no evaluation this visiontune knows wrote (an older visiontune's:
    neither a name nor ``averages``). ``"report"`` is always the evaluation's name in what it returns."""
    path = Path(path)
    record = _load(path)
    if record is None:
        return None
    where = str(path)
    if not isinstance(record, dict):
        raise UserError(f"{where}: damaged run record: the record is {_shown(record)}, expected a JSON object")
    name = record.get("report")
    if name is None and "averages" in record:  # written before evaluations were named: the task's own
        name = (recorded(record) or SINGLE_LABEL).name
    known = {**EVALUATIONS, **(schemas or {})}
    if not isinstance(name, str) or name not in known:
        return None
    schema, needed = known[name]
    out = _checked(record, {**EVALUATION, **schema}, where, "")
    missing = [k for k in needed if k not in out]
    if missing:
        raise UserError(
            f"{where}: damaged run record: a {name} evaluation without its {', '.join(missing)} "
            "(run visiontune evaluate again, or delete it)"
        )
    classes = len(out.get("classes") or [])
    if any(not (it["true"] < classes and it["predicted"] < classes) for it in out.get("top_losses") or []):
        raise UserError(f"{where}: damaged run record: top_losses names a class index outside its {classes} classes")
    return {**out, "report": name}


def read_bench(path: str | Path) -> dict | None:
    """A ``bench.json`` (at ``path``) checked, or None without one."""
    path = Path(path)
    record = _load(path)
    return None if record is None else _checked(record, BENCH, str(path), "")


def read_skipped(path: str | Path) -> int:
    """How many images the evaluation at ``path`` skipped as unreadable: what ``evaluate --nproc N``'s
    launching process says of the ``eval.json`` its workers wrote. One line when there is none, or none
    that lists them."""
    path = Path(path)
    record = _load(path)
    record = {} if record is None else _checked(record, {"skipped": SKIPPED}, str(path), "")
    if "skipped" not in record:
        raise UserError(f"{path}: damaged run record: no list of the images it skipped (run visiontune evaluate again)")
    return len(record["skipped"])
