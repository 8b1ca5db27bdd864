"""``visiontune serve``: a trained model behind HTTP -- FastAPI on uvicorn, with dynamic batching.

``POST /predict`` takes one image as the raw body (an ``image/*`` or
``application/octet-stream`` content type) or any number as the files of a
``multipart/form-data`` body, decodes them in a thread pool with ``predict``'s
code (``runtime``) and hands them to the ``Batcher``, which runs the images of
requests arriving within ``max_wait_ms`` as one batch. A multi-label model answers
each image with its label set (the model file's per-class thresholds, or
``?threshold=T``) and every class's sigmoid probability. ``GET /health`` is 200
once the model is loaded and a warm-up forward pass has run (503 before, and
while shutting down), ``GET /metadata`` describes the model, ``GET /metrics``
counts in Prometheus' text format.

Hostile input is refused with a 4xx and one JSON line ``{"error": ...}``, and
one log line saying what was refused: a body over ``max_body_mb`` (413, from
its Content-Length before anything is read, else as soon as the bytes read pass
the limit), a content type that is not an image (415), an empty or malformed
body (400), an image that does not decode, is truncated or declares too many
pixels (422). SIGTERM drains: new requests get 503, those in flight are
answered, then uvicorn stops and the process exits 0 (after ``GRACE_S`` at most).
"""

import asyncio
import json
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass

from visiontune.data.decode import MAX_PIXELS, header_pixels
from visiontune.errors import UserError
from visiontune.inference import decodepool
from visiontune.inference.batching import Batcher
from visiontune.inference.decodepool import DecodePool
from visiontune.inference.runtime import Runtime, load_runtime
from visiontune.inference.servemetrics import Metrics
from visiontune.text import printable

MAX_FILES = 256  # images in one multipart request
GRACE_S = 30.0  # the longest SIGTERM waits for requests in flight
PATHS = ("/predict", "/health", "/metadata", "/metrics")
OPTIONS_ENV = "VISIONTUNE_SERVE_OPTIONS"  # how --workers N hands the options to each worker process
log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ServeOptions:
    run: str | None = None
    weights: str | None = None
    model: str | None = None
    classes: list[str] | None = None
    image_size: int | None = None
    compile: bool = False
    threads: int = 1  # intra-op threads of each process
    threads_from: str = ""  # what chose them (``launch.threads_choice``), said at start-up
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 32
    max_wait_ms: float = 5.0
    workers: int = 1
    max_body_mb: float = 16.0
    max_connections: int = 256  # requests being answered at once; uvicorn keeps up to 4x as many connections
    access_log: bool = True
    decoders: int = 2  # decode processes (0: this process's threads, no crash isolation)
    max_request_pixels: int = 4 * MAX_PIXELS  # the pixels the images of one request declare, in all
    max_pixels_in_flight: int = 8 * MAX_PIXELS  # declared pixels of the images being decoded, all requests
    header_timeout: float = 10.0  # seconds for a request's head to arrive
    body_timeout: float = 60.0  # seconds for its body, once the head is in


def require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import python_multipart  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("serve needs the serve extra: pip install 'visiontune[serve]'") from None


class Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def _client(scope) -> str:
    host, port = scope.get("client") or ("?", 0)
    return f"{host}:{port}"


def _refusal(scope, status: int, reason: str):
    from fastapi.responses import JSONResponse

    method, path = scope.get("method"), printable(scope.get("path", ""))
    log.warning("refused %s %s from %s: %d %s", method, path, _client(scope), status, printable(reason))
    headers = {"Connection": "close"} if status >= 500 or status == 408 else {}
    headers |= {"Retry-After": "1"} if status == 503 else {}
    return JSONResponse({"error": reason}, status_code=status, headers=headers or None)


