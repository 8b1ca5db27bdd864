"""Data in Google Cloud Storage (``gs://``: ``data/stores.py`` through gcsfs), against a GCS emulator on
127.0.0.1 (``tests/gcsserver.py``): shards and folders read as the same files on disk, each object fetched
once, a missing one one line. (The emulator checks no credentials: wrong ones are not tried here.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gcsserver import gcs_server, upload
from storefiles import FOLDERS, make_store_files
from storefiles import one_line as _one_line
from storefiles import same as _same
from visiontune.cli.commands import main
from visiontune.data import sources
from visiontune.tasks import AUTO

pytest.importorskip("webdataset")  # `visiontune shard` writes with its ShardWriter


@pytest.fixture(scope="module")
def gs(tmp_path_factory):
    """The emulator, with a folder of 6 images (Kaggle layout), its shards (one or two images each, with
    visiontune's index.json) and a class-subfolder copy with a manifest, uploaded to bucket ``data``."""
    tmp = tmp_path_factory.mktemp("gcs")
    make_store_files(tmp)
    with gcs_server() as server:
        for name in FOLDERS:
            upload(server, tmp / name, f"gs://data/{name}")
        server.local = tmp
        yield server


@pytest.fixture(autouse=True)
def store_env(tmp_path, monkeypatch, gs):
    monkeypatch.setenv("VISIONTUNE_SHARD_CACHE", str(tmp_path / "shard-cache"))
    monkeypatch.chdir(tmp_path)  # `check` writes its report here
    for k, v in gs.env().items():
        monkeypatch.setenv(k, v)
    gs.requests.clear()


@pytest.mark.slow  # (the emulator and gcsfs: a few seconds a test)
@pytest.mark.parametrize("url", ["gs://data/shards/", "gs://data/shards/shards-{000000..000005}.tar"])
def test_shards_in_a_bucket_are_listed_through_the_store_copied_once_and_read_as_the_local_shards(gs, url):
    local = sources.discover(str(gs.local / "shards"), task=AUTO)
    got = sources.discover(url, task=AUTO)
    _same(got, local)
    assert [got.reader[i] for i in range(len(got))] == [local.reader[i] for i in range(len(local))]
    assert got.split_note == "the split recorded in index.json" and got.root == url.rstrip("/")
    names = sorted(p.name for p in (gs.local / "shards").iterdir())
    assert len(names) == 7 and {n: gs.gets(f"/data/shards/{n}") for n in names} == dict.fromkeys(names, 1)
    gs.requests.clear()
    _same(
        sources.discover(url, task=AUTO), local
    )  # a later command, another process: from the cache, no request at all
    assert gs.requests == []


@pytest.mark.slow
@pytest.mark.parametrize("name, url", [("folder", "gs://data/folder"), ("manifest", "gs://data/manifest/labels.csv")])
def test_a_folder_in_a_bucket_is_copied_once_and_read_in_its_layout(gs, name, url):
    local = sources.discover(str(gs.local / name / ("labels.csv" if name == "manifest" else "")), task=AUTO)
    got = sources.discover(url, task=AUTO)
    _same(got, local)
    assert got.layout == local.layout == ("manifest" if name == "manifest" else "kaggle")
    assert [Path(p).read_bytes() for p in got.paths] == [Path(p).read_bytes() for p in local.paths]
    files = [p.relative_to(gs.local / name).as_posix() for p in (gs.local / name).rglob("*") if p.is_file()]
    assert {f: gs.gets(f"/data/{name}/{f}") for f in files} == dict.fromkeys(files, 1)
    gs.requests.clear()
    _same(sources.discover(url, task=AUTO), local)
    assert gs.requests == []
    assert sources.find(url).name == "store" and sources.recorded(url) == url


@pytest.mark.slow  # (a process of its own: gcsfs imported as a user's command imports it)
def test_a_gs_command_says_nothing_of_gcsfs_on_stderr(gs, tmp_path):
    """gcsfs's default file system asks GCS's storage-control API what kind each bucket is and, where it
    cannot (an emulator, anonymous or object-only credentials), logs a warning on every request: a user of
    ``--data gs://...`` sees visiontune's lines alone."""
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    argv = [sys.executable, "-m", "visiontune", "check", "gs://data/shards/"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "6 images in 2 classes (shards)" in done.stdout
    assert [line for line in done.stderr.splitlines() if not line.startswith("visiontune")] == [], done.stderr


@pytest.mark.slow
def test_gcsfs_chooses_its_file_system_only_when_its_own_variable_is_set(monkeypatch):
    import gcsfs
    from gcsfs.core import GCSFileSystem

    from visiontune.data import stores

    monkeypatch.delenv(stores.ZONAL_SWITCH, raising=False)
    assert type(stores._filesystem("gs://data/shards/")) is GCSFileSystem
    monkeypatch.setenv(stores.ZONAL_SWITCH, "true")  # (read by gcsfs at its import: its class then, whichever)
    assert type(stores._filesystem("gs://data/shards/")) is gcsfs.GCSFileSystem


@pytest.mark.slow
@pytest.mark.parametrize(
    "url, said",
    [
        ("gs://data/nowhere/", "cannot read gs://data/nowhere (not found"),
        ("gs://no-such-bucket/x/", "cannot read gs://no-such-bucket/x (not found"),
        ("gs://data/shards/shards-{000000..000009}.tar", "cannot read gs://data/shards/shards-000006.tar (not found;"),
    ],
)
def test_a_missing_object_or_bucket_is_one_line(url, said, capsys):
    assert main(["check", url]) == 2
    assert said in _one_line(capsys)
