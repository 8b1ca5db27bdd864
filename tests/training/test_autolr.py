"""--lr auto: the run trains with what `lr-find` suggests on the same data and seed, records both, and a
resume takes the recorded lr instead of sweeping again."""

from __future__ import annotations

import json

import pytest

from trainrun import flags
from visiontune.cli import main
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.training import lrfind


@pytest.mark.slow
def test_lr_auto_uses_lr_finds_suggestion_records_it_and_a_resume_reuses_it(small_data, tmp_path, monkeypatch):
    common = flags(data=small_data, batch_size=8, num_workers=0, seed=3, no_progress=True)
    common += flags(model="timm/test_resnet", weights="none", image_size=32)  # the model is not the subject
    monkeypatch.setattr(lrfind, "STEPS", 12)  # a shorter sweep for the test, the same for both commands
    assert main(["lr-find", *common, *flags(output_dir=tmp_path / "lrf", steps=12)]) == 0
    found = json.loads((tmp_path / "lrf" / "lr_find.json").read_text())

    run = tmp_path / "run"
    assert main(["train", *common, *flags(lr="auto", epochs=1, output_dir=run)]) == 0
    record = json.loads((run / "config.json").read_text())
    assert record["config"]["lr"] == "auto"
    assert record["setup"]["lr"] == found["suggested_lr"]  # the same sweep, bit for bit
    assert json.loads((run / "lr_find.json").read_text())["lrs"] == found["lrs"]
    history = json.loads((run / "history.json").read_text())
    assert history[0]["lr"] == pytest.approx(found["suggested_lr"], rel=1e-12)  # constant lr: the blog recipe

    def no_sweep(*args, **kwargs):
        raise AssertionError("the resumed run swept again")

    monkeypatch.setattr(lrfind, "sweep", no_sweep)
    assert main(["train", *common, *flags(lr="auto", epochs=2, output_dir=run, resume="auto")]) == 0
    assert json.loads((run / "config.json").read_text())["setup"]["lr"] == found["suggested_lr"]
    history = json.loads((run / "history.json").read_text())
    assert len(history) == 2 and history[1]["lr"] == pytest.approx(found["suggested_lr"], rel=1e-12)


def test_lr_auto_is_checked_in_one_line(capsys):
    assert validate(TrainConfig(data="d", lr="auto")).lr == "auto"
    with pytest.raises(UserError, match="drop --scale-lr"):
        validate(TrainConfig(data="d", lr="auto", scale_lr=True))
    with pytest.raises(UserError, match="--lr must be a positive number or auto, got fast"):
        validate(TrainConfig(data="d", lr="fast"))
    assert main(["train", "--data", "d", "--lr", "-1"]) == 2
    assert "--lr: must be a positive number or auto, got '-1'" in capsys.readouterr().err
