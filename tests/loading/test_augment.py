"""Augmentation: draws are a function of (seed, epoch, index), so resumes repeat them exactly."""

from __future__ import annotations

import pickle
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torchvision.transforms import v2

from trainrun import (
    assert_same_weights,
    env_for,
    final_weights,
    flags,
    relative_difference,
    train_argv,
    train_ddp_beside_one,
)
from visiontune import cli
from visiontune.cli.commands import build_parser
from visiontune.cli.flags import config_from_args
from visiontune.errors import UserError
from visiontune.loading.augment import BatchMix, EpochIndex, derive_seed, sample_augment, seeded
from visiontune.loading.pipeline import EpochSampler
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import UNREADABLE


def test_sample_draws_depend_on_seed_epoch_and_index_only():
    img = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
    aug = sample_augment("trivial", 32, seed=5, random_erasing=0.5)
    a = aug(img, EpochIndex(3, 1))
    torch.rand(100)  # other users of the global generator do not change the draws ...
    assert torch.equal(aug(img, EpochIndex(3, 1)), a)
    state = torch.get_rng_state()
    aug(img, EpochIndex(4, 1))
    assert torch.equal(torch.get_rng_state(), state)  # ... nor do the draws change the global generator
    others = [
        aug(img, EpochIndex(3, 2)),
        aug(img, EpochIndex(4, 1)),
        sample_augment("trivial", 32, seed=6, random_erasing=0.5)(img, EpochIndex(3, 1)),
    ]
    assert all(o.shape == (3, 32, 32) and o.dtype == torch.uint8 for o in others)
    assert all(not torch.equal(o, a) for o in others)
    assert sample_augment("none", 32, seed=5) is None


def test_light_is_a_mild_crop_and_a_flip_repeatable_per_seed_epoch_and_index():
    ramp = torch.linspace(0, 255, 32).round().to(torch.uint8).expand(32, 32)
    img = torch.stack([ramp, ramp.T, ramp])  # red and blue brighter to the right, green downwards
    aug = sample_augment("light", 32, seed=3)
    outs = [aug(img, EpochIndex(i, 1)) for i in range(16)]
    assert all(o.shape == (3, 32, 32) and o.dtype == torch.uint8 for o in outs)
    assert torch.equal(aug(img, EpochIndex(5, 1)), outs[5])
    assert not torch.equal(aug(img, EpochIndex(5, 2)), outs[5])
    assert not torch.equal(sample_augment("light", 32, seed=4)(img, EpochIndex(5, 1)), outs[5])
    assert all(not torch.equal(o, img) for o in outs)  # a crop (area 35-100%) resized back: never the identity
    # Geometry only: every row stays a ramp, rising (kept) or falling (mirrored), both seen.
    steps = [o[0, :, 1:].int() - o[0, :, :-1].int() for o in outs]
    rising = [bool((d >= 0).all()) for d in steps]
    falling = [bool((d <= 0).all()) for d in steps]
    assert all(r != f for r, f in zip(rising, falling)) and any(rising) and any(falling)


def _ramps() -> torch.Tensor:
    ramp = torch.linspace(0, 255, 32).round().to(torch.uint8).expand(32, 32)
    return torch.stack([ramp, ramp.T, ramp])  # red and blue brighter to the right, green downwards


def test_flips_and_crop_scale_apply_over_any_level_with_their_probability():
    img = _ramps()
    steps = sample_augment("light", 32, seed=0, hflip=0.3, vflip=0.7, crop_scale=(0.5, 0.9)).transform.transforms
    assert [type(t) for t in steps] == [v2.RandomResizedCrop, v2.RandomHorizontalFlip, v2.RandomVerticalFlip]
    assert steps[0].scale == (0.5, 0.9) and steps[1].p == 0.3 and steps[2].p == 0.7
    # P=1 always flips, P=0 never: on "none" the flip is the whole transform.
    for i in range(4):
        assert torch.equal(sample_augment("none", 32, seed=i, hflip=1.0)(img, EpochIndex(i, 1)), img.flip(-1))
        assert torch.equal(sample_augment("none", 32, seed=i, vflip=1.0)(img, EpochIndex(i, 1)), img.flip(-2))
    assert sample_augment("none", 32, seed=0, hflip=0.0, vflip=0.0) is None
    # --hflip 0 over flip-crop: no flip at all; the crop keeps its scale. A crop of the whole area of a
    # square image at its own size is the identity, so "light" with scale 1 and no flip changes nothing.
    kept = sample_augment("flip-crop", 32, seed=0, hflip=0.0)
    assert [type(t) for t in kept.transform.transforms] == [v2.RandomResizedCrop]
    assert kept.transform.transforms[0].scale == (0.08, 1.0)
    still = sample_augment("light", 32, seed=0, hflip=0.0, crop_scale=(1.0, 1.0))
    assert all(torch.equal(still(img, EpochIndex(i, 1)), img) for i in range(8))
    # A crop asked for over "none" brings the image to size itself.
    assert sample_augment("none", 16, seed=0, crop_scale=(0.5, 1.0)).resizes
    assert not sample_augment("none", 16, seed=0, vflip=0.5).resizes


