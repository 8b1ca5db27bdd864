"""``visiontune bench``: the reference job's strategy comparison, made fair.

Each strategy trains in a fresh ``visiontune train`` process with the same
data, model and -- by default -- the same global batch and learning rate, so
accuracies are comparable. Throughput leaves out each epoch's first
``--timing-warmup`` steps, and every step's time is split into waiting for the
loader and the rest, reported as a data-stall share. A speedup above the number
of devices is flagged: it means the baseline was waiting for its input.
The results go to ``bench.md`` (the blog's table), ``bench.json`` and ``bench.png``.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from visiontune.config import TrainConfig, UserError
from visiontune.host import available_cores
from visiontune.models import get_spec
from visiontune.outputs import atomic_write, pyplot, save_figure, versions, write_json

STRATEGIES = ("single", "dp", "ddp")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [{"name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())]
    return {"cpu": cpu, "cores": available_cores(), "gpus": gpus, **versions()}


def plan(cfg: TrainConfig, strategies: list[str], nproc: int, same: str) -> list[dict]:
    """Per strategy: processes, per-process batch, global batch, or why it is not run."""
    gpus = torch.cuda.device_count()
    rows = []
    for s in strategies:
        if s == "dp" and gpus < 2:
            rows.append({"strategy": s, "skipped": f"DataParallel needs 2 or more GPUs; {gpus} visible"})
            continue
        devices = {"single": 1, "dp": gpus, "ddp": nproc}[s]
        procs = nproc if s == "ddp" else 1
        if same == "global":  # every strategy trains on nproc * batch per step
            per_process = cfg.batch_size * nproc // procs
        else:  # the blog's setting: batch per device
            per_process = cfg.batch_size * devices // procs
        rows.append({"strategy": s, "devices": devices, "processes": procs, "per_process_batch": per_process,
                     "global_batch": per_process * procs})
    return rows


def run_one(row: dict, train_argv: list[str], out_dir: Path) -> dict:
    """Train one strategy in a fresh process and read back its summary."""
    run_dir = out_dir / row["strategy"]
    cmd = [sys.executable, "-m", "visiontune", "train", *train_argv, "--strategy", row["strategy"],
           "--batch-size", str(row["per_process_batch"]), "--output-dir", str(run_dir), "--no-progress"]
    if row["strategy"] == "ddp":
        cmd += ["--nproc", str(row["processes"])]
    print(f"visiontune bench: {row['strategy']} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**row, "failed": f"exit code {proc.returncode}: {tail}"}
    summary = json.loads((run_dir / "summary.json").read_text())
    last = json.loads((run_dir / "history.json").read_text())[-1]
    epoch_seconds = sum(r["train"]["seconds"] for r in json.loads((run_dir / "history.json").read_text()))
    return {**row, "lr": summary["lr"], "epoch_seconds": epoch_seconds / summary["epochs"],
            "images_per_s": summary["train_images_per_s"], "steady_images": summary["steady_images"],
            "steady_seconds": summary["steady_seconds"], "data_stall": summary["data_wait_fraction"],
            "train_loss": last["train"]["loss"], "train_accuracy": last["train"]["accuracy"],
            "val_loss": last["val"]["loss"], "val_accuracy": last["val"]["accuracy"], "run_dir": str(run_dir)}


def compare(rows: list[dict]) -> list[dict]:
    """Speedup against single and scaling efficiency; flag super-linear speedups."""
    base = next((r for r in rows if r["strategy"] == "single" and "images_per_s" in r), None)
    for r in rows:
        if base and "images_per_s" in r and base["images_per_s"] > 0:
            r["speedup"] = r["images_per_s"] / base["images_per_s"]
            r["efficiency"] = r["speedup"] / r["devices"]
            if r["speedup"] > r["devices"] * 1.05:
                r["note"] = "speedup above the device count: the baseline was waiting for its input"
    return rows


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def table(rows: list[dict], info: dict) -> str:
    head = ("| strategy | processes | batch/process | global batch | epoch time (s) | images/s | speedup | "
            "efficiency | data stall | train loss | train acc | val loss | val acc | note |")
    lines = [f"# visiontune bench: {info['model']} at {info['image_size']} px, {info['epochs']} epoch(s), "
             f"same {info['same']} batch", "",
             f"Machine: {info['machine']['cpu']}, {info['machine']['cores']} cores, "
             f"GPUs: {', '.join(g['name'] for g in info['machine']['gpus']) or 'none'}; "
             f"torch {info['machine']['torch']}, torchvision {info['machine']['torchvision']}, "
             f"accelerate {info['machine']['accelerate']}", "", head, "|" + "---|" * 14]
    for r in rows:
        if "skipped" in r or "failed" in r:
            lines.append(f"| {r['strategy']} | | | | | | | | | | | | | not run: {r.get('skipped') or r['failed']} |")
            continue
        lines.append(
            f"| {r['strategy']} | {r['processes']} | {r['per_process_batch']} | {r['global_batch']} | "
            f"{r['epoch_seconds']:.1f} | {r['images_per_s']:.1f} | {_fmt(r.get('speedup'), '.2f')}x | "
            f"{_fmt(r.get('efficiency'), '.0%')} | {r['data_stall']:.0%} | {r['train_loss']:.4f} | "
            f"{r['train_accuracy']:.4f} | {r['val_loss']:.4f} | {r['val_accuracy']:.4f} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def chart(path: Path, rows: list[dict]) -> None:
    plt = pyplot()
    done = [r for r in rows if "images_per_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["strategy"] for r in done]
    axes[0].bar(names, [r["epoch_seconds"] for r in done], color="tab:blue")
    axes[0].set_title("Epoch time (s)")
    axes[1].bar(names, [r["images_per_s"] for r in done], color="tab:green")
    axes[1].set_title("Training images/s (after warm-up)")
    fig.tight_layout()
    save_figure(path, fig)


def bench(cfg: TrainConfig, train_argv: list[str], strategies: list[str], nproc: int, same: str,
          out_dir: str) -> list[dict]:
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    if same not in ("global", "per-device"):
        raise UserError(f"--same must be global or per-device, got {same!r}")
    out = Path(out_dir)
    rows = compare([r if "skipped" in r else run_one(r, train_argv, out) for r in plan(cfg, strategies, nproc, same)])
    info = {"model": cfg.model, "image_size": cfg.image_size or get_spec(cfg.model).preprocess.size, "epochs": cfg.epochs, "same": same,
            "timing_warmup": cfg.timing_warmup, "machine": machine()}
    write_json(out / "bench.json", {**info, "rows": rows})
    atomic_write(out / "bench.md", table(rows, info))
    chart(out / "bench.png", rows)
    print(table(rows, info))
    print(f"visiontune bench: results in {out}/bench.md, bench.json, bench.png")
    return rows
