"""What ``predict`` and ``evaluate`` share: a trained model loaded, and one forward pass over files.

A run folder loads without unpickling anything: ``best.safetensors`` (or a
``.pth`` read with ``weights_only=True``), ``config.json`` for the model name
and image size, ``classes.json`` for the class names. Images go through
training's own code -- ``read_image`` and ``resize_uint8`` in the loader,
``DeviceNormalize`` on the device -- and the forward pass is
``engine.evaluate``'s, so with N processes Accelerate shards the files and
``gather_for_metrics`` hands every output back exactly once, in input order.
An unreadable file keeps its slot (a blank image labelled ``UNREADABLE``) so
the sharding and the order stay the same.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from accelerate import Accelerator
from torch import nn

from visiontune import engine
from visiontune.config import TrainConfig, UserError, load_config_file
from visiontune.data.decode import BadImage, read_image
from visiontune.data.pipeline import UNREADABLE, DeviceNormalize, ImageDataset, make_loader
from visiontune.models import build_model
from visiontune.strategy import decode_threads, loader_workers, make_accelerator

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt")


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module  # eval mode, on the CPU
    name: str
    image_size: int
    classes: list[str]
    batch_size: int  # the run's per-process batch: the default for inference


@dataclass(frozen=True)
class InferenceConfig:
    """How the forward pass runs (``strategy.make_accelerator`` and the loader read these)."""
    batch_size: int  # per process
    mixed_precision: str = "no"
    progress: bool = True
    num_workers: int | None = None  # None: strategy.loader_workers' choice
    timeout: float = 600.0  # seconds any collective may wait
    # Never accumulated or logged: fixed, for make_accelerator.
    grad_accum: ClassVar[int] = 1
    log_with: ClassVar[None] = None


def _check_classes(classes, where: str) -> list[str]:
    if not (isinstance(classes, list) and len(classes) >= 2 and all(isinstance(c, str) and c for c in classes)):
        raise UserError(f"{where}: expected at least two class names, got {classes!r}")
    return classes


def load_run(run_dir: str) -> LoadedModel:
    """The run's best model, its name, image size and batch, and its class names."""
    run = Path(run_dir)
    for name in ("config.json", "classes.json"):
        if not (run / name).is_file():
            raise UserError(f"{run_dir} is not a visiontune run folder ({name} is missing)")
    cfg = TrainConfig(**load_config_file(str(run / "config.json")))
    try:
        classes = json.loads((run / "classes.json").read_text())
    except ValueError as e:
        raise UserError(f"cannot parse {run / 'classes.json'}: {e}") from None
    _check_classes(classes, str(run / "classes.json"))
    weights = next((run / f"best{s}" for s in (".safetensors", ".pth") if (run / f"best{s}").is_file()), None)
    if weights is None:
        raise UserError(f"{run_dir} has no best.safetensors or best.pth: did its training finish an epoch?")
    model = build_model(cfg.model, len(classes), str(weights)).eval()
    return LoadedModel(model, cfg.model, cfg.image_size, classes, cfg.batch_size)


def load_weights(weights: str, model: str, classes: list[str], image_size: int) -> LoadedModel:
    """``--weights FILE --model NAME --classes a,b``: a state_dict saved outside a run folder."""
    if Path(weights).suffix not in WEIGHT_SUFFIXES:
        raise UserError(f"--weights must be a {'/'.join(WEIGHT_SUFFIXES)} file, got {weights!r}")
    _check_classes(classes, "--classes")
    if image_size < 1:
        raise UserError(f"--image-size must be a positive integer, got {image_size}")
    return LoadedModel(build_model(model, len(classes), weights).eval(), model, image_size, classes,
                       TrainConfig.batch_size)


def start(icfg: InferenceConfig) -> Accelerator:
    """The process's one Accelerator (mixed precision, the process group under a launcher)."""
    return make_accelerator(icfg)


def forward(accelerator: Accelerator, loaded: LoadedModel, icfg: InferenceConfig, paths: list[str],
            labels: list[int], desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels (``UNREADABLE`` for files that failed) of every path, in order, on every process."""
    dataset = ImageDataset(paths, labels, loaded.image_size, report=False,  # reported once, by the caller
                           threads=decode_threads(icfg))
    loader = make_loader(dataset, icfg.batch_size, train=False, seed=0, num_workers=loader_workers(icfg),
                         pin_memory=torch.cuda.is_available())
    # evaluation_mode: device placement and mixed precision, no DDP wrapper (nothing to synchronise).
    model = accelerator.prepare_model(loaded.model, evaluation_mode=True)
    loader = accelerator.prepare_data_loader(loader)
    kept: list = []
    engine.evaluate(accelerator, model, loader, DeviceNormalize(accelerator.device), progress=icfg.progress,
                    desc=desc, keep=kept)
    return torch.cat([lg for lg, _ in kept]).cpu(), torch.cat([lb for _, lb in kept]).cpu()


def unreadable_reasons(paths: list[str], labels: torch.Tensor) -> list[tuple[str, str]]:
    """(path, reason) for each file that came back ``UNREADABLE``, printed on stderr."""
    skipped = []
    for i in (labels == UNREADABLE).nonzero().flatten().tolist():
        try:
            read_image(paths[i])
            reason = "unreadable while predicting"  # it failed in the loader, not now
        except BadImage as e:
            reason = str(e)
        print(f"visiontune: skipped unreadable image {paths[i]}: {reason}", file=sys.stderr)
        skipped.append((paths[i], reason))
    return skipped
