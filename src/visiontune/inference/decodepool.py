"""Uploads decoded where a crashing decoder cannot take the server down: a few supervised processes.

``serve`` hands every upload's bytes to a ``DecodePool`` of ``n`` slots. Each slot is a
one-process ``ProcessPoolExecutor`` started by a forkserver (a clean interpreter that imports
visiontune's decode once), and runs one image at a time, so a process that dies -- a native
decoder's SIGSEGV on bytes no check foresaw -- fails that one image alone: its slot gets a new
process and the image is answered as unreadable (``CRASHED``) while the server goes on. It is
also a memory bound: at most ``n`` images are decoded at full size at once, whatever the number
of requests. What comes back is the resized uint8 image as a numpy array (a few KB). ``n == 0``
decodes in this process's thread pool instead, without that isolation.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

CRASHED = "the image decoder crashed on it"


def _init() -> None:
    import torch

    torch.set_num_threads(1)  # one image per process: its cores are the other slots'


def prepare(data: bytes, size: int, interpolation: str, crop_pct: float | None, decode: str):
    """``decode.try_read`` in a decode process: the image as a numpy uint8 [3, S, S], or why it is unreadable."""
    from visiontune.data.decode import try_read

    out = try_read(data, size, interpolation, crop_pct, decode)
    return out if isinstance(out, str) else out.numpy()


def pixels(data: bytes) -> int | None:
    """The pixel count an image's header declares, read by PIL without decoding it (formats other than
    JPEG and PNG, whose headers ``serve`` walks itself); None when PIL cannot open it."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.width * im.height
    except Exception:  # noqa: BLE001 - not an image: the decode says why
        return None


class DecodePool:
    def __init__(self, n: int, on_restart: Callable[[], None] = lambda: None):
        self.n, self.on_restart = max(0, n), on_restart
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["visiontune.data.decode"])
        self._slots = [self._executor() for _ in range(self.n)]
        self._free: asyncio.Queue = asyncio.Queue()
        for i in range(self.n):
            self._free.put_nowait(i)

    def _executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=self._context, initializer=_init)

    def warm_up(self) -> None:
        """Start every process (the forkserver first) before the server says it is ready."""
        try:
            for slot in self._slots:
                slot.submit(pixels, b"").result()
        except RuntimeError:  # stopped meanwhile: the server is ending before it was ready
            pass

    async def run(self, fn: Callable, *args):
        """``fn(*args)`` in a free slot; None when its process died on it (the slot has a new one)."""
        if not self.n:
            from starlette.concurrency import run_in_threadpool

            return await run_in_threadpool(fn, *args)
        i = await self._free.get()
        try:
            return await asyncio.wrap_future(self._slots[i].submit(fn, *args))
        except BrokenProcessPool:
            self._slots[i].shutdown(wait=False)
            self._slots[i] = self._executor()
            self.on_restart()
            return None
        finally:
            self._free.put_nowait(i)

    def stop(self) -> None:
        for slot in self._slots:
            slot.shutdown(wait=False, cancel_futures=True)
