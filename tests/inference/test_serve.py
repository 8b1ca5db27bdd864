"""visiontune serve: the real server in a subprocess answers as ``predict`` does, batches concurrent requests,
refuses hostile input with a 4xx and lives on, and drains on SIGTERM.

One server (``server``) serves the whole module, on a free local port, over the shared ``trained_run``; the
SIGTERM test comes last and ends it.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import visiontune
import zygote
from conftest import PYTHON, _worker_env
from trained import one_thread  # noqa: F401  (autouse: in-process runs use one thread, as the server does)
from trainrun import start
from visiontune.cli.commands import main
from visiontune.tasks import MULTI_LABEL

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

MAX_BODY_MB = 1
JPEG = {"content-type": "image/jpeg"}
TIMEOUT = 60  # a harness limit for a request's answer (httpx's default, 5 s, is short on a busy machine)


@dataclass
class Server:
    url: str
    proc: subprocess.Popen | zygote.Forked
    log: Path

    def metric(self, name: str, default: float | None = None) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=TIMEOUT).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        if default is None:
            raise KeyError(name)
        return default  # a labelled series appears with its first count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported first by every Python process of the server, its decode processes included: there it turns off the
# PNG check, so that the PNG which crashes torchvision's decoder reaches it, and the supervision is what is tested.
UNGUARDED = """
from visiontune.data import pngcheck
pngcheck.problem = lambda data: None
"""
# Waited out by the tests of the limits (idle seconds of the suite); every other request sends at once.
HEADER_TIMEOUT, BODY_TIMEOUT = 3, 5


@pytest.fixture(scope="module")
def server(trained_run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    log = folder / "serve.log"
    (folder / "sitecustomize.py").write_text(UNGUARDED)
    port = _free_port()
    argv = [PYTHON, "-m", "visiontune", "serve", "--run", str(trained_run), "--port", str(port), "--threads", "1"]
    argv += ["--max-batch", "32", "--max-wait-ms", "20", "--max-body-mb", str(MAX_BODY_MB)]
    argv += ["--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)]
    env = _worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    # Forked from a process holding visiontune's imports (tests/zygote.py), which runs the hook first as an
    # interpreter would; the decode processes are new interpreters of the server's own, which run it at start.
    proc = start(argv, env, log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield Server(url, proc, log)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def images(sample_data) -> list[Path]:
    return sorted((sample_data / "test").iterdir())[:8]


@pytest.fixture(scope="module")
def predictor(trained_run):
    return visiontune.load(trained_run)


def _probs(prediction: dict, classes: list[str]) -> list[float]:
    by_class = {t["class"]: t["probability"] for t in prediction["top"]}
    return [by_class[c] for c in classes]


@pytest.mark.slow
def test_answers_equal_predict_and_the_api_bit_for_bit(server, trained_run, images, predictor, tmp_path):
    classes = predictor.classes
    files = [("file", (p.name, p.read_bytes(), "image/jpeg")) for p in images]
    got = httpx.post(f"{server.url}/predict?all=1", files=files, timeout=TIMEOUT).json()  # one request: one batch of 8
    assert got["model"] == "resnet18" and got["run"] == str(trained_run)
    assert [p["file"] for p in got["predictions"]] == [p.name for p in images]
    served = [_probs(p, classes) for p in got["predictions"]]

    api = predictor.predict(images, batch_size=len(images))  # the same batch through predict's code
    assert served == [[r["probabilities"][c] for c in classes] for r in api]  # exact floats
    assert [p["label"] for p in got["predictions"]] == [r["label"] for r in api]

    listing, out = tmp_path / "list.txt", tmp_path / "pred.csv"
    listing.write_text("".join(f"{p}\n" for p in images))
    argv = ["predict", "--run", str(trained_run), "--data", str(listing), "--out", str(out), "--no-progress"]
    assert main([*argv, "--batch-size", str(len(images))]) == 0
    rows = list(csv.reader(out.open()))[1:]
    assert [[f"{p:.6f}" for p in row] for row in served] == [row[2:] for row in rows]
    assert [p["label"] for p in got["predictions"]] == [row[1] for row in rows]

    # One image as the raw body is a batch of one: predict on that one file, bit for bit; top_k trims.
    one = httpx.post(f"{server.url}/predict?top_k=1", content=images[0].read_bytes(), headers=JPEG, timeout=TIMEOUT)
    (answer,) = one.json()["predictions"]
    alone = predictor.predict(images[0])
    assert answer["label"] == alone["label"] and answer["score"] == alone["score"]
    assert answer["top"] == [{"class": alone["label"], "probability": alone["score"]}]


@pytest.mark.slow
def test_concurrent_requests_share_forward_passes_and_get_their_own_answers(server, images, predictor):
    before = server.metric("visiontune_batch_size_count") - server.metric('visiontune_batch_size_bucket{le="1"}')
    answered = server.metric(OK_PREDICTS)
    reference = [predictor.predict(p)["probabilities"] for p in images]

    async def load():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/predict", content=images[i % 8].read_bytes(), headers=JPEG) for i in range(200))
            )

    answers = asyncio.run(load())
    assert [a.status_code for a in answers] == [200] * 200
    served = torch.tensor([_probs(a.json()["predictions"][0], predictor.classes) for a in answers])
    want = torch.tensor([[reference[i % 8][c] for c in predictor.classes] for i in range(200)])
    # In a batch of another size the convolutions may take another algorithm and sum in another order:
    # differences of a few float32 steps (1.9e-6 seen), against answers that differ by 0.1 between images.
    assert (served - want).abs().max().item() < 1e-5
    after = server.metric("visiontune_batch_size_count") - server.metric('visiontune_batch_size_bucket{le="1"}')
    assert after - before > 0  # some forward passes carried more than one request's image
    assert server.metric(OK_PREDICTS) - answered == 200  # each request counted once, by path and code


def _png_bomb(side: int = 50_000) -> bytes:
    """A valid PNG header declaring side x side pixels, with a few bytes of data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


