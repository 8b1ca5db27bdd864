"""``--strategy fsdp``: fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Each process holds 1/N of every parameter, gradient and optimizer moment; a block's parameters are
gathered for its forward and backward and freed after. The model is sharded block by block (timm's
``blocks``/``stages``, torchvision's ``layer1``..``layer4``, ``features`` or ``encoder.layers``), then as a
whole for what is left (stem, head). ``--mixed-precision`` sets the dtype of the gathered parameters and
of the gradient reductions; ``--fsdp-offload`` keeps parameters and optimizer state in CPU memory.

``fully_shard`` is called directly, not through Accelerate's FSDP plugin: Accelerate turns the plugin on
only for GPU-like devices and on a CPU (gloo) would wrap the model in DDP instead. Accelerate still
prepares the loaders and the optimizer (accumulation, the scaler) and saves the RNG and sampler states;
the sharded model and optimizer are saved and loaded with ``torch.distributed.checkpoint`` through
Accelerate's save/load hooks, so a checkpoint reshards to any world size, one process included; they are
read back through ``dcpfiles``, which unpickles nothing.
"""

from __future__ import annotations

from visiontune.cluster.strategies.base import Strategy, register
from visiontune.errors import UserError

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_EMA = "ema"  # the sharded EMA's folder in a checkpoint


