"""The evaluation figures: the confusion matrix (counts beside row shares) and the top losses.

Both stay readable from 2 to 100 classes: tick labels are cut to 24 characters
(the full names are in ``eval.json``), the font shrinks and the cells lose
their numbers as classes grow, and the figure grows with the classes up to a
cap. Matplotlib runs headless (Agg); files are written atomically.
"""

from __future__ import annotations

from pathlib import Path

from visiontune.metrics import short
from visiontune.outputs import pyplot, save_figure

# Beyond this many classes the panel (18 in at most) leaves under 0.15 in a name: unreadable, and laying out
# 1,000 rotated labels per axis took matplotlib minutes. The class order is in the report and eval.json.
NAMED_TICKS = 120


def plot_confusion(path: str | Path, report: dict) -> None:
    """Counts (left) and each row divided by its class's images (right)."""
    plt = pyplot()
    names = [short(c) for c in report["classes"]]
    k = len(names)
    side = min(18.0, 3.2 + 0.15 * k)  # inches per panel: about 0.15 in (12 px) per class at 100 classes
    font = max(5.5, min(10.0, 10.5 - 0.05 * k))
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
            top = max(max(row) for row in m) or 1
            for t in range(k):
                for p in range(k):
                    ax.text(
                        p,
                        t,
                        fmt.format(m[t][p]),
                        ha="center",
                        va="center",
                        fontsize=font,
                        color="white" if m[t][p] > top / 2 else "black",
                    )
        if k <= NAMED_TICKS:
            ax.set_xticks(range(k), names, rotation=90 if k > 4 or max(map(len, names)) > 6 else 0, fontsize=font)
            ax.set_yticks(range(k), names, fontsize=font)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        ax.set_title(f"Confusion matrix, {title}")
    save_figure(path, fig)


def plot_top_losses(path: str | Path, items: list[dict], paths: list[str], classes: list[str], size: int = 160) -> None:
    """A grid of the images, each titled true / predicted (probability) and its loss."""
    import torch

    from visiontune.data.decode import BadImage, read_image, resize_uint8

    plt = pyplot()
    if not items:
        fig = plt.figure(figsize=(6, 1))
        fig.text(0.5, 0.5, "Top losses: no misclassified images", ha="center", va="center", fontsize=12)
        save_figure(path, fig)
        return
    cols = min(4, len(items))
    rows = max(1, -(-len(items) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.6 * rows + 0.4), squeeze=False)
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
            fontsize=8,
        )
    fig.suptitle("Top losses: the most confidently wrong images")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # keep the titles clear of the heading
    save_figure(path, fig)
