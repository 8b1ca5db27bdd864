"""``--decode device``: JPEGs decoded on the training device in batches (nvJPEG on a CUDA GPU,
libjpeg-turbo on a CPU), then resized and augmented there.

Loader side, ``DeviceDecodeDataset`` reads each file's bytes and checks a JPEG's header -- its size
against the pixel limit, and a frame the device decoder reads (8-bit baseline or progressive, grey
or colour) -- but decodes nothing; every other file (PNG, a CMYK JPEG, anything odd) is decoded and
resized there as ``--decode exact`` does. ``DeviceCollate`` stacks a batch into an ``EncodedBatch``:
the images decoded already, zeros in the JPEGs' slots, and the JPEGs' bytes in one block with their
slots and sample indices. Accelerate moves it with the rest of the batch through its ``to``, which
moves the decoded images only: ``decode_jpeg`` reads encoded bytes from host memory on every device.

Training side, ``on_device(images, labels)`` (the engine calls it before normalising) decodes all
of a batch's JPEGs with one ``decode_jpeg`` call on the device the batch went to (each alone when
that call fails, to find the bad one), turns each upright by its EXIF orientation with the flips
torchvision's CPU decoder uses (its CUDA decoder ignores the orientation), and resizes and augments
it as ``ImageDataset`` does, seeded by the same (seed, epoch, index): on a CPU the batch is, bit for
bit, ``--decode exact``'s. A JPEG the device decoder refuses is read by the CPU decoder
(``decode.try_read``); one that fails there too keeps its slot as a black image labelled
``UNREADABLE``, said and recorded as the loader records it. Batches keep their size, so the
sampler, DDP sharding and resume are those of every other run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from visiontune.data.decode import MAX_PIXELS, JpegHeader, jpeg_header, orient, resize_uint8, try_read
from visiontune.loading.augment import EpochIndex, SampleAugment
from visiontune.loading.pipeline import (
    ImageDataset,
    collate_channels_last,
    record_failure,
)
from visiontune.tasks import UNREADABLE

_JPEG_MAGIC = b"\xff\xd8\xff"
# Frames nvJPEG decodes: baseline, extended and progressive Huffman (not lossless or arithmetic coding).
_DEVICE_FRAMES = (0xC0, 0xC1, 0xC2)


def device_reads(header: JpegHeader | None) -> bool:
    """Whether a JPEG goes to the device decoder: 8 bits, grey or three components, a Huffman DCT frame,
    within the pixel limit (an image over it is refused on the loader side, with the reason)."""
    return (
        header is not None
        and header.frame in _DEVICE_FRAMES
        and header.precision == 8
        and header.components in (1, 3)  # CMYK/YCCK: libjpeg's conversion on the loader side
        and 0 < header.width * header.height <= MAX_PIXELS
    )


@dataclass(frozen=True)
class EncodedJPEG:
    """A JPEG sample as the loader hands it over: its bytes and what the device step needs to finish it."""

    data: torch.Tensor  # uint8 [n], the file's bytes
    orientation: int  # EXIF, 1 to 8
    sample: tuple[int, int, int]  # (index, epoch, draw): what augmentation seeds its draws with
    name: str  # the file, for the failure record


@dataclass(frozen=True)
class DeviceView:
    """What the device step does to a decoded image: the run's resize and the train split's augmentation."""

    size: int
    interpolation: str = "bilinear"
    crop_pct: float | None = None
    augment: SampleAugment | None = None
    failures_csv: str | None = None
    report: bool = True

    def finish(self, img: torch.Tensor, index: int) -> torch.Tensor:
        """uint8 [3, H, W] -> [3, S, S] in ``ImageDataset``'s order: a resizing augmentation gets the full
        image, any other comes after the resize."""
        if self.augment is not None and self.augment.resizes:
            return self.augment(img, index)
        img = resize_uint8(img, self.size, self.interpolation, self.crop_pct)
        return self.augment(img, index) if self.augment is not None else img


@dataclass(frozen=True)
class EncodedBatch:
    """A batch's images: the decoded ones, and the JPEGs ``on_device`` decodes into their slots."""

    images: torch.Tensor  # uint8 [B, 3, S, S]; the JPEGs' slots hold zeros until decoded
    data: torch.Tensor  # uint8: the JPEGs' bytes back to back (one block: one shared buffer per batch)
    lengths: list[int]
    slots: list[int]  # each JPEG's position in the batch
    orientations: list[int]
    samples: list[tuple[int, int, int]]
    names: list[str]
    view: DeviceView

    def to(self, device, non_blocking: bool = False) -> EncodedBatch:
        # Only the decoded images move: decode_jpeg takes host bytes on every device.
        return replace(self, images=self.images.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> EncodedBatch:
        return replace(self, images=self.images.pin_memory())


class DeviceCollate:
    """``collate_channels_last`` for a batch with ``EncodedJPEG`` samples: an ``EncodedBatch`` and the labels."""

    def __init__(self, view: DeviceView):
        self.view = view

    def __call__(self, batch: Sequence) -> tuple[EncodedBatch, torch.Tensor]:
        blank = torch.zeros(3, self.view.size, self.view.size, dtype=torch.uint8)
        images, labels = collate_channels_last(
            [(blank if isinstance(img, EncodedJPEG) else img, label) for img, label in batch]
        )
        jpegs = [(slot, img) for slot, (img, _) in enumerate(batch) if isinstance(img, EncodedJPEG)]
        data = torch.cat([j.data for _, j in jpegs]) if jpegs else torch.zeros(0, dtype=torch.uint8)
        encoded = EncodedBatch(
            images,
            data,
            [len(j.data) for _, j in jpegs],
            [slot for slot, _ in jpegs],
            [j.orientation for _, j in jpegs],
            [j.sample for _, j in jpegs],
            [j.name for _, j in jpegs],
            self.view,
        )
        return encoded, labels


class DeviceDecodeDataset(ImageDataset):
    """``ImageDataset`` that hands JPEGs over undecoded (``EncodedJPEG``); other files are decoded and resized
    here as ``--decode exact`` does. Its loader's batches are ``EncodedBatch``es (``collate``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "decode": "exact"})  # what the loader side decodes, it decodes exactly
        self.collate = DeviceCollate(
            DeviceView(self.size, self.interpolation, self.crop_pct, self.augment, self.failures_csv, self.report)
        )

    def _decode(self, i: int):
        source = self.paths[i] if self.reader is None else self.reader[i]
        if isinstance(source, (str, os.PathLike)):
            try:
                with open(source, "rb") as f:
                    source = f.read()
            except OSError:
                return self._read(source)  # the CPU path names the problem
        data = bytes(source)
        if not (data.startswith(_JPEG_MAGIC) and device_reads(header := jpeg_header(data))):
            return self._read(data)
        sample = (int(i), getattr(i, "epoch", 0), getattr(i, "draw", 0))  # the sampler's EpochIndex, or val's int
        bytes_ = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return EncodedJPEG(bytes_, header.orientation, sample, str(self.paths[i]))

    def _finish(self, i: int, img):
        if isinstance(img, EncodedJPEG):
            return img, self.task.sample_label(self.labels, i)
        return super()._finish(i, img)


def _decode_all(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Each JPEG decoded to uint8 [3, H, W] on ``device`` (None: the device decoder refused it), in one call
    while every file decodes; the decoder returns nothing when one fails, so then one by one."""
    try:
        return list(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device))
    except Exception:  # noqa: BLE001 - libjpeg and nvJPEG raise RuntimeError, ValueError or their own
        out: list[torch.Tensor | None] = []
        for jpeg in jpegs:
            try:
                out.append(decode_jpeg(jpeg, mode=ImageReadMode.RGB, device=device))
            except Exception:  # noqa: BLE001
                out.append(None)
        return out


def on_device(images, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the loader gave it, on the device -> (uint8 [B, 3, S, S], labels); a plain batch is returned
    as it is. The labels of JPEGs no decoder reads become ``UNREADABLE``."""
    if not isinstance(images, EncodedBatch):
        return images, labels
    out, view = images.images, images.view
    if not images.slots:
        return out, labels
    jpegs = list(torch.split(images.data, images.lengths))
    for k, decoded in enumerate(_decode_all(jpegs, out.device)):
        slot = images.slots[k]
        if decoded is not None:
            img = orient(decoded, images.orientations[k])
        else:  # the CPU decoder, as --decode exact reads the file (and why it cannot, when it cannot)
            img = try_read(jpegs[k].numpy().tobytes())
            img = img.to(out.device) if isinstance(img, torch.Tensor) else img
        if isinstance(img, str):
            if view.report:
                print(f"visiontune: skipped unreadable image {images.names[k]}: {img}", file=sys.stderr)
            if view.failures_csv:
                record_failure(view.failures_csv, images.names[k], img)
            labels = labels.clone()
            labels[slot] = UNREADABLE  # a multi-hot row becomes a row of UNREADABLE
            continue
        out[slot] = view.finish(img, EpochIndex(*images.samples[k]))
    return out, labels
