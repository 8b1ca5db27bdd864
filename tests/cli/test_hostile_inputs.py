"""Hostile input that once ended in a traceback, a false claim or a file outside the run: one line and exit 2,
or a run that goes on and records what it skipped."""

from __future__ import annotations

import csv
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

import trainrun
from conftest import FAST
from trainrun import (
    SQUEEZENET,
    TINY,
    assert_same_weights,
    env_for,
    final_weights,
    flags,
    one_line,
    tiny_train,
    train_argv,
)
from visiontune import cli
from visiontune.cluster import strategy
from visiontune.data.sample import make_sample_data
from visiontune.runs import records
from visiontune.settings.config import TrainConfig

FLOATS = sorted(n for n, k in get_type_hints(TrainConfig).items() if float in (k, *get_args(k)))


def test_the_float_settings_are_the_ones_expected():
    # The non-finite test below runs over FLOATS; if the hints stopped naming floats it would test nothing.
    assert {"lr", "momentum", "timeout", "val_fraction", "max_bad_fraction", "mixup"} <= set(FLOATS)


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("name", FLOATS)
def test_a_config_file_with_a_non_finite_float_is_refused(tmp_path, small_data, capsys, no_scan, name, value):
    (tmp_path / "c.toml").write_text(f"{name} = {value}\n")  # TOML reads nan and inf as floats
    assert cli.main([*tiny_train(small_data, tmp_path / "run"), "--config", str(tmp_path / "c.toml")]) == 2
    one_line(capsys, f"--{name.replace('_', '-')} must be a finite number")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--lr", "--timeout", "--ema", "--max-bad-fraction"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_float_flag_is_refused(tmp_path, small_data, capsys, no_scan, flag, value):
    assert cli.main(tiny_train(small_data, tmp_path / "run", flag, value)) == 2
    one_line(capsys, flag, "must be a finite number", repr(value))


@pytest.mark.parametrize(
    "argv",
    [
        ["lr-find", "--end-lr", "inf"],  # 0 < start < end held for inf: the sweep ran into nan losses
        ["lr-find", "--start-lr", "nan"],
    ],
)
def test_lr_find_refuses_a_non_finite_sweep(tmp_path, small_data, capsys, no_scan, argv):
    assert cli.main([*argv, "--data", str(small_data), "--output-dir", str(tmp_path / "run"), *FAST]) == 2
    one_line(capsys, argv[1], "must be a finite number")


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(10**30)])
def test_a_seed_numpy_cannot_take_is_refused_as_a_flag(tmp_path, small_data, capsys, no_scan, seed):
    assert cli.main(tiny_train(small_data, tmp_path / "run", "--seed", seed)) == 2
    one_line(capsys, "--seed", "from 0 to 4294967295", seed)


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_refused_in_a_config_file(tmp_path, small_data, capsys, no_scan, seed):
    (tmp_path / "c.toml").write_text(f"seed = {seed}\n")
    assert cli.main([*tiny_train(small_data, tmp_path / "run"), "--config", str(tmp_path / "c.toml")]) == 2
    one_line(capsys, "--seed must be an integer from 0 to 4294967295", str(seed))


def test_sample_data_refuses_a_negative_seed(tmp_path, capsys):
    assert cli.main(["sample-data", str(tmp_path / "d"), "--seed", "-1"]) == 2
    one_line(capsys, "--seed", "from 0 to 4294967295")
    assert not (tmp_path / "d").exists()


def test_the_seeds_at_both_ends_are_accepted(small_data):
    from visiontune.settings.validation import validate

    for seed in (0, 2**32 - 1):
        assert validate(TrainConfig(data=str(small_data), seed=seed)).seed == seed


@pytest.mark.parametrize("value", ["garbage", "-5", "nan"])
def test_a_bad_progress_interval_is_refused_at_start_up(tmp_path, small_data, capsys, no_scan, monkeypatch, value):
    monkeypatch.setenv("VISIONTUNE_PROGRESS_SECONDS", value)
    assert cli.main(tiny_train(small_data, tmp_path / "run")) == 2
    one_line(capsys, "VISIONTUNE_PROGRESS_SECONDS", repr(value))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["/proc/nonexistent", "{tmp}/a-file/cache"])
