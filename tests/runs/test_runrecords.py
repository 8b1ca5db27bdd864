"""A run folder's records from someone else: ``report`` and ``compare`` (and the model card, crossval) read
config.json, summary.json, history.json and split.json through ``runs.runrecords``; a value of the wrong type is
one line naming the file and the field, exit 2, never an AttributeError. The fuzz targets feed them any JSON."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from trainrun import one_line
from visiontune import cli
from visiontune.errors import UserError
from visiontune.reports import compare, modelcard, report
from visiontune.runs import runrecords
from visiontune.runs.runinfo import describe
from visiontune.settings.config import TrainConfig

MODEL = describe("resnet18", "torchvision", ["cat", "dog"], 32, (0.5,) * 3, (0.25,) * 3, "bilinear").to_dict()


def config_record() -> dict:
    """A config.json as a run writes it (records.write_records), small."""
    return {
        "config": {**TrainConfig(data="data").to_dict(), "folds": 2, "fold": 0},
        "image_cache": {"setting": "off"},
        "setup": {"strategy": "single", "world_size": 1, "per_process_batch": 4, "global_batch": 4, "lr": 0.001,
                  "devices": ["cpu"], "threads": 2, "loader_workers": 0, "decode_threads": 2, "threads_from": "cores"},
        "overview": {"train images": "8", "model": "resnet18 (torchvision)"},
        "versions": {"torch": "2.9"},
        "data": {"root": "/data", "layout": "folder", "source": "/data"},
        "model": MODEL,
    }  # fmt: skip


def summary_record() -> dict:
    return {
        "run_dir": "runs/a",
        "total_seconds": 3.5,
        "best_val_accuracy": 0.75,
        "best_val_loss": 0.5,
        "best_epoch": 2,
        "epochs_counted_from": 1,
        "best_metric": "accuracy",
        "best_weights": "raw",
        "epochs": 2,
        "train_images_per_s": 20.0,
        "data_wait_fraction": 0.1,
        "val_images_counted": 4,
        "val_split_size": 4,
        "train_split_size": 8,
        "classes": ["cat", "dog"],
        "world_size": 1,
        "devices": ["cpu"],
    }


def history_record() -> list:
    phase = {"loss": 0.5, "accuracy": 0.75, "images": 4}
    return [{"epoch": e, "lr": 0.001, "train": dict(phase), "val": dict(phase)} for e in (1, 2)]


def write_run(folder: Path, config=None, summary=None, history=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, record in (("config", config), ("summary", summary), ("history", history)):
        if record is not None:
            (folder / f"{name}.json").write_text(json.dumps(record))
    return folder


def _with(record: dict, path: str, value) -> dict:
    """``record`` with the value at the dotted ``path`` replaced."""
    out = json.loads(json.dumps(record))
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[last] = value
    return out


def test_a_run_folder_written_as_visiontune_writes_it_reads_back_whole(tmp_path):
    run = write_run(tmp_path / "a", config_record(), summary_record(), history_record())
    config = runrecords.read_config(run)
    assert config["config"]["data"] == "data" and config["setup"]["devices"] == ["cpu"] and config["model"] == MODEL
    assert runrecords.read_summary(run) == summary_record()
    assert runrecords.read_history(run) == history_record()
    assert runrecords.read_summary(tmp_path / "absent") is None and runrecords.read_history(tmp_path / "absent") == []


def test_an_older_run_s_epochs_counted_from_0_read_counted_from_1(tmp_path):
    """Runs written before the files counted epochs from 1 (history.json from 0, a summary.json without
    epochs_counted_from and a 0-based best_epoch) read as today's: every reader counts from 1."""
    summary = {k: v for k, v in summary_record().items() if k != "epochs_counted_from"} | {"best_epoch": 1}
    history = [{**row, "epoch": row["epoch"] - 1} for row in history_record()]
    run = write_run(tmp_path / "old", config_record(), summary, history)
    assert runrecords.read_summary(run) == summary_record()
    assert runrecords.read_history(run) == history_record()


