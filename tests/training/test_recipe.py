"""Recipes: presets resolve as documented, and each setting changes what it should."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
from torch import nn

from trainrun import flags
from visiontune.errors import UserError
from visiontune.loading import loaders
from visiontune.runs import records
from visiontune.settings import presets
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import SINGLE_LABEL
from visiontune.tasks.single import per_sample_loss
from visiontune.training import optim, plan
from visiontune.training.ema import EMA, ShardedEMA
from visiontune.training.plan import Plan
from visiontune.training.schedule import warmup_steps


def _cfg(**kw) -> TrainConfig:
    return validate(TrainConfig(data="d", **kw))


def test_presets_fill_only_what_was_not_given_and_keep_the_old_augment_flag():
    blog = _cfg()
    assert (blog.optimizer, blog.lr, blog.weight_decay, blog.lr_schedule, blog.augment, blog.ema, blog.normalize) == (
        "sgd",
        1e-3,
        0.0,
        "none",
        "none",
        0.0,
        "blog",
    )
    modern = _cfg(recipe="modern", lr=3e-3, ema=0.5)
    assert (
        modern.optimizer,
        modern.lr,
        modern.weight_decay,
        modern.lr_schedule,
        modern.warmup_epochs,
        modern.label_smoothing,
        modern.augment,
        modern.ema,
    ) == ("adamw", 3e-3, 0.05, "cosine", 1.0, 0.1, "none", 0.5)
    assert (_cfg(recipe="modern").lr, _cfg(recipe="modern").ema, _cfg(recipe="modern", augment="light").augment) == (
        1e-3,
        0.0,
        "light",
    )
    assert modern.normalize == "weights" and _cfg(recipe="modern", weights="none").normalize == "data"
    assert _cfg(augment=True).augment == "flip-crop" and _cfg(augment=False).augment == "none"
    with pytest.raises(UserError, match="--recipe must be one of blog, modern"):
        _cfg(recipe="fancy")
    with pytest.raises(UserError, match="--label-smoothing must be in"):
        _cfg(label_smoothing=1.0)


def test_the_cli_takes_plain_augment_and_named_ones():
    from visiontune.cli.commands import build_parser, config_from_args

    def parse(*flags):
        return config_from_args(build_parser().parse_args(["train", "--data", "d", *flags]))

    assert parse("--augment").augment == "flip-crop"
    assert parse("--augment", "randaugment", "--epochs", "3").augment == "randaugment"
    assert parse("--recipe", "modern", "--augment", "light").augment == "light"
    assert parse("--recipe", "modern", "--no-augment").augment == "none"


class Tiny(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.fc = nn.Linear(4, classes)
        self.__dict__["_visiontune_head"] = "fc"  # what models.build_model records for torchvision

    def forward(self, x):
        return self.fc(self.features(x))


def test_adamw_leaves_norms_and_biases_undecayed_and_the_backbone_gets_its_multiplier():
    model = Tiny()
    opt, _ = optim.optimization(_cfg(recipe="modern", backbone_lr_mult=0.1), model, 1e-3, 10)
    assert type(opt) is torch.optim.AdamW
    groups = {(g["initial_lr"], g["weight_decay"]): {id(p) for p in g["params"]} for g in opt.param_groups}
    named = {id(p): n for n, p in model.named_parameters()}
    by_group = {k: sorted(named[i] for i in v) for k, v in groups.items()}
    assert by_group == {
        (1e-4, 0.05): ["features.0.weight"],
        (1e-4, 0.0): ["features.0.bias", "features.1.bias", "features.1.weight"],
        (1e-3, 0.05): ["fc.weight"],
        (1e-3, 0.0): ["fc.bias"],
    }
    sgd, _ = optim.optimization(_cfg(), Tiny(), 1e-3, 10)  # the reference job: one group, SGD
    assert type(sgd) is torch.optim.SGD and len(sgd.param_groups) == 1
    assert sgd.param_groups[0]["momentum"] == 0.9 and len(sgd.param_groups[0]["params"]) == 6


def test_the_head_is_the_one_the_model_spec_names_both_of_a_distilled_model():
    from visiontune.models.build import build_model

    # DeiT-distilled has two classifiers, head and head_dist: both get the head's lr.
    model = build_model("timm/deit_tiny_distilled_patch16_224", 3, "none")
    opt, _ = optim.optimization(_cfg(recipe="modern", backbone_lr_mult=0.1), model, 1e-3, 10)
    named = {id(p): n for n, p in model.named_parameters()}
    head_lr = sorted(named[id(p)] for g in opt.param_groups if g["initial_lr"] == 1e-3 for p in g["params"])
    assert head_lr == ["head.bias", "head.weight", "head_dist.bias", "head_dist.weight"]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(named)


@pytest.mark.parametrize(
    "schedule,expected",
    [
        # 2 epochs of 5 steps, warm-up 0.4 epoch = 2 steps; then 8 steps of the schedule
        ("cosine", lambda s: 0.5 * (1 + math.cos(math.pi * (s - 2) / 8))),
        ("linear", lambda s: 1 - (s - 2) / 8),
        ("step", lambda s: 1.0 if s < 6 else 0.1 if s < 8 else 0.01),
        ("none", lambda s: 1.0),
    ],
)
def test_the_lr_of_each_step_follows_warm_up_then_the_schedule(schedule, expected):
    model = Tiny()
    cfg = _cfg(recipe="modern", lr_schedule=schedule, warmup_epochs=0.4, epochs=2)
    opt, stepper = optim.optimization(cfg, model, 0.01, 5)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])  # the lr this optimizer step uses
        opt.step()
        stepper.step()
    hand = [0.01 * (s + 1) / 2 if s < 2 else 0.01 * expected(s) for s in range(10)]
    assert seen == pytest.approx(hand, rel=1e-12, abs=1e-15)
    assert _cfg(recipe="modern", warmup_steps=3).warmup_steps == 3
    assert warmup_steps(_cfg(recipe="modern", warmup_steps=3), 5) == 3


def test_ema_is_the_hand_computed_average_and_restores_exactly():
    model = Tiny()
    ema = EMA(model, 0.9)
    hand = None
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model.features[1].running_mean.add_(1.0)
        ema.update()
        now = {k: v.clone().float() for k, v in model.state_dict().items()}
        hand = now if hand is None else {k: 0.9 * hand[k] + 0.1 * now[k] for k in now}
    got = ema.module.state_dict()
    for k, v in hand.items():
        if not k.endswith("num_batches_tracked"):
            assert torch.allclose(got[k].float(), v, atol=1e-6), k
    again = EMA(Tiny(), 0.9)
    again.load_state_dict(ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ema.state_dict().values()))


def test_the_sharded_ema_is_the_same_average_and_its_weights_are_lent_to_the_model_and_given_back():
    """ShardedEMA (--strategy fsdp's) averages the model's own tensors in place of a copy: the same numbers,
    bit for bit, as EMA's; inside ``weights()`` the model holds them, after it its own again."""
    model = Tiny()
    copied, sharded = EMA(model, 0.9), ShardedEMA(model, 0.9)
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model.features[1].running_mean.add_(1.0)
            model.features[1].num_batches_tracked.add_(3)
        copied.update()
        sharded.update()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with sharded.weights() as lent:
        assert lent is model
        averaged = {k: v.clone() for k, v in model.state_dict().items()}
    assert averaged.keys() == copied.module.state_dict().keys()
    assert all(torch.equal(averaged[k], v) for k, v in copied.module.state_dict().items())
    assert all(torch.equal(own[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(averaged["features.1.running_mean"], own["features.1.running_mean"])
    again = ShardedEMA(Tiny(), 0.9)
    again.load_state_dict(sharded.state_dict())
    assert again.n_averaged == 4 and all(torch.equal(again.tensors[k], v) for k, v in sharded.tensors.items())


def _step(model, opt, stepper):
    model.train()
    loss = model(torch.randn(4, 3, 8, 8)).logsumexp(1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    stepper.step()


def test_freeze_epochs_hold_the_backbone_and_its_batchnorm_still_then_release_them():
    model = Tiny()
    opt, stepper = optim.optimization(_cfg(freeze_epochs=1, lr=0.1), model, 0.1, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):  # the first epoch: 2 steps, head only
        _step(model, opt, stepper)
    after = model.state_dict()
    for k, value in before.items():
        same = torch.equal(value, after[k])
        assert same != k.startswith("fc."), k  # the backbone (weights and BN statistics) unchanged; head trained
    _step(model, opt, stepper)  # the second epoch: everything trains
    assert not torch.equal(model.features[0].weight, before["features.0.weight"])
    assert not torch.equal(model.features[1].running_mean, before["features.1.running_mean"])


def test_freeze_backbone_keeps_batchnorm_statistics_fixed():
    model = Tiny()
    for n, p in model.named_parameters():
        p.requires_grad = n.startswith("fc.")
    opt, stepper = optim.optimization(_cfg(freeze_backbone=True, lr=0.1), model, 0.1, 2)
    stats = model.features[1].running_mean.clone(), model.features[1].running_var.clone()
    for _ in range(3):
        _step(model, opt, stepper)
    assert torch.equal(model.features[1].running_mean, stats[0]) and torch.equal(
        model.features[1].running_var, stats[1]
    )


def test_soft_targets_give_the_mixed_cross_entropy_and_unreadable_rows_none():
    logits = torch.randn(3, 4)
    targets = torch.tensor([[0.7, 0.3, 0, 0], [0, 0, 0, 0], [0, 0, 0.4, 0.6]])
    got = per_sample_loss(0.0)(logits, targets)
    logp = logits.log_softmax(1)
    hand = -(targets * logp).sum(1)
    assert torch.allclose(got, hand) and got[1] == 0
    smooth = per_sample_loss(0.1)(logits, torch.tensor([2, -100, 1]))
    hand2 = -(0.9 * logp[0, 2] + 0.1 * logp[0].mean())
    assert torch.allclose(smooth[0], hand2) and smooth[1] == 0


def test_best_picks_ema_or_raw_by_the_chosen_metric():
    history = [
        {"epoch": 0, "val": {"accuracy": 0.8, "loss": 0.5}, "val_ema": {"accuracy": 0.9, "loss": 0.6}},
        {"epoch": 1, "val": {"accuracy": 0.85, "loss": 0.4}},
    ]
    assert (records.best_of(history)[0]["epoch"], records.best_of(history)[1]) == (0, "val_ema")
    assert (records.best_of(history, "loss")[0]["epoch"], records.best_of(history, "loss")[1]) == (1, "val")


@pytest.mark.slow
def test_ema_best_pick_early_stop_and_the_recorded_recipe(tmp_path, small_data, monkeypatch):
    import json

    from safetensors.torch import load_file

    from visiontune import cli
    from visiontune.training import engine

    # Scripted validation: raw 0.5, 0.6, 0.55...; EMA 0.4, 0.7, 0.5...: the EMA of epoch 1 is best,
    # and with patience 2 the run stops after epoch 3 of 6.
    script = {"val": [0.5, 0.6, 0.55, 0.55, 0.55, 0.55], "val ema": [0.4, 0.7, 0.5, 0.5, 0.5, 0.5]}
    calls = {"val": 0, "val ema": 0}

    def scripted(accelerator, model, loader, prepare_input, *, progress=True, desc="val", keep=None, task=None):
        acc = script[desc][calls[desc]]
        calls[desc] += 1
        return engine.PhaseResult(loss=1 - acc, accuracy=acc, images=8, seconds=0.1)

    monkeypatch.setattr(engine, "evaluate", scripted)
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                *flags(data=small_data),
                # timm's test_resnet (0.4M parameters): the model is not the subject, and each of the four
                # epochs' checkpoints holds it three times (the weights, AdamW's two moments) and its EMA.
                *flags(model="timm/test_resnet", weights="none", image_size=32, no_progress=True),
                *flags(
                    batch_size=8,
                    epochs=6,
                    recipe="modern",
                    augment="trivial",
                    ema=0.9,
                    early_stop=2,
                    keep_last=10,
                    num_workers=0,
                    output_dir=out,
                ),
            ]
        )
        == 0
    )
    history = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]  # counted from 1, as the console counts
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["best_epoch"], summary["best_weights"], summary["best_val_accuracy"]) == (2, "ema", 0.7)
    ema = torch.load(out / "checkpoints" / "epoch0002-end" / "lr_scheduler.pt", weights_only=True)["ema"]
    best = load_file(str(out / "best.safetensors"))
    assert best.keys() and all(torch.equal(best[k], ema["module." + k]) for k in best)
    config = json.loads((out / "config.json").read_text())["config"]
    assert (
        config["recipe"],
        config["optimizer"],
        config["lr_schedule"],
        config["label_smoothing"],
        config["augment"],
        config["ema"],
        config["normalize"],
    ) == ("modern", "adamw", "cosine", 0.1, "trivial", 0.9, "data")


