"""Robust image reading: every file becomes an upright RGB uint8 tensor or a BadImage.

JPEG and PNG, nearly all of any real data set, take the fast path: the pixel
count is read from the header by a few lines below, a PNG is checked for what
would crash libpng's caller (``pngcheck``), then
``torchvision.io.decode_image`` (libjpeg-turbo / libpng) decodes with EXIF
orientation applied. Everything else, and any JPEG/PNG torchvision refuses for
a reason other than truncation, goes through PIL, whose ``Image.open`` reads
the size lazily so the pixel limit is still checked before any pixel is
decoded. Every failure, whatever library raised it, leaves this module as a
``BadImage`` carrying a short reason a user can act on. PIL's global settings
are read, never written.

``--decode fast`` (``DECODES``): a JPEG at least twice the size it will be resized to is
decoded at one of libjpeg's DCT scales (1/2, 1/4, 1/8; ``dct_scale``), through PIL's
``draft``, since ``decode_image`` has no such option; then resized as usual. It skips most
of the inverse DCT and the colour conversion of pixels the resize would throw away, at the
price of pixels that differ from the full decode's by a few grey levels (docs/performance.md).
"""

from __future__ import annotations

import io
import math
import os
import re
from typing import NamedTuple

import numpy as np
import torch
import torchvision.transforms.v2.functional as F
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import InterpolationMode

from visiontune.data import pngcheck

MAX_PIXELS = 89_478_485  # PIL's own default decompression-bomb limit
# exact: every pixel decoded, then resized (the reference pipeline's pixels, within a grey level);
# fast: large JPEGs decoded at a DCT scale first (dct_scale); device: JPEGs decoded on the training
# device in batches (loading.devicedecode), exact's pixels up to the decoder's rounding, and read
# as exact everywhere else (predict, evaluate, serve). Recorded with the run and its model files.
DECODES = ("exact", "fast", "device")
_DCT_SCALES = (8, 4, 2)  # the power-of-two reductions libjpeg's scaled IDCT offers (and PIL's draft uses)

_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Start-of-frame markers carry the size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class BadImage(Exception):
    """A file that cannot be used as a training image; str(exc) is the reason."""


def _jpeg_segments(data: bytes):
    """(marker, payload start, payload end) of each segment up to the start of scan (0xDA), the last one
    yielded; the walk stops early where it breaks."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return  # libjpeg would resync past garbage; we refuse and let PIL judge instead
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length field
            i += 2
            continue
        end = i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        yield marker, i + 4, end
        if marker == 0xDA:  # start of scan: the header is over
            return
        i = end


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the first SOF marker, or None when the marker walk breaks first."""
    for marker, start, _ in _jpeg_segments(data):
        if marker in _JPEG_SOF:
            if start + 5 > len(data):
                return None
            return int.from_bytes(data[start + 3 : start + 5], "big"), int.from_bytes(
                data[start + 1 : start + 3], "big"
            )
    return None


class JpegHeader(NamedTuple):
    width: int
    height: int
    components: int  # 1 grey, 3 YCbCr/RGB, 4 CMYK/YCCK
    frame: int  # the SOF marker: 0xC0 baseline, 0xC1 extended, 0xC2 progressive, others lossless/arithmetic
    precision: int  # bits per sample
    orientation: int  # EXIF orientation, 1 (upright) to 8; 1 when absent or unreadable


def jpeg_header(data: bytes) -> JpegHeader | None:
    """What a JPEG's header says before any pixel is decoded, or None when the marker walk breaks before
    the scan (an odd file: the full decoder judges it)."""
    header, orientation, exif_seen = None, 1, False
    for marker, start, end in _jpeg_segments(data):
        if marker == 0xDA:
            return None if header is None else JpegHeader(*header, orientation)
        if marker == 0xE1 and not exif_seen:  # libjpeg hands torchvision the first APP1 segment, Exif or not
            exif_seen = True
            orientation = exif_orientation(data[start + 6 : min(end, len(data))])
        elif marker in _JPEG_SOF and header is None:
            if start + 6 > len(data):
                return None
            height, width = (int.from_bytes(data[start + k : start + k + 2], "big") for k in (1, 3))
            header = (width, height, data[start + 5], marker, data[start])
    return None


def exif_orientation(tiff: bytes) -> int:
    """The orientation tag of an Exif block's first directory (after "Exif\\0\\0"), read as torchvision's
    ``decode_jpeg(apply_exif_orientation=True)`` reads it (its exif.h): 1 when absent or out of range."""
    if len(tiff) < 8:
        return 1
    order = "little" if tiff[:2] == b"II" else "big"  # torchvision reads anything but "II" as big-endian

    def number(at: int, size: int) -> int | None:
        return int.from_bytes(tiff[at : at + size], order) if at + size <= len(tiff) else None

    if number(2, 2) != 0x2A:
        return 1
    offset = number(4, 4)
    entries = number(offset, 2) if offset is not None else None
    for k in range(entries or 0):
        tag = number(offset + 2 + 12 * k, 2)
        if tag is None or tag == 0xFFFF:  # torchvision's reader stops at its out-of-bounds value
            break
        if tag == 0x0112:
            value = number(offset + 2 + 12 * k + 8, 2)
            return value if value is not None and 1 <= value <= 8 else 1
    return 1


def orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """[..., H, W] as EXIF ``orientation`` says to view it: the flips and transposes of torchvision's decoder,
    in its order, so the result (values and memory layout) is what ``apply_exif_orientation=True`` gives."""
    transposed = img.transpose(-1, -2) if orientation >= 5 else img
    flips = {2: (-1,), 3: (-2, -1), 4: (-2,), 6: (-1,), 7: (-2, -1), 8: (-2,)}.get(orientation)
    return transposed.flip(flips) if flips else transposed


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the IHDR chunk, which the PNG spec requires to come first."""
    if len(data) < 24 or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def header_pixels(data: bytes) -> int | None:
    """The pixel count a JPEG's or PNG's header declares, read without decoding; None for other formats
    or a header the walk cannot read."""
    size = (
        _jpeg_size(data) if data.startswith(_JPEG_MAGIC) else _png_size(data) if data.startswith(_PNG_MAGIC) else None
    )
    return None if size is None else size[0] * size[1]


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise BadImage(f"image too large ({width * height} pixels > limit {max_pixels})")


def _to_uint8(img: torch.Tensor) -> torch.Tensor:
    # 16-bit PNGs decode to uint16; scaling keeps the top byte, unlike PIL's convert, which clips.
    return img if img.dtype == torch.uint8 else F.to_dtype(img, torch.uint8, scale=True)


def _short(exc: BaseException) -> str:
    """The first line of a library error, without torchvision's C++ file:line prefix."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^.*?\.cpp:\d+, ", "", line)[:80]


