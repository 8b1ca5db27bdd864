"""``visiontune shard``: write any data visiontune reads as WebDataset tar shards with an index.

The writer lives apart from the reader (``data/shards.py``): it lists its source through
``sources.discover`` and screens it with the bad-file scan, which the reader never needs.
The shards hold the usable images, cut at ``--shard-size``, beside an ``index.json`` in
webdataset's ``wids`` shard-index format with visiontune's own entry (class names, each
sample's name in the source and its split), which ``data/shards.py`` reads back. ``--out`` may be an
object store's prefix (``s3://bucket/prefix/``, ``data/stores.py``): each shard is uploaded as it is
closed, and ``index.json`` last.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

import numpy as np

from visiontune.data import stores
from visiontune.data.check import scan, scan_cache_path
from visiontune.data.imageset import LabelReader
from visiontune.data.shards import IMAGE_MEMBERS, INDEX
from visiontune.data.sources import discover
from visiontune.data.split import relative_paths, split_of
from visiontune.errors import UserError
from visiontune.files import write_json

PATTERN = "shards-%06d.tar"
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"), (b"II*", "tiff"))
_MAGIC += ((b"MM\0*", "tiff"),)
_TAR_END = 1024 + 10240  # two zero blocks, then padding to tarfile's 10 KiB record
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``1GB``, ``500MB``, ``64KiB`` or a plain byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m[2].upper()
    if not m or unit not in _UNITS or float(m[1]) * _UNITS[unit] < 1:
        raise UserError(f"--shard-size: expected a size such as 1GB, 500MB or 64KiB, got {text!r}")
    return int(float(m[1]) * _UNITS[unit])


def _ext(source: str | bytes, data: bytes) -> str:
    if isinstance(source, str):
        ext = os.path.splitext(source)[1][1:].lower()
        if ext in IMAGE_MEMBERS:
            return ext
    if data[8:12] == b"WEBP":
        return "webp"
    return next((e for magic, e in _MAGIC if data.startswith(magic)), "img")


def write(
    data: str,
    out: str,
    shard_size: str = "1GB",
    *,
    seed: int = 42,
    val_fraction: float = 0.2,
    columns: tuple[str | None, str | None] = (None, None),
    workers: int = 2,
    task: LabelReader,
) -> dict:
    """``visiontune shard``: ``data``'s usable images into WebDataset shards in ``out``, with ``index.json``."""
    try:
        import webdataset
    except ImportError:
        raise UserError("writing shards needs webdataset: pip install 'visiontune[formats]'") from None
    maxsize = parse_size(shard_size)
    # An object store's prefix (s3://...): each shard is uploaded once written and deleted here, so the
    # staging folder holds one shard at a time; index.json goes last, once every shard is there.
    put = stores.uploader(out) if stores.is_store(out) else None
    if put is None and os.path.isdir(out) and any(n.endswith(".tar") or n == INDEX for n in os.listdir(out)):
        raise UserError(f"{out} already holds shards; choose an empty or new folder")
    images = discover(data, *columns, task=task)
    if images.targets is not None:  # a shard's .cls holds one class: label sets or numbers would be lost
        raise UserError(f"{data} is {images.task} data; tar shards carry one class per sample: train on it as it is")
    print(images.describe())
    bad = list(images.rejects) + scan(
        images.paths, workers=workers, cache_path=scan_cache_path(images.root), reader=images.reader
    )
    for path, problem in bad:
        print(f"visiontune: left out {path}: {problem}", file=sys.stderr)
    drop = {p for p, _ in bad}
    images = images.take(np.flatnonzero(np.fromiter((p not in drop for p in images.paths), bool, len(images))))
    split = split_of(images, val_fraction, seed)  # the split a run on ``data`` with this seed would make
    names = relative_paths(images.paths, range(len(images)), images.root)
    keys = [f"{i:09d}" for i in range(len(images))]
    staging = tempfile.TemporaryDirectory(prefix="visiontune-shards-") if put else None
    folder = staging.name if staging else out
    os.makedirs(folder, exist_ok=True)
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}

    def written(path: str) -> None:
        sizes[os.path.basename(path)] = os.path.getsize(path)
        if put:
            put(path)
            os.unlink(path)

    # ShardWriter's maxsize counts the payload only (and closes a shard after it is passed), but each member
    # of its tars takes a 512-byte header, a pax header (1 KB) and padding to 512 bytes: 3.5 KB a sample,
    # twice a 3 KB thumbnail. So the shards are cut here, on the tar file's own offset plus what the next
    # sample takes at most, end blocks and record padding included.
    pattern = os.path.join(folder, PATTERN)
    with webdataset.ShardWriter(pattern, maxsize=float("inf"), maxcount=10**9, verbose=0, post=written) as w:
        for i, key in enumerate(keys):
            source = images.source(i)
            if isinstance(source, str):
                with open(source, "rb") as f:
                    blob = f.read()
            else:
                blob = source
            label = int(images.labels[i])
            size = sum(1536 + -(-len(data) // 512) * 512 for data in (blob, str(label).encode()))
            held = w.tarstream.tarstream.offset if w.tarstream is not None else 0  # tarfile.TarFile's position
            if held and held + size + _TAR_END > maxsize:
                w.next_stream()
            w.write({"__key__": key, _ext(source, blob): blob, "cls": label})
            name = os.path.basename(w.fname)
            counts[name] = counts.get(name, 0) + 1
    index = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        # filesize: what a copy of a remote shard is checked against (data/remote.py)
        "shardlist": [{"url": name, "nsamples": n, "filesize": sizes[name]} for name, n in counts.items()],
        "visiontune": {
            "source": images.root,
            "classes": images.classes,
            "names": names,
            "split": {
                "seed": seed,
                "val_fraction": val_fraction,
                **({"from": images.split_note} if images.split_note else {}),
                "val": [keys[i] for i in split.val.tolist()],
            },
        },
    }
    write_json(os.path.join(folder, INDEX), index)
    if put:
        put(os.path.join(folder, INDEX))
        staging.cleanup()
    print(
        f"visiontune: wrote {len(keys)} images in {len(counts)} shard(s) to {out} ({len(split.train)} train / "
        f"{len(split.val)} val recorded in {INDEX}); {len(bad)} bad file(s) left out"
    )
    return index
