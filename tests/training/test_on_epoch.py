"""The caller's ``on_epoch`` hook (what ``visiontune tune`` prunes with): it sees each recorded epoch's row after
the epoch's checkpoint, and a reason it returns ends the run there, except after the last epoch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from visiontune.training.hooks import EarlyStop, RunHooks, StopAfterEpoch


class _Outputs:
    def __init__(self):
        self.history: list[dict] = []
        self.accelerator = SimpleNamespace(print=lambda *a: None, is_main_process=True, num_processes=1)
        self.best_metric = "loss"

    def record(self, epoch, tr, va):
        self.history.append({"epoch": epoch, "val": va})
        return epoch


def _hooks(on_epoch, saved):
    checkpointer = SimpleNamespace(save=lambda epoch, batch: saved.append(epoch) or f"ckpt-{epoch}")
    return RunHooks(checkpointer, _Outputs(), SimpleNamespace(agreed=lambda: 0), epochs=3, on_epoch=on_epoch)


def test_a_reason_from_on_epoch_stops_the_run_after_that_epoch_s_checkpoint():
    seen, saved = [], []

    def on_epoch(epoch, row):
        seen.append((epoch, row["val"], list(saved)))
        return "pruned" if epoch == 1 else None

    hooks = _hooks(on_epoch, saved)
    hooks.on_epoch_end(0, None, {"loss": 0.5})
    with pytest.raises(StopAfterEpoch) as stop:
        hooks.on_epoch_end(1, None, {"loss": 0.7})
    assert (stop.value.epoch, stop.value.reason) == (1, "pruned") and isinstance(stop.value, EarlyStop)
    # Each call came after its epoch was recorded and its checkpoint (epoch + 1, batch 0) written.
    assert seen == [(0, {"loss": 0.5}, [1]), (1, {"loss": 0.7}, [1, 2])]


def test_after_the_last_epoch_a_reason_changes_nothing():
    hooks = _hooks(lambda epoch, row: "pruned", [])
    with pytest.raises(StopAfterEpoch):
        hooks.on_epoch_end(0, None, {"loss": 0.5})
    hooks.on_epoch_end(2, None, {"loss": 0.4})  # the run ends anyway: no stop to record
