"""timm and Hugging Face Hub models: their specs (from timm's pretrained config, or the Hub
model's ``config.json``), building them with a ``num_classes`` head (timm sizes it itself), and
the one line a Hub failure gets (offline, not cached, no such repository). timm itself is imported
inside the functions, only when a ``timm/NAME`` or ``hf-hub:ORG/NAME`` model is asked for: it takes a
while to import.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from visiontune.errors import UserError
from visiontune.models.spec import ModelSpec, Preprocess, is_weights_file


def hub_error(name: str, e: Exception) -> UserError:
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(e, RepositoryNotFoundError):
        return UserError(
            f"no model {name!r} on the Hugging Face Hub (or it is private); check the name "
            f"at https://huggingface.co/{name.split(':', 1)[-1].lstrip('/')}"
        )
    todo = (
        "copy that cache from a machine that has it"
        if name.startswith("hf-hub:")
        else "pass --weights none / --weights PATH"
    )  # a Hub model needs its config.json even untrained
    return UserError(
        f"cannot fetch {name} ({e.__class__.__name__}): offline or not in the Hugging Face cache "
        f"{constants.HF_HUB_CACHE} (HF_HOME) nor torch hub's {torch.hub.get_dir()}; run once with "
        f"network access to fill the cache, or {todo}"
    )


@contextlib.contextmanager
def hub_quiet():
    """The hub client logs each retry; the one line that matters is ours."""
    from huggingface_hub.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _preprocess(cfg: dict) -> Preprocess:
    from timm.data import resolve_data_config

    data = resolve_data_config(pretrained_cfg=cfg)
    return Preprocess(
        int(data["input_size"][-1]),
        tuple(data["mean"]),
        tuple(data["std"]),
        str(data["interpolation"]),
        float(data["crop_pct"]),
    )


def spec(name: str) -> ModelSpec:
    """The spec of ``timm/NAME[.TAG]`` or ``hf-hub:ORG/NAME``, or a ``UserError`` saying what is wrong."""
    if name.startswith("hf-hub:"):
        from timm.models import _hub

        try:
            with hub_quiet():
                cfg = _hub.load_model_config_from_hf(name[len("hf-hub:") :])[0]
        except OSError as e:  # hub errors are OSErrors: offline, not cached, no such repository
            raise hub_error(name, e) from None
        return ModelSpec(name, "hf-hub", name, _preprocess(cfg))
    import timm
    from timm.models import get_pretrained_cfg

    arch = name[len("timm/") :]
    if not timm.is_model(arch):
        raise UserError(f"unknown timm model {arch!r}; see `visiontune models --source timm --filter TEXT`")
    try:
        cfg = get_pretrained_cfg(arch)
    except RuntimeError as e:  # an unknown pretrained tag
        raise UserError(f"{name}: {e}") from None
    return ModelSpec(name, "timm", arch, _preprocess(cfg.to_dict() if cfg else {}))


def build(spec: ModelSpec, num_classes: int, weights: str) -> nn.Module:
    """``spec``'s model with a ``num_classes`` head; ``weights`` DEFAULT (pretrained) or none."""
    import timm

    if weights not in ("DEFAULT", "none") and not is_weights_file(weights):
        raise UserError(
            f"--weights for {spec.name} is DEFAULT, none or a .safetensors/.pth path; "
            f"a pretrained tag goes in the name: --model {spec.name}.TAG"
        )
    try:
        with hub_quiet():
            return timm.create_model(spec.arch, pretrained=weights == "DEFAULT", num_classes=num_classes)
    except OSError as e:  # timm fetches through huggingface_hub (or torch hub): all OSErrors
        raise hub_error(spec.name, e) from None
