"""Classification metrics from logits and labels: the numbers ``evaluate`` reports.

Everything is computed from the confusion matrix and the softmax of the
logits, in float64, on the CPU, once (on the main process, after the gather).
Conventions, chosen to match scikit-learn: a class that is never predicted has
no precision of its own (``None`` in its row) and counts as 0 in the averages;
macro averages and balanced accuracy run over the classes that have images
(a class with no images says nothing about the model); weighted averages
weight each class by its images. F1 is ``2 tp / (2 tp + fp + fn)``. Average precision ranks the
images by one class's probability against the rest (macro: the mean over classes with images).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ECE_BINS = 15  # equal-width confidence bins, as in Guo et al. (2017)


def top_k_for(num_classes: int) -> int | None:
    """Top-5 beyond 5 classes; with 3-5 classes top-2; none for 2 (top-2 of 2 is always 1)."""
    return 5 if num_classes > 5 else (2 if num_classes > 2 else None)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Share-weighted gap between confidence and accuracy over bins ``(i/bins, (i+1)/bins]``."""
    conf, pred = probs.max(1)
    edges = torch.linspace(0, 1, bins + 1, dtype=probs.dtype)
    which = torch.bucketize(conf, edges[1:-1])  # (lo, hi]: the binning of sklearn's calibration_curve
    correct = torch.bincount(which, weights=(pred == labels).double(), minlength=bins)
    confidence = torch.bincount(which, weights=conf.double(), minlength=bins)
    return ((correct - confidence).abs().sum() / labels.numel()).item() if labels.numel() else 0.0


