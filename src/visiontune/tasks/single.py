"""Single-label classification: one class an image, int64 class indices, softmax cross-entropy."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable

import numpy as np

from visiontune.tasks._torch import F, nn, torch
from visiontune.tasks.base import UNREADABLE, Loss, Task


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
    reads = "classify"
    best_metric, metrics = "accuracy", ("accuracy", "loss")
    curves, accuracy_title, labels_per_image = (), "Training and Validation Accuracy", "one label"
    card_verb, activation_code, card_note = "classify images into", "logits.softmax(-1)", ""

    def best_figures(self, row: dict) -> dict:
        return {}

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
