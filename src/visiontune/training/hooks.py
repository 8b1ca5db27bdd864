"""What a run does between steps, in three small pieces that ``RunHooks`` joins.

``engine.fit`` calls ``on_step`` after every batch and ``on_epoch_end`` after
each validation. ``CheckpointPolicy`` decides when a step is a checkpoint (every
``--save-every-steps`` optimizer steps, an epoch end, a stop signal that every
process agreed on at the same optimizer step); ``Checkpointer`` writes one with
the run's identity, and ``RunHooks`` then raises ``RunStopped`` when a signal asked for it (one
that arrived during the write included); and
``EpochOutputs`` evaluates the EMA weights when there are some, and writes the run
folder's history, metrics, curves and best model (raw or EMA, as ``--best-metric``
picks) from a snapshot, in the background, while the next epoch trains; ``--early-stop``
then ends the run through ``EarlyStop``. A caller's ``on_epoch(epoch, row)`` (a tuner deciding whether to
prune its trial) sees each epoch's row once the epoch is recorded and checkpointed; a reason it returns ends
the run there through ``StopAfterEpoch``, which ``summary.json`` records.
The stop signals themselves are owned by the caller (``with StopSignals(...)``).
Every process calls every method: the collectives inside (reduce, the stop
agreement, ``save_state``) run everywhere, and only the main process writes.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator

from visiontune import files
from visiontune.cluster import signals, strategies
from visiontune.cluster.strategy import ThreadWatch, effective
from visiontune.reports import figures
from visiontune.runs import checkpoint, epochs, records, runinfo
from visiontune.settings.config import TrainConfig
from visiontune.tasks import SINGLE_LABEL, Task
from visiontune.training import engine
from visiontune.training.ema import EMA, ShardedEMA
from visiontune.training.meter import PhaseResult, Totals
from visiontune.training.steplog import StepLog


@dataclass(frozen=True)
class CheckpointPolicy:
    per_epoch: int  # batches per epoch and process
    grad_accum: int
    save_every_steps: int

    def optimizer_steps(self, epoch: int, batch: int) -> int:
        return (epoch * self.per_epoch + batch) // self.grad_accum

    def at_step_boundary(self, batch: int) -> bool:
        """False inside an accumulation window: no optimizer step yet, nothing to save or agree on."""
        return batch % self.grad_accum == 0 or batch == self.per_epoch

    def due(self, epoch: int, batch: int) -> bool:
        """A periodic checkpoint here (an epoch's last step saves at the epoch end instead)."""
        return (
            bool(self.save_every_steps)
            and batch != self.per_epoch
            and self.optimizer_steps(epoch, batch) % self.save_every_steps == 0
        )


@dataclass
class Checkpointer:
    accelerator: Accelerator
    cfg: TrainConfig
    run_dir: str
    scheduler: object
    policy: CheckpointPolicy
    identity: dict  # what a resume must match: split hash, model, classes, global batch
    history: list[dict]  # shared with EpochOutputs: the epochs so far

    def save(self, epoch: int, batch: int, totals: Totals | None = None) -> str:
        row, which = records.best_of(self.history, self.cfg.best_metric) if self.history else ({}, "")
        best = row.get(which)
        meta = {
            **self.identity,
            "world_size": self.accelerator.num_processes,
            "history": self.history,
            "best_val": best,
            "optimizer_steps": self.policy.optimizer_steps(epoch, batch),
            "partial_totals": totals.to_list() if totals is not None else None,
            "config": self.cfg.to_dict(),
        }
        return checkpoint.save(
            self.accelerator,
            self.run_dir,
            epoch,
            batch,
            meta,
            self.scheduler,
            self.cfg.keep_last,
            effective(self.cfg),
        )

    def stopped(self, signum: int, path: str) -> signals.RunStopped:
        # The README's way, --resume auto, continues the folder of --output-dir: offered when that is this run's
        # folder; a folder the run chose itself (a timestamp), or --resume RUN without --output-dir, is named.
        given = self.cfg.output_dir
        auto = given is not None and os.path.abspath(given) == os.path.abspath(self.run_dir)
        how = f"--resume auto --output-dir {self.run_dir}" if auto else f"--resume {self.run_dir}"
        return signals.stopped(signum, f"checkpoint {path}; continue with {how}")

    def mid_epoch(self, epoch: int, batch: int, totals: Totals) -> str:
        """Save the partial epoch (its sums over every process); return the checkpoint's path."""
        reduced = totals.reduced(self.accelerator)
        if self.cfg.on_nan == "stop" and not torch.isfinite(reduced.values[0]):
            raise engine.NonFiniteLoss(
                f"training loss became non-finite in Epoch {epoch + 1}/{self.cfg.epochs} before batch {batch}; "
                "the last checkpoint before it is kept (lower --lr, or --on-nan skip)"
            )
        return self.save(epoch, batch, reduced)


@dataclass
class EpochOutputs:
    accelerator: Accelerator
    run_dir: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    history: list[dict]
    model_metadata: dict[str, str] = field(default_factory=dict)  # the run's description, inside best.safetensors
    save_pth: bool = False  # also best.pth (--save-pth)
    per_epoch: int = 1  # batches per epoch and process: trackers get an epoch's figures at its last step
    best_metric: str = "accuracy"
    ema: EMA | ShardedEMA | None = None  # the weights' average, evaluated after each epoch beside the raw model
    evaluate: Callable[[torch.nn.Module], PhaseResult] | None = None
    writes: records.BackgroundWrites = field(default_factory=records.BackgroundWrites)  # the main process's
    strategy: strategies.Strategy = field(default_factory=strategies.one_device)  # takes the model's full state
    task: Task = SINGLE_LABEL  # what the run learns: the metrics its files and figures show

    def record(self, epoch: int, tr: PhaseResult, va: PhaseResult) -> int:
        """Record the epoch and save the best model; return the best epoch so far."""
        acc, history = self.accelerator, self.history
        row = {"epoch": epoch, "lr": self.optimizer.param_groups[0]["lr"], "train": tr.as_dict(), "val": va.as_dict()}
        row["threads"] = torch.get_num_threads()  # the model's, this epoch (visiontune's choice may change)
        if self.ema is not None:
            with self.ema.weights() as averaged:
                ve = self.evaluate(averaged)
            acc.print(f"val (EMA) {engine.phase_line(ve, self.task)}\n")
            row["val_ema"] = ve.as_dict()
        history.append(row)
        # At the epoch's last step, so that per-step (StepLog) and per-epoch values share one rising axis.
        acc.log(
            {
                "epoch": epoch + 1,  # as the console and the files count
                # Numbers only: a multi-label row's thresholds are a list (and its mAP None without positives).
                **{
                    f"{p}/{k}": v
                    for p in ("train", "val", "val_ema")
                    if p in row
                    for k, v in row[p].items()
                    if v is not None and not isinstance(v, list)
                },
            },
            step=(epoch + 1) * self.per_epoch,
        )
        best, which = records.best_of(history, self.best_metric)
        acc.wait_for_everyone()
        best_from = which if best["epoch"] == epoch else None
        state = self._best_state(best_from)  # on every process: a sharded model is gathered
        if acc.is_main_process:
            self._write(history, best_from, state)
        return best["epoch"]

    def rewrite_last_epoch(self) -> None:
        """After a resume at an epoch's end: its files again, from the restored state.

        The checkpoint that closes an epoch is published while that epoch's files may still be
        written in the background; a run killed then left them behind. The restored model (and EMA)
        is the epoch's own, so the files come out as the uninterrupted run wrote them.
        """
        if self.history:
            best, which = records.best_of(self.history, self.best_metric)
            best_from = which if best["epoch"] == self.history[-1]["epoch"] else None
            state = self._best_state(best_from)
            if self.accelerator.is_main_process:
                self._write(self.history, best_from, state)

    def _best_state(self, best_from: str | None) -> dict[str, torch.Tensor] | None:
        """CPU copies of the weights the best metric picked, EMA or raw, on the main process (None elsewhere,
        and when this epoch is not the best). Every process calls it: the strategy may gather a sharded model."""
        if best_from is None:
            return None
        if best_from == "val_ema":
            with self.ema.weights() as averaged:
                return self.strategy.full_state_dict(self.accelerator, averaged)
        return self.strategy.full_state_dict(self.accelerator, self.model)

    def _write(self, history: list[dict], best_from: str | None, state: dict[str, torch.Tensor] | None) -> None:
        """Snapshot now (the best weights' CPU copies given, the history copied), write in the background."""
        rows = epochs.for_files(copy.deepcopy(history))  # the files count epochs from 1
        run_dir, metadata, pth, task = self.run_dir, self.model_metadata, self.save_pth, self.task
        metric = self.best_metric
        thresholds = history[-1][best_from].get("thresholds") if best_from is not None else None
        if thresholds is not None:  # multi-label: the best epoch's thresholds travel in the model file
            metadata = runinfo.metadata_with_thresholds(metadata, thresholds)

        def write() -> None:
            if state is not None:
                records.save_model(run_dir, state, metadata=metadata, pth=pth)
            files.write_json(f"{run_dir}/history.json", rows)
            records.write_metrics_csv(f"{run_dir}/metrics.csv", rows, task)
            figures.plot_history(f"{run_dir}/training_results.png", rows, task, metric)

        self.writes.submit(write)


class EarlyStop(Exception):
    """``--early-stop``: the best metric stopped improving; the run ends normally after this epoch."""


class StopAfterEpoch(EarlyStop):
    """The caller's ``on_epoch`` asked the run to end after this epoch; ``reason`` says why."""

    def __init__(self, epoch: int, reason: str):
        super().__init__(epoch)
        self.epoch, self.reason = epoch, reason


# A caller's look at each recorded epoch: (0-based epoch, its history row) -> a reason to stop now, or None.
OnEpoch = Callable[[int, dict], "str | None"]


@dataclass
class RunHooks:
    checkpointer: Checkpointer
    outputs: EpochOutputs
    stop: signals.StopSignals
    epochs: int
    steps: StepLog | None = None  # per-step loss and lr for the trackers (--log-with)
    early_stop: int = 0  # epochs without a better best metric before stopping (0: never)
    on_epoch: OnEpoch | None = None  # the caller's, asked in the main process: it answers for the whole run
    threads: ThreadWatch | None = None  # visiontune's thread choice, made again when the machine changes
    history: list[dict] = field(init=False)

    def __post_init__(self) -> None:
        self.history = self.outputs.history

    def on_step(self, epoch: int, batch: int, totals: Totals) -> None:
        policy = self.checkpointer.policy
        if self.steps:
            self.steps.record(epoch, batch, totals.values)
        if not policy.at_step_boundary(batch):
            return
        signum = self.stop.agreed()
        if signum or policy.due(epoch, batch):
            # A checkpoint inside an epoch is published only once the last epoch's files are on disk: a resume
            # from it rewrites nothing (only one that closes an epoch does: rewrite_last_epoch).
            self.outputs.writes.wait()
            path = self.checkpointer.mid_epoch(epoch, batch, totals)
            # A signal that came while the checkpoint was written stops here too: no further step, no second write.
            signum = signum or self.stop.agreed()
            if signum:
                raise self.checkpointer.stopped(signum, path)

    def _asked(self, epoch: int) -> str | None:
        """The caller's answer after ``epoch``: the main process asks, every process gets its answer."""
        acc = self.outputs.accelerator
        if self.on_epoch is None:
            return None
        answer = [self.on_epoch(epoch, self.history[-1]) if acc.is_main_process else None]
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(answer)
        return answer[0]

    def on_epoch_end(self, epoch: int, tr: PhaseResult, va: PhaseResult) -> None:
        if self.steps:
            self.steps.flush()
        best = self.outputs.record(epoch, tr, va)
        changed = self.threads.after_epoch(tr.images_per_s) if self.threads else None
        if changed:  # the next epoch's row records the count it ran with
            self.outputs.accelerator.print(f"visiontune: {changed}")
        path = self.checkpointer.save(epoch + 1, 0)
        signum = self.stop.agreed()
        if signum and epoch + 1 < self.epochs:
            raise self.checkpointer.stopped(signum, path)
        reason = self._asked(epoch)
        if reason and epoch + 1 < self.epochs:
            self.outputs.accelerator.print(f"visiontune: stopped after epoch {epoch + 1}: {reason}")
            raise StopAfterEpoch(epoch, reason)
        if self.early_stop and epoch - best >= self.early_stop and epoch + 1 < self.epochs:
            self.outputs.accelerator.print(
                f"visiontune: early stop: no better val {self.outputs.best_metric} for {self.early_stop} epoch(s)"
            )
            raise EarlyStop(epoch)
