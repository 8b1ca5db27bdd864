"""One writer per run folder: an exclusive lock held for the run's lifetime.

``hold(run_dir)`` creates the run folder if needed (refusing, in one line, a
path that is a file or a folder it cannot write), then takes ``flock`` on
``RUN/.visiontune.lock`` and writes the holder's pid and host into it. The
kernel releases a ``flock`` when the process holding it ends, however it ends,
so a crashed or SIGKILLed run never leaves a stale lock behind; a second run
into the same folder is refused with the holder's pid and host. Under a
launcher the lock belongs to one process: the visiontune launcher takes it
before starting the workers and tells them so through ``HELD_BY_PARENT`` (an
elastic restart replaces workers, never the launcher); under an outside
launcher (torchrun, accelerate launch) the main process takes it, and its
restarted successor takes it again once the kernel has released it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from visiontune import files
from visiontune.errors import UserError

LOCK_FILE = ".visiontune.lock"
HELD_BY_PARENT = "VISIONTUNE_RUN_LOCK"  # the run folder our launcher holds the lock of, for its workers
_HELD: set[int] = set()  # the lock descriptors this process holds


def _drop_in_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file, and a flock is released only when
    # every copy is closed: after a kill -9 of the run, a worker still alive for its few seconds of
    # noticing would keep the folder locked against the run's own --resume. The child never writes the
    # run folder, so it lets go of the lock at once.
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def writable_dir(path: str, what: str = "--output-dir") -> Path:
    """``path`` as a folder this process can write into (created if missing), or one ``UserError`` line."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{what} {path} is a file, not a folder; choose another {what}") from None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot create it ({e.strerror}); choose another {what}") from None
    if not folder.is_dir():
        raise UserError(f"{what} {path} is a file, not a folder; choose another {what}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path} is not writable; choose another {what} or fix its permissions")
    return folder


def writable_file(path: str, what: str = "--out") -> None:
    """Refuse now, before any work, a file path whose folder cannot be made or written."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file path")
    files.check_replaceable(path, what)  # a device or a link: refused now, not after the work
    parent = target.parent
    while not parent.exists() and parent != parent.parent:  # the nearest existing ancestor decides
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{what} {path}: {parent} is a file, not a folder; choose another {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path}: {parent} is not writable; choose another {what}")


def _holder(lock: Path) -> str:
    try:
        text = lock.read_text().split()
    except OSError:
        text = []
    return f"pid {text[0]} on host {text[1]}" if len(text) >= 2 else "another process"


@contextlib.contextmanager
def hold(run_dir: str, *, main_process: bool = True) -> Iterator[None]:
    """Hold ``run_dir``'s lock inside the ``with`` (only in the main process, unless our launcher holds it)."""
    if not main_process or os.environ.get(HELD_BY_PARENT) == os.path.abspath(run_dir):
        yield
        return
    created = not os.path.isdir(run_dir)
    folder = writable_dir(run_dir)
    lock = folder / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise UserError(
            f"--output-dir {run_dir}: cannot create {lock.name} ({e.strerror}); choose another --output-dir"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(f"--output-dir {run_dir}: cannot lock it ({e.strerror})") from None
            raise UserError(
                f"{run_dir} is in use by another visiontune run ({_holder(lock)}); wait for it "
                "to end, or choose another --output-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        _HELD.add(fd)
        yield
    finally:
        if created and os.listdir(folder) == [LOCK_FILE]:
            # A run that stopped before writing anything leaves no folder behind. Unlinked while still
            # held, so no later run can lock the old file after a new one locked its replacement.
            with contextlib.suppress(OSError):
                lock.unlink()
                folder.rmdir()
        _HELD.discard(fd)
        os.close(fd)  # releases the lock; an existing folder keeps the file (removing it would race)


@contextlib.contextmanager
def hold_for_workers(run_dir: str | None) -> Iterator[None]:
    """In the launcher: hold the lock while the workers run, and tell them it is held."""
    if run_dir is None:  # the workers' main process locks the folder it is given
        yield
        return
    with hold(run_dir):
        os.environ[HELD_BY_PARENT] = os.path.abspath(run_dir)
        try:
            yield
        finally:
            os.environ.pop(HELD_BY_PARENT, None)


def hold_run(accelerator, run_dir: str) -> contextlib.ExitStack:
    """Every process of a run: the main process takes the lock; a refusal stops every process alike."""
    from accelerate.utils import broadcast_object_list

    held, problem = contextlib.ExitStack(), [None]
    if accelerator.is_main_process:
        try:
            held.enter_context(hold(run_dir))
        except UserError as e:
            problem = [str(e)]
    if accelerator.num_processes > 1:
        broadcast_object_list(problem)
    if problem[0]:
        held.close()
        raise UserError(problem[0])
    return held
