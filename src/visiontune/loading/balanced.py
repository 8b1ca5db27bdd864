"""``--sampler balanced``: an epoch that draws every class equally often, made from (seed, epoch) alone.

The epoch keeps the train split's length (the same steps per epoch and lr schedule as a plain run).
Its ``n`` slots are shared equally by the classes that have training images; the ``n mod K`` left
over go to classes picked at random each epoch. A class fills its slots by walking through shuffles
of its images: a rare class repeats each of its images as evenly as it can (the counts differ by at
most one), a common one shows a different random part of its images each epoch. The slots are then
shuffled together.

The sampler is read like ``pipeline.EpochSampler``: one index list per epoch, whatever the number
of processes; Accelerate hands consecutive batches of it to consecutive ranks (disjoint shares of
one list) and a mid-epoch resume skips its first batches. Each index carries its ``draw`` (how many
times the same image came earlier in the epoch), so a repeated image gets augmentation draws of its
own and every (index, draw) pair of an epoch is distinct.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from visiontune.loading.augment import EpochIndex, derive_seed


def balanced_epoch(labels: Sequence[int], seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, draws) of epoch ``epoch``: ``len(labels)`` draws, classes as even as whole numbers allow."""
    labels = torch.as_tensor(np.asarray(labels, np.int64))
    n = labels.numel()
    g = torch.Generator().manual_seed(derive_seed(seed, epoch, 0x6A1A))  # its own stream, not EpochSampler's
    # The images of each class, in one sort (not a pass over the labels per class: 1000 classes).
    by_class = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels.clamp(min=-1) + 1)[1:]  # an unlabelled (negative) image is no class
    starts = counts.cumsum(0) - counts + (labels < 0).sum()
    present = torch.nonzero(counts).flatten()
    k = present.numel()
    if k == 0:
        return torch.arange(n), torch.zeros(n, dtype=torch.int64)
    slots = torch.full((k,), n // k, dtype=torch.int64)
    slots[torch.randperm(k, generator=g)[: n % k]] += 1
    indices, draws = [], []
    for c, s in zip(present.tolist(), slots.tolist()):
        members = by_class[starts[c] : starts[c] + counts[c]]
        rounds = -(-s // members.numel())  # enough shuffles of the class to fill its slots
        walk = torch.cat([members[torch.randperm(members.numel(), generator=g)] for _ in range(rounds)])[:s]
        indices.append(walk)
        draws.append(torch.arange(s) // members.numel())  # round r shows each image for the (r+1)-th time
    indices, draws = torch.cat(indices), torch.cat(draws)
    order = torch.randperm(n, generator=g)
    return indices[order], draws[order]


class BalancedSampler(Sampler[int]):
    """``balanced_epoch`` as a sampler of ``EpochIndex`` ints; set_epoch and the loader's generator as
    ``pipeline.EpochSampler`` has them (so a resumed epoch starts its workers from the same seeds)."""

    def __init__(self, labels: Sequence[int], seed: int, loader_generator: torch.Generator | None = None):
        self.labels = np.asarray(labels, np.int64).reshape(-1)
        self.seed, self.epoch, self.loader_generator = seed, 0, loader_generator

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.loader_generator is not None:
            self.loader_generator.manual_seed(self.seed + 7919 * (epoch + 1))

    def __iter__(self) -> Iterator[EpochIndex]:
        indices, draws = balanced_epoch(self.labels, self.seed, self.epoch)
        for start in range(0, len(indices), 8192):  # made as the loader asks for them, as EpochSampler's
            for i, d in zip(indices[start : start + 8192].tolist(), draws[start : start + 8192].tolist()):
                yield EpochIndex(i, self.epoch, d)

    def __len__(self) -> int:
        return len(self.labels)
