"""--lora and --grad-checkpointing through `visiontune train`: a LoRA run learns, its best model file is the
merged plain model (scored independently), its checkpoints hold only the adapters, the head and the
buffers, and a resume from one ends with the uninterrupted run's tensors; under DDP x2 and FSDP x2 (with
--grad-checkpointing) it trains what one process does with the doubled batch, and an FSDP run killed with
-9 resumes exactly. Bad settings: one line."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from trained import independent_eval, one_thread  # noqa: F401  (one_thread: autouse)
from trainrun import (
    PYTHON,
    env_for,
    flags,
    one_line,
    relative_difference,
    run,
    sharded_tensors,
    start,
    tiny_train,
    train_ddp_beside_one,
    wait_for,
)
from visiontune import cli
from visiontune.runs import checkpoint

STEPS = 12  # per epoch: 96 train images of sample_data at batch 8


def _tensors(ckpt) -> dict[str, torch.Tensor]:
    """The model's tensors and the optimizer's state in a checkpoint, by a flat name."""
    flat = {f"model.{k}": v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    state = torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=True)["state"]
    flat.update({f"opt.{i}.{k}": v for i, s in state.items() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return flat


@pytest.mark.slow
def test_a_lora_run_learns_saves_a_merged_model_keeps_adapter_checkpoints_and_resumes_exactly(
    tmp_path, sample_data, capsys
):
    run = tmp_path / "run"
    argv = [*tiny_train(sample_data, run), *flags(lora=8, epochs=2, batch_size=8, lr=0.005, num_workers=0)]
    argv += flags(save_every_steps=5, keep_last=10, split_method="random")
    assert cli.main(argv) == 0
    assert "rank 8, alpha 8, dropout 0 on 20 layers" in capsys.readouterr().out  # said at the start
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_val_accuracy"] >= 0.8  # two classes: chance is 0.5
    # best.safetensors is the merged model: a plain torchvision resnet18 loads it (strictly) and scores it
    # as the run did.
    loss, accuracy, n = independent_eval(run, sample_data)
    assert n == summary["val_split_size"] and accuracy == pytest.approx(summary["best_val_accuracy"], abs=1e-9)

    final = run / "checkpoints" / checkpoint.name(2, 0)
    kept = load_file(str(final / "model.safetensors"))
    frozen_base = [k for k in kept if not (".lora_" in k or k.startswith("fc.") or "running_" in k or "batches" in k)]
    assert frozen_base == [] and any(".lora_A." in k for k in kept)
    ratio = (final / "model.safetensors").stat().st_size / (run / "best.safetensors").stat().st_size
    assert ratio < 0.05, ratio

    # A run stopped after its checkpoint in epoch 2 (the later ones never written), resumed: the same tensors.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    for later in checkpoint.listed(str(resumed))[:2]:  # epoch0002-end and epoch0002-batch0000008
        shutil.rmtree(later)
    (resumed / "summary.json").unlink()
    assert checkpoint.listed(str(resumed))[0].endswith(checkpoint.name(1, 15 - STEPS))
    assert cli.main([*argv[:3], "--output-dir", str(resumed), *argv[5:], "--resume", "auto"]) == 0
    assert "resuming from" in capsys.readouterr().out
    got, want = _tensors(resumed / "checkpoints" / checkpoint.name(2, 0)), _tensors(final)
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []

    # Another rank cannot continue these adapters: one line, exit 2.
    assert cli.main([*argv[:3], "--output-dir", str(resumed), *argv[5:], "--resume", "auto", "--lora", "4"]) == 2
    one_line(capsys, "cannot resume: the LoRA adapters differ", "--lora 8", "--lora 4")


@pytest.mark.distributed
def test_lora_with_grad_checkpointing_under_ddp_and_fsdp_equals_one_process_and_fsdp_resumes_exactly_after_kill_9(
    small_data, tmp_path, worker_env
):
    """timm's test_convnext (no BatchNorm, no dropout): DDP x2 and FSDP x2 at batch 3 compute what one process
    does at 6; an FSDP x2 run SIGKILLed mid-epoch and resumed ends with the uninterrupted one's tensors."""
    from visiontune.inference.loaded import load_model

    env = env_for(worker_env, tmp_path)
    common = flags(data=small_data, model="timm/test_convnext", weights="none", val_fraction=0.25, image_size=32)
    common += flags(
        lora=4, lora_alpha=8, grad_checkpointing=True, epochs=1, num_workers=0, timeout=60, no_progress=True
    )
    common += flags(save_every_steps=1, keep_last=20)
    ddp = flags(strategy="ddp", nproc=2, batch_size=3, lr=0.01)
    train_ddp_beside_one(common, ddp, flags(batch_size=6, lr=0.01), tmp_path, env)
    fsdp = [PYTHON, "-m", "visiontune", "train", *common, *flags(strategy="fsdp", nproc=2, batch_size=3, lr=0.01)]
    done = run([*fsdp, "--output-dir", str(tmp_path / "fsdp")], env)
    assert done.returncode == 0, done.stderr[-3000:]
    best = [load_file(str(tmp_path / d / "best.safetensors")) for d in ("ddp", "fsdp", "one")]
    assert not any("lora_" in k or "base_layer" in k for b in best[:2] for k in b)  # merged: the plain names
    assert relative_difference(best[0], best[2]) < 1e-5 and relative_difference(best[1], best[2]) < 1e-5
    loaded = load_model(weights=str(tmp_path / "fsdp" / "best.safetensors"))  # builds the plain timm model
    assert all(torch.equal(v, best[1][k]) for k, v in loaded.model.state_dict().items())
    record = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert record["overview"]["LoRA"].startswith("rank 4, alpha 8") and "grad checkpointing" in record["overview"]

    # FSDP's sharded checkpoints hold the adapters and the head only.
    final = checkpoint.name(1, 0)
    want = sharded_tensors(tmp_path / "fsdp" / "checkpoints" / final, tmp_path)
    model_keys = [k for k in want if k.startswith(".model.")]
    assert model_keys and all(".lora_" in k or k.startswith(".model.head.") for k in model_keys)
    said = record["overview"]["LoRA"]  # "rank 4, ... on 22 layers; 18,978 of 226,106 parameters train (...)"
    trained = int(said.split("; ")[1].split(" of ")[0].replace(",", ""))
    assert sum(want[k].numel() for k in model_keys) == trained < 0.1 * sum(v.numel() for v in best[1].values())

    # kill -9 of the whole job mid-epoch, then --resume auto: the uninterrupted run's tensors, bit for bit.
    out = tmp_path / "killed"
    proc = start([*fsdp, "--output-dir", str(out)], env, tmp_path / "killed.log")
    wait_for(out / "checkpoints" / checkpoint.name(0, 2), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "checkpoints" / final).exists(), "the run ended before the kill"
    resumed = run([*fsdp, "--output-dir", str(out), "--resume", "auto"], env)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    got = sharded_tensors(out / "checkpoints" / final, tmp_path)
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.parametrize(
    "extra,says",
    [
        (flags(lora=-1), "--lora must be an integer from 0"),
        (flags(lora_targets="qkv"), "--lora-targets sets up LoRA adapters: add --lora R"),
        (flags(lora=4, lora_dropout=1.5), "--lora-dropout must be in [0, 1)"),
        (flags(lora=4, freeze_backbone=True), "--lora trains adapters in the backbone"),
        (flags(lora=4, lora_targets="qkv"), "--lora-targets qkv matches no Linear or Conv2d layer of resnet18"),
    ],
)
def test_bad_lora_settings_are_one_line(tmp_path, small_data, capsys, no_scan, extra, says):
    assert cli.main(tiny_train(small_data, tmp_path / "run", *extra)) == 2
    one_line(capsys, says)
