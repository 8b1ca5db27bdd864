"""Slurm: what an allocation says (the batch script ``visiontune slurm`` writes is ``sbatch``'s).

``allocation(env)`` reads the variables Slurm sets in a job step (``srun``, or the
batch script itself): the nodes, this node's index, the first node's name from
the hostlist (``scontrol show hostnames`` where Slurm is installed, else the same
expansion here), a port derived from the job id, the GPUs on this node and the
tasks started. ``launch`` decides from it how the processes start; nothing here
starts any. Every variable is read strictly: a node list that does not parse, or ranks
and counts that do not add up, is one line before any process waits for another.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from visiontune.errors import UserError

MAX_HOSTS = 100_000  # more than any cluster has: a list like n[0-999999999] is refused, not expanded into memory
_HOST_PART = r"[A-Za-z0-9._-]+"


def _entries(text: str) -> list[str]:
    """``a[1-2,5],b`` -> ``a[1-2,5]``, ``b``: a comma outside brackets separates hosts, inside them ranges."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth not in (0, 1):
            raise ValueError("its brackets nest, or one closes before it opens")
        if ch == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("a bracket is not closed")
    return [*entries, text[start:]]


def _range_items(group: str) -> list[str]:
    """``01-03,7`` -> ``01, 02, 03, 7``: the lower bound's width is the zero padding of its range."""
    items: list[str] = []
    for part in group.split(","):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if not m:
            raise ValueError(f"[{group}] is not a list of numbers and ranges N-M")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo > hi:
            raise ValueError(f"the range {part} runs backwards")
        if len(items) + hi - lo >= MAX_HOSTS:
            raise ValueError(f"it names more than {MAX_HOSTS} hosts")
        items += [str(i).zfill(len(m[1])) for i in range(lo, hi + 1)]
    return items


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist grammar: ``gpu[01-02,7]-ib,r[1-2]n[1-2]`` -> ``gpu01-ib, gpu02-ib, gpu7-ib, r1n1, r1n2,
    r2n1, r2n2`` (zero padding kept). A ``ValueError`` says why a list does not parse: one read leniently
    (``node[1-`` as ``node``) starts a job whose rendezvous waits for a host that is not in it."""
    hosts: list[str] = []
    for entry in _entries(text):
        if not re.fullmatch(rf"(?:{_HOST_PART}|\[[^\[\]]+\])+", entry):
            raise ValueError(f"{entry!r} is not a host name, or a name with [ranges]")
        names = [""]
        for literal, group in re.findall(rf"({_HOST_PART})|\[([^\]]+)\]", entry):
            parts = [literal] if literal else _range_items(group)
            if len(hosts) + len(names) * len(parts) > MAX_HOSTS:
                raise ValueError(f"it names more than {MAX_HOSTS} hosts")
            names = [n + part for n in names for part in parts]
        hosts += names
    return hosts


def hostnames(nodelist: str, variable: str = "the node list") -> list[str]:
    """Slurm's own expansion when ``scontrol`` is on PATH, else ``expand_hostlist``; what neither parses is a
    ``UserError`` naming ``variable``."""
    if shutil.which("scontrol"):
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    try:  # scontrol failed or is absent: the same grammar here, and its reason when it does not parse
        return expand_hostlist(nodelist)
    except ValueError as e:
        raise UserError(f"{variable}={nodelist!r} is not a Slurm node list ({e}){_NOT_A_STEP}") from None


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> ``[2, 2, 2, 1]``; ``ValueError`` when it is not that form."""
    if not re.fullmatch(r"[0-9]+(?:\(x[0-9]+\))?(?:,[0-9]+(?:\(x[0-9]+\))?)*", text):
        raise ValueError("not of the form N, N(xM), ... ")
    counts: list[int] = []
    for n, times in re.findall(r"([0-9]+)(?:\(x([0-9]+)\))?", text):
        if len(counts) + int(times or 1) > MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS} nodes")
        counts += [int(n)] * int(times or 1)
    return counts


