"""``visiontune export``: a run's best model as ONNX or a ``torch.export`` archive, checked before it is written.

Both formats go through ``torch.export`` (the exporter torch 2.14 supports;
``torch.jit.trace`` is deprecated there): ONNX with
``torch.onnx.export(dynamo=True)`` (onnxscript), and ``.pt2`` -- the successor
of TorchScript -- with ``torch.export.save``; load it with
``torch.export.load(path).module()``. The graph takes what ``DeviceNormalize``
produces -- a float32 batch ``[N, 3, S, S]`` of normalised images, any N -- and
returns the logits. The run's description (model, classes, size, mean/std) is
stored in the file: ONNX ``metadata_props`` and the ``.pt2`` extra file
``visiontune.json``, each under the key ``visiontune``. Before the file is
written, it is run (onnxruntime, or the loaded ``.pt2``) on a batch of a size it
was not exported with, and its outputs must match the eager model's within
``TOLERANCE``; so a file on disk is one that works.
"""

from __future__ import annotations

import io
import warnings

import torch
from torch import nn

from visiontune import files
from visiontune.errors import UserError
from visiontune.runs.runinfo import KEY, RunInfo

FORMATS = ("onnx", "pt2")
SUFFIX = {"onnx": ".onnx", "pt2": ".pt2"}
TOLERANCE = 1e-4


def _exported(model: nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=1)
    return torch.export.export(model, (example,), dynamic_shapes=({0: batch},))


def _onnx_bytes(model: nn.Module, example: torch.Tensor, info: RunInfo) -> bytes:
    import onnx

    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(
        model,
        (example,),
        dynamo=True,
        verbose=False,
        input_names=["images"],
        output_names=["logits"],
        dynamic_shapes=({0: batch},),
    )
    proto = program.model_proto
    for key, value in info.metadata().items():
        proto.metadata_props.add(key=key, value=value)
    return onnx.ModelProto.SerializeToString(proto)


def _onnx_run(data: bytes, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])


def _pt2_bytes(model: nn.Module, example: torch.Tensor, info: RunInfo) -> bytes:
    buf = io.BytesIO()
    torch.export.save(_exported(model, example), buf, extra_files={f"{KEY}.json": info.metadata()[KEY]})
    return buf.getvalue()


def _pt2_run(data: bytes, x: torch.Tensor) -> torch.Tensor:
    return torch.export.load(io.BytesIO(data)).module()(x)


def require_onnx() -> None:
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401  (the dynamo exporter's graph builder)
    except ImportError:
        raise UserError("ONNX export needs the onnx extra: pip install 'visiontune[onnx]'") from None


def check_format(fmt: str) -> None:
    if fmt == "torchscript":
        raise UserError(
            "TorchScript is deprecated in torch 2.14 (torch.jit); use --format pt2 "
            "(torch.export; load with torch.export.load(PATH).module()) or --format onnx"
        )
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "onnx":
        require_onnx()


def export(model: nn.Module, info: RunInfo, fmt: str, out: str) -> float:
    """Write ``model`` to ``out`` in ``fmt``; return the largest |exported - eager| seen in the check."""
    check_format(fmt)
    model = model.float().eval().cpu()
    size = info.image_size
    gen = torch.Generator().manual_seed(0)
    example = torch.randn(2, 3, size, size, generator=gen)
    check = torch.randn(3, 3, size, size, generator=gen)  # another batch size: it must be dynamic
    build, run = (_onnx_bytes, _onnx_run) if fmt == "onnx" else (_pt2_bytes, _pt2_run)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' notes are not the user's to fix
        data = build(model, example, info)
        diff = (run(data, check) - model(check)).abs().max().item()
    if not diff <= TOLERANCE:
        raise RuntimeError(
            f"the exported {fmt} model differs from the eager one by {diff:.2e} (> {TOLERANCE}); nothing written"
        )
    files.atomic_write(out, data)
    return diff


def described(out: str, info: RunInfo, diff: float) -> str:
    """The line ``visiontune export`` ends with: what the file takes and gives, and how it was checked."""
    s = info.image_size
    return (
        f"visiontune: wrote {out}: input float32 [N, 3, {s}, {s}] RGB scaled to [0, 1] then normalised "
        f"with mean {info.mean} std {info.std}; output [N, {len(info.classes)}] logits for "
        f"{', '.join(info.classes)}; checked against the eager model, max difference {diff:.1e}; "
        f"the file carries this description under the metadata key 'visiontune'"
    )
