"""What a job keeps when its processes change: restarts, a new world size, one shared run folder.

An elastic job (``--rdzv-endpoint`` with ``--nnodes MIN:MAX``) may run, or come back
after a failure, with fewer or more processes than MAX nodes or its last checkpoint had.
visiontune keeps the global batch (per-process batch x processes x accumulation) that
of MAX nodes, or of the checkpoint, by changing ``--grad-accum``: the learning rate,
the LR schedule's length and the samples each optimizer step sees stay the same; the
position read from a checkpoint is converted from the old world's batches to the new
one's. A world that cannot make the global batch is refused with one line. Every start of the workers is
appended to ``RUN/world.jsonl``. The run folder must be one folder for all machines
(each process writes its RNG state into the checkpoint): a folder that is not shared
is found before training and stops the run with one line.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from datetime import timedelta

import torch

from visiontune.cluster import jobplan, launch
from visiontune.errors import UserError
from visiontune.runs import checkpoint
from visiontune.settings.config import TrainConfig

WORLD_LOG = "world.jsonl"


def join_restarted_group(timeout_s: float) -> None:
    """In a restarted worker, join the process group under a key prefix of its own attempt.

    The elastic agent keeps one store for every attempt, and the previous attempt's
    gloo/NCCL address keys are still in it: a worker that reads its peer's stale
    address before the peer rewrites it connects to a dead port and the restart
    fails (or hangs). Prefixing the keys by the attempt number avoids the race;
    Accelerate then adopts the initialised group as it is.
    """
    import torch.distributed as dist

    if not launch.restart_count() or dist.is_initialized() or launch.rendezvous() is None:
        return
    timeout = timedelta(seconds=timeout_s)
    addr, port = launch.rendezvous()
    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"visiontune/attempt_{launch.restart_count()}", store)
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=prefixed,
        timeout=timeout,
        rank=launch.rank(),
        world_size=launch.world_size(),
    )


def _resume_source(cfg: TrainConfig) -> str | None:
    if cfg.resume not in (None, "auto"):
        return cfg.resume
    return cfg.output_dir if cfg.resume == "auto" or launch.restart_count() else None


def global_batch_accumulation(cfg: TrainConfig) -> int:
    """The accumulation that gives this world the job's global batch (``cfg.grad_accum`` when it does).

    The global batch is the checkpoint's when the world changed since it was written; in a fresh
    elastic job (``--nnodes MIN:MAX``), that of MAX nodes, whichever nodes came first.
    """
    world, source = launch.world_size(), _resume_source(cfg)
    found = checkpoint.latest(source, say=lambda *_: None) if source and os.path.isdir(source) else None
    lo, hi = jobplan.node_range(cfg.nnodes or 1)
    if found is not None and (found.meta.get("world_size", world) != world or lo != hi):
        target, why = found.meta["global_batch"], f"the checkpoint in {source} ({found.meta['world_size']} processes)"
    elif found is None and lo != hi:
        target = cfg.batch_size * hi * launch.local_world_size() * cfg.grad_accum
        why = f"--nnodes {cfg.nnodes} at {hi} nodes"
    else:
        return cfg.grad_accum
    if target == cfg.batch_size * world * cfg.grad_accum:
        return cfg.grad_accum
    accum, rest = divmod(target, cfg.batch_size * world)
    if rest or accum < 1:
        raise UserError(
            f"the global batch is {target}, set by {why}; {world} processes of --batch-size "
            f"{cfg.batch_size} cannot make it with gradient accumulation; use a number of nodes that "
            "divides it, or start a new run"
        )
    return accum


def record_world(run_dir: str, setup, cfg: TrainConfig, resumed) -> dict:
    """Append this start of the workers to ``RUN/world.jsonl`` (main process only); return the entry."""
    entry = {
        "restart": launch.restart_count(),
        "world_size": setup.world_size,
        "grad_accum": cfg.grad_accum,
        "global_batch": setup.global_batch,
        "lr": setup.lr,
        "resumed_from": resumed.path if resumed else None,
        "checkpoint_world_size": resumed.meta.get("world_size") if resumed else None,
    }
    with open(os.path.join(run_dir, WORLD_LOG), "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def check_shared_folder(accelerator, run_dir: str) -> None:
    """Stop before training when some process cannot see a file the main process wrote in ``run_dir``."""
    if accelerator.num_processes < 2:
        return
    from accelerate.utils import broadcast_object_list, gather_object

    token = [f".shared-check-{uuid.uuid4().hex}"]
    broadcast_object_list(token)
    probe = os.path.join(run_dir, token[0])
    if accelerator.is_main_process:
        os.makedirs(run_dir, exist_ok=True)
        open(probe, "w").close()
    accelerator.wait_for_everyone()
    views = gather_object([(accelerator.process_index, socket.gethostname(), os.path.exists(probe))])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.remove(probe)
    blind = [(r, host) for r, host, seen in views if not seen]
    if blind:
        who = ", ".join(f"rank {r} on {host}" for r, host in blind)
        raise UserError(
            f"the run folder {run_dir} is not shared: {who} cannot see the files rank 0 writes there; "
            "put --output-dir on a file system every machine mounts (each process writes its part "
            "of every checkpoint)"
        )
