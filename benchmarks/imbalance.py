"""Minority recall on a 95/5 set: the plain run, `--sampler balanced` and `--class-weights auto|effective`.

The set: 380 "cat" and 20 "dog" images (95/5), 16 px noisy squares whose brightness differs by class
but overlaps (means 100 and 130, spread 20), so that no model tells every image apart and where it
puts the boundary shows. A separate balanced set of 100 + 100, never trained on, measures each run
(`visiontune evaluate --data`): the dogs' recall, the cats' recall, the balanced accuracy and the
macro average precision. timm's test_resnet from scratch at 16 px, batch 16, `--recipe modern`
(AdamW, cosine), 3 epochs, no augmentation, one thread; each setting once per `--seeds` seed (the
seed of the split, the sampler and the head's init). These are the settings of
tests/training/test_imbalance_train.py.

    python benchmarks/imbalance.py [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from common import WORK, python_env, run, write_result
from visiontune.data.sample import overlapping_classes as overlapping

RUN = ["--model", "timm/test_resnet", "--weights", "none", "--image-size", "16", "--no-progress"]
RUN += ["--num-workers", "0", "--batch-size", "16", "--epochs", "3", "--recipe", "modern", "--threads", "1"]
CHOICES = {
    "plain": [],
    "--sampler balanced": ["--sampler", "balanced"],
    "--class-weights auto": ["--class-weights", "auto"],
    "--class-weights effective": ["--class-weights", "effective"],
}


def data(root: Path) -> tuple[Path, Path]:
    """(the 380/20 train folder, the 100/100 held-out folder), made once."""
    train, heldout = root / "data", root / "heldout"
    if not (root / ".done").exists():
        shutil.rmtree(root, ignore_errors=True)
        overlapping(train, {"cat": 380, "dog": 20}, seed=1)
        overlapping(heldout, {"cat": 100, "dog": 100}, seed=2)
        (root / ".done").touch()
    return train, heldout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1")
    seeds = [int(s) for s in parser.parse_args().seeds.split(",")]
    root = WORK / "imbalance-overlap"
    train, heldout = data(root)
    vt, env = [sys.executable, "-m", "visiontune"], python_env(threads=1)
    rows: dict[str, list[dict]] = {name: [] for name in CHOICES}
    for seed in seeds:
        for name, flags in CHOICES.items():
            out = root / "runs" / f"{name.replace('--', '').replace(' ', '-')}-{seed}"
            shutil.rmtree(out, ignore_errors=True)
            train_argv = ["train", "--data", str(train), "--output-dir", str(out), *RUN, "--seed", str(seed), *flags]
            run([*vt, *train_argv], env)
            run([*vt, "evaluate", "--run", str(out), "--data", str(heldout), "--out", str(out / "held.json")], env)
            ev = json.loads((out / "held.json").read_text())
            rows[name].append(
                {
                    "seed": seed,
                    "dog_recall": ev["per_class"]["dog"]["recall"],
                    "cat_recall": ev["per_class"]["cat"]["recall"],
                    "balanced_accuracy": ev["balanced_accuracy"],
                    "macro_average_precision": ev["macro_average_precision"],
                }
            )
            print(name, rows[name][-1], flush=True)
    print("\n| setting | dog recall | cat recall | balanced accuracy | macro AP |\n|---|---|---|---|---|")
    for name, got in rows.items():
        cells = [
            " / ".join(f"{r[k]:.2f}" for r in got)
            for k in ("dog_recall", "cat_recall", "balanced_accuracy", "macro_average_precision")
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    write_result("imbalance", {"seeds": seeds, "runs": rows, "settings": RUN})


if __name__ == "__main__":
    main()
