"""``--cache``: decode and resize every image once into a memory-mapped uint8 array.

By default (``--cache fit``, ``choose``) the array goes in the user cache folder when it fits under a cap
(the smaller of 8 GiB and a quarter of the free space there), and a run whose array does not fit, or
cannot be written, decodes every epoch instead, after one line saying why; ``--cache DIR|auto`` always
caches (in DIR, or the user cache folder) and ``--cache off`` never does. The pixels are the same either way.

The cache is two files per (data set, image size, resize): ``<id>-<S>px.u8``, the images back to back as
uint8 [N, S, S, 3] (the decoder's order), and ``<id>-<S>px.json``, a small header whose ``key`` is a sha256
of the file list with each file's size and mtime, the image size, the resize (interpolation and crop) and
the decode (``--decode``; a non-default one of these also names the files, so a bilinear and a bicubic cache
of one data set live side by side), the format version and the torchvision release (its resize defines the
pixels), and ``digest``, an xxh3-128 of the array's bytes taken as they were written. A header whose key
matches means the array may be reused, once its bytes hash to that digest again (read whole at open: a
changed or corrupt array is rebuilt, said in one line; skipped while the array's ``stamp`` in the header,
its inode, size, mtime and ctime when it last matched, still holds: nothing has written to it since) and
neither file can be written by another user; anything else rebuilds it in place, written to temp files and
moved into place (array first, header last), so a reader never sees half a cache. Every process and every
epoch reads the same file through the OS page cache (in a job only each machine's local main process opens,
and so verifies, it): nothing is loaded into a process's own memory, and a process drops its page mappings
after each read, so its resident memory does not grow with the data set. The folder must be one only this
user may write in (``host.untrusted``, the rule ssh has for ``~/.ssh``; made 0700 when missing): ``--cache
DIR`` or ``auto`` in another is an error, ``fit`` goes on without a cache. The digest is no signature
(whoever can write the array can write its header): the folder rule keeps other users out, the digest
catches what changed an array in place since (a disk, a tool, a hand). The header is read bounded
(``MAX_HEADER``) and checked (its failed rows, digest and stamp); one that is not as ``build`` writes it is
rebuilt.
Files that fail to decode are stored as zeros, listed in the header, and skipped by
``CachedDataset`` exactly as ``ImageDataset`` skips them. Samples read through a reader (datasets
rows, shard members) are keyed by their names and the reader's content fingerprint instead of each
file's size and mtime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torchvision
import xxhash
from torch.utils.data import Dataset

from visiontune.cluster import launch
from visiontune.cluster.host import available_cores, untrusted, user_cache_dir
from visiontune.data.check import bounded_map, file_keys, name_keys
from visiontune.data.decode import MAX_PIXELS, try_read
from visiontune.errors import NoSpaceError, UserError
from visiontune.files import atomic_file
from visiontune.tasks import SINGLE_LABEL, Task

CACHE_VERSION = 3  # 2: rows stored height x width x channel; 3: the header holds the array's digest
DIGEST = "xxh3_128"  # ~12 GB/s of one core (benchmarks/cache_digest.py); hashlib's run at ~1
_CHUNK = 8 * 2**20
# A stamp taken less than this after the array's last change may not tell a later change apart (a file
# system's timestamps tick in milliseconds to seconds): such an array is hashed again, as git re-reads a
# "racily clean" file.
_RACY_NS = 3 * 10**9
_AROUND = max(mmap.PAGESIZE, 64 * 1024)


def resolve_dir(cache: str) -> str:
    """``auto`` -> the user's cache folder (``host.user_cache_dir``); anything else is the folder itself."""
    return user_cache_dir() if cache == AUTO else cache


def _resize_tag(interpolation: str, crop_pct: float | None, decode: str = "exact") -> str:
    # Empty for the default (exact decode, bilinear squash), so caches built before the choice existed stay valid.
    return (
        ("" if interpolation == "bilinear" else f"-{interpolation}")
        + ("" if crop_pct is None else f"-crop{crop_pct:g}")
        + ("" if decode == "exact" else f"-{decode}")
    )


