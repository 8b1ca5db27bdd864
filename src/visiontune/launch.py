"""Re-run a ``visiontune`` subcommand under ``torch.distributed.run`` when N processes are asked for.

``visiontune train --strategy ddp --nproc N`` becomes, in this same process,
the elastic agent of ``torchrun --nproc-per-node N -m visiontune train ...``:
PyTorch starts, watches and (with ``--max-restarts``) restarts the workers.
Inside a launcher already (torchrun, ``accelerate launch``) nothing is
re-run. The run folder is fixed here, before the workers start, so that they
all agree on it.
"""
from __future__ import annotations

import os
import signal
import sys
from datetime import datetime, timezone

import torch

from visiontune.config import TrainConfig
from visiontune.strategy import cpu_budget


def default_nproc() -> int:
    return torch.cuda.device_count() or 2


def default_output_dir() -> str:
    return os.path.join("runs", datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))


def needs_launcher(cfg: TrainConfig) -> bool:
    # Any launcher's worker (even a job of one process) has LOCAL_RANK: never nest a second launcher.
    return cfg.strategy == "ddp" and "LOCAL_RANK" not in os.environ and (
        (cfg.nproc or default_nproc()) > 1 or cfg.nnodes > 1 or cfg.max_restarts > 0)


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``--f v`` or ``--f=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def launcher_argv(cfg: TrainConfig, argv: list[str], command: str = "train") -> list[str]:
    """torchrun's arguments for this run, then the workers' ``visiontune <command>`` arguments."""
    nproc = cfg.nproc or default_nproc()
    args = [f"--nproc-per-node={nproc}", f"--nnodes={cfg.nnodes}", f"--max-restarts={cfg.max_restarts}"]
    if cfg.nnodes == 1:
        args.append("--standalone")  # rendezvous on a free local port
    else:
        args += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}",
                 f"--master-port={cfg.master_port}"]
    # "--" ends torchrun's own options: its parser takes abbreviations, so a worker's
    # ``--run`` would otherwise clash with its ``--run-path``.
    return [*args, "-m", "--", "visiontune", command, *argv]


def relaunch(cfg: TrainConfig, argv: list[str], command: str = "train") -> int:
    """Run the workers under the elastic agent; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    nproc = cfg.nproc or default_nproc()
    # Each worker takes cores / processes threads (strategy.cpu_budget); tell
    # OpenMP the same before the workers start so nothing oversubscribes.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpu_budget() // nproc)))
    if command == "train" and cfg.output_dir is None:
        argv = [*argv, "--output-dir", default_output_dir()]
    # The agent already passes SIGTERM and SIGINT on to the workers (which checkpoint and stop);
    # make SIGUSR1 take the same path instead of killing the agent alone.
    signal.signal(signal.SIGUSR1, _terminate_process_handler)
    try:
        run(get_args_parser().parse_args(launcher_argv(cfg, argv, command)))
    except SignalException as e:
        print(f"visiontune: stopped by {signal.Signals(e.sigval).name}; the workers wrote a checkpoint "
              "(continue with --resume auto and the same --output-dir)", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"visiontune: worker rank {rank} failed with exit code {failure.exitcode} "
              f"(its output is above); the job stopped", file=sys.stderr)
        return code
    return 0
