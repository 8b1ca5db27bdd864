"""The checkpoints of a ``--lora`` run: they hold what trains (the adapters, the new head) and the
buffers, not the frozen base, which the resumed run builds again from ``--weights``.

``adapters_only`` registers an Accelerate ``save_state`` pre-hook that drops the frozen weights from
what is written, and a ``load_state`` pre-hook that refuses a checkpoint lacking any of the kept
tensors (``resume.load`` loads such a checkpoint with ``strict=False``, so a missing adapter would
otherwise stay at its initial value without a word). ``base_digest`` fingerprints the frozen base,
so a resume on other base weights is refused rather than training adapters meant for another model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import xxhash

from visiontune.errors import UserError
from visiontune.models.lora import trained_keys


def adapters_only(accelerator) -> None:
    """Make ``accelerator.save_state`` keep only the trained tensors of each prepared model."""

    def drop_frozen(models, weights, _output_dir) -> None:
        for model, state in zip(models, weights):
            keep = trained_keys(model)
            for key in [k for k in state if k not in keep]:
                del state[key]

    def check_complete(models, input_dir) -> None:
        from safetensors import safe_open

        for i, model in enumerate(models):
            path = Path(input_dir) / f"model{f'_{i}' if i else ''}.safetensors"
            if not path.is_file():
                raise UserError(f"cannot load checkpoint {input_dir}: {path.name} is missing")
            with safe_open(str(path), "pt") as f:
                missing = sorted(trained_keys(model) - set(f.keys()))
            if missing:
                raise UserError(
                    f"cannot resume from {input_dir}: it lacks {len(missing)} trained tensor(s) of this run "
                    f"({missing[0]}, ...); resume with the run's --lora settings, or start a new run"
                )

    accelerator.register_save_state_pre_hook(drop_frozen)
    accelerator.register_load_state_pre_hook(check_complete)


def base_digest(model: torch.nn.Module) -> str:
    """A digest of the frozen weights (the base the adapters were trained on), the same on every process and
    whatever the strategy shards (every process calls it)."""
    h = xxhash.xxh3_128()
    for name, p in sorted(model.named_parameters()):
        if not p.requires_grad:
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # a shard: gathered (a collective)
            h.update(name.encode())
            h.update(whole.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
