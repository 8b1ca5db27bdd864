"""``visiontune serve`` under a bounded local load: dynamic batching against ``--max-batch 1``, ONNX Runtime
against torch eager.

The model is resnet18 at 224 px with two classes and untrained weights (the
time of a forward pass does not depend on the values), written as a
self-describing ``.safetensors`` file and exported to ONNX with visiontune's
own exporter. One server per configuration listens on 127.0.0.1, all started
before any is measured; they are then loaded in turn, round after round
(``common.interleave``'s rule: a machine that gets busier affects each alike),
each round ``VT_SERVE_REQUESTS / VT_SERVE_ROUNDS`` requests from
``VT_SERVE_CLIENTS`` clients, each client a keep-alive connection that posts
one JPEG (the synthetic set's 300-500 px images, in turn) as soon as its last
answer came. The client is a few lines of asyncio on raw sockets, to take as
little of the CPU the server needs as it can. Figures: requests per second
(the median round) and the latency percentiles over every request.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import RESULTS, WORK, image_paths, python_env, sample_data, write_result

REQUESTS = int(os.environ.get("VT_SERVE_REQUESTS", "2000"))  # per configuration, over all rounds
ROUNDS = int(os.environ.get("VT_SERVE_ROUNDS", "2"))
CLIENTS = int(os.environ.get("VT_SERVE_CLIENTS", "32"))
SIZE = int(os.environ.get("VT_SERVE_SIZE", "224"))
THREADS = len(os.sched_getaffinity(0))
CONFIGS = {  # name -> (model file suffix, extra flags)
    "eager, batches up to 32": (".safetensors", ["--max-batch", "32"]),
    "eager, --max-batch 1": (".safetensors", ["--max-batch", "1"]),
    "onnx, batches up to 32": (".onnx", ["--max-batch", "32"]),
}


def model_files(folder: Path) -> dict[str, Path]:
    from visiontune.inference.export import export
    from visiontune.models.build import build_model, input_view
    from visiontune.runs.runinfo import describe
    from visiontune.settings.config import MEAN, STD

    folder.mkdir(parents=True, exist_ok=True)
    files = {s: folder / f"resnet18-{SIZE}{s}" for s in (".safetensors", ".onnx")}
    if not all(p.exists() for p in files.values()):
        torch.manual_seed(0)
        model = build_model("resnet18", 2, "none").eval()
        info = describe("resnet18", "torchvision", ["cat", "dog"], SIZE, MEAN, STD, *input_view("resnet18"))
        save_file(model.state_dict(), str(files[".safetensors"]), metadata=info.metadata())
        export(model, info, "onnx", str(files[".onnx"]))
    return files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(weights: Path, flags: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    argv = [sys.executable, "-m", "visiontune", "serve", "--weights", str(weights), "--port", str(port)]
    argv += ["--threads", str(THREADS), "--no-access-log", *flags]
    proc = subprocess.Popen(argv, env=python_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, port


def wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        try:
            status, _ = asyncio.run(_one_get(port, "/health"))
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready: {log.read_text()[-2000:]}")


async def _one_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    answer = await _response(reader)
    writer.close()
    return answer


def mean_batch(port: int) -> float:
    """Images per forward pass over the server's life (warm-up included), from its /metrics."""
    _, text = asyncio.run(_one_get(port, "/metrics"))
    values = dict(line.rsplit(" ", 1) for line in text.decode().splitlines() if not line.startswith("#"))
    return float(values["visiontune_batch_size_sum"]) / float(values["visiontune_batch_size_count"])


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length")
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def load(port: int, bodies: list[bytes], requests: int) -> tuple[float, list[float]]:
    """(seconds, latency of each request) of ``requests`` posts from ``CLIENTS`` keep-alive connections."""
    latencies: list[float] = []
    counter = iter(range(requests))

    async def client():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in counter:
            body = bodies[i % len(bodies)]
            head = f"POST /predict HTTP/1.1\r\nHost: bench\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}"
            start = time.perf_counter()
            writer.write(head.encode() + b"\r\n\r\n" + body)
            status, answer = await _response(reader)
            latencies.append(time.perf_counter() - start)
            if status != 200:
                raise SystemExit(f"answer {status}: {answer[:200]!r}")
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return time.perf_counter() - start, latencies


