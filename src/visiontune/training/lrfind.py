"""``visiontune lr-find``: a short exponential learning-rate sweep, as fastai and Lightning do it.

The run's own model, data, optimizer (with its parameter groups and their lr
ratios) and loss train for up to ``steps`` batches while the lr grows
geometrically from ``start`` to ``end``; the sweep stops early once the smoothed
loss passes four times its minimum. The suggestion is the classic one: a tenth
of the lr at the smoothed loss's minimum, where the loss still falls steeply.
One process, one device: the sweep is short and its answer does not depend on
the number of processes (pass the global batch you will train with).
"""

from __future__ import annotations

import itertools
import os

import torch
from accelerate.utils import set_seed

from visiontune.cluster.launch import default_output_dir
from visiontune.cluster.strategy import make_accelerator
from visiontune.data.groups import split_for
from visiontune.data.jobdata import prepare as prepare_data
from visiontune.data.layouts import discover
from visiontune.data.pipeline import DeviceNormalize
from visiontune.errors import UserError
from visiontune.models.build import build_model, get_spec
from visiontune.settings import presets
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.training import imbalance, optim
from visiontune.training.engine import readable_cross_entropy


def _plot(path: str, lrs: list[float], losses: list[float], suggested: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(lrs, losses)
    ax.axvline(suggested, color="tab:red", linestyle="--", label=f"suggested lr {suggested:.2g}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss (smoothed)", title="lr-find")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def lr_find(cfg: TrainConfig, *, start: float = 1e-7, end: float = 10.0, steps: int = 100) -> dict:
    """Sweep the lr; write ``lr_find.png`` and ``lr_find.json`` in the output folder; return the record."""
    from visiontune.data.loaders import loaders  # the train loader exactly as `train` builds it

    cfg = validate(cfg.replace(strategy="single", log_with=None))
    cfg = cfg.replace(image_size=cfg.image_size or get_spec(cfg.model).preprocess.size)
    if not 0 < start < end or steps < 2:
        raise UserError("lr-find needs 0 < --start-lr < --end-lr and --steps >= 2")
    out = cfg.output_dir or default_output_dir().replace("runs", "runs/lr-find", 1)
    os.makedirs(out, exist_ok=True)
    accelerator = make_accelerator(cfg)
    images = discover(cfg.data, cfg.image_column, cfg.label_column, multi_label=cfg.multi_label)
    set_seed(cfg.seed)
    model = build_model(cfg.model, len(images.classes), cfg.weights, cfg.freeze_backbone)
    data = prepare_data(accelerator, cfg, out, images)
    split = split_for(data.images, cfg)[0]
    cfg, loader, _ = loaders(cfg, data, split, out)
    optimizer, _ = optim.optimization(cfg, model, 1.0, max(1, len(loader)))
    ratios = [g["initial_lr"] for g in optimizer.param_groups]  # lr multipliers of the groups
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    normalize = DeviceNormalize(accelerator.device, cfg.channels_last, *presets.mean_std(cfg))
    imbalance.check_single_label(cfg, images.multi_label)
    weights = imbalance.class_weights(cfg.class_weights, data.images.classes, data.images.label_array[split.train])
    criterion = optim.criterion(cfg, images.multi_label, weights) or readable_cross_entropy  # the run's loss
    model.train()
    lrs, losses, avg, lowest = [], [], 0.0, float("inf")
    batches = itertools.chain.from_iterable(_epochs(loader))
    for step, (images_, labels) in zip(range(steps), batches):
        lr = start * (end / start) ** (step / (steps - 1))
        for g, r in zip(optimizer.param_groups, ratios):
            g["lr"] = lr * r
        loss = criterion(model(normalize(images_)), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        avg = 0.98 * avg + 0.02 * loss.item()  # the smoothing of fastai's sweep, debiased below
        smooth = avg / (1 - 0.98 ** (step + 1))
        lrs.append(lr)
        losses.append(smooth)
        lowest = min(lowest, smooth)
        if not torch.isfinite(loss) or smooth > 4 * lowest:
            break
    suggested = lrs[losses.index(min(losses))] / 10
    record = {"suggested_lr": suggested, "lrs": lrs, "losses": losses, "start": start, "end": end}
    if accelerator.is_main_process:
        from visiontune import files

        files.write_json(os.path.join(out, "lr_find.json"), record)
        _plot(os.path.join(out, "lr_find.png"), lrs, losses, suggested)
    return {**record, "dir": out}


def _epochs(loader):
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield loader
