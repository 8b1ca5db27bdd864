"""Loader throughput: visiontune's pipeline and its cache against the blog's PIL pipeline.

Same JPEGs (synthetic, 300-500 px, like Kaggle's), 224 px output, batch 50,
one loader worker each, persistent workers for all three so that the figure is
the per-image pipeline cost and not worker start-up. visiontune's batches are
uint8 and are normalised on the device, inside the model step; the
``*_cpu_normalize`` figures add that step in the consuming process
(``DeviceNormalize`` on the CPU), as a CPU-only run does, to end where the
blog's loader ends: normalised floats.

The ``--decode`` rows compare ``--decode fast`` with ``exact`` (and the blog's pipeline) at 64,
128 and 224 px on the same JPEGs: at 64 px every file is decoded at a quarter or an eighth of its
size, at 128 px at a half, at 224 px only the files at least 448 px on both sides, at a half.
Beside the loaders' images/s, ``decode_cpu_ms`` is the CPU time per image of decode + resize
alone, one thread in this process (``time.process_time``, interleaved and repeated as the rest):
on a machine shared with other work, CPU time moves far less than wall time.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.utils.data import DataLoader

from common import WORK, BlogDataset, image_paths, interleave, sample_data, timed, write_result
from visiontune.data.decode import try_read
from visiontune.loading.cache import CachedDataset, open_or_build
from visiontune.loading.pipeline import DeviceNormalize, ImageDataset, make_loader

SIZE, BATCH, PER_CLASS = 224, 50, 100
DECODE_SIZES = (64, 128, 224)


def drain(loader, normalize=None) -> int:
    n = 0
    for images, labels in loader:
        if normalize is not None:
            images = normalize(images)
        n += len(labels)
    return n


def decode_rate(paths: list[str], size: int, decode: str) -> float:
    """Images per CPU second of decode + resize, in this process on one thread."""
    start = time.process_time()
    for p in paths:
        try_read(p, size, decode=decode)
    return len(paths) / (time.process_time() - start)


def pixel_diffs(paths: list[str]) -> dict:
    """Max and mean |fast - exact| in grey levels per target size, over every pixel of every file."""
    out = {}
    for size in DECODE_SIZES:
        d = torch.stack([(try_read(p, size, decode="fast").int() - try_read(p, size).int()).abs() for p in paths])
        out[size] = {"max": int(d.max()), "mean": round(float(d.float().mean()), 3)}
    return out


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
    candidates = {
        "blog_pil": lambda: timed(lambda: drain(blog)),
        "visiontune": lambda: timed(lambda: drain(ours)),
        "visiontune_cache": lambda: timed(lambda: drain(cached)),
        "visiontune_cpu_normalize": lambda: timed(lambda: drain(ours, normalize)),
        "visiontune_cache_cpu_normalize": lambda: timed(lambda: drain(cached, normalize)),
    }
    for size in DECODE_SIZES:
        for decode in ("exact", "fast"):
            ds = ImageDataset(paths, labels, size, decode=decode)
            loader = make_loader(ds, BATCH, train=True, seed=0, num_workers=1, pin_memory=False)
            candidates[f"{decode}_{size}"] = lambda loader=loader: timed(lambda: drain(loader))
        if size != SIZE:
            small = DataLoader(
                BlogDataset(paths, size), batch_size=BATCH, shuffle=True, num_workers=1, persistent_workers=True
            )
            candidates[f"blog_{size}"] = lambda small=small: timed(lambda: drain(small))
    res = interleave(candidates)
    res[f"blog_{SIZE}"] = res["blog_pil"]
    cpu = interleave(
        {
            f"{decode}_{size}": lambda size=size, decode=decode: decode_rate(paths, size, decode)
            for size in DECODE_SIZES
            for decode in ("exact", "fast")
        }
    )
    decode_rows = {
        size: {
            "fast_vs_exact": res[f"fast_{size}"]["median"] / res[f"exact_{size}"]["median"],
            "fast_vs_blog": res[f"fast_{size}"]["median"] / res[f"blog_{size}"]["median"],
            "exact_vs_blog": res[f"exact_{size}"]["median"] / res[f"blog_{size}"]["median"],
            "cpu_fast_vs_exact": cpu[f"fast_{size}"]["median"] / cpu[f"exact_{size}"]["median"],
        }
        for size in DECODE_SIZES
    }
    base = res["blog_pil"]["median"]
    out = {
        "what": f"loader images/s, {len(paths)} JPEGs 300-500 px -> {SIZE} px, batch {BATCH}, 1 worker each; "
        "visiontune's batches are uint8 (normalised on the device); the *_cpu_normalize rows also "
        "normalise them in the consuming process, as a CPU-only run does",
        "images_per_s": res,
        **{f"ratio_{k}_vs_blog": res[k]["median"] / base for k in res if k.startswith("visiontune")},
        "decode": decode_rows,
        "decode_cpu_ms": {k: 1000 / v["median"] for k, v in cpu.items()},
        "fast_vs_exact_grey_levels": pixel_diffs(paths),
        "decode_images_per_cpu_s": cpu,
        "targets": {"ratio_visiontune_vs_blog": 2.5, "ratio_visiontune_cache_vs_blog": 10.0},
    }
    print(
        f"loader: blog {base:.0f} img/s; "
        + ", ".join(
            f"{k} {res[k]['median']:.0f} ({res[k]['median'] / base:.2f}x)" for k in res if k.startswith("visiontune")
        )
    )
    for size, r in decode_rows.items():
        print(
            f"loader {size} px: fast {res[f'fast_{size}']['median']:.0f}, exact {res[f'exact_{size}']['median']:.0f}, "
            f"blog {res[f'blog_{size}']['median']:.0f} img/s; fast/exact {r['fast_vs_exact']:.2f}x; decode + resize "
            f"CPU ms/image fast {1000 / cpu[f'fast_{size}']['median']:.2f}, exact "
            f"{1000 / cpu[f'exact_{size}']['median']:.2f} ({r['cpu_fast_vs_exact']:.2f}x)"
        )
    write_result("loader", out)


if __name__ == "__main__":
    sys.exit(main())
