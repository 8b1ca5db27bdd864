"""Find the labelled images in a data folder, whatever its layout.

Three layouts are detected, in this order: a manifest CSV (``DATA/train.csv``
with ``filename,label`` rows, as the reference job's DogCatDataset reads it, or
a ``.csv`` path given directly), Kaggle Dogs vs Cats (``DATA/train/<class>.<n>.jpg``
with an optional ``DATA/test/``), and class subfolders (ImageFolder, Microsoft's
PetImages ``Cat/`` and ``Dog/`` included; a class is every file under its folder,
at any depth). The result is an ``ImageSet`` (``data/imageset.py``): absolute paths with class indices,
class names in index order, the unlabelled test files, and the files the layout
itself had to reject. Listing uses ``os.scandir`` (no ``stat`` per file), so an
ImageNet-size folder is listed in seconds; the paths are kept as a ``PathList``
and the labels as one int32 array, no Python object per file (``jobdata`` carries
one listing to the other processes of a job as those arrays' bytes).

This is the ``folder`` source (``SOURCE``), tried after the others
(``data/sources.py``): data kept in a container -- ``hf:`` data sets, tar shards --
is listed into the same ``ImageSet`` by its own module, with a ``reader``.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

import numpy as np

from visiontune.data.imageset import Cells, ImageSet, LabelReader, Source, read_classes
from visiontune.data.pathlist import PathList, bounded_lines, refuse_larger, too_many
from visiontune.errors import UserError
from visiontune.files import atomic_write

KAGGLE_NAME = re.compile(r"^(?P<cls>[A-Za-z]+)\.(?P<num>\d+)\.[A-Za-z]+$")
# What operating systems leave in folders (macOS, Windows, KDE): never data, so never counted bad.
OS_METADATA = {".DS_Store", "Thumbs.db", "ehthumbs.db", "desktop.ini", ".directory"}
# A manifest comes from elsewhere: bounded before its rows are Python objects. ImageNet's 1.28M rows are about
# 60 MB; tens of millions of rows fit; a runaway file, or one line without an end, does not.
MAX_MANIFEST_BYTES = 1 << 30
MAX_MANIFEST_ROWS = 20_000_000
MAX_MANIFEST_LINE = 1 << 20  # characters: a file name and its label cells (csv refuses a cell over 128 KiB)
_MANIFEST = "a manifest"


def _numeric_key(path: str) -> tuple:
    # Kaggle ids sort numerically (2.jpg before 10.jpg), everything else by name.
    stem = Path(path).stem
    return (0, int(stem), "") if stem.isdigit() else (1, 0, stem)


def _is_dir(e: os.DirEntry) -> bool:
    # A symbolic link in a loop (l1 -> l2 -> l1) raises ELOOP here: no folder, so it is listed as a file
    # and the scan reports it as bad, as it does a broken link.
    try:
        return e.is_dir()
    except OSError:
        return False


def _listed(e: os.DirEntry) -> bool:
    # A broken symbolic link, or one in a loop, is listed so that the scan reports it; macOS "._" files are
    # metadata too.
    try:
        target = e.is_file() or (e.is_symlink() and not os.path.exists(e.path))
    except OSError:
        target = True
    return target and not (e.name in OS_METADATA or e.name.startswith("._"))


def _files(folder: str) -> list[str]:
    with os.scandir(folder) as it:
        return sorted(e.path for e in it if _listed(e))


def _folder_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


LOOP = "a folder reached again through a symbolic link (a loop); not followed"


def _files_under(folder: str, rejects: list[tuple[str, str]], above: frozenset = frozenset()) -> list[str]:
    """Every file below ``folder``, at any depth, sorted; hidden subfolders are not entered.

    A folder reached again below itself through a link (a/up -> ..), or one of ``above`` (the data
    root) reached from a class, would be walked forever: it goes to ``rejects`` instead. Other links
    to folders are followed, as before.
    """
    if _folder_id(folder) in above:  # a class folder that links to the data root
        rejects.append((folder, LOOP))
        return []
    out, stack = [], [(folder, above | {_folder_id(folder)})]
    while stack:
        path, ancestors = stack.pop()
        with os.scandir(path) as it:
            for e in it:
                if _is_dir(e):
                    if e.name.startswith("."):
                        continue
                    here = _folder_id(e.path)
                    if here in ancestors:
                        rejects.append((e.path, LOOP))
                    else:
                        stack.append((e.path, ancestors | {here}))
                elif _listed(e):
                    out.append(e.path)
    out.sort()
    return out


def _kaggle_name(name: str) -> tuple[str, int] | None:
    """(class, number) of a file named ``<class>.<number>.<ext>`` (``KAGGLE_NAME``), or None."""
    # str methods first: at ImageNet size the regex is about a second of a warm start. A name they accept
    # the regex accepts too; every other name is still the regex's to decide.
    cls, _, rest = name.partition(".")
    num, dot2, ext = rest.partition(".")
    if dot2 and cls.isascii() and cls.isalpha() and num.isdecimal() and ext.isascii() and ext.isalpha():
        return cls, int(num)
    m = KAGGLE_NAME.match(name)
    return (m["cls"], int(m["num"])) if m else None


def _kaggle(root: Path) -> ImageSet | None:
    train = root / "train"
    if not train.is_dir():
        return None
    # Names, not paths, are parsed and sorted (one folder: the same order); a path is made once, at the end.
    with os.scandir(train) as it:
        names = sorted(e.name for e in it if _listed(e))
    parsed = [_kaggle_name(n) for n in names]
    if not any(parsed):
        return None
    classes = sorted({p[0].lower() for p in parsed if p})
    index = {c: i for i, c in enumerate(classes)}
    good = sorted((p[0].lower(), p[1], n) for n, p in zip(names, parsed) if p)
    folder = os.path.join(str(train), "")  # as os.scandir makes an entry's path
    rejects = [(folder + n, "file name is not <class>.<number>.<ext>") for n, p in zip(names, parsed) if not p]
    test_dir = root / "test"
    test = sorted(_files(str(test_dir)), key=_numeric_key) if test_dir.is_dir() else []
    return ImageSet(
        str(root), "kaggle", [folder + n for _, _, n in good], [index[c] for c, _, _ in good], classes, test, rejects
    )


def _image_folder(root: Path) -> ImageSet | None:
    base = root / "train" if (root / "train").is_dir() else root
    with os.scandir(base) as it:
        dirs = sorted((e.name, e.path) for e in it if _is_dir(e) and not e.name.startswith("."))
    names, counts, rejects = [], [], []
    top = frozenset({_folder_id(str(root)), _folder_id(str(base))})

    def each_class():  # one class's file names at a time: never all of them as str at once
        for name, path in dirs:
            # One rule for every command: a class is every file below its folder, however deep.
            files = _files_under(path, rejects, top)
            if files:
                names.append(name)
                counts.append(len(files))
                yield files

    paths = PathList.from_chunks(each_class(), os.path.join(str(root), ""))
    if not names:
        return None
    labels = np.repeat(np.arange(len(names), dtype=np.int32), counts)
    return ImageSet(str(root), "imagefolder", paths, labels, names, rejects=sorted(rejects))


def read_rows(csv_path: Path) -> list[tuple[int, list[str]]]:
    """(line number, cells) of every non-blank row of the manifest ``csv_path``, its one reader (``groups``
    reads its columns here too): at most ``MAX_MANIFEST_BYTES``, ``MAX_MANIFEST_ROWS`` rows, ``MAX_MANIFEST_LINE``
    characters a line, one line naming the file and the bound past them. A BOM is dropped, a non-UTF-8 file is
    refused."""
    refuse_larger(csv_path, MAX_MANIFEST_BYTES, _MANIFEST, "is it the manifest?")
    rows = []
    line_is = "a manifest's line is a file name and its label cells"
    try:
        with open(csv_path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(bounded_lines(f, csv_path, _MANIFEST, line_is, MAX_MANIFEST_LINE, MAX_MANIFEST_BYTES))
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue
                if len(rows) == MAX_MANIFEST_ROWS:
                    raise too_many(csv_path, MAX_MANIFEST_ROWS, "rows", _MANIFEST)
                rows.append((reader.line_num, row))
    except UnicodeDecodeError as e:
        raise UserError(
            f"{csv_path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "save the manifest as UTF-8 and run again"
        ) from None
    except csv.Error as e:  # e.g. a cell over csv's 128 KiB limit: no file name or label is that long
        raise UserError(f"{csv_path} line {reader.line_num}: not a CSV row ({e}); fix the manifest") from None
    return rows


def read_manifest(csv_path: Path, image_root: Path, task: LabelReader) -> ImageSet:
    """Read ``filename,<label cells>`` rows; a bad row is an error naming its row number.

    The file name is this module's to check; the cells after it are ``task``'s to read (``LabelReader``:
    class names, label sets, numbers), as is whether the first row is a header naming the columns.
    """
    rows = read_rows(csv_path)
    header = None
    if rows and task.names_columns(rows[0][1], f"{csv_path} row {rows[0][0]}"):
        header, rows = rows[0][1][1:], rows[1:]
    if not rows:
        raise UserError(f"{csv_path}: no rows; expected 'filename,label' lines")
    for n, row in rows:
        if not row[0].strip():
            raise UserError(f"{csv_path} row {n}: expected 'filename,label', got {','.join(row)!r}")
    # The label cells first (the task reads them, a bad one is its row), then the files they name.
    cells = Cells(
        [row[1:] for _, row in rows],
        len(rows),
        lambda i: f"{csv_path} row {rows[i][0]}",
        str(csv_path),
        per_row=True,
        line=lambda i: ",".join(rows[i][1]),
        header=header,
        files=[row[0].strip() for _, row in rows],
    )
    labelled = task.parse(cells)
    root = str(image_root.resolve())
    paths, seen = [], {}
    for n, row in rows:
        name = row[0].strip()
        # Reject escaping paths before touching the file system with them.
        if os.path.isabs(name) or ".." in Path(name).parts:
            raise UserError(f"{csv_path} row {n}: path {name!r} leaves the image root {root}; use paths relative to it")
        norm = os.path.normpath(name)  # ./a.jpg and a//b.jpg name the same files as a.jpg and a/b.jpg
        if norm in seen:
            raise UserError(
                f"{csv_path} row {n}: duplicate row for {name!r} (same file as row {seen[norm]}); list each file once"
            )
        seen[norm] = n
        path = os.path.join(root, norm)
        if not os.path.isfile(path):
            # a name from the file may hold a newline or other control characters: shown quoted, on one line
            raise UserError(f"{csv_path} row {n}: file not found: {path if path.isprintable() else repr(path)}")
        paths.append(path)
    test_dir = image_root.parent / "test"
    test = sorted(_files(str(test_dir)), key=_numeric_key) if test_dir.is_dir() else []
    return ImageSet.of(str(image_root), "manifest", paths, labelled, test_files=test)


def _manifest(root: Path, task: LabelReader) -> ImageSet | None:
    if root.is_file() and root.suffix.lower() == ".csv":
        image_root = root.parent / "train" if (root.parent / "train").is_dir() else root.parent
        return read_manifest(root, image_root, task)
    csv_path = root / "train.csv"
    if not csv_path.is_file():
        return None
    return read_manifest(csv_path, root / "train" if (root / "train").is_dir() else root, task)


def read_folder(
    data: str,
    image_column: str | None = None,
    label_column: str | None = None,
    *,
    every_split: bool = False,
    task: LabelReader,
) -> ImageSet:
    """Detect the layout of the folder (or manifest) ``data`` and list its labelled images.

    ``task`` reads the label cells: a manifest's (``read_manifest``), or the class of each file of the other
    layouts. The columns and ``every_split`` are other sources' (``data/sources.py`` gives each the same call).
    """
    root = Path(data).expanduser()
    if not root.exists():
        raise UserError(f"data folder not found: {data} (make one with `visiontune sample-data {data}`)")
    if root.is_dir() and not any(root.iterdir()):
        raise UserError(f"data folder is empty: {data}")
    for finder in (_manifest, _kaggle, _image_folder):
        try:
            if finder is _manifest:
                found = _manifest(root, task)
            else:
                found = finder(root) if root.is_dir() else None
                found = (
                    None if found is None else read_classes(found, task, f"{data}: the {found.layout} layout's files")
                )
        except PermissionError as e:
            raise UserError(
                f"cannot read {e.filename} (permission denied): fix its permissions or move it out of {data}"
            ) from None
        if found is not None:
            return found
    raise UserError(
        f"cannot tell the layout of {data}: expected train.csv, train/<class>.<n>.jpg "
        "(Kaggle Dogs vs Cats) or one subfolder per class"
    )


# Tried last: any --data the other sources do not recognise is a folder (or manifest) path.
SOURCE = Source(
    "folder",
    recognises=lambda data: True,
    read=read_folder,
    help="data folder (Kaggle layout, train.csv manifest, or class subfolders)",
    short="a data folder",
    exists=lambda data: Path(data).exists(),
)


def write_kaggle_manifest(data: str) -> tuple[str, int]:
    """``visiontune prepare``: write ``DATA/train.csv`` from the Kaggle layout."""
    found = _kaggle(Path(data)) if Path(data).is_dir() else None
    if found is None:
        raise UserError(f"{data} is not in the Kaggle layout (train/<class>.<n>.jpg)")
    out = Path(data) / "train.csv"
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["filename", "label"])
    for p, lab in zip(found.paths, found.labels):
        w.writerow([os.path.basename(p), found.classes[lab]])
    atomic_write(out, buf.getvalue())
    return str(out), len(found.paths)