@pytest.mark.slow
def test_hostile_input_gets_a_4xx_and_the_server_lives_on(server, images):
    jpeg = images[0].read_bytes()
    too_big = MAX_BODY_MB * 1024 * 1024 + 1

    def chunks():  # no Content-Length: the limit must be found while reading
        for _ in range(4):
            yield b"\xff" * (too_big // 2)

    MULTIPART = "multipart/form-data"
    cases = [
        ("not an image", dict(content=b"hello, world", headers=JPEG), 422, "not an image"),
        ("truncated", dict(content=jpeg[: len(jpeg) // 3], headers=JPEG), 422, "truncated"),
        ("bomb", dict(content=_png_bomb(), headers={"content-type": "image/png"}), 422, "too large"),
        ("declared too big", dict(content=b"\0" * too_big, headers=JPEG), 413, "limit"),
        ("chunked too big", dict(content=chunks(), headers=JPEG), 413, "limit"),
        ("empty", dict(content=b"", headers=JPEG), 400, "empty"),
        ("wrong type", dict(content=jpeg, headers={"content-type": "application/json"}), 415, "not an image"),
        ("no type", dict(content=jpeg), 415, "not an image"),
        ("no file", dict(files={"x": (None, b"y")}), 400, "no file"),
        ("broken multipart", dict(content=b"--x\r\n", headers={"content-type": MULTIPART}), 400, "multipart"),
        (
            "one bad file of two",
            dict(files=[("f", ("ok.jpg", jpeg, "image/jpeg")), ("f", ("bad.jpg", b"junk", "image/jpeg"))]),
            422,
            "bad.jpg: not an image",
        ),
        ("bad top_k", dict(params={"top_k": "0"}, content=jpeg, headers=JPEG), 400, "top_k"),
    ]
    for name, request, status, says in cases:
        try:
            answer = httpx.post(f"{server.url}/predict", timeout=30, **request)
        except httpx.TransportError as exc:  # only acceptable if the server closed a body it refused
            pytest.fail(f"{name}: {exc!r}")
        assert answer.status_code == status, (name, answer.text)
        error = answer.json()["error"]
        assert says in error and "Traceback" not in answer.text, (name, error)
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert httpx.post(f"{server.url}/predict", content=jpeg, headers=JPEG, timeout=TIMEOUT).status_code == 200
    log = server.log.read_text()
    assert "refused POST /predict" in log and "422 body: not an image" in log and "Traceback" not in log


OK_PREDICTS = 'visiontune_requests_total{path="/predict",code="200"}'


@pytest.mark.slow
def test_metadata_and_metrics_describe_the_model_and_count(server, trained_run, images):
    meta = httpx.get(f"{server.url}/metadata", timeout=TIMEOUT).json()
    described = json.loads((trained_run / "config.json").read_text())["model"]
    assert {k: meta[k] for k in described} == described
    assert meta["backend"] == "eager" and meta["max_batch"] == 32 and meta["run"] == str(trained_run)
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    assert "# TYPE visiontune_batch_size histogram" in text and "# TYPE visiontune_request_seconds histogram" in text
    # Counted from here (what the module's other tests sent before is theirs, whichever of them ran): two
    # answers, and two 413s (requests whose PNG headers declare more pixels than a request may hold).
    too_many = 'visiontune_errors_total{code="413"}'
    ok, refused = server.metric(OK_PREDICTS, default=0), server.metric(too_many, default=0)
    bombs = [("f", (f"{i}.png", _png_bomb(9400), "image/png")) for i in range(5)]
    for _ in range(2):
        answer = httpx.post(f"{server.url}/predict", content=images[0].read_bytes(), headers=JPEG, timeout=TIMEOUT)
        assert answer.status_code == 200
        assert httpx.post(f"{server.url}/predict", files=bombs, timeout=TIMEOUT).status_code == 413
    assert server.metric(OK_PREDICTS) - ok == 2 and server.metric(too_many) - refused == 2
    assert server.metric("visiontune_ready") == 1


def _port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.mark.slow
def test_a_png_that_kills_a_decode_process_is_a_422_and_the_server_goes_on(server, images):
    """The decode processes of this server skip the PNG check (UNGUARDED), so the PNG that crashes torchvision's
    decode_png kills the one that reads it: that request is answered 422, its process replaced, the server up."""
    from badfiles import short_png

    before = server.metric("visiontune_decoder_restarts_total")
    files = [("f", ("ok.jpg", images[0].read_bytes(), "image/jpeg")), ("f", ("crash.png", short_png(), "image/png"))]
    answer = httpx.post(f"{server.url}/predict", files=files, timeout=60)
    assert answer.status_code == 422 and answer.json() == {"error": "crash.png: the image decoder crashed on it"}
    assert server.metric("visiontune_decoder_restarts_total") == before + 1
    for _ in range(3):  # both decode slots work again, the new process among them
        files = [("f", (p.name, p.read_bytes(), "image/jpeg")) for p in images[:2]]
        assert httpx.post(f"{server.url}/predict", files=files, timeout=60).status_code == 200
    assert server.proc.poll() is None and httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert "a decode process died on crash.png: restarted" in server.log.read_text()


@pytest.mark.slow
def test_images_declaring_more_pixels_than_a_request_may_hold_are_refused_before_decoding(server):
    """Five 9400 x 9400 PNGs of a few hundred bytes each (88 Mpx, each under the per-image limit) declare 442 Mpx:
    413 from their headers, nothing decoded; one alone is admitted (and found short of data, or kills its
    decode process here, where the PNG check is off)."""
    bomb = _png_bomb(9400)
    files = [("f", (f"{i}.png", bomb, "image/png")) for i in range(5)]
    answer = httpx.post(f"{server.url}/predict", files=files, timeout=60)
    assert answer.status_code == 413, answer.text
    assert "441800000 pixels in all" in answer.json()["error"] and "--max-request-pixels" in answer.json()["error"]
    one = httpx.post(f"{server.url}/predict", content=bomb, headers={"content-type": "image/png"}, timeout=60)
    assert one.status_code == 422 and one.json()["error"].startswith("body: ")  # admitted and decoded


@pytest.mark.slow
def test_slow_heads_neither_keep_others_out_nor_stay_open(server):
    """300 connections that send half a request head and wait (slowloris): a normal request is answered at once
    (it was 503 while they stayed), and the server closes each of them after --header-timeout."""
    slow = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", _port(server)), timeout=120)
            s.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")
            slow.append(s)
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        assert all(s.recv(1024) == b"" for s in slow)  # each closed by the server: recv sees the end
    finally:
        for s in slow:
            s.close()


def _half_a_body(server: Server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", _port(server)), timeout=120)
    s.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 5000\r\n\r\n")
    s.sendall(b"\xff\xd8" * 100)
    return s


@pytest.mark.slow
def test_a_body_that_stops_coming_is_answered_408_after_body_timeout(server):
    with _half_a_body(server) as s:
        reply = b""
        while b"}" not in reply:
            chunk = s.recv(4096)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout" in reply


@pytest.mark.slow
def test_a_client_that_leaves_mid_body_is_a_counted_disconnect_not_a_500(server):
    before = server.metric("visiontune_client_disconnects_total")
    _half_a_body(server).close()
    deadline = time.monotonic() + 60
    while server.metric("visiontune_client_disconnects_total") == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    assert 'code="500"' not in text
    log = server.log.read_text()
    assert "ClientDisconnect" not in log and "Traceback" not in log and " left during POST /predict" in log


@pytest.mark.slow
def test_no_openapi_schema_and_control_characters_in_names_are_escaped_in_the_log(server):
    assert httpx.get(f"{server.url}/openapi.json", timeout=TIMEOUT).status_code == 404
    name = "evil\u202egpj.exe\x1b[2K"  # a right-to-left override, and the terminal code that erases a line
    answer = httpx.post(f"{server.url}/predict", files=[("f", (name, b"junk", "image/jpeg"))], timeout=TIMEOUT)
    assert answer.status_code == 422 and answer.json()["error"] == f"{name}: not an image"  # the answer keeps it
    lines = [line for line in server.log.read_text().splitlines() if "evil" in line]
    assert len(lines) == 1 and "evil\\u202egpj.exe\\x1b[2K: not an image" in lines[0], lines


def test_health_is_503_until_the_warm_up_forward_pass_has_run():
    import threading

    from fastapi.testclient import TestClient

    from visiontune.inference.runtime import Runtime
    from visiontune.inference.serve import ServeOptions, build_app
    from visiontune.runs.runinfo import describe
    from visiontune.settings.config import MEAN, STD

    release, calls = threading.Event(), []

    class Slow(Runtime):
        def warm_up(self, sizes=(1,)):
            release.wait(30)
            super().warm_up(sizes)

    def forward(x):
        calls.append(x.shape)
        return torch.zeros(len(x), 2)

    info = describe("resnet18", "torchvision", ["a", "b"], 8, MEAN, STD, "bilinear")
    app = build_app(Slow(info, None, "m.safetensors", "eager", torch.device("cpu"), forward), ServeOptions(decoders=0))
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "warming up"} and client.get("/health").status_code == 503
        assert client.post("/predict", content=b"x", headers={"content-type": "image/png"}).status_code == 503
        assert calls == []
        release.set()
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert calls == [(1, 3, 8, 8)]  # the warm-up pass came before ready


def test_a_multi_label_model_answers_a_sigmoid_per_class_and_the_labels_at_its_thresholds(tmp_path):
    """An untrained resnet18 saved as training saves a multi-label model, served in-process: each class's
    probability is the sigmoid of the plain torchvision model's logit on the textbook preprocessing, and the
    label set is the classes at or over their recorded thresholds (or ?threshold=T for every class)."""
    from dataclasses import replace

    import torchvision
    from fastapi.testclient import TestClient
    from torchvision.io import encode_png

    from trained import preprocess
    from visiontune.inference.runtime import Runtime, load_runtime
    from visiontune.inference.serve import ServeOptions, build_app
    from visiontune.runs import records
    from visiontune.runs.runinfo import describe, metadata_with_thresholds
    from visiontune.settings.config import MEAN, STD

    classes = ["cloud", "river", "road"]
    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(encode_png(torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=gen)).numpy())
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).eval()
    with torch.no_grad():
        want = torch.sigmoid(model(preprocess(paths, 16)).double())
    # Thresholds between the images' probabilities, so that the label sets differ from image to image.
    thresholds = want.median(0).values.tolist()
    info = describe("resnet18", "torchvision", classes, 16, MEAN, STD, "bilinear", None, MULTI_LABEL)
    metadata = metadata_with_thresholds(info.metadata(), thresholds)
    records.save_model(tmp_path, records.plain_state_dict(model), metadata=metadata)

    runtime = load_runtime(weights=str(tmp_path / "best.safetensors"))
    with TestClient(build_app(runtime, ServeOptions(decoders=0))) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        files = [("files", (p.name, p.read_bytes(), "image/png")) for p in paths]
        for query, used in (("", thresholds), ("?threshold=0.5", [0.5] * 3)):
            got = client.post(f"/predict{query}", files=files).json()
            assert got["thresholds"] == pytest.approx(used, abs=0)
            for row, answer in zip(want.tolist(), got["predictions"]):
                assert list(answer["probabilities"]) == classes
                assert list(answer["probabilities"].values()) == pytest.approx(row, abs=1e-6)
                assert answer["labels"] == [
                    c for c, p, t in zip(classes, answer["probabilities"].values(), used) if p >= t
                ]
        assert {tuple(a["labels"]) for a in client.post("/predict", files=files).json()["predictions"]} != {()}
        bad = client.post("/predict?threshold=1.5", files=files)
        assert bad.status_code == 400 and "threshold" in bad.json()["error"]
        assert client.get("/metadata").json()["task"] == "multilabel"
    # A single-label model has no threshold to set.
    single = Runtime(
        replace(info, task_name="classify", thresholds=None),
        None,
        "m",
        "eager",
        torch.device("cpu"),
        lambda x: x.mean((2, 3)),
    )
    with TestClient(build_app(single, ServeOptions(decoders=0))) as client:
        got = client.post(
            "/predict?threshold=0.5", content=paths[0].read_bytes(), headers={"content-type": "image/png"}
        )
        assert got.status_code == 400 and "multi-label" in got.json()["error"]


def test_without_the_serve_extra_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    assert main(["serve", "--run", "anything"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'visiontune[serve]'" in err


def test_an_onnx_file_is_fed_as_the_torch_model_and_describes_itself(images, tmp_path):
    """A small ONNX graph (mean colour -> 2 logits) built with onnx.helper, carrying a run's description as
    `visiontune export` writes it: the runtime reads the description and feeds the graph the same normalised
    batch as the same graph in torch. (test_export checks that exported files match their eager models.)"""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from visiontune.inference.runtime import Runtime, load_runtime
    from visiontune.runs.runinfo import describe
    from visiontune.settings.config import MEAN, STD

    info = describe("resnet18", "torchvision", ["cat", "dog"], 24, MEAN, STD, "bicubic", 0.875)
    weight = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25]])
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("MatMul", ["flat", "weight"], ["logits"]),
        ],
        "mean-colour",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 24, 24])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(weight.numpy(), "weight")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    for key, value in info.metadata().items():
        proto.metadata_props.add(key=key, value=value)
    path = tmp_path / "model.onnx"
    onnx.save(proto, str(path))

    served = load_runtime(weights=str(path))
    assert served.info == info and served.backend == "onnx" and served.describe()["weights"] == str(path)
    same = Runtime(info, None, str(path), "eager", torch.device("cpu"), lambda x: x.mean((2, 3)) @ weight)
    prepared = [served.prepare(p.read_bytes()) for p in images]
    assert prepared[0].shape == (3, 24, 24)  # the file's size, crop and interpolation
    assert torch.allclose(served.probabilities(prepared), same.probabilities(prepared), atol=1e-6, rtol=0)

    proto.ClearField("metadata_props")
    onnx.save(proto, str(path))
    with pytest.raises(visiontune.UserError, match="does not describe itself"):
        load_runtime(weights=str(path))


