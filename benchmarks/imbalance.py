"""Minority recall on a 95/5 set: the plain run, `--sampler balanced` and `--class-weights auto|effective`.

The synthetic sample set thinned to 190 cats and 10 dogs (95/5) is trained on; a separate balanced
set of 25 cats and 25 dogs, never trained on, measures each run (`visiontune evaluate --data`):
the dogs' recall, the balanced accuracy and the macro average precision. resnet18 from scratch at
16 px, batch 8, SGD lr 0.01, 3 epochs, no augmentation, one thread; each setting once per
`--seeds` seed (the seed of the split, the sampler and the head's init). These are the settings of
tests/training/test_imbalance_train.py.

    python benchmarks/imbalance.py [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from common import WORK, python_env, run, write_result

RUN = ["--model", "resnet18", "--weights", "none", "--image-size", "16", "--no-progress", "--num-workers", "0"]
RUN += ["--batch-size", "8", "--epochs", "3", "--lr", "0.01", "--threads", "1"]
CHOICES = {
    "plain": [],
    "--sampler balanced": ["--sampler", "balanced"],
    "--class-weights auto": ["--class-weights", "auto"],
    "--class-weights effective": ["--class-weights", "effective"],
}


def data(root: Path) -> tuple[Path, Path]:
    """(the 190/10 train folder, the 25/25 held-out folder), made once."""
    from visiontune.data.sample import make_sample_data

    train, heldout = root / "data", root / "heldout"
    if not (root / ".done").exists():
        shutil.rmtree(root, ignore_errors=True)
        make_sample_data(train, per_class=190, test_count=0, seed=3)
        for dog in (train / "train").glob("dog.*.jpg"):
            if int(dog.name.split(".")[1]) >= 10:
                dog.unlink()
        make_sample_data(heldout, per_class=25, test_count=0, seed=4)
        (root / ".done").touch()
    return train, heldout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    seeds = [int(s) for s in parser.parse_args().seeds.split(",")]
    root = WORK / "imbalance"
    train, heldout = data(root)
    vt, env = [sys.executable, "-m", "visiontune"], python_env(threads=1)
    rows: dict[str, list[dict]] = {name: [] for name in CHOICES}
    for seed in seeds:
        for name, flags in CHOICES.items():
            out = root / "runs" / f"{name.replace('--', '').replace(' ', '-')}-{seed}"
            shutil.rmtree(out, ignore_errors=True)
            cache = ["--cache", str(root / "cache")]
            run(
                [
                    *vt,
                    "train",
                    "--data",
                    str(train),
                    "--output-dir",
                    str(out),
                    *RUN,
                    *cache,
                    "--seed",
                    str(seed),
                    *flags,
                ],
                env,
            )
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
