"""The batch script ``visiontune slurm`` writes: one job that asks for the resources, runs ``srun PYTHON -m
visiontune train ... --resume auto`` (the interpreter that wrote it, by absolute path) with one task per
node, has Slurm send USR1 two minutes before the time limit (the run checkpoints and exits 138) and then
puts itself back in the queue, where the same command resumes at that batch. Every value is held to
Slurm's syntax or shell-quoted: nothing a user types becomes a line of its own.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

from visiontune.cluster import strategies
from visiontune.errors import UserError

PREEMPTED = 138  # 128 + SIGUSR1: what a run stopped by USR1 exits with
SIGNAL_LEAD_S = 120


def time_limit_seconds(text: str) -> int:
    """Slurm's ``--time`` formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    # The text goes into the script as given: no strip (a newline before it would start a shell line), and
    # ASCII digits only (\d is any script's digit, which int() reads and Slurm does not).
    m = re.fullmatch(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?", text)
    if not m:
        raise UserError(f"--time {text!r} is not a Slurm time limit; write e.g. 90 (minutes), 4:00:00 or 1-12:00:00")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-H[:M[:S]]
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a * 60 + b) * 60 + c
    return a * 60 + (b or 0)  # M[:S]


# The ``visiontune slurm`` options besides the train flags: (flag, type, help).
FLAGS = (
    ("--nodes", int, "required: nodes to allocate"),
    ("--gpus-per-node", int, "required: GPUs per node (0 for CPU nodes); one process per GPU"),
    ("--time", str, "required: time limit, as Slurm writes it (90, 4:00:00, 1-12:00:00)"),
    ("--partition", str, "Slurm partition"),
    ("--cpus-per-task", int, "CPU cores per node (default 4 per GPU)"),
    ("--job-name", str, "job name (default visiontune); the log is NAME-JOBID.out"),
    ("--out", str, "file to write (default: standard output, e.g. piped into sbatch)"),
)


def write(script: str, out: str | None) -> None:
    """The script to ``out`` (made executable), or to standard output."""
    if out is None:
        print(script, end="")
        return
    from visiontune.files import atomic_write

    try:
        atomic_write(out, script)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror}); pass another --out PATH") from None
    os.chmod(out, 0o755)
    print(f"visiontune: wrote {out}; submit it with `sbatch {out}`", file=sys.stderr)


# Train flags a batch script may not carry: Slurm decides them, or the requeue needs --resume auto.
_SLURM_DECIDES = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--resume")


# Values written into ``#SBATCH`` lines, which sbatch reads without any quoting: each is held to Slurm's own
# syntax for it, which has no room for a newline (the next line would be a shell command, or a directive of
# its own), quotes, ``$``, backticks or ``;``.
_NAME = r"[A-Za-z0-9_.-]+"


_SBATCH_SYNTAX = {
    "--partition": (
        rf"{_NAME}(?:,{_NAME})*",
        "a partition name, or several separated by commas (letters, digits, _ . -)",
    ),
    "--job-name": (r"[A-Za-z0-9_.+-]{1,128}", "up to 128 letters, digits and _ . + -"),
}


def _check_sbatch_value(flag: str, value: str) -> None:
    pattern, wanted = _SBATCH_SYNTAX[flag]
    if not re.fullmatch(pattern, value):
        raise UserError(f"{flag} {value!r} is not a Slurm {flag[2:].replace('-', ' ')}: write {wanted}")


def _check_printable(argv: list[str], output_dir: str | None) -> None:
    """Every value of the srun line is shell-quoted, so ``$``, quotes and ``;`` stay text; a control character
    (a newline, a tab, an escape) has no place in a path or a name, and would split or hide a line of the script."""
    values = [(a.split("=", 1)[0] if a.startswith("--") else argv[i - 1] if i else "", a) for i, a in enumerate(argv)]
    for flag, value in [*values, ("--output-dir", output_dir or "")]:
        if not value.isprintable():
            raise UserError(
                f"{flag or 'an argument'} {value!r} holds a control character (a newline, a tab...), which a "
                "batch script cannot carry: remove it"
            )


