"""The modules a task's model ends in, beyond torch's own: a regression's map back to the targets' units.
A module of its own so that the task modules define no ``nn.Module`` at import (they import torch on first
use, ``_torch``)."""

from __future__ import annotations

import torch
from torch import nn


class Destandardise(nn.Module):
    """The standardised output back in the targets' units: ``z * std + mean``."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.std + self.mean
