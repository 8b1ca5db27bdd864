"""What a run learns to predict, one object per task behind ``base.Task``: ``single`` (one class an image)
and ``multi`` (a set of classes an image, multi-hot rows).

The labels say which task they are: class indices [N] or multi-hot rows [N, K] (``data`` reads them so).
``of`` is the one place that looks; everything else asks the task it returns.
"""

from __future__ import annotations

from visiontune.tasks.base import UNREADABLE, Task
from visiontune.tasks.multi import MULTI_LABEL
from visiontune.tasks.single import SINGLE_LABEL

__all__ = ["MULTI_LABEL", "SINGLE_LABEL", "UNREADABLE", "Task", "named", "of"]


def of(labels) -> Task:
    """The task of ``labels``: an array or tensor of class indices, or of multi-hot rows."""
    return MULTI_LABEL if labels.ndim == 2 else SINGLE_LABEL


def named(multi_label: bool) -> Task:
    """The task a run's records name (``multi_label`` in its config and model file)."""
    return MULTI_LABEL if multi_label else SINGLE_LABEL
