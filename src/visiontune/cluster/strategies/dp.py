"""``--strategy dp``: one process with the model wrapped in ``torch.nn.DataParallel`` over every visible GPU."""

from visiontune.cluster.strategies.base import Strategy, register


@register
class DP(Strategy):
    name = "dp"
    description = "nn.DataParallel over the visible GPUs in one process"

    def unavailable(self, gpus: int) -> str | None:
        return None if gpus >= 2 else f"DataParallel needs 2 or more GPUs; {gpus} visible"

    def devices_used(self, gpus: int, nproc: int) -> int:
        return gpus

    def devices(self, accelerator) -> list[str]:
        import torch

        if torch.cuda.device_count() > 1:
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return super().devices(accelerator)

    def wrap(self, accelerator, cfg, model, optimizer, loaders):
        import torch
        from torch import nn

        if torch.cuda.device_count() < 2:
            accelerator.print(
                f"visiontune: {torch.cuda.device_count()} GPU(s) visible: DataParallel gives no "
                "parallelism here; running its code path on one device"
            )
        # Prepare the inner model first so its forward carries the autocast of
        # mixed precision: DataParallel's replica threads would not inherit it.
        model = nn.DataParallel(accelerator.prepare_model(model))
        prepared = accelerator.prepare(optimizer, *loaders)  # one object alone comes back as itself
        optimizer, *loaders = prepared if loaders else (prepared,)
        return model, optimizer, loaders
