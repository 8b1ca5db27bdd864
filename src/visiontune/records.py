"""The run folder's records and the run's opening and closing lines: ``config.json``,
``classes.json``, ``split.json``, ``bad_files.csv`` and the trackers at the start, the summary's
figures (best epoch, steady-state throughput) and ``summary.json`` with the report at the end.
Only the main process writes files; ``summary.json`` after every process has arrived.
"""

from __future__ import annotations

import os
import time

import numpy as np

from visiontune import outputs, recipe, runinfo
from visiontune.config import TrainConfig
from visiontune.data.check import write_report
from visiontune.data.layouts import ImageSet
from visiontune.data.split import Split, write_split


def results(history: list[dict], metric: str) -> dict:
    """The summary's figures: the best epoch, and train images/s over the steady steps of every epoch."""
    best, which = recipe.best(history, metric)
    steady = {k: sum(r["train"][k] for r in history) for k in ("steady_images", "steady_seconds", "data_wait_seconds")}
    if not steady["steady_images"]:  # epochs shorter than the timing warm-up: use everything
        steady = {
            "steady_images": sum(r["train"]["images"] for r in history),
            "steady_seconds": sum(r["train"]["seconds"] for r in history),
            "data_wait_seconds": 0.0,
        }
    seconds = steady["steady_seconds"]
    return {
        "best_val_accuracy": best[which]["accuracy"],
        "best_val_loss": best[which]["loss"],
        "best_epoch": best["epoch"],
        "best_weights": "ema" if which == "val_ema" else "raw",
        "epochs": len(history),
        "train_images_per_s": steady["steady_images"] / seconds if seconds else 0.0,
        "data_wait_fraction": steady["data_wait_seconds"] / seconds if seconds else 0.0,
        **steady,
        "val_images_counted": history[-1]["val"]["images"],
    }


def announce(accelerator, cfg: TrainConfig, setup, images: ImageSet, split: Split, run_dir: str) -> None:
    """The run's opening line: strategy, devices, split sizes, batch, lr and run folder."""
    accelerator.print(
        f"visiontune: {setup.strategy} on {', '.join(sorted(set(setup.devices)))} x{setup.world_size} | "
        f"{len(split.train)} train / {len(split.val)} val images, {len(images.classes)} classes | "
        f"batch {setup.per_process_batch} per process, global batch {setup.global_batch}, "
        f"lr {setup.lr:g} | run folder {run_dir}"
    )
    # The split is not stratified: a class of one or two images can land wholly in val, and the model
    # then never sees it. The run goes on (its other classes are worth training); the user is told.
    unseen = np.flatnonzero(np.bincount(images.labels[split.train], minlength=len(images.classes)) == 0)
    if len(unseen):
        accelerator.print(
            f"visiontune: warning: {len(unseen)} of {len(images.classes)} classes have no training image "
            f"(e.g. {images.classes[unseen[0]]!r}), so the model cannot learn them; give every class "
            "several images"
        )


def write_records(
    accelerator,
    cfg: TrainConfig,
    setup,
    images: ImageSet,
    split: Split,
    split_rec: dict,
    bad: list,
    run_dir: str,
    info: runinfo.RunInfo,
) -> None:
    """The run folder's records (main process), and the trackers, which write into it."""
    record = {
        "config": cfg.to_dict(),
        "setup": setup.__dict__,
        "versions": outputs.versions(),
        # Absolute: evaluate recognises the run's own data by it from any working folder.
        "data": {"root": os.path.abspath(images.root), "layout": images.layout},
        "model": info.to_dict(),
    }
    if accelerator.is_main_process:
        outputs.write_json(f"{run_dir}/config.json", record)
        outputs.write_json(f"{run_dir}/classes.json", images.classes)
        write_split(f"{run_dir}/split.json", split_rec, split, images.paths, images.root)
        write_report(bad, f"{run_dir}/bad_files.csv")
    if cfg.log_with:
        # Trackers write into the run folder, known only now that the main process chose it.
        accelerator.project_configuration.project_dir = run_dir
        accelerator.project_configuration.logging_dir = run_dir
        accelerator.init_trackers(
            "visiontune", config={k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool))}
        )


def finish(
    accelerator, run_dir: str, since: float, history: list[dict], split: Split, images: ImageSet, setup, metric: str
) -> dict:
    elapsed = time.time() - since
    summary = {
        "run_dir": run_dir,
        "total_seconds": round(elapsed, 3),
        **results(history, metric),
        "val_split_size": len(split.val),
        "train_split_size": len(split.train),
        "classes": images.classes,
        **setup.__dict__,
    }
    accelerator.print(f"Training complete in {elapsed // 60:.0f}m {elapsed % 60:.0f}s")
    accelerator.print(f"Best val Acc: {summary['best_val_accuracy']:4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        outputs.write_json(f"{run_dir}/summary.json", summary)
        from visiontune import report

        print(f"visiontune: outputs in {run_dir}; report {report.write(run_dir)}")
    accelerator.end_training()
    return summary
