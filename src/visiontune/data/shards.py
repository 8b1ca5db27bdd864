"""WebDataset tar shards, read back by index for exact sampling (``data/shardwriter.py`` writes them).

``--data DIR`` (a folder of ``*.tar``), ``DIR/shards-{000000..000127}.tar`` or one
``.tar`` reads shards in WebDataset's naming (``KEY.jpg``/``KEY.png`` and
``KEY.cls``). The tar headers are walked once (one ``pread`` a header) into a per-sample
index -- shard, byte offset and size of each image, and its label -- kept in
the user's cache folder under the shards' names, sizes and mtimes; sample i is
then one ``pread``, so the seeded sampler, the split, DDP sharding, exact resume,
the bad-file screen and ``--cache`` treat shards as they treat a folder's files.
A URL (``https://``, ``hf://``, ``pipe:`` with ``--allow-pipe``) is copied into the cache first
(``data/remote.py``) and read from there, under its URL's name.

``visiontune shard`` (``data/shardwriter.py``) writes any data visiontune reads with ``webdataset.ShardWriter``,
the bad files left out, beside an ``index.json`` in webdataset's ``wids`` shard-index
format (each shard's sample count) with visiontune's own entry: the class names,
each sample's name in the source (``split.json`` then lists the same names as a run
on the source) and its split, which training from the shards uses as the data's own.
Shards without an index (written by ShardWriter elsewhere) get classes from their
``.cls`` integers and visiontune's seeded split.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile

import numpy as np

from visiontune.data import remote
from visiontune.data.braces import expand
from visiontune.data.imageset import (
    IMAGE_EXTENSIONS,
    ImageSet,
    LabelReader,
    Source,
    read_classes,
    refuse_unless_classes,
)
from visiontune.errors import UserError
from visiontune.files import atomic_file

INDEX = "index.json"
# The member suffixes that hold a sample's image (the writer names a member by them too).
IMAGE_MEMBERS = {e[1:] for e in IMAGE_EXTENSIONS} | {"img", "image"}
_ZERO_BLOCK = bytes(512)
# A pax header or GNU long name holds a name (and a few numbers): more than this is no shard's, and is not read.
_MAX_HEADER = 1 << 20
# A .cls holds a class number: a decimal from 0 to int32's largest (the labels' type). Else: no label, or a bad one.
_MAX_CLASS = 2**31 - 1
_NO_CLS, _BAD_CLS = -1, -2


def is_shards(data: str) -> bool:
    """Whether ``data`` names tar shards: a brace pattern, a .tar file, a folder of .tar files only, or a URL
    (``data/remote.py``)."""
    if remote.is_remote(data):
        return True
    if data.startswith("file://"):
        raise UserError(f"{data}: pass the path itself: --data {data[len('file://') :]}")
    if "{" in data and ".tar" in data:
        return True
    if data.endswith(".tar") and os.path.isfile(data):
        return True
    if not os.path.isdir(data):
        return False
    with os.scandir(data) as it:
        entries = [(e.name, e.is_dir()) for e in it if not e.name.startswith(".")]
    return any(n.endswith(".tar") for n, _ in entries) and not any(d for _, d in entries)


def _files(root: str) -> tuple[list[str], dict | None]:
    """The shard files of ``root`` (a folder, pattern or file) in order, and the index that describes them."""
    if "{" in root:
        shards, folder = expand(root), os.path.dirname(root)
    elif os.path.isdir(root):
        folder = root
        shards = sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".tar"))
    else:
        shards, folder = [root], os.path.dirname(root)
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        raise UserError(f"shard not found: {missing[0]} ({len(missing)} of the {len(shards)} named are missing)")
    index = None
    try:
        with open(os.path.join(folder, INDEX), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        pass
    if index is not None:
        listed = [os.path.join(folder, s["url"]) for s in index.get("shardlist", [])]
        if "visiontune" not in index or listed != shards:
            index = None  # another tool's index, or a subset of the shards: read them as ShardWriter's
        else:
            order = {s: i for i, s in enumerate(listed)}
            shards.sort(key=order.__getitem__)
    return shards, index


def _number(field: bytes) -> int:
    """A tar header's number: octal text, or GNU's base-256 for large values (first byte 0x80/0xff)."""
    if field[0] in (0o200, 0o377):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _pax(data: bytes) -> dict[str, str]:
    """The records of a pax extended header: ``"<length> <key>=<value>\\n"`` each, the length counting the
    whole record. One that does not parse so (a length of 0 would never move on) is a damaged header."""
    out, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        end = pos + int(digits) if digits.isdigit() else 0
        if not (space + 2 < end <= len(data) and data[end - 1] == 10 and b"=" in data[space + 1 : end - 1]):
            raise tarfile.ReadError(f"a malformed pax record at byte {pos} of a pax header")
        key, _, value = data[space + 1 : end - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _members(fd: int, end: int):
    """(name, data offset, size) of each regular file of the tar at ``fd``, header by header.

    tarfile's iteration keeps a TarInfo for every member and costs ~0.2 ms a member: at 100k
    samples ~23 s and ~190 MB. This reads the same ustar, GNU (long names) and pax headers with one
    ``pread`` each, checks each header's checksum and skips the data.
    """
    pos, long_name, pax = 0, None, {}
    while True:
        block = os.pread(fd, 512, pos)
        if len(block) < 512:
            raise tarfile.ReadError("no end-of-archive marker" if not block else f"cut inside the header at {pos}")
        if block == _ZERO_BLOCK:
            if end < pos + 1024:  # a tar ends with two zero blocks; a cut file lacks them
                raise tarfile.ReadError("no end-of-archive marker")
            return
        stored = _number(block[148:156])
        unsigned = sum(block[:148]) + 256 + sum(block[156:])  # the checksum field counted as 8 spaces
        if stored != unsigned and stored != unsigned - 256 * sum(b > 127 for b in block[:148] + block[156:]):
            raise tarfile.ReadError(f"bad header checksum at byte {pos}")
        kind, size, data = block[156:157], _number(block[124:136]), pos + 512
        if size < 0 or data + size > end:  # (a negative size would walk back: a loop)
            raise tarfile.ReadError(f"the member at byte {pos} ends past the end of the file")
        if kind in (b"L", b"x") and size > _MAX_HEADER:
            raise tarfile.ReadError(f"a {size}-byte name header at byte {pos}, more than any name needs")
        if kind == b"L":  # GNU: the next member's long name
            long_name = os.pread(fd, size, data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == b"x":  # pax: the next member's path, size, ...
            pax = _pax(os.pread(fd, size, data))
        elif kind != b"g":  # (a global pax header holds nothing a sample needs)
            name = block[:100].split(b"\0", 1)[0]
            if block[257:263] == b"ustar\0" and block[345]:  # POSIX ustar: a directory prefix
                name = block[345:500].split(b"\0", 1)[0] + b"/" + name
            if "size" in pax:  # a plain decimal (int() would take a sign, spaces and "1_0")
                if not (pax["size"].isascii() and pax["size"].isdigit()):
                    raise tarfile.ReadError(f"a malformed pax size at byte {pos}")
                size = int(pax["size"])
            if data + size > end:
                raise tarfile.ReadError(f"the member at byte {pos} ends past the end of the file")
            if kind in (b"0", b"\0", b"7"):
                yield long_name or pax.get("path") or name.decode("utf-8", "surrogateescape"), data, size
            long_name, pax = None, {}
        pos = data + (size + 511) // 512 * 512


def _walk(path: str) -> list[tuple[str, int, int, int]]:
    """(key, image offset, image size, label) of each sample of one shard, in order; a damaged tar, or a key
    used by two samples (webdataset would read them as two), stops here."""
    groups: dict[str, dict] = {}
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            last = None
            for name, offset, size in _members(fd, os.fstat(fd).st_size):
                folder, _, base = name.rpartition("/")
                key, _, ext = base.partition(".")
                key, ext = f"{folder}/{key}" if folder else key, ext.lower()
                entry = groups.setdefault(key, {})
                if ext in entry or (entry and key != last):  # a sample's files come together, once each
                    raise UserError(
                        f"{path}: the sample key {key!r} comes twice in this shard; give each sample its own __key__"
                    )
                entry[ext], last = (offset, size), key
            out = []
            for key, entry in groups.items():
                image = next((entry[e] for e in entry if e in IMAGE_MEMBERS), None)
                label = _label(fd, *entry["cls"]) if "cls" in entry else _NO_CLS
                out.append((key, *(image or (-1, 0)), label))
        finally:
            os.close(fd)
    except (tarfile.TarError, OSError, ValueError) as e:
        raise UserError(f"{path}: truncated or damaged shard ({e}); write it again (visiontune shard)") from None
    return out


def _label(fd: int, offset: int, size: int) -> int:
    """A ``.cls`` member's class number; ``_NO_CLS`` when empty, ``_BAD_CLS`` when it holds anything else."""
    text = os.pread(fd, size, offset).strip() if size <= 64 else b"?"
    if not text:
        return _NO_CLS
    return int(text) if text.isdigit() and len(text) <= 10 and int(text) <= _MAX_CLASS else _BAD_CLS


