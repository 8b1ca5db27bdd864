"""A compact list of file paths: ImageNet-size listings without a Python object per file.

A ``str`` per file costs about 100 bytes plus its list slot, and a forked
loader worker that reads the list writes to the objects' reference counts, so
each worker ends up with its own copy of their pages. ``PathList`` keeps the
paths as one shared prefix (the data root, with its separator) and, for each
path, the rest UTF-8 encoded back to back in one uint8 array with an int64
array of end offsets: about 40 bytes per file at ImageNet size, in three
objects whatever the count, so forks share them untouched. A path becomes a
``str`` only when it is read (``paths[i]``); a slice gives a list of them;
``take`` gives a view of some of the paths (an index array over the same bytes).

A text file that lists paths, one a line, comes from elsewhere (``predict --data FILE``): ``read_list`` is its
one reader, bounded in bytes, paths and characters a line. Its bounded lines (``bounded_lines``, with
``refuse_larger`` before them) are the manifest's too (``layouts.read_rows``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from visiontune.errors import UserError
from visiontune.text import printable

_CODEC = ("utf-8", "surrogateescape")  # any name the file system returns round-trips


def _encodes(path: str) -> bool:
    try:
        path.encode(*_CODEC)
    except UnicodeEncodeError:
        return False
    return True


_CHUNK = 65536  # paths encoded or gathered at a time

# A list of image paths is bounded before its lines are Python strings: ImageNet's 1.28M paths are about 100 MB.
MAX_LIST_BYTES = 1 << 30
MAX_LIST_PATHS = 20_000_000
MAX_LIST_LINE = 4096  # characters, its end included: Linux's PATH_MAX, so no longer path opens
_LIST = "a list of image paths"


def root_prefixes(root: str) -> list[str]:
    """The prefixes a layout's paths start with: the root as given, or resolved (manifests)."""
    return list(dict.fromkeys(os.path.join(r, "") for r in (root, os.path.realpath(root)) if r != "."))


class PathList(Sequence[str]):
    """Paths ``prefix + rel(i)``; ``order`` (optional) picks and orders entries of the underlying arrays."""

    __slots__ = ("prefix", "blob", "ends", "order")

    def __init__(self, prefix: str, blob: np.ndarray, ends: np.ndarray, order: np.ndarray | None = None):
        self.prefix, self.blob, self.ends, self.order = prefix, blob, ends, order

    @classmethod
    def from_chunks(cls, chunks: Iterable[Sequence[str]], prefix: str) -> PathList:
        """The paths of ``chunks`` (lists of paths that all start with ``prefix``), in order."""
        blob, ends = bytearray(), [np.zeros(0, np.int64)]  # grown in place: no second copy of the bytes
        for chunk in chunks:
            try:
                enc = [p[len(prefix) :].encode(*_CODEC) for p in chunk]
            except UnicodeEncodeError as e:  # a lone surrogate no file system name decodes to (a JSON "\ud800")
                bad = next(p for p in chunk if not _encodes(p))
                why = f"is not text a file system holds ({e.reason})"
                raise UserError(f"the file name {printable(bad)} {why}") from None
            ends.append(np.cumsum(np.fromiter(map(len, enc), np.int64, len(enc))) + len(blob))
            blob += b"".join(enc)
        return cls(prefix, np.frombuffer(blob, np.uint8), np.concatenate(ends))

    @classmethod
    def from_paths(cls, paths: Sequence[str], root: str) -> PathList:
        """``paths``, stored relative to ``root`` when they all lie under it."""
        if isinstance(paths, PathList):
            return paths
        prefix = next((r for r in root_prefixes(root) if all(p.startswith(r) for p in paths)), "")
        return cls.from_chunks((paths[i : i + _CHUNK] for i in range(0, len(paths), _CHUNK)), prefix)

    def __len__(self) -> int:
        return len(self.ends) if self.order is None else len(self.order)

    def _rows(self, idx) -> np.ndarray:
        """Rows of the underlying arrays for positions ``idx`` (ints in range)."""
        idx = np.asarray(idx, np.int64)
        return idx if self.order is None else self.order[idx]

    def rels(self, idx) -> list[str]:
        """The paths at positions ``idx`` without the prefix, decoded in one pass."""
        rows = self._rows(idx)
        ends = self.ends[rows]
        starts = np.where(rows > 0, self.ends[np.maximum(rows - 1, 0)], 0)
        view = memoryview(self.blob)
        return [str(view[s:e], *_CODEC) for s, e in zip(starts.tolist(), ends.tolist())]

    def rel(self, i: int) -> str:
        """Path ``i`` (0 <= i < len) without the prefix."""
        return self.rels([i])[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.prefix + r for r in self.rels(np.arange(*i.indices(len(self))))]
        if not -len(self) <= i < len(self):
            raise IndexError("PathList index out of range")
        return self.prefix + self.rel(i % len(self))

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), _CHUNK):
            yield from self[start : start + _CHUNK]

    def __eq__(self, other) -> bool:
        if not isinstance(other, (PathList, list, tuple)):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # compared by content, like a list

    def __repr__(self) -> str:
        return f"PathList({len(self)} paths under {self.prefix!r})"

    def take(self, idx: Sequence[int] | np.ndarray) -> PathList:
        """A view of the paths at ``idx``, in that order: one int64 per path, no bytes copied."""
        idx = np.asarray(idx, np.int64)
        return PathList(self.prefix, self.blob, self.ends, idx if self.order is None else self.order[idx])

    def compact(self) -> PathList:
        """The same paths in arrays of their own (a view's bytes gathered), for writing out."""
        if self.order is None:
            return self
        starts = np.concatenate([np.zeros(1, np.int64), self.ends[:-1]])
        raw = self.blob.tobytes() if len(self.blob) else b""
        pieces = []
        for k in range(0, len(self.order), _CHUNK):
            o = self.order[k : k + _CHUNK]
            pieces.append(b"".join(raw[s:e] for s, e in zip(starts[o].tolist(), self.ends[o].tolist())))
        lengths = self.ends[self.order] - starts[self.order]
        return PathList(self.prefix, np.frombuffer(b"".join(pieces), np.uint8), np.cumsum(lengths))


