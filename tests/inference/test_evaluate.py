"""visiontune evaluate: the numbers equal a hand computation from an independent forward pass,
--nproc 2 gives exactly the same numbers, unreadable files are left out and listed, the run's own
data is scored on its validation split by default, and the top losses are the worst images."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from sklearn import metrics as skm

from trained import independent_eval, one_thread, reference_probs  # noqa: F401  (one_thread: autouse)
from trainrun import PYTHON, flags
from visiontune.cli.commands import main
from visiontune.inference.evaluate import recorded_data
from visiontune.tasks import AUTO

CLASSES = ["cat", "dog"]


@pytest.fixture(scope="module")
def run(trained_run) -> Path:
    return trained_run  # one training for the predict, evaluate and export tests (read-only)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, sample_data) -> tuple[Path, list[Path], list[int]]:
    """13 cats and 10 dogs in PetImages' Cat/ and Dog/ folders (a layout train accepts), plus one corrupt dog."""
    root = tmp_path_factory.mktemp("labelled") / "pets"
    paths, labels = [], []
    for label, (name, count) in enumerate((("cat", 13), ("dog", 10))):
        folder = root / name.capitalize()
        folder.mkdir(parents=True)
        for src in sorted((sample_data / "train").glob(f"{name}.*.jpg"))[:count]:
            shutil.copy(src, folder / src.name)
        for p in sorted(folder.iterdir()):
            paths.append(p)
            labels.append(label)
    (root / "Dog" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    return root, paths, labels


def hand_metrics(run: Path, paths: list[Path], labels: list[int]) -> dict:
    probs = reference_probs(run, paths).tolist()
    preds = [max(range(2), key=row.__getitem__) for row in probs]
    confusion = [[sum(1 for t, p in zip(labels, preds) if t == i and p == j) for j in range(2)] for i in range(2)]
    return {
        "accuracy": sum(t == p for t, p in zip(labels, preds)) / len(labels),
        "log_loss": -sum(math.log(row[t]) for row, t in zip(probs, labels)) / len(labels),
        "confusion_matrix": confusion,
        "precision": [confusion[c][c] / (confusion[0][c] + confusion[1][c]) for c in range(2)],
        "recall": [confusion[c][c] / sum(confusion[c]) for c in range(2)],
    }


@pytest.fixture(scope="module")
def report(run, labelled, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "eval.json"
    rc = main(["evaluate", *flags(run=run, data=labelled[0], out=out, no_progress=True, batch_size=5)])
    return rc, out


@pytest.mark.slow
def test_numbers_equal_a_hand_computation(run, labelled, report):
    root, paths, labels = labelled
    rc, out = report
    assert rc == 1  # one file was unreadable
    got = json.loads(out.read_text())
    want = hand_metrics(run, paths, labels)
    assert got["classes"] == CLASSES and got["images"] == 23
    assert got["confusion_matrix"] == want["confusion_matrix"]
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-12)
    assert got["log_loss"] == pytest.approx(want["log_loss"], abs=1e-5)
    for c, name in enumerate(CLASSES):
        assert got["per_class"][name]["precision"] == pytest.approx(want["precision"][c], abs=1e-12)
        assert got["per_class"][name]["recall"] == pytest.approx(want["recall"][c], abs=1e-12)
        assert got["per_class"][name]["support"] == labels.count(c)
    assert got["split"] == "all" and got["own_data"] is False and got["scored"].startswith("all 23 images")
    preds = [0 if p0 > p1 else 1 for p0, p1 in reference_probs(run, paths).tolist()]
    assert got["balanced_accuracy"] == pytest.approx(skm.balanced_accuracy_score(labels, preds), abs=1e-12)
    assert got["averages"]["macro"]["f1"] == pytest.approx(skm.f1_score(labels, preds, average="macro"), abs=1e-12)
    [skipped] = got["skipped"]
    assert skipped["path"] == str(root / "Dog" / "zz_broken.jpg") and "JPEG" in skipped["reason"]
    assert (out.parent / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_table_printed(run, labelled, tmp_path, capsys):
    _, paths, labels = labelled
    main(
        ["evaluate", "--run", str(run), "--data", str(labelled[0]), "--out", str(tmp_path / "e.json"), "--no-progress"]
    )
    captured = capsys.readouterr()
    (tn, fp), (fn, tp) = hand_metrics(run, paths, labels)["confusion_matrix"]
    lines = captured.out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("confusion matrix"))
    # Counts with the share of the true class beside them: cat has 13 images, dog 10 readable ones.
    assert [line.split() for line in lines[at + 1 : at + 4]] == [
        ["0", "1"],
        ["0", "cat", str(tn), f"({tn / 13:.0%})", str(fp), f"({fp / 13:.0%})"],
        ["1", "dog", str(fn), f"({fn / 10:.0%})", str(tp), f"({tp / 10:.0%})"],
    ]
    assert "scored all 23 images (not the run's own data)" in captured.out
    assert "zz_broken.jpg" in captured.err


@pytest.mark.slow
def test_top_losses_are_the_wrong_images_with_the_highest_loss(run, labelled, report):
    import csv
    import math

    _, paths, labels = labelled
    probs = reference_probs(run, paths).tolist()
    wrong = [(-math.log(p[t]), str(path), p) for path, t, p in zip(paths, labels, probs) if p[t] < 0.5]
    want = sorted(wrong, reverse=True)[:16]
    with open(report[1].parent / "top_losses.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == [w[1] for w in want]
    for r, (loss, _, p) in zip(rows, want):
        assert float(r["loss"]) == pytest.approx(loss, abs=1e-4)
        assert float(r["probability"]) == pytest.approx(max(p), abs=1e-4) and r["true"] != r["predicted"]
    assert (report[1].parent / "top_losses.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_runs_own_data_is_scored_on_its_validation_split(run, sample_data, tmp_path, capsys):
    run = Path(shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints")))  # shared: copy
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 0  # no --data: the run's own (config.json)
    got = json.loads((run / "eval.json").read_text())
    split = json.loads((run / "split.json").read_text())
    loss, accuracy, n = independent_eval(run, sample_data)
    assert (got["split"], got["own_data"], got["images"]) == ("val", True, n) and n == len(split["val"])
    assert got["accuracy"] == pytest.approx(accuracy, abs=1e-12) and got["log_loss"] == pytest.approx(loss, abs=1e-5)
    assert f"scored the run's validation split: {n} of 120 images" in capsys.readouterr().out
    assert "Scored: the run&#x27;s validation split" in (run / "report.html").read_text()  # refreshed
    assert (
        main(
            [
                "evaluate",
                *flags(run=run, data=sample_data, no_progress=True, split="train", out=run / "train-eval.json"),
            ]
        )
        == 0
    )
    assert json.loads((run / "train-eval.json").read_text())["images"] == len(split["train"])


@pytest.mark.slow
def test_split_on_other_data_is_a_user_error(run, labelled, tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["evaluate", *flags(run=run, data=labelled[0], split="val", out=out, no_progress=True)]) == 2
    err = capsys.readouterr().err
    assert "--split val needs the run's own data" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_give_exactly_the_same_numbers(run, labelled, report, tmp_path, worker_env):
    """The command from a shell that sets no OMP_NUM_THREADS: its launching process loads the model with torch
    on every core, and workers forked from it then hung at their first op (OpenMP's team, without its
    threads); they start as new interpreters instead, and each leaves its process group before it exits
    (left to the exit, its threads could abort a finished worker)."""
    import subprocess

    out = tmp_path / "eval.json"
    # 24 files in batches of 5 per process: the last round is ragged and padded by Accelerate.
    argv = ["evaluate", *flags(run=run, data=labelled[0], out=out, no_progress=True, batch_size=5, nproc=2)]
    env = {k: v for k, v in worker_env.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([PYTHON, "-m", "visiontune", *argv], env=env, capture_output=True, text=True, timeout=300)
    # 1: the unreadable file, reported by the launching process; no worker failed.
    assert done.returncode == 1 and "worker rank" not in done.stderr, done.stderr[-3000:]
    single, multi = json.loads(report[1].read_text()), json.loads(out.read_text())
    assert multi.pop("world_size") == 2 and single.pop("world_size") == 1
    assert multi == single


@pytest.mark.slow
def test_classes_must_match_the_run(run, tmp_path, sample_data, capsys):
    for name in ("cat", "fox"):
        (tmp_path / "data" / name).mkdir(parents=True)
        shutil.copy(next((sample_data / "train").glob("cat.*.jpg")), tmp_path / "data" / name / "a.jpg")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir())
    assert main(["evaluate", "--run", str(run), "--data", str(tmp_path / "data"), "--no-progress"]) == 2
    assert "['cat', 'fox'] but the model was trained on ['cat', 'dog']" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir()) == before  # nothing written


@pytest.mark.slow
def test_without_data_a_run_whose_data_is_gone_is_one_line(run, tmp_path, capsys):
    run = Path(shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints")))
    record = json.loads((run / "config.json").read_text())
    record["data"]["root"] = record["data"]["source"] = str(tmp_path / "moved")
    (run / "config.json").write_text(json.dumps(record))
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the run's data {tmp_path / 'moved'} no longer exists; pass --data" in err
    assert not (run / "eval.json").exists()


def test_without_data_the_run_lists_what_training_was_given_and_an_older_manifest_run_says_pass_data(tmp_path, capsys):
    # A manifest run's root is its images' folder (DATA/train), which is not a layout: evaluate lists the
    # recorded source, DATA itself; a run from before "source" was recorded gets one line, nothing written.
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "train.csv").write_text("filename,label\n")
    record = {"config": {"image_column": None}, "data": {"root": str(data / "train"), "layout": "manifest"}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**record, "data": {**record["data"], "source": str(data)}}))
    assert recorded_data(str(run)) == (str(data), (None, None))
    (run / "config.json").write_text(json.dumps(record))
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained on a manifest" in err and "pass --data" in err
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


@pytest.mark.slow
def test_an_exported_model_s_evaluation_goes_beside_the_run_s_own_and_each_names_its_file(
    exported_onnx, tmp_path, capsys
):
    """`evaluate --run R --weights R/best.onnx` writes R/eval-best.json (and its figures, named after it) beside
    R/eval.json, which it leaves as it was; each records the file it scored (name, sha256), and the report
    shows both side by side while its detailed section stays the run's own evaluation."""
    import hashlib

    # The shared run's copy that `export --format onnx` (no --out) wrote its best.onnx into (conftest.py).
    run = Path(shutil.copytree(exported_onnx.parent, tmp_path / "run"))
    assert sorted(p.name for p in run.glob("*.onnx")) == ["best.onnx"]
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 0
    own = {name: (run / name).read_bytes() for name in ("eval.json", "confusion_matrix.png", "top_losses.csv")}
    assert main(["evaluate", "--run", str(run), "--weights", str(run / "best.onnx"), "--no-progress"]) == 0
    assert {name: (run / name).read_bytes() for name in own} == own  # the run's own evaluation untouched
    exported = json.loads((run / "eval-best.json").read_text())
    assert (run / "eval-best-confusion_matrix.png").is_file() and (run / "eval-best-top_losses.csv").is_file()
    for ev, file in ((json.loads(own["eval.json"]), "best.safetensors"), (exported, "best.onnx")):
        assert ev["model_file"] == {"name": file, "sha256": hashlib.sha256((run / file).read_bytes()).hexdigest()}
    page = (run / "report.html").read_text()
    side = page[page.index("<h3>Side by side</h3>") : page.index("</table>", page.index("<h3>Side by side</h3>"))]
    assert "eval.json" in side and "eval-best.json" in side and "best.safetensors" in side and "best.onnx" in side
    assert exported["model_file"]["sha256"][:12] in side
    assert "<p>Model file: best.safetensors (sha256" in page  # the detailed section: the run's own evaluation
    assert "wrote " + str(run / "eval-best.json") in capsys.readouterr().out


# A run folder from someone else: evaluate reads its config.json and split.json through runs.runrecords.


@pytest.mark.parametrize(
    "data,says",
    [
        ("a folder", "data is 'a folder'"),  # before: "records no data folder", not what is wrong
        ({"root": 5, "layout": "folder"}, "data is {'root': 5"),  # before: a traceback from the data sources
    ],
)
def test_without_data_a_damaged_config_json_is_one_line_naming_the_field(tmp_path, capsys, data, says):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {}, "data": data}))
    assert main(["evaluate", "--run", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'config.json'}: damaged run record: {says}" in err


@pytest.mark.parametrize(
    "record,says",
    [
        ({"seed": 0, "val_fraction": 0.2, "sha256": "x", "val": 5, "train": []}, "val is 5"),  # before: TypeError
        ({"seed": "zero", "val_fraction": 0.2, "sha256": "x", "val": [], "train": []}, "seed is 'zero'"),
        ([], "the record is []"),  # before: taken for no split.json
    ],
)
@pytest.mark.parametrize("recorded", ["same", "other"])  # the run's data as recorded, or moved: told by the hash
def test_a_damaged_split_json_is_one_line_naming_the_field(tmp_path, sample_data, record, says, recorded):
    from visiontune.data.sources import discover
    from visiontune.errors import UserError
    from visiontune.inference.evaluate import select

    images = discover(str(sample_data), task=AUTO)
    run = tmp_path / "run"
    run.mkdir()
    root = images.root if recorded == "same" else str(tmp_path / "moved")
    (run / "config.json").write_text(json.dumps({"config": {}, "data": {"root": root}}))
    (run / "split.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match="damaged run record") as e:
        select(images, str(run), "val")
    assert str(run / "split.json") in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_a_split_json_larger_than_any_run_writes_is_refused_unread(tmp_path, sample_data, monkeypatch):
    from visiontune.data.sources import discover
    from visiontune.errors import UserError
    from visiontune.inference.evaluate import select
    from visiontune.runs import runrecords

    images = discover(str(sample_data), task=AUTO)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {}, "data": {"root": images.root}}))
    (run / "split.json").write_text(json.dumps({"val": [], "train": []}))
    monkeypatch.setattr(runrecords, "MAX_SPLIT", 10)
    with pytest.raises(UserError, match="more than any run writes"):
        select(images, str(run), "val")


