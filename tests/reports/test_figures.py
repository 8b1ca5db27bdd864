"""Every figure visiontune draws, at 2, 10 and 100 classes, read by matplotlib's own text extents: no text
box overlaps another, none runs over a panel it does not belong to, none leaves the figure."""

from __future__ import annotations

import random

import pytest
from matplotlib.text import Text

from visiontune import tasks
from visiontune.reports import benchtable, compare, figures


def _skipped(fig) -> set[int]:
    """Texts matplotlib does not draw: the tick labels outside an axis's view, an axis switched off."""
    skip = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not ax.axison or not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    skip.update((id(tick.label1), id(tick.label2)))
            if not ax.axison:
                skip.update((id(axis.label), id(axis.get_offset_text())))
    return skip


def clashes(fig) -> list[str]:
    """What reads badly in ``fig``: text boxes that overlap each other, a title, label or legend entry over a
    panel, a text inside a panel (a cell's number, a bar's value) outside its own, a text cut off by the edge."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    skip = _skipped(fig)
    inside = {id(t): ax for ax in fig.axes for t in ax.texts}
    texts = [
        t
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and id(t) not in skip and t.get_figure() is not None
    ]
    boxes = [(t, t.get_window_extent(renderer).expanded(1, 1).padded(-1)) for t in texts]  # 1 px of slack
    panels = [(ax, ax.get_window_extent(renderer).padded(-1)) for ax in fig.axes]
    whole = fig.bbox.padded(1)
    found = []
    for i, (a, box) in enumerate(boxes):
        name = repr(a.get_text()[:40])
        for b, other in boxes[i + 1 :]:
            if box.overlaps(other):
                found.append(f"{name} overlaps {b.get_text()[:40]!r}")
        own = inside.get(id(a))
        for ax, panel in panels:
            if ax is own:
                if not (panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1):
                    found.append(f"{name} leaves its panel")
            elif box.overlaps(panel):
                found.append(f"{name} runs over the panel titled {ax.get_title()[:30]!r}")
        if not (whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1):
            found.append(f"{name} is cut off by the figure's edge")
    return found


def _names(k: int) -> list[str]:
    long = k >= 100  # the names of a large catalogue: cut to 24 characters on the ticks
    return [f"a rather long class name number {i:03d}" if long else f"class {i}" for i in range(k)]


def _history(multi_label: bool) -> list[dict]:
    rows = []
    for e in range(3):
        val = {"accuracy": 0.6 + 0.1 * e, "loss": 0.9 - 0.2 * e, **({"map": 0.7 + 0.05 * e} if multi_label else {})}
        rows.append(
            {"epoch": e + 1, "lr": 1e-3, "train": {"accuracy": 0.5 + 0.1 * e, "loss": 1.0 - 0.2 * e}, "val": val}
        )
    return rows


def confusion(k: int, tmp_path):
    rng = random.Random(k)
    m = [[rng.randint(20, 999) if t == p else rng.randint(0, 99) for p in range(k)] for t in range(k)]
    shares = [[v / sum(row) for v in row] for row in m]
    report = {"classes": _names(k), "confusion_matrix": m, "confusion_matrix_normalized": shares}
    return figures.confusion_figure(report)


def top_losses(k: int, tmp_path):
    """Scanned digits' look: a white digit on black, the case where a title over the image above vanished."""
    from PIL import Image, ImageDraw

    paths = []
    for i in range(5):  # two rows of tiles: the second row's titles under the first row's images
        image = Image.new("RGB", (28, 28), "black")
        ImageDraw.Draw(image).text((10, 8), str(i), fill="white")
        image.save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    items = [{"index": i, "true": i % k, "predicted": (i + 1) % k, "probability": 0.93, "loss": 2.71} for i in range(5)]
    return figures.top_losses_figure(items, paths, _names(k))


def curves(k: int, tmp_path):
    return figures.history_figure(_history(multi_label=False), tasks.SINGLE_LABEL)


def multi_label_curves(k: int, tmp_path):
    return figures.history_figure(_history(multi_label=True), tasks.MULTI_LABEL, "map")


def bench(k: int, tmp_path):
    common = {"devices": 1, "processes": 1, "per_process_batch": 100, "global_batch": 100, "data_stall": 0.0}
    rows = [
        {**common, "strategy": "single", "epoch_seconds": 40.0, "images_per_s": 10.0, "speedup": 1.0},
        {
            **common,
            "strategy": "ddp",
            "devices": 2,
            "processes": 2,
            "per_process_batch": 50,
            "epoch_seconds": 1.0,
            "images_per_s": 390.0,
            "speedup": 39.0,
            "unreliable": "noisy machine: load average 5.00 per core before the benchmark started",
        },
        {"strategy": "dp", "skipped": "DataParallel needs 2 or more GPUs; 0 visible"},
    ]
    return benchtable.chart_figure(rows)


def _run(name: str, maps=None) -> compare.Run:
    history = _history(multi_label=False)
    for row, m in zip(history, maps or ()):
        row["val"]["map"] = m
    return compare.Run(name, {}, {"best_epoch": 2}, history, tasks.MULTI_LABEL if maps else tasks.SINGLE_LABEL)


def compared(k: int, tmp_path):
    return compare.curves_figure([_run("runs/lr-0.01"), _run("runs/lr-0.1-modern-recipe")])


def compared_multi_label(k: int, tmp_path):
    return compare.curves_figure([_run("runs/multi-label", [0.5, 0.6, 0.7]), _run("runs/single-label")])


def k_fold(k: int, tmp_path):
    return compare.curves_figure([_run(f"runs/cv/fold{i}") for i in range(5)])


FIGURES = [confusion, top_losses, curves, multi_label_curves, bench, compared, compared_multi_label, k_fold]


@pytest.mark.parametrize("draw", FIGURES, ids=lambda f: f.__name__)
def test_no_text_in_a_figure_overlaps_another_or_a_panel(draw, tmp_path):
    import matplotlib.pyplot as plt

    fig = draw(2, tmp_path)
    try:
        assert clashes(fig) == []
    finally:
        plt.close(fig)


@pytest.mark.slow
@pytest.mark.parametrize("k", [10, 100])
@pytest.mark.parametrize("draw", [confusion, top_losses], ids=lambda f: f.__name__)  # the others draw no class
def test_no_text_overlaps_at_10_and_100_classes(draw, k, tmp_path):
    import matplotlib.pyplot as plt

    fig = draw(k, tmp_path)
    try:
        assert clashes(fig) == []
    finally:
        plt.close(fig)


def test_a_constant_learning_rate_is_said_as_its_value_without_an_offset():
    import matplotlib.pyplot as plt

    fig = figures.history_figure(_history(multi_label=False), tasks.SINGLE_LABEL)
    fig.canvas.draw()
    lr_ax = fig.axes[-1]
    assert lr_ax.yaxis.get_offset_text().get_text() == ""  # no "1e-3" over the axis
    assert [t.get_text() for t in lr_ax.get_yticklabels()] == ["0.001"]
    assert lr_ax.get_title() == "Learning rate: 0.001, constant"
    plt.close(fig)
