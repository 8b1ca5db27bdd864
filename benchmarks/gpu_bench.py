"""VGG16 training images/s on one CUDA GPU, through visiontune's own Accelerator, prepare and loop.

``benchmarks/gpu.sh`` runs this. Each precision mode runs in its own process
(Accelerate fixes mixed precision once per process): fp32 (TF32 tensor cores,
as visiontune allows them), bf16, bf16 + channels-last, bf16 + channels-last +
torch.compile. Each mode is measured from synthetic uint8 batches already on
the GPU (the model's ceiling) and from the uint8 cache through loader workers
(what the input pipeline lets it reach); the modes of ``--file-modes`` (bf16 +
channels-last) also from the JPEG files themselves, every epoch: decoded by the
loader workers (``--decode exact --cache off``) and decoded on the GPU in batches
(``--decode device``, nvJPEG). Every row of a mode carries its ratio to that
mode's cached row. VGG16 training costs about 93 GFLOP
per 224 px image (3x the 31 GFLOP forward pass), so images/s x 93 GFLOP over the
GPU's dense peak (a small table below, by name) is the share of peak reached.
``--smoke`` runs the same code tiny on a CPU, for the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GFLOP_PER_IMAGE = 93.0
# Dense tensor-core peaks, TFLOP/s: (bf16, tf32). SXM parts; PCIe cards are lower.
PEAKS = {
    "H200": (989.0, 494.7),
    "H100": (989.0, 494.7),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "L4": (121.0, 60.0),
    "A10": (125.0, 62.5),
}
MODES = {
    "fp32": ("no", False, False),
    "bf16": ("bf16", False, False),
    "bf16-channels-last": ("bf16", True, False),
    "bf16-channels-last-compile": ("bf16", True, True),
}


def peak_tflops(gpu: str, mode: str) -> float | None:
    for name, (bf16, tf32) in PEAKS.items():  # order matters: "L40S" before "L4", "A100" before "A10"
        if name in gpu:
            return tf32 if mode == "fp32" else bf16
    return None


def measure(args, mode: str) -> list[dict]:
    """In this process: one mode, every source."""
    import torch

    from visiontune.cluster.strategy import ProcessSettings, make_accelerator, prepare, resolve_threads
    from visiontune.data.sources import discover
    from visiontune.loading.cache import CachedDataset, open_or_build
    from visiontune.loading.devicedecode import DeviceDecodeDataset
    from visiontune.loading.pipeline import DeviceNormalize, ImageDataset, make_loader
    from visiontune.models.build import build_model
    from visiontune.settings.config import TrainConfig
    from visiontune.tasks import AUTO
    from visiontune.training.engine import Learner, LoopOptions, train_one_epoch

    precision, channels_last, compile_ = MODES[mode]
    cfg = TrainConfig(
        data=args.data,
        model=args.model,
        weights="none",
        image_size=args.image_size,
        batch_size=args.batch,
        mixed_precision=precision,
        channels_last=channels_last,
        compile=compile_,
        progress=False,
    )
    accelerator = make_accelerator(ProcessSettings.of(cfg))
    device = accelerator.device
    images = discover(args.data, task=AUTO)
    cache = open_or_build(args.cache, images.paths, args.image_size)
    cores = resolve_threads(cfg, args.workers if args.workers >= 0 else None)
    workers = cores.loader_workers
    datasets = {"cache": CachedDataset(cache, range(len(images)), images.labels)}
    if mode in args.file_modes.split(","):
        # The files as `train --cache off` reads them: --decode exact (the workers decode and resize),
        # --decode device (the workers read bytes; the training process decodes on the GPU).
        for source, kind in (("files-cpu", ImageDataset), ("files-device", DeviceDecodeDataset)):
            datasets[source] = kind(images.paths, images.labels, args.image_size, report=False, threads=cores.decode)
    loaders = [
        make_loader(ds, args.batch, train=True, seed=0, num_workers=workers, pin_memory=device.type == "cuda")
        for ds in datasets.values()
    ]
    model = build_model(args.model, 2, "none")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, optimizer, loaders = prepare(accelerator, cfg, model, optimizer, *loaders)
    loaders = dict(zip(datasets, loaders))
    learner = Learner(model, optimizer, None, DeviceNormalize(device, channels_last))
    x = torch.randint(0, 256, (args.batch, 3, args.image_size, args.image_size), dtype=torch.uint8, device=device)
    y = torch.randint(0, 2, (args.batch,), device=device)
    results, opts = [], LoopOptions(epochs=1, progress=False)
    for source in ("synthetic", *loaders):

        def epoch(steps: int):
            if source == "synthetic":  # noqa: B023 -- epoch() is called within this iteration only
                return train_one_epoch(accelerator, learner, [(x, y)] * steps, opts)
            loader = loaders[source]  # noqa: B023
            loader.set_epoch(len(results))
            return train_one_epoch(accelerator, learner, loader, opts)

        epoch(args.warmup)  # compile, cuDNN autotuning, loader workers starting
        if device.type == "cuda":
            torch.cuda.synchronize()
        r = epoch(args.steps)  # train_one_epoch ends on an .item(): its time includes the GPU's work
        ips = r.images_per_s
        peak = peak_tflops(args.gpu, mode)
        tflops = ips * GFLOP_PER_IMAGE / 1000 * (args.image_size / 224) ** 2
        results.append(
            {
                "mode": mode,
                "source": source,
                "images_per_s": round(ips, 1),
                "images": r.images,
                "achieved_tflops": round(tflops, 1),
                "share_of_peak": round(tflops / peak, 3) if peak else None,
                "peak_tflops": peak,
            }
        )
        share = f"{tflops / peak:.1%} of {peak:g} TFLOP/s peak" if peak else "peak unknown for this GPU"
        print(f"{mode:28s} {source:12s} {ips:8.1f} img/s  {tflops:6.1f} TFLOP/s  {share}", flush=True)
    cached = next(r["images_per_s"] for r in results if r["source"] == "cache")
    for r in results:  # the share of the cached input's rate each source keeps
        r["ratio_to_cache"] = round(r["images_per_s"] / cached, 3)
    print("  ratio to cache: " + ", ".join(f"{r['source']} {r['ratio_to_cache']:.2f}" for r in results), flush=True)
    return results


def prepare_data(args) -> None:
    from visiontune.data.sample import make_sample_data
    from visiontune.data.sources import discover
    from visiontune.loading.cache import open_or_build
    from visiontune.tasks import AUTO

    if not Path(args.data, "train").is_dir():
        make_sample_data(args.data, per_class=args.images // 2, test_count=0, seed=0)
    t0 = time.perf_counter()
    open_or_build(args.cache, discover(args.data, task=AUTO).paths, args.image_size)
    print(
        f"cache of {args.images} images at {args.image_size} px ready in {time.perf_counter() - t0:.1f} s", flush=True
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    p.add_argument("--work", default="/tmp/visiontune-gpu-bench")
    p.add_argument("--model", default="vgg16")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--workers", type=int, default=-1, help="loader workers (default: visiontune's auto)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--file-modes",
        default="bf16-channels-last",
        help="modes also measured from the JPEG files: workers decoding, and --decode device",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this mode in this process
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of the same code (tests)")
    args = p.parse_args()
    if args.smoke:
        args.model, args.image_size, args.batch, args.images, args.steps, args.warmup = "resnet18", 32, 4, 16, 2, 1
    args.data, args.cache = os.path.join(args.work, f"data-{args.images}"), os.path.join(args.work, "cache")
    import torch

    args.gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if args.one:
        print("RESULT " + json.dumps(measure(args, args.one)), flush=True)
        return 0
    prepare_data(args)
    rows = []
    for mode in args.modes.split(","):
        # Its own process per mode; a failure (or out of memory) in one mode does not lose the others.
        cmd = [sys.executable, __file__, "--one", mode, *sys.argv[1:]]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        found = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        print("\n".join(ln for ln in done.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
        rows += json.loads(found[-1][7:]) if found else [{"mode": mode, "error": f"exit code {done.returncode}"}]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "gpu": args.gpu,
                    "model": args.model,
                    "image_size": args.image_size,
                    "batch": args.batch,
                    "gflop_per_image_at_224": GFLOP_PER_IMAGE,
                    "torch": torch.__version__,
                    "results": rows,
                },
                indent=2,
            )
            + "\n"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
