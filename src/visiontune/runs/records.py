"""The run folder's records and the run's opening and closing lines: ``config.json``,
``classes.json``, ``split.json``, ``bad_files.csv`` and the trackers at the start, the summary's
figures (best epoch, steady-state throughput) and ``summary.json`` with the report at the end;
during the run, ``metrics.csv`` and the best model (``best.safetensors``, carrying the run's
description).
Only the main process writes files; ``summary.json`` after every process has arrived.
"""

from __future__ import annotations

import csv
import io
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from visiontune import files
from visiontune.cluster import host, strategies
from visiontune.cluster.strategy import Setup
from visiontune.data import sources
from visiontune.data.check import write_report
from visiontune.data.imageset import ImageSet
from visiontune.data.split import Split, write_split
from visiontune.files import atomic_write
from visiontune.models import lora
from visiontune.runs import epochs, runinfo
from visiontune.settings.config import TrainConfig
from visiontune.tasks import RANKED, Task


def results(history: list[dict], metric: str, task: Task) -> dict:
    """The summary's figures: the best epoch (with what its ``task`` adds, multi-label's mAP and thresholds),
    and train images/s over the steady steps of every epoch."""
    best, which = best_of(history, metric)
    steady = {k: sum(r["train"][k] for r in history) for k in ("steady_images", "steady_seconds", "data_wait_seconds")}
    if not steady["steady_images"]:  # epochs shorter than the timing warm-up: use everything
        steady = {
            "steady_images": sum(r["train"]["images"] for r in history),
            "steady_seconds": sum(r["train"]["seconds"] for r in history),
            "data_wait_seconds": 0.0,
        }
    seconds = steady["steady_seconds"]
    return {
        f"best_val_{task.score_key}": best[which]["accuracy"],
        "best_val_loss": best[which]["loss"],
        **task.best_figures(best[which]),
        "best_epoch": best["epoch"] + 1,  # counted from 1, as the console ("Epoch 3/3") and history.json count
        epochs.COUNTED_FROM: 1,
        "best_metric": metric,  # what chose it: --best-metric, resolved (mAP for multi-label by default)
        "best_weights": "ema" if which == "val_ema" else "raw",
        "epochs": len(history),
        "train_images_per_s": steady["steady_images"] / seconds if seconds else 0.0,
        "data_wait_fraction": steady["data_wait_seconds"] / seconds if seconds else 0.0,
        **steady,
        "val_images_counted": history[-1]["val"]["images"],
    }


RARE_VAL_IMAGES = 10  # below this many val images of a class, the start lines warn


@dataclass(frozen=True)
class RunFacts:
    """What a run's records say of it, resolved (``training.plan``): its processes and folder, the settings and
    the world's setup, what it learns, its images and their split, and what ``--cache`` came to."""

    accelerator: Any
    run_dir: str
    cfg: TrainConfig
    setup: Setup  # the world's strategy, devices, batch and lr
    task: Task
    images: ImageSet
    split: Split
    image_cache: dict | None = None  # cache.CacheChoice.to_dict()


def announce(run: RunFacts, overview: list[tuple[str, str]] = (), note: str | None = None) -> None:
    """The run's opening line (strategy, devices, split sizes, batch, lr and run folder) and a warning when
    a class has few val images, then the resolved setup, one row a line, and a note on the recipe if it has one."""
    setup, images, split = run.setup, run.images, run.split
    run.accelerator.print(
        f"visiontune: {setup.strategy} on {', '.join(sorted(set(setup.devices)))} x{setup.world_size} | "
        f"{len(split.train)} train / {len(split.val)} val images"
        f"{f' ({images.split_note})' if images.split_note else ''}, {len(images.classes)} {run.task.classes_word} | "
        f"batch {setup.per_process_batch} per process, global batch {setup.global_batch}, "
        f"lr {setup.lr:g} | run folder {run.run_dir}"
    )
    # Per-class recall (and the balanced accuracy, their mean) of a class with a handful of val images
    # jumps by large steps between epochs: say so before the numbers are read as differences.
    val_counts = np.asarray(list(images.class_counts(split.val).values()), np.int64)  # multi-label: each of its classes
    if len(split.val) and len(val_counts) and val_counts.min() < RARE_VAL_IMAGES:
        rarest = int(val_counts.argmin())
        count = int(val_counts[rarest])
        run.accelerator.print(
            f"visiontune: warning: the rarest class, {images.classes[rarest]!r}, has {count} validation "
            f"image{'s' * (count != 1)} (fewer than {RARE_VAL_IMAGES}): its recall and the balanced "
            f"accuracy are coarse; {_rare_advice(run.cfg, images, rarest)}"
        )
    if overview:
        width = max(len(label) for label, _ in overview)
        run.accelerator.print(
            "Running training\n" + "\n".join(f"  {label:<{width}}  {text}" for label, text in overview)
        )
    if note:
        run.accelerator.print(f"visiontune: {note}")
    # A class with no training image (in the data's own validation split only, one of a shuffle's draws, or
    # a class of one image) cannot be learnt: it scores 0. The run goes on (its other classes are worth
    # training); the user is told which, and what to do.
    unseen = np.flatnonzero(np.asarray(list(images.class_counts(split.train).values())) == 0)
    if len(unseen):
        named = ", ".join(repr(images.classes[c]) for c in unseen[:5]) + (", ..." if len(unseen) > 5 else "")
        in_val = int(val_counts[unseen].sum())
        scored = f", and scores 0 on their {in_val} validation image{'s' * (in_val != 1)}" if in_val else ""
        run.accelerator.print(
            f"visiontune: warning: {len(unseen)} of {len(images.classes)} classes have no training image "
            f"({named}), so the model cannot learn them{scored}; {_unseen_advice(run.cfg, images)}"
        )


