"""Every subcommand's flags (the training ones made from ``TrainConfig``), and an argparse that complains in one line.

Training flags default to "not given" so that the precedence is explicit:
``TrainConfig`` defaults, then ``--config FILE``, then the flags on the command
line. A ``Literal[...]`` field becomes a flag with argparse ``choices``; a bool
field ``--x/--no-x``. ``validate`` checks the same choices for values that come
from a config file.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import fields

from visiontune.cluster import sbatch
from visiontune.cluster.host import available_cores
from visiontune.errors import UserError
from visiontune.inference import EXPORT_FORMATS
from visiontune.settings import presets
from visiontune.settings.config import SEEDS, TrainConfig, choices
from visiontune.settings.validation import load_config_file, validate
from visiontune.version import __version__


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


# sample-data's bound: eight times Kaggle's 12,500 a class (about 7.5 GB with the unlabelled half), far past
# a demo's needs, and short of filling a disk with a mistyped 99999999999.
MAX_PER_CLASS = 100_000


def _per_class(text: str) -> int:
    """argparse type: sample-data's --per-class, 1 to ``MAX_PER_CLASS``."""
    value = positive(text)
    if value > MAX_PER_CLASS:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_PER_CLASS:,}, got {text!r}")
    return value


def finite(text: str) -> float:
    """argparse type: a float that is a number (float() also reads "nan" and "inf", which no setting can use)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def seed(text: str) -> int:
    """argparse type: a seed numpy takes, 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEEDS:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {SEEDS - 1}, got {text!r}")
    return value


def _lr(text: str) -> float | str:
    """argparse type: a positive number, or auto (lr-find's suggestion, see --lr)."""
    if text == "auto":
        return text
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number or auto, got {text!r}")
    return value


