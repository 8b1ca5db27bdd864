"""Datasets, the epoch sampler, loaders and on-device normalisation.

Images are decoded and resized as uint8 on the loader side and travel to the
device as uint8 (a quarter of the bytes of float32); ``DeviceNormalize`` turns
them into normalised floats there. The ``EpochSampler`` gives the same
permutation for epoch ``e`` however many processes read it: Accelerate then
hands consecutive per-process batches to consecutive ranks, so N processes with
batch B see, step by step, the samples one process with batch N*B sees.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms import v2

from visiontune.config import MEAN, STD
from visiontune.data.decode import BadImage, read_image, resize_uint8


class ImageDataset(Dataset):
    """(uint8 [3,S,S] image, label) pairs; an unreadable file yields ``None``."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int], image_size: int, augment: bool = False):
        self.paths, self.labels, self.size = list(paths), list(labels), image_size
        self.augment = v2.Compose([v2.RandomResizedCrop(image_size, antialias=True),
                                   v2.RandomHorizontalFlip()]) if augment else None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        try:
            img = read_image(self.paths[i])
        except BadImage as e:
            # A file that breaks after the scan must not end the epoch: skip it.
            print(f"visiontune: skipped unreadable image {self.paths[i]}: {e}", file=sys.stderr)
            return None
        img = self.augment(img) if self.augment else resize_uint8(img, self.size)
        return img, self.labels[i]


def collate_skipping_bad(batch):
    good = [b for b in batch if b is not None]
    if not good:
        return torch.empty(0, 3, 1, 1, dtype=torch.uint8), torch.empty(0, dtype=torch.long)
    return torch.stack([b[0] for b in good]), torch.tensor([b[1] for b in good])


class EpochSampler(Sampler[int]):
    """A permutation of ``range(n)`` that depends only on (seed, epoch)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def make_loader(dataset: Dataset, batch_size: int, *, train: bool, seed: int, num_workers: int,
                pin_memory: bool) -> DataLoader:
    """Train: seeded permutation, full batches only. Val: in order, every sample."""
    return DataLoader(
        dataset, batch_size=batch_size,
        sampler=EpochSampler(len(dataset), seed) if train else None,
        drop_last=train, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=num_workers > 0, collate_fn=collate_skipping_bad,
        prefetch_factor=4 if num_workers > 0 else None)


class DeviceNormalize(torch.nn.Module):
    """uint8 NCHW on the device -> normalised float, optionally channels-last."""

    def __init__(self, device: torch.device, channels_last: bool = False):
        super().__init__()
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place on the one new float tensor: bit-identical to (x - mean) / std, and on a CPU ten
        # times faster, since fresh batch-sized buffers cost a page fault per 4 KiB.
        x = x.float().sub_(self.mean).div_(self.std)
        return x.contiguous(memory_format=self.memory_format)
