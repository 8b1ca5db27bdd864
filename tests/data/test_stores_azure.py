"""Data in Azure Blob Storage (``az://``, ``abfs://``: ``data/stores.py`` through adlfs), against Azure's own
emulator, Azurite, on 127.0.0.1 (``tests/azureserver.py``): shards and folders read as the same files on disk,
each object fetched once, credentials from adlfs's own chain and never shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from azureserver import KEY, azurite_server, upload
from storefiles import FOLDERS, make_store_files
from storefiles import one_line as _one_line
from storefiles import same as _same
from visiontune.cli.commands import main
from visiontune.data import sources
from visiontune.tasks import AUTO

pytest.importorskip("webdataset")  # `visiontune shard` writes with its ShardWriter


@pytest.fixture(scope="module")
def az(tmp_path_factory):
    """Azurite, with a folder of 6 images (Kaggle layout), its shards (one or two images each, with
    visiontune's index.json) and a class-subfolder copy with a manifest, uploaded to container ``data``."""
    tmp = tmp_path_factory.mktemp("azure")
    make_store_files(tmp)
    with azurite_server() as server:
        for name in FOLDERS:
            upload(server, tmp / name, f"az://data/{name}")
        server.local = tmp
        yield server


@pytest.fixture(autouse=True)
def store_env(tmp_path, monkeypatch, az):
    monkeypatch.setenv("VISIONTUNE_SHARD_CACHE", str(tmp_path / "shard-cache"))
    monkeypatch.chdir(tmp_path)  # `check` writes its report here
    for k, v in az.env().items():
        monkeypatch.setenv(k, v)
    az.sync()
    az.requests.clear()


def _no_request_but_the_sync(az) -> None:
    az.sync()
    assert [r[1] for r in az.requests] == [f"/vt-sync-{az._syncs}"], az.requests


@pytest.mark.slow  # Azurite is a process of its own (Node.js)
@pytest.mark.parametrize("url", ["az://data/shards/", "abfs://data/shards/shards-{000000..000005}.tar"])
def test_shards_in_a_container_are_listed_through_the_store_copied_once_and_read_as_the_local_shards(az, url):
    local = sources.discover(str(az.local / "shards"), task=AUTO)
    got = sources.discover(url, task=AUTO)
    _same(got, local)
    assert [got.reader[i] for i in range(len(got))] == [local.reader[i] for i in range(len(local))]
    assert got.split_note == "the split recorded in index.json" and got.root == url.rstrip("/")
    az.sync()
    names = sorted(p.name for p in (az.local / "shards").iterdir())
    assert len(names) == 7 and {n: az.gets(f"/data/shards/{n}") for n in names} == dict.fromkeys(names, 1)
    az.requests.clear()
    _same(
        sources.discover(url, task=AUTO), local
    )  # a later command, another process: from the cache, no request at all
    _no_request_but_the_sync(az)


@pytest.mark.slow
@pytest.mark.parametrize("name, url", [("folder", "az://data/folder"), ("manifest", "az://data/manifest/labels.csv")])
def test_a_folder_in_a_container_is_copied_once_and_read_in_its_layout(az, name, url):
    local = sources.discover(str(az.local / name / ("labels.csv" if name == "manifest" else "")), task=AUTO)
    got = sources.discover(url, task=AUTO)
    _same(got, local)
    assert got.layout == local.layout == ("manifest" if name == "manifest" else "kaggle")
    assert [Path(p).read_bytes() for p in got.paths] == [Path(p).read_bytes() for p in local.paths]
    az.sync()
    files = [p.relative_to(az.local / name).as_posix() for p in (az.local / name).rglob("*") if p.is_file()]
    assert {f: az.gets(f"/data/{name}/{f}") for f in files} == dict.fromkeys(files, 1)
    az.requests.clear()
    _same(sources.discover(url, task=AUTO), local)
    _no_request_but_the_sync(az)
    assert sources.find(url).name == "store" and sources.recorded(url) == url


@pytest.mark.slow
@pytest.mark.parametrize(
    "url, said",
    [
        ("az://data/nowhere/", "cannot read az://data/nowhere (not found"),
        ("az://no-such-container/x/", "cannot read az://no-such-container/x (not found"),
        ("az://data/shards/shards-{000000..000009}.tar", "cannot read az://data/shards/shards-000006.tar (not found;"),
    ],
)
def test_a_missing_object_or_container_is_one_line(url, said, capsys):
    assert main(["check", url]) == 2
    assert said in _one_line(capsys)


@pytest.mark.slow
def test_wrong_credentials_are_one_line_that_shows_none_of_them(az, monkeypatch, capsys):
    wrong = "V3JvbmdXcm9uZ1dyb25nV3JvbmdXcm9uZ1dyb25nV3JvbmdXcm9uZ1dyb25nV3Jvbmc="  # (base64, as a key is)
    for k, v in az.env(key=wrong).items():
        monkeypatch.setenv(k, v)
    assert main(["check", "az://data/shards/"]) == 2
    line = _one_line(capsys)
    assert "cannot read az://data/shards (access denied: check the credentials" in line, line
    assert wrong not in line and KEY not in line and "AccountKey" not in line
    assert not (Path("shard-cache").exists() and any(Path("shard-cache").rglob("*.tar")))
