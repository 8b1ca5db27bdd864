"""One ``ModelSpec`` per model source: torchvision, timm and the Hugging Face Hub (through timm).

``--model NAME`` is a torchvision classifier, ``timm/NAME[.TAG]`` any name
``timm.list_models()`` knows, or ``hf-hub:ORG/NAME`` a timm model on the Hub.
A spec says how to build the model with a head for ``num_classes`` (timm sizes
it itself through ``create_model(num_classes=K)``; torchvision's 1000-way layer
is swapped), which modules are that head (timm's ``get_classifier()`` and
``pretrained_cfg['classifier']``), and the preprocessing its pretrained weights
expect (size, mean/std, interpolation: timm's pretrained config, torchvision's
``weights.transforms()``). Local weights (``--weights PATH``) load everything
that fits; a head of another shape is re-initialised and named, any other mismatch
is an error. Nothing is unpickled: safetensors or ``weights_only``. timm's and the
Hub's specifics live in ``timm_models``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision
from torch import nn

from visiontune.errors import UserError
from visiontune.models.spec import IMAGENET_CLASSES, UNKNOWN, ModelSpec, Preprocess, is_weights_file
from visiontune.models.statedict import load_fitting, load_state_file


def get_spec(name: str) -> ModelSpec:
    """The spec of ``--model NAME``, or a ``UserError`` saying where the names are."""
    if name.startswith(("hf-hub:", "timm/")):
        from visiontune.models import timm_models  # timm is imported only for its models

        return timm_models.spec(name)
    if name not in torchvision_names():
        raise UserError(UNKNOWN.format(name))
    t = torchvision.models.get_model_weights(name).DEFAULT.transforms()
    return ModelSpec(
        name,
        "torchvision",
        name,
        Preprocess(
            t.crop_size[0], tuple(t.mean), tuple(t.std), t.interpolation.value, t.crop_size[0] / t.resize_size[0]
        ),
    )


def input_view(name: str, interpolation: str | None = None, crop_pct: float | None = None) -> tuple[str, float | None]:
    """(interpolation, crop_pct) a run of model ``name`` resizes with (``decode.resize_uint8``).

    The interpolation is ``interpolation`` (``--interpolation``) or the pretrained config's; the crop is
    ``crop_pct`` (``--crop-pct``) or, for timm and Hub models, their config's eval crop (timm's own eval
    view). torchvision's models keep the reference job's squash to size (crop None) unless asked.
    """
    spec = get_spec(name)
    crop = crop_pct if crop_pct is not None else None if spec.source == "torchvision" else spec.preprocess.crop_pct
    return interpolation or spec.preprocess.interpolation, crop


def torchvision_names() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def _torchvision_weights(name: str, weights: str):
    if weights.lower() == "none" or is_weights_file(weights):
        return None
    enum = torchvision.models.get_model_weights(name)
    if weights == "DEFAULT":
        return enum.DEFAULT
    try:
        return enum[weights]
    except KeyError:
        names = ", ".join(["DEFAULT", *enum.__members__, "none"])
        raise UserError(
            f"unknown weights {weights!r} for {name}; choose one of: {names}, or a path to a .pth/.safetensors file"
        ) from None


def replace_head(model: nn.Module, num_classes: int) -> str:
    """Swap torchvision's last 1000-way layer (Linear; SqueezeNet's 1x1 Conv2d) for a new one; its name."""
    qual = [
        q
        for q, m in model.named_modules()
        if (isinstance(m, nn.Linear) and m.out_features == IMAGENET_CLASSES)
        or (isinstance(m, nn.Conv2d) and m.out_channels == IMAGENET_CLASSES)
    ][-1]
    old = model.get_submodule(qual)
    parent_name, _, attr = qual.rpartition(".")
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, device=old.weight.device)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, kernel_size=old.kernel_size, device=old.weight.device)
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    if hasattr(model, "num_classes"):
        model.num_classes = num_classes
    return qual


def head_names(model: nn.Module) -> list[str]:
    """The classifier's module names, as the library names them."""
    if hasattr(model, "get_classifier"):  # timm: get_classifier(), plus pretrained_cfg's (distilled models have two)
        modules = dict(model.named_modules())
        listed = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ()
        found = {n for n, m in modules.items() if m is model.get_classifier()}
        return sorted(found | {n for n in ([listed] if isinstance(listed, str) else listed) if n in modules})
    return [model.__dict__["_visiontune_head"]]


