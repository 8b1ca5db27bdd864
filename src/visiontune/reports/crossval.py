"""The folds of one cross-validation (runs made with ``--folds K --fold I``) summed up for ``compare``.

K runs, one per held-out fold, are one measurement: what is reported is each metric's mean over the
folds with its sample standard deviation and range (scikit-learn's ``cross_validate`` users read the
same), and whether the runs are all K folds, each once, of one split: their ``split.json`` validation
lists disjoint, together every image.
"""

from __future__ import annotations

import statistics

from visiontune.runs import runrecords

# Then the metrics the runs' task adds (multi-label: mAP). A metric some fold lacks is left out (a
# multi-label fold's mAP when its val split has no positive).
METRICS = (
    ("best val accuracy", "best_val_accuracy"),
    ("best val loss", "best_val_loss"),
)


def _split(run) -> dict | None:
    return runrecords.read_split_lists(run.name)


def summary(runs: list) -> dict | None:
    """The cross-validation the runs make (``compare.Run`` objects), or None when they are not folds of one."""
    folds = {r.settings.get("folds") for r in runs}
    if len(folds) != 1 or not isinstance(k := folds.pop(), int) or k < 2:
        return None
    held = sorted(int(r.settings.get("fold", 0)) for r in runs)
    complete = held == list(range(k))
    splits = [_split(r) for r in runs]
    partition = None
    if all(s is not None for s in splits):
        every = [n for s in splits for n in s["val"]]
        whole = set(splits[0]["val"]) | set(splits[0]["train"])
        partition = len(every) == len(set(every)) and (not complete or set(every) == whole)
    metrics = {}
    added = {(f"best val {name}", f"best_val_{key}") for r in runs for key, name in r.task.curves}
    for label, key in (*METRICS, *sorted(added)):
        values = [r.summary.get(key) for r in runs]
        if any(not isinstance(v, (int, float)) for v in values):
            continue
        metrics[label] = {
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values),
            "max": max(values),
        }
    return {"folds": k, "held_out": held, "complete": complete, "partition": partition, "metrics": metrics}


def lines(cv: dict) -> list[str]:
    """The summary as text lines: what the folds are, then each metric's mean +- std (min-max)."""
    held = ", ".join(map(str, cv["held_out"]))
    what = f"all {cv['folds']} folds" if cv["complete"] else f"folds {held} of {cv['folds']} (not all of them)"
    if cv["partition"] is True:
        what += "; their validation sets are disjoint" + (" and hold every image" if cv["complete"] else "")
    elif cv["partition"] is False:
        what += "; WARNING: their validation sets overlap or miss images (another seed, data or --group-by?)"
    out = [f"cross-validation: {what}"]
    for label, m in cv["metrics"].items():
        out.append(f"  {label}: {m['mean']:.4f} +- {m['std']:.4f} (min {m['min']:.4f}, max {m['max']:.4f})")
    return out