def _rare_advice(cfg: TrainConfig, images: ImageSet, rarest: int) -> str:
    """What to do about a class with few validation images: what made them few decides."""
    if images.val_mask is not None:
        return "the data's own validation split holds few of it: add validation images of it there"
    total = images.class_counts()[images.classes[rarest]]
    if cfg.split_method == "random" and not cfg.group_by and total * cfg.val_fraction >= RARE_VAL_IMAGES:
        return (
            f"it has {total} images, but the random split drew few of them: --split-method stratified (the "
            "default) holds out --val-fraction of every class"
        )
    return f"it has {total} images: add images of it or raise --val-fraction"


def _unseen_advice(cfg: TrainConfig, images: ImageSet) -> str:
    if images.val_mask is not None:
        return "the data's own train split lacks them: add training images of them, or leave them out of validation"
    if cfg.split_method == "random" and not cfg.group_by and not cfg.folds:
        return "--split-method stratified (the default) keeps a training image of every class"
    return "give every class two or more images (with --group-by, two or more groups)"


def write_records(
    run: RunFacts, split_rec: dict, bad: list, info: runinfo.RunInfo, overview: list[tuple[str, str]] = ()
) -> None:
    """The run folder's records (main process), and the trackers, which write into it."""
    accelerator, cfg, images, run_dir = run.accelerator, run.cfg, run.images, run.run_dir
    record = {
        "config": cfg.to_dict(),
        "image_cache": run.image_cache,
        "setup": run.setup.__dict__,
        "overview": dict(overview),  # the resolved setup as announced, for the report
        "versions": host.versions(),
        # Absolute: evaluate recognises the run's own data by it from any working folder (hf: names and
        # URLs stay: a URL's shards are read from the cache, which is no name for them).
        # "source" is what discover was given, which evaluate lists again: a manifest's root is its images'
        # folder (DATA/train), a folder discover cannot read as a layout by itself.
        "data": {
            "root": sources.recorded(images.root),
            "layout": images.layout,
            "source": sources.recorded(cfg.data),
        },
        "model": info.to_dict(),
    }
    if accelerator.is_main_process:
        files.write_json(f"{run_dir}/config.json", record)
        files.write_json(f"{run_dir}/classes.json", images.classes)
        write_split(f"{run_dir}/split.json", split_rec, run.split, images.paths, images.root)
        write_report(bad, f"{run_dir}/bad_files.csv")
    if cfg.log_with:
        # Trackers write into the run folder, known only now that the main process chose it.
        accelerator.project_configuration.project_dir = run_dir
        accelerator.project_configuration.logging_dir = run_dir
        accelerator.init_trackers(
            "visiontune", config={k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool))}
        )


