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
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

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
    weights: str = _setting(
        "DEFAULT",
        "DEFAULT (pretrained), none, a torchvision weights name, or a "
        ".pth/.safetensors path (a head of another shape is re-initialised)",
    )
    init_from: str | None = _setting(
        None,
        "start from an earlier run's best model (its --model, --interpolation and "
        "--image-size unless given; a new head when the classes differ)",
    )
    freeze_backbone: bool = _setting(False, "train only the new head")
    # data
    image_size: int | None = _setting(None, "square input size in pixels (default: the model's pretrained size)")
    interpolation: Literal["bilinear", "bicubic", "nearest", "nearest-exact"] | None = _setting(
        None, "resize interpolation of every image (default: the model's pretrained config; recorded)"
    )
    augment: Literal["none", "flip-crop", "light", "trivial", "randaugment"] | None = _setting(
        None, "none, flip-crop (also plain --augment), light, trivial or randaugment (default: the recipe's)"
    )
    random_erasing: float | None = _setting(None, "probability of erasing a random box of each training image")
    mixup: float | None = _setting(None, "mixup alpha (0: off); soft labels, see README")
    cutmix: float | None = _setting(None, "cutmix alpha (0: off); with --mixup each pair uses one of them")
    normalize: Literal["weights", "data", "blog"] | None = _setting(
        None, "weights (the pretrained weights' mean/std), data (the train split's) or blog (the reference constants)"
    )
    mean: str | None = _setting(None, "per-channel mean R,G,B in [0, 1] (default: from --normalize; recorded)")
    std: str | None = _setting(None, "per-channel std R,G,B (default: from --normalize; recorded)")
    val_fraction: float = _setting(0.2, "share of images held out for validation")
    seed: int = _setting(42, "seed of the split, the sampler and the head's init")
    num_workers: int | None = _setting(
        None,
        "loader worker processes per process, or auto (default: "
        "cores - 1 with a GPU, none on a CPU, where threads decode)",
    )
    cache: str | None = _setting(None, "decode once into a memory-mapped uint8 cache: a folder or auto")
    max_bad_fraction: float = _setting(0.01, "stop before training when more files than this are bad")
    # optimisation (settings left None come from --recipe; see recipe.py)
    recipe: Literal["blog", "modern"] = _setting(
        "blog",
        "blog (the reference job, unchanged) or modern (AdamW, "
        "warm-up + cosine, label smoothing, TrivialAugment, EMA); flags win",
    )
    epochs: int = _setting(2, "epochs")
    batch_size: int = _setting(50, "batch size PER PROCESS, as in the reference job")
    optimizer: Literal["sgd", "adamw"] | None = _setting(
        None, "sgd or adamw (AdamW: no weight decay on norms and biases)"
    )
    lr: float | None = _setting(None, "learning rate")
    momentum: float = _setting(0.9, "SGD momentum")
    weight_decay: float | None = _setting(None, "weight decay")
    lr_schedule: Literal["none", "cosine", "linear", "step"] | None = _setting(
        None, "none, cosine, linear or step, stepped per optimizer step"
    )
    warmup_epochs: float | None = _setting(None, "linear lr warm-up, in epochs (fractions allowed)")
    warmup_steps: int = _setting(0, "linear lr warm-up in optimizer steps (wins over --warmup-epochs)")
    label_smoothing: float | None = _setting(None, "label smoothing of the training loss")
    ema: float | None = _setting(None, "decay of an EMA of the weights, evaluated each epoch (0: off)")
    freeze_epochs: int = _setting(0, "train only the head for this many epochs, then everything")
    backbone_lr_mult: float = _setting(1.0, "lr multiplier for everything but the head")
    early_stop: int = _setting(0, "stop after this many epochs without a better --best-metric (0: off)")
    best_metric: Literal["accuracy", "loss"] = _setting(
        "accuracy", "accuracy or loss: what picks the best epoch (and EMA or raw weights)"
    )
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
    # The four below default to what a Slurm allocation or a Kubernetes job says, else 1, 0, 127.0.0.1, 29500.
    nnodes: str | None = _setting(None, "machines in a ddp job: N, or MIN:MAX with --rdzv-endpoint")
    node_rank: int | None = _setting(None, "this machine's rank in a ddp job")
    master_addr: str | None = _setting(None, "address of the rank-0 machine")
    master_port: int | None = _setting(None, "port of the rank-0 machine")
    rdzv_endpoint: str | None = _setting(None, "HOST:PORT of a c10d rendezvous (elastic) instead of a fixed master")
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

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def choices(cls: type = TrainConfig) -> dict[str, tuple[str, ...]]:
    """The allowed values of each ``Literal[...]`` field, optional ones too (argparse ``choices`` and
    ``validate`` use them; an optional one is None only until its recipe fills it in)."""
    found = {}
    for name, hint in get_type_hints(cls).items():
        options = [hint, *get_args(hint)] if getattr(hint, "__origin__", None) is not Literal else [hint]
        literal = next((h for h in options if getattr(h, "__origin__", None) is Literal), None)
        if literal is not None:
            found[name] = get_args(literal)
    return found


