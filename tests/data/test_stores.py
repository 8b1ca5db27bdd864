"""Data in object storage (``data/stores.py``), against a real S3-protocol server on 127.0.0.1 (moto's server
mode, ``tests/s3server.py``): shards and folders read as the same files on disk, each object fetched once,
the server's failures retried and then one line, credentials kept to the store's own chain."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from s3server import CREDENTIALS, s3_server, upload
from storefiles import FOLDERS, make_store_files
from storefiles import one_line as _one_line
from storefiles import same as _same
from visiontune.cli.commands import main
from visiontune.data import sources, stores
from visiontune.errors import UserError
from visiontune.tasks import AUTO

pytest.importorskip("webdataset")  # `visiontune shard` writes with its ShardWriter


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server, with a folder of 6 images (Kaggle layout), its shards (one or two images each, with
    visiontune's index.json) and a class-subfolder copy with a manifest, uploaded to bucket ``data``."""
    tmp = tmp_path_factory.mktemp("stores")
    make_store_files(tmp)
    with s3_server() as server:
        for name in FOLDERS:
            upload(server, tmp / name, f"s3://data/{name}")
        server.local = tmp
        yield server


@pytest.fixture(autouse=True)
def store_env(tmp_path, monkeypatch, s3):
    monkeypatch.setenv("VISIONTUNE_SHARD_CACHE", str(tmp_path / "shard-cache"))
    monkeypatch.chdir(tmp_path)  # `check` writes its report here
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    s3.requests.clear()
    s3.faults.clear()


@pytest.mark.parametrize(
    "url", ["s3://data/shards/", "s3://data/shards", "s3://data/shards/shards-{000000..000005}.tar"]
)
def test_shards_in_a_bucket_are_listed_through_the_store_copied_once_and_read_as_the_local_shards(s3, url):
    local = sources.discover(str(s3.local / "shards"), task=AUTO)
    got = sources.discover(url, task=AUTO)
    _same(got, local)
    assert [got.reader[i] for i in range(len(got))] == [local.reader[i] for i in range(len(local))]
    assert got.split_note == "the split recorded in index.json" and got.root == url.rstrip("/")
    assert got.paths[0] == f"{url.rstrip('/')}/train/cat.0.jpg"  # the folder's names, below the URL
    names = sorted(p.name for p in (s3.local / "shards").iterdir())
    assert len(names) == 7 and all(s3.gets(f"/data/shards/{n}") == 1 for n in names), s3.requests
    assert [r for r in s3.requests if r[1] == "/data"] == [("GET", "/data", "")]  # one LIST
    s3.requests.clear()
    again = sources.discover(url, task=AUTO)  # a later command, another process: from the cache, no request at all
    _same(again, local)
    assert s3.requests == []
    # A worker reopens the reader from its spec: the same bytes, no request.
    spec = got.reader.take(np.asarray([2, 0])).spec()
    assert spec["kind"] == "store" and spec["data"] == url.rstrip("/")
    assert [sources.reopen(spec)[i] for i in range(2)] == [local.reader[2], local.reader[0]]
    assert s3.requests == []


@pytest.mark.parametrize("how", ["AWS_ENDPOINT_URL_S3", "profile"])
def test_the_endpoint_and_credentials_come_from_the_store_s_own_chain(s3, tmp_path, monkeypatch, how):
    """The S3-only endpoint variable, or a profile (its endpoint_url and keys) in the AWS config file."""
    for k in s3.env():
        monkeypatch.delenv(k)
    if how == "profile":
        config = tmp_path / "aws-config"
        keys = "".join(f"{k.lower()} = {v}\n" for k, v in CREDENTIALS.items())
        config.write_text(f"[profile bench]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n{keys}")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
        monkeypatch.setenv("AWS_PROFILE", "bench")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for k, v in CREDENTIALS.items():
            monkeypatch.setenv(k, v)
    got = sources.discover("s3://data/shards/", task=AUTO)
    assert len(got) == 6 and s3.gets("/data/shards/shards-000000.tar") == 1


