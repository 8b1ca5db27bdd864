"""The train and val loaders of a job's split, built the same for ``train`` and ``lr-find``: from
the cache when the job has one, else from the files, with the run's one resize (the model's
interpolation and crop) and the seeded per-sample augmentation; with ``--normalize data`` the
mean/std are measured here on the train split and returned in the config, which records them.
"""

from __future__ import annotations

import os

import torch

from visiontune.cluster.strategy import Threads
from visiontune.data.split import Split
from visiontune.loading.augment import sample_augment
from visiontune.loading.cache import CachedDataset
from visiontune.loading.devicedecode import DeviceDecodeDataset
from visiontune.loading.jobdata import JobData
from visiontune.loading.pipeline import ImageDataset, make_loader
from visiontune.settings.config import TrainConfig
from visiontune.settings.presets import stats_text
from visiontune.tasks import SINGLE_LABEL, Task

LOAD_FAILURES = "load_failures.csv"  # path,problem rows for files that failed after the scan


def loaders(cfg: TrainConfig, data: JobData, split: Split, run_dir: str, cores: Threads, task: Task) -> tuple:
    """The train split's (mean, std) when ``--normalize data`` asks for them measured (else None), and the
    train and val loaders over the split: from the cache when asked for, else from the files. ``cfg``'s
    input view is resolved (``training.plan``): the run's one resize, for val and train; ``cores`` its
    loader workers and decoding threads; ``task`` how a sample's label is kept and collated."""
    images = data.images
    interpolation, crop_pct = cfg.interpolation, cfg.crop_pct
    if data.cache:

        def subset(idx, augment, device=False):  # a cached image is decoded already
            return CachedDataset(data.cache, data.rows[idx], images.label_array[idx], augment, task=task)
    else:

        def subset(idx, augment, device=False):  # device: JPEGs reach the training process undecoded
            return (DeviceDecodeDataset if device else ImageDataset)(
                images.paths.take(idx),  # a view: no str per file until a sample is read
                images.label_array[idx],  # as the task keeps them: class indices, multi-hot rows, numbers
                cfg.image_size,
                augment,
                failures_csv=os.path.join(run_dir, LOAD_FAILURES),
                threads=cores.decode,
                interpolation=interpolation,
                crop_pct=crop_pct,
                reader=None if images.reader is None else images.reader.take(idx),
                decode=cfg.decode,
                task=task,
            )

    workers, pin = cores.loader_workers, torch.cuda.is_available()
    augment = sample_augment(
        cfg.augment,
        cfg.image_size,
        cfg.seed,
        cfg.random_erasing,
        interpolation,
        hflip=cfg.hflip,
        vflip=cfg.vflip or 0.0,
        crop_scale=cfg.crop_scale,
    )
    stats = None
    if cfg.mean is None:  # --normalize data: measured once on the train split, then recorded in config.json
        # Decoded here with --decode device too (as exact): the statistics are the same up to the decoder's rounding.
        stats = data_stats(subset(split.train, None), task, seed=cfg.seed)
    return stats, *(
        make_loader(
            subset(idx, augment if train else None, device=cfg.decode == "device"),
            cfg.batch_size,
            train=train,
            seed=cfg.seed,
            num_workers=workers,
            pin_memory=pin,
            balanced_labels=images.labels[idx] if train and cfg.sampler == "balanced" else None,
        )
        for idx, train in ((split.train, True), (split.val, False))
    )


def data_stats(dataset, task: Task = SINGLE_LABEL, limit: int = 2000, seed: int = 0) -> tuple[str, str]:
    """Per-channel mean and std (as --mean/--std text) of up to ``limit`` images of ``dataset``, seeded."""
    from torch.utils.data import DataLoader, Subset

    pick = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:limit].tolist()
    total = torch.zeros(2, 3, dtype=torch.float64)
    n = 0
    for images, labels in DataLoader(Subset(dataset, pick), batch_size=64):
        # Unreadable images are black stand-ins: left out.
        x = images[task.readable(labels)].double().div_(255)
        total += torch.stack([x.sum((0, 2, 3)), x.square().sum((0, 2, 3))])
        n += x.numel() // 3
    mean = total[0] / max(n, 1)
    std = (total[1] / max(n, 1) - mean.square()).clamp_min(1e-12).sqrt()
    return stats_text(mean.tolist()), stats_text(std.tolist())