BAD_CONFIGS = [
    ("config", ["not", "settings"], "config is ['not', 'settings']"),
    ("config.epochs", "2", "epochs = '2' is not of type int"),
    ("setup", "single", "setup is 'single'"),
    ("setup.devices", 3, "setup.devices is 3"),
    ("data", "a folder", "data is 'a folder'"),
    ("versions", ["torch"], "versions is ['torch']"),
    ("overview", {"x": {"y": 1}}, "overview is {'x': {'y': 1}}"),
    ("model", ["resnet18"], "model is ['resnet18']"),
    ("model.classes", "cat", "classes is 'cat'"),  # the model file's own schema
]
BAD_SUMMARIES = [
    ("best_val_accuracy", "high", "best_val_accuracy is 'high'"),
    ("best_epoch", "1", "best_epoch is '1'"),
    ("classes", "cat", "classes is 'cat'"),
    ("devices", {"cpu": 1}, "devices is {'cpu': 1}"),
]


@pytest.mark.parametrize("path,value,says", BAD_CONFIGS)
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_config_json_value_of_the_wrong_type_is_one_line(tmp_path, capsys, command, path, value, says):
    bad = write_run(tmp_path / "bad", _with(config_record(), path, value), summary_record(), history_record())
    good = write_run(tmp_path / "good", config_record(), summary_record(), history_record())
    argv = (
        ["report", str(bad)]
        if command == "report"
        else ["compare", str(good), str(bad), "--out", str(tmp_path / "c.html")]
    )
    assert cli.main(argv) == 2
    one_line(capsys, str(bad / "config.json"), says)
    assert not (bad / "report.html").exists() and not (tmp_path / "c.html").exists()


@pytest.mark.parametrize("path,value,says", BAD_SUMMARIES)
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_summary_json_value_of_the_wrong_type_is_one_line(tmp_path, capsys, command, path, value, says):
    bad = write_run(tmp_path / "bad", config_record(), _with(summary_record(), path, value), history_record())
    good = write_run(tmp_path / "good", config_record(), summary_record(), history_record())
    argv = (
        ["report", str(bad)]
        if command == "report"
        else ["compare", str(good), str(bad), "--out", str(tmp_path / "c.html")]
    )
    assert cli.main(argv) == 2
    one_line(capsys, str(bad / "summary.json"), says)


@pytest.mark.parametrize(
    "name,text,says",
    [
        ("summary.json", "[1, 2]", "the record is [1, 2], expected a JSON object"),
        ("summary.json", "{not json", "is not JSON"),
        ("history.json", '{"epoch": 0}', "expected a list of epochs"),
        ("history.json", '[{"epoch": 0, "train": {"accuracy": "x"}, "val": {}}]', "epoch 0: train is"),
        ("split.json", '{"val": [["a"]], "train": []}', "val is [['a']]"),
        ("summary.json", "[" * 100_000, "is not JSON"),
    ],
)
def test_damaged_records_compare_reads_are_one_line(tmp_path, capsys, name, text, says):
    runs = [write_run(tmp_path / n, _with(config_record(), "config.fold", i), summary_record(), history_record())
            for i, n in enumerate("ab")]  # fmt: skip
    (runs[1] / name).write_text(text)
    assert cli.main(["compare", *map(str, runs), "--out", str(tmp_path / "c.html")]) == 2
    one_line(capsys, str(runs[1] / name), says)


def test_a_record_larger_than_any_run_writes_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    run = write_run(tmp_path / "a", config_record())
    monkeypatch.setattr(runrecords, "MAX_RECORD", 100)
    with pytest.raises(UserError, match="more than any run writes"):
        runrecords.read_config(run)


