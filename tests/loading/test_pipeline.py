"""Faithfulness to the blog's PIL pipeline, on-device normalisation, GPU settings and the GPU script."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from torchvision import transforms

import trainrun
from conftest import PYTHON, ROOT
from trainrun import flags
from visiontune.cluster.strategy import enable_gpu_speedups
from visiontune.data.decode import read_image, resize_uint8
from visiontune.loading.pipeline import DeviceNormalize
from visiontune.models.build import build_model, load_state_file
from visiontune.settings.config import MEAN, STD

SIZE = 32


def blog_pipeline(size: int) -> transforms.Compose:
    """The reference job's transform, applied to a PIL image opened and converted as its dataset does."""
    return transforms.Compose(
        [transforms.Resize((size, size)), transforms.ToTensor(), transforms.Normalize(mean=list(MEAN), std=list(STD))]
    )


@pytest.mark.slow
def test_trained_model_predicts_the_same_through_both_pipelines(sample_data, trained_run):
    run = trained_run  # 2 epochs of resnet18 at 32 px
    classes = json.loads((run / "classes.json").read_text())
    model = build_model("resnet18", len(classes), "none")
    model.load_state_dict(load_state_file(str(run / "best.safetensors")))
    model.eval()
    split = json.loads((run / "split.json").read_text())
    paths = [str(sample_data / rel) for rel in split["val"]]
    labels = torch.tensor([classes.index(Path(p).name.split(".")[0]) for p in paths])

    ours_u8 = torch.stack([resize_uint8(read_image(p), SIZE) for p in paths])
    blog = blog_pipeline(SIZE)
    theirs = torch.stack([blog(Image.open(p).convert("RGB")) for p in paths])
    # The pixel difference, documented in the README: at most one grey level, almost always none.
    theirs_u8 = torch.stack(
        [
            transforms.functional.pil_to_tensor(transforms.Resize((SIZE, SIZE))(Image.open(p).convert("RGB")))
            for p in paths
        ]
    )
    diff = (ours_u8.int() - theirs_u8.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.05

    with torch.inference_mode():
        ours_pred = model(DeviceNormalize(torch.device("cpu"))(ours_u8)).argmax(1)
        theirs_pred = model(theirs).argmax(1)
    agreement = (ours_pred == theirs_pred).float().mean().item()
    assert agreement >= 0.99, f"predictions agree on {agreement:.1%} of {len(paths)} val images"
    # A model that always answers one class would agree trivially: this one has learnt the task.
    assert (ours_pred == labels).float().mean() >= 0.75 and len(set(ours_pred.tolist())) == 2


def test_device_normalize_equals_totensor_then_normalize():
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    expected = transforms.Normalize(MEAN, STD)(x.float() / 255)
    got = DeviceNormalize(torch.device("cpu"))(x)
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-5)
    cl = DeviceNormalize(torch.device("cpu"), channels_last=True)(x)
    assert cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(cl, got)


def test_gpu_speedups_allow_tf32_and_cudnn_autotuning():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
        enable_gpu_speedups()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.benchmark
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) = saved


@pytest.mark.slow
def test_gpu_script_says_there_is_no_gpu_and_exits_0(worker_env):
    env = {**worker_env, "PYTHON": PYTHON, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU" in out.stdout


@pytest.mark.slow
def test_gpu_benchmark_code_runs_tiny_on_a_cpu(tmp_path, worker_env, monkeypatch, capsys):
    """The measuring code gpu.sh runs, at toy size: every source counts the images it trained on, and the
    JPEG files' rows (workers decoding; --decode device) carry their ratio to the cached row. The script's
    own process is this one (it measures each mode in a process it starts, as on a GPU machine)."""
    import runpy

    out_json = tmp_path / "gpu.json"
    script = str(ROOT / "benchmarks" / "gpu_bench.py")
    argv = flags(smoke=True, modes="fp32", file_modes="fp32", workers=0, work=tmp_path, out=out_json)
    for key, value in worker_env.items():  # what the measuring process inherits
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("sys.argv", [script, *argv])
    main = runpy.run_path(script)["main"]
    # Each mode's measuring process (`python gpu_bench.py --one MODE ...`, as the script builds it) a fork of the
    # tests' process that has imported torch (tests/zygote.py) instead of a new interpreter.
    forked = lambda cmd, **_: trainrun.run(trainrun.script_argv(*cmd[1:]), dict(os.environ))  # noqa: E731
    main.__globals__["subprocess"] = SimpleNamespace(run=forked, PIPE=subprocess.PIPE)
    assert main() == 0, capsys.readouterr().out[-2000:]
    rows = json.loads(out_json.read_text())["results"]
    sources = ["synthetic", "cache", "files-cpu", "files-device"]
    assert [(r["mode"], r["source"]) for r in rows] == [("fp32", s) for s in sources]
    assert rows[0]["images"] == 2 * 4 and rows[1]["images"] == 16  # --smoke: 2 steps of 4; 16 cached images
    assert rows[2]["images"] == rows[3]["images"] == 16  # every file, decoded either way
    assert all(r["images_per_s"] > 0 and r["share_of_peak"] is None for r in rows)
    for r in rows:
        assert r["ratio_to_cache"] == round(r["images_per_s"] / rows[1]["images_per_s"], 3)
    assert os.path.exists(tmp_path / "cache")
