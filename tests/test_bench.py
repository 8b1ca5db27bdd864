"""`visiontune bench`: one fresh process per strategy, consistent numbers, the three files."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from conftest import FAST
from visiontune.cli import main


@pytest.fixture(scope="module")
def bench_dir(sample_data, tmp_path_factory, worker_env_module):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--data", str(sample_data), *FAST, "--batch-size", "8", "--nproc", "2",
                 "--timing-warmup", "1", "--output-dir", str(out)])
    assert code == 0
    return out


def test_bench_json_rows_are_consistent(bench_dir):
    report = json.loads((bench_dir / "bench.json").read_text())
    rows = {r["strategy"]: r for r in report["rows"]}
    assert list(rows) == ["single", "dp", "ddp"]
    assert report["epochs"] == 1 and report["machine"]["cores"] >= 1 and "torch" in report["machine"]
    single, ddp = rows["single"], rows["ddp"]
    # Same global batch by default: 2 processes x 8 against one process x 16, same lr.
    assert (single["processes"], single["per_process_batch"], single["global_batch"]) == (1, 16, 16)
    assert (ddp["processes"], ddp["per_process_batch"], ddp["global_batch"]) == (2, 8, 16)
    assert single["lr"] == ddp["lr"]
    for r in (single, ddp):
        assert r["images_per_s"] == pytest.approx(r["steady_images"] / r["steady_seconds"], rel=1e-9)
        # 96 train images / 16 = 6 steps, one left out as warm-up: 5 x 16 images counted.
        assert r["steady_images"] == 80
        assert 0.0 <= r["data_stall"] <= 1.0
        summary = json.loads((bench_dir / r["strategy"] / "summary.json").read_text())
        assert summary["world_size"] == r["processes"]
    assert ddp["speedup"] == pytest.approx(ddp["images_per_s"] / single["images_per_s"], rel=1e-9)
    assert ddp["efficiency"] == pytest.approx(ddp["speedup"] / 2, rel=1e-9)
    assert single["speedup"] == pytest.approx(1.0)


def test_dp_row_says_why_on_a_cpu_machine(bench_dir):
    rows = {r["strategy"]: r for r in json.loads((bench_dir / "bench.json").read_text())["rows"]}
    assert "DataParallel needs 2 or more GPUs; 0 visible" == rows["dp"]["skipped"]
    md = (bench_dir / "bench.md").read_text()
    assert "| dp |" in md and "not run: DataParallel needs 2 or more GPUs" in md
    assert md.count("\n| single | 1 | 16 | 16 |") == 1 and "| ddp | 2 | 8 | 16 |" in md


def test_bench_png_is_a_png(bench_dir):
    with Image.open(bench_dir / "bench.png") as im:
        assert im.format == "PNG" and im.size[0] > 300


def test_per_device_plan_reproduces_the_blogs_setting():
    from visiontune.bench import plan
    from visiontune.config import TrainConfig

    rows = plan(TrainConfig(data="x", batch_size=50), ["single", "ddp"], 4, "per-device")
    assert [(r["per_process_batch"], r["global_batch"]) for r in rows] == [(50, 50), (50, 200)]


def test_unknown_strategy_is_a_user_error(sample_data, capsys, tmp_path):
    assert main(["bench", "--data", str(sample_data), "--strategies", "single,fsdp",
                 "--output-dir", str(tmp_path / "b")]) == 2
    assert "unknown strategy fsdp" in capsys.readouterr().err
