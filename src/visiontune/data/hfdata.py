"""``--data hf:PATH`` and ``hf:ORG/NAME``: a Hugging Face ``datasets`` set as an ``ImageSet``.

PATH is a folder written by ``save_to_disk``, a folder of Parquet files, or an
image folder that ``load_dataset`` reads (its ``imagefolder`` builder); anything
else after ``hf:`` is a Hub id, loaded through datasets' own cache. The image
column is the one whose feature is ``Image`` and the label column the
``ClassLabel`` one (or a list of ``ClassLabel``: multi-label), unless
``--image-column``/``--label-column`` say otherwise; the task reads the column's values (class names from
the ClassLabel, other labels their sorted values; a regression's numbers). A
``train`` split with a ``validation`` one is used as it is (``val_mask``); a
lone split, or one beside an empty validation split, gets visiontune's seeded
split. Images are read as the encoded bytes stored in the Arrow table
(``Image(decode=False)``), never decoded by datasets: decoding, its failures and
the resize are visiontune's, as for files. Each sample is named
``hf:PATH/<split>/<row>``.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any

import numpy as np

from visiontune.data.imageset import Cells, ImageSet, LabelReader, Source
from visiontune.errors import UserError
from visiontune.text import byte_size

INSTALL = "reading hf: data needs Hugging Face datasets: pip install 'visiontune[formats]'"
VAL_SPLITS = ("validation", "valid", "val")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(INSTALL) from None
    datasets.disable_progress_bars()
    return datasets


def _local(name: str) -> str | None:
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.exists(path):
        raise UserError(f"hf:{name} is a file; give the folder a datasets set was saved to, or a Hub id")
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise UserError(f"data folder not found: {name} (hf:PATH is a folder saved by datasets, or hf:ORG/NAME)")
    return None


def load(data: str) -> tuple[str, Any]:
    """(root, the ``Dataset`` or ``DatasetDict``) of ``hf:...``; root names the data in records and sample names."""
    ds, name = _datasets(), data[3:]
    path = _local(name)
    if path is not None:
        saved = any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
        try:
            return "hf:" + path, _from_disk(ds, path) if saved else _from_files(ds, path)
        except UserError:
            raise
        except Exception as e:  # datasets' own reasons (no data files, mixed formats, ...)
            raise UserError(f"cannot read {data} with datasets ({_short(e)})") from None
    try:
        return data, ds.load_dataset(name)
    except Exception as e:
        cache = ds.config.HF_DATASETS_CACHE
        why = "HF_HUB_OFFLINE is set" if ds.config.HF_HUB_OFFLINE else _short(e)
        raise UserError(
            f"{name} is not in the datasets cache {cache} and cannot be downloaded ({why}); "
            "download it once with a connection, or save it with save_to_disk and pass hf:PATH"
        ) from None


MAX_RECORD = 16 << 20  # bytes of a saved set's JSON record (dataset_dict.json, state.json, dataset_info.json)


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _record(path: str) -> dict:
    """A saved set's JSON record (an object), read bounded: one line when it is too large, not JSON or no object."""
    with open(path, "rb") as f:
        text = f.read(MAX_RECORD + 1)
    if len(text) > MAX_RECORD:
        raise UserError(
            f"{path} is larger than a datasets record is ({byte_size(MAX_RECORD)}); "
            "save the set again with save_to_disk"
        )
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested past the parser
        raise UserError(f"{path} is not JSON ({_short(e)[:80]}); save the set again with save_to_disk") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} is {_shown(record)}, not a JSON object; save the set again with save_to_disk")
    return record


def _plain(name: Any) -> bool:
    """A file or folder name inside the saved set's folder (no path, so nothing outside it is read)."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _saved(path: str) -> dict[str | None, bool]:
    """The splits of the set ``save_to_disk`` wrote in ``path`` (None: one Dataset there), each with whether it
    has data files: every record datasets reads read here first, bounded, and the names in them checked."""
    splits: list[str | None] = [None]
    if os.path.isfile(listing := os.path.join(path, "dataset_dict.json")):
        names = _record(listing).get("splits")
        if not isinstance(names, list) or not all(_plain(n) for n in names):
            raise UserError(
                f"{listing}: its splits are {_shown(names)}, expected a list of the names of its split folders; "
                "save the set again with save_to_disk"
            )
        splits = names
    out = {}
    for split in splits:
        folder = path if split is None else os.path.join(path, split)
        if os.path.isfile(info := os.path.join(folder, "dataset_info.json")):
            _record(info)
        state = os.path.join(folder, "state.json")
        files = _record(state).get("_data_files", []) if os.path.isfile(state) else []
        if not isinstance(files, list) or not all(isinstance(f, dict) and _plain(f.get("filename")) for f in files):
            raise UserError(
                f'{state}: its _data_files are {_shown(files)}, expected a list of {{"filename": NAME}} of files '
                "in its folder; save the set again with save_to_disk"
            )
        out[split] = bool(files)
    return out


def _from_disk(ds, path: str):
    """``load_from_disk``, its records checked first (``_saved``), but a split saved empty (``save_to_disk``
    writes it no Arrow file, and datasets fails to load it back: "list index out of range") is read as an empty
    Dataset of its features."""
    splits = _saved(path)
    try:
        return ds.load_from_disk(path)
    except IndexError:
        pass

    def one(folder: str, has_data: bool):
        if has_data:
            return ds.Dataset.load_from_disk(folder)
        features = ds.DatasetInfo.from_directory(folder).features
        return ds.Dataset.from_dict({k: [] for k in features}, features=features)

    if None in splits:
        return one(path, splits[None])
    return ds.DatasetDict({s: one(os.path.join(path, s), has_data) for s, has_data in splits.items()})


def _from_files(ds, path: str):
    """``load_dataset`` of a folder of data files, but an empty split's files (which datasets refuses with
    'Instruction "validation" corresponds to no data!') give an empty Dataset of the other splits' features."""
    try:
        return ds.load_dataset(path)
    except ValueError as e:
        if "corresponds to no data" not in str(e):
            raise
        error = e
    splits = {}
    for name in ds.load_dataset_builder(path).config.data_files:
        try:
            splits[str(name)] = ds.load_dataset(path, split=name)
        except ValueError:
            splits[str(name)] = None
    features = next((d.features for d in splits.values() if d is not None), None)
    if features is None:  # every split empty
        raise error
    empty = ds.Dataset.from_dict({k: [] for k in features}, features=features)
    return ds.DatasetDict({n: empty if d is None else d for n, d in splits.items()})


