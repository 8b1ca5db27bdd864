"""The optimizer, the loss and the freezing a resolved config asks for, for a built model.

The presets that chose these values live in ``settings.presets``; this module
only builds them. The lr schedule and the EMA step in ``schedule.Stepper``; every
per-step rule counts optimizer steps, so a resume, which restores that count,
repeats it exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from visiontune.tasks import SINGLE_LABEL, Task
from visiontune.training.schedule import Stepper


def warm_up() -> None:
    """Import what building the optimizer imports: ``torch._dynamo``, which torch imports on an optimizer's
    first ``add_param_group`` (wrapped in dynamo's ``disable``), and which the ``visiontune`` command's start
    leaves out of torchvision's import (``visiontune.imports``). About a second of one core: the trainer spends
    it while a forked child builds the image cache, and a job's launching process before its workers are
    forked, so that they need not each import it."""
    import torch._dynamo  # noqa: F401


def _in_head(name: str, heads: tuple[str, ...]) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def build_optimizer(model: nn.Module, cfg, lr: float, heads: tuple[str, ...]) -> torch.optim.Optimizer:
    """SGD or AdamW over the trainable parameters, in groups by (head or backbone) x (decay or not).

    AdamW decays no norm weights and biases (the 1-d tensors), as timm and torchvision's
    references do; SGD decays everything, as the reference job does. The backbone's lr is
    ``lr * backbone_lr_mult``. One group when nothing differs, as the reference job has.
    """
    groups: dict[tuple[float, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mult = 1.0 if _in_head(name, heads) else cfg.backbone_lr_mult
        decay = 0.0 if cfg.optimizer == "adamw" and p.ndim <= 1 else cfg.weight_decay
        groups.setdefault((lr * mult, decay), []).append(p)
    params = [{"params": ps, "lr": g_lr, "weight_decay": wd} for (g_lr, wd), ps in groups.items()]
    if cfg.optimizer == "adamw":
        # fused: one multi-tensor kernel per step; torch's default on a CPU, a loop over the tensors,
        # took over half as long as resnet18's forward and backward at 32 px (SGD's step: a tenth).
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, fused=True)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def freeze_backbone_during(
    model: nn.Module, heads: tuple[str, ...], optimizer: torch.optim.Optimizer, frozen: Callable[[], bool]
) -> None:
    """Hold everything but the head still while ``frozen()``: no updates, BatchNorm statistics fixed.

    The parameters keep ``requires_grad`` (DDP needs the same set every step): a step pre-hook
    drops their gradients, so the optimizer leaves them and their state untouched. The
    backbone's norm layers run in eval mode, so their running statistics do not move either.
    """
    backbone = [p for n, p in model.named_parameters() if not _in_head(n, heads)]

    def drop_grads(*_):
        if frozen():
            for p in backbone:
                p.grad = None

    optimizer.register_step_pre_hook(drop_grads)
    keep_norms_still(model, heads, frozen)


def keep_norms_still(model: nn.Module, heads: tuple[str, ...], frozen: Callable[[], bool]) -> None:
    """Batch norms outside the head run in eval mode whenever ``frozen()`` (the engine sets train mode)."""

    def to_eval(module, _args):
        if frozen() and module.training:
            module.train(False)

    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not _in_head(name, heads):
            m.register_forward_pre_hook(to_eval)


def criterion(
    cfg, task: Task = SINGLE_LABEL, class_weights: torch.Tensor | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The training loss: the mean over readable samples (engine's contract), or None for the reference
    job's own cross entropy (multi-label: binary cross-entropy) when neither label smoothing, mixed
    labels nor class weights change it; then the task's ``smoothed_loss``.

    ``class_weights`` ([K], ``training.imbalance``) scale each sample's loss by its class's weight (a soft
    target: by its mix of the classes' weights); the sum is still divided by the readable count, so with
    weights whose mean over the train split is 1 the loss keeps the plain one's scale. On multi-label
    data they are the binary cross-entropy's ``pos_weight``.
    """
    if not (cfg.label_smoothing or cfg.mixup or cfg.cutmix) and class_weights is None:
        return None
    return task.smoothed_loss(cfg.label_smoothing, class_weights)


def optimization(cfg, model: nn.Module, lr: float, steps_per_epoch: int) -> tuple[torch.optim.Optimizer, Stepper]:
    """The optimizer and its ``Stepper`` for the plain model, with the freezing ``cfg`` asks for.

    The head is the classifier the model's spec names (``models.head_names``). Call before the
    model is wrapped; attach the EMA with ``Stepper.attach_ema`` after.
    """
    from visiontune.models.build import head_names

    heads = tuple(head_names(model))
    optimizer = build_optimizer(model, cfg, lr, heads)
    stepper = Stepper(optimizer, cfg, steps_per_epoch)
    if cfg.freeze_backbone:  # the backbone never trains: its norms never update their statistics either
        keep_norms_still(model, heads, lambda: True)
    elif cfg.freeze_epochs:
        freeze_backbone_during(model, heads, optimizer, lambda: stepper.frozen)
    return optimizer, stepper