def batch_script(
    train_argv: list[str],
    *,
    nodes: int,
    gpus_per_node: int,
    time: str,
    partition: str | None,
    cpus_per_task: int | None,
    job_name: str,
    output_dir: str | None,
    python: str | None = None,
    prefix: str | None = None,
    strategy: str | None = None,
) -> str:
    """An sbatch script running ``visiontune train`` with ``train_argv`` on the allocation, with ``python``
    (default: this interpreter) of the environment at ``prefix`` (default ``sys.prefix``: this venv or conda
    env, whichever is running, not whatever VIRTUAL_ENV or CONDA_PREFIX a shell left set)."""
    python, prefix = python or sys.executable, prefix or sys.prefix
    if nodes < 1 or gpus_per_node < 0:
        raise UserError(f"--nodes must be >= 1 and --gpus-per-node >= 0, got {nodes} and {gpus_per_node}")
    if cpus_per_task is not None and cpus_per_task < 1:
        raise UserError(f"--cpus-per-task must be >= 1, got {cpus_per_task}")
    _check_sbatch_value("--job-name", job_name)
    if partition is not None:
        _check_sbatch_value("--partition", partition)
    _check_printable([*train_argv, python, prefix], output_dir)
    if time_limit_seconds(time) <= SIGNAL_LEAD_S:
        raise UserError(f"--time {time} leaves no time to train: Slurm warns {SIGNAL_LEAD_S} s before the limit")
    for flag in _SLURM_DECIDES:
        if any(a == flag or a.startswith(flag + "=") for a in train_argv):
            raise UserError(
                f"{flag} has no place in a batch script: the allocation decides the nodes, ranks and "
                "address, and a requeued job resumes with --resume auto (to continue a run, give "
                "its folder as --output-dir)"
            )
    cpus = cpus_per_task or 4 * max(1, gpus_per_node)
    run_dir = shlex.quote(output_dir) if output_dir else '"runs/slurm-$SLURM_JOB_ID"'
    train = " ".join(shlex.quote(a) for a in train_argv)
    bin_dir, python = shlex.quote(os.path.join(prefix, "bin")), shlex.quote(python)
    gpus = f"#SBATCH --gpus-per-node={gpus_per_node}\n" if gpus_per_node else ""
    part = f"#SBATCH --partition={partition}\n" if partition else ""
    # Each node's visiontune starts its processes: --strategy's when it is one of several processes (fsdp).
    chosen = strategies.get(strategy) if strategy else strategies.several_default()
    multi = (chosen if chosen.several_processes else strategies.several_default()).name
    return f"""#!/bin/bash
# Written by `visiontune slurm`. One task per node: on each node visiontune starts
# its processes under torch.distributed.run, and reads nodes, ranks and the address
# of the first node from the allocation. Submit with: sbatch THIS_FILE
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time}
{part}#SBATCH --signal=USR1@{SIGNAL_LEAD_S}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

# {SIGNAL_LEAD_S} s before the time limit Slurm sends USR1: the run finishes its step, writes a
# checkpoint and exits with {PREEMPTED}; the job then goes back in the queue, and the same command
# (--resume auto, same run folder) continues at that batch. A requeued job keeps its id and log.

# visiontune runs from the environment this script was written from, its interpreter by absolute path
# and its bin/ first on PATH (as activating it would), whatever the job's login shell activates. Every
# node must see that path (a shared filesystem); Slurm's srun and scontrol must be on PATH.
export PATH={bin_dir}:"$PATH"
srun --kill-on-bad-exit=1 {python} -m visiontune train {train} --strategy {multi} --output-dir {run_dir} --resume auto
code=$?
if [ "$code" -eq {PREEMPTED} ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""


def tune_script(
    tune_argv: list[str],
    *,
    storage: str | None,
    nodes: int,
    gpus_per_node: int,
    time: str,
    partition: str | None,
    cpus_per_task: int | None,
    job_name: str,
    trial_processes: int = 1,
    python: str | None = None,
    prefix: str | None = None,
) -> str:
    """An sbatch script running one ``visiontune tune`` per node on one journal file (``storage``): the tuners
    share the study, each running as many trials at once as its node has GPUs for them (``--parallel``: one
    per GPU, or one per ``trial_processes`` GPUs when each trial is a job of that many processes), and a
    requeued job continues the study (a trial stopped by USR1 is run again from its start)."""
    python, prefix = python or sys.executable, prefix or sys.prefix
    if not storage or "://" in storage:
        raise UserError(
            "a Slurm tune job needs --storage FILE, a journal file on a file system every node sees "
            "(a database URL works too, but then run the tuners yourself)"
        )
    if nodes < 1 or gpus_per_node < 0:
        raise UserError(f"--nodes must be >= 1 and --gpus-per-node >= 0, got {nodes} and {gpus_per_node}")
    if cpus_per_task is not None and cpus_per_task < 1:
        raise UserError(f"--cpus-per-task must be >= 1, got {cpus_per_task}")
    if gpus_per_node and trial_processes > gpus_per_node:
        raise UserError(
            f"each trial is a job of {trial_processes} processes, one GPU each, but --gpus-per-node is "
            f"{gpus_per_node}: ask for at least {trial_processes} GPUs a node, or lower --nproc"
        )
    _check_sbatch_value("--job-name", job_name)
    if partition is not None:
        _check_sbatch_value("--partition", partition)
    if any(a in ("--storage", "--parallel") or a.startswith(("--storage=", "--parallel=")) for a in tune_argv):
        raise UserError("a Slurm tune job sets --storage and --parallel itself: leave them out of its tune flags")
    _check_printable([*tune_argv, python, prefix, storage], None)
    if time_limit_seconds(time) <= SIGNAL_LEAD_S:
        raise UserError(f"--time {time} leaves no time to tune: Slurm warns {SIGNAL_LEAD_S} s before the limit")
    cpus, per_node = cpus_per_task or 4 * max(1, gpus_per_node), max(1, gpus_per_node // trial_processes)
    args = " ".join(shlex.quote(a) for a in tune_argv)
    bin_dir, python = shlex.quote(os.path.join(prefix, "bin")), shlex.quote(python)
    gpus = f"#SBATCH --gpus-per-node={gpus_per_node}\n" if gpus_per_node else ""
    part = f"#SBATCH --partition={partition}\n" if partition else ""
    job = f", each a job of {trial_processes} processes on its node" if trial_processes > 1 else ""
    return f"""#!/bin/bash
# Written by `visiontune tune --slurm-script`. One tuner per node, all on one journal file: they share
# one study (Optuna gives each trial to one tuner) and each runs {per_node} trial(s) at once{job}.
# Submit with: sbatch THIS_FILE
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time}
{part}#SBATCH --signal=USR1@{SIGNAL_LEAD_S}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

# {SIGNAL_LEAD_S} s before the time limit Slurm sends USR1: each running trial stops at its next step and
# goes back in the study's queue, and the tuners exit with {PREEMPTED}; the requeued job runs the same
# command, which continues the study (finished trials kept, the stopped ones run again).
export PATH={bin_dir}:"$PATH"
srun --kill-on-bad-exit=0 {python} -m visiontune tune {args} --storage {shlex.quote(storage)} --parallel {per_node}
code=$?
if [ "$code" -eq {PREEMPTED} ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""
