"""What a run learns to predict, one object per task behind ``base.Task``, chosen by name from ``TASKS``:
``classify`` (``single``: one class an image), ``multilabel`` (``multi``: a set of classes an image,
multi-hot rows), ``regress`` (``regress``: one or more numbers an image).

A run's task is resolved once (``training.plan``: ``--task``, or for ``auto`` the one its data was read as)
and handed to everything downstream; a run's records name it (``recorded`` also reads the records of
runs from before the name, which said ``multi_label``). A new task is one module here and one line below.

A task reads its own labels: the data sources list each image's raw label cells and hand them to the task
(``Task.parse``), which also says how they are split; ``reader`` gives the sources what ``--task`` names,
``AUTO`` for ``auto`` (the cells say which task they are: class names, or label sets where they say so).
"""

from __future__ import annotations

import numpy as np

from visiontune.data.imageset import Cells, Labelled
from visiontune.errors import UserError
from visiontune.tasks.base import RANKED, UNREADABLE, Task
from visiontune.tasks.multi import MULTI_LABEL
from visiontune.tasks.regress import REGRESSION
from visiontune.tasks.single import SINGLE_LABEL

__all__ = [
    "MULTI_LABEL",
    "RANKED",
    "REGRESSION",
    "SINGLE_LABEL",
    "TASKS",
    "UNREADABLE",
    "Task",
    "AUTO",
    "best_metric",
    "get",
    "reader",
    "recorded",
    "register",
    "task_of",
]

TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Add ``task`` to the registry under its name (a test may register its own)."""
    TASKS[task.name] = task
    return task


for _task in (SINGLE_LABEL, MULTI_LABEL, REGRESSION):
    register(_task)


def get(name: str) -> Task:
    """The task called ``name`` (``--task``, a run's records); one line naming the tasks there are when none is."""
    if name not in TASKS:
        raise UserError(f"--task {name}: no such task; choose auto or one of {', '.join(TASKS)}")
    return TASKS[name]


class Auto:
    """``--task auto``: label cells read as the task they say they are. Label sets where they say so (a ``;`` in
    a manifest's label cell, an hf: column of ClassLabel lists), else class names."""

    name = "auto"

    def names_columns(self, row: list[str], where: str = "") -> bool:
        return SINGLE_LABEL.names_columns(row, where)

    def parse(self, cells: Cells) -> Labelled:
        if cells.per_row:
            sets = any(row and ";" in row[0] for row in cells.rows)
        else:
            sets = cells.rows is not None and cells.names is not None and not isinstance(cells.rows, np.ndarray)
        return (MULTI_LABEL if sets else SINGLE_LABEL).parse(cells)

    def read_as(self, name: str) -> Task:
        return get(name)


AUTO = Auto()


def reader(name: str) -> Task | Auto:
    """What the data sources hand their label cells to under ``--task name``."""
    return AUTO if name == "auto" else get(name)


def recorded(model: dict | None) -> Task | None:
    """The task a run's model description names: ``task``, or ``multi_label`` in records written before the
    task had a name; None when it names one this visiontune does not know."""
    model = model if isinstance(model, dict) else {}
    if "task" in model:
        return TASKS.get(model["task"]) if isinstance(model["task"], str) else None
    return MULTI_LABEL if model.get("multi_label") is True else SINGLE_LABEL


def task_of(cfg, images) -> Task:
    """What a run on ``images`` learns to predict: ``--task``, or for ``auto`` what the data was read as (the
    task ``--task`` names reads the labels itself, so the two agree unless the listing came from elsewhere)."""
    task = get(images.task if cfg.task == "auto" else cfg.task)
    if task.name != images.task:
        raise UserError(
            f"--task {cfg.task}: {cfg.data} holds {get(images.task).title} data; drop --task or fix the data"
        )
    task = task.configured(cfg)
    problem = task.refusal(cfg)
    if problem:
        raise UserError(problem)
    return task


def best_metric(cfg, task: Task) -> str:
    """What picks the best epoch: ``--best-metric``, one the task measures, or for ``auto`` the task's own."""
    if cfg.best_metric == "auto":
        return task.best_metric
    if cfg.best_metric not in task.metrics:
        raise UserError(
            f"--best-metric {cfg.best_metric} is not measured on {task.title} data ({cfg.data}): "
            f"choose one of {', '.join(task.metrics)} or auto"
        )
    return cfg.best_metric
