"""Azure's storage emulator, Azurite, on 127.0.0.1 for the az:// tests: its blob service, in memory, in a
process of its own, with every request it answered read from its access log.

Azurite is an npm package, pinned with all it needs by ``tests/azurite/package-lock.json``; ``make`` installs
it into the virtual environment (``npm ci``). A test that needs it and does not find it fails saying so.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BINARY = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"  # Azurite's one account, and its well-known key
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_LINE = re.compile(
    r'"(?P<method>[A-Z]+) /' + ACCOUNT + r'(?P<path>/[^? ]*)(?:\?(?P<query>\S*))? HTTP/[\d.]+" (?P<status>\d+)'
)


class Azurite:
    """The running emulator: its blob endpoint, and ``requests`` (method, path below the account, query,
    status), in the order it answered them (``sync`` first: its log is read by a thread)."""

    def __init__(self, proc: subprocess.Popen, endpoint: str):
        self.proc, self.endpoint, self.requests, self.lines = proc, endpoint, [], []
        self._syncs = 0
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            m = _LINE.search(line)
            with self._seen:
                self.lines.append(line)
                if m:
                    self.requests.append((m["method"], m["path"], m["query"] or "", int(m["status"])))
                self._seen.notify_all()

    def env(self, key: str = KEY) -> dict[str, str]:
        """What a process needs to reach the emulator through adlfs's own chain: a connection string."""
        endpoint = f"{self.endpoint}/{ACCOUNT}"
        return {
            "AZURE_STORAGE_CONNECTION_STRING": (
                f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};BlobEndpoint={endpoint};"
            )
        }

    def sync(self) -> None:
        """Every request answered so far is in ``requests``: one more is made, and its line waited for (the
        log is written in the order the answers end)."""
        self._syncs += 1
        path = f"/vt-sync-{self._syncs}"
        try:
            urllib.request.urlopen(f"{self.endpoint}/{ACCOUNT}{path}", timeout=30).close()
        except urllib.error.HTTPError:
            pass  # (an unsigned request: refused, and logged)
        with self._seen:
            assert self._seen.wait_for(lambda: any(r[1] == path for r in self.requests), timeout=30), self.lines[-5:]

    def gets(self, path: str) -> int:
        """How many GETs read the blob at ``path`` (``/container/name``), after ``sync``."""
        return sum(1 for m, p, q, _ in self.requests if m == "GET" and p == path and "comp=" not in q)


@contextmanager
def azurite_server() -> Iterator[Azurite]:
    """Azurite's blob service on a free port of 127.0.0.1, in memory, telemetry off; stopped at the end."""
    pytest.importorskip("adlfs")
    if not BINARY.exists():
        pytest.fail(f"Azurite is not installed ({BINARY} is missing): `make azurite` installs it with npm")
    argv = [str(BINARY), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence"]
    argv += ["--disableTelemetry", "--skipApiVersionCheck"]  # (azure-storage-blob may speak a newer version)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            said.append(line)
            m = re.search(r"listens on (http://127\.0\.0\.1:\d+)", line)
            if m or not line:
                break
        if not m:
            pytest.fail(f"Azurite did not start: {''.join(said)[-2000:]}")
        yield Azurite(proc, m[1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def upload(server: Azurite, folder: Path, url: str) -> None:
    """Every file below ``folder`` to ``url`` (``az://container/prefix``), the container made if it is missing."""
    from adlfs import AzureBlobFileSystem

    fs = AzureBlobFileSystem(connection_string=server.env()["AZURE_STORAGE_CONNECTION_STRING"])
    container, _, prefix = url.split("://", 1)[1].partition("/")
    if not fs.exists(container):
        fs.mkdir(container)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = "/".join(filter(None, [container, prefix.strip("/"), path.relative_to(folder).as_posix()]))
        fs.pipe_file(key, path.read_bytes())
