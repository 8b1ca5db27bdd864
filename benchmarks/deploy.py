"""CPU serving formats side by side: eager torch, fp32 ONNX, int8 ONNX, OpenVINO IR and OpenVINO int8.

For each model (torchvision resnet18 and timm's vit_tiny_patch16_224, from scratch, at 224 px) one short
training on the synthetic Kaggle-layout set (``VT_DEPLOY_PER_CLASS`` images per class, default 60; one
epoch), then ``visiontune export`` to each format. The accuracy of each format is the one its export
recorded on the run's validation split (``--max-accuracy-drop 100``: recorded, never refused; eager's is
the fp32 ONNX file's, which export checked against the eager logits within 1e-4). A model this briefly
trained is barely above chance, so the accuracies show agreement between formats, not a good model.

Then every format runs in the same process, on one thread (``VT_DEPLOY_THREADS``), opened as predict and
serve open it (``inference.formats``; the eager model as ``load_model`` gives it), the calls interleaved
round by round so that load on the shared machine falls on all of them alike: latency of one image
(``VT_DEPLOY_LATENCY`` calls; p50 and p99) and throughput of batches of 32 (``VT_DEPLOY_BATCHES`` calls;
images per second of the median call). Inputs are random normalised batches: the runtime's cost alone,
without decoding.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

from common import WORK, run, sample_data, write_result

PER_CLASS = int(os.environ.get("VT_DEPLOY_PER_CLASS", "60"))
THREADS = int(os.environ.get("VT_DEPLOY_THREADS", "1"))
LATENCY_CALLS = int(os.environ.get("VT_DEPLOY_LATENCY", "60"))
BATCH_CALLS = int(os.environ.get("VT_DEPLOY_BATCHES", "6"))
MODELS = ("resnet18", "timm/vit_tiny_patch16_224")
SIZE = 224
TRAIN = ["--weights", "none", "--image-size", str(SIZE), "--epochs", "1", "--batch-size", "16", "--lr", "0.001"]
TRAIN += ["--num-workers", "2", "--no-progress"]
# (format, export flags, file name, record key of its accuracy)
FORMATS = (
    ("onnx", ["--format", "onnx"], "best.onnx", None),
    ("onnx-int8", ["--format", "onnx", "--int8"], "best.int8.onnx", "val_accuracy_int8"),
    ("openvino", ["--format", "openvino"], "best.xml", "val_accuracy_openvino"),
    ("openvino-int8", ["--format", "openvino", "--int8"], "best.int8.xml", "val_accuracy_openvino_int8"),
)
CHECK = ["--max-accuracy-drop", "100", "--calibration-images", "64"]


def _visiontune(*argv: str) -> None:
    run([sys.executable, "-m", "visiontune", *argv])


def _prepare(model: str, data) -> tuple:
    run_dir = WORK / f"deploy-run-{model.replace('/', '_')}-{PER_CLASS}"
    if not (run_dir / "summary.json").exists():
        _visiontune("train", "--data", str(data), "--output-dir", str(run_dir), "--model", model, *TRAIN)
    accuracy = {}
    for name, flags, file, key in FORMATS:
        path = run_dir / file
        if not path.exists():
            extra = CHECK if ("--int8" in flags or "openvino" in flags) else []
            _visiontune("export", "--run", str(run_dir), *flags, *extra, "--out", str(path))
        if key:
            from visiontune.inference import openvino_ir, quantize

            record = (openvino_ir if path.suffix == ".xml" else quantize).record_of(path)
            accuracy[name] = record[key]
            accuracy["onnx"] = accuracy["eager"] = record["val_accuracy_fp32"]
            accuracy["val_images"] = record["val_images"]
    return run_dir, accuracy


def _forwards(run_dir) -> dict:
    from visiontune.inference import formats
    from visiontune.inference.loaded import load_model

    model = load_model(run=str(run_dir)).model

    def eager(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(x)).numpy()

    out = {"eager": eager}
    for name, _, file, _ in FORMATS:
        out[name] = formats.open_exported(str(run_dir / file), THREADS).forward
    return out


def _timings(forwards: dict, batch: int, calls: int) -> dict[str, list[float]]:
    x = np.random.default_rng(0).standard_normal((batch, 3, SIZE, SIZE)).astype(np.float32)
    for forward in forwards.values():  # warm up: allocations, kernels chosen
        forward(x)
    times: dict[str, list[float]] = {name: [] for name in forwards}
    for _ in range(calls):
        for name, forward in forwards.items():
            start = time.perf_counter()
            forward(x)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()
    data = sample_data(PER_CLASS)
    rows: dict[str, dict] = {}
    for model in MODELS:
        run_dir, accuracy = _prepare(model, data)
        forwards = _forwards(run_dir)
        one = _timings(forwards, 1, LATENCY_CALLS)
        many = _timings(forwards, 32, BATCH_CALLS)
        for name in forwards:
            rows[f"{model} {name}"] = {
                "model": model,
                "format": name,
                "latency_p50_ms": float(np.percentile(one[name], 50) * 1000),
                "latency_p99_ms": float(np.percentile(one[name], 99) * 1000),
                "throughput_b32_images_per_s": 32 / float(np.median(many[name])),
                "val_accuracy": accuracy[name],
                "val_images": accuracy["val_images"],
            }
        eager = rows[f"{model} eager"]
        for name in forwards:
            r = rows[f"{model} {name}"]
            r["speedup_b1_vs_eager"] = eager["latency_p50_ms"] / r["latency_p50_ms"]
            r["speedup_b32_vs_eager"] = r["throughput_b32_images_per_s"] / eager["throughput_b32_images_per_s"]
    print(f"{'model':<26} {'format':<14} {'p50 ms':>8} {'p99 ms':>8} {'b32 img/s':>10} {'x eager':>8} {'val acc':>8}")
    for r in rows.values():
        print(
            f"{r['model']:<26} {r['format']:<14} {r['latency_p50_ms']:>8.2f} {r['latency_p99_ms']:>8.2f} "
            f"{r['throughput_b32_images_per_s']:>10.1f} {r['speedup_b32_vs_eager']:>8.2f} {r['val_accuracy']:>8.4f}"
        )
    result = {
        "command": "python benchmarks/deploy.py",
        "per_class": PER_CLASS,
        "image_size": SIZE,
        "threads": THREADS,
        "latency_calls": LATENCY_CALLS,
        "batch_calls": BATCH_CALLS,
        "train": TRAIN,
        "export_check": CHECK,
        "load_average_before": load_before,
        "rows": rows,
    }
    write_result("deploy", result)
    print(json.dumps({"load_average_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
