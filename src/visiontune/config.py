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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def __getattr__(name: str) -> Any:
    # Moved: RunStopped next to the signals (faults), MEAN/STD to the data pipeline. Old imports work.
    if name == "RunStopped":
        from visiontune.faults import RunStopped
        return RunStopped
    if name in ("MEAN", "STD"):
        from visiontune.data import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _setting(default: Any, help_text: str) -> Any:
    # The CLI makes each field the flag --field-name with this help (and the default appended).
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TrainConfig:
    data: str = _setting("", "data folder (Kaggle layout, train.csv manifest, or class subfolders)")
    output_dir: str | None = _setting(None, "run folder (default runs/<UTC timestamp>)")
    # model
    model: str = _setting("vgg16", "torchvision name, timm/NAME or hf-hub:ORG/NAME; see `visiontune models`")
    weights: str = _setting("DEFAULT", "DEFAULT (pretrained), none, a torchvision weights name, or a "
                                       ".pth/.safetensors path (a head of another shape is re-initialised)")
    init_from: str | None = _setting(None, "start from an earlier run's best model (its --model and "
                                           "--image-size unless given; a new head when the classes differ)")
    freeze_backbone: bool = _setting(False, "train only the new head")
    # data
    image_size: int | None = _setting(None, "square input size in pixels (default: the model's pretrained size)")
    augment: bool = _setting(False, "random-resized-crop and horizontal flip for training")
    val_fraction: float = _setting(0.2, "share of images held out for validation")
    seed: int = _setting(42, "seed of the split, the sampler and the head's init")
    num_workers: int | None = _setting(None, "loader worker processes per process, or auto (default: "
                                             "cores - 1 with a GPU, none on a CPU, where threads decode)")
    cache: str | None = _setting(None, "decode once into a memory-mapped uint8 cache: a folder or auto")
    max_bad_fraction: float = _setting(0.01, "stop before training when more files than this are bad")
    # optimisation
    epochs: int = _setting(2, "epochs")
    batch_size: int = _setting(50, "batch size PER PROCESS, as in the reference job")
    lr: float = _setting(1e-3, "learning rate")
    momentum: float = _setting(0.9, "SGD momentum")
    weight_decay: float = _setting(0.0, "SGD weight decay")
    lr_schedule: Literal["none", "cosine"] = _setting("none", "none or cosine, stepped per optimizer step")
    grad_accum: int = _setting(1, "gradient accumulation steps")
    scale_lr: bool = _setting(False, "scale lr by global batch / --reference-batch")
    reference_batch: int = _setting(50, "the batch --lr was tuned for")
    mixed_precision: Literal["no", "fp16", "bf16"] = _setting("no", "no, fp16 or bf16")
    channels_last: bool = _setting(False, "channels-last memory format")
    compile: bool = _setting(False, "torch.compile the model")
    sync_batchnorm: bool = _setting(False, "synchronise BatchNorm statistics across processes")
    on_nan: Literal["stop", "skip"] = _setting("stop", "stop or skip when the loss is not finite")
    # distribution
    strategy: Literal["single", "dp", "ddp"] = _setting("single", "single, dp (nn.DataParallel) or ddp")
    nproc: int | None = _setting(None, "processes per machine for ddp (default: GPUs, or 2 on a CPU)")
    nnodes: int = _setting(1, "machines in a ddp job")
    node_rank: int = _setting(0, "this machine's rank in a ddp job")
    master_addr: str = _setting("127.0.0.1", "address of the rank-0 machine")
    master_port: int = _setting(29500, "port of the rank-0 machine")
    max_restarts: int = _setting(0, "restart the workers this often when one dies")
    timeout: float = _setting(600.0, "seconds any collective may wait")
    # checkpoints and logging
    save_every_steps: int = _setting(0, "also checkpoint every N optimizer steps (0: at epoch ends only)")
    keep_last: int = _setting(2, "checkpoints to keep")
    save_pth: bool = _setting(False, "also write best.pth beside best.safetensors (the same tensors)")
    resume: str | None = _setting(None, "a run folder to continue, or auto")
    log_with: str | None = _setting(None, "an Accelerate tracker: tensorboard, wandb, mlflow, ...")
    progress: bool = _setting(True, "progress bars")
    timing_warmup: int = _setting(5, "steps per epoch left out of the steady-state images/s")

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def choices(cls: type = TrainConfig) -> dict[str, tuple[str, ...]]:
    """The allowed values of each ``Literal[...]`` field (argparse ``choices`` and ``validate`` use them)."""
    return {name: get_args(hint) for name, hint in get_type_hints(cls).items()
            if getattr(hint, "__origin__", None) is Literal}


POSITIVE = ("epochs", "batch_size", "image_size", "grad_accum", "reference_batch", "nnodes", "keep_last")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Return ``cfg`` unchanged if it is usable, else raise ``UserError``."""
    if not cfg.data:
        raise UserError("no data folder given: pass --data DIR (try `visiontune sample-data DIR`)")
    for name in POSITIVE:
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    for name, allowed in choices().items():
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
    if cfg.init_from and cfg.weights != "DEFAULT":
        raise UserError(f"give --weights {cfg.weights} or --init-from {cfg.init_from}, not both")
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
