"""The data of one training job: listed once, screened once per machine, the same in every process.

``visiontune train`` lists the data folder once, in the command itself; when it
starts workers it leaves the listing in a temp file named by an environment
variable (``listing``), so no worker lists the folder again. Inside the job, each machine's
local main process screens the files -- on a first run the image cache's build
(``--cache``, by default when it fits), which records the bad files itself, or
the bad-file scan when there is no cache, so every image is decoded once -- on
all of the machine's cores, while the other processes wait on the process
group's key-value store by polling it: waiting for the scan is not a hung peer,
so no collective (and no ``--timeout``) is involved however long it takes.
The local main then hands the result to the other processes of its machine in
one compact file, and every process drops the same bad files before the split.
Machines choose the default cache each by its own free space; the pixels are
the same either way.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from visiontune.cluster.host import available_cores
from visiontune.data import sources
from visiontune.data.check import (
    bad_fraction_error,
    scan,
    scan_cache_path,
    write_report,
)
from visiontune.data.imageset import ImageSet
from visiontune.data.listing import load_listing, save_listing
from visiontune.errors import UserError
from visiontune.loading.cache import CacheChoice, ImageCache, choose
from visiontune.settings.config import TrainConfig


@dataclass(frozen=True)
class JobData:
    images: ImageSet  # the usable images: the listing less the bad files
    bad: list[tuple[str, str]]  # (path, reason): the layout's rejects, then the files that do not decode
    cache: ImageCache | None = None  # --cache: the decoded images
    rows: np.ndarray | None = None  # with a cache: each usable image's row in it (int64)
    cache_choice: CacheChoice | None = None  # what --cache came to on this machine, and why (recorded)


def _screen(
    cfg: TrainConfig, images: ImageSet, meanwhile: Callable[[], None] | None = None
) -> tuple[list[tuple[str, str]], ImageCache | None, CacheChoice]:
    """The bad files (layout rejects first) and the cache as --cache chose it: each file decoded once, by the
    cache build, or by the scan when there is no cache to build. ``meanwhile``: ``prepare``'s."""
    interpolation, crop_pct = cfg.interpolation, cfg.crop_pct  # resolved (training.plan): as the loaders resize
    cache, choice = choose(
        cfg.cache,
        images.paths,
        cfg.image_size,
        available_cores(),
        interpolation=interpolation,
        crop_pct=crop_pct,
        reader=images.reader,
        decode=cfg.decode,
        meanwhile=meanwhile,
    )
    if cache is not None:
        return list(images.rejects) + [cache.bad[row] for row in sorted(cache.bad)], cache, choice
    found = scan(images.paths, workers=available_cores(), cache_path=scan_cache_path(images.root), reader=images.reader)
    return list(images.rejects) + found, None, choice


def _cache_dict(cache: ImageCache | None) -> dict | None:
    return (
        None
        if cache is None
        else {
            "array_path": cache.array_path,
            "image_size": cache.image_size,
            "count": cache.count,
            "bad": {str(r): list(pr) for r, pr in cache.bad.items()},
        }
    )


def _cache_from(d: dict | None) -> ImageCache | None:
    return (
        None
        if d is None
        else ImageCache(d["array_path"], d["image_size"], d["count"], {int(r): tuple(pr) for r, pr in d["bad"].items()})
    )


def _wait_for(store, key: str, count: int) -> None:
    # Polling, not store.wait or a barrier: both give up after the group's timeout.
    delay = 0.05
    while int(store.add(key, 0)) < count:
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)


