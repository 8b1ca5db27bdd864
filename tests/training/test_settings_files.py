"""Files of settings a user is handed (``--config FILE``, ``--class-weights FILE``) are untrusted: each is read by
one reader, bounded, and anything it cannot use is one line (a UserError), never a traceback. The fuzz targets
feed them any bytes and any nesting."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from visiontune.errors import UserError
from visiontune.settings import validation
from visiontune.settings.validation import load_config_file
from visiontune.training import imbalance
from visiontune.training.imbalance import read_weight_file

CLASSES = ["cat", "dog"]


@pytest.mark.parametrize(
    "name,content,says",
    [
        ("w.csv", b"cat," + b"1" * 200_000, "not a CSV of class,weight rows"),  # before: csv.Error, a traceback
        ("w.json", b"[" * 100_000, "not valid JSON"),  # before: RecursionError
    ],
)
def test_a_damaged_class_weights_file_is_one_line(tmp_path, name, content, says):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=says) as e:
        read_weight_file(str(tmp_path / name), CLASSES)
    assert "\n" not in str(e.value)


def test_a_class_weights_file_larger_than_any_is_refused_unread(tmp_path, monkeypatch):
    (tmp_path / "w.csv").write_text("cat,1\ndog,2\n")
    monkeypatch.setattr(imbalance, "MAX_WEIGHT_FILE", 5)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("read an oversized file"))
    with pytest.raises(UserError, match="more than the weights of any classes take"):
        read_weight_file(str(tmp_path / "w.csv"), CLASSES)


def test_a_config_file_nested_past_the_parser_is_one_line(tmp_path):
    (tmp_path / "c.json").write_text("[" * 100_000)  # before: RecursionError, a traceback
    with pytest.raises(UserError, match="cannot parse config file"):
        load_config_file(str(tmp_path / "c.json"))


def test_a_config_file_larger_than_any_is_refused_unread(tmp_path, monkeypatch):
    (tmp_path / "c.toml").write_text('model = "resnet18"\n')
    monkeypatch.setattr(validation, "MAX_CONFIG_BYTES", 5)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("read an oversized file"))
    with pytest.raises(UserError, match="more than a file of settings holds"):
        load_config_file(str(tmp_path / "c.toml"))


# Text that looks like the files these readers take: their separators, quotes and brackets, names and numbers.
LIKE = st.lists(st.sampled_from([*'catdog,=:"[]{}\n\r\x00 .-1e9#', "nan", "true", "epochs", "lr"]), max_size=30).map(
    "".join
)


@fuzz_settings(100)
@given(st.one_of(st.binary(max_size=80), LIKE.map(str.encode)), st.sampled_from(["w.csv", "w.json", "w.txt"]))
def test_fuzz_any_class_weights_file_gives_positive_weights_or_one_line(content, name):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(content)
        try:
            weights = read_weight_file(str(path), CLASSES)
        except UserError:
            return
    assert weights.shape == (2,) and bool((weights > 0).all()) and bool(weights.isfinite().all())


@fuzz_settings(100)
@given(st.one_of(st.binary(max_size=80), LIKE.map(str.encode)), st.sampled_from(["c.toml", "c.json"]))
def test_fuzz_any_config_file_gives_typed_settings_or_one_line(content, name):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(content)
        try:
            settings = load_config_file(str(path))
        except UserError:
            return
    assert isinstance(settings, dict)
    validation.check_types(settings, name)  # what it returns is of TrainConfig's types
