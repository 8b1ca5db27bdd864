"""Epoch numbers in the run folder's files, counted from 1 as the console prints them ("Epoch 1/3"):
``history.json``'s and ``metrics.csv``'s ``epoch``, ``summary.json``'s ``best_epoch``. The trainer and its
checkpoints count from 0 inside; ``for_files`` turns its rows into the files' count. Runs written before
the files counted from 1 (``history.json`` starting at epoch 0, a ``summary.json`` without
``COUNTED_FROM``) are read through ``rows`` and ``best_epoch`` (``runrecords`` does), which give every reader
the count from 1.
"""

from __future__ import annotations

COUNTED_FROM = "epochs_counted_from"  # summary.json: 1 (its absence: an older run's 0-based best_epoch)


def for_files(history: list[dict]) -> list[dict]:
    """The trainer's rows (0-based) as the files hold them: copies, ``epoch`` counted from 1."""
    return [{**row, "epoch": row["epoch"] + 1} for row in history]


def rows(history: list[dict]) -> list[dict]:
    """A ``history.json`` read back, counted from 1 whichever visiontune wrote it: an older file's first
    epoch is 0 (every run's history starts at its first epoch)."""
    if history and isinstance(history[0], dict) and history[0].get("epoch") == 0:
        return for_files(history)
    return history


def best_epoch(summary: dict) -> int | None:
    """``summary.json``'s best epoch counted from 1 (an older file's is 0-based); None when it has none."""
    v = summary.get("best_epoch")
    if not isinstance(v, int) or isinstance(v, bool):
        return None
    return v if summary.get(COUNTED_FROM) == 1 else v + 1
