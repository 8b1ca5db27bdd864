"""Layout detection, manifests, `prepare`, and the seeded split."""

from __future__ import annotations

import json

import pytest
import torch

from trainrun import SQUEEZENET, flags
from visiontune.data.layouts import write_kaggle_manifest
from visiontune.data.sources import discover
from visiontune.data.split import make_split, split_record
from visiontune.errors import UserError
from visiontune.tasks import AUTO


def _touch(path, data=b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_kaggle_layout_classes_order_and_numeric_test_ids(tmp_path):
    for name in ["cat.10.jpg", "cat.2.jpg", "dog.1.jpg", "notes.txt", "Thumbs.db", ".DS_Store"]:
        _touch(tmp_path / "train" / name)
    for i in [10, 2, 1]:
        _touch(tmp_path / "test" / f"{i}.jpg")
    found = discover(str(tmp_path), task=AUTO)
    assert found.layout == "kaggle" and found.classes == ["cat", "dog"]
    assert [p.split("/")[-1] for p in found.paths] == ["cat.2.jpg", "cat.10.jpg", "dog.1.jpg"]
    assert found.labels.tolist() == [0, 0, 1]
    assert [p.split("/")[-1] for p in found.test_files] == ["1.jpg", "2.jpg", "10.jpg"]
    assert [p.split("/")[-1] for p, _ in found.rejects] == ["notes.txt"]  # the OS's metadata files are ignored


def test_image_folder_layout_like_petimages(tmp_path):
    for cls in ["Dog", "Cat"]:
        for i in range(3):
            _touch(tmp_path / "PetImages" / cls / f"{i}.jpg")
    found = discover(str(tmp_path / "PetImages"), task=AUTO)
    assert found.layout == "imagefolder" and found.classes == ["Cat", "Dog"]
    assert found.labels.tolist() == [0, 0, 0, 1, 1, 1]


def test_prepare_writes_a_manifest_that_reads_back_identically(tmp_path):
    for name in ["cat.0.jpg", "cat.1.jpg", "dog.0.jpg", "dog.5.jpg"]:
        _touch(tmp_path / "train" / name)
    kaggle = discover(str(tmp_path), task=AUTO)
    out, n = write_kaggle_manifest(str(tmp_path))
    assert n == 4 and open(out).readline().strip() == "filename,label"
    manifest = discover(str(tmp_path), task=AUTO)
    assert manifest.layout == "manifest"
    assert (list(manifest.paths), manifest.labels.tolist(), manifest.classes) == (
        list(kaggle.paths),
        kaggle.labels.tolist(),
        kaggle.classes,
    )


def test_manifest_with_integer_labels(tmp_path):
    for i in range(4):
        _touch(tmp_path / "train" / f"img{i}.jpg")
    (tmp_path / "train.csv").write_text("filename,label\nimg0.jpg,1\nimg1.jpg,0\nimg2.jpg,1\nimg3.jpg,0\n")
    found = discover(str(tmp_path), task=AUTO)
    assert found.classes == ["0", "1"] and found.labels.tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize(
    "rows,msg",
    [
        ("a.jpg,cat\nmissing.jpg,dog\n", "row 3: file not found"),
        ("a.jpg,cat\na.jpg,dog\n", "row 3: duplicate"),
        ("a.jpg,cat\n../secret.jpg,dog\n", "row 3: path '../secret.jpg' leaves the image root"),
        ("a.jpg,cat\n/etc/passwd,dog\n", "row 3: path '/etc/passwd' leaves"),
        ("a.jpg,cat\nb.jpg,\n", "row 3: expected 'filename,label'"),
    ],
)
def test_manifest_row_errors_name_the_row(tmp_path, rows, msg):
    _touch(tmp_path / "train" / "a.jpg")
    _touch(tmp_path / "train" / "b.jpg")
    (tmp_path / "train.csv").write_text("filename,label\n" + rows)
    with pytest.raises(UserError, match=msg):
        discover(str(tmp_path), task=AUTO)


def test_missing_empty_and_unknown_layouts(tmp_path):
    with pytest.raises(UserError, match="not found"):
        discover(str(tmp_path / "nope"), task=AUTO)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty"):
        discover(str(tmp_path / "empty"), task=AUTO)
    _touch(tmp_path / "flat" / "a.jpg")
    with pytest.raises(UserError, match="cannot tell the layout"):
        discover(str(tmp_path / "flat"), task=AUTO)


def test_split_is_seeded_private_and_blog_sized():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a = make_split(25000, 0.2, 42)
    after = torch.rand(1)
    assert torch.equal(before, after), "the split must not consume the global RNG"
    assert (len(a.train), len(a.val)) == (20000, 5000)
    assert set(a.train).isdisjoint(a.val) and len(set(a.train) | set(a.val)) == 25000
    assert make_split(25000, 0.2, 42) == a and make_split(25000, 0.2, 43) != a
    with pytest.raises(UserError, match="empty"):
        make_split(1, 0.2, 42)


def test_split_record_hash_changes_with_content():
    paths = [f"/d/train/cat.{i}.jpg" for i in range(10)]
    s = make_split(10, 0.2, 42)
    rec = split_record(s, paths, "/d", 42, 0.2)
    assert rec["counts"] == {"train": 8, "val": 2} and rec["val"][0].startswith("train/")
    other = split_record(make_split(10, 0.2, 7), paths, "/d", 7, 0.2)
    assert rec["sha256"] != other["sha256"]
    assert json.loads(json.dumps(rec)) == rec


def _image(path, seed=0):
    import numpy as np
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)


