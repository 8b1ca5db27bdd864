"""The contract every task keeps: an unreadable sample is left out of every count and loss, the losses are
the textbook ones, and the labels say which task they are."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, log_loss

from visiontune import tasks
from visiontune.tasks import MULTI_LABEL, SINGLE_LABEL, UNREADABLE

K = 4


def _batch(task, seed: int = 0):
    """Logits and labels of 6 samples, the third unreadable, kept and collated as a dataset does."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, K, generator=g)
    if task is SINGLE_LABEL:
        raw = np.array([0, 3, 1, 2, 1, 0])
    else:
        raw = (torch.rand(6, K, generator=g) > 0.5).numpy()
    kept = task.label_array(raw)
    rows = [task.sample_label(kept, i) for i in range(6)]
    rows[2] = task.unreadable_label(kept)
    labels = torch.stack(rows) if task is MULTI_LABEL else torch.tensor(rows)
    return logits, labels


@pytest.mark.parametrize("task", [SINGLE_LABEL, MULTI_LABEL], ids=lambda t: t.name)
def test_an_unreadable_sample_counts_nowhere(task):
    logits, labels = _batch(task)
    assert tasks.get(task.name) is task
    assert task.readable(labels).tolist() == [True, True, False, True, True, True]
    assert (labels[2] == UNREADABLE).all()  # cross-entropy's ignore_index, or a row of it
    assert task.eval_loss(logits, labels)[2] == 0 and task.hits(logits, labels)[2] == 0
    # The mean loss is over the five read samples: the unreadable one's logits do not move it.
    moved = logits.clone()
    moved[2] += 100.0
    assert torch.equal(task.mean_loss(logits, labels), task.mean_loss(moved, labels))
    assert torch.allclose(task.mean_loss(logits, labels), task.eval_loss(logits, labels).sum() / 5)
    weights = torch.ones(K)
    assert torch.allclose(task.smoothed_loss(0.0, weights)(logits, labels), task.mean_loss(logits, labels))
    words = task.label_text(labels, ["a", "b", "c", "d"])
    assert words[2] == "unreadable" and len(words) == 6


def test_the_losses_and_probabilities_are_the_textbook_ones():
    logits, labels = _batch(SINGLE_LABEL)
    ok = SINGLE_LABEL.readable(labels)
    probs = SINGLE_LABEL.probabilities(logits)
    assert torch.allclose(probs.sum(1), torch.ones(6))
    want = log_loss(labels[ok].numpy(), logits[ok].double().softmax(1).numpy(), labels=list(range(K)))
    assert SINGLE_LABEL.mean_loss(logits, labels).item() == pytest.approx(want, rel=1e-5)
    assert SINGLE_LABEL.hits(logits, labels)[ok].tolist() == (logits.argmax(1) == labels)[ok].float().tolist()

    logits, labels = _batch(MULTI_LABEL)
    ok = MULTI_LABEL.readable(labels)
    p = MULTI_LABEL.probabilities(logits)[ok].numpy()
    y = labels[ok].numpy()
    bce = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()
    assert MULTI_LABEL.mean_loss(logits, labels).item() == pytest.approx(bce, rel=1e-5)
    ranked = MULTI_LABEL.ranking(logits, labels)
    present = [c for c in range(K) if y[:, c].any()]
    want_map = np.mean([average_precision_score(y[:, c], p[:, c]) for c in present])
    assert ranked["map"] == pytest.approx(want_map) and len(ranked["thresholds"]) == K


@pytest.mark.parametrize("task", [SINGLE_LABEL, MULTI_LABEL], ids=lambda t: t.name)
def test_a_mixed_batch_keeps_an_unreadable_sample_out_of_the_loss(task):
    from torchvision.transforms import v2

    logits, labels = _batch(task)
    images = torch.rand(6, 3, 8, 8)
    mix = v2.MixUp(alpha=1.0, num_classes=task.mixed_classes(K))
    torch.manual_seed(0)
    parts = [task.mix_pair(mix, images[j : j + 2], labels[j : j + 2]) for j in range(0, 6, 2)]
    targets = task.mixed_targets(labels, torch.cat([y for _, y in parts]))
    assert targets.shape == (6, K)
    loss = task.smoothed_loss(0.0, None)
    # The unreadable sample's target is what the loss leaves out: moving its logits changes nothing.
    moved = logits.clone()
    moved[2] += 100.0
    assert torch.equal(loss(logits, targets), loss(moved, targets))
    counted = task.counted(labels, targets)
    assert not task.readable(counted)[2] and task.readable(counted).sum() == 5


