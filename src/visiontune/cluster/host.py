"""What this machine offers a run: the cores this process may use, how many other tasks are running on
it now, the user's cache folder, and the library versions a run records.

One rule each, so the scan, the image cache, the loaders and ``check`` agree; ``check_environment``
refuses the environment variables the docs name when they are unusable. No torch: the CLI reads
these before it imports it.
"""

from __future__ import annotations

import math
import os
import stat
import statistics
import sys
import tempfile
import time

from visiontune.errors import UserError

CGROUP_ROOT = "/sys/fs/cgroup"
LOADAVG = "/proc/loadavg"  # read at each call: tests point it at a file of their own
OWN_TASKS = "/proc/self/task"
DEVICES = "/dev"  # where a GPU driver's device files are; tests point it at a folder of their own
# A GPU torch.cuda can use has one of these device files on Linux: NVIDIA's driver (nvidiactl, nvidia0, ...),
# ROCm's kernel driver (kfd), WSL2's GPU paravirtualisation (dxg).
_GPU_FILES = ("nvidia", "kfd", "dxg")


def _quota(text: str) -> float | None:
    """Cores a cgroup grants from ``cpu.max`` ("200000 100000"; "max ..." is none), or None."""
    parts = text.split()
    if len(parts) < 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup and its parents (the smallest), in cores, or None.

    A container limited to 2 CPUs on a 64-core host (Kubernetes ``limits.cpu``, ``docker --cpus``)
    still has all 64 in its affinity; only the quota says 2. cgroup v2 keeps it in ``cpu.max``
    along the process's path; v1 in ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``.
    """
    limits = []
    own = ""
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.startswith("0::"):  # v2: the unified hierarchy
            own = line[3:].strip().strip("/")
    parts = own.split("/") if own else []
    for depth in range(len(parts), -1, -1):  # the process's own cgroup first, then each parent
        text = _read(os.path.join(root, *parts[:depth], "cpu.max"))
        if text is not None and (q := _quota(text)) is not None:
            limits.append(q)
    v1 = os.path.join(root, "cpu")
    quota, period = _read(os.path.join(v1, "cpu.cfs_quota_us")), _read(os.path.join(v1, "cpu.cfs_period_us"))
    if quota is not None and period is not None and (q := _quota(f"{quota.strip()} {period.strip()}")):
        limits.append(q)
    return min(limits) if limits else None


def core_limits() -> dict[str, float | int | None]:
    """What bounds this process's cores: its affinity and its cgroup quota (None: no quota)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"affinity": affinity, "cgroup_quota": cgroup_cpu_limit()}


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity (a Slurm or taskset limit) and its cgroup quota
    (a container's CPU limit, rounded up: a quota of 1.5 lets two threads run half the time), at least 1."""
    limits = core_limits()
    cores = limits["affinity"]
    if limits["cgroup_quota"] is not None:
        cores = min(cores, math.ceil(limits["cgroup_quota"]))
    return max(1, int(cores))


def machine_cores() -> int:
    """The machine's online cores, whatever this process may use: what the load on it is shared by."""
    return os.cpu_count() or 1


def gpus() -> int:
    """The CUDA (or ROCm) GPUs torch sees, asking torch only where there may be one: a refusal or a job's plan
    that needs the answer on a machine without a GPU gets it without torch's import (seconds, tens on a busy
    machine)."""
    if no_gpu_here():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_gpu_here() -> bool:
    """True where this machine surely has no GPU for torch.cuda, told from the device files a driver makes
    (Linux) or the platform (macOS has no CUDA); False where there may be one, and torch must be asked."""
    if sys.platform == "darwin":
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        names = os.listdir(DEVICES)
    except OSError:
        return False  # no /dev to read: ask torch
    return not any(name.startswith(_GPU_FILES) for name in names)


def running_elsewhere(samples: int = 3, interval: float = 0.01) -> int | None:
    """Tasks outside this process that are running or waiting for a core now, or None where the system does
    not say (no ``/proc/loadavg``).

    ``/proc/loadavg``'s fourth field ("3/412": 3 runnable of 412) is the machine's runnable count at the
    moment it is read; the load averages beside it trail by a minute and still count this process's own
    last run. The median of a few reads ``interval`` seconds apart, less this process's own running
    threads (the reader at least), is what a busy neighbour looks like now.
    """
    counts = []
    for i in range(samples):
        if i:
            time.sleep(interval)
        text = _read(LOADAVG)
        fields = text.split() if text else []
        running = fields[3].split("/")[0] if len(fields) > 3 else ""
        if not running.isdigit():
            return None
        counts.append(int(running) - _own_running())
    return max(0, round(statistics.median(counts)))


def _own_running() -> int:
    """This process's threads that are running now (state R in ``/proc/self/task/*/stat``), at least 1: the one
    reading."""
    try:
        tasks = os.listdir(OWN_TASKS)
    except OSError:
        return 1
    running = 0
    for task in tasks:
        text = _read(os.path.join(OWN_TASKS, task, "stat")) or ""
        state = text[text.rfind(")") + 1 :].split()[:1]  # the name in parentheses may hold spaces
        running += state == ["R"]
    return max(1, running)


def user_cache_dir() -> str:
    """``$VISIONTUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/visiontune``, else ``~/.cache/visiontune``."""
    return os.environ.get("VISIONTUNE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "visiontune"
    )


def versions() -> dict[str, str]:
    """The library versions a run records in ``config.json`` (and ``bench`` in its results)."""
    import platform

    import accelerate
    import torch
    import torchvision

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "accelerate": accelerate.__version__,
    }


