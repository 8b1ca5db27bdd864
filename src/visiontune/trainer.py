"""``train(config) -> summary``: one run, from data folder to run folder.

This is the Python API (``visiontune.train``) and what ``visiontune train``
runs in every process. It wires the pieces in order -- Accelerator, data and
split, model, loaders, ``engine.fit``, outputs -- and keeps every collective
outside rank checks: all processes call ``wait_for_everyone`` before the main
process writes.
"""
from __future__ import annotations

import platform
import time

import accelerate
import torch
import torchvision
from accelerate.utils import broadcast_object_list

from visiontune import engine, outputs
from visiontune.config import TrainConfig, UserError, validate
from visiontune.data.cache import CachedDataset, open_or_build
from visiontune.data.layouts import ImageSet, discover
from visiontune.data.pipeline import DeviceNormalize, ImageDataset, make_loader
from visiontune.data.split import Split, make_split, split_record
from visiontune.launch import default_output_dir
from visiontune.models import build_model
from visiontune.strategy import describe, loader_workers, make_accelerator, prepare


def versions() -> dict[str, str]:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "accelerate": accelerate.__version__}


def _run_dir(accelerator, cfg: TrainConfig) -> str:
    # The main process picks the folder (a timestamp) and every process uses it.
    choice = [cfg.output_dir or default_output_dir()]
    broadcast_object_list(choice) if accelerator.num_processes > 1 else None
    return choice[0]


def _optimizer_and_schedule(model, cfg: TrainConfig, lr: float, steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps)) if cfg.lr_schedule == "cosine" \
        else None
    return opt, sched


def _datasets(cfg: TrainConfig, images: ImageSet, split: Split, accelerator):
    if cfg.cache:
        # One process per machine builds the cache while the others wait, then all map the same file.
        with accelerator.local_main_process_first():
            cache = open_or_build(cfg.cache, images.paths, cfg.image_size)

        def subset(idx, augment):
            return CachedDataset(cache, idx, [images.labels[i] for i in idx], augment)
    else:
        def subset(idx, augment):
            return ImageDataset([images.paths[i] for i in idx], [images.labels[i] for i in idx], cfg.image_size,
                                augment)
    return subset(split.train, cfg.augment), subset(split.val, False)


def train(cfg: TrainConfig) -> dict:
    """Fine-tune ``cfg.model`` on ``cfg.data``; return the run's summary."""
    validate(cfg)
    since = time.time()
    accelerator = make_accelerator(cfg)
    setup = describe(cfg, accelerator)
    images = discover(cfg.data)
    split = make_split(len(images), cfg.val_fraction, cfg.seed)
    if len(split.train) < setup.per_process_batch * setup.world_size:
        raise UserError(f"the train split has {len(split.train)} images, fewer than one global batch of "
                        f"{setup.per_process_batch * setup.world_size}; lower --batch-size or add images")
    with accelerator.main_process_first():  # a weights download happens once
        model = build_model(cfg.model, len(images.classes), cfg.weights, cfg.freeze_backbone)
    run_dir = _run_dir(accelerator, cfg)
    train_ds, val_ds = _datasets(cfg, images, split, accelerator)
    workers, pin = loader_workers(cfg), torch.cuda.is_available()
    train_loader = make_loader(train_ds, cfg.batch_size, train=True, seed=cfg.seed, num_workers=workers,
                               pin_memory=pin)
    val_loader = make_loader(val_ds, cfg.batch_size, train=False, seed=cfg.seed, num_workers=workers,
                             pin_memory=pin)
    steps = cfg.epochs * (len(train_loader) // (setup.world_size * cfg.grad_accum))
    optimizer, scheduler = _optimizer_and_schedule(model, cfg, setup.lr, steps)
    model, optimizer, (train_loader, val_loader) = prepare(accelerator, cfg, model, optimizer,
                                                          train_loader, val_loader)
    accelerator.print(f"visiontune: {setup.strategy} on {', '.join(setup.devices)} x{setup.world_size} | "
                      f"{len(split.train)} train / {len(split.val)} val images, {len(images.classes)} classes | "
                      f"batch {setup.per_process_batch} per process, global batch {setup.global_batch}, "
                      f"lr {setup.lr:g} | run folder {run_dir}")
    record = {"config": cfg.to_dict(), "setup": setup.__dict__, "versions": versions(),
              "data": {"root": images.root, "layout": images.layout}}
    if accelerator.is_main_process:
        outputs.write_json(f"{run_dir}/config.json", record)
        outputs.write_json(f"{run_dir}/classes.json", images.classes)
        outputs.write_json(f"{run_dir}/split.json",
                           split_record(split, images.paths, images.root, cfg.seed, cfg.val_fraction))
    if cfg.log_with:
        accelerator.init_trackers("visiontune", config={k: v for k, v in cfg.to_dict().items()
                                                        if isinstance(v, (int, float, str, bool))})
    history: list[dict] = []

    def on_epoch_end(epoch: int, tr: engine.PhaseResult, va: engine.PhaseResult) -> None:
        history.append({"epoch": epoch, "train": tr.as_dict(), "val": va.as_dict()})
        accelerator.log({f"{p}/{k}": v for p, r in (("train", tr), ("val", va))
                         for k, v in r.as_dict().items()}, step=epoch)
        is_best = outputs.best_epoch(history)["epoch"] == epoch
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if is_best:
                unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
                outputs.save_model(run_dir, outputs.plain_state_dict(unwrapped))
            outputs.write_json(f"{run_dir}/history.json", history)
            outputs.write_metrics_csv(f"{run_dir}/metrics.csv", history)
            outputs.plot_history(f"{run_dir}/training_results.png", history)

    engine.fit(accelerator, model, train_loader, val_loader, optimizer, scheduler,
               DeviceNormalize(accelerator.device, cfg.channels_last), epochs=cfg.epochs,
               on_nan=cfg.on_nan, progress=cfg.progress, on_epoch_end=on_epoch_end)
    elapsed = time.time() - since
    best = outputs.best_epoch(history)
    train_images = sum(r["train"]["images"] for r in history)
    train_seconds = sum(r["train"]["seconds"] for r in history)
    summary = {
        "run_dir": run_dir, "total_seconds": round(elapsed, 3),
        "best_val_accuracy": best["val"]["accuracy"], "best_val_loss": best["val"]["loss"],
        "best_epoch": best["epoch"], "epochs": len(history),
        "train_images_per_s": train_images / train_seconds if train_seconds else 0.0,
        "val_images_counted": history[-1]["val"]["images"], "val_split_size": len(split.val),
        "train_split_size": len(split.train), "classes": images.classes, **setup.__dict__,
    }
    accelerator.print(f"Training complete in {elapsed // 60:.0f}m {elapsed % 60:.0f}s")
    accelerator.print(f"Best val Acc: {best['val']['accuracy']:4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        outputs.write_json(f"{run_dir}/summary.json", summary)
        print(f"visiontune: outputs in {run_dir}")
    accelerator.end_training()
    return summary
