"""What a run does between steps: checkpoints, stop requests, and the per-epoch outputs.

``engine.fit`` calls ``on_step`` after every batch and ``on_epoch_end`` after
each validation; ``RunHooks`` turns those calls into a checkpoint every
``--save-every-steps`` optimizer steps and at each epoch end, into a checkpoint
and an exit when a stop signal arrived (every process agrees on it at the same
optimizer step), and into the run folder's history, metrics, curves and best
model. Every process calls every method: the collectives inside (reduce, the
stop agreement, ``save_state``) run everywhere, and only the main process writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate import Accelerator

from visiontune import checkpoint, engine, faults, outputs
from visiontune.config import RunStopped, TrainConfig
from visiontune.steplog import StepLog


@dataclass
class RunHooks:
    accelerator: Accelerator
    cfg: TrainConfig
    run_dir: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    per_epoch: int  # batches per epoch and process
    identity: dict  # what a resume must match: split hash, model, classes, global batch
    history: list[dict] = field(default_factory=list)  # a resumed run's epochs so far
    stop: faults.StopSignals = field(init=False)
    steps: StepLog | None = field(init=False)

    def __post_init__(self) -> None:
        self.stop = faults.StopSignals(self.accelerator)
        self.steps = StepLog(self.accelerator, self.optimizer, self.per_epoch) if self.cfg.log_with else None

    def _optimizer_steps(self, epoch: int, batch: int) -> int:
        return (epoch * self.per_epoch + batch) // self.cfg.grad_accum

    def save(self, epoch: int, batch: int, totals: torch.Tensor | None = None) -> str:
        cfg = self.cfg
        best = outputs.best_epoch(self.history)["val"] if self.history else None
        meta = {**self.identity, "world_size": self.accelerator.num_processes, "history": self.history,
                "best_val": best, "optimizer_steps": self._optimizer_steps(epoch, batch),
                "partial_totals": totals.tolist() if totals is not None else None, "config": cfg.to_dict()}
        return checkpoint.save(self.accelerator, self.run_dir, epoch, batch, meta, self.scheduler, cfg.keep_last)

    def _stopped(self, signum: int, path: str) -> RunStopped:
        return faults.stopped(signum, f"checkpoint {path}; continue with --resume {self.run_dir}")

    def on_step(self, epoch: int, batch: int, totals: torch.Tensor) -> None:
        cfg = self.cfg
        if self.steps:
            self.steps.record(epoch, batch, totals)
        if batch % cfg.grad_accum and batch != self.per_epoch:
            return  # inside an accumulation window: no optimizer step yet
        signum = self.stop.agreed()
        due = cfg.save_every_steps and self._optimizer_steps(epoch, batch) % cfg.save_every_steps == 0
        if not (signum or (due and batch != self.per_epoch)):  # an epoch's last step saves at the epoch end
            return
        reduced = self.accelerator.reduce(totals.clone(), reduction="sum")
        if cfg.on_nan == "stop" and not torch.isfinite(reduced[0]):
            raise engine.NonFiniteLoss(f"training loss became non-finite in epoch {epoch} before batch {batch}; "
                                       "the last checkpoint before it is kept (lower --lr, or --on-nan skip)")
        path = self.save(epoch, batch, reduced)
        if signum:
            raise self._stopped(signum, path)

    def on_epoch_end(self, epoch: int, tr: engine.PhaseResult, va: engine.PhaseResult) -> None:
        acc, history = self.accelerator, self.history
        history.append({"epoch": epoch, "lr": self.optimizer.param_groups[0]["lr"], "train": tr.as_dict(),
                        "val": va.as_dict()})
        if self.steps:
            self.steps.flush()
        # Logged at the epoch's last step, so that per-step and per-epoch values share one rising axis.
        acc.log({"epoch": epoch, **{f"{p}/{k}": v for p, r in (("train", tr), ("val", va))
                                    for k, v in r.as_dict().items()}}, step=(epoch + 1) * self.per_epoch)
        is_best = outputs.best_epoch(history)["epoch"] == epoch
        acc.wait_for_everyone()
        if acc.is_main_process:
            if is_best:
                unwrapped = acc.unwrap_model(self.model, keep_torch_compile=False)
                outputs.save_model(self.run_dir, outputs.plain_state_dict(unwrapped))
            outputs.write_json(f"{self.run_dir}/history.json", history)
            outputs.write_metrics_csv(f"{self.run_dir}/metrics.csv", history)
            outputs.plot_history(f"{self.run_dir}/training_results.png", history)
        path = self.save(epoch + 1, 0)
        signum = self.stop.agreed()
        if signum and epoch + 1 < self.cfg.epochs:
            raise self._stopped(signum, path)
