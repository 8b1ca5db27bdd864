"""``visiontune bench``: the reference job's strategy comparison, made fair.

Each strategy trains in a fresh ``visiontune train`` process with the same
data, model and -- by default -- the same global batch and learning rate, so
accuracies are comparable. Throughput leaves out each epoch's first
``--timing-warmup`` steps, and every step's time is split into waiting for the
loader and the rest, reported as a data-stall share. With ``--repeats N`` each
strategy trains N times (interleaved: single, ddp, single, ddp, ...), its row is
the median run and the spread of images/s is shown; the machine's load average
is recorded before every run. A speedup above the number of devices is only
explained by input waiting when the baseline's measured data stall says so; a
large spread or a loaded machine is reported as "noisy machine", without
guessing a cause. The results go to ``bench.md`` (the blog's table),
``bench.json`` and ``bench.png``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from visiontune.cluster import strategies as registry
from visiontune.cluster.host import available_cores, versions
from visiontune.errors import UserError
from visiontune.files import atomic_write, write_json
from visiontune.models.build import get_spec
from visiontune.reports.benchtable import batch_line, chart, load_line, table
from visiontune.runs import runrecords
from visiontune.settings.config import TrainConfig

NOISY_SPREAD = 0.10  # (max - min) / median of a strategy's images/s across repeats
BUSY_LOAD = 0.5  # 1-minute load average per core before a run: other work is competing for the cores
STALL = 0.10  # a baseline data-stall share that can explain a super-linear speedup


def machine() -> dict:
    # Not platform.processor(): on Linux it starts `uname -p` (once a process), which says no more than this.
    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [
        {
            "name": torch.cuda.get_device_name(i),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(torch.cuda.device_count())
    ]
    return {"cpu": cpu, "cores": available_cores(), "gpus": gpus, **versions()}


def plan(cfg: TrainConfig, strategies: list[str], nproc: int, same: str) -> list[dict]:
    """Per strategy: processes, per-process batch, global batch, or why it is not run."""
    gpus = torch.cuda.device_count()
    rows = []
    for s in strategies:
        strategy = registry.get(s)
        if why := strategy.unavailable(gpus):
            rows.append({"strategy": s, "skipped": why})
            continue
        devices = strategy.devices_used(gpus, nproc)
        procs = nproc if strategy.several_processes else 1
        if same == "global":  # every strategy trains on nproc * batch per step
            per_process = cfg.batch_size * nproc // procs
        else:  # the blog's setting: batch per device
            per_process = cfg.batch_size * devices // procs
        rows.append(
            {
                "strategy": s,
                "devices": devices,
                "processes": procs,
                "per_process_batch": per_process,
                "global_batch": per_process * procs,
            }
        )
    return rows


def load_per_core() -> float:
    return os.getloadavg()[0] / available_cores()


def run_one(row: dict, train_argv: list[str], out_dir: Path, repeat: int = 0) -> dict:
    """Train one strategy in a fresh process and read back its summary."""
    run_dir = out_dir / (row["strategy"] + (f".{repeat + 1}" if repeat else ""))
    load = load_per_core()
    cmd = [
        sys.executable,
        "-m",
        "visiontune",
        "train",
        *train_argv,
        "--strategy",
        row["strategy"],
        "--batch-size",
        str(row["per_process_batch"]),
        "--output-dir",
        str(run_dir),
        "--no-progress",
    ]
    if registry.get(row["strategy"]).several_processes:
        cmd += ["--nproc", str(row["processes"])]
    print(f"visiontune bench: {row['strategy']}{f' (repeat {repeat + 1})' if repeat else ''} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**row, "failed": f"exit code {proc.returncode}: {tail}", "load_per_core": load}
    # Written by the run this process just launched (exit 0); read back bounded and checked all the same.
    summary, history = runrecords.read_summary(run_dir), runrecords.read_history(run_dir)
    if summary is None or not history:
        return {**row, "failed": f"no summary.json or history.json in {run_dir}", "load_per_core": load}
    last = history[-1]
    epoch_seconds = sum(r["train"]["seconds"] for r in history)
    return {
        **row,
        "lr": summary["lr"],
        "epoch_seconds": epoch_seconds / summary["epochs"],
        "images_per_s": summary["train_images_per_s"],
        "steady_images": summary["steady_images"],
        "steady_seconds": summary["steady_seconds"],
        "data_stall": summary["data_wait_fraction"],
        "train_loss": last["train"]["loss"],
        "train_accuracy": last["train"]["accuracy"],
        "val_loss": last["val"]["loss"],
        "val_accuracy": last["val"]["accuracy"],
        "run_dir": str(run_dir),
        "load_per_core": load,
    }


def combine(runs: list[dict]) -> dict:
    """One strategy's repeats -> its median run (upper median), with every run's images/s and the spread."""
    done = sorted((r for r in runs if "images_per_s" in r), key=lambda r: r["images_per_s"])
    if not done:
        return runs[0]
    row = dict(done[len(done) // 2])
    speeds = [r["images_per_s"] for r in runs if "images_per_s" in r]
    row.update(
        repeats=len(speeds),
        images_per_s_runs=speeds,
        load_per_core=max(r["load_per_core"] for r in runs),
        spread=(max(speeds) - min(speeds)) / row["images_per_s"] if len(speeds) > 1 and row["images_per_s"] else None,
    )
    return row


def noise(r: dict | None, start_load: float) -> str | None:
    """Why this row's timing cannot be trusted, or None.

    Only the load before the first run counts as other work: later loads include the tail of
    the previous run's own load (the 1-minute average decays slowly).
    """
    if r and r.get("spread") is not None and r["spread"] > NOISY_SPREAD:
        return f"noisy machine: images/s of {r['strategy']} varied by {r['spread']:.0%} across {r['repeats']} repeats"
    if start_load > BUSY_LOAD:
        return f"noisy machine: load average {start_load:.2f} per core before the benchmark started"
    return None


def compare(rows: list[dict], start_load: float = 0.0) -> list[dict]:
    """Speedup against single and scaling efficiency; say what a super-linear speedup means, or that we can't.

    A row whose speedup a loaded or noisy machine made meaningless is marked ``unreliable`` with the reason,
    and its note says the reason before the figures."""
    base = next((r for r in rows if "images_per_s" in r and registry.get(r["strategy"]).one_device), None)
    for r in rows:
        if "images_per_s" not in r:
            continue
        noisy = noise(r, start_load) or noise(base, start_load)
        if base and base["images_per_s"] > 0:
            r["speedup"] = r["images_per_s"] / base["images_per_s"]
            r["efficiency"] = r["speedup"] / r["devices"]
        if noisy and "speedup" in r and r is not base:  # the baseline's own 1.00x is true by definition
            # The load, not the strategy, made these figures: the reason comes first, the figures after it.
            r["unreliable"] = noisy
            above = "; above the device count" if r["speedup"] > r["devices"] * 1.05 else ""
            r["note"] = f"unreliable: {noisy} (measured {r['speedup']:.2f}x, {r['efficiency']:.0%}{above})"
        elif r.get("speedup", 0) > r["devices"] * 1.05:
            if base["data_stall"] >= STALL and base["data_stall"] > r["data_stall"]:
                r["note"] = (
                    f"speedup above the device count: the baseline waited for its input "
                    f"{base['data_stall']:.0%} of the time ({r['data_stall']:.0%} here)"
                )
            else:
                r["note"] = (
                    f"speedup above the device count, not explained by data stall "
                    f"({base['data_stall']:.0%}); rerun with --repeats 3"
                )
        elif noisy:
            r["note"] = noisy
    return rows


def train_flags(cfg: TrainConfig, argv: list[str], epochs_given: bool) -> tuple[TrainConfig, list[str]]:
    """The flags each strategy's ``visiontune train`` gets, and the config they make.

    Bench's own flags are dropped and the per-strategy ones are appended (argparse: the last
    wins); one epoch unless ``--epochs`` was given.
    """
    from visiontune.cluster.launch import without_flags

    train_argv = without_flags(argv, ("--strategies", "--same", "--output-dir", "--repeats"))
    return (cfg, train_argv) if epochs_given else (cfg.replace(epochs=1), [*train_argv, "--epochs", "1"])


def _eta(seconds: float) -> str:
    return f"{int(seconds // 60)}m {int(seconds % 60):02d}s"


def measure(plans: list[dict], train_argv: list[str], out: Path, repeats: int, clock=time.monotonic) -> list[dict]:
    """Every runnable strategy ``repeats`` times, interleaved so that a change in load hits all alike; a line
    before each run says which of all the bench's runs it is, and the bench's ETA from the runs so far."""
    runs: dict[int, list[dict]] = {i: [] for i, r in enumerate(plans) if "skipped" not in r}
    total, started = repeats * len(runs), clock()
    for repeat in range(repeats):
        for n, (i, done) in enumerate(runs.items()):
            finished = repeat * len(runs) + n
            left = f"; about {_eta((clock() - started) / finished * (total - finished))} left" if finished else ""
            print(
                f"visiontune bench: run {finished + 1}/{total}: {plans[i]['strategy']}, "
                f"repeat {repeat + 1}/{repeats}{left}",
                flush=True,
            )
            done.append(run_one(plans[i], train_argv, out, repeat))
    return [combine(runs[i]) if i in runs else r for i, r in enumerate(plans)]


def bench(
    cfg: TrainConfig,
    train_argv: list[str],
    strategies: list[str],
    nproc: int,
    same: str,
    out_dir: str,
    repeats: int = 1,
) -> list[dict]:
    unknown = [s for s in strategies if s not in registry.names()]
    if unknown:
        raise UserError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(registry.names())}")
    if same not in ("global", "per-device"):
        raise UserError(f"--same must be global or per-device, got {same!r}")
    if repeats < 1:
        raise UserError(f"--repeats must be a positive integer, got {repeats}")
    out = Path(out_dir)
    info = {
        "model": cfg.model,
        "image_size": cfg.image_size or get_spec(cfg.model).preprocess.size,
        "epochs": cfg.epochs,
        "same": same,
        "timing_warmup": cfg.timing_warmup,
        "repeats": repeats,
        "load_per_core": load_per_core(),
        "machine": machine(),
    }
    plans = plan(cfg, strategies, nproc, same)
    print(f"visiontune bench: {batch_line(plans, same)}", flush=True)  # before the runs: why single's batch is nproc x
    rows = compare(measure(plans, train_argv, out, repeats), info["load_per_core"])
    info["load_note"] = load_line(rows, info)
    write_json(out / "bench.json", {**info, "rows": rows})
    atomic_write(out / "bench.md", table(rows, info))
    chart(out / "bench.png", rows)
    from visiontune.reports import report

    for r in rows:  # the bench's own page, and each run's page with the bench table in it
        if "run_dir" in r:
            report.write(r["run_dir"])
    report.write(out)
    print(table(rows, info))
    print(f"visiontune bench: results in {out}/bench.md, bench.json, bench.png, report.html")
    return rows
