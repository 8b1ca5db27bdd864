"""Data in object storage -- ``s3://bucket/prefix/`` (and S3-compatible stores), ``gs://``, ``az://``/``abfs://``
-- through fsspec, copied into the shard cache and read from there.

This is the ``store`` source. The prefix is listed through the store (one LIST, paged by the store's
client), and what it holds decides how it is read: ``.tar`` objects alone (beside an optional
``index.json``) are WebDataset shards, read by ``data/shards.py`` under the URL's name; anything else
is a data folder in one of the three layouts (``data/layouts.py``), a manifest ``.csv`` naming
files relative to it included. A brace pattern or one ``.tar`` names shards in its folder. Exact
sampling, DDP sharding and resume need random access by offset, so, as for shards at an http(s) URL
(``data/remote.py``), each object is copied once per machine into the cache -- a subfolder per URL
-- by byte ranges of at most ``CHUNK`` bytes, several objects at once, each written in a staging
folder beside it and renamed into place when whole. The listing is kept beside the copies once every object is
in, so later commands, a DDP job's other processes and a worker reopening the data make no request
at all (delete the subfolder to fetch again).

Credentials come from the store's own chain (s3fs/botocore: the environment, the profile, the
instance role; an S3-compatible endpoint from ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` or the
profile's ``endpoint_url``; gcsfs: Google's application default credentials; adlfs: Azure's):
visiontune never reads, prints or records them, and refuses a URL that carries any. A gs:// URL with
one of gsutil's wildcards is refused: here it would name one object, where a user copying it from
gsutil means many. What the store returns is untrusted (DESIGN.md, "The trust boundary"): at most
``MAX_OBJECTS`` objects, each key a plain relative path (no ``.``/``..`` segment, nothing that could
land outside the cache folder), at most the listed size read from each object, a time-out on each
request, retries with backoff on 5xx, throttling and dropped connections (botocore's standard mode,
s3fs's own; gcsfs and adlfs retry with their own), and one line naming the object when the last retry
fails.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from visiontune.data import layouts, remote, shards
from visiontune.data.braces import MAX_NAMES, expand
from visiontune.data.imageset import ImageSet, LabelReader, Source, read_classes
from visiontune.errors import UserError
from visiontune.files import atomic_write
from visiontune.text import mask_urls

# scheme: (the fsspec package that reads it, the visiontune extra that installs it)
SCHEMES = {
    "s3": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}
MAX_OBJECTS = 5_000_000  # objects one folder may hold: ImageNet-1k is 1.28M; a bound on the listing's memory
MAX_KEY = 1024  # S3's own longest key
CHUNK = 16 << 20  # one ranged GET: the memory an object's copy holds at once
PARALLEL = 16  # objects copied at once
RETRIES = 5  # attempts at a request (5xx, throttling, a dropped connection), with exponential backoff
_BAD_SEGMENT = re.compile(r"^\.{1,2}$|[\0\\]")
# gcsfs's default file system asks GCS's storage-control API (gRPC) what kind each bucket is before it reads
# it; where it cannot ask (anonymous or object-only credentials, an emulator, no gRPC route) it logs a
# warning on every request, asks again on the next, and reads through the JSON API anyway. Its JSON API
# file system never asks. gcsfs's own variable, set either way (true: a zonal bucket, Rapid Storage, read
# through gcsfs's gRPC reader), hands the choice back to gcsfs.
ZONAL_SWITCH = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


def is_store(data: str) -> bool:
    return data.split("://", 1)[0] in SCHEMES and "://" in data


def _filesystem(data: str):
    """The fsspec file system for ``data``'s scheme, with visiontune's bounds; one line when it is missing."""
    scheme = data.split("://", 1)[0]
    package, extra = SCHEMES[scheme]
    try:
        import fsspec

        if scheme == "gs" and ZONAL_SWITCH not in os.environ:
            import gcsfs  # the package itself first: a missing one is the line below, whatever was imported

            return gcsfs.core.GCSFileSystem(skip_instance_cache=True)  # (the JSON API's: see ZONAL_SWITCH)
        if scheme != "s3":  # (a new instance each time: the credentials are read when it is made)
            return fsspec.filesystem(scheme, skip_instance_cache=True)
        timeouts = {"connect_timeout": remote.TIMEOUT_S, "read_timeout": remote.TIMEOUT_S}
        retries = {"total_max_attempts": RETRIES, "mode": "standard"}  # 5xx and throttling, backed off
        config = {**timeouts, "retries": retries}
        return fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config)
    except ImportError:
        raise UserError(f"reading {scheme}:// needs {package}: pip install 'visiontune[{extra}]'") from None


def _check(data: str) -> None:
    bucket = data.split("://", 1)[1].split("/", 1)[0]
    if "@" in bucket or ":" in bucket:  # s3://KEY:SECRET@bucket: a secret would be recorded with the data
        raise UserError(
            f"{data.split('://', 1)[0]}://...: credentials in the URL are not read; give them the store's own "
            "way (environment, profile or role) and pass --data with the bucket and prefix alone"
        )
    if not bucket:
        raise UserError(f"{data}: name a bucket, e.g. s3://bucket/prefix/")
    if data.startswith("gs://") and re.search(r"[*?\[\]]", data):
        raise UserError(
            f"{data}: gsutil would read * ? [ ] as wildcards, visiontune reads none; name the shards with "
            "{000..009} braces"
        )


def _failed(url: str, e: BaseException, doing: str = "read") -> UserError:
    """A failed request as one line naming the object (never the store's own words about credentials)."""
    if isinstance(e, FileNotFoundError):
        why = "not found"
    elif isinstance(e, PermissionError) or getattr(e, "status_code", None) in (401, 403):  # (azure-core's own)
        why = "access denied: check the credentials the store's client finds (environment, profile or role)"
    else:
        why = mask_urls(remote._first_line(e)) if str(e).strip() else type(e).__name__  # (an endpoint's password)
    return UserError(f"cannot {doing} {url} ({why}); check the URL, the network and the store's endpoint")


def _relative(key: str, base: str, url: str) -> str:
    """``key``'s path below ``base``: plain segments only, so that its copy stays inside the cache folder."""
    rel = key[len(base) :].lstrip("/")
    if (
        not key.startswith(base)
        or len(rel) > MAX_KEY
        or any(not s or _BAD_SEGMENT.search(s) for s in rel.split("/"))
        or not rel.isprintable()
    ):
        raise UserError(f"{url} holds an object named {rel!r:.100}, which visiontune does not copy; rename it")
    return rel


def _entries(fs, base: str, deep: bool) -> list[dict]:
    """The entries below ``base`` (one level, or ``deep`` all), at most ``MAX_OBJECTS + 1``. s3fs's pages are
    read one at a time and the walk stops there, so a listing of any length costs bounded memory; the
    other stores' listings are taken whole."""
    if "s3" not in fs.protocol:
        return list(fs.find(base, detail=True).values()) if deep else fs.ls(base, detail=True)
    from fsspec.asyn import sync

    bucket, _, key = base.partition("/")

    async def walk() -> list[dict]:
        out = []
        async for entry in fs._iterdir(bucket, delimiter="" if deep else "/", prefix=f"{key}/" if key else ""):
            out.append(entry)
            if len(out) > MAX_OBJECTS:
                break
        return out

    return sync(fs.loop, walk)


def _list(fs, base: str, url: str) -> dict[str, int]:
    """Each object below ``base``: its relative name and size. Top level first: shards need no deeper look."""
    try:
        found = _entries(fs, base, deep=False)
        if any(e["type"] == "directory" or not e["name"].endswith((".tar", shards.INDEX)) for e in found):
            found = _entries(fs, base, deep=True)
    except Exception as e:  # the store's client raises its own kinds (botocore, aiohttp, ...): one line each
        raise _failed(url, e) from None
    if len(found) > MAX_OBJECTS:
        raise UserError(f"{url} holds more than the {MAX_OBJECTS:,} objects visiontune reads")
    objects = {}
    for entry in sorted(found, key=lambda e: e["name"]):
        key = entry["name"]
        if entry.get("type") == "directory" or key.endswith("/"):
            continue
        size = entry.get("size")
        if type(size) is not int or size < 0:
            raise UserError(f"{url}: the store gives no size for {key!r:.100}")
        objects[_relative(key, base, url)] = size
    if not objects:
        raise UserError(f"cannot read {url} (not found: no object below it); check the bucket and the prefix")
    return objects


def _copy(fs, key: str, url: str, dest: str, size: int, staging: str) -> None:
    """The object ``key`` into ``dest``, by ranged reads of at most ``CHUNK`` bytes, whole or not at all: it
    is written in ``staging``, beside the copies, and renamed into place when whole (a folder's copy is
    listed as a data folder, where a partial file of a killed command would be a bad image)."""
    fd, tmp = tempfile.mkstemp(dir=staging, suffix=".part")
    head = b""
    try:
        with os.fdopen(fd, "wb") as f:
            while f.tell() < size:
                got = fs.cat_file(key, start=f.tell(), end=min(size, f.tell() + CHUNK))
                if not got:
                    raise UserError(
                        f"{url}: {f.tell()} bytes came where the store listed {size}; it changed, run again"
                    )
                head = head or got[:512]
                f.write(got)
            f.flush()
            os.fsync(f.fileno())
        if dest.endswith(".tar") and size and head[257:262] != b"ustar":
            raise UserError(f"{url} is not a tar file; check the URL")
        os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
        os.replace(tmp, dest)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, UserError) or not isinstance(e, Exception):
            raise
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(
                f"no space left on the disk of {staging} while copying {url}; free some space, or set "
                "VISIONTUNE_SHARD_CACHE to a folder on another disk"
            ) from None
        raise _failed(url, e) from None


