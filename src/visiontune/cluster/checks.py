"""What a run's settings are refused for before anything heavy loads: the strategy, the precision, the tracker.

A refusal here is one line within the command's first second: this module imports neither torch nor
Accelerate, and asks torch whether there is a GPU (fp16, ``--fsdp-offload``, ``--sync-batchnorm``) only on a
machine whose device files say there may be one (``host.gpus``), so that a flag combination that cannot run
is not refused after seconds of loading. ``strategy`` builds the Accelerator from settings that passed here.
"""

from __future__ import annotations

import importlib.util

from visiontune.cluster import host, strategies
from visiontune.cluster.launch import accelerate_cpu_single, inside_launcher, local_world_size, rank
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig


def effective(cfg: TrainConfig) -> strategies.Strategy:
    """The strategy this process runs: --strategy's, except that a worker of a launcher's job of several
    processes (torchrun, accelerate launch) runs the default one of several processes when --strategy
    names a strategy of one."""
    named = strategies.get(cfg.strategy)
    if inside_launcher() and not named.several_processes:
        return strategies.several_default()
    return named


def check_runnable(cfg) -> None:
    """Refuse settings (a ``TrainConfig``, or ``strategy.ProcessSettings``) that would quietly do something else
    here: fp16 on a CPU, a missing tracker."""
    if cfg.mixed_precision == "fp16" and not host.gpus():
        # Accelerate would train in fp32 on a CPU while config.json said fp16.
        raise UserError(
            "--mixed-precision fp16 needs a GPU (on a CPU it would train in fp32); use --mixed-precision bf16 or no"
        )
    if not cfg.log_with:
        return
    from accelerate.utils import LoggerType

    trackers = {t.value for t in LoggerType} - {"all"}  # their values are also their module names
    if cfg.log_with in trackers and importlib.util.find_spec(cfg.log_with) is None:
        # Accelerate leaves out trackers it cannot import, so the run would log nothing.
        extra = "'visiontune[tensorboard]'" if cfg.log_with == "tensorboard" else cfg.log_with
        raise UserError(f"--log-with {cfg.log_with}: {cfg.log_with} is not installed; pip install {extra}")


def check(cfg: TrainConfig) -> None:
    """Refuse what cannot run here before any worker starts; note what a launcher overrides."""
    effective(cfg).check(cfg)
    check_runnable(cfg)
    if cfg.sync_batchnorm and effective(cfg).several_processes and not host.gpus():
        raise UserError(
            "--sync-batchnorm needs GPUs: torch's SyncBatchNorm does not run on the CPU; "
            "drop the flag (each process then normalises its own batch)"
        )
    if rank() != 0:
        return  # one note per job, not one per process
    if inside_launcher() and cfg.nproc is not None and cfg.nproc != local_world_size():
        print(
            f"visiontune: --nproc {cfg.nproc} ignored: the launcher started {local_world_size()} "
            "process(es) on this machine"
        )
    elif accelerate_cpu_single() and not strategies.get(cfg.strategy).several_processes:
        # `accelerate launch --cpu --num_processes N` needs mpirun to start N processes; without it, one runs.
        print(
            "visiontune: accelerate launch started one process (its --cpu mode needs mpirun for more); for N "
            "CPU processes use `accelerate launch --multi_gpu --num_processes N` or "
            f"--strategy {strategies.several_default().name} --nproc N"
        )