def average_precision(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """Area under the precision-recall curve as a step sum, sklearn's ``average_precision_score``: over
    the distinct scores, highest first, the precision there times the recall it adds; None without
    positives (no curve to draw)."""
    total = int(positive.sum())
    if not total:
        return None
    scores, order = scores.double().sort(descending=True, stable=True)
    hits = positive[order].double().cumsum(0)
    # Tied scores are one threshold: keep the last position of each run of equal scores.
    last = torch.cat([scores[1:] != scores[:-1], torch.ones(1, dtype=torch.bool)])
    tp = hits[last]
    seen = torch.nonzero(last).flatten().double() + 1
    recall_gain = torch.diff(tp, prepend=tp.new_zeros(1)) / total
    return (recall_gain * tp / seen).sum().item()


def per_class(confusion: torch.Tensor, classes: list[str]) -> dict[str, dict]:
    """Precision, recall, F1 and images of each class, from ``confusion[true, predicted]``."""
    out = {}
    for c, name in enumerate(classes):
        hit, predicted, actual = int(confusion[c, c]), int(confusion[:, c].sum()), int(confusion[c].sum())
        out[name] = {
            "precision": _ratio(hit, predicted),
            "recall": _ratio(hit, actual),
            "f1": _ratio(2 * hit, predicted + actual),
            "support": actual,
        }
    return out


def averages(rows: dict[str, dict]) -> dict[str, dict]:
    """Macro (classes with images, undefined as 0) and support-weighted precision, recall and F1."""
    present = [r for r in rows.values() if r["support"]]
    total = sum(r["support"] for r in present)
    out = {}
    for kind, weight in (("macro", lambda r: 1 / len(present)), ("weighted", lambda r: r["support"] / total)):
        out[kind] = {
            k: sum(weight(r) * (r[k] or 0.0) for r in present) if present else None
            for k in ("precision", "recall", "f1")
        }
    return out


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> dict:
    """Every figure of ``eval.json`` (see the module docstring for the conventions)."""
    k, n = len(classes), labels.numel()
    logits = logits.double()
    probs = logits.softmax(1)
    pred = logits.argmax(1)
    confusion = torch.bincount(labels * k + pred, minlength=k * k).view(k, k)  # [true, predicted]
    rows = per_class(confusion, classes)
    recalls = [r["recall"] for r in rows.values() if r["support"]]
    top_k = top_k_for(k)
    actual = confusion.sum(1, keepdim=True).double()
    # One class against the rest, ranked by its probability; macro over the classes with images.
    for c, row in enumerate(rows.values()):
        row["average_precision"] = average_precision(probs[:, c], labels == c)
    aps = [r["average_precision"] for r in rows.values() if r["support"]]
    return {
        "images": n,
        "accuracy": (pred == labels).double().mean().item() if n else None,
        "balanced_accuracy": sum(recalls) / len(recalls) if recalls else None,
        "top_k": top_k,
        "top_k_accuracy": (logits.topk(top_k, 1).indices == labels[:, None]).any(1).double().mean().item()
        if top_k and n
        else None,
        "log_loss": F.cross_entropy(logits, labels).item() if n else None,
        "ece": expected_calibration_error(probs, labels) if n else None,
        "ece_bins": ECE_BINS,
        "macro_average_precision": sum(aps) / len(aps) if aps else None,
        "averages": averages(rows),
        "per_class": rows,
        "confusion_matrix": confusion.tolist(),
        # Each row divided by its class's images (a row of zeros for a class with none, as sklearn does).
        "confusion_matrix_normalized": torch.where(actual > 0, confusion / actual.clamp(min=1), 0.0).tolist(),
    }


def top_losses(logits: torch.Tensor, labels: torch.Tensor, n: int) -> list[dict]:
    """The ``n`` misclassified images with the highest loss (``index`` into the inputs), worst first."""
    losses = F.cross_entropy(logits.double(), labels, reduction="none")
    probs = logits.double().softmax(1)
    pred = probs.argmax(1)
    wrong = (pred != labels).nonzero().flatten()
    order = wrong[losses[wrong].argsort(descending=True, stable=True)][:n]
    return [
        {
            "index": i,
            "true": int(labels[i]),
            "predicted": int(pred[i]),
            "probability": probs[i, pred[i]].item(),
            "true_probability": probs[i, labels[i]].item(),
            "loss": losses[i].item(),
        }
        for i in order.tolist()
    ]


def short(name: str, width: int = 24) -> str:
    """A class name cut to ``width`` characters for tables and tick labels (full names are in eval.json)."""
    return name if len(name) <= width else name[: width - 1] + "…"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def per_class_table(report: dict) -> str:
    """One row per class and the two averages; names cut to 24 characters."""
    head = f"{'#':>3} {'class':<24} {'precision':>9} {'recall':>8} {'f1':>8} {'images':>7}"
    lines = [head]
    for i, (name, r) in enumerate(report["per_class"].items()):
        lines.append(
            f"{i:>3} {short(name):<24} {_fmt(r['precision']):>9} {_fmt(r['recall']):>8} "
            f"{_fmt(r['f1']):>8} {r['support']:>7}"
        )
    for kind, r in report["averages"].items():
        lines.append(
            f"{'':>3} {kind + ' avg':<24} {_fmt(r['precision']):>9} {_fmt(r['recall']):>8} "
            f"{_fmt(r['f1']):>8} {report['images']:>7}"
        )
    return "\n".join(lines)


def confusion_text(report: dict, full_up_to: int = 10, pairs: int = 10) -> str:
    """Counts with the row share beside them; beyond ``full_up_to`` classes, the most confused pairs."""
    counts, norm, names = report["confusion_matrix"], report["confusion_matrix_normalized"], report["classes"]
    k = len(names)
    if k <= full_up_to:
        cells = [[f"{c} ({p:.0%})" for c, p in zip(cr, pr)] for cr, pr in zip(counts, norm)]
        w = max(len(s) for row in cells for s in row) + 2
        # Classes named by their own index (digits 0..9): the index alone, not "0 0", "1 1".
        indexed = all(n == str(i) for i, n in enumerate(names))
        label, indent = (lambda i, n: f"{i:>3}", 3) if indexed else (lambda i, n: f"{i:>3} {short(n):<24}", 28)
        lines = [
            "confusion matrix (rows: true class, columns: predicted class #; count and share of the row)",
            " " * indent + "".join(f"{j:>{w}}" for j in range(k)),
        ]
        lines += [label(i, n) + "".join(f"{s:>{w}}" for s in row) for i, (n, row) in enumerate(zip(names, cells))]
        return "\n".join(lines)
    off = sorted(((counts[t][p], t, p) for t in range(k) for p in range(k) if t != p and counts[t][p]), reverse=True)[
        :pairs
    ]
    lines = [f"most confused pairs ({k} classes; the full matrix is in eval.json and confusion_matrix.png)"]
    lines += [
        f"{c:>6}  {short(names[t])} -> {short(names[p])} ({norm[t][p]:.0%} of {short(names[t])})" for c, t, p in off
    ]
    return "\n".join(lines if off else lines + ["  none: every image is on the diagonal"])