def _short(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def _parts(root: str, loaded, every_split: bool) -> tuple[list[tuple[str, Any]], str | None, str]:
    """The splits to list, as (name, Dataset), the validation one's name when the data has both, and the
    split's note: its own splits, or an empty validation split left for the seeded split of train."""
    if not hasattr(loaded, "keys"):  # one Dataset
        parts = [(str(loaded.split or "train"), loaded)]
    elif every_split:
        return [(n, loaded[n]) for n in loaded], None, ""
    else:
        names = list(loaded.keys())
        train = "train" if "train" in loaded else names[0] if len(names) == 1 else None
        if train is None:
            raise UserError(f"{root} has the splits {', '.join(names)} and none is 'train'; save one as 'train'")
        parts = [(train, loaded[train])]
    if not len(parts[0][1]):
        raise UserError(f"{root}: its {parts[0][0]} split has no rows; give it the images to train on")
    val = next((v for v in VAL_SPLITS if hasattr(loaded, "keys") and v in loaded), None)
    if val is None:
        return parts, None, ""
    if not len(loaded[val]):  # as if there were none, but said on the start line and in split.json
        return parts, None, f"its {val} split is empty: the seeded split of {parts[0][0]}"
    return parts + [(val, loaded[val])], val, f"its own {parts[0][0]}/{val} splits"


def _columns(root: str, features, image_column: str | None, label_column: str | None) -> tuple[str, str | None]:
    ds = _datasets()
    for flag, col in (("--image-column", image_column), ("--label-column", label_column)):
        if col is not None and col not in features:
            raise UserError(f"{root} has no column {col!r} ({flag}); its columns: {', '.join(features)}")
    if image_column is None:
        images = [k for k, f in features.items() if isinstance(f, ds.Image)]
        if len(images) != 1:
            raise UserError(
                f"{root}: {'no' if not images else 'several'} Image column(s) among {', '.join(features)}; "
                "pass --image-column NAME"
            )
        image_column = images[0]
    elif not isinstance(features[image_column], ds.Image) and features[image_column] != ds.Value("binary"):
        raise UserError(f"{root}: column {image_column!r} holds {features[image_column]}, not images")
    if label_column is None:
        labels = [k for k, f in features.items() if isinstance(f, ds.ClassLabel) or _label_sets(f) is not None]
        if len(labels) > 1:
            raise UserError(f"{root}: several ClassLabel columns ({', '.join(labels)}); pass --label-column NAME")
        label_column = labels[0] if labels else "label" if "label" in features else None
    return image_column, label_column


class HFReader:
    """Sample i's encoded bytes: row ``row[i]`` of split ``part[i]``, read from the memory-mapped Arrow table.

    Picklable (a Dataset pickles as the paths of its Arrow files), and ``spec()`` reopens it from
    the data's name in another process of the job.
    """

    def __init__(self, data: str, splits: list[str], column: str, parts: list, part: np.ndarray, row: np.ndarray):
        self.data, self.splits, self.column, self.parts = data, splits, column, parts
        self.part, self.row = part, row
        self.fingerprint = "hf\0" + "\0".join([data, column, *(getattr(p, "_fingerprint", "") or "" for p in parts)])
        ds = _datasets()
        self._tables = [
            p.select_columns([column]).cast_column(column, ds.Image(decode=False))
            if isinstance(p.features[column], ds.Image)
            else p.select_columns([column])
            for p in parts
        ]

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, i: int) -> bytes:
        item = self._tables[int(self.part[i])][int(self.row[i])][self.column]
        if isinstance(item, dict):  # {"bytes", "path"}: an image folder's rows hold the path only
            if item.get("bytes") is None and item.get("path"):
                try:
                    with open(item["path"], "rb") as f:
                        return f.read()
                except OSError:
                    return b""  # decoding says "empty file"; the name says which row
            item = item.get("bytes")
        return bytes(item or b"")

    def take(self, idx) -> HFReader:
        out = object.__new__(HFReader)
        out.__dict__.update(self.__dict__, part=self.part[idx], row=self.row[idx])
        return out

    def spec(self) -> dict:
        whole = len(self.row) == sum(len(p) for p in self.parts) and bool(np.all(np.diff(self.part) >= 0))
        whole = whole and bool(np.all(np.diff(self.row)[np.diff(self.part) == 0] == 1))
        rows = None if whole else {"part": self.part.tolist(), "row": self.row.tolist()}
        return {"kind": "hf", "data": self.data, "splits": self.splits, "column": self.column, "rows": rows}


