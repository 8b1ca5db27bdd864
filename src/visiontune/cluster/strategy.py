"""The run's one Accelerator, built with what its strategy asks for, and this process's thread budget.

What each strategy does differently (``prepare``, several processes or one, how its state is taken and
restored) lives in its own object in ``cluster/strategies/``; ``effective`` says which one this process
runs. All of them then run the same loop. Threads are budgeted here: each process gets cores / local
processes, and loader workers come out of that budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
from torch import nn

from visiontune.cluster.checks import check_runnable, effective
from visiontune.cluster.launch import (
    core_share,
    cpu_budget,
    default_threads,
    threads_choice,
)
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig


@dataclass(frozen=True)
class ProcessSettings:
    """How this process runs a model, training or not: what the Accelerator and the thread budget read.
    A training run's come from its config (``of``); predict, evaluate and serve make their own."""

    mixed_precision: str = "no"
    timeout: float = 600.0  # seconds any collective may wait
    threads: int | None = None  # None: this process's share of the cores
    grad_accum: int = 1
    log_with: str | None = None

    @classmethod
    def of(cls, cfg: TrainConfig) -> ProcessSettings:
        return cls(cfg.mixed_precision, cfg.timeout, cfg.threads, cfg.grad_accum, cfg.log_with)


@dataclass(frozen=True)
class Threads:
    """This process's cores as a run or a forward pass shares them, resolved once (``threads``)."""

    intra_op: int  # the model's threads: --threads, OMP_NUM_THREADS, or cores / local processes
    chosen_by: str  # what chose ``intra_op``
    loader_workers: int  # decoding worker processes (--num-workers, or auto)
    decode: int  # threads decoding each batch: in a loader worker, or here without workers
    adaptive: bool = False  # visiontune's own choice (no --threads, no OMP_NUM_THREADS): the load may change it


def resolve_threads(settings: TrainConfig | ProcessSettings, num_workers: int | None) -> Threads:
    """``settings.threads`` (None: this process's share of the cores, cut to those the machine's load leaves
    free) and ``--num-workers`` (None: auto) resolved: the cores the model computes on, the loader's workers
    out of the same budget, and the threads that decode a batch."""
    intra_op, chosen_by = threads_choice(settings.threads)
    if num_workers is None:
        # With a GPU the cores decode while it computes. On a CPU the model needs the cores too: a worker
        # process would fight the model's threads for them (measured: slower than either alone), so the
        # batch is decoded in this process, by every thread of the budget.
        num_workers = max(1, min(8, intra_op - 1)) if torch.cuda.is_available() else 0
    decode = intra_op if num_workers == 0 else 1
    return Threads(intra_op, chosen_by, num_workers, decode, default_threads(settings.threads))


FAR_SLOWER = 1.5  # an epoch this many times slower than the one before it: the machine got busier


@dataclass
class ThreadWatch:
    """Visiontune's own thread choice, made again between epochs when the machine may have changed: after an
    epoch ``FAR_SLOWER`` times slower than the one before it (a neighbour started: threads that wait for a
    descheduled peer spin), and after each epoch while the load holds it below the cores' share (the
    neighbour may have gone). A count the user chose (``--threads``, ``OMP_NUM_THREADS``) is never changed."""

    threads: Threads
    rate: float | None = None  # the last epoch's train images/s

    def after_epoch(self, images_per_s: float) -> str | None:
        """Set the threads for the next epoch; what changed and why, or None."""
        previous, self.rate = self.rate, images_per_s
        if not self.threads.adaptive:
            return None
        now = torch.get_num_threads()
        slower = bool(previous) and 0 < images_per_s * FAR_SLOWER < previous
        if not slower and now >= core_share():
            return None
        chosen, why = threads_choice()
        if chosen == now:
            return None
        torch.set_num_threads(chosen)
        cause = f"the epoch ran {previous / images_per_s:.1f}x slower than the one before; " if slower else ""
        return f"{chosen} intra-op threads from the next epoch, not {now} ({cause}{why})"


def enable_gpu_speedups() -> None:
    """TF32 tensor cores for float32 matmuls/convolutions (ignored by GPUs without them), and cuDNN
    autotuning: the input shape is fixed (full batches of SxS), so the search pays once per run."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True


def make_accelerator(process: ProcessSettings, project_dir: str | None = None, **strategy_kwargs) -> Accelerator:
    """Create the process's only Accelerator (with a strategy's own arguments), then set its thread budget."""
    check_runnable(process)
    if not torch.distributed.is_initialized():
        # Accelerate keeps one state per process; a second run in the same process
        # (the Python API, a notebook) may ask for other settings.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if torch.cuda.is_available():
        enable_gpu_speedups()
    try:
        accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),  # makes Accelerate join gloo processes on a CPU
            mixed_precision=process.mixed_precision,
            gradient_accumulation_steps=process.grad_accum,
            log_with=process.log_with,
            project_dir=project_dir,
            dataloader_config=DataLoaderConfiguration(non_blocking=True),
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=process.timeout))],
            **strategy_kwargs,
        )
    except ValueError as e:  # e.g. fp16 asked for on a CPU, an unknown tracker
        raise UserError(f"cannot set up the run: {e}") from None
    # After Accelerate, which sets its own count on a CPU when OMP_NUM_THREADS is unset.
    torch.set_num_threads(cpu_budget(process.threads))
    return accelerator


@dataclass(frozen=True)
class Setup:
    strategy: str
    world_size: int
    per_process_batch: int
    global_batch: int
    lr: float
    devices: list[str]  # one entry per process (dp: every GPU of its one process)
    threads: int  # this process's intra-op threads (cores / processes on a machine)
    loader_workers: int
    decode_threads: int  # threads decoding each batch in a loader worker, or here without workers
    threads_from: str  # what chose ``threads``: --threads, OMP_NUM_THREADS, or the cores, quota and load


def describe(cfg: TrainConfig, accelerator: Accelerator, cores: Threads) -> Setup:
    """This world's share of the job: the global batch, the learning rate it scales to (NaN for ``--lr
    auto`` until the sweep chooses it), the devices in play, and the process's ``cores``."""
    strategy = effective(cfg)
    global_batch = cfg.batch_size * accelerator.num_processes * cfg.grad_accum
    lr = float("nan") if cfg.lr == "auto" else cfg.lr
    if cfg.scale_lr:
        lr *= global_batch / cfg.reference_batch
    return Setup(
        strategy.name,
        accelerator.num_processes,
        cfg.batch_size,
        global_batch,
        lr,
        strategy.devices(accelerator),
        cores.intra_op,
        cores.loader_workers,
        cores.decode,
        cores.chosen_by,
    )


def prepare(accelerator: Accelerator, cfg: TrainConfig, model: nn.Module, optimizer, *loaders):
    """Hand everything to Accelerate the way this process's strategy does."""
    return effective(cfg).prepare(accelerator, cfg, model, optimizer, *loaders)