def _sweep(staging: str) -> None:
    """Partial copies a killed command left (a live copy writes at least every few seconds): gone after an hour."""
    with contextlib.suppress(OSError), os.scandir(staging) as it:
        for e in it:
            with contextlib.suppress(OSError):
                if e.name.endswith(".part") and time.time() - e.stat().st_mtime > 3600:
                    os.unlink(e.path)


def _split(data: str) -> tuple[str, str | None]:
    """(the folder URL, the last segment when it names shards or a manifest, else None)."""
    head, _, last = data.rstrip("/").rpartition("/")
    if "://" in head and ("{" in last or last.endswith((".tar", ".csv"))):
        return head, last
    return data.rstrip("/"), None


def _kept(path: str, url: str) -> dict[str, int] | None:
    """The listing kept beside the copies (the cache is the user's own: ``remote._trusted_root``)."""
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is damaged ({e}); delete it to list {url} again") from None
    objects = kept.get("objects") if isinstance(kept, dict) else None
    if not isinstance(objects, dict) or kept.get("url") != url:
        raise UserError(f"{path} is not the listing of {url}; delete it to list {url} again")
    return {_relative(f"{url}/{k}", url, url): v for k, v in objects.items() if type(v) is int and v >= 0}


def fetch(data: str) -> str:
    """The local copy of what ``data`` names (a folder, a shard pattern, a ``.tar`` or a ``.csv`` in the
    cache); what is missing is copied first (one line, exit 2, when that fails)."""
    _check(data)
    url, last = _split(data)
    root = remote._trusted_root()
    name = hashlib.sha256(f"store\0{url}/".encode()).hexdigest()[:16]
    folder, listing = os.path.join(root, name), os.path.join(root, f"{name}.listing.json")
    objects = _kept(listing, url)
    fs = None
    if objects is None:
        fs = _filesystem(data)
        objects = _list(fs, fs._strip_protocol(url).rstrip("/"), url)
    wanted = objects
    if last is not None and not last.endswith(".csv"):
        names = expand(last)
        missing = [n for n in names if n not in objects]
        if missing:
            raise UserError(f"cannot read {url}/{missing[0]} (not found; {len(missing)} of the {len(names)} named)")
        wanted = {n: objects[n] for n in [*names, shards.INDEX] if n in objects}
    elif all("/" not in n for n in objects) and any(n.endswith(".tar") for n in objects):
        if sum(n.endswith(".tar") for n in objects) > MAX_NAMES:
            raise UserError(f"{url} holds more than the {MAX_NAMES:,} shards visiontune reads")
    todo = [n for n in wanted if not remote._whole(os.path.join(folder, n), wanted[n])]
    if todo:
        staging = f"{folder}.partial"
        remote._trusted_root(folder, staging)
        print(f"visiontune: copying {len(todo)} of {len(wanted)} object(s) of {url} into {folder}", flush=True)
        fs = fs or _filesystem(data)
        base = fs._strip_protocol(url).rstrip("/")
        _sweep(staging)

        def copy(n: str) -> None:
            _copy(fs, f"{base}/{n}", f"{url}/{n}", os.path.join(folder, n), wanted[n], staging)

        with ThreadPoolExecutor(min(PARALLEL, len(todo))) as pool:
            list(pool.map(copy, todo))
    if not os.path.exists(listing):
        atomic_write(listing, json.dumps({"url": url, "objects": objects}))
    return os.path.join(folder, last) if last is not None else folder


