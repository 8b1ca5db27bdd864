"""Fuzz: whatever body is posted to ``/predict`` (multipart with any boundary, part headers, file names and
lengths; a Content-Length that lies), serve answers 4xx or a valid answer, never a 500. In-process: the
FastAPI app behind its gate through Starlette's TestClient, a stand-in model, no network.
The fuzz tier's rules are in tests/fuzzing.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from fuzzing import fuzz_settings

pytest.importorskip("fastapi")  # the serve extra
pytest.importorskip("python_multipart")

CLASSES = ["cat", "dog"]
LIMIT_MB = 0.25  # --max-body-mb: a small one, so huge bodies are within reach of the fuzz


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from visiontune.inference.runtime import Runtime
    from visiontune.inference.serve import ServeOptions, build_app
    from visiontune.runs.runinfo import describe
    from visiontune.settings.config import MEAN, STD

    info = describe("resnet18", "torchvision", CLASSES, 8, MEAN, STD, "bilinear")
    runtime = Runtime(info, None, "m.safetensors", "eager", torch.device("cpu"), lambda x: x.mean((2, 3))[:, :2])
    gate = build_app(runtime, ServeOptions(max_body_mb=LIMIT_MB))
    gate.state.warm_up()  # ready before the lifespan's own warm-up thread: nothing to wait for
    # Entered, so that every request runs on one event loop, as under uvicorn (the decode pool's queue belongs
    # to the loop it was made on; a client per request would bring a new loop each time).
    with TestClient(gate) as client:
        yield client  # an exception the app does not answer is raised here: the test fails on it


def _png() -> bytes:
    from torchvision.io import encode_png

    return encode_png(torch.arange(3 * 6 * 6, dtype=torch.uint8).reshape(3, 6, 6)).numpy().tobytes()


PNG = _png()
ODD = ["", "../../etc/passwd", 'a"b.png', "a\\b.png", "\x00.png", "\u202eevil.png", "é.png", "x" * 5000, "a\r\nb"]
NAME = st.sampled_from(ODD) | st.text(max_size=20)
CONTENT = st.sampled_from([PNG, b"", PNG[:40], b"\x89PNG\r\n\x1a\n"]) | st.binary(max_size=64)
BOUNDARY = st.sampled_from(["b", "----WebKitFormBoundary7MA4YWxkTrZu0gW", "x" * 71, "a b", "é", ""]) | st.text(
    alphabet="abc-_'()+,./:=? ", min_size=1, max_size=20
)
PART_HEADER = st.sampled_from(
    [
        'Content-Disposition: form-data; name="files"; filename="{name}"',
        "Content-Disposition: form-data; name=files; filename={name}",
        "Content-Disposition: form-data; name=\"files\"; filename*=UTF-8''{name}",
        'Content-Disposition: form-data; name="{name}"',
        'Content-Disposition: attachment; filename="{name}"',
        "Content-Disposition: form-data",
        "Content-Type: image/png",
        "Content-Length: 99999999999999999999",
        "Content-Length: 0",
        "Content-Transfer-Encoding: base64",
        "{name}",
    ]
)


FILE_PART = 'Content-Disposition: form-data; name="files"; filename="{name}"\r\nContent-Type: image/png'


@st.composite
def requests(draw) -> tuple[bytes, dict[str, bytes]]:
    # Half the bodies are well formed but for the file names and contents (answers 200 and 422 within reach),
    # the other half odd anywhere: boundary, part headers, closing, cuts, type and length headers.
    odd = draw(st.booleans())
    boundary = draw(BOUNDARY) if odd else "b0undary"
    b = boundary.encode("utf-8", "surrogatepass")
    body = draw(st.sampled_from([b"", b"preamble\r\n"])) if odd else b""
    for _ in range(draw(st.integers(0, 4) if odd else st.integers(1, 2))):
        name = draw(NAME)
        headers = draw(st.lists(PART_HEADER, max_size=3)) if odd else [FILE_PART]
        head = "\r\n".join(h.format(name=name) for h in headers).encode("utf-8", "surrogatepass")
        content = PNG if not odd and draw(st.booleans()) else draw(CONTENT)
        body += b"--" + b + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n"
    ends = [b"--" + b + b"--\r\n", b"--" + b, b"", b"--" + b + b"--"]
    body += draw(st.sampled_from(ends)) if odd else ends[0]
    if odd and draw(st.booleans()):  # a cut, or bytes spliced in anywhere
        at = draw(st.integers(0, len(body)))
        body = body[:at] + (draw(st.binary(max_size=16)) if draw(st.booleans()) else b"")
    kinds = [
        f"multipart/form-data; boundary={boundary}",
        f'multipart/form-data; boundary="{boundary}"',
        "multipart/form-data",
        f"multipart/form-data; boundary={boundary}; boundary=other",
        f"Multipart/Form-Data; charset=latin-1; boundary={boundary}",
    ]
    headers = {"content-type": (draw(st.sampled_from(kinds)) if odd else kinds[0]).encode()}  # bytes: any octets
    lengths = [None, "0", "1", str(len(body) + 1), "99999999999999999999", "-1", "12abc"]
    length = draw(st.sampled_from(lengths)) if odd else None
    if length is not None:
        headers["content-length"] = length.encode()
    if odd and draw(st.integers(0, 7)) == 0 and len(body) < 4096:  # over --max-body-mb, however it is sent
        body += b"\0" * int(LIMIT_MB * 2**20)
    return body, headers


def assert_answer(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert isinstance(response.json()["error"], str)
        return
    predictions = response.json()["predictions"]
    assert predictions and all(p["label"] in CLASSES and 0 <= p["score"] <= 1 for p in predictions)


@pytest.mark.slow  # a request through the app per example: a few seconds
@fuzz_settings(150)
@given(requests())
def test_any_multipart_body_gets_a_4xx_or_an_answer(client, sent):
    body, headers = sent
    response = client.post("/predict", content=body, headers=headers)
    event(f"HTTP {response.status_code}")  # --hypothesis-show-statistics: how often each answer came
    assert_answer(response)
