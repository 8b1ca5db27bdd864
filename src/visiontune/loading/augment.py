"""Training augmentation whose randomness is a function of (seed, epoch, position), never of history.

transforms.v2 draws from torch's global CPU generator. If augmentation simply
drew from it, the draws would depend on how many batches a loader had read
ahead, on which loader worker decoded a batch, and on everything else that used
the generator: a resumed run could not repeat them. So each sample is augmented
with the global generator seeded from (seed, epoch, sample index) and restored
afterwards, and each mixup/cutmix pair from (seed, epoch, position of the pair
in the epoch's global batch order). The sampler tells the dataset the epoch by
handing out ``EpochIndex`` ints. Resume with or without loader workers, on any
number of processes, then repeats every draw bit for bit, by construction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torchvision.transforms import v2

from visiontune import tasks
from visiontune.settings.presets import AUGMENT_VIEW

AUGMENTS = tuple(AUGMENT_VIEW)


class EpochIndex(int):
    """A dataset index that also carries the epoch it was drawn for (it pickles to loader workers).

    ``draw`` counts the earlier draws of the same index in the epoch: a balanced epoch repeats the
    images of rare classes, and each repeat gets draws of its own.
    """

    epoch: int
    draw: int

    def __new__(cls, index: int, epoch: int, draw: int = 0) -> EpochIndex:  # noqa: PYI034 (typing.Self needs 3.11)
        obj = super().__new__(cls, index)
        obj.epoch, obj.draw = epoch, draw
        return obj

    def __reduce__(self):
        return EpochIndex, (int(self), self.epoch, self.draw)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that changes unpredictably with every part (neighbouring seeds give unrelated streams)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Torch's global CPU generator seeded with ``seed`` inside the block and restored after it.

    Only the CPU generator: ``torch.manual_seed`` would also reseed every CUDA generator.
    """
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _pipeline(
    augment: str,
    size: int,
    random_erasing: float,
    interpolation: str,
    hflip: float | None = None,
    vflip: float = 0.0,
    crop_scale: tuple[float, float] | None = None,
) -> list:
    """The steps of ``augment``; ``hflip``/``crop_scale`` left None are the preset's (``AUGMENT_VIEW``)."""
    preset_hflip, _, preset_crop = AUGMENT_VIEW[augment]
    hflip = preset_hflip if hflip is None else hflip
    crop_scale = preset_crop if crop_scale is None else crop_scale
    mode = v2.InterpolationMode(interpolation)  # the model's, as for every other resize of the run
    steps = []
    if crop_scale is not None:
        steps.append(v2.RandomResizedCrop(size, scale=tuple(crop_scale), interpolation=mode, antialias=True))
    # A flip of probability 0 is left out rather than kept as a no-op: a no-op would still take a draw.
    if hflip > 0:  # letters, digits and text change meaning mirrored: --hflip 0 keeps them as they are
        steps.append(v2.RandomHorizontalFlip(p=hflip))
    if vflip > 0:  # aerial and microscopy images have no "up"
        steps.append(v2.RandomVerticalFlip(p=vflip))
    if augment in ("trivial", "randaugment"):
        steps.append(v2.TrivialAugmentWide() if augment == "trivial" else v2.RandAugment())
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing))
    return steps


class SampleAugment:
    """uint8 [3,H,W] -> uint8 [3,S,S] for one training sample, repeatable per (seed, epoch, index).

    ``resizes`` says whether the pipeline itself brings the image to size (a random crop does),
    so the dataset may hand it the decoded image at full size.
    """

    def __init__(
        self,
        augment: str,
        size: int,
        seed: int,
        random_erasing: float = 0.0,
        interpolation: str = "bilinear",
        **view,  # hflip, vflip, crop_scale: see _pipeline
    ):
        steps = _pipeline(augment, size, random_erasing, interpolation, **view)
        self.transform, self.seed = v2.Compose(steps), seed
        self.resizes = any(isinstance(step, v2.RandomResizedCrop) for step in steps)

    def __call__(self, img: torch.Tensor, index: int) -> torch.Tensor:
        # A first draw keeps the seed it had before repeats existed, so plain epochs augment as they did.
        draw = getattr(index, "draw", 0)
        parts = (self.seed, getattr(index, "epoch", 0), int(index), *((draw,) if draw else ()))
        with seeded(derive_seed(*parts)):
            return self.transform(img)


def sample_augment(
    augment: str,
    size: int,
    seed: int,
    random_erasing: float = 0.0,
    interpolation: str = "bilinear",
    *,
    hflip: float | None = None,
    vflip: float = 0.0,
    crop_scale: tuple[float, float] | None = None,
) -> SampleAugment | None:
    """The training transform, or None when nothing random is asked for."""
    view = {"hflip": hflip, "vflip": vflip, "crop_scale": crop_scale}
    if not _pipeline(augment, size, random_erasing, interpolation, **view):
        return None
    return SampleAugment(augment, size, seed, random_erasing, interpolation, **view)


class BatchMix:
    """Mixup / CutMix on a normalised batch on the device, labels -> soft targets [B, classes].

    Samples are mixed in neighbouring pairs (0 with 1, 2 with 3, ...), each pair with its own
    draw seeded from (seed, epoch, the pair's position in the epoch): a global batch then mixes
    alike whether one process reads it or N read a part each (each part has an even size).
    Unreadable samples get an all-zero target, so they add nothing to the loss.

    Multi-hot labels [B, K] (multi-label data) mix the same way: v2 mixes a pair's indices 0 and 1 as
    two classes, which gives each output row the share of each image in it (mixup's lambda, or cutmix's
    area), and the pair's label rows are mixed with those shares. An unreadable sample keeps its row of
    UNREADABLE (an all-zero row is an image without labels) and counts as unlabelled in its partner.
    """

    def __init__(
        self,
        num_classes: int,
        mixup: float,
        cutmix: float,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        task: tasks.Task = tasks.SINGLE_LABEL,
    ):
        self.task = task  # how a pair's labels mix, and what an unreadable sample's target is
        mixed = task.mixed_classes(num_classes)
        kinds = ([v2.MixUp(alpha=mixup, num_classes=mixed)] if mixup > 0 else []) + (
            [v2.CutMix(alpha=cutmix, num_classes=mixed)] if cutmix > 0 else []
        )
        # With both, each pair uses one of them (as timm and torchvision's reference do).
        self.mix = v2.RandomChoice(kinds) if len(kinds) > 1 else kinds[0]
        self.num_classes, self.seed, self.rank, self.world = num_classes, seed, rank, world_size

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int):
        task = self.task
        batch = images.shape[0]
        first = (step * self.world + self.rank) * batch  # this batch's first position in the epoch
        out_x, out_y = [], []
        for j in range(0, batch, 2):
            with seeded(derive_seed(self.seed, epoch, first + j, 1)):
                x, y = task.mix_pair(self.mix, images[j : j + 2], labels[j : j + 2])
            out_x.append(x)
            out_y.append(y)
        return torch.cat(out_x), task.mixed_targets(labels, torch.cat(out_y))
