"""``visiontune lr-find`` and ``--lr auto``: a short exponential learning-rate sweep, as fastai and Lightning do it.

The run's own model, data, optimizer (with its parameter groups and their lr
ratios) and loss train for up to ``steps`` optimizer steps while the lr grows
geometrically from ``start`` to ``end``; the sweep stops early once the smoothed
loss passes four times its minimum. The suggestion is the classic one: a tenth
of the lr at the smoothed loss's minimum, where the loss still falls steeply.

The sweep runs in one process on one device, in full precision (fp16 without the
run's loss scaler would underflow), seeded with ``--seed`` and leaving the
caller's random state as it found it. Each step sees the run's global batch: the
loader's batches, ``processes x --grad-accum`` of them accumulated, as DDP and
accumulation average them. So ``train --lr auto`` gets exactly the lr that
``lr-find`` with the same flags suggests.
"""

from __future__ import annotations

import copy
import itertools
import os
import random

import numpy as np
import torch
from accelerate.utils import broadcast_object_list, set_seed

from visiontune.cluster import strategies
from visiontune.cluster.launch import default_output_dir
from visiontune.cluster.strategy import make_accelerator
from visiontune.data.groups import split_for
from visiontune.data.sources import discover
from visiontune.errors import UserError
from visiontune.loading.devicedecode import on_device
from visiontune.loading.jobdata import prepare as prepare_data
from visiontune.loading.pipeline import DeviceNormalize
from visiontune.models.build import build_model
from visiontune.runs import runrecords
from visiontune.settings import presets
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import reader
from visiontune.training import imbalance, optim, plan

START, END, STEPS = 1e-7, 10.0, 100  # fastai's lr_find range and length; --lr auto sweeps the same
RECORD = "lr_find.json"


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


def sweep(
    cfg: TrainConfig,
    model: torch.nn.Module,
    loader,
    device,
    accumulate: int,
    criterion,
    *,
    start=START,
    end=END,
    steps=STEPS,
) -> dict:
    """The sweep on ``model`` (trained in place: pass a copy to keep it) over the unprepared train ``loader``."""
    if not 0 < start < end or steps < 2:
        raise UserError("lr-find needs 0 < --start-lr < --end-lr and --steps >= 2")
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_seed(cfg.seed)  # the same sweep whatever the caller drew before
    try:
        return _sweep(cfg, model.to(device), loader, device, accumulate, criterion, start, end, steps)
    finally:  # the run that follows draws as it would have without the sweep
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _sweep(cfg, model, loader, device, accumulate: int, criterion, start: float, end: float, steps: int) -> dict:
    optimizer, _ = optim.optimization(cfg, model, 1.0, max(1, len(loader)))
    ratios = [g["initial_lr"] for g in optimizer.param_groups]  # lr multipliers of the groups
    normalize = DeviceNormalize(device, cfg.channels_last, *presets.mean_std(cfg))
    model.train()
    lrs, losses, avg, lowest = [], [], 0.0, float("inf")
    batches = itertools.chain.from_iterable(_epochs(loader))
    for step in range(steps):
        lr = start * (end / start) ** (step / (steps - 1))
        for g, r in zip(optimizer.param_groups, ratios):
            g["lr"] = lr * r
        total = 0.0
        for images, labels in itertools.islice(batches, accumulate):  # one global batch
            images, labels = on_device(images.to(device), labels.to(device))  # --decode device's JPEGs
            loss = criterion(model(normalize(images)), labels) / accumulate
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        avg = 0.98 * avg + 0.02 * total  # the smoothing of fastai's sweep, debiased below
        smooth = avg / (1 - 0.98 ** (step + 1))
        lrs.append(lr)
        losses.append(smooth)
        lowest = min(lowest, smooth)
        if not np.isfinite(total) or smooth > 4 * lowest:
            break
    suggested = lrs[losses.index(min(losses))] / 10
    return {"suggested_lr": suggested, "lrs": lrs, "losses": losses, "start": start, "end": end}


def lr_find(cfg: TrainConfig, *, start: float = START, end: float = END, steps: int = STEPS) -> dict:
    """Sweep the lr; write ``lr_find.png`` and ``lr_find.json`` in the output folder; return the record."""
    from visiontune.loading.loaders import loaders  # the train loader exactly as `train` builds it

    cfg = validate(cfg.replace(strategy=strategies.one_device().name, log_with=None))
    resolved = plan.view(cfg)  # the input view train resolves
    cfg = resolved.cfg
    if not 0 < start < end or steps < 2:
        raise UserError("lr-find needs 0 < --start-lr < --end-lr and --steps >= 2")
    out = cfg.output_dir or default_output_dir().replace("runs", "runs/lr-find", 1)
    os.makedirs(out, exist_ok=True)
    accelerator = make_accelerator(resolved.process())
    images = discover(cfg.data, cfg.image_column, cfg.label_column, task=reader(cfg.task))
    set_seed(cfg.seed)  # the model's init, as train's main process draws it
    model = build_model(cfg.model, len(images.classes), cfg.weights, cfg.freeze_backbone, image_size=cfg.image_size)
    data = prepare_data(accelerator, cfg, out, images)
    split = split_for(data.images, cfg)[0]
    train_labels = data.images.label_array[split.train]
    task = plan.task_of(cfg, images).fitted(train_labels)
    stats, loader, _ = loaders(cfg, data, split, out, resolved.threads, task)
    cfg = plan.laid_out(plan.measured(resolved, stats), model, accelerator.device).cfg  # as train resolves them
    imbalance.check_sampler(cfg, task)
    weights = imbalance.class_weights(cfg.class_weights, data.images.classes, train_labels, task)
    criterion = optim.criterion(cfg, task, weights) or task.mean_loss  # the run's loss
    record = sweep(cfg, model, loader, accelerator.device, cfg.grad_accum, criterion, start=start, end=end, steps=steps)
    if accelerator.is_main_process:
        from visiontune import files

        files.write_json(os.path.join(out, RECORD), record)
        _plot(os.path.join(out, "lr_find.png"), record["lrs"], record["losses"], record["suggested_lr"])
    return {**record, "dir": out}


def auto_lr(accelerator, cfg: TrainConfig, model: torch.nn.Module, loader, criterion, resumed_from: str | None):
    """``--lr auto``: the lr of a resumed run as its folder recorded it, else the sweep's suggestion.

    The main process sweeps a copy of its freshly built ``model`` (the others' heads were drawn with
    other seeds until DDP copies rank 0's weights) and every process takes its answer, so all ranks
    train with one lr, with the run's own loss (``criterion``). Returns the lr and the sweep's record
    (None on a resume), which the run keeps as ``lr_find.json``.
    """
    if resumed_from is not None:  # the resumed run's own choice: the sweep is not run again
        return _recorded(resumed_from), None
    found = [None]
    if accelerator.is_main_process:
        accumulate = accelerator.num_processes * cfg.grad_accum
        model = copy.deepcopy(model)  # the run trains the model as built; the sweep, a copy
        found[0] = sweep(cfg, model, loader, accelerator.device, accumulate, criterion, steps=STEPS)
    if accelerator.num_processes > 1:
        broadcast_object_list(found)
    return found[0]["suggested_lr"], found[0]


def _recorded(source: str) -> float:
    path = os.path.join(source, "config.json")
    lr = (runrecords.read_config(source) or {"setup": {}})["setup"].get("lr")  # a number, when there
    if lr is None:
        raise UserError(
            f"--lr auto resumes with the lr its run chose, but {path} does not say it; pass that run's --lr"
        )
    return float(lr)


def _epochs(loader):
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield loader
