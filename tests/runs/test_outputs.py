"""Run-folder writers: the best-epoch rule, metrics.csv, atomic writes."""

from __future__ import annotations

import csv
import os

import pytest

from visiontune import files, tasks
from visiontune.reports import figures
from visiontune.runs import records


def _row(epoch, acc, loss):
    phase = {"loss": loss, "accuracy": acc, "images": 10, "seconds": 2.0, "images_per_s": 5.0}
    return {"epoch": epoch, "train": phase, "val": phase}


def test_best_epoch_is_highest_val_accuracy_then_lowest_val_loss():
    history = [_row(0, 0.90, 0.30), _row(1, 0.95, 0.20), _row(2, 0.95, 0.10), _row(3, 0.94, 0.01)]
    assert figures.best_epoch(history)["epoch"] == 2
    assert figures.best_epoch(history[:2] + [_row(2, 0.95, 0.20)])["epoch"] == 1  # full tie: the earlier


def test_metrics_csv_has_a_row_per_epoch_and_phase(tmp_path):
    path = tmp_path / "metrics.csv"
    records.write_metrics_csv(path, [_row(0, 0.5, 0.7), _row(1, 0.75, 0.5)], tasks.SINGLE_LABEL)
    rows = list(csv.DictReader(open(path)))
    assert [(r["epoch"], r["phase"], r["accuracy"]) for r in rows] == [
        ("0", "train", "0.500000"),
        ("0", "val", "0.500000"),
        ("1", "train", "0.750000"),
        ("1", "val", "0.750000"),
    ]
    assert "map" not in rows[0]


def test_a_multi_label_runs_metrics_csv_adds_its_val_map_and_leaves_train_rows_empty(tmp_path):
    path = tmp_path / "metrics.csv"
    history = [_row(0, 0.5, 0.7), _row(1, 0.75, 0.5)]
    for row, m in zip(history, (0.25, None)):  # epoch 1's val split had no positive: no mAP
        row["val"] = {**row["val"], "map": m, "thresholds": [0.5]}
    records.write_metrics_csv(path, history, tasks.MULTI_LABEL)
    rows = list(csv.DictReader(open(path)))
    assert [(r["phase"], r["map"]) for r in rows] == [("train", ""), ("val", "0.250000"), ("train", ""), ("val", "")]


def test_a_summary_adds_what_the_task_measures_of_the_best_epoch():
    history = [_row(0, 0.5, 0.7), _row(1, 0.75, 0.5)]
    for row in history:
        row["train"] = {**row["train"], "steady_images": 10, "steady_seconds": 2.0, "data_wait_seconds": 0.0}
    assert "best_val_map" not in records.results(history, "accuracy", tasks.SINGLE_LABEL)
    for row, m, t in zip(history, (0.9, 0.6), ([0.3], [0.7])):
        row["val"] = {**row["val"], "map": m, "thresholds": t}
    got = records.results(history, "map", tasks.MULTI_LABEL)
    # The trainer's rows count from 0; the summary, as the console and every file, from 1.
    assert (got["best_epoch"], got["epochs_counted_from"], got["best_val_map"], got["thresholds"]) == (1, 1, 0.9, [0.3])


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "f.json"
    files.atomic_write(target, "old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        files.atomic_write(target, "new")
    assert target.read_text() == "old" and os.listdir(target.parent) == ["f.json"]


def test_curves_mark_the_best_epoch_show_the_lr_and_keep_the_legend_off_the_data(tmp_path):
    import matplotlib.pyplot as plt

    history = [
        {**_row(e, acc, loss), "lr": lr}
        for e, acc, loss, lr in ((1, 0.6, 0.9, 0.01), (2, 0.9, 0.4, 0.008), (3, 0.8, 0.5, 0.002))
    ]
    fig = figures.history_figure(history, tasks.SINGLE_LABEL)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    acc_ax, _, lr_ax = fig.axes
    [legend] = fig.legends
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    # history.json counts from 1, as the console's "Epoch 2/3": the figure too.
    assert "best epoch 2, chosen by val accuracy (0.9000)" in [t.get_text() for t in legend.get_texts()]
    star = next(line for line in acc_ax.get_lines() if line.get_marker() == "*")
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([2], [0.9])
    assert [t.get_text() for t in acc_ax.get_xticklabels()] == ["1", "2", "3"]
    assert [list(line.get_ydata()) for line in lr_ax.get_lines() if line.get_marker() == "o"] == [[0.01, 0.008, 0.002]]
    plt.close(fig)
    figures.plot_history(tmp_path / "c.png", history, tasks.SINGLE_LABEL)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_a_multi_label_runs_curves_add_its_val_map_and_mark_the_epoch_its_best_metric_picked():
    import math

    import matplotlib.pyplot as plt

    maps = (0.5, None, 0.8, 0.7)  # epoch 2's val split had no positive: no mAP, a gap in the curve
    history = [{**_row(e, acc, 0.5), "lr": 0.01} for e, acc in enumerate((0.9, 0.95, 0.85, 0.8), start=1)]
    for row, m in zip(history, maps):
        row["val"] = {**row["val"], "map": m, "thresholds": [0.5, 0.5]}
    assert figures.best_epoch(history, "map")["epoch"] == 3 and figures.best_epoch(history)["epoch"] == 2
    fig = figures.history_figure(history, tasks.MULTI_LABEL, "map")
    acc_ax, _, map_ax, _ = fig.axes
    assert map_ax.get_title() == "Validation mAP (macro)"
    [curve] = [line for line in map_ax.get_lines() if line.get_marker() == "o"]  # val only: train has no mAP
    got = list(curve.get_ydata())
    assert math.isnan(got[1]) and got[:1] + got[2:] == [0.5, 0.8, 0.7]
    star = next(line for line in map_ax.get_lines() if line.get_marker() == "*")
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([3], [0.8])
    assert "best epoch 3, chosen by val mAP (0.8000)" in [t.get_text() for t in fig.legends[0].get_texts()]
    plt.close(fig)  # (a single-label run's three panels: the test above)


def test_atomic_files_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        files.atomic_write(tmp_path / "a.bin", b"x")
        with files.atomic_file(tmp_path / "b.bin") as f:
            f.write(b"y")
        os.umask(0o077)
        files.atomic_write(tmp_path / "private.bin", b"z")
    finally:
        os.umask(old)
    assert [(tmp_path / n).stat().st_mode & 0o777 for n in ("a.bin", "b.bin", "private.bin")] == [0o644, 0o644, 0o600]
    assert (tmp_path / "b.bin").read_bytes() == b"y"
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin", "private.bin"]


def test_the_image_cache_and_the_scan_use_one_cache_folder(tmp_path, monkeypatch):
    from visiontune.cluster import host
    from visiontune.data import check
    from visiontune.loading import cache

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "vt"))
    assert cache.resolve_dir("auto") == str(tmp_path / "vt") == os.path.dirname(check.scan_cache_path("/data"))
    monkeypatch.delenv("VISIONTUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.resolve_dir("auto") == host.user_cache_dir() == str(tmp_path / "xdg" / "visiontune")
    assert cache.resolve_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
