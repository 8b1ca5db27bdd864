"""An exponential moving average of a model's weights (``--ema DECAY``), torch's AveragedModel inside.

After every optimizer step ``ema = decay * ema + (1 - decay) * weights`` for every
parameter and buffer (BatchNorm statistics too, so the average is a model that can
be evaluated as it is). The first update copies the weights. Its state is plain
tensors, so checkpoints keep it with ``weights_only`` loading and a resume
continues the average exactly.

Two kinds, one interface (``update``, ``weights()``, ``state_dict``/``load_state_dict``):

- ``EMA``: a copy of the whole model (AveragedModel), for strategies where each process holds the whole model.
- ``ShardedEMA``: under a sharded model (``--strategy fsdp``) the model cannot be copied, and a full copy is
  what sharding avoids: each process averages its own shards, with the same update. ``weights()`` swaps
  the averages into the model's own shards for as long as it is held (evaluation, the gathered best
  model) and swaps them back; its state is DTensors, so a checkpoint of it reshards as the model's does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def _rank0_buffers(buffers: list[torch.Tensor]) -> None:
    """Rank 0's values everywhere. Each process's BatchNorm statistics follow its own batches; the average
    evaluated (and saved, from rank 0) must be one model on every process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for b in buffers:
            dist.broadcast(b, 0)


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        # ``model`` is the plain (unwrapped) model: its parameters are the ones DDP keeps equal everywhere.
        self.model, self.decay = model, decay
        self.average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.average.requires_grad_(False)

    def update(self) -> None:
        self.average.update_parameters(self.model)

    @property
    def module(self) -> nn.Module:
        """The averaged model, ready to evaluate or save (its plain state dict has the model's keys)."""
        return self.average.module

    @contextlib.contextmanager
    def weights(self) -> Iterator[nn.Module]:
        """The averaged model, its buffers rank 0's (every process calls it when there are several)."""
        _rank0_buffers(list(self.module.buffers()))
        yield self.module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.average.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.average.load_state_dict(state)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (the storage the optimizer steps), or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class ShardedEMA:
    def __init__(self, model: nn.Module, decay: float):
        self.model, self.decay = model, decay
        self.average_fn = get_ema_multi_avg_fn(decay)
        self.n_averaged = 0
        with torch.no_grad():
            self.tensors = {n: _local(t).detach().clone() for n, t in self._live()}

    def _live(self) -> list[tuple[str, torch.Tensor]]:
        # Looked up each time, after sharding again what a forward pass left gathered (FSDP keeps the root's
        # parameters whole after a forward without backward, an evaluation's): its shards are the ones to take.
        for m in self.model.modules():
            if hasattr(m, "reshard"):
                m.reshard()
        return [*self.model.named_parameters(), *self.model.named_buffers()]

    @torch.no_grad()
    def update(self) -> None:
        pairs = [(self.tensors[n], _local(t).detach()) for n, t in self._live()]
        if self.n_averaged == 0:
            for ema, now in pairs:
                ema.copy_(now)
        else:  # AveragedModel's update, one dtype at a time as it groups them
            n = torch.tensor(self.n_averaged)
            for dtype in dict.fromkeys(e.dtype for e, _ in pairs):
                group = [(e, t) for e, t in pairs if e.dtype == dtype]
                self.average_fn([e for e, _ in group], [t for _, t in group], n)
        self.n_averaged += 1

    @contextlib.contextmanager
    def weights(self) -> Iterator[nn.Module]:
        """The model itself with the averages in its shards, until the block ends (every process calls it)."""
        self._swap()
        try:
            _rank0_buffers([_local(b) for _, b in self.model.named_buffers()])
            yield self.model
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for name, t in self._live():
            mine, live = self.tensors[name], _local(t)
            held = live.clone()
            live.copy_(mine)
            mine.copy_(held)

    def state_dict(self) -> dict:
        """The shards as DTensors over the model's mesh (sharing this EMA's storage, so loading into them
        restores it), the buffers as they are."""
        from torch.distributed.tensor import DTensor

        state = {}
        for name, t in self._live():
            mine = self.tensors[name]
            if isinstance(t, DTensor):
                mine = DTensor.from_local(mine, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
            state[name] = mine
        return {"n_averaged": torch.tensor(self.n_averaged), "tensors": state}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.n_averaged = int(state["n_averaged"])
        for name, t in state["tensors"].items():
            self.tensors[name].copy_(_local(t))
