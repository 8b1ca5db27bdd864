"""``--decode device``: JPEGs handed over undecoded and decoded in batches where the model trains.

On a CPU the device decoder is libjpeg-turbo, the one ``--decode exact`` uses, so everything here is
checked bit for bit against the loader-side pipeline: batches (every EXIF orientation, grey, progressive,
CMYK and PNG files, each resize and augmentation order), a whole training run's weights and metrics,
and the fallbacks (a JPEG the device decoder refuses goes to the CPU decoder; one no decoder reads keeps
its slot as UNREADABLE and is recorded).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from trained import one_thread  # noqa: F401  (autouse: one thread in-process)
from trainrun import flags, one_line, tiny_train
from visiontune.cli.commands import main
from visiontune.data.decode import jpeg_header, try_read
from visiontune.loading import devicedecode
from visiontune.loading.augment import EpochIndex, sample_augment
from visiontune.loading.devicedecode import DeviceDecodeDataset, EncodedBatch, on_device
from visiontune.loading.pipeline import ImageDataset, collate_channels_last
from visiontune.runs import runrecords
from visiontune.tasks import UNREADABLE


def _picture(rng, w: int, h: int, tint: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 3 + tint, y * 2 + 40, (x + y) + 2 * tint], -1) % 256
    return np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def _encode(img: Image.Image, fmt: str = "JPEG", **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def make_folder(root: Path, per_class: int = 16) -> list[Path]:
    """Class folders of 40-80 px JPEGs of many sizes, every EXIF orientation, and one each of a grey,
    a progressive and a CMYK JPEG and a PNG."""
    rng = np.random.default_rng(0)
    paths = []
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            img = Image.fromarray(_picture(rng, int(rng.integers(40, 81)), int(rng.integers(40, 81)), 90 * c))
            kind, save = "jpg", {"quality": 90}
            if i < 8:  # orientations 1..8
                exif = Image.Exif()
                exif[0x0112] = i + 1
                save["exif"] = exif.tobytes()
            elif i == 8 and c == 0:
                img = img.convert("L")
            elif i == 9 and c == 0:
                save["progressive"] = True
            elif i == 10 and c == 0:
                img = img.convert("CMYK")
            elif i == 11 and c == 0:
                kind, save = "png", {}
            paths.append(root / name / f"{i:02d}.{kind}")
            paths[-1].write_bytes(_encode(img, "PNG" if kind == "png" else "JPEG", **save))
    return paths


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("devicedecode") / "data"
    return root, make_folder(root)


def _batches(paths, epoch: int, **view) -> tuple[tuple, tuple]:
    """One batch of every file through the loader-side pipeline and through the device one."""
    labels = [i % 2 for i in range(len(paths))]
    index = [EpochIndex(i, epoch, draw=i % 3 == 0) for i in range(len(paths))]
    exact = ImageDataset([str(p) for p in paths], labels, 24, **view)
    device = DeviceDecodeDataset([str(p) for p in paths], labels, 24, threads=2, **view)
    encoded, device_labels = device.collate(device.__getitems__(index))
    return collate_channels_last(exact.__getitems__(index)), (encoded, device_labels)


@pytest.mark.parametrize(
    "view",
    [
        {},  # a squash
        {"crop_pct": 0.875, "interpolation": "bicubic"},  # timm's eval view
        {"augment": sample_augment("light", 24, seed=3)},  # a random crop of the full image, then a flip
        {"augment": sample_augment("none", 24, seed=3, hflip=0.5, vflip=0.5)},  # flips after the resize
    ],
)
def test_a_batch_decoded_on_the_device_is_the_exact_batch(folder, view):
    paths = folder[1]
    (want, want_labels), (encoded, labels) = _batches(paths, epoch=2, **view)
    assert isinstance(encoded, EncodedBatch) and encoded.images.shape == want.shape
    # Every JPEG but the CMYK one is left to the device; the PNG and the CMYK JPEG arrive decoded.
    loader_side = {p.name for p in paths if p.suffix == ".png" or jpeg_header(p.read_bytes()).components == 4}
    assert loader_side == {"11.png", "10.jpg"}
    assert sorted(Path(n).name for n in encoded.names) == sorted(
        p.name for p in paths if p.parent.name + p.name not in {"cat11.png", "cat10.jpg"}
    )
    assert not encoded.images[encoded.slots].any()  # the JPEGs' slots wait, black, for the device step
    images, labels = on_device(encoded.to("cpu"), labels)
    assert torch.equal(images, want) and torch.equal(labels, want_labels)


def test_the_exif_orientation_is_read_as_torchvision_reads_it(folder):
    oriented = [p for p in folder[1] if p.parent.name == "dog" and int(p.stem) < 8]
    assert [jpeg_header(p.read_bytes()).orientation for p in oriented] == list(range(1, 9))
    assert {try_read(str(p)).shape[1:] for p in oriented[4:]} != {try_read(str(p)).shape[1:] for p in oriented[:4]}


def test_the_device_falls_back_to_the_cpu_decoder_and_marks_what_none_reads(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(1)
    files = []
    for i in range(3):
        files.append(tmp_path / f"{i}.jpg")
        files[-1].write_bytes(_encode(Image.fromarray(_picture(rng, 60, 50, 40 * i)), quality=90))
    whole = files[2].read_bytes()
    files[2].write_bytes(whole[: len(whole) // 2])  # truncated after the scan: its header still reads
    refused = torch.frombuffer(bytearray(files[1].read_bytes()), dtype=torch.uint8)
    real = devicedecode.decode_jpeg

    def device_decoder(jpegs, **kw):  # a device decoder that refuses file 1 (and so, the batch)
        for jpeg in jpegs if isinstance(jpegs, list) else [jpegs]:
            if torch.equal(jpeg, refused):
                raise RuntimeError("nvjpeg: unsupported")
        return real(jpegs, **kw)

    monkeypatch.setattr(devicedecode, "decode_jpeg", device_decoder)
    log = tmp_path / "load_failures.csv"
    dataset = DeviceDecodeDataset([str(f) for f in files], [0, 1, 0], 24, failures_csv=str(log))
    encoded, labels = dataset.collate(dataset.__getitems__([0, 1, 2]))
    assert encoded.slots == [0, 1, 2]
    images, labels = on_device(encoded, labels)
    assert torch.equal(images[0], try_read(str(files[0]), 24))
    assert torch.equal(images[1], try_read(str(files[1]), 24))  # read by the CPU decoder instead
    assert not images[2].any() and labels.tolist() == [0, 1, UNREADABLE]
    assert try_read(str(files[2]), 24) == "truncated JPEG"
    assert list(csv.reader(log.open())) == [[str(files[2]), "truncated JPEG"]]
    assert f"skipped unreadable image {files[2]}: truncated JPEG" in capsys.readouterr().err


@pytest.fixture(scope="module")
def device_runs(folder, tmp_path_factory):
    """The same seeded run on ``folder`` with --decode exact --cache off and --decode device (whose default
    cache, fit, comes to none)."""
    root = folder[0]
    tmp = tmp_path_factory.mktemp("device-runs")
    decoded = []
    real = devicedecode._decode_all

    def counted(jpegs, device):
        decoded.append(len(jpegs))
        return real(jpegs, device)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("visiontune.cluster.strategy.cpu_budget", lambda *_: 1)
        mp.setattr(devicedecode, "_decode_all", counted)
        common = flags(epochs=2, batch_size=8, num_workers=0, augment="flip-crop", lr=0.01)
        assert main(tiny_train(root, tmp / "exact", *common, "--decode", "exact", "--cache", "off")) == 0
        assert main(tiny_train(root, tmp / "device", *common, "--decode", "device")) == 0
    return tmp / "exact", tmp / "device", decoded


@pytest.mark.slow
def test_a_device_decoded_run_trains_the_exact_runs_weights_and_metrics(device_runs):
    exact, device, decoded = device_runs
    # 32 images: 25 train (3 full batches of 8 per epoch) and 7 val (one batch), each with JPEGs to decode.
    assert len(decoded) == 2 * (3 + 1) and sum(decoded) >= 2 * (24 + 7 - 2)  # the PNG and CMYK JPEG: loader side
    a, b = load_file(str(exact / "best.safetensors")), load_file(str(device / "best.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [list(csv.DictReader((run / "metrics.csv").open())) for run in (exact, device)]
    keys = ("epoch", "phase", "loss", "accuracy", "images")
    assert len(rows[0]) == 4 and [[r[k] for k in keys] for r in rows[0]] == [[r[k] for k in keys] for r in rows[1]]


@pytest.mark.slow
def test_the_run_records_the_decode_and_why_it_has_no_cache(device_runs):
    device = device_runs[1]
    config = json.loads((device / "config.json").read_text())
    assert config["config"]["decode"] == "device"
    assert config["image_cache"] == {
        "setting": "fit",
        "path": None,
        "why": "--decode device: JPEGs are decoded on the device each epoch",
    }
    assert runrecords.read_run(str(device)).decode == "device"
    # Said where the run is described (console and report): here, on a CPU, that it brings no speed.
    said = [json.loads((d / "config.json").read_text())["overview"]["decode"] for d in device_runs[:2]]
    assert said == [
        "exact: every pixel, on the loader side",
        "device: JPEGs in batches on cpu in the training process; on a CPU the loader side is as fast",
    ]


@pytest.mark.parametrize("cache", ["auto", "DIR"])
def test_a_cache_with_device_decode_is_refused_in_one_line(tmp_path, small_data, capsys, no_scan, cache):
    value = str(tmp_path / "cache") if cache == "DIR" else cache
    out = tmp_path / "run"
    assert main(tiny_train(small_data, out, "--decode", "device", "--cache", value)) == 2
    one_line(capsys, "--decode device", f"--cache {value}", "--decode exact")
    assert not out.exists() and not (tmp_path / "cache").exists()
