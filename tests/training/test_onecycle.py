"""--lr-schedule onecycle: torch's OneCycleLR, wired to visiontune's step count, resumable mid-cycle."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_RESNET
from trainrun import flags
from visiontune.cli import main
from visiontune.training.schedule import Stepper


def _cfg(**kw):
    base = dict(
        epochs=2,
        warmup_steps=0,
        warmup_epochs=0.0,
        lr_schedule="onecycle",
        ema=0.0,
        freeze_epochs=0,
        freeze_backbone=False,
    )
    return SimpleNamespace(**{**base, **kw})


def _optimizer(kind: str) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    head, body = torch.nn.Linear(3, 2), torch.nn.Linear(3, 3)
    groups = [{"params": head.parameters(), "lr": 0.1}, {"params": body.parameters(), "lr": 0.01}]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9) if kind == "sgd" else torch.optim.AdamW(groups, lr=0.1)


def _momentum(group: dict) -> float:
    return group["momentum"] if "momentum" in group else group["betas"][0]


def _trace(optimizer, stepper, steps: int) -> torch.Tensor:
    """[step, group, (lr, momentum)] before each optimizer step."""
    out = []
    for _ in range(steps):
        out.append([[g["lr"], _momentum(g)] for g in optimizer.param_groups])
        optimizer.step()
        stepper.step()
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("warmup, peak_step", [(0, 4), (5, 4), (10, 9)])
def test_onecycle_follows_torchs_one_cycle_step_by_step(kind, warmup, peak_step):
    ours = _optimizer(kind)
    stepper = Stepper(ours, _cfg(warmup_steps=warmup), steps_per_epoch=10)  # 20 optimizer steps
    ref = _optimizer(kind)
    # Written out independently: fastai's fit_one_cycle as torch spells it.
    sched = torch.optim.lr_scheduler.OneCycleLR(
        ref,
        max_lr=[0.1, 0.01],
        total_steps=20,
        pct_start=(warmup or 5) / 20,
        div_factor=25.0,
        final_div_factor=1e4,
        base_momentum=0.85,
        max_momentum=0.95,
    )
    got, want = _trace(ours, stepper, 20), _trace(ref, sched, 20)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    lrs = got[:, 0, 0].tolist()
    assert lrs[0] == pytest.approx(0.1 / 25) and max(lrs) == pytest.approx(0.1) and lrs.index(max(lrs)) == peak_step
    assert got[peak_step, 1, 0].item() == pytest.approx(0.01)  # the backbone's group peaks at its own lr
    assert got[peak_step, 0, 1].item() == pytest.approx(0.85)  # momentum falls as the lr rises
    assert got[0, 0, 1].item() == pytest.approx(0.95) and got[-1, 0, 1].item() == pytest.approx(0.95, abs=1e-3)
    assert got[-1, 0, 0].item() < 1e-4  # down to peak / 25e4 at the end


def test_a_resume_mid_cycle_continues_the_same_cycle():
    full_opt = _optimizer("sgd")
    full = _trace(full_opt, Stepper(full_opt, _cfg(), 10), 20)
    first_opt = _optimizer("sgd")
    first = Stepper(first_opt, _cfg(), 10)
    head = _trace(first_opt, first, 7)
    # What a checkpoint keeps: the optimizer's state and the Stepper's, loaded into fresh objects.
    saved_opt, saved_step = first_opt.state_dict(), first.state_dict()
    again_opt = _optimizer("sgd")
    again = Stepper(again_opt, _cfg(), 10)
    again_opt.load_state_dict(saved_opt)
    again.load_state_dict(saved_step)
    assert torch.equal(torch.cat([head, _trace(again_opt, again, 13)]), full)


@pytest.mark.slow
def test_a_run_with_onecycle_records_the_cycle(sample_data, tmp_path):
    out = tmp_path / "run"
    argv = flags(data=sample_data, output_dir=out, epochs=2, batch_size=16, lr=0.05, optimizer="sgd")
    assert main(["train", *argv, *TINY_RESNET, *flags(lr_schedule="onecycle")]) == 0
    history = json.loads((out / "history.json").read_text())
    # 96 train images / 16 = 6 optimizer steps an epoch, 12 in all; the lr after epoch 0 is step 6's.
    ref = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.05, total_steps=12, pct_start=0.25)
    lrs = []
    for _ in range(12):
        ref.step()
        sched.step()
        lrs.append(ref.param_groups[0]["lr"])
    assert [history[0]["lr"], history[1]["lr"]] == pytest.approx([lrs[5], lrs[11]], rel=1e-9)
    assert json.loads((out / "config.json").read_text())["config"]["lr_schedule"] == "onecycle"
