"""Checking settings: ``validate`` fills in the recipe's settings and refuses, in one line naming
the flag, any value out of its range or choices; ``load_config_file`` reads a TOML file or an
earlier run's ``config.json``, refusing unknown settings and values of the wrong type ("no" is not
a bool).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from visiontune.errors import UserError
from visiontune.settings.config import SEEDS, TrainConfig, choices

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# (low, high, high included): ranges of the recipe's numbers.
RANGES = {
    "weight_decay": (0, math.inf, False),
    "warmup_epochs": (0, math.inf, False),
    "warmup_steps": (0, math.inf, False),
    "label_smoothing": (0, 1, False),
    "random_erasing": (0, 1, True),
    "hflip": (0, 1, True),
    "vflip": (0, 1, True),
    "mixup": (0, math.inf, False),
    "cutmix": (0, math.inf, False),
    "ema": (0, 1, False),
    "freeze_epochs": (0, math.inf, False),
    "early_stop": (0, math.inf, False),
}


# (low, high) of the integers (and the timeout) that reach torch, a C library, a timedelta or an
# allocation: past these, a mistyped 99999999999999999999 fails there with an OverflowError or a C++
# stack, or trains for ever. The highs are far above any real run's.
LIMITS = {
    "image_size": (1, 8192),
    "batch_size": (1, 2**20),
    "epochs": (1, 10**6),
    "grad_accum": (1, 2**16),
    "reference_batch": (1, 2**30),
    "keep_last": (1, 10**4),
    "num_workers": (0, 1024),
    "threads": (1, 4096),
    "nproc": (1, 4096),
    "node_rank": (0, 2**16),
    "master_port": (1, 65535),
    "max_restarts": (0, 10**4),
    "save_every_steps": (0, 2**31 - 1),
    "warmup_steps": (0, 2**31 - 1),
    "timing_warmup": (0, 2**31 - 1),
    "freeze_epochs": (0, 10**6),
    "early_stop": (0, 10**6),
    "folds": (0, 10**6),
    "warmup_epochs": (0, 10**6),
    "timeout": (0, 365 * 86400),
    "lora": (0, 65536),
}


# None: the model's pretrained config's, known once the model is; or, for --loss, the task's own
FROM_MODEL = ("interpolation", "loss")
MAX_CONFIG_BYTES = 64 << 20  # a --config file: settings, or a run's config.json (as runs.runrecords bounds it)
POSITIVE = ("epochs", "batch_size", "image_size", "grad_accum", "reference_batch", "keep_last")


def _fits(value: Any, kind: Any) -> bool:
    """Whether ``value`` has the annotated type (``bool`` is no integer here, an int is a float)."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is Literal:  # of the choices' type here; which choice, ``validate`` says with the flag's name
        return any(type(value) is type(a) for a in args)
    if origin is tuple:  # a fixed-length tuple (a list in JSON and TOML)
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(map(_fits, value, args))
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
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."  # a file's value: any size
            raise UserError(f"{where}: {name} = {shown} is not of type {kind}")


