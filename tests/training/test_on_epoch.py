"""The caller's ``on_epoch`` hook (what ``visiontune tune`` prunes with): it sees each recorded epoch's row after
the epoch's checkpoint, and a reason it returns ends the run there, except after the last epoch."""

from __future__ import annotations

import json
from pathlib import Path
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


def _readme_block() -> str:
    """The README's on_epoch example, as printed there."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    after = readme.split("<!-- on_epoch example:", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_on_epoch_example_stops_the_run_with_its_reason(tmp_path, monkeypatch, capsys):
    """The README's example, run as printed on data made as the demo's (80 images a class, not 200: one epoch of
    them reaches the example's 0.9 as well): the callback sees epochs from 1 and the history.json row, and its
    string ends the run after that epoch with that reason."""
    import visiontune
    from visiontune.data.sample import make_sample_data

    make_sample_data(tmp_path / "demo-data", per_class=80, test_count=0, seed=0)
    monkeypatch.chdir(tmp_path)
    seen = []
    namespace: dict = {"visiontune": visiontune, "TrainConfig": visiontune.TrainConfig}
    namespace["watched"] = lambda epoch, row: seen.append((epoch, row)) or namespace["stop_when_good"](epoch, row)
    code = _readme_block().replace("on_epoch=stop_when_good", "on_epoch=watched")  # the same, its calls seen
    exec(compile(code, "README.md", "exec"), namespace)
    summary = namespace["summary"]
    history = json.loads((tmp_path / "runs" / "stop" / "history.json").read_text())
    stopped = summary["stopped"]
    done = stopped["epochs_done"]
    assert summary["epochs"] == done == len(seen) == len(history) < 5
    assert [epoch for epoch, _ in seen] == list(range(1, done + 1))
    last = seen[-1][1]
    assert last["val"] == history[-1]["val"] and last["val"]["accuracy"] >= 0.9
    assert all(row["val"]["accuracy"] < 0.9 for _, row in seen[:-1])
    assert stopped["reason"] == f"val accuracy {last['val']['accuracy']:.2f} at epoch {done}"
    assert f"visiontune: stopped after epoch {done}: {stopped['reason']}" in capsys.readouterr().out


def test_on_epoch_is_refused_for_a_job_of_several_processes(sample_data, tmp_path):
    import visiontune

    config = visiontune.TrainConfig(data=str(sample_data), strategy="ddp", nproc=2, output_dir=str(tmp_path / "r"))
    with pytest.raises(visiontune.UserError, match="on_epoch runs in this process"):
        visiontune.train(config, on_epoch=lambda epoch, row: None)
    assert not (tmp_path / "r").exists()