def _nested(root):
    """cat/ holds its images, bird/ only in a subfolder, dog/ two levels down: 3 classes, 4+3+2 images."""
    for i in range(4):
        _image(root / "cat" / f"{i}.png", i)
    for i in range(3):
        _image(root / "bird" / "photos" / f"{i}.png", 10 + i)
    for i in range(2):
        _image(root / "dog" / "a" / "b" / f"{i}.png", 20 + i)
    return root


def test_class_folders_whose_images_are_all_in_subfolders_are_classes(tmp_path):
    found = discover(str(_nested(tmp_path / "data")), task=AUTO)
    assert found.classes == ["bird", "cat", "dog"]
    assert found.class_counts() == {"bird": 3, "cat": 4, "dog": 2}
    assert [found.classes[lab] for lab in found.labels] == [
        p.split("/")[len(str(tmp_path / "data").split("/"))] for p in found.paths
    ]
    assert "bird 3, cat 4, dog 2" in found.describe()


@pytest.mark.slow
def test_check_train_and_evaluate_use_the_nested_rule_and_report_counts(tmp_path, capsys):
    from visiontune.cli.commands import main

    data = _nested(tmp_path / "data")
    for i in range(4, 8):  # enough images for a split with batches of 2
        _image(data / "bird" / "photos" / f"{i}.png", 30 + i)
        _image(data / "dog" / "a" / "b" / f"{i}.png", 40 + i)
    assert main(["check", str(data), "--report", str(tmp_path / "bad.csv")]) == 0
    assert "bird 7, cat 4, dog 6" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", *flags(data=data, epochs=1, batch_size=4, output_dir=run), *SQUEEZENET]) == 0
    assert "bird 7, cat 4, dog 6" in capsys.readouterr().out
    assert json.loads((run / "classes.json").read_text()) == ["bird", "cat", "dog"]
    main(["evaluate", "--run", str(run), "--data", str(data), "--split", "all", "--no-progress"])
    report = json.loads((run / "eval.json").read_text())
    assert report["images"] == 17 and {k: v["support"] for k, v in report["per_class"].items()} == {
        "bird": 7,
        "cat": 4,
        "dog": 6,
    }
    assert "bird 7, cat 4, dog 6" in capsys.readouterr().out


def _manifest_dir(tmp_path, text: bytes):
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        _touch(tmp_path / "train" / name)
    (tmp_path / "train.csv").write_bytes(text)
    return str(tmp_path)


@pytest.mark.parametrize("rows", ["a.jpg,cat\nb.jpg,dog\n./a.jpg,dog\n", "a.jpg,cat\nb.jpg,dog\n.//a.jpg,dog\n"])
def test_manifest_duplicate_spelt_differently_is_refused(tmp_path, rows):
    with pytest.raises(UserError, match=r"row 4: duplicate row for '\./+a\.jpg' \(same file as row 2\)"):
        discover(_manifest_dir(tmp_path, ("filename,label\n" + rows).encode()), task=AUTO)


def test_manifest_with_bom_and_trailing_blank_lines_reads_normally(tmp_path):
    found = discover(
        _manifest_dir(tmp_path, "\ufefffilename,label\na.jpg,cat\nb.jpg,dog\n\n\n".encode("utf-8")), task=AUTO
    )
    assert found.layout == "manifest" and found.classes == ["cat", "dog"] and found.labels.tolist() == [0, 1]
    assert [p.split("/")[-1] for p in found.paths] == ["a.jpg", "b.jpg"]


def test_latin1_manifest_is_one_line_naming_the_encoding_exit_2(tmp_path, capsys):
    from visiontune.cli.commands import main

    data = _manifest_dir(tmp_path, "filename,label\na.jpg,chat\nb.jpg,ch\u00e8vre\n".encode("latin-1"))
    assert main(["check", data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.csv: not UTF-8 text (byte 0xe8" in err[0] and "Traceback" not in err[0]