def uploader(url: str) -> Callable[[str], None]:
    """``put(path)``: the local file ``path`` to ``url/NAME`` (``visiontune shard --out URL``), one line when
    it fails; refused before anything is written when ``url`` holds shards already."""
    _check(url)
    url = url.rstrip("/")
    fs = _filesystem(url)
    base = fs._strip_protocol(url).rstrip("/")
    try:
        there = fs.ls(base, detail=False)
    except FileNotFoundError:
        there = []
    except Exception as e:
        raise _failed(url, e) from None
    if any(n.endswith(".tar") or n.rpartition("/")[2] == shards.INDEX for n in there):
        raise UserError(f"{url} already holds shards; choose an empty or new prefix")

    def put(path: str) -> None:
        name = os.path.basename(path)
        try:
            fs.put_file(path, f"{base}/{name}")
        except Exception as e:
            raise _failed(f"{url}/{name}", e, "write") from None

    return put


def _read(
    data: str, image_column: str | None, label_column: str | None, *, every_split: bool, task: LabelReader | None
) -> ImageSet:
    local = fetch(data)
    if shards.is_shards(local):
        found = shards.read(data.rstrip("/"), local=local, kind=SOURCE.name)  # (names are URL/NAME)
        return found if task is None else read_classes(found, task, f"{data}: tar shards")
    return layouts.read_folder(local, image_column, label_column, every_split=every_split, task=task)


def _folder_copy(data: str) -> str | None:
    """The local copy of the folder ``data`` names (None for shards or a manifest): predict's unlabelled images."""
    local = fetch(data)
    return local if os.path.isdir(local) and not shards.is_shards(local) else None


def _reopen(spec: dict) -> shards.ShardReader:
    # (the shards' reader alone: what the labels are was read with the listing)
    return shards.reopen(spec, lambda data: _read(data, None, None, every_split=False, task=None))


SOURCE = Source(
    "store",
    recognises=is_store,
    read=_read,
    reopen=_reopen,
    help="an object store's shards or folder (s3://bucket/prefix/, gs://, az://)",
    short="object-store data (s3://, gs://, az://)",
    named=True,
    container=True,
    fetch=fetch,
    folder_copy=_folder_copy,
)