def cache_key(
    paths: Sequence[str],
    image_size: int,
    interpolation: str = "bilinear",
    crop_pct: float | None = None,
    reader=None,
    decode: str = "exact",
) -> str:
    """sha256 over what decides the cached pixels: files (path, size, mtime), the size, the resize and the decode."""
    head = [CACHE_VERSION, image_size, torchvision.__version__]
    if _resize_tag(interpolation, crop_pct):
        head += [interpolation, crop_pct]
    if decode != "exact":
        head += [decode]
    h = hashlib.sha256(json.dumps(head).encode())
    # A missing file is part of the key too: it is recorded as bad.
    keys = file_keys(paths, MAX_PIXELS) if reader is None else name_keys(paths, reader.fingerprint, MAX_PIXELS)
    h.update(keys.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ImageCache:
    """A built cache: where its array lives, its shape, and the files that failed to decode."""

    array_path: str
    image_size: int
    count: int
    bad: dict[int, tuple[str, str]]  # row -> (path, reason)

    @property
    def item_bytes(self) -> int:
        return 3 * self.image_size * self.image_size


def _files(folder: str, paths: Sequence[str], image_size: int, tag: str) -> tuple[str, str]:
    # One cache per data set (its file list), size and resize, so several can share a folder.
    where = "" if not paths or os.path.isabs(paths[0]) else os.getcwd()
    h = hashlib.sha256(where.encode("utf-8", "surrogateescape"))
    for start in range(0, len(paths), 65536):  # "\n".join([where, *paths]), a chunk at a time
        h.update(("\n" + "\n".join(paths[start : start + 65536])).encode("utf-8", "surrogateescape"))
    ident = h.hexdigest()[:12]
    stem = os.path.join(folder, f"{ident}-{image_size}px{tag}")
    return stem + ".u8", stem + ".json"


def digest_file(path: str) -> str:
    """The array's digest as its header records it: ``xxh3_128:`` and the hash of the file's bytes."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:  # a map, not reads into a buffer: no copy (about 3x the speed); dropped as read, as rows are
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                m.madvise(mmap.MADV_SEQUENTIAL)
                for start in range(0, size, _CHUNK):
                    with memoryview(m)[start : start + _CHUNK] as chunk:
                        h.update(chunk)
                    m.madvise(mmap.MADV_DONTNEED, start, min(_CHUNK, size - start))
    return f"{DIGEST}:{h.hexdigest()}"


def _stamp(path: str) -> list[int]:
    """What any write to the array, in place or by replacing it, changes: its inode, size, mtime and
    ctime (which nobody can set back), with the time this was taken."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, time.time_ns()]


def _unchanged_since_hashed(array_path: str, stamp) -> bool:
    """Whether the array is the file its header's stamp saw when its bytes last hashed to the digest."""
    if not isinstance(stamp, list) or len(stamp) != 6 or not all(type(x) is int for x in stamp):
        return False  # none, or not one _stamp takes: the array is hashed
    now = _stamp(array_path)
    return now[:5] == stamp[:5] and stamp[4] + _RACY_NS < stamp[5]


def _changed(array_path: str, header_path: str, head: dict) -> str | None:
    """Why a cache whose key matches may not hold the pixels it was built with, or None."""
    for path in (array_path, header_path):
        st = os.stat(path)
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            return f"{path} is owned by another user (uid {st.st_uid}): it may have been changed"
        if st.st_mode & 0o022:
            return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): it may have been changed"
    # The whole array is hashed (a second and more at ImageNet size) unless nothing can have written to it
    # since it last hashed to the digest: then its stamp still matches, and that stamp was taken well after
    # its last change.
    if _unchanged_since_hashed(array_path, head.get("stamp")):
        return None
    before = _stamp(array_path)  # taken before the hash: a write while hashing changes the file after it
    if digest_file(array_path) != head.get("digest"):
        return f"{array_path} does not match its digest (changed or corrupt since it was built)"
    try:  # hashed whole just now: the next start need not, while the array stays this file
        _write_header(header_path, {**head, "stamp": before})
    except OSError:
        pass
    return None


def _write_header(header_path: str, head: dict) -> None:
    with atomic_file(header_path) as f:
        _owner_writes_only(f)
        f.write(json.dumps(head).encode("utf-8", "surrogateescape"))


MAX_HEADER = 64 << 20  # bytes of a header: only its list of the files that failed to decode grows


def _read_header(header_path: str) -> dict | None:
    """The header's JSON object, read bounded; None when there is none or it is no such object (rebuilt)."""
    with open(header_path, "rb") as f:
        text = f.read(MAX_HEADER + 1)
    try:
        head = json.loads(text) if len(text) <= MAX_HEADER else None
    except (ValueError, RecursionError):  # RecursionError: arrays nested past the parser
        return None
    return head if isinstance(head, dict) else None


