"""The data-source registry: which source a --data string names, and what each asks of it."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from visiontune.data import sources
from visiontune.data.sample import make_sample_data
from visiontune.data.shardwriter import write
from visiontune.errors import UserError
from visiontune.inference.predict import list_inputs
from visiontune.reports.modelcard import dataset_name
from visiontune.tasks import AUTO, reader


def test_each_data_string_is_told_apart_once_and_described_by_its_source(tmp_path):
    tars = tmp_path / "tars"
    tars.mkdir()
    (tars / "a.tar").write_bytes(b"")
    folder = tmp_path / "folder"
    (folder / "cat").mkdir(parents=True)
    cases = {
        "hf:org/name": "hf",
        "hf:./saved": "hf",
        "hf://datasets/org/name/shards-{0..3}.tar": "url-shards",  # hf:// naming .tar: shards at a URL
        "https://host/s-{000..009}.tar": "url-shards",
        "gs://bucket/s.tar": "store",
        "s3://bucket/set/": "store",  # told by the scheme alone: listed when read
        "az://container/s-{0..3}.tar": "store",
        str(tars): "shards",  # a folder of .tar files only
        str(tars / "a.tar"): "shards",
        str(tmp_path / "missing-{0..2}.tar"): "shards",  # a pattern: its shards are checked when read
        str(folder): "folder",
        str(tmp_path / "gone"): "folder",
    }
    assert {data: sources.find(data).name for data in cases} == cases
    # Names are recorded as given, paths made absolute; a path that is gone is said to be gone.
    assert sources.recorded("hf:org/name") == "hf:org/name"
    assert sources.recorded("https://host/s.tar") == "https://host/s.tar"
    assert sources.recorded("s3://bucket/set/") == "s3://bucket/set/"
    assert sources.recorded("rel/data") == os.path.abspath("rel/data")
    assert [sources.exists(d) for d in ("hf:org/name", str(folder), str(tmp_path / "gone"))] == [True, True, False]
    assert sources.exists(str(tmp_path / "missing-{0..2}.tar"))
    # Only hf: data has a Hub id: the model card names the data set by it.
    assert sources.hub_id("hf:org/name@main") == "org/name" and sources.hub_id(str(folder)) is None
    assert dataset_name({"data": {"source": "hf:org/name:cfg"}}) == ("org/name", "org/name")
    assert dataset_name({"data": {"source": str(folder)}}) == ("folder", None)
    # --help in each source's own words, as the commands have always said it.
    assert sources.help_text() == (
        "data folder (Kaggle layout, train.csv manifest, or class subfolders), tar shards (a folder, pattern or "
        "URL), hf:PATH|ORG/NAME, or an object store's shards or folder (s3://bucket/prefix/, gs://, az://)"
    )
    assert (
        sources.help_text(short=True)
        == "a data folder, tar shards, hf:PATH|ORG/NAME or object-store data (s3://, gs://, az://)"
    )
    with pytest.raises(UserError, match="pass the path itself"):
        sources.find("file:///data")
    with pytest.raises(UserError, match="tar shards carry one class per sample"):
        sources.discover(str(tars), task=reader("multilabel"))


def test_predict_lists_container_data_through_its_source_and_folders_itself(tmp_path):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("webdataset")
    data = tmp_path / "data"
    make_sample_data(data, per_class=3, test_count=0, seed=2)
    write(str(data), str(tmp_path / "sh"), workers=1, task=AUTO)
    shards = list_inputs(str(tmp_path / "sh"))
    listed = sources.discover(str(tmp_path / "sh"), task=AUTO)
    assert shards.paths == list(listed.paths) and len(shards.paths) == 6
    assert [shards.reader[i] for i in range(6)] == [listed.reader[i] for i in range(6)]
    # The reader travels as its spec and is reopened by the source that named it.
    again = sources.reopen(shards.reader.take(np.array([4, 1])).spec())
    assert [again[0], again[1]] == [shards.reader[4], shards.reader[1]]
    # hf: data with an unlabelled test split: predict lists every row (train would refuse the test rows).
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    rows = {"image": [{"bytes": png.getvalue(), "path": None}] * 3, "label": [0, 1, -1]}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    part = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict({"train": part.select([0, 1]), "test": part.select([2])}).save_to_disk(str(tmp_path / "hf"))
    hf = list_inputs(f"hf:{tmp_path / 'hf'}")
    assert len(hf.paths) == 3 and hf.reader[2] == png.getvalue()
    # A folder is predict's own listing: its image files, no reader.
    folder = list_inputs(str(data))
    assert folder.reader is None and sorted(folder.paths) == sorted(sources.discover(str(data), task=AUTO).paths)


def test_only_a_source_that_copies_its_data_in_is_fetched_once_per_machine_before_listing(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from visiontune.loading import jobdata

    fetched = []
    monkeypatch.setattr(jobdata, "_once_per_machine", lambda accelerator, what, work: fetched.append((what, work)))
    for data, processes in [
        ("https://host/s.tar", 2),
        ("https://host/s.tar", 1),
        ("hf:org/name", 2),
        (str(tmp_path), 2),
    ]:
        jobdata.fetch_per_machine(SimpleNamespace(num_processes=processes), data)
    assert [what for what, _ in fetched] == ["fetch"]  # the URL, in a job of two processes only
