"""Remote tar shards (``https://``, ``http://``, ``hf://``, and ``pipe:`` behind ``--allow-pipe``),
copied whole into the shard cache and read from there.

Exact sampling, DDP sharding and resume need each sample's offset in its shard, which a stream does
not give, so ``--data URL`` first copies the shards it names into ``$VISIONTUNE_SHARD_CACHE`` (else
``shards/`` in the user's cache folder), a subfolder per URL; ``data/shards.py`` reads the copies. A
file is renamed into place when whole (``atomic_file``), and one already there, of the size
``index.json`` gives, is not fetched again. The ``index.json`` beside the shards is fetched with them;
where there is none, that is noted once the shards are in, so every later run reads the set the same way.

The HTTP is fsspec's HTTP file system (aiohttp): one streamed GET a file (``get_file``), the index
first, then each shard named. ``hf://`` is the Hub's file URL and headers from huggingface_hub
(``hf_hub_url``, ``HF_ENDPOINT`` honoured; ``build_hf_headers``: the user's token) read the same way;
aiohttp follows redirects to http(s) alone and drops the token on one to another host (the Hub's file
store: that URL is signed). What a URL returns, and a URL read from a file (a run's ``config.json``, a
config file, an ``index.json``), is untrusted (DESIGN.md, "The trust boundary"), so this module adds
what those libraries lack, each pinned by ``tests/data/test_remote_trust.py``:

- a size cut: the index at most ``MAX_INDEX_BYTES``, a shard at most the size its index gives (fsspec
  reads whatever comes; huggingface_hub's ``hf_hub_download`` trusts the size the server states);
- the GET alone: fsspec's ``open`` and huggingface_hub's ``hf_hub_download``/``HfFileSystem`` first ask
  for the size (a HEAD, or the Hub's API), a request more a shard;
- at most ``MAX_REDIRECTS`` redirects (aiohttp follows 10, huggingface_hub 20); a time-out on connecting
  and on each read, and none on the whole file (aiohttp's default cuts every download at 5 minutes);
- retries with backoff on 5xx, 429 and a connection dropped mid-file (fsspec's HTTP file system makes
  none; huggingface_hub's are for its own client), then one line naming the URL;
- the proxy the environment names, and no ``~/.netrc`` login (``_proxy``: aiohttp's ``trust_env`` sends
  both);
- the names an index lists are plain file names (``_NAME``): a copy's name and a request, never a
  path, a URL or a glob; at most ``braces.MAX_NAMES``; every shard name, an index's or a brace pattern's
  (``named``), is one file of the cache folder (``_cache_name``: printable, at most ``MAX_SHARD_NAME``
  bytes); the kept ``index.json`` is read within the download's bound.

A ``pipe:`` command runs only when this process's own command line gave it as its data with
``--allow-pipe`` (``allow_command``); one read from a file never runs. Webdataset's other
command-run schemes (sftp://, scp://, ais://, ...) are not opened: a trusted ``pipe:`` command reads
them. Object stores (s3://, gs://, az://) are ``data/stores.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import time
from typing import BinaryIO
from urllib.parse import unquote

from visiontune.data.braces import MAX_NAMES, expand
from visiontune.errors import UserError
from visiontune.files import atomic_file, atomic_write
from visiontune.text import byte_size, shown
from visiontune.version import __version__

SCHEMES = ("http://", "https://", "hf://", "pipe:")
_ELSEWHERE = ("htgs://", "ais://", "sftp://", "ftps://", "scp://")  # webdataset runs a command for these
INDEX = "index.json"
NO_INDEX = ".no-index"  # the URL has no index.json: noted when its shards were fetched
MAX_INDEX_BYTES = 256 << 20  # visiontune's own index of 1.28M samples is about 60 MB
TIMEOUT_S = 60  # a server silent this long (connecting, or mid-file) is a failed download
MAX_REDIRECTS = 5
RETRIES, BACKOFF_S = 4, 1.0  # attempts at a GET that failed on the way (5xx, 429, a dropped connection)
_TAR = re.compile(r"[^/\s'\"]+\.tar(?![\w.])")  # the shard file name in a URL or a pipe: command
# A shard name an index.json may list: a plain file beside it (no separator, scheme, %-escape, glob or brace).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=~-]*\.tar")
MAX_SHARD_NAME = 200  # bytes of a shard's name, its copy's file name in the cache (a file name is 255 at most)
_allowed_commands: set[str] = set()  # (set by the command line: ``allow_command``)


def is_remote(data: str) -> bool:
    return data.startswith((*SCHEMES, *_ELSEWHERE))


def runs_command(data: str) -> bool:
    """Whether reading ``data`` runs a command it names (a ``pipe:`` URL)."""
    return data.startswith("pipe:")


def allow_command(data: str | None) -> None:
    """``--allow-pipe``: the ``pipe:`` command this process's command line gave as its data may be run, and
    no other (None: none may)."""
    _allowed_commands.clear()
    if data is not None:
        _allowed_commands.add(data)


def command_allowed(data: str) -> bool:
    """Whether ``data`` is a ``pipe:`` command this process may run (``allow_command``)."""
    return runs_command(data) and data in _allowed_commands


def refuse_command(data: object, where: str) -> None:
    """One line when ``data``, read from the file ``where``, is a command: none read from a file is run."""
    if isinstance(data, str) and runs_command(data):
        raise UserError(
            f"{where} gives a command as the data, {data!r:.80}; visiontune runs no command read from a file: "
            "pass it as --data on the command line, with --allow-pipe, if you trust it"
        )


def cache_root() -> str:
    """``$VISIONTUNE_SHARD_CACHE``, else ``shards/`` in ``host.user_cache_dir()``."""
    from visiontune.cluster.host import user_cache_dir

    return os.environ.get("VISIONTUNE_SHARD_CACHE") or os.path.join(user_cache_dir(), "shards")


def _trusted_root(*make: str) -> str:
    """The shard cache, held to the image cache's folder rule (``host.untrusted``) before anything in it is
    read, and again once made (0700) with the folders ``make`` names in it: a shard or index that another
    user could write there is what would be trained on. Not made before it is needed: a refused URL leaves
    nothing."""
    from visiontune.cluster.host import untrusted

    root = cache_root()
    try:
        for folder in (root, *make) if make else ():
            os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as e:
        reason = "Not a directory" if os.path.exists(root) and not os.path.isdir(root) else e.strerror
        raise UserError(
            f"cannot keep shards in {root} ({reason}); set VISIONTUNE_SHARD_CACHE to a folder you can write"
        ) from None
    why = untrusted(root) if os.path.isdir(root) else None
    if why:
        raise UserError(
            f"{why}: another user could change the shards kept there; `chmod go-w` it, or set "
            "VISIONTUNE_SHARD_CACHE to a folder of your own"
        )
    return root


def _check_source(data: str) -> None:
    """One line for a URL this module does not open, or may not open here."""
    if data.startswith(_ELSEWHERE):
        scheme = data.split(":", 1)[0]
        raise UserError(
            f"{data}: visiontune reads http(s)://, hf:// and object stores itself; read {scheme}:// through a command "
            f"you trust: --data 'pipe:COMMAND' --allow-pipe (the .tar names in the command)"
        )
    if runs_command(data) and not command_allowed(data):
        raise UserError(
            f"--data {data!r:.100}: a pipe: command is run only when given on this command line together with "
            "--allow-pipe (never one read from a file)"
        )


def fetch(data: str) -> str:
    """The local copy of the shards ``data`` names: a brace pattern, a ``.tar`` or a folder in the cache,
    for ``shards.read``; what is missing is downloaded first (one line, exit 2, when that fails)."""
    _check_source(data)
    index_url, urls, pattern = named(data)
    root = _trusted_root()
    folder = os.path.join(root, hashlib.sha256(index_url.encode()).hexdigest()[:16])
    index, raw = _index(folder, index_url, required=urls is None)
    if urls is None:
        urls = {n: f"{data.rstrip('/')}/{n}" for n in _listed(index, index_url)}
    sizes = _sizes(index)
    _trusted_root(folder)
    wanted = [n for n in urls if not _whole(os.path.join(folder, n), sizes.get(n))]
    if wanted:
        said = f"{len(wanted)} of {len(urls)} shard(s) of {shown(data)}"  # a password in the URL: masked
        print(f"visiontune: downloading {said} into {folder}", flush=True)
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
    return os.path.join(folder, pattern) if pattern else folder


def named(data: str) -> tuple[str, dict[str, str] | None, str | None]:
    """What the URL ``data`` names: the URL of the index beside its shards; each shard's name (its copy's file in
    the cache folder) and URL, or None for a folder URL, whose index names them; and the brace pattern (or the
    one ``.tar``) among its words, None for a folder. A pattern's names are expanded here, each one file of the
    cache folder (``_cache_name``): one line for one that is not."""
    found = list(_TAR.finditer(data))
    if not found:
        if data.startswith("pipe:"):
            raise UserError(f"{data}: name the .tar files in the command, e.g. 'pipe:curl -s URL/shards-{{0..9}}.tar'")
        return f"{data.rstrip('/')}/{INDEX}", None, None
    m = found[-1]  # a pattern, or one shard: the index is the file beside them
    names = expand(m[0])
    odd = next((n for n in names if not _cache_name(n)), None)
    if odd is not None:
        raise UserError(
            f"{shown(data)[:200]} names the shard {odd!r:.80}, which cannot be a file of the shard cache "
            f"(printable, at most {MAX_SHARD_NAME} bytes); rename the shards or copy them to a folder"
        )
    before, after = data[: m.start()], data[m.end() :]
    return before + INDEX + after, {n: before + n + after for n in names}, m[0]


def _cache_name(name: str) -> bool:
    """Whether ``name`` is one file in the shard cache's folder: no separator, not ``.`` or ``..``, printable
    (no NUL), UTF-8 and at most ``MAX_SHARD_NAME`` bytes (its temporary copy's name adds 18 to that)."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate, from JSON's \udcxx
        return False
    return 0 < size <= MAX_SHARD_NAME and name.isprintable() and "/" not in name and name not in (".", "..")


def _listed(index: dict, url: str) -> list[str]:
    """The shard names a folder URL's index lists: at most ``MAX_NAMES``, each a plain file name beside it."""
    shardlist = index["shardlist"]
    if len(shardlist) > MAX_NAMES:
        raise UserError(f"{url} lists {len(shardlist):,} shards, more than the {MAX_NAMES:,} visiontune reads")
    names = [s.get("url") if isinstance(s, dict) else s for s in shardlist]
    odd = [n for n in names if not (isinstance(n, str) and _NAME.fullmatch(n) and _cache_name(n))]
    if odd:  # the name a copy is written under, and a request: never a path, a URL or a glob
        raise UserError(
            f"{url} lists {odd[0]!r:.80}, not a shard file beside it (letters, digits, _ . + = ~ -, ending .tar, "
            f"at most {MAX_SHARD_NAME} characters); pass a brace pattern"
        )
    return list(dict.fromkeys(names))


def _sizes(index: dict | None) -> dict[str, int]:
    """Each listed shard's size in bytes, where its entry gives one."""
    sizes = {}
    for s in (index or {}).get("shardlist", []):
        if isinstance(s, dict) and isinstance(s.get("url"), str) and type(s.get("filesize")) is int:
            sizes[s["url"]] = max(0, s["filesize"])
    return sizes


def _whole(path: str, size: int | None) -> bool:
    """Whether ``path`` holds its shard: any file there was renamed into place whole; ``size`` (the index's)
    tells a shard that changed at the source, or a damaged copy, from the one wanted."""
    try:
        got = os.path.getsize(path)
    except OSError:
        return False
    return size is None or got == size


def _parse_index(raw: bytes) -> dict:
    try:
        index = json.loads(raw)
    except RecursionError:
        raise ValueError("its JSON is nested too deep") from None
    if not isinstance(index, dict) or not isinstance(index.get("shardlist"), list):
        raise ValueError("it lists no shards")
    return index


def _index(folder: str, url: str, required: bool) -> tuple[dict | None, bytes | None]:
    """The index of the shards, and its bytes when they were fetched now: the cached one, else fetched
    (None where there is none; ``required`` for a folder URL, whose shards only its index names)."""
    cached = os.path.join(folder, INDEX)
    if os.path.exists(cached):
        try:
            with open(cached, "rb") as f:
                raw = f.read(MAX_INDEX_BYTES + 1)  # (a cache on a shared disk is read as a download is)
            if len(raw) > MAX_INDEX_BYTES:
                raise ValueError(f"larger than {byte_size(MAX_INDEX_BYTES)}")
            return _parse_index(raw), None
        except (OSError, ValueError) as e:
            raise UserError(f"{cached} is damaged ({e}); delete it to fetch {url} again") from None
    if os.path.exists(os.path.join(folder, NO_INDEX)) and not required:
        return None, None
    raw = io.BytesIO()
    try:
        _copy(url, raw, MAX_INDEX_BYTES)
    except UserError:
        if required:
            raise
        return None, None  # shards written elsewhere come without one
    if raw.tell() > MAX_INDEX_BYTES:
        raise UserError(f"{url} is larger than {byte_size(MAX_INDEX_BYTES)}: no shard index visiontune reads")
    try:
        index = _parse_index(raw.getvalue())
    except ValueError as e:
        if required:
            raise UserError(f"{url} is no shard index ({e}); pass --data 'URL/shards-{{000000..000127}}.tar'") from None
        return None, None
    return index, raw.getvalue()


class _Enough(Exception):
    """More than the limit came: the copy stops there."""


class _Sink(io.RawIOBase):
    """Where a download is written: into ``out``, its first 512 bytes kept, stopped once more than ``limit``."""

    def __init__(self, out: BinaryIO, limit: int | None):
        self.out, self.limit, self.head = out, limit, b""

    def write(self, chunk) -> int:
        self.head = self.head or bytes(chunk[:512])
        self.out.write(chunk)  # (a full disk is atomic_file's one line, not a failed download)
        if self.limit is not None and self.out.tell() > self.limit:
            raise _Enough
        return len(chunk)


def _copy(url: str, out: BinaryIO, limit: int | None = None) -> bytes:
    """``url``'s bytes into the file ``out`` (stopping once more than ``limit`` came), and their first 512;
    a failure is one line."""
    sink = _Sink(out, limit)
    with contextlib.suppress(_Enough):
        if url.startswith(("http://", "https://", "hf://")):
            _http_copy(url, sink)
            return sink.head
        try:  # an allowed pipe: command, through webdataset's opener
            from webdataset.gopen import gopen
        except ImportError:
            raise UserError("reading pipe: shards needs webdataset: pip install 'visiontune[formats]'") from None
        try:
            with gopen(url, "rb") as stream:
                shutil.copyfileobj(stream, sink, 1 << 20)
        except (OSError, ValueError) as e:
            status = re.search(r"exit (\d+)", str(e))
            raise _failed(url, f"the command's exit status {status[1]}" if status else _first_line(e)) from None
    return sink.head


def _hub(url: str) -> tuple[str, dict[str, str]]:
    """The Hub's download URL for an hf:// file, and the headers huggingface_hub sends there (the token)."""
    try:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers
    except ImportError:
        raise UserError("reading hf:// shards needs huggingface_hub: pip install 'visiontune[formats]'") from None
    m = re.fullmatch(r"hf://(?:(datasets|spaces)/)?([^/@]+/[^/@]+)(?:@([^/]+))?/(.+)", url)
    if m is None:
        raise UserError(f"{url}: an hf:// shard URL is hf://datasets/ORG/NAME[@REVISION]/PATH.tar")
    kind = {"datasets": "dataset", "spaces": "space"}.get(m[1])
    file_url = hf_hub_url(m[2], m[4], repo_type=kind, revision=unquote(m[3]) if m[3] else None)
    return file_url, build_hf_headers(library_name="visiontune", library_version=__version__)


def _http_copy(url: str, sink: _Sink) -> None:
    """One streamed GET of ``url`` (http(s):// or hf://) into ``sink``, again after a transient failure."""
    try:
        import aiohttp
        import fsspec
    except ImportError:
        raise UserError("reading http(s):// shards needs aiohttp: pip install 'visiontune[formats]'") from None
    # No time-out on the whole file (aiohttp's default cuts any download at 5 min).
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT_S, sock_read=TIMEOUT_S)
    fs = fsspec.filesystem("http", client_kwargs={"timeout": timeout})
    target, headers = _hub(url) if url.startswith("hf://") else (url, {"User-Agent": f"visiontune/{__version__}"})
    # (aiohttp counts the answer that would be one redirect too many)
    get = {"headers": headers, "max_redirects": MAX_REDIRECTS + 1, "chunk_size": 1 << 20, **_proxy(target)}
    for attempt in range(RETRIES):
        sink.out.seek(0)
        sink.out.truncate()
        sink.head = b""
        try:
            return fs.get_file(target, sink, **get)
        except (aiohttp.ClientError, FileNotFoundError, TimeoutError, asyncio.TimeoutError) as e:
            status = getattr(e, "status", 0) if isinstance(e, aiohttp.ClientResponseError) else 0
            dropped = isinstance(e, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError))
            if attempt + 1 == RETRIES or not (status >= 500 or status == 429 or dropped):
                raise _failed(url, _why(e)) from None
        time.sleep(BACKOFF_S * 2**attempt)