def _bad_rows(bad, n: int) -> dict[int, tuple[str, str]] | None:
    """The header's failed rows checked -- each a row of the array with the file's path and why it failed,
    as ``build`` writes them -- or None."""
    if not isinstance(bad, dict):
        return None
    rows = {}
    for row, failed in bad.items():
        if not (row.isascii() and row.isdigit() and int(row) < n and isinstance(failed, list) and len(failed) == 2):
            return None
        if not all(isinstance(x, str) for x in failed):
            return None
        rows[int(row)] = (failed[0], failed[1])
    return rows


def _load(array_path: str, header_path: str, key: str, n: int, image_size: int) -> ImageCache | None:
    """The cache in these files when its key matches, its header is whole and its array whole and unchanged,
    else None."""
    try:
        head = _read_header(header_path)
        size_ok = os.path.getsize(array_path) == n * 3 * image_size * image_size
    except OSError:
        return None
    if head is None or head.get("key") != key or not size_ok:
        return None
    bad = _bad_rows(head.get("bad", {}), n)
    if bad is None or not isinstance(head.get("digest"), str):
        print(f"visiontune: the image cache header {header_path} is damaged: rebuilding it")
        return None
    try:
        problem = _changed(array_path, header_path, head)
    except OSError as e:
        problem = f"{array_path} cannot be read ({e.strerror or e})"
    if problem:  # never reused: it may not hold the pixels it was built with
        print(f"visiontune: the image cache {problem}: rebuilding it")
        return None
    return ImageCache(array_path, image_size, n, bad)


def build(
    array_path: str,
    header_path: str,
    key: str,
    paths: Sequence[str],
    image_size: int,
    threads: int,
    interpolation: str = "bilinear",
    crop_pct: float | None = None,
    reader=None,
    decode: str = "exact",
) -> ImageCache:
    """Decode + resize every file (in a thread pool: the decoders release the GIL) and write both files."""
    bad: dict[int, tuple[str, str]] = {}
    blank = bytes(3 * image_size * image_size)

    def write_array(f) -> None:
        # Bounded look-ahead: memory stays flat while building. Each file is decoded once, here: the
        # files that fail are the run's bad files, so no separate scan decodes them again.
        def read(i: int) -> torch.Tensor | str:
            return try_read(paths[i] if reader is None else reader[i], image_size, interpolation, crop_pct, decode)

        for i, img in enumerate(bounded_map(read, range(len(paths)), max(1, threads))):
            if isinstance(img, str):
                bad[i] = (paths[i], img)
                print(f"visiontune: cache: unreadable image {paths[i]}: {img}", file=sys.stderr)
            row = blank if isinstance(img, str) else img.permute(1, 2, 0).contiguous().numpy().tobytes()
            digest.update(row)  # the bytes as written: no second read of the array
            f.write(row)

    digest = xxhash.xxh3_128()
    # Readable by other users' runs (umask permitting), as every written file is; writable by this user only
    # (a umask of 002 would let the group write), as _load requires.
    with atomic_file(array_path) as f:
        _owner_writes_only(f)
        write_array(f)
    head = {
        "version": CACHE_VERSION,
        "key": key,
        "image_size": image_size,
        "interpolation": interpolation,
        "crop_pct": crop_pct,
        "decode": decode,
        "count": len(paths),
        "bad": {str(i): list(pr) for i, pr in bad.items()},
        "digest": f"{DIGEST}:{digest.hexdigest()}",
        "stamp": _stamp(array_path),  # the array in place, as just hashed (racy: the next open hashes it again)
    }
    _write_header(header_path, head)
    return ImageCache(array_path, image_size, len(paths), bad)


def _owner_writes_only(f) -> None:
    if hasattr(os, "fchmod"):
        os.fchmod(f.fileno(), stat.S_IMODE(os.fstat(f.fileno()).st_mode) & ~0o022)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class _Slot:
    """Where the cache of one (data set, size, resize, decode) lives in a folder, and the key it must carry."""

    folder: str
    array_path: str
    header_path: str
    key: str
    count: int
    image_size: int

    @property
    def nbytes(self) -> int:
        return self.count * 3 * self.image_size * self.image_size


