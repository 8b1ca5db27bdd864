"""The bad-file scan: decode every image once, up front, and list the ones that fail.

Training skips bad images anyway, but a scan before the first epoch names them
all in one report instead of one warning per epoch, and it catches files that
would only fail on the last batch. Decoding is the whole cost, so it runs on a
thread pool (libjpeg-turbo, libpng and PIL all release the GIL while decoding)
with a bounded number of files in flight, so memory stays flat at any size.

Verdicts are remembered per file, keyed by a 64-bit hash of (absolute path,
size, mtime_ns, pixel limit), in two append-only files: ``<cache>`` holds the
keys of good files as raw uint64, ``<cache>.bad`` one JSON line per bad file
with its reason. A warm scan is one ``stat`` per file and a vectorised lookup;
a changed file appends one record, never rewrites the cache; the key file is
compacted only when stale keys outnumber live ones. A torn last record (a crash
mid-append) is ignored and compacted away. The files are read bounded and each
record checked (``_load_cache``): one that is not a record ``scan`` writes is
ignored, and its file decoded again. Samples read through an
``ImageSet``'s reader (datasets rows, shard members) are keyed by their name and
the reader's content fingerprint instead of a ``stat``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from visiontune.cluster.host import user_cache_dir
from visiontune.data import remote
from visiontune.data.decode import MAX_PIXELS, BadImage, decode_bytes, read_image
from visiontune.data.imageset import LabelReader
from visiontune.data.sources import discover
from visiontune.errors import UserError
from visiontune.files import atomic_write

_CACHE_VERSION = 2
_FLUSH = 4096  # verdicts appended to the cache per write: Ctrl-C loses at most this many
_CHUNK = 65536  # files whose keys are computed together


def bounded_map(fn: Callable, items: Iterable, threads: int, window: int | None = None) -> Iterator:
    """``fn`` over ``items`` on ``threads`` threads, in order, with at most ``window`` calls in flight."""
    window = window or 4 * threads
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        pending: deque = deque()
        try:
            for item in items:
                if len(pending) >= window:
                    yield pending.popleft().result()
                pending.append(pool.submit(fn, item))
            while pending:
                yield pending.popleft().result()
        finally:  # on an error or Ctrl-C, do not wait for the queued files
            for f in pending:
                f.cancel()


def _check_one(source: str | bytes, max_pixels: int) -> str | None:
    """The reason ``source`` (a path or an image's bytes) is bad, or None when it decodes."""
    try:
        if isinstance(source, bytes):
            decode_bytes(source, max_pixels=max_pixels)
        else:
            read_image(source, max_pixels=max_pixels)
    except BadImage as exc:
        return str(exc)
    return None


def file_keys(paths: Sequence[str], max_pixels: int) -> np.ndarray:
    """One uint64 per file from (absolute path, size, mtime_ns, limit); 0 for a file that cannot be stat'ed."""
    # Relative paths are relative to the working folder: hash it in once rather than abspath each path.
    where = "" if not paths or os.path.isabs(paths[0]) else os.getcwd()
    salt = f"\0{max_pixels}\0{_CACHE_VERSION}\0{where}".encode("utf-8", "surrogateescape")
    keys = np.zeros(len(paths), np.uint64)
    stat, blake = os.stat, hashlib.blake2b
    for start in range(0, len(paths), _CHUNK):  # in chunks: the Python objects of a chunk at a time
        sizes, mtimes, digests, missing = [], [], [], []
        for i, p in enumerate(paths[start : start + _CHUNK]):  # the hot loop of a warm start
            try:
                st = stat(p)
            except OSError:  # read_image will name the problem; nothing worth caching
                st = None
                missing.append(i)
            sizes.append(st.st_size if st else 0)
            mtimes.append(st.st_mtime_ns if st else 0)
            digests.append(blake(p.encode("utf-8", "surrogateescape") + salt, digest_size=8).digest())
        part = np.frombuffer(b"".join(digests), np.uint64).copy()
        # Mix size and mtime in with odd multipliers (uint64 arithmetic wraps), vectorised.
        part ^= np.array(sizes, np.int64).view(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ np.array(
            mtimes, np.int64
        ).view(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
        part[missing] = 0
        keys[start : start + len(part)] = part
    return keys


def name_keys(names: Sequence[str], fingerprint: str, max_pixels: int) -> np.ndarray:
    """``file_keys`` for samples read through a reader: one uint64 per (name, content fingerprint, limit)."""
    salt = f"\0{max_pixels}\0{_CACHE_VERSION}\0{fingerprint}".encode("utf-8", "surrogateescape")
    digests = (hashlib.blake2b(n.encode("utf-8", "surrogateescape") + salt, digest_size=8).digest() for n in names)
    keys = np.frombuffer(b"".join(digests), np.uint64).copy()
    keys[keys == 0] = 1  # 0 means "no key"
    return keys


def _isin(keys: np.ndarray, members: np.ndarray) -> np.ndarray:
    """``np.isin(keys, members)`` by binary search: np.isin sorts both arrays together, which at
    ImageNet size costs ~100 MB of temporaries; this costs two arrays the size of ``keys``."""
    if not len(members):
        return np.zeros(len(keys), bool)
    members = np.sort(members)
    pos = np.searchsorted(members, keys)
    np.minimum(pos, len(members) - 1, out=pos)
    return members[pos] == keys


MAX_VERDICT = 4096  # bytes of one remembered bad verdict's line (longer: that file is decoded again)
MAX_BAD_VERDICTS = 100_000  # bad verdicts read back at most (beyond: those files are decoded again)


def _verdict(line: str) -> tuple[int, str] | None:
    """A ``.bad`` line's (key, reason), or None when it is not one ``scan`` writes (a torn or damaged line)."""
    try:
        key, reason = json.loads(line)
    except (ValueError, TypeError, RecursionError):  # RecursionError: arrays nested past the parser
        return None
    if type(key) is not int or not 0 < key < 2**64 or not isinstance(reason, str) or not reason.isprintable():
        return None
    return key, reason


def _load_cache(cache_path: str, count: int) -> tuple[np.ndarray, dict[int, str], bool]:
    """(good keys, {bad key: reason}, whether the files need compacting) for a scan of ``count`` files.

    The files are a cache on disk: a crash, a full disk or another program may have left anything there. Each
    is read up to a bound (more keys than compaction ever leaves: the rest is stale, and compacted away) and
    each bad verdict checked; a record that is not one ``scan`` writes is ignored, so its file is decoded again.
    """
    most = 4 * max(count, 1024)  # compaction keeps the key file under 2 x max(count, 1024) keys
    try:
        size = os.path.getsize(cache_path)
        raw = np.fromfile(cache_path, dtype="<u8", count=min(size // 8, most))
        compact = size % 8 != 0 or size // 8 > most
    except (OSError, ValueError):
        raw, compact = np.zeros(0, np.uint64), False
    bad: dict[int, str] = {}
    try:
        with open(cache_path + ".bad", encoding="utf-8", errors="replace") as f:
            for _ in range(min(most, MAX_BAD_VERDICTS)):
                line = f.readline(MAX_VERDICT)
                if not line:
                    break
                found = _verdict(line)
                if found is not None:
                    bad[found[0]] = found[1]
            else:
                compact = compact or bool(f.read(1))  # more than the bound: keep only the live verdicts
    except OSError:
        pass
    return raw.astype(np.uint64), bad, compact


def _append(path: str, data: bytes) -> None:
    # One O_APPEND write per batch: concurrent scans of the same folder never interleave within a record.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def scan(
    paths: Sequence[str],
    *,
    workers: int = 2,
    cache_path: str | None = None,
    max_pixels: int = MAX_PIXELS,
    reader=None,
) -> list[tuple[str, str]]:
    """Fully decode every file (``reader[i]``'s bytes when given, ``paths`` then being names); return
    [(path, reason)] for the bad ones, in input order."""
    reasons: dict[int, str] = {}
    todo = np.arange(len(paths))
    keys = np.zeros(0, np.uint64)
    if cache_path:
        keys = file_keys(paths, max_pixels) if reader is None else name_keys(paths, reader.fingerprint, max_pixels)
        good, bad, torn = _load_cache(cache_path, len(paths))
        unknown = ~_isin(keys, good) | (keys == 0)
        bad_keys = np.array(list(bad), np.uint64)
        for i in np.flatnonzero(unknown & np.isin(keys, bad_keys)).tolist():
            reasons[i] = bad[int(keys[i])]
        unknown[list(reasons)] = False
        todo = np.flatnonzero(unknown)  # an array, not a list: a cold scan of 1.28M files holds 10 MB here
        if torn or len(good) + len(bad) > 2 * max(len(paths), 1024):  # stale keys dominate: keep the live ones
            atomic_write(cache_path, np.unique(keys[~unknown & ~np.isin(keys, bad_keys)]).astype("<u8").tobytes())
            live = bad_keys[np.isin(bad_keys, keys)].tolist()
            atomic_write(cache_path + ".bad", "".join(json.dumps([k, bad[k]]) + "\n" for k in live))
    new_good: list[int] = []
    new_bad: list[str] = []

    def flush() -> None:
        if cache_path and new_good:
            _append(cache_path, np.array(new_good, "<u8").tobytes())
        if cache_path and new_bad:
            _append(cache_path + ".bad", "".join(new_bad).encode())
        new_good.clear()
        new_bad.clear()

    try:
        order = todo.tolist()
        verdicts = bounded_map(
            lambda i: _check_one(paths[i] if reader is None else reader[i], max_pixels), order, max(1, workers)
        )
        for i, reason in zip(order, verdicts):
            if reason is not None:
                reasons[i] = reason
            if cache_path and keys[i]:
                if reason is None:
                    new_good.append(int(keys[i]))
                else:
                    new_bad.append(json.dumps([int(keys[i]), reason]) + "\n")
                if len(new_good) + len(new_bad) >= _FLUSH:
                    flush()
    finally:
        flush()  # keep what was decoded, even on Ctrl-C
    return [(paths[i], reasons[i]) for i in sorted(reasons)]


def write_report(bad: list[tuple[str, str]], out_csv: str) -> None:
    """Write the scan's findings as CSV with header ``path,problem``, atomically."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["path", "problem"])
    writer.writerows(bad)
    atomic_write(out_csv, buf.getvalue())


def scan_cache_path(data_root: str) -> str:
    """Where ``train`` remembers scan verdicts for ``data_root``: outside the data, which may be read-only.

    ``host.user_cache_dir()`` (the image cache's ``auto`` folder too); one key file (and its
    ``.bad`` companion) per data folder, named by the sha256 of its absolute path.
    """
    base = user_cache_dir()
    os.makedirs(base, exist_ok=True)
    name = data_root if remote.is_remote(data_root) else os.path.abspath(data_root)  # a URL is no path
    key = hashlib.sha256(name.encode()).hexdigest()[:16]
    return os.path.join(base, f"scan-{key}.v{_CACHE_VERSION}.keys")


def bad_fraction_error(n_bad: int, n_files: int, limit: float, report: str) -> str | None:
    """The message that stops a run before training, or None when the bad share is within ``limit``."""
    if n_files and n_bad / n_files > limit:
        return (
            f"{n_bad} of {n_files} files are bad ({n_bad / n_files:.1%} > --max-bad-fraction {limit:g}); "
            f"see {report}, fix or remove them, or raise --max-bad-fraction"
        )
    return None


def check_folder(
    data: str, report: str | None, workers: int | None, columns: tuple = (None, None), *, task: LabelReader
) -> int:
    """``visiontune check``: list ``data``, name every bad file and write the report; 1 if any, else 0."""
    images = discover(data, *columns, task=task)  # ``task``: what reads the labels (--task auto's reader)
    print(images.describe())
    # The working folder, never the data's: a data set may be read-only, shared, or listed again by the next
    # run, and a report is not one of its files.
    report = report or "bad_files.csv"
    if not os.access(os.path.dirname(os.path.abspath(report)) or ".", os.W_OK):
        raise UserError(f"cannot write the report to {report}; pass --out PATH")
    # Layout rejects (Thumbs.db in a Kaggle folder, ...) first, then every file that does not decode.
    bad = list(images.rejects) + scan(images.paths, workers=workers, reader=images.reader)
    write_report(bad, report)
    for path, problem in bad:
        print(f"{path}: {problem}")
    print(f"visiontune: {len(bad)} bad of {len(images.paths) + len(images.rejects)} files; report in {report}")
    return 1 if bad else 0
