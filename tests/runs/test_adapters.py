"""A --lora run's checkpoint identity: the digest of the frozen base changes with any frozen weight and
with nothing that trains; what a checkpoint keeps is the trainable tensors and the buffers."""

from __future__ import annotations

import torch

from visiontune.models import lora
from visiontune.models.build import build_model, head_names
from visiontune.runs.adapters import base_digest


def _adapted(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model("squeezenet1_1", 2, "none")
    return lora.add_adapters(model, 2, head_names(model))


def test_the_base_digest_follows_the_frozen_weights_only_and_checkpoints_keep_what_trains():
    a, b = _adapted(0), _adapted(0)
    assert base_digest(a) == base_digest(b)
    with torch.no_grad():
        next(p for n, p in b.named_parameters() if ".lora_B." in n).add_(1.0)  # an adapter moves: same base
        head = b.get_submodule(head_names(b)[0])
        head.weight.add_(1.0)
    assert base_digest(a) == base_digest(b)
    with torch.no_grad():
        b.get_submodule("features.0.base_layer").weight[0, 0, 0, 0] += 1e-3
    assert base_digest(a) != base_digest(b)
    assert base_digest(a) != base_digest(_adapted(1))  # another seed's random base

    kept = lora.trained_keys(a)
    assert kept == {n for n, p in a.named_parameters() if ".lora_" in n or n.startswith("classifier.1.")}