def _slot(folder, paths, image_size, interpolation, crop_pct, reader, decode) -> _Slot:
    array_path, header_path = _files(folder, paths, image_size, _resize_tag(interpolation, crop_pct, decode))
    key = cache_key(paths, image_size, interpolation, crop_pct, reader, decode)
    return _Slot(folder, array_path, header_path, key, len(paths), image_size)


def _build_in(slot: _Slot, paths, threads, interpolation, crop_pct, reader, decode, meanwhile=None) -> ImageCache:
    """Build the cache in ``slot``, saying so; a folder that cannot be written raises ``OSError``, a full
    disk ``NoSpaceError`` (nothing half-written is left either way). ``meanwhile``: this process's own work
    to do while a forked child builds (``_build_beside``), where a child may be forked."""
    # stdout, from whichever process builds: a second build in one job would show up here.
    print(
        f"visiontune: building the image cache {slot.array_path} ({slot.count} images at {slot.image_size} px, "
        f"{interpolation}, {decode} decode)",
        flush=True,
    )
    if threads is None:  # the other processes wait for this one: all the machine's cores may decode
        threads = available_cores()
    args = (slot.array_path, slot.header_path, slot.key, paths, slot.image_size, threads, interpolation, crop_pct)
    # A reader's open files would be shared with the child (their offsets too): those are built here.
    if meanwhile is not None and reader is None and launch.can_fork_helper():
        return _build_beside(meanwhile, args, decode)
    return build(*args, reader, decode)


def _build_beside(meanwhile: Callable[[], None], args: tuple, decode: str) -> ImageCache:
    """``build(*args)`` in a forked child while this process runs ``meanwhile()``: the build's decoding
    threads then use the cores this process leaves, without waiting for its GIL. The child says on a pipe
    which rows failed, or why it could not build (raised here as it would have been in the child); a child
    that ends without saying is an ``OSError``. If this process stops meanwhile (an error, Ctrl-C), so does the
    child, cleaning up its temp files; it is killed if this process is."""
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, which ends here whatever happens: it never returns into the parent's code
        code = 1
        try:
            os.close(read_end)
            launch.die_with_parent(parent)
            code = _child_builds(write_end, args, decode)
        finally:
            os._exit(code)
    os.close(write_end)
    reply = None
    with os.fdopen(read_end, "rb") as pipe:
        try:
            meanwhile()
            reply = pipe.read()
        finally:
            if reply is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            status = os.waitpid(pid, 0)[1]
    try:
        said = json.loads(reply) if reply else {}
    except ValueError:  # cut short: the child was killed as it wrote
        said = {}
    code = os.waitstatus_to_exitcode(status)
    if "no_space" in said:
        raise NoSpaceError(said["no_space"])
    if "os_error" in said:
        raise OSError(*said["os_error"])
    bad = _bad_rows(said.get("bad"), len(args[3]))
    if code != 0 or bad is None:
        how = f"was killed by signal {-code}" if code < 0 else said.get("error") or f"ended with exit code {code}"
        raise OSError(0, f"the process that built it {how}")
    return ImageCache(args[0], args[4], len(args[3]), bad)