def test_shards_without_an_index_are_found_by_listing_the_prefix(s3, tmp_path):
    shards = sorted((s3.local / "shards").glob("*.tar"))
    (tmp_path / "bare").mkdir()
    for p in shards:
        (tmp_path / "bare" / p.name).write_bytes(p.read_bytes())
    upload(s3, tmp_path / "bare", "s3://data/bare")
    got = sources.discover("s3://data/bare/", task=AUTO)
    assert len(got) == 6 and got.classes == ["0", "1"] and got.split_note == ""
    assert all(s3.gets(f"/data/bare/{p.name}") == 1 for p in shards) and s3.gets("/data/bare/index.json") == 0


@pytest.mark.parametrize("name, url", [("folder", "s3://data/folder"), ("manifest", "s3://data/manifest/labels.csv")])
def test_a_folder_in_a_bucket_is_copied_once_and_read_in_its_layout(s3, name, url):
    local = sources.discover(str(s3.local / name / ("labels.csv" if name == "manifest" else "")), task=AUTO)
    got = sources.discover(url, task=AUTO)
    _same(got, local)
    assert got.layout == local.layout == ("manifest" if name == "manifest" else "kaggle")
    assert [Path(p).read_bytes() for p in got.paths] == [Path(p).read_bytes() for p in local.paths]
    files = [p for p in (s3.local / name).rglob("*") if p.is_file()]
    assert all(s3.gets(f"/data/{name}/{p.relative_to(s3.local / name).as_posix()}") == 1 for p in files)
    s3.requests.clear()
    _same(sources.discover(url, task=AUTO), local)
    assert s3.requests == []
    assert sources.find(url).name == "store" and sources.recorded(url) == url


def test_a_folder_s_copy_holds_whole_objects_only_at_every_moment_and_old_partial_copies_are_swept(
    s3, tmp_path, monkeypatch
):
    """A command killed mid-copy leaves no partial image in the copied folder (where the next run would list
    it as a bad file): each object is written beside it and renamed in when whole."""
    sizes = {p.name: p.stat().st_size for p in (s3.local / "folder").rglob("*.jpg")}
    monkeypatch.setattr(stores, "CHUNK", 1000)  # each image in several ranged GETs
    cache, seen = tmp_path / "shard-cache", []

    def look(path: str) -> None:  # the copies as they are while the server answers a GET
        files = [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".json"]
        seen.extend((p.name, p.stat().st_size) for p in files if not p.parent.name.endswith(".partial"))

    s3.on_get = look
    try:
        url = "s3://data/folder"
        name = stores.hashlib.sha256(f"store\0{url}/".encode()).hexdigest()[:16]
        stale = cache / f"{name}.partial" / "old.part"  # what a command killed long ago left
        stale.parent.mkdir(parents=True)
        stale.write_bytes(b"x")
        os.utime(stale, (0, 0))
        got = sources.discover(url, task=AUTO)
    finally:
        s3.on_get = None
    assert len(seen) > 6 and all(size == sizes.get(n) for n, size in seen), seen
    assert len(got) == 6 and got.rejects == [] and not stale.exists()
    assert list(stale.parent.iterdir()) == []


def test_503s_and_a_connection_dropped_mid_object_are_retried(s3):
    s3.faults["/data/shards/shards-000001.tar"] = [503, "drop", 503]
    local = sources.discover(str(s3.local / "shards"), task=AUTO)
    got = sources.discover("s3://data/shards/", task=AUTO)
    assert [got.reader[i] for i in range(len(got))] == [local.reader[i] for i in range(len(local))]
    assert s3.gets("/data/shards/shards-000001.tar") == 4 and s3.gets("/data/shards/shards-000002.tar") == 1


