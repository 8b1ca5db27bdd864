"""--class-weights: the weights against independent computations (scikit-learn's "balanced" weights, the
effective-number formula in numpy), the file formats and their one-line errors, the weighted loss
against torch's own weighted cross-entropy, and a resume with other choices refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.utils.class_weight import compute_class_weight

from visiontune import tasks
from visiontune.errors import UserError
from visiontune.runs.checkpoint import Checkpoint
from visiontune.runs.resume import compatible
from visiontune.tasks import MULTI_LABEL, SINGLE_LABEL, UNREADABLE
from visiontune.training import imbalance, optim

COUNTS = [950, 50, 7, 0]  # a class without training images too
LABELS = np.repeat(np.arange(4), COUNTS)


def test_auto_is_scikit_learns_balanced_weights():
    got = imbalance.class_weights("auto", ["a", "b", "c", "d"], LABELS)
    want = compute_class_weight("balanced", classes=np.arange(3), y=LABELS)  # the classes that have images
    np.testing.assert_allclose(got[:3].numpy(), want, rtol=1e-12)
    assert got[3] == 0  # no image to weigh


@pytest.mark.parametrize("spec, beta", [("effective", 0.999), ("effective:0.99", 0.99), ("effective:0.9999", 0.9999)])
def test_effective_number_weights_follow_the_formula_scaled_to_a_mean_of_one_per_image(spec, beta):
    n = np.array(COUNTS[:3], dtype=np.float64)
    raw = (1 - beta) / (1 - np.power(beta, n))  # Cui et al. (2019), eq. 3
    want = raw * n.sum() / (raw * n).sum()
    got = imbalance.class_weights(spec, ["a", "b", "c", "d"], LABELS)
    np.testing.assert_allclose(got[:3].numpy(), want, rtol=1e-9)
    assert (got[:3] * torch.tensor(n)).sum().item() == pytest.approx(n.sum())
    assert got[0] < got[1] < got[2] and got[2] / got[0] < 950 / 7  # flatter than inverse frequency
    assert imbalance.class_weights("effective:0", ["a", "b", "c", "d"], LABELS)[:3].tolist() == [1.0, 1.0, 1.0]


def test_weights_from_a_json_or_csv_file_and_one_line_errors(tmp_path):
    classes = ["cat", "dog", "fox, red"]
    (tmp_path / "w.json").write_text(json.dumps({"dog": 4, "fox, red": 0.5}))
    (tmp_path / "w.csv").write_text('class,weight\ndog,4\n"fox, red",0.5\n')
    for name in ("w.json", "w.csv"):
        assert imbalance.class_weights(str(tmp_path / name), classes, LABELS).tolist() == [1.0, 4.0, 0.5]
    bad = {
        "unknown.json": ('{"wolf": 2}', "unknown class 'wolf'; the classes are cat, dog, fox, red"),
        "zero.csv": ("dog,0\n", "the weight of 'dog' must be a positive number, got '0'"),
        "text.json": ('{"dog": "heavy"}', "the weight of 'dog' must be a positive number"),
        "list.json": ("[1, 2]", "expected a JSON object of class: weight"),
        "rows.csv": ("dog,2,3\n", "expected rows of class,weight"),
        "broken.json": ("{dog: 2", "not valid JSON"),
        "twice.csv": ("class,weight\ndog,4\ncat,1\n dog ,2\n", "class 'dog' is given 2 times; give each class one"),
        "twice.json": ('{"dog": 4, "dog": 2}', "class 'dog' is given 2 times; give each class one weight"),
    }
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError, match=message.replace("(", r"\(")) as e:
            imbalance.class_weights(str(tmp_path / name), classes, LABELS)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="BETA"):
        imbalance.class_weights("effective:1", classes, LABELS)


def test_a_missing_weights_file_is_refused_before_training():
    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import validate

    with pytest.raises(UserError, match="--class-weights must be none, auto, effective"):
        validate(TrainConfig(data="d", class_weights="weights.jsn"))
    assert validate(TrainConfig(data="d", class_weights="effective:0.99")).class_weights == "effective:0.99"


def _cfg(**kw):
    return SimpleNamespace(**{"label_smoothing": 0.0, "mixup": 0.0, "cutmix": 0.0, **kw})


def test_the_weighted_loss_is_torch_s_weighted_cross_entropy_over_the_readable_count():
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 3), torch.tensor([0, 2, 1, UNREADABLE, 0, 2])
    w = torch.tensor([0.5, 3.0, 1.5], dtype=torch.float64)
    got = optim.criterion(_cfg(), class_weights=w)(logits, labels)
    per = F.cross_entropy(logits, labels, weight=w.float(), reduction="none")  # weight[y] * ce, 0 where ignored
    assert got.item() == pytest.approx(per.sum().item() / 5, rel=1e-6)
    assert optim.criterion(_cfg()) is None  # unweighted: the reference job's own loss
    # A soft target weighs its sample by its mix of the classes' weights; a zero row (unreadable) counts 0.
    soft = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    got = optim.criterion(_cfg(mixup=0.2), class_weights=w)(logits[:3], soft)
    ce = -(soft * logits[:3].log_softmax(1)).sum(1)
    assert got.item() == pytest.approx(((soft @ w.float()) * ce).sum().item() / 2, rel=1e-6)


def test_a_resume_with_another_sampler_or_other_class_weights_is_refused():
    meta = {
        "split_sha256": "s",
        "model": "m",
        "num_classes": 2,
        "global_batch": 4,
        "epoch": 0,
        "batch": 0,
        "samples": 0,
        "config": {"batch_size": 4, "grad_accum": 1},
        "sampler": "balanced",
        "class_weights": [0.5, 10.0],
    }
    now = {**{k: meta[k] for k in ("split_sha256", "model", "num_classes", "global_batch")}, "batch_samples": 4}
    now["grad_accum"] = 1
    assert compatible(Checkpoint("c", meta), {**now, "sampler": "balanced", "class_weights": [0.5, 10.0]})
    with pytest.raises(UserError, match=r"--sampler differs from the checkpoint's \('balanced' there, 'random' now\)"):
        compatible(Checkpoint("c", meta), {**now, "sampler": "random", "class_weights": [0.5, 10.0]})
    with pytest.raises(UserError, match=r"--class-weights differs .*\[0.5, 10.0\] there, 'none' now"):
        compatible(Checkpoint("c", meta), {**now, "sampler": "balanced", "class_weights": None})
    # A checkpoint from before these settings: random order, no weights.
    old = {k: v for k, v in meta.items() if k not in ("sampler", "class_weights")}
    assert compatible(Checkpoint("c", old), {**now, "sampler": "random", "class_weights": None})


def test_the_start_lines_warn_when_the_rarest_class_has_fewer_than_10_val_images_and_say_the_choices(tmp_path):
    from visiontune.data.imageset import ImageSet
    from visiontune.data.split import Split
    from visiontune.runs import records
    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import validate
    from visiontune.training import overview
    from visiontune.training.plan import Plan

    said: list[str] = []
    accelerator = SimpleNamespace(print=lambda *a: said.append(" ".join(map(str, a))))
    setup = SimpleNamespace(
        strategy="single", devices=["cpu"], world_size=1, per_process_batch=4, global_batch=4, lr=0.1
    )
    labels = [0] * 60 + [1] * 20
    images = ImageSet(str(tmp_path), "folder", [f"{i}.jpg" for i in range(80)], labels, ["cat", "dog"])
    cfg = validate(TrainConfig(data="d", sampler="balanced", class_weights="auto", epochs=1, image_size=32))
    for dogs, warned in ((9, True), (10, False)):  # val: 30 cats and 9 or 10 dogs; train: 30 cats, the other dogs
        said.clear()
        split = Split(
            np.r_[np.arange(30), np.arange(60 + dogs, 80)], np.r_[np.arange(30, 60), np.arange(60, 60 + dogs)]
        )
        weights = imbalance.class_weights("auto", images.classes, images.labels[split.train])
        text = imbalance.describe("auto", weights, images.classes)
        resolved = Plan(cfg, cfg, None, setup, SINGLE_LABEL)
        rows = overview.rows(resolved, len(split.train), len(split.val), images.classes, 40, 10, "torchvision", text)
        records.announce(
            records.RunFacts(accelerator, str(tmp_path), cfg, setup, tasks.SINGLE_LABEL, images, split), rows
        )
        assert said[0].startswith("visiontune: single on cpu")
        warning = "visiontune: warning: the rarest class, 'dog', has 9 validation images (fewer than 10)"
        assert (warning in said[1]) is warned and sum("fewer than 10" in s for s in said) == warned
        start = next(s for s in said if s.startswith("Running training"))
        n, dog = 30 + 20 - dogs, 20 - dogs  # sklearn's balanced weights: n / (2 * count)
        weighted = f"cross-entropy, class weights inverse frequency: cat {n / 60:.4g}, dog {n / (2 * dog):.4g}"
        assert f"  {'loss':<15}  {weighted}\n" in start
        assert (
            f"  {'sampler':<15}  balanced: the 2 classes drawn equally often, about 20 images each per epoch" in start
        )


def test_multi_label_data_refuses_the_balanced_sampler_in_one_line():
    cfg = SimpleNamespace(class_weights="auto", sampler="balanced")
    with pytest.raises(UserError, match="^--sampler balanced works on single-label data") as e:
        imbalance.check_sampler(cfg, tasks.MULTI_LABEL)
    assert "\n" not in str(e.value)
    imbalance.check_sampler(cfg, tasks.SINGLE_LABEL)
    imbalance.check_sampler(SimpleNamespace(class_weights="auto", sampler="random"), tasks.MULTI_LABEL)


# 40 multi-label train images: label 0 on 30, label 1 on 4, label 2 on none, label 3 on all.
TARGETS = np.zeros((40, 4), np.uint8)
TARGETS[:30, 0], TARGETS[:4, 1], TARGETS[:, 3] = 1, 1, 1


@pytest.mark.parametrize("spec", ["auto", "effective:0.99"])
def test_multi_label_weights_are_each_labels_positive_weight(spec):
    got = imbalance.class_weights(spec, list("abcd"), TARGETS, MULTI_LABEL).numpy()
    pos, neg = TARGETS.sum(0).astype(np.float64), 40 - TARGETS.sum(0).astype(np.float64)
    if spec == "auto":
        want = neg[:2] / pos[:2]  # BCEWithLogitsLoss's pos_weight: as many negatives as positives, weighed
    else:
        want = (1 - 0.99 ** neg[:2]) / (1 - 0.99 ** pos[:2])
    np.testing.assert_allclose(got[:2], want, rtol=1e-12)
    assert got[2] == got[3] == 1  # no positive, or no negative: nothing to balance


def test_the_multi_label_weighted_loss_is_bce_with_logits_pos_weight_over_the_readable_count():
    weights = imbalance.class_weights("auto", list("abcd"), TARGETS, MULTI_LABEL)
    cfg = SimpleNamespace(label_smoothing=0.0, mixup=0.0, cutmix=0.0)
    loss = optim.criterion(cfg, MULTI_LABEL, class_weights=weights)
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor(TARGETS[[0, 3, 31, 35, 5]], dtype=torch.float32)
    targets[2] = UNREADABLE  # a bad image's row: no loss, not counted
    ok = [0, 1, 3, 4]
    want = torch.nn.BCEWithLogitsLoss(pos_weight=weights.float())(logits[ok], targets[ok])
    assert loss(logits, targets).item() == pytest.approx(want.item(), rel=1e-6)
    assert imbalance.describe("auto", weights, list("abcd"), tasks.MULTI_LABEL).startswith(
        "positive weight negatives / positives: a 0.3333, b 9"
    )


def test_the_balanced_sampler_on_multi_label_data_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    """The refusal needs the data's task, not the model: it comes before the model is built (which may mean
    a download and minutes of loading), and before the files are screened."""
    from visiontune.cli.commands import main
    from visiontune.data.sample import make_multilabel_data
    from visiontune.loading import jobdata
    from visiontune.training import trainer

    def never(*a, **k):
        raise AssertionError("the model was built (or the files screened) before the refusal")

    monkeypatch.setattr(trainer, "build_model", never)
    monkeypatch.setattr(jobdata, "scan", never)
    make_multilabel_data(tmp_path / "data", count=24, size=16, seed=0)
    argv = ["train", "--data", str(tmp_path / "data"), "--sampler", "balanced", "--output-dir", str(tmp_path / "r")]
    assert main([*argv, "--model", "resnet18", "--weights", "none", "--image-size", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sampler balanced works on single-label data" in err[0]
