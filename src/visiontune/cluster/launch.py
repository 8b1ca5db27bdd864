"""Every launcher and cluster variable visiontune reads, and the hand-over to torch.distributed.run.

Who started this process decides what happens. Inside a launcher's worker
(torchrun, ``accelerate launch``: LOCAL_RANK is set) nothing is started. Slurm with
one task per GPU started every process already: each joins under the ranks Slurm
gave it. Otherwise a strategy of several processes (``visiontune train --strategy ddp``) becomes, in this same process,
the elastic agent of ``torchrun ... -m visiontune train ...`` for this machine; its
nodes, node rank and rendezvous are planned by ``jobplan`` from the flags and the
environment read here (Slurm, Kubernetes-style variables). Workers die with their agent (a parent-death signal), so
a launcher killed with SIGKILL leaves nothing running. The run folder is fixed
here, before the workers start, so that they all agree on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

from visiontune.cluster import jobplan, slurm, strategies
from visiontune.cluster.host import available_cores, core_limits, machine_cores, running_elsewhere
from visiontune.cluster.jobplan import LaunchSettings, Plan
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig

LAUNCHER_PID = "VISIONTUNE_LAUNCHER_PID"  # set by relaunch for its workers: who they must die with
ENV = os.environ  # the one place the process environment is read from


# --- inside a worker: what the launcher said ----------------------------------------------------------


def is_worker() -> bool:
    """Started by a launcher (even one of a single process): never start a second one."""
    return "LOCAL_RANK" in ENV


def world_size() -> int:
    return int(ENV.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(ENV.get("RANK", "0"))


def local_world_size() -> int:
    """Processes on this machine, as the launcher says (1 outside a launcher)."""
    return int(ENV.get("LOCAL_WORLD_SIZE", "1"))


def inside_launcher() -> bool:
    """A worker of a job of several processes: it runs a strategy of several, whatever --strategy says
    (``strategy.effective``)."""
    return is_worker() and world_size() > 1


def group_rank(default: int) -> int:
    """This machine's index among the job's machines, as the launcher says (``default`` outside one)."""
    return int(ENV.get("GROUP_RANK", default))


def restart_count() -> int:
    """How often torch.distributed.run restarted this job's workers (0 on the first attempt)."""
    return int(ENV.get("TORCHELASTIC_RESTART_COUNT", "0"))


def rendezvous() -> tuple[str, int] | None:
    """The address and port of the store the agent keeps for every attempt; None when rank 0 makes one per attempt."""
    if ENV.get("TORCHELASTIC_USE_AGENT_STORE", "True") != "True":
        return None
    return ENV["MASTER_ADDR"], int(ENV["MASTER_PORT"])


def accelerate_cpu_single() -> bool:
    """``accelerate launch --cpu`` without mpirun: it started one process where N were asked for."""
    return (
        ENV.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1") and "MASTER_ADDR" in ENV and "WORLD_SIZE" not in ENV
    )


def die_with_launcher() -> None:
    """In a torchrun worker: ask Linux to SIGKILL this process when its parent, the agent, dies.

    The agent starts each worker in a session of its own, so a SIGKILLed agent
    (``kill -9``, the OOM killer) would otherwise leave its workers training on as orphans.
    """
    if "TORCHELASTIC_RUN_ID" not in ENV or not sys.platform.startswith("linux"):
        return
    if forked_worker():
        _forked_worker()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    # 15 = PR_SET_NAME: `ps -o comm`, `top` and `pgrep` tell the workers apart (a forked one has its agent's
    # command line).
    libc.prctl(15, f"visiontune r{rank()}".encode()[:15])
    if ENV.get(LAUNCHER_PID) and os.getppid() != int(ENV[LAUNCHER_PID]):
        os._exit(128 + signal.SIGKILL)  # the agent died before the line above took effect


def forked_worker() -> bool:
    """Whether this process is a torchrun worker forked from its agent (not a new interpreter)."""
    return "TORCHELASTIC_RUN_ID" in ENV and multiprocessing.parent_process() is not None


