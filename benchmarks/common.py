"""Shared pieces of the benchmarks: the blog's PIL pipeline, interleaved timing, result files.

Every figure the benchmarks report is a ratio of two things measured in the
same command: ``interleave`` runs the candidates in turn (A, B, A, B, ...)
after a warm-up round, so a machine that gets busier or quieter affects both
alike, and takes the median of the repeats. ``BlogDataset`` is the reference
job's ``DogCatDataset`` with its transform: PIL open, ``Resize((s, s))``,
``ToTensor``, ``Normalize`` with the blog's statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORK = Path(os.environ.get("VT_BENCH_WORK", "/tmp/visiontune-bench"))
BLOG_MEAN, BLOG_STD = [0.4883, 0.4551, 0.4170], [0.2257, 0.2211, 0.2214]
REPEATS = int(os.environ.get("VT_BENCH_REPEATS", "5"))
WARMUP = int(os.environ.get("VT_BENCH_WARMUP", "1"))  # 0 only where time is short: the first round then counts


def blog_transform(size: int) -> transforms.Compose:
    return transforms.Compose(
        [transforms.Resize((size, size)), transforms.ToTensor(), transforms.Normalize(mean=BLOG_MEAN, std=BLOG_STD)]
    )


class BlogDataset(Dataset):
    """The blog's DogCatDataset: label from the Kaggle file name, PIL decode, its transform."""

    def __init__(self, paths: list[str], size: int):
        self.paths, self.transform = paths, blog_transform(size)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        image = Image.open(self.paths[i]).convert("RGB")
        return self.transform(image), int(os.path.basename(self.paths[i]).startswith("dog"))


def sample_data(per_class: int) -> Path:
    """Synthetic Kaggle-layout JPEGs, 300-500 px, made once per size and reused."""
    from visiontune.data.sample import make_sample_data

    out = WORK / f"data-{per_class}"
    if not (out / ".done").exists():
        make_sample_data(out, per_class=per_class, test_count=0, seed=0)
        (out / ".done").touch()
    return out


def image_paths(data: Path) -> list[str]:
    return sorted(str(p) for p in (data / "train").glob("*.jpg"))


def interleave(
    candidates: dict[str, Callable[[], float]], repeats: int = REPEATS, warmup: int = WARMUP, alternate: bool = False
) -> dict:
    """Run each candidate (returns a rate, higher is better) in turn; medians after ``warmup`` rounds.
    ``alternate``: every other round in the reverse order, so that none always runs after the same one."""
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    for r in range(warmup + repeats):
        for name, fn in list(candidates.items())[:: -1 if alternate and r % 2 else 1]:
            value = fn()
            if r >= warmup:
                samples[name].append(value)
    return {name: {"median": statistics.median(v), "samples": [round(x, 4) for x in v]} for name, v in samples.items()}


def timed(fn: Callable[[], int]) -> float:
    """Items per second of ``fn`` (which returns how many items it processed)."""
    start = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - start)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_end": load,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**result, "machine": machine()}, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


def python_env(threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run(cmd: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env or python_env(), capture_output=True, text=True, **kw)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit(f"benchmark command failed ({out.returncode}): {' '.join(cmd)}")
    return out


def peer_args(doc: str, size: bool = True, epochs_help: str | None = None) -> argparse.Namespace:
    """A peer script's command line, as ``recipe.py`` and ``transfer.py`` call each peer: its data folder, test
    folder and result file, then ``--epochs``, ``--batch``, ``--seed`` (and ``--size``)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name in ("root", "test", "out"):
        p.add_argument(name)
    p.add_argument("--epochs", type=int, required=True, help=epochs_help)
    for name in ("batch", "seed", *(("size",) if size else ())):
        p.add_argument(f"--{name}", type=int, required=True)
    return p.parse_args()
