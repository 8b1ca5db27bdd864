"""Command-line flags made from ``TrainConfig``, and an argparse that complains in one line.

Training flags default to "not given" so that the precedence is explicit:
``TrainConfig`` defaults, then ``--config FILE``, then the flags on the command
line. A ``Literal[...]`` field becomes a flag with argparse ``choices``; a bool
field ``--x/--no-x``. ``validate`` checks the same choices for values that come
from a config file.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from visiontune.config import TrainConfig, UserError, choices, load_config_file, validate


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _workers(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {text!r}") from None


# How a TrainConfig field's annotation is parsed from the command line (bool fields are --x/--no-x).
_PARSERS = {"str": str, "str | None": str, "int": int, "int | None": int, "float": float, "float | None": float}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose complaints are a ``UserError``: one line and exit 2, like every other input error."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, --field-name, with the field's help and default."""
    p.add_argument("--config", help="TOML file or an earlier run's config.json; flags given here win")
    allowed = choices()
    for f in fields(TrainConfig):
        flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type == "bool":
            help_text += " (default on)" if f.default else ""
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
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
        if f.name in allowed:
            p.add_argument(flag, choices=allowed[f.name], default=argparse.SUPPRESS, help=help_text)
            continue
        kind = _workers if f.name == "num_workers" else _PARSERS[f.type]
        p.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the config file, then the flags given."""
    names = {f.name for f in fields(TrainConfig)}
    merged = load_config_file(args.config) if getattr(args, "config", None) else {}
    merged.update({k: v for k, v in vars(args).items() if k in names})
    if merged.get("init_from"):  # continuing an earlier run: its model, size and resize unless said otherwise
        from visiontune.runinfo import read_run

        earlier = read_run(merged["init_from"])
        merged = {
            "model": earlier.model,
            "image_size": earlier.image_size,
            "interpolation": earlier.interpolation,
            **merged,
        }
    return validate(TrainConfig(**merged))
