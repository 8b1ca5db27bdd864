"""Channels-last memory on a CPU: which models train faster in it, and whether accuracy moves.

1. Speed: one training step (forward, backward, SGD) of torchvision models at 64 px in contiguous and in
   channels-last memory, the two interleaved (``common.interleave``), medians; the ratio is contiguous time
   over channels-last time (above 1: channels-last is faster). visiontune's default, ``--channels-last``
   unset, is on for the models ``models.build.depthwise_with_batchnorm`` picks; the table says which.
2. Accuracy: ``visiontune train --recipe modern`` of mobilenet_v2 at 64 px (picked: channels-last by
   default) from scratch on the recipe benchmark's digits (``recipe.py``'s data and seeded splits), the
   default against ``--no-channels-last``, test accuracy per seed. The two differ only by float rounding in
   the kernels. (mobilenet_v3_small at 32 px, the first choice, stays near chance on digits either way: its
   last feature map is 1 x 1.)

``VT_CL_SEEDS`` (default "0,1"), ``VT_CL_EPOCHS`` (default 15), ``VT_CL_MODEL`` and ``VT_CL_SIZE`` size
part 2; ``VT_CL_PARTS`` picks "speed", "accuracy" or both (a run of one part writes
``results/channels_last-<part>.json``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import torch
import torchvision

from common import WORK, interleave, python_env, write_result

MODELS = [  # (name, batch) at 64 px
    ("mobilenet_v3_small", 32),
    ("mobilenet_v2", 32),
    ("mnasnet0_5", 32),
    ("efficientnet_b0", 16),
    ("shufflenet_v2_x0_5", 32),
    ("resnet18", 16),
    ("resnet50", 8),
    ("resnext50_32x4d", 8),
    ("convnext_tiny", 8),
    ("regnet_y_400mf", 16),
    ("densenet121", 8),
    ("squeezenet1_1", 16),
    ("vgg16", 8),
]
SIZE, STEPS = 64, 8
SEEDS = [int(s) for s in os.environ.get("VT_CL_SEEDS", "0,1").split(",")]
MODEL, IMAGE_SIZE = os.environ.get("VT_CL_MODEL", "mobilenet_v2"), os.environ.get("VT_CL_SIZE", "64")
EPOCHS = int(os.environ.get("VT_CL_EPOCHS", "15"))
PARTS = os.environ.get("VT_CL_PARTS", "speed,accuracy").split(",")


def steps_per_s(name: str, batch: int, channels_last: bool) -> float:
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = torchvision.models.get_model(name, num_classes=2).to(memory_format=fmt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, SIZE, SIZE).contiguous(memory_format=fmt)
    y = torch.randint(0, 2, (batch,))
    for i in range(STEPS + 2):  # two warm-up steps
        if i == 2:
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return STEPS / (time.perf_counter() - start)


def speed() -> dict:
    from visiontune.models.build import depthwise_with_batchnorm

    rows = {}
    for name, batch in MODELS:
        rates = interleave(
            {
                fmt: (lambda fmt=fmt, name=name, batch=batch: steps_per_s(name, batch, fmt == "channels_last"))
                for fmt in ("contiguous", "channels_last")
            },
            repeats=3,
            warmup=0,
        )
        default = depthwise_with_batchnorm(torchvision.models.get_model(name, num_classes=2))
        ratio = rates["channels_last"]["median"] / rates["contiguous"]["median"]
        rows[name] = {"batch": batch, "rates": rates, "ratio": ratio, "default_channels_last": default}
        print(
            f"{name:20} batch {batch:3}: channels-last {ratio:.2f}x contiguous (default: {'on' if default else 'off'})",
            flush=True,
        )
    return rows


def accuracy() -> dict:
    import recipe

    data = recipe.digits(WORK / "recipe" / "digits", None, 0)
    env = python_env()
    out = {}
    for seed in SEEDS:
        folders = recipe.seed_split(data, seed, WORK / "recipe" / f"digits-seed{seed}")
        row = {}
        for name, flags in (("default", []), ("no_channels_last", ["--no-channels-last"])):
            cmd = [sys.executable, "-m", "visiontune", "train", "--data", str(folders["pool"])]
            cmd += ["--model", MODEL, "--weights", "none", "--image-size", IMAGE_SIZE, "--recipe", "modern"]
            cmd += ["--epochs", str(EPOCHS), "--batch-size", "32", "--seed", str(seed), "--no-progress", *flags]
            run_dir = WORK / "channels-last" / f"{name}-{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
            start = time.perf_counter()
            recipe.run([*cmd, "--output-dir", str(run_dir)], env=env)
            row[name] = {"accuracy": recipe._test_accuracy(run_dir, folders), "seconds": time.perf_counter() - start}
        out[seed] = row
        print(
            f"seed {seed}: " + ", ".join(f"{k} {v['accuracy']:.4f} ({v['seconds']:.0f} s)" for k, v in row.items()),
            flush=True,
        )
    return out


def main() -> None:
    result = {"what": f"train steps at {SIZE} px, channels-last vs contiguous; {MODEL} at {IMAGE_SIZE} px on digits"}
    if "speed" in PARTS:
        result["speed"] = speed()
    if "accuracy" in PARTS:
        result["accuracy"] = accuracy()
    write_result("channels_last" if len(PARTS) == 2 else f"channels_last-{PARTS[0]}", result)


if __name__ == "__main__":
    sys.exit(main())