@pytest.mark.parametrize(
    "text,says", [("[" * 100_000, "is not JSON"), ('{"model": "resnet18"}', "model is 'resnet18'")]
)
def test_a_damaged_config_json_is_one_line_before_the_model_loads(tmp_path, sample_data, capsys, text, says):
    """The run's description (runrecords.read_run): before, an array nested past the parser was a traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(text)
    (run / "classes.json").write_text('["cat", "dog"]')
    assert main(["evaluate", "--run", str(run), "--data", str(sample_data), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(run / "config.json") in err and says in err


# evaluate --nproc N: the workers wrote eval.json, and the launching process reads back how many images they
# skipped through the run folder's reader (runs.evalrecords): bounded, checked, one line when damaged.
@pytest.mark.slow
@pytest.mark.parametrize(
    "text,says",
    [
        ("[" * 100_000, "is not JSON"),  # before: RecursionError, a traceback
        ('{"skipped": 5}', "skipped is 5"),  # before: exit 1, "5 skipped" taken as true
        ('{"skipped": [{"path": 7}]}', "skipped is [{'path': 7}]"),  # before: exit 1
        ('{"report": "classify"}', "no list of the images it skipped"),  # before: KeyError, a traceback
        ('{"skipped": []}' + " " * 300_000, "more than any run writes"),  # (the bound lowered)
        (None, "no list of the images it skipped"),  # none written: before, FileNotFoundError
    ],
)
def test_a_damaged_eval_json_after_a_launched_evaluate_is_one_line(run, tmp_path, monkeypatch, capsys, text, says):
    from visiontune.cluster import launch
    from visiontune.runs import runrecords

    out = tmp_path / "eval.json"

    def workers(cfg, argv, command):
        if text is not None:
            out.write_text(text)
        monkeypatch.setattr(runrecords, "MAX_RECORD", 200_000)  # (the run's own config.json was read at its size)
        return 0

    monkeypatch.setattr(launch, "needs_launcher", lambda *a: True)
    monkeypatch.setattr(launch, "relaunch", workers)
    argv = ["evaluate", "--run", str(run), "--data", str(tmp_path), "--out", str(out), "--nproc", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and says in err, err


def _own_run(tmp_path, images) -> tuple[Path, dict]:
    """A run folder of ``images`` (recorded at their folder) with the split.json training writes."""
    from visiontune.data.split import split_of, split_record

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {}, "data": {"root": images.root}}))
    record = split_record(split_of(images, 0.2, 0), images.paths, images.root, 0, 0.2)
    (run / "split.json").write_text(json.dumps(record))
    (run / "bad_files.csv").write_text("path,reason\n")  # none: every image of the data was split
    return run, record


@pytest.mark.parametrize("recorded", ["same", "other"])  # the run's data as recorded, or moved: told by the hash
def test_a_split_json_whose_lists_do_not_match_its_sha256_is_one_line(tmp_path, sample_data, recorded):
    """--split val scores the run's held-out images: a val list edited after training (training images moved
    into it) no longer hashes to the sha256 the run wrote. Before: scored, silently, as the val split."""
    from visiontune.data.sources import discover
    from visiontune.errors import UserError
    from visiontune.inference.evaluate import select

    images = discover(str(sample_data), task=AUTO)
    run, record = _own_run(tmp_path, images)
    if recorded == "other":
        (run / "config.json").write_text(json.dumps({"config": {}, "data": {"root": str(tmp_path / "moved")}}))
    chosen, scored = select(images, str(run), "val")
    assert (len(chosen), scored["split"]) == (len(record["val"]), "val")
    edited = {**record, "val": record["val"] + record["train"][:10], "train": record["train"][10:]}
    (run / "split.json").write_text(json.dumps(edited))
    with pytest.raises(UserError) as e:
        select(images, str(run), "val")
    said = str(e.value)
    assert str(run / "split.json") in said and "do not match its sha256" in said and "\n" not in said


@pytest.mark.slow
def test_evaluate_refuses_a_val_split_edited_after_training(run, tmp_path, capsys):
    """The trained run's split.json, its val list given training images: one line, exit 2, nothing written."""
    run = Path(shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints", "eval*.json")))
    record = json.loads((run / "split.json").read_text())
    record["val"], record["train"] = record["val"] + record["train"][:20], record["train"][20:]
    (run / "split.json").write_text(json.dumps(record))
    assert main(["evaluate", "--run", str(run), "--split", "val", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'split.json'}: its file lists do not match its sha256" in err, err
    assert not (run / "eval.json").exists()


def test_a_damaged_bad_files_csv_of_a_moved_run_is_one_line(tmp_path, sample_data):
    """Told by the hash whether moved data is the run's own, its bad_files.csv is read: a cell over csv's field
    limit was a csv.Error traceback before."""
    from visiontune.data.sources import discover
    from visiontune.errors import UserError
    from visiontune.inference.evaluate import select

    images = discover(str(sample_data), task=AUTO)
    run, _ = _own_run(tmp_path, images)
    (run / "config.json").write_text(json.dumps({"config": {}, "data": {"root": str(tmp_path / "moved")}}))
    (run / "bad_files.csv").write_text("path,reason\n" + "x" * 200_000 + ",bad\n")
    with pytest.raises(UserError) as e:
        select(images, str(run), "val")
    assert f"{run / 'bad_files.csv'}: damaged run record: not a CSV" in str(e.value) and "\n" not in str(e.value)


def test_a_bad_files_csv_of_a_moved_run_past_its_bound_is_one_line(tmp_path, sample_data, monkeypatch):
    """Its bad_files.csv is read bounded: past the bound one line naming it; under it, the val split scored."""
    from bounded import past_and_under
    from visiontune.data.sources import discover
    from visiontune.inference.evaluate import select
    from visiontune.runs import runrecords

    images = discover(str(sample_data), task=AUTO)
    run, record = _own_run(tmp_path, images)
    (run / "config.json").write_text(json.dumps({"config": {}, "data": {"root": str(tmp_path / "moved")}}))
    (run / "bad_files.csv").write_text("path,problem\n")  # 13 bytes
    read = lambda: select(images, str(run), "val")  # noqa: E731
    chosen, scored = past_and_under(monkeypatch, runrecords, "MAX_BAD_FILES", 10, read, "bad_files.csv", "is 13 bytes")
    assert (len(chosen), scored["split"], scored["own_data"]) == (len(record["val"]), "val", True)
