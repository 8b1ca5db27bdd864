"""A model held for serving: loaded once, fed encoded images, answering class probabilities.

The preprocessing is ``predict``'s own, piece by piece: ``decode.try_read``
decodes the upload's bytes and brings them to the run's size with its
interpolation and crop (the code ``ImageDataset`` runs on a file's bytes),
``collate_channels_last`` stacks the batch and ``DeviceNormalize`` normalises it
with the run's mean and std, then the model's logits go through ``softmax`` (a
multi-label model's through one ``sigmoid`` per class) as ``predict``'s do. So
on the CPU a batch of the same images gives ``visiontune predict``'s numbers bit
for bit. The forward pass is torch eager,
``torch.compile`` of it, or for a file made by ``visiontune export`` (``.onnx``
on ONNX Runtime, OpenVINO's ``.xml``) its runtime, opened through
``formats``: the file takes the same normalised batch and carries the run's
description.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from visiontune.data.decode import try_read
from visiontune.errors import UserError
from visiontune.inference import formats
from visiontune.inference.loaded import load_model
from visiontune.loading.pipeline import DeviceNormalize, collate_channels_last
from visiontune.runs import runinfo
from visiontune.runs.runinfo import RunInfo

BACKENDS = ("eager", "compile", "onnx", "openvino")


@dataclass
class Runtime:
    info: RunInfo  # what the model is and how it must be fed
    run: str | None  # the run folder it came from, when known
    weights: str  # the model file
    backend: str  # one of BACKENDS
    device: torch.device
    forward: Callable[[torch.Tensor], torch.Tensor]  # normalised float batch -> logits
    # An exported multi-label file ends in its sigmoid, one exported with --probabilities in its softmax
    # (export.py): its outputs are probabilities already.
    gives_probabilities: bool = False

    def __post_init__(self):
        self.normalize = DeviceNormalize(self.device, False, self.info.mean, self.info.std)

    def prepare(self, data: bytes) -> torch.Tensor | str:
        """An upload as a uint8 [3, S, S] image, or why it cannot be read."""
        return try_read(data, self.info.image_size, self.info.interpolation, self.info.crop_pct, self.info.decode)

    def probabilities(self, images: list[torch.Tensor]) -> torch.Tensor:
        """[N, classes] probabilities of prepared images, on the CPU: float32 softmax, or for a multi-label
        model one float64 sigmoid per class (predict's: a probability meets its threshold as it does there)."""
        batch, _ = collate_channels_last([(image, 0) for image in images])
        with torch.inference_mode():
            out = self.forward(self.normalize(batch.to(self.device))).cpu()
        return self.info.task.probabilities(out, self.gives_probabilities)

    def warm_up(self, sizes: tuple[int, ...] = (1,)) -> None:
        """One forward pass per batch size: allocations made, kernels chosen, ``torch.compile`` done."""
        s = self.info.image_size
        for n in sizes:
            self.probabilities([torch.zeros(3, s, s, dtype=torch.uint8)] * n)

    def describe(self) -> dict:
        return {**self.info.to_dict(), "run": self.run, "weights": self.weights, "backend": self.backend}


def load_runtime(
    run: str | None = None,
    weights: str | None = None,
    *,
    compile: bool = False,
    threads: int = 1,
    model: str | None = None,
    classes: list[str] | None = None,
    image_size: int | None = None,
) -> Runtime:
    """A run's best model or a model file (an exported ``.onnx`` or ``.xml`` included), ready for ``warm_up``."""
    torch.set_num_threads(threads)
    if formats.is_exported(weights):
        if run:
            raise UserError("give --run RUN_DIR or --weights FILE, not both")
        if compile:
            raise UserError("--compile is for torch models; an exported .onnx or .xml file runs on its own runtime")
        exported = formats.open_exported(weights, threads)
        info = exported.info
        runinfo.reconcile(
            info, weights, model=model, classes=tuple(classes) if classes else None, image_size=image_size
        )

        def forward(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(exported.forward(x.cpu().numpy()))

        return Runtime(
            info, None, weights, exported.backend, torch.device("cpu"), forward, exported.gives_probabilities
        )
    loaded = load_model(run, weights, model=model, classes=classes, image_size=image_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net = loaded.model.to(device)
    forward = torch.compile(net) if compile else net
    path = runinfo.best_weights(run) if run else weights
    return Runtime(loaded.info, run, path, "compile" if compile else "eager", device, forward)
