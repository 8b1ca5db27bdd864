"""Flags that used to do something other than what they said: fp16 on a CPU, a tracker that is not
installed, sample data written over an earlier data set. Each is one line and exit code 2 now."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import FAST
from visiontune import TrainConfig, train
from visiontune.cli.commands import main
from visiontune.errors import UserError


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused on CPU-only machines only")
def test_fp16_on_a_cpu_is_refused_with_bf16_suggested(sample_data, tmp_path, capsys):
    # (predict and evaluate refuse it too: test_predict's bad-input cases)
    out = tmp_path / "r"
    assert (
        main(["train", "--data", str(sample_data), *FAST, "--mixed-precision", "fp16", "--output-dir", str(out)]) == 2
    )
    assert "--mixed-precision fp16 needs a GPU" in (line := _one_error_line(capsys)) and "bf16" in line
    assert not out.exists()
    with pytest.raises(UserError, match="bf16"):  # the Python API too
        train(
            TrainConfig(
                data=str(sample_data), model="resnet18", weights="none", mixed_precision="fp16", output_dir=str(out)
            )
        )
    assert not out.exists()


def test_log_with_a_tracker_that_is_not_installed_names_the_extra(sample_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes `import tensorboard` fail
    out = tmp_path / "r"
    assert (
        main(["train", "--data", str(sample_data), *FAST, "--log-with", "tensorboard", "--output-dir", str(out)]) == 2
    )
    assert "pip install 'visiontune[tensorboard]'" in _one_error_line(capsys)
    assert not out.exists()


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_sample_data_refuses_a_folder_that_is_not_empty_unless_forced(tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["sample-data", str(data), "--per-class", "3"]) == 0  # a new folder
    assert _names(data / "train") == [f"{c}.{n}.jpg" for c in ("cat", "dog") for n in range(3)]
    (data / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["sample-data", str(data), "--per-class", "2"]) == 2
    assert "not empty" in (line := _one_error_line(capsys)) and "--force" in line
    assert len(_names(data / "train")) == 6  # untouched
    # --force replaces the data set: no old image is left beside the new ones; other files stay.
    assert main(["sample-data", str(data), "--per-class", "2", "--force"]) == 0
    assert _names(data / "train") == [f"{c}.{n}.jpg" for c in ("cat", "dog") for n in range(2)]
    assert _names(data / "test") == ["1.jpg"]
    assert (data / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert main(["sample-data", str(tmp_path / "empty"), "--per-class", "1"]) == 0