def _once_per_machine(accelerator, step: str, work: Callable[[], str]) -> str:
    """``work()`` in the local main process of each machine, as long as it takes, while the machine's other
    processes poll the store for it; every process gets its machine's result (a short string). A failure
    there ends every process: one line for a ``UserError``, else the host and the error."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    from visiontune.cluster import launch

    prefix = f"visiontune/{step}/{launch.restart_count()}/"
    local = launch.local_world_size()
    machine = launch.group_rank(accelerator.process_index // local)
    if accelerator.is_local_main_process:
        try:
            store.set(f"{prefix}result/{machine}", work())
        except BaseException as e:
            store.set(
                f"{prefix}error",
                str(e)
                if isinstance(e, UserError)
                else f"preparing the data failed on {socket.gethostname()} ({type(e).__name__}: {e})",
            )
            raise
        finally:
            store.add(f"{prefix}ready", 1)
    _wait_for(store, f"{prefix}ready", max(1, accelerator.num_processes // local))
    if store.check([f"{prefix}error"]):
        raise UserError(store.get(f"{prefix}error").decode())
    return store.get(f"{prefix}result/{machine}").decode()


def fetch_per_machine(accelerator, data: str) -> None:
    """Data a source copies in first (shards at a URL, ``data/remote.py``): downloaded into the cache by each
    machine's local main process before any process lists them, so that the others read its copies instead
    of downloading them too."""
    source = sources.named(data) if accelerator.num_processes > 1 else None
    if source is not None and source.fetch is not None:
        _once_per_machine(accelerator, "fetch", lambda: source.fetch(data))


def _screen_per_machine(accelerator, cfg: TrainConfig, images: ImageSet):
    """(listing, bad, cache, cache choice) in every process; the local main of each machine does the work."""
    screened = {}

    def screen() -> str:
        listing = images
        screened["bad"], screened["cache"], screened["choice"] = _screen(cfg, listing)
        screened["images"] = listing
        fd, path = tempfile.mkstemp(prefix="visiontune-data-", suffix=".bin")
        os.close(fd)
        extra = {
            "bad": screened["bad"],
            "cache": _cache_dict(screened["cache"]),
            "choice": screened["choice"].to_dict(),
        }
        save_listing(listing, path, extra)
        return path

    path = _once_per_machine(accelerator, "data", screen)
    if accelerator.is_local_main_process:
        images, bad, cache, choice = screened["images"], screened["bad"], screened["cache"], screened["choice"]
    else:
        images, extra = load_listing(path, images.reading)
        bad, cache = [tuple(b) for b in extra["bad"]], _cache_from(extra["cache"])
        choice = CacheChoice(**extra["choice"])
    accelerator.wait_for_everyone()  # every process has read the file: quick, they all started together
    if accelerator.is_local_main_process:
        os.unlink(path)
    return images, bad, cache, choice


def prepare(
    accelerator, cfg: TrainConfig, run_dir: str, images: ImageSet, meanwhile: Callable[[], None] | None = None
) -> JobData:
    """The job's usable images of its one listing ``images``, the same in every process; stops the run when
    too many are bad. ``meanwhile``: work of this process's own that it may do while a forked child builds
    the image cache (``cache.choose``), in a run of one process."""
    if accelerator.num_processes > 1:
        images, bad, cache, choice = _screen_per_machine(accelerator, cfg, images)
    else:
        bad, cache, choice = _screen(cfg, images, meanwhile)
    accelerator.print(images.describe())
    report = os.path.join(run_dir, "bad_files.csv")
    problem = bad_fraction_error(len(bad), len(images.paths) + len(images.rejects), cfg.max_bad_fraction, report)
    if problem:  # stop before training; the report is what the user needs now
        if accelerator.is_main_process:
            write_report(bad, report)
        accelerator.wait_for_everyone()
        raise UserError(problem)
    if bad:
        accelerator.print(f"visiontune: skipping {len(bad)} bad file(s), listed in {report}")
    drop = {p for p, _ in bad}
    if not drop:  # the common case: no copies of the lists
        return JobData(images, bad, cache, np.arange(len(images.paths)) if cache else None, choice)
    keep = np.flatnonzero(np.fromiter((p not in drop for p in images.paths), bool, len(images.paths)))
    usable = images.take(keep)
    return JobData(usable, bad, cache, keep if cache else None, choice)


def limit(images: ImageSet, n: int | None, seed: int) -> tuple[ImageSet, dict | None]:
    """``--limit-images N``: a seeded random ``n`` of ``images`` (in listing order, the same in every
    process and every run with this seed), and what ``split.json`` records of it; all of them when n is None."""
    if n is None:
        return images, None
    if n < 1:
        raise UserError(f"--limit-images must be a positive integer, got {n}")
    total = len(images)
    keep = np.sort(np.random.default_rng([seed, 7]).permutation(total)[:n]) if n < total else np.arange(total)
    return images.take(keep), {"images": int(len(keep)), "of": total, "seed": seed}
