"""``visiontune export --format openvino [--int8]``: OpenVINO IR (``.xml`` and its ``.bin``) for CPU serving.

The IR is converted by ``openvino.convert_model`` from the fp32 ONNX file of ``export`` (itself checked
against the eager model), so both formats are one graph: the same input (a normalised float32
``[N, 3, S, S]`` batch, any N), the same output (logits; a multi-label model's sigmoid probabilities).
``--int8`` converts instead the int8 ONNX file of ``quantize`` -- ONNX Runtime's static quantization
calibrated on the run's training split --, whose quantize/dequantize pairs OpenVINO's CPU plugin runs as
int8; one calibration serves both runtimes, so NNCF is not needed. The weights are saved as they are
(``compress_to_fp16=False``). Before anything is written the IR, compiled for the CPU in f32, scores the
run's validation split beside the fp32 ONNX file through ``quantize.checked`` -- the one place the drop
is measured and refused above ``--max-accuracy-drop``. The IR carries the run's description in its
``rt_info`` under ``visiontune`` (as the ONNX file does in its metadata), what the output is under
``visiontune_output``, and the check's record as JSON under ``visiontune_check``. OpenVINO is imported
through ``formats.import_openvino``, which keeps its usage statistics from being sent.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from visiontune import files
from visiontune.errors import UserError
from visiontune.inference import formats, quantize
from visiontune.inference.export import OUTPUT_KEY, export, require_onnx
from visiontune.inference.loaded import LoadedModel

KEY = "visiontune_check"


def require_openvino():
    return formats.import_openvino()


def _compiled_forward(model):
    config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": "f32"}
    compiled = formats.openvino_core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    return lambda x: request.infer({"images": x})[compiled.output(0)].copy()


def export_openvino(
    loaded: LoadedModel,
    run_dir: str,
    out: str,
    int8: bool = False,
    max_drop: float = 1.0,
    calibration: int = quantize.CALIBRATION_IMAGES,
) -> dict:
    """Write ``out`` (``.xml``) and its ``.bin`` when the IR's val accuracy is within ``max_drop`` points of
    the fp32 model's; return the check's record."""
    quantize.check_options(max_drop, calibration)
    if Path(out).suffix != ".xml":
        raise UserError(f"--out must name the IR's .xml file (its weights go beside it as .bin), got {out}")
    ov = require_openvino()
    require_onnx()  # the IR is converted from the checked ONNX file
    name = "openvino_int8" if int8 else "openvino"
    with tempfile.TemporaryDirectory(prefix="visiontune-openvino-") as tmp:
        fp32 = source = f"{tmp}/fp32.onnx"
        export(loaded.model, loaded.info, "onnx", fp32)
        record: dict = {"format": "openvino", "precision": "int8" if int8 else "fp32"}
        if int8:
            source = f"{tmp}/int8.onnx"
            record["calibration_images"] = quantize.quantized(loaded, run_dir, fp32, source, calibration)
            record["calibration_split"] = "train"
        model = ov.convert_model(source)
        advice = "calibrate on more images with --calibration-images, or export fp32" if int8 else "export ONNX"
        candidate = _compiled_forward(model)
        record.update(
            quantize.checked(loaded, run_dir, quantize.session_forward(fp32), candidate, name, max_drop, advice)
        )
        output = "probabilities" if loaded.info.task.exports_probabilities(False) else "logits"
        for key, value in {**loaded.info.metadata(), OUTPUT_KEY: output, KEY: json.dumps(record)}.items():
            model.set_rt_info(value, [key])
        ov.save_model(model, f"{tmp}/model.xml", compress_to_fp16=False)
        # The weights first: an .xml on disk always has its .bin beside it.
        files.atomic_write(Path(out).with_suffix(".bin"), Path(f"{tmp}/model.bin").read_bytes())
        files.atomic_write(out, Path(f"{tmp}/model.xml").read_bytes())
    return record


def described(out: str, record: dict) -> str:
    name = f"val_accuracy_openvino{'_int8' if record['precision'] == 'int8' else ''}"
    how = (
        f"int8 (ONNX Runtime's static quantization, calibrated on {record['calibration_images']} training images)"
        if record["precision"] == "int8"
        else "fp32"
    )
    metric = record["metric"].replace("_", " ")
    return (
        f"visiontune: wrote {out} and {Path(out).with_suffix('.bin').name}: OpenVINO IR, {how}; validation {metric} "
        f"{record[name]:.4f} against the fp32 ONNX model's {record['val_accuracy_fp32']:.4f} on {record['val_images']} "
        f"images ({quantize.change(record)}); "
        f"the run's description is in its rt_info under 'visiontune', the record under '{KEY}'"
    )


def record_of(path: str | Path) -> dict:
    """The check's record of an IR ``export_openvino`` wrote."""
    return json.loads(formats.openvino_core().read_model(str(path)).get_rt_info([KEY]).astype(str))
