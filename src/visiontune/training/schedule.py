"""What follows every optimizer step: the lr schedule (linear warm-up, then cosine, linear, step
or constant; or torch's one-cycle) and the EMA update, in ``Stepper``, which stands in the lr scheduler's place for the
engine and the checkpoint. Everything counts optimizer steps, so a resume, which restores that
count, repeats the schedule exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from visiontune.training.ema import EMA, ShardedEMA

STEP_MILESTONES, STEP_GAMMA = (0.5, 0.75), 0.1  # --lr-schedule step: x0.1 at half and three quarters
# --lr-schedule onecycle, fastai's fit_one_cycle defaults: the rise takes a quarter of the run unless a
# warm-up is given, from peak / 25 to the peak, then cosine down to peak / 25e4; momentum moves the other way.
ONECYCLE_RISE, ONECYCLE_DIV, ONECYCLE_FINAL_DIV, ONECYCLE_MOMENTUM = 0.25, 25.0, 1e4, (0.85, 0.95)


def warmup_steps(cfg, steps_per_epoch: int) -> int:
    return cfg.warmup_steps or round(cfg.warmup_epochs * steps_per_epoch)


def frozen_steps(cfg, steps_per_epoch: int) -> int:
    """The optimizer steps of ``--freeze-epochs``' head-only phase (none under --freeze-backbone, where
    the backbone never trains and there is no second phase)."""
    return 0 if cfg.freeze_backbone else cfg.freeze_epochs * steps_per_epoch


def lr_factor(step: int, total: int, warmup: int, schedule: str, frozen: int = 0) -> float:
    """The lr multiplier before optimizer step ``step`` (0-based) of ``total``.

    The first ``frozen`` steps (``--freeze-epochs``: the new head alone) run at the full lr: a warm-up
    protects pretrained weights from a large first update, and those are not moving yet. The warm-up
    starts where the backbone unfreezes, rising linearly to 1 over ``warmup`` steps ((step + 1) /
    warmup, so the first step already learns); then ``schedule`` runs over the remaining steps.
    """
    if step < frozen:
        return 1.0
    step, total = step - frozen, total - frozen
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    if schedule == "linear":
        return max(0.0, 1 - t)
    if schedule == "step":
        return STEP_GAMMA ** sum(t >= m for m in STEP_MILESTONES)
    return 1.0


def one_cycle(optimizer: torch.optim.Optimizer, total: int, warmup: int) -> torch.optim.lr_scheduler.OneCycleLR:
    """torch's ``OneCycleLR`` over ``total`` optimizer steps, peaking at each group's own lr (the head's and
    the backbone's may differ) after ``warmup`` steps (a quarter of the run when 0); SGD's momentum or
    AdamW's beta1 cycles inversely, between the two ``ONECYCLE_MOMENTUM`` values."""
    total = max(total, 2)
    rise = min(max(warmup / total, 1 / total), 1 - 1 / total) if warmup else ONECYCLE_RISE
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=[g["lr"] for g in optimizer.param_groups],
        total_steps=total,
        pct_start=rise,
        anneal_strategy="cos",
        div_factor=ONECYCLE_DIV,
        final_div_factor=ONECYCLE_FINAL_DIV,
        base_momentum=ONECYCLE_MOMENTUM[0],
        max_momentum=ONECYCLE_MOMENTUM[1],
    )


class Stepper:
    """What follows every optimizer step: the lr schedule and the EMA update.

    The engine calls ``step()`` where it would step an lr scheduler, and the checkpoint
    saves ``state_dict()`` (plain tensors and numbers) in the scheduler's place. Its step
    count also says whether the head-only phase of ``--freeze-epochs`` is still on.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg, steps_per_epoch: int):
        total, warm, schedule = cfg.epochs * steps_per_epoch, warmup_steps(cfg, steps_per_epoch), cfg.lr_schedule
        frozen = frozen_steps(cfg, steps_per_epoch)
        if schedule == "onecycle":  # one cycle over the whole run, frozen phase included (overview says so)
            self.scheduler = one_cycle(optimizer, total, warm)
        else:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: lr_factor(s, total, warm, schedule, frozen)
            )
        self.ema_decay, self.ema = cfg.ema, None
        self.freeze_steps = frozen

    def attach_ema(self, model: nn.Module, sharded: bool = False) -> None:
        """Start the EMA from ``model`` (the unwrapped model, on its device), if ``--ema`` asks for one;
        ``sharded``: the model's parameters are split over the processes (each averages its own shards)."""
        if self.ema_decay:
            self.ema = (ShardedEMA if sharded else EMA)(model, self.ema_decay)

    @property
    def steps(self) -> int:
        return self.scheduler.last_epoch

    @property
    def frozen(self) -> bool:
        return self.steps < self.freeze_steps

    def step(self) -> None:
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update()

    def state_dict(self) -> dict:
        return {
            "scheduler": self.scheduler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if "scheduler" not in state:  # a checkpoint written before recipes: a plain scheduler's state
            state = {"scheduler": state, "ema": None}
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
