"""Re-run ``visiontune train`` under ``torch.distributed.run`` when N processes are asked for.

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
from visiontune.strategy import cpu_budget, inside_launcher


def default_nproc() -> int:
    return torch.cuda.device_count() or 2


def default_output_dir() -> str:
    return os.path.join("runs", datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))


def needs_launcher(cfg: TrainConfig) -> bool:
    return cfg.strategy == "ddp" and not inside_launcher() and (
        (cfg.nproc or default_nproc()) > 1 or cfg.nnodes > 1 or cfg.max_restarts > 0)


# Flags for the launcher only. They are not passed on to the workers: torchrun's
# parser would take ``--nproc`` for its own ``--nproc-per-node`` and fail.
LAUNCHER_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--max-restarts")


def worker_argv(train_argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in train_argv:
        if skip:
            skip = False
        elif arg in LAUNCHER_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in LAUNCHER_FLAGS)):
            out.append(arg)
    return out


def launcher_argv(cfg: TrainConfig, train_argv: list[str]) -> list[str]:
    """torchrun's arguments for this run, then the workers' ``visiontune train`` arguments."""
    nproc = cfg.nproc or default_nproc()
    args = [f"--nproc-per-node={nproc}", f"--nnodes={cfg.nnodes}", f"--max-restarts={cfg.max_restarts}"]
    if cfg.nnodes == 1:
        args.append("--standalone")  # rendezvous on a free local port
    else:
        args += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}",
                 f"--master-port={cfg.master_port}"]
    return [*args, "-m", "visiontune", "train", *worker_argv(train_argv)]


def relaunch(cfg: TrainConfig, train_argv: list[str]) -> int:
    """Run the workers under the elastic agent; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    nproc = cfg.nproc or default_nproc()
    # Each worker takes cores / processes threads (strategy.cpu_budget); tell
    # OpenMP the same before the workers start so nothing oversubscribes.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpu_budget() // nproc)))
    if cfg.output_dir is None:
        train_argv = [*train_argv, "--output-dir", default_output_dir()]
    # The agent already passes SIGTERM and SIGINT on to the workers (which checkpoint and stop);
    # make SIGUSR1 take the same path instead of killing the agent alone.
    signal.signal(signal.SIGUSR1, _terminate_process_handler)
    try:
        run(get_args_parser().parse_args(launcher_argv(cfg, train_argv)))
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
