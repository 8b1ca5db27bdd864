"""Recipe presets resolved into settings: ``--recipe blog|modern`` and the normalisation they imply.

``--recipe blog`` is the reference job (SGD lr 1e-3 momentum 0.9, constant lr,
no augmentation, the blog's normalisation). ``--recipe modern`` is what won on
real images (see benchmarks/recipe.py): AdamW with decoupled weight decay
(none on norms and biases), one warm-up epoch then cosine decay, label
smoothing, no augmentation and no EMA (on 32 px digits from scratch in 10
epochs, a mild crop and flip cost 3 points of accuracy and the EMA gained none
worth its time; --augment and --ema add them). A preset only fills the settings
left unset (None): a flag or config file value always wins, and the resolved
config records every value. Nothing else in visiontune knows the presets; the
optimizer, loss and freezing they ask for are built in ``training.optim``.
"""

from __future__ import annotations

from pathlib import Path

from visiontune.settings.config import MEAN, STD

PRESETS: dict[str, dict] = {
    "blog": {
        "optimizer": "sgd",
        "lr": 1e-3,
        "weight_decay": 0.0,
        "lr_schedule": "none",
        "warmup_epochs": 0.0,
        "label_smoothing": 0.0,
        "augment": "none",
        "random_erasing": 0.0,
        "mixup": 0.0,
        "cutmix": 0.0,
        "ema": 0.0,
        "normalize": "blog",
    },
    "modern": {
        "optimizer": "adamw",
        "lr": 1e-3,
        "weight_decay": 0.05,
        "lr_schedule": "cosine",
        "warmup_epochs": 1.0,
        "label_smoothing": 0.1,
        "augment": "none",
        "random_erasing": 0.0,
        "mixup": 0.0,
        "cutmix": 0.0,
        "ema": 0.0,
        "normalize": None,
    },  # normalize: see _normalize
}


# The flips and the random-resized crop each --augment level brings: (hflip p, vflip p, crop scale or None).
# --hflip, --vflip and --crop-scale replace them over any level. The levels other than flip-crop crop
# mildly: at full strength (area down to 8%) a small image loses the object (measured on 32 px digits:
# 0.84 accuracy against 0.98 without cropping).
MILD_CROP = (0.35, 1.0)
AUGMENT_VIEW: dict[str, tuple[float, float, tuple[float, float] | None]] = {
    "none": (0.0, 0.0, None),
    "flip-crop": (0.5, 0.0, (0.08, 1.0)),  # the original --augment: torchvision's RandomResizedCrop defaults
    "light": (0.5, 0.0, MILD_CROP),  # the mild crop and flip alone: no colour or shape changes of the object
    "trivial": (0.5, 0.0, MILD_CROP),  # ... and TrivialAugmentWide
    "randaugment": (0.5, 0.0, MILD_CROP),  # ... and RandAugment
}


def _value_text(name: str, value) -> str:
    if value is None:  # normalize in the modern recipe: decided per run, see _normalize
        return "weights (pretrained) or data (from scratch)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe(name: str) -> str:
    """One recipe as its flags and values, the ones it turns off last: the --recipe help is made of these."""
    on, off = [], []
    for key, value in PRESETS[name].items():
        flag = key.replace("_", "-")
        if value in (0, "none") and key != "normalize":
            off.append(flag)
        else:
            on.append(f"--{flag} {_value_text(key, value)}")
    return f"{name} ({', '.join(on)}; off: {', '.join(off)})" if off else f"{name} ({', '.join(on)})"


# Why --recipe modern adds no augmentation (benchmarks/README.md, the recipe tables), said where a run takes
# that default (--help says it shorter).
MODERN_NO_AUGMENT = (
    "--recipe modern adds no augmentation: it was chosen on 32 px digits, where flips and crops cost accuracy; "
    "for natural photos add --augment light"
)


def recipe_help() -> str:
    """The --recipe help text, rendered from ``PRESETS`` so that it cannot disagree with them."""
    recipes = [describe(name) for name in PRESETS]
    photos = "modern was chosen on digits: for photos add --augment light"
    return f"{', or '.join(recipes)}; {photos}. Flags and --config win"


def _normalize(cfg) -> str:
    # Pretrained weights see inputs normalised as in their own training; a model trained from
    # scratch (or from a file without metadata) is best served by the data's own statistics.
    named = cfg.weights.lower() != "none" and Path(cfg.weights).suffix not in (".pth", ".pt", ".safetensors")
    return "weights" if named else "data"


def resolve(cfg, task=None):
    """``cfg`` with every setting the preset governs filled in (explicit values kept). ``task``: the task
    ``--task`` names, when known (None: auto, told by the data later); a recipe setting it declares it
    does without (``Task.supports_label_smoothing``) is left at its plain value."""
    from visiontune.errors import UserError

    if cfg.recipe not in PRESETS:
        raise UserError(f"--recipe must be one of {', '.join(PRESETS)}, got {cfg.recipe!r}")
    changes = {k: v for k, v in PRESETS[cfg.recipe].items() if getattr(cfg, k) is None}
    if task is not None and not task.supports_label_smoothing and "label_smoothing" in changes:
        changes["label_smoothing"] = 0.0  # a recipe's smoothing is of classes: a task without them declines it
    if "normalize" in changes and changes["normalize"] is None:
        changes["normalize"] = _normalize(cfg)
    augment = changes.get("augment", cfg.augment)
    if isinstance(augment, bool):  # the old boolean --augment / `augment = true` in a config file
        changes["augment"] = "flip-crop" if augment else "none"
    cfg = cfg.replace(**changes) if changes else cfg
    if cfg.augment in AUGMENT_VIEW:  # an unknown one is refused by validate, with the flag's name
        hflip, vflip, crop = AUGMENT_VIEW[cfg.augment]
        cfg = cfg.replace(
            hflip=hflip if cfg.hflip is None else cfg.hflip,
            vflip=vflip if cfg.vflip is None else cfg.vflip,
            crop_scale=crop if cfg.crop_scale is None else tuple(cfg.crop_scale),
        )
    if (cfg.mean is None) != (cfg.std is None):
        raise UserError("give --mean and --std together (or neither, to take them from --normalize)")
    if cfg.mean is None and cfg.normalize != "data":  # data: the trainer measures the train split
        mean, std = _weights_stats(cfg) if cfg.normalize == "weights" else (MEAN, STD)
        cfg = cfg.replace(mean=stats_text(mean), std=stats_text(std))
    mean_std(cfg)  # refuses malformed values now, not after the data is read
    return cfg


def stats_text(values) -> str:
    return ",".join(f"{float(v):.6g}" for v in values)


def mean_std(cfg) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The run's normalisation (the reference constants for runs that predate --normalize)."""
    from visiontune.errors import UserError

    if cfg.mean is None:
        return MEAN, STD
    try:
        mean, std = (tuple(float(x) for x in text.split(",")) for text in (cfg.mean, cfg.std))
    except ValueError:
        mean = std = ()
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise UserError(f"--mean/--std must be three numbers each, std positive: got {cfg.mean!r}, {cfg.std!r}")
    return mean, std


def _weights_stats(cfg) -> tuple:
    from visiontune.errors import UserError
    from visiontune.models.build import get_spec

    if _normalize(cfg) != "weights":
        raise UserError(
            f"--normalize weights needs named pretrained weights (--weights {cfg.weights} has no "
            "metadata); use --normalize data or blog"
        )
    preprocess = get_spec(cfg.model).preprocess  # timm's pretrained_cfg, torchvision's weights.transforms()
    return preprocess.mean, preprocess.std
