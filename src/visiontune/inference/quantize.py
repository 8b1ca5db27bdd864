"""``visiontune export --format onnx --int8``: an int8 ONNX model for CPU serving, and proof of what it costs.

The fp32 file of ``export`` (checked against the eager model) is quantized by ONNX Runtime's static
quantization (``quantize_static``: QDQ, int8 weights per channel, uint8 activations), its activation
ranges calibrated on images of the run's own training split (``--calibration-images``, a seeded choice;
the count used is recorded). Then both files score the run's validation split, fed by training's own
decode, resize and normalisation; when the int8 accuracy is more than ``--max-accuracy-drop`` points
below the fp32 one, nothing is written and the line says by how much. The file carries the run's
description under ``visiontune`` as every export does, and the record -- calibration count, validation
images, both accuracies, the drop and the limit -- as JSON under ``visiontune_int8``. A multi-label
model (its graph ends in the sigmoid) is scored by its label accuracy: the share of its per-class
decisions, at the thresholds it carries, that are right. ``checked`` is the one place the drop is
measured and refused; the OpenVINO export (``openvino_ir``) goes through it too.
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from visiontune import files
from visiontune.data.sources import discover
from visiontune.errors import UserError
from visiontune.inference.evaluate import recorded_data, select
from visiontune.inference.export import export
from visiontune.inference.loaded import LoadedModel
from visiontune.loading.pipeline import DeviceNormalize, ImageDataset, make_loader

KEY = "visiontune_int8"
CALIBRATION_IMAGES = 128
BATCH = 32


def batches(loaded: LoadedModel, run_dir: str, split: str, limit: int | None = None) -> Iterator[tuple]:
    """(normalised float32 NCHW array, labels array) over ``split`` of the run's own data (``limit``: a
    seeded choice of that many), unreadable files left out."""
    data, columns = recorded_data(run_dir)
    chosen, _ = select(discover(data, *columns, task=loaded.info.task), run_dir, split)
    if limit is not None and limit < len(chosen.paths):
        chosen = chosen.take(np.sort(np.random.default_rng(0).choice(len(chosen.paths), limit, replace=False)))
    info = loaded.info
    dataset = ImageDataset(
        chosen.paths,
        chosen.label_array,
        info.image_size,
        report=False,
        interpolation=info.interpolation,
        crop_pct=info.crop_pct,
        reader=chosen.reader,
        decode=info.decode,
        task=info.task,
    )
    normalize = DeviceNormalize(torch.device("cpu"), False, info.mean, info.std)
    for x, y in make_loader(dataset, BATCH, train=False, seed=0, num_workers=0, pin_memory=False):
        keep = info.task.readable(y)
        if keep.any():
            yield normalize(x[keep]).numpy(), y[keep].numpy()


class _Calibration:
    """onnxruntime's CalibrationDataReader: one batch of training images at a time."""

    def __init__(self, source: Iterator[tuple]):
        self.source, self.count = source, 0

    def get_next(self):
        x, _ = next(self.source, (None, None))
        if x is None:
            return None
        self.count += len(x)
        return {"images": x}


def _quantize(fp32: str, int8: str, calibration: _Calibration) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    quantize_static(
        fp32,
        int8,
        calibration,
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )


def session_forward(path: str):
    """A forward pass of the ONNX file at ``path`` on ONNX Runtime's CPU provider (its first output)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_outputs()[0].name
    return lambda x: session.run([name], {"images": x})[0]


def accuracies(loaded: LoadedModel, forwards: list, source: Iterator[tuple]) -> tuple[list[float], int]:
    """The accuracy of each forward pass over ``source`` (a multi-label model's: the share of its
    per-class decisions at its thresholds that are right), and the number of images."""
    task, thresholds = loaded.info.task, loaded.info.decision_thresholds
    right, decisions, n = [0] * len(forwards), 0, 0
    for x, y in source:
        n += len(y)
        for i, forward in enumerate(forwards):
            hit, decisions_here = task.right(forward(x), y, thresholds)
            right[i] += hit
        decisions += decisions_here
    if not n:
        raise UserError("the run's validation split has no readable image to check the exported model on")
    return [r / decisions for r in right], n


def checked(loaded: LoadedModel, run_dir: str, fp32, candidate, name: str, max_drop: float, advice: str) -> dict:
    """The record of ``candidate`` (a forward pass) scored beside the fp32 file's on the run's validation
    split; UserError, so nothing is written, when it loses more than ``max_drop`` points."""
    (fp32_acc, acc), n = accuracies(loaded, [fp32, candidate], batches(loaded, run_dir, "val"))
    record = {
        "metric": loaded.info.task.accuracy_name,
        "val_images": n,
        "val_accuracy_fp32": fp32_acc,
        f"val_accuracy_{name}": acc,
        "accuracy_drop_points": round((fp32_acc - acc) * 100, 6),
        "max_accuracy_drop_points": max_drop,
    }
    if record["accuracy_drop_points"] > max_drop:
        raise UserError(
            f"the {name} model's validation {record['metric'].replace('_', ' ')} is {acc:.4f} against fp32's "
            f"{fp32_acc:.4f} on {n} images: {record['accuracy_drop_points']:.2f} points lost, more than "
            f"--max-accuracy-drop {max_drop:g}; nothing written ({advice})"
        )
    return record


def change(record: dict) -> str:
    """The accuracy an exported file lost beside fp32, in words: a negative drop is a gain, and says so."""
    drop, most = record["accuracy_drop_points"], record["max_accuracy_drop_points"]
    if round(drop, 2) > 0:
        return f"{drop:.2f} points lost, at most {most:g}"
    if round(drop, 2) < 0:
        return f"{-drop:.2f} points gained; at most {most:g} may be lost"
    return f"no point lost, at most {most:g}"


def check_options(max_drop: float, calibration: int) -> None:
    if not max_drop >= 0:
        raise UserError(f"--max-accuracy-drop must be 0 or more points, got {max_drop}")
    if calibration < 1:
        raise UserError(f"--calibration-images must be at least 1, got {calibration}")


def quantized(loaded: LoadedModel, run_dir: str, fp32: str, int8: str, calibration: int) -> int:
    """Write the int8 file ``int8`` of the fp32 file ``fp32``, calibrated on the run's training split;
    the number of images it was calibrated on."""
    reader = _Calibration(batches(loaded, run_dir, "train", calibration))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # its advice to pre-process, on the root logger: not the user's
        try:
            _quantize(fp32, int8, reader)
        finally:
            logging.disable(logging.NOTSET)
    if not reader.count:
        raise UserError("the run's training split has no readable image to calibrate the int8 model on")
    return reader.count


def export_int8(
    loaded: LoadedModel, run_dir: str, out: str, max_drop: float = 1.0, calibration: int = CALIBRATION_IMAGES
) -> dict:
    """Write the int8 ONNX file ``out`` when its val accuracy is within ``max_drop`` points; its record."""
    import onnx

    check_options(max_drop, calibration)
    with tempfile.TemporaryDirectory(prefix="visiontune-int8-") as tmp:
        fp32, int8 = f"{tmp}/fp32.onnx", f"{tmp}/int8.onnx"
        export(loaded.model, loaded.info, "onnx", fp32)
        count = quantized(loaded, run_dir, fp32, int8, calibration)
        advice = "calibrate on more images with --calibration-images, or export fp32"
        record = {
            "calibration_images": count,
            "calibration_split": "train",
            **checked(loaded, run_dir, session_forward(fp32), session_forward(int8), "int8", max_drop, advice),
        }
        model = onnx.load(int8)
        model.metadata_props.add(key=KEY, value=json.dumps(record))
        files.atomic_write(out, model.SerializeToString())
    return record


def described(out: str, record: dict) -> str:
    return (
        f"visiontune: wrote {out}: int8 ONNX (static, calibrated on {record['calibration_images']} training "
        f"images); validation {record['metric'].replace('_', ' ')} {record['val_accuracy_int8']:.4f} against fp32's "
        f"{record['val_accuracy_fp32']:.4f} on {record['val_images']} images "
        f"({change(record)}); the record is in the metadata key '{KEY}'"
    )


def record_of(path: str | Path) -> dict:
    """The int8 record of a file ``export_int8`` wrote."""
    import onnx

    return json.loads({p.key: p.value for p in onnx.load(str(path)).metadata_props}[KEY])