def _forked_worker() -> None:
    """A worker forked from the agent starts as a new interpreter would (``subprocess`` workers are).

    In a session of its own, so a Ctrl-C or a signal to the launcher's process group reaches the agent
    alone, which passes it on; with the default signal handlers (the agent's handlers raise its own
    exceptions); and printing to the standard file descriptors, not to whatever stream objects the agent
    had put in ``sys.stdout`` (a test's capture).
    """
    with contextlib.suppress(OSError):
        os.setsid()
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout, sys.stderr = _on_fd(sys.stdout, 1, "surrogateescape"), _on_fd(sys.stderr, 2, "backslashreplace")


def _on_fd(stream, fd: int, errors: str):
    with contextlib.suppress(AttributeError, OSError, ValueError):
        if stream.fileno() == fd:
            return stream
    return open(fd, "w", buffering=1, errors=errors, closefd=False)  # noqa: SIM115 (the process's own, for its life)


# What gloo says in the processes left when a peer of the job has died (its own error said above).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is this worker's collective failing because another process of the job ended."""
    return inside_launcher() and isinstance(exc, RuntimeError) and any(p in str(exc) for p in _PEER_GONE)


def outlast_peer(seconds: float = 10.0) -> None:
    """After a peer of the job ended: stay until the agent stops this worker (SIGTERM, sent once it has seen
    the peer's exit), for at most ``seconds``. Exiting at once, this worker could be the failure the agent
    sees first, and the job would say it failed rather than the peer that did. The only worker on its machine
    leaves at once: the peer was another machine's, whose exit this machine's agent never sees."""
    if not inside_launcher() or local_world_size() == 1:
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        signal.sigtimedwait({signal.SIGTERM}, seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def leave_process_group() -> None:
    """Tear this worker's process group down before it exits on an error it has reported.

    Left to the interpreter's exit, the group's C++ threads can end the process with SIGABRT
    ("terminate called without an active exception") once a peer has gone, and the launcher
    then reports a crash instead of the worker's own exit code (2 for a user error).
    """
    if "torch" not in sys.modules:  # nothing to tear down, and no reason to import torch for it
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- before any worker: how this machine's part of the job starts -------------------------------------


def run_folder(cfg: TrainConfig) -> str:
    """The folder a run writes: --output-dir, else the run --resume names, else a new timestamped one."""
    return cfg.output_dir or (cfg.resume if cfg.resume not in (None, "auto") else default_output_dir())


def default_output_dir() -> str:
    return os.path.join("runs", datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))


def plan(cfg: TrainConfig | LaunchSettings, env: Mapping[str, str] = ENV, cluster: bool = True) -> Plan:
    """``jobplan.plan`` for this machine: from the process environment unless ``env`` is given."""
    return jobplan.plan(_launch(cfg), env, cluster)


def _launch(cfg: TrainConfig | LaunchSettings) -> LaunchSettings:
    return cfg if isinstance(cfg, LaunchSettings) else LaunchSettings.of(cfg)


# The variables by which a cluster names a job's processes (Slurm's SLURM_*, an operator's PET_* and these).
_CLUSTER_VARS = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}


