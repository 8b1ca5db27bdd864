"""The job's plan for this machine: nodes, node rank, processes and rendezvous, from the flags,
else a Slurm allocation, else the variables a Kubernetes operator sets (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, and torchrun's PET_* ones). A flag that contradicts the cluster is an error
naming both. The environment comes in as a mapping (``launch`` passes the process's), so
nothing here reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from visiontune.cluster import host, slurm, strategies
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig


def default_nproc() -> int:
    """Processes on this machine when --nproc is not given: one per GPU, else two."""
    return host.gpus() or 2


@dataclass(frozen=True)
class LaunchSettings:
    """What the launch of a job of several processes reads: the flags of ``train`` that place its processes
    (``of``), or a command's own (``predict --nproc N``)."""

    several_processes: bool = True  # the strategy runs one process per device
    nproc: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    threads: int | None = None

    @classmethod
    def of(cls, cfg: TrainConfig) -> LaunchSettings:
        several = strategies.get(cfg.strategy).several_processes
        placed = (cfg.nproc, cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port, cfg.rdzv_endpoint)
        return cls(several, *placed, cfg.max_restarts, cfg.threads)


@dataclass(frozen=True)
class Plan:
    source: str  # where nodes and ranks came from: flags, Slurm or Kubernetes
    nnodes: str  # N, or MIN:MAX for an elastic job
    node_rank: int
    nproc: int  # processes on this machine
    master_addr: str
    master_port: int
    rdzv_endpoint: str | None  # HOST:PORT of a c10d rendezvous instead of a fixed master
    rdzv_id: str
    join: dict[str, str] | None = None  # Slurm started every process: the variables this one joins with


def node_range(nnodes: str) -> tuple[int, int]:
    lo, _, hi = str(nnodes).partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"--nnodes must be N or MIN:MAX, got {nnodes!r}") from None
    if not 1 <= lo_n <= hi_n:
        raise UserError(f"--nnodes must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got {nnodes!r}")
    return lo_n, hi_n


def _agree(flag: str, given, found, where: str):
    """The flag's value when given, else the cluster's; both given and different is an error."""
    if given is None or found is None:
        return found if given is None else given
    ok = node_range(given)[0] <= found <= node_range(given)[1] if flag == "nnodes" else given == found
    if not ok:
        raise UserError(
            f"--{flag.replace('_', '-')} {given} contradicts {where}: drop the flag, or change the allocation"
        )
    return given


def kubernetes(env: Mapping[str, str]) -> bool:
    """Variables of a Kubernetes-style operator (PyTorchJob and the like) name the job's processes."""
    return {"MASTER_ADDR", "WORLD_SIZE", "RANK"} <= env.keys()


def plan(cfg: LaunchSettings, env: Mapping[str, str], cluster: bool = True) -> Plan:
    """Nodes, ranks, processes and rendezvous for ``cfg``: flags first, then the cluster's variables."""
    if cfg.rdzv_endpoint and not cfg.rdzv_endpoint.rpartition(":")[2].isdigit():
        raise UserError(f"--rdzv-endpoint must be HOST:PORT, got {cfg.rdzv_endpoint!r}")
    nnodes, node_rank, nproc = cfg.nnodes, cfg.node_rank, cfg.nproc
    addr, port, join, source = cfg.master_addr, cfg.master_port, None, "flags"
    alloc = slurm.allocation(env) if cluster else None
    if alloc is not None:
        source, at = "Slurm", "the Slurm allocation"
        nnodes = str(_agree("nnodes", nnodes, alloc.nnodes, f"{at} ({alloc.nnodes} nodes, SLURM_NNODES)"))
        node_rank = _agree("node_rank", node_rank, alloc.node_rank, f"{at} (SLURM_NODEID={alloc.node_rank})")
        addr, port = addr or alloc.first_host, port or alloc.port
        if alloc.one_task_per_gpu:
            nproc = _agree("nproc", nproc, alloc.tasks_here, f"{at} ({alloc.tasks_here} task(s) on this node)")
            if cfg.rdzv_endpoint:
                addr, port = cfg.rdzv_endpoint.rsplit(":", 1)[0], int(cfg.rdzv_endpoint.rsplit(":", 1)[1])
            join = {
                "RANK": str(alloc.task_rank),
                "LOCAL_RANK": str(alloc.local_task),
                "GROUP_RANK": str(node_rank),
                "WORLD_SIZE": str(alloc.ntasks),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": addr,
                "MASTER_PORT": str(port),
            }
        elif nproc is not None and alloc.gpus and nproc > alloc.gpus:
            raise UserError(
                f"--nproc {nproc} contradicts {at} ({alloc.gpus} GPU(s) on this node, "
                "SLURM_GPUS_ON_NODE): drop the flag, or ask for more GPUs"
            )
        nproc = nproc or alloc.gpus
    elif cluster and kubernetes(env) and "LOCAL_RANK" not in env:
        source, at = "Kubernetes", "the job's environment"
        # PyTorchJob sets PET_NNODES/PET_NODE_RANK (torchrun's own variables) beside WORLD_SIZE and RANK,
        # which then count processes; operators of one process per pod set WORLD_SIZE and RANK alone.
        nodes = int(env["PET_NNODES"] if env.get("PET_NNODES", "").isdigit() else env["WORLD_SIZE"])
        this = int(env.get("PET_NODE_RANK") or env["RANK"])
        nnodes = str(_agree("nnodes", nnodes, nodes, f"{at} ({nodes} nodes, PET_NNODES or WORLD_SIZE)"))
        node_rank = _agree("node_rank", node_rank, this, f"{at} (node rank {this}, PET_NODE_RANK or RANK)")
        addr, port = addr or env["MASTER_ADDR"], port or int(env.get("MASTER_PORT") or 29500)
        nproc = nproc or (int(env["PET_NPROC_PER_NODE"]) if env.get("PET_NPROC_PER_NODE", "").isdigit() else None)
    nnodes, node_rank = str(nnodes or 1), node_rank or 0
    lo, hi = node_range(nnodes)
    if lo != hi and not cfg.rdzv_endpoint:
        raise UserError(
            f"--nnodes {nnodes} (elastic) needs --rdzv-endpoint HOST:PORT: membership that changes "
            "needs the c10d rendezvous"
        )
    if not 0 <= node_rank < hi:
        raise UserError(f"--node-rank must be in [0, {hi - 1}], got {node_rank}")
    rdzv_id = alloc.job_id if alloc else env.get("PET_RDZV_ID", "visiontune")
    return Plan(
        source,
        nnodes,
        node_rank,
        nproc or default_nproc(),
        addr or "127.0.0.1",
        port or 29500,
        cfg.rdzv_endpoint,
        rdzv_id,
        join,
    )
