"""Per-step training loss and learning rate for the trackers (``--log-with``).

The loss of a step is the change in the epoch's running totals (loss sum and
images, kept on the device by ``engine.train_one_epoch``), so recording it
costs no host sync; the values are read back and handed to
``accelerator.log`` every ``FLUSH`` steps and at each epoch end: one sync per
``FLUSH`` steps instead of one per step. The loss is the main process's share
of the global batch (trackers log from the main process only); the learning
rate is the one the step used. Steps count batches since the start of training.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

FLUSH = 10


class StepLog:
    def __init__(self, accelerator: Accelerator, optimizer: torch.optim.Optimizer, per_epoch: int):
        self.accelerator, self.optimizer, self.per_epoch = accelerator, optimizer, per_epoch
        self.lr = optimizer.param_groups[0]["lr"]  # what the next step will use
        self.epoch, self.previous = None, None
        self.pending: list[tuple[int, float, torch.Tensor]] = []

    def record(self, epoch: int, batch: int, totals: torch.Tensor) -> None:
        """After batch ``batch`` (1-based) of ``epoch``, with the epoch's running ``totals``."""
        now = totals[[0, 2]].clone()  # loss sum, images; a copy: the loop adds to ``totals`` in place
        if epoch != self.epoch:  # a new epoch's totals start from zero; a resumed one's from its checkpoint
            self.epoch, self.previous = epoch, torch.zeros_like(now) if batch == 1 else None
        if self.previous is not None:
            self.pending.append((epoch * self.per_epoch + batch, self.lr, now - self.previous))
        self.previous, self.lr = now, self.optimizer.param_groups[0]["lr"]
        if len(self.pending) >= FLUSH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        values = torch.stack([d for _, _, d in self.pending]).tolist()  # the one host sync
        for (step, lr, _), (loss_sum, images) in zip(self.pending, values):
            self.accelerator.log({"train/step_loss": loss_sum / max(images, 1), "train/lr": lr}, step=step)
        self.pending = []