# Any JSON value, to depth 3: what a damaged or hostile record may hold in any field.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
CONFIG_PATHS = ["config", "config.epochs", "config.fold", "config.folds", "config.data", "setup", "setup.devices",
                "setup.lr", "overview", "versions", "data", "data.root", "model", "model.classes", "model.multi_label",
                "image_cache"]  # fmt: skip
SUMMARY_PATHS = ["best_val_accuracy", "best_val_loss", "best_val_map", "best_epoch", "best_metric", "epochs",
                 "classes", "devices", "val_split_size", "best_weights", "val_images_counted",
                 "thresholds"]  # fmt: skip


def _pages(run: Path, other: Path) -> None:
    """Everything made from a run folder's records: the report, compare's page and table, the model card."""
    report.build(run)
    runs = [compare.read_run(other), compare.read_run(run)]
    compare.settings_table(runs), compare.metrics_table(runs), compare.terminal_table(runs)
    config, summary = runrecords.read_config(run), runrecords.read_summary(run)
    try:
        modelcard.card(config, summary, "resnet18", "me/model", None)
    except KeyError:  # a field the card needs is absent: inference.hub says so in one line
        pass


@fuzz_settings(60)
@given(
    st.lists(st.tuples(st.sampled_from(CONFIG_PATHS), JSON), max_size=3),
    st.lists(st.tuples(st.sampled_from(SUMMARY_PATHS), JSON), max_size=3),
)
def test_fuzz_config_and_summary_json_read_back_or_one_line(config_changes, summary_changes):
    config, summary = config_record(), summary_record()
    for path, value in config_changes:
        try:
            config = _with(config, path, value)
        except (TypeError, KeyError, IndexError):  # a parent already replaced by a non-object
            pass
    for path, value in summary_changes:
        summary = _with(summary, path, value)
    with tempfile.TemporaryDirectory() as folder:
        other = write_run(Path(folder) / "other", config_record(), summary_record(), history_record())
        run = write_run(Path(folder) / "run", config, summary, history_record())
        try:
            _pages(run, other)
        except UserError as e:
            assert "\n" not in str(e) and len(str(e)) < 1000


def split_file(folder: Path, record=None) -> Path:
    """A split.json as a run writes it (``data.split:write_split``), or ``record`` in its place."""
    from visiontune.data.split import split_hash

    train, val = ["cat/1.jpg", "dog/2.jpg"], ["cat/3.jpg"]
    whole = {"seed": 0, "val_fraction": 0.25, "sha256": split_hash(train, val), "counts": {"train": 2, "val": 1},
             "train": train, "val": val}  # fmt: skip
    path = folder / "split.json"
    path.write_text(json.dumps(whole if record is None else record))
    return path


@pytest.mark.parametrize(
    "text,says",
    [
        ('{"train": [], "val": []}', "no train and val lists of file names with their sha256"),  # a KeyError before
        ("[1]", "the record is [1], expected a JSON object"),  # a TypeError before
        ('{"train": [1], "val": [], "sha256": "x"}', "train is [1], expected a list of file names"),
        ("[" * 100_000, "is not JSON"),  # a RecursionError before
        ("\xff{", "is not JSON"),
    ],
)
def test_a_damaged_split_json_is_one_line(tmp_path, text, says):
    (tmp_path / "split.json").write_text(text, encoding="latin-1")
    with pytest.raises(UserError, match=re.escape(says)) as e:
        runrecords.read_split_record(tmp_path / "split.json")
    assert str(tmp_path / "split.json") in str(e.value) and "\n" not in str(e.value)


def test_a_split_json_reads_back_checked_and_a_larger_one_than_any_run_writes_is_refused(tmp_path, monkeypatch):
    path = split_file(tmp_path)
    assert runrecords.read_split_record(path)["val"] == ["cat/3.jpg"]
    monkeypatch.setattr(runrecords, "MAX_SPLIT", 100)
    with pytest.raises(UserError, match="more than any run writes"):
        runrecords.read_split_record(path)