def test_an_unusable_cache_folder_is_refused_at_start_up(tmp_path, small_data, capsys, no_scan, monkeypatch, where):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", where.format(tmp=tmp_path))
    assert cli.main(tiny_train(small_data, tmp_path / "run")) == 2
    one_line(capsys, "VISIONTUNE_CACHE_DIR=", "writable folder")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_default_cache_folder_that_cannot_be_written_gives_way_to_a_temporary_one(
    tmp_path, small_data, capsys, monkeypatch
):
    """A read-only home (as in many containers) does not stop a run: its caches go to a new temporary folder,
    said in one line; a folder the user named is still refused (above)."""
    (tmp_path / "home").write_text("a file: nothing can be made under it")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("VISIONTUNE_CACHE_DIR", raising=False)  # and restored after, whatever the run sets
    assert cli.main(tiny_train(small_data, tmp_path / "run", *flags(epochs=1, batch_size=8))) == 0
    temporary = os.environ["VISIONTUNE_CACHE_DIR"]
    try:
        notes = [line for line in capsys.readouterr().err.splitlines() if "cannot be written" in line]
        assert len(notes) == 1 and str(tmp_path / "home" / ".cache" / "visiontune") in notes[0]
        assert f"keeps its caches in {temporary} " in notes[0] and temporary.startswith(tempfile.gettempdir())
        cache = json.loads((tmp_path / "run" / "config.json").read_text())["image_cache"]
        assert cache["setting"] == "fit" and cache["path"].startswith(temporary + os.sep)
    finally:
        shutil.rmtree(temporary)


def _image_folder(root, per_class: int = 4, classes=("cat", "dog")):
    """An ImageFolder layout (DATA/<class>/*.jpg) from the synthetic Kaggle set's pictures."""
    kaggle = root.parent / f"{root.name}-kaggle"
    make_sample_data(kaggle, per_class=per_class, test_count=0, seed=3)
    for i, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for n, f in enumerate(sorted((kaggle / "train").glob(f"{('cat', 'dog')[i % 2]}.*.jpg"))):
            shutil.copy(f, root / name / f"{n}.jpg")
    return root


def _loops(root):
    """A pair of links that point at each other, and a folder link to the data root (walked, it never ends)."""
    os.symlink("l2", root / "cat" / "l1")
    os.symlink("l1", root / "cat" / "l2")
    os.symlink("..", root / "dog" / "up")


def test_check_reports_symbolic_link_loops_as_bad_entries_and_goes_on(tmp_path, capsys):
    data = _image_folder(tmp_path / "data")
    _loops(data)
    report = tmp_path / "bad.csv"
    assert cli.main(["check", str(data), "--report", str(report)]) == 1  # 1: bad files found, none hidden
    out = capsys.readouterr().out
    assert "3 bad of 11 files" in out, out  # 8 pictures, 2 links listed as files, 1 folder link not followed
    rows = {Path(p).relative_to(data).as_posix(): why for p, why in csv.reader(report.open()) if p != "path"}
    assert set(rows) == {"cat/l1", "cat/l2", "dog/up"}, rows
    assert "Too many levels of symbolic links" in rows["cat/l1"]
    assert "loop" in rows["dog/up"]


def _not_utf8_names(folder: Path) -> tuple[Path, Path]:
    """A good picture and a junk file, each named with a byte that is not UTF-8 (Latin-1 é, 0xff)."""
    folder.mkdir(parents=True, exist_ok=True)
    make_sample_data(folder.parent / "src", per_class=1, test_count=0, seed=5)
    good = Path(os.fsdecode(bytes(folder) + b"/caf\xe9.jpg"))
    junk = Path(os.fsdecode(bytes(folder) + b"/bad\xff.jpg"))
    shutil.copy(next((folder.parent / "src" / "train").glob("*.jpg")), good)
    junk.write_bytes(b"not a picture")
    return good, junk