def progress_seconds(default: float) -> float:
    """``$VISIONTUNE_PROGRESS_SECONDS``: seconds between progress lines when stderr is not a terminal."""
    text = os.environ.get("VISIONTUNE_PROGRESS_SECONDS")
    if not text:  # set but empty is unset, as for the cache folder
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:  # 0: a line at every step
        raise UserError(f"VISIONTUNE_PROGRESS_SECONDS={text!r} is not a number of seconds >= 0; fix or unset it")
    return value


def check_environment(trains: bool) -> None:
    """Refuse, at start-up, the environment variables the README names when they hold what no run can use.

    Read later, a bad value would end a run after its listing, scan and first steps, or in every
    worker at once: one line now instead. ``trains``: the command scans or caches images, so the
    cache folder must be one this process can create and write in. A folder the user named
    (``VISIONTUNE_CACHE_DIR``, ``XDG_CACHE_HOME``) is refused; the default one (a read-only home, as in
    many containers) is replaced, as matplotlib does with its own, by a new temporary folder, said in
    one line and set in ``VISIONTUNE_CACHE_DIR`` so that the workers the run starts use it too. A cache
    folder another user could write in (``untrusted``), named or not, is refused: its files are trusted.
    """
    progress_seconds(0.0)
    if not trains:
        return
    base = user_cache_dir()
    named = next((v for v in ("VISIONTUNE_CACHE_DIR", "XDG_CACHE_HOME") if os.environ.get(v)), None)
    problem = _unwritable(base)
    if problem is None:
        _refuse_untrusted(base)
        return
    if named:
        raise UserError(
            f"{named}={os.environ[named]!r}: cannot write there ({problem}); "
            "point VISIONTUNE_CACHE_DIR to a writable folder"
        )
    temporary = tempfile.mkdtemp(prefix="visiontune-cache-")  # mode 0700, this user's: as a cache folder must be
    _refuse_untrusted(temporary)  # a $TMPDIR others may write in
    os.environ["VISIONTUNE_CACHE_DIR"] = temporary
    print(
        f"visiontune: the cache folder {base} cannot be written ({problem}); this run keeps its caches in "
        f"{temporary} (set VISIONTUNE_CACHE_DIR to a writable folder to keep them between runs)",
        file=sys.stderr,
    )


def _refuse_untrusted(folder: str) -> None:
    problem = untrusted(folder)
    if problem:
        raise UserError(
            f"{problem}: another user could change the cached images and downloads a run trusts; make the folder "
            "yours and `chmod go-w` it (as ssh wants ~/.ssh), or set VISIONTUNE_CACHE_DIR to a folder of your own"
        )


def untrusted(folder: str) -> str | None:
    """Why files in ``folder`` could be changed by another user, or None: the rule ssh has for ``~/.ssh``.

    The folder must be owned by this user and writable by nobody else (group or others); each folder above
    it owned by this user or root and not writable by others unless sticky (as /tmp: nobody may rename or
    replace another user's entry there), or another user could swap the whole folder. A group-writable folder
    above is let be: a umask of 002 (one group per user, as on Debian) makes such folders.
    """
    if not hasattr(os, "getuid"):  # no POSIX owners and modes (Windows)
        return None
    uid, path = os.getuid(), os.path.realpath(folder)
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot read the owner of the cache folder {path} ({e.strerror or e})"
    if st.st_uid != uid:
        return f"the cache folder {path} is owned by another user (uid {st.st_uid}; this user is {uid})"
    if st.st_mode & 0o022:
        return f"the cache folder {path} is writable by {_who(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})"
    while (parent := os.path.dirname(path)) != path:
        path = parent
        try:
            st = os.stat(path)
        except OSError as e:
            return f"cannot read the owner of {path}, above the cache folder ({e.strerror or e})"
        if st.st_uid not in (0, uid):
            return f"{path}, above the cache folder, is owned by another user (uid {st.st_uid})"
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            return f"{path}, above the cache folder, is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _who(mode: int) -> str:
    return "every user" if mode & 0o002 else "its group"


def _unwritable(folder: str) -> str | None:
    """Why ``folder`` cannot be created or written in, or None. Made 0700: a cache folder is this user's alone."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        # Root may write anywhere os.access says, and /proc says yes to it: only a real file tells.
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None
