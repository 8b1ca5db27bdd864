"""`visiontune bench`: one fresh process per strategy, consistent numbers, the three files."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from PIL import Image

import trainrun
from trainrun import SQUEEZENET, flags
from visiontune.cli.commands import main
from visiontune.reports import bench


@pytest.fixture(scope="module")
def bench_dir(sample_data, tmp_path_factory, worker_env_module):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", *flags(data=sample_data), *SQUEEZENET, *flags(batch_size=8, nproc=2, timing_warmup=1)]
    # Each strategy's `python -m visiontune train` (the command line bench builds) runs as a process of its
    # own, forked from one that has imported visiontune (tests/zygote.py): a new interpreter's imports cost
    # more than the tiny run itself.
    forked = SimpleNamespace(run=lambda cmd, **_: trainrun.run(cmd, dict(os.environ)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "subprocess", forked)
        code = main([*argv, "--output-dir", str(out)])
    assert code == 0
    return out


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_dp_row_says_why_on_a_cpu_machine(bench_dir):
    rows = {r["strategy"]: r for r in json.loads((bench_dir / "bench.json").read_text())["rows"]}
    assert "DataParallel needs 2 or more GPUs; 0 visible" == rows["dp"]["skipped"]
    md = (bench_dir / "bench.md").read_text()
    assert "| dp |" in md and "not run: DataParallel needs 2 or more GPUs" in md
    assert md.count("\n| single | 1 | 16 | 16 |") == 1 and "| ddp | 2 | 8 | 16 |" in md


@pytest.mark.distributed
def test_bench_png_is_a_png(bench_dir):
    with Image.open(bench_dir / "bench.png") as im:
        assert im.format == "PNG" and im.size[0] > 300


@pytest.mark.distributed
def test_the_bench_and_each_of_its_runs_get_a_page_with_the_table(bench_dir):
    rows = json.loads((bench_dir / "bench.json").read_text())["rows"]
    for page in (bench_dir / "report.html", bench_dir / "single" / "report.html", bench_dir / "ddp" / "report.html"):
        html = page.read_text()
        assert "<h2>Benchmark</h2>" in html
        # a rate to 3 significant digits (whole above 100), as the pages round what is not a score
        rate = lambda v: f"{v:,.0f}" if v >= 100 else f"{v:#.3g}".rstrip(".")  # noqa: E731
        assert f">{rate(rows[0]['images_per_s'])}</td>" in html and f">{rate(rows[2]['images_per_s'])}</td>" in html


def test_per_device_plan_reproduces_the_blogs_setting():
    from visiontune.reports.bench import plan
    from visiontune.settings.config import TrainConfig

    rows = plan(TrainConfig(data="x", batch_size=50), ["single", "ddp"], 4, "per-device")
    assert [(r["per_process_batch"], r["global_batch"]) for r in rows] == [(50, 50), (50, 200)]


def test_unknown_strategy_is_a_user_error(sample_data, capsys, tmp_path):
    assert (
        main(["bench", "--data", str(sample_data), "--strategies", "single,zero3", "--output-dir", str(tmp_path / "b")])
        == 2
    )
    assert "unknown strategy zero3" in capsys.readouterr().err


def _row(strategy, speed, stall=0.0, devices=1):
    return {
        "strategy": strategy,
        "devices": devices,
        "processes": devices,
        "per_process_batch": 8,
        "global_batch": 16,
        "images_per_s": speed,
        "data_stall": stall,
        "epoch_seconds": 1.0,
        "lr": 0.1,
        "train_loss": 0.5,
        "train_accuracy": 0.5,
        "val_loss": 0.5,
        "val_accuracy": 0.5,
        "load_per_core": 0.1,
    }


@pytest.mark.parametrize(
    "base_stall, spread, start_load, note",
    [
        (0.0, None, 0.1, "not explained by data stall (0%); rerun with --repeats 3"),
        (0.3, None, 0.1, "the baseline waited for its input 30% of the time (0% here)"),
        (0.3, 0.25, 0.1, "noisy machine: images/s of single varied by 25% across 3 repeats"),
        (0.0, None, 0.9, "noisy machine: load average 0.90 per core before the benchmark started"),
    ],
)
def test_a_super_linear_speedup_is_explained_only_by_what_was_measured(base_stall, spread, start_load, note):
    from visiontune.reports.bench import compare

    base = {**_row("single", 100.0, base_stall), "spread": spread, "repeats": 3}
    rows = compare([base, _row("ddp", 250.0, devices=2)], start_load)
    assert rows[1]["speedup"] == pytest.approx(2.5)
    if "noisy" in note:  # the load made the figure: the reason first, the figure after it
        assert rows[1]["note"] == f"unreliable: {note} (measured 2.50x, 125%; above the device count)"
        assert rows[1]["unreliable"] == note
    else:
        assert rows[1]["note"].startswith("speedup above the device count") and note in rows[1]["note"]
        assert "unreliable" not in rows[1]
    if base_stall == 0.0:
        assert "waiting" not in rows[1]["note"] and "waited" not in rows[1]["note"]


def test_repeats_interleave_and_report_the_median_run_and_its_spread(monkeypatch, tmp_path):
    from visiontune.reports import bench
    from visiontune.settings.config import TrainConfig

    speeds = {"single": iter([100.0, 80.0, 120.0]), "ddp": iter([150.0, 160.0, 155.0])}
    calls = []

    def fake_run_one(row, argv, out, repeat=0):
        calls.append((row["strategy"], repeat))
        return {
            **_row(row["strategy"], next(speeds[row["strategy"]]), devices=row["devices"]),
            **{k: row[k] for k in ("processes", "per_process_batch", "global_batch")},
            "repeat": repeat,
        }

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "load_per_core", lambda: 0.05)
    rows = bench.bench(
        TrainConfig(data="x", batch_size=8), [], ["single", "dp", "ddp"], 2, "global", str(tmp_path), repeats=3
    )
    assert calls == [("single", 0), ("ddp", 0), ("single", 1), ("ddp", 1), ("single", 2), ("ddp", 2)]
    single, dp, ddp = rows
    assert "skipped" in dp
    assert (single["images_per_s"], single["repeat"], single["images_per_s_runs"]) == (100.0, 0, [100.0, 80.0, 120.0])
    assert single["spread"] == pytest.approx(0.4) and ddp["spread"] == pytest.approx(10 / 155)
    assert single["note"] == "noisy machine: images/s of single varied by 40% across 3 repeats"
    assert ddp["speedup"] == pytest.approx(1.55) and ddp["note"].startswith("unreliable: noisy machine")
    md = (tmp_path / "bench.md").read_text()
    assert "| 100.0 ±20% |" in md and "Repeats per strategy: 3" in md and "at the start: 0.05" in md
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["repeats"] == 3 and saved["rows"][0]["images_per_s_runs"] == [100.0, 80.0, 120.0]
    page = (tmp_path / "report.html").read_text()  # the bench's own page shows the same rows, rates to 3 digits
    assert '<td data-src="bench" data-path="[&quot;rows&quot;, 0, &quot;images_per_s&quot;]">100</td>' in page
    assert "noisy machine: images/s of single varied by 40%" in page


def test_repeats_must_be_positive(sample_data, capsys, tmp_path):
    assert main(["bench", "--data", str(sample_data), "--repeats", "0", "--output-dir", str(tmp_path / "b")]) == 2
    assert "--repeats must be a positive integer" in capsys.readouterr().err


def test_a_speedup_on_a_loaded_machine_is_marked_unreliable_before_its_figure(tmp_path):
    """14.40x on 2 devices at load 5 per core: the table leads with the warning, never with the figure."""
    from visiontune.reports import report
    from visiontune.reports.bench import compare
    from visiontune.reports.benchtable import table

    rows = compare([_row("single", 10.0), _row("ddp", 144.0, devices=2)], start_load=5.1)
    info = {
        "model": "resnet18",
        "image_size": 32,
        "epochs": 1,
        "same": "global",
        "repeats": 1,
        "load_per_core": 5.1,
        "machine": {"cpu": "x", "cores": 2, "gpus": [], "torch": "t", "torchvision": "v", "accelerate": "a"},
    }
    md = table(rows, info)
    reason = "noisy machine: load average 5.10 per core before the benchmark started"
    warning = next(line for line in md.splitlines() if line.startswith("UNRELIABLE"))
    assert reason in warning and md.index(warning) < md.index("| strategy |")
    ddp = next(line for line in md.splitlines() if line.startswith("| ddp |"))
    assert "| unreliable | unreliable |" in ddp and "14.40x" not in ddp.split("unreliable:")[0]
    assert f"unreliable: {reason} (measured 14.40x, 720%; above the device count)" in ddp
    (tmp_path / "bench.json").write_text(json.dumps({**info, "rows": rows}))
    page = report.build(tmp_path)
    assert page.index(warning) < page.index("<th class='l'>strategy</th>") and "<td>unreliable</td>" in page


def test_each_bench_run_says_which_of_all_it_is_and_the_bench_s_eta(monkeypatch, tmp_path, capsys):
    from visiontune.reports import bench

    now = iter([0.0, 10.0, 20.0, 30.0])  # the start, then before each run after the first: 10 s a run
    monkeypatch.setattr(
        bench, "run_one", lambda row, argv, out, repeat=0: {**_row(row["strategy"], 1.0), "repeat": repeat}
    )
    plans = [{"strategy": "single"}, {"strategy": "dp", "skipped": "no GPUs"}, {"strategy": "ddp"}]
    bench.measure(plans, [], tmp_path, repeats=2, clock=lambda: next(now))
    assert capsys.readouterr().out.splitlines() == [
        "visiontune bench: run 1/4: single, repeat 1/2",
        "visiontune bench: run 2/4: ddp, repeat 1/2; about 0m 30s left",
        "visiontune bench: run 3/4: single, repeat 2/2; about 0m 20s left",
        "visiontune bench: run 4/4: ddp, repeat 2/2; about 0m 10s left",
    ]


def test_bench_says_why_single_trains_at_the_global_batch(monkeypatch, tmp_path, capsys):
    from visiontune.reports import bench
    from visiontune.settings.config import TrainConfig

    def fake_run_one(row, argv, out, repeat=0):
        return {**_row(row["strategy"], 10.0, devices=row["devices"]), **row}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "load_per_core", lambda: 0.05)
    bench.bench(TrainConfig(data="x", batch_size=50), [], ["single", "ddp"], 2, "global", str(tmp_path))
    said = capsys.readouterr().out.splitlines()
    why = (
        "Batches: every strategy trains on the same global batch of 100 (--same global), so their accuracies "
        "compare; processes x batch per process: single 1 x 100, ddp 2 x 50."
    )
    assert said[0].startswith(f"visiontune bench: {why}") and "--same per-device" in said[0]
    assert why in (tmp_path / "bench.md").read_text()
    per_device = bench.plan(TrainConfig(data="x", batch_size=50), ["single", "ddp"], 2, "per-device")
    from visiontune.reports.benchtable import batch_line

    assert "single 1 x 50, ddp 2 x 50. The global batches differ" in batch_line(per_device, "per-device")


def test_bench_png_marks_an_unreliable_bar_and_carries_the_warning():
    import matplotlib.pyplot as plt

    from visiontune.reports.bench import compare
    from visiontune.reports.benchtable import chart_figure, unreliable_line

    rows = compare([_row("single", 10.0), _row("ddp", 390.0, devices=2)], start_load=5.1)
    fig = chart_figure(rows)
    heading = fig.get_suptitle()
    assert heading.replace("\n", " ") == unreliable_line(rows)  # the warning bench.md opens with
    for ax in fig.axes:
        single, ddp = ax.patches
        assert ddp.get_hatch() == "//" and not single.get_hatch()
        labels = [t.get_text() for t in ax.texts]
        assert labels[1].endswith("39.00x (unreliable)") and "x" not in labels[0].split()[-1]
    plt.close(fig)
    calm = chart_figure(compare([_row("single", 10.0), _row("ddp", 18.0, devices=2)]))
    assert calm.get_suptitle() == "" and [t.get_text() for t in calm.axes[1].texts][1] == "18.0/s, 1.80x"
    plt.close(calm)


def test_the_machine_record_starts_no_process(monkeypatch):
    """platform.processor() runs `uname -p` the first time in a process: a bench (or a fast test of one) that
    had not run it yet would start a process just to name the CPU, which /proc/cpuinfo and os.uname name."""
    import platform

    from visiontune.reports.bench import machine

    def processor():
        raise AssertionError("platform.processor() starts `uname -p`")

    monkeypatch.setattr(platform, "processor", processor)
    record = machine()
    assert record["cpu"] and record["cores"] >= 1 and "torch" in record
