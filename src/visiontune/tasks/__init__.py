"""What a run learns to predict, one object per task behind ``base.Task``, chosen by name from ``TASKS``:
``classify`` (``single``: one class an image), ``multilabel`` (``multi``: a set of classes an image,
multi-hot rows), ``regress`` (``regress``: one or more numbers an image).

A run's task is resolved once (``training.plan``: ``--task``, or for ``auto`` the one its data was read as)
and handed to everything downstream; a run's records name it (``recorded`` also reads the records of
runs from before the name, which said ``multi_label``). A new task is one module here and one line below.
"""

from __future__ import annotations

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
    "best_metric",
    "get",
    "read_as",
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


def read_as(name: str) -> str:
    """What ``--task name``'s data sources read the label cells as (``auto``: as they say themselves)."""
    return name if name == "auto" else get(name).reads


def recorded(model: dict | None) -> Task | None:
    """The task a run's model description names: ``task``, or ``multi_label`` in records written before the
    task had a name; None when it names one this visiontune does not know."""
    model = model if isinstance(model, dict) else {}
    if "task" in model:
        return TASKS.get(model["task"]) if isinstance(model["task"], str) else None
    return MULTI_LABEL if model.get("multi_label") is True else SINGLE_LABEL


def task_of(cfg, images) -> Task:
    """What a run on ``images`` learns to predict: ``--task``, or for ``auto`` what the data was read as (its
    sources read the labels as ``--task`` asks, so the two agree unless a source cannot read them so)."""
    task = get(images.task if cfg.task == "auto" else cfg.task)
    if task.reads != images.task:
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
