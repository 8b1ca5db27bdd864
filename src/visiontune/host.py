"""What this machine offers a run: the cores this process may use, and the user's cache folder.

One rule each, so the scan, the image cache, the loaders and ``check`` agree; ``check_environment``
refuses the environment variables the README names when they are unusable. No torch: the CLI reads
these before it imports it.
"""

from __future__ import annotations

import math
import os
import tempfile

from visiontune.config import UserError


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a Slurm or container limit), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def user_cache_dir() -> str:
    """``$VISIONTUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/visiontune``, else ``~/.cache/visiontune``."""
    return os.environ.get("VISIONTUNE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "visiontune"
    )


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
    cache folder must be one this process can create and write in.
    """
    progress_seconds(0.0)
    if not trains:
        return
    base = user_cache_dir()
    named = next((v for v in ("VISIONTUNE_CACHE_DIR", "XDG_CACHE_HOME") if os.environ.get(v)), None)
    where = f"{named}={os.environ[named]!r}" if named else f"the cache folder {base}"
    try:
        os.makedirs(base, exist_ok=True)
        # Root may write anywhere os.access says, and /proc says yes to it: only a real file tells.
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise UserError(
            f"{where}: cannot write there ({e.strerror}); point VISIONTUNE_CACHE_DIR to a writable folder"
        ) from None