def _child_builds(write_end: int, args: tuple, decode: str) -> int:
    """The forked child's body: the build, then one JSON object on the pipe (the failed rows, or why not)."""
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):  # run stops are the parent's to handle
        signal.signal(s, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from the parent: stop, removing the temp files
    try:
        torch.set_num_threads(1)  # the parent's OpenMP team is not this process's: its decoding threads are
        said = {"bad": {str(row): list(failed) for row, failed in build(*args, None, decode).bad.items()}}
    except NoSpaceError as e:
        said = {"no_space": str(e)}
    except OSError as e:
        said = {"os_error": [e.errno or 0, e.strerror or str(e)]}
    except BaseException as e:  # noqa: BLE001 (said to the parent, which raises)
        said = {"error": f"failed: {type(e).__name__}: {e}"}
    with contextlib.suppress(OSError), open(write_end, "wb") as pipe:
        pipe.write(json.dumps(said).encode())  # ASCII: names that are not UTF-8 go as escaped surrogates
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return 0 if "bad" in said else 1


def open_or_build(
    cache: str,
    paths: Sequence[str],
    image_size: int,
    threads: int | None = None,
    *,
    interpolation: str = "bilinear",
    crop_pct: float | None = None,
    reader=None,
    decode: str = "exact",
    meanwhile: Callable[[], None] | None = None,
) -> ImageCache:
    """The cache of ``paths`` at ``image_size`` (decoded as ``decode`` says, resized as ``decode.resize_uint8``
    does with ``interpolation`` and ``crop_pct``) in folder ``cache`` (or auto), built if missing or stale.
    The folder was named by the user: one that cannot be written, or that another user may write in, is an error."""
    slot = _slot(resolve_dir(cache), paths, image_size, interpolation, crop_pct, reader, decode)
    try:
        problem = _folder_problem(slot.folder)
        if problem:
            raise UserError(
                f"--cache {cache}: {problem}, so another user could choose the images this run trains on; make "
                "the folder yours and `chmod go-w` it (as ssh wants ~/.ssh), or pass --cache a folder of your own"
            )
        found = _load(slot.array_path, slot.header_path, slot.key, slot.count, image_size)
        if found is not None:
            return found
        return _build_in(slot, paths, threads, interpolation, crop_pct, reader, decode, meanwhile)
    except OSError as e:
        raise UserError(
            f"cannot write the image cache in {slot.folder} ({e.strerror or e}); pass --cache a writable "
            f"folder with {_gib(slot.nbytes)} free, or --cache off"
        ) from None


def _folder_problem(folder: str) -> str | None:
    """Why the cache may not live in ``folder`` (made 0700 when missing), or None; ``OSError``: it cannot be made."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return untrusted(folder)


# --cache's settings besides a folder: FIT, the default, caches in the user cache folder when the array
# fits there; AUTO always caches there (an error if it cannot); OFF decodes the files every epoch.
FIT, AUTO, OFF = "fit", "auto", "off"
# FIT's cap: the smaller of FIT_MAX_BYTES and FIT_FREE_SHARE of the folder's free space. A cache nobody asked
# for must not fill a disk: 8 GiB holds 700,000 images at 64 px (ImageNet-1k at 64 px is 15 GiB, at 224 px
# 180 GiB), and three quarters of the free space stay for checkpoints, data sets and other users' files.
# Above the cap --cache DIR (or auto) still caches: the user has then chosen the disk.
FIT_MAX_BYTES = 8 * 2**30
DEVICE_DECODES = "--decode device: JPEGs are decoded on the device each epoch"  # why fit caches nothing then
FIT_FREE_SHARE = 0.25


@dataclass(frozen=True)
class CacheChoice:
    """What ``--cache`` came to in this run: the array read (None: each epoch decodes the files) and why."""

    setting: str  # fit, auto, off or the folder given
    path: str | None
    why: str

    def to_dict(self) -> dict:
        return {"setting": self.setting, "path": self.path, "why": self.why}

    def text(self) -> str:
        """The start-up table's row."""
        return f"{self.path} ({self.why})" if self.path else f"off ({self.why})"


def free_bytes(folder: str) -> int:
    """Free bytes (for this user) on the disk that holds ``folder``, or would once it is made."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def fit_cap(folder: str) -> tuple[int, int]:
    """(the most bytes ``--cache fit`` writes in ``folder``, the free bytes there)."""
    free = free_bytes(folder)
    return min(FIT_MAX_BYTES, int(free * FIT_FREE_SHARE)), free


def choose(
    setting: str | None,
    paths: Sequence[str],
    image_size: int,
    threads: int | None = None,
    *,
    interpolation: str = "bilinear",
    crop_pct: float | None = None,
    reader=None,
    decode: str = "exact",
    meanwhile: Callable[[], None] | None = None,
) -> tuple[ImageCache | None, CacheChoice]:
    """The run's cache as ``--cache`` says (None: the files are decoded every epoch), and what was chosen and why.

    ``fit`` reuses a cache of this data in the user cache folder whatever its size (it is on the disk already),
    builds one there when it fits under the cap, and otherwise -- too big, a folder that cannot be written or
    that another user may write in -- says so in one line and goes on without: the cache changes the speed
    only, never the pixels.
    """
    view = {"interpolation": interpolation, "crop_pct": crop_pct, "reader": reader, "decode": decode}
    if setting in (None, OFF):  # None: a config.json from before --cache had a default
        return None, CacheChoice(OFF, None, "--cache off: every epoch decodes the images")
    if decode == "device":  # fit comes to off (settings.validation refuses a folder or auto with it)
        return None, CacheChoice(setting, None, DEVICE_DECODES)
    if setting != FIT:
        cache = open_or_build(setting, paths, image_size, threads, **view, meanwhile=meanwhile)
        return cache, CacheChoice(setting, cache.array_path, f"--cache {setting}")
    slot = _slot(user_cache_dir(), paths, image_size, interpolation, crop_pct, reader, decode)
    try:
        problem = _folder_problem(slot.folder)  # another user's folder: no cache (the start-up check refuses it)
    except OSError as e:
        problem = f"cannot write the cache in {slot.folder} ({e.strerror or e})"
    if problem is None:
        found = _load(slot.array_path, slot.header_path, slot.key, slot.count, image_size)
        if found is not None:
            return found, CacheChoice(FIT, found.array_path, f"--cache fit: reused, {_gib(slot.nbytes)}")
        try:
            cap, free = fit_cap(slot.folder)
        except OSError as e:
            problem = f"cannot read the free space of {slot.folder} ({e.strerror or e})"
        else:
            if slot.nbytes > cap:
                problem = (
                    f"the cache would take {_gib(slot.nbytes)}, over --cache fit's cap of {_gib(cap)} (the smaller "
                    f"of {_gib(FIT_MAX_BYTES)} and {FIT_FREE_SHARE:.0%} of the {_gib(free)} free in {slot.folder})"
                )
    if problem is None:
        try:
            built = _build_in(slot, paths, threads, interpolation, crop_pct, reader, decode, meanwhile)
            return built, CacheChoice(FIT, built.array_path, f"--cache fit: built, {_gib(slot.nbytes)}")
        except NoSpaceError:  # the disk or the quota filled up while writing; nothing half-written is left
            problem = f"no space was left in {slot.folder} (a full disk or quota) while the cache was written"
        except OSError as e:
            problem = f"cannot write the cache in {slot.folder} ({e.strerror or e})"
    print(
        f"visiontune: no image cache: {problem}; every epoch decodes the images. To cache them, pass "
        f"--cache DIR (a folder with {_gib(slot.nbytes)} free)",
        flush=True,
    )
    return None, CacheChoice(FIT, None, problem)


class CachedDataset(Dataset):
    """``ImageDataset``'s (uint8 [3,S,S] image, label) pairs, read from an ``ImageCache``.

    ``indices`` pick this subset's rows of the cache. The memory map is opened
    lazily in each process (a loader worker gets the path, never a copy of the
    array), and after each read the pages are unmapped from this process again.
    """

    def __init__(
        self, cache: ImageCache, indices: Sequence[int], labels: Sequence[int], augment=None, task: Task = SINGLE_LABEL
    ):
        # augment: a data.augment.SampleAugment, called with (image, index) to seed its draws
        # int64 arrays, not lists: no Python object per image for loader workers to copy
        self.cache, self.indices = cache, np.asarray(indices, np.int64).reshape(-1)
        self.task = task
        self.labels = self.task.label_array(labels)  # as the task keeps them: class indices, multi-hot rows...
        self.augment = augment
        self._map: mmap.mmap | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list:
        """A batch: its rows gathered from the map in one copy, then split into items."""
        if self._map is None:
            with open(self.cache.array_path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        s, n = self.cache.image_size, self.cache.item_bytes
        rows = [int(self.indices[i]) for i in indices]
        block = torch.from_numpy(np.frombuffer(self._map, np.uint8).reshape(-1, s, s, 3)[rows])
        for row in rows:
            # The page cache keeps the data for every process; this process need not keep it
            # mapped. A page fault also maps its neighbours (the kernel's fault-around, 64 KiB
            # aligned by default), so drop the aligned window around the row, not just the row.
            start = row * n // _AROUND * _AROUND
            end = min(len(self._map), -(-(row + 1) * n // _AROUND) * _AROUND)
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        out = []
        for i, row, img in zip(indices, rows, block):
            if row in self.cache.bad:  # as ImageDataset does: keep the slot, say so, the epoch goes on
                path, reason = self.cache.bad[row]
                print(f"visiontune: skipped unreadable image {path}: {reason}", file=sys.stderr)
                out.append((torch.zeros(3, s, s, dtype=torch.uint8), self.task.unreadable_label(self.labels)))
                continue
            img = img.permute(2, 0, 1)  # rows are HWC; the view is CHW as everywhere else
            img = self.augment(img, i) if self.augment is not None else img
            out.append((img, self.task.sample_label(self.labels, i)))
        return out
