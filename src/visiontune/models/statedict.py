"""State dicts: read without unpickling, and loaded into a model as far as they fit.

A file is a safetensors file or a ``.pth`` read with ``weights_only=True``;
anything else a user hands over is an error, never executed. ``load_fitting``
is what lets an earlier run's weights start a run on other classes: keys under
the head's modules may be missing or differently shaped (they keep the new
head's init and are named), every other difference is an error.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from visiontune.errors import UserError


def load_error(e: Exception) -> str:
    """What went wrong loading a file, in one line, without torch's advice to load it unsafely."""
    if isinstance(e, pickle.UnpicklingError):
        return "it holds Python objects other than tensors, which visiontune never unpickles"
    return str(e).splitlines()[0][:300] if str(e) else e.__class__.__name__


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """Read a state_dict without unpickling arbitrary objects."""
    if not Path(path).is_file():
        raise UserError(f"weights file not found: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        with warnings.catch_warnings():  # torch's advice to retry unsafely must not reach the user
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (pickle refusals, truncation, wrong format: all user errors here)
        raise UserError(f"cannot load weights from {path} safely: {load_error(e)}") from None
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise UserError(f"{path} is not a state_dict (a dict of tensors)")
    return state


def load_fitting(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    where: str,
    heads: list[str],
    head_may_differ: bool,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Load ``state`` into ``model``; head keys that do not fit keep their fresh init (when allowed).

    Returns the left-out keys. Any other missing, extra or differently shaped key is a ``UserError``.
    """
    own = model.state_dict()
    wrong = sorted(
        {k for k in own if k not in state}
        | {k for k in state if k not in own}
        | {k for k in own if k in state and state[k].shape != own[k].shape}
    )
    body = [k for k in wrong if not k.startswith(tuple(h + "." for h in heads))]
    if body or (wrong and not head_may_differ):
        k = (body or wrong)[0]
        what = (
            "missing"
            if k not in state
            else "not in the model"
            if k not in own
            else f"shape {tuple(state[k].shape)} there, {tuple(own[k].shape)} here"
        )
        hint = "was it saved from the same --model?" if body else "its head is for other classes"
        raise UserError(
            f"{where} does not fit this model: {len(body or wrong)} key(s) differ, e.g. {k} ({what}); " + hint
        )
    model.load_state_dict({k: v for k, v in state.items() if k not in wrong}, strict=not wrong)
    if wrong:
        say(f"visiontune: {where}: its head does not fit these classes; re-initialised, left out: {', '.join(wrong)}")
    return wrong
