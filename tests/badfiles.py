"""Builders for bad and odd image files, shared by any test that needs them.

Real data sets carry zero-byte JPEGs, half-downloaded files, Windows and macOS
litter and images saved in every colour mode; these helpers write small
stand-ins for each into a folder and say which is which, so decode, scan and
loader tests all exercise the same cases. Images stay tiny (40x30) except the
"big" one, which is only too large under ``SMALL_MAX_PIXELS``: tests pass that
limit instead of writing a real decompression bomb.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

W, H = 40, 30
SMALL_MAX_PIXELS = 10_000  # above every odd-mode image (1,200 px), below make_big_image's default
BIG_W, BIG_H = 200, 150

# A fragment of the reason read_image gives for each bad kind.
EXPECTED_REASON = {
    "empty": "empty file",
    "truncated": "truncated",
    "random": "not an image",
    "thumbs": "not an image",
    "text": "not an image",
    "ds_store": "not an image",
    "too_large": "image too large",
}

# The rotated JPEG's upright content: left half red, right half blue.
LEFT_RGB, RIGHT_RGB = (255, 0, 0), (0, 0, 255)


def natural_ish(w: int = W, h: int = H, seed: int = 0) -> np.ndarray:
    """A uint8 [h, w, 3] picture with smooth gradients and mild noise, like a photo at low res."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(x / 7.0), 128 + 100 * np.cos(y / 5.0), 128 + 80 * np.sin((x + y) / 9.0)], -1)
    img += rng.normal(0, 10, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_big_image(path: Path, w: int = BIG_W, h: int = BIG_H) -> Path:
    """A valid image of w x h pixels, format taken from the suffix."""
    Image.fromarray(natural_ish(w, h, seed=1)).save(path)
    return path


def make_bad_files(folder: Path) -> dict[str, str]:
    """Write one file per bad kind into ``folder``; returns {filename: kind} (kinds: EXPECTED_REASON)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    (folder / "empty.jpg").write_bytes(b"")
    buf = io.BytesIO()
    Image.fromarray(natural_ish(64, 48)).save(buf, "JPEG", quality=90)
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 6 // 10])
    (folder / "random.jpg").write_bytes(rng.integers(0, 256, 2000, dtype=np.uint8).tobytes())
    # Thumbs.db is an OLE compound file; .DS_Store starts with the "Bud1" buddy-allocator magic.
    (folder / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504))
    (folder / "notes.txt").write_text("labels were fixed by hand on tuesday\n")
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(2040))
    make_big_image(folder / "big.jpg")
    return {
        "empty.jpg": "empty",
        "truncated.jpg": "truncated",
        "random.jpg": "random",
        "Thumbs.db": "thumbs",
        "notes.txt": "text",
        ".DS_Store": "ds_store",
        "big.jpg": "too_large",
    }


def make_rotated_jpeg(path: Path) -> Path:
    """A JPEG stored sideways with EXIF orientation 6; upright it is W x H, red left, blue right."""
    upright = np.zeros((H, W, 3), np.uint8)
    upright[:, : W // 2] = LEFT_RGB
    upright[:, W // 2 :] = RIGHT_RGB
    # Orientation 6 means "rotate 90 degrees clockwise to display", so store it turned counter-clockwise.
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(path, "JPEG", quality=95, exif=exif.tobytes())
    return path


def make_odd_mode_images(folder: Path) -> dict[str, str]:
    """Write valid images in awkward modes and formats; returns {filename: kind}."""
    folder.mkdir(parents=True, exist_ok=True)
    rgb = Image.fromarray(natural_ish())
    rgb.convert("CMYK").save(folder / "cmyk.jpg", "JPEG", quality=95)
    rgb.convert("L").save(folder / "gray.jpg", "JPEG", quality=95)
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, W, dtype=np.uint8), (H, 1))))
    rgba.save(folder / "rgba.png")
    rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(folder / "palette.png")
    gray16 = (np.linspace(0, 65535, W * H).reshape(H, W)).astype(np.uint16)
    Image.fromarray(gray16).save(folder / "gray16.png")
    Image.fromarray(gray16).save(folder / "gray16.tif")
    rgb.save(folder / "png_named.jpg", "PNG")
    rgb.save(folder / "plain.bmp")
    rgb.save(folder / "plain.gif")
    rgb.save(folder / "plain.tif")
    make_rotated_jpeg(folder / "rotated.jpg")
    return {
        "cmyk.jpg": "cmyk",
        "gray.jpg": "gray",
        "rgba.png": "rgba",
        "palette.png": "palette",
        "gray16.png": "16bit",
        "gray16.tif": "16bit",
        "png_named.jpg": "png_as_jpg",
        "plain.bmp": "bmp",
        "plain.gif": "gif",
        "plain.tif": "tiff",
        "rotated.jpg": "exif_rotated",
    }


def png_chunk(kind: bytes, data: bytes, crc: int | None = None) -> bytes:
    crc = zlib.crc32(kind + data) if crc is None else crc
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def short_png(w: int = 10, h: int = 10, rows: int = 5) -> bytes:
    """A PNG whose header says w x h grey but whose image data holds only ``rows`` rows: libpng says "Not
    enough image data" while torchvision 0.29's decode_png reads the rows, and the process dies (SIGSEGV)."""
    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    data = zlib.compress(b"".join(b"\0" + b"\x80" * w for _ in range(rows)))
    return PNG_MAGIC + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
