"""Sharing the machine: visiontune and a bare PyTorch loop, each alone and beside a competing job.

The competitor is another process running a 2-thread matrix-multiply loop, as a second training job
or a notebook would. Both trainers train what ``overhead.py`` trains (resnet18, 32 px, batch 16, the
cached pixels); visiontune sizes its threads itself (``launch.threads_choice``), the bare loop keeps
torch's default (one thread per core). The figure is each trainer's slowdown, alone / beside the
competitor, in second-epoch training images/s; visiontune's must be no worse than the bare loop's.
``VT_CONTENTION_PER_CLASS`` makes the data set smaller (default: ``overhead.py``'s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from common import interleave, python_env, sample_data, write_result
from overhead import BATCH, LR, MODEL, PER_CLASS, SIZE, cached_images, hand_rate, visiontune_rate

# It says "ready" once its first products are done: importing torch alone takes seconds on a busy machine.
COMPETITOR = (
    "import torch\ntorch.set_num_threads(2)\na = torch.randn(384, 384)\nfor _ in range(20):\n"
    "    a = (a @ a).clamp_(-1, 1)\nprint('ready', flush=True)\nwhile True:\n    a = (a @ a).clamp_(-1, 1)\n"
)


def beside_competitor(fn):
    def run() -> float:
        proc = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=python_env(), stdout=subprocess.PIPE, text=True)
        try:
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"the competing process ended before it started ({proc.wait()})")
            time.sleep(1)  # its threads at full speed before the timing starts
            return fn()
        finally:
            proc.kill()
            proc.wait()

    return run


def main() -> None:
    data = sample_data(int(os.environ.get("VT_CONTENTION_PER_CLASS", PER_CLASS)))
    cfg, images, labels = cached_images(data)
    cfg = cfg.replace(threads=None)
    default_threads = torch.get_num_threads()

    def bare() -> float:
        torch.set_num_threads(default_threads)  # a bare loop keeps torch's default
        return hand_rate(images, labels)

    def ours() -> float:
        return visiontune_rate(cfg)

    res = interleave(
        {
            "bare_alone": bare,
            "bare_contended": beside_competitor(bare),
            "visiontune_alone": ours,
            "visiontune_contended": beside_competitor(ours),
        }
    )
    slow = {k: res[f"{k}_alone"]["median"] / res[f"{k}_contended"]["median"] for k in ("bare", "visiontune")}
    out = {
        "what": f"train images/s, 2nd epoch, {MODEL} {SIZE} px, batch {BATCH}, lr {LR}, {len(labels)} train images, "
        "alone and beside a "
        "2-thread matmul process; slowdown = alone / contended",
        "images_per_s": res,
        "slowdown": slow,
        "target": "visiontune's slowdown <= the bare loop's",
    }
    print(f"contention: slowdown bare loop {slow['bare']:.2f}x, visiontune {slow['visiontune']:.2f}x")
    write_result("contention", out)


if __name__ == "__main__":
    sys.exit(main())
