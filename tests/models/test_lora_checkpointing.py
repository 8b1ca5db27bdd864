"""--lora and --grad-checkpointing on the model alone, in-process: torchvision's resnet18 (LoRA on its
convolutions, checkpointed per BasicBlock) and timm's test_vit (LoRA on attention and MLP layers,
checkpointed by timm's own switch), at 32 px with no pretrained weights."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from peft.tuners.lora import LoraLayer

from visiontune.errors import UserError
from visiontune.models import checkpointing, lora
from visiontune.models.build import build_model, head_names


def _resnet18() -> torch.nn.Module:
    return build_model("resnet18", 3, "none")


def _vit() -> torch.nn.Module:
    return timm.create_model("test_vit", num_classes=3, img_size=32, patch_size=8)


MODELS = {"resnet18": _resnet18, "timm-test_vit": _vit}


def _loss_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_grad_checkpointing_gives_the_same_loss_and_gradients_and_recomputes_the_blocks(make):
    torch.manual_seed(0)
    plain = make()
    checked = copy.deepcopy(plain)
    how = checkpointing.enable(checked, "m")
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    # A layer inside the first block runs twice per step when its block is recomputed in the backward pass.
    inner = (checked.layer1[0].conv1 if hasattr(checked, "layer1") else checked.blocks[0].attn.qkv, [])
    inner[0].register_forward_hook(lambda *_: inner[1].append(1))
    want_loss, want = _loss_and_grads(plain, x, y)
    got_loss, got = _loss_and_grads(checked, x, y)
    assert len(inner[1]) == 2, how
    assert torch.allclose(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys() and len(want) == len(list(plain.parameters()))
    assert all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6) for k in want)
    assert plain.state_dict().keys() == checked.state_dict().keys()  # names and files unchanged
    with torch.no_grad():  # evaluation is not recomputed
        inner[1].clear()
        checked.eval()(x)
        assert len(inner[1]) == 1


def test_grad_checkpointing_refuses_a_model_without_blocks():
    with pytest.raises(UserError, match="has none"):
        checkpointing.enable(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()), "a stack")


def test_lora_targets_are_chosen_per_family_and_a_name_that_matches_nothing_is_one_error():
    vit = _vit()
    targets = lora.default_targets(vit, head_names(vit))
    assert targets and {t.split(".", 2)[2] for t in targets} == {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}
    resnet = _resnet18()
    convs = lora.default_targets(resnet, head_names(resnet))
    assert "fc" not in convs and len(convs) == 20 and "layer4.1.conv2" in convs  # 17 3x3/7x7 + 3 downsample 1x1
    assert lora.resolve_targets(vit, ["head"], "qkv", "v") == [f"blocks.{i}.attn.qkv" for i in range(len(vit.blocks))]
    with pytest.raises(UserError, match="--lora-targets nope matches no"):
        lora.resolve_targets(vit, ["head"], "qkv,nope", "v")
    with pytest.raises(UserError, match="matches no"):
        lora.resolve_targets(resnet, ["fc"], "fc", "resnet18")  # the head is never adapted


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_lora_trains_only_adapters_and_head_and_its_merged_weights_give_the_adapted_outputs(make):
    torch.manual_seed(0)
    model = make()
    heads = head_names(model)
    model = lora.add_adapters(model, 4, heads, alpha=8, targets=lora.default_targets(model, heads))
    with torch.no_grad():  # B starts at zero (the adapted model is the base); move it so the merge matters
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    _, grads = _loss_and_grads(model, x, y)
    adapter_or_head = {n for n, _ in model.named_parameters() if ".lora_" in n or n.startswith(tuple(heads))}
    assert set(grads) == adapter_or_head and all(g.abs().sum() > 0 for g in grads.values())
    trained, total = lora.size(model)
    assert trained == sum(p.numel() for n, p in model.named_parameters() if n in adapter_or_head) < total

    merged = lora.merged_state_dict(model)
    plain = make()
    plain.load_state_dict(merged)  # strict: the plain model's names, nothing more
    with torch.no_grad():
        assert torch.allclose(plain.eval()(x), model.eval()(x), rtol=0, atol=1e-5)
        # What peft's own merge writes into each layer.
        for name, layer in lora.lora_layers(copy.deepcopy(model)).items():
            assert isinstance(layer, LoraLayer)
            layer.merge()
            assert torch.equal(layer.get_base_layer().weight, merged[name + ".weight"])
