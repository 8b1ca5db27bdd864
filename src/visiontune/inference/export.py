"""``visiontune export``: a run's best model as ONNX or a ``torch.export`` archive, checked before it is written.

Both formats go through ``torch.export`` (the exporter torch 2.14 supports;
``torch.jit.trace`` is deprecated there): ONNX with
``torch.onnx.export(dynamo=True)`` (onnxscript), and ``.pt2`` -- the successor
of TorchScript -- with ``torch.export.save``; load it with
``torch.export.load(path).module()``. The graph takes what ``DeviceNormalize``
produces -- a float32 batch ``[N, 3, S, S]`` of normalised images, any N -- and
returns the logits (a multi-label model: the per-class sigmoid probabilities; ``--probabilities``: the
softmax, output named ``probabilities``, recorded under the metadata key ``OUTPUT_KEY`` so that ``serve``
does not apply it twice). The run's description
(model, classes, size, mean/std) is
stored in the file: ONNX ``metadata_props`` and the ``.pt2`` extra file
``visiontune.json``, each under the key ``visiontune``. Before the file is
written, it is run (onnxruntime, or the loaded ``.pt2``) on a batch of a size it
was not exported with, and its outputs must match the eager model's within
``TOLERANCE``; so a file on disk is one that works.

``--with-preprocessing`` (ONNX) puts the decode-to-logits steps after decoding into the graph: it takes
a uint8 ``[N, H, W, 3]`` RGB batch of any N, H and W, resizes it exactly as ``predict`` does (the uint8
antialiased bilinear resize of ``decode.resize_uint8``, its fixed-point arithmetic included, so the
pixels are bit-identical), normalises it and returns the logits.
"""

from __future__ import annotations

import io
import warnings

import torch
from torch import nn

from visiontune import files
from visiontune.errors import UserError
from visiontune.inference import EXPORT_FORMATS
from visiontune.runs.runinfo import KEY, RunInfo

FORMATS = ("onnx", "pt2")
# What the graph's output is, beside the run's description: "logits" or "probabilities" (softmax or, for a
# multi-label model, the sigmoid). Files from before it was written: probabilities exactly when multi-label.
OUTPUT_KEY = "visiontune_output"
SUFFIX = {"onnx": ".onnx", "pt2": ".pt2"}
TOLERANCE = 1e-4


def _aa_weights(n_in, n_out: int) -> torch.Tensor:
    """The antialiased bilinear weights [n_out, n_in] (float64) of torch's resize, as a dense matrix."""
    scale = n_in / n_out
    support = torch.clamp(torch.tensor(scale, dtype=torch.float64), min=1.0)  # the filter widens to downscale
    center = scale * (torch.arange(n_out, dtype=torch.float64) + 0.5)
    first = torch.clamp((center - support + 0.5).trunc(), min=0)
    end = torch.clamp((center + support + 0.5).trunc(), max=n_in)
    j = torch.arange(n_in, dtype=torch.float64)[None]
    w = torch.clamp(1 - ((j - center[:, None] + 0.5) / support).abs(), min=0)
    w = torch.where((j >= first[:, None]) & (j < end[:, None]), w, torch.zeros_like(w))
    return w / w.sum(1, keepdim=True)


def _uint8_pass(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One axis of torch's uint8 resize: weights in int16 fixed point (the most bits that keep the largest
    below 2**15, at most 22), the sum rounded and clipped to [0, 255]; float64 holds every value exactly."""
    bits = (0.5 + w.max() * torch.pow(2.0, torch.arange(1, 23, dtype=torch.float64))).floor() < 2**15
    one = torch.pow(2.0, bits.sum().to(torch.float64))
    fixed = (w * one + 0.5).floor()
    return ((x @ fixed.T + one / 2) / one).floor().clamp(0, 255)


class WithPreprocessing(nn.Module):
    """uint8 ``[N, H, W, 3]`` RGB -> ``predict``'s resize (bilinear, whole image) and normalisation -> logits."""

    def __init__(self, model: nn.Module, info: RunInfo):
        super().__init__()
        self.model, self.size = model, info.image_size
        self.register_buffer("mean", torch.tensor(info.mean, dtype=torch.float32).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(info.std, dtype=torch.float32).view(1, 3, 1, 1) * 255)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).to(torch.float64)
        x = _uint8_pass(x, _aa_weights(x.shape[3], self.size))  # across, then down, as torch's kernel does
        x = _uint8_pass(x.transpose(2, 3), _aa_weights(x.shape[2], self.size)).transpose(2, 3)
        return self.model((x.float() - self.mean) / self.std)


def check_preprocessing(info: RunInfo, fmt: str) -> None:
    if fmt != "onnx":
        raise UserError(f"--with-preprocessing is for --format onnx, not {fmt}")
    if info.interpolation != "bilinear" or info.crop_pct is not None:
        raise UserError(
            f"--with-preprocessing reproduces a bilinear resize of the whole image; this run resizes "
            f"{info.interpolation}{f' with a centre crop ({info.crop_pct})' if info.crop_pct else ''}: "
            "export without it and resize before the graph"
        )


