"""Each task's evaluation, found through the task's name in one registry: the writer of its ``eval.json``
(and the files beside it) and its section of the run's page.

The two halves live where their imports allow -- a writer scores gathered outputs in
``inference.evaluate``, a section is HTML in ``reports.report`` -- and each registers into the one record
its task's name keys here; a task defined elsewhere (a test module) registers both halves at once. A task
with no evaluation of its own has the one of the task it is built on (its nearest parent class that has
one), and its ``eval.json`` names the evaluation that wrote it (``report``), so the page finds the section
again in a process that never heard of the task. An ``eval.json`` is read back checked (``runs.evalrecords:
read_evaluation``): a section is given only the fields its evaluation's schema checked, the built-in ones' in
``evalrecords.EVALUATIONS``, another's registered with it (``fields``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Evaluation:
    name: str  # the task's name it is registered under
    # (accelerator, loaded, (logits, labels), paths, chosen, images, scored, tta_mode, top_n, out) -> eval.json's dict
    write: Callable | None = None
    section: Callable | None = None  # (eval_json path, eval.json's dict) -> the page's HTML
    # (schema, fields the section cannot do without) of the eval.json fields the section shows beyond every
    # evaluation's (evalrecords.EVALUATION); the built-in evaluations' are evalrecords.EVALUATIONS
    fields: tuple[dict, tuple[str, ...]] | None = None


EVALUATIONS: dict[str, Evaluation] = {}


def register(
    name: str,
    *,
    write: Callable | None = None,
    section: Callable | None = None,
    fields: tuple[dict, tuple[str, ...]] | None = None,
) -> Evaluation:
    """Register the writer, the section (with the ``fields`` it shows) or both of task ``name``'s evaluation (the
    halves may come apart)."""
    evaluation = EVALUATIONS.setdefault(name, Evaluation(name))
    evaluation.write = write or evaluation.write
    evaluation.section = section or evaluation.section
    evaluation.fields = fields or evaluation.fields
    return evaluation


def schemas() -> dict[str, tuple[dict, tuple[str, ...]]]:
    """The fields of each registered evaluation that has a page section, by its name: what ``eval.json`` is
    checked by when it is read back."""
    return {name: e.fields for name, e in EVALUATIONS.items() if e.fields and e.section}


def of(task) -> Evaluation:
    """The evaluation of ``task``: registered under its name, or under the nearest task class it is built on."""
    for cls in type(task).__mro__:
        name = vars(cls).get("name")
        if name in EVALUATIONS:
            return EVALUATIONS[name]
    raise LookupError(f"task {task.name} has no evaluation registered")  # every built-in task has one
