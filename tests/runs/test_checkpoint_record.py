"""A checkpoint's ``visiontune.json`` from someone else: ``checkpoint.read_meta`` bounds it and checks every field
resume and training use; a checkpoint that fails is skipped as a damaged one, and with no intact one left
``--resume`` is one line, exit 2 -- never a traceback, never a file read outside the folder."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from visiontune import cli
from visiontune.errors import UserError
from visiontune.runs import checkpoint, resume
from visiontune.settings.config import TrainConfig

WEIGHTS = b"not really weights"


def record() -> dict:
    """A visiontune.json as ``checkpoint.save`` writes it, small."""
    phase = {"loss": 0.5, "accuracy": 0.75, "images": 4}
    return {
        "format": 1,
        "epoch": 1,
        "batch": 0,
        "sampler": "random",
        "class_weights": None,
        "split_sha256": "0" * 64,
        "model": "resnet18",
        "num_classes": 2,
        "global_batch": 4,
        "batch_samples": 4,
        "grad_accum": 1,
        "image_size": 32,
        "world_size": 1,
        "history": [{"epoch": 0, "lr": 0.001, "train": dict(phase), "val": dict(phase)}],
        "best_val": dict(phase),
        "optimizer_steps": 4,
        "partial_totals": None,
        "config": TrainConfig(data="data").to_dict(),
        "files": {"model.safetensors": [len(WEIGHTS), hashlib.sha256(WEIGHTS).hexdigest()]},
        "samples": 0,
    }


def write_checkpoint(run: Path, meta, name: str = "epoch0001-end") -> Path:
    folder = run / checkpoint.SUBDIR / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    (folder / checkpoint.META).write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return folder


def _with(meta: dict, key: str, value) -> dict:
    return {**meta, key: value}


def test_a_checkpoint_record_as_visiontune_writes_it_is_intact(tmp_path):
    folder = write_checkpoint(tmp_path, record())
    found = checkpoint.latest(str(tmp_path))
    assert found is not None and found.path == str(folder) and found.meta == record()


@pytest.mark.parametrize(
    "key,value,says",
    [
        ("epoch", "1", "epoch is '1', expected a whole number"),  # a TypeError at "Epoch {epoch + 1}" before
        ("batch", -3, "batch is -3"),
        ("files", {"model.safetensors": 5}, "files is"),  # "cannot unpack non-iterable int" before
        ("files", {"../../config.json": [2, "0" * 64]}, "files is"),  # a file outside the folder, hashed before
        ("files", {"/etc/hostname": [2, "0" * 64]}, "files is"),
        ("history", {"epoch": 0}, "history is"),
        ("history", [{"epoch": 0, "train": {"accuracy": "high"}, "val": {}}], "epoch 0: train is"),
        ("config", {**TrainConfig(data="data").to_dict(), "epochs": "2"}, "epochs = '2' is not of type int"),
        ("config", [], "config is []"),
        ("partial_totals", "many", "partial_totals is 'many'"),
        ("split_sha256", ["x"], "split_sha256 is ['x']"),
    ],
)
def test_a_wrong_typed_field_makes_the_checkpoint_unusable_in_one_line(tmp_path, capsys, key, value, says):
    write_checkpoint(tmp_path, _with(record(), key, value))
    with pytest.raises(UserError, match="no intact checkpoint") as e:
        resume.find_resume("auto", str(tmp_path), False)
    assert "\n" not in str(e.value)
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "is unusable" in said[0] and says in said[0]


def test_a_damaged_newest_record_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    write_checkpoint(tmp_path, record())
    write_checkpoint(tmp_path, _with(record(), "history", "x"), "epoch0002-end")
    found = resume.find_resume("auto", str(tmp_path), False)
    assert found is not None and found.path.endswith("epoch0001-end")
    assert "epoch0002-end is unusable (visiontune.json: history is 'x'" in capsys.readouterr().out


def test_a_record_larger_than_any_checkpoint_writes_is_refused_before_it_is_parsed(tmp_path, monkeypatch, capsys):
    write_checkpoint(tmp_path, record())
    monkeypatch.setattr(checkpoint, "MAX_META", 100)
    monkeypatch.setattr(checkpoint.json, "loads", lambda *a, **k: pytest.fail("parsed an oversized record"))
    with pytest.raises(UserError, match="no intact checkpoint"):
        resume.find_resume("auto", str(tmp_path), False)
    assert "more than any checkpoint writes" in capsys.readouterr().out


def test_a_record_nested_past_the_parser_is_one_line(tmp_path, capsys):
    write_checkpoint(tmp_path, "[" * 100_000)
    with pytest.raises(UserError, match="no intact checkpoint"):
        resume.find_resume("auto", str(tmp_path), False)
    assert "visiontune.json unreadable" in capsys.readouterr().out


def test_train_resume_auto_from_a_damaged_record_is_one_line_exit_2(tmp_path, small_data, capsys):
    write_checkpoint(tmp_path / "run", _with(record(), "epoch", "1"))
    argv = ["train", "--data", str(small_data), "--output-dir", str(tmp_path / "run"), "--resume", "auto"]
    assert cli.main([*argv, "--model", "resnet18", "--weights", "none", "--image-size", "32", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no intact checkpoint" in err[0]


# Any JSON value, to depth 3: what a damaged or hostile record may hold in any field.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KEYS = [*checkpoint.SCHEMA, "image_size", "interpolation", "crop_pct", "hflip", "lora"]


@fuzz_settings(60)
@given(st.lists(st.tuples(st.sampled_from(KEYS), JSON), max_size=3), st.booleans())
def test_fuzz_a_checkpoint_record_is_checked_or_one_line(changes, drop):
    """Any field replaced by any JSON value (or dropped): the checkpoint is found intact, with every field a
    resume reads of its type, or skipped with one line; resuming from an intact one is compared or refused."""
    meta = record()
    for key, value in changes:
        if drop:
            meta.pop(key, None)
        else:
            meta[key] = value
    with tempfile.TemporaryDirectory() as run:
        write_checkpoint(Path(run), meta)
        said: list[str] = []
        try:
            found = checkpoint.latest(run, say=said.append)
        except UserError as e:
            assert "\n" not in str(e) and len(said) == 1 and "\n" not in said[0]
            return
        assert found is not None and isinstance(found.epoch, int) and isinstance(found.batch, int)
        assert isinstance(found.meta["history"], list) and isinstance(found.meta["config"], dict)
        current = {k: record()[k] for k in ("split_sha256", "model", "num_classes", "global_batch", "grad_accum")}
        try:
            resume.compatible(found, {**current, "batch_samples": 4, "sampler": "random", "class_weights": None})
        except UserError as e:
            assert "\n" not in str(e)


def test_a_record_whose_settings_lack_the_batch_size_is_unusable(tmp_path, capsys):
    """Found by the fuzz target: resume names the position by the saving run's --batch-size (a KeyError)."""
    write_checkpoint(tmp_path, _with(record(), "config", {}))
    with pytest.raises(UserError, match="no intact checkpoint"):
        resume.find_resume("auto", str(tmp_path), False)
    assert "config lacks the batch size" in capsys.readouterr().out
