"""Multi-label classification: a set of classes an image, float32 multi-hot rows [N, K], one sigmoid per class.

Its loss is the binary cross-entropy of each class, its "accuracy" the exact-match ratio (every class on
the right side of probability 0.5), and an evaluation also ranks: the mAP and each class's F1-tuned
threshold, from every gathered output (``reports.multilabel`` states the conventions, sklearn's).

Its labels are label sets, kept as ``uint8`` multi-hot rows (each image's first class as its index). A
manifest row's label cell is a set: names separated by ``;`` (then a name may hold spaces), or by spaces
when no row holds a ``;`` (and ``--task multilabel`` says so); an empty cell, or a file alone on its row,
is an image with no label. A ``;`` anywhere makes a manifest multi-label under ``--task auto``; a space
alone does not, since single-label class names may hold spaces ("golden retriever"). An ``hf:`` column
of ``ClassLabel`` lists is one too. Its split is iterative stratification (``data/multilabel.py``).
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from visiontune.data.imageset import Cells, Labelled
from visiontune.errors import UserError
from visiontune.tasks._torch import F, nn, torch
from visiontune.tasks.base import UNREADABLE, Loss, Task
from visiontune.tasks.single import class_names, names_class_columns, refuse_class_cells
from visiontune.text import printable

SEPARATORS = re.compile(r"[;\s]+")


def label_sets(cells: list[str], spaces: bool) -> list[list[str]]:
    """Each cell's label names: split on ``;`` (and on spaces too with ``spaces``), empty names dropped,
    repeats kept once, in order."""
    split = SEPARATORS if spaces else re.compile(r";")
    out = []
    for cell in cells:
        names = [name.strip() for name in split.split(cell)]
        out.append(list(dict.fromkeys(name for name in names if name)))
    return out


def says_label_sets(cells: list[str]) -> bool:
    """Whether a manifest's label cells are label sets without being told: some cell holds a ``;``."""
    return any(";" in cell for cell in cells)


def multi_hot(sets: list[list[str]], classes: list[str]) -> np.ndarray:
    """``uint8 [N, K]``: 1 where image n has class k."""
    index = {c: i for i, c in enumerate(classes)}
    out = np.zeros((len(sets), len(classes)), np.uint8)
    for n, names in enumerate(sets):
        out[n, [index[name] for name in names]] = 1
    return out


def first_labels(targets: np.ndarray) -> np.ndarray:
    """Each image's first class (0 for an image without any): the ``labels`` of a multi-label set."""
    if not targets.shape[1]:  # no classes at all (every label cell empty): argmax has nothing to pick from
        return np.zeros(len(targets), np.int32)
    return np.where(targets.any(1), targets.argmax(1), 0).astype(np.int32)


def multi_hot_of_indices(rows, classes: int) -> np.ndarray:
    """``uint8 [rows, K]`` from lists of class indices (an hf: column of ClassLabel lists; -1 dropped)."""
    out = np.zeros((len(rows), classes), np.uint8)
    for n, values in enumerate(rows):
        out[n, [v for v in (values or []) if v >= 0]] = 1
    return out


DEFAULT_THRESHOLD = 0.5


def positive_weights(positives, images: int, beta: float | None) -> torch.Tensor:
    """float64 ``pos_weight`` per class with ``positives`` of ``images`` train images carrying each label:
    negatives / positives (``beta`` None), or the ratio of their effective numbers, ``(1 - beta^neg) /
    (1 - beta^pos)``. 1 where a class has no positive or no negative (nothing to balance)."""
    pos = torch.as_tensor(np.asarray(positives, np.float64))
    neg = images - pos
    if beta is None:
        ratio = neg / pos
    else:
        ratio = torch.expm1(neg * math.log(beta)) / torch.expm1(pos * math.log(beta)) if beta else torch.ones_like(pos)
    return torch.where((pos > 0) & (neg > 0), ratio, 1.0)


