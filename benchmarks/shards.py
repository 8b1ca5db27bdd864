"""Shards against the folder they were made from: the loader's images/s, one process, same images.

``visiontune shard`` writes the synthetic JPEGs (``sample-data``, 300-500 px) into
WebDataset tar shards; both loaders then run visiontune's own pipeline (decode,
resize to SIZE, seeded epoch permutation) with no loader workers and one decode
thread, so the figure is the cost of reading a sample: ``open``+``read`` of a file
against one ``pread`` at an indexed offset of a shard. Both read through the OS
page cache, warm after the warm-up round (dropping it needs root): the ratio is
the per-sample overhead of each format, not disk throughput. Set VT_SHARDS_PER_CLASS
for a larger set (default 1000: 2,000 images).
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

from common import WORK, interleave, sample_data, timed, write_result
from visiontune.data.layouts import discover
from visiontune.data.pipeline import ImageDataset, make_loader
from visiontune.data.shards import write

SIZE, BATCH = 64, 50
PER_CLASS = int(os.environ.get("VT_SHARDS_PER_CLASS", "1000"))


def loader(images):
    dataset = ImageDataset(images.paths, images.labels, SIZE, report=False, reader=images.reader)
    return make_loader(dataset, BATCH, train=True, seed=0, num_workers=0, pin_memory=False)


def drain(batches) -> int:
    return sum(len(labels) for _, labels in batches)


def main() -> None:
    torch.set_num_threads(1)
    data = sample_data(PER_CLASS)
    out = WORK / f"shards-{PER_CLASS}"
    if not (out / "index.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        write(str(data), str(out), "64MB")
    folder, shards = discover(str(data)), discover(str(out))
    assert len(folder) == len(shards)
    res = interleave(
        {"folder": lambda: timed(lambda: drain(loader(folder))), "shards": lambda: timed(lambda: drain(loader(shards)))}
    )
    tars = sorted(out.glob("*.tar"))
    megabytes = sum(t.stat().st_size for t in tars) / 1e6
    result = {
        "what": f"loader images/s, 1 process, no workers, 1 decode thread: {len(folder)} JPEGs 300-500 px -> "
        f"{SIZE} px, batch {BATCH}, from the folder and from {len(tars)} shards ({megabytes:.0f} MB) made of it "
        "by `visiontune shard`; page cache warm for both (no drop_caches without root)",
        "images_per_s": res,
        "ratio_shards_vs_folder": res["shards"]["median"] / res["folder"]["median"],
    }
    print(
        f"shards: folder {res['folder']['median']:.0f} img/s, shards {res['shards']['median']:.0f} img/s "
        f"({result['ratio_shards_vs_folder']:.2f}x)"
    )
    write_result("shards", result)


if __name__ == "__main__":
    sys.exit(main())
