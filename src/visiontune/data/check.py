"""The bad-file scan: decode every image once, up front, and list the ones that fail.

Training skips bad images anyway, but a scan before the first epoch names them
all in one report instead of one warning per epoch, and it catches files that
would only fail on the last batch. Decoding is the whole cost, so it runs on a
thread pool (libjpeg-turbo, libpng and PIL all release the GIL while decoding),
and an optional JSON cache keyed by (absolute path, size, mtime_ns) makes a
second scan of an unchanged data set decode nothing. The cache and the CSV
report are written to a temp file and moved into place, so an interrupted run
never leaves half a file behind.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from visiontune.data.decode import MAX_PIXELS, BadImage, read_image
from visiontune.host import user_cache_dir
from visiontune.outputs import atomic_write

_CACHE_VERSION = 1


def _check_one(path: str, max_pixels: int) -> str | None:
    """The reason ``path`` is bad, or None when it decodes."""
    try:
        read_image(path, max_pixels=max_pixels)
    except BadImage as exc:
        return str(exc)
    return None


def _file_key(path: str) -> tuple[str, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None  # read_image will name the problem; nothing worth caching
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def _load_cache(cache_path: str, max_pixels: int) -> dict[str, list]:
    """{abs path: [size, mtime_ns, reason or None]}; empty when missing, unreadable or stale."""
    try:
        with open(cache_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    # A different pixel limit changes which files are "too large", so the old verdicts do not carry over.
    if data.get("max_pixels") != max_pixels:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def scan(
    paths: Sequence[str],
    *,
    workers: int = 2,
    cache_path: str | None = None,
    max_pixels: int = MAX_PIXELS,
) -> list[tuple[str, str]]:
    """Fully decode every file; return [(path, reason)] for the bad ones, in input order."""
    cache = _load_cache(cache_path, max_pixels) if cache_path else {}
    keys = [_file_key(p) for p in paths]
    reasons: list[str | None] = [None] * len(paths)
    todo = []
    for i, key in enumerate(keys):
        entry = cache.get(key[0]) if key else None
        if key and isinstance(entry, list) and len(entry) == 3 and entry[:2] == [key[1], key[2]]:
            reasons[i] = entry[2]
        else:
            todo.append(i)

    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        verdicts = pool.map(_check_one, [paths[i] for i in todo], [max_pixels] * len(todo))
        for i, reason in zip(todo, verdicts):
            reasons[i] = reason
            if keys[i]:
                cache[keys[i][0]] = [keys[i][1], keys[i][2], reason]
    finally:
        # Keep what was decoded even on Ctrl-C, and do not wait for the files still queued.
        pool.shutdown(wait=True, cancel_futures=True)
        if cache_path and todo:
            payload = {"version": _CACHE_VERSION, "max_pixels": max_pixels, "files": cache}
            atomic_write(cache_path, json.dumps(payload))
    return [(p, r) for p, r in zip(paths, reasons) if r is not None]


def write_report(bad: list[tuple[str, str]], out_csv: str) -> None:
    """Write the scan's findings as CSV with header ``path,problem``, atomically."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["path", "problem"])
    writer.writerows(bad)
    atomic_write(out_csv, buf.getvalue())


def scan_cache_path(data_root: str) -> str:
    """Where ``train`` remembers scan verdicts for ``data_root``: outside the data, which may be read-only.

    ``host.user_cache_dir()`` (the image cache's ``auto`` folder too); one file per data folder, named by the sha256 of its absolute path.
    """
    base = user_cache_dir()
    os.makedirs(base, exist_ok=True)
    key = hashlib.sha256(os.path.abspath(data_root).encode()).hexdigest()[:16]
    return os.path.join(base, f"scan-{key}.json")


def bad_fraction_error(n_bad: int, n_files: int, limit: float, report: str) -> str | None:
    """The message that stops a run before training, or None when the bad share is within ``limit``."""
    if n_files and n_bad / n_files > limit:
        return (f"{n_bad} of {n_files} files are bad ({n_bad / n_files:.1%} > --max-bad-fraction {limit:g}); "
                f"see {report}, fix or remove them, or raise --max-bad-fraction")
    return None
