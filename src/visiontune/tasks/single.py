"""Single-label classification: one class an image, int64 class indices, softmax cross-entropy.

Its labels are class names: a manifest's label cell (``filename,label``; class names that are all whole
numbers are sorted as numbers), a class folder, an ``hf:`` ``ClassLabel`` column or any column of names;
its split holds each class out at ``--val-fraction`` (``data.split.make_stratified_split``).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from visiontune.data.imageset import Cells, Labelled
from visiontune.errors import UserError
from visiontune.tasks._torch import F, nn, torch
from visiontune.tasks.base import UNREADABLE, Loss, Task
from visiontune.text import printable

_NAME_HEADERS = ("filename", "file", "path", "id")
_HEADERS = tuple([name, label] for label in ("label", "labels", "tags") for name in _NAME_HEADERS)


def names_class_columns(row: list[str], where: str) -> bool:
    """Whether a manifest's first ``row`` is a header naming a file column and a label column; one line when it
    names a file column and no label column (numbers to predict, read as classes)."""
    first = [c.strip().lower() for c in row[:2]]
    if first in _HEADERS:
        return True
    if len(row) > 1 and first[0] in _NAME_HEADERS:
        shown = ",".join(c.strip() for c in row)[:80]
        raise UserError(
            f"{where}: header {shown!r} names no label column (label, labels or tags); "
            "for numbers to predict pass --task regress, for classes name the column label"
        )
    return False


def class_names(sets: list[list[str]]) -> tuple[list[list[str]], list[str]]:
    """The label sets with their names as classes, and the classes in index order: sorted by name, or as
    numbers when every name is a whole number ("10" after "9"; "07" is then "7")."""
    every = [lab for labs in sets for lab in labs]
    if every and all(lab.lstrip("-").isdigit() for lab in every):
        sets = [[str(int(lab)) for lab in labs] for labs in sets]
        return sets, [str(c) for c in sorted({int(lab) for labs in sets for lab in labs})]
    return sets, sorted({lab for labs in sets for lab in labs})


def column_classes(cells: Cells) -> tuple[np.ndarray, list[str]]:
    """int64 class index per row of an ``hf:`` column (-1: none) and the classes: a ClassLabel's, or the
    column's sorted values."""
    if cells.names is not None:
        classes = list(cells.names)
        labels = np.asarray(cells.rows, np.int64).reshape(-1)
        if len(labels) and labels.max() >= len(classes):
            raise UserError(
                f"{cells.origin}: column {cells.column!r} holds class {labels.max()} of a ClassLabel of {len(classes)}"
            )
        return labels, classes
    flat = list(cells.rows)
    odd = next((v for v in flat if v is not None and not isinstance(v, (str, int, float))), None)
    if odd is not None:
        raise UserError(f"{cells.origin}: column {cells.column!r} holds {type(odd).__name__} values, not class labels")
    present = {v for v in flat if v is not None and v == v}  # (NaN != NaN: no label)
    try:
        uniq = sorted(present)
    except TypeError:  # splits saved with different types (text in one, numbers in another)
        raise UserError(f"{cells.origin}: column {cells.column!r} mixes text and numbers across its splits") from None
    index = {u: i for i, u in enumerate(uniq)}
    return np.fromiter((index.get(v, -1) if v == v else -1 for v in flat), np.int64, len(flat)), [str(u) for u in uniq]


def refuse_class_cells(cells: Cells, task: str, needs: str) -> None:
    """One line: cells that are class indices (a class folder, tar shards, a ClassLabel) are not ``task``'s."""
    if cells.column is not None:
        what = f"{cells.origin}: column {cells.column!r} holds one class a row"
    else:
        what = f"{cells.origin} carry one class per sample"
    raise UserError(f"{what}; --task {task} needs {needs}")


def per_sample_loss(label_smoothing: float) -> Loss:
    """Per-sample loss for hard labels (UNREADABLE ignored: 0) or soft [B, K] targets (zero rows: 0)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.is_floating_point():
            per = F.cross_entropy(logits.float(), targets, reduction="none", label_smoothing=label_smoothing)
            return per * (targets.sum(1) > 0)
        return F.cross_entropy(logits, targets, reduction="none", label_smoothing=label_smoothing)

    return loss


def count_weights(counts, beta: float | None) -> torch.Tensor:
    """float64 weights of the classes with ``counts`` images: inverse frequency (``beta`` None) or the
    inverse effective number ``(1 - beta) / (1 - beta ** n)``, scaled so that ``sum(w * counts) ==
    sum(counts)``; 0 where a count is 0 (``training.imbalance`` says why)."""
    n = torch.as_tensor(np.asarray(counts, np.float64))
    if beta is None:
        raw = 1 / n
    else:
        # (1 - beta) / (1 - beta ** n) as expm1 / expm1, which keeps its digits for beta near 1.
        raw = math.expm1(math.log(beta)) / torch.expm1(n * math.log(beta)) if beta else torch.ones_like(n)
    raw = torch.where(n > 0, raw, 0.0)
    return raw * n.sum() / (raw * n).sum() if n.sum() else raw


def positive_class(classes: list[str]) -> int:
    """Kaggle's ``label`` is P(dog); for other two-class models, P(the second class)."""
    lower = [c.lower() for c in classes]
    return lower.index("dog") if "dog" in lower else 1


