"""``--strategy ddp``: one process per device (or N gloo processes on a CPU), started by
``torch.distributed.run`` (``cluster.launch``) and joined up by Accelerate, which wraps the model in
``DistributedDataParallel``. Every process holds the whole model, so the defaults take and restore
its state: the main process copies it, each process saves and loads its own part of a checkpoint."""

from visiontune.cluster.strategies.base import Strategy, register


@register
class DDP(Strategy):
    name = "ddp"
    description = "distributed data parallel: one process per device"
    several_processes = True
    default_for_several = True
