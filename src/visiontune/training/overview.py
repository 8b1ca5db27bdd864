"""The run's resolved setup, said once at the start (as the Hugging Face Trainer's "Running training")
and recorded in ``config.json`` for the report's Setup table: what the images are, how many steps
they make, and what the recipe resolved into. Plain (label, text) rows, made from the resolved
config and the numbers the trainer computed; nothing here decides anything.
"""

from __future__ import annotations

import math

from visiontune.cluster.strategy import Threads
from visiontune.models.build import resized_from
from visiontune.settings import presets
from visiontune.settings.config import LR_SCHEDULE_SAID, TrainConfig
from visiontune.text import printable
from visiontune.training.plan import Plan
from visiontune.training.schedule import frozen_steps, warmup_steps

MAX_CLASS_NAMES = 10


def _n(value: int) -> str:
    return f"{value:,}"


def _optimizer(cfg: TrainConfig, lr: float) -> str:
    shown = f"{lr:.3g} (--lr auto: lr-find's suggestion)" if cfg.lr == "auto" else f"{lr:g}"
    if cfg.optimizer == "adamw":
        text = f"AdamW, lr {shown}, weight decay {cfg.weight_decay:g} (none on norms and biases)"
    else:
        text = f"SGD, lr {shown}, momentum {cfg.momentum:g}, weight decay {cfg.weight_decay:g}"
    if cfg.backbone_lr_mult != 1:
        text += f", backbone lr x{cfg.backbone_lr_mult:g}"
    return text


def _schedule(cfg: TrainConfig, steps_per_epoch: int) -> str:
    warm = warmup_steps(cfg, steps_per_epoch)
    shape = LR_SCHEDULE_SAID.get(cfg.lr_schedule, cfg.lr_schedule)
    text = f"{warm} warm-up steps, then {shape}" if warm else shape
    frozen = frozen_steps(cfg, steps_per_epoch)
    if not frozen or cfg.lr_schedule == "onecycle":  # one cycle spans the whole run, its rise in the frozen phase
        return text
    return f"{_n(frozen)} head-only steps at the full lr, then {text} from the unfreeze"


def _phases(cfg: TrainConfig, steps_per_epoch: int) -> str | None:
    """The head-only phase of --freeze-epochs and the one after it, in the console's epoch numbers."""
    if cfg.freeze_backbone:
        return "every epoch: the new head only (--freeze-backbone; the backbone and its norms never change)"
    if not cfg.freeze_epochs:
        return None
    frozen = min(cfg.freeze_epochs, cfg.epochs)
    head = f"epoch{'s' * (frozen > 1)} {'1' if frozen == 1 else f'1-{frozen}'}"
    text = f"{head}: the new head only, the backbone frozen (its BatchNorm statistics too)"
    if frozen < cfg.epochs:
        rest = f"epoch{'s' * (cfg.epochs - frozen > 1)} {frozen + 1}" + (
            f"-{cfg.epochs}" if cfg.epochs - frozen > 1 else ""
        )
        text += f"; {rest}: everything (from step {_n(frozen * steps_per_epoch + 1)})"
    return text


def _view(cfg: TrainConfig) -> list[str]:
    """The flips and the crop, where they differ from what ``--augment`` brings."""
    hflip, vflip, crop = presets.AUGMENT_VIEW.get(cfg.augment, (None, None, None))
    out = [] if cfg.hflip in (None, hflip) else [f"horizontal flip {cfg.hflip:g}"]
    out += [] if cfg.vflip in (None, vflip) else [f"vertical flip {cfg.vflip:g}"]
    if cfg.crop_scale is not None and tuple(cfg.crop_scale) != crop:
        out.append(f"crop scale {cfg.crop_scale[0]:g}-{cfg.crop_scale[1]:g}")
    return out


