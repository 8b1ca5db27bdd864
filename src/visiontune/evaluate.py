"""``visiontune evaluate``: a trained run measured on labelled data.

The data is read with the same ``discover`` as ``train`` (any layout it
accepts) and must have the run's classes. The forward pass is predict's
(``inference.forward``), so every image counts once whatever the number of
processes, and the numbers -- accuracy, log loss, per-class precision and
recall, the confusion matrix -- are computed once, on the main process, from
the gathered logits in data order: N processes give exactly the same figures
as one. Unreadable images are left out of every figure and listed.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from visiontune import inference, outputs
from visiontune.config import UserError
from visiontune.data.layouts import discover
from visiontune.data.pipeline import UNREADABLE
from visiontune.inference import InferenceConfig, LoadedModel, unreadable_reasons


def metrics(logits: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> dict:
    """Accuracy, log loss (natural log), per-class precision/recall and the confusion matrix."""
    k = len(classes)
    pred = logits.argmax(1)
    # confusion[t, p]: images of true class t predicted as p.
    confusion = torch.bincount(labels * k + pred, minlength=k * k).view(k, k)
    per_class = {}
    for c, name in enumerate(classes):
        predicted, actual, hit = int(confusion[:, c].sum()), int(confusion[c].sum()), int(confusion[c, c])
        per_class[name] = {"precision": hit / predicted if predicted else None,  # undefined: never predicted
                           "recall": hit / actual if actual else None, "support": actual}
    n = labels.numel()
    return {"images": n, "accuracy": (pred == labels).double().mean().item() if n else None,
            "log_loss": F.cross_entropy(logits.double(), labels).item() if n else None,
            "per_class": per_class, "confusion_matrix": confusion.tolist()}


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def confusion_table(confusion: list[list[int]], classes: list[str]) -> str:
    width = max(6, *(len(c) for c in classes), *(len(str(v)) for row in confusion for v in row)) + 2
    lines = ["confusion matrix (rows: true class, columns: predicted)",
             " " * width + "".join(c.rjust(width) for c in classes)]
    lines += [name.ljust(width) + "".join(str(v).rjust(width) for v in row) for name, row in zip(classes, confusion)]
    return "\n".join(lines)


def plot_confusion(path: str | Path, confusion: list[list[int]], classes: list[str]) -> None:
    plt = outputs.pyplot()
    k = len(classes)
    fig, ax = plt.subplots(figsize=(2 + 0.6 * k, 1.6 + 0.6 * k))
    ax.imshow(confusion, cmap="Blues")
    top = max(max(row) for row in confusion) or 1
    for t in range(k):
        for p in range(k):
            ax.text(p, t, str(confusion[t][p]), ha="center", va="center",
                    color="white" if confusion[t][p] > top / 2 else "black")
    ax.set_xticks(range(k), classes, rotation=45 if k > 4 else 0)
    ax.set_yticks(range(k), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("Confusion matrix")
    fig.tight_layout()
    outputs.save_figure(path, fig, dpi=100)


def evaluate(loaded: LoadedModel, icfg: InferenceConfig, data: str, out: str) -> dict:
    """Measure ``model`` on every labelled image of ``data``; write ``out`` and the confusion matrix."""
    images, classes = discover(data), loaded.classes
    # Case aside (Kaggle's cat/dog, PetImages' Cat/Dog), the names and their order must agree.
    if [c.lower() for c in images.classes] != [c.lower() for c in classes]:
        raise UserError(f"{data} has classes {images.classes} but the model was trained on {classes}; "
                        "evaluate on data with the same classes")
    if int(os.environ.get("RANK", "0")) == 0:
        print(images.describe())
    accelerator = inference.start(icfg)
    logits, labels = inference.forward(accelerator, loaded, icfg, images.paths, images.labels, "evaluate")
    report: dict = {}
    if accelerator.is_main_process:
        skipped = unreadable_reasons(images.paths, labels)
        ok = labels != UNREADABLE
        report = {"data": images.root, "layout": images.layout, "classes": classes,
                  **metrics(logits[ok], labels[ok], classes), "world_size": accelerator.num_processes,
                  "skipped": [{"path": p, "reason": r} for p, r in skipped]}
        png = Path(out).with_name("confusion_matrix.png")
        plot_confusion(png, report["confusion_matrix"], classes)
        outputs.write_json(out, report)
        print(confusion_table(report["confusion_matrix"], classes))
        print("class".ljust(16) + "precision".rjust(11) + "recall".rjust(9) + "images".rjust(9))
        for name, m in report["per_class"].items():
            print(name.ljust(16) + _num(m["precision"]).rjust(11) + _num(m["recall"]).rjust(9)
                  + str(m["support"]).rjust(9))
        print(f"visiontune: {report['images']} images, accuracy {_num(report['accuracy'])}, "
              f"log loss {_num(report['log_loss'])} -> {out}, {png}")
    accelerator.wait_for_everyone()
    return report