def finish(run: RunFacts, since: float, history: list[dict], stopped: dict | None = None) -> dict:
    """summary.json (the caller writes the report from it); ``stopped``: why the run ended before its epochs
    were done (--max-steps, or a reason the caller gave, such as a tuner pruning its trial)."""
    accelerator, run_dir, task = run.accelerator, run.run_dir, run.task
    elapsed = time.time() - since
    summary = {
        "run_dir": run_dir,
        "total_seconds": round(elapsed, 3),
        **results(history, run.cfg.best_metric, task),
        "task": task.name,
        "val_split_size": len(run.split.val),
        "train_split_size": len(run.split.train),
        "classes": run.images.classes,
        **run.setup.__dict__,
        "image_cache": run.image_cache,  # total_seconds depends on it: a cache built, read, or none
        **({"stopped": stopped} if stopped else {}),
    }
    if stopped and stopped["reason"] == "max-steps":
        accelerator.print(f"visiontune: stopped after {stopped['optimizer_steps']} optimizer steps (--max-steps)")
    accelerator.print(f"Training complete in {elapsed // 60:.0f}m {elapsed % 60:.0f}s")
    accelerator.print(f"Best val {task.score_name}: {summary[f'best_val_{task.score_key}']:4f}")
    for key, name in task.curves:
        if summary.get(f"best_val_{key}") is not None:  # None: no val image had a positive
            accelerator.print(f"Best val {name}: {summary[f'best_val_{key}']:4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files.write_json(f"{run_dir}/summary.json", summary)
    accelerator.end_training()
    return summary


PHASES = ("train", "val")


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the unwrapped model's tensors (no ``module.``/``_orig_mod.``); a ``--lora`` model's
    adapters merged into their layers, under the plain model's names."""
    if lora.has_adapters(model):
        return lora.merged_state_dict(model)
    return strategies.base.cpu_copies(model.state_dict())


def save_model(
    run_dir: str | os.PathLike,
    state: dict[str, torch.Tensor],
    stem: str = "best",
    metadata: dict[str, str] | None = None,
    pth: bool = False,
) -> None:
    """``<stem>.safetensors`` (carrying ``metadata``), and with ``pth`` the same tensors as ``<stem>.pth``
    (loads with weights_only=True)."""
    from safetensors.torch import save as st_save

    atomic_write(Path(run_dir) / f"{stem}.safetensors", st_save(state, metadata=metadata))
    if pth:  # opt-in: a second copy of every tensor (about 0.5 GB for VGG16)
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write(Path(run_dir) / f"{stem}.pth", buf.getvalue())


def write_metrics_csv(path: str | os.PathLike, history: list[dict], task: Task) -> None:
    """One row an epoch and phase; a column for each metric the ``task`` adds (empty in train rows)."""
    out = io.StringIO()
    w = csv.writer(out)
    extra = [key for key, _ in task.curves]
    w.writerow(["epoch", "phase", "loss", task.score_key, "images", "seconds", "images_per_s", *extra])
    for row in history:
        for phase in PHASES:
            r = row[phase]
            w.writerow(
                [
                    row["epoch"],
                    phase,
                    f"{r['loss']:.6f}",
                    f"{r['accuracy']:.6f}",
                    r["images"],
                    f"{r['seconds']:.3f}",
                    f"{r['images_per_s']:.2f}",
                    *("" if r.get(key) is None else f"{r[key]:.6f}" for key in extra),
                ]
            )
    atomic_write(path, out.getvalue())


def best_of(history: list[dict], metric: str = "accuracy") -> tuple[dict, str]:
    """The best (epoch row, "val" or "val_ema") by ``metric`` (accuracy, loss, or multi-label mAP); ties:
    the other of accuracy and loss, then earlier."""

    def key(item):
        r = item[0][item[1]]
        if metric in RANKED:  # a val set without any positive has no mAP (nor a constant one an R²): it ranks last
            m, sign = r.get(metric), RANKED[metric]
            return (-math.inf if m is None else sign * m), -r["loss"], -item[0]["epoch"], item[1] == "val"
        main = r["accuracy"] if metric == "accuracy" else -r["loss"]
        other = -r["loss"] if metric == "accuracy" else r["accuracy"]
        return main, other, -item[0]["epoch"], item[1] == "val"

    return max(((row, w) for row in history for w in ("val", "val_ema") if w in row), key=key)


class BackgroundWrites:
    """The end-of-epoch files (best model, history, metrics.csv, curves) written off the training path.

    One writer thread: a new job waits for the one before it, so two writes never run at once and
    files land in epoch order; ``wait`` re-raises what a job raised (a full disk is one line). The
    caller hands over a snapshot (CPU copies of the tensors, a copy of the history) taken while every
    process stands still, so the epoch's files are consistent whatever training does meanwhile.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._wait()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="visiontune-writes")
            self._last = self._pool.submit(job)

    def wait(self) -> None:
        """Block until the last job is on disk; raise its error, if any."""
        with self._lock:
            self._wait()

    def _wait(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