class SingleLabel(Task):
    name, title, ranks, thresholded, accuracy_name = "classify", "single-label", False, False, "accuracy"
    best_metric, metrics = "accuracy", ("accuracy", "loss")
    curves, accuracy_title, labels_per_image = (), "Training and Validation Accuracy", "one label"
    card_verb, activation_code, card_note = "classify images into", "logits.softmax(-1)", ""

    # -- its label cells --

    def names_columns(self, row: list[str], where: str = "") -> bool:
        return names_class_columns(row, where)

    def parse(self, cells: Cells) -> Labelled:
        if cells.rows is None:  # an hf: data set with no label column
            if not cells.optional:
                raise UserError(f"{cells.origin}: no ClassLabel column; pass --label-column NAME")
            return Labelled(self, np.zeros(cells.count, np.int32), [])
        if not cells.per_row:  # one value an image: a class index into names (a folder, a ClassLabel) or a name
            if cells.names is not None and not isinstance(cells.rows, np.ndarray):
                raise UserError(
                    f"{cells.origin}: column {cells.column!r} holds label sets (several classes a row); "
                    "pass --task multilabel or auto"
                )
            labels, classes = column_classes(cells)
            missing = np.flatnonzero(labels < 0)
            if len(missing) and not cells.optional:
                raise UserError(
                    f"{cells.origin}: {len(missing)} rows have no label in column {cells.column!r} (None, NaN or a "
                    f"ClassLabel's -1), the first {cells.where(int(missing[0]))}; label them or leave them out "
                    "(Dataset.filter) and save it again"
                )
            return Labelled(self, np.maximum(labels, 0).astype(np.int32), classes)
        names = []
        for i, row in enumerate(cells.rows):  # a manifest's cells after the file name
            if not row or not row[0].strip():
                raise UserError(f"{cells.where(i)}: expected 'filename,label', got {cells.line(i)!r}")
            names.append(row[0].strip())
        sets, classes = class_names([[x] for x in names])
        index = {c: i for i, c in enumerate(classes)}
        return Labelled(self, np.fromiter((index[labs[0]] for labs in sets), np.int32, len(sets)), classes)

    def split(self, images, val_fraction: float, seed: int):
        from visiontune.data.split import make_stratified_split  # (torch: imported when a split is made)

        return make_stratified_split(images.labels, val_fraction, seed)

    def class_counts(self, images, idx) -> dict[str, int]:
        labels = images.labels if idx is None else images.labels[idx]
        counts = np.bincount(labels, minlength=len(images.classes)).tolist()
        return {name: counts[i] for i, name in enumerate(images.classes)}

    def describe(self, images) -> str:
        counts = ", ".join(f"{name} {n}" for name, n in self.class_counts(images, None).items())
        return f"visiontune: {len(images.paths)} images in {len(images.classes)} classes ({images.layout}): {counts}"

    def relabelled(self, images, cells: dict[int, str], where: str):
        index = {c: k for k, c in enumerate(images.classes)}
        labels = images.labels.copy()
        for i, cell in cells.items():
            if cell not in index:
                shown = printable(cell)[:100]
                raise UserError(f"{where}: '{shown}' (for {images.paths[i]}) is not a class of {images.root}")
            labels[i] = index[cell]
        return replace(images, labels=labels)

    # -- its labels in a run --

    def label_array(self, labels) -> np.ndarray:
        return np.asarray(labels).astype(np.int64).reshape(-1)

    def sample_label(self, labels: np.ndarray, i: int):
        return int(labels[i])

    def unreadable_label(self, labels: np.ndarray):
        return UNREADABLE

    def readable(self, labels: torch.Tensor) -> torch.Tensor:
        return labels != UNREADABLE

    def mean_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, reduction="sum") / (labels != UNREADABLE).sum().clamp(min=1)

    def eval_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="none")

    def smoothed_loss(self, label_smoothing: float, class_weights: torch.Tensor | None) -> Loss:
        """``class_weights`` ([K]) scales each sample's loss by its class's weight (a soft target: by its mix
        of the classes' weights); the sum is still divided by the readable count."""
        per_sample = per_sample_loss(label_smoothing)
        on_device: dict = {}  # the weights copied once per (device, dtype), not every step

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            soft = targets.is_floating_point()
            readable = targets.sum(1) > 0 if soft else targets >= 0
            per = per_sample(logits, targets)
            if class_weights is not None:
                key = (per.device, per.dtype)
                w = on_device.get(key)
                if w is None:
                    w = on_device[key] = class_weights.to(device=per.device, dtype=per.dtype)
                per = per * (targets.to(per.dtype) @ w if soft else w[targets.clamp(min=0)])
            return per.sum() / readable.sum().clamp(min=1)

        return loss

    def probabilities(self, out: torch.Tensor, given: bool = False) -> torch.Tensor:
        return out.float() if given else out.float().softmax(1)  # one softmax over the classes

    def hits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (logits.argmax(1) == labels).float()

    def mixed_classes(self, num_classes: int) -> int:
        return num_classes

    def mix_pair(self, mix: Callable, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # v2 one-hot encodes the labels itself; an unreadable one stands in as class 0, zeroed after.
        return mix(images, labels.clamp(min=0))

    def mixed_targets(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets * (labels >= 0).unsqueeze(1)  # an all-zero target adds nothing to the loss

    def counted(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # A mixed pair counts as its larger part's class; a zeroed row (unreadable) as unreadable.
        return torch.where(targets.sum(1) > 0, targets.argmax(1), UNREADABLE)

    def ranking(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        return {}

    def label_text(self, labels: torch.Tensor, classes: list[str]) -> list[str]:
        return ["unreadable" if y == UNREADABLE else classes[y] for y in labels.tolist()]

    def balancing_weights(self, labels: np.ndarray, num_classes: int, beta: float | None) -> torch.Tensor:
        labels = np.asarray(labels, np.int64)  # negative: no class
        return count_weights(np.bincount(labels[labels >= 0], minlength=num_classes), beta)

    def weighting_text(self, how: str | None) -> str:
        return "inverse frequency" if how is None else how

    def sampler_refusal(self, sampler: str) -> str | None:
        return None

    def loss_text(self, label_smoothing: float, class_weights: str) -> str:
        text = f"cross-entropy, label smoothing {label_smoothing:g}" if label_smoothing else "cross-entropy"
        return text if class_weights == "none" else f"{text}, class weights {class_weights}"

    def activation(self) -> nn.Module:
        return nn.Softmax(dim=1)

    def logits_of(self, probs: torch.Tensor) -> torch.Tensor:
        # log-probabilities: a softmax of them is the probabilities again; no -inf for an underflowed class
        return probs.double().clamp_min(1e-300).log()

    def exports_probabilities(self, asked: bool) -> bool:
        return asked

    def output_name(self, probabilities: bool) -> str:
        return "probabilities" if probabilities else "logits"

    def output_text(self, probabilities: bool) -> str:
        return "softmax probabilities" if probabilities else "logits"

    def averaged(self, outputs: torch.Tensor) -> torch.Tensor:
        probs = outputs.float().softmax(-1).mean(0)
        return probs.clamp_min(torch.finfo(probs.dtype).tiny).log()

    def thresholds(self, recorded, num_classes: int) -> list[float] | None:
        return None  # the most probable class, whatever its probability

    def right(self, out: np.ndarray, y: np.ndarray, thresholds) -> tuple[int, int]:
        return int((out.argmax(1) == y).sum()), len(y)

    def answer(self, row: list[float] | None, classes, thresholds, top_k: int | None = None) -> dict:
        if row is None:
            return {"label": None, "score": None, "probabilities": None}
        order = sorted(range(len(row)), key=lambda i: -row[i])  # ties keep class order, as argmax does
        given = {"label": classes[order[0]], "score": row[order[0]]}
        if top_k is None:
            return {**given, "probabilities": dict(zip(classes, row))}
        return {**given, "top": [{"class": classes[i], "probability": row[i]} for i in order[:top_k]]}

    def csv_text(
        self, paths, classes, probs: torch.Tensor, readable: torch.Tensor, thresholds, clip: float, kaggle_ids=None
    ) -> str:
        """``id,label`` for a two-class model on a Kaggle test folder, else ``path,prediction,prob_<class>...``."""
        predicted = probs.argmax(1).tolist()
        probs = probs.clamp(clip, 1 - clip) if clip > 0 else probs
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        if kaggle_ids is not None and len(classes) == 2:
            pos = positive_class(classes)
            w.writerow(["id", "label"])
            for i, ok, p in zip(kaggle_ids, readable.tolist(), probs[:, pos].tolist()):
                w.writerow([i, f"{p if ok else 0.5:.6f}"])  # 0.5: the log-loss-safest guess for a missing image
            return buf.getvalue()
        w.writerow(["path", "prediction", *(f"prob_{c}" for c in classes)])
        for path, ok, c, row in zip(paths, readable.tolist(), predicted, probs.tolist()):
            if ok:
                w.writerow([path, classes[c], *(f"{p:.6f}" for p in row)])
            else:  # no prediction: empty fields rather than numbers that look real
                w.writerow([path, "", *([""] * len(classes))])
        return buf.getvalue()


SINGLE_LABEL = SingleLabel()
