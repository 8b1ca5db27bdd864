"""A model held for serving: loaded once, fed encoded images, answering class probabilities.

The preprocessing is ``predict``'s own, piece by piece: ``decode.try_read``
decodes the upload's bytes and brings them to the run's size with its
interpolation and crop (the code ``ImageDataset`` runs on a file's bytes),
``collate_channels_last`` stacks the batch and ``DeviceNormalize`` normalises it
with the run's mean and std, then the model's logits go through ``softmax`` (a
multi-label model's through one ``sigmoid`` per class) as ``predict``'s do. So
on the CPU a batch of the same images gives ``visiontune predict``'s numbers bit
for bit. The forward pass is torch eager,
``torch.compile`` of it, or ONNX Runtime for a file made by ``visiontune
export``, which takes the same normalised batch and carries the run's
description in its metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from visiontune.data.decode import try_read
from visiontune.errors import UserError
from visiontune.inference.export import OUTPUT_KEY
from visiontune.inference.loaded import load_model
from visiontune.loading.pipeline import DeviceNormalize, collate_channels_last
from visiontune.runs import runinfo
from visiontune.runs.runinfo import KEY, RunInfo

BACKENDS = ("eager", "compile", "onnx")


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
        if not self.info.multi_label:
            return out.float() if self.gives_probabilities else out.float().softmax(1)
        return out.double() if self.gives_probabilities else out.double().sigmoid()

    def thresholds(self) -> list[float]:
        """A multi-label model's per-class thresholds (tuned on its validation split), else 0.5 each."""
        return list(self.info.thresholds or [0.5] * len(self.info.classes))

    def warm_up(self, sizes: tuple[int, ...] = (1,)) -> None:
        """One forward pass per batch size: allocations made, kernels chosen, ``torch.compile`` done."""
        s = self.info.image_size
        for n in sizes:
            self.probabilities([torch.zeros(3, s, s, dtype=torch.uint8)] * n)

    def describe(self) -> dict:
        return {**self.info.to_dict(), "run": self.run, "weights": self.weights, "backend": self.backend}


def _onnx(path: str, threads: int) -> tuple[RunInfo, Callable, bool]:
    """The file's description, its forward pass, and whether it gives probabilities (else logits)."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError("serving an .onnx file needs the onnx extra: pip install 'visiontune[onnx]'") from None
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Idle intra-op threads sleep rather than spin: they would take the cores the decoding threads and the
    # event loop need between batches.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own classes for a missing or damaged file
        raise UserError(f"cannot load {path} with ONNX Runtime: {str(exc).splitlines()[0][:200]}") from None
    meta = session.get_modelmeta().custom_metadata_map
    if KEY not in meta:
        raise UserError(f"{path} does not describe itself: serve an .onnx file written by `visiontune export`")
    info = RunInfo.from_dict(json.loads(meta[KEY]), path)
    # export's --probabilities puts the softmax in the graph (a multi-label file always ends in its sigmoid).
    output = meta.get(OUTPUT_KEY, "probabilities" if info.multi_label else "logits")
    if output not in ("logits", "probabilities"):
        raise UserError(
            f"{path}: damaged model description: {OUTPUT_KEY} is {output[:60]!r}, expected logits or probabilities"
        )
    name = session.get_outputs()[0].name

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run([name], {"images": x.cpu().numpy()})[0])

    return info, forward, output == "probabilities"


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
    """A run's best model or a model file (``.onnx`` included), ready for ``warm_up``."""
    torch.set_num_threads(threads)
    if weights and Path(weights).suffix == ".onnx":
        if run:
            raise UserError("give --run RUN_DIR or --weights FILE, not both")
        if compile:
            raise UserError("--compile is for torch models; an .onnx file runs on ONNX Runtime")
        info, forward, gives_probabilities = _onnx(weights, threads)
        runinfo.reconcile(
            info, weights, model=model, classes=tuple(classes) if classes else None, image_size=image_size
        )
        return Runtime(info, None, weights, "onnx", torch.device("cpu"), forward, gives_probabilities)
    loaded = load_model(run, weights, model=model, classes=classes, image_size=image_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net = loaded.model.to(device)
    forward = torch.compile(net) if compile else net
    path = runinfo.best_weights(run) if run else weights
    return Runtime(loaded.info, run, path, "compile" if compile else "eager", device, forward)
