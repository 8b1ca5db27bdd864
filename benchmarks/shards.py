"""Shards against the folder they were made from: images/s, cold and warm page cache, 1 and 2 processes;
and the start-up of a training run on a 100k-sample shard set.

Read rate. A Kaggle-layout folder of VT_SHARDS_N (25,000) synthetic JPEGs, VT_SHARDS_PX px
(96: small, so a pass over the set fits this machine's time and reading is a visible share
of the cost), and the shards ``visiontune shard`` writes of it (64 MB each). A "loader" pass
reads VT_SHARDS_LOADER_SAMPLES (5,000: to fit the time) samples drawn at random from the
whole set in visiontune's loader (``ImageDataset`` + the seeded epoch sampler, no loader
workers, one decode thread, decode and resize to 64 px, batch 50); a "bytes" pass reads
every sample's bytes and decodes none (``open``+``read`` of a file against one ``pread`` at
the indexed offset of a shard): the I/O alone. With 2 processes (forked after the listing,
started together) each reads half, in its own order, as DDP ranks do.
"cold": before the pass every file of that format is dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed; ``fincore`` checks it worked and the
result records the resident share after it); the kernel's dentry and inode caches stay warm
(dropping them needs root), and on a virtual machine the host may still cache the disk.
"warm": the same pass again with the files in the page cache. The passes are interleaved
(folder, shards, folder, shards, ...) and the figures are medians of VT_SHARDS_REPEATS (3)
rounds after none (cold needs no warm-up; warm passes follow a cold pass of the same files).

Start-up. ``visiontune train`` (squeezenet1_1, 32 px) to its first step on VT_SHARDS_STARTUP_N
(100,000) samples, as shards written by ``visiontune shard`` and as the folder they came
from -- ``startup.py``'s ImageFolder of 1,000 classes of hard links to 64 tiny JPEGs (16 px:
start-up is listing, indexing and the bad-file screen, not decoding big images): seconds to
the first step and peak RSS of the job, cold (no scan cache, no shard index) and warm.
VT_SHARDS_PARTS picks ``read`` and/or ``startup``.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common import RESULTS, WORK, write_result
from visiontune.data.shardwriter import write
from visiontune.data.sources import discover
from visiontune.loading.pipeline import ImageDataset, make_loader
from visiontune.tasks import AUTO

N = int(os.environ.get("VT_SHARDS_N", "25000"))
PX = int(os.environ.get("VT_SHARDS_PX", "96"))
REPEATS = int(os.environ.get("VT_SHARDS_REPEATS", "3"))
LOADER_SAMPLES = int(os.environ.get("VT_SHARDS_LOADER_SAMPLES", "5000"))
STARTUP_N = int(os.environ.get("VT_SHARDS_STARTUP_N", "100000"))
PARTS = os.environ.get("VT_SHARDS_PARTS", "read,startup").split(",")
SIZE, BATCH, BASES = 64, 50, 256


def make_folder() -> Path:
    """N JPEGs (cat.i.jpg / dog.i.jpg), PX px, each its own file (its own page-cache pages); made once."""
    out = WORK / f"shards-read-{N}-{PX}"
    if (out / ".done").exists():
        return out / "data"
    shutil.rmtree(out, ignore_errors=True)
    (out / "data" / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    bases = []
    for _ in range(BASES):  # smooth gradients plus noise: JPEGs of a photo's size per pixel, not of noise
        y, x = np.mgrid[0:PX, 0:PX]
        img = (x[..., None] * rng.uniform(0.5, 2, 3) + y[..., None] * rng.uniform(0.5, 2, 3)) % 256
        img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=85)
        bases.append(buf.getvalue())
    for i in range(N):
        label = ("cat", "dog")[i % 2]
        (out / "data" / "train" / f"{label}.{i // 2}.jpg").write_bytes(bases[i % BASES])
    os.sync()  # dirty pages cannot be dropped from the page cache
    (out / ".done").touch()
    return out / "data"


def make_shards(data: Path, out: Path) -> Path:
    if not (out / "index.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        write(str(data), str(out), "64MB")
        os.sync()
    return out


def evict(files: list[str]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(files: list[str]) -> float | None:
    """The share of these files' bytes in the page cache (``fincore``), or None without fincore."""
    if not shutil.which("fincore"):
        return None
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "-o", "RES,SIZE", *files], capture_output=True)
    pairs = [line.split() for line in done.stdout.decode().splitlines() if line.strip()]
    res, size = sum(int(r) for r, _ in pairs), sum(int(s) for _, s in pairs)
    return min(res / max(size, 1), 1.0)  # whole pages: a file's last page counts in full


def _read(images, idx, rank: int, world: int, what: str, barrier, counts) -> None:
    torch.set_num_threads(1)
    share = images.take(idx[rank::world])
    barrier.wait()
    if what == "bytes":
        order = torch.randperm(len(share), generator=torch.Generator().manual_seed(rank)).tolist()
        n = 0
        for i in order:
            if share.reader is None:
                with open(share.paths[i], "rb") as f:
                    n += len(f.read()) > 0
            else:
                n += len(share.reader[i]) > 0
    else:
        dataset = ImageDataset(share.paths, share.labels, SIZE, report=False, reader=share.reader)
        loader = make_loader(dataset, BATCH, train=True, seed=rank, num_workers=0, pin_memory=False)
        n = sum(len(labels) for _, labels in loader)
    counts[rank] = n


