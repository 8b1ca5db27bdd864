"""Single-label classification: one class an image, int64 class indices, softmax cross-entropy."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from visiontune.tasks.base import UNREADABLE, Loss, Task


def per_sample_loss(label_smoothing: float) -> Loss:
    """Per-sample loss for hard labels (UNREADABLE ignored: 0) or soft [B, K] targets (zero rows: 0)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.is_floating_point():
            per = F.cross_entropy(logits.float(), targets, reduction="none", label_smoothing=label_smoothing)
            return per * (targets.sum(1) > 0)
        return F.cross_entropy(logits, targets, reduction="none", label_smoothing=label_smoothing)

    return loss


class SingleLabel(Task):
    name, multi_label, ranks = "single-label", False, False

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


SINGLE_LABEL = SingleLabel()
