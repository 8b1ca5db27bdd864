"""The train and val loaders of a job's split, built the same for ``train`` and ``lr-find``: from
the cache when the job has one, else from the files, with the run's one resize (the model's
interpolation and crop) and the seeded per-sample augmentation; with ``--normalize data`` the
mean/std are measured here on the train split and returned in the config, which records them.
"""

from __future__ import annotations

import os

import torch

from visiontune import recipe
from visiontune.config import TrainConfig
from visiontune.data.augment import sample_augment
from visiontune.data.cache import CachedDataset
from visiontune.data.jobdata import JobData
from visiontune.data.pipeline import ImageDataset, make_loader
from visiontune.data.split import Split
from visiontune.models import input_view
from visiontune.strategy import decode_threads, loader_workers

LOAD_FAILURES = "load_failures.csv"  # path,problem rows for files that failed after the scan


def loaders(cfg: TrainConfig, data: JobData, split: Split, run_dir: str) -> tuple:
    """The config with its normalisation measured if needed, and the train and val loaders over the
    split: from the cache when asked for, else from the files."""
    images = data.images
    # The run's one resize, for val and train.
    interpolation, crop_pct = input_view(cfg.model, cfg.interpolation, cfg.crop_pct)
    if data.cache:

        def subset(idx, augment):
            return CachedDataset(data.cache, data.rows[idx], images.labels[idx], augment)
    else:

        def subset(idx, augment):
            return ImageDataset(
                images.paths.take(idx),  # a view: no str per file until a sample is read
                images.labels[idx],
                cfg.image_size,
                augment,
                failures_csv=os.path.join(run_dir, LOAD_FAILURES),
                threads=decode_threads(cfg),
                interpolation=interpolation,
                crop_pct=crop_pct,
            )

    workers, pin = loader_workers(cfg), torch.cuda.is_available()
    augment = sample_augment(cfg.augment, cfg.image_size, cfg.seed, cfg.random_erasing, interpolation)
    if cfg.mean is None:  # --normalize data: measured once on the train split, then recorded in config.json
        mean, std = recipe.data_stats(subset(split.train, None), seed=cfg.seed)
        cfg = cfg.replace(mean=mean, std=std)
    return cfg, *(
        make_loader(
            subset(idx, augment if train else None),
            cfg.batch_size,
            train=train,
            seed=cfg.seed,
            num_workers=workers,
            pin_memory=pin,
        )
        for idx, train in ((split.train, True), (split.val, False))
    )
