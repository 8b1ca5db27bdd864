"""What libpng would stop on while it reads the rows, checked before torchvision hands it a PNG.

torchvision 0.29's ``decode_png`` survives libpng's errors in the header (they come back as a
RuntimeError), but one raised while the rows are read kills the process with SIGSEGV: "Not
enough image data" (an IDAT stream shorter than the header promises), a CRC error in an IDAT
chunk, a bad chunk name where more image data should be, a zlib error (bad block, bad window
size, a preset dictionary, a wrong Adler-32), a row filter type above 4. ``problem`` looks for
exactly those, as libpng would meet them: it walks the chunks up to the end of the first run of
IDAT chunks (whole, named with letters, CRC right), inflates that run's data with zlib (the
inflater libpng uses, with its 32 KB window) into at most one byte more than the rows need,
discarding it piece by piece, and checks the filter byte of every row of every pass. A stream
that ends early, fails to inflate, or does not end with its checksum is refused, so libpng only
ever gets a PNG whose rows it can read without an error. It costs about one more inflate of the
image data (about 70% of a decode; docs/data.md); libjpeg needs no such check (its errors come back as
exceptions in torchvision, tested on truncated, corrupt and mutated files).
"""

from __future__ import annotations

import zlib

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
# Adam7's passes: (first column, first row, column step, row step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_PIECE = 1 << 16  # compressed bytes fed, and inflated bytes looked at then dropped, at a time
_FILTERS = bytes(range(5))  # none, sub, up, average, paeth


def _passes(width: int, height: int, interlace: int) -> list[tuple[int, int]]:
    """(rows, pixels per row) of each pass that has any (one pass without interlacing)."""
    if not interlace:
        return [(height, width)]
    out = []
    for x0, y0, dx, dy in _ADAM7:
        w, h = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        if w > 0 and h > 0:
            out.append((h, w))
    return out


def _chunks(data: bytes):
    """(type, payload start, payload end) of each chunk after the signature, or a reason string (last)."""
    pos = 8
    while pos < len(data):
        if pos + 8 > len(data):
            yield "truncated PNG (a chunk header is cut off)"
            return
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        if length > 0x7FFFFFFF or not kind.isalpha():
            yield "corrupt PNG (a chunk with a bad length or name)"
            return
        end = pos + 8 + length
        if end + 4 > len(data):
            yield "truncated PNG"
            return
        if zlib.crc32(memoryview(data)[pos + 4 : end]) != int.from_bytes(data[end : end + 4], "big"):
            yield f"corrupt PNG (CRC error in a {kind.decode()} chunk)"
            return
        yield kind, pos + 8, end
        pos = end + 4
    yield "truncated PNG (no image data)"


def problem(data: bytes) -> str | None:
    """Why libpng could not read ``data``'s rows without an error (a reason for ``BadImage``), or None."""
    if not data.startswith(_PNG_MAGIC):
        return "not a PNG"
    header, idat = None, []
    for chunk in _chunks(data):
        if isinstance(chunk, str):
            if idat:  # chunks after the image data are never read: a fault there does not matter
                break
            return chunk
        kind, start, end = chunk
        if header is None:
            if kind != b"IHDR" or end - start != 13:
                return "corrupt PNG (it does not start with its header)"
            header = data[start:end]
        elif kind == b"IDAT":
            idat.append(memoryview(data)[start:end])
        elif idat:  # the first run of IDAT chunks is over: libpng needs its rows from that run
            break
    if not idat:
        return "corrupt PNG (no image data)"

    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, colour, compression, filtering, interlace = header[8:13]
    if not (0 < width <= 0x7FFFFFFF and 0 < height <= 0x7FFFFFFF) or depth not in _DEPTHS.get(colour, ()):
        return "corrupt PNG (bad size, bit depth or colour type in its header)"
    if compression or filtering or interlace > 1:
        return "corrupt PNG (unknown compression, filter or interlace method)"
    bits = _CHANNELS[colour] * depth
    # Each row: one filter byte, then its pixels' bytes. (offset of the pass's first row, row stride, rows)
    rows, offset = [], 0
    for n, w in _passes(width, height, interlace):
        stride = 1 + (w * bits + 7) // 8
        rows.append((offset, stride, n))
        offset += stride * n
    return _inflate_rows(idat, offset, rows)


def _inflate_rows(idat: list[memoryview], expected: int, rows: list[tuple[int, int, int]]) -> str | None:
    """Inflate the IDAT data into at most ``expected`` + 1 bytes, checking every row's filter byte."""
    inflater = zlib.decompressobj()  # zlib header required, window of at most 32 KB: what libpng accepts
    budget, seen = expected + 1, 0
    try:
        for chunk in idat:
            for at in range(0, len(chunk), _PIECE):
                piece = chunk[at : at + _PIECE]  # in pieces: the unconsumed tail zlib hands back stays small
                while seen < budget and not inflater.eof:
                    room = min(_PIECE, budget - seen)
                    out = inflater.decompress(piece, room)
                    if bad := _bad_filter(out, seen, rows):
                        return bad
                    seen += len(out)
                    piece = inflater.unconsumed_tail
                    if not piece and len(out) < room:  # this piece used up, no output held back
                        break
                if seen >= budget or inflater.eof:
                    return _ending(seen, expected, inflater.eof)
    except zlib.error as exc:
        reason = "needs a preset dictionary" if "Error 2 " in str(exc) else str(exc).split(": ")[-1]
        return f"corrupt PNG (image data: {reason})"
    return _ending(seen, expected, inflater.eof)


def _ending(seen: int, expected: int, ended: bool) -> str | None:
    if seen < expected:
        return f"truncated PNG (image data for {seen} of {expected} bytes)"
    if seen == expected and not ended:  # the rows are there, the end of the stream and its checksum not
        return "truncated PNG (the image data does not end)"
    return None  # ended, or more data than the rows take (expected + 1), which libpng ignores with a warning


def _bad_filter(out: bytes, at: int, rows: list[tuple[int, int, int]]) -> str | None:
    """A reason when a row starting within ``out`` (inflated bytes from offset ``at``) has a filter type over 4."""
    for first, stride, n in rows:
        last = first + stride * (n - 1)  # offset of the pass's last row
        if last < at or first >= at + len(out):
            continue
        k = max(0, -(-(at - first) // stride))  # the first row starting at or after ``at``
        start = first + k * stride - at
        end = min(len(out), last - at + 1)
        if start < end and out[start:end:stride].translate(None, _FILTERS):
            return "corrupt PNG (a row with an unknown filter type)"
    return None