def test_the_levels_defaults_draw_as_before():
    # flip-crop with the defaults is torchvision's crop then a 0.5 flip, draw for draw.
    img, before = _ramps(), v2.Compose([v2.RandomResizedCrop(24, antialias=True), v2.RandomHorizontalFlip()])
    aug = sample_augment("flip-crop", 24, seed=9)
    for i in range(6):
        with seeded(derive_seed(9, 1, i)):
            want = before(img)
        assert torch.equal(aug(img, EpochIndex(i, 1)), want)


def test_flip_and_crop_settings_resolve_per_level_and_are_checked():
    resolved = validate(TrainConfig(data="d", augment="light"))
    assert (resolved.hflip, resolved.vflip, resolved.crop_scale) == (0.5, 0.0, (0.35, 1.0))
    assert validate(TrainConfig(data="d")).crop_scale is None and validate(TrainConfig(data="d")).hflip == 0.0
    given = validate(TrainConfig(data="d", augment="flip-crop", hflip=0.0, vflip=0.5, crop_scale=[0.2, 0.6]))
    assert (given.hflip, given.vflip, given.crop_scale) == (0.0, 0.5, (0.2, 0.6))
    args = build_parser().parse_args(["train", "--data", "d", "--crop-scale", "0.3", "1", "--hflip", "0"])
    assert config_from_args(args).crop_scale == (0.3, 1.0) and config_from_args(args).hflip == 0.0
    for bad, message in (
        ({"crop_scale": (0.9, 0.5)}, "--crop-scale MIN MAX must satisfy 0 < MIN <= MAX <= 1, got 0.9 0.5"),
        ({"crop_scale": (0.0, 1.0)}, "--crop-scale"),
        ({"hflip": 1.5}, "--hflip must be in"),
        ({"crop_scale": ["a", 1]}, "is not of type"),
    ):
        with pytest.raises(UserError, match=re.escape(message)):
            validate(TrainConfig(data="d", **bad))


def test_the_sampler_hands_out_its_epoch_and_the_index_survives_pickling():
    s = EpochSampler(10, seed=1)
    s.set_epoch(3)
    idx = list(s)
    assert sorted(idx) == list(range(10)) and {i.epoch for i in idx} == {3}
    back = pickle.loads(pickle.dumps(idx[0]))
    assert back == idx[0] and back.epoch == 3


def _onehot(labels, k=3):
    return torch.nn.functional.one_hot(labels, k).float()