def rate(images, world: int, what: str) -> float:
    """Images/s of ``world`` forked processes reading their shares of ``images`` together (the loader: of
    the first LOADER_SAMPLES of a seeded permutation, drawn from the whole set)."""
    idx = np.arange(len(images))
    if what == "loader":
        idx = np.sort(np.random.default_rng(0).permutation(len(images))[:LOADER_SAMPLES])
    ctx = multiprocessing.get_context("fork")
    barrier, counts = ctx.Barrier(world + 1), ctx.Array("q", world)
    procs = [ctx.Process(target=_read, args=(images, idx, r, world, what, barrier, counts)) for r in range(world)]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.perf_counter()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return sum(counts) / (time.perf_counter() - start)


def read_rates() -> dict:
    data = make_folder()
    shards = make_shards(data, WORK / f"shards-read-{N}-{PX}" / "shards")
    sets = {"folder": discover(str(data), task=AUTO), "shards": discover(str(shards), task=AUTO)}
    assert len(sets["folder"]) == len(sets["shards"]) == N
    files = {
        "folder": [str(p) for p in sets["folder"].paths],
        "shards": sorted(str(p) for p in shards.glob("*.tar")),
    }
    sizes = {k: sum(os.path.getsize(f) for f in v) for k, v in files.items()}
    rows: dict[str, list[float]] = {}
    after_evict: dict[str, list[float]] = {}
    for r in range(REPEATS):
        for what in ("loader", "bytes"):
            for world in (1, 2):
                for fmt in ("folder", "shards"):
                    evict(files[fmt])
                    share = resident(files[fmt][:: max(1, len(files[fmt]) // 500)])
                    if share is not None:
                        after_evict.setdefault(fmt, []).append(share)
                    for temp in ("cold", "warm"):
                        key = f"{what} {world}p {temp} {fmt}"
                        rows.setdefault(key, []).append(rate(sets[fmt], world, what))
                        print(f"shards: round {r + 1}/{REPEATS} {key}: {rows[key][-1]:.0f} img/s", flush=True)
    medians = {k: statistics.median(v) for k, v in rows.items()}
    table = []
    for what in ("loader", "bytes"):
        for world in (1, 2):
            for temp in ("cold", "warm"):
                f, s = (medians[f"{what} {world}p {temp} {fmt}"] for fmt in ("folder", "shards"))
                paired = zip(*(rows[f"{what} {world}p {temp} {fmt}"] for fmt in ("folder", "shards")))
                table.append(
                    {
                        "read": what,
                        "processes": world,
                        "page_cache": temp,
                        "folder_images_per_s": round(f),
                        "shards_images_per_s": round(s),
                        "ratio_shards_vs_folder": round(s / f, 3),
                        "ratio_each_round": [round(b / a, 2) for a, b in paired],
                    }
                )
    return {
        "what": f"images/s reading {N:,} JPEGs ({PX} px, {sizes['folder'] / 1e6:.0f} MB) as a folder and as the "
        f"{len(files['shards'])} shards ({sizes['shards'] / 1e6:.0f} MB) `visiontune shard` made of it; loader: "
        f"{min(LOADER_SAMPLES, N):,} samples drawn from the whole set, decoded and resized to {SIZE} px, batch "
        f"{BATCH}, no workers, 1 thread per process; bytes: all {N:,} samples' bytes read, no decode; "
        f"cold: the format's files dropped from the page cache (posix_fadvise DONTNEED) before the pass; medians "
        f"of {REPEATS} interleaved rounds",
        "rows": table,
        "samples": {k: [round(x) for x in v] for k, v in rows.items()},
        "resident_share_after_evict": {k: max(v) for k, v in after_evict.items()},
    }


def startup_rows() -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import startup

    hooks = WORK / "startup-hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(startup.HOOK)
    folder = startup.make_folder(STARTUP_N)
    t = time.perf_counter()
    shards = make_shards(Path(folder), WORK / f"startup-{STARTUP_N}" / "shards")
    print(f"shards: {STARTUP_N} samples as shards ready ({time.perf_counter() - t:.0f} s)", flush=True)
    rows = []
    for fmt, data in (("folder", folder), ("shards", str(shards))):
        cache = WORK / "shards-startup-cache"
        shutil.rmtree(cache, ignore_errors=True)  # cold: no scan cache, no shard index
        for temp in ("cold", "warm"):
            r = {"data": fmt, "start": temp, **startup.start_up(data, [], str(cache), str(hooks))}
            rows.append(r)
            print(f"shards: start-up {r}", flush=True)
    return {
        "what": f"`visiontune train` to its first step on {STARTUP_N:,} samples (16 px JPEGs, 1,000 classes) as a "
        "folder and as its shards, squeezenet1_1 32 px: wall seconds, CPU seconds, peak RSS of the job's largest "
        "process; cold: no scan cache and no shard index; warm: the same run again",
        "rows": rows,
    }


def main() -> None:
    torch.set_num_threads(1)
    result = {}
    if set(PARTS) != {"read", "startup"} and (RESULTS / "shards.json").is_file():  # keep the other part's rows
        result = {
            k: v for k, v in json.loads((RESULTS / "shards.json").read_text()).items() if k in ("read", "startup")
        }
    if "read" in PARTS:
        result["read"] = {"load_average_at_start": list(os.getloadavg()), **read_rates()}
        for row in result["read"]["rows"]:
            print(f"shards: {row}")
    if "startup" in PARTS:
        result["startup"] = {"load_average_at_start": list(os.getloadavg()), **startup_rows()}
    write_result("shards", result)


if __name__ == "__main__":
    sys.exit(main())
