"""hf: data sets and WebDataset shards as ImageSets: columns, splits, names, bytes, bad samples, the hand-over."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from visiontune.cli.commands import main
from visiontune.data import shards
from visiontune.data.check import scan
from visiontune.data.decode import try_read
from visiontune.data.sample import make_sample_data
from visiontune.data.sources import discover
from visiontune.data.split import make_split, make_stratified_split, relative_paths, split_of
from visiontune.errors import UserError
from visiontune.loading import jobdata
from visiontune.loading.cache import CachedDataset, open_or_build
from visiontune.tasks import AUTO

datasets = pytest.importorskip("datasets")
webdataset = pytest.importorskip("webdataset")


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(np.full((12, 10, 3), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def hf_dict(images: list[bytes], labels: list[int], names=("cat", "dog")):
    features = datasets.Features(
        {"img": datasets.Image(), "note": datasets.Value("int64"), "y": datasets.ClassLabel(names=list(names))}
    )
    rows = {"img": [{"bytes": b, "path": None} for b in images], "note": list(range(len(images))), "y": labels}
    return datasets.Dataset.from_dict(rows, features=features)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("formats") / "data"
    make_sample_data(out, per_class=10, test_count=0, seed=5)
    return out


def test_hf_saved_set_lists_rows_by_their_features_and_keeps_its_own_split(tmp_path):
    images = [_png(10 * i) for i in range(9)]
    train = hf_dict(images[:6], [0, 1, 0, 1, 1, 0])
    val = hf_dict(images[6:], [1, 0, 1])
    datasets.DatasetDict({"train": train, "validation": val, "test": val}).save_to_disk(str(tmp_path / "hf"))

    found = discover(f"hf:{tmp_path / 'hf'}", task=AUTO)
    root = f"hf:{tmp_path / 'hf'}"
    assert (found.root, found.layout, found.classes) == (root, "hf", ["cat", "dog"])
    assert list(found.paths) == [f"{root}/train/{i}" for i in range(6)] + [f"{root}/validation/{i}" for i in range(3)]
    assert found.labels.tolist() == [0, 1, 0, 1, 1, 0, 1, 0, 1]
    assert [found.reader[i] for i in range(9)] == images  # the stored bytes, not a re-encoding
    split = split_of(found, 0.5, seed=0)  # its own: the fraction and seed do not apply
    assert split.train.tolist() == list(range(6)) and split.val.tolist() == [6, 7, 8]
    assert relative_paths(found.paths, split.val, found.root) == ["validation/0", "validation/1", "validation/2"]
    # A view keeps names, labels and bytes together.
    part = found.take([8, 2])
    assert list(part.paths) == [f"{root}/validation/2", f"{root}/train/2"]
    assert [part.reader[0], part.reader[1]] == [images[8], images[2]] and part.val_mask.tolist() == [True, False]
    # predict lists every split's rows.
    assert len(discover(root, every_split=True, task=AUTO)) == 12
    # Columns chosen by name; an unknown one is one line naming the columns there are.
    by_name = discover(root, "img", "note", task=AUTO)
    assert by_name.classes == [str(i) for i in range(6)] and by_name.labels.tolist()[:6] == list(range(6))
    with pytest.raises(UserError, match="no column 'pixels'.*img, note, y"):
        discover(root, "pixels", task=AUTO)


def test_hf_parquet_folder_gets_the_seeded_split_and_broken_bytes_are_a_bad_file(tmp_path):
    images = [_png(20 * i) for i in range(9)] + [b"\xff\xd8\xff\xe0 not really a jpeg"]
    hf_dict(images, [i % 2 for i in range(10)]).to_parquet(str(tmp_path / "pq" / "train-00000.parquet"))
    found = discover(f"hf:{tmp_path / 'pq'}", task=AUTO)
    assert len(found) == 10 and found.val_mask is None and found.split_note == ""
    # Stratified by class (the default): one of each class's five images held out, in the seed's order.
    split = split_of(found, 0.2, seed=3)
    assert split == make_stratified_split(found.labels, 0.2, 3) and sorted(found.labels[split.val]) == [0, 1]
    assert split_of(found, 0.2, seed=3, method="random") == make_split(10, 0.2, 3)
    bad = scan(found.paths, reader=found.reader, cache_path=str(tmp_path / "scan.keys"))
    assert bad == [(f"hf:{tmp_path / 'pq'}/train/9", bad[0][1])] and "JPEG" in bad[0][1]
    # Remembered by name and content: a second scan decodes nothing and says the same.
    assert scan(found.paths, reader=found.reader, cache_path=str(tmp_path / "scan.keys")) == bad


def test_group_by_an_hf_column_follows_the_rows_through_take(tmp_path):
    from visiontune.data.groups import group_names

    hf_dict([_png(9 * i) for i in range(8)], [i % 2 for i in range(8)]).to_parquet(str(tmp_path / "pq" / "t.parquet"))
    found = discover(f"hf:{tmp_path / 'pq'}", task=AUTO)
    assert group_names(found, "note") == [str(i) for i in range(8)]  # the "note" column, row by row
    assert group_names(found.take([5, 2]), "note") == ["5", "2"]


def test_the_listing_hand_over_reopens_readers_with_their_split(tmp_path, folder):
    images = [_png(7 * i) for i in range(5)]
    datasets.DatasetDict(
        {"train": hf_dict(images[:3], [0, 1, 0]), "validation": hf_dict(images[3:], [1, 0])}
    ).save_to_disk(str(tmp_path / "hf"))
    assert main(["shard", str(folder), "--out", str(tmp_path / "sh"), "--shard-size", "50KB"]) == 0
    for data in (f"hf:{tmp_path / 'hf'}", str(tmp_path / "sh")):
        found = discover(data, task=AUTO).take([4, 0, 1, 3])  # a view, as after dropping bad files
        jobdata.save_listing(found, str(tmp_path / "list.bin"))
        back, _ = jobdata.load_listing(str(tmp_path / "list.bin"), AUTO)
        assert list(back.paths) == list(found.paths) and back.labels.tolist() == found.labels.tolist()
        assert back.val_mask.tolist() == found.val_mask.tolist() and back.split_note == found.split_note
        assert [back.reader[i] for i in range(4)] == [found.reader[i] for i in range(4)]


def test_shard_writes_webdataset_shards_that_read_back_as_the_folder(tmp_path, folder, capsys):
    out = tmp_path / "sh"
    assert main(["shard", str(folder), "--out", str(out), "--shard-size", "150KB", "--seed", "7"]) == 0
    index = json.loads((out / "index.json").read_text())
    tars = sorted(p.name for p in out.glob("*.tar"))
    assert [s["url"] for s in index["shardlist"]] == tars and len(tars) > 2
    # --shard-size bounds the files (tar headers and padding included), unless one sample is larger alone.
    assert all((out / s["url"]).stat().st_size <= 150_000 or s["nsamples"] == 1 for s in index["shardlist"])
    assert any(s["nsamples"] > 1 for s in index["shardlist"])
    source = discover(str(folder), task=AUTO)
    assert sum(s["nsamples"] for s in index["shardlist"]) == len(source) == 20
    # webdataset's own reader sees KEY.jpg + KEY.cls samples with the folder's labels, in order.
    samples = list(webdataset.WebDataset([str(out / t) for t in tars], shardshuffle=False))
    assert [int(s["cls"]) for s in samples] == source.labels.tolist()
    assert [s["jpg"] for s in samples] == [Path(p).read_bytes() for p in source.paths]

    found = discover(str(out), task=AUTO)
    assert found.layout == "shards" and found.classes == source.classes
    assert relative_paths(found.paths, range(20), found.root) == relative_paths(source.paths, range(20), source.root)
    assert [found.reader[i] for i in range(20)] == [Path(p).read_bytes() for p in source.paths]
    # The recorded split (what a run on the folder with seed 7 makes: stratified), whatever the run's seed.
    assert split_of(found, 0.5, seed=0) == make_stratified_split(source.labels, 0.2, 7)
    # A brace pattern over the same shards reads the same samples.
    pattern = discover(str(out / f"shards-{{000000..{len(tars) - 1:06d}}}.tar"), task=AUTO)
    assert pattern.labels.tolist() == found.labels.tolist() and pattern.reader[5] == found.reader[5]
    # --cache on shards: the rows are what decoding each sample gives.
    cache = open_or_build(str(tmp_path / "cache"), found.paths, 16, threads=1, reader=found.reader)
    rows = CachedDataset(cache, [3, 11], found.labels[[3, 11]])
    for (img, label), i in zip(rows.__getitems__([0, 1]), (3, 11)):
        assert img.equal(try_read(found.reader[i], 16)) and label == found.labels[i]


def test_shards_written_by_shardwriter_with_a_corrupt_sample_and_a_truncated_shard(tmp_path, capsys):
    out = tmp_path / "wds"
    out.mkdir()
    with webdataset.ShardWriter(str(out / "part-%03d.tar"), maxcount=4, verbose=0) as w:
        for i in range(10):
            image = b"garbage, not an image" if i == 6 else _png(20 * i)
            w.write({"__key__": f"img{i:03d}", "png": image, "cls": 3 if i % 3 else 7})
    found = discover(str(out), task=AUTO)
    assert found.classes == ["3", "7"] and found.val_mask is None
    assert found.labels.tolist() == [1 if i % 3 == 0 else 0 for i in range(10)]
    assert found.reader[4] == _png(80)
    assert main(["check", str(out)]) == 1
    said = capsys.readouterr().out
    assert f"{out}/img006: not an image" in said and "1 bad of 10" in said

    last = sorted(out.glob("*.tar"))[-1]
    last.write_bytes(last.read_bytes()[:1700])  # cut inside a sample
    assert main(["check", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{last}: truncated" in err[0]


@pytest.mark.parametrize("fmt", ["pax", "gnu", "ustar"])
def test_the_shard_walk_finds_every_member_where_tarfile_does(tmp_path, fmt):
    """The index's own header reader against tarfile's: long names (pax records, GNU 'L' members, the ustar
    prefix), non-ASCII names, a directory and links between the samples; then a header broken."""
    deep = "d" * 90 + "/" + "e" * 90  # over 100 characters: a prefix in ustar, a long-name record otherwise
    names = [f"{deep}/k{i:03d}" for i in range(3)] + ["short/img", "caf\u00e9/\u732b"] * (fmt != "ustar")
    path = tmp_path / f"{fmt}.tar"
    with tarfile.open(path, "w", format=getattr(tarfile, f"{fmt.upper()}_FORMAT")) as tar:
        folder = tarfile.TarInfo("short")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for n, name in enumerate(names):
            for ext, data in (("png", _png(20 * n) * (n + 1)), ("cls", str(n).encode())):
                info = tarfile.TarInfo(f"{name}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            link = tarfile.TarInfo(f"{name}.link")
            link.type, link.linkname = tarfile.SYMTYPE, "elsewhere.png"
            tar.addfile(link)
    with tarfile.open(path) as tar:
        want = [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert list(shards._members(fd, path.stat().st_size)) == want and len(want) == 2 * len(names)
    finally:
        os.close(fd)
    found = discover(str(path), task=AUTO)
    assert [p.rpartition("/")[2] for p in found.paths] == [n.rpartition("/")[2] for n in names]
    assert [found.reader[i] for i in range(len(names))] == [_png(20 * n) * (n + 1) for n in range(len(names))]
    # A header whose checksum does not add up is a damaged shard.
    raw = bytearray(path.read_bytes())
    raw[520] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="damaged shard .*checksum"):
        shards.read(str(path))


def test_without_the_extra_hf_data_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets fails, as when it is not installed
    assert main(["check", "hf:some/set"]) == 2
    assert "pip install 'visiontune[formats]'" in capsys.readouterr().err


def test_urls_webdataset_cannot_open_and_file_urls_are_answered_with_what_to_pass(capsys):
    assert main(["check", "sftp://host/set/shards-{000..009}.tar"]) == 2
    assert "read sftp:// through a command you trust: --data 'pipe:COMMAND'" in capsys.readouterr().err
    assert main(["check", "file:///data/shards"]) == 2 and "--data /data/shards" in capsys.readouterr().err


@pytest.mark.slow
def test_a_hub_id_offline_names_the_datasets_cache(tmp_path, worker_env):
    env = {**worker_env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    env.pop("HF_DATASETS_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-m", "visiontune", "check", "hf:someone/not-cached"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "hf-home" / "datasets") in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert os.listdir(tmp_path) == ["hf-home"] or "bad_files.csv" not in os.listdir(tmp_path)


def test_hf_label_column_of_classlabel_lists_is_multi_label_and_gets_the_stratified_split(tmp_path):
    tags = datasets.Sequence(datasets.ClassLabel(names=["cloudy", "river", "road"]))
    features = datasets.Features({"img": datasets.Image(), "tags": tags})
    sets = [[0, 2], [1], [], [0, 1, 2], [2], [0], [1, 2], [], [0, 2], [1]]
    rows = {"img": [{"bytes": _png(20 * i), "path": None} for i in range(len(sets))], "tags": sets}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    found = discover(f"hf:{tmp_path / 'hf'}", task=AUTO)
    assert found.task == "multilabel" and found.classes == ["cloudy", "river", "road"]
    assert found.targets.tolist() == [[int(k in s) for k in range(3)] for s in sets]  # [] is all-negative
    split = split_of(found, 0.3, seed=0)
    assert "iterative" in split.method and len(split.train) + len(split.val) == len(sets)
