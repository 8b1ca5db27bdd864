"""Dynamic batching: images from requests that arrive close together share one forward pass.

``Batcher`` owns one thread and a queue. The thread takes the first waiting
image, then waits at most ``max_wait`` seconds for more, up to ``max_batch``,
and runs them through ``run`` as one batch; each image's row of the answer goes
back through its own ``concurrent.futures.Future`` (a request awaits them with
``asyncio.wrap_future``). While a batch runs, newcomers queue, so under load
the next batch fills without waiting; an idle server answers a lone request
after ``max_wait``. The model is only ever called from this thread, one batch
at a time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

_STOP = object()


class Batcher:
    def __init__(
        self,
        run: Callable[[list[torch.Tensor]], torch.Tensor],
        max_batch: int,
        max_wait: float,
        on_batch: Callable[[int, float], None] = lambda size, seconds: None,
    ):
        """``run`` maps a list of images to a tensor with one row per image; ``on_batch`` hears each
        batch's size and how long ``run`` took."""
        self.run, self.max_batch, self.max_wait, self.on_batch = run, max_batch, max_wait, on_batch
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="visiontune-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Answer what is queued, then end the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def submit(self, images: Sequence[torch.Tensor]) -> list[Future]:
        """One future per image, resolved with its row of ``run``'s answer (or ``run``'s exception)."""
        futures = []
        for image in images:
            future: Future = Future()
            self._queue.put((image, future))
            futures.append(future)
        return futures

    def _gather(self, first) -> tuple[list, bool]:
        """``first`` and what arrives within ``max_wait`` of it, up to ``max_batch``; and whether to stop after."""
        items, deadline = [first], time.monotonic() + self.max_wait
        while len(items) < self.max_batch:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is _STOP:
                return items, True
            items.append(item)
        return items, False

    def _loop(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                break
            items, stop = self._gather(first)
            start = time.perf_counter()
            try:
                rows = self.run([image for image, _ in items])
            except Exception as exc:  # every waiting request hears it; the thread lives on
                for _, future in items:
                    future.set_exception(exc)
                continue
            self.on_batch(len(items), time.perf_counter() - start)
            for row, (_, future) in zip(rows, items):
                future.set_result(row)
