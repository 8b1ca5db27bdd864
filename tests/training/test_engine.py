"""The training loop on an ``nn.Linear``: every figure checked against a hand computation.

No images, no run folder: each test feeds a few fixed batches to ``train_one_epoch``
and replays the same arithmetic with plain torch (SGD without momentum: w -= lr * grad).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from visiontune.tasks import SINGLE_LABEL, UNREADABLE
from visiontune.training.engine import Learner, LoopOptions, NonFiniteLoss, Span, train_one_epoch
from visiontune.training.meter import StepClock, Totals

readable_cross_entropy = SINGLE_LABEL.mean_loss  # the plain loss a classification run trains with

LR = 0.1


def _batches(n: int = 4, size: int = 3, unreadable: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(n):
        x = torch.randn(size, 4, generator=g)
        y = torch.randint(0, 3, (size,), generator=g)
        if b in unreadable:
            y[0] = UNREADABLE
        out.append((x, y))
    return out


def _setup(accum: int = 1):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, start


def _run(acc, model, opt, batches, scheduler=None, **opts):
    calls = []
    o = LoopOptions(
        epochs=1, progress=False, on_step=lambda e, b, t: calls.append((e, b, t.images)), **{"timing_warmup": 0, **opts}
    )
    return train_one_epoch(acc, Learner(model, opt, scheduler), batches, o, Span(epoch=7)), calls


def _replay(start: dict, steps: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict:
    """Plain SGD: one step per group of batches, on the mean of the groups' mean losses."""
    w, b = start["weight"].clone().requires_grad_(), start["bias"].clone().requires_grad_()
    for group in steps:
        loss = sum(readable_cross_entropy(x @ w.T + b, y) for x, y in group) / len(group)
        gw, gb = torch.autograd.grad(loss, (w, b))
        with torch.no_grad():
            w -= LR * gw
            b -= LR * gb
    return {"weight": w.detach(), "bias": b.detach()}


def _sums(start: dict, batches) -> tuple[float, float, float]:
    """(loss sum, correct, readable images) of ``batches`` at the weights the loop had for each."""
    loss_sum = correct = images = 0.0
    for i, (x, y) in enumerate(batches):
        w = _replay(start, [[bt] for bt in batches[:i]])
        logits = x @ w["weight"].T + w["bias"]
        n = (y != UNREADABLE).sum().item()
        loss_sum += readable_cross_entropy(logits, y).item() * n
        correct += (logits.argmax(1) == y).sum().item()
        images += n
    return loss_sum, correct, images


def test_loss_accuracy_and_weights_match_plain_sgd_with_unreadable_samples_left_out():
    acc, model, opt, start = _setup()
    batches = _batches(unreadable=(1, 2))
    res, calls = _run(acc, model, opt, batches)
    loss_sum, correct, images = _sums(start, batches)
    assert res.images == images == 10  # 12 samples, 2 unreadable
    assert res.loss == pytest.approx(loss_sum / images, rel=1e-6)
    assert res.accuracy == pytest.approx(correct / images)
    expected = _replay(start, [[b] for b in batches])
    assert torch.allclose(model.weight, expected["weight"], atol=1e-6)
    assert [c[:2] for c in calls] == [(7, 1), (7, 2), (7, 3), (7, 4)]  # on_step(epoch, batches done, totals)
    assert [c[2] for c in calls] == [3, 5, 7, 10]


def test_nan_skip_leaves_the_step_out_of_weights_and_counts():
    acc, model, opt, start = _setup()
    batches = _batches()
    seen = []

    def nan_on_second(logits, labels):
        seen.append(1)
        loss = readable_cross_entropy(logits, labels)
        return loss * float("nan") if len(seen) == 2 else loss

    res, _ = _run(acc, model, opt, batches, on_nan="skip", criterion=nan_on_second)
    assert res.skipped == 1
    assert res.images == 9  # the skipped batch's 3 images are not counted
    kept = [batches[0], batches[2], batches[3]]
    expected = _replay(start, [[b] for b in kept])
    assert torch.allclose(model.weight, expected["weight"], atol=1e-6)
    assert torch.allclose(model.bias, expected["bias"], atol=1e-6)
    # The loss of the kept batches, at the weights each one saw (batch 2 saw batch 0's step only).
    w1 = _replay(start, [[batches[0]]])
    w2 = _replay(start, [[batches[0]], [batches[2]]])
    losses = [
        readable_cross_entropy(x @ w["weight"].T + w["bias"], y).item() * 3 for (x, y), w in zip(kept, (start, w1, w2))
    ]
    assert res.loss == pytest.approx(sum(losses) / 9, rel=1e-6)


