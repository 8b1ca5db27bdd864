"""``--out`` names a regular file or a new one: a symbolic link, a FIFO, a device or a folder there is refused
in one line (exit 2) and left as it was, by every writer (``files.atomic_file`` checks the target)."""

from __future__ import annotations

import json
import os

import pytest
import torchvision
from safetensors.torch import save_file

from trainrun import flags, one_line
from visiontune import cli
from visiontune.errors import UserError
from visiontune.files import atomic_write

SHOW = ["--model", "resnet18", "--weights", "none", "--image-size", "32", "--batch-size", "8"]


def _link(tmp_path):
    """A symbolic link to a file that must not change, and that file."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / "out.png"
    link.symlink_to(target)
    return link, target


def _unchanged(link, target) -> None:
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "keep me\n"
    assert not [p for p in link.parent.iterdir() if p.name.endswith(".tmp")]  # no temp file left behind


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_an_atomic_write_replaces_only_a_regular_file(tmp_path, kind):
    target = tmp_path / "t"
    if kind == "link":
        (tmp_path / "elsewhere").write_text("x")
        target.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    said = {"link": "is a symbolic link (to ", "fifo": "is a FIFO", "folder": "is a folder"}[kind]
    with pytest.raises(UserError, match="replaces only regular files") as e:
        atomic_write(target, b"data")
    assert said in str(e.value) and "\n" not in str(e.value)
    assert target.is_symlink() if kind == "link" else os.path.lexists(target) and not target.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["t", *(["elsewhere"] if kind == "link" else [])])
    atomic_write(tmp_path / "plain", b"old")
    atomic_write(tmp_path / "plain", b"new")  # a regular file is replaced, as always
    assert (tmp_path / "plain").read_bytes() == b"new"


def test_show_out_a_symbolic_link_is_refused_and_the_link_kept(small_data, tmp_path, capsys):
    link, target = _link(tmp_path)
    assert cli.main(["show", str(small_data), *SHOW, "--out", str(link)]) == 2
    one_line(capsys, f"--out {link} is a symbolic link", str(target))
    _unchanged(link, target)


def test_show_out_a_fifo_is_refused(small_data, tmp_path, capsys):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    assert cli.main(["show", str(small_data), *SHOW, "--out", str(fifo)]) == 2
    one_line(capsys, f"--out {fifo} is a FIFO")
    assert not fifo.is_file() and fifo.exists()


def test_predict_out_a_symbolic_link_is_refused_before_the_forward_pass(tmp_path, small_data, capsys, monkeypatch):
    from visiontune.inference import loaded as inference

    save_file(torchvision.models.squeezenet1_1(num_classes=2).state_dict(), str(tmp_path / "w.safetensors"))
    monkeypatch.setattr(inference, "forward", lambda *a, **kw: pytest.fail("the forward pass ran"))
    link, target = _link(tmp_path)
    args = flags(weights=tmp_path / "w.safetensors", model="squeezenet1_1", classes="cat,dog", out=link)
    assert cli.main(["predict", *args, "--data", str(small_data / "train")]) == 2
    one_line(capsys, f"--out {link} is a symbolic link")
    _unchanged(link, target)


def test_compare_out_a_fifo_is_refused_by_the_one_atomic_write(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"config": {"lr": 0.1 if name == "a" else 0.2}}))
        runs.append(str(run))
    fifo = tmp_path / "compare.html"
    os.mkfifo(fifo)
    assert cli.main(["compare", *runs, "--out", str(fifo)]) == 2
    one_line(capsys, f"{fifo} is a FIFO", "replaces only regular files")
    assert fifo.exists() and not fifo.is_file()
