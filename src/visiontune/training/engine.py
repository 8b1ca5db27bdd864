"""The training and evaluation loops, and ``fit`` that alternates them.

Metrics accumulate as device tensors (``meter.Totals``) and are reduced across
processes once per phase, so the hot loop never waits on the GPU for a number
(the progress bar reads them once per redraw, at most every ``meter.REDRAW_SECONDS``).
Training counts exactly the samples it trained on (full batches: the loader
drops the ragged tail); evaluation counts every validation sample exactly once,
because ``gather_for_metrics`` drops the duplicates Accelerate pads the last
batch with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from visiontune.cluster.signals import RunStopped
from visiontune.loading.devicedecode import on_device
from visiontune.tasks import SINGLE_LABEL, Task
from visiontune.training.meter import PhaseResult, StepClock, Totals, progress_bar, run_progress

# criterion(logits, labels) -> the MEAN loss over the batch's readable samples, a scalar that
# ``backward`` is called on (0, not NaN, for a batch without any). ``labels`` are as the run's task
# collates them (``tasks``: class indices, multi-hot rows, numbers), with the task's unreadable label for
# samples the loader could not decode; the epoch's loss is this mean weighted by the readable count.
# Label smoothing or soft targets keep the same contract. What counts as a hit is the task's too.
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NonFiniteLoss(RunStopped):
    """The training loss became NaN or infinite (exit code 3)."""

    def __init__(self, message: str):
        super().__init__(message, 3)


OnStep = Callable[[int, int, Totals], None]  # (epoch, batches done in it, this process's totals)


@dataclass(frozen=True)
class StartAt:
    """Where a run begins: a resumed run at batch ``batch`` of ``epoch``, with that epoch's sums."""

    epoch: int = 0
    batch: int = 0
    totals: Totals | None = None


@dataclass(frozen=True)
class LoopOptions:
    epochs: int
    on_nan: str = "stop"  # stop: raise NonFiniteLoss at the epoch end; skip: skip steps with non-finite grads
    progress: bool = True
    timing_warmup: int = 5
    task: Task = SINGLE_LABEL  # what the run learns: its labels, its plain loss, its hits
    criterion: Criterion | None = None  # None: the task's plain loss (``Task.mean_loss``)
    # mix(inputs, labels, epoch, step) -> (inputs, soft targets [B, classes]): mixup/cutmix. The
    # criterion then gets the soft targets (all-zero rows: unreadable samples), and the accuracy
    # counts a prediction as right when it names the class with the largest share of the target.
    mix: Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
    on_step: OnStep | None = None
    on_epoch_end: Callable[[int, PhaseResult, PhaseResult], None] | None = None
    # --max-steps: the run's train batches per process at most (optimizer steps x --grad-accum); the epoch
    # that reaches it ends there, is validated and closed as any epoch, and the run stops after it.
    max_batches: int | None = None


def _show(bar, totals: Totals, clock: StepClock) -> None:
    """The running loss, score and speed on the bar, read from the device only when it redraws next."""
    if not bar.disable and time.time() - bar.last_print_t >= bar.mininterval:  # tqdm's clock
        loss_sum, correct, images = totals.values.tolist()[:3]  # one sync
        bar.set_postfix(
            loss=f"{loss_sum / max(images, 1):.4f}",
            acc=f"{correct / max(images, 1):.4f}",
            img_s=f"{images / (time.perf_counter() - clock.start):.0f}",
            refresh=False,
        )


def _grads_finite(model: torch.nn.Module) -> bool:
    # After the all-reduce every process holds the same gradients, so all decide alike.
    return bool(torch.stack([torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None]).all())


def _optimizer_step(accelerator: Accelerator, model, optimizer, scheduler, on_nan: str) -> bool:
    """Step unless --on-nan skip finds non-finite gradients; True if a due step was not taken."""
    # skip: one host sync per step, the price of not stepping on inf/NaN gradients.
    bad = on_nan == "skip" and accelerator.sync_gradients and not _grads_finite(model)
    if not bad:
        optimizer.step()
    skipped = accelerator.sync_gradients and (bad or optimizer.step_was_skipped)  # NaN skip, fp16 overflow
    if accelerator.sync_gradients and not skipped and scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped


