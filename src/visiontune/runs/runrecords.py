"""A run folder's training records read back: ``config.json``, ``summary.json``, ``history.json`` and
``split.json``, checked first.

A run folder may come from anyone (a colleague's, a download), so every command that reads one -- the pages,
tables and cards made from it (``report``, ``compare`` and its cross-validation, the Hub folder's model card),
the model's description for ``predict``, ``evaluate`` and ``export`` (``read_run``), ``evaluate``'s data and
split, the summary a launched job's workers wrote -- reads it here and nowhere else. Each record is a JSON
object (history: a list) of at most ``MAX_RECORD`` bytes (``_load``); each field it shows is checked against a
schema (``_checked``) -- the settings against ``TrainConfig``'s types, the model's description against the model
file's own schema (``runinfo.check``), the figures as numbers, counts and texts -- and a field that fails is one
line naming the file and the field. Fields no reader shows are dropped, and those an older visiontune did not
write are simply absent. A missing file is ``None``: a run that did not finish. ``bad_files.csv`` (the files the
run skipped, which ``evaluate`` leaves out when it tells moved data by ``split.json``'s hash) is read here too,
bounded as the records are (``read_bad_files``). The records later commands add
(an evaluation's ``eval.json``, a bench's ``bench.json``) are ``runs.evalrecords``', read through the same
``_load`` and ``_checked`` and the type checks here.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from visiontune.data.split import split_hash
from visiontune.errors import UserError
from visiontune.runs import epochs
from visiontune.runs.runinfo import RunInfo
from visiontune.settings.config import MEAN, STD
from visiontune.settings.validation import check_types, in_current_forms
from visiontune.tasks import TASKS

MAX_RECORD = 64 << 20  # bytes: a million epochs of history fit; a record no run writes does not reach json
MAX_SPLIT = 1 << 30  # bytes of split.json: every file name of the data, tens of millions of them
MAX_TEXT = 100_000  # characters of one text field (a data path, an announced setup line)
MAX_BAD_FILES = MAX_SPLIT  # bytes of bad_files.csv: at most every file of the data, each with why it is bad


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_TEXT


def _optional_text(v: Any) -> bool:
    return v is None or _text(v)


def _real(v: Any) -> bool:
    # NaN is a value a run writes (the lr of --lr auto before its sweep); a bool is no number.
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _optional_real(v: Any) -> bool:
    return v is None or _real(v)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float)) or _text(v)


def _table(value_ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A JSON object whose every value passes ``value_ok``."""
    return lambda v: isinstance(v, dict) and all(value_ok(x) for x in v.values())


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(_text(x) for x in v)


def _reals(v: Any) -> bool:
    return v is None or isinstance(v, list) and all(_real(x) for x in v)


def _object(v: Any) -> bool:
    return v is None or isinstance(v, dict)


# The world's setup (``cluster.strategy.Setup``), in config.json's "setup" and summary.json alike.
SETUP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "strategy": (_text, "a strategy name"),
    "world_size": (_count, "a whole number"),
    "per_process_batch": (_count, "a whole number"),
    "global_batch": (_count, "a whole number"),
    "lr": (_real, "a number"),
    "devices": (_texts, "a list of device names"),
    "threads": (_count, "a whole number"),
    "loader_workers": (_count, "a whole number"),
    "decode_threads": (_count, "a whole number"),
    "threads_from": (_text, "a text"),
}

# config.json, section by section ("config" is TrainConfig's fields, "model" the run's self-description).
CONFIG: dict[str, tuple[Callable[[Any], bool], str]] = {
    "config": (lambda v: isinstance(v, dict), "the run's settings, an object"),
    "setup": (_table(lambda x: _scalar(x) or _texts(x)), "an object of values"),
    "overview": (_table(_scalar), "an object of texts"),
    "versions": (_table(_text), "an object of version texts"),
    "data": (
        lambda v: isinstance(v, dict) and all(_optional_text(v.get(k)) for k in ("root", "layout", "source")),
        'an object with the texts "root", "layout" and "source"',
    ),
    "model": (lambda v: isinstance(v, dict), "a model description, an object"),
    "image_cache": (_object, "an object or null"),
}

