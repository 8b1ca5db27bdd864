"""``--class-weights``: per-class weights of the training loss, from the train split's class counts
or from a file.

``weights_from_counts`` is a function of per-class counts only, so it serves any loss that weighs
classes by how often they occur (a multi-label BCE's ``pos_weight`` from per-class positives too):

- ``auto``: inverse frequency, ``N / (K * n_c)`` -- scikit-learn's ``class_weight="balanced"``;
- ``effective`` (or ``effective:BETA``, default BETA 0.999): the inverse effective number of samples
  of Cui et al. (2019), ``(1 - BETA) / (1 - BETA ** n_c)``, which flattens inverse frequency for
  large classes (BETA -> 0: no weighting; BETA -> 1: inverse frequency);

both scaled so that the train split's mean weight per image is 1 (a weighted loss is on the scale
of the plain one, and the lr needs no change). A class without training images gets weight 0 (it
has no image to weigh). ``FILE`` gives the weights by class name, used as they are.

Multi-label data is K two-way problems, each imbalanced between an image with the label and one
without: there the weights are binary cross-entropy's ``pos_weight`` (``positive_weights``), a
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

from visiontune.errors import UserError

DEFAULT_BETA = 0.999
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


def weights_from_counts(counts: Sequence[int], how: str = "auto") -> torch.Tensor:
    """float64 weights of the classes with ``counts`` images: ``auto`` or ``effective[:BETA]`` (see the
    module docstring), scaled so that ``sum(w * counts) == sum(counts)``; 0 where a count is 0."""
    n = torch.as_tensor(np.asarray(counts, np.float64))
    beta = parse_beta(how)
    if how == "auto":
        raw = 1 / n
    elif beta is not None:
        # (1 - beta) / (1 - beta ** n) as expm1 / expm1, which keeps its digits for beta near 1.
        raw = math.expm1(math.log(beta)) / torch.expm1(n * math.log(beta)) if beta else torch.ones_like(n)
    else:
        raise ValueError(f"unknown weighting {how!r}")
    raw = torch.where(n > 0, raw, 0.0)
    return raw * n.sum() / (raw * n).sum() if n.sum() else raw


class _Pairs(list):
    """A JSON object's (key, value) pairs in file order, repeats kept."""


def read_weight_file(path: str, classes: Sequence[str]) -> torch.Tensor:
    """Weights from a JSON object ``{"class": weight}`` or a CSV of ``class,weight`` rows (a header row
    ``class,weight`` is allowed); classes not named weigh 1."""
    where = f"--class-weights {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"{where}: cannot read it ({e.__class__.__name__}); give none, auto, effective or a file"
        ) from None
    if path.lower().endswith(".json"):
        try:  # the object's pairs as written: json.loads would keep the last of a repeated key silently
            given = json.loads(text, object_pairs_hook=_Pairs)
        except ValueError as e:
            raise UserError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(given, _Pairs):
            raise UserError(f'{where}: expected a JSON object of class: weight, e.g. {{"cat": 1, "dog": 4}}')
        pairs = list(given)
    else:
        rows = [r for r in csv.reader(text.splitlines()) if r and any(x.strip() for x in r)]
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


def positive_weights(positives: Sequence[int], images: int, how: str = "auto") -> torch.Tensor:
    """float64 ``pos_weight`` per class of multi-label data with ``positives`` of ``images`` train images
    carrying each label: ``auto`` negatives / positives; ``effective[:BETA]`` the negatives' effective
    number over the positives', ``(1 - BETA^neg) / (1 - BETA^pos)``. 1 where a class has no positive or
    no negative (nothing to balance)."""
    pos = torch.as_tensor(np.asarray(positives, np.float64))
    neg = images - pos
    beta = parse_beta(how)
    if how == "auto":
        ratio = neg / pos
    elif beta is not None:
        ratio = torch.expm1(neg * math.log(beta)) / torch.expm1(pos * math.log(beta)) if beta else torch.ones_like(pos)
    else:
        raise ValueError(f"unknown weighting {how!r}")
    return torch.where((pos > 0) & (neg > 0), ratio, 1.0)


def check_single_label(cfg, multi_label: bool) -> None:
    """Refuse, in one line, --sampler balanced on multi-label data (an image there is of several classes)."""
    if multi_label and cfg.sampler == "balanced":
        raise UserError(
            "--sampler balanced works on single-label data; this data is multi-label: leave it out"
            " (--class-weights auto weighs each label's positives instead)"
        )


def class_weights(spec: str, classes: Sequence[str], train_labels: np.ndarray) -> torch.Tensor | None:
    """The loss's class weights for ``--class-weights spec`` (None for ``none``), from the train split's
    labels (negative ones: no class; a [N, K] multi-hot array: multi-label ``pos_weight``) or the file."""
    if spec == "none":
        return None
    if spec == "auto" or parse_beta(spec) is not None:
        labels = np.asarray(train_labels, np.int64)
        if labels.ndim == 2:
            return positive_weights(labels.sum(0), len(labels), spec)
        return weights_from_counts(np.bincount(labels[labels >= 0], minlength=len(classes)), spec)
    return read_weight_file(spec, classes)


def describe(
    spec: str, weights: torch.Tensor | None, classes: Sequence[str], multi_label: bool = False, shown: int = 10
) -> str:
    """The weights as the start lines and config.json say them: what made them, then class weight pairs."""
    if weights is None:
        return "none"
    beta = parse_beta(spec)
    auto = "positive weight negatives / positives" if multi_label else "inverse frequency"
    how = {"auto": auto}.get(spec) or (f"effective number, beta {beta:g}" if beta is not None else spec)
    how = f"positive weight, {how}" if multi_label and spec != "auto" else how
    pairs = ", ".join(f"{name} {w:.4g}" for name, w in zip(classes[:shown], weights.tolist()))
    return f"{how}: {pairs}{', ...' if len(classes) > shown else ''}"
