"""evaluate's metrics against scikit-learn on hand-chosen logits: a class that is never predicted,
a class with no images, top-k, calibration, and the top-loss ranking against per-image losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn import metrics as skm
from sklearn.calibration import calibration_curve

from visiontune.reports import metrics

CLASSES = ["apple", "banana", "cherry (never predicted)", "durian (no images)", "elder", "fig", "grape"]
# 12 images of 7 classes. Nothing is predicted as class 2 although 2 images are of it; no image is of
# class 3 although 1 is predicted as it. No two logits in a row tie, so every ranking is unambiguous.
LABELS = [0, 0, 0, 1, 1, 2, 2, 4, 4, 5, 6, 6]
LOGITS = [
    [3.0, 1.0, 0.2, -1.0, 0.1, 0.0, -0.5],  # 0 -> 0
    [2.5, 2.4, 0.1, 0.0, -0.2, 0.3, 0.4],  # 0 -> 0, barely
    [0.1, 2.0, 1.5, 0.3, 0.0, -1.0, 0.2],  # 0 -> 1
    [0.0, 4.0, 1.0, 0.5, 0.2, 0.1, -0.3],  # 1 -> 1
    [0.3, 0.2, 0.1, 2.2, 0.0, -0.1, 1.9],  # 1 -> 3 (a class with no images)
    [1.0, 0.5, 0.9, 0.0, 0.2, 0.3, 0.1],  # 2 -> 0
    [0.1, 3.5, 0.2, 0.0, 0.3, -0.2, -0.1],  # 2 -> 1, confidently
    [0.0, 0.1, 0.2, 0.3, 1.4, 0.5, 0.6],  # 4 -> 4
    [0.2, 0.1, 0.0, 0.3, 0.4, 2.6, 0.5],  # 4 -> 5
    [0.1, 0.0, 0.2, 0.3, 0.4, 5.0, 0.5],  # 5 -> 5
    [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6],  # 6 -> 6, unsure
    [6.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7],  # 6 -> 0, very confidently
]


@pytest.fixture(scope="module")
def got():
    return metrics.classification_metrics(torch.tensor(LOGITS, dtype=torch.float64), torch.tensor(LABELS), CLASSES)


def _np():
    logits = np.array(LOGITS)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return np.array(LABELS), probs, probs.argmax(1)


def test_the_case_is_the_one_described():
    y, _, pred = _np()
    assert 2 not in pred and 2 in y and 3 in pred and 3 not in y


def test_overall_figures_equal_sklearn(got):
    y, probs, pred = _np()
    labels = list(range(len(CLASSES)))
    assert got["images"] == 12
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(y, pred), abs=1e-12)
    with pytest.warns(UserWarning, match="y_pred contains classes not in y_true"):
        want_balanced = skm.balanced_accuracy_score(y, pred)
    assert got["balanced_accuracy"] == pytest.approx(want_balanced, abs=1e-12)
    assert got["top_k"] == 5
    assert got["top_k_accuracy"] == pytest.approx(skm.top_k_accuracy_score(y, probs, k=5, labels=labels), abs=1e-12)
    assert got["log_loss"] == pytest.approx(skm.log_loss(y, probs, labels=labels), abs=1e-12)
    assert got["confusion_matrix"] == skm.confusion_matrix(y, pred, labels=labels).tolist()
    with np.errstate(invalid="ignore"):
        want_norm = skm.confusion_matrix(y, pred, labels=labels, normalize="true")
    np.testing.assert_allclose(got["confusion_matrix_normalized"], want_norm, atol=1e-12)


def test_per_class_and_averages_equal_sklearn(got):
    y, _, pred = _np()
    labels = list(range(len(CLASSES)))
    p, r, f, s = skm.precision_recall_fscore_support(y, pred, labels=labels, zero_division=np.nan)
    for c, name in enumerate(CLASSES):
        row = got["per_class"][name]
        assert row["support"] == s[c]
        for key, want in (("precision", p[c]), ("recall", r[c]), ("f1", f[c])):
            assert (row[key] is None) if np.isnan(want) else row[key] == pytest.approx(want, abs=1e-12), (name, key)
    assert got["per_class"][CLASSES[2]]["precision"] is None  # never predicted
    assert got["per_class"][CLASSES[3]]["recall"] is None  # no images
    present = [c for c in labels if c in y]  # macro: the classes with images, undefined counted as 0
    for kind, which in (("macro", present), ("weighted", labels)):
        want = skm.precision_recall_fscore_support(y, pred, labels=which, average=kind, zero_division=0)
        for key, w in zip(("precision", "recall", "f1"), want[:3]):
            assert got["averages"][kind][key] == pytest.approx(w, abs=1e-12), (kind, key)


def test_ece_equals_the_binned_gap_from_sklearns_calibration_curve(got):
    y, probs, pred = _np()
    conf = probs.max(1)
    correct = (pred == y).astype(float)
    acc, mean_conf = calibration_curve(correct, conf, n_bins=15, strategy="uniform")
    counts = np.bincount(np.searchsorted(np.linspace(0, 1, 16)[1:-1], conf), minlength=15)
    want = float(np.sum(counts[counts > 0] * np.abs(acc - mean_conf)) / len(y))
    assert got["ece"] == pytest.approx(want, abs=1e-12) and got["ece"] > 0.05


def test_top_k_only_where_it_says_something():
    assert [metrics.top_k_for(k) for k in (2, 3, 5, 6, 100)] == [None, 2, 2, 5, 5]
    two = metrics.classification_metrics(torch.tensor([[1.0, 0.0]]), torch.tensor([1]), ["a", "b"])
    assert two["top_k"] is None and two["top_k_accuracy"] is None


def test_top_losses_are_the_wrong_images_with_the_highest_loss():
    logits, labels = torch.tensor(LOGITS, dtype=torch.float64), torch.tensor(LABELS)
    got = metrics.top_losses(logits, labels, 4)
    y, probs, pred = _np()
    loss = -np.log(probs[np.arange(len(y)), y])
    wrong = [i for i in range(len(y)) if pred[i] != y[i]]
    want = sorted(wrong, key=lambda i: -loss[i])[:4]
    assert [g["index"] for g in got] == want and want[0] == 11
    for g in got:
        i = g["index"]
        assert (g["true"], g["predicted"]) == (y[i], pred[i])
        assert g["loss"] == pytest.approx(loss[i], abs=1e-12)
        assert g["probability"] == pytest.approx(probs[i].max(), abs=1e-12)
    # Fewer wrong images than asked for: all of them, and never a right one.
    assert sorted(g["index"] for g in metrics.top_losses(logits, labels, 100)) == wrong


@pytest.mark.slow
def test_text_tables_and_the_figure_stay_readable_with_100_long_class_names(tmp_path):
    from PIL import Image

    from visiontune.reports import figures

    k = 100
    names = [f"a rather long class name number {i:03d} from the catalogue" for i in range(k)]
    labels = torch.arange(k).repeat(2)
    logits = torch.nn.functional.one_hot((labels + (labels % 7 == 0)) % k, k).double() * 5
    report = {**metrics.classification_metrics(logits, labels, names), "classes": names}
    table = metrics.per_class_table(report)
    assert max(len(line) for line in table.splitlines()) < 80 and len(table.splitlines()) == k + 3
    text = metrics.confusion_text(report)
    assert "most confused pairs" in text and max(len(line) for line in text.splitlines()) < 100
    assert metrics.short(names[0]) == "a rather long class nam…" and len(metrics.short(names[0])) == 24
    figures.plot_confusion(tmp_path / "cm.png", report)
    with Image.open(tmp_path / "cm.png") as im:  # two panels of about 10 px per class, not a poster
        assert 2000 < im.size[0] <= 3200 and 1000 < im.size[1] <= 1600


def test_classes_named_by_their_index_print_once_in_the_confusion_text():
    labels = torch.tensor([0, 1, 2, 2])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 1]), 3).double()
    digits = metrics.confusion_text(
        {**metrics.classification_metrics(logits, labels, ["0", "1", "2"]), "classes": ["0", "1", "2"]}
    )
    rows = digits.splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["0", "1", "2"] and rows[0].split()[1] == "1"  # no "0 0"
    assert rows[2].split()[:3] == ["2", "0", "(0%)"]
    named = ["cat", "dog", "2"]  # not every name is its index: the index and the name, as before
    text = metrics.confusion_text({**metrics.classification_metrics(logits, labels, named), "classes": named})
    assert text.splitlines()[2].split()[:3] == ["0", "cat", "1"]


def test_average_precision_per_class_and_macro_equal_sklearn(got):
    y, probs, _ = _np()
    present = [c for c in range(len(CLASSES)) if c in y]
    for c, name in enumerate(CLASSES):
        ap = got["per_class"][name]["average_precision"]
        if c in present:
            assert ap == pytest.approx(skm.average_precision_score(y == c, probs[:, c]), abs=1e-12), name
        else:
            assert ap is None, name  # no images: no precision-recall curve
    # Macro over the classes with images: sklearn's macro on the one-vs-rest columns of those classes.
    onehot = np.eye(len(CLASSES))[y][:, present]
    want = skm.average_precision_score(onehot, probs[:, present], average="macro")
    assert got["macro_average_precision"] == pytest.approx(want, abs=1e-12)


def test_average_precision_counts_tied_scores_as_one_threshold():
    # sklearn's step sum over distinct scores: a tie's hits and misses arrive together.
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, 50) / 4.0
    positive = rng.random(50) < 0.3
    want = skm.average_precision_score(positive, scores)
    assert metrics.average_precision(torch.tensor(scores), torch.tensor(positive)) == pytest.approx(want, abs=1e-12)