def validate(cfg: TrainConfig, tasks: Callable[[str], Any] | None = None) -> TrainConfig:
    """``cfg`` with its recipe's settings filled in, if it is usable; else raise ``UserError``. ``tasks``
    (``visiontune.tasks.get``, which this wing cannot import) finds the task ``--task`` names, so that the
    recipe asks it which of its settings apply (auto: the data tells the task later)."""
    from visiontune.settings.presets import resolve  # the presets live there, with the rest of the recipe

    if isinstance(cfg.augment, bool):  # `augment = true` from before the named augmentations: flip-crop
        cfg = cfg.replace(augment="flip-crop" if cfg.augment else "none")
    check_types(cfg.to_dict(), "settings")
    if cfg.multi_label:  # the synonym of --task multilabel, folded into the one setting the run reads
        if cfg.task not in ("auto", "multilabel"):
            raise UserError(f"--multi-label contradicts --task {cfg.task}: drop one of them")
        cfg = cfg.replace(task="multilabel", multi_label=False)
    for name, kind in get_type_hints(TrainConfig).items():
        # nan passes every `x < low` test and inf every `x > 0` one; a config file can hold both (TOML's nan/inf,
        # JSON's NaN/Infinity), so no float is let through unless it is finite.
        value = getattr(cfg, name)
        if float in (kind, *get_args(kind)) and isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if not 0 <= cfg.seed < SEEDS:
        raise UserError(f"--seed must be an integer from 0 to {SEEDS - 1}, got {cfg.seed}")
    if cfg.recipe not in choices()["recipe"]:
        raise UserError(f"--recipe must be one of {', '.join(choices()['recipe'])}, got {cfg.recipe!r}")
    cfg = resolve(cfg, tasks(cfg.task) if tasks is not None and cfg.task != "auto" else None)
    for name, (low, high, closed) in RANGES.items():
        v = getattr(cfg, name)
        if not (low <= v <= high if closed else low <= v < high):
            raise UserError(f"--{name.replace('_', '-')} must be in [{low}, {high}{']' if closed else ')'}, got {v}")
    if cfg.crop_scale is not None and not (
        all(math.isfinite(v) for v in cfg.crop_scale) and 0 < cfg.crop_scale[0] <= cfg.crop_scale[1] <= 1
    ):
        low, high = cfg.crop_scale
        raise UserError(f"--crop-scale MIN MAX must satisfy 0 < MIN <= MAX <= 1, got {low:g} {high:g}")
    if cfg.folds == 1 or cfg.folds < 0:
        raise UserError(f"--folds must be 2 or more (0: no cross-validation), got {cfg.folds}")
    if cfg.folds and not 0 <= cfg.fold < cfg.folds:
        raise UserError(f"--fold must be from 0 to {cfg.folds - 1} with --folds {cfg.folds}, got {cfg.fold}")
    if not cfg.folds and cfg.fold:
        raise UserError(f"--fold {cfg.fold} needs --folds K (the number of folds)")
    if cfg.group_by is not None and not cfg.group_by.strip():
        raise UserError("--group-by is empty: give a regex over the image paths or a column name")
    if cfg.crop_pct is not None and not 0 < cfg.crop_pct <= 1:
        raise UserError(f"--crop-pct must be in (0, 1], got {cfg.crop_pct}")
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
    if cfg.decode == "device" and cfg.cache not in (None, "fit", "off"):
        raise UserError(
            f"--decode device decodes the JPEGs on the device every epoch and keeps no image cache, but --cache "
            f"{cfg.cache} asks for one; drop --cache, or cache the decoded images with --decode exact"
        )
    if not 0.0 < cfg.val_fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1, got {cfg.val_fraction}")
    if cfg.lr == "auto":
        if cfg.scale_lr:  # the sweep already runs at the run's global batch
            raise UserError("--lr auto finds the lr for the run's own global batch: drop --scale-lr")
    elif isinstance(cfg.lr, str) or cfg.lr <= 0:
        raise UserError(f"--lr must be a positive number or auto, got {cfg.lr}")
    if cfg.nproc is not None and cfg.nproc < 1:
        raise UserError(f"--nproc must be a positive integer, got {cfg.nproc}")
    if cfg.threads is not None and cfg.threads < 1:
        raise UserError(f"--threads must be 1 or more, got {cfg.threads}")
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
    for name, (low, high) in LIMITS.items():
        value = getattr(cfg, name)
        if value is not None and not low <= value <= high:
            kind = (
                "a number of seconds" if name == "timeout" else "an integer" if name != "warmup_epochs" else "a number"
            )
            raise UserError(f"--{name.replace('_', '-')} must be {kind} from {low} to {high}, got {value}")
    if cfg.freeze_epochs and cfg.freeze_epochs >= cfg.epochs:
        # --epochs is the run's total, on a resume too: the head-only phase would be the whole run.
        raise UserError(
            f"--freeze-epochs {cfg.freeze_epochs} leaves no epoch of --epochs {cfg.epochs} in which the backbone "
            "trains: give fewer --freeze-epochs than --epochs, or --freeze-backbone to train only the head"
        )
    _check_lora(cfg)
    if cfg.max_steps is not None and cfg.max_steps < 1:  # the flag's type checks it; a config file or the API here
        raise UserError(f"--max-steps must be a positive integer, got {cfg.max_steps}")
    if cfg.resume == "auto" and not cfg.output_dir:
        raise UserError("--resume auto continues the run in --output-dir: pass --output-dir RUN_DIR")
    weights = cfg.class_weights
    if weights not in ("none", "auto") and weights.partition(":")[0] != "effective" and not Path(weights).is_file():
        raise UserError(
            f"--class-weights must be none, auto, effective[:BETA] or a JSON/CSV file, got {weights!r} (no such file)"
        )
    return cfg


