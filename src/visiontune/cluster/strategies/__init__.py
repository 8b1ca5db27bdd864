"""Strategies: how one run is spread over devices and processes, each an object behind one protocol.

``base`` holds the protocol (``Strategy``) and the registry; every other module of this package is one
strategy that registers itself under its ``--strategy`` name (``single``, ``dp``, ``ddp``). The rest of
visiontune asks the object (``get(cfg.strategy)``, or ``cluster.strategy.effective`` inside a launcher)
what it needs: its Accelerator arguments, ``prepare``, whether it runs several processes, and how a
full state dict and a checkpoint are taken and restored. Modules here import torch only when used:
the launching process asks ``several_processes`` without paying for it.
"""

from visiontune.cluster.strategies.base import Strategy, get, names, one_device, register, several_default

__all__ = ["Strategy", "get", "names", "one_device", "register", "several_default"]
