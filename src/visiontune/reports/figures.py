"""The figures: a run's curves (``training_results.png``), the confusion matrix (counts beside row
shares) and the top losses, and the headless pyplot they are drawn with.

Both stay readable from 2 to 100 classes: tick labels are cut to 24 characters
(the full names are in ``eval.json``; beyond 20 classes each after its index),
the font shrinks and the cells lose their numbers as classes grow, and the
figure grows with the classes up to a cap. Epochs are counted from 1, as the
console prints them. ``tests/reports/test_figures.py`` checks every figure for
text that overlaps other text or a panel. Matplotlib runs headless (Agg); files
are written atomically.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

from visiontune.files import atomic_write
from visiontune.reports.metrics import short
from visiontune.tasks import RANKED, Task

# Beyond this many classes the panel (18 in at most) leaves under 0.15 in a name: unreadable, and laying out
# 1,000 rotated labels per axis took matplotlib minutes. The class order is in the report and eval.json.
NAMED_TICKS = 120


def plot_confusion(path: str | Path, report: dict) -> None:
    """``confusion_matrix.png``: the figure of ``confusion_figure``."""
    save_figure(path, confusion_figure(report))


def confusion_figure(report: dict):
    """Counts (left) and each row divided by its class's images (right)."""
    plt = pyplot()
    k = len(report["classes"])
    # Many classes: each name after its index (the report's per-class table's #), since names cut to 24
    # characters can share all of them ("a rather long class nam…").
    names = [short(c) if k <= 20 else f"{i} {short(c, 20)}" for i, c in enumerate(report["classes"])]
    side = min(18.0, 3.2 + 0.15 * k)  # inches per panel: about 0.15 in (12 px) per class at 100 classes
    font = max(7.0, min(10.0, 10.5 - 0.05 * k))  # 7 pt is 8 px at 80 dpi: one name per 12 px row
    fig, axes = plt.subplots(1, 2, figsize=(2 * side + 2, side + 1), constrained_layout=True)
    for ax, key, title, fmt in (
        (axes[0], "confusion_matrix", "counts", "{:d}"),
        (axes[1], "confusion_matrix_normalized", "row shares", "{:.0%}"),
    ):
        m = report[key]
        image = ax.imshow(
            m, cmap="Blues", vmin=0, vmax=1 if key.endswith("normalized") else None, interpolation="nearest"
        )
        fig.colorbar(image, ax=ax, shrink=0.6)
        if k <= 20:  # beyond that the numbers would not fit in the cells
            # The colour scale's top (1 for the shares): the number is white where its cell is dark.
            top = 1 if key.endswith("normalized") else max(max(row) for row in m) or 1
            cell = min(font, 130 / k)  # points: a 4-digit count fits its cell at 20 classes
            for t in range(k):
                for p in range(k):
                    ax.text(
                        p,
                        t,
                        fmt.format(m[t][p]),
                        ha="center",
                        va="center",
                        fontsize=cell,
                        color="white" if m[t][p] > top / 2 else "black",
                    )
        if k <= NAMED_TICKS:
            ax.set_xticks(range(k), names, rotation=90 if k > 4 or max(map(len, names)) > 6 else 0, fontsize=font)
            ax.set_yticks(range(k), names, fontsize=font)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        ax.set_title(f"Confusion matrix, {title}")
    return fig


def plot_top_losses(path: str | Path, items: list[dict], paths: list[str], classes: list[str], size: int = 160) -> None:
    """``top_losses.png``: the figure of ``top_losses_figure``."""
    save_figure(path, top_losses_figure(items, paths, classes, size))