@pytest.mark.parametrize("task", [SINGLE_LABEL, MULTI_LABEL], ids=["single", "multi"])
def test_an_exported_models_probabilities_give_the_eager_logits_meaning_back(task):
    """The activation an export ends in, undone by ``logits_of``, gives the probabilities predict computes
    from the eager logits; TTA's average is the mean of the views' probabilities."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, K, generator=g) * 4
    probs = task.activation()(logits)
    again = task.probabilities(task.logits_of(probs))
    assert torch.allclose(again.double(), task.probabilities(logits).double(), atol=1e-6)
    views = torch.randn(3, 5, K, generator=g)
    if task is SINGLE_LABEL:
        want = np.mean([torch.softmax(v, 1).numpy() for v in views], 0)
    else:
        want = np.mean([1 / (1 + np.exp(-v.double().numpy())) for v in views], 0)
    assert np.allclose(task.probabilities(task.averaged(views)).numpy(), want, atol=1e-6)


def test_the_answers_and_rows_of_each_task():
    classes, row = ["cat", "dog", "owl"], [0.2, 0.5, 0.3]
    assert SINGLE_LABEL.thresholds(None, 3) is None and MULTI_LABEL.thresholds(None, 3) == [0.5] * 3
    assert MULTI_LABEL.thresholds((0.1, 0.9, 0.25), 3) == [0.1, 0.9, 0.25]
    assert SINGLE_LABEL.answer(row, classes, None) == {
        "label": "dog",
        "score": 0.5,
        "probabilities": {"cat": 0.2, "dog": 0.5, "owl": 0.3},
    }
    top = SINGLE_LABEL.answer(row, classes, None, top_k=2)["top"]
    assert top == [{"class": "dog", "probability": 0.5}, {"class": "owl", "probability": 0.3}]
    assert MULTI_LABEL.answer(row, classes, [0.1, 0.9, 0.25])["labels"] == ["cat", "owl"]
    assert SINGLE_LABEL.answer(None, classes, None)["label"] is None
    assert MULTI_LABEL.answer(None, classes, [0.5] * 3)["labels"] is None
    # Decisions counted as quantize scores them: one per image, or one per image and class.
    out, y = np.array([[0.9, 0.1, 0.0], [0.2, 0.7, 0.6]]), np.array([0, 2])
    assert SINGLE_LABEL.right(out, y, None) == (1, 2)
    multi_y = np.array([[1, 0, 0], [0, 1, 0]])
    assert MULTI_LABEL.right(out, multi_y, [0.5, 0.5, 0.5]) == (5, 6)
    probs, readable = torch.tensor([row, [0.6, 0.1, 0.3]]), torch.tensor([True, False])
    text = MULTI_LABEL.csv_text(["a.jpg", "b.jpg"], classes, probs, readable, [0.25, 0.5, 0.25], 0.0)
    assert text.splitlines() == [
        "path,labels,prob_cat,prob_dog,prob_owl",
        "a.jpg,dog;owl,0.200000,0.500000,0.300000",
        "b.jpg,,,,",
    ]
    kaggle = SINGLE_LABEL.csv_text(["1.jpg", "2.jpg"], ["cat", "dog"], probs[:, 1:], readable, None, 0.05, [1, 2])
    assert kaggle.splitlines() == ["id,label", "1,0.300000", "2,0.500000"]  # P(dog); unreadable: 0.5


def test_a_recipes_label_smoothing_is_what_the_named_task_declares_not_its_name():
    """``--recipe modern`` smooths the labels of a task whose loss takes smoothing, whatever the task is
    called, and leaves it out for one that declares it does without; an explicit value is kept for the
    task to refuse."""
    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import validate
    from visiontune.tasks.regress import Regression
    from visiontune.tasks.single import SingleLabel

    class Species(SingleLabel):
        name = "species"

    class Weight(Regression):
        name = "weight"

    added = [tasks.register(Species()), tasks.register(Weight())]
    try:
        modern = {"data": "d", "recipe": "modern"}
        assert validate(TrainConfig(**modern, task="species"), tasks.get).label_smoothing == 0.1
        assert validate(TrainConfig(**modern, task="weight"), tasks.get).label_smoothing == 0.0
        assert validate(TrainConfig(**modern, task="regress"), tasks.get).label_smoothing == 0.0
        assert validate(TrainConfig(**modern, task="multilabel"), tasks.get).label_smoothing == 0.1
        given = validate(TrainConfig(**modern, task="weight", label_smoothing=0.2), tasks.get)
        assert given.label_smoothing == 0.2 and "--label-smoothing" in tasks.get("weight").refusal(given)
    finally:
        for task in added:
            del tasks.TASKS[task.name]
