"""``visiontune audit`` on sklearn's real scanned digits with planted faults: flipped labels ranked near the
top, every planted copy grouped (as a leak where it spans train and val), the files it writes, a stopped
audit resumed to the same rows, each fold the run ``train --folds K --fold I`` makes, and bad input refused
in one line before anything is written."""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from digits import write_digits
from trainrun import run, start
from visiontune.cli.commands import main
from visiontune.tasks import AUTO

# Small and fixed: timm's test_resnet from scratch at 16 px, 3 epochs at lr 0.01, one thread (the same sums in
# every run). Its folds train in a third of resnet18's time and rank the flipped labels as well.
FLAGS = [
    *("--model", "timm/test_resnet", "--weights", "none", "--image-size", "16", "--epochs", "3"),
    *("--batch-size", "32", "--lr", "0.01", "--num-workers", "0", "--threads", "1", "--no-progress"),
]
HOSTILE = "<img src=x onerror=document.title='pwned'>"
TOP = 150  # the audit's top list: about 1.5 times the flipped files


def _rows(out: Path) -> list[dict]:
    with open(out / "audit.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    planted = write_digits(root / "data", seed=0, hostile=HOSTILE)
    out = root / "audit"
    # Two folds: each image is scored by a model that trained on the other half (half the training of three).
    assert main(["audit", str(planted.root), "--folds", "2", "--out", str(out), *FLAGS]) == 0
    return planted, out


@pytest.mark.slow
def test_flipped_labels_rank_near_the_top(audited):
    planted, out = audited
    labels = [r for r in _rows(out) if r["kind"] == "label"]
    scores = [float(r["score"]) for r in labels]
    assert scores == sorted(scores)  # worst label quality first
    top = {r["file"] for r in labels[:TOP]}
    recall = len(top & planted.flipped) / len(planted.flipped)
    assert recall >= 0.7, (recall, len(labels))
    for r in labels:  # each row says what the label is and what the folds' models make of it
        assert r["given"] == r["file"].split("/")[0] and r["suggested"] != r["given"]
        assert 0.0 < float(r["probability"]) <= 1.0


@pytest.mark.slow
def test_every_planted_copy_is_grouped_and_leaks_are_the_ones_across_the_split(audited):
    from visiontune.data.groups import split_for
    from visiontune.data.sources import discover
    from visiontune.data.split import relative_paths
    from visiontune.settings.config import TrainConfig

    planted, out = audited
    rows = [r for r in _rows(out) if r["kind"] in ("duplicate", "leak")]
    group = {r["file"]: r["group"] for r in rows}
    for original, copy in planted.copies:
        assert group.get(original) is not None and group.get(original) == group.get(copy), (original, copy)
    # The split train would make with these flags, computed here on its own.
    images = discover(str(planted.root), task=AUTO)
    split, _ = split_for(images, TrainConfig(data=str(planted.root)))
    names = relative_paths(images.paths, range(len(images)), images.root)
    side = {names[i]: "train" for i in split.train} | {names[i]: "val" for i in split.val}
    spans = 0
    for original, copy in planted.copies:
        across = {side[original], side[copy]} == {"train", "val"}
        spans += across
        for name in (original, copy):
            row = next(r for r in rows if r["file"] == name)
            assert row["split"] == side[name]
            assert row["kind"] == ("leak" if across else "duplicate"), (name, across)
    assert spans > 0  # the check above saw both kinds
    assert len({r["group"] for r in rows}) == len(planted.copies)  # no scan of the data is taken for a copy


@pytest.mark.slow
def test_the_json_counts_the_csv_and_the_settings(audited):
    planted, out = audited
    summary = json.loads((out / "audit.json").read_text())
    rows = _rows(out)
    assert summary["counts"] == {
        k: sum(r["kind"] == k for r in rows) for k in ("label", "leak", "duplicate", "outlier")
    }
    assert summary["images"] == summary["scored"] == 1797 + 20
    assert summary["settings"]["folds"] == 2 and summary["versions"]["cleanlab"]
    # Every image was scored by the one fold that held it out: the folds' validation lists are a partition.
    held = [json.loads((out / "folds" / f"fold-{k}" / "split.json").read_text())["val"] for k in range(2)]
    assert sorted(sum(held, [])) == sorted({*sum(held, [])}) and len(sum(held, [])) == 1797 + 20


@pytest.mark.slow
@pytest.mark.browser
def test_the_page_in_a_headless_browser_escapes_names(audited, tmp_path):
    from browser import CHECK, dump_dom

    planted, out = audited
    text = (out / "audit.html").read_text()
    assert HOSTILE not in text and "&lt;img src=x" in text
    page = tmp_path / "page.html"
    page.write_text(text.replace("</body>", CHECK + "</body>"))
    done = dump_dom(page, tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "<title>visiontune audit</title>" in done.stdout  # the hostile name's handler never ran
    shown = int(done.stdout.split('data-images="')[1].split('"')[0])
    assert shown >= 40 and 'data-broken="0"' in done.stdout


def _small(root: Path):
    return write_digits(root, seed=1, per_class=24, copies=4)


SMALL = [*FLAGS[:7], "1", *FLAGS[8:]]  # one epoch


@pytest.mark.slow
def test_a_killed_audit_resumes_to_the_same_rows(tmp_path, worker_env):
    planted = _small(tmp_path / "data")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert main(["audit", str(planted.root), "--folds", "3", "--out", str(whole), *SMALL]) == 0
    argv = ["audit", str(planted.root), "--folds", "3", "--out", str(stopped), *SMALL]
    # A real process, forked from one holding the imports where it can be (tests/zygote.py).
    proc = start([sys.executable, "-m", "visiontune", *argv], worker_env, tmp_path / "stopped.log")
    first = stopped / "folds" / "fold-0" / "oof.npz"
    while not first.exists() and proc.poll() is None:  # killed in fold 1, after fold 0 was scored
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert first.exists() and not (stopped / "audit.csv").exists()
    assert main(argv) == 2  # a stopped audit is continued only when asked
    before = first.stat().st_mtime_ns
    assert main([*argv, "--resume", "auto"]) == 0
    assert first.stat().st_mtime_ns == before  # fold 0 was read back, not trained again
    assert (stopped / "audit.csv").read_text() == (whole / "audit.csv").read_text()


@pytest.mark.slow
def test_each_fold_is_the_run_train_makes_of_it(tmp_path):
    from safetensors.torch import load_file

    planted = _small(tmp_path / "data")
    out = tmp_path / "audit"
    assert main(["audit", str(planted.root), "--folds", "2", "--out", str(out), *SMALL]) == 0
    run = tmp_path / "fold1"
    assert (
        main(["train", "--data", str(planted.root), "--folds", "2", "--fold", "1", "--output-dir", str(run), *SMALL])
        == 0
    )
    mine, theirs = load_file(out / "folds" / "fold-1" / "best.safetensors"), load_file(run / "best.safetensors")
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    # Its probabilities are of that run's validation images, and only of them.
    from visiontune.data.sources import discover
    from visiontune.data.split import relative_paths

    images = discover(str(planted.root), task=AUTO)
    names = relative_paths(images.paths, range(len(images)), images.root)
    with np.load(out / "folds" / "fold-1" / "oof.npz") as z:
        scored = {names[i] for i in z["index"]}
        assert np.allclose(z["probs"].sum(1), 1.0, atol=1e-5)
    assert scored == set(json.loads((run / "split.json").read_text())["val"])


def _pngs(folder: Path, n: int, value: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(np.full((8, 8, 3), (value + 37 * i) % 256, np.uint8)).save(folder / f"{i}.png")


def _refused(capsys, argv: list[str], says: str, out: Path) -> None:
    capsys.readouterr()
    assert main(["audit", *argv, "--out", str(out), *FLAGS]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("case", ["no labels", "one class", "fewer images than folds", "undecodable test image"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, case, no_scan):
    data = tmp_path / "data"
    extra: list[str] = []
    if case == "no labels":
        _pngs(data, 6)
        says = "one subfolder per class"
    elif case == "one class":
        _pngs(data / "cat", 6)
        says = "only one class"
    elif case == "fewer images than folds":
        _pngs(data / "cat", 2)
        _pngs(data / "dog", 2, 100)
        extra = ["--folds", "5"]
        says = "--folds 5 needs at least 5 images"
    else:
        _pngs(data / "cat", 6)
        _pngs(data / "dog", 6, 100)
        (tmp_path / "test").mkdir()
        (tmp_path / "test" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
        extra = ["--test", str(tmp_path / "test")]
        says = "broken.jpg cannot be decoded"
    _refused(capsys, [str(data), *extra], says, tmp_path / "out")


@pytest.mark.slow
@pytest.mark.distributed
def test_each_fold_trains_under_ddp_and_scores_its_own_fold(tmp_path, worker_env):
    from visiontune.data.sources import discover
    from visiontune.data.split import relative_paths

    planted = _small(tmp_path / "data")
    out = tmp_path / "audit"
    flags = [*SMALL[: SMALL.index("--batch-size")], "--batch-size", "16", *SMALL[SMALL.index("--batch-size") + 2 :]]
    argv = ["audit", str(planted.root), "--folds", "2", "--out", str(out), "--strategy", "ddp", "--nproc", "2"]
    # The command, as a user starts it (forked from a process holding its imports: tests/zygote.py), so that each
    # fold's workers are forks of it, not new interpreters (those of a job started from Python, which
    # tests/training/test_strategies.py runs).
    done = run([sys.executable, "-m", "visiontune", *argv, *flags], worker_env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    images = discover(str(planted.root), task=AUTO)
    names = relative_paths(images.paths, range(len(images)), images.root)
    for fold in (0, 1):
        folder = out / "folds" / f"fold-{fold}"
        assert json.loads((folder / "config.json").read_text())["setup"]["world_size"] == 2
        with np.load(folder / "oof.npz") as z:
            assert {names[i] for i in z["index"]} == set(json.loads((folder / "split.json").read_text())["val"])
            assert np.allclose(z["probs"].sum(1), 1.0, atol=1e-5)
    assert json.loads((out / "audit.json").read_text())["scored"] == len(images)


@pytest.mark.slow
def test_multi_label_and_regression_data_are_audited_by_their_task(tmp_path):
    from visiontune.audit import issues, pages
    from visiontune.data.sample import make_multilabel_data, make_regression_data

    make_multilabel_data(tmp_path / "ml", count=80, size=16)
    make_regression_data(tmp_path / "rg", count=80, size=16)
    for data, extra in (("ml", []), ("rg", ["--task", "regress"])):
        out = tmp_path / f"{data}-audit"
        assert main(["audit", str(tmp_path / data), "--folds", "2", "--out", str(out), *SMALL, *extra]) == 0
        summary = json.loads((out / "audit.json").read_text())
        assert summary["task"] == {"ml": "multilabel", "rg": "regress"}[data] and summary["scored"] == 80
    labels = [r for r in _rows(tmp_path / "ml-audit") if r["kind"] == "label"]
    classes = {"red", "green", "blue", "yellow"}
    assert labels and all(set(r["given"].split(";")) <= classes | {""} for r in labels)
    # A regression's label rows: the largest out-of-fold errors, numbers in and out, and the page shows them.
    given = np.full((20, 1), 0.5)
    given[:, 0] += np.random.default_rng(0).uniform(-0.02, 0.02, 20).round(3)
    given[7] = 0.9
    images = type("Targets", (), {"targets": given})()
    rows = issues.LABELS["regress"](images, [f"f{i}" for i in range(20)], np.full((20, 1), 0.5), np.arange(20))
    assert [(r["file"], r["given"], r["suggested"]) for r in rows] == [("f7", "0.9", "0.5")]
    assert "0.9 → 0.5</b>" in pages.page(
        rows, {**summary, "counts": {"label": 1, "leak": 0, "duplicate": 0, "outlier": 0}}, str
    )


@pytest.mark.parametrize(
    "argv,said",
    [
        (["audit"], "give the data to audit: visiontune audit DATA"),
        (["audit", "a", "--data", "b"], "give the data once: DATA or --data DATA"),
    ],
)
def test_the_data_is_given_once_or_the_audit_is_one_line(argv, said, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"visiontune: error: {said}"] and not (tmp_path / "out").exists()
