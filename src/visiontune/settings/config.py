"""Run configuration: one frozen dataclass and its defaults (``validation`` checks the values).

Everything below the CLI takes a ``TrainConfig``; nothing mutates it after it
is built. Defaults follow the reference job (VGG16, SGD lr 1e-3 momentum 0.9,
batch 50 per process, 2 epochs, 80/20 split with seed 42). ``MEAN``/``STD`` are
the reference job's normalisation (``--normalize blog``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

# Seeds run from 0 to SEEDS - 1: numpy's generators (which Accelerate's set_seed seeds too) take no others.
SEEDS = 2**32
# --lr-schedule none, as every page and the start-up block say it
LR_SCHEDULE_SAID = {"none": "constant"}


def _setting(default: Any, help_text: str) -> Any:
    # The CLI makes each field the flag --field-name with this help (and the default appended).
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TrainConfig:
    data: str = _setting("", "what to train on: any source of data/sources.py (`visiontune train --help` names each)")
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
    lora: int = _setting(
        0,
        "train rank-R LoRA adapters (peft) and the new head, the rest frozen (0: off); the best model file is "
        "merged; see docs/training.md",
    )
    lora_alpha: float | None = _setting(None, "LoRA scale numerator: adapters add alpha / R x B A (default: R)")
    lora_dropout: float = _setting(0.0, "dropout on the LoRA adapters' input")
    lora_targets: str | None = _setting(
        None,
        "layers --lora adapts, comma-separated names or name suffixes (default: attn.qkv, attn.proj, mlp.fc1, "
        "mlp.fc2 in a transformer, every Linear and dense Conv2d in a convnet; never the head)",
    )
    grad_checkpointing: bool = _setting(
        False, "recompute each block's activations in the backward pass: less memory, about a third more compute"
    )
    # data
    image_size: int | None = _setting(None, "square input size in pixels (default: the model's pretrained size)")
    interpolation: Literal["bilinear", "bicubic", "nearest", "nearest-exact"] | None = _setting(
        None, "resize interpolation of every image (default: the model's pretrained config; recorded)"
    )
    crop_pct: float | None = _setting(
        None,
        "centre crop: the short side resized to size / CROP_PCT, then the centre size x size kept, as timm "
        "evaluates (default: the model's for timm and Hub models; torchvision's squash the whole image; recorded)",
    )
    decode: Literal["exact", "fast", "device"] = _setting(
        "exact",
        "exact (every pixel decoded, then resized), fast (a JPEG at least twice the image size decoded at a "
        "DCT scale first: faster, pixels a few grey levels off) or device (JPEGs decoded on the training device "
        "in batches, nvJPEG on a GPU, then resized there; other files as exact; no image cache); "
        "docs/performance.md; recorded",
    )
    augment: Literal["none", "flip-crop", "light", "trivial", "randaugment"] | None = _setting(
        None, "none, flip-crop (also plain --augment), light, trivial or randaugment (default: the recipe's)"
    )
    random_erasing: float | None = _setting(None, "probability of erasing a random box of each training image")
    hflip: float | None = _setting(
        None,
        "probability of a horizontal flip of each training image, over any --augment (0 for text and digits; "
        "default: 0.5 with augmentation, else 0)",
    )
    vflip: float | None = _setting(
        None, "probability of a vertical flip of each training image, for images with no up (default 0)"
    )
    crop_scale: tuple[float, float] | None = _setting(
        None,
        "MIN MAX: the share of the image area the random-resized crop keeps, over any --augment (default: "
        "0.08 1 for flip-crop, 0.35 1 for the other levels, no crop for none)",
    )
    mixup: float | None = _setting(None, "mixup alpha (0: off); soft labels, see docs/training.md")
    cutmix: float | None = _setting(None, "cutmix alpha (0: off); with --mixup each pair uses one of them")
    normalize: Literal["weights", "data", "blog"] | None = _setting(
        None, "weights (the pretrained weights' mean/std), data (the train split's) or blog (the reference constants)"
    )
    mean: str | None = _setting(None, "per-channel mean R,G,B in [0, 1] (default: from --normalize; recorded)")
    std: str | None = _setting(None, "per-channel std R,G,B (default: from --normalize; recorded)")
    val_fraction: float = _setting(0.2, "share of images held out for validation")
    split_method: Literal["stratified", "random"] = _setting(
        "stratified",
        "stratified (each class held out at --val-fraction; multi-label: iterative stratification) or random (a "
        "seeded shuffle of all the images, the split of runs before stratification); recorded in split.json",
    )
    group_by: str | None = _setting(
        None,
        "keep each group of images on one side of the split: a regex over the path relative to the data "
        "whose first group names the group, or a column of the manifest or hf: data",
    )
    folds: int = _setting(0, "K-fold cross-validation: split the data into K folds (0: off; see --fold)")
    fold: int = _setting(0, "with --folds K: the fold (0 to K-1) held out for validation")
    seed: int = _setting(42, "seed of the split, the sampler and the head's init")
    sampler: Literal["random", "balanced"] = _setting(
        "random", "random (each image once per epoch) or balanced (each class drawn equally often per epoch)"
    )
    threads: int | None = _setting(
        None,
        "intra-op threads per process (default: OMP_NUM_THREADS when set, else this process's share of "
        "the cores its affinity and cgroup CPU quota allow)",
    )
    num_workers: int | None = _setting(
        None,
        "loader worker processes per process, or auto (default: "
        "cores - 1 with a GPU, none on a CPU, where threads decode)",
    )
    cache: str | None = _setting(
        "fit",
        "decode and resize every image once into a memory-mapped uint8 cache that every epoch reads: fit (the "
        "user cache folder when the cache fits in the smaller of 8 GiB and a quarter of its free space, else "
        "no cache, said in one line), auto (the user cache folder, always), off (decode every epoch), or a folder",
    )
    max_bad_fraction: float = _setting(0.01, "stop before training when more files than this are bad")
    limit_images: int | None = _setting(
        None, "use a seeded random subset of N images of the data (before the split; recorded in split.json)"
    )
    exclude: str | None = _setting(
        None, "a CSV with a file column (audit.csv): leave those files out (recorded in split.json)"
    )
    relabel: str | None = _setting(
        None, "a CSV with file and suggested columns (audit.csv): train those files with the suggested labels"
    )
    image_column: str | None = _setting(None, "hf: data: the image column (default: the one with the Image feature)")
    label_column: str | None = _setting(None, "hf: data: the label column (default: the ClassLabel one)")
    task: str = _setting(
        "auto",
        "what the model learns: classify (one class an image), multilabel (any number of labels: a manifest's "
        "labels split on ';' or spaces, one sigmoid per class), regress (one or more numbers an image: a "
        "manifest's value columns, an hf: numeric column) or auto (classify, or multilabel where the labels "
        "say so: a ';' in a manifest's cell, an hf: label sequence), or the name of a task registered in "
        "visiontune.tasks; see docs/data.md",
    )
    multi_label: bool = _setting(False, "the same as --task multilabel")
    # optimisation (settings left None come from --recipe; see recipe.py)
    recipe: Literal["blog", "modern"] = _setting(
        "blog",
        "blog (the reference job, unchanged) or modern; what each sets is presets.PRESETS "
        "(`visiontune train --help` lists it); flags win",
    )
    epochs: int = _setting(2, "epochs")
    max_steps: int | None = _setting(
        None,
        "a smoke run: stop after N optimizer steps (mid-epoch too), validate, write the run folder as at an "
        "epoch's end and say so in summary.json",
    )
    batch_size: int = _setting(50, "batch size PER PROCESS, as in the reference job")
    optimizer: Literal["sgd", "adamw"] | None = _setting(
        None, "sgd or adamw (AdamW: no weight decay on norms and biases)"
    )
    lr: float | str | None = _setting(
        None,
        "learning rate, or auto: lr-find's suggestion for this run (its sweep at the start, on the main process; "
        "config.json records auto and the lr chosen, which a continued run keeps)",
    )
    momentum: float = _setting(0.9, "SGD momentum")
    weight_decay: float | None = _setting(None, "weight decay")
    lr_schedule: Literal["none", "cosine", "linear", "step", "onecycle"] | None = _setting(
        None,
        "none, cosine, linear, step or onecycle, stepped per optimizer step (onecycle: from lr/25 up to --lr over "
        "the warm-up, a quarter of the run by default, then cosine down to lr/25e4, with SGD momentum or Adam's "
        "beta1 cycled 0.95 -> 0.85 -> 0.95, as fastai's fit_one_cycle)",
    )
    warmup_epochs: float | None = _setting(None, "linear lr warm-up, in epochs (fractions allowed)")
    warmup_steps: int = _setting(0, "linear lr warm-up in optimizer steps (wins over --warmup-epochs)")
    label_smoothing: float | None = _setting(None, "label smoothing of the training loss")
    loss: Literal["mse", "l1", "huber"] | None = _setting(
        None, "regression's training loss, on the standardised targets: mse (default), l1 or huber"
    )
    class_weights: str = _setting(
        "none",
        "weigh the training loss by class: none, auto (inverse frequency), effective[:BETA] (effective number "
        "of samples, BETA 0.999) or a JSON/CSV file of class weights; see docs/training.md",
    )
    ema: float | None = _setting(None, "decay of an EMA of the weights, evaluated each epoch (0: off)")
    freeze_epochs: int = _setting(0, "train only the head for this many epochs, then everything")
    backbone_lr_mult: float = _setting(1.0, "lr multiplier for everything but the head")
    early_stop: int = _setting(0, "stop after this many epochs without a better --best-metric (0: off)")
    best_metric: Literal["auto", "accuracy", "loss", "map", "mae", "rmse", "r2"] = _setting(
        "auto",
        "auto, accuracy, loss, map (multi-label: mean average precision), mae, rmse or r2 (regression): what picks "
        "the best epoch (and EMA or raw weights); auto is the task's own: map for multi-label data (whose "
        "accuracy is the exact-match ratio), mae for regression, accuracy otherwise",
    )
    grad_accum: int = _setting(1, "gradient accumulation steps")
    scale_lr: bool = _setting(False, "scale lr by global batch / --reference-batch")
    reference_batch: int = _setting(50, "the batch --lr was tuned for")
    mixed_precision: Literal["no", "fp16", "bf16"] = _setting("no", "no, fp16 or bf16")
    channels_last: bool | None = _setting(
        None,
        "channels-last memory format (default: on for a model with depthwise convolutions and BatchNorm on a "
        "CPU, MobileNet or EfficientNet, where it trains 1.1-1.5x faster; off otherwise)",
    )
    compile: bool = _setting(False, "torch.compile the model")
    sync_batchnorm: bool = _setting(False, "synchronise BatchNorm statistics across processes")
    on_nan: Literal["stop", "skip"] = _setting("stop", "stop or skip when the loss is not finite")
    # distribution
    strategy: Literal["single", "dp", "ddp", "fsdp"] = _setting(
        "single", "single, dp (nn.DataParallel), ddp or fsdp (fully sharded: parameters split over processes)"
    )
    fsdp_offload: bool = _setting(False, "fsdp: keep parameters and optimizer state in CPU memory")
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


# The blog's normalisation statistics, measured on Dogs vs Cats.
MEAN = (0.4883, 0.4551, 0.4170)
STD = (0.2257, 0.2211, 0.2214)
