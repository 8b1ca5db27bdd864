"""Trainer overhead: ``visiontune.train`` against a minimal hand-written PyTorch loop.

Both train the same model (resnet18, 32 px, no pretrained weights), batch 16,
SGD with momentum, with the same intra-op threads (one, on one core), on the same images: the
decoded uint8 pixels in visiontune's cache, which the hand-written loop holds
as one in-memory tensor and visiontune reads through ``--cache`` with no loader
workers. Each repeat is a fresh 2-epoch run; the figure is the second epoch's
training images/s (the first carries one-off warm-up), as ``train_one_epoch``
times it and as the hand loop times the same span.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from common import WORK, interleave, sample_data, write_result
from visiontune.cluster.launch import cpu_budget
from visiontune.data.sources import discover
from visiontune.data.split import make_split
from visiontune.loading.cache import CachedDataset, open_or_build
from visiontune.loading.pipeline import DeviceNormalize
from visiontune.models.build import build_model
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import AUTO
from visiontune.training.trainer import train

# 480 train images (30 steps an epoch): with fewer, one-off stalls on a shared machine swing the ratio by 10%.
SIZE, BATCH, MODEL, PER_CLASS, LR = 32, 16, "resnet18", 300, 0.01


def visiontune_rate(cfg: TrainConfig) -> float:
    with tempfile.TemporaryDirectory() as out:
        train(cfg.replace(output_dir=out))
        with open(os.path.join(out, "history.json")) as f:
            return json.load(f)[1]["train"]["images_per_s"]


def hand_rate(images: torch.Tensor, labels: torch.Tensor, seed: int = 42) -> float:
    torch.manual_seed(seed)
    model = build_model(MODEL, 2, "none")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    normalize = DeviceNormalize(torch.device("cpu"))
    rate = 0.0
    for epoch in range(2):
        model.train()
        perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed + epoch))
        start, n = time.perf_counter(), 0
        for i in range(0, len(perm) - BATCH + 1, BATCH):
            idx = perm[i : i + BATCH]
            loss = F.cross_entropy(model(normalize(images[idx])), labels[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += len(idx)
        rate = n / (time.perf_counter() - start)
    return rate


def cached_images(data) -> tuple[TrainConfig, torch.Tensor, torch.Tensor]:
    """The run's config (reading visiontune's cache) and the train split's cached pixels and labels."""
    cache_dir = str(WORK / "cache")
    cfg = validate(  # as the command line's is: train takes a validated config
        TrainConfig(
            data=str(data),
            model=MODEL,
            weights="none",
            image_size=SIZE,
            epochs=2,
            batch_size=BATCH,
            lr=LR,
            num_workers=0,
            cache=cache_dir,
            progress=False,
        )
    )
    images_set = discover(str(data), task=AUTO)
    split = make_split(len(images_set), cfg.val_fraction, cfg.seed)
    cache = open_or_build(cache_dir, images_set.paths, SIZE)
    ds = CachedDataset(cache, split.train, [images_set.labels[i] for i in split.train])
    images = torch.stack([ds[i][0] for i in range(len(ds))])
    labels = torch.tensor([ds[i][1] for i in range(len(ds))])
    return cfg, images, labels


def main() -> None:
    cfg, images, labels = cached_images(sample_data(PER_CLASS))
    # One core for both: with 2 intra-op threads on cores other work also wants, OpenMP's barriers
    # stall and single runs swing 5x; one thread keeps the comparison about the loops.
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    threads = cpu_budget()  # what make_accelerator gives visiontune (1 here); the hand loop gets the same
    torch.set_num_threads(threads)
    res = interleave({"hand_loop": lambda: hand_rate(images, labels), "visiontune": lambda: visiontune_rate(cfg)})
    ratio = res["visiontune"]["median"] / res["hand_loop"]["median"]
    out = {
        "what": f"train images/s, 2nd epoch, {MODEL} {SIZE} px, batch {BATCH}, {threads} threads, "
        f"{len(labels)} train images",
        "images_per_s": res,
        "ratio_visiontune_vs_hand_loop": ratio,
        "target": 0.97,
    }
    print(
        f"overhead: hand loop {res['hand_loop']['median']:.1f} img/s, visiontune "
        f"{res['visiontune']['median']:.1f} img/s, ratio {ratio:.3f}"
    )
    write_result("overhead", out)


if __name__ == "__main__":
    sys.exit(main())
