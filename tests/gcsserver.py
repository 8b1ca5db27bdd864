"""A Google Cloud Storage server on 127.0.0.1 for the gs:// tests: gcp-storage-emulator (a pinned dev
dependency: GCS's JSON API, in memory) in a thread of this process, which gcsfs reaches through
``STORAGE_EMULATOR_HOST``, with every request it answered logged.

gcsfs's default file system first asks GCS's storage-control API (gRPC) what kind each bucket is, which no
emulator answers (nor anonymous credentials): it logs a warning on every request. visiontune opens gcsfs's
JSON API file system, which never asks (``data/stores.py``); the tests set nothing to quiet gcsfs, so that
what they see on stderr is what a user sees. The emulator checks no credentials.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

import pytest

_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>[^? ]*)(?:\?(?P<query>\S*))? HTTP/[\d.]+" (?P<status>\d+)')


class GcsServer(logging.Handler):
    """The running emulator: its endpoint, and ``requests`` (method, path, query, status) as it logged them
    (in this process, before each answer's body: complete when the client has its answer)."""

    def __init__(self, endpoint: str):
        super().__init__()
        self.endpoint, self.requests = endpoint, []

    def emit(self, record: logging.LogRecord) -> None:
        m = _LINE.search(record.getMessage())
        if m:
            self.requests.append((m["method"], unquote(m["path"]), m["query"] or "", int(m["status"])))

    def env(self) -> dict[str, str]:
        """What a process needs to reach the emulator through gcsfs's own chain."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def gets(self, path: str) -> int:
        """How many GETs read the object at ``path`` (``/bucket/name``): media downloads."""
        bucket, _, name = path.lstrip("/").partition("/")
        media = f"/download/storage/v1/b/{bucket}/o/{name}"
        return sum(1 for m, p, q, _ in self.requests if m == "GET" and p == media)


@contextmanager
def gcs_server() -> Iterator[GcsServer]:
    """gcp-storage-emulator on a free port of 127.0.0.1, in memory, in a thread of this process."""
    pytest.importorskip("gcsfs")
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    server = emulator.create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    log = logging.getLogger(emulator.__name__)
    found = GcsServer(f"http://127.0.0.1:{server._api._httpd.server_address[1]}")  # (the port it was given)
    log.addHandler(found)
    level, log.propagate = log.level, False
    log.setLevel(logging.INFO)
    try:
        yield found
    finally:
        log.removeHandler(found)
        log.setLevel(level)
        log.propagate = True
        server.stop()


def upload(server: GcsServer, folder: Path, url: str) -> None:
    """Every file below ``folder`` to ``url`` (``gs://bucket/prefix``), the bucket made if it is missing."""
    from gcsfs.core import GCSFileSystem  # (the JSON API's, as visiontune's: no question of the bucket's kind)

    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
    try:
        fs = GCSFileSystem(token="anon", skip_instance_cache=True)
        bucket, _, prefix = url.split("://", 1)[1].partition("/")
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = "/".join(filter(None, [bucket, prefix.strip("/"), path.relative_to(folder).as_posix()]))
            fs.pipe_file(key, path.read_bytes())
    finally:
        if old is None:
            del os.environ["STORAGE_EMULATOR_HOST"]
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
