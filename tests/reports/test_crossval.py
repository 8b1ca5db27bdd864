"""compare on the K runs of a cross-validation: each metric's mean, std and range over the folds."""

from __future__ import annotations

import json

import numpy as np

from visiontune.data.groups import fold_split
from visiontune.data.split import split_record
from visiontune.reports import compare, crossval
from visiontune.runs.runinfo import describe
from visiontune.tasks import MULTI_LABEL


def _fold_runs(tmp_path, folds: int, accuracies: list[float], held: list[int], maps=None) -> list:
    labels = np.arange(30) % 3
    paths = [f"/d/{c}/{i}.png" for i, c in enumerate(labels)]
    runs = []
    for fold, acc, m in zip(held, accuracies, maps or [None] * len(held)):
        run = tmp_path / f"fold{fold}-{len(runs)}"
        run.mkdir()
        split = fold_split(labels, None, folds, fold, seed=1)[0]
        (run / "split.json").write_text(json.dumps(split_record(split, paths, "/d", 1, 0.2)))
        config = {"model": "resnet18", "folds": folds, "fold": fold, "output_dir": str(run)}
        model = describe(
            "resnet18", "torchvision", ["0", "1", "2"], 32, (0.5,) * 3, (0.25,) * 3, "bilinear", task=MULTI_LABEL
        )
        record = {"config": config, "data": {"root": "/d"}, **({"model": model.to_dict()} if maps else {})}
        (run / "config.json").write_text(json.dumps(record))
        summary = {"best_val_accuracy": acc, "best_val_loss": 1 - acc, **({"best_val_map": m} if maps else {})}
        (run / "summary.json").write_text(json.dumps(summary))
        runs.append(compare.read_run(run))
    return runs


def test_the_folds_of_one_cross_validation_are_summed_up(tmp_path):
    accuracies = [0.8, 0.9, 0.7, 0.85]
    runs = _fold_runs(tmp_path, 4, accuracies, [0, 1, 2, 3])
    cv = crossval.summary(runs)
    assert cv["complete"] and cv["partition"] is True
    acc = cv["metrics"]["best val accuracy"]
    assert np.isclose(acc["mean"], np.mean(accuracies)) and np.isclose(acc["std"], np.std(accuracies, ddof=1))
    assert (acc["min"], acc["max"]) == (0.7, 0.9)
    text = compare.terminal_table(runs)
    assert "cross-validation: all 4 folds; their validation sets are disjoint and hold every image" in text
    assert f"best val accuracy: {np.mean(accuracies):.4f} +- {np.std(accuracies, ddof=1):.4f}" in text
    assert "fold" in text.splitlines()[1]  # the fold is the setting that differs


def test_missing_or_repeated_folds_are_said_and_other_runs_are_no_cross_validation(tmp_path):
    for name in ("part", "twice", "plain"):
        (tmp_path / name).mkdir()
    cv = crossval.summary(_fold_runs(tmp_path / "part", 3, [0.5, 0.6], [0, 2]))
    assert not cv["complete"] and cv["partition"] is True
    assert crossval.lines(cv)[0].startswith("cross-validation: folds 0, 2 of 3 (not all of them)")
    cv = crossval.summary(_fold_runs(tmp_path / "twice", 3, [0.5, 0.6], [1, 1]))
    assert cv["partition"] is False and "overlap" in crossval.lines(cv)[0]
    plain = _fold_runs(tmp_path / "plain", 2, [0.5, 0.6], [0, 1])
    assert crossval.summary([compare.Run(r.name, {"model": "x"}, r.summary, [], r.task) for r in plain]) is None


def test_the_folds_of_a_multi_label_cross_validation_sum_up_their_map_too(tmp_path):
    maps = [0.61, 0.72, 0.68]
    runs = _fold_runs(tmp_path, 3, [0.9, 0.8, 0.85], [0, 1, 2], maps)
    got = crossval.summary(runs)["metrics"]["best val mAP"]
    assert np.isclose(got["mean"], np.mean(maps)) and np.isclose(got["std"], np.std(maps, ddof=1))
    assert (got["min"], got["max"]) == (0.61, 0.72)
    assert f"best val mAP: {np.mean(maps):.4f} +- {np.std(maps, ddof=1):.4f}" in compare.terminal_table(runs)
    (tmp_path / "single").mkdir()
    single = _fold_runs(tmp_path / "single", 2, [0.9, 0.8], [0, 1])
    assert "best val mAP" not in crossval.summary(single)["metrics"]  # single-label folds have none