def test_mix_gives_soft_labels_that_split_one_global_batch_like_ddp_parts():
    x = torch.randn(8, 3, 16, 16)
    y = torch.tensor([0, 1, 2, 0, 1, UNREADABLE, 2, 2])
    whole = BatchMix(3, mixup=0.4, cutmix=1.0, seed=7)
    xs, ts = whole(x, y, epoch=2, step=5)
    # Soft targets: each readable row a mix of its own label and its pair partner's, summing to 1.
    assert ts.shape == (8, 3) and torch.allclose(ts[[0, 1, 2, 3, 6, 7]].sum(1), torch.ones(6))
    assert (ts[5] == 0).all() and not torch.equal(xs, x)
    lam = ts[0, 0]  # pair (0, 1): labels 0 and 1 mixed with the same weight for images and labels
    assert torch.allclose(ts[0], lam * _onehot(y[0:1])[0] + (1 - lam) * _onehot(y[1:2])[0])
    # Two processes reading a half each (per-process batch 4, the step's parts rank 0 and 1) mix alike.
    parts = [
        BatchMix(3, 0.4, 1.0, seed=7, rank=r, world_size=2)(x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4], 2, 5)
        for r in range(2)
    ]
    assert torch.equal(torch.cat([p[0] for p in parts]), xs) and torch.equal(torch.cat([p[1] for p in parts]), ts)
    assert not torch.equal(whole(x, y, epoch=3, step=5)[0], xs)  # another epoch, other draws


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["--augment", "--num-workers", "0"],  # the old flag, from files, decoded in this process
        [
            *flags(
                augment="trivial",
                random_erasing=0.5,
                mixup=0.4,
                cutmix=1,
                ema=0.9,
                optimizer="adamw",
                lr_schedule="cosine",
                warmup_epochs=0.5,
                label_smoothing=0.1,
                num_workers=1,
                cache="CACHE",
                vflip=0.5,
            ),
            *["--crop-scale", "0.5", "0.9"],
        ],  # everything random, from the cache, in a loader worker
    ],
    ids=["flip-crop-files-0-workers", "all-options-cache-1-worker"],
)
def test_resume_from_a_mid_epoch_checkpoint_in_a_new_folder_is_exact(tmp_path, small_data, monkeypatch, extra):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "scan"))
    extra = [str(tmp_path / "cache") if e == "CACHE" else e for e in extra]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = ["--save-every-steps", "3", "--keep-last", "20", *extra]
    assert cli.main(train_argv(small_data, full, *args)[3:]) == 0
    # Mid-epoch (step 3 of 8, with the loader a batch or more ahead), copied into a fresh run folder.
    shutil.copytree(full / "checkpoints" / "epoch0001-batch0000003", resumed / "checkpoints" / "epoch0001-batch0000003")
    assert cli.main([*train_argv(small_data, resumed, *args)[3:], "--resume", "auto"]) == 0
    assert_same_weights(final_weights(resumed), final_weights(full))
    # The EMA and the schedule (saved in the scheduler's place) continued exactly too.
    a, b = (
        torch.load(run / "checkpoints" / "epoch0002-end" / "lr_scheduler.pt", weights_only=True)
        for run in (full, resumed)
    )
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 16
    assert a["scheduler"]["_last_lr"] == b["scheduler"]["_last_lr"]
    if "--ema" in extra:
        assert_same_weights(a["ema"], b["ema"])


@pytest.mark.distributed
def test_ddp_with_the_new_options_matches_one_process(tmp_path, worker_env):
    """2 processes x batch 2 = 1 process x batch 4, with every random and scheduled option on."""
    from visiontune.data.sample import make_sample_data

    data = tmp_path / "data"
    make_sample_data(data, per_class=6, test_count=0, seed=1)  # 12 images: 8 train, 2 steps of 4
    # timm's test_vit: no BatchNorm (each process would normalise its own half) and no dropout.
    # SGD: AdamW's first step is about lr * sign(gradient), which turns the last-bit differences
    # of 1 x 2 threads against 2 x 1 thread into visible ones where a gradient is near 0.
    common = flags(data=data, model="timm/test_vit", weights="none", image_size=32, no_progress=True, epochs=1)
    common += flags(val_fraction=0.3, num_workers=0, recipe="modern", optimizer="sgd", lr=0.01, warmup_steps=1)
    common += flags(augment="randaugment", random_erasing=0.5, mixup=0.4, cutmix=1, ema=0.5, normalize="data")
    common += flags(sampler="balanced", class_weights="auto")  # each rank's share of one class-balanced epoch
    ddp, one = flags(strategy="ddp", nproc=2, batch_size=2), flags(batch_size=4)
    train_ddp_beside_one(common, ddp, one, tmp_path, env_for(worker_env, tmp_path))
    ckpt = "checkpoints/epoch0001-end"
    weights = [load_file(str(tmp_path / d / ckpt / "model.safetensors")) for d in ("ddp", "one")]
    ema = [torch.load(tmp_path / d / ckpt / "lr_scheduler.pt", weights_only=True)["ema"] for d in ("ddp", "one")]
    for name, (a, b) in (("model", weights), ("ema", ema)):
        assert relative_difference(a, b) < 1e-4, name