# (low, high, high included): ranges of the recipe's numbers.
RANGES = {
    "weight_decay": (0, math.inf, False),
    "warmup_epochs": (0, math.inf, False),
    "warmup_steps": (0, math.inf, False),
    "label_smoothing": (0, 1, False),
    "random_erasing": (0, 1, True),
    "mixup": (0, math.inf, False),
    "cutmix": (0, math.inf, False),
    "ema": (0, 1, False),
    "freeze_epochs": (0, math.inf, False),
    "early_stop": (0, math.inf, False),
}


FROM_MODEL = ("interpolation",)  # None: the model's pretrained config's, known once the model is
POSITIVE = ("epochs", "batch_size", "image_size", "grad_accum", "reference_batch", "keep_last")


def _fits(value: Any, kind: Any) -> bool:
    """Whether ``value`` has the annotated type (``bool`` is no integer here, an int is a float)."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is Literal:  # of the choices' type here; which choice, ``validate`` says with the flag's name
        return any(type(value) is type(a) for a in args)
    if args:  # X | None
        return any(_fits(value, k) for k in args)
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def check_types(values: dict[str, Any], where: str) -> None:
    """Refuse, in one line, a setting whose value does not have its field's type ("no" is not a bool)."""
    hints = get_type_hints(TrainConfig)
    for name, value in values.items():
        if name in hints and not _fits(value, hints[name]):
            kind = str(hints[name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise UserError(f"{where}: {name} = {value!r} is not of type {kind}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its recipe's settings filled in, if it is usable; else raise ``UserError``."""
    from visiontune.recipe import resolve  # the presets live there, with the rest of the recipe

    if isinstance(cfg.augment, bool):  # `augment = true` from before the named augmentations: flip-crop
        cfg = cfg.replace(augment="flip-crop" if cfg.augment else "none")
    check_types(cfg.to_dict(), "settings")
    if cfg.recipe not in choices()["recipe"]:
        raise UserError(f"--recipe must be one of {', '.join(choices()['recipe'])}, got {cfg.recipe!r}")
    cfg = resolve(cfg)
    for name, (low, high, closed) in RANGES.items():
        v = getattr(cfg, name)
        if not (low <= v <= high if closed else low <= v < high):
            raise UserError(f"--{name.replace('_', '-')} must be in [{low}, {high}{']' if closed else ')'}, got {v}")
    if cfg.backbone_lr_mult <= 0:
        raise UserError(f"--backbone-lr-mult must be positive, got {cfg.backbone_lr_mult}")
    if not cfg.data:
        raise UserError("no data folder given: pass --data DIR (try `visiontune sample-data DIR`)")
    for name in POSITIVE:
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    for name, allowed in choices().items():
        if getattr(cfg, name) not in allowed and not (name in FROM_MODEL and getattr(cfg, name) is None):
            raise UserError(
                f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
            )
    if not 0.0 < cfg.val_fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1, got {cfg.val_fraction}")
    if cfg.lr <= 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}")
    if cfg.nproc is not None and cfg.nproc < 1:
        raise UserError(f"--nproc must be a positive integer, got {cfg.nproc}")
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise UserError(f"--num-workers must be 'auto' or >= 0, got {cfg.num_workers}")
    if cfg.timing_warmup < 0:
        raise UserError(f"--timing-warmup must be >= 0, got {cfg.timing_warmup}")
    if cfg.save_every_steps < 0 or cfg.max_restarts < 0:
        raise UserError("--save-every-steps and --max-restarts must be >= 0")
    if cfg.init_from and cfg.weights != "DEFAULT":
        raise UserError(f"give --weights {cfg.weights} or --init-from {cfg.init_from}, not both")
    if not 0.0 <= cfg.max_bad_fraction <= 1.0:
        raise UserError(f"--max-bad-fraction must be between 0 and 1, got {cfg.max_bad_fraction}")
    if cfg.momentum < 0 or cfg.weight_decay < 0:
        raise UserError(f"--momentum and --weight-decay must be >= 0, got {cfg.momentum} and {cfg.weight_decay}")
    if cfg.timeout <= 0:
        raise UserError(f"--timeout must be a positive number of seconds, got {cfg.timeout}")
    return cfg


def load_config_file(path: str) -> dict[str, Any]:
    """Read settings from a TOML file or an earlier run's ``config.json``."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text())
            raw = raw.get("config", raw) if isinstance(raw, dict) else raw  # a run's config.json nests them
        else:
            raw = tomllib.loads(p.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot parse config file {path}: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a {type(raw).__name__}, not a table of settings")
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"unknown setting(s) in {path}: {', '.join(unknown)}")
    check_types(raw, path)
    return raw