def _workers(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {text!r}") from None


def _or_none(kind: Callable) -> Callable:
    """argparse type of an optional setting: ``none`` sets it back to unset (its default: the recipe's, the
    model's or the data's), also over a value from ``--config``, as Hydra's ``null`` and LightningCLI's
    ``None`` do; anything else is parsed by ``kind``."""

    def parse(text: str):
        return None if text == "none" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse's "invalid int value" names the type
    return parse


def _nothing(text: str):
    raise argparse.ArgumentTypeError(f"takes no value, or none for its default, not {text!r}")


class _UnsetOr(list):
    """argparse choices listed with ``none``, which ``_or_none`` has made None by the time they are checked."""

    def __contains__(self, value) -> bool:
        return value is None or super().__contains__(value)


# How a TrainConfig field's annotation is parsed from the command line (bool fields are --x/--no-x).
_PARSERS = {"str": str, "str | None": str, "int": int, "int | None": int, "float": finite, "float | None": finite}


# `train --help` in sections: each TrainConfig field's flag goes under one of these titles.
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "data": (
        "data",
        "image_size",
        "interpolation",
        "crop_pct",
        "decode",
        "normalize",
        "mean",
        "std",
        "val_fraction",
        "split_method",
        "group_by",
        "folds",
        "fold",
        "seed",
        "sampler",
        "num_workers",
        "cache",
        "max_bad_fraction",
        "limit_images",
        "exclude",
        "relabel",
        "image_column",
        "label_column",
        "task",
        "multi_label",
    ),
    "model": (
        "model",
        "weights",
        "init_from",
        "freeze_backbone",
        "freeze_epochs",
        "backbone_lr_mult",
        "lora",
        "lora_alpha",
        "lora_dropout",
        "lora_targets",
        "grad_checkpointing",
    ),
    "optimisation": (
        "recipe",
        "epochs",
        "max_steps",
        "batch_size",
        "optimizer",
        "lr",
        "momentum",
        "weight_decay",
        "lr_schedule",
        "warmup_epochs",
        "warmup_steps",
        "label_smoothing",
        "loss",
        "class_weights",
        "ema",
        "early_stop",
        "best_metric",
        "grad_accum",
        "scale_lr",
        "reference_batch",
        "mixed_precision",
        "channels_last",
        "compile",
        "on_nan",
    ),
    "augmentation": ("augment", "hflip", "vflip", "crop_scale", "random_erasing", "mixup", "cutmix"),
    "run folder and resume": ("output_dir", "resume", "save_every_steps", "keep_last", "save_pth"),
    "distributed": (
        "strategy",
        "fsdp_offload",
        "nproc",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "rdzv_endpoint",
        "max_restarts",
        "timeout",
        "sync_batchnorm",
        "threads",
    ),
    "logging": ("log_with", "progress", "timing_warmup"),
}
# What `train --help` opens with: the flags a first run needs (each is listed here instead of in its section).
NEWCOMER_FLAGS = (
    "data",
    "model",
    "weights",
    "recipe",
    "epochs",
    "batch_size",
    "lr",
    "image_size",
    "augment",
    "output_dir",
    "resume",
)
# The usage line of the commands with the training flags: the ~70 flags are listed once, below, in sections.
TRAIN_USAGE = "%(prog)s --data DATA [--model NAME] [--recipe {blog,modern}] [--epochs N] [options]"
# Flags that mean nothing to a command that writes no checkpoints and resumes nothing (lr-find, bench).
CHECKPOINT_FLAGS = ("resume", "save_every_steps", "keep_last", "save_pth")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose complaints are a ``UserError``: one line and exit 2, like every other input error."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def add_train_flags(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> None:
    """One flag per ``TrainConfig`` field, --field-name, with the field's help and default, in the
    sections of ``FLAG_GROUPS``; the fields in ``leave_out`` get no flag (their defaults hold)."""
    parser.add_argument(
        "--config", help="TOML file or an earlier run's config.json; flags given here win (--FLAG none: back to unset)"
    )
    allowed = choices()
    titles = [title.replace(" and resume", "") if "resume" in leave_out else title for title in FLAG_GROUPS]
    shown = [
        t for t, names in zip(titles, FLAG_GROUPS.values(), strict=True) if set(names) - {*NEWCOMER_FLAGS, *leave_out}
    ]
    start = parser.add_argument_group(
        "start here",
        f"the flags a first run needs; every other flag is in its section below ({', '.join(shown)}), "
        "and docs/training.md explains them",
    )
    groups = {title: parser.add_argument_group(shown) for title, shown in zip(FLAG_GROUPS, titles, strict=True)}
    group_of = {name: groups[title] for title, names in FLAG_GROUPS.items() for name in names}
    group_of.update(dict.fromkeys(NEWCOMER_FLAGS, start))
    add_pipe_flag(groups["data"])  # a data flag, below the first screen
    for f in fields(TrainConfig):
        if f.name in leave_out:
            continue
        p = group_of[f.name]
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.name == "recipe":  # rendered from the presets' own table, so the two cannot disagree
            help_text = presets.recipe_help()
        if f.type == "bool":
            help_text += " (default on)" if f.default else ""
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
            continue
        if f.type == "bool | None":  # --flag, --no-flag, or --flag none: its own default again (over --config)
            p.add_argument(
                flag,
                nargs="?",
                const=True,
                type=_or_none(_nothing),
                metavar="none",
                default=argparse.SUPPRESS,
                help=help_text,
            )
            no = "--no-" + flag[2:]
            p.add_argument(no, dest=f.name, action="store_false", default=argparse.SUPPRESS, help=f"{flag} off")
            continue
        if f.default not in (None, ""):
            help_text += f" (default {f.default})"
        if f.name == "augment":  # plain --augment keeps its old meaning, flip-crop
            p.add_argument(
                flag, nargs="?", const="flip-crop", choices=allowed[f.name], default=argparse.SUPPRESS, help=help_text
            )
            p.add_argument(
                "--no-augment",
                dest="augment",
                action="store_const",
                const="none",
                default=argparse.SUPPRESS,
                help="no augmentation",
            )
            continue
        unsettable = f.default is None and f.type.endswith("| None")
        if f.name in allowed:
            if unsettable and "none" not in allowed[f.name]:  # `none` is no choice of these: it unsets them
                listed = _UnsetOr([*allowed[f.name], "none"])
                p.add_argument(flag, type=_or_none(str), choices=listed, default=argparse.SUPPRESS, help=help_text)
                continue
            p.add_argument(flag, choices=allowed[f.name], default=argparse.SUPPRESS, help=help_text)
            continue
        if f.name == "crop_scale":
            p.add_argument(
                flag, nargs=2, type=finite, metavar=("MIN", "MAX"), default=argparse.SUPPRESS, help=help_text
            )
            continue
        kind = {"num_workers": _workers, "seed": seed, "lr": _lr, "max_steps": positive, "limit_images": positive}.get(
            f.name
        ) or _PARSERS[f.type]
        action = p.add_argument(
            flag, type=_or_none(kind) if unsettable else kind, default=argparse.SUPPRESS, help=help_text
        )
        if f.name == "data":  # in the words of each data source, so that a new one is named by itself
            data_sources_help(action)


