"""Images/s from shards in an S3 bucket (moto's S3 server on 127.0.0.1, in its own process) against the same
shards on local disk: listing the data and reading every sample's image bytes in a seeded random order,
as an epoch's loader asks for them (decoding, the same for both, is left out).

Three candidates, interleaved (``common.interleave``):

- ``local``: ``--data DIR`` of the shards on disk (their walked index kept in the cache after the warm-up);
- ``s3_cold``: ``--data s3://bench/shards/`` with an empty shard cache: the prefix listed and every shard
  copied (16 MiB ranged GETs, 16 objects at once), walked, then read from the copies;
- ``s3_cached``: the same URL with the shard cache of an earlier round: no request, read from the copies.

Not in ``make bench`` (it needs the dev extra's moto). Run: ``python benchmarks/s3_shards.py`` (``VT_S3_N``
images of ``VT_S3_PX`` px, default 20,000 of 96 px, in 64 MB shards).
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

from common import WORK, interleave, write_result
from visiontune.data import sources
from visiontune.data.shardwriter import write
from visiontune.tasks import AUTO

N = int(os.environ.get("VT_S3_N", "20000"))
PX = int(os.environ.get("VT_S3_PX", "96"))
BASES = 64


def make_shards() -> str:
    """N JPEGs (cat.i.jpg / dog.i.jpg, PX px) written as 64 MB shards with their index; made once."""
    out = WORK / f"s3-shards-{N}-{PX}"
    if (out / "shards" / "index.json").exists():
        return str(out / "shards")
    shutil.rmtree(out, ignore_errors=True)
    (out / "data" / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    bases = []
    for _ in range(BASES):  # smooth gradients plus noise: JPEGs of a photo's size per pixel
        y, x = np.mgrid[0:PX, 0:PX]
        img = (x[..., None] * rng.uniform(0.5, 2, 3) + y[..., None] * rng.uniform(0.5, 2, 3)) % 256
        img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=85)
        bases.append(buf.getvalue())
    for i in range(N):
        (out / "data" / "train" / f"{('cat', 'dog')[i % 2]}.{i // 2}.jpg").write_bytes(bases[i % BASES])
    write(str(out / "data"), str(out / "shards"), "64MB")
    return str(out / "shards")


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto's server did not start")


def epoch(data: str) -> float:
    """Images/s: list ``data`` and read every sample's image bytes in a seeded random order."""
    start = time.perf_counter()
    images = sources.discover(data, task=AUTO)
    n = 0
    for i in np.random.default_rng(0).permutation(len(images)).tolist():
        n += len(images.reader[i]) > 0
    return n / (time.perf_counter() - start)


def main() -> None:
    local = make_shards()
    server, endpoint = start_server()
    caches = tempfile.mkdtemp(prefix="vt-s3-bench-")
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
    )
    try:
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bench")
        for name in sorted(os.listdir(local)):
            fs.put_file(os.path.join(local, name), f"bench/shards/{name}")
        url, rounds = "s3://bench/shards/", iter(range(10**6))

        def cold() -> float:
            os.environ["VISIONTUNE_SHARD_CACHE"] = os.path.join(caches, f"cold-{next(rounds)}")
            return epoch(url)

        def cached() -> float:
            os.environ["VISIONTUNE_SHARD_CACHE"] = os.path.join(caches, "kept")
            return epoch(url)

        result = interleave({"local": lambda: epoch(local), "s3_cold": cold, "s3_cached": cached})
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(caches, ignore_errors=True)
    shards = [n for n in os.listdir(local) if n.endswith(".tar")]
    size = sum(os.path.getsize(os.path.join(local, n)) for n in shards)
    write_result("s3_shards", {"images": N, "px": PX, "shards": len(shards), "bytes": size, "images_per_s": result})
    for name, r in result.items():
        print(f"{name:10s} {r['median']:10.0f} images/s  {r['samples']}")


if __name__ == "__main__":
    main()
