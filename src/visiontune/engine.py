"""The training and evaluation loops, and ``fit`` that alternates them.

Metrics accumulate as device tensors and are reduced across processes once per
phase, so the hot loop never waits on the GPU for a number (the progress bar
reads them once per redraw, at most every ``REDRAW_SECONDS``). Training counts
exactly the samples it trained on (full batches: the loader drops the ragged
tail); evaluation counts every validation sample exactly once, because
``gather_for_metrics`` drops the duplicates Accelerate pads the last batch with.
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from tqdm.auto import tqdm

from visiontune.config import RunStopped
from visiontune.data.pipeline import UNREADABLE

# A terminal's bar redraws every REDRAW_SECONDS; without a terminal a line is printed every
# LOG_EVERY_SECONDS ($VISIONTUNE_PROGRESS_SECONDS). The running loss/accuracy is read from the
# device just before each redraw (one sync), so what is shown is never older than the redraw.
REDRAW_SECONDS = 0.5
LOG_EVERY_SECONDS = 30.0


@dataclass
class PhaseResult:
    loss: float
    accuracy: float
    images: int
    seconds: float
    skipped: int = 0  # optimizer steps not taken: non-finite gradients (--on-nan skip), fp16 overflow
    # Train only: the steps after the first ``timing_warmup`` ones.
    steady_images: int = 0
    steady_seconds: float = 0.0
    data_wait_seconds: float = 0.0  # of the steady seconds, spent waiting for the loader

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "images_per_s": self.images_per_s}


class NonFiniteLoss(RunStopped):
    """The training loss became NaN or infinite (exit code 3)."""

    def __init__(self, message: str):
        super().__init__(message, 3)


class _LogLines(tqdm):
    """tqdm's status as a plain line every ``mininterval`` seconds, for logs (Slurm, CI) where
    carriage-return redraws pile up; nothing at the start and nothing left at the end."""

    def display(self, msg=None, pos=None):
        if msg is not None or not self.n:  # msg="" is tqdm clearing the bar on close: nothing to clear
            return False
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()
        return True


def _bar(accelerator: Accelerator, loader: Iterable, desc: str, progress: bool):
    disable = not (progress and accelerator.is_main_process)
    if getattr(sys.stderr, "isatty", lambda: False)():
        return tqdm(loader, desc=desc, leave=False, dynamic_ncols=True, mininterval=REDRAW_SECONDS, disable=disable)
    every = float(os.environ.get("VISIONTUNE_PROGRESS_SECONDS", LOG_EVERY_SECONDS))
    return _LogLines(loader, desc=desc, leave=False, mininterval=every, miniters=1, disable=disable,
                     bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]")


# Train totals: loss sum, correct, images, skipped steps, images of the steady steps.
TRAIN_TOTALS = 5


def _result(totals: torch.Tensor, seconds: float, **timing) -> PhaseResult:
    loss_sum, correct, count, *rest = totals.tolist()
    n = max(count, 1)
    skipped, steady = (int(rest[0]), int(rest[1])) if rest else (0, 0)
    return PhaseResult(loss_sum / n, correct / n, int(count), seconds, skipped, steady, **timing)


def _grads_finite(model: torch.nn.Module) -> bool:
    # After the all-reduce every process holds the same gradients, so all decide alike.
    return bool(torch.stack([torch.isfinite(p.grad).all() for p in model.parameters()
                             if p.grad is not None]).all())


def train_one_epoch(accelerator: Accelerator, model: torch.nn.Module, loader: Iterable,
                    optimizer: torch.optim.Optimizer, scheduler, prepare_input: Callable,
                    *, on_nan: str = "stop", progress: bool = True, timing_warmup: int = 5,
                    start_step: int = 0, totals: torch.Tensor | None = None,
                    on_step: Callable[[int, torch.Tensor], None] | None = None) -> PhaseResult:
    """One pass over ``loader``; returns loss/accuracy summed over every process.

    ``totals`` (see ``TRAIN_TOTALS``) continues a resumed epoch whose first
    ``start_step`` batches ``loader`` already skips; ``on_step(batches_done,
    totals)`` runs after every batch. Host clocks split the steps after this
    call's first ``timing_warmup`` into waiting for the loader and the rest; no
    clock reads the device, so nothing syncs per step.
    """
    model.train()
    totals = torch.zeros(TRAIN_TOTALS, dtype=torch.float64) if totals is None else totals.clone()
    totals = totals.to(accelerator.device)
    start = last = time.perf_counter()
    steady_start, wait = None, 0.0
    bar = _bar(accelerator, loader, "train", progress)
    for step, (images, labels) in enumerate(bar, start=start_step):
        steady = step - start_step >= timing_warmup
        if steady:
            steady_start = steady_start or last
            wait += time.perf_counter() - last
        with accelerator.accumulate(model):
            logits = model(prepare_input(images))
            valid = labels != UNREADABLE
            # Mean over the readable samples; 0 (not NaN) for a batch with none.
            loss = F.cross_entropy(logits, labels, reduction="sum") / valid.sum().clamp(min=1)
            accelerator.backward(loss)
            # skip: one host sync per step, the price of not stepping on inf/NaN gradients.
            bad = on_nan == "skip" and accelerator.sync_gradients and not _grads_finite(model)
            if not bad:
                optimizer.step()
            # Count skipped steps (NaN skip, fp16 overflow) on the main process only: every
            # process skips the same steps, and the totals are summed over processes.
            if accelerator.sync_gradients and (bad or optimizer.step_was_skipped):
                totals[3] += float(accelerator.is_main_process)
            elif accelerator.sync_gradients and scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        n = valid.sum().double()
        loss = loss.detach().double()
        if on_nan == "skip":  # keep the epoch's loss finite; the skipped images are not counted
            n = n * torch.isfinite(loss)
            loss = loss.nan_to_num(0.0, 0.0, 0.0)
        totals[:3] += torch.stack([loss * n, (logits.argmax(1) == labels).sum().double() * (n > 0), n])
        if steady:
            totals[4] += n
        if not bar.disable and time.time() - bar.last_print_t >= bar.mininterval:  # tqdm's clock: it redraws next
            loss_sum, correct, count = totals.tolist()[:3]
            bar.set_postfix(loss=f"{loss_sum / max(count, 1):.4f}", acc=f"{correct / max(count, 1):.4f}",
                            img_s=f"{count / (time.perf_counter() - start):.0f}", refresh=False)
        if on_step is not None:
            on_step(step + 1, totals)
        last = time.perf_counter()
    totals = accelerator.reduce(totals, reduction="sum")  # also waits for the device's queued work
    end = time.perf_counter()
    if on_nan == "stop" and not math.isfinite(totals[0].item()):
        raise NonFiniteLoss("training loss became non-finite in this epoch; the last checkpoint before it is "
                            "kept (lower --lr, or pass --on-nan skip)")
    return _result(totals, end - start, steady_seconds=end - steady_start if steady_start else 0.0,
                   data_wait_seconds=wait)


@torch.inference_mode()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: Iterable, prepare_input: Callable,
             *, progress: bool = True, desc: str = "val", keep: list | None = None) -> PhaseResult:
    """Loss and accuracy over every sample of ``loader`` exactly once.

    With ``keep``, each batch's gathered ``(logits, labels)`` is appended to it, padding removed
    (prediction and evaluation reports use them).
    """
    model.eval()
    totals = torch.zeros(3, device=accelerator.device, dtype=torch.float64)  # loss sum, correct, images
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
        *, epochs: int, start_epoch: int = 0, start_batch: int = 0, start_totals: torch.Tensor | None = None,
        on_nan: str = "stop", progress: bool = True, timing_warmup: int = 5,
        on_step: Callable[[int, int, torch.Tensor], None] | None = None,
        on_epoch_end: Callable[[int, PhaseResult, PhaseResult], None] | None = None) -> None:
    """Train and validate each epoch; print the reference job's epoch lines.

    A resumed run starts at batch ``start_batch`` of ``start_epoch`` with that
    epoch's ``start_totals``; ``on_step(epoch, batches_done, totals)`` runs after every batch.
    """
    for epoch in range(start_epoch, epochs):
        accelerator.print(f"Epoch {epoch}/{epochs - 1}\n" + "-" * 10)
        train_loader.set_epoch(epoch)  # the sampler is shared with any skipping loader below
        skip = start_batch if epoch == start_epoch else 0
        loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        tr = train_one_epoch(accelerator, model, loader, optimizer, scheduler, prepare_input,
                             on_nan=on_nan, progress=progress, timing_warmup=timing_warmup, start_step=skip,
                             totals=start_totals if skip else None,
                             on_step=(lambda b, t, e=epoch: on_step(e, b, t)) if on_step else None)
        va = evaluate(accelerator, model, val_loader, prepare_input, progress=progress)
        for phase, r in (("train", tr), ("val", va)):
            accelerator.print(f"{phase} Loss: {r.loss:.4f} Acc: {r.accuracy:.4f}")
        if tr.skipped:
            accelerator.print(f"train skipped {tr.skipped} optimizer step(s) (non-finite gradients or fp16 overflow)")
        accelerator.print()
        if on_epoch_end is not None:
            on_epoch_end(epoch, tr, va)
