"""The server's counters, written in the Prometheus text exposition format (version 0.0.4) for ``GET /metrics``.

The families a dashboard needs: requests by path and status code, errors
(answers of 400 and above) by code, images predicted, the batch sizes the
batcher ran, the time of each forward pass and the request latency (the last
three as cumulative histograms), the requests in flight and whether the model
is ready. They are per process: with ``--workers N`` each worker counts its
own. The format is a few lines of text, so no client library is needed for it.
"""

from __future__ import annotations

import threading
from collections import Counter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PREFIX = "visiontune_"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def samples(self) -> list[str]:
        """The sample lines after the family's name: cumulative buckets, then the sum and the count."""
        out, running = [], 0
        for upper, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'_bucket{{le="{upper:g}"}} {running}')
        return [*out, f'_bucket{{le="+Inf"}} {self.count}', f"_sum {self.sum:.6g}", f"_count {self.count}"]


def batch_buckets(max_batch: int) -> tuple[float, ...]:
    """1, 2, 4, ... up to ``max_batch`` (included)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


class Metrics:
    """Thread-safe: the event loop counts requests, the batcher's thread counts batches."""

    def __init__(self, max_batch: int):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (path, code) -> answers
        self.images = 0
        self.batch_size = Histogram(batch_buckets(max_batch))
        self.batch_seconds = Histogram(LATENCY_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.disconnects = self.restarts = 0

    def disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def decoder_restart(self) -> None:
        with self._lock:
            self.restarts += 1

    def request(self, path: str, code: int, seconds: float) -> None:
        with self._lock:
            self.requests[path, code] += 1
            self.latency.observe(seconds)

    def batch(self, size: int, seconds: float) -> None:
        with self._lock:
            self.images += size
            self.batch_size.observe(size)
            self.batch_seconds.observe(seconds)

    def text(self, in_flight: int, ready: bool, pixels_in_flight: int = 0) -> str:
        with self._lock:
            errors: Counter = Counter()
            for (_, code), n in self.requests.items():
                if code >= 400:
                    errors[code] += n
            families = [
                ("requests_total", "counter", "Requests answered, by path and status code.",
                 [f'{{path="{path}",code="{code}"}} {n}' for (path, code), n in sorted(self.requests.items())]),
                ("errors_total", "counter", "Answers with a status of 400 or more, by code.",
                 [f'{{code="{code}"}} {n}' for code, n in sorted(errors.items())]),
                ("images_total", "counter", "Images predicted.", [f" {self.images}"]),
                ("batch_size", "histogram", "Images per forward pass.", self.batch_size.samples()),
                ("batch_seconds", "histogram", "Time of one forward pass.", self.batch_seconds.samples()),
                ("request_seconds", "histogram", "Time from request to answer.", self.latency.samples()),
                ("client_disconnects_total", "counter", "Requests whose client left before the answer.",
                 [f" {self.disconnects}"]),
                ("decoder_restarts_total", "counter", "Decode processes that died on an image and were replaced.",
                 [f" {self.restarts}"]),
                ("requests_in_flight", "gauge", "Requests being answered now.", [f" {in_flight}"]),
                ("pixels_in_flight", "gauge", "Declared pixels of the images being decoded now.",
                 [f" {pixels_in_flight}"]),
                ("ready", "gauge", "1 once the model is loaded and warmed up.", [f" {int(ready)}"]),
            ]  # fmt: skip
        lines = []
        for name, kind, help_text, samples in families:
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
            lines += [f"{PREFIX}{name}{sample}" for sample in samples]
        return "\n".join(lines) + "\n"
