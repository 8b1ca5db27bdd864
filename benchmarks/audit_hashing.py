"""The audit's hashing pass (``visiontune.audit.hashing.hash_all``: SHA-256, decode, thumbnail, spread)
against decoding alone (``data.decode.read_source``), in images/s on one thread, interleaved A, B, A, B
after a warm-up, median of the repeats; then the grouping of the thumbnails (all pairs).

Sets: sklearn's digits (1,797 scans as 16 px PNGs) and synthetic photo-sized JPEGs (``--photos N``,
``visiontune.data.sample``'s 300-500 px images). Not in ``make bench`` (figures in benchmarks/README.md):

    python benchmarks/audit_hashing.py --photos 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def digits(folder: Path) -> list[str]:
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    out = []
    for i, a in enumerate((d.images * (255 / 16)).astype(np.uint8)):
        path = folder / f"{i:04d}.png"
        Image.fromarray(a).resize((16, 16), Image.NEAREST).save(path)
        out.append(str(path))
    return out


def photos(folder: Path, n: int) -> list[str]:
    from visiontune.data.sample import make_sample_data

    make_sample_data(str(folder), per_class=n // 2, test_count=0, seed=0)
    return sorted(str(p) for p in folder.rglob("*.jpg"))


def rate(work, paths: list[str]) -> float:
    start = time.perf_counter()
    work(paths)
    return len(paths) / (time.perf_counter() - start)


def measure(name: str, paths: list[str], repeats: int) -> None:
    from visiontune.audit import hashing
    from visiontune.data.decode import read_source

    def decode(ps):
        for p in ps:
            read_source(p)

    kinds = {"decode alone": decode, "hash pass": hashing.hash_all}
    for work in kinds.values():  # warm-up: the page cache, the decoders' first calls
        work(paths[:50])
    seen: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for k, work in kinds.items():
            seen[k].append(rate(work, paths))
    hashes = hashing.hash_all(paths)
    start = time.perf_counter()
    hashing.groups(hashes, 0.998)
    grouping = time.perf_counter() - start
    dec, hsh = (statistics.median(seen[k]) for k in kinds)
    print(
        f"| {name} | {len(paths)} | {dec:,.0f} | {hsh:,.0f} | {hsh / dec:.2f} | {grouping:.2f} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=2000, help="synthetic JPEGs (0: digits only)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| set | images | decode alone, images/s | hash pass, images/s | ratio | grouping s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="vt-audit-bench-") as tmp:
        (Path(tmp) / "digits").mkdir()
        measure("digits, 16 px PNG", digits(Path(tmp) / "digits"), args.repeats)
        if args.photos:
            measure("synthetic JPEGs, 300-500 px", photos(Path(tmp) / "photos", args.photos), args.repeats)


if __name__ == "__main__":
    main()