class _SourcesHelp:
    """What ``--data`` accepts in the data sources' own words (``data/sources.py``), looked up only when
    help is printed: the sources' modules import numpy, which a command that only parses need not."""

    def __init__(self, short: bool) -> None:
        self.short = short

    def __str__(self) -> str:
        from visiontune.data import sources

        return sources.help_text(short=self.short)


def data_sources_help(action: argparse.Action, short: bool = False, then: str = "") -> None:
    """Make ``action``'s help the data sources' list (``short``: their short names), ``then`` after it."""
    action.help, action.sources = f"%(sources)s{then}", _SourcesHelp(short)


def add_pipe_flag(parser) -> None:
    """--allow-pipe: the one way a ``pipe:`` command runs (``data/remote.py``, docs/data-formats.md)."""
    parser.add_argument(
        "--allow-pipe",
        action="store_true",
        help="run the shell command of a --data 'pipe:COMMAND' given on this command line (one read from a "
        "file, such as a run's config.json or an index.json, is never run)",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the config file, then the flags given."""
    from visiontune.data import remote

    names = {f.name for f in fields(TrainConfig)}
    merged = load_config_file(args.config) if getattr(args, "config", None) else {}
    if "data" not in vars(args):  # the file's data is used: a command in it is never run
        remote.refuse_command(merged.get("data"), args.config)
    merged.update({k: v for k, v in vars(args).items() if k in names})
    if merged.get("init_from"):  # continuing an earlier run: its model, size and resize unless said otherwise
        from visiontune.runs.runrecords import read_run

        earlier = read_run(merged["init_from"])
        merged = {
            "model": earlier.model,
            "image_size": earlier.image_size,
            "interpolation": earlier.interpolation,
            "crop_pct": earlier.crop_pct,
            "decode": earlier.decode,
            **merged,
        }
    from visiontune import tasks

    return validate(TrainConfig(**merged), tasks.get)


def _add_inference_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=positive, help="images per batch PER PROCESS (default: the run's)")
    p.add_argument(
        "--mixed-precision", choices=choices()["mixed_precision"], default="no", help="no, fp16 or bf16 (default no)"
    )
    p.add_argument("--nproc", type=positive, default=1, help="processes (DDP-style sharding; same output)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    p.add_argument(
        "--tta",
        choices=("none", "flip", "flip+crop"),
        default="none",
        help="test-time augmentation: average the probabilities of mirrored (and centre-cropped) views",
    )
    p.add_argument(
        "--threshold",
        type=finite,
        help="multi-label models: one probability threshold for every class (default: the per-class ones "
        "tuned on the run's validation split)",
    )
    p.add_argument(
        "--decode",
        choices=("exact", "fast"),
        help="how images are decoded (default: as the model was trained, recorded in its file)",
    )


def _add_column_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-column", help="hf: data: the image column (default: the one with the Image feature)")
    p.add_argument("--label-column", help="hf: data: the label column (default: the ClassLabel one)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """--run or --weights (with --model/--classes/--image-size for a file that does not describe itself)."""
    p.add_argument("--run", help="a training run folder")
    p.add_argument(
        "--weights",
        help="instead of --run: a visiontune .safetensors file (it says what it is), "
        + "an .onnx or OpenVINO .xml file from `visiontune export`, "
        + "or a .pth/.safetensors state_dict with --model and --classes",
    )
    p.add_argument("--model", help="with --weights: the model name (checked against the file's own)")
    p.add_argument("--classes", help="with --weights: class names in training order, comma-separated")
    p.add_argument(
        "--image-size",
        type=int,
        help="with --weights: input size (default: the file's, else the model's pretrained size)",
    )


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    _add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=positive, default=32, help="images per forward pass at most (default 32)")
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="how long the first image of a batch waits for others (default 5; 0: batch only what is queued)",
    )
    p.add_argument("--workers", type=positive, default=1, help="server processes, each with its own model (default 1)")
    p.add_argument(
        "--threads",
        type=positive,
        help="intra-op threads per worker (default: the cores less --decoders, over --workers, cut to those the "
        "machine's load leaves free)",
    )
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body in MiB (default 16)")
    p.add_argument(
        "--max-connections",
        type=positive,
        default=256,
        help="requests answered at once; beyond it new requests get 503 (default 256)",
    )
    p.add_argument(
        "--decoders",
        type=int,
        default=2,
        help="processes that decode uploads, so a decoder crash costs one answer, not the server (default 2; "
        "0: decode in the server's threads)",
    )
    p.add_argument(
        "--max-request-pixels",
        type=positive,
        default=4 * 89_478_485,
        help="pixels the images of one request may declare in all; beyond, 413 (default 357913940)",
    )
    p.add_argument(
        "--max-pixels-in-flight",
        type=positive,
        default=8 * 89_478_485,
        help="declared pixels being decoded at once over all requests; beyond, 503 (default 715827880)",
    )
    p.add_argument("--header-timeout", type=finite, default=10.0, help="seconds for a request's head (default 10)")
    p.add_argument(
        "--body-timeout", type=finite, default=60.0, help="seconds for a request's body; then 408 (default 60)"
    )
    p.add_argument("--compile", action="store_true", help="run the model through torch.compile (a torch model only)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True, help="one log line per request")


TUNE_USAGE = (
    "%(prog)s --data DATA --trials N [--timeout 2h] [--parallel K] [--space FILE] [--storage URL|FILE] [train's flags]"
)


def _add_tune_parser(sub, commands: Mapping[str, Callable]) -> None:
    p = sub.add_parser("tune", usage=TUNE_USAGE, help="search training settings over Optuna: trials of train, pruned")
    add_train_flags(p, leave_out=("output_dir", "resume", "timeout"))  # --timeout: the search's
    t = p.add_argument_group("the search (docs/tuning.md); train's flags above stay fixed for every trial")
    t.add_argument("--trials", type=positive, required=True, help="finished trials the study should hold")
    t.add_argument(
        "--timeout",
        dest="tune_timeout",
        metavar="DURATION",
        help="start no trial after this long: seconds, or 90m, 2h, 1h30m",
    )
    t.add_argument("--parallel", type=positive, default=1, help="trials at once on this machine (default 1)")
    t.add_argument("--space", help="the search space, a TOML file (default: the recipe's own space)")
    t.add_argument(
        "--storage",
        help="where the study lives: a database URL (sqlite:///..., postgresql://...) or a journal file path "
        "for a shared file system (default OUT/study.db)",
    )
    t.add_argument("--study", default="visiontune", help="the study's name in the storage (default visiontune)")
    t.add_argument("--out", default="runs/tune", help="tune folder: trial-NNNN run folders and the results")
    t.add_argument("--search", choices=("tpe", "random"), default="tpe", help="Optuna sampler (default tpe)")
    t.add_argument(
        "--pruner", choices=("median", "hyperband", "none"), default="median", help="Optuna pruner (default median)"
    )
    t.add_argument(
        "--heartbeat",
        type=finite,
        default=30.0,
        help="seconds between a running trial's heartbeats; a trial silent for 3 is another tuner's lost one",
    )
    s = p.add_argument_group("instead, write a Slurm job of one tuner per node on a --storage journal file")
    s.add_argument("--slurm-script", metavar="FILE", help="write the batch script here instead of tuning")
    for flag, kind, help_text in sbatch.FLAGS:
        if flag != "--out":
            s.add_argument(flag, type=kind, default="visiontune" if flag == "--job-name" else None, help=help_text)
    p.set_defaults(func=commands["tune"])


def _add_audit_parser(sub, commands: Mapping[str, Callable]) -> None:
    p = sub.add_parser(
        "audit",
        usage="%(prog)s DATA [--folds K] [--out FOLDER] [--test FOLDER] [train's options]",
        help="probable label errors, duplicates, train/val/test leaks and outliers, from K folds' trainings",
    )
    p.add_argument("images_from", nargs="?", metavar="DATA", help="the data, as train's --data")
    a = p.add_argument_group("the audit (docs/audit.md); train's flags below train every fold")
    a.add_argument("--folds", type=positive, default=5, help="trainings, each scoring the fold it held out (default 5)")
    a.add_argument("--out", default="runs/audit", help="folder of audit.csv, audit.json, audit.html and the folds")
    a.add_argument("--test", metavar="FOLDER", help="a test folder: its copies of training images are leaks")
    a.add_argument(
        "--similarity", type=finite, help="thumbnails this alike (cosine, at most 1) are near copies (default 0.998)"
    )
    # Its own dest: train's resume setting names a run folder, the audit's the folds in --out.
    a.add_argument(
        "--resume", dest="resume_audit", choices=("auto",), help="auto: continue the stopped audit in --out at its fold"
    )
    add_train_flags(p, leave_out=("output_dir", "folds", "fold", "resume"))
    p.set_defaults(func=commands["audit"])


def build_parser(commands: Mapping[str, Callable]) -> argparse.ArgumentParser:
    """Every subcommand and its flags; ``commands`` maps each name to the function that runs it."""
    parser = OneLineParser(
        prog="visiontune",
        description="Fine-tune torchvision and timm image classifiers on a folder of images, on one CPU or many GPUs.",
    )
    parser.add_argument("--version", action="version", version=f"visiontune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", usage=TRAIN_USAGE, help="fine-tune a torchvision, timm or Hugging Face Hub classifier")
    add_train_flags(p)
    p.set_defaults(func=commands["train"])
    p = sub.add_parser(
        "lr-find", usage=TRAIN_USAGE, help="a short exponential lr sweep: loss-vs-lr PNG and a suggested lr"
    )
    add_train_flags(p, leave_out=CHECKPOINT_FLAGS)
    p.add_argument("--steps", type=positive, default=100, help="batches in the sweep (default 100)")
    p.add_argument("--start-lr", type=finite, default=1e-7, help="first lr (default 1e-7)")
    p.add_argument("--end-lr", type=finite, default=10.0, help="last lr (default 10)")
    p.set_defaults(func=commands["lr-find"])
    p = sub.add_parser(
        "show",
        usage="%(prog)s DATA [--augment LEVEL] [--model NAME] [--image-size N] [--out show.png] [train's options]",
        help="a PNG grid of the first training batch as the model will see it (split, resize, augmentation)",
    )
    p.add_argument("images_from", nargs="?", metavar="DATA", help="the data, as train's --data")
    p.add_argument("--out", default="show.png", help="the PNG to write (default show.png)")
    p.add_argument("--count", type=positive, default=32, help="images of the batch to draw at most (default 32)")
    add_train_flags(p, leave_out=CHECKPOINT_FLAGS)
    p.set_defaults(func=commands["show"])
    _add_audit_parser(sub, commands)
    p = sub.add_parser("prepare", help="write DATA/train.csv from the Kaggle layout")
    p.add_argument("data", help="a data folder in the Kaggle layout (train/ with cat.1.jpg-style names)")
    p.set_defaults(func=commands["prepare"])
    p = sub.add_parser("sample-data", help="write a small synthetic data set in the Kaggle layout")
    p.add_argument("dir", help="the folder to write (made if missing; see --force)")
    p.add_argument(
        "--per-class",
        type=_per_class,
        default=200,
        help=f"labelled images per class, 1 to {MAX_PER_CLASS:,} (default 200; about 30 kB each)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the drawn images (default 0): same seed, same files")
    p.add_argument("--force", action="store_true", help="replace the data set in a folder that is not empty")
    p.add_argument(
        "--multi-label",
        action="store_true",
        help="instead: 4 x PER_CLASS 32 px images of coloured squares, any number each (train.csv: filename,labels)",
    )
    p.add_argument(
        "--regress",
        action="store_true",
        help="instead: PER_CLASS 32 px images of a bright square whose side (a fraction of the image's) is the "
        "value to predict, for --task regress (train.csv: filename,value)",
    )
    p.set_defaults(func=commands["sample-data"])
    p = sub.add_parser("models", help="list the model names --model accepts (Hub models: hf-hub:ORG/NAME)")
    p.add_argument(
        "--source",
        choices=("torchvision", "timm", "all"),
        default="torchvision",
        help="which library (default torchvision)",
    )
    p.add_argument("--filter", default="", help="only names containing this text (any case)")
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="only names with pretrained weights, with their parameter counts where known (torchvision's)",
    )
    p.set_defaults(func=commands["models"])
    p = sub.add_parser("check", help="decode every image of a data set and report the bad ones")
    data_sources_help(p.add_argument("data"), short=True, then=", as train's --data")
    p.add_argument(
        "--out", "--report", dest="report", help="the CSV report to write (default bad_files.csv in the current folder)"
    )
    p.add_argument("--workers", type=positive, default=available_cores(), help="decoding threads (default: cores)")
    add_pipe_flag(p)
    _add_column_flags(p)
    p.set_defaults(func=commands["check"])
    p = sub.add_parser("shard", help="write any data visiontune reads as WebDataset tar shards with an index")
    data_sources_help(p.add_argument("data"), short=True)
    p.add_argument(
        "--out",
        required=True,
        help="folder (or s3://bucket/prefix/) for shards-NNNNNN.tar and index.json (new or empty)",
    )
    p.add_argument("--shard-size", default="1GB", help="bytes per shard, such as 1GB or 500MB (default 1GB)")
    p.add_argument("--seed", type=int, default=42, help="seed of the recorded split, as train's (default 42)")
    p.add_argument("--val-fraction", type=float, default=0.2, help="share recorded as validation (default 0.2)")
    add_pipe_flag(p)
    _add_column_flags(p)
    p.set_defaults(func=commands["shard"])
    p = sub.add_parser("bench", usage=TRAIN_USAGE, help="train once per strategy and compare time and accuracy fairly")
    add_train_flags(p, leave_out=CHECKPOINT_FLAGS)
    p.add_argument("--strategies", default="single,dp,ddp", help="comma-separated (default single,dp,ddp)")
    p.add_argument(
        "--same",
        default="global",
        choices=("global", "per-device"),
        help="keep the global batch (default) or the per-device batch equal across strategies",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="train each strategy N times, interleaved; report the median run and the spread",
    )
    p.set_defaults(func=commands["bench"])
    p = sub.add_parser(
        "slurm", usage=TRAIN_USAGE, help="write a Slurm batch script for `visiontune train` (requeued on preemption)"
    )
    add_train_flags(p)
    for flag, kind, help_text in sbatch.FLAGS:
        p.add_argument(
            flag,
            type=kind,
            required=help_text.startswith("required"),
            default="visiontune" if flag == "--job-name" else None,
            help=help_text,
        )
    p.set_defaults(func=commands["slurm"])
    _add_tune_parser(sub, commands)
    p = sub.add_parser("predict", help="predict images with a trained model (Kaggle test/ -> submission)")
    _add_model_flags(p)
    p.add_argument("images", nargs="*", metavar="IMAGE", help="image files or folders to predict (instead of --data)")
    p.add_argument("--data", help="a folder of images, Kaggle's test/, a file listing paths, shards or hf:...")
    add_pipe_flag(p)
    _add_column_flags(p)
    p.add_argument("--out", help="CSV to write (unreadable files go to OUT.skipped.txt; default: the CSV on stdout)")
    p.add_argument("--clip", type=finite, default=0.0, help="clamp probabilities to [EPS, 1-EPS] (log loss)")
    _add_inference_flags(p)
    p.set_defaults(func=commands["predict"])
    p = sub.add_parser("evaluate", help="accuracy, F1, calibration, confusion matrix, top losses on labelled data")
    p.add_argument("--run", required=True, help="a training run folder")
    p.add_argument(
        "--weights",
        help="a model file to score instead of the run's best (an exported .onnx or OpenVINO .xml included); "
        "the run still names the data and its split",
    )
    p.add_argument("--data", help="labelled data in any layout train accepts (default: the run's own data)")
    add_pipe_flag(p)
    _add_column_flags(p)
    p.add_argument("--out", help="JSON report (default RUN/eval.json; the figures and top_losses.csv go beside it)")
    p.add_argument(
        "--split",
        choices=("val", "train", "all"),
        help="with the run's own data: which images to score (default val); other data is scored whole",
    )
    p.add_argument("--top-losses", type=int, default=16, help="misclassified images in top_losses.png/.csv")
    _add_inference_flags(p)
    p.set_defaults(func=commands["evaluate"])
    formats = list(EXPORT_FORMATS.values())
    p = sub.add_parser("export", help=f"export a run's best model: {', '.join(formats[:-1])} or {formats[-1]}")
    p.add_argument("--run", required=True, help="a training run folder")
    p.add_argument(
        "--format",
        required=True,
        help="; ".join(f"{name}: {what}" for name, what in EXPORT_FORMATS.items()),
    )
    p.add_argument(
        "--out", help="file to write (default RUN/best.onnx, RUN/best.xml, RUN/best.pt2 or the folder RUN/hub)"
    )
    p.add_argument(
        "--with-preprocessing",
        action="store_true",
        help="onnx, fp32 (not with --int8): take uint8 [N, H, W, 3] images of any size; resize and normalise "
        "inside the graph",
    )
    p.add_argument(
        "--probabilities",
        action="store_true",
        help="the softmax in the graph: output class probabilities, not logits (recorded in the file, which "
        "serve reads; a multi-label model's sigmoid always is)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="onnx, openvino: int8 static quantization of the network, calibrated on training images (not with "
        "--with-preprocessing or --probabilities: it takes the resized, normalised batch and gives logits)",
    )
    p.add_argument(
        "--max-accuracy-drop",
        type=finite,
        default=1.0,
        help="--int8, openvino: refuse when the val accuracy falls more than this many points below fp32's (default 1)",
    )
    p.add_argument("--calibration-images", type=int, default=128, help="--int8: training images to calibrate on")
    p.set_defaults(func=commands["export"])
    p = sub.add_parser("push", help="upload a run's best model to the Hugging Face Hub as a timm model with its card")
    p.add_argument("run", help="a training run folder")
    p.add_argument("--repo", required=True, help="the Hub repository, ORG/NAME (created if it does not exist)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", help="the branch to commit to (created if missing; default main)")
    p.set_defaults(func=commands["push"])
    p = sub.add_parser("serve", help="serve a trained model over HTTP: POST /predict, with dynamic batching")
    _add_serve_flags(p)
    p.set_defaults(func=commands["serve"])
    p = sub.add_parser("report", help="rebuild RUN/report.html, one self-contained page about the run")
    p.add_argument("run", help="a training run folder (or a bench folder)")
    p.set_defaults(func=commands["report"])
    p = sub.add_parser("compare", help="runs side by side: settings that differ, curves on shared axes, metrics")
    p.add_argument("runs", nargs="+", metavar="RUN", help="two or more training run folders")
    p.add_argument("--out", default="compare.html", help="the page to write (default compare.html)")
    p.set_defaults(func=commands["compare"])
    return parser
