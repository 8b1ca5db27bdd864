"""Room on disk for a checkpoint: about how many bytes ``Accelerator.save_state`` will write, and
whether a write that failed ran out of room -- torch does not always say so with an errno, so the
disk is asked too. ``checkpoint.save`` checks the free space before writing and turns a full disk
into one line naming the checkpoint that is kept.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import torch

MB = 1 << 20


def needed_bytes(accelerator) -> int:
    """About what ``save_state`` writes: every model and optimizer tensor, plus room for the small files."""
    # The models and optimizers ``prepare`` registered: what ``save_state`` writes.
    stack = [m.state_dict() for m in accelerator._models] + [o.state_dict()["state"] for o in accelerator._optimizers]
    total = 0
    while stack:  # optimizer state nests: {param index: {"momentum_buffer": tensor, ...}}
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
    return total + 4 * MB


def out_of_space(e: BaseException, tmp: Path, needed: int) -> bool:
    """Whether a failed write ran out of room: torch reports a full disk as a RuntimeError with no errno
    ("iostream error", "unexpected pos"), so also ask the disk whether what is written plus what is free
    falls short of what was needed (after a passed free-space check, only a full disk does that)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    written = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file()) if tmp.is_dir() else 0
    return shutil.disk_usage(tmp.parent).free + written < needed
