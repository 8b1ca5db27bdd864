"""--strategy fsdp (FSDP2 on gloo, 2 processes) against ddp, and its sharded checkpoints killed and resumed.

One uninterrupted fsdp x2 run and one ddp x2 run on the same seed (timm's test_resnet at 32 px: a ResNet, sharded
by its layer1..layer4 as torchvision's, BatchNorm and all, at 0.4M parameters where resnet18 has 11M, whose
sharded checkpoints were most of this module's time; with an EMA of the weights),
then a fsdp x2 run SIGKILLed mid-epoch and continued with --resume auto, and a checkpoint of the fsdp run
continued on one process. 20 images, 5 of them val (odd: padding would count 6), 2 epochs of 4 steps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trained import independent_eval
from trainrun import PYTHON, env_for, flags, run, sharded_tensors, start, wait_for
from visiontune.data.sample import make_sample_data
from visiontune.runs import checkpoint

EPOCHS = 2
RUN = [
    *flags(model="timm/test_resnet", weights="none", image_size=32, no_progress=True, timeout=60, epochs=EPOCHS),
    *flags(batch_size=2, val_fraction=0.25, save_every_steps=1, keep_last=20, ema=0.5),
]
# Same seed, same global batch, same gradients: only the order of the float sums may differ (reduce-scatter
# against all-reduce), which on gloo with 2 processes gives the same bits and elsewhere about 1e-6.
TOLERANCE = 1e-5
VALS = ("val", "val_ema")  # the rows a best model is picked from (--ema)


def _argv(data: Path, out: Path, strategy: str, nproc: int = 2) -> list[str]:
    return [
        PYTHON,
        "-m",
        "visiontune",
        "train",
        *flags(data=data, output_dir=out, strategy=strategy, nproc=nproc),
        *RUN,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The data, and the uninterrupted fsdp and ddp runs (one after the other: 3 processes at a time)."""
    from conftest import _worker_env

    tmp = tmp_path_factory.mktemp("fsdp")
    make_sample_data(tmp / "data", per_class=10, test_count=0, seed=3)
    env = env_for(_worker_env(), tmp)
    # Of fsdp's step checkpoints only the one a process resumes from alone (step 4: epoch 2, after batch 1) is read;
    # the killed run saves every step, so its tensors are also held to a run that saved less often. ddp's: unread.
    for strategy, extra in (("fsdp", flags(save_every_steps=4)), ("ddp", flags(save_every_steps=0))):
        result = run([*_argv(tmp / "data", tmp / strategy, strategy), *extra], env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max() / (b[k].double().abs().max() + 1e-12)) for k in a)


@pytest.mark.distributed
def test_fsdp_x2_matches_ddp_x2_counts_every_val_image_once_and_writes_one_full_model_file(runs):
    fsdp, ddp = runs / "fsdp", runs / "ddp"
    first_line = (fsdp / "config.json").read_text()
    assert '"strategy": "fsdp"' in first_line
    hf, hd = (json.loads((r / "history.json").read_text()) for r in (fsdp, ddp))
    val = json.loads((fsdp / "split.json").read_text())["counts"]["val"]
    assert val == 5 and all(h["val"]["images"] == val for h in hf)
    for a, b in zip(hf, hd, strict=True):
        for phase in ("train", "val", "val_ema"):
            assert a[phase]["loss"] == pytest.approx(b[phase]["loss"], rel=TOLERANCE)
            assert a[phase]["accuracy"] == b[phase]["accuracy"]
    # best.safetensors is one full file with the plain model's names: timm loads it as it is.
    assert _close(load_file(str(fsdp / "best.safetensors")), load_file(str(ddp / "best.safetensors"))) < TOLERANCE
    loss, acc, n = independent_eval(fsdp, runs / "data")
    summary = json.loads((fsdp / "summary.json").read_text())
    assert n == val and summary["best_val_accuracy"] == pytest.approx(acc, abs=1e-9)
    assert summary["best_val_loss"] == pytest.approx(loss, rel=1e-4)
    # The checkpoint is sharded: one file per process, no gathered model.
    final = fsdp / "checkpoints" / checkpoint.name(EPOCHS, 0)
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (final / "model.safetensors").exists()


