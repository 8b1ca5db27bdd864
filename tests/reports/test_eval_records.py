"""An evaluation's ``eval.json`` (and a bench's ``bench.json``) from someone else: ``visiontune report`` reads them
through ``runs.evalrecords`` -- bounded, each field the page shows checked by the schema of the evaluation that
wrote it -- so a damaged one is one line naming the file and the field, exit 2, and no page; the PNGs beside a
run are embedded up to a size. The fuzz targets feed the page any JSON in any field of each kind."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from trainrun import one_line
from visiontune import cli
from visiontune.errors import UserError
from visiontune.reports import metrics, multilabel, regression, report
from visiontune.runs import evalrecords, runrecords

CLASSES = ["cat", "dog", "fox"]
SCORED = {"split": "val", "own_data": True, "model_file": {"name": "best.safetensors", "sha256": "ab" * 32}}


def _head(task: str, classes: list[str]) -> dict:
    """The fields every evaluation writes (``inference.evaluate``) before its own."""
    return {"data": "/data", "layout": "folder", **SCORED, "scored": "the run's validation split: 6 of 24 images",
            "tta": "none", "classes": classes, "task": task, "report": task}  # fmt: skip


def single_label() -> dict:
    """An eval.json as ``inference.evaluate._single_label`` writes it, from the same metric functions."""
    logits = torch.tensor([[2.0, 0.1, 0.0], [0.2, 1.5, 0.1], [0.1, 0.3, 1.0], [1.0, 0.9, 0.0], [0.0, 2.0, 0.5]])
    labels = torch.tensor([0, 1, 2, 1, 2])
    record = {**_head("classify", CLASSES), **metrics.classification_metrics(logits, labels, CLASSES)}
    losses = metrics.top_losses(logits, labels, 3)
    return {**record, "world_size": 1, "skipped": [], "top_losses": [{**it, "path": f"img{it['index']}.jpg"}
                                                                    for it in losses]}  # fmt: skip


def multi_label() -> dict:
    probs = torch.tensor([[0.9, 0.2, 0.6], [0.1, 0.8, 0.4], [0.7, 0.6, 0.1], [0.3, 0.1, 0.9]])
    targets = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]]).double()
    record = {**_head("multilabel", CLASSES), "thresholds_from": "the run's tuned thresholds"}
    record |= multilabel.multilabel_metrics(probs, targets, CLASSES, [0.5, 0.5, 0.5])
    worst = multilabel.worst_per_class(probs, targets, 2)
    worst_per_class = {c: [{**it, "path": f"img{it['index']}.jpg"} for it in items] for c, items in zip(CLASSES, worst)}
    return {**record, "world_size": 1, "skipped": [], "worst_per_class": worst_per_class}


def regression_record() -> dict:
    true = np.array([[1.0, 10.0], [2.0, 12.0], [3.0, 9.0], [4.0, 15.0]])
    pred = true + np.array([[0.1, -1.0], [0.3, 0.5], [-0.2, 2.0], [0.0, 0.1]])
    names = ["age", "weight"]
    record = {**_head("regress", names), **regression.regression_metrics(pred, true, names)}
    residuals = regression.largest_residuals(pred, true, 2)
    return {**record, "world_size": 1, "skipped": [], "largest_residuals": [{**it, "path": f"img{it['index']}.jpg"}
                                                                           for it in residuals]}  # fmt: skip


KINDS = {"classify": single_label, "multilabel": multi_label, "regress": regression_record}


def bench_record() -> dict:
    """A bench.json as ``reports.bench`` writes it: the load line and one row per strategy, run or not."""
    rows = [
        {"strategy": "single", "processes": 1, "global_batch": 8, "images_per_s": 20.0, "spread": None,
         "speedup": 1.0, "data_stall": 0.1, "val_accuracy": 0.75, "run_dir": "/nowhere/single"},
        {"strategy": "ddp", "processes": 2, "global_batch": 8, "images_per_s": 30.0, "spread": 0.4, "speedup": 1.5,
         "data_stall": 0.05, "val_accuracy": 0.75, "unreliable": "noisy machine", "note": "unreliable: noisy"},
        {"strategy": "dp", "skipped": "needs 2 GPUs"},
    ]  # fmt: skip
    return {"model": "resnet18", "load_note": "Repeats per strategy: 1.", "rows": rows}


def write_run(folder: Path, ev: dict | None = None, bench: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"config": {"model": "resnet18", "epochs": 1}, "data": {"root": "/data", "layout": "folder"}}
    (folder / "config.json").write_text(json.dumps(config))
    for name, record in (("eval.json", ev), ("bench.json", bench)):
        if record is not None:
            (folder / name).write_text(json.dumps(record))
    return folder


def _with(record, path: str, value):
    """``record`` with the value at the dotted ``path`` replaced (a number in it is a list index)."""
    out = json.loads(json.dumps(record))
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[int(key) if isinstance(node, list) else key]
    node[int(last) if isinstance(node, list) else last] = value
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_an_eval_json_of_each_kind_as_its_writer_writes_it_reads_back_and_shows(tmp_path, kind):
    ev = KINDS[kind]()
    run = write_run(tmp_path / "run", ev)
    back = evalrecords.read_evaluation(run / "eval.json")
    shown = {k: v for k, v in ev.items() if k not in ("world_size", "skipped", "split", "own_data")}
    shown = {k: v for k, v in shown.items() if k not in ("confusion_matrix", "confusion_matrix_normalized")}
    shown = {k: v for k, v in shown.items() if k != "thresholds"}  # the page shows each class's, in per_class
    assert back == shown  # every field the page shows kept as written, the rest dropped
    page = report.build(run)
    assert "Not evaluated yet" not in page and "img" in page and "best.safetensors" in page


@pytest.mark.parametrize(
    "kind,path,value,says",
    [
        ("classify", "top_losses.0.true", -1, "top_losses is"),  # shown as the last class before
        ("classify", "top_losses.0.predicted", 7, "top_losses names a class index outside its 3 classes"),
        ("classify", "scored", ["<b>"], "scored is ['<b>'], expected a text"),
        ("classify", "averages", {"macro": [1]}, "averages is {'macro': [1]}"),
        ("multilabel", "worst_per_class.cat.0.positive", "yes", "worst_per_class is"),
        ("multilabel", "thresholds_from", None, "thresholds_from is None"),
        ("regress", "per_target.age", 3, "per_target is"),
        ("regress", "largest_residuals.0.path", {"x": 1}, "largest_residuals is"),
        ("regress", "model_file", "best.safetensors", "model_file is 'best.safetensors'"),
    ],
)
def test_an_eval_json_field_of_the_wrong_type_is_one_line_and_no_page(tmp_path, capsys, kind, path, value, says):
    run = write_run(tmp_path / "run", _with(KINDS[kind](), path, value))
    assert cli.main(["report", str(run)]) == 2
    one_line(capsys, f"{run / 'eval.json'}: damaged run record: ", says)
    assert not (run / "report.html").exists()


@pytest.mark.parametrize(
    "name,text,says",
    [
        ("eval.json", "[" * 100_000, "is not JSON"),  # a RecursionError's traceback before
        ("eval.json", "[1, 2]", "the record is [1, 2], expected a JSON object"),
        ("eval-best.int8.json", '{"report": "classify", "averages": [1]}', "averages is [1]"),  # beside eval.json
        ("bench.json", "[" * 100_000, "is not JSON"),
        ("bench.json", '{"rows": [{"strategy": 3}]}', "rows is [{'strategy': 3}]"),  # an AttributeError before
        ("bench.json", '{"rows": "single"}', "rows is 'single'"),
        ("bench.json", '{"rows": [{"strategy": "ddp", "unreliable": ["load"]}]}', "rows is"),  # unhashable before
    ],
)
def test_a_damaged_eval_or_bench_json_is_one_line_and_no_page(tmp_path, capsys, name, text, says):
    run = write_run(tmp_path / "run", single_label())
    (run / name).write_text(text)
    assert cli.main(["report", str(run)]) == 2
    one_line(capsys, str(run / name), says)
    assert not (run / "report.html").exists()


def test_an_eval_json_larger_than_any_run_writes_is_refused_unread(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", single_label())
    monkeypatch.setattr(runrecords, "MAX_RECORD", 1000)
    (run / "config.json").write_text('{"config": {"model": "resnet18"}}')  # under the bound: only eval.json is over
    assert cli.main(["report", str(run)]) == 2
    one_line(capsys, str(run / "eval.json"), "more than any run writes")


def test_an_eval_json_of_an_evaluation_this_visiontune_does_not_know_is_not_shown(tmp_path):
    run = write_run(tmp_path / "run", {**single_label(), "report": "detect"})
    assert evalrecords.read_evaluation(run / "eval.json") is None
    assert "Not evaluated yet" in report.build(run)


def test_a_png_larger_than_a_page_embeds_is_left_out_with_a_note_and_not_read(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run", single_label())
    (run / "confusion_matrix.png").write_bytes(b"\x89PNG" + b"0" * 200)
    (run / "top_losses.png").write_bytes(b"\x89PNG" + b"1" * 50)
    monkeypatch.setattr(report, "MAX_PNG", 100)
    page = report.build(run)
    assert "confusion_matrix.png is larger than a page embeds" in page
    assert page.count("data:image/png;base64,") == 1  # top_losses.png, under the bound, is embedded


def test_the_bench_table_of_a_bench_json_as_bench_writes_it_is_shown(tmp_path):
    run = write_run(tmp_path / "run", bench=bench_record())
    page = report.build(run)
    assert "not run: needs 2 GPUs" in page and "<td>unreliable</td>" in page and "UNRELIABLE" in page


# Any JSON value, to depth 3: what a damaged or hostile record may hold in any field.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
EVAL_PATHS = {
    "classify": ["report", "task", "data", "scored", "tta", "classes", "classes.0", "model_file", "model_file.name",
                 "averages", "averages.macro", "averages.macro.f1", "images", "accuracy", "top_k", "ece_bins",
                 "per_class", "per_class.cat", "per_class.cat.recall", "top_losses", "top_losses.0",
                 "top_losses.0.true", "top_losses.0.path", "top_losses.1.probability"],
    "multilabel": ["report", "scored", "tta", "thresholds_from", "map", "per_class", "per_class.dog",
                   "per_class.dog.ap", "worst_per_class", "worst_per_class.cat", "worst_per_class.cat.0",
                   "worst_per_class.cat.0.path", "worst_per_class.fox.1.positive", "averages.micro"],
    "regress": ["report", "data", "scored", "mae", "r2", "count", "per_target", "per_target.age",
                "per_target.age.mae", "largest_residuals", "largest_residuals.0", "largest_residuals.0.error",
                "largest_residuals.1.path", "model_file"],
}  # fmt: skip
BENCH_PATHS = ["load_note", "rows", "rows.0", "rows.0.strategy", "rows.0.speedup", "rows.1.unreliable",
               "rows.1.note", "rows.2.skipped", "rows.0.run_dir", "rows.1.images_per_s"]  # fmt: skip


def _changed(record, changes):
    for path, value in changes:
        try:
            record = _with(record, path, value)
        except (TypeError, KeyError, IndexError, ValueError):  # a parent already replaced by another value
            pass
    return record


@fuzz_settings(80)
@given(st.sampled_from(sorted(KINDS)), st.data())
def test_fuzz_any_eval_json_field_gives_a_page_or_one_line(kind, data):
    changes = data.draw(st.lists(st.tuples(st.sampled_from(EVAL_PATHS[kind]), JSON), max_size=3))
    with tempfile.TemporaryDirectory() as folder:
        run = write_run(Path(folder) / "run", _changed(KINDS[kind](), changes))
        try:
            report.build(run)
        except UserError as e:
            assert "\n" not in str(e) and len(str(e)) < 1000


@fuzz_settings(60)
@given(st.lists(st.tuples(st.sampled_from(BENCH_PATHS), JSON), max_size=3), st.binary(max_size=32))
def test_fuzz_any_bench_json_gives_a_page_or_one_line(changes, tail):
    with tempfile.TemporaryDirectory() as folder:
        run = write_run(Path(folder) / "run", single_label())
        (run / "bench.json").write_bytes(json.dumps(_changed(bench_record(), changes)).encode() + tail)
        try:
            report.build(run)
        except UserError as e:
            assert "\n" not in str(e) and len(str(e)) < 1000
