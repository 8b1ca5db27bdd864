"""Activation checkpointing (``--grad-checkpointing``): each block's activations are recomputed in the
backward pass instead of kept from the forward one, trading about a third more compute for memory.

timm models use their own switch (``set_grad_checkpointing``, non-reentrant by timm's default).
torchvision models, and timm models that refuse the switch, have each block run under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: a block is a module with parameters that
is a child of an ``nn.Sequential``/``ModuleList``/``ModuleDict`` and no such container itself
(ResNet's ``BasicBlock``/``Bottleneck``, ConvNeXt's ``CNBlock``, ViT's ``EncoderBlock``, EfficientNet's
``MBConv``...). The block's class is swapped for a subclass whose ``forward`` checkpoints (DataParallel's
replicas and deep copies keep it; names and state dicts do not change). Only a forward that records
gradients is checkpointed: evaluation runs as before.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from visiontune.errors import UserError

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@cache
def _checkpointed(cls: type) -> type:
    class Checkpointed(cls):
        def forward(self, *args, **kwargs):
            if not (self.training and torch.is_grad_enabled()):
                return super().forward(*args, **kwargs)
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)

    Checkpointed.__name__ = Checkpointed.__qualname__ = cls.__name__  # repr and messages read as before
    Checkpointed.visiontune_checkpointed = True
    return Checkpointed


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` that ``--grad-checkpointing`` runs under a checkpoint (see the module)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module, in_container: bool) -> None:
        for child in module.children():
            is_container = isinstance(child, _CONTAINERS)
            if in_container and not is_container and any(True for _ in child.children()):
                found.append(child)  # a block: its insides run under its checkpoint
            else:
                visit(child, is_container)

    visit(model, isinstance(model, _CONTAINERS))
    return found


def enable(model: nn.Module, name: str) -> str:
    """Turn on activation checkpointing in ``model`` (``--model name``); say how, in a few words."""
    if hasattr(model, "set_grad_checkpointing"):
        try:
            model.set_grad_checkpointing(True)
            return "timm's set_grad_checkpointing"
        except (AssertionError, NotImplementedError):  # a timm model without it: its blocks, as torchvision's
            pass
    found = blocks(model)
    if not found:
        raise UserError(
            f"--grad-checkpointing checkpoints a model's blocks, and {name} has none (a plain stack of "
            "layers); drop the flag, or lower --batch-size to save memory"
        )
    for block in found:
        if not getattr(block, "visiontune_checkpointed", False):
            block.__class__ = _checkpointed(type(block))
    return f"{len(found)} blocks under torch.utils.checkpoint"
