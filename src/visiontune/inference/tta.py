"""Test-time augmentation for ``predict`` and ``evaluate``: ``--tta flip`` or ``flip+crop``.

The model is wrapped so that every batch it sees is also seen mirrored (and,
with ``flip+crop``, as its central 7/8 enlarged back to full size, plain and
mirrored); the class probabilities of the views are averaged. The wrapper
returns the log of that average, which is a valid set of logits: softmax gives
the averaged probabilities back, and cross-entropy on it is the log loss of
the averaged prediction. All views go through the model as one batch, on the
device, after normalisation. A multi-label model's per-class sigmoid
probabilities are averaged instead, and the wrapper returns their logit.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchvision.transforms.v2 import functional as TF

from visiontune.tasks import SINGLE_LABEL, Task

TTA_MODES = ("none", "flip", "flip+crop")
CROP = 7 / 8


def views(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The batches the model sees for one input batch ``x`` [N, C, H, W]."""
    out = [x, x.flip(-1)]
    if mode == "flip+crop":
        h, w = x.shape[-2:]
        ch, cw = round(h * CROP), round(w * CROP)
        crop = TF.resized_crop(x, (h - ch) // 2, (w - cw) // 2, ch, cw, [h, w], antialias=True)
        out += [crop, crop.flip(-1)]
    return out


class TTA(nn.Module):
    def __init__(self, model: nn.Module, mode: str, task: Task = SINGLE_LABEL):
        super().__init__()
        self.model, self.mode, self.task = model, mode, task

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vs = views(x, self.mode)
        return self.task.averaged(self.model(torch.cat(vs)).view(len(vs), x.shape[0], -1))


def wrap(model: nn.Module, mode: str, task: Task = SINGLE_LABEL) -> nn.Module:
    """``model`` itself for ``none``, else the averaging wrapper (in eval mode, like the model)."""
    if mode not in TTA_MODES:
        from visiontune.errors import UserError

        raise UserError(f"--tta must be one of {', '.join(TTA_MODES)}, got {mode!r}")
    return model if mode == "none" else TTA(model, mode, task).eval()


def wrap_loaded(loaded, mode: str):
    """An ``inference.LoadedModel`` whose model is wrapped for ``mode``."""
    return dataclasses.replace(loaded, model=wrap(loaded.model, mode, loaded.info.task))
