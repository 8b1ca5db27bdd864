"""How well ``visiontune audit`` finds planted faults in sklearn's real scanned digits, over seeds: a seeded 5%
of files moved to another class's folder, 20 near copies (resized, re-encoded as JPEG) put in other classes'
folders (the planting of tests/digits.py, which the audit's tests use too). Per seed: the recall of the
flipped files among the label rows and among the first ``--top`` of them, the precision of the label rows
(flipped files and planted copies, whose folder is wrong too, count as right), the planted copy pairs found
in one group, and the seconds the audit took. Not in ``make bench`` (figures in benchmarks/README.md):

    python benchmarks/audit_labels.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from digits import write_digits  # noqa: E402

FLAGS = [
    *("--model", "resnet18", "--weights", "none", "--image-size", "16", "--epochs", "2", "--batch-size", "32"),
    *("--num-workers", "0", "--no-progress"),
]


def one(seed: int, folds: int, top: int) -> str:
    from visiontune.cli.commands import main as visiontune

    with tempfile.TemporaryDirectory(prefix="vt-audit-labels-") as tmp:
        planted = write_digits(Path(tmp) / "data", seed=seed)
        out = Path(tmp) / "audit"
        start = time.perf_counter()
        argv = ["audit", str(planted.root), "--folds", str(folds), "--out", str(out), "--seed", str(seed), *FLAGS]
        assert visiontune(argv) == 0
        took = time.perf_counter() - start
        with open(out / "audit.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    labels = [r["file"] for r in rows if r["kind"] == "label"]
    wrong = planted.flipped | {c for _, c in planted.copies}
    group = {r["file"]: r["group"] for r in rows if r["kind"] in ("duplicate", "leak")}
    pairs = sum(bool(group.get(a)) and group.get(a) == group.get(b) for a, b in planted.copies)
    recall = len(set(labels) & planted.flipped) / len(planted.flipped)
    recall_top = len(set(labels[:top]) & planted.flipped) / len(planted.flipped)
    precision = len(set(labels) & wrong) / max(1, len(labels))
    return (
        f"| {seed} | {len(planted.flipped)} | {len(labels)} | {recall:.2f} | {recall_top:.2f} | {precision:.2f} "
        f"| {pairs}/{len(planted.copies)} | {took:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--top", type=int, default=150)
    args = parser.parse_args()
    print(f"| seed | flipped | label rows | recall | recall in top {args.top} | precision | copy pairs grouped | s |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        print(one(seed, args.folds, args.top), flush=True)


if __name__ == "__main__":
    main()
