"""Sharing the machine: visiontune's default thread choice against ``--threads 1`` and ``--threads N``.

N is the cores this process may use. Each is measured on the machine as it is ("quiet": nothing started by
the benchmark), then beside 1 and 2 busy processes (each a Python loop that keeps one core busy, as a
colleague's job, a package install or a test suite would), for the four ways visiontune computes:

- train: second-epoch training images/s of ``visiontune.train`` (``overhead.py``'s resnet18 at 32 px,
  batch 16, reading the image cache);
- evaluate: images/s of the forward pass over the 300-500 px JPEGs of the data set, 8 times over, batch 32,
  decoded on the way, as ``visiontune evaluate`` runs it (``inference.start`` then ``inference.forward``);
- predict: images/s of the Python API's one-image call (``visiontune.load(run).predict(path)``);
- serve: requests/s of a ``visiontune serve`` process (started after the busy processes, so that its
  default sees them, with its default 2 decoding processes) answering 32 keep-alive clients that post
  one JPEG at a time (``serve.py``'s client).

The variants run in turn, round after round, every other round in reverse (``common.interleave``), so a
machine whose own load moves affects each alike; the table gives each variant's median as a ratio to the
faster of ``--threads 1`` and ``--threads N`` (1.00: as fast as the better fixed choice). The load average is
recorded before and after
each condition. ``VT_CONTENTION_PER_CLASS`` (default 40), ``VT_CONTENTION_REPEATS`` (default 5) and
``VT_CONTENTION_REQUESTS`` (default 120 per round) size it; ``VT_CONTENTION_WORKLOADS`` (default
"train,evaluate,predict,serve") picks the rows and ``VT_CONTENTION_BUSY`` (default "0,1,2") the conditions;
a run of only some workloads or conditions writes ``results/contention-<workloads>-busy<N...>.json`` (the
parts it ran), not the full table's file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import image_paths, interleave, python_env, sample_data, write_result
from overhead import cached_images, visiontune_rate
from serve import load as serve_load
from serve import wait_ready

PER_CLASS = int(os.environ.get("VT_CONTENTION_PER_CLASS", "40"))
REPEATS = int(os.environ.get("VT_CONTENTION_REPEATS", "5"))
EVAL_PASSES = 8
REQUESTS = int(os.environ.get("VT_CONTENTION_REQUESTS", "120"))
N = len(os.sched_getaffinity(0))
VARIANTS = {"default": None, "--threads 1": 1, f"--threads {N}": N}
BUSY = "while True:\n    pass\n"
ALL_WORKLOADS = ("train", "evaluate", "predict", "serve")
WORKLOADS = tuple(os.environ.get("VT_CONTENTION_WORKLOADS", ",".join(ALL_WORKLOADS)).split(","))
BUSY_COUNTS = tuple(int(n) for n in os.environ.get("VT_CONTENTION_BUSY", "0,1,2").split(","))


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:4])


def trained_run(cfg, root: Path) -> str:
    """A one-epoch run of the benchmark's model: what evaluate, predict and serve load."""
    from visiontune.training.trainer import train

    run = root / "run"
    if not (run / "best.safetensors").exists():
        train(cfg.replace(output_dir=str(run), epochs=1, threads=1))
    return str(run)


def inference_rates(run: str, paths: list[str]):
    from visiontune.inference.loaded import InferenceConfig, forward, load_model, start

    loaded = load_model(run)

    # A pass over the images EVAL_PASSES times: as long as an evaluation of a few hundred images, so that the
    # one-time choice of threads at the start (the default reads the load for about 20 ms) weighs as it does in
    # a real `visiontune evaluate`, not as a fifth of a 0.1 s call.
    scored = paths * EVAL_PASSES

    def evaluate(threads):
        icfg = InferenceConfig(32, progress=False, threads=threads)
        begin = time.perf_counter()
        forward(start(icfg), loaded, icfg, scored, [0] * len(scored), "evaluate")
        return len(scored) / (time.perf_counter() - begin)

    def predict(threads):
        from visiontune.inference.api import Predictor

        # As visiontune.load(run) gives it: the default threads chosen once, when the model is loaded.
        predictor = Predictor(loaded) if threads is None else Predictor(loaded, threads=threads)
        few = paths[:20]
        begin = time.perf_counter()
        for path in few:
            predictor.predict(path)
        return len(few) / (time.perf_counter() - begin)

    return evaluate, predict