def test_normalize_modes_resolve_to_recorded_statistics():
    from visiontune.settings.config import MEAN, STD

    assert presets.mean_std(_cfg()) == (MEAN, STD)
    w = _cfg(model="resnet18", weights="DEFAULT", normalize="weights")  # torchvision's metadata, no download
    assert presets.mean_std(w) == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert _cfg(normalize="data").mean is None  # measured by the trainer on the train split
    assert presets.mean_std(_cfg(mean="0.1,0.2,0.3", std="1,1,1")) == ((0.1, 0.2, 0.3), (1.0, 1.0, 1.0))
    with pytest.raises(UserError, match="needs named pretrained weights"):
        _cfg(weights="none", normalize="weights")
    with pytest.raises(UserError, match="three numbers"):
        _cfg(mean="0.1,0.2", std="1,1,1")


def test_data_statistics_are_those_of_the_pixels():
    images = torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8)
    dataset = [(img, 0) for img in images] + [(torch.zeros(3, 4, 4, dtype=torch.uint8), -100)]
    mean, std = loaders.data_stats(dataset)
    x = images.double() / 255
    assert mean == presets.stats_text(x.mean((0, 2, 3)).tolist())
    assert std == presets.stats_text(x.std((0, 2, 3), unbiased=False).tolist())


