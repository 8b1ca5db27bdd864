"""``--class-weights``: per-class weights of the training loss, from the train split's class counts
or from a file.

How a task balances its loss is the task's (``Task.balancing_weights``); a single-label run weighs each
class by its count of train images (``tasks.single.count_weights``):

- ``auto``: inverse frequency, ``N / (K * n_c)`` -- scikit-learn's ``class_weight="balanced"``;
- ``effective`` (or ``effective:BETA``, default BETA 0.999): the inverse effective number of samples
  of Cui et al. (2019), ``(1 - BETA) / (1 - BETA ** n_c)``, which flattens inverse frequency for
  large classes (BETA -> 0: no weighting; BETA -> 1: inverse frequency);

both scaled so that the train split's mean weight per image is 1 (a weighted loss is on the scale
of the plain one, and the lr needs no change). A class without training images gets weight 0 (it
has no image to weigh). ``FILE`` gives the weights by class name, used as they are.

Multi-label data is K two-way problems, each imbalanced between an image with the label and one
without: there the weights are binary cross-entropy's ``pos_weight`` (``tasks.multi.positive_weights``), a
positive's loss against a negative's per class -- ``auto`` negatives / positives, the field's usual
choice, ``effective`` the ratio of their effective numbers -- and a FILE gives them by class name.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from visiontune import tasks
from visiontune.errors import UserError

DEFAULT_BETA = 0.999
MAX_WEIGHT_FILE = 16 << 20  # bytes of a --class-weights file: a name and a weight for 100,000 classes fit
KEYWORDS = ("none", "auto", "effective")  # anything else (but effective:BETA) is a FILE


def parse_beta(spec: str) -> float | None:
    """The BETA of ``effective[:BETA]``, None for any other spec; one-line error for a bad BETA."""
    if spec != "effective" and not spec.startswith("effective:"):
        return None
    text = spec.partition(":")[2] or str(DEFAULT_BETA)
    try:
        beta = float(text)
    except ValueError:
        beta = math.nan
    if not 0 <= beta < 1:
        raise UserError(f"--class-weights effective:BETA needs 0 <= BETA < 1 (e.g. effective:0.999), got {text!r}")
    return beta


class _Pairs(list):
    """A JSON object's (key, value) pairs in file order, repeats kept."""


def read_weight_file(path: str, classes: Sequence[str]) -> torch.Tensor:
    """Weights from a JSON object ``{"class": weight}`` or a CSV of ``class,weight`` rows (a header row
    ``class,weight`` is allowed); classes not named weigh 1."""
    where = f"--class-weights {path}"
    try:
        size = Path(path).stat().st_size
        if size > MAX_WEIGHT_FILE:
            raise UserError(f"{where}: {size:,} bytes, more than the weights of any classes take ({MAX_WEIGHT_FILE:,})")
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"{where}: cannot read it ({e.__class__.__name__}); give none, auto, effective or a file"
        ) from None
    if path.lower().endswith(".json"):
        try:  # the object's pairs as written: json.loads would keep the last of a repeated key silently
            given = json.loads(text, object_pairs_hook=_Pairs)
        except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
            raise UserError(f"{where}: not valid JSON ({str(e)[:200]})") from None
        if not isinstance(given, _Pairs):
            raise UserError(f'{where}: expected a JSON object of class: weight, e.g. {{"cat": 1, "dog": 4}}')
        pairs = list(given)
    else:
        try:
            rows = [r for r in csv.reader(text.splitlines()) if r and any(x.strip() for x in r)]
        except csv.Error as e:  # a NUL byte, a field past csv's limit
            raise UserError(f"{where}: not a CSV of class,weight rows ({e})") from None
        if rows and [x.strip().lower() for x in rows[0]] == ["class", "weight"]:
            rows = rows[1:]
        bad = next((r for r in rows if len(r) != 2), None)
        if bad is not None:
            raise UserError(f"{where}: expected rows of class,weight, got {','.join(bad)!r}")
        pairs = [(name.strip(), value.strip()) for name, value in rows]
    times = Counter(name for name, _ in pairs)
    twice = next((name for name, _ in pairs if times[name] > 1), None)
    if twice is not None:  # which of its weights was meant cannot be told
        raise UserError(f"{where}: class {twice!r} is given {times[twice]} times; give each class one weight")
    index = {name: i for i, name in enumerate(classes)}
    weights = torch.ones(len(classes), dtype=torch.float64)
    for name, value in pairs:
        if name not in index:
            shown = ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else "")
            raise UserError(f"{where}: unknown class {name!r}; the classes are {shown}")
        try:
            w = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            w = math.nan
        if not (math.isfinite(w) and w > 0):
            raise UserError(f"{where}: the weight of {name!r} must be a positive number, got {value!r}")
        weights[index[name]] = w
    return weights


def check_sampler(cfg, task: tasks.Task) -> None:
    """Refuse, in one line, a ``--sampler`` that cannot draw the task's images (balanced on multi-label data)."""
    refusal = task.sampler_refusal(cfg.sampler)
    if refusal:
        raise UserError(refusal)


def class_weights(
    spec: str, classes: Sequence[str], train_labels: np.ndarray, task: tasks.Task = tasks.SINGLE_LABEL
) -> torch.Tensor | None:
    """The loss's class weights for ``--class-weights spec`` (None for ``none``), from the train split's
    labels, as their task balances them (``Task.balancing_weights``), or from the file."""
    if spec == "none":
        return None
    if spec == "auto" or parse_beta(spec) is not None:
        labels = np.asarray(train_labels)
        return task.balancing_weights(labels, len(classes), parse_beta(spec))
    return read_weight_file(spec, classes)


def describe(
    spec: str,
    weights: torch.Tensor | None,
    classes: Sequence[str],
    task: tasks.Task = tasks.SINGLE_LABEL,
    shown: int = 10,
) -> str:
    """The weights as the start lines and config.json say them: what made them, then class weight pairs."""
    if weights is None:
        return "none"
    beta = parse_beta(spec)
    how = None if spec == "auto" else f"effective number, beta {beta:g}" if beta is not None else spec
    pairs = ", ".join(f"{name} {w:.4g}" for name, w in zip(classes[:shown], weights.tolist()))
    return f"{task.weighting_text(how)}: {pairs}{', ...' if len(classes) > shown else ''}"