@pytest.mark.slow
def test_predict_writes_names_that_are_not_utf8_as_their_bytes_on_disk(trained_run, tmp_path):
    good, junk = _not_utf8_names(tmp_path / "in")
    out = tmp_path / "pred.csv"
    argv = ["predict", "--run", str(trained_run), "--data", str(tmp_path / "in"), "--out", str(out)]
    assert cli.main(argv) == 1  # 1: a file was skipped (the junk one)
    raw = out.read_bytes()
    assert b"caf\xe9.jpg" in raw and b"bad\xff.jpg" in raw  # the names' own bytes, not a replacement character
    with open(out, newline="", encoding="utf-8", errors="surrogateescape") as f:
        rows = {r["path"]: r for r in csv.DictReader(f)}
    assert set(rows) == {str(good), str(junk)}  # read back, each row names a file that exists
    assert all(Path(p).exists() for p in rows)
    assert rows[str(good)]["prediction"] in ("cat", "dog") and rows[str(junk)]["prediction"] == ""
    skipped = Path(f"{out}.skipped.txt").read_bytes()
    assert skipped.startswith(bytes(junk) + b"\t")


def test_check_lists_and_reports_a_bad_file_whose_name_is_not_utf8(tmp_path, monkeypatch):
    """Through the command's entry point, with a stdout that refuses what is not UTF-8 (a UTF-8 locale's)."""
    data = _image_folder(tmp_path / "data", per_class=2)
    _, junk = _not_utf8_names(data / "cat")
    report = tmp_path / "bad.csv"
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "argv", ["visiontune", "check", str(data), "--report", str(report)])
    try:
        assert cli.entry() == 1  # 1: a bad file was found
    finally:
        gc.unfreeze()  # entry() freezes the objects alive for a quick exit; this process goes on
    assert bytes(junk) + b": not an image\n" in raw.getvalue()
    assert report.read_bytes() == b"path,problem\n" + bytes(junk) + b",not an image\n"


def _run_recorded_elsewhere(trained_run: Path, tmp_path: Path, split_json: bool) -> Path:
    """A copy of the shared run whose config.json names its data relative to another working folder, as
    runs trained with a relative --data recorded it; without split.json when ``split_json`` is False."""
    run = Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints")))
    config = json.loads((run / "config.json").read_text())
    config["data"]["root"] = "data"
    (run / "config.json").write_text(json.dumps(config))
    if not split_json:
        (run / "split.json").unlink()
    return run


def _evaluate(run: Path, data: Path, *extra: str) -> int:
    return cli.main(["evaluate", "--run", str(run), "--data", str(data), "--no-progress", *extra])


@pytest.mark.slow
def test_evaluate_knows_the_runs_own_data_by_its_listing_when_the_recorded_path_does_not_match(
    trained_run, sample_data, tmp_path, capsys
):
    run = _run_recorded_elsewhere(trained_run, tmp_path, split_json=True)
    assert _evaluate(run, sample_data) == 0
    got = json.loads((run / "eval.json").read_text())
    val = json.loads((run / "split.json").read_text())["val"]
    assert (got["own_data"], got["split"], got["images"]) == (True, "val", len(val))
    assert "not the run's own data" not in capsys.readouterr().out


@pytest.mark.slow
def test_evaluate_without_split_json_says_training_images_may_be_scored(trained_run, sample_data, tmp_path, capsys):
    run = _run_recorded_elsewhere(trained_run, tmp_path, split_json=False)
    assert _evaluate(run, sample_data) == 0
    got = json.loads((run / "eval.json").read_text())
    assert got["own_data"] is None and got["images"] == 120
    out = capsys.readouterr().out
    assert "not the run's own data" not in out and "training images possibly included" in out