def _augmentation(cfg: TrainConfig) -> str:
    """The augmentation row; a modern run without any says why, and what photos want."""
    extra = _view(cfg) + [
        f"{name} {value:g}"
        for name, value in (("random erasing", cfg.random_erasing), ("mixup", cfg.mixup), ("cutmix", cfg.cutmix))
        if value
    ]
    text = ", ".join([cfg.augment, *extra])
    if cfg.recipe == "modern" and text == "none":
        text += f" ({presets.MODERN_NO_AUGMENT})"
    return text


def _sampler(cfg: TrainConfig, num_classes: int, images_per_epoch: int) -> str:
    if cfg.sampler != "balanced":
        return "random: each train image once per epoch"
    return (
        f"balanced: the {num_classes} classes drawn equally often, about {_n(images_per_epoch // max(num_classes, 1))}"
        " images each per epoch (a rare class's images repeat)"
    )


def _decode(cfg: TrainConfig, setup) -> str:
    if cfg.decode == "fast":
        return "fast: a JPEG at least twice the input size is decoded at a DCT scale, on the loader side"
    if cfg.decode != "device":
        return "exact: every pixel, on the loader side"
    device = setup.devices[0] if setup.devices else "cpu"
    if device.startswith("cuda"):
        return f"device: JPEGs in batches on {device} (nvJPEG), other files on the loader side"
    # Allowed (and bit-identical to exact) so the path can be tried anywhere, but no faster here.
    return f"device: JPEGs in batches on {device} in the training process; on a CPU the loader side is as fast"


def _model(cfg: TrainConfig, source: str) -> str:
    """The model row; a model made for one input size (a ViT) and built for another says so."""
    text = f"{cfg.model} ({source}), weights {cfg.weights}, {cfg.image_size} px"
    native = resized_from(cfg.model, cfg.image_size)
    if native is None:
        return text
    if cfg.weights == "DEFAULT":
        return text + f" (built for {cfg.image_size} px: position embeddings resized from the pretrained {native} px)"
    return text + f" (built for {cfg.image_size} px, not its pretrained {native} px)"


def _threads(cores: Threads) -> str:
    """The model's threads, what chose them, and who decodes the batches."""
    text = f"{cores.intra_op} for the model ({cores.chosen_by})"
    if cores.adaptive:
        text += "; chosen again after an epoch far slower than the one before (--threads N fixes the count)"
    if cores.loader_workers:
        return text + f"; {cores.loader_workers} loader worker process(es) decode, {cores.decode} thread each"
    return text + f"; {cores.decode} thread(s) decode each batch in this process, between steps"


def _resize(cfg: TrainConfig, given: TrainConfig, source: str) -> str:
    """How every image is resized and cropped, and where each choice came from: ``given`` is the config
    before ``input_view`` filled in the model's defaults (a value given there came from a flag or --config)."""
    inherited = " or the --init-from run" if given.init_from else ""
    own = "the model's pretrained config" if source != "torchvision" else "the torchvision weights' transforms"
    how = f"{cfg.interpolation} interpolation ({'--interpolation' + inherited if given.interpolation else own})"
    if cfg.crop_pct is None:
        crop = "no crop: the whole image squashed to the input size (the default for torchvision models)"
    else:
        origin = "--crop-pct" + inherited if given.crop_pct is not None else "the model's pretrained config"
        crop = (
            f"centre crop {cfg.crop_pct:g}: the short side resized to {math.floor(cfg.image_size / cfg.crop_pct)} px, "
            f"the centre {cfg.image_size} x {cfg.image_size} kept ({origin})"
        )
    size = "--image-size" + inherited if given.image_size else "the model's pretrained size"
    return f"{cfg.image_size} px ({size}), {how}, {crop}"