@pytest.mark.slow
def test_lr_find_sweeps_writes_the_curve_and_suggests_a_tenth_of_the_minimum(tmp_path, small_data, capsys):
    import json

    from PIL import Image

    from conftest import FAST
    from visiontune import cli

    out = tmp_path / "lrf"
    assert (
        cli.main(
            [
                "lr-find",
                *flags(data=small_data),
                *FAST,
                *flags(batch_size=8, num_workers=0, steps=12, start_lr="1e-4", end_lr=1, output_dir=out),
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    rec = json.loads((out / "lr_find.json").read_text())
    lrs = rec["lrs"]
    assert lrs[0] == pytest.approx(1e-4)
    assert all(b / a == pytest.approx(10 ** (4 / 11)) for a, b in itertools.pairwise(lrs))
    assert rec["suggested_lr"] == pytest.approx(lrs[rec["losses"].index(min(rec["losses"]))] / 10)
    assert line.startswith(f"visiontune: suggested lr {rec['suggested_lr']:.2g}")
    with Image.open(out / "lr_find.png") as im:
        assert im.format == "PNG"


def test_the_start_lines_say_the_dropped_partial_batch_and_when_the_blog_recipe_does_badly():
    from types import SimpleNamespace

    from visiontune.training import overview

    setup = SimpleNamespace(world_size=1, per_process_batch=50, global_batch=50, lr=1e-3)
    cfg = _cfg(epochs=3, image_size=224)
    rows = dict(
        overview.rows(Plan(cfg, cfg, None, setup, SINGLE_LABEL), 1437, 360, ["cat", "dog"], 1400, 28, "torchvision")
    )
    assert rows["train images"] == (
        "1,437 (1,400 of 1,437 per epoch, last partial batch dropped; every image is seen over epochs)"
    )
    assert rows["optimizer steps"] == "28 per epoch x 3 epochs = 84"
    modern_cfg = _cfg(recipe="modern")
    modern = dict(
        overview.rows(
            Plan(modern_cfg, modern_cfg, None, setup, SINGLE_LABEL), 1400, 360, ["cat", "dog"], 1400, 28, "timm"
        )
    )
    assert modern["train images"] == "1,400" and modern["lr schedule"] == "28 warm-up steps, then cosine"
    assert modern["optimizer"] == "AdamW, lr 0.001, weight decay 0.05 (none on norms and biases)"
    assert modern["loss"] == "cross-entropy, label smoothing 0.1" and modern["recipe"] == "modern"
    # The blog recipe, where it does worse: from scratch or on a timm/Hub model; not with --recipe modern.
    assert "--recipe modern" in overview.recipe_note(_cfg(weights="none"), "torchvision")
    assert "on a timm model" in overview.recipe_note(_cfg(model="timm/resnet18", normalize="blog"), "timm")
    assert overview.recipe_note(_cfg(), "torchvision") is None
    assert overview.recipe_note(_cfg(recipe="modern", weights="none"), "timm") is None


def _resolved(**kw) -> Plan:
    """A config as given, and as the trainer resolves it: the model's size, interpolation and crop filled in."""
    return plan.view(_cfg(**kw))


def test_the_start_lines_say_the_resize_the_crop_and_where_each_came_from():
    from types import SimpleNamespace

    from visiontune.training import overview

    setup = SimpleNamespace(world_size=1, per_process_batch=50, global_batch=50, lr=1e-3)

    def resize(source: str, **kw) -> str:
        resolved = dataclasses.replace(_resolved(**kw), setup=setup, task=SINGLE_LABEL)
        return dict(overview.rows(resolved, 100, 20, ["a", "b"], 100, 2, source))["resize"]

    # A timm model brings its pretrained config's bicubic resize and 0.875 centre crop: said, with its origin.
    said = resize("timm", model="timm/resnet10t", weights="none", image_size=32)
    assert said == (
        "32 px (--image-size), bicubic interpolation (the model's pretrained config), centre crop 0.875: "
        "the short side resized to 36 px, the centre 32 x 32 kept (the model's pretrained config)"
    )
    assert math.floor(32 / 0.875) == 36  # as decode.resize_uint8 resizes
    # Flags win and say so; the size left out is the model's.
    said = resize("timm", model="timm/resnet10t", interpolation="bilinear", crop_pct=1.0)
    assert said.startswith("176 px (the model's pretrained size), bilinear interpolation (--interpolation), ")
    assert said.endswith("centre crop 1: the short side resized to 176 px, the centre 176 x 176 kept (--crop-pct)")
    # torchvision: the weights' interpolation, and the reference job's squash.
    said = resize("torchvision", model="resnet18", image_size=64)
    assert said == (
        "64 px (--image-size), bilinear interpolation (the torchvision weights' transforms), "
        "no crop: the whole image squashed to the input size (the default for torchvision models)"
    )


def test_modern_s_missing_augmentation_is_said_with_what_to_add_for_photos(tmp_path):
    """--recipe modern adds no augmentation (chosen on digits): the start-up row and --help say so and name
    --augment light; a run with augmentation, or the blog recipe, gets no such words."""
    from types import SimpleNamespace

    from visiontune.cli.commands import build_parser
    from visiontune.reports.report import build
    from visiontune.training import overview

    setup = SimpleNamespace(world_size=1, per_process_batch=50, global_batch=50, lr=1e-3)

    def augmentation(**kw) -> str:
        resolved = dataclasses.replace(_resolved(**kw), setup=setup, task=SINGLE_LABEL)
        return dict(overview.rows(resolved, 100, 20, ["a", "b"], 100, 2, "torchvision"))["augmentation"]

    said = augmentation(recipe="modern", weights="none")
    assert said.startswith("none (--recipe modern adds no augmentation: it was chosen on 32 px digits")
    assert said.endswith("for natural photos add --augment light)")
    assert augmentation(recipe="modern", weights="none", augment="light") == "light"
    assert augmentation(weights="none") == "none"
    train = next(a for a in build_parser()._actions if a.dest == "command").choices["train"]
    recipe_help = " ".join(next(a for a in train._actions if "--recipe" in a.option_strings).help.split())
    assert "modern was chosen on digits: for photos add --augment light" in recipe_help
    # The report explains a val loss below the train loss under label smoothing, in one line; not without it.
    for smoothing, said in ((0.1, True), (0.0, False)):
        (tmp_path / "config.json").write_text(json.dumps({"config": {"label_smoothing": smoothing}}))
        page = build(tmp_path)
        assert ("Label smoothing 0.1: the train loss is measured against softened targets" in page) is said
        assert ("the val loss can sit below the train loss" in page) is said