def this_machine_only(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less the cluster's names for a job's processes: a job started with it plans its processes from
    its flags, on this machine alone. A tuner's trial is such a job: under a Slurm tune job each node's tuner
    runs trials of its own, which must not rendezvous with the other nodes' trials as one job."""
    return {k: v for k, v in env.items() if not k.startswith(("SLURM_", "PET_")) and k not in _CLUSTER_VARS}


def join_cluster(cfg: TrainConfig) -> None:
    """Under Slurm with one task per GPU, become the rank Slurm started (Accelerate reads these variables).

    Also refuse a cluster job of several processes that --strategy would not make one job.
    """
    if is_worker():
        return
    alloc = slurm.allocation(ENV)
    started = alloc.ntasks if alloc else (world_size() if jobplan.kubernetes(ENV) else 1)
    several = strategies.get(cfg.strategy).several_processes
    if not several and started > 1:
        raise UserError(
            f"the cluster started {started} processes but --strategy is {cfg.strategy}: each would "
            f"train alone; pass --strategy {strategies.several_default().name}"
        )
    if several:
        p = plan(cfg)
        if p.join:
            ENV.update(p.join)


def needs_launcher(cfg: TrainConfig | LaunchSettings, command: str = "train") -> bool:
    cfg = _launch(cfg)
    if not cfg.several_processes or is_worker():
        return False
    p = plan(cfg, cluster=command == "train")
    return p.nproc > 1 or p.nnodes != "1" or cfg.max_restarts > 0 or p.rdzv_endpoint is not None


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


def launcher_argv(
    cfg: TrainConfig | LaunchSettings, argv: list[str], command: str = "train", forked: bool = False
) -> list[str]:
    """torchrun's arguments for this run, then the workers' ``visiontune <command>`` arguments.

    ``forked``: each worker is a fork of this process running ``visiontune/__main__.py`` as a function
    (torchrun's ``--start-method fork --run-path``), not a new interpreter: it starts holding what this
    process has imported (torch, at least: about 2 CPU s a worker, and every import on a restart).
    """
    cfg = _launch(cfg)
    p = plan(cfg, cluster=command == "train")
    args = [f"--nproc-per-node={p.nproc}", f"--nnodes={p.nnodes}", f"--max-restarts={cfg.max_restarts}"]
    if p.rdzv_endpoint:  # elastic: the c10d store at the endpoint assigns the node ranks
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={p.rdzv_endpoint}", f"--rdzv-id={p.rdzv_id}"]
    elif p.nnodes == "1":
        args.append("--standalone")  # rendezvous on a free local port
    else:
        args += [f"--node-rank={p.node_rank}", f"--master-addr={p.master_addr}", f"--master-port={p.master_port}"]
    # "--" ends torchrun's own options: its parser takes abbreviations, so a worker's
    # ``--run`` would otherwise clash with its ``--run-path``.
    if forked:
        main_py = importlib.util.find_spec("visiontune.__main__").origin
        return [*args, "--start-method=fork", "--run-path", "--", main_py, command, *argv]
    return [*args, "-m", "--", "visiontune", command, *argv]


_COMMAND_LINE = [False]  # set by the `visiontune` command: this process is visiontune's from its start


def started_by_command_line() -> None:
    _COMMAND_LINE[0] = True


def can_fork_workers() -> bool:
    """Whether the workers may be forks of this process: only the `visiontune` command's own process (not a
    notebook's or another program's that calls the CLI, whose threads and descriptors a fork would copy),
    and not where CUDA is, which a forked child cannot use once its parent has touched it, and only while
    this process has one thread: a fork keeps just the calling thread, so a lock another one held (OpenMP's
    team, started by any torch op run on several threads, is the usual one) would never be released in the
    child, which then hangs at its first parallel op. Otherwise the workers start as new interpreters."""
    if not _COMMAND_LINE[0]:
        return False
    _stop_tqdm_monitor()
    if _threads_now() > 1:
        return False
    import torch

    return not torch.cuda.is_available()


def can_fork_helper() -> bool:
    """Whether a child forked now may do a piece of this process's work on one torch thread (the image cache's
    build, ``loading.cache``): only in the `visiontune` command's own process, as for ``can_fork_workers``,
    and while no other Python thread runs, whose locks (a print's, an import's) the child could need. OpenMP's
    team, which keeps a training worker from being a fork, is no such lock to a child that runs every op on
    its one thread (as a DataLoader's forked workers do). Linux only: elsewhere torch's libraries are not known
    to survive a fork."""
    if not (_COMMAND_LINE[0] and sys.platform.startswith("linux")):
        return False
    _stop_tqdm_monitor()
    return threading.active_count() == 1


def die_with_parent(parent: int) -> None:
    """In a forked child: ask Linux to SIGKILL it when ``parent`` dies, so that it never outlives its work."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)  # the parent died before the line above took effect


def _command_in_fork(argv: list[str], env: dict[str, str], log: str | None) -> None:
    """A forked child's body: ``visiontune ARGV`` as ``python -m visiontune`` runs it, its output in ``log``
    (None: this process's own)."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for std in (1, 2):
            os.dup2(fd, std)
        os.close(fd)
    main_py = importlib.util.find_spec("visiontune.__main__").origin
    sys.argv = [main_py, *argv]
    runpy.run_path(main_py, run_name="__main__")  # exits non-zero by SystemExit, as the command does


class ForkedProcess:
    """A ``multiprocessing`` child, started, with the ``subprocess.Popen`` methods a parent that waits for it and
    passes signals on uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self._process.start()
        self.pid = self._process.pid

    def wait(self) -> int:
        """The exit code (negative: the signal that ended it), once it has ended."""
        self._process.join()
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedCommand(ForkedProcess):
    """``visiontune ARGV`` in a fork of this process (where ``can_fork_workers``), started holding its imports."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: str | None = None):
        sys.stdout.flush()
        sys.stderr.flush()
        super().__init__(
            multiprocessing.get_context("fork").Process(target=_command_in_fork, args=(argv, dict(env), log))
        )


def ended(thread: threading.Thread) -> None:
    """Join ``thread`` and wait for its system thread to go: joined, its Python side is done, and the system
    thread ends a moment later; until then ``can_fork_workers`` counts it."""
    thread.join()
    for _ in range(1000):
        if not os.path.exists(f"/proc/self/task/{thread.native_id}"):
            return
        time.sleep(0.001)


def _threads_now() -> int:
    """This process's threads that a fork could leave holding a lock (Linux: its /proc tasks; elsewhere what
    Python started). jemalloc's background thread (pyarrow's allocator, there once ``hf:`` data was read) is
    not counted: jemalloc takes its own locks around a fork, and the child allocates without that thread."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return threading.active_count()
    return sum(_thread_name(t) not in _FORK_SAFE_THREADS for t in tasks)


_FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def _stop_tqdm_monitor() -> None:
    """End tqdm's monitor thread, which a progress bar starts (``datasets`` shows one while it loads ``hf:``
    data) and which only retunes a stalled bar's refresh: the workers can then be forks. A later bar starts
    another."""
    monitor = sys.modules.get("tqdm._monitor")
    for thread in threading.enumerate() if monitor else ():
        if isinstance(thread, monitor.TMonitor):
            thread.exit()
            thread.tqdm_cls.monitor = None  # the bar class that started it (a subclass of tqdm's)
            ended(thread)


def _thread_name(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended meanwhile
        return ""


def here_or_relaunched(
    nproc: int | None, argv: list[str], command: str, skipped: Callable[[], object], run: Callable[[], object]
) -> int:
    """``run()`` here, or with ``nproc`` > 1 in that many processes; exit 1 when ``skipped()`` files were unreadable.

    Under a launcher a worker exits 0 with skips (exit 1 would read as a crashed worker); the
    launching process reads ``skipped()`` from the output the workers wrote and reports it.
    """
    cfg = LaunchSettings(nproc=nproc)
    if needs_launcher(cfg, command):
        code = relaunch(cfg, argv, command)
        return 1 if code == 0 and skipped() else code
    run()
    if inside_launcher():
        leave_process_group()  # left to the interpreter's exit, its threads can abort a finished worker
    return 1 if not inside_launcher() and skipped() else 0


def relaunch(cfg: TrainConfig | LaunchSettings, argv: list[str], command: str = "train") -> int:
    """Run the workers under the elastic agent; return the job's exit code."""
    cfg = _launch(cfg)
    from torch.distributed.elastic.multiprocessing.api import (
        SignalException,
        _terminate_process_handler,
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    forked = can_fork_workers()
    torchrun_args = launcher_argv(cfg, argv, command, forked=forked)
    if forked:
        # A forked worker that exits non-zero is logged by the agent with the traceback of its own join; the
        # worker has said why it stopped (one line), and a new-interpreter worker's exit is logged without one.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_traceback)
    # Each worker takes cores / processes threads (cpu_budget); tell
    # OpenMP the same before the workers start so nothing oversubscribes.
    nproc = int(torchrun_args[0].split("=")[1])
    # What this process had: a job started from the Python API leaves the caller's environment as it was.
    before = {k: ENV.get(k) for k in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    if cfg.threads:
        ENV["OMP_NUM_THREADS"] = str(cfg.threads)
    ENV.setdefault("OMP_NUM_THREADS", str(max(1, cpu_budget() // nproc)))
    ENV[LAUNCHER_PID] = str(os.getpid())
    if cfg.rdzv_endpoint:
        # torch shares the rendezvous store with the workers, but a node that joins a later round
        # then waits forever for keys the first round's rank 0 never writes again: opt out.
        ENV.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The agent already passes SIGTERM and SIGINT on to the workers (which checkpoint and stop);
    # make SIGUSR1 take the same path instead of killing the agent alone.
    old_usr1 = signal.signal(signal.SIGUSR1, _terminate_process_handler)
    try:
        run(get_args_parser().parse_args(torchrun_args))
    except SignalException as e:
        print(
            f"visiontune: stopped by {signal.Signals(e.sigval).name}; the workers wrote a checkpoint "
            "(continue with --resume auto and the same --output-dir)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank_, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(
            f"visiontune: worker rank {rank_} failed with exit code {failure.exitcode} "
            f"(its output is above); the job stopped",
            file=sys.stderr,
        )
        return code
    finally:
        # Called from the Python API the process lives on: workers it starts later, through another
        # launcher, must not take it for their launcher and kill themselves.
        ENV.pop(LAUNCHER_PID, None)
        for k, v in before.items():
            if v is None:
                ENV.pop(k, None)
            else:
                ENV[k] = v
        signal.signal(signal.SIGUSR1, old_usr1)
    return 0


def _without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info = record.exc_text = None
    return True


def threads_choice(threads: int | None = None, processes: int | None = None, reserved: int = 0) -> tuple[int, str]:
    """This process's intra-op threads and what chose them.

    ``--threads N`` first, then ``OMP_NUM_THREADS`` (set by the user to share a machine, by
    visiontune's own launcher for its workers, or by torchrun, whose default is 1), then this
    process's share of the cores it may use (affinity and cgroup quota, over the ``processes`` on
    this machine: by default the launcher's local processes), cut to the cores no other task is running on
    now (``host.running_elsewhere``). PyTorch's OpenMP threads spin at every parallel region until all have
    arrived: one that another process has descheduled holds up the rest, and beside one busy process two
    threads on two cores ran 2-10x slower than one (benchmarks/contention.py). Decoding shares the same
    budget (``strategy.resolve_threads``). ``reserved``: cores kept for one-thread processes beside them
    (``serve``'s decoding processes).
    """
    if threads:
        return threads, "--threads"
    omp = ENV.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    processes = processes or local_world_size()
    limits = core_limits()
    quota = "" if limits["cgroup_quota"] is None else f", cgroup quota {limits['cgroup_quota']:g}"
    share = core_share(processes, reserved)
    less = f" less {reserved} for decoding processes" if reserved else ""
    why = f"cores (affinity {limits['affinity']}{quota}){less} / {processes} local process{'es' * (processes != 1)}"
    busy = running_elsewhere() if share > 1 else None
    if busy is None:
        return share, why
    free = machine_cores() - busy - reserved  # the reserved processes run beside the model too
    if free >= share or not busy:
        return share, f"{why}; {busy} other task{'s' * (busy != 1)} running on the machine's {machine_cores()} cores"
    chosen = max(1, free)
    return chosen, (
        f"{why} = {share}, cut to {chosen}: {busy} other task{'s' * (busy != 1)} running on the machine's "
        f"{machine_cores()} cores (/proc/loadavg), and a thread that waits for a descheduled one spins"
    )


def core_share(processes: int | None = None, reserved: int = 0) -> int:
    """This process's share of the cores it may use, less ``reserved``, among ``processes`` (default: the
    launcher's local ones)."""
    return max(1, (available_cores() - reserved) // (processes or local_world_size()))


def default_threads(threads: int | None) -> bool:
    """Whether ``threads_choice(threads)`` is visiontune's own choice, which the machine's load may change."""
    omp = ENV.get("OMP_NUM_THREADS", "").strip()
    return not threads and not (omp.isdigit() and int(omp) > 0)


def cpu_budget(threads: int | None = None) -> int:
    """This process's share of the machine's cores (``threads_choice``)."""
    return threads_choice(threads)[0]