def forward_cost(rounds: int = 3) -> dict[str, float]:
    """CPU milliseconds per image of the bare forward pass at batch 1, 8 and 32, one thread, in this process:
    what batching can save on the model itself (interleaved rounds, medians)."""
    from visiontune.models.build import build_model

    torch.set_num_threads(1)
    model = build_model("resnet18", 2, "none").eval()
    batches = {n: torch.randn(n, 3, SIZE, SIZE) for n in (1, 8, 32)}
    samples: dict[int, list[float]] = {n: [] for n in batches}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for n, x in batches.items():
                repeats = max(1, 32 // n)
                start = time.process_time()
                for _ in range(repeats):
                    model(x)
                if r:  # the first round warms up
                    samples[n].append(1000 * (time.process_time() - start) / (repeats * n))
    return {f"batch {n}": round(statistics.median(v), 1) for n, v in samples.items()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    if "--forward-only" in sys.argv:  # add the forward pass's cost to an existing result
        path = RESULTS / ("serve.json" if SIZE == 224 else f"serve-{SIZE}px.json")
        result = json.loads(path.read_text())
        result["forward_cpu_ms_per_image_one_thread"] = forward_cost()
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(result["forward_cpu_ms_per_image_one_thread"])
        return
    files = model_files(WORK / "serve-models")
    bodies = [Path(p).read_bytes() for p in image_paths(sample_data(32))]
    servers = {}
    for name, (suffix, flags) in CONFIGS.items():
        log = WORK / f"serve-{len(servers)}.log"
        servers[name] = (*start(files[suffix], flags, log), log)
    try:
        for proc, port, log in servers.values():
            wait_ready(proc, port, log)
        per_round = REQUESTS // ROUNDS
        rates: dict[str, list[float]] = {name: [] for name in servers}
        latencies: dict[str, list[float]] = {name: [] for name in servers}
        for _, port, _ in servers.values():  # warm-up round, not counted
            asyncio.run(load(port, bodies, 2 * CLIENTS))
        for r in range(ROUNDS):
            for name, (_, port, _) in servers.items():
                seconds, lat = asyncio.run(load(port, bodies, per_round))
                rates[name].append(per_round / seconds)
                latencies[name] += lat
                print(f"round {r}: {name}: {per_round / seconds:.1f} requests/s", flush=True)
        batches = {name: round(mean_batch(port), 2) for name, (_, port, _) in servers.items()}
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
        codes = [proc.wait(timeout=120) for proc, _, _ in servers.values()]
    rows = {
        name: {
            "requests_per_s": round(statistics.median(rates[name]), 2),
            "rounds": [round(x, 2) for x in rates[name]],
            "p50_ms": round(1000 * percentile(latencies[name], 0.50), 1),
            "p99_ms": round(1000 * percentile(latencies[name], 0.99), 1),
            "requests": len(latencies[name]),
            "mean_batch": batches[name],
        }
        for name in servers
    }
    batched, single, onnx = (rows[n]["requests_per_s"] for n in CONFIGS)
    result = {
        "model": f"resnet18 at {SIZE} px, 2 classes, untrained weights",
        "clients": CLIENTS,
        "threads_per_server": THREADS,
        "max_wait_ms": 5,
        "exit_codes_after_sigterm": codes,
        "rows": rows,
        "batching_speedup": round(batched / single, 2),
        "onnx_against_eager": round(onnx / batched, 2),
        "forward_cpu_ms_per_image_one_thread": forward_cost(),
    }
    print(result)
    write_result("serve" if SIZE == 224 else f"serve-{SIZE}px", result)


if __name__ == "__main__":
    main()
