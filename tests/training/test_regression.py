"""Image regression end to end: trained, predicted, evaluated and exported in the targets' units; the
scanned digits learnt as numbers under DDP with the MAE counted exactly; and run folders written before the
task had a name still load, predict and resume."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trainrun import env_for, flags, start
from visiontune import load
from visiontune.cli.commands import main
from visiontune.data.sample import make_multilabel_data, make_regression_data

TINY_VIT = flags(model="timm/test_vit", weights="none", image_size=32, no_progress=True, num_workers=0)


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_regression_run_predicts_evaluates_and_exports_values_in_the_targets_units(tmp_path, monkeypatch):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["sample-data", str(data), "--regress", "--per-class", "40"]) == 0
    truth = {r["filename"]: float(r["value"]) for r in _csv(data / "train.csv")}
    argv = ["train", "--data", str(data), "--task", "regress", "--output-dir", str(run), *TINY_VIT]
    argv += flags(epochs=2, batch_size=8, recipe="modern", loss="huber", mixup=0.2)
    assert main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert summary["task"] == config["model"]["task"] == "regress" and summary["best_metric"] == "mae"
    # --recipe modern's label smoothing (0.1 on classes) is left out for a task without classes
    assert config["config"]["recipe"] == "modern" and config["config"]["label_smoothing"] == 0.0
    scale = config["model"]["task_state"]
    train_values = [truth[Path(p).name] for p in json.loads((run / "split.json").read_text())["train"]]
    assert scale["mean"] == pytest.approx([np.mean(train_values)]) and scale["loss"] == "huber"

    # evaluate: eval.json's figures are those of its own predictions.csv, and those of the run's last epoch
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    rows = _csv(run / "predictions.csv")
    err = np.array([float(r["predicted_value"]) - float(r["true_value"]) for r in rows])
    assert [float(r["true_value"]) for r in rows] == [truth[Path(r["path"]).name] for r in rows]
    assert ev["count"] == len(rows) == summary["val_split_size"]
    assert ev["mae"] == pytest.approx(np.abs(err).mean(), rel=1e-9)
    assert ev["rmse"] == pytest.approx(np.sqrt((err**2).mean()), rel=1e-9)
    assert ev["mae"] == pytest.approx(summary["best_val_mae"], rel=1e-4)  # the run's own count, in float32
    assert (run / "scatter.png").is_file() and len(_csv(run / "largest_residuals.csv")) == len(rows)

    # predict writes values; the ONNX file and the Python API answer the same
    assert main(["predict", "--run", str(run), "--data", str(data / "train"), "--out", str(tmp_path / "p.csv")]) == 0
    eager = {Path(r["path"]).name: float(r["value"]) for r in _csv(tmp_path / "p.csv")}
    assert set(eager) == set(truth)
    by_name = {Path(r["path"]).name: float(r["predicted_value"]) for r in rows}
    assert all(eager[n] == pytest.approx(v, abs=1e-5) for n, v in by_name.items())
    onnx = tmp_path / "m.onnx"
    assert main(["export", "--run", str(run), "--format", "onnx", "--out", str(onnx)]) == 0
    out = tmp_path / "onnx.csv"
    assert main(["predict", "--weights", str(onnx), "--data", str(data / "train"), "--out", str(out)]) == 0
    assert all(eager[Path(r["path"]).name] == pytest.approx(float(r["value"]), abs=1e-4) for r in _csv(out))
    xml = tmp_path / "ov" / "m.xml"  # OpenVINO's IR, checked beside the ONNX file on the val split
    assert main(["export", "--run", str(run), "--format", "openvino", "--out", str(xml)]) == 0
    assert main(["predict", "--weights", str(xml), "--data", str(data / "train"), "--out", str(out)]) == 0
    assert all(eager[Path(r["path"]).name] == pytest.approx(float(r["value"]), abs=1e-4) for r in _csv(out))
    name = sorted(truth)[0]
    answer = load(str(run)).predict([str(data / "train" / name)])[0]
    assert answer["value"] == pytest.approx(eager[name], abs=1e-5) and list(answer["values"]) == ["value"]
    _served_value_is(run, data / "train" / name, eager[name])


def _served_value_is(run: Path, image: Path, value: float) -> None:
    """``serve`` answers an upload with the value predict wrote, and its metadata names the task and scale."""
    from fastapi.testclient import TestClient

    from visiontune.inference.runtime import load_runtime
    from visiontune.inference.serve import ServeOptions, build_app

    with TestClient(build_app(load_runtime(run=str(run)), ServeOptions(decoders=0))) as client:
        while client.get("/health").status_code != 200:  # the warm-up forward pass runs first
            time.sleep(0.05)
        got = client.post("/predict", content=image.read_bytes(), headers={"content-type": "image/png"}).json()
        assert got["predictions"][0]["value"] == pytest.approx(value, abs=1e-5)
        meta = client.get("/metadata").json()
        assert meta["task"] == "regress" and len(meta["task_state"]["mean"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, said",
    [
        (["--task", "regress", "--cutmix", "1.0"], "--cutmix has no meaning for regression"),
        # asked for, not a recipe's: refused (--recipe modern's own smoothing is left out, above)
        (["--task", "regress", "--recipe", "modern", "--label-smoothing", "0.1"], "--label-smoothing has no meaning"),
        # --task auto never reads numbers as a regression: the data's line, not the recipe's smoothing
        (["--recipe", "modern"], "data/train.csv row 1: header 'filename,value' names no label column"),
    ],
)
def test_what_regression_refuses_and_regression_data_under_task_auto_are_one_line_and_exit_2(
    tmp_path, capsys, extra, said
):
    make_regression_data(tmp_path / "data", count=20)
    argv = ["train", "--data", str(tmp_path / "data"), "--output-dir", str(tmp_path / "run")]
    assert main([*argv, *TINY_VIT, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("visiontune: error: ") and said in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def write_digits(out: Path, count: int) -> None:
    """sklearn's scanned digits (8 x 8, 16 grey levels) as 16 px PNGs, the digit's value the target."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    (out / "train").mkdir(parents=True)
    lines = ["filename,digit"]
    for i in range(count):
        img = Image.fromarray((digits.images[i] * (255 / 16)).astype(np.uint8)).resize((16, 16), Image.NEAREST)
        img.convert("RGB").save(out / "train" / f"{i:04d}.png")
        lines.append(f"{i:04d}.png,{digits.target[i]}")
    (out / "train.csv").write_text("\n".join(lines) + "\n")


