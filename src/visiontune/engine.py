"""The training and evaluation loops, and ``fit`` that alternates them.

Metrics accumulate as device tensors and are reduced across processes once per
phase, so the hot loop never waits on the GPU for a number (the progress bar
reads them every ``POSTFIX_EVERY`` steps only). Training counts exactly the
samples it trained on (full batches: the loader drops the ragged tail);
evaluation counts every validation sample exactly once, because
``gather_for_metrics`` drops the duplicates Accelerate pads the last batch with.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from tqdm.auto import tqdm

from visiontune.data.pipeline import UNREADABLE

POSTFIX_EVERY = 10


@dataclass
class PhaseResult:
    loss: float
    accuracy: float
    images: int
    seconds: float
    # Train only: the steps after the first ``timing_warmup`` ones.
    steady_images: int = 0
    steady_seconds: float = 0.0
    data_wait_seconds: float = 0.0  # of the steady seconds, spent waiting for the loader

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "images_per_s": self.images_per_s}


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite."""


def _bar(accelerator: Accelerator, loader: Iterable, desc: str, progress: bool):
    return tqdm(loader, desc=desc, leave=False, dynamic_ncols=True,
                disable=not (progress and accelerator.is_main_process))


def _result(totals: torch.Tensor, seconds: float, **steady) -> PhaseResult:
    loss_sum, correct, count = totals.tolist()[:3]
    n = max(count, 1)
    return PhaseResult(loss_sum / n, correct / n, int(count), seconds, **steady)


def train_one_epoch(accelerator: Accelerator, model: torch.nn.Module, loader: Iterable,
                    optimizer: torch.optim.Optimizer, scheduler, prepare_input: Callable,
                    *, on_nan: str = "stop", progress: bool = True, timing_warmup: int = 5,
                    on_step: Callable[[int], None] | None = None) -> PhaseResult:
    """One pass over ``loader``; returns loss/accuracy summed over every process.

    Host clocks split the steps after ``timing_warmup`` into waiting for the
    loader and the rest; no clock reads the device, so nothing syncs per step.
    """
    model.train()
    # loss sum, correct, images, images of the steady (post-warm-up) steps
    totals = torch.zeros(4, device=accelerator.device, dtype=torch.float64)
    start = last = time.perf_counter()
    steady_start, wait = None, 0.0
    bar = _bar(accelerator, loader, "train", progress)
    for step, (images, labels) in enumerate(bar):
        if step >= timing_warmup:
            steady_start = steady_start or last
            wait += time.perf_counter() - last
        with accelerator.accumulate(model):
            logits = model(prepare_input(images))
            valid = labels != UNREADABLE
            # Mean over the readable samples; 0 (not NaN) for a batch with none.
            loss = F.cross_entropy(logits, labels, reduction="sum") / valid.sum().clamp(min=1)
            if on_nan == "skip" and not torch.isfinite(loss):
                loss = loss.nan_to_num(0.0, 0.0, 0.0) * 0  # keeps every rank in the same collectives
            accelerator.backward(loss)
            optimizer.step()
            if accelerator.sync_gradients and scheduler is not None and not optimizer.step_was_skipped:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        n = valid.sum().double()
        totals += torch.stack([loss.detach().double() * n, (logits.argmax(1) == labels).sum().double(), n,
                               n if step >= timing_warmup else n * 0])
        if step % POSTFIX_EVERY == 0 and not bar.disable:
            loss_sum, correct, count, _ = totals.tolist()
            if on_nan == "stop" and not math.isfinite(loss_sum):
                raise NonFiniteLoss(f"training loss became {loss_sum} at step {step}")
            bar.set_postfix(loss=f"{loss_sum / count:.4f}", acc=f"{correct / count:.4f}",
                            img_s=f"{count / (time.perf_counter() - start):.0f}")
        if on_step is not None:
            on_step(step)
        last = time.perf_counter()
    totals = accelerator.reduce(totals, reduction="sum")  # also waits for the device's queued work
    end = time.perf_counter()
    if on_nan == "stop" and not math.isfinite(totals[0].item()):
        raise NonFiniteLoss("training loss became non-finite in this epoch")
    return _result(totals, end - start, steady_images=int(totals[3].item()),
                   steady_seconds=end - steady_start if steady_start else 0.0, data_wait_seconds=wait)


@torch.inference_mode()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: Iterable, prepare_input: Callable,
             *, progress: bool = True, desc: str = "val", keep: list | None = None) -> PhaseResult:
    """Loss and accuracy over every sample of ``loader`` exactly once.

    With ``keep``, each batch's gathered ``(logits, labels)`` is appended to it, padding removed
    and in dataset order: ``visiontune predict`` and ``evaluate`` need every prediction.
    """
    model.eval()
    totals = torch.zeros(3, device=accelerator.device, dtype=torch.float64)
    start = time.perf_counter()
    for images, labels in _bar(accelerator, loader, desc, progress):
        logits = model(prepare_input(images))
        per_sample = torch.stack([F.cross_entropy(logits.float(), labels, reduction="none"),
                                  (logits.argmax(1) == labels).float(), (labels != UNREADABLE).float()], dim=1)
        # Every rank gets the same gathered rows, padding removed: sum them once.
        totals += accelerator.gather_for_metrics(per_sample).double().sum(0)
        if keep is not None:
            keep.append(accelerator.gather_for_metrics((logits.float(), labels)))
    return _result(totals, time.perf_counter() - start)


def fit(accelerator: Accelerator, model, train_loader, val_loader, optimizer, scheduler, prepare_input: Callable,
        *, epochs: int, start_epoch: int = 0, on_nan: str = "stop", progress: bool = True, timing_warmup: int = 5,
        on_epoch_end: Callable[[int, PhaseResult, PhaseResult], None] | None = None) -> list[dict]:
    """Train and validate each epoch; print the reference job's epoch lines."""
    history = []
    for epoch in range(start_epoch, epochs):
        accelerator.print(f"Epoch {epoch}/{epochs - 1}\n" + "-" * 10)
        train_loader.set_epoch(epoch)
        tr = train_one_epoch(accelerator, model, train_loader, optimizer, scheduler, prepare_input,
                             on_nan=on_nan, progress=progress, timing_warmup=timing_warmup)
        va = evaluate(accelerator, model, val_loader, prepare_input, progress=progress)
        for phase, r in (("train", tr), ("val", va)):
            accelerator.print(f"{phase} Loss: {r.loss:.4f} Acc: {r.accuracy:.4f}")
        accelerator.print()
        history.append({"epoch": epoch, "train": tr.as_dict(), "val": va.as_dict()})
        if on_epoch_end is not None:
            on_epoch_end(epoch, tr, va)
    return history
