"""Files written whole or not at all: a temp file beside the target, fsync, ``os.replace``.

Every wing writes through these (run records, caches, batch scripts, reports), so a kill or a full
disk never leaves half a file. Only the main process writes run files: callers invoke these after
``accelerator.wait_for_everyone()`` inside ``if accelerator.is_main_process``, which is safe
because none of them runs a collective. Imports only ``errors``.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from visiontune.errors import NoSpaceError, UserError


def _kind(mode: int) -> str | None:
    """What a path that is not a regular file is, in words (None for a regular file)."""
    kinds = (
        (stat.S_ISREG, None),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISFIFO, "a FIFO"),
    )
    return next((kind for test, kind in kinds if test(mode)), "a socket")


def check_replaceable(path: str | os.PathLike, what: str = "") -> None:
    """Refuse, in one line, a target that is there and is not a regular file.

    A write here is a rename over the target, which would turn a device node (``/dev/full``, as root), a FIFO
    or a symbolic link into a plain file. A link is not written through either (``cp`` does): the link may
    have been planted in a shared folder to aim the write at another file, so the user names the file itself.
    ``what`` (``--out``) names the flag the path came from.
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # absent (the usual case), or its folder is not: the write itself says so
        return
    kind = _kind(mode)
    if kind is None:
        return
    named = f"{what} {path}" if what else str(path)
    target = f" (to {os.path.realpath(path)})" if kind == "a symbolic link" else ""
    raise UserError(
        f"{named} is {kind}{target}; visiontune writes a new file whole and renames it into place, so it replaces "
        "only regular files: give the path of a regular file or a new one"
    )


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` whole or not at all: a unique temp file beside it, fsync, rename.

    Its mode is what the user's umask makes of 0666, as for any new file (and Accelerate's own). A full
    disk (or quota) is a ``UserError`` saying that ``path`` is as it was; a ``path`` that is there and is
    not a regular file (a device, a link) is refused before anything is written (``check_replaceable``).
    """
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its files are mode 0600; 0666 here is narrowed by the user's umask, like any new file.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            # The temp file is gone and ``path`` was never touched: say so, in one line, not a traceback.
            kept = f"the previous {path.name} is kept whole" if path.exists() else f"no {path.name} was written"
            raise NoSpaceError(
                f"no space left on the disk of {path.parent} while writing {path.name} ({e.strerror}); "
                f"{kept}; free some space and run the command again"
            ) from None
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` to ``path`` whole or not at all (see ``atomic_file``).

    Text is UTF-8 with surrogate escapes: a file name that is not UTF-8 (read from the disk as
    lone surrogates) is written back as the bytes it has on disk, as the split and the scan cache
    store it, so a CSV row names the file it came from.
    """
    with atomic_file(path) as f:
        f.write(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)


def write_json(path: str | os.PathLike, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")
