"""Multi-label metrics from per-image class probabilities and multi-hot targets.

Computed once per evaluation from the gathered outputs (every image once, as
``metrics`` is), in float64 on the CPU. Conventions follow scikit-learn, which
the tests check every figure against:

- average precision (AP) of a class is ``average_precision_score``: the sum over
  the distinct scores, highest first, of (recall gained) x (precision there);
  mAP ``macro`` is the mean over the classes that have a positive among the
  scored images (sklearn would count a class without one as 0: it says nothing of
  the model, so it is left out and its AP is ``None``); ``micro`` is the AP of every
  (image, class) pair pooled;
- precision, recall and F1 at a threshold (a class is predicted when its
  probability is ``>=`` its threshold) use ``zero_division=0``; macro averages run
  over every class, micro ones pool the pairs;
- the exact-match ratio is the share of images whose predicted set is exactly
  their label set (sklearn's ``accuracy_score`` on multi-hot rows).

A per-class threshold is tuned on the validation split: the probability that
gives the class its best F1 there (the highest such one on ties), moved halfway
down to the next lower probability seen, so that the validation images fall on
the same side of it as of the score itself; a class with no positive keeps 0.5.
"""

from __future__ import annotations

import torch

from visiontune.tasks.multi import DEFAULT_THRESHOLD, average_precision


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def multilabel_metrics(
    probs: torch.Tensor, targets: torch.Tensor, classes: list[str], thresholds: list[float] | None = None
) -> dict:
    """Every multi-label figure of ``eval.json``; ``thresholds`` default to 0.5 for every class."""
    probs, y = probs.double(), targets > 0.5
    n, k = probs.shape
    thresholds = list(thresholds) if thresholds is not None else [DEFAULT_THRESHOLD] * k
    predicted = probs >= torch.tensor(thresholds, dtype=torch.float64)
    tp = (predicted & y).sum(0).double()
    fp = (predicted & ~y).sum(0).double()
    fn = (~predicted & y).sum(0).double()
    rows, aps = {}, []
    for c, name in enumerate(classes):
        ap = average_precision(probs[:, c], y[:, c])
        if ap is not None:
            aps.append(ap)
        rows[name] = {
            "ap": ap,
            "threshold": thresholds[c],
            "precision": _ratio(tp[c].item(), (tp[c] + fp[c]).item()),
            "recall": _ratio(tp[c].item(), (tp[c] + fn[c]).item()),
            "f1": _ratio(2 * tp[c].item(), (2 * tp[c] + fp[c] + fn[c]).item()),
            "support": int(y[:, c].sum()),
        }
    TP, FP, FN = tp.sum().item(), fp.sum().item(), fn.sum().item()
    return {
        "images": n,
        "map": sum(aps) / len(aps) if aps else None,
        "map_micro": average_precision(probs.flatten(), y.flatten()),
        "exact_match": (predicted == y).all(1).double().mean().item() if n else None,
        "hamming_accuracy": (predicted == y).double().mean().item() if n else None,
        "averages": {
            "macro": {m: sum(r[m] for r in rows.values()) / k for m in ("precision", "recall", "f1")},
            "micro": {
                "precision": _ratio(TP, TP + FP),
                "recall": _ratio(TP, TP + FN),
                "f1": _ratio(2 * TP, 2 * TP + FP + FN),
            },
        },
        "per_class": rows,
        "thresholds": thresholds,
    }


def worst_per_class(probs: torch.Tensor, targets: torch.Tensor, n: int) -> list[list[dict]]:
    """For each class, the ``n`` images its probability got most wrong (a positive scored low, a negative
    high: the largest binary cross-entropy), worst first; ``index`` into the inputs."""
    probs, y = probs.double(), targets > 0.5
    wrongness = torch.where(y, 1 - probs, probs)
    out = []
    for c in range(probs.shape[1]):
        order = wrongness[:, c].argsort(descending=True, stable=True)[:n]
        out.append([{"index": i, "positive": bool(y[i, c]), "probability": probs[i, c].item()} for i in order.tolist()])
    return out


def table(report: dict) -> str:
    """One row per class (AP, threshold, precision, recall, F1, positives) and the two averages."""
    lines = [f"{'#':>3} {'class':<24} {'AP':>7} {'thresh':>7} {'prec':>7} {'recall':>7} {'f1':>7} {'pos':>5}"]
    for i, (name, r) in enumerate(report["per_class"].items()):
        ap = "-" if r["ap"] is None else f"{r['ap']:.4f}"
        lines.append(
            f"{i:>3} {name[:24]:<24} {ap:>7} {r['threshold']:>7.3f} {r['precision']:>7.4f} {r['recall']:>7.4f} "
            f"{r['f1']:>7.4f} {r['support']:>5}"
        )
    for kind, r in report["averages"].items():
        lines.append(
            f"{'':>3} {kind + ' avg':<24} {'':>7} {'':>7} {r['precision']:>7.4f} {r['recall']:>7.4f} {r['f1']:>7.4f}"
        )
    return "\n".join(lines)
