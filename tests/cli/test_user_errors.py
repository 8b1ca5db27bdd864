"""Bad input ends in one line and exit code 2, before any long work; small promises about files kept."""

from __future__ import annotations

import csv
import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from trainrun import flags, one_line, tiny_train
from visiontune import cli
from visiontune.data.sample import make_sample_data


@pytest.mark.parametrize(
    "flag,value,says",
    [
        ("--momentum", "-1", "--momentum"),
        ("--timeout", "0", "--timeout"),
        ("--weight-decay", "-0.1", "--weight-decay"),
    ],
)
def test_out_of_range_numbers_are_refused(tmp_path, small_data, capsys, no_scan, flag, value, says):
    assert cli.main(tiny_train(small_data, tmp_path / "run", flag, value)) == 2
    one_line(capsys, says)


HUGE = "99999999999999999999"  # past int64: an OverflowError (and a C++ frame dump) where torch gets it


@pytest.mark.parametrize(
    "flag,value,says",
    [
        ("--image-size", HUGE, f"--image-size must be an integer from 1 to 8192, got {HUGE}"),
        ("--batch-size", HUGE, f"--batch-size must be an integer from 1 to 1048576, got {HUGE}"),
        ("--epochs", HUGE, f"--epochs must be an integer from 1 to 1000000, got {HUGE}"),
        ("--grad-accum", HUGE, f"--grad-accum must be an integer from 1 to 65536, got {HUGE}"),
        ("--num-workers", HUGE, f"--num-workers must be an integer from 0 to 1024, got {HUGE}"),
        ("--threads", HUGE, "--threads must be an integer from 1 to 4096"),
        ("--warmup-steps", HUGE, "--warmup-steps must be an integer from 0 to 2147483647"),
        ("--save-every-steps", HUGE, "--save-every-steps must be an integer from 0 to 2147483647"),
        ("--keep-last", HUGE, "--keep-last must be an integer from 1 to 10000"),
        ("--master-port", "65536", "--master-port must be an integer from 1 to 65535, got 65536"),
        ("--timeout", "1e300", "--timeout must be a number of seconds from 0 to 31536000, got 1e+300"),
        ("--warmup-epochs", "1e300", "--warmup-epochs must be a number from 0 to 1000000"),
    ],
)
def test_numbers_too_large_for_torch_are_refused_with_the_range(
    tmp_path, small_data, capsys, no_scan, flag, value, says
):
    assert cli.main(tiny_train(small_data, tmp_path / "run", flag, value)) == 2
    one_line(capsys, says)
    assert not (tmp_path / "run").exists()


def test_an_image_size_too_large_in_a_config_file_is_refused_with_the_range(tmp_path, small_data, capsys, no_scan):
    (tmp_path / "c.toml").write_text(f"image_size = {HUGE}\nbatch_size = {HUGE}\n")
    args = [a for a in tiny_train(small_data, tmp_path / "run") if a not in ("--image-size", "32")]
    assert cli.main([*args, "--config", str(tmp_path / "c.toml")]) == 2
    one_line(capsys, f"--image-size must be an integer from 1 to 8192, got {HUGE}")


@pytest.mark.parametrize(
    "text,says",
    [
        ('epochs = "2"', "epochs = '2' is not of type int"),
        ('channels_last = "no"', "channels_last = 'no' is not of type bool"),
        ("lr = true", "lr = True is not of type float"),
    ],
)
def test_config_values_of_the_wrong_type_are_refused(tmp_path, small_data, capsys, text, says):
    (tmp_path / "c.toml").write_text(text + "\n")
    assert cli.main([*tiny_train(small_data, tmp_path / "run"), "--config", str(tmp_path / "c.toml")]) == 2
    one_line(capsys, str(tmp_path / "c.toml"), says)


def test_a_config_json_that_is_not_a_table_is_refused(tmp_path, small_data, capsys):
    (tmp_path / "config.json").write_text(json.dumps([{"epochs": 1}]))
    assert cli.main([*tiny_train(small_data, tmp_path / "run"), "--config", str(tmp_path / "config.json")]) == 2
    one_line(capsys, "holds a list, not a table of settings")


def test_weights_that_are_not_a_state_dict_are_refused(tmp_path, small_data, capsys, no_scan):
    torch.save([torch.zeros(2), torch.ones(2)], tmp_path / "list.pth")
    assert cli.main([*tiny_train(small_data, tmp_path / "run"), "--weights", str(tmp_path / "list.pth")]) == 2
    one_line(capsys, "is not a state_dict")