def _read_with_pil(data: bytes, fmt: str, max_pixels: int) -> torch.Tensor:
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # over twice PIL's own limit: refused before our check
        raise BadImage(f"image too large ({_short(exc)})") from None
    except UnidentifiedImageError:
        raise BadImage("not an image") from None
    except Exception as exc:
        raise BadImage(f"corrupt {fmt} ({_short(exc)})") from None
    with im:
        fmt = im.format or fmt
        _check_pixels(im.width, im.height, max_pixels)
        try:
            im.load()  # decodes every pixel, so truncation shows up here rather than as grey rows
            im = ImageOps.exif_transpose(im)
            if im.mode.startswith("I;16"):
                arr = (np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8)
                im = Image.fromarray(arr)
            arr = np.asarray(im.convert("RGB"))
        except OSError as exc:
            reason = "truncated" if "truncated" in str(exc).lower() else "corrupt"
            raise BadImage(f"{reason} {fmt}") from None
        except Exception as exc:
            raise BadImage(f"corrupt {fmt} ({_short(exc)})") from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def dct_scale(width: int, height: int, target: int) -> int:
    """The reduction a ``width`` x ``height`` JPEG is decoded at for a resize to ``target`` px per side.

    The largest of 8, 4, 2 that keeps every side at or above ``target`` (libjpeg rounds a scaled
    side up, so ``side // scale >= target`` is enough), else 1: an image under twice the target is
    decoded whole.
    """
    fit = min(width // target, height // target)
    return next((s for s in _DCT_SCALES if s <= fit), 1)


def resize_target(size: int, crop_pct: float | None = None) -> int:
    """The side ``resize_uint8`` brings the image's shorter side to at least: ``size``, or timm's
    ``floor(size / crop_pct)`` before its centre crop."""
    return size if crop_pct is None else math.floor(size / crop_pct)


def _read_scaled(data: bytes, width: int, height: int, target: int) -> torch.Tensor | None:
    """A JPEG decoded at ``dct_scale``'s reduction, or None when it has none or PIL cannot do it
    here (the full decode then reads the file, and names its faults)."""
    scale = dct_scale(width, height, target)
    # A truncated file must fail, not come back half grey: that is PIL's default, which other code may
    # have turned off, and then the full decoder (which checks for itself) reads the file instead.
    if scale == 1 or ImageFile.LOAD_TRUNCATED_IMAGES:
        return None
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.mode not in ("RGB", "L"):  # CMYK and the like: left to the full decode's conversion
                return None
            im.draft("RGB", (width // scale, height // scale))  # PIL picks the largest scale these allow: ours
            im.load()
            im = im if im.mode == "RGB" else im.convert("RGB")  # convert would copy an RGB image too
            ImageOps.exif_transpose(im, in_place=True)
            hwc = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.height, im.width, 3)
    except Exception:
        return None
    return hwc.permute(2, 0, 1)


def read_image(path: str | os.PathLike, *, max_pixels: int = MAX_PIXELS, scale_to: int | None = None) -> torch.Tensor:
    """Decode ``path`` into a uint8 tensor [3, H, W], RGB and upright, or raise BadImage."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise BadImage(f"cannot read file ({exc.strerror or type(exc).__name__})") from None
    return decode_bytes(data, max_pixels=max_pixels, scale_to=scale_to)


def decode_bytes(data: bytes, *, max_pixels: int = MAX_PIXELS, scale_to: int | None = None) -> torch.Tensor:
    """Decode an encoded image (a file's bytes, an upload) as ``read_image`` does, or raise BadImage.

    ``scale_to``: the side the image will be resized to (``--decode fast``): a JPEG at least twice
    that is decoded at a DCT scale that keeps every side at or above it (``dct_scale``).
    """
    if not data:
        raise BadImage("empty file")

    fmt, size = "image", None
    if data.startswith(_JPEG_MAGIC):
        fmt, size = "JPEG", _jpeg_size(data)
    elif data.startswith(_PNG_MAGIC):
        fmt, size = "PNG", _png_size(data)
    if size is None:  # not JPEG/PNG, or a header we could not walk: PIL checks the size itself
        return _read_with_pil(data, fmt, max_pixels)

    _check_pixels(*size, max_pixels)
    # libpng's errors while it reads the rows crash torchvision's decoder (SIGSEGV): such a PNG stops here.
    if fmt == "PNG" and (reason := pngcheck.problem(data)):
        raise BadImage(reason)
    if scale_to is not None and fmt == "JPEG":
        scaled = _read_scaled(data, *size, scale_to)
        if scaled is not None:
            return scaled
    try:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        img = _to_uint8(decode_image(buf, mode=ImageReadMode.RGB, apply_exif_orientation=True))
    except Exception as exc:
        message = str(exc)
        # A truncated file must not reach PIL: under LOAD_TRUNCATED_IMAGES=True set by other
        # code it would come back half grey instead of failing.
        if "truncated" in message or "Out of bound read" in message:
            raise BadImage(f"truncated {fmt}") from None
        return _read_with_pil(data, fmt, max_pixels)
    if img.ndim != 3 or img.shape[0] != 3:  # never expected for JPEG/PNG; do not pass it on silently
        raise BadImage(f"corrupt {fmt} (decoded shape {tuple(img.shape)})")
    return img


def resize_uint8(
    img: torch.Tensor, size: int, interpolation: str = "bilinear", crop_pct: float | None = None
) -> torch.Tensor:
    """Resize uint8 [3, H, W] to [3, size, size], antialiased, with ``interpolation`` (bilinear: within 1
    level of PIL's).

    ``crop_pct`` None squashes the whole image to size x size (the reference job's view, which
    torchvision models keep); a number is timm's eval view: the shorter side to
    ``floor(size / crop_pct)``, then the centre ``size`` x ``size`` (zero-padded when crop_pct > 1, as timm does).
    """
    if img.dtype != torch.uint8 or img.ndim != 3:
        raise ValueError(f"expected a uint8 [C, H, W] tensor, got {img.dtype} {tuple(img.shape)}")
    mode = InterpolationMode(interpolation)
    if crop_pct is None:
        return F.resize(img, [size, size], interpolation=mode, antialias=True)
    img = F.resize(img, math.floor(size / crop_pct), interpolation=mode, antialias=True)
    return F.center_crop(img, [size, size])


def read_source(source: str | os.PathLike | bytes | torch.Tensor, scale_to: int | None = None) -> torch.Tensor:
    """A path, an encoded image's bytes, or an already decoded uint8 [3, H, W] tensor, as uint8 [3, H, W]
    (``scale_to``: see ``decode_bytes``)."""
    if isinstance(source, torch.Tensor):
        if source.dtype != torch.uint8 or source.ndim != 3 or source.shape[0] != 3:
            raise BadImage(f"expected a uint8 [3, H, W] RGB tensor, got {source.dtype} {tuple(source.shape)}")
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_bytes(bytes(source), scale_to=scale_to)
    return read_image(source, scale_to=scale_to)


def try_read(
    source: str | os.PathLike | bytes | torch.Tensor,
    size: int | None = None,
    interpolation: str = "bilinear",
    crop_pct: float | None = None,
    decode: str = "exact",
) -> torch.Tensor | str:
    """``read_source`` brought to size x size by ``resize_uint8`` (full size without ``size``), or why it
    cannot be read; ``decode`` is one of ``DECODES`` (fast: see ``decode_bytes``; device reads as exact here,
    the pixels ``loading.devicedecode`` gets on a CPU)."""
    try:
        scale_to = resize_target(size, crop_pct) if decode == "fast" and size is not None else None
        img = read_source(source, scale_to)
    except BadImage as e:
        return str(e)
    return img if size is None else resize_uint8(img, size, interpolation, crop_pct)
