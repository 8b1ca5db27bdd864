"""--lora and --grad-checkpointing through `visiontune train`: a LoRA run learns, its best model file is the
merged plain model (scored independently), its checkpoints hold only the adapters, the head and the
buffers, and a resume from one ends with the uninterrupted run's tensors; under DDP x2 (with
--grad-checkpointing) it trains what one process does with the doubled batch. Bad settings: one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from trained import independent_eval, one_thread  # noqa: F401  (one_thread: autouse)
from trainrun import env_for, flags, one_line, relative_difference, tiny_train, train_ddp_beside_one
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
def test_lora_with_grad_checkpointing_under_ddp_equals_one_process(small_data, tmp_path, worker_env):
    """timm's test_convnext (no BatchNorm, no dropout): DDP x2 at batch 3 computes what one process does at 6."""
    from visiontune.inference.loaded import load_model

    common = flags(data=small_data, model="timm/test_convnext", weights="none", val_fraction=0.25, image_size=32)
    common += flags(
        lora=4, lora_alpha=8, grad_checkpointing=True, epochs=1, num_workers=0, timeout=60, no_progress=True
    )
    ddp = flags(strategy="ddp", nproc=2, batch_size=3, lr=0.01)
    train_ddp_beside_one(common, ddp, flags(batch_size=6, lr=0.01), tmp_path, env_for(worker_env, tmp_path))
    best = [load_file(str(tmp_path / d / "best.safetensors")) for d in ("ddp", "one")]
    assert not any("lora_" in k or "base_layer" in k for k in best[0])  # merged: the plain model's names
    assert relative_difference(*best) < 1e-5
    loaded = load_model(weights=str(tmp_path / "ddp" / "best.safetensors"))  # builds the plain timm model
    assert all(torch.equal(v, best[0][k]) for k, v in loaded.model.state_dict().items())
    record = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert record["overview"]["LoRA"].startswith("rank 4, alpha 8") and "grad checkpointing" in record["overview"]


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
