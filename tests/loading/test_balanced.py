"""--sampler balanced: classes drawn evenly (counted), each rank's share of an epoch disjoint (Accelerate's
own batch sharding, world 2, in-process), the same order from (seed, epoch), and a mid-epoch skip that
yields exactly the epoch's tail."""

from __future__ import annotations

import numpy as np
import torch
from accelerate.data_loader import BatchSamplerShard, skip_first_batches
from torch.utils.data import BatchSampler, DataLoader

from visiontune.loading.augment import EpochIndex, sample_augment
from visiontune.loading.balanced import BalancedSampler
from visiontune.loading.pipeline import make_loader

# 95/5 of 200 images, plus a third class of 3 images: 198 train slots over 3 classes.
LABELS = np.array([0] * 185 + [1] * 10 + [2] * 3)


def _epoch(sampler: BalancedSampler, epoch: int) -> list[tuple[int, int]]:
    sampler.set_epoch(epoch)
    return [(int(i), i.draw) for i in sampler]


def test_each_class_is_drawn_equally_often_and_each_image_as_evenly_as_its_class_allows():
    sampler = BalancedSampler(LABELS, seed=7)
    for epoch in range(3):
        drawn = _epoch(sampler, epoch)
        assert len(drawn) == len(LABELS)
        per_class = np.bincount(LABELS[[i for i, _ in drawn]], minlength=3)
        assert per_class.tolist() == [66, 66, 66]  # 198 / 3
        per_image = np.bincount([i for i, _ in drawn], minlength=len(LABELS))
        # class 2: 3 images fill 66 slots, 22 each; class 1: 10 images, 6 or 7 each; class 0: 66 of 185 once.
        assert set(per_image[LABELS == 2]) == {22}
        assert set(per_image[LABELS == 1]) <= {6, 7} and per_image[LABELS == 1].sum() == 66
        assert set(per_image[LABELS == 0]) <= {0, 1}
        # The k-th draw of an image is numbered k - 1: every (index, draw) of an epoch is distinct.
        assert len(set(drawn)) == len(drawn)
        for i in range(len(LABELS)):
            assert sorted(d for j, d in drawn if j == i) == list(range(per_image[i]))


def test_an_uneven_remainder_goes_to_some_classes_and_the_order_repeats_from_seed_and_epoch():
    labels = np.array([0] * 9 + [1] * 2)  # 11 slots over 2 classes: 6 and 5
    a, b = BalancedSampler(labels, seed=3), BalancedSampler(labels, seed=3)
    assert _epoch(a, 4) == _epoch(b, 4)  # a fresh sampler, the same (seed, epoch): the same epoch
    assert sorted(np.bincount(labels[[i for i, _ in _epoch(a, 4)]]).tolist()) == [5, 6]
    assert _epoch(a, 4) != _epoch(a, 5) and _epoch(a, 4) != _epoch(BalancedSampler(labels, seed=4), 4)


def test_two_ranks_get_disjoint_shares_that_make_up_the_single_process_epoch():
    sampler = BalancedSampler(LABELS, seed=11)
    sampler.set_epoch(2)
    batch, world = 8, 2
    whole = [(int(i), i.draw) for b in BatchSampler(sampler, batch * world, drop_last=True) for i in b]
    # What Accelerate hands each process when it prepares the train loader: consecutive batches to consecutive ranks.
    shares = [
        [[(int(i), i.draw) for i in b] for b in BatchSamplerShard(BatchSampler(sampler, batch, True), world, rank)]
        for rank in range(world)
    ]
    assert not set(sum(shares[0], [])) & set(sum(shares[1], []))
    interleaved = [x for pair in zip(*shares) for b in pair for x in b]
    assert interleaved == whole  # step by step, world x batch B is one process with batch world * B


class _Index(torch.utils.data.Dataset):
    """The sampler's (index, draw) as the sample, with the augmentation's draws for it."""

    def __init__(self, n: int):
        self.n = n
        self.aug = sample_augment("flip-crop", 8, seed=5)
        self.image = torch.arange(3 * 16 * 16, dtype=torch.uint8).view(3, 16, 16)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self.aug(self.image, i), int(i), i.draw


def test_a_mid_epoch_skip_yields_exactly_the_epoch_s_tail_and_repeats_are_augmented_apart():
    dataset = _Index(len(LABELS))
    train = make_loader(dataset, 8, train=True, seed=1, num_workers=0, pin_memory=False, balanced_labels=LABELS)
    assert isinstance(train.sampler, BalancedSampler)  # what --sampler balanced gives the train loader
    loader = DataLoader(dataset, batch_size=8, sampler=train.sampler, drop_last=True)
    loader.sampler.set_epoch(3)
    full = list(loader)
    tail = list(skip_first_batches(loader, 5))  # how a resumed run skips the batches it trained on
    assert len(tail) == len(full) - 5
    for got, want in zip(tail, full[5:]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # A repeated image of the rarest class gets other augmentation draws on each repeat.
    images, index, draw = (torch.cat(x) for x in zip(*full))
    rare = int(np.flatnonzero(LABELS == 2)[0])
    first, second = (images[(index == rare) & (draw == d)][0] for d in (0, 1))
    assert not torch.equal(first, second)
    assert torch.equal(dataset.aug(dataset.image, EpochIndex(rare, 3, 1)), second)
    assert torch.equal(dataset.aug(dataset.image, EpochIndex(rare, 3)), first)
