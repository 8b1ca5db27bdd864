"""The training-side data pipeline: sampler, dataset, collate, on-device normalisation."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision import transforms

from visiontune.data.sources import discover
from visiontune.loading.augment import EpochIndex, sample_augment
from visiontune.loading.pipeline import DeviceNormalize, EpochSampler, ImageDataset
from visiontune.settings.config import MEAN, STD
from visiontune.tasks import AUTO, UNREADABLE


def test_epoch_sampler_depends_only_on_seed_and_epoch():
    a, b = EpochSampler(50, seed=42), EpochSampler(50, seed=42)
    torch.manual_seed(1)
    first = list(a)
    torch.manual_seed(2)  # the global RNG plays no part
    assert list(b) == first and sorted(first) == list(range(50))
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(50))
    b.set_epoch(1)
    assert list(a) == list(b)


def test_dataset_matches_the_blogs_pipeline_after_normalisation(sample_data):
    images = discover(str(sample_data), task=AUTO)
    ds = ImageDataset(images.paths[:6], images.labels[:6], image_size=48)
    blog = transforms.Compose([transforms.Resize((48, 48)), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    norm = DeviceNormalize(torch.device("cpu"))
    for i in range(6):
        img, label = ds[i]
        assert img.dtype == torch.uint8 and img.shape == (3, 48, 48) and label == images.labels[i]
        ours = norm(img[None])[0]
        with Image.open(images.paths[i]) as im:
            ref = blog(im.convert("RGB"))
        # Same geometry and normalisation; resampling differs by about one grey level at most.
        assert (ours - ref).abs().mean() < 0.02


def test_augment_is_random_per_epoch_and_index_and_train_only(sample_data):
    images = discover(str(sample_data), task=AUTO)
    aug = ImageDataset(images.paths[:1], [0], image_size=32, augment=sample_augment("flip-crop", 32, seed=0))
    plain = ImageDataset(images.paths[:1], [0], image_size=32)
    outs = [aug[EpochIndex(0, e)][0] for e in range(5)]
    assert all(o.shape == (3, 32, 32) and o.dtype == torch.uint8 for o in outs)
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(aug[EpochIndex(0, 0)][0], outs[0])  # the same epoch and index: the same draws
    assert torch.equal(plain[0][0], plain[0][0])


def test_unreadable_file_keeps_its_slot_and_is_reported(tmp_path, sample_data, capsys):
    images = discover(str(sample_data), task=AUTO)
    broken = tmp_path / "cat.999.jpg"
    broken.write_bytes(b"\xff\xd8\xff garbage")
    ds = ImageDataset([images.paths[0], str(broken), images.paths[1]], [0, 0, 1], image_size=16)
    x, y = default_collate([ds[i] for i in range(3)])
    assert x.shape == (3, 3, 16, 16) and y.tolist() == [0, UNREADABLE, 1] and x[1].sum() == 0
    assert str(broken) in capsys.readouterr().err


def test_unreadable_samples_add_nothing_to_the_metrics():
    from accelerate import Accelerator

    from visiontune.training.engine import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
    x = torch.randint(0, 256, (6, 3, 4, 4), dtype=torch.uint8)
    y = torch.tensor([0, 1, UNREADABLE, 1, 0, UNREADABLE])
    norm = DeviceNormalize(torch.device("cpu"))
    res = evaluate(Accelerator(cpu=True), model, [(x[:3], y[:3]), (x[3:], y[3:])], norm, progress=False)
    keep = y != UNREADABLE
    with torch.no_grad():
        logits = model(norm(x[keep]))
    assert res.images == 4
    assert res.loss == pytest.approx(torch.nn.functional.cross_entropy(logits, y[keep]).item(), rel=1e-6)
    assert res.accuracy == pytest.approx((logits.argmax(1) == y[keep]).float().mean().item())


def test_device_normalize_channels_last():
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    out = DeviceNormalize(torch.device("cpu"), channels_last=True)(x)
    ref = (x.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.allclose(out, ref, atol=1e-5) and out.is_contiguous(memory_format=torch.channels_last)


def _batch_with_a_broken_file(tmp_path, sample_data, **kw) -> tuple[ImageDataset, list[int]]:
    images = discover(str(sample_data), task=AUTO)
    broken = tmp_path / "cat.999.jpg"
    broken.write_bytes(b"\xff\xd8\xff garbage")
    paths = images.paths[:5] + [str(broken)] + images.paths[5:8]
    return ImageDataset(paths, list(range(len(paths))), image_size=24, report=False, **kw), [8, 5, 0, 3, 7, 1]


def test_a_batch_decoded_by_threads_equals_one_image_at_a_time(tmp_path, sample_data, monkeypatch):
    import threading

    import visiontune.loading.pipeline as pipeline

    serial, order = _batch_with_a_broken_file(tmp_path, sample_data)
    threaded, _ = _batch_with_a_broken_file(tmp_path, sample_data, threads=2)
    seen, real = set(), pipeline.try_read
    monkeypatch.setattr(pipeline, "try_read", lambda *a: seen.add(threading.current_thread().name) or real(*a))
    batch = threaded.__getitems__(order)
    assert any(name.startswith("visiontune-decode") for name in seen)  # the pool did the decoding
    assert [label for _, label in batch] == [UNREADABLE if i == 5 else i for i in order]
    assert all(torch.equal(img, serial[i][0]) for (img, _), i in zip(batch, order))


def test_threaded_augmentation_repeats_under_the_same_seed(tmp_path, sample_data):
    serial, order = _batch_with_a_broken_file(tmp_path, sample_data, augment=sample_augment("flip-crop", 24, seed=3))
    threaded, _ = _batch_with_a_broken_file(
        tmp_path, sample_data, augment=sample_augment("flip-crop", 24, seed=3), threads=2
    )
    order = [EpochIndex(i, 1) for i in order]
    a = threaded.__getitems__(order)
    b = [serial[i] for i in order]
    assert all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))


@pytest.mark.slow
def test_a_forked_loader_worker_decodes_with_its_own_pool(tmp_path, sample_data):
    from torch.utils.data import DataLoader

    ds, order = _batch_with_a_broken_file(tmp_path, sample_data, threads=2)
    expected = ds.__getitems__(order)  # the parent's pool now exists; its threads do not survive a fork
    # A worker that used the inherited pool would wait forever; the timeout turns that into a failure.
    loader = DataLoader(
        ds, batch_size=len(order), sampler=order, num_workers=1, timeout=30, multiprocessing_context="fork"
    )
    ((images, labels),) = list(loader)
    assert labels.tolist() == [label for _, label in expected]
    assert torch.equal(images, torch.stack([img for img, _ in expected]))
