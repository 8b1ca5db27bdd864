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
"""

from __future__ import annotations

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