@pytest.mark.slow  # botocore's backoff between tries
def test_a_server_that_keeps_failing_is_one_line_naming_the_object_and_leaves_no_partial_copy(
    s3, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(stores, "RETRIES", 2)
    s3.faults["/data/shards/shards-000003.tar"] = [503] * 50
    assert main(["check", "s3://data/shards/"]) == 2
    line = _one_line(capsys)
    assert "cannot read s3://data/shards/shards-000003.tar (" in line and "Please try again" in line, line
    assert s3.gets("/data/shards/shards-000003.tar") == 2
    copies = [p.name for p in (tmp_path / "shard-cache").rglob("*")]
    assert "shards-000003.tar" not in copies and not [n for n in copies if n.endswith(".tmp")]
    assert not [n for n in copies if n.endswith(".listing.json")]  # listed again next time
    s3.faults.clear()
    assert main(["check", "s3://data/shards/"]) == 0  # the rest were kept: only the missing one is fetched
    assert s3.gets("/data/shards/shards-000003.tar") == 3 and s3.gets("/data/shards/shards-000001.tar") == 1


@pytest.mark.parametrize(
    "url, said",
    [
        ("s3://data/nowhere/", "cannot read s3://data/nowhere (not found: no object below it)"),
        ("s3://no-such-bucket/x/", "cannot read s3://no-such-bucket/x (not found)"),
        ("s3://data/shards/shards-{000000..000009}.tar", "cannot read s3://data/shards/shards-000006.tar (not found;"),
        ("s3://data/shards/shards-{0..99999999999}.tar", "more than the 100,000 visiontune reads"),
        ("s3://KEY:SECRET@data/shards/", "credentials in the URL are not read"),
    ],
)
def test_a_missing_object_or_bucket_is_one_line(url, said, capsys):
    assert main(["check", url]) == 2
    line = _one_line(capsys)
    assert said in line and "SECRET" not in line, line


def test_a_failure_s_line_masks_a_password_in_the_endpoint():
    line = str(stores._failed("s3://b/p", OSError('Could not connect to "http://user:hunter2@127.0.0.1:9/b"')))
    assert "hunter2" not in line and "http://user:***@127.0.0.1:9/b" in line


@pytest.mark.slow  # s3fs tries the bucket's region first
def test_wrong_credentials_are_one_line_that_shows_none_of_them(monkeypatch, capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    assert main(["check", "s3://data/shards/"]) == 2
    line = _one_line(capsys)
    assert "cannot read s3://data/shards (access denied: check the credentials" in line, line
    assert "AKIAWRONG" not in line and "wrong-secret" not in line and CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in line


def test_an_object_key_that_would_leave_the_cache_folder_is_refused(s3, tmp_path, capsys):
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1")
    for key in ("odd/cat/a.jpg", "odd/../escape.jpg"):
        client.put_object(Bucket="data", Key=key, Body=b"x")
    assert main(["check", "s3://data/odd"]) == 2
    assert "holds an object named '../escape.jpg', which visiontune does not copy" in _one_line(capsys)
    assert not (tmp_path / "shard-cache" / "escape.jpg").exists() and s3.gets("/data/odd/cat/a.jpg") == 0


def test_a_cache_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """Something else where the URL's folder in the shard cache goes: one line, not the makedirs traceback."""
    cache = tmp_path / "shard-cache"
    assert main(["check", "s3://data/shards/"]) == 0
    for p in list(cache.iterdir()):  # the copies, the staging folder and the listing gone; a file for the copies
        copies = p.is_dir() and not p.name.endswith(".partial")
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        if copies:
            p.write_text("not a folder")
    capsys.readouterr()
    assert main(["check", "s3://data/shards/"]) == 2
    assert f"cannot keep shards in {cache} (File exists); set VISIONTUNE_SHARD_CACHE" in _one_line(capsys)


def test_a_listing_longer_than_the_bound_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(stores, "MAX_OBJECTS", 5)
    assert main(["check", "s3://data/folder"]) == 2  # 6 objects
    assert "s3://data/folder holds more than the 5 objects visiontune reads" in _one_line(capsys)
    monkeypatch.setattr(stores, "MAX_OBJECTS", 6)
    assert main(["check", "s3://data/folder"]) == 0


def test_a_missing_store_package_is_one_line_naming_the_extra(monkeypatch, capsys):
    import fsspec

    registry = sys.modules[fsspec.get_filesystem_class.__module__]._registry
    for scheme, package in (("s3", "s3fs"), ("az", "adlfs"), ("gs", "gcsfs")):  # not installed, whether or not
        monkeypatch.setitem(sys.modules, package, None)  # another test imported it (fsspec keeps the class)
        monkeypatch.delitem(registry, scheme, raising=False)
    assert main(["check", "s3://data/shards/"]) == 2
    assert "reading s3:// needs s3fs: pip install 'visiontune[s3]'" in _one_line(capsys)
    assert main(["check", "az://container/set/"]) == 2
    assert "reading az:// needs adlfs: pip install 'visiontune[azure]'" in _one_line(capsys)
    for data in ("gs://bucket/set/", "gs://bucket/set/shards-{0..3}.tar"):  # (no gsutil is run for it)
        assert main(["check", data]) == 2
        assert "reading gs:// needs gcsfs: pip install 'visiontune[gcs]'" in _one_line(capsys)


def test_shard_out_to_a_bucket_writes_the_shards_then_their_index_and_they_read_back_as_local_ones(
    s3, tmp_path, monkeypatch, capsys
):
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    url = "s3://data/written/"
    assert main(["shard", str(s3.local / "folder"), "--out", url, "--shard-size", "20KB"]) == 0
    assert f"in 6 shard(s) to {url}" in capsys.readouterr().out
    local = sources.discover(str(s3.local / "shards"), task=AUTO)  # the same command, to a local folder
    puts = [p for m, p, _ in s3.requests if m == "PUT"]
    assert sorted(puts) == sorted(f"/data/written/{p.name}" for p in (s3.local / "shards").iterdir())
    assert puts[-1] == "/data/written/index.json" and list(staging.iterdir()) == []  # the index last; none kept
    got = sources.discover(url, task=AUTO)
    _same(got, local)
    assert [got.reader[i] for i in range(len(got))] == [local.reader[i] for i in range(len(local))]
    assert got.split_note == "the split recorded in index.json"
    assert main(["shard", str(s3.local / "folder"), "--out", url]) == 2
    assert f"{url.rstrip('/')} already holds shards; choose an empty or new prefix" in _one_line(capsys)


@fuzz_settings(300)
@given(st.text(st.sampled_from("ab./\\\0\n%~-_ "), max_size=24))
def test_fuzz_an_object_key_is_copied_inside_the_cache_folder_or_refused(rel):
    """Whatever a listing names, its copy lands inside the URL's cache folder, or the key is refused."""
    try:
        name = stores._relative(f"bucket/set/{rel}", "bucket/set", "s3://bucket/set")
    except UserError:
        return
    folder = os.path.join(os.sep, "cache", "f")
    assert os.path.normpath(os.path.join(folder, name)).startswith(folder + os.sep)


@pytest.mark.slow  # (a trained model, shared)
def test_predict_on_a_folder_of_unlabelled_images_in_a_bucket_predicts_what_the_same_local_folder_gives(
    s3, trained_run, sample_data, tmp_path
):
    """Kaggle's test/ (numbered images, no labels) and a nested folder of them: the same rows as predicting
    the local files, named by their URLs."""
    nested = tmp_path / "nested"
    shutil.copytree(sample_data / "test", nested / "batch1")
    upload(s3, sample_data / "test", "s3://data/unlabelled")
    upload(s3, nested, "s3://data/nested")
    for local, url in ((sample_data / "test", "s3://data/unlabelled/"), (nested, "s3://data/nested")):
        outs = [tmp_path / f"{i}.csv" for i in range(2)]
        for data, out in zip((str(local), url), outs):
            assert main(["predict", "--run", str(trained_run), "--data", data, "--out", str(out), "--no-progress"]) == 0
        want = outs[0].read_text().replace(str(local), url.rstrip("/"))
        assert outs[1].read_text() == want
    assert "s3://data/nested/batch1/7.jpg," in outs[1].read_text()
