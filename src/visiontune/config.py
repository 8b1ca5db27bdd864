"""Run configuration: one frozen dataclass, its defaults and its validation.

Everything below the CLI takes a ``TrainConfig``; nothing mutates it after it
is built. Defaults follow the reference job (VGG16, SGD lr 1e-3 momentum 0.9,
batch 50 per process, 2 epochs, 80/20 split with seed 42). ``UserError`` is the
one exception type that means "the user asked for something wrong": the CLI
prints its message on one line and exits with code 2.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# The blog's normalisation statistics, measured on Dogs vs Cats.
MEAN = (0.4883, 0.4551, 0.4170)
STD = (0.2257, 0.2211, 0.2214)


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


class RunStopped(Exception):
    """The run stopped on purpose (a signal, a non-finite loss): one line, then ``exit_code``."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class TrainConfig:
    data: str = ""
    output_dir: str | None = None
    # model
    model: str = "vgg16"
    weights: str = "DEFAULT"
    freeze_backbone: bool = False
    # data
    image_size: int = 224
    augment: bool = False
    val_fraction: float = 0.2
    seed: int = 42
    num_workers: int | None = None  # None: sized from the cores per process
    cache: str | None = None
    max_bad_fraction: float = 0.01
    # optimisation
    epochs: int = 2
    batch_size: int = 50  # per process, as in the blog
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "none"
    grad_accum: int = 1
    scale_lr: bool = False
    reference_batch: int = 50
    mixed_precision: str = "no"
    channels_last: bool = False
    compile: bool = False
    sync_batchnorm: bool = False
    on_nan: str = "stop"
    # distribution
    strategy: str = "single"
    nproc: int | None = None  # None: number of GPUs, or 2 on a CPU-only machine
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    timeout: float = 600.0
    # checkpoints and logging
    save_every_steps: int = 0
    keep_last: int = 2
    resume: str | None = None
    log_with: str | None = None
    progress: bool = True
    timing_warmup: int = 5  # first steps of each epoch left out of the steady-state throughput

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CHOICES = {
    "lr_schedule": ("none", "cosine"),
    "mixed_precision": ("no", "fp16", "bf16"),
    "strategy": ("single", "dp", "ddp"),
    "on_nan": ("stop", "skip"),
}
POSITIVE = ("epochs", "batch_size", "image_size", "grad_accum", "reference_batch", "nnodes", "keep_last")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Return ``cfg`` unchanged if it is usable, else raise ``UserError``."""
    if not cfg.data:
        raise UserError("no data folder given: pass --data DIR (try `visiontune sample-data DIR`)")
    for name in POSITIVE:
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise UserError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                            f"got {getattr(cfg, name)!r}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1, got {cfg.val_fraction}")
    if cfg.lr <= 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}")
    if cfg.nproc is not None and cfg.nproc < 1:
        raise UserError(f"--nproc must be a positive integer, got {cfg.nproc}")
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise UserError(f"--num-workers must be 'auto' or >= 0, got {cfg.num_workers}")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise UserError(f"--node-rank must be in [0, {cfg.nnodes - 1}], got {cfg.node_rank}")
    if cfg.timing_warmup < 0:
        raise UserError(f"--timing-warmup must be >= 0, got {cfg.timing_warmup}")
    if cfg.save_every_steps < 0 or cfg.max_restarts < 0:
        raise UserError("--save-every-steps and --max-restarts must be >= 0")
    if not 0.0 <= cfg.max_bad_fraction <= 1.0:
        raise UserError(f"--max-bad-fraction must be between 0 and 1, got {cfg.max_bad_fraction}")
    return cfg


def load_config_file(path: str) -> dict[str, Any]:
    """Read settings from a TOML file or an earlier run's ``config.json``."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text())
            raw = raw.get("config", raw)  # a run's config.json nests the settings
        else:
            raw = tomllib.loads(p.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot parse config file {path}: {e}") from None
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"unknown setting(s) in {path}: {', '.join(unknown)}")
    return raw
