"""LoRA adapters (``--lora R``) through Hugging Face ``peft``, and the merged weights of an adapted model.

``add_adapters`` injects peft's LoRA layers into the model in place (``peft.inject_adapter_in_model``:
no ``PeftModel`` wrapper, so every module keeps its name and the head stays where ``head_names``
finds it), freezes everything else and leaves the new head trainable. The target modules are chosen
per model family unless given: a transformer's attention ``qkv``/``proj`` and MLP ``fc1``/``fc2`` (timm's
ViT, DeiT, Swin, EVA...), as the LoRA paper and peft's examples adapt; in any other model (convnets)
every dense ``Conv2d`` (not depthwise) and ``Linear`` layer. The head is never a target.

``merged_state_dict`` is the plain model's state dict with each adapter added into its layer
(``W + scale * B A``, peft's ``get_delta_weight``, what ``merge_and_unload`` adds), computed layer by
layer on the CPU copies (``merged``: also from a sharded model's gathered state dict): the best model
file loads into the plain model, so every later command works unchanged. ``trained_keys`` names what a
checkpoint must hold: the parameters that train (adapters, head) and the buffers (BatchNorm statistics
move while the base is frozen).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from visiontune.errors import UserError

ADAPTER = "default"  # peft's adapter name
_TRANSFORMER = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")  # timm's Attention and Mlp


def _in(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _adaptable(model: nn.Module) -> dict[str, nn.Module]:
    """Layers peft's LoRA can adapt here: Linear and dense Conv2d, outside nn.MultiheadAttention
    (whose forward reads ``out_proj.weight`` directly, so an adapter there would be skipped)."""
    inside_mha = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    return {
        n: m
        for n, m in model.named_modules()
        if (isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.groups == 1))
        and not any(n.startswith(p + ".") for p in inside_mha)
    }


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule for a list of target names


def default_targets(model: nn.Module, heads: Iterable[str]) -> list[str]:
    """The module names ``--lora`` adapts in ``model`` when ``--lora-targets`` is not given."""
    layers = {n: m for n, m in _adaptable(model).items() if not _in(n, heads)}
    if any(_matches(n, "attn.qkv") for n in layers):  # a transformer: its attention and MLP layers
        return [n for n in layers if any(_matches(n, t) for t in _TRANSFORMER)]
    return list(layers)


def resolve_targets(model: nn.Module, heads: Iterable[str], targets: str | None, model_name: str) -> list[str]:
    """The full names of the layers to adapt: ``targets`` (comma-separated names or name suffixes, peft's
    rule) or the family default; a ``UserError`` when nothing matches."""
    heads = tuple(heads)
    if targets is None:
        chosen = default_targets(model, heads)
        if not chosen:
            raise UserError(f"--lora: {model_name} has no Linear or Conv2d layer to adapt; pick another --model")
        return chosen
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    layers = {n for n in _adaptable(model) if not _in(n, heads)}
    chosen = [n for n in layers if any(_matches(n, t) for t in wanted)]
    unmatched = [t for t in wanted if not any(_matches(n, t) for n in layers)]
    if unmatched or not chosen:
        examples = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in layers})[:12])
        raise UserError(
            f"--lora-targets {','.join(unmatched) or targets} matches no Linear or Conv2d layer of {model_name} "
            f"(the head excluded); its layers end in names such as: {examples}"
        )
    return sorted(chosen, key=list(dict(model.named_modules())).index)


def add_adapters(
    model: nn.Module,
    rank: int,
    heads: Iterable[str],
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: list[str] | None = None,
) -> nn.Module:
    """Inject rank-``rank`` LoRA adapters into ``targets`` (full module names, default: the family's);
    only they and the ``heads`` train afterwards. ``alpha`` defaults to ``rank`` (peft's scale 1)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise UserError("--lora needs Hugging Face peft: pip install 'visiontune[lora]'") from None

    heads = tuple(heads)
    targets = targets if targets is not None else default_targets(model, heads)
    config = LoraConfig(
        r=rank, lora_alpha=rank if alpha is None else alpha, lora_dropout=dropout, target_modules=targets
    )
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():  # peft froze everything but the adapters; the new head trains too
        if _in(name.rpartition(".")[0], heads):
            p.requires_grad_(True)
    return model


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The adapted layers of ``model`` by name (empty for a plain model)."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_adapters(model: nn.Module) -> bool:
    return any(".lora_" in n for n, _ in model.named_parameters())


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every adapter merged into its layer, under the plain model's names
    (CPU copies)."""
    with torch.no_grad():
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    return merged(model, state)


def merged(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s whole state dict, adapters in it, as CPU tensors: a sharded model's gathered
    one) with each adapter added into its layer by peft's own ``get_delta_weight``, under the plain
    model's names. ``model`` only says which layers are adapted and how (their scale, kernel, groups)."""
    out = dict(state)
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            a, b = (out.pop(f"{name}.lora_{w}.{ADAPTER}.weight") for w in "AB")
            weight = out.pop(f"{name}.base_layer.weight")
            out[f"{name}.weight"] = weight + _delta(layer, a, b).to(weight.dtype)
            if f"{name}.base_layer.bias" in out:
                out[f"{name}.bias"] = out.pop(f"{name}.base_layer.bias")
    return {k: v for k, v in out.items() if ".lora_" not in k}


def _delta(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """peft's ``get_delta_weight`` of ``layer`` computed from ``a`` and ``b``, lent to its adapter's layers
    for the call (the layer's own may be shards of a sharded model, or on a GPU)."""
    lent = [(layer.lora_A[ADAPTER], a), (layer.lora_B[ADAPTER], b)]
    held = [m._parameters["weight"] for m, _ in lent]
    try:
        for m, t in lent:
            m._parameters["weight"] = t
        return layer.get_delta_weight(ADAPTER)
    finally:
        for (m, _), t in zip(lent, held):
            m._parameters["weight"] = t


def trained_keys(model: nn.Module) -> set[str]:
    """State-dict keys of ``model`` (as wrapped: DDP's ``module.`` kept) that a LoRA run's checkpoint
    holds: the trainable parameters and every buffer; the frozen base comes from ``--weights`` again."""
    return {n for n, p in model.named_parameters() if p.requires_grad} | {n for n, _ in model.named_buffers()}


def size(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters) of ``model``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
