"""What the object-store tests (S3, Azure, GCS: ``tests/data/test_stores*.py``) upload, and how they read
what visiontune answered: one set of files and checks, so the three stores are held to the same behaviour."""

from __future__ import annotations

from pathlib import Path

from visiontune.cli.commands import main
from visiontune.data.sample import make_sample_data

FOLDERS = ("folder", "shards", "manifest")  # each uploaded to the store as DATA_ROOT/NAME


def make_store_files(tmp: Path) -> None:
    """A folder of 6 images (Kaggle layout), its shards (one or two images each, with visiontune's
    index.json) and a class-subfolder copy with a manifest: ``tmp/folder``, ``tmp/shards``, ``tmp/manifest``."""
    make_sample_data(tmp / "folder", per_class=3, test_count=0, seed=2)
    assert main(["shard", str(tmp / "folder"), "--out", str(tmp / "shards"), "--shard-size", "20KB"]) == 0
    (tmp / "manifest").mkdir()
    rows = ["filename,label"]
    for p in sorted((tmp / "folder" / "train").iterdir()):
        (tmp / "manifest" / p.name).write_bytes(p.read_bytes())
        rows.append(f"{p.name},{p.name.split('.')[0]}")
    (tmp / "manifest" / "labels.csv").write_text("\n".join(rows) + "\n")


def one_line(capsys) -> str:
    """The one line on stderr, no traceback."""
    said = capsys.readouterr()
    lines = said.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in said.err, said.err
    return lines[0]


def same(got, local) -> None:
    """Two listings of the same images: classes, labels and count."""
    assert (got.classes, got.labels.tolist(), len(got)) == (local.classes, local.labels.tolist(), len(local))
