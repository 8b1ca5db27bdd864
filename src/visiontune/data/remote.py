"""Remote tar shards (``https://``, ``hf://``, ``gs://``, ``pipe:``, any URL webdataset opens), copied whole
into a local folder and read from there.

Exact sampling, DDP sharding and resume need each sample's offset in its shard, which a
stream does not give, so ``--data URL`` first copies the shards it names into the cache
-- ``$VISIONTUNE_SHARD_CACHE``, else ``shards/`` in the user's cache folder, a subfolder
per URL -- with webdataset's own opener (``webdataset.gopen``: curl for http(s),
gsutil for gs://, the Hub for hf://, a shell command for pipe:), then ``data/shards.py``
reads the copies as local shards. A file is written under a temporary name and renamed
when it is whole, so a killed download, or two runs fetching at once, never leave a
partial shard under a shard's name; a shard already there (of the size ``index.json``
gives, when it gives one) is not fetched again. The ``index.json`` beside the shards
(``visiontune shard`` writes one) is fetched with them; where there is none, that is
noted once the shards are in, so every later run -- offline included -- reads the set
the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from typing import BinaryIO

from visiontune.errors import UserError
from visiontune.files import atomic_file, atomic_write

# webdataset's gopen schemes (s3:// is not one of them: it is read through `pipe:aws s3 cp URL -`).
SCHEMES = ("http://", "https://", "hf://", "gs://", "htgs://", "ais://", "sftp://", "ftps://", "scp://", "pipe:")
INDEX = "index.json"
NO_INDEX = ".no-index"  # the URL has no index.json: noted when its shards were fetched
_TAR = re.compile(r"[^/\s'\"]+\.tar(?![\w.])")  # the shard file name in a URL or a pipe: command


def is_remote(data: str) -> bool:
    return data.startswith((*SCHEMES, "s3://"))


def cache_root() -> str:
    """``$VISIONTUNE_SHARD_CACHE``, else ``shards/`` in ``host.user_cache_dir()``."""
    from visiontune.cluster.host import user_cache_dir

    return os.environ.get("VISIONTUNE_SHARD_CACHE") or os.path.join(user_cache_dir(), "shards")


def fetch(data: str) -> str:
    """The local copy of the shards ``data`` names: a brace pattern, a ``.tar`` or a folder in the cache,
    for ``shards.read``; what is missing is downloaded first (one line, exit 2, when that fails)."""
    from visiontune.data.shards import expand

    if data.startswith("s3://"):
        raise UserError(f"{data}: webdataset reads s3:// through a command: pass --data 'pipe:aws s3 cp {data} -'")
    found = list(_TAR.finditer(data))
    if found:  # a pattern, or one shard: the index is the file beside them
        m = found[-1]
        index_url = data[: m.start()] + INDEX + data[m.end() :]
        urls = {n: data[: m.start()] + n + data[m.end() :] for n in expand(m[0])}
    elif data.startswith("pipe:"):
        raise UserError(f"{data}: name the .tar files in the command, e.g. 'pipe:curl -s URL/shards-{{0..9}}.tar'")
    else:  # a folder: its index lists the shards
        index_url, urls = f"{data.rstrip('/')}/{INDEX}", None
    folder = os.path.join(cache_root(), hashlib.sha256(index_url.encode()).hexdigest()[:16])  # made on writing
    index, raw = _index(folder, index_url, required=urls is None)
    if urls is None:
        urls = {s["url"]: f"{data.rstrip('/')}/{s['url']}" for s in index["shardlist"]}
        odd = [n for n in urls if not isinstance(n, str) or os.path.basename(n) != n or not n.endswith(".tar")]
        if odd:  # a name the copy would be written under: never a path out of the cache folder
            raise UserError(f"{index_url} lists {odd[0]!r}, not a shard file beside it; pass a brace pattern")
    sizes = {s.get("url"): s.get("filesize") for s in (index or {}).get("shardlist", [])}
    wanted = [n for n in urls if not _whole(os.path.join(folder, n), sizes.get(n))]
    if wanted:
        print(f"visiontune: downloading {len(wanted)} of {len(urls)} shard(s) of {data} into {folder}", flush=True)
    try:
        for name in wanted:
            _download(urls[name], os.path.join(folder, name), sizes.get(name))
    except UserError:
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # nothing was fetched: no empty folder left behind
        raise
    # What the URL has beside its shards, noted once they are in (a network fault before then notes nothing).
    if raw is not None:
        atomic_write(os.path.join(folder, INDEX), raw)
    elif index is None and not os.path.exists(os.path.join(folder, NO_INDEX)):
        atomic_write(os.path.join(folder, NO_INDEX), index_url)
    return os.path.join(folder, found[-1][0]) if found else folder


def _whole(path: str, size: int | None) -> bool:
    """Whether ``path`` holds its shard: any file there was renamed into place whole; ``size`` (the index's)
    tells a shard that changed at the source, or a damaged copy, from the one wanted."""
    try:
        got = os.path.getsize(path)
    except OSError:
        return False
    return size is None or got == size


def _index(folder: str, url: str, required: bool) -> tuple[dict | None, bytes | None]:
    """The index of the shards, and its bytes when they were fetched now: the cached one, else fetched
    (None where there is none; ``required`` for a folder URL, whose shards only its index names)."""
    cached = os.path.join(folder, INDEX)
    if os.path.exists(cached):
        with open(cached, "rb") as f:
            return json.loads(f.read()), None
    if os.path.exists(os.path.join(folder, NO_INDEX)) and not required:
        return None, None
    raw = io.BytesIO()
    try:
        _copy(url, raw)
        index = json.loads(raw.getvalue())
        if not isinstance(index, dict) or not isinstance(index.get("shardlist"), list):
            raise ValueError("it lists no shards")
    except UserError:
        if required:
            raise
        return None, None  # shards written elsewhere come without one
    except ValueError as e:
        if required:
            raise UserError(f"{url} is no shard index ({e}); pass --data 'URL/shards-{{000000..000127}}.tar'") from None
        return None, None
    return index, raw.getvalue()


def _copy(url: str, out: BinaryIO) -> bytes:
    """``url``'s bytes into the file ``out`` through webdataset's opener, and their first 512; a failure is
    one line."""
    try:
        from webdataset.gopen import gopen
    except ImportError:
        raise UserError("reading remote shards needs webdataset: pip install 'visiontune[formats]'") from None
    head = b""
    try:
        with gopen(url, "rb") as stream:
            while chunk := stream.read(1 << 20):
                head = head or chunk[:512]
                out.write(chunk)
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot download {url} ({_why(e)}); check the URL and the network, or copy the shards to a "
            "folder and pass --data FOLDER"
        ) from None
    return head


def _why(e: BaseException) -> str:
    """What went wrong, short: curl's exit status in words (webdataset's opener for http), or the error."""
    status = re.search(r"exit (\d+)", str(e))
    if status is None:
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    words = {"6": "host not found", "7": "connection refused", "22": "the server answered with an HTTP error"}
    what = words.get(status[1]) if "curl" in str(e) else None
    return f"{what}: curl exit {status[1]}" if what else f"the opener's exit status {status[1]}"


def _download(url: str, dest: str, size: int | None) -> None:
    with atomic_file(dest) as f:  # whole, or not there at all
        head = _copy(url, f)
        if size is not None and f.tell() != size:
            raise UserError(f"{url}: {f.tell()} bytes came where its index.json says {size}; download it again")
        if head.strip(b"\0") and head[257:262] != b"ustar":
            raise UserError(f"{url} is not a tar file (the server sent something else); check the URL")