def _proxy(url: str) -> dict:
    """The proxy the environment names for ``url`` (``http_proxy``, ``https_proxy``, ``no_proxy``, read by
    urllib as aiohttp's ``trust_env`` reads them), as aiohttp's request argument; a login in the proxy's URL
    goes to the proxy alone (aiohttp's ``Proxy-Authorization``). Not ``trust_env`` itself: it also sends the
    ``~/.netrc`` login of the URL's host (and fails on one beside the Hub's token), where a URL here may
    come from a run folder or an index, over plain http://. A redirect goes through the same proxy."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    target = urlsplit(url)
    proxy = getproxies().get(target.scheme)
    return {"proxy": proxy} if proxy and not (target.hostname and proxy_bypass(target.hostname)) else {}


def _why(e: BaseException) -> str:
    """What failed a GET, in a few words: the HTTP status, or what the network said."""
    import aiohttp

    if isinstance(e, FileNotFoundError):  # (fsspec's word for a 404)
        return "the server answered HTTP 404 Not Found"
    if isinstance(e, (aiohttp.TooManyRedirects, aiohttp.RedirectClientError)):
        status = e.history[-1].status if isinstance(e, aiohttp.TooManyRedirects) else "3xx"
        many = f"more than {MAX_REDIRECTS} redirects, or one to a URL that is not http(s)"
        return f"the server answered HTTP {status}: {many}"
    if isinstance(e, aiohttp.ClientResponseError):
        return f"the server answered HTTP {e.status} {_first_line(e.message)}"
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)) and not str(e):
        return f"nothing came for {TIMEOUT_S} s"
    return _first_line(e)


def _failed(url: str, why: str) -> UserError:
    return UserError(
        f"cannot download {url} ({why}); check the URL and the network, or copy the shards to a folder and "
        "pass --data FOLDER"
    )


def _first_line(e: object) -> str:
    """What ``e`` says, on one line (a server's words included: nothing unprintable)."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return "".join(c if c.isprintable() else "?" for c in line)


def _download(url: str, dest: str, size: int | None) -> None:
    with atomic_file(dest) as f:  # whole, or not there at all
        head = _copy(url, f, size)
        if size is not None and f.tell() != size:
            came = f"more than {size}" if f.tell() > size else f"{f.tell()}"
            raise UserError(f"{url}: {came} bytes came where its index.json says {size}; download it again")
        if head.strip(b"\0") and head[257:262] != b"ustar":
            raise UserError(f"{url} is not a tar file (the server sent something else); check the URL")