@fuzz_settings(100)
@given(st.lists(st.tuples(st.sampled_from(["seed", "sha256", "counts", "train", "val", "method", "train.0"]), JSON),
                max_size=3), st.binary(max_size=64))  # fmt: skip
def test_fuzz_a_split_json_reads_back_checked_or_one_line(changes, tail):
    with tempfile.TemporaryDirectory() as folder:
        record = json.loads(split_file(Path(folder)).read_text())
        for path, value in changes:
            try:
                record = _with(record, path, value)
            except (TypeError, KeyError, IndexError):  # a parent already replaced by a non-list
                pass
        path = Path(folder) / "split.json"
        path.write_bytes(json.dumps(record).encode() + tail)
        try:
            back = runrecords.read_split_record(path)
        except UserError as e:
            assert "\n" not in str(e) and len(str(e)) < 1000
        else:
            assert runrecords.SPLIT["train"][0](back["train"]) and runrecords.SPLIT["val"][0](back["val"])


# A run's bad_files.csv (data.check.write_report), read back when evaluate tells moved data by split.json's hash:
# bounded like the records (runrecords.read_bad_files). Before, evaluate read it whole, whatever its size.
def test_a_bad_files_csv_reads_back_the_paths_it_was_written_with(tmp_path):
    from visiontune.data.check import write_report

    bad = [("/d/a,b.jpg", "truncated"), ('/d/new\nline "q".png', "not an image"), ("/d/é.jpg", "x"), ("/d/c", "")]
    write_report(bad, str(tmp_path / "bad_files.csv"))
    assert runrecords.read_bad_files(tmp_path) == [path for path, _ in bad]
    write_report([], str(tmp_path / "bad_files.csv"))
    assert runrecords.read_bad_files(tmp_path) == [] and runrecords.read_bad_files(tmp_path / "absent") is None


def test_a_huge_bad_files_csv_is_refused_unread_in_one_line(tmp_path):
    with open(tmp_path / "bad_files.csv", "wb") as f:  # sparse: no disk, and nothing of it is read
        f.truncate(runrecords.MAX_BAD_FILES + 1)
    with pytest.raises(UserError) as e:
        runrecords.read_bad_files(tmp_path)
    said = str(e.value)
    assert f"bad_files.csv is {runrecords.MAX_BAD_FILES + 1:,} bytes, more than any run writes" in said, said
    assert "\n" not in said


@pytest.mark.parametrize(
    "text,says",
    [
        ("path,problem\n" + "x" * 200_000 + ",bad\n", "not a CSV of file names (field larger than field limit"),
        ('path,problem\n"a.jpg,bad\n', "not a CSV of file names (unexpected end of data)"),
        ("path,problem\na.jpg,bad\n,bad\n", "not a CSV of file names (row 3 names no file)"),
    ],
)
def test_a_damaged_bad_files_csv_is_one_line(tmp_path, text, says):
    (tmp_path / "bad_files.csv").write_text(text)
    with pytest.raises(UserError) as e:
        runrecords.read_bad_files(tmp_path)
    said = str(e.value)
    assert f"{tmp_path / 'bad_files.csv'}: damaged run record: {says}" in said and "\n" not in said, said


# Any bytes, and rows of the pieces a CSV of file names is made of (names, commas, quotes, line ends, NUL, non-UTF-8).
CSV_PIECES = st.lists(st.sampled_from([b"a.jpg", b",", b'"', b"\n", b"\r", b"\x00", b"\xff"])).map(b"".join)


@fuzz_settings(200)
@given(st.binary(max_size=400) | CSV_PIECES)
def test_fuzz_any_bytes_as_a_bad_files_csv_give_its_paths_or_one_line(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("run")
    (run / "bad_files.csv").write_bytes(data)
    try:
        paths = runrecords.read_bad_files(run)
    except UserError as e:
        assert "\n" not in str(e) and str(run / "bad_files.csv") in str(e)
        return
    assert isinstance(paths, list) and all(isinstance(p, str) and p for p in paths)