# summary.json (``records.finish``): the best epoch's figures, the split's sizes, the setup.
SUMMARY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "run_dir": (_text, "a folder name"),
    "total_seconds": (_real, "a number"),
    "best_val_accuracy": (_real, "a number"),
    "best_val_loss": (_real, "a number"),
    "best_val_map": (_optional_real, "a number or null"),
    # a regression's: its epochs' score is the MAE (in the targets' units), not an accuracy
    "best_val_mae": (_optional_real, "a number or null"),
    "best_val_rmse": (_optional_real, "a number or null"),
    "best_val_r2": (_optional_real, "a number or null"),
    "task": (_optional_text, "a task's name"),
    "thresholds": (_reals, "a list of numbers or null"),
    "best_epoch": (_count, "a whole number"),
    epochs.COUNTED_FROM: (_count, "1"),
    "best_metric": (_optional_text, "a metric name"),
    "best_weights": (_text, "raw or ema"),
    "epochs": (_count, "a whole number"),
    "train_images_per_s": (_real, "a number"),
    "data_wait_fraction": (_real, "a number"),
    "steady_images": (_real, "a number"),
    "steady_seconds": (_real, "a number"),
    "data_wait_seconds": (_real, "a number"),
    "val_images_counted": (_count, "a whole number"),
    "val_split_size": (_count, "a whole number"),
    "train_split_size": (_count, "a whole number"),
    "classes": (_texts, "a list of class names"),
    "image_cache": (_object, "an object or null"),
    "stopped": (_object, "an object or null"),
    **SETUP,
}

# One row of history.json: the epoch (from 1; an older run's from 0, read as from 1) and each phase's figures.
PHASE = _table(lambda x: _optional_real(x) or _reals(x))
ROW: dict[str, tuple[Callable[[Any], bool], str]] = {
    "epoch": (_count, "a whole number"),
    "lr": (_optional_real, "a number"),
    "train": (PHASE, "an object of numbers"),
    "val": (PHASE, "an object of numbers"),
    "val_ema": (PHASE, "an object of numbers"),
}


# split.json (``data.split:split_summary``, ``data.groups``): how the split was made, and its two lists.
SPLIT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (_whole, "a whole number"),
    "val_fraction": (_real, "a number"),
    "sha256": (_text, "a sha256 text"),
    "method": (_optional_text, "a split method's name"),
    "group_by": (_optional_text, "a pattern"),
    "folds": (_count, "a whole number"),
    "fold": (_count, "a whole number"),
    "from": (_text, "a text"),
    "counts": (_table(_count), "an object of counts"),
    "val": (_texts, "a list of file names"),
    "train": (_texts, "a list of file names"),
}


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _read(path: Path, limit: int) -> bytes | None:
    """The bytes of the run record at ``path``, None when there is no file; one line when it is no file or
    larger than ``limit`` (refused unread, and while read: a file that grows is cut at the bound)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not path.is_file():
        raise UserError(f"{path} is not a file; use a run folder visiontune wrote")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1) if size <= limit else b""
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    size = max(size, len(data))
    if size > limit:
        raise UserError(f"{path} is {size:,} bytes, more than any run writes ({limit:,}); is it a run's record?")
    return data


def _load(path: Path, limit: int | None = None) -> Any | None:
    """The JSON at ``path``, None when there is no file; one line when it is too large or not JSON."""
    data = _read(path, limit or MAX_RECORD)
    if data is None:
        return None
    try:
        return json.loads(data.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise UserError(f"{path} is not JSON ({str(e)[:80]}); use a run folder visiontune wrote") from None


def _checked(record: Any, schema: dict, where: str, what: str) -> dict:
    """The fields of ``record`` that ``schema`` knows, each checked; one line naming the first that fails."""
    if not isinstance(record, dict):
        raise UserError(
            f"{where}: damaged run record: {what.rstrip('.: ') or 'the record'} is {_shown(record)}, "
            "expected a JSON object"
        )
    out = {}
    for name, (ok, wanted) in schema.items():
        if name in record:
            if not ok(record[name]):
                raise UserError(
                    f"{where}: damaged run record: {what}{name} is {_shown(record[name])}, expected {wanted} "
                    "(use a run folder visiontune wrote)"
                )
            out[name] = record[name]
    return out


def read_config(run_dir: str | Path) -> dict | None:
    """``RUN/config.json`` checked, or None without one. Its sections are always there (empty when an older
    run did not write them); ``"model"`` is the run's description as ``RunInfo.to_dict`` writes it, or None."""
    path = Path(run_dir) / "config.json"
    record = _load(path)
    if record is None:
        return None
    where = str(path)
    out = _checked(record, CONFIG, where, "")
    # An earlier run's settings in the forms they had then (`augment = true`, `nnodes = 1`), read in today's.
    settings = out["config"] = in_current_forms(out.get("config", {}))
    check_types(settings, f"{where}: config")
    if "model" in out:
        out["model"] = RunInfo.from_dict(out["model"], where).to_dict()
    for name in ("config", "setup", "overview", "versions", "data"):
        out.setdefault(name, {})
    out.setdefault("model", None)
    _checked(out["setup"], SETUP, where, "setup.")
    return out