def reopen(spec: dict) -> HFReader:
    """The reader ``spec()`` described, in this process."""
    _, loaded = load(spec["data"])
    parts = [loaded[s] if hasattr(loaded, "keys") else loaded for s in spec["splits"]]
    if spec["rows"] is None:
        part = np.repeat(np.arange(len(parts), dtype=np.int32), [len(p) for p in parts])
        row = np.concatenate([np.arange(len(p), dtype=np.int64) for p in parts])
    else:
        part, row = np.asarray(spec["rows"]["part"], np.int32), np.asarray(spec["rows"]["row"], np.int64)
    return HFReader(spec["data"], spec["splits"], spec["column"], parts, part, row)


def _label_sets(feature):
    """The ClassLabel of a column that holds a list of them (``Sequence(ClassLabel)``: multi-label), else None."""
    inner = getattr(feature, "feature", None)
    return inner if isinstance(inner, _datasets().ClassLabel) else None


def _where(root: str, parts, i: int) -> str:
    """Row ``i`` of the splits listed one after the other, as ``ROOT/<split> row <n>``."""
    where = 0
    while i >= len(parts[where][1]):
        i -= len(parts[where][1])
        where += 1
    return f"{root}/{parts[where][0]} row {i}"


def _cells(root: str, parts, column: str | None, optional: bool) -> Cells:
    """The label column's values, for the task to read: a ClassLabel's indices (a list of ClassLabel: lists of
    them) with its names, or any other column's values as Arrow gives them; None without a label column."""
    ds = _datasets()
    n = sum(len(p) for _, p in parts)
    where = partial(_where, root, parts)
    if column is None:
        return Cells(None, n, where, root, optional=optional)
    feature = parts[0][1].features[column]
    sets = _label_sets(feature)
    if isinstance(feature, ds.ClassLabel):
        rows = np.concatenate([np.asarray(p.with_format("numpy")[column]) for _, p in parts]).astype(np.int64)
        names = list(feature.names)
    elif sets is not None:
        rows, names = [v for _, p in parts for v in p.with_format(None)[column]], list(sets.names)
    else:  # read through Arrow: numpy's strings are slow
        rows, names = [v for _, p in parts for v in p.with_format("arrow")[column].to_pylist()], None
    return Cells(rows, n, where, root, names=names, optional=optional, column=column)


def read(
    data: str,
    image_column: str | None = None,
    label_column: str | None = None,
    *,
    every_split: bool = False,
    task: LabelReader,
) -> ImageSet:
    """List ``hf:...`` as an ImageSet whose ``reader`` gives each row's image bytes; ``task`` reads the label
    column (a column that is a list of ClassLabel is a label set whether or not --task multilabel says so)."""
    root, loaded = load(data)
    parts, val, note = _parts(root, loaded, every_split)
    image_column, label_column = _columns(root, parts[0][1].features, image_column, label_column)
    labelled = task.parse(_cells(root, parts, label_column, optional=every_split))
    sizes = [len(p) for _, p in parts]
    part = np.repeat(np.arange(len(parts), dtype=np.int32), sizes)
    row = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])
    names = [f"{root}/{name}/{r}" for name, p in parts for r in range(len(p))]
    reader = HFReader(root, [n for n, _ in parts], image_column, [p for _, p in parts], part, row)
    return ImageSet.of(
        root, "hf", names, labelled, reader=reader, val_mask=(part == len(parts) - 1) if val else None, split_note=note
    )


def _read_source(
    data: str, image_column: str | None, label_column: str | None, *, every_split: bool, task: LabelReader
) -> ImageSet:
    return read(data, image_column, label_column, every_split=every_split, task=task)


SOURCE = Source(
    "hf",
    # hf://...tar is a URL of shards (data/remote.py), not a data set
    recognises=lambda data: data.startswith("hf:") and not (data.startswith("hf://") and ".tar" in data),
    read=_read_source,
    reopen=reopen,
    help="hf:PATH|ORG/NAME",
    short="hf:PATH|ORG/NAME",
    named=True,
    container=True,
    lists_unlabelled=True,
    hub_id=lambda data: data[3:].split("@")[0].split(":")[0],
)
