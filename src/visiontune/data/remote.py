"""Remote tar shards (``https://``, ``http://``, ``hf://``, and ``pipe:`` behind ``--allow-pipe``),
copied whole into a local folder and read from there.

Exact sampling, DDP sharding and resume need each sample's offset in its shard, which a
stream does not give, so ``--data URL`` first copies the shards it names into the cache
-- ``$VISIONTUNE_SHARD_CACHE``, else ``shards/`` in the user's cache folder, a subfolder
per URL -- then ``data/shards.py`` reads the copies as local shards. A file is written
under a temporary name and renamed when it is whole, so a killed download, or two runs
fetching at once, never leave a partial shard under a shard's name; a shard already there
(of the size ``index.json`` gives, when it gives one) is not fetched again. The
``index.json`` beside the shards (``visiontune shard`` writes one) is fetched with them;
where there is none, that is noted once the shards are in, so every later run -- offline
included -- reads the set the same way.

What a URL returns, and a URL read from a file (a run's ``config.json``, a config file, an
``index.json``), is untrusted (DESIGN.md, "The trust boundary"):

- http(s):// and hf:// are read by this module's one HTTP client (urllib, no curl: nothing
  expands ``[1-100000000]`` or ``{a,b}`` in a URL): one GET a file -- the index, then each
  shard named, at most ``braces.MAX_NAMES`` -- with a time-out, at most 5 redirects, an
  index of at most ``MAX_INDEX_BYTES`` and a shard of at most the size its index gives.
  The names an index lists must be plain file names (``_NAME``).
- A ``pipe:`` command runs only when this process's own command line gave it as its data
  together with ``--allow-pipe`` (``allow_command``); one read from any file never runs.
  Webdataset's other command-run schemes (sftp://, scp://, ais://, ...) are not opened:
  a trusted ``pipe:`` command reads them.

Object stores (s3://, gs://, az://) are read through fsspec by ``data/stores.py``. http(s) and hf:// keep this
client rather than fsspec's HTTP file system or huggingface_hub (``hf_hub_download``, ``HfFileSystem``) for
guards those lack, each pinned by the trust tests (``tests/data/test_remote_trust.py``), which read this
client's request as it is: exactly one GET a file and nothing else (fsspec's HTTP file system asks for the
size first, then reads by ranges; ``hf_hub_download`` sends a HEAD for the file's metadata first, and
``HfFileSystem`` lists through the Hub's API); at most 5 redirects, and only to http(s) (huggingface_hub
follows up to 20); and a shard cut off at the size its ``index.json`` gives (huggingface_hub takes the size the
server states). The Hub token goes to the Hub's host alone, never along a redirect to its file store, as
huggingface_hub does too; what is taken from huggingface_hub is the Hub's URL for a file (``hf_hub_url``,
``HF_ENDPOINT`` honoured) and the user's token (``get_token``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from typing import BinaryIO

from visiontune.data.braces import MAX_NAMES, expand
from visiontune.errors import UserError
from visiontune.files import atomic_file, atomic_write
from visiontune.text import shown
from visiontune.version import __version__

SCHEMES = ("http://", "https://", "hf://", "pipe:")
_ELSEWHERE = ("htgs://", "ais://", "sftp://", "ftps://", "scp://")  # webdataset runs a command for these
INDEX = "index.json"
NO_INDEX = ".no-index"  # the URL has no index.json: noted when its shards were fetched
MAX_INDEX_BYTES = 256 << 20  # visiontune's own index of 1.28M samples is about 60 MB
TIMEOUT_S = 60  # a server silent this long (connecting, or mid-file) is a failed download
_TAR = re.compile(r"[^/\s'\"]+\.tar(?![\w.])")  # the shard file name in a URL or a pipe: command
# A shard name an index.json may list: a plain file beside it (no separator, scheme, %-escape, glob or brace).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=~-]*\.tar")
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


def _trusted_root(make: bool = False) -> str:
    """The shard cache, held to the image cache's folder rule (``host.untrusted``) before anything in it is
    read, and again once made (0700, with the folder of this URL): a shard or index that another user could
    write there is what would be trained on. Not made before it is needed: a refused URL leaves nothing."""
    from visiontune.cluster.host import untrusted

    root = cache_root()
    try:
        if make:
            os.makedirs(root, mode=0o700, exist_ok=True)
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
    found = list(_TAR.finditer(data))
    if found:  # a pattern, or one shard: the index is the file beside them
        m = found[-1]
        index_url = data[: m.start()] + INDEX + data[m.end() :]
        urls = {n: data[: m.start()] + n + data[m.end() :] for n in expand(m[0])}
    elif data.startswith("pipe:"):
        raise UserError(f"{data}: name the .tar files in the command, e.g. 'pipe:curl -s URL/shards-{{0..9}}.tar'")
    else:  # a folder: its index lists the shards
        index_url, urls = f"{data.rstrip('/')}/{INDEX}", None
    root = _trusted_root()
    folder = os.path.join(root, hashlib.sha256(index_url.encode()).hexdigest()[:16])
    index, raw = _index(folder, index_url, required=urls is None)
    if urls is None:
        urls = {n: f"{data.rstrip('/')}/{n}" for n in _listed(index, index_url)}
    sizes = _sizes(index)
    _trusted_root(make=True)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot keep shards in {root} ({e.strerror}); set VISIONTUNE_SHARD_CACHE to a folder you can write"
        ) from None
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
    return os.path.join(folder, found[-1][0]) if found else folder


def _listed(index: dict, url: str) -> list[str]:
    """The shard names a folder URL's index lists: at most ``MAX_NAMES``, each a plain file name beside it."""
    shardlist = index["shardlist"]
    if len(shardlist) > MAX_NAMES:
        raise UserError(f"{url} lists {len(shardlist):,} shards, more than the {MAX_NAMES:,} visiontune reads")
    names = [s.get("url") if isinstance(s, dict) else s for s in shardlist]
    odd = [n for n in names if not (isinstance(n, str) and _NAME.fullmatch(n))]
    if odd:  # the name a copy is written under, and a request: never a path, a URL or a glob
        raise UserError(
            f"{url} lists {odd[0]!r:.80}, not a shard file beside it (letters, digits, _ . + = ~ -, ending .tar); "
            "pass a brace pattern"
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
                return _parse_index(f.read()), None
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
        raise UserError(f"{url} is larger than {MAX_INDEX_BYTES >> 20} MiB: no shard index visiontune reads")
    try:
        index = _parse_index(raw.getvalue())
    except ValueError as e:
        if required:
            raise UserError(f"{url} is no shard index ({e}); pass --data 'URL/shards-{{000000..000127}}.tar'") from None
        return None, None
    return index, raw.getvalue()


def _copy(url: str, out: BinaryIO, limit: int | None = None) -> bytes:
    """``url``'s bytes into the file ``out`` (stopping once more than ``limit`` came), and their first 512;
    a failure is one line."""
    if url.startswith(("http://", "https://", "hf://")):
        return _http_copy(url, out, limit)
    try:  # an allowed pipe: command, through webdataset's opener
        from webdataset.gopen import gopen
    except ImportError:
        raise UserError("reading pipe: shards needs webdataset: pip install 'visiontune[formats]'") from None
    head = b""
    try:
        with gopen(url, "rb") as stream:
            while chunk := stream.read(1 << 20):
                head = head or chunk[:512]
                out.write(chunk)
                if limit is not None and out.tell() > limit:
                    break
    except (OSError, ValueError) as e:
        status = re.search(r"exit (\d+)", str(e))
        why = f"the command's exit status {status[1]}" if status else _first_line(e)
        raise UserError(
            f"cannot download {url} ({why}); check the URL and the network, or copy the shards to a folder and "
            "pass --data FOLDER"
        ) from None
    return head


def _opener():
    """urllib's opener for http(s) alone (no file://, ftp:// or data: a redirect could lead to), following
    at most 5 redirects; the Hub token goes along only to the host it was meant for."""
    import urllib.request

    class Redirects(urllib.request.HTTPRedirectHandler):
        max_redirections = 5

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            new = super().redirect_request(req, fp, code, msg, headers, newurl)
            token = req.unredirected_hdrs.get("Authorization")
            if new is not None and token and _host(newurl) == _host(req.full_url):
                new.add_unredirected_header("Authorization", token)
            return new

    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.UnknownHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        Redirects(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def _host(url: str) -> str | None:
    import urllib.parse

    return urllib.parse.urlsplit(url).hostname


def _request(url: str):
    """The GET for an http(s) URL, or for an hf:// file on the Hub, with the user's token if they have one."""
    import urllib.parse
    import urllib.request

    if not url.startswith("hf://"):
        return urllib.request.Request(url, headers={"User-Agent": f"visiontune/{__version__}"})
    try:
        from huggingface_hub import get_token, hf_hub_url
    except ImportError:
        raise UserError("reading hf:// shards needs huggingface_hub: pip install 'visiontune[formats]'") from None
    m = re.fullmatch(r"hf://(?:(datasets|spaces)/)?([^/@]+/[^/@]+)(?:@([^/]+))?/(.+)", url)
    if m is None:
        raise UserError(f"{url}: an hf:// shard URL is hf://datasets/ORG/NAME[@REVISION]/PATH.tar")
    kind = {"datasets": "dataset", "spaces": "space"}.get(m[1])
    revision = urllib.parse.unquote(m[3]) if m[3] else None
    request = _request(hf_hub_url(m[2], m[4], repo_type=kind, revision=revision))
    token = get_token()
    if token:  # not in a redirect to the Hub's file store: that URL is signed
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    return request


def _http_copy(url: str, out: BinaryIO, limit: int | None) -> bytes:
    """One GET of ``url`` into ``out``: ``_copy`` for http(s):// and hf://."""
    import http.client

    request = _request(url)
    try:
        answer = _opener().open(request, timeout=TIMEOUT_S)
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise _failed(url, e) from None
    head, got = b"", 0
    with answer:
        while True:
            try:
                chunk = answer.read(1 << 20)
            except (OSError, http.client.HTTPException) as e:
                raise _failed(url, e) from None
            if not chunk:
                return head
            head = head or chunk[:512]
            out.write(chunk)  # (a full disk is atomic_file's one line, not a failed download)
            got += len(chunk)
            if limit is not None and got > limit:
                return head


def _failed(url: str, e: BaseException) -> UserError:
    """A failed GET as one line: the HTTP status, or what the network said."""
    import socket
    import urllib.error

    reason = e.reason if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError) else e
    if isinstance(e, urllib.error.HTTPError):
        e.close()  # (it holds the answer's connection)
        why = f"the server answered HTTP {e.code} {_first_line(e.reason)}"
        if 300 <= e.code < 400:  # urllib's own words span lines
            why = f"the server answered HTTP {e.code}: more than 5 redirects, or one to a URL that is not http(s)"
    elif isinstance(reason, socket.gaierror):
        why = "host not found"
    elif isinstance(reason, ConnectionRefusedError):
        why = "connection refused"
    elif isinstance(reason, TimeoutError):
        why = f"nothing came for {TIMEOUT_S} s"
    else:
        why = _first_line(reason)
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