@pytest.mark.distributed
def test_digits_learnt_as_numbers_under_ddp_beat_the_mean_and_count_each_val_image_once(tmp_path, worker_env):
    """301 digits, 61 in val (odd: padded on 2 processes); the MAE the DDP run recorded equals the one computed
    here from the predictions saved by evaluate, and is well under always answering the train split's mean."""
    data, run = tmp_path / "data", tmp_path / "run"
    write_digits(data, 301)
    argv = ["-m", "visiontune", "train", "--data", str(data), "--task", "regress", "--output-dir", str(run)]
    argv += [*TINY_VIT, *flags(epochs=6, batch_size=8, recipe="modern", strategy="ddp", nproc=2)]
    import sys

    job = start([sys.executable, *argv], env_for(worker_env, tmp_path), tmp_path / "log")
    job.wait(900)
    assert job.returncode == 0, (tmp_path / "log").read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_images_counted"] == summary["val_split_size"] == 61
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 0
    rows = _csv(run / "predictions.csv")
    err = np.array([float(r["predicted_digit"]) - float(r["true_digit"]) for r in rows])
    assert len(rows) == 61 and summary["best_val_mae"] == pytest.approx(np.abs(err).mean(), rel=1e-4)
    split = json.loads((run / "split.json").read_text())
    truth = {r["filename"]: float(r["digit"]) for r in _csv(data / "train.csv")}
    mean = np.mean([truth[Path(p).name] for p in split["train"]])
    baseline = np.mean([abs(truth[Path(p).name] - mean) for p in split["val"]])
    assert summary["best_val_mae"] < 0.6 * baseline, (summary["best_val_mae"], baseline)


