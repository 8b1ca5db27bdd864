"""``visiontune export``: a run's best model as ONNX or TorchScript, checked before it is written.

The exported graph takes what ``DeviceNormalize`` produces -- a float32 batch
``[N, 3, S, S]`` of normalised images, any N -- and returns the logits. Before
the file is written, the exported model is run (onnxruntime for ONNX,
``torch.jit.load`` for TorchScript) on a batch of a size it was not traced
with, and its outputs must match the eager model's within ``TOLERANCE``; so a
file on disk is one that works. ONNX needs the optional extra
``visiontune[onnx]``.
"""
from __future__ import annotations

import io
import warnings

import torch
from torch import nn

from visiontune import outputs
from visiontune.config import UserError

FORMATS = ("onnx", "torchscript")
TOLERANCE = 1e-4


def _onnx_bytes(model: nn.Module, example: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    # The TorchScript-based exporter: the torch.export one needs onnxscript, which the extra does not pull in.
    torch.onnx.export(model, (example,), buf, dynamo=False, input_names=["images"], output_names=["logits"],
                      dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    return buf.getvalue()


def _onnx_run(data: bytes, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])


def _torchscript_bytes(model: nn.Module, example: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.jit.save(torch.jit.trace(model, example, check_trace=False), buf)
    return buf.getvalue()


def _torchscript_run(data: bytes, x: torch.Tensor) -> torch.Tensor:
    return torch.jit.load(io.BytesIO(data), map_location="cpu")(x)


def require_onnx() -> None:
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
    except ImportError:
        raise UserError("ONNX export needs the onnx extra: pip install 'visiontune[onnx]'") from None


def export(model: nn.Module, image_size: int, fmt: str, out: str) -> float:
    """Write ``model`` to ``out`` in ``fmt``; return the largest |exported - eager| seen in the check."""
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "onnx":
        require_onnx()
    model = model.float().eval().cpu()
    gen = torch.Generator().manual_seed(0)
    example = torch.randn(2, 3, image_size, image_size, generator=gen)
    check = torch.randn(3, 3, image_size, image_size, generator=gen)  # another batch size: it must be dynamic
    build, run = (_onnx_bytes, _onnx_run) if fmt == "onnx" else (_torchscript_bytes, _torchscript_run)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and tracer notes are not the user's to fix
        data = build(model, example)
        diff = (run(data, check) - model(check)).abs().max().item()
    if not diff <= TOLERANCE:
        raise RuntimeError(f"the exported {fmt} model differs from the eager one by {diff:.2e} "
                           f"(> {TOLERANCE}); nothing written")
    outputs.atomic_write(out, data)
    return diff
