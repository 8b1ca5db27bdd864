"""--freeze-epochs: the head-only phase trains at the full lr, the warm-up starts where the backbone
unfreezes, and the start-up block, config.json's overview and the epoch lines show the phases."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from visiontune.models.build import build_model, head_names
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import SINGLE_LABEL
from visiontune.training import optim, overview
from visiontune.training.engine import _phase_mark
from visiontune.training.plan import Plan
from visiontune.training.schedule import lr_factor


def _lrs_per_step(cfg: TrainConfig, per_epoch: int) -> tuple[list[float], list[float], list[bool]]:
    """The head's and the backbone's lr at every optimizer step of the run, and whether it was frozen."""
    model = build_model("resnet18", 2, "none")
    optimizer, stepper = optim.optimization(cfg, model, 1e-3, per_epoch)
    heads = tuple(head_names(model))
    head = next(i for i, g in enumerate(optimizer.param_groups) if any(p is model.fc.weight for p in g["params"]))
    back = next((i for i in range(len(optimizer.param_groups)) if i != head), head)
    assert heads == ("fc",)
    head_lr, back_lr, frozen = [], [], []
    for _ in range(cfg.epochs * per_epoch):
        head_lr.append(optimizer.param_groups[head]["lr"])
        back_lr.append(optimizer.param_groups[back]["lr"])
        frozen.append(stepper.frozen)
        optimizer.step()  # no gradients: nothing moves, the lr is what is looked at
        stepper.step()
    return head_lr, back_lr, frozen


def test_the_frozen_epoch_trains_at_the_full_head_lr_and_the_warm_up_starts_at_the_unfreeze():
    per_epoch = 4
    cfg = validate(TrainConfig(data="d", recipe="modern", epochs=3, freeze_epochs=1, backbone_lr_mult=0.1))
    assert (cfg.warmup_epochs, cfg.lr_schedule) == (1, "cosine")
    head, back, frozen = _lrs_per_step(cfg, per_epoch)
    assert frozen == [True] * 4 + [False] * 8
    assert head[:4] == pytest.approx([1e-3] * 4)  # the new head, at its full lr while the backbone waits
    # From the first unfrozen step: the warm-up's start (1/4 of the lr), rising over an epoch, then cosine.
    assert head[4:8] == pytest.approx([1e-3 * k / 4 for k in (1, 2, 3, 4)])
    assert back[4] == pytest.approx(1e-4 / 4)  # the backbone's group at its own multiple
    assert head[8:] == pytest.approx([1e-3 * lr_factor(s, 12, 4, "cosine", 4) for s in range(8, 12)])
    assert head[8] == pytest.approx(1e-3) and head[-1] < head[8]
    # Without freezing, the run starts with the warm-up as before.
    head, _, frozen = _lrs_per_step(validate(TrainConfig(data="d", recipe="modern", epochs=3)), per_epoch)
    assert not any(frozen) and head[0] == pytest.approx(1e-3 / 4)


def test_the_start_lines_and_the_epoch_lines_show_the_phases():
    setup = SimpleNamespace(world_size=1, per_process_batch=50, global_batch=50, lr=1e-3)
    cfg = validate(TrainConfig(data="d", recipe="modern", epochs=3, freeze_epochs=1))
    rows = dict(
        overview.rows(Plan(cfg, cfg, None, setup, SINGLE_LABEL), 1400, 360, ["cat", "dog"], 1400, 28, "torchvision")
    )
    assert rows["phases"] == (
        "epoch 1: the new head only, the backbone frozen (its BatchNorm statistics too); "
        "epochs 2-3: everything (from step 29)"
    )
    assert (
        rows["lr schedule"] == "28 head-only steps at the full lr, then 28 warm-up steps, then cosine from the unfreeze"
    )
    plain_cfg = validate(TrainConfig(data="d"))
    plain = dict(
        overview.rows(
            Plan(plain_cfg, plain_cfg, None, setup, SINGLE_LABEL), 1400, 360, ["a", "b"], 1400, 28, "torchvision"
        )
    )
    assert "phases" not in plain and plain["lr schedule"] == "constant"
    stepper = SimpleNamespace(freeze_steps=8)  # two epochs of 4 steps head-only
    marks = [_phase_mark(stepper, epoch, 4) for epoch in range(4)]
    assert marks == [
        " (head only: backbone frozen)",
        " (head only: backbone frozen)",
        " (backbone unfrozen: everything trains)",
        "",
    ]
    assert _phase_mark(SimpleNamespace(freeze_steps=0), 0, 4) == "" and _phase_mark(None, 0, 4) == ""


@pytest.mark.slow
def test_a_run_with_freeze_epochs_marks_its_epochs_and_records_the_phases(sample_data, tmp_path, capsys):
    from conftest import TINY_RESNET  # the phases are the subject, not the model
    from visiontune.cli.commands import main

    run = tmp_path / "frozen"
    argv = ["train", "--data", str(sample_data), *TINY_RESNET, "--batch-size", "16", "--epochs", "2"]
    argv += ["--num-workers", "0"]
    assert main([*argv, "--freeze-epochs", "1", "--recipe", "modern", "--output-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Epoch 1/2 (head only: backbone frozen)\n" in out
    assert "Epoch 2/2 (backbone unfrozen: everything trains)\n" in out
    recorded = json.loads((run / "config.json").read_text())["overview"]
    assert recorded["phases"] == (
        "epoch 1: the new head only, the backbone frozen (its BatchNorm statistics too); epoch 2: everything "
        "(from step 7)"
    )
    # history.json's lr is the one after the epoch's last step: after the frozen epoch, the lr the first
    # unfrozen step takes, the start of the 6-step warm-up (96 train images, batch 16).
    history = json.loads((run / "history.json").read_text())
    assert history[0]["lr"] == pytest.approx(1e-3 / 6)
    assert torch.isfinite(torch.tensor(history[1]["val"]["loss"]))


@pytest.mark.parametrize("freeze,epochs", [(5, 1), (2, 2)])
def test_freeze_epochs_that_cover_the_whole_run_are_refused_in_one_line(
    tmp_path, small_data, capsys, no_scan, freeze, epochs
):
    from trainrun import one_line, tiny_train
    from visiontune.cli.commands import main

    argv = tiny_train(small_data, tmp_path / "run", "--freeze-epochs", str(freeze), "--epochs", str(epochs))
    assert main(argv) == 2
    one_line(capsys, f"--freeze-epochs {freeze}", f"--epochs {epochs}", "--freeze-backbone")
    assert not (tmp_path / "run" / "config.json").exists()


def test_freeze_epochs_below_the_epochs_are_accepted():
    assert validate(TrainConfig(data="d", epochs=3, freeze_epochs=2)).freeze_epochs == 2
