"""Datasets, the epoch sampler, loaders and on-device normalisation.

Images are decoded and resized as uint8 on the loader side and travel to the
device as uint8 (a quarter of the bytes of float32); ``DeviceNormalize`` turns
them into normalised floats there. The ``EpochSampler`` gives the same
permutation for epoch ``e`` however many processes read it: Accelerate then
hands consecutive per-process batches to consecutive ranks, so N processes with
batch B see, step by step, the samples one process with batch N*B sees.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from visiontune.data.decode import try_read
from visiontune.data.pathlist import PathList
from visiontune.loading.augment import EpochIndex, SampleAugment
from visiontune.loading.balanced import BalancedSampler
from visiontune.settings.config import MEAN, STD
from visiontune.tasks import SINGLE_LABEL, Task


class ImageDataset(Dataset):
    """(uint8 [3,S,S] image, label) pairs, resized by ``decode.resize_uint8`` (``interpolation``, ``crop_pct``),
    decoded as ``decode`` says (``decode.DECODES``).

    A file that cannot be read (it broke after the scan) keeps its slot as a
    black image labelled ``UNREADABLE``: batches keep their size, so sharding
    and Accelerate's padding stay exact, and the loops leave it out of metrics.

    The DataLoader fetches a batch through ``__getitems__``: with ``threads`` > 1
    its files are decoded and resized by a thread pool (libjpeg-turbo and the
    resize release the GIL), which is how a CPU-only run decodes without loader
    processes competing with the model for the cores. Augmentation then runs in
    the calling thread (``SampleAugment`` seeds each sample's draws itself).
    """

    def __init__(
        self,
        paths: Sequence[str],
        labels: Sequence[int],
        image_size: int,
        augment: SampleAugment | None = None,
        report: bool = True,
        failures_csv: str | None = None,
        threads: int = 1,
        interpolation: str = "bilinear",
        crop_pct: float | None = None,
        reader=None,
        decode: str = "exact",
        task: Task = SINGLE_LABEL,
    ):
        # ``reader`` (an ImageSet's): then paths are names and the bytes of sample i are reader[i].
        self.reader = reader
        # A PathList and an int64 array stay as they are: no Python object per file to copy into workers.
        self.paths = paths if isinstance(paths, PathList) else list(paths)
        # The run's task: how the labels are kept (class indices, multi-hot rows, numbers) and collated.
        self.task = task
        self.labels, self.size, self.report = self.task.label_array(labels), image_size, report
        self.interpolation, self.crop_pct = interpolation, crop_pct  # how resize_uint8 brings files to size
        self.decode = decode
        self.failures_csv = failures_csv  # where files that fail at load time are recorded
        self.augment = augment
        self.threads = threads
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (owner pid, pool)

    def __len__(self) -> int:
        return len(self.paths)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None}

    def _decode(self, i: int) -> torch.Tensor | str:
        return self._read(self.paths[i] if self.reader is None else self.reader[i])

    def _read(self, source) -> torch.Tensor | str:
        # Full size when augmenting: the random crop comes before the resize (so no DCT scale either).
        if self.augment and self.augment.resizes:
            return try_read(source)
        return try_read(source, self.size, self.interpolation, self.crop_pct, self.decode)

    def _finish(self, i: int, img: torch.Tensor | str):
        if isinstance(img, str):
            if self.report:
                print(f"visiontune: skipped unreadable image {self.paths[i]}: {img}", file=sys.stderr)
            if self.failures_csv:
                record_failure(self.failures_csv, self.paths[i], img)
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), self.task.unreadable_label(self.labels)
        return (self.augment(img, i) if self.augment else img), self.task.sample_label(self.labels, i)

    def __getitem__(self, i: int):
        return self._finish(i, self._decode(i))

    def __getitems__(self, indices: Sequence[int]) -> list:
        if self.threads <= 1 or len(indices) < 2:
            return [self[i] for i in indices]
        # A forked loader worker inherits the object but not the pool's threads: each process owns its pool.
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(self.threads, thread_name_prefix="visiontune-decode"))
        return [self._finish(i, img) for i, img in zip(indices, self._pool[1].map(self._decode, indices))]


def record_failure(csv_path: str, path: str, problem: str) -> None:
    # Loader workers of every process may append at once: one small O_APPEND write per row
    # lands whole, so rows never interleave.
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([path, problem])
    fd = os.open(csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, buf.getvalue().encode())
    finally:
        os.close(fd)


class EpochSampler(Sampler[int]):
    """A permutation of ``range(n)`` that depends only on (seed, epoch).

    Its indices are ``EpochIndex`` ints: they tell the dataset the epoch, from which
    (with the index) augmentation seeds its draws, in this process or a loader worker.

    ``loader_generator`` is the DataLoader's own generator, reseeded each epoch: the
    loader draws its workers' base seed from it (instead of from the global RNG) when
    an epoch's iterator starts, so a run resumed mid-epoch gets the same worker seeds
    and the same global RNG stream as the run it continues.
    """

    def __init__(self, n: int, seed: int, loader_generator: torch.Generator | None = None):
        self.n, self.seed, self.epoch = n, seed, 0
        self.loader_generator = loader_generator

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.loader_generator is not None:
            self.loader_generator.manual_seed(self.seed + 7919 * (epoch + 1))

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return _epoch_indices(torch.randperm(self.n, generator=g), self.epoch)

    def __len__(self) -> int:
        return self.n


def _epoch_indices(perm: torch.Tensor, epoch: int):
    # Made as the loader asks for them: a list of a million EpochIndex objects would hold ~150 MB.
    for start in range(0, len(perm), 8192):
        for i in perm[start : start + 8192].tolist():
            yield EpochIndex(i, epoch)


def collate_channels_last(batch):
    """Stack (uint8 [3,S,S], label) pairs into a [B,3,S,S] batch kept in channels-last memory.

    The decoder and the antialiased uint8 resize work in height x width x channel
    order; stacking those images into a channels-first block is a transposing copy
    about 10x slower than the stack itself (a quarter of the loader's time at 224 px).
    So the batch keeps their order and ``DeviceNormalize`` converts it on the device.
    """
    images, labels = default_collate([(img.permute(1, 2, 0), label) for img, label in batch])
    return images.permute(0, 3, 1, 2), labels


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    train: bool,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    balanced_labels: Sequence[int] | None = None,
) -> DataLoader:
    """Train: seeded permutation (or, given the dataset's ``balanced_labels``, a class-balanced
    epoch), full batches only. Val: in order, every sample."""
    generator = torch.Generator().manual_seed(seed) if train else None
    sampler = None
    if train:
        sampler = (
            EpochSampler(len(dataset), seed, generator)
            if balanced_labels is None
            else BalancedSampler(balanced_labels, seed, generator)
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        generator=generator,
        sampler=sampler,
        drop_last=train,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        collate_fn=getattr(dataset, "collate", collate_channels_last),  # devicedecode's datasets bring their own
        prefetch_factor=4 if num_workers > 0 else None,
    )


class DeviceNormalize(torch.nn.Module):
    """uint8 NCHW on the device -> normalised float, optionally channels-last."""

    def __init__(
        self,
        device: torch.device,
        channels_last: bool = False,
        mean: Sequence[float] = MEAN,
        std: Sequence[float] = STD,
    ):
        super().__init__()
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place on the one new float tensor: bit-identical to (x - mean) / std, and on a CPU ten
        # times faster, since fresh batch-sized buffers cost a page fault per 4 KiB.
        # The layout change (loader batches are channels-last) is done on the uint8 batch,
        # a quarter of the bytes of the float one.
        x = x.contiguous(memory_format=self.memory_format).float()
        return x.sub_(self.mean).div_(self.std)