def test_a_multi_label_onnx_file_is_served_with_its_probabilities_and_thresholds(images, tmp_path):
    """A multi-label ONNX graph as `visiontune export` writes one (sigmoid probabilities out, thresholds in the
    metadata): served, each class's probability is the graph's own, and the label set is the classes at or
    over the file's thresholds."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from fastapi.testclient import TestClient
    from onnx import TensorProto, helper, numpy_helper

    from trained import preprocess
    from visiontune.inference.runtime import load_runtime
    from visiontune.inference.serve import ServeOptions, build_app
    from visiontune.runs.runinfo import describe, metadata_with_thresholds
    from visiontune.settings.config import MEAN, STD

    classes = ["cloud", "river", "road"]
    info = describe("resnet18", "torchvision", classes, 24, MEAN, STD, "bilinear", None, MULTI_LABEL)
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.5, 3.0, -1.0], [-1.5, 0.25, 2.0]])
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("MatMul", ["flat", "weight"], ["scores"]),
            helper.make_node("Sigmoid", ["scores"], ["logits"]),  # export's output name, sigmoid included
        ],
        "mean-colour",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 24, 24])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(weight.numpy(), "weight")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    # The probabilities of these images, computed here in torch from the same weights.
    want = torch.sigmoid(preprocess(images, 24, interpolation="bilinear").mean((2, 3)) @ weight).double()
    thresholds = want.median(0).values.tolist()  # between the images', so the label sets differ
    for key, value in metadata_with_thresholds(info.metadata(), thresholds).items():
        proto.metadata_props.add(key=key, value=value)
    path = tmp_path / "model.onnx"
    onnx.save(proto, str(path))

    served = load_runtime(weights=str(path))
    assert (
        served.backend == "onnx"
        and served.info.task_name == "multilabel"
        and served.info.decision_thresholds == pytest.approx(thresholds)
    )
    with TestClient(build_app(served, ServeOptions(decoders=0))) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        files = [("files", (p.name, p.read_bytes(), "image/jpeg")) for p in images]
        got = client.post("/predict", files=files).json()
    assert got["thresholds"] == pytest.approx(thresholds, abs=0)
    for row, answer in zip(want.tolist(), got["predictions"]):
        assert list(answer["probabilities"]) == classes
        assert list(answer["probabilities"].values()) == pytest.approx(row, abs=1e-5)
        assert answer["labels"] == [
            c for c, p, t in zip(classes, answer["probabilities"].values(), thresholds) if p >= t
        ]
    assert len({tuple(a["labels"]) for a in got["predictions"]}) > 1


@pytest.mark.slow
def test_sigterm_answers_the_request_in_flight_refuses_new_ones_and_exits_0(server, images):
    """Last in the module: it ends the server."""
    jpeg = images[0].read_bytes()
    slow = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=60)
    head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
    slow.sendall(head.encode() + jpeg[:100])  # in flight: the rest of its body comes after the signal
    deadline = time.monotonic() + 30
    while server.metric("visiontune_requests_in_flight") < 2:  # it, and this /metrics request
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(server.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30  # a harness limit: the signal is handled when the server next runs
    while httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code != 503:
        assert time.monotonic() < deadline and server.proc.poll() is None
        time.sleep(0.02)
    refused = httpx.post(f"{server.url}/predict", content=jpeg, headers=JPEG, timeout=TIMEOUT)
    assert refused.status_code == 503 and refused.json() == {"error": "shutting down"}
    slow.sendall(jpeg[100:])
    reply = b""
    while b"}]}" not in reply:
        chunk = slow.recv(65536)
        assert chunk, reply
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["predictions"][0]["file"] == "body"
    assert server.proc.wait(timeout=60) == 0


def test_a_request_that_would_pass_the_pixels_in_flight_gets_503_until_the_others_are_decoded(monkeypatch):
    """In process, decoding in threads: while one request's 16 x 16 image (256 px) is held in its decode, another
    one's would take the pixels in flight past 300: 503 with Retry-After; once the first is answered, it passes."""
    import threading

    from fastapi.testclient import TestClient
    from torchvision.io import encode_png

    from visiontune.inference import decodepool
    from visiontune.inference.runtime import Runtime
    from visiontune.inference.serve import ServeOptions, build_app
    from visiontune.runs.runinfo import describe
    from visiontune.settings.config import MEAN, STD

    entered, release, real = threading.Event(), threading.Event(), decodepool.prepare

    def held(*args):
        entered.set()
        assert release.wait(60)
        return real(*args)

    monkeypatch.setattr(decodepool, "prepare", held)
    info = describe("resnet18", "torchvision", ["a", "b"], 8, MEAN, STD, "bilinear")
    runtime = Runtime(info, None, "m", "eager", torch.device("cpu"), lambda x: x.mean((2, 3))[:, :2])
    png = encode_png(torch.zeros(3, 16, 16, dtype=torch.uint8)).numpy().tobytes()
    options = ServeOptions(decoders=0, max_request_pixels=300, max_pixels_in_flight=300)
    with TestClient(build_app(runtime, options)) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        post = lambda: client.post("/predict", content=png, headers={"content-type": "image/png"})  # noqa: E731
        first: list = []
        thread = threading.Thread(target=lambda: first.append(post()))
        thread.start()
        assert entered.wait(60)
        assert "visiontune_pixels_in_flight 256" in client.get("/metrics").text
        busy = post()
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "256 pixels are being decoded" in busy.json()["error"]
        release.set()
        thread.join(60)
        assert first[0].status_code == 200 and post().status_code == 200