def _index(shards: list[str]) -> dict[str, np.ndarray]:
    """The per-sample index of ``shards``, from the cache folder or walked once and kept there."""
    from visiontune.cluster.host import user_cache_dir

    h, sizes = hashlib.sha256(b"v2"), []  # v2: v1 indexes merged a key used twice in one shard
    for s in shards:
        st = os.stat(s)
        h.update(f"\0{os.path.abspath(s)}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogateescape"))
        sizes.append(st.st_size)
    path = os.path.join(user_cache_dir(), f"shards-{h.hexdigest()[:16]}.npz")
    kept = _kept(path, np.asarray(sizes, np.int64))
    if kept is not None:
        return kept | {"fingerprint": np.asarray(h.hexdigest())}
    rows = [(i, *r) for i, s in enumerate(shards) for r in _walk(s)]
    cols = list(zip(*rows)) if rows else [[]] * 5
    index = {
        "shard": np.asarray(cols[0], np.int32),
        "key": np.asarray(cols[1], str),
        "offset": np.asarray(cols[2], np.int64),
        "size": np.asarray(cols[3], np.int64),
        "label": np.asarray(cols[4], np.int64),
    }
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_file(path) as f:
            np.savez(f, **index)
    except OSError:
        pass  # walked again next time
    return index | {"fingerprint": np.asarray(h.hexdigest())}