@register
class FSDP(Strategy):
    name = "fsdp"
    description = "fully sharded data parallel (FSDP2): parameters, gradients and optimizer state split over processes"
    several_processes = True
    sharded = True

    def check(self, cfg) -> None:
        if cfg.compile:
            raise UserError("--compile does not run with --strategy fsdp yet: drop --compile or use --strategy ddp")
        if cfg.fsdp_offload:
            from visiontune.cluster import host

            if not host.gpus():
                raise UserError("--fsdp-offload moves parameters from GPU to CPU memory; without a GPU: drop it")

    def wrap(self, accelerator, cfg, model, optimizer, loaders):
        import torch
        import torch.distributed as dist
        from accelerate.optimizer import AcceleratedOptimizer
        from torch import nn
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if not dist.is_initialized():  # one process (no launcher): a group of one, so the same code runs
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = model.to(accelerator.device)
        # Each process drew its own initial weights (seed + rank): rank 0's, as DDP starts from them too.
        _from_rank0(model, (), tensors=[*model.parameters(), *model.buffers()])
        by_id = {id(p): n for n, p in model.named_parameters()}
        groups = [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        dtype = getattr(torch, _DTYPES[cfg.mixed_precision]) if cfg.mixed_precision in _DTYPES else None
        how = {
            "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype),
            "offload_policy": CPUOffloadPolicy() if cfg.fsdp_offload else OffloadPolicy(),
        }
        if dtype is not None:
            # BatchNorm's statistics stay float32, and its kernel wants its weights in the same dtype: each
            # BatchNorm is a unit of its own that gathers float32 (cheap: two vectors a layer).
            fp32 = {**how, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=dtype)}
            for norm in [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
                fully_shard(norm, **fp32)
            model.forward = _autocast(model.forward, accelerator)  # what accelerator.prepare_model would add
        for block in blocks(model):
            fully_shard(block, **how)
        fully_shard(model, **how)
        # fully_shard swapped every parameter for a sharded one (same name): the optimizer must hold those.
        params = dict(model.named_parameters())
        for group, names in zip(optimizer.param_groups, groups):
            group["params"] = [params[n] for n in names]
        model.register_forward_pre_hook(_from_rank0)
        # The optimizer is wrapped as ``accelerator.prepare`` would, but not registered with the accelerator:
        # its sharded state is saved by the hooks below, not gathered into Accelerate's one-file save.
        optimizer = AcceleratedOptimizer(optimizer, device_placement=False, scaler=accelerator.scaler)
        prepared = accelerator.prepare(*loaders) if loaders else ()
        loaders = list(prepared) if len(loaders) > 1 else ([prepared] if loaders else [])
        accelerator.register_save_state_pre_hook(lambda _m, _w, folder: _save(model, optimizer.optimizer, folder))
        accelerator.register_load_state_pre_hook(lambda _m, folder: _load(model, optimizer.optimizer, folder))
        return model, optimizer, loaders

    def save_schedule(self, accelerator, state, path):
        """The EMA's shards through torch.distributed.checkpoint into ``ema/`` beside ``path`` (every process
        writes its own, resharded on load as the model's are); the rest as one file, as elsewhere."""
        import os

        import torch.distributed.checkpoint as dcp
        from torch.distributed.tensor import DTensor

        ema = state.get("ema")
        if ema is not None:
            # Buffers are whole on every process, each its own; rank 0's are the ones evaluated and saved.
            _from_rank0(None, (), tensors=[t for t in ema["tensors"].values() if not isinstance(t, DTensor)])
            dcp.save({"ema": ema}, checkpoint_id=os.path.join(os.path.dirname(path), _EMA))
            state = {**state, "ema": _EMA}
        super().save_schedule(accelerator, state, path)

    def load_schedule(self, accelerator, scheduler, path):
        import os

        import torch

        from visiontune.cluster import dcpfiles

        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("ema") == _EMA:
            if scheduler.ema is None:
                state["ema"] = None
            else:
                held = {"ema": scheduler.ema.state_dict()}  # DTensors over this EMA's own storage
                dcpfiles.load(held, os.path.join(os.path.dirname(path), _EMA))
                state["ema"] = held["ema"]
        scheduler.load_state_dict(state)

    def full_state_dict(self, accelerator, model):
        """Gathered parameter by parameter into the main process's CPU memory: no rank ever holds two full
        copies, and the others hold none."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from visiontune.models import lora  # torch: not imported before a model is

        plain = self.unwrap(accelerator, model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(plain, options=options)
        if not accelerator.is_main_process:
            return None
        # Gathered parameters are new tensors, but the buffers (not sharded) and, in a world of one, the
        # parameters too are the model's own storage, which the next step (or an EMA swapped out again)
        # changes while the file is written in the background: copies of those.
        live = {_local(t).untyped_storage().data_ptr() for t in (*plain.parameters(), *plain.buffers())}
        state = {k: v.clone() if v.untyped_storage().data_ptr() in live else v.contiguous() for k, v in state.items()}
        return lora.merged(plain, state) if lora.has_adapters(plain) else state


def _local(t):
    """A DTensor's own shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def blocks(model) -> list:
    """The repeated blocks to shard one by one: the first container the model family keeps them in."""
    from torch import nn

    found = []
    for path in ("blocks", "stages", "layers", "encoder.layers", "features"):  # timm; torchvision's ViT, CNNs
        holder = model
        for part in path.split("."):
            holder = getattr(holder, part, None)
        if isinstance(holder, (nn.Sequential, nn.ModuleList)):
            found = [b for b in holder if any(True for _ in b.parameters())]
            break
    resnet = [
        getattr(model, f"layer{i}") for i in range(1, 5) if isinstance(getattr(model, f"layer{i}", None), nn.Module)
    ]
    return found or resnet or [c for c in model.children() if any(True for _ in c.parameters())]


def _autocast(forward, accelerator):
    """``forward`` under the run's autocast, its outputs in float32 (the loss and metrics are taken in float32)."""
    import functools

    from accelerate.utils import convert_outputs_to_fp32

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    return convert_outputs_to_fp32(run)


def _from_rank0(module, _args, tensors=None) -> None:
    """Rank 0's buffers (BatchNorm statistics), or ``tensors``, to every process. A forward pre-hook, as DDP
    does it: FSDP shards parameters only, and each process would otherwise evaluate with its own statistics."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        with torch.no_grad():
            for t in module.buffers() if tensors is None else tensors:
                dist.broadcast(t.data, 0)


def _save(model, optimizer, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # Buffers are not sharded: each process holds its own copy, and which copy the save keeps is the
    # planner's choice. Rank 0's, as under DDP (and as every process's next forward would take them).
    _from_rank0(model, ())
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": _kept(model, model_state), "optim": optim_state}, checkpoint_id=folder)


def _load(model, optimizer, folder: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from visiontune.cluster import dcpfiles
    from visiontune.models import lora

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": _kept(model, model_state), "optim": optim_state}
    dcpfiles.load(state, folder)  # resharded to this world size; a key it lacks is an error
    options = StateDictOptions(strict=not lora.has_adapters(model))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def _kept(model, state: dict) -> dict:
    """What a checkpoint holds of the model: all of it, or under ``--lora`` what trains (the adapters, the new
    head) and the buffers; the frozen base is built again from ``--weights`` on resume."""
    from visiontune.models import lora

    if not lora.has_adapters(model):
        return state
    keep = lora.trained_keys(model)
    return {k: v for k, v in state.items() if k in keep}