class _RunsCode:
    def __reduce__(self):
        return (os.getpid, ())


def test_an_unsafe_pickle_is_refused_without_advice_to_load_it_unsafely(tmp_path, small_data, capsys, no_scan):
    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"w": _RunsCode()}))
    assert cli.main([*tiny_train(small_data, tmp_path / "run"), "--weights", str(tmp_path / "evil.pth")]) == 2
    line = one_line(capsys, "cannot load weights", "never unpickles")
    assert "weights_only" not in line and "False" not in line


def test_an_image_size_too_small_for_the_model_is_refused_at_start(tmp_path, small_data, capsys, no_scan):
    args = tiny_train(small_data, tmp_path / "run", "--model", "squeezenet1_1", "--image-size", "16")
    assert cli.main(args) == 2
    one_line(capsys, "--image-size 16 is too small for squeezenet1_1")


def test_a_batch_of_one_is_refused_when_batchnorm_would_see_one_value(tmp_path, small_data, capsys, no_scan):
    assert cli.main(tiny_train(small_data, tmp_path / "run", "--batch-size", "1")) == 2  # resnet18 at 32 px: 1x1
    one_line(capsys, "--batch-size 1 is too small for resnet18", "BatchNorm")


def test_predict_out_under_a_file_is_refused_before_the_forward_pass(tmp_path, small_data, capsys, monkeypatch):
    save_file(torchvision.models.squeezenet1_1(num_classes=2).state_dict(), str(tmp_path / "w.safetensors"))
    (tmp_path / "file").write_text("x")
    from visiontune.inference import loaded as inference

    monkeypatch.setattr(inference, "forward", lambda *a, **kw: pytest.fail("the forward pass ran"))
    args = [
        "predict",
        *flags(
            weights=tmp_path / "w.safetensors",
            model="squeezenet1_1",
            classes="cat,dog",
            data=small_data / "train",
            out=tmp_path / "file" / "preds.csv",
        ),
    ]
    assert cli.main(args) == 2
    one_line(capsys, "--out", "is a file, not a folder")


def test_an_unreadable_class_folder_is_named(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    for cls in ("cat", "dog"):
        (data / cls).mkdir(parents=True)
        (data / cls / "a.jpg").write_bytes(b"x")
    locked = data / "dog"
    locked.chmod(0)
    if os.access(locked, os.R_OK):  # root reads anything: make the listing fail as it would for a user
        real = os.scandir

        def scandir(path="."):
            if Path(path) == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)
    try:
        assert cli.main(["check", str(data)]) == 2
    finally:
        locked.chmod(0o755)
    one_line(capsys, f"cannot read {locked} (permission denied)")


def _folder_data(tmp_path) -> Path:
    data = tmp_path / "data"
    make_sample_data(tmp_path / "kaggle", per_class=3, test_count=0, seed=0)
    for p in sorted((tmp_path / "kaggle" / "train").iterdir()):
        (data / p.name.split(".")[0]).mkdir(parents=True, exist_ok=True)
        p.rename(data / p.name.split(".")[0] / p.name)
    return data


def _rows(report: Path) -> dict[str, str]:
    with open(report, newline="") as f:
        return {r[0]: r[1] for r in list(csv.reader(f))[1:]}


def test_os_metadata_files_are_ignored_and_broken_links_reported(tmp_path, capsys):
    data = _folder_data(tmp_path)
    for cls in ("cat", "dog"):
        (data / cls / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(64))
        (data / cls / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0" + bytes(64))
    assert cli.main(["check", str(data), "--report", str(tmp_path / "clean.csv")]) == 0
    assert _rows(tmp_path / "clean.csv") == {}
    (data / "dog" / "gone.jpg").symlink_to(tmp_path / "no-such-file.jpg")
    assert cli.main(["check", str(data), "--report", str(tmp_path / "bad.csv")]) == 1
    assert list(_rows(tmp_path / "bad.csv")) == [str(data / "dog" / "gone.jpg")]


def test_written_files_respect_the_umask(tmp_path, small_data):
    old = os.umask(0o022)
    try:
        assert cli.main(["check", str(small_data), "--report", str(tmp_path / "report.csv")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.csv").stat().st_mode) == 0o644


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly(worker_env):
    proc = subprocess.Popen(
        [sys.executable, "-m", "visiontune", "models"], env=worker_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # `| head` that has read enough: every write now fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141
    assert "Error" not in err and "Traceback" not in err, err
