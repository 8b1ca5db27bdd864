"""What this machine offers a run: the cores this process may use, the user's cache folder, and the
library versions a run records.

One rule each, so the scan, the image cache, the loaders and ``check`` agree. Only ``os``:
the CLI reads these before it imports torch.
"""

from __future__ import annotations

import os


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