def test_nan_stop_raises_at_the_epoch_end():
    acc, model, opt, _ = _setup()
    with pytest.raises(NonFiniteLoss):
        _run(acc, model, opt, _batches(), criterion=lambda lg, y: readable_cross_entropy(lg, y) * float("nan"))


def test_gradient_accumulation_steps_once_per_window_on_the_mean_gradient():
    acc, model, opt, start = _setup(accum=2)
    batches = _batches(n=4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda step: 1.0)
    res, _ = _run(acc, model, opt, batches, scheduler=sched)
    expected = _replay(start, [batches[:2], batches[2:]])
    assert torch.allclose(model.weight, expected["weight"], atol=1e-6)
    assert torch.allclose(model.bias, expected["bias"], atol=1e-6)
    assert sched.last_epoch == 2  # stepped per optimizer step, not per batch
    assert res.images == 12 and res.skipped == 0


def test_a_resumed_epoch_adds_to_the_saved_totals():
    saved = [5.0, 2.0, 6.0, 1.0, 6.0]  # loss sum, correct, images, skipped, steady images
    assert Totals.from_checkpoint(saved, is_main_process=False).to_list() == [0.0] * 5  # summed once, on rank 0
    restored = Totals.from_checkpoint(saved, is_main_process=True)
    assert (restored.loss_sum, restored.images, restored.skipped) == (5.0, 6.0, 1.0)
    acc, model, opt, start = _setup()
    batches = _batches(n=2)
    o = LoopOptions(epochs=1, progress=False, timing_warmup=0)
    res = train_one_epoch(acc, Learner(model, opt), batches, o, Span(start_step=2, totals=restored))
    loss_sum, correct, images = _sums(start, batches)
    assert res.images == 6 + images
    assert res.loss == pytest.approx((5.0 + loss_sum) / (6 + images), rel=1e-6)
    assert res.accuracy == pytest.approx((2.0 + correct) / (6 + images))
    assert res.skipped == 1 and res.steady_images == 6 + images
    assert restored.to_list() == saved  # the caller's totals are not modified


def test_timing_split_leaves_out_the_warmup_and_separates_the_data_wait():
    ticks = iter(
        [
            0.0,  # start
            1.0,  # step 0 done (warm-up: its 1 s wait is not counted)
            3.0,  # step 1 arrives after 2 s of waiting
            4.0,  # step 1 done
            4.5,  # step 2 arrives
            6.0,  # step 2 done
            7.0,
        ]
    )  # the end
    clock = StepClock(warmup=1, clock=lambda: next(ticks))
    flags = []
    for _ in range(3):
        flags.append(clock.batch_ready())
        clock.step_done()
    assert flags == [False, True, True]
    assert clock.split() == {"seconds": 7.0, "steady_seconds": 6.0, "data_wait_seconds": 2.5}


def test_steady_images_count_the_steps_after_the_warmup():
    acc, model, opt, _ = _setup()
    res, _ = _run(acc, model, opt, _batches(n=4), timing_warmup=3)
    assert res.images == 12 and res.steady_images == 3
    assert 0 < res.steady_seconds <= res.seconds and 0 <= res.data_wait_seconds <= res.steady_seconds


def test_criterion_is_what_trains():
    """A label-smoothing criterion passed in is the loss reported and the gradient followed."""
    acc, model, opt, start = _setup()
    batches = _batches(n=1)
    res, _ = _run(acc, model, opt, batches, criterion=lambda lg, y: F.cross_entropy(lg, y, label_smoothing=0.2))
    x, y = batches[0]
    assert res.loss == pytest.approx(
        F.cross_entropy(x @ start["weight"].T + start["bias"], y, label_smoothing=0.2).item(), rel=1e-6
    )
