"""A real S3-protocol server on 127.0.0.1 for the tests: moto's server mode, behind a WSGI layer that logs
every request and can answer the next requests for an object with a fault (503, a connection dropped
mid-object)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "vt-test-key-id", "AWS_SECRET_ACCESS_KEY": "vt-test-secret-value"}


class S3Server:
    """moto's S3 app with a request log (``requests``: method, path, byte range) and ``faults``: for an
    object's path, what to answer its next GETs with, one item a GET (``503`` or ``"drop"``)."""

    def __init__(self, app):
        self.app, self.requests, self.faults, self.endpoint = app, [], {}, ""
        self.on_get = None  # called with each GET's path before it is answered
        self.lock = threading.Lock()

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server: its endpoint, a region and test credentials."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1", **CREDENTIALS}

    def gets(self, path: str) -> int:
        """How many GETs asked for the object at ``path`` (``/bucket/key``)."""
        return sum(1 for m, p, _ in self.requests if m == "GET" and p == path)

    def __call__(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ["PATH_INFO"]
        if f"Credential={CREDENTIALS['AWS_ACCESS_KEY_ID']}/" not in environ.get("HTTP_AUTHORIZATION", ""):
            # S3's answer to a key it does not know (moto's server takes any key)
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [
                b"<Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not "
                b"exist in our records.</Message></Error>"
            ]
        with self.lock:
            self.requests.append((method, path, environ.get("HTTP_RANGE", "")))
            pending = self.faults.get(path) if method == "GET" else None
            fault = pending.pop(0) if pending else None
        if method == "GET" and self.on_get is not None:
            self.on_get(path)
        if fault == 503:
            start_response("503 Service Unavailable", [("Content-Type", "application/xml")])
            return [b"<Error><Code>ServiceUnavailable</Code><Message>Please try again.</Message></Error>"]
        if fault == "drop":  # the real answer, its Content-Length, and half its body: then the connection closes
            held = {}
            body = b"".join(self.app(environ, lambda status, headers, *a: held.update(s=status, h=headers)))
            start_response(held["s"], [*held["h"], ("Connection", "close")])
            return [body[: len(body) // 2]]
        return self.app(environ, start_response)


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on a free port of 127.0.0.1, in a thread of this process (its processes reach it too)."""
    pytest.importorskip("s3fs")
    moto_app = pytest.importorskip("moto.moto_server.werkzeug_app")
    from werkzeug.serving import make_server

    class Quiet(moto_app.MotoRequestHandler):
        protocol_version = "HTTP/1.0"  # one request a connection: a dropped answer is a closed connection

        def log(self, *args, **kwargs):
            pass

    server = S3Server(moto_app.DomainDispatcherApplication(moto_app.create_backend_app))
    http = make_server("127.0.0.1", 0, server, threaded=True, request_handler=Quiet)
    server.endpoint = f"http://127.0.0.1:{http.server_address[1]}"
    thread = threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        http.shutdown()
        http.server_close()


def upload(server: S3Server, folder: Path, url: str) -> None:
    """Every file below ``folder`` to ``url`` (``s3://bucket/prefix``), the bucket made if it is not there."""
    import boto3

    bucket, _, prefix = url[len("s3://") :].partition("/")
    s3 = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    if bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=bucket)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = "/".join(filter(None, [prefix.strip("/"), path.relative_to(folder).as_posix()]))
        s3.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