def refuse_larger(path: str | os.PathLike, limit: int, what: str, hint: str) -> None:
    """One line when the file ``path`` (``what``, in words: "a manifest") is over ``limit`` bytes: refused unread."""
    size = os.stat(path).st_size
    if size > limit:
        raise UserError(f"{path} is {size:,} bytes, more than the {limit:,} of {what} visiontune reads; {hint}")


def bounded_lines(f, path: str | os.PathLike, what: str, line_is: str, max_line: int, max_bytes: int) -> Iterator[str]:
    """``f``'s lines, each at most ``max_line`` characters and all of them ``max_bytes``: a line is read no further
    than its bound, so one without an end (or a file still growing) is refused. ``what``: the file in words ("a
    manifest"); ``line_is``: what one of its lines holds, in words ("a manifest's line is a file name ...")."""
    read = 0
    for number in itertools.count(1):
        line = f.readline(max_line + 1)
        if not line:
            return
        read += len(line)
        if len(line) > max_line:
            raise UserError(f"{path} line {number}: longer than {max_line:,} characters; {line_is}")
        if read > max_bytes:
            raise UserError(f"{path}: more than the {max_bytes:,} bytes of {what} visiontune reads")
        yield line


def too_many(path: str | os.PathLike, limit: int, things: str, what: str) -> UserError:
    """The line for a file of more than ``limit`` ``things`` ("rows") than ``what`` ("a manifest") may hold."""
    return UserError(f"{path}: more than the {limit:,} {things} of {what} visiontune reads")


def read_list(path: str) -> list[str]:
    """The image paths the text file ``path`` lists, one a line (``predict --data FILE``), its one reader: blank
    lines and ``#`` comments skipped, each path stripped; at most ``MAX_LIST_BYTES``, ``MAX_LIST_PATHS`` paths and
    ``MAX_LIST_LINE`` characters a line, one line naming the file and the bound past them. Bytes that are not
    UTF-8 (a file name in another encoding, as ``ls > list.txt`` writes it) are kept as surrogate escapes, so
    the path opens the file it names and is written back as the same bytes."""
    paths: list[str] = []
    try:
        refuse_larger(path, MAX_LIST_BYTES, _LIST, "give one image path per line")
        with open(path, encoding=_CODEC[0], errors=_CODEC[1]) as f:
            lines = bounded_lines(f, path, _LIST, "a list's line is one image path", MAX_LIST_LINE, MAX_LIST_BYTES)
            for number, line in enumerate(lines, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                if "\x00" in line:
                    raise UserError(f"{path} line {number}: holds a NUL character, which no path does")
                if len(paths) == MAX_LIST_PATHS:
                    raise too_many(path, MAX_LIST_PATHS, "paths", _LIST)
                paths.append(line)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if not paths:
        raise UserError(f"{path}: no paths listed; expected one image path per line")
    return paths
