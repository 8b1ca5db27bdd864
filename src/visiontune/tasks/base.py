"""``Task``: what a task owns, from a sample's label to the loss and the exact metrics of a phase.

The labels of a batch travel as a task encodes them (``sample_label``); a sample that could not be read
keeps its slot in the batch with the task's ``unreadable_label``, and every count leaves it out
(``readable``). Losses follow the engine's contract: per sample, 0 for an unreadable one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# The label of an unreadable image: F.cross_entropy's ignore_index, and left out of every count. A
# multi-label image's label is its multi-hot float row; an unreadable one's is a row of UNREADABLE.
UNREADABLE = -100

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Task:
    """One task: its subclasses override every method."""

    name: str
    multi_label: bool
    ranks: bool  # evaluation gathers every output, for metrics that rank them (``ranking``)

    def label_array(self, labels) -> np.ndarray:
        """The labels as a dataset keeps them."""
        raise NotImplementedError

    def sample_label(self, labels: np.ndarray, i: int):
        """Sample i's label as the loader collates it."""
        raise NotImplementedError

    def unreadable_label(self, labels: np.ndarray):
        """The label of a sample of ``labels`` that could not be read."""
        raise NotImplementedError

    def readable(self, labels: torch.Tensor) -> torch.Tensor:
        """bool [B]: which samples of a batch were read."""
        raise NotImplementedError

    def mean_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The plain training loss: the mean over the batch's readable samples."""
        raise NotImplementedError

    def eval_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-sample loss of an evaluation, in float32."""
        raise NotImplementedError

    def smoothed_loss(self, label_smoothing: float, class_weights: torch.Tensor | None) -> Loss:
        """The training loss with label smoothing, mixed targets or per-class weights: a mean as ``mean_loss``."""
        raise NotImplementedError

    def probabilities(self, out: torch.Tensor, given: bool = False) -> torch.Tensor:
        """[N, K] class probabilities of a model's output: its logits, or the probabilities themselves when
        ``given`` (an exported graph that ends in them), in the precision predict and serve compare them at."""
        raise NotImplementedError

    def hits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per sample, 1.0 when the prediction is right; 0 for an unreadable one."""
        raise NotImplementedError

    def mixed_classes(self, num_classes: int) -> int:
        """How many classes torchvision's MixUp/CutMix one-hot encode for this task."""
        raise NotImplementedError

    def mix_pair(self, mix: Callable, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pair of samples (or a last one alone) mixed by ``mix`` (a MixUp or CutMix): images and targets."""
        raise NotImplementedError

    def mixed_targets(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A mixed batch's targets, an unreadable sample's made what the loss leaves out."""
        raise NotImplementedError

    def counted(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The labels a mixed batch (``targets``, MixUp/CutMix) is counted against."""
        raise NotImplementedError

    def ranking(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        """Metrics of a phase's gathered outputs beyond loss and accuracy (``PhaseResult`` fields)."""
        raise NotImplementedError

    def label_text(self, labels: torch.Tensor, classes: list[str]) -> list[str]:
        """Each sample's label in words, or why there is none."""
        raise NotImplementedError
