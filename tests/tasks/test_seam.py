"""The task seam: a task defined entirely in this module -- counting the bright blobs of an image, a
regression with labels of its own (counts written as words, "two blobs"), read and validated here, a split
of its own (stratified by count), a metric of its own (the share of images whose count, rounded, is right)
and an evaluation of its own (a file beside eval.json, a section of the run's page) -- registered by name,
then listed, trained, predicted and evaluated through the command line with no other file knowing of it."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import trainrun
from visiontune import tasks
from visiontune.cli.commands import main
from visiontune.data.imageset import Cells, Labelled
from visiontune.data.sources import discover
from visiontune.data.split import make_stratified_split
from visiontune.errors import UserError
from visiontune.reports import evaluations
from visiontune.runs import evalrecords, runrecords
from visiontune.tasks.regress import Regression

WORDS = ("none", "one blob", "two blobs", "three blobs")
BY_COUNT = "stratified by blob count: each count held out at --val-fraction"


class BlobCount(Regression):
    """How many bright blobs an image holds: a regression whose own metric counts exact answers."""

    name, title = "blobs", "blob count"
    curves = (*Regression.curves, ("count_accuracy", "count accuracy"))

    def names_columns(self, row: list[str], where: str = "") -> bool:
        return row[1:] == ["blobs"]

    def parse(self, cells: Cells) -> Labelled:
        """A manifest's ``filename,<count in words>``: a word that is no count is one line naming its row."""
        counts = []
        for i, row in enumerate(cells.rows):
            said = row[0].strip().lower() if row else ""
            if said not in WORDS:
                raise UserError(f"{cells.where(i)}: {said!r} is not a count of blobs ({', '.join(WORDS)})")
            counts.append(WORDS.index(said))
        return Labelled(self, np.zeros(len(counts), np.int32), ["blobs"], np.asarray(counts, np.float32)[:, None])

    def split(self, images, val_fraction: float, seed: int):
        counts = images.targets[:, 0].astype(np.int64)
        return replace(make_stratified_split(counts, val_fraction, seed), method=BY_COUNT)

    def ranking(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        out = super().ranking(logits, labels)
        ok = self.readable(labels)
        right = self.values(logits[ok]).round() == labels[ok].double()
        out["count_accuracy"] = float(right.double().mean()) if ok.any() else None
        return out


def write_blob_evaluation(accelerator, loaded, outputs, paths, chosen, images, scored, tta_mode, top_n, out) -> dict:
    """A regression's eval.json and files, and the count accuracy in words beside them."""
    regress = evaluations.of(tasks.REGRESSION)
    report = regress.write(accelerator, loaded, outputs, paths, chosen, images, scored, tta_mode, top_n, out)
    (Path(out).parent / "count_accuracy.txt").write_text(f"{report['count_accuracy']!r}\n")
    return report


def blob_section(eval_json: Path, ev: dict) -> str:
    regress = evaluations.of(tasks.REGRESSION)
    return f"<p class='blobs'>Counted right: {ev['count_accuracy']:.4f}</p>" + regress.section(eval_json, ev)


@pytest.fixture
def blobs():
    task = tasks.register(BlobCount())
    # the fields its section shows: a regression's, and its own count accuracy (checked when eval.json is read back)
    schema, needed = evalrecords.EVALUATIONS[tasks.REGRESSION.name]
    fields = ({**schema, "count_accuracy": (lambda v: isinstance(v, float), "a number")}, (*needed, "count_accuracy"))
    evaluations.register(task.name, write=write_blob_evaluation, section=blob_section, fields=fields)
    yield task
    del tasks.TASKS[task.name], evaluations.EVALUATIONS[task.name]


def write_blobs(out: Path, count: int, size: int = 32, seed: int = 0) -> dict[str, int]:
    """Images of 0 to 3 bright 6 px squares on a dark ground, apart; train.csv ``filename,blobs`` (in words)."""
    rng = np.random.default_rng(seed)
    (out / "train").mkdir(parents=True)
    counts, lines = {}, ["filename,blobs"]
    for i in range(count):
        n = int(rng.integers(0, 4))
        pixels = rng.normal(30, 8, (size, size, 3))
        for k in range(n):  # one blob in each of the first n quadrants, at a random place in it
            y, x = (k // 2) * 16 + int(rng.integers(0, 10)), (k % 2) * 16 + int(rng.integers(0, 10))
            pixels[y : y + 6, x : x + 6] = 230
        name = f"{i:04d}.png"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out / "train" / name)
        counts[name] = n
        lines.append(f"{name},{WORDS[n]}")
    (out / "train.csv").write_text("\n".join(lines) + "\n")
    return counts


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_task_defined_in_a_test_module_trains_predicts_and_evaluates(blobs, tmp_path, monkeypatch):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    data, run = tmp_path / "data", tmp_path / "run"
    counts = write_blobs(data, 60)
    argv = ["train", "--data", str(data), "--task", "blobs", "--output-dir", str(run), "--model", "timm/test_vit"]
    argv += ["--weights", "none", "--image-size", "32", "--no-progress", "--num-workers", "0", "--epochs", "2"]
    assert main([*argv, "--batch-size", "8", "--recipe", "modern"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    history = json.loads((run / "history.json").read_text())
    split = json.loads((run / "split.json").read_text())
    assert split["method"] == BY_COUNT  # its own split: every count has its share of the val images
    for n in range(4):
        val = sum(counts[Path(p).name] == n for p in split["val"])
        assert abs(val - 0.2 * sum(c == n for c in counts.values())) < 1, (n, val)
    assert summary["task"] == json.loads((run / "config.json").read_text())["model"]["task"] == "blobs"
    # the figures of its best epoch: its own metric's too, kept when the summary is read back
    best = next(row["val"] for row in history if row["epoch"] == summary["best_epoch"])
    assert summary["best_val_count_accuracy"] == best["count_accuracy"] and runrecords.read_summary(run) == summary
    assert all(0 <= row["val"]["count_accuracy"] <= 1 for row in history)  # its own metric, recorded each epoch
    assert "count_accuracy" in (run / "metrics.csv").read_text().splitlines()[0]

    assert main(["predict", "--run", str(run), "--data", str(data / "train"), "--out", str(tmp_path / "p.csv")]) == 0
    rows = _csv(tmp_path / "p.csv")
    assert sorted(Path(r["path"]).name for r in rows) == sorted(counts) and list(rows[0]) == ["path", "blobs"]

    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    scored = _csv(run / "predictions.csv")
    pred = {Path(r["path"]).name: float(r["predicted_blobs"]) for r in scored}
    right = np.mean([round(v) == counts[n] for n, v in pred.items()])
    assert ev["task"] == ev["report"] == "blobs" and ev["count_accuracy"] == pytest.approx(right)
    # its own evaluation, found through its name: the writer's file and the page's section
    assert float((run / "count_accuracy.txt").read_text()) == ev["count_accuracy"]
    assert f"<p class='blobs'>Counted right: {ev['count_accuracy']:.4f}</p>" in (run / "report.html").read_text()
    assert "MAE of always the mean" in (run / "report.html").read_text()  # the regression's section within it
    assert ev["mae"] == pytest.approx(np.mean([abs(v - counts[n]) for n, v in pred.items()]), rel=1e-9)
    for r in rows:  # predict and evaluate answer alike
        name = Path(r["path"]).name
        if name in pred:
            assert float(r["blobs"]) == pytest.approx(pred[name], abs=1e-5)


def test_a_summary_read_back_keeps_the_figures_its_task_adds(blobs, tmp_path):
    """What a task's best epoch adds to a summary (``best_val_`` and each metric of its curves) is read back with
    it, checked as a number: a job of several processes hands its caller the summary.json its workers wrote."""
    row = {"loss": 0.5, "accuracy": 0.4, "mae": 0.4, "rmse": 0.6, "r2": 0.7, "count_accuracy": 0.75}
    figures = blobs.best_figures(row)
    assert figures == {"best_val_rmse": 0.6, "best_val_r2": 0.7, "best_val_count_accuracy": 0.75}
    written = {"task": "blobs", "best_val_mae": 0.4, "best_val_loss": 0.5, **figures, "epochs": 2}
    (tmp_path / "summary.json").write_text(json.dumps(written))
    assert runrecords.read_summary(tmp_path) == written
    (tmp_path / "summary.json").write_text(json.dumps({**written, "best_val_count_accuracy": "most"}))
    with pytest.raises(UserError) as e:
        runrecords.read_summary(tmp_path)
    assert "best_val_count_accuracy is 'most', expected a number or null" in str(e.value)
    (tmp_path / "summary.json").write_text(json.dumps({**written, "best_val_other": 1.0, "task": "classify"}))
    assert "best_val_count_accuracy" not in runrecords.read_summary(tmp_path)  # another task's: not its figure


# Every process of the job knows the task: this module's, registered as each interpreter starts (the launching
# one and the workers torch.distributed.run starts).
SITE = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]
from test_seam import BlobCount
from visiontune import tasks
tasks.register(BlobCount())
"""
API_JOB = """
import json, sys
import visiontune
config = visiontune.TrainConfig(
    data=sys.argv[1], output_dir=sys.argv[2], task="blobs", model="timm/test_vit", weights="none", image_size=32,
    progress=False, num_workers=0, epochs=1, batch_size=4, strategy="ddp", nproc=2,
)
print(json.dumps(visiontune.train(config)))
"""


@pytest.mark.distributed
def test_a_job_of_two_processes_returns_the_figures_its_task_adds(tmp_path, worker_env):
    """``visiontune.train()`` of the task under --strategy ddp --nproc 2 returns the summary its workers wrote,
    its own metric's best figure included, as a run in one process does. Before, the launching process read it
    back through the summary's schema, which knew the built-in tasks' figures only: it dropped the task's."""
    site, data, run = tmp_path / "site", tmp_path / "data", tmp_path / "run"
    site.mkdir()
    here = Path(__file__).parent
    (site / "sitecustomize.py").write_text(SITE.format(here=str(here), tests=str(here.parent)))
    env = trainrun.env_for(worker_env, tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    write_blobs(data, 24)
    done = trainrun.run([trainrun.PYTHON, "-c", API_JOB, str(data), str(run)], env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    returned = json.loads(done.stdout.splitlines()[-1])
    assert returned == json.loads((run / "summary.json").read_text()) and returned["world_size"] == 2
    assert returned["task"] == "blobs" and 0 <= returned["best_val_count_accuracy"] <= 1


def test_a_tasks_own_labels_are_read_and_refused_by_it_alone(blobs, tmp_path):
    """The data sources hand the cells to the task: its words are its counts, and a word it does not know is
    one line naming the manifest's row."""
    data = tmp_path / "data"
    counts = write_blobs(data, 8, size=8)
    images = discover(str(data), task=blobs)
    assert images.task == "blobs" and images.classes == ["blobs"] and images.reading is blobs
    assert images.targets[:, 0].tolist() == [counts[Path(p).name] for p in images.paths]
    assert "blob count" not in images.describe() and "regression" in images.describe()
    lines = (data / "train.csv").read_text().splitlines()
    lines[3] = lines[3].split(",")[0] + ",four blobs"
    (data / "train.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as e:
        discover(str(data), task=blobs)
    assert str(e.value) == f"{data / 'train.csv'} row 4: 'four blobs' is not a count of blobs ({', '.join(WORDS)})"
    assert main(["train", "--data", str(data), "--task", "blobs", "--output-dir", str(tmp_path / "run")]) == 2
    with pytest.raises(UserError, match="row 2 .*'three blobs', not a finite number"):  # words: no regression's
        discover(str(data), task=tasks.REGRESSION)