class WithActivation(nn.Sequential):
    """A model followed by its task's activation (a softmax, a sigmoid, a regression's units)."""


def _output(model: nn.Module) -> str:
    """What the exported graph gives: a model that ends in its task's activation gives "probabilities" (what
    ``Task.logits_of`` turns back into logits; a regression's values)."""
    return "probabilities" if isinstance(model, WithActivation) else "logits"


def _metadata(model: nn.Module, info: RunInfo) -> dict[str, str]:
    return {**info.metadata(), OUTPUT_KEY: _output(model)}


def _onnx_preprocessing_bytes(model: nn.Module, example: torch.Tensor, info: RunInfo) -> bytes:
    import onnx

    dims = {i: torch.export.Dim(name, min=m) for i, (name, m) in enumerate((("batch", 1), ("height", 2), ("width", 2)))}
    program = torch.onnx.export(
        WithPreprocessing(model, info).eval(),
        (example,),
        dynamo=True,
        verbose=False,
        input_names=["images"],
        output_names=[_output_name(model, info)],
        dynamic_shapes=(dims,),
    )
    proto = program.model_proto
    for key, value in _metadata(model, info).items():
        proto.metadata_props.add(key=key, value=value)
    return onnx.ModelProto.SerializeToString(proto)


def _output_name(model: nn.Module, info: RunInfo) -> str:
    return info.task.output_name(_output(model) == "probabilities")


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
        output_names=[_output_name(model, info)],
        dynamic_shapes=({0: batch},),
    )
    proto = program.model_proto
    for key, value in _metadata(model, info).items():
        proto.metadata_props.add(key=key, value=value)
    return onnx.ModelProto.SerializeToString(proto)


def _onnx_run(data: bytes, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"images": x.numpy()})[0])


def _pt2_bytes(model: nn.Module, example: torch.Tensor, info: RunInfo) -> bytes:
    buf = io.BytesIO()
    extra = {f"{KEY}.json": info.metadata()[KEY], f"{OUTPUT_KEY}.txt": _output(model)}
    torch.export.save(_exported(model, example), buf, extra_files=extra)
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
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"--format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
    if fmt not in FORMATS:  # the others are written by their own modules (openvino_ir, hub)
        raise ValueError(f"{fmt} is not written by export.export")
    if fmt == "onnx":
        require_onnx()


def export(
    model: nn.Module, info: RunInfo, fmt: str, out: str, preprocessing: bool = False, probabilities: bool = False
) -> float:
    """Write ``model`` to ``out`` in ``fmt``; return the largest |exported - eager| seen in the check.
    ``probabilities``: a single-label model's softmax is in the graph (a multi-label one's sigmoid always is)."""
    check_format(fmt)
    model = model.float().eval().cpu()
    if info.task.exports_probabilities(probabilities):
        model = WithActivation(model, info.task.activation()).eval()
    size = info.image_size
    gen = torch.Generator().manual_seed(0)
    example = torch.randn(2, 3, size, size, generator=gen)
    check = torch.randn(3, 3, size, size, generator=gen)  # another batch size: it must be dynamic
    build, run = (_onnx_bytes, _onnx_run) if fmt == "onnx" else (_pt2_bytes, _pt2_run)
    eager = model
    if preprocessing:  # images of other sizes and another batch size than the example: all dynamic
        check_preprocessing(info, fmt)
        eager, build = WithPreprocessing(model, info).eval(), _onnx_preprocessing_bytes
        example = torch.randint(0, 256, (2, size + 9, size + 17, 3), dtype=torch.uint8, generator=gen)
        check = torch.randint(0, 256, (3, 2 * size + 5, size + 3, 3), dtype=torch.uint8, generator=gen)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' notes are not the user's to fix
        data = build(model, example, info)
        diff = (run(data, check) - eager(check)).abs().max().item()
    if not diff <= TOLERANCE:
        raise RuntimeError(
            f"the exported {fmt} model differs from the eager one by {diff:.2e} (> {TOLERANCE}); nothing written"
        )
    files.atomic_write(out, data)
    return diff


def described(out: str, info: RunInfo, diff: float, preprocessing: bool = False, probabilities: bool = False) -> str:
    """The line ``visiontune export`` ends with: what the file takes and gives, and how it was checked."""
    s = info.image_size
    given = (
        f"input uint8 [N, H, W, 3] RGB images of any size (one image: add the leading axis), resized to "
        f"{s} x {s} and normalised inside the graph as predict does"
        if preprocessing
        else f"input float32 [N, 3, {s}, {s}] RGB scaled to [0, 1] then normalised with mean {info.mean} std {info.std}"
    )
    gives = info.task.output_text(probabilities)
    return (
        f"visiontune: wrote {out}: {given}; output [N, {len(info.classes)}] {gives} for "
        f"{', '.join(info.classes)}; checked against the eager model, max difference {diff:.1e}; "
        f"the file carries this description under the metadata key 'visiontune'"
    )