@pytest.mark.slow
def test_evaluate_without_split_json_refuses_to_pick_the_validation_images(trained_run, sample_data, tmp_path, capsys):
    run = _run_recorded_elsewhere(trained_run, tmp_path, split_json=False)
    assert _evaluate(run, sample_data, "--split", "val") == 2
    one_line(capsys, "split.json is missing", "--split all")
    assert not (run / "eval.json").exists()


# Item: what a run does when the world misbehaves while it runs. Each training here is one epoch or two of
# squeezenet at 32 px on one thread (as trained.train_run, for a shared 2-core machine).
RUN = [*TINY, *flags(lr=0.01)]


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setattr(strategy, "cpu_budget", lambda *_: 1)


def _fill_the_disk_at(monkeypatch, name: str, nth: int = 1) -> list[str]:
    """Make the ``nth`` write of ``name`` (through ``atomic_file``'s temp file) hit a full disk for real:
    its temp file is created as usual, but the descriptor written to is /dev/full, where every write
    fails with ENOSPC. Returns the temp files diverted."""
    real, seen, diverted = os.open, [], []

    def open_(path, flags, *mode, **kw):
        if os.path.basename(os.fspath(path)).startswith(f".{name}.") and os.fspath(path).endswith(".tmp"):
            seen.append(path)
            if len(seen) == nth:
                os.close(real(path, flags, *mode, **kw))  # the temp file exists, as on a real disk
                diverted.append(os.fspath(path))
                return real("/dev/full", os.O_WRONLY)
        return real(path, flags, *mode, **kw)

    monkeypatch.setattr(os, "open", open_)
    return diverted


@pytest.mark.slow
def test_a_full_disk_while_writing_report_html_keeps_the_previous_page(trained_run, tmp_path, monkeypatch, capsys):
    run = Path(shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints")))
    before = (run / "report.html").read_bytes()
    diverted = _fill_the_disk_at(monkeypatch, "report.html")
    assert cli.main(["report", str(run)]) == 2
    one_line(capsys, "no space left on the disk of", "report.html", "the previous report.html is kept whole")
    assert diverted and (run / "report.html").read_bytes() == before
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]


@pytest.mark.slow
def test_a_full_disk_while_writing_best_safetensors_keeps_the_previous_best(
    tmp_path, small_data, monkeypatch, capsys, one_thread
):
    from safetensors.torch import load_file

    # Each epoch is the best so far, so the second epoch writes best.safetensors again, onto a full disk.
    monkeypatch.setattr(records, "best_of", lambda history, metric="accuracy": (history[-1], "val"))
    diverted = _fill_the_disk_at(monkeypatch, "best.safetensors", nth=2)
    out = tmp_path / "run"
    assert cli.main(["train", "--data", str(small_data), "--output-dir", str(out), *RUN]) == 2
    one_line(capsys, "best.safetensors", "the previous best.safetensors is kept whole")
    assert len(diverted) == 1
    assert_same_weights(load_file(str(out / "best.safetensors")), final_weights(out, epochs=1))  # epoch 1's, whole
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


# Loaded into rank 0 of a DDP job through PYTHONPATH: its second history.json write hits a full disk.
# Installed in every process; it acts in rank 0 only, asked at each call (the workers are forks of the
# launching process, which has no rank).
_FULL_DISK_ON_RANK_0 = """
import os
real, seen = os.open, []

def open_(path, flags, *mode, **kw):
    name = os.path.basename(os.fspath(path))
    if os.environ.get("RANK") == "0" and name.startswith(".history.json.") and name.endswith(".tmp"):
        seen.append(name)
        if len(seen) == 2:
            os.close(real(path, flags, *mode, **kw))
            return real("/dev/full", os.O_WRONLY)
    return real(path, flags, *mode, **kw)

os.open = open_
"""