def _build_torchvision(spec: ModelSpec, num_classes: int, weights: str) -> nn.Module:
    resolved = _torchvision_weights(spec.arch, weights)
    builder = torchvision.models.get_model_builder(spec.arch)
    kwargs = {"aux_logits": False} if "aux_logits" in inspect.signature(builder).parameters else {}
    if spec.arch in ("googlenet", "inception_v3") and resolved is None:
        kwargs["init_weights"] = True  # silences a torchvision warning; same as its default
    try:
        model = builder(weights=resolved, **kwargs)
    except OSError as e:  # urllib's URLError and socket failures are OSErrors
        raise _download_error(resolved, e) from None
    model.__dict__["_visiontune_head"] = replace_head(model, num_classes)  # plain attribute, not a module
    return model


def _download_error(weights, e: Exception) -> UserError:
    filename = Path(weights.url).name
    cache = Path(torch.hub.get_dir()) / "checkpoints" / filename
    return UserError(
        f"cannot download {weights} ({filename}): {e.__class__.__name__}; "
        f"put the file at {cache}, or pass --weights none or --weights PATH"
    )


def depthwise_with_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has depthwise convolutions (as many groups as input channels) and BatchNorm: the
    MobileNet, MnasNet, EfficientNet and ShuffleNet families. On a CPU these train 1.1-1.5x faster in
    channels-last memory, where plain convolutions (ResNet), grouped ones (ResNeXt) and ConvNeXt (depthwise,
    with LayerNorm) were as fast or slower (benchmarks/channels_last.py)."""
    modules = list(model.modules())
    depthwise = any(isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels for m in modules)
    return depthwise and any(isinstance(m, nn.BatchNorm2d) for m in modules)


def train_head_only(model: nn.Module) -> None:
    """Train only the head."""
    heads = tuple(h + "." for h in head_names(model))
    for pname, p in model.named_parameters():
        p.requires_grad = pname.startswith(heads)


def build_model(
    name: str,
    num_classes: int,
    weights: str = "DEFAULT",
    freeze_backbone: bool = False,
    *,
    image_size: int | None = None,
    head_may_differ: bool = True,
    say: Callable[[str], None] = print,
) -> nn.Module:
    """``name`` with a fresh ``num_classes`` head; ``weights`` DEFAULT, none, a torchvision name or a file.
    A model made for one input size (a ViT) is built for ``image_size`` (``ModelSpec.resized_from``)."""
    spec = get_spec(name)
    named = "none" if is_weights_file(weights) else weights  # a file is loaded below, into any source's model
    from visiontune.models import timm_models  # timm itself is imported only when a timm model is built

    if spec.source == "torchvision":
        model = _build_torchvision(spec, num_classes, named)
    else:
        model = timm_models.build(spec, num_classes, named, image_size)
    if is_weights_file(weights):
        state = load_state_file(weights)
        if spec.preprocess.fixed_size:
            fitted = timm_models.fit_positions(model, state)
            if fitted is not state:
                say(f"visiontune: {weights}: position embeddings resampled to {image_size} px")
            state = fitted
        load_fitting(model, state, weights, head_names(model), head_may_differ, say)
    if freeze_backbone:
        train_head_only(model)
    return model


def resized_from(name: str, image_size: int) -> int | None:
    """The pretrained input size that model ``name`` is rebuilt from for ``image_size``, or None."""
    return get_spec(name).resized_from(image_size)


def ensure_weights(name: str, weights: str) -> None:
    """Download torchvision weights into the hub cache now, once, before workers start."""
    spec = get_spec(name)  # an unknown or unreachable name: one error line here, not one per worker
    resolved = _torchvision_weights(spec.arch, weights) if spec.source == "torchvision" else None
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
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: per_channel.append(args[0].shape[2:].numel()))
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    training = model.training
    try:
        with torch.inference_mode():
            model.eval()(torch.zeros(1, 3, image_size, image_size))
    except (RuntimeError, AssertionError) as e:  # timm checks sizes with assertions
        raise UserError(
            f"--image-size {image_size} is too small for {name} ({str(e).splitlines()[0][:120]}); "
            "use a larger --image-size"
        ) from None
    finally:
        for h in hooks:
            h.remove()
        model.train(training)
    if per_channel and batch_size * min(per_channel) < 2:
        raise UserError(
            f"--batch-size {batch_size} is too small for {name} at --image-size {image_size}: its "
            "BatchNorm layers need more than one value per channel to train; use --batch-size 2 or "
            "more (per process)"
        )
