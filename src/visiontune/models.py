"""Build any torchvision classifier with a new head for the data set's classes.

The model is built with its 1000-class ImageNet head (so pretrained weights
load unchanged), then the last 1000-way layer -- a Linear everywhere except
SqueezeNet's 1x1 Conv2d -- is replaced by a fresh one for ``num_classes``.
GoogLeNet and Inception are built without auxiliary heads so every model
returns a plain logits tensor. Weights: ``DEFAULT``, a torchvision weights
name, ``none``, or a local ``.pth`` (read with ``weights_only=True``) or
``.safetensors`` state_dict of the plain model.
"""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import torch
import torchvision
from torch import nn

from visiontune.config import UserError

IMAGENET_CLASSES = 1000


def model_names() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def _resolve_weights(name: str, weights: str):
    if weights.lower() == "none" or Path(weights).suffix in (".pth", ".pt", ".safetensors"):
        return None
    enum = torchvision.models.get_model_weights(name)
    if weights == "DEFAULT":
        return enum.DEFAULT
    try:
        return enum[weights]
    except KeyError:
        names = ", ".join(["DEFAULT", *enum.__members__, "none"])
        raise UserError(f"unknown weights {weights!r} for {name}; choose one of: {names}, "
                        "or a path to a .pth/.safetensors file") from None


def _head(model: nn.Module) -> tuple[nn.Module, str]:
    """The last layer producing the 1000 ImageNet logits, and its dotted name."""
    found = None
    for qual, mod in model.named_modules():
        if (isinstance(mod, nn.Linear) and mod.out_features == IMAGENET_CLASSES) or (
                isinstance(mod, nn.Conv2d) and mod.out_channels == IMAGENET_CLASSES):
            found = (mod, qual)
    if found is None:
        raise RuntimeError("no 1000-way classification layer found")
    return found


def replace_head(model: nn.Module, num_classes: int) -> str:
    """Swap the ImageNet head for a new ``num_classes`` one; return its name."""
    old, qual = _head(model)
    parent_name, _, attr = qual.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, device=old.weight.device)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, kernel_size=old.kernel_size, device=old.weight.device)
    setattr(parent, attr, new)
    if hasattr(model, "num_classes"):
        model.num_classes = num_classes
    return qual


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """Read a state_dict without unpickling arbitrary objects."""
    if not Path(path).is_file():
        raise UserError(f"weights file not found: {path}")
    from visiontune.checkpoint import load_error

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        with warnings.catch_warnings():  # torch's advice to retry unsafely must not reach the user
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle refusals, truncation, wrong format: all user errors here
        raise UserError(f"cannot load weights from {path} safely: {load_error(e)}") from None
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise UserError(f"{path} holds a {type(state).__name__}, not a state_dict (names -> tensors); "
                        "save model.state_dict()")
    return state


def _download_error(weights, e: Exception) -> UserError:
    filename = Path(weights.url).name
    cache = Path(torch.hub.get_dir()) / "checkpoints" / filename
    return UserError(f"cannot download {weights} ({filename}): {e.__class__.__name__}; "
                     f"put the file at {cache}, or pass --weights none or --weights PATH")


def build_model(name: str, num_classes: int, weights: str = "DEFAULT", freeze_backbone: bool = False) -> nn.Module:
    """A torchvision classifier with a fresh ``num_classes`` head."""
    if name not in model_names():
        raise UserError(f"unknown model {name!r}; see `visiontune models` for the {len(model_names())} names")
    resolved = _resolve_weights(name, weights)
    builder = torchvision.models.get_model_builder(name)
    kwargs = {"aux_logits": False} if "aux_logits" in inspect.signature(builder).parameters else {}
    if name in ("googlenet", "inception_v3") and resolved is None:
        kwargs["init_weights"] = True  # silences a torchvision warning; same as its default
    try:
        model = builder(weights=resolved, **kwargs)
    except OSError as e:  # urllib's URLError and socket failures are OSErrors
        if resolved is None:
            raise
        raise _download_error(resolved, e) from None
    head = replace_head(model, num_classes)
    if resolved is None and weights.lower() != "none":
        try:
            model.load_state_dict(load_state_file(weights))
        except RuntimeError as e:  # missing/unexpected keys or shape mismatches
            raise UserError(f"{weights} does not fit {name} with {num_classes} classes: "
                            f"{str(e).splitlines()[1].strip()}") from None
    if freeze_backbone:
        for pname, p in model.named_parameters():
            p.requires_grad = pname.startswith(head + ".")
    return model


def ensure_weights(name: str, weights: str) -> None:
    """Download torchvision weights into the hub cache now, once, before workers start."""
    resolved = _resolve_weights(name, weights)
    if resolved is None:
        return
    target = Path(torch.hub.get_dir()) / "checkpoints" / Path(resolved.url).name
    if target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(resolved.url, str(target))
    except OSError as e:
        raise _download_error(resolved, e) from None


def check_input(model: nn.Module, name: str, image_size: int, batch_size: int) -> None:
    """One dry forward of a blank image before any work: refuse, in one line, an input size too small
    for the model, and a per-process batch that leaves BatchNorm one value per channel to train on.

    Eval mode and no RNG draw, so the run that follows is unchanged.
    """
    per_channel: list[int] = []  # values per channel each BatchNorm sees for one image
    hooks = [m.register_forward_pre_hook(lambda _m, args: per_channel.append(args[0].shape[2:].numel()))
             for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    training = model.training
    try:
        with torch.inference_mode():
            model.eval()(torch.zeros(1, 3, image_size, image_size))
    except RuntimeError as e:
        raise UserError(f"--image-size {image_size} is too small for {name} ({str(e).splitlines()[0][:120]}); "
                        "use a larger --image-size") from None
    finally:
        for h in hooks:
            h.remove()
        model.train(training)
    if per_channel and batch_size * min(per_channel) < 2:
        raise UserError(f"--batch-size {batch_size} is too small for {name} at --image-size {image_size}: its "
                        "BatchNorm layers need more than one value per channel to train; use --batch-size 2 or "
                        "more (per process)")
