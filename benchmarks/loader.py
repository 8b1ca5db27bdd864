"""Loader throughput: visiontune's pipeline and its cache against the blog's PIL pipeline.

Same JPEGs (synthetic, 300-500 px, like Kaggle's), 224 px output, batch 50,
one loader worker each, persistent workers for all three so that the figure is
the per-image pipeline cost and not worker start-up. visiontune's batches are
uint8 and are normalised on the device, inside the model step; the
``*_cpu_normalize`` figures add that step in the consuming process
(``DeviceNormalize`` on the CPU), as a CPU-only run does, to end where the
blog's loader ends: normalised floats.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader

from common import WORK, BlogDataset, image_paths, interleave, sample_data, timed, write_result
from visiontune.data.cache import CachedDataset, open_or_build
from visiontune.data.pipeline import DeviceNormalize, ImageDataset, make_loader

SIZE, BATCH, PER_CLASS = 224, 50, 100


def drain(loader, normalize=None) -> int:
    n = 0
    for images, labels in loader:
        if normalize is not None:
            images = normalize(images)
        n += len(labels)
    return n


def main() -> None:
    torch.set_num_threads(1)  # the consumer; each loader worker is one more process
    paths = image_paths(sample_data(PER_CLASS))
    labels = [int(os.path.basename(p).startswith("dog")) for p in paths]
    cache = open_or_build(str(WORK / "cache"), paths, SIZE)
    normalize = DeviceNormalize(torch.device("cpu"))
    blog = DataLoader(BlogDataset(paths, SIZE), batch_size=BATCH, shuffle=True, num_workers=1, persistent_workers=True)
    ours = make_loader(ImageDataset(paths, labels, SIZE), BATCH, train=True, seed=0, num_workers=1, pin_memory=False)
    cached = make_loader(
        CachedDataset(cache, range(len(paths)), labels), BATCH, train=True, seed=0, num_workers=1, pin_memory=False
    )
    res = interleave(
        {
            "blog_pil": lambda: timed(lambda: drain(blog)),
            "visiontune": lambda: timed(lambda: drain(ours)),
            "visiontune_cache": lambda: timed(lambda: drain(cached)),
            "visiontune_cpu_normalize": lambda: timed(lambda: drain(ours, normalize)),
            "visiontune_cache_cpu_normalize": lambda: timed(lambda: drain(cached, normalize)),
        }
    )
    base = res["blog_pil"]["median"]
    out = {
        "what": f"loader images/s, {len(paths)} JPEGs 300-500 px -> {SIZE} px, batch {BATCH}, 1 worker each; "
        "visiontune's batches are uint8 (normalised on the device); the *_cpu_normalize rows also "
        "normalise them in the consuming process, as a CPU-only run does",
        "images_per_s": res,
        **{f"ratio_{k}_vs_blog": res[k]["median"] / base for k in res if k != "blog_pil"},
        "targets": {"ratio_visiontune_vs_blog": 2.5, "ratio_visiontune_cache_vs_blog": 10.0},
    }
    print(
        f"loader: blog {base:.0f} img/s; "
        + ", ".join(f"{k} {res[k]['median']:.0f} ({res[k]['median'] / base:.2f}x)" for k in res if k != "blog_pil")
    )
    write_result("loader", out)


if __name__ == "__main__":
    sys.exit(main())