@pytest.mark.distributed
def test_a_full_disk_under_ddp_stops_the_job_in_one_line_per_process_without_a_traceback(
    tmp_path, small_data, worker_env
):
    """Rank 0 says what filled up and exits 2; its peer, whose next collective fails, says why it stops too,
    in one line; the job ends at once (not after --timeout) with rank 0's code, the files whole."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_FULL_DISK_ON_RANK_0)
    env = env_for(worker_env, tmp_path)
    env["PYTHONPATH"] = f"{hooks}{os.pathsep}{env['PYTHONPATH']}"
    out = tmp_path / "run"
    argv = train_argv(small_data, out, *flags(epochs=3, strategy="ddp", nproc=2, timeout=300))
    done = trainrun.run(argv, env, timeout=240)  # forked where it can be, the hook run first
    said = done.stdout + done.stderr
    assert done.returncode == 2, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    ours = [line for line in said.splitlines() if line.startswith("visiontune: error")]
    assert len(ours) == 1 and "no space left" in ours[0] and "history.json" in ours[0], ours
    assert "visiontune: rank 1 stopped: another process of the job ended (its message is above)" in said
    assert len(json.loads((out / "history.json").read_text())) == 1  # epoch 1's, whole
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


@pytest.fixture(scope="module")
def shaken_run(tmp_path_factory):
    """Two epochs on an ImageFolder set with symbolic link loops in it, given as a relative --data, with
    one picture deleted after the bad-file scan, before the first training step reads anything."""
    from visiontune.loading import pipeline

    tmp = tmp_path_factory.mktemp("shaken")
    data = _image_folder(tmp / "data", per_class=8)
    _loops(data)
    victim = data / "dog" / "3.jpg"
    real_read = pipeline.try_read

    def read(path, *a, **kw):
        if victim.exists():
            victim.unlink()
        return real_read(path, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(strategy, "cpu_budget", lambda *_: 1)
        mp.setattr(pipeline, "try_read", read)
        mp.chdir(tmp)
        # 3 bad entries of 19 (the loops) are more than the default 1%. --cache off: every epoch reads the
        # files (an image cache would still hold the deleted picture).
        argv = ["train", "--data", "data", "--output-dir", str(tmp / "run"), *RUN, "--max-bad-fraction", "0.2"]
        rc = cli.main([*argv, "--cache", "off"])
    return rc, tmp / "run", data, victim


@pytest.mark.slow
def test_a_run_with_symbolic_link_loops_in_its_data_records_them_and_finishes(shaken_run):
    rc, run, data, _ = shaken_run
    assert rc == 0 and (run / "summary.json").is_file()
    # Named as the run was given its data: relative to the folder it was started in.
    rows = list(csv.reader((run / "bad_files.csv").open()))[1:]
    bad = {os.path.relpath(data.parent / p, data): why for p, why in rows}
    assert set(bad) == {"cat/l1", "cat/l2", "dog/up"}, bad
    assert "Too many levels of symbolic links" in bad["cat/l1"] and "loop" in bad["dog/up"]


@pytest.mark.slow
def test_an_image_deleted_mid_run_is_skipped_recorded_and_the_run_finishes(shaken_run):
    rc, run, _, victim = shaken_run
    assert rc == 0 and json.loads((run / "summary.json").read_text())["best_val_accuracy"] is not None
    rows = list(csv.reader((run / "load_failures.csv").open()))
    assert rows and {victim.parents[2] / p for p, _ in rows} == {victim}, rows  # each epoch that read it says so
    assert all("No such file" in why for _, why in rows), rows


@pytest.mark.slow
def test_the_run_records_its_data_folder_as_an_absolute_path(shaken_run):
    _, run, data, _ = shaken_run
    assert json.loads((run / "config.json").read_text())["data"]["root"] == str(data)  # given as "data"


HOSTILE = ["../escape", "a/b", "..", "/abs", "..\\\\win", "./.hidden"]


@pytest.mark.slow
def test_a_thousand_one_image_classes_with_hostile_names_train_and_write_only_in_the_run(
    tmp_path, monkeypatch, capsys, one_thread
):
    """Class names come from a manifest, so they may hold path separators and dots; they must stay text."""
    work = tmp_path / "work" / "deep"  # ../escape from the run folder or the working folder lands in tmp_path
    data = work / "data"
    make_sample_data(tmp_path / "src", per_class=5, test_count=0, seed=2)
    pictures = sorted((tmp_path / "src" / "train").glob("*.jpg"))
    (data / "train").mkdir(parents=True)
    names = HOSTILE + [f"c{i:04d}" for i in range(1000 - len(HOSTILE))]
    rows = ["filename,label"]
    for i, name in enumerate(names):
        os.link(pictures[i % len(pictures)], data / "train" / f"{i}.jpg")
        rows.append(f'{i}.jpg,"{name}"')
    (data / "train.csv").write_text("\n".join(rows) + "\n")
    monkeypatch.chdir(work)
    before = {p for p in tmp_path.rglob("*")}
    run = work / "run"
    argv = ["--data", str(data), *SQUEEZENET, *flags(num_workers=0, batch_size=100, epochs=1, timeout=60)]
    assert cli.main(["train", *argv, "--output-dir", str(run)]) == 0
    assert cli.main(["evaluate", "--run", str(run), "--data", str(data), "--no-progress"]) == 0  # confusion, top losses
    assert sorted(json.loads((run / "classes.json").read_text())) == sorted(names)
    out = capsys.readouterr().out
    train_files = set(json.loads((run / "split.json").read_text())["train"])
    unseen = sum(f"{i}.jpg" not in train_files for i in range(1000))  # one image a class: file i is class i
    assert 0 < unseen < 1000 and f"warning: {unseen} of 1000 classes have no training image" in out
    new = {p for p in tmp_path.rglob("*")} - before
    assert new and all(p == run or run in p.parents for p in new), sorted(map(str, new - {run}))[:5]
    assert not Path("/escape").exists() and not Path("/abs").exists()


@pytest.mark.slow
def test_a_png_that_crashes_torchvision_is_one_bad_file_to_check_predict_and_train(trained_run, tmp_path):
    """The 69-byte PNG whose image data holds half its rows killed every command with SIGSEGV (libpng's "Not
    enough image data" inside torchvision's decode_png); each now names it as a bad file and goes on. Run as
    subprocesses, so that a crash shows as its exit code instead of taking the test process with it."""
    from badfiles import short_png
    from conftest import PYTHON, _worker_env

    data = _image_folder(tmp_path / "data")
    (data / "dog" / "crash.png").write_bytes(short_png())
    env = env_for(_worker_env(), tmp_path)

    def visiontune(*argv: str) -> subprocess.CompletedProcess:
        # forked where it can be: a crash all the same; in tmp_path, where check writes its report
        return trainrun.run([PYTHON, "-m", "visiontune", *argv], env, cwd=tmp_path)

    check = visiontune("check", str(data))
    assert check.returncode == 1, check.stderr  # 1: bad files found
    assert f"{data / 'dog' / 'crash.png'}: truncated PNG" in check.stdout and "Traceback" not in check.stderr

    out = tmp_path / "pred.csv"
    predict = visiontune("predict", "--run", str(trained_run), "--data", str(data / "dog"), "--out", str(out))
    assert predict.returncode == 1, predict.stderr  # 1: a file was skipped
    (line,) = predict.stdout.strip().splitlines()
    assert "predicted 4 of 5 images" in line and "1 unreadable" in line, line
    assert Path(f"{out}.skipped.txt").read_text().startswith(f"{data / 'dog' / 'crash.png'}\ttruncated PNG")

    cache, run = tmp_path / "cache", tmp_path / "run"
    train = visiontune(
        "train", "--data", str(data), "--output-dir", str(run), *TINY, "--epochs", "1",
        "--cache", str(cache), "--max-bad-fraction", "0.2",
    )  # fmt: skip
    assert train.returncode == 0, train.stdout + train.stderr
    bad = {Path(p).name: why for p, why in csv.reader((run / "bad_files.csv").open()) if p != "path"}
    assert bad.keys() == {"crash.png"} and bad["crash.png"].startswith("truncated PNG"), bad
    assert cache.is_dir() and not [p for p in cache.rglob("*") if ".tmp" in p.name]