def servers(run: str, root: Path) -> dict[str, tuple[subprocess.Popen, int]]:
    from serve import free_port

    started = {}
    for name, threads in VARIANTS.items():
        port = free_port()
        argv = [sys.executable, "-m", "visiontune", "serve", "--run", run, "--port", str(port), "--no-access-log"]
        argv += ["--threads", str(threads)] if threads else []
        env = python_env()
        env.pop("OMP_NUM_THREADS", None)
        log = root / f"serve-{threads or 'default'}.log"
        started[name] = (subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT), port)
        # One at a time: a server starting beside the default one would be a busy process to its choice.
        wait_ready(*started[name], log)
    return started


def condition(busy: int, cfg, run: str, paths: list[str], bodies: list[bytes], root: Path) -> dict:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        time.sleep(1)  # the busy processes running before anything chooses its threads
        before = loadavg()
        evaluate, predict = inference_rates(run, paths)
        rows = {}
        for workload in WORKLOADS:
            if workload == "serve":
                started = servers(run, root)
                try:
                    for _, port in started.values():  # warm: the first forward passes build their kernels
                        asyncio.run(serve_load(port, bodies, 8))
                    fns = {
                        name: (lambda port=port: REQUESTS / asyncio.run(serve_load(port, bodies, REQUESTS))[0])
                        for name, (_, port) in started.items()
                    }
                    rows[workload] = interleave(fns, repeats=REPEATS, warmup=0, alternate=True)
                    print(
                        f"   {busy} busy, serve: "
                        + ", ".join(f"{k} {v['median']:.1f}" for k, v in rows[workload].items())
                    )
                finally:
                    for proc, _ in started.values():
                        proc.terminate()
                        proc.wait()
                continue
            fn = {
                "train": lambda t: visiontune_rate(cfg.replace(threads=t)),
                "evaluate": evaluate,
                "predict": predict,
            }[workload]
            rows[workload] = interleave(
                {name: (lambda t=t, fn=fn: fn(t)) for name, t in VARIANTS.items()},
                repeats=REPEATS,
                warmup=0 if workload == "train" else 1,  # a train run's first epoch is its own warm-up
                # Every other round reversed: a variant never always follows --threads N, whose OpenMP threads
                # still spin for a while after its last call (a fifth of 20 one-image predictions).
                alternate=True,
            )
            print(
                f"   {busy} busy, {workload}: " + ", ".join(f"{k} {v['median']:.1f}" for k, v in rows[workload].items())
            )
        return {"busy_processes": busy, "loadavg_before": before, "loadavg_after": loadavg(), "rates": rows}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def table(results: list[dict]) -> str:
    """Markdown: each variant's median as a ratio to the faster fixed choice, per condition and workload."""
    lines = [
        "| machine | load before -> after | workload | " + " | ".join(VARIANTS) + " | best fixed, /s |",
        "|---|---|---|" + "---|" * len(VARIANTS) + "---|",
    ]
    for res in results:
        where = "quiet" if not res["busy_processes"] else f"{res['busy_processes']} busy"
        for workload, rates in res["rates"].items():
            medians = {k: v["median"] for k, v in rates.items()}
            best = max(medians["--threads 1"], medians[f"--threads {N}"])
            cells = " | ".join(f"{medians[k] / best:.2f}" for k in VARIANTS)
            load = f"{res['loadavg_before'].split()[0]} -> {res['loadavg_after'].split()[0]}"
            lines.append(f"| {where} | {load} | {workload} | {cells} | {best:.1f} |")
    return "\n".join(lines)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the busy processes and servers are ended on the way out
    os.environ.pop("OMP_NUM_THREADS", None)  # the default choice is what is measured
    data = sample_data(PER_CLASS)
    cfg, _, _ = cached_images(data)
    cfg = cfg.replace(threads=None)
    paths = image_paths(data)
    bodies = [Path(p).read_bytes() for p in paths[:16]]
    with tempfile.TemporaryDirectory(prefix="visiontune-contention-") as tmp:
        root = Path(tmp)
        run = trained_run(cfg, root)
        torch.set_num_threads(N)
        results = [condition(busy, cfg, run, paths, bodies, root) for busy in BUSY_COUNTS]
    text = table(results)
    print(f"contention: rates as a ratio to the faster of --threads 1 and --threads {N} ({N} cores)\n{text}")
    write_result(
        "contention"
        + ("" if WORKLOADS == ALL_WORKLOADS else "-" + "-".join(WORKLOADS))
        + ("" if BUSY_COUNTS == (0, 1, 2) else "-busy" + "".join(map(str, BUSY_COUNTS))),
        {
            "what": f"default threads against --threads 1 and --threads {N}, quiet and beside 1 and 2 busy "
            "processes; train images/s (2nd epoch), evaluate and predict images/s, serve requests/s",
            "results": results,
            "table": text,
            "target": "default within 10% of the faster fixed choice (ratio >= 0.90) in every row",
        },
    )


if __name__ == "__main__":
    sys.exit(main())