def per_sample_bce(label_smoothing: float, pos_weight: torch.Tensor | None = None) -> Loss:
    """Multi-label per-sample loss: ``binary_cross_entropy_with_logits`` (what ``BCEWithLogitsLoss`` computes)
    averaged over the classes, for multi-hot or mixed [B, K] targets; an unreadable row (UNREADABLE) gives 0.

    Label smoothing pulls every target towards 0.5, ``y (1 - e) + e / 2``: each class is a two-way choice,
    so this is cross-entropy's smoothing towards the uniform distribution over its two outcomes.
    ``pos_weight`` ([K], ``--class-weights`` on multi-label data) weighs each class's positive term.
    """
    on_device: dict = {}  # the weights copied once per device, not every step

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ok = targets[:, 0] >= 0
        y = targets.float().clamp(min=0) * (1 - label_smoothing) + label_smoothing / 2
        w = None
        if pos_weight is not None:
            w = on_device.get(logits.device)
            if w is None:
                w = on_device[logits.device] = pos_weight.to(device=logits.device, dtype=torch.float32)
        per = F.binary_cross_entropy_with_logits(logits.float(), y, reduction="none", pos_weight=w).mean(1)
        return per * ok

    return loss


def curve(scores: torch.Tensor, positive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(true positives, false positives, score) at each distinct score, highest score first."""
    order = scores.argsort(descending=True, stable=True)
    s, y = scores[order], positive[order].double()
    last = torch.cat([(s[1:] != s[:-1]).nonzero().flatten(), torch.tensor([len(s) - 1])])
    tps = y.cumsum(0)[last]
    return tps, (last + 1).double() - tps, s[last]


def average_precision(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """sklearn's ``average_precision_score`` of one class; None without a positive."""
    if not len(scores) or not positive.any():
        return None
    tps, fps, _ = curve(scores.double(), positive.bool())
    precision, recall = tps / (tps + fps), tps / tps[-1]
    return float((torch.diff(recall, prepend=recall.new_zeros(1)) * precision).sum())


def tune_thresholds(probs: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Each class's F1-best threshold on these images: the probability that gives the class its best F1
    (the highest such one on ties), moved halfway down to the next lower probability seen, so that these
    images fall on the same side of it as of the score itself; a class with no positive keeps 0.5."""
    out = []
    for k in range(probs.shape[1]):
        positive = targets[:, k] > 0.5
        if not positive.any():
            out.append(DEFAULT_THRESHOLD)
            continue
        tps, fps, s = curve(probs[:, k].double(), positive)
        f1 = 2 * tps / (tps + fps + positive.sum())
        best = int(f1.argmax())  # the first maximum: the highest threshold
        lower = float(s[best + 1]) if best + 1 < len(s) else 0.0
        out.append((float(s[best]) + lower) / 2)
    return out


class MultiLabel(Task):
    name, title, ranks, thresholded, accuracy_name = "multilabel", "multi-label", True, True, "label_accuracy"
    # mAP: the exact-match ratio (its accuracy) says little until nearly every label set is right
    best_metric, metrics = "map", ("accuracy", "loss", "map")
    curves, accuracy_title, labels_per_image = (("map", "mAP"),), "Accuracy (exact match)", "several labels"
    card_verb, activation_code = "tag images with any of", "logits.sigmoid()"
    card_note = (
        "A multi-label model: one sigmoid per class; a label applies when its probability reaches its "
        "threshold, tuned on the validation split (`config.json`, `visiontune.thresholds`, in label order)."
    )

    def best_figures(self, row: dict) -> dict:
        if "thresholds" not in row:  # an epoch without a readable val image
            return {}
        return {"best_val_map": row["map"], "thresholds": row["thresholds"]}  # the thresholds the model keeps

    # -- its label cells --

    def names_columns(self, row: list[str], where: str = "") -> bool:
        return names_class_columns(row, where)

    def parse(self, cells: Cells) -> Labelled:
        if cells.rows is None:
            if not cells.optional:
                raise UserError(f"{cells.origin}: no ClassLabel column; pass --label-column NAME")
            return Labelled(self, np.zeros(cells.count, np.int32), [], np.zeros((cells.count, 0), np.uint8))
        if not cells.per_row:
            if cells.names is None or isinstance(cells.rows, np.ndarray):  # one class a row
                refuse_class_cells(cells, self.name, "a manifest (train.csv: filename,labels) or an hf: label list")
            targets = multi_hot_of_indices(cells.rows, len(cells.names))
            return Labelled(self, first_labels(targets), list(cells.names), targets)
        texts = [row[0] if row else "" for row in cells.rows]  # a file alone on its row: no label
        spaces = not any(";" in c for c in texts)  # a ';' anywhere: names are split on it alone
        sets, classes = class_names(label_sets(texts, spaces))
        targets = multi_hot(sets, classes)
        return Labelled(self, first_labels(targets), classes, targets)

    def split(self, images, val_fraction: float, seed: int):
        from visiontune.data.split import make_multilabel_split  # (torch: imported when a split is made)

        return make_multilabel_split(images.targets, val_fraction, seed)

    def class_counts(self, images, idx) -> dict[str, int]:
        """The images that have each class."""
        counts = (images.targets if idx is None else images.targets[idx]).sum(0, dtype=np.int64).tolist()
        return {name: counts[i] for i, name in enumerate(images.classes)}

    def describe(self, images) -> str:
        counts = ", ".join(f"{name} {n}" for name, n in self.class_counts(images, None).items())
        none = int((images.targets.sum(1) == 0).sum())
        return (
            f"visiontune: {len(images.paths)} images, multi-label, {len(images.classes)} classes ({images.layout}): "
            f"{counts}; {none} with no label"
        )

    def relabelled(self, images, cells: dict[int, str], where: str):
        """A cell is a label set, its names joined by ``;`` (empty: no label)."""
        index = {c: k for k, c in enumerate(images.classes)}
        labels, targets = images.labels.copy(), images.targets.copy()
        for i, cell in cells.items():
            names = [n for n in cell.split(";") if n]
            unknown = [n for n in names if n not in index]
            if unknown:
                shown = printable(unknown[0])[:100]
                raise UserError(f"{where}: '{shown}' (for {images.paths[i]}) is not a class of {images.root}")
            targets[i] = 0
            targets[i, [index[n] for n in names]] = 1
            if names:
                labels[i] = index[names[0]]
        return replace(images, labels=labels, targets=targets)

    # -- its labels in a run --

    def label_array(self, labels) -> np.ndarray:
        return np.asarray(labels).astype(np.float32)

    def sample_label(self, labels: np.ndarray, i: int):
        return torch.from_numpy(labels[i])

    def unreadable_label(self, labels: np.ndarray):
        return torch.full((labels.shape[1],), float(UNREADABLE))

    def readable(self, labels: torch.Tensor) -> torch.Tensor:
        return labels[:, 0] != UNREADABLE

    def mean_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return per_sample_bce(0.0)(logits, labels).sum() / self.readable(labels).sum().clamp(min=1)

    def eval_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return per_sample_bce(0.0)(logits, labels)

    def smoothed_loss(self, label_smoothing: float, class_weights: torch.Tensor | None) -> Loss:
        """``class_weights`` ([K]) are the binary cross-entropy's ``pos_weight``."""
        per_bce = per_sample_bce(label_smoothing, class_weights)

        def bce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return per_bce(logits, targets).sum() / (targets[:, 0] >= 0).sum().clamp(min=1)

        return bce

    def probabilities(self, out: torch.Tensor, given: bool = False) -> torch.Tensor:
        # float64: a probability meets its threshold (tuned in float64) as it did when the run chose it
        return out.double() if given else out.double().sigmoid()

    def hits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (((logits > 0) == (labels > 0.5)).all(1) & self.readable(labels)).float()

    def mixed_classes(self, num_classes: int) -> int:
        return 2  # the pair's two positions are the "classes" v2 mixes (its draws do not depend on it)

    def mix_pair(self, mix: Callable, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # v2 mixes the pair's positions 0 and 1 as two classes, which gives each output row each image's
        # share in it (mixup's lambda, or cutmix's area); the label rows are mixed with those shares.
        rows = labels.float().clamp(min=0)
        pair = torch.arange(len(images), device=labels.device)
        x, shares = mix(images, pair)  # shares[r, p]: image p's part of output r
        return x, shares[:, : len(pair)].to(rows.dtype) @ rows

    def mixed_targets(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # An unreadable sample keeps its row of UNREADABLE (an all-zero row is an image without labels).
        return torch.where((labels[:, 0] >= 0).unsqueeze(1), targets, torch.full_like(targets, float(UNREADABLE)))

    def counted(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets  # mixed rows, rounded, are the label sets counted

    def ranking(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        """mAP (macro: the classes with a positive) and the tuned thresholds, readable rows only."""
        ok = self.readable(labels)
        probs, targets = logits[ok].double().sigmoid(), labels[ok]
        ap = [average_precision(probs[:, c], targets[:, c] > 0.5) for c in range(probs.shape[1])]
        present = [a for a in ap if a is not None]
        return {"map": sum(present) / len(present) if present else None, "thresholds": tune_thresholds(probs, targets)}

    def label_text(self, labels: torch.Tensor, classes: list[str]) -> list[str]:
        return [
            "unreadable" if row[0] < 0 else "+".join(c for c, y in zip(classes, row) if y > 0.5) or "(none)"
            for row in labels
        ]

    def balancing_weights(self, labels: np.ndarray, num_classes: int, beta: float | None) -> torch.Tensor:
        """Binary cross-entropy's ``pos_weight``: K two-way problems, each balanced on its own."""
        labels = np.asarray(labels, np.int64)
        return positive_weights(labels.sum(0), len(labels), beta)

    def weighting_text(self, how: str | None) -> str:
        return "positive weight negatives / positives" if how is None else f"positive weight, {how}"

    def sampler_refusal(self, sampler: str) -> str | None:
        if sampler != "balanced":
            return None
        return (
            "--sampler balanced works on single-label data; this data is multi-label: leave it out"
            " (--class-weights auto weighs each label's positives instead)"
        )

    def loss_text(self, label_smoothing: float, class_weights: str) -> str:
        smoothing = f", label smoothing {label_smoothing:g} (targets towards 0.5)" if label_smoothing else ""
        weights = "" if class_weights == "none" else f", {class_weights}"
        return f"binary cross-entropy, one sigmoid per class (multi-label){smoothing}{weights}"

    def activation(self) -> nn.Module:
        return nn.Sigmoid()

    def logits_of(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.logit(probs.double(), eps=1e-12)

    def exports_probabilities(self, asked: bool) -> bool:
        return True  # what a multi-label model means: one probability per class, each on its own

    def output_name(self, probabilities: bool) -> str:
        return "logits"  # a multi-label graph's output has always been named so (sigmoid included)

    def output_text(self, probabilities: bool) -> str:
        return "sigmoid probabilities (multi-label; thresholds in the metadata)"

    def averaged(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs.double().sigmoid().mean(0).logit(eps=1e-12).float()

    def thresholds(self, recorded, num_classes: int) -> list[float] | None:
        return list(recorded or [DEFAULT_THRESHOLD] * num_classes)

    def right(self, out: np.ndarray, y: np.ndarray, thresholds) -> tuple[int, int]:
        # each class's decision (its sigmoid probability against its threshold) counts on its own
        return int(((out >= np.asarray(thresholds)) == (y > 0.5)).sum()), y.size

    def answer(self, row: list[float] | None, classes, thresholds, top_k: int | None = None) -> dict:
        if row is None:
            return {"labels": None, "probabilities": None}
        chosen = [c for c, p, t in zip(classes, row, thresholds) if p >= t]
        return {"labels": chosen, "probabilities": dict(zip(classes, row))}

    def csv_text(
        self, paths, classes, probs: torch.Tensor, readable: torch.Tensor, thresholds, clip: float, kaggle_ids=None
    ) -> str:
        """``path,labels,prob_<class>...``; ``labels`` is the predicted set, the classes whose probability
        reaches their threshold, joined by ``;`` (empty: none)."""
        chosen = probs >= torch.tensor(thresholds, dtype=probs.dtype)
        probs = probs.clamp(clip, 1 - clip) if clip > 0 else probs
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["path", "labels", *(f"prob_{c}" for c in classes)])
        for path, ok, row, picks in zip(paths, readable.tolist(), probs.tolist(), chosen.tolist()):
            if ok:
                w.writerow([path, ";".join(c for c, p in zip(classes, picks) if p), *(f"{p:.6f}" for p in row)])
            else:
                w.writerow([path, "", *([""] * len(classes))])
        return buf.getvalue()


MULTI_LABEL = MultiLabel()