@pytest.mark.distributed
def test_fsdp_killed_mid_epoch_resumes_to_the_uninterrupted_tensors_and_on_one_process(runs, tmp_path, worker_env):
    env, out = env_for(worker_env, tmp_path), tmp_path / "run"
    argv = _argv(runs / "data", out, "fsdp")
    proc = start(argv, env, tmp_path / "killed.log")
    wait_for(out / "checkpoints" / checkpoint.name(0, 2), proc)  # mid-epoch 0
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "checkpoints" / checkpoint.name(EPOCHS, 0)).exists(), "the run ended before the kill"
    resumed = run([*argv, "--resume", "auto"], env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    final = checkpoint.name(EPOCHS, 0)
    got, want = (
        sharded_tensors(out / "checkpoints" / final, tmp_path),
        sharded_tensors(runs / "fsdp" / "checkpoints" / final, tmp_path),
    )
    assert sorted(got.keys() ^ want.keys()) == []
    best = load_file(str(runs / "fsdp" / "best.safetensors"))
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    # The EMA's shards (and its rank-0 buffers), beside them in their own sharded checkpoint.
    got_ema, want_ema = (sharded_tensors(r / "checkpoints" / final / "ema", tmp_path) for r in (out, runs / "fsdp"))
    assert sorted(got_ema.keys() ^ want_ema.keys()) == [] and len(got_ema) == len(best) + 1  # + n_averaged
    assert [k for k in want_ema if not torch.equal(got_ema[k], want_ema[k])] == []
    # Not an empty state: every tensor of the model, and SGD's momentum of every parameter.
    assert {k for k in got if k.startswith(".model.")} == {f".model.{k}" for k in best}
    params = [k for k in best if "running_" not in k and "num_batches" not in k]
    assert len({k.rsplit(".", 1)[0] for k in got if k.endswith(".momentum_buffer")}) == len(params)

    # The same sharded checkpoint on one process (resharded from 2 to 1): same global batch, the run ends.
    one, at = tmp_path / "one", checkpoint.name(1, 1)
    shutil.copytree(runs / "fsdp" / "checkpoints" / at, one / "checkpoints" / at)
    alone = run([*_argv(runs / "data", one, "fsdp", nproc=1), "--batch-size", "4", "--resume", "auto"], env)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert f"resuming from {one / 'checkpoints' / at} (Epoch 2/{EPOCHS}, after batch 1)" in alone.stdout
    world = json.loads((one / "world.jsonl").read_text().splitlines()[-1])
    assert (world["world_size"], world["checkpoint_world_size"], world["global_batch"]) == (1, 2, 4)
    history = json.loads((one / "history.json").read_text())
    reference = json.loads((runs / "fsdp" / "history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2] and history[1]["train"]["images"] == reference[1]["train"]["images"]
    assert history[0] == reference[0]  # the epoch before the checkpoint is the reference's, carried over
    # Its BatchNorm sees batches of 4 where each reference process saw 2, so its epoch 1 is its own, and so is its
    # best epoch: the one its history ranks first (accuracy, then loss, then the earlier; raw or EMA).
    ranked = [(h[w]["accuracy"], -h[w]["loss"], -h["epoch"], w == "val", h["epoch"]) for h in history for w in VALS]
    best_epoch = max(ranked)[-1]
    summary = json.loads((one / "summary.json").read_text())
    assert summary["best_epoch"] == best_epoch
    if best_epoch == 2:  # a full file written by one process, which scores what the summary says
        loss, acc, _ = independent_eval(one, runs / "data")
        assert summary["best_val_accuracy"] == pytest.approx(acc, abs=1e-9)
        assert summary["best_val_loss"] == pytest.approx(loss, rel=1e-4)
    else:  # epoch 1's model is the reference's, in its folder: none is written in this one
        assert not (one / "best.safetensors").exists()