def _task_figures(record: Any) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """The schema of what the task a summary names adds of its best epoch (``Task.best_figures``: its score and a
    figure a curve), each a number or null: a task registered outside the built-in ones, whose figures ``SUMMARY``
    does not name, keeps them (a launched job's summary is its workers' read back here)."""
    name = record.get("task") if isinstance(record, dict) else None
    task = TASKS.get(name) if isinstance(name, str) else None
    keys = () if task is None else (task.score_key, *(key for key, _ in task.curves))
    return {f"best_val_{key}": (_optional_real, "a number or null") for key in keys}


def read_summary(run_dir: str | Path) -> dict | None:
    """``RUN/summary.json`` checked, or None: the training did not finish."""
    path = Path(run_dir) / "summary.json"
    record = _load(path)
    if record is None:
        return None
    summary = _checked(record, {**_task_figures(record), **SUMMARY}, str(path), "")
    if "best_epoch" in summary:  # counted from 1 for every reader, an older run's 0-based one too
        summary.update(best_epoch=epochs.best_epoch(summary), **{epochs.COUNTED_FROM: 1})
    return summary


def read_history(run_dir: str | Path) -> list[dict]:
    """``RUN/history.json``'s epochs checked (empty without one), in order, each with its train and val."""
    path = Path(run_dir) / "history.json"
    record = _load(path)
    return [] if record is None else check_history(record, str(path))


def check_history(record: Any, where: str) -> list[dict]:
    """A history's epochs (``history.json``, a checkpoint's ``history``) checked: the fields ``ROW`` knows."""
    if not isinstance(record, list):
        raise UserError(f"{where}: damaged run record: expected a list of epochs, got {_shown(record)}")
    rows = [_checked(row, ROW, where, f"epoch {i}: ") for i, row in enumerate(record)]
    for i, row in enumerate(rows):  # what every epoch has: its number, and the training accuracy and loss
        if not {"epoch", "train", "val"} <= set(row) or not all(
            _real(row["train"].get(k)) for k in ("accuracy", "loss")
        ):
            raise UserError(
                f"{where}: damaged run record: epoch {i} lacks its number, its val figures or its train accuracy "
                "and loss (use a run folder visiontune wrote)"
            )
    return epochs.rows(rows)  # counted from 1, an older run's 0-based file too


