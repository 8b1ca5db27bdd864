"""The strategy objects and their registry: one object per --strategy name, asked instead of the name."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from visiontune.cluster import strategies
from visiontune.cluster.strategy import effective
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig, choices


def test_the_registry_holds_exactly_the_strategies_the_settings_offer():
    assert sorted(strategies.names()) == sorted(choices()["strategy"])
    assert all(strategies.get(n).name == n for n in strategies.names())
    assert strategies.several_default().several_processes
    assert strategies.one_device().devices_used(gpus=8, nproc=4) == 1 and not strategies.one_device().several_processes
    with pytest.raises(UserError, match="unknown strategy 'nope'; choose from "):
        strategies.get("nope")
    with pytest.raises(ValueError, match="registered twice"):
        strategies.register(type(strategies.one_device()))


def test_a_launcher_worker_runs_a_strategy_of_several_processes(monkeypatch):
    for k in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert [effective(TrainConfig(data="d", strategy=n)).name for n in strategies.names()] == list(strategies.names())
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for n in strategies.names():  # one-process choices become the default of several; the others stay
        want = n if strategies.get(n).several_processes else strategies.several_default().name
        assert effective(TrainConfig(data="d", strategy=n)).name == want


def test_bench_plans_from_the_objects():
    dp = strategies.get("dp")
    assert dp.unavailable(1) == "DataParallel needs 2 or more GPUs; 1 visible" and dp.unavailable(2) is None
    assert dp.devices_used(gpus=4, nproc=2) == 4
    assert strategies.several_default().devices_used(gpus=4, nproc=3) == 3


def test_the_full_state_dict_is_cpu_copies_under_the_plain_names(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    for name in strategies.names():
        if strategies.get(name).several_processes:
            continue  # needs a process group: tests/training/test_strategies.py
        s = strategies.get(name)
        wrapped, _, _ = s.prepare(accelerator, TrainConfig(data="d"), model, torch.optim.SGD(model.parameters(), 0.1))
        assert s.unwrap(accelerator, wrapped) is model
        state = s.full_state_dict(accelerator, wrapped)
        assert state.keys() == model.state_dict().keys()
        state["0.weight"] += 1  # a copy: training on does not change what is being written
        assert not torch.equal(state["0.weight"], model[0].weight)


def test_fsdp_shards_each_family_by_its_blocks():
    import timm
    import torchvision

    from visiontune.cluster.strategies.fsdp import blocks

    resnet = torchvision.models.resnet18(num_classes=2)
    assert blocks(resnet) == [resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4]
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=2, img_size=32, depth=3)
    assert blocks(vit) == list(vit.blocks) and len(blocks(vit)) == 3
    convnext = timm.create_model("convnext_atto", pretrained=False, num_classes=2)
    assert blocks(convnext) == list(convnext.stages)
    squeeze = torchvision.models.squeezenet1_1(num_classes=2)  # its parameter-free layers are left to the root
    assert blocks(squeeze) == [m for m in squeeze.features if any(True for _ in m.parameters())]


@pytest.mark.parametrize(
    "given,says",
    [
        (["--strategy", "ddp", "--fsdp-offload"], "--fsdp-offload is an option of --strategy fsdp, not of ddp"),
        (["--strategy", "fsdp", "--compile"], "--compile does not run with --strategy fsdp yet"),
    ],
)
def test_what_a_strategy_cannot_run_is_one_line_before_any_worker(sample_data, tmp_path, capsys, given, says):
    from visiontune.cli.commands import main

    out = tmp_path / "r"
    argv = ["train", "--data", str(sample_data), "--model", "resnet18", "--weights", "none", "--output-dir", str(out)]
    assert main([*argv, *given]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert not out.exists()


def test_fsdp_s_full_state_in_a_world_of_one_is_copies_not_the_live_shards(tmp_path):
    """One process gathers nothing: its full state would be the live parameters, which the next step (or the
    EMA swapped back) changes while the best model's file is written in the background."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    accelerator = Accelerator(cpu=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)))
        state = strategies.get("fsdp").full_state_dict(accelerator, model)
        assert state.keys() == {
            "0.weight",
            "0.bias",
            "1.weight",
            "1.bias",
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
        }
        before = {k: v.clone() for k, v in state.items()}
        with torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                t.to_local().add_(1) if hasattr(t, "to_local") else t.add_(1)
        assert [k for k in state if not torch.equal(state[k], before[k])] == []
    finally:
        dist.destroy_process_group()