@pytest.mark.distributed
def test_regression_under_fsdp_counts_each_val_image_once_and_records_the_mae_of_its_predictions(tmp_path, worker_env):
    """41 images, 9 in val (odd: 2 processes pad one); FSDP shards the model over 2 processes, and the MAE each
    epoch records is over the 9 val images once, equal to the one computed here from evaluate's predictions."""
    data, run = tmp_path / "data", tmp_path / "run"
    values = make_regression_data(data, count=41, size=32, seed=2)["values"]
    argv = ["-m", "visiontune", "train", "--data", str(data), "--task", "regress", "--output-dir", str(run)]
    argv += [*TINY_VIT, *flags(epochs=2, batch_size=4, strategy="fsdp", nproc=2)]
    import sys

    job = start([sys.executable, *argv], env_for(worker_env, tmp_path), tmp_path / "log")
    job.wait(900)
    assert job.returncode == 0, (tmp_path / "log").read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    history = json.loads((run / "history.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "fsdp"
    assert summary["val_images_counted"] == summary["val_split_size"] == 9
    assert all(row["val"]["images"] == 9 for row in history)
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 0
    rows = _csv(run / "predictions.csv")
    assert sorted(Path(r["path"]).name for r in rows) == sorted(
        Path(p).name for p in json.loads((run / "split.json").read_text())["val"]
    )
    err = np.array([float(r["predicted_value"]) - values[Path(r["path"]).name] for r in rows])
    assert summary["best_val_mae"] == pytest.approx(np.abs(err).mean(), rel=1e-4)
    best = min(history, key=lambda row: row["val"]["mae"])
    assert best["val"]["mae"] == pytest.approx(summary["best_val_mae"], rel=1e-6)
    assert best["val"]["rmse"] == pytest.approx(np.sqrt(np.square(err).mean()), rel=1e-4)


def _as_before_the_task_had_a_name(run: Path) -> None:
    """Rewrite a run's records as visiontune wrote them when the task was a boolean: ``multi_label`` in
    config.json's model description and in best.safetensors' metadata, no ``task``."""
    config = json.loads((run / "config.json").read_text())
    model = config["model"]
    multi = model.pop("task") == "multilabel"
    if multi:
        model["multi_label"] = True
    config["config"].pop("task", None)
    config["config"]["multi_label"] = multi
    (run / "config.json").write_text(json.dumps(config))
    best = run / "best.safetensors"
    with safe_open(str(best), "pt") as f:
        meta = f.metadata()
    described = json.loads(meta["visiontune"])
    assert described.pop("task") == ("multilabel" if multi else "classify")
    if multi:
        described["multi_label"] = True
    save_file(load_file(str(best)), str(best), metadata={**meta, "visiontune": json.dumps(described)})


@pytest.mark.slow
def test_a_multi_label_run_in_the_previous_format_loads_predicts_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    make_multilabel_data(tmp_path / "data", count=40, size=16, seed=1)
    run = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "data"), "--output-dir", str(run), "--multi-label", *TINY_VIT]
    assert main([*argv, *flags(epochs=1, batch_size=8)]) == 0
    images = tmp_path / "data" / "train"
    assert main(["predict", "--run", str(run), "--data", str(images), "--out", str(tmp_path / "new.csv")]) == 0
    _as_before_the_task_had_a_name(run)
    assert main(["predict", "--run", str(run), "--data", str(images), "--out", str(tmp_path / "old.csv")]) == 0
    assert (tmp_path / "old.csv").read_text() == (tmp_path / "new.csv").read_text()  # the label sets, as before
    weights = run / "best.safetensors"
    assert main(["predict", "--weights", str(weights), "--data", str(images), "--out", str(tmp_path / "w.csv")]) == 0
    assert (tmp_path / "w.csv").read_text() == (tmp_path / "new.csv").read_text()
    # resumed: the old config.json's settings (multi_label, no task) carry it on as a multi-label run
    assert main(["train", "--config", str(run / "config.json"), "--resume", str(run), "--epochs", "2"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "multilabel" and summary["epochs"] == 2 and "best_val_map" in summary