def _kept(path: str, sizes: np.ndarray) -> dict[str, np.ndarray] | None:
    """The index kept at ``path`` if it is whole and fits the shards (each image inside its shard), else None:
    a damaged or foreign file is walked again, never read past or trusted to point outside the shards."""
    try:
        with np.load(path, allow_pickle=False) as z:
            index = {k: z[k] for k in ("shard", "key", "offset", "size", "label")}
    except Exception:  # any reason (BadZipFile, NotImplementedError for a zip version, a .npy, ...): walk again
        return None
    shard, offset, size = index["shard"], index["offset"], index["size"]
    if len({a.shape for a in index.values()}) != 1 or index["key"].ndim != 1 or index["key"].dtype.kind != "U":
        return None
    if any(index[k].dtype.kind != "i" for k in ("shard", "offset", "size", "label")):
        return None
    if len(shard) and (shard.min() < 0 or shard.max() >= len(sizes) or index["label"].min() < _BAD_CLS):
        return None
    if len(shard) and index["label"].max() > _MAX_CLASS:
        return None
    end = sizes[shard]  # (each term bounded first: a sum of two huge numbers would wrap around)
    inside = (offset >= 0) & (size >= 0) & (offset <= end) & (size <= end) & (offset + size <= end)
    return index if np.all(inside | (offset == -1) & (size == 0)) else None


class ShardReader:
    """Sample i's image bytes: ``size[i]`` bytes at ``offset[i]`` of shard ``shard[i]``, one ``pread``.

    Picklable (file descriptors are opened in each process); ``spec()`` reopens it elsewhere from the
    shards' name and the cached index.
    """

    def __init__(self, root: str, shards: list[str], shard, offset, size, fingerprint: str, kind: str = "shards"):
        self.root, self.shards, self.shard, self.offset, self.size = root, shards, shard, offset, size
        self.fingerprint, self.order, self.kind = fingerprint, None, kind
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.shard)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}}

    def __getitem__(self, i: int) -> bytes:
        s = int(self.shard[i])
        if self._pid != os.getpid():  # a forked worker: its own descriptors (their offsets are not shared
            self._fds, self._pid = {}, os.getpid()  # by pread, but closing them in one process would be)
        if s not in self._fds:
            self._fds[s] = os.open(self.shards[s], os.O_RDONLY)
        if self.size[i] <= 0:
            return b""
        return os.pread(self._fds[s], int(self.size[i]), int(self.offset[i]))

    def take(self, idx) -> ShardReader:
        out = object.__new__(ShardReader)
        out.__dict__.update(self.__getstate__(), shard=self.shard[idx], offset=self.offset[idx], size=self.size[idx])
        out.order = idx if self.order is None else self.order[idx]
        out._pid = os.getpid()
        return out

    def spec(self) -> dict:
        return {"kind": self.kind, "data": self.root, "order": None if self.order is None else self.order.tolist()}