def top_losses_figure(items: list[dict], paths: list[str], classes: list[str], size: int = 160):
    """A grid of the images, each titled true / predicted (probability) and its loss.

    Constrained layout gives each tile's three title lines their own room above the image, so a title
    never runs into the image of the row above (where a white digit hid the black class name).
    """
    import torch

    from visiontune.data.decode import BadImage, read_image, resize_uint8

    plt = pyplot()
    if not items:
        fig = plt.figure(figsize=(6, 1))
        fig.text(0.5, 0.5, "Top losses: no misclassified images", ha="center", va="center", fontsize=12)
        return fig
    cols = min(4, len(items))
    rows = max(1, -(-len(items) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 3.4 * rows + 0.5), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for ax, it in zip(axes.flat, items):
        try:
            img = resize_uint8(read_image(paths[it["index"]]), size)
        except BadImage:
            img = torch.zeros(3, size, size, dtype=torch.uint8)
        ax.imshow(img.permute(1, 2, 0).numpy())
        ax.set_title(
            f"true: {short(classes[it['true']], 20)}\npredicted: {short(classes[it['predicted']], 20)} "
            f"({it['probability']:.2f})\nloss {it['loss']:.2f}",
            fontsize=9,
        )
    fig.suptitle("Top losses: the most confidently wrong images")
    return fig


def save_figure(path: str | os.PathLike, fig, dpi: int = 80) -> None:
    """A matplotlib figure as a PNG, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_history(path: str | os.PathLike, history: list[dict], task: Task, metric: str = "accuracy") -> None:
    """``training_results.png``: the figure of ``history_figure``."""
    save_figure(path, history_figure(history, task, metric))


def history_figure(history: list[dict], task: Task, metric: str = "accuracy"):
    """Accuracy and loss, train against val, the val metrics the run's ``task`` adds (multi-label: mAP),
    and the learning rate; the best epoch (by ``metric``, the run's ``--best-metric``) marked.

    ``history`` is counted from 1, as training prints epochs ("Epoch 1/3") and ``history.json`` holds them
    (``reports.epochs``). The legend sits below the panels, never over a curve, and says which metric chose the best
    epoch (``best_epoch``), a dotted line with its val points starred, so the curve and the saved model
    can be matched.
    """
    import matplotlib.ticker

    plt = pyplot()
    epochs = [row["epoch"] for row in history]
    best = best_epoch(history, metric)
    panels = [("accuracy", task.accuracy_title), ("loss", "Training and Validation Loss")]
    panels += [(key, f"Validation {name} (macro)") for key, name in task.curves]  # measured on val only
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.4))
    shown = dict(task.curves).get(metric, metric)
    said = best["val"].get(metric)
    best_x = best["epoch"]
    best_label = f"best epoch {best_x}, chosen by val {shown} ({'-' if said is None else f'{said:.4f}'})"
    for ax, (key, title) in zip(axes, panels):
        for phase, label in (("train", "Training"), ("val", "Validation")):
            if key in _keys(history, phase):
                values = [_nan(row[phase].get(key)) for row in history]  # no positive in val: no mAP
                ax.plot(epochs, values, marker="o", label=label, color="C1" if phase == "val" else "C0")
        ax.plot(
            [best_x],
            [_nan(best["val"].get(key))],
            marker="*",
            markersize=16,
            color="tab:red",
            linestyle="none",
            label=best_label,
        )
        ax.set_title(title)
    _lr_panel(axes[-1], [(row["epoch"], row["lr"]) for row in history if "lr" in row])
    for ax in axes:
        ax.axvline(best_x, color="tab:red", linestyle=":", linewidth=1)
        ax.set_xlabel("epoch")
        if len(epochs) <= 15:  # every epoch a tick (a one-epoch run would otherwise get fractional ones)
            ax.set_xticks(epochs)
        else:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    legend = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}  # one per label
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room below the panels for the legend
    return fig


def _lr_panel(ax, lrs: list[tuple[int, float]]) -> None:
    """The learning rate per epoch, its ticks in plain numbers: no "1e-3" offset over the axis. A constant lr
    is said as one value (matplotlib would spread a flat line over 0.96..1.04 of it)."""
    import matplotlib.ticker

    ax.plot([e for e, _ in lrs], [lr for _, lr in lrs], marker="o", color="tab:gray", label="learning rate")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
    values = {lr for _, lr in lrs}
    if len(values) == 1:
        (lr,) = values
        ax.set_yticks([lr])
        ax.set_title(f"Learning rate: {lr:g}, constant")
    else:
        ax.set_title("Learning rate (at the end of each epoch)")


def _keys(history: list[dict], phase: str) -> set[str]:
    return {k for row in history for k in row.get(phase, {})}


def _nan(v):
    return float("nan") if v is None else v


def best_epoch(history: list[dict], metric: str = "accuracy") -> dict:
    """The best epoch by ``metric`` as training picks it: highest val accuracy (ties: lower val loss), lowest
    val loss (ties: higher accuracy), or highest val mAP (ties: lower loss; no mAP ranks last); then the
    earlier epoch."""

    def key(r):
        v = r["val"]
        if metric in RANKED:
            m = v.get(metric)
            return (-math.inf if m is None else RANKED[metric] * m), -v["loss"], -r["epoch"]
        if metric == "loss":
            return -v["loss"], v["accuracy"], -r["epoch"]
        return v["accuracy"], -v["loss"], -r["epoch"]

    return max(history, key=key)