def _check_lora(cfg: TrainConfig) -> None:
    """--lora R and its companions (which model layers match is checked once the model is built)."""
    if not cfg.lora:  # a negative rank: LIMITS said so already
        given = [f for f in ("lora_alpha", "lora_targets") if getattr(cfg, f) is not None] + (
            ["lora_dropout"] if cfg.lora_dropout else []
        )
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} sets up LoRA adapters: add --lora R (a rank, e.g. 8)")
        return
    if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
        raise UserError(f"--lora-alpha must be a positive number, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise UserError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_targets is not None and not cfg.lora_targets.strip(" ,"):
        raise UserError("--lora-targets is empty: give layer names such as qkv,proj (or drop it for the default)")
    if cfg.freeze_backbone:
        raise UserError("--lora trains adapters in the backbone and --freeze-backbone freezes it: give one of them")
    if cfg.ema:
        raise UserError("--ema averages every weight, and under --lora only the adapters and the head move: drop --ema")


# Settings whose form changed, as earlier runs' config.json files (and config files) still hold them.
_EARLIER = {
    "augment": lambda v: {True: "flip-crop", False: "none"}.get(v, v) if isinstance(v, bool) else v,  # was a switch
    "nnodes": lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v,  # now N or MIN:MAX
}


def in_current_forms(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` as an earlier run's config.json or a config file holds them, in today's forms."""
    return {k: _EARLIER.get(k, lambda v: v)(v) for k, v in settings.items()}


def recorded_split_method(record: dict) -> str:
    """The ``--split-method`` of the run whose ``config.json`` is ``record``: as recorded, or for a run from
    before the setting, the split it made (a shuffle, or iterative stratification for multi-label data)."""
    config, model = record.get("config"), record.get("model")
    if isinstance(config, dict) and "split_method" in config:
        return config["split_method"]
    multilabel = isinstance(model, dict) and (model.get("task") == "multilabel" or model.get("multi_label") is True)
    return "stratified" if multilabel else "random"


def load_config_file(path: str) -> dict[str, Any]:
    """Read settings from a TOML file or an earlier run's ``config.json``."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {path}")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:  # a file of settings (or a run's config.json): never this large
        raise UserError(
            f"config file {path} is {size:,} bytes, more than a file of settings holds ({MAX_CONFIG_BYTES:,})"
        )
    try:
        if p.suffix == ".json":
            record = json.loads(p.read_text())
            raw = record.get("config", record) if isinstance(record, dict) else record  # a run's config.json nests them
            if raw is not record and isinstance(raw, dict):  # an earlier run's settings: its split too
                raw = {**raw, "split_method": recorded_split_method(record)}
        else:
            raw = tomllib.loads(p.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"cannot parse config file {path}: {str(e)[:200]}") from None
    except RecursionError:  # arrays nested thousands deep
        raise UserError(f"cannot parse config file {path}: nested too deep") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a {type(raw).__name__}, not a table of settings")
    raw = in_current_forms(raw)
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"unknown setting(s) in {path}: {', '.join(unknown)}")
    check_types(raw, path)
    return raw