def read_split(run_dir: str | Path) -> dict | None:
    """``RUN/split.json`` checked -- seed, fraction, sha256, method, groups or fold, and its file lists as the
    run wrote them -- or None without one."""
    path = Path(run_dir) / "split.json"
    record = _load(path, MAX_SPLIT)
    return None if record is None else _checked(record, SPLIT, str(path), "")


def read_split_lists(run_dir: str | Path) -> dict[str, list[str]] | None:
    """``RUN/split.json``'s validation and training file names (as the run wrote them), or None without one."""
    record = read_split(run_dir)
    if record is None:
        return None
    if not {"val", "train"} <= set(record):
        raise UserError(f"{Path(run_dir) / 'split.json'}: damaged run record: no val and train lists of file names")
    return {"val": record["val"], "train": record["train"]}


def read_split_record(path: str | Path) -> dict:
    """A ``split.json`` (at ``path``) whole, its lists checked against its sha256: one line when it is missing,
    damaged, or its lists were edited."""
    path = Path(path)
    record = _load(path, MAX_SPLIT)
    if record is None:
        raise UserError(f"{path} is missing; use a run folder visiontune wrote")
    return held_to_sha256(_checked(record, SPLIT, str(path), ""), path)


def held_to_sha256(record: dict, path: str | Path) -> dict:
    """A checked ``split.json`` record (from ``path``) whose train and val lists hash to the sha256 the run
    wrote beside them; one line when they do not (the file was edited: training images in the val list) or
    it has not both lists and the sha256."""
    if not {"train", "val", "sha256"} <= set(record):
        raise UserError(f"{path}: damaged run record: no train and val lists of file names with their sha256")
    if split_hash(record["train"], record["val"]) != record["sha256"]:
        raise UserError(f"{path}: its file lists do not match its sha256; the file was edited or damaged")
    return record


def read_bad_files(run_dir: str | Path) -> list[str] | None:
    """The files ``RUN/bad_files.csv`` (``data.check:write_report``) names, in order, or None without one: at most
    ``MAX_BAD_FILES`` bytes, a CSV whose every row after its header starts with a file's path; one line when not."""
    path = Path(run_dir) / "bad_files.csv"
    data = _read(path, MAX_BAD_FILES)
    if data is None:
        return None
    damaged = f"{path}: damaged run record: not a CSV of file names"
    try:
        rows = csv.reader(io.StringIO(data.decode("utf-8", "surrogateescape"), newline=""), strict=True)
        next(rows, None)  # its header
        paths = []
        for number, row in enumerate(rows, 2):
            if row and not row[0]:
                raise UserError(f"{damaged} (row {number} names no file)")
            paths += row[:1]
    except csv.Error as e:  # a cell over csv's field limit (no file name is that long), a quote left open
        raise UserError(f"{damaged} ({e})") from None
    return paths


def read_run(run_dir: str) -> RunInfo:
    """The run's description in ``RUN/config.json`` (``predict``, ``evaluate``, ``export``, ``--init-from``);
    runs from before it existed are described from their settings and ``classes.json``."""
    run = Path(run_dir)
    for name in ("config.json", "classes.json"):
        if not (run / name).is_file():
            raise UserError(f"{run_dir} is not a visiontune run folder ({name} is missing)")
    where, record = str(run / "config.json"), read_config(run)
    if record["model"] is not None:
        return RunInfo.from_dict(record["model"], where)
    classes = _load(run / "classes.json")
    if not _texts(classes):
        raise UserError(f"{run / 'classes.json'}: damaged run record: expected a list of class names")
    cfg = record["config"]
    # Written before runs described themselves: torchvision, the blog's statistics, a bilinear resize.
    return RunInfo.from_dict(
        {
            "model": cfg.get("model"),
            "source": "torchvision",
            "classes": classes,
            "image_size": cfg.get("image_size"),
            "mean": MEAN,
            "std": STD,
            "interpolation": "bilinear",
            "version": "unknown",
        },
        where,
    )