def rows(
    resolved: Plan,
    train_images: int,
    val_images: int,
    classes: list[str],
    images_per_epoch: int,
    steps_per_epoch: int,
    source: str,
    class_weights: str = "none",
) -> list[tuple[str, str]]:
    """The ``resolved`` plan as (label, text) rows: its settings and the world's setup, the resize said with
    where each choice came from (what was asked, or the model's defaults), the task's loss; ``class_weights``
    as ``imbalance.describe`` says them."""
    cfg, setup, task = resolved.cfg, resolved.setup, resolved.task
    train = _n(train_images)
    if images_per_epoch < train_images:  # the train loader keeps full batches only
        train += (
            f" ({_n(images_per_epoch)} of {_n(train_images)} per epoch, last partial batch dropped; "
            "every image is seen over epochs)"
        )
    names = ", ".join(classes[:MAX_CLASS_NAMES]) + (", ..." if len(classes) > MAX_CLASS_NAMES else "")
    processes = "process" if setup.world_size == 1 else "processes"
    batch = f"{setup.per_process_batch} per process x {setup.world_size} {processes}"
    if cfg.grad_accum > 1:
        batch += f" x {cfg.grad_accum} accumulated"
    steps = (
        f"{_n(steps_per_epoch)} per epoch x {cfg.epochs} epoch{'s' * (cfg.epochs != 1)} = "
        f"{_n(steps_per_epoch * cfg.epochs)}"
    )
    if cfg.max_steps is not None and cfg.max_steps < steps_per_epoch * cfg.epochs:
        steps += f"; --max-steps {_n(cfg.max_steps)}: stops there"
    if cfg.limit_images is not None:
        train += f" (--limit-images {_n(cfg.limit_images)}: a seeded subset of the data, split.json)"
    if cfg.exclude:
        train += f" (--exclude {printable(cfg.exclude)}: its files left out of train and val, split.json)"
    if cfg.relabel:
        train += f" (--relabel {printable(cfg.relabel)}: its files with its suggested labels, split.json)"
    val = f"{_n(val_images)}, each counted once per epoch"
    if cfg.folds:
        val += f"; fold {cfg.fold} of {cfg.folds} (folds 0 to {cfg.folds - 1})"
    if cfg.group_by:
        val += f"; each group ({cfg.group_by}) on one side (split.json counts them)"
    return [
        ("train images", train),
        ("val images", val),
        (task.classes_word, f"{len(classes)}: {names}"),
        ("model", _model(cfg, source)),
        ("resize", _resize(cfg, resolved.asked, source)),
        ("batch", f"{batch} = global batch {setup.global_batch}"),
        ("optimizer steps", steps),
        ("optimizer", _optimizer(cfg, setup.lr)),
        ("lr schedule", _schedule(cfg, steps_per_epoch)),
        *([("phases", phases)] if (phases := _phases(cfg, steps_per_epoch)) else []),
        ("loss", task.loss_text(cfg.label_smoothing, class_weights)),
        ("sampler", _sampler(cfg, len(classes), images_per_epoch)),
        ("augmentation", _augmentation(cfg)),
        ("decode", _decode(cfg, setup)),
        *([("threads", _threads(resolved.threads))] if resolved.threads else []),
        *([("memory format", _memory_format(resolved))] if cfg.channels_last else []),
        ("EMA", f"decay {cfg.ema:g}" if cfg.ema else "off"),
        ("normalisation", f"{cfg.normalize}: mean {cfg.mean}, std {cfg.std}"),
        ("recipe", cfg.recipe),
    ]


def _memory_format(resolved: Plan) -> str:
    if resolved.asked.channels_last:
        return "channels-last (--channels-last)"
    return (
        "channels-last (the default for a model with depthwise convolutions and BatchNorm on a CPU: faster there; "
        "--no-channels-last turns it off)"
    )


def recipe_note(cfg: TrainConfig, source: str) -> str | None:
    """One line when the blog recipe is used where it does badly: from scratch, or on a timm/Hub model."""
    if cfg.recipe != "blog":
        return None
    if cfg.weights.lower() == "none":
        where = "from scratch (--weights none)"
    elif source != "torchvision":
        where = f"on a {source} model"
    else:
        return None
    return (
        f"note: the blog recipe (SGD, constant lr) was made for fine-tuning a pretrained torchvision model; "
        f"{where} it does worse than --recipe modern (benchmarks/recipe.py)"
    )
