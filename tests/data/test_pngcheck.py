"""visiontune.data.pngcheck: every PNG that makes libpng fail while torchvision reads its rows (a SIGSEGV in
torchvision 0.29) is refused with a reason, and every PNG libpng reads cleanly passes.

The refused files are never handed to torchvision here: that would kill the test process. The subprocess
tests in tests/cli/test_hostile_inputs.py run the commands on one of them.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from badfiles import PNG_MAGIC, natural_ish, png_chunk, short_png
from visiontune.data import pngcheck
from visiontune.data.decode import decode_bytes

GREY_10 = struct.pack(">IIBBBBB", 10, 10, 8, 0, 0, 0, 0)
ROWS = b"".join(b"\0" + b"\x80" * 10 for _ in range(10))  # 10 rows: filter byte 0, then 10 pixels


def _png(*chunks: bytes, header: bytes = GREY_10) -> bytes:
    return PNG_MAGIC + png_chunk(b"IHDR", header) + b"".join(chunks) + png_chunk(b"IEND", b"")


def _idat(data: bytes, crc: int | None = None) -> bytes:
    return png_chunk(b"IDAT", data, crc)


def _unended(data: bytes) -> bytes:
    """A zlib stream of ``data`` flushed but never finished: no last block, no Adler-32."""
    z = zlib.compressobj()
    return z.compress(data) + z.flush(zlib.Z_SYNC_FLUSH)


FULL = zlib.compress(ROWS)
NOISY = b"".join(b"\0" + bytes(np.random.default_rng(i).integers(0, 256, 10, dtype=np.uint8)) for i in range(10))
INTERLACED = struct.pack(">IIBBBBB", 10, 10, 8, 0, 0, 0, 1)

# Each of these made torchvision 0.29's decode_image die with SIGSEGV (the libpng message in the comment).
CRASHING = {
    "short rows": (short_png(), "truncated PNG (image data for 55 of 110 bytes)"),  # Not enough image data
    "no rows": (_png(_idat(zlib.compress(b""))), "truncated PNG (image data for 0 of 110 bytes)"),
    "idat crc": (_png(_idat(FULL, crc=0)), "CRC error in a IDAT chunk"),  # IDAT: CRC error
    "bad filter": (_png(_idat(zlib.compress(ROWS.replace(b"\0", b"\7", 1)))), "unknown filter type"),
    "bad filter in a later row": (
        _png(_idat(zlib.compress(ROWS[:55] + b"\5" + ROWS[56:]))),
        "unknown filter type",
    ),  # bad adaptive filter value
    "interlaced, short": (  # the passes' rows read as other bytes: bad adaptive filter value
        _png(_idat(zlib.compress(ROWS[:55])), header=INTERLACED),
        "corrupt PNG",
    ),
    "bad deflate block": (_png(_idat(b"\x78\x9c" + b"\xff" * 30)), "invalid block type"),
    "bad adler-32": (_png(_idat(FULL[:-4] + b"\0\0\0\0")), "incorrect data check"),  # IDAT: incorrect data check
    "window over 32 KB": (_png(_idat(b"\x88\x1c" + FULL[2:])), "invalid window size"),
    "preset dictionary": (_png(_idat(b"\x78\xbb\0\0\0\1" + FULL[2:])), "preset dictionary"),  # missing LZ dictionary
    "no end of stream": (_png(_idat(_unended(ROWS))), "does not end"),
    "rows split by a bad chunk name": (
        _png(_idat(zlib.compress(NOISY)[:20]), png_chunk(b"zz1z", b"x"), _idat(zlib.compress(NOISY)[20:])),
        "PNG",
    ),  # zzzz: bad header (invalid type)
}


@pytest.mark.parametrize("name", CRASHING)
def test_each_png_that_crashes_torchvision_is_refused_with_its_reason(name):
    data, reason = CRASHING[name]
    assert reason in pngcheck.problem(data)


def test_the_69_byte_png_of_the_report_is_refused():
    data = short_png()
    assert len(data) < 80 and pngcheck.problem(data).startswith("truncated PNG")


CLEAN = {
    "plain": _png(_idat(FULL)),
    "rows over several IDAT chunks, one empty": _png(_idat(FULL[:7]), _idat(b""), _idat(FULL[7:])),
    "more data than the rows take": _png(_idat(zlib.compress(ROWS + b"\0" * 50))),
    "no IEND": PNG_MAGIC + png_chunk(b"IHDR", GREY_10) + _idat(FULL),
    "a broken chunk after the rows": _png(_idat(FULL), png_chunk(b"tEXt", b"a\0b", crc=0)),
    "garbage after the rows": _png(_idat(FULL)) + b"\xff" * 7,
}


@pytest.mark.parametrize("name", CLEAN)
def test_pngs_libpng_reads_cleanly_pass(name):
    data = CLEAN[name]
    assert pngcheck.problem(data) is None
    assert decode_bytes(data).shape == (3, 10, 10)


@pytest.mark.parametrize(
    "mode, interlace",
    [(m, i) for m in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16") for i in (False, True)],
)
def test_every_mode_and_interlacing_pil_writes_passes_and_decodes_as_pil_reads_it(mode, interlace):
    rgb = Image.fromarray(natural_ish(13, 11))
    im = rgb.convert(mode) if mode != "I;16" else Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257)
    buf = io.BytesIO()
    im.save(buf, "PNG", **({"interlace": 1} if interlace else {}))
    assert pngcheck.problem(buf.getvalue()) is None
    want = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")) if mode != "I;16" else None
    got = decode_bytes(buf.getvalue())
    if want is not None:
        assert torch.equal(got, torch.from_numpy(want.copy()).permute(2, 0, 1))


def test_the_inflated_rows_are_bounded_by_the_header(monkeypatch):
    """A small file whose image data inflates to far more than its header's rows is read no further than
    one byte past them (a bound on the check's work and memory)."""
    big = zlib.compress(ROWS + b"\0" * 5_000_000)  # 5 KB that inflate to 5 MB
    calls = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self):
            self.inner = real()

        def decompress(self, data, max_length=0):
            out = self.inner.decompress(data, max_length)
            calls.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(pngcheck.zlib, "decompressobj", Counting)
    assert pngcheck.problem(_png(_idat(big))) is None
    assert sum(calls) == len(ROWS) + 1
