"""torch for the task modules, imported on first use.

A task's names, settings and refusals (``--task regress --cutmix``: one line) are read before a run
needs torch, whose import takes seconds (tens of seconds on a busy machine); the tasks' tensor code
imports it the first time it runs. Each name here is a module once it has been imported:
``torch.Tensor`` in a task module is torch's own.
"""

from __future__ import annotations

import importlib


class _OnFirstUse:
    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(importlib.import_module(self._module), name)


torch = _OnFirstUse("torch")
nn = _OnFirstUse("torch.nn")
F = _OnFirstUse("torch.nn.functional")
