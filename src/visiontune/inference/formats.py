"""The one seam through which ``predict``, ``evaluate``, the Python API and ``serve`` open an exported file.

An exported model file is recognised by its suffix: ``.onnx`` (fp32 or int8, run by ONNX Runtime) and
``.xml`` (OpenVINO IR beside its ``.bin``, run by OpenVINO's CPU plugin). Each opener reads the run's
description that ``export`` stored in the file (ONNX ``metadata_props``, the IR's ``rt_info``, both under
``visiontune``) and returns an ``Exported``: that description, a forward pass (normalised float32 NCHW
batch -> the graph's output) and whether that output is probabilities already (a multi-label file ends
in its sigmoid; ``--probabilities``, in its softmax). A file that cannot be opened, or that was not
written by visiontune, is one line; so is one whose output is not one finite row per image of as many
numbers as its description has classes (checked on one plain image when it is opened, and on every batch).
``as_module`` turns an ``Exported`` into the ``nn.Module`` that
``loaded.forward`` runs, so the commands need no branch of their own.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from visiontune.errors import UserError
from visiontune.inference.export import OUTPUT_KEY
from visiontune.runs.runinfo import KEY, RunInfo


@dataclass(frozen=True)
class Exported:
    info: RunInfo
    forward: Callable[[np.ndarray], np.ndarray]  # float32 [N, 3, S, S] normalised -> [N, classes]
    gives_probabilities: bool
    backend: str  # "onnx" or "openvino"


def _described(path: str, meta: dict[str, str], what: str) -> tuple[RunInfo, bool]:
    if KEY not in meta:
        raise UserError(f"{path} does not describe itself: use {what} written by `visiontune export`")
    info = RunInfo.from_dict(_json(meta[KEY], path), path)
    output = meta.get(OUTPUT_KEY, "probabilities" if info.task.exports_probabilities(False) else "logits")
    if output not in ("logits", "probabilities"):
        raise UserError(
            f"{path}: damaged model description: {OUTPUT_KEY} is {output[:60]!r}, expected logits or probabilities"
        )
    return info, output == "probabilities"


def _json(text: str, path: str):
    try:
        return json.loads(text)
    except ValueError:
        raise UserError(f"{path}: damaged model description under '{KEY}' (not JSON)") from None


def _onnx(path: str, threads: int) -> Exported:
    try:
        import onnxruntime
    except ImportError:
        raise UserError("an .onnx file needs the onnx extra: pip install 'visiontune[onnx]'") from None
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
    meta = dict(session.get_modelmeta().custom_metadata_map)
    info, probabilities = _described(path, meta, "an .onnx file")
    if session.get_inputs()[0].type != "tensor(float)":  # --with-preprocessing: uint8 images of any size
        raise UserError(
            f"{path} takes uint8 images (exported --with-preprocessing): predict, evaluate and serve feed "
            "normalised float batches; export without --with-preprocessing"
        )
    name = session.get_outputs()[0].name
    return Exported(info, lambda x: session.run([name], {"images": x})[0], probabilities, "onnx")


def import_openvino():
    """``openvino``, imported without its usage statistics: ``import openvino`` otherwise sends an event to
    Google Analytics from a subprocess (openvino-telemetry, unless the user opted out). OpenVINO falls back
    to its own stub when that package cannot be imported, so it is hidden before the first import."""
    if "openvino" not in sys.modules:
        sys.modules.setdefault("openvino_telemetry", None)  # None in sys.modules: the import raises ImportError
    try:
        import openvino
    except ImportError:
        raise UserError("OpenVINO IR needs the openvino extra: pip install 'visiontune[openvino]'") from None
    return openvino


_CORE: list = []


def openvino_core():
    """The process's one ``openvino.Core``, kept until the process ends.

    OpenVINO's CPU plugin gives the calling thread an alternate signal stack of its own while a Core
    lives and, when the Core goes, puts back the stack it found. Two Cores that do not end in reverse
    order leave the thread on a stack already freed, and the next signal handled on that thread (a
    child's SIGCHLD, a SIGTERM) kills the process with SIGSEGV. One Core that never goes cannot.
    """
    if not _CORE:
        _CORE.append(import_openvino().Core())
    return _CORE[0]


def _openvino(path: str, threads: int) -> Exported:
    core = openvino_core()
    try:
        model = core.read_model(path)
    except Exception as exc:  # OpenVINO raises RuntimeError for a missing, damaged or foreign file
        raise UserError(f"cannot load {path} with OpenVINO: {_first_line(exc)}") from None
    meta = {key: model.get_rt_info([key]).astype(str) for key in (KEY, OUTPUT_KEY) if model.has_rt_info([key])}
    info, probabilities = _described(path, meta, "an OpenVINO .xml file")
    # f32 inference: the CPU plugin would otherwise pick bf16 on CPUs that have it, and differ from the check.
    config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
    try:
        compiled = core.compile_model(model, "CPU", config)
    except Exception as exc:
        raise UserError(f"cannot compile {path} for the CPU with OpenVINO: {_first_line(exc)}") from None
    request = compiled.create_infer_request()

    def forward(x: np.ndarray) -> np.ndarray:
        return request.infer({"images": x})[compiled.output(0)].copy()

    return Exported(info, forward, probabilities, "openvino")


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # OpenVINO's messages open with its source file's path; the reason is on the last line.
    return (lines[-1] if lines else type(exc).__name__)[:200]


OPENERS: dict[str, Callable[[str, int], Exported]] = {".onnx": _onnx, ".xml": _openvino}


def is_exported(path: str | None) -> bool:
    return path is not None and Path(path).suffix.lower() in OPENERS


def open_exported(path: str, threads: int = 1) -> Exported:
    """The exported file at ``path``, opened for ``threads`` CPU threads, its output held to its description."""
    if not Path(path).is_file():
        raise UserError(f"not found: {path}")
    return _held_to_description(path, OPENERS[Path(path).suffix.lower()](path, threads))


def _held_to_description(path: str, exported: Exported) -> Exported:
    """``exported`` whose forward pass gives, for every batch, one row of finite numbers per image and per class
    its description names -- else one line naming the file. Checked now on one plain image, so a graph of another
    width (5 outputs for 2 classes) or with NaN weights is refused before any image is read; a batch that
    breaks the rule later (an output that overflows) stops predict and evaluate rather than writing NaN rows."""
    classes = len(exported.info.classes)
    redo = "export the model again with `visiontune export`"

    def forward(x: np.ndarray) -> np.ndarray:
        out = exported.forward(x)
        if not (isinstance(out, np.ndarray) and out.shape == (x.shape[0], classes)):
            raise UserError(
                f"{path} gives outputs of shape {tuple(np.shape(out))} for {x.shape[0]} image(s), but its "
                f"description names {classes} classes; {redo}"
            )
        if not np.isfinite(out).all():
            raise UserError(f"{path} gives non-finite outputs (NaN or infinity): its weights are damaged; {redo}")
        return out

    s = exported.info.image_size
    try:
        forward(np.ones((1, 3, s, s), np.float32))  # not zeros: a kernel may take 0 x NaN as 0
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001  (each runtime raises its own classes for a graph that cannot run)
        raise UserError(f"{path} cannot run on an image of its size {s}: {_first_line(exc)}; {redo}") from None
    return replace(exported, forward=forward)


class AsLogits(nn.Module):
    """An exported file as a module that gives logits, as the eager model does: probabilities from the file
    become logits again (the log for a softmax, the logit for a sigmoid), so predict and evaluate apply the
    softmax or sigmoid they always apply and get the file's probabilities back."""

    def __init__(self, exported: Exported):
        super().__init__()
        self.exported = exported

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(self.exported.forward(x.detach().float().cpu().numpy().copy())).to(x.device)
        if not self.exported.gives_probabilities:
            return out
        return self.exported.info.task.logits_of(out)
