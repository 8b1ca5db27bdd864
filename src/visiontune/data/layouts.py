"""Find the labelled images in a data folder, whatever its layout.

Three layouts are detected, in this order: a manifest CSV (``DATA/train.csv``
with ``filename,label`` rows, as the reference job's DogCatDataset reads it, or
a ``.csv`` path given directly), Kaggle Dogs vs Cats (``DATA/train/<class>.<n>.jpg``
with an optional ``DATA/test/``), and class subfolders (ImageFolder, Microsoft's
PetImages ``Cat/`` and ``Dog/`` included). The result is an ``ImageSet``:
absolute paths with class indices, class names in index order, the unlabelled
test files, and the files the layout itself had to reject.
"""
from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from visiontune.config import UserError

KAGGLE_NAME = re.compile(r"^(?P<cls>[A-Za-z]+)\.(?P<num>\d+)\.[A-Za-z]+$")
# What operating systems leave in folders (macOS, Windows, KDE): never data, so never counted bad.
OS_METADATA = {".DS_Store", "Thumbs.db", "ehthumbs.db", "desktop.ini", ".directory"}


@dataclass(frozen=True)
class ImageSet:
    root: str
    layout: str
    paths: list[str]
    labels: list[int]
    classes: list[str]
    test_files: list[str] = field(default_factory=list)
    rejects: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)

    def __len__(self) -> int:
        return len(self.paths)


def _numeric_key(path: str) -> tuple:
    # Kaggle ids sort numerically (2.jpg before 10.jpg), everything else by name.
    stem = Path(path).stem
    return (0, int(stem), "") if stem.isdigit() else (1, 0, stem)


def _listed(p: Path) -> bool:
    # A broken symbolic link is listed so that the scan reports it; macOS "._" files are metadata too.
    return (p.is_file() or (p.is_symlink() and not p.exists())) and not (
        p.name in OS_METADATA or p.name.startswith("._"))


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if _listed(p))


def _kaggle(root: Path) -> ImageSet | None:
    train = root / "train"
    if not train.is_dir():
        return None
    files = _files(train)
    matched = [(p, KAGGLE_NAME.match(p.name)) for p in files]
    if not any(m for _, m in matched):
        return None
    classes = sorted({m["cls"].lower() for _, m in matched if m})
    good = sorted(((m["cls"].lower(), int(m["num"]), p) for p, m in matched if m))
    rejects = [(str(p), "file name is not <class>.<number>.<ext>") for p, m in matched if not m]
    test_dir = root / "test"
    test = sorted((str(p) for p in _files(test_dir)), key=_numeric_key) if test_dir.is_dir() else []
    return ImageSet(str(root), "kaggle", [str(p) for _, _, p in good],
                    [classes.index(c) for c, _, _ in good], classes, test, rejects)


def _image_folder(root: Path) -> ImageSet | None:
    base = root / "train" if (root / "train").is_dir() else root
    class_dirs = sorted(d for d in base.iterdir() if d.is_dir() and not d.name.startswith("."))
    class_dirs = [d for d in class_dirs if any(_listed(p) for p in d.iterdir())]
    if not class_dirs:
        return None
    paths, labels = [], []
    for idx, d in enumerate(class_dirs):
        for p in sorted(d.rglob("*")):
            if _listed(p):
                paths.append(str(p))
                labels.append(idx)
    return ImageSet(str(root), "imagefolder", paths, labels, [d.name for d in class_dirs])


def read_manifest(csv_path: Path, image_root: Path) -> ImageSet:
    """Read ``filename,label`` rows; every bad row is an error naming its row number."""
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    if rows and [c.strip().lower() for c in rows[0][:2]] in (["filename", "label"], ["file", "label"],
                                                              ["path", "label"], ["id", "label"]):
        rows = rows[1:]
        first_row = 2
    else:
        first_row = 1
    if not rows:
        raise UserError(f"{csv_path}: no rows; expected 'filename,label' lines")
    root = image_root.resolve()
    entries, seen = [], set()
    for n, row in enumerate(rows, start=first_row):
        if len(row) < 2 or not row[0].strip() or not row[1].strip():
            raise UserError(f"{csv_path} row {n}: expected 'filename,label', got {','.join(row)!r}")
        name, label = row[0].strip(), row[1].strip()
        # Reject escaping paths before touching the file system with them.
        if os.path.isabs(name) or ".." in Path(name).parts:
            raise UserError(f"{csv_path} row {n}: path {name!r} leaves the image root {root}; "
                            "use paths relative to it")
        if name in seen:
            raise UserError(f"{csv_path} row {n}: duplicate row for {name!r}; list each file once")
        seen.add(name)
        path = root / name
        if not path.is_file():
            raise UserError(f"{csv_path} row {n}: file not found: {path}")
        entries.append((str(path), label))
    labels = [lab for _, lab in entries]
    if all(lab.lstrip("-").isdigit() for lab in labels):
        classes = [str(c) for c in sorted({int(lab) for lab in labels})]
        index = {str(int(lab)): classes.index(str(int(lab))) for lab in labels}
        ids = [index[str(int(lab))] for lab in labels]
    else:
        classes = sorted(set(labels))
        ids = [classes.index(lab) for lab in labels]
    test_dir = image_root.parent / "test"
    test = sorted((str(p) for p in _files(test_dir)), key=_numeric_key) if test_dir.is_dir() else []
    return ImageSet(str(image_root), "manifest", [p for p, _ in entries], ids, classes, test)


def _manifest(root: Path) -> ImageSet | None:
    if root.is_file() and root.suffix.lower() == ".csv":
        return read_manifest(root, root.parent / "train" if (root.parent / "train").is_dir() else root.parent)
    csv_path = root / "train.csv"
    if not csv_path.is_file():
        return None
    return read_manifest(csv_path, root / "train" if (root / "train").is_dir() else root)


def discover(data: str) -> ImageSet:
    """Detect the layout of ``data`` and list its labelled images."""
    root = Path(data).expanduser()
    if not root.exists():
        raise UserError(f"data folder not found: {data} (make one with `visiontune sample-data {data}`)")
    if root.is_dir() and not any(root.iterdir()):
        raise UserError(f"data folder is empty: {data}")
    for finder in (_manifest, _kaggle, _image_folder):
        try:
            found = finder(root) if root.is_dir() or finder is _manifest else None
        except PermissionError as e:
            raise UserError(f"cannot read {e.filename} (permission denied): fix its permissions or move it "
                            f"out of {data}") from None
        if found is not None:
            if not found.paths:
                raise UserError(f"no labelled images found in {data}")
            if len(found.classes) < 2:
                raise UserError(f"{data}: found only one class ({found.classes[0]}); "
                                "a classifier needs at least two")
            return found
    raise UserError(f"cannot tell the layout of {data}: expected train.csv, train/<class>.<n>.jpg "
                    "(Kaggle Dogs vs Cats) or one subfolder per class")


def write_kaggle_manifest(data: str) -> tuple[str, int]:
    """``visiontune prepare``: write ``DATA/train.csv`` from the Kaggle layout."""
    found = _kaggle(Path(data)) if Path(data).is_dir() else None
    if found is None:
        raise UserError(f"{data} is not in the Kaggle layout (train/<class>.<n>.jpg)")
    from visiontune.outputs import atomic_write

    out = Path(data) / "train.csv"
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["filename", "label"])
    for p, lab in zip(found.paths, found.labels):
        w.writerow([Path(p).name, found.classes[lab]])
    atomic_write(out, buf.getvalue())
    return str(out), len(found.paths)