def port_for_job(job_id: str) -> int:
    """15000 + the job id's last four digits: every node of a job derives the same port, and
    neighbouring jobs on a node differ (the convention PyTorch Lightning uses)."""
    return 15000 + int(re.sub(r"\D", "", job_id)[-4:] or 0)


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nnodes: int
    node_rank: int  # SLURM_NODEID
    first_host: str
    port: int
    gpus: int | None  # on this node, when Slurm says
    ntasks: int  # tasks of the step, over every node
    tasks_here: int
    task_rank: int  # SLURM_PROCID
    local_task: int  # SLURM_LOCALID

    @property
    def one_task_per_gpu(self) -> bool:
        """Slurm started every process (``--ntasks-per-node G``); else one task per node starts them."""
        return self.ntasks > self.nnodes


# Said after each refusal of the Slurm variables: they are checked before any rendezvous, since a job started
# on numbers that do not add up waits for processes that will never come.
_NOT_A_STEP = "; visiontune reads the job from the SLURM_ variables: run it under srun, or unset them"


def _var(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set and not empty."""
    return next((n for n in names if env.get(n)), None)


def _count(env: Mapping[str, str], name: str | None, least: int = 0) -> int | None:
    """``env[name]`` as a whole number >= ``least`` (None when ``name`` is), else a ``UserError`` naming it."""
    if name is None:
        return None
    if not re.fullmatch(r"[0-9]+", env[name]) or int(env[name]) < least:
        raise UserError(f"{name}={env[name]!r} is not a whole number >= {least}{_NOT_A_STEP}")
    return int(env[name])


def _beyond(name: str, value: int, limit_name: str, limit: int) -> UserError:
    return UserError(f"{name}={value} is not below {limit_name}={limit}: the step has no such task{_NOT_A_STEP}")


def allocation(env: Mapping[str, str]) -> Allocation | None:
    """The job step this process runs in, or None outside Slurm (or in a bare ``salloc`` shell).

    Every number is checked, and checked against the others, before anything waits on it: a rank
    beyond the step's size or a node list that does not parse is one line here, not a rendezvous that hangs.
    """
    if not env.get("SLURM_JOB_ID") or "SLURM_NODEID" not in env:
        return None
    job_id = env["SLURM_JOB_ID"]
    _count(env, "SLURM_JOB_ID")  # the port and the rendezvous id are derived from it
    nnodes_var = _var(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nnodes = _count(env, nnodes_var, least=1) or 1
    node = _count(env, "SLURM_NODEID")
    if node >= nnodes:
        raise _beyond("SLURM_NODEID", node, nnodes_var or "the node count", nnodes)
    per_node_var = _var(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    try:
        per_node = tasks_per_node(env[per_node_var]) if per_node_var else []
    except ValueError as e:
        raise UserError(f"{per_node_var}={env[per_node_var]!r} is not a Slurm task count ({e}){_NOT_A_STEP}") from None
    ntasks_var = _var(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    ntasks = _count(env, ntasks_var, least=1) or sum(per_node) or nnodes
    task_rank = _count(env, "SLURM_PROCID") if "SLURM_PROCID" in env else node
    if task_rank >= ntasks:
        raise _beyond("SLURM_PROCID", task_rank, ntasks_var or "the task count", ntasks)
    tasks_here = per_node[node] if node < len(per_node) else max(1, ntasks // nnodes)
    local_task = _count(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    if local_task >= tasks_here:
        raise _beyond("SLURM_LOCALID", local_task, "this node's tasks", tasks_here)
    gpus_var = _var(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")
    gpus = env[gpus_var].rsplit(":", 1)[-1] if gpus_var else None  # the latter may read "a100:4"
    if gpus is not None and not re.fullmatch(r"[0-9]+", gpus):
        raise UserError(f"{gpus_var}={env[gpus_var]!r} is not a GPU count (N or TYPE:N){_NOT_A_STEP}")
    nodelist_var = _var(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    hosts = hostnames(env[nodelist_var], nodelist_var) if nodelist_var else ["localhost"]
    if nodelist_var and len(hosts) < nnodes:
        raise UserError(
            f"{nodelist_var}={env[nodelist_var]!r} names {len(hosts)} host(s), fewer than "
            f"{nnodes_var}={nnodes}{_NOT_A_STEP}"
        )
    return Allocation(
        job_id,
        nnodes,
        node,
        hosts[0],
        port_for_job(job_id),
        int(gpus) if gpus is not None else None,
        ntasks,
        tasks_here,
        task_rank,
        local_task,
    )
