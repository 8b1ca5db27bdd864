"""Tests for visiontune.data.decode: bad files fail clearly, odd files decode right, bombs stay shut."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

import visiontune.data.decode as decode
from badfiles import (
    BIG_H,
    BIG_W,
    EXPECTED_REASON,
    LEFT_RGB,
    RIGHT_RGB,
    SMALL_MAX_PIXELS,
    H,
    W,
    make_bad_files,
    make_big_image,
    make_odd_mode_images,
    make_rotated_jpeg,
    natural_ish,
)
from visiontune.data import imageset
from visiontune.data.decode import BadImage, read_image, resize_uint8


def pil_rgb(path) -> np.ndarray:
    """The reference decode: PIL, upright, converted to RGB."""
    with Image.open(path) as im:
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    return folder, make_bad_files(folder)


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("odd")
    return folder, make_odd_mode_images(folder)


def test_every_bad_kind_raises_bad_image_with_its_reason(bad):
    folder, files = bad
    for name, kind in files.items():
        with pytest.raises(BadImage) as info:
            read_image(folder / name, max_pixels=SMALL_MAX_PIXELS)
        assert EXPECTED_REASON[kind] in str(info.value), (name, str(info.value))


def test_missing_file_and_folder_are_bad_images(tmp_path):
    with pytest.raises(BadImage, match="cannot read file"):
        read_image(tmp_path / "nope.jpg")
    with pytest.raises(BadImage, match="cannot read file"):
        read_image(tmp_path)


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_jpeg_and_png_never_half_decode(tmp_path, keep):
    for fmt, suffix in [("JPEG", ".jpg"), ("PNG", ".png"), ("BMP", ".bmp")]:
        full = tmp_path / f"full{suffix}"
        Image.fromarray(natural_ish(120, 90)).save(full, fmt)
        data = full.read_bytes()
        cut = tmp_path / f"cut{suffix}"
        cut.write_bytes(data[: int(len(data) * keep)])
        with pytest.raises(BadImage):
            read_image(cut)


def test_truncated_jpeg_is_refused_even_if_pil_is_told_to_accept_truncation(bad, monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    folder, _ = bad
    with pytest.raises(BadImage, match="truncated JPEG"):
        read_image(folder / "truncated.jpg")


def test_odd_modes_become_rgb_uint8_matching_pil(odd):
    folder, files = odd
    for name, kind in files.items():
        img = read_image(folder / name)
        assert img.dtype == torch.uint8 and img.shape == (3, H, W), (name, img.shape)
        got = img.permute(1, 2, 0).numpy().astype(int)
        if kind == "16bit":
            # PIL's convert clips 16-bit values to 255, so compare with the top byte instead.
            with Image.open(folder / name) as im:
                want = np.repeat((np.asarray(im).astype(np.uint16) >> 8)[..., None], 3, axis=2)
        else:
            want = pil_rgb(folder / name)
        assert np.abs(got - want.astype(int)).mean() < 1.0, name


def test_sixteen_bit_png_keeps_full_range(odd):
    folder, _ = odd
    img = read_image(folder / "gray16.png")
    assert img.min() == 0 and img.max() == 255  # clipping would leave almost everything at 255
    assert (img[0] == img[1]).all() and (img[1] == img[2]).all()


def test_alpha_and_cmyk_keep_their_colours(odd):
    """RGBA drops alpha rather than darkening, and CMYK is not colour-inverted."""
    folder, _ = odd
    truth = natural_ish().astype(int)
    for name, tol in [("rgba.png", 0), ("cmyk.jpg", 6), ("png_named.jpg", 0)]:
        got = read_image(folder / name).permute(1, 2, 0).numpy().astype(int)
        assert np.abs(got - truth).mean() <= tol, name


def check_upright(img: torch.Tensor) -> None:
    assert img.shape == (3, H, W)  # stored 30 wide and 40 high
    left = img[:, :, : W // 2 - 2].float().mean(dim=(1, 2))
    right = img[:, :, W // 2 + 2 :].float().mean(dim=(1, 2))
    assert torch.allclose(left, torch.tensor(LEFT_RGB, dtype=torch.float), atol=8), left
    assert torch.allclose(right, torch.tensor(RIGHT_RGB, dtype=torch.float), atol=8), right


def test_exif_orientation_is_applied(tmp_path):
    path = make_rotated_jpeg(tmp_path / "rotated.jpg")
    with Image.open(path) as im:
        assert im.size == (H, W)  # really stored sideways
    check_upright(read_image(path))


def test_pil_fallback_also_applies_orientation(tmp_path, monkeypatch):
    path = make_rotated_jpeg(tmp_path / "rotated.jpg")

    def refuse(*args, **kwargs):
        raise RuntimeError("Unsupported marker type 0xcf")

    monkeypatch.setattr(decode, "decode_image", refuse)
    check_upright(read_image(path))


def test_pil_fallback_failure_is_still_a_bad_image(bad, monkeypatch):
    monkeypatch.setattr(decode, "decode_image", lambda *a, **k: (_ for _ in ()).throw(ValueError("x")))
    folder, _ = bad
    with pytest.raises(BadImage, match="truncated JPEG"):
        read_image(folder / "truncated.jpg")


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".bmp", ".tif"])
def test_max_pixels_is_checked_before_any_decoding(tmp_path, monkeypatch, suffix):
    path = make_big_image(tmp_path / f"bomb{suffix}")
    calls = []
    real_decode, real_load = decode.decode_image, ImageFile.ImageFile.load

    def counting_decode(*args, **kwargs):
        calls.append("torchvision")
        return real_decode(*args, **kwargs)

    def counting_load(self, *args, **kwargs):
        calls.append("pil")
        return real_load(self, *args, **kwargs)

    # Every file-backed PIL image decodes its pixels in ImageFile.load.
    monkeypatch.setattr(decode, "decode_image", counting_decode)
    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    with pytest.raises(BadImage, match=rf"image too large \({BIG_W * BIG_H} pixels > limit 10000\)"):
        read_image(path, max_pixels=SMALL_MAX_PIXELS)
    assert calls == []
    img = read_image(path, max_pixels=BIG_W * BIG_H)  # exactly at the limit is allowed
    assert img.shape == (3, BIG_H, BIG_W) and calls


def test_jpeg_header_size_matches_pil(tmp_path):
    big_exif = {"exif": b"Exif\x00\x00" + bytes(60000)}  # pushes the frame header past a 64 KiB segment
    for w, h, kw in [(123, 45, {}), (64, 200, {"progressive": True}), (50, 50, big_exif)]:
        path = tmp_path / "x.jpg"
        Image.fromarray(natural_ish(w, h)).save(path, "JPEG", **kw)
        assert decode._jpeg_size(path.read_bytes()) == (w, h)


def test_resize_uint8_matches_pil_bilinear():
    img = natural_ish(500, 375)
    tensor = torch.from_numpy(img).permute(2, 0, 1).contiguous()
    for size in (64, 224):
        out = resize_uint8(tensor, size)
        assert out.dtype == torch.uint8 and out.shape == (3, size, size)
        ref = np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR)).astype(int)
        diff = np.abs(out.permute(1, 2, 0).numpy().astype(int) - ref)
        assert diff.mean() < 0.5 and diff.max() <= 2
    with pytest.raises(ValueError):
        resize_uint8(tensor.float(), 64)


def test_image_extensions_are_lower_case_with_dots():
    assert {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"} == imageset.IMAGE_EXTENSIONS
