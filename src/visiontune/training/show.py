"""``visiontune show``: the first training batch of a run, as the model will see it, without training.

The batch is made by the run's own code, in the run's order: the listing (and ``--limit-images``), the
seeded split, the loaders of ``loading.loaders`` with the run's resize and the seeded per-sample
augmentation of epoch 0, then ``DeviceNormalize``; what is drawn is that normalised batch taken back
to pixels with the same mean and std. Batch-level mixing (``--mixup``, ``--cutmix``) is not drawn.
"""

from __future__ import annotations

import tempfile

import torch

from visiontune.data.groups import split_for
from visiontune.data.imageset import ImageSet
from visiontune.data.listing import listed
from visiontune.errors import UserError
from visiontune.loading.jobdata import JobData, limit
from visiontune.loading.loaders import loaders
from visiontune.loading.pipeline import DeviceNormalize
from visiontune.settings import presets
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import Task, reader
from visiontune.training import plan


def first_batch(
    cfg: TrainConfig, images: ImageSet | None = None
) -> tuple[TrainConfig, torch.Tensor, torch.Tensor, Task]:
    """(the config, the normalised float batch [N, 3, S, S], its labels, the run's task) of epoch 0's first
    training batch.
    No cache is built (the images are decoded as the run without one would) and no file is screened first:
    an unreadable one is the black stand-in that training would skip."""
    # No cache and no loader processes: the batch is decoded here, as a run without a cache would.
    shown = plan.view(validate(cfg.replace(cache="off", num_workers=0)))
    cfg = shown.cfg
    images = images or listed(cfg.data, cfg.image_column, cfg.label_column, reader(cfg.task))
    images, _ = limit(images, cfg.limit_images, cfg.seed)
    task = plan.task_of(cfg, images)
    split, _ = split_for(images, cfg)
    if len(split.train) < cfg.batch_size:
        raise UserError(f"the train split has {len(split.train)} images, fewer than one batch of {cfg.batch_size}")
    with tempfile.TemporaryDirectory() as scratch:  # where a loader would record files that fail to load
        stats, train_loader, _ = loaders(cfg, JobData(images, []), split, scratch, shown.threads, task)
        cfg = plan.measured(shown, stats).cfg  # --normalize data: as train measures it
        train_loader.sampler.set_epoch(0)
        batch, labels = next(iter(train_loader))
    mean, std = presets.mean_std(cfg)
    return cfg, DeviceNormalize(torch.device("cpu"), False, mean, std)(batch), labels, task


def pixels(cfg: TrainConfig, x: torch.Tensor) -> torch.Tensor:
    """A normalised batch back to uint8 pixels, with the run's mean and std."""
    mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) * 255 for v in presets.mean_std(cfg))
    return (x.double() * std + mean).round().clamp(0, 255).to(torch.uint8)


def show(cfg: TrainConfig, out: str, count: int) -> str:
    """Write the grid of the first ``count`` images of the first training batch to ``out``; the line to print."""
    from visiontune.reports.batchgrid import write_grid

    images = listed(cfg.data, cfg.image_column, cfg.label_column, reader(validate(cfg).task))
    cfg, x, labels, task = first_batch(cfg, images)
    n = min(count, len(x))
    write_grid(pixels(cfg, x[:n]), task.label_text(labels[:n], images.classes), out)
    return (
        f"visiontune: wrote {out}: {n} of the first training batch's {len(x)} images as the model sees them "
        f"({cfg.image_size} px, {cfg.interpolation}, augment {cfg.augment}, seed {cfg.seed}; epoch 1)"
    )
