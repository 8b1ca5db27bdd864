"""An exponential moving average of a model's weights (``--ema DECAY``), torch's AveragedModel inside.

After every optimizer step ``ema = decay * ema + (1 - decay) * weights`` for every
parameter and buffer (BatchNorm statistics too, so the average is a model that can
be evaluated as it is). The first update copies the weights. Its state is plain
tensors, so checkpoints keep it with ``weights_only`` loading and a resume
continues the average exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        # ``model`` is the plain (unwrapped) model: its parameters are the ones DDP keeps equal everywhere.
        self.model, self.decay = model, decay
        self.average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.average.requires_grad_(False)

    def update(self) -> None:
        self.average.update_parameters(self.model)

    @property
    def module(self) -> nn.Module:
        """The averaged model, ready to evaluate or save (its plain state dict has the model's keys)."""
        return self.average.module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.average.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.average.load_state_dict(state)