def reopen(spec: dict, lister=None) -> ShardReader:
    """The reader ``spec`` describes; ``lister`` lists its data (the ``store`` source's own, for its copies)."""
    reader = (lister or read)(spec["data"]).reader
    return reader if spec["order"] is None else reader.take(np.asarray(spec["order"], np.int64))


def read(data: str, local: str | None = None, kind: str = "shards") -> ImageSet:
    """List shards as an ImageSet whose ``reader`` reads each sample's image by offset. Remote shards are
    read from their local copies (``remote.fetch``, or ``local`` made by the ``kind`` source that copied
    them) under their URL's name."""
    if local is not None:
        root, shards, index = data, *_files(local)
    elif remote.is_remote(data):
        root, shards, index = data, *_files(remote.fetch(data))
    else:
        root = os.path.abspath(os.path.expanduser(data))
        shards, index = _files(root)
    found = _index(shards)
    keys, labels = found["key"].tolist(), found["label"]
    own = (index or {}).get("visiontune", {})
    names = own.get("names") or keys
    if len(names) != len(keys):
        raise UserError(f"{root}: {INDEX} lists {len(names)} samples but the shards hold {len(keys)}; rewrite them")
    if len(set(names)) != len(names):
        raise UserError(f"{root}: the shards repeat sample keys; give each sample its own __key__")
    no_image = found["offset"] < 0
    rejects = [(f"{root}/{names[i]}", "no image in the sample") for i in np.flatnonzero(no_image).tolist()]
    rejects += [
        (f"{root}/{names[i]}", "no .cls label") for i in np.flatnonzero(~no_image & (labels == _NO_CLS)).tolist()
    ]
    bad_cls = f"its .cls is not a class number (a decimal from 0 to {_MAX_CLASS})"
    rejects += [(f"{root}/{names[i]}", bad_cls) for i in np.flatnonzero(~no_image & (labels == _BAD_CLS)).tolist()]
    keep = np.flatnonzero(~no_image & (labels >= 0))
    if own.get("classes"):
        classes = list(own["classes"])
        if len(keep) and labels[keep].max() >= len(classes):
            raise UserError(f"{root}: a .cls label is beyond the {len(classes)} classes of {INDEX}")
        mapped = labels[keep]
    else:
        uniq = np.unique(labels[keep])
        classes, mapped = [str(c) for c in uniq.tolist()], np.searchsorted(uniq, labels[keep])
    reader = ShardReader(root, shards, found["shard"], found["offset"], found["size"], str(found["fingerprint"]), kind)
    val = None
    if own.get("split"):
        val = np.isin(np.asarray(keys, str), np.asarray(own["split"]["val"], str))[keep]
    return ImageSet(
        root,
        "shards",
        [f"{root}/{names[i]}" for i in keep.tolist()],
        mapped,
        classes,
        rejects=rejects,
        reader=reader.take(keep) if len(keep) != len(keys) else reader,
        val_mask=val,
        split_note=f"the split recorded in {INDEX}" if val is not None else "",
    )


def _read_source(
    data: str, image_column: str | None, label_column: str | None, *, every_split: bool, task: LabelReader
) -> ImageSet:
    refuse_unless_classes(task, f"{data}: tar shards")  # before a shard is opened
    return read_classes(read(data), task, f"{data}: tar shards")


SOURCE = Source(
    "shards",
    recognises=is_shards,
    read=_read_source,
    reopen=reopen,
    help="tar shards (a folder, pattern or URL)",
    short="tar shards",
    container=True,
    exists=lambda data: "{" in data or os.path.exists(data),  # a pattern's shards are checked when read
)
# Shards at a URL: copied into the cache (once per machine) and read as local shards; their readers'
# spec() names "shards", which reopens them from the URL. Told in --help with the local ones.
URL_SOURCE = Source(
    "url-shards", recognises=remote.is_remote, read=_read_source, named=True, container=True, fetch=remote.fetch
)