@dataclass(frozen=True)
class Learner:
    """What trains: the model, its optimizer and lr schedule, and how a batch of images reaches the model
    (on-device normalisation)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object = None
    prepare_input: Callable = lambda x: x


@dataclass(frozen=True)
class Span:
    """The part of an epoch one call trains: the epoch, the batch it starts at with the sums of the batches
    before it (a resumed epoch, whose loader skips them), and the batch it stops before (``--max-steps``)."""

    epoch: int = 0
    start_step: int = 0
    totals: Totals | None = None
    stop_at: int | None = None


def _step(accelerator: Accelerator, learner: Learner, opts: LoopOptions, images, labels, epoch: int, step: int):
    """One batch: mixed (mixup/cutmix), forward, the task's loss, backward and the optimizer's step; the
    logits, the labels it is counted against, the loss and whether a due optimizer step was skipped."""
    task, model = opts.task, learner.model
    with accelerator.accumulate(model):
        inputs, targets = learner.prepare_input(images), labels
        if opts.mix is not None:
            inputs, targets = opts.mix(inputs, labels, epoch, step)
            labels = task.counted(labels, targets)
        logits = model(inputs)
        loss = (opts.criterion or task.mean_loss)(logits, targets)
        accelerator.backward(loss)
        skipped = _optimizer_step(accelerator, model, learner.optimizer, learner.scheduler, opts.on_nan)
    return logits, labels, loss.detach().double(), skipped


def train_one_epoch(
    accelerator: Accelerator, learner: Learner, loader: Iterable, opts: LoopOptions, span: Span = Span(), run_bar=None
) -> PhaseResult:
    """One pass over ``loader`` (the part ``span`` says); returns loss and the task's score summed over every
    process. ``opts.on_step(epoch, batches_done, totals)`` runs after every batch."""
    learner.model.train()
    totals = Totals(span.totals.values if span.totals is not None else None, accelerator.device)
    clock = StepClock(opts.timing_warmup)
    bar = progress_bar(accelerator, loader, "train", opts.progress)
    for step, (images, labels) in enumerate(bar, start=span.start_step):
        # --decode device: the batch's JPEGs are decoded here, and that is input time (data_stall), not the step's.
        images, labels = on_device(images, labels)
        steady = clock.batch_ready()
        logits, labels, loss, skipped = _step(accelerator, learner, opts, images, labels, span.epoch, step)
        if skipped:  # counted on the main process only: every process skips the same steps, and totals are summed
            totals.count_skipped(float(accelerator.is_main_process))
        n, hits = opts.task.measure(logits, labels)
        if opts.on_nan == "skip":  # keep the epoch's loss finite; the skipped images are not counted
            n, loss = n * torch.isfinite(loss), loss.nan_to_num(0.0, 0.0, 0.0)
        totals.add(loss, hits * (n > 0), n, steady)
        _show(bar, totals, clock)
        if opts.on_step is not None:
            opts.on_step(span.epoch, step + 1, totals)
        if run_bar is not None:
            run_bar.update(1)
        clock.step_done()
        if span.stop_at is not None and step + 1 >= span.stop_at:  # --max-steps: every process stops alike
            break
    totals = totals.reduced(accelerator)
    if opts.on_nan == "stop" and not math.isfinite(totals.loss_sum):
        raise NonFiniteLoss(
            "training loss became non-finite in this epoch; the last checkpoint before it is "
            "kept (lower --lr, or pass --on-nan skip)"
        )
    n = max(totals.images, 1)
    return PhaseResult(
        totals.loss_sum / n,
        totals.correct / n,
        int(totals.images),
        skipped=int(totals.skipped),
        steady_images=int(totals.steady_images),
        **clock.split(),
    )


@torch.inference_mode()
def evaluate(
    accelerator: Accelerator,
    model: torch.nn.Module,
    loader: Iterable,
    prepare_input: Callable,
    *,
    progress: bool = True,
    desc: str = "val",
    keep: list | None = None,
    task: Task = SINGLE_LABEL,
) -> PhaseResult:
    """Loss and accuracy over every sample of ``loader`` exactly once.

    The loss is plain cross-entropy (multi-label: binary cross-entropy) whatever the training criterion,
    so validation losses compare across recipes. With ``keep``, each batch's gathered ``(logits, labels)``
    is appended to it, padding removed (prediction and evaluation reports use them). Multi-label data
    always gathers them: the result then also has the mAP and the per-class thresholds tuned on these
    samples (``tasks.multi``), the same on every process.
    """
    model.eval()
    totals = torch.zeros(3, device=accelerator.device, dtype=torch.float64)  # loss sum, correct, images
    start = time.perf_counter()
    gathered: list = []
    for images, labels in progress_bar(accelerator, loader, desc, progress):
        images, labels = on_device(images, labels)
        logits = model(prepare_input(images))
        loss = task.eval_loss(logits, labels)
        per_sample = torch.stack([loss, task.hits(logits, labels), task.readable(labels).float()], dim=1)
        # Every rank gets the same gathered rows, padding removed: sum them once.
        totals += accelerator.gather_for_metrics(per_sample).double().sum(0)
        if keep is not None or task.ranks:
            gathered.append(accelerator.gather_for_metrics((logits.float(), labels)))
    if keep is not None:
        keep.extend(gathered)
    loss_sum, correct, count = totals.tolist()
    ranked = {}
    if gathered and task.ranks:
        logits = torch.cat([lg for lg, _ in gathered]).cpu()
        ranked = task.ranking(logits, torch.cat([lb for _, lb in gathered]).cpu())
    elapsed = time.perf_counter() - start
    return PhaseResult(loss_sum / max(count, 1), correct / max(count, 1), int(count), elapsed, ranked=ranked)


def phase_line(r: PhaseResult, task: Task) -> str:
    """A phase's figures on its epoch line: loss, the task's score and the metrics it ranks by."""
    ranked = "".join(f" {name}: {r.ranked[key]:.4f}" for key, name in task.curves if r.ranked.get(key) is not None)
    return f"Loss: {r.loss:.4f} {task.score_name}: {r.accuracy:.4f}{ranked}"


def fit(
    accelerator: Accelerator, learner: Learner, train_loader, val_loader, opts: LoopOptions, start: StartAt = StartAt()
) -> None:
    """Train and validate each epoch from ``start``; print the reference job's epoch lines, and keep
    the run's own progress (epoch, step of all steps, ETA) beside each phase's bar."""
    per_epoch = len(train_loader)
    total = opts.epochs * per_epoch if opts.max_batches is None else min(opts.epochs * per_epoch, opts.max_batches)
    run_bar = run_progress(accelerator, total, start.epoch * per_epoch + start.batch, opts.progress)
    try:
        _epochs(accelerator, learner, train_loader, val_loader, opts, start, run_bar)
    finally:
        run_bar.close()


def _phase_mark(scheduler, epoch: int, steps_per_epoch: int) -> str:
    """The epoch line's note of --freeze-epochs' phases: head only, and the epoch where everything starts."""
    frozen = getattr(scheduler, "freeze_steps", 0)  # a Stepper's; 0 for a plain scheduler or none
    if not frozen:
        return ""
    if epoch * steps_per_epoch < frozen:
        return " (head only: backbone frozen)"
    return " (backbone unfrozen: everything trains)" if (epoch - 1) * steps_per_epoch < frozen else ""


def _epochs(accelerator, learner: Learner, train_loader, val_loader, opts: LoopOptions, start: StartAt, run_bar):
    per_epoch = max(1, len(train_loader) // max(1, accelerator.gradient_accumulation_steps))  # optimizer steps
    for epoch in range(start.epoch, opts.epochs):
        if opts.max_batches is not None and epoch * len(train_loader) >= opts.max_batches:
            break  # a resumed run that had already reached --max-steps
        run_bar.set_description_str(f"run: epoch {epoch + 1}/{opts.epochs},", refresh=False)
        # Counted from 1 for people ("Epoch 1/3" .. "Epoch 3/3"), as the figures, pages and checkpoint folder
        # names count; the records' keys (history.json, metrics.csv, summary.json) keep the 0-based index.
        accelerator.print(
            f"Epoch {epoch + 1}/{opts.epochs}{_phase_mark(learner.scheduler, epoch, per_epoch)}\n" + "-" * 10
        )
        train_loader.set_epoch(epoch)  # the sampler is shared with any skipping loader below
        skip = start.batch if epoch == start.epoch else 0
        loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        stop_at = None if opts.max_batches is None else opts.max_batches - epoch * len(train_loader)
        stop_at = stop_at if stop_at is not None and stop_at < len(train_loader) else None
        span = Span(epoch, skip, start.totals if skip else None, stop_at)
        tr = train_one_epoch(accelerator, learner, loader, opts, span, run_bar)
        va = evaluate(
            accelerator, learner.model, val_loader, learner.prepare_input, progress=opts.progress, task=opts.task
        )
        for phase, r in (("train", tr), ("val", va)):
            accelerator.print(f"{phase} {phase_line(r, opts.task)}")
        if tr.skipped:
            accelerator.print(f"train skipped {tr.skipped} optimizer step(s) (non-finite gradients or fp16 overflow)")
        accelerator.print()
        if opts.on_epoch_end is not None:
            opts.on_epoch_end(epoch, tr, va)
        if opts.max_batches is not None and (epoch + 1) * len(train_loader) >= opts.max_batches:
            break
