"""The strategy protocol and its registry (Lightning's ``Strategy`` and ``StrategyRegistry`` are the model).

A strategy is a class with a ``name`` that registers itself with ``@register``; the registry imports
every module of this package the first time it is asked, so a new strategy is one module here (and
its name among the settings' choices, which a test keeps equal to the registry's names).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
from typing import TYPE_CHECKING, Any, ClassVar

from visiontune.errors import UserError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch import nn

_REGISTRY: dict[str, Strategy] = {}
_LOADED = False


class Strategy:
    """The behaviour of one process on one device, which the other strategies change where they differ."""

    name: ClassVar[str]
    description: ClassVar[str]
    several_processes: ClassVar[bool] = False  # one process per device, started by a launcher
    default_for_several: ClassVar[bool] = False  # what a launcher's worker runs when --strategy is one process
    one_device: ClassVar[bool] = False  # one process on one device: the baseline bench compares against
    sharded: ClassVar[bool] = False  # each process holds a part of every parameter (no whole copy to average)

    # --- setting up ---------------------------------------------------------------------------------

    def check(self, cfg) -> None:
        """Refuse settings this strategy cannot run (a UserError), before any worker starts."""
        if cfg.fsdp_offload:  # it would change nothing here, silently
            raise UserError(f"--fsdp-offload is an option of --strategy fsdp, not of {self.name}: drop it")

    def accelerator_kwargs(self, cfg) -> dict[str, Any]:
        """Arguments this strategy adds to the run's ``Accelerator(...)``."""
        return {}

    def unavailable(self, gpus: int) -> str | None:
        """Why this strategy gives nothing to measure with ``gpus`` visible GPUs (bench skips it), or None."""
        return None

    def devices_used(self, gpus: int, nproc: int) -> int:
        """Devices a run of ``nproc`` processes per machine trains on (bench's plan)."""
        return nproc if self.several_processes else 1

    def devices(self, accelerator: Accelerator) -> list[str]:
        """The devices in play, one entry per process (a collective when there are several)."""
        from accelerate.utils import gather_object

        if accelerator.num_processes > 1:
            return gather_object([str(accelerator.device)])
        return [str(accelerator.device)]

    def prepare(self, accelerator: Accelerator, cfg, model: nn.Module, optimizer, *loaders):
        """Hand the model, optimizer and loaders to Accelerate (``wrap``), with the model-wide switches around it."""
        import torch
        from torch import nn

        if cfg.sync_batchnorm and accelerator.num_processes > 1:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        with no_datasets_import():
            model, optimizer, loaders = self.wrap(accelerator, cfg, model, optimizer, loaders)
        if cfg.compile:
            model = torch.compile(model)
        return model, optimizer, loaders

    def wrap(self, accelerator: Accelerator, cfg, model: nn.Module, optimizer, loaders):
        model, optimizer, *loaders = accelerator.prepare(model, optimizer, *loaders)
        return model, optimizer, loaders

    # --- taking the state out and putting it back -----------------------------------------------------

    def unwrap(self, accelerator: Accelerator, model: nn.Module) -> nn.Module:
        """The user's module inside whatever ``prepare`` wrapped it in (its own parameters, not copies)."""
        return accelerator.unwrap_model(model, keep_torch_compile=False)

    def full_state_dict(self, accelerator: Accelerator, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's tensors as CPU copies under the plain module's names, on the main process
        (None elsewhere). Every process calls it: a sharded strategy gathers here."""
        if not accelerator.is_main_process:
            return None
        from visiontune.models import lora  # torch: not imported before a model is

        plain = self.unwrap(accelerator, model)
        if lora.has_adapters(plain):  # --lora: the adapters merged into their layers, under the plain names
            return lora.merged_state_dict(plain)
        return cpu_copies(plain.state_dict())

    def save_checkpoint(self, accelerator: Accelerator, folder: str) -> None:
        """Every process writes its part of the training state (model, optimizer, scaler, RNGs) into ``folder``."""
        accelerator.save_state(folder)

    def load_checkpoint(self, accelerator: Accelerator, folder: str, strict: bool = True) -> None:
        """Every process reads its part back; ``strict=False``: the model's tensors may be a subset (``--lora``)."""
        accelerator.load_state(folder, **({} if strict else {"strict": False}))

    def save_schedule(self, accelerator: Accelerator, state: dict, path: str) -> None:
        """The lr schedule's and the EMA's state (``Stepper.state_dict()``, taken on every process) into the
        checkpoint file ``path``: the main process's, which every process holds the same."""
        import torch

        if accelerator.is_main_process:
            torch.save(state, path)

    def load_schedule(self, accelerator: Accelerator, scheduler, path: str) -> None:
        """What ``save_schedule`` wrote, back into ``scheduler`` on every process."""
        import torch

        scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


@contextlib.contextmanager
def no_datasets_import():
    """Accelerate's sharding of a loader over several processes imports Hugging Face ``datasets`` (1.8 s of
    every DDP worker's start on 2 cores) only to ask whether the dataset is a ``datasets.IterableDataset``.
    Nothing is an instance of a class whose module was never imported, so while ``datasets`` is not
    imported the answer is no, and it is given without the import. With ``hf:`` data it is imported
    already, and Accelerate asks as it always does."""
    from accelerate import data_loader

    if "datasets" in sys.modules or not hasattr(data_loader, "is_datasets_available"):
        yield
        return
    real = data_loader.is_datasets_available
    data_loader.is_datasets_available = lambda: False
    try:
        yield
    finally:
        data_loader.is_datasets_available = real


def cpu_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies: safe to write in the background while training goes on."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` the strategy named ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"strategy {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def _load() -> dict[str, Strategy]:
    global _LOADED
    if not _LOADED:
        package = importlib.import_module(__name__.rsplit(".", 1)[0])
        for info in pkgutil.iter_modules(package.__path__):
            if info.name != "base":
                importlib.import_module(f"{package.__name__}.{info.name}")
        _LOADED = True
    return _REGISTRY


def names() -> tuple[str, ...]:
    return tuple(_load())


def get(name: str) -> Strategy:
    """The strategy registered as ``name``; an unknown name is one line."""
    try:
        return _load()[name]
    except KeyError:
        raise UserError(f"unknown strategy {name!r}; choose from {', '.join(names())}") from None


def several_default() -> Strategy:
    """The strategy a job of several processes runs when its --strategy names a one-process one."""
    return next(s for s in _load().values() if s.default_for_several)


def one_device() -> Strategy:
    """The strategy of one process on one device (lr-find's, bench's baseline)."""
    return next(s for s in _load().values() if s.one_device)