class State:
    """What the routes and the gate share: readiness, draining, requests in flight, the counters."""

    def __init__(self, runtime: Runtime, options: ServeOptions):
        self.runtime, self.options = runtime, options
        self.metrics = Metrics(options.max_batch)
        self.batcher = Batcher(runtime.probabilities, options.max_batch, options.max_wait_ms / 1000, self.metrics.batch)
        self.decoders = DecodePool(options.decoders, self.metrics.decoder_restart)
        self.ready = self.draining = False
        self._warming = threading.Lock()
        self.in_flight = 0
        self.pixels_in_flight = 0  # declared pixels of the images being decoded now

    def warm_up(self) -> None:
        """Once: a second call (an embedding app warmed it before the lifespan's thread) finds it ready."""
        with self._warming:
            if not self.ready:
                self._warm_up()

    def _warm_up(self) -> None:
        sizes = (1, 2, self.options.max_batch) if self.runtime.backend == "compile" else (1,)
        self.runtime.warm_up(tuple(sorted(set(sizes))))
        self.decoders.warm_up()
        self.batcher.start()
        self.ready = True
        log.info("visiontune: model warmed up (%s, %s): ready", self.runtime.info.model, self.runtime.backend)


class Gate:
    """Outermost ASGI layer: 503 while draining or over ``max_connections`` requests, the body limit and its
    deadline, requests in flight, counts and latency, and quiet client disconnects."""

    def __init__(self, app, state: State):
        self.app, self.state = app, state
        self.limit = int(state.options.max_body_mb * 1024 * 1024)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        from starlette.requests import ClientDisconnect

        self.state.in_flight += 1
        try:
            await self._answer(scope, receive, sending)
        except ClientDisconnect:  # raised where no handler sees it (a body read outside the routes)
            scope["visiontune.disconnected"] = True
        finally:
            self.state.in_flight -= 1
            path = scope["path"] if scope["path"] in PATHS else "other"
            if scope.get("visiontune.disconnected"):
                log.info("client %s left during %s %s", _client(scope), scope.get("method"), printable(scope["path"]))
                self.state.metrics.disconnect()
            else:
                self.state.metrics.request(path, status[0], time.perf_counter() - start)

    async def _answer(self, scope, receive, send):
        if self.state.draining:
            return await _refusal(scope, 503, "shutting down")(scope, receive, send)
        if self.state.in_flight > self.state.options.max_connections:
            busy = f"{self.state.options.max_connections} requests are being answered (--max-connections): retry"
            return await _refusal(scope, 503, busy)(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit():
            return await _refusal(scope, 400, "bad Content-Length")(scope, receive, send)
        if int(declared) > self.limit:
            return await _refusal(scope, 413, self._too_large(int(declared)))(scope, receive, send)
        seen, more, deadline = 0, True, time.monotonic() + self.state.options.body_timeout

        async def limited():
            nonlocal seen, more
            if not more:  # the body is in: what is left to hear is a disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise Refused(408, self._too_slow(seen)) from None
            seen += len(message.get("body", b""))
            more = message.get("more_body", False) and message["type"] == "http.request"
            if seen > self.limit:
                raise Refused(413, self._too_large(seen, "at least "))
            return message

        await self.app(scope, limited, send)

    def _too_large(self, size: int, qualifier: str = "") -> str:
        return f"body of {qualifier}{size} bytes is over the limit of {self.limit} (--max-body-mb)"

    def _too_slow(self, size: int) -> str:
        return (
            f"the body did not arrive within {self.state.options.body_timeout:g} s ({size} bytes came; --body-timeout)"
        )


async def _uploads(request) -> list[tuple[str, bytes]]:
    """(name, bytes) of each image in the request, or Refused."""
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException

    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        try:
            form = await request.form(max_files=MAX_FILES, max_fields=MAX_FILES)
        except HTTPException as exc:  # python-multipart's complaints, raised by Starlette as a 400
            raise Refused(400, f"bad multipart body: {exc.detail}") from None
        files = [(f.filename or name, await f.read()) for name, f in form.multi_items() if isinstance(f, UploadFile)]
        if not files:
            raise Refused(400, "no file in the multipart body: send each image as a file field")
        return files
    if kind.startswith("image/") or kind == "application/octet-stream":
        data = await request.body()
        if not data:
            raise Refused(400, "empty body: send the image's bytes")
        return [("body", data)]
    raise Refused(415, f"content type {kind or '(none)'} is not an image: send image/* or multipart/form-data")


async def _pixels(state: State, uploads: list[tuple[str, bytes]]) -> int:
    """The pixels the request's images declare, in all, read from their headers before any is decoded; an
    image over the per-image limit is refused here, and a request over its budget."""
    total = 0
    for name, data in uploads:
        n = header_pixels(data)
        n = n if n is not None else await state.decoders.run(decodepool.pixels, data)  # PIL reads other headers
        if n is not None and n > MAX_PIXELS:
            raise Refused(422, f"{name}: image too large ({n} pixels > limit {MAX_PIXELS})")
        total += n or 0
    if total > state.options.max_request_pixels:
        raise Refused(
            413, f"the images hold {total} pixels in all, over the limit of {state.options.max_request_pixels} "
            "(--max-request-pixels): send fewer or smaller images per request",
        )  # fmt: skip
    return total


async def _decode(state: State, uploads: list[tuple[str, bytes]]) -> list:
    """The uploads as uint8 [3, S, S] images, decoded in the decode processes within the pixel budgets, or
    Refused: 422 naming the first image that does not decode, 503 while others' images fill the budget."""
    import torch

    total = await _pixels(state, uploads)
    budget = state.options.max_pixels_in_flight
    if state.pixels_in_flight + total > budget:
        busy = f"busy: {state.pixels_in_flight} pixels are being decoded (--max-pixels-in-flight {budget}): retry"
        raise Refused(503, busy)
    info = state.runtime.info
    state.pixels_in_flight += total
    try:
        images = await asyncio.gather(
            *(
                state.decoders.run(
                    decodepool.prepare, data, info.image_size, info.interpolation, info.crop_pct, info.decode
                )
                for _, data in uploads
            )
        )
    finally:
        state.pixels_in_flight -= total
    for (name, _), image in zip(uploads, images):
        if image is None:
            log.warning("a decode process died on %s: restarted", printable(name))
        if image is None or isinstance(image, str):
            raise Refused(422, f"{name}: {image or decodepool.CRASHED}")
    return [torch.from_numpy(image) for image in images]


def build_app(runtime: Runtime, options: ServeOptions):
    """The ASGI application: the routes behind the ``Gate``."""
    from fastapi import FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    state = State(runtime, options)

    @asynccontextmanager
    async def lifespan(app):
        _drain_on_sigterm(state, asyncio.get_running_loop())
        threading.Thread(target=state.warm_up, name="visiontune-warm-up", daemon=True).start()
        yield
        state.batcher.stop()
        state.decoders.stop()

    app = FastAPI(title="visiontune", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect):
        request.scope["visiontune.disconnected"] = True  # the Gate counts it; nobody is left to answer
        return PlainTextResponse("", status_code=400)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        return _refusal(request.scope, exc.status, exc.reason)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        return _refusal(request.scope, 400, f"{first['loc'][-1]}: {first['msg']}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return _refusal(request.scope, exc.status_code, str(exc.detail))

    @app.post("/predict")
    async def predict(
        request: Request,
        top_k: int = Query(5, ge=1),
        all_classes: bool = Query(False, alias="all"),
        threshold: float | None = Query(None, gt=0, lt=1),
    ):
        task = runtime.info.task
        if threshold is not None and not task.thresholded:
            raise Refused(400, "threshold is for multi-label models; this one picks the most probable class")
        if not state.ready:
            raise Refused(503, "the model is still warming up")
        uploads = await _uploads(request)
        images = await _decode(state, uploads)
        rows = await asyncio.gather(*(asyncio.wrap_future(f) for f in state.batcher.submit(images)))
        classes = list(runtime.info.classes)
        answer = {"model": runtime.info.model, "run": runtime.run, "weights": runtime.weights}
        thresholds = runtime.info.decision_thresholds  # a thresholded model's: the file's, or the query's
        if threshold is not None:
            thresholds = [threshold] * len(classes)
        if thresholds is not None:
            answer["thresholds"] = thresholds
        k = len(classes) if all_classes else min(top_k, len(classes))
        predictions = [
            {"file": name, **task.answer(row.tolist(), classes, thresholds, k)} for (name, _), row in zip(uploads, rows)
        ]
        return {**answer, "predictions": predictions}

    @app.get("/health")
    async def health():
        status = "shutting down" if state.draining else "ready" if state.ready else "warming up"
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    @app.get("/metadata")
    async def metadata():
        return {**runtime.describe(), "max_batch": options.max_batch, "max_wait_ms": options.max_wait_ms}

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.text(state.in_flight, state.ready, state.pixels_in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.serving = state
    return Gate(app, state)


def _drain_on_sigterm(state: State, loop: asyncio.AbstractEventLoop) -> None:
    """SIGTERM: refuse new requests, wait for those in flight, then hand the signal to uvicorn's own handler.

    uvicorn installs its handler before the application starts; it is called once the drain is done,
    so its shutdown finds nothing left to wait for. A second SIGTERM goes to it at once.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # signals reach only the main thread (a test client runs the app elsewhere)
    uvicorn_handler = signal.getsignal(signal.SIGTERM)
    if not callable(uvicorn_handler):
        return

    async def drain():
        deadline = time.monotonic() + GRACE_S
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        log.info("visiontune: drained, stopping")
        uvicorn_handler(signal.SIGTERM, None)

    def on_sigterm(sig, frame):
        if state.draining:
            return uvicorn_handler(sig, frame)
        state.draining = True
        log.info("visiontune: SIGTERM: refusing new requests, finishing %d in flight", state.in_flight)
        loop.call_soon_threadsafe(lambda: loop.create_task(drain()))

    signal.signal(signal.SIGTERM, on_sigterm)


def _load(options: ServeOptions) -> Runtime:
    return load_runtime(
        options.run,
        options.weights,
        compile=options.compile,
        threads=options.threads,
        model=options.model,
        classes=options.classes,
        image_size=options.image_size,
    )


def app_from_env():
    """The application of one ``--workers`` process, from the options the parent put in the environment."""
    from visiontune.inference.serveproto import HeaderDeadline

    options = ServeOptions(**json.loads(os.environ[OPTIONS_ENV]))
    HeaderDeadline.timeout = options.header_timeout
    return build_app(_load(options), options)


def serve(options: ServeOptions) -> int:
    """Serve until SIGTERM or Ctrl+C; 0 once every request in flight has been answered."""
    require_extra()
    import uvicorn

    from visiontune.inference.serveproto import HeaderDeadline

    HeaderDeadline.timeout = options.header_timeout
    runtime = _load(options)  # bad paths and files: one line here, before anything listens
    common = dict(
        host=options.host,
        port=options.port,
        access_log=options.access_log,
        http=HeaderDeadline,
        # Connections: room for as many again as requests, so that clients still sending their heads (each
        # closed after --header-timeout) do not keep others out; the Gate holds requests to max_connections.
        limit_concurrency=4 * options.max_connections,
        timeout_graceful_shutdown=int(GRACE_S),
        log_level="info",
    )
    print(
        f"visiontune: serving {runtime.info.model} ({runtime.backend}, {', '.join(runtime.info.classes)}) from "
        f"{runtime.run or runtime.weights}: batches of up to {options.max_batch} within {options.max_wait_ms:g} ms, "
        f"{options.workers} worker(s) of {options.threads} thread(s)"
        f"{f' ({options.threads_from})' if options.threads_from else ''}; POST http://{options.host}:{options.port}/predict",
        flush=True,
    )
    # uvicorn raises the signal that stopped it again once it has put back the handler it found; this one
    # makes that a plain return: by then every request in flight has had its answer.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        if options.workers == 1:
            server = uvicorn.Server(uvicorn.Config(build_app(runtime, options), lifespan="on", **common))
            server.run()
            started = server.started
        else:
            del runtime  # each worker loads its own
            os.environ[OPTIONS_ENV] = json.dumps(asdict(options))
            uvicorn.run("visiontune.inference.serve:app_from_env", factory=True, workers=options.workers, **common)
            started = True
    except SystemExit:
        started = False
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not started:
        raise UserError(f"could not serve on {options.host}:{options.port} (the log line above says why)")
    return 0
