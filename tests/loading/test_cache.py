"""Tests for visiontune.loading.cache: exact pixels, rebuilt on change, reused otherwise, one build per job."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import default_collate

import visiontune.loading.cache as cache_mod
from conftest import FAST, PYTHON, TINY_RESNET
from fuzzing import fuzz_settings
from trainrun import flags, one_line, run
from visiontune.cli.commands import main
from visiontune.data.decode import read_image, resize_uint8
from visiontune.errors import UserError
from visiontune.loading.augment import sample_augment
from visiontune.loading.cache import FIT, CachedDataset, choose, digest_file, open_or_build
from visiontune.loading.pipeline import ImageDataset
from visiontune.tasks import UNREADABLE

SIZE = 24


@pytest.fixture
def files(sample_data, tmp_path):
    """A private copy of 10 sample images plus one broken file, so tests may touch them."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    paths = []
    for src in sorted((sample_data / "train").iterdir())[:10]:
        shutil.copy(src, folder / src.name)
        paths.append(str(folder / src.name))
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    paths.insert(3, str(folder / "broken.jpg"))
    return paths


@pytest.fixture
def decodes(monkeypatch):
    """Counts the images the cache decodes."""
    calls = []
    real = cache_mod.try_read

    def counting(path, *resize):
        calls.append(path)
        return real(path, *resize)

    monkeypatch.setattr(cache_mod, "try_read", counting)
    return calls


def test_cache_equals_direct_decode_and_skips_bad_files_like_imagedataset(files, tmp_path):
    cache = open_or_build(str(tmp_path / "c"), files, SIZE, threads=2)
    labels = list(range(len(files)))
    cached = CachedDataset(cache, range(len(files)), labels)
    direct = ImageDataset(files, labels, SIZE)
    assert os.path.getsize(cache.array_path) == len(files) * 3 * SIZE * SIZE
    for i, path in enumerate(files):
        if path.endswith("broken.jpg"):
            for img, label in (cached[i], direct[i]):  # both keep the slot, labelled UNREADABLE
                assert label == UNREADABLE and img.shape == (3, SIZE, SIZE) and img.sum() == 0
            assert cache.bad == {i: (path, cache.bad[i][1])} and "JPEG" in cache.bad[i][1]
            continue
        img, label = cached[i]
        assert img.dtype == torch.uint8 and label == i
        assert torch.equal(img, resize_uint8(read_image(path), SIZE))
        assert torch.equal(img, direct[i][0])
    # a subset picks rows of the cache; the unreadable file keeps its slot in the batch
    sub = CachedDataset(cache, [2, 3, 4], [7, 8, 9])
    images, batch_labels = default_collate([sub[j] for j in range(3)])
    assert images.shape == (3, 3, SIZE, SIZE) and batch_labels.tolist() == [7, UNREADABLE, 9]
    # a whole batch in one read (the DataLoader's path), in the sampler's order, equals item by item
    order = [2, 0, 1]
    batch = sub.__getitems__(order)
    assert [label for _, label in batch] == [9, 7, UNREADABLE]
    assert all(torch.equal(img, sub[j][0]) for (img, _), j in zip(batch, order))


def test_reused_when_unchanged_rebuilt_when_files_or_size_change(files, tmp_path, decodes):
    folder = str(tmp_path / "c")
    first = open_or_build(folder, files, SIZE, threads=1)
    assert len(decodes) == len(files)
    again = open_or_build(folder, files, SIZE, threads=1)
    assert len(decodes) == len(files), "an unchanged data set must not be decoded again"
    assert again == first

    # rewrite one image with other pixels (new size and mtime): the cache follows it
    target = files[0]
    shutil.copy(files[5], target)
    st = os.stat(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    decodes.clear()
    rebuilt = open_or_build(folder, files, SIZE, threads=1)
    assert len(decodes) == len(files)
    assert rebuilt.array_path == first.array_path  # rebuilt in place, not piled up
    img, _ = CachedDataset(rebuilt, [0], [0])[0]
    assert torch.equal(img, resize_uint8(read_image(files[5]), SIZE))

    decodes.clear()
    other_size = open_or_build(folder, files, SIZE + 8, threads=1)
    assert len(decodes) == len(files) and other_size.image_size == SIZE + 8
    decodes.clear()
    fewer = open_or_build(folder, files[:-1], SIZE, threads=1)
    assert len(decodes) == len(files) - 1 and fewer.count == len(files) - 1
    decodes.clear()
    open_or_build(folder, files, SIZE, threads=1)  # the first set at the first size is still there
    assert decodes == []


def test_stale_header_or_short_array_rebuilds(files, tmp_path, decodes):
    folder = str(tmp_path / "c")
    cache = open_or_build(folder, files, SIZE, threads=1)
    with open(cache.array_path, "r+b") as f:  # an array cut short, e.g. a disk that filled up
        f.truncate(100)
    decodes.clear()
    open_or_build(folder, files, SIZE, threads=1)
    assert len(decodes) == len(files)
    header = cache.array_path[:-3] + ".json"
    with open(header) as f:
        head = json.load(f)
    with open(header, "w") as f:
        json.dump({**head, "key": "0" * 64}, f)
    decodes.clear()
    open_or_build(folder, files, SIZE, threads=1)
    assert len(decodes) == len(files)


def test_dataset_pickles_without_the_array_and_augments_uint8(files, tmp_path):
    cache = open_or_build(str(tmp_path / "c"), files, 64, threads=2)
    ds = CachedDataset(cache, [0, 1], [0, 1], augment=sample_augment("flip-crop", 64, seed=0))
    img, _ = ds[0]
    assert img.dtype == torch.uint8 and img.shape == (3, 64, 64)
    plain = CachedDataset(cache, [0], [0])[0][0]
    assert not torch.equal(img, plain)  # crop/flip did something (seeded by (seed, epoch, index))
    # a loader worker receives the path, not the mapped pixels
    assert len(pickle.dumps(ds)) < 3 * 64 * 64


@pytest.mark.distributed
def test_two_ddp_processes_share_one_cache_built_once(sample_data, tmp_path, worker_env):
    cache_dir = tmp_path / "cache"  # the user cache folder: the default, --cache fit, caches there
    cmd = [
        PYTHON,
        "-m",
        "visiontune",
        "train",
        *flags(data=sample_data),
        *TINY_RESNET,  # the cache is the subject, not the model
        *flags(
            epochs=1,
            batch_size=16,
            strategy="ddp",
            nproc=2,
            num_workers=0,
            output_dir=tmp_path / "run",
        ),
    ]
    env = {**worker_env, "VISIONTUNE_CACHE_DIR": str(cache_dir)}
    out = run(cmd, env, timeout=300)  # forked where it can be (tests/zygote.py)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("building the image cache") == 1, out.stdout
    assert len(list(cache_dir.glob("*.u8"))) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_images_counted"] == summary["val_split_size"]
    assert summary["image_cache"]["path"] == str(next(cache_dir.glob("*.u8")))


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_reading_the_whole_cache_does_not_keep_it_resident(sample_data, tmp_path):
    paths = [str(p) for p in sorted((sample_data / "train").iterdir())] * 2  # 240 rows, 18 MiB at 160 px
    cache = open_or_build(str(tmp_path / "c"), paths, 160, threads=2)
    ds = CachedDataset(cache, range(len(paths)), [0] * len(paths))
    ds[0]  # the first read maps library code (file-backed too); measure from here
    before = _rss_file_kib()
    for i in range(len(ds)):
        ds[i]
    grown_kib = _rss_file_kib() - before
    assert grown_kib * 1024 < cache.count * cache.item_bytes / 8, f"RSS grew {grown_kib} KiB"
    before = _rss_file_kib()
    digest_file(cache.array_path)  # the check at open reads it all too, and drops it as it goes
    grown_kib = _rss_file_kib() - before
    assert grown_kib * 1024 < cache.count * cache.item_bytes / 8, f"RSS grew {grown_kib} KiB while hashing"


def test_unwritable_cache_folder_is_one_clear_error(sample_data, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    run = tmp_path / "run"
    code = main(
        [
            "train",
            *flags(data=sample_data),
            *FAST,
            *flags(epochs=1, batch_size=16, num_workers=0, cache=blocker / "cache", output_dir=run),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "cannot write the image cache" in err and "Traceback" not in err
    assert not run.exists() or not any(run.iterdir())


def _good_rows_match_the_files(cache, files) -> None:
    """Every readable file's row holds that file's pixels, decoded afresh."""
    ds = CachedDataset(cache, range(len(files)), list(range(len(files))))
    for i, path in enumerate(files):
        if i not in cache.bad:
            assert torch.equal(ds[i][0], resize_uint8(read_image(path), SIZE)), path


def test_the_header_holds_a_digest_of_the_array_as_written(files, tmp_path):
    cache = open_or_build(str(tmp_path / "c"), files, SIZE, threads=2)
    head = json.loads(Path(cache.array_path[:-3] + ".json").read_text())
    assert head["digest"] == "xxh3_128:" + xxhash.xxh3_128(Path(cache.array_path).read_bytes()).hexdigest()


def test_an_array_overwritten_with_white_pixels_is_not_reused_but_rebuilt(
    files, tmp_path, decodes, monkeypatch, capsys
):
    """The attack of issue 35: the .u8 overwritten with 0xFF bytes of the same size, its header left as it was."""
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "user"))
    first, choice = choose(FIT, files, SIZE, 1)
    assert "built" in choice.why
    array = Path(first.array_path)
    array.write_bytes(b"\xff" * array.stat().st_size)
    capsys.readouterr()
    decodes.clear()
    again, choice = choose(FIT, files, SIZE, 1)
    out = capsys.readouterr().out.splitlines()
    assert "reused" not in choice.why and "built" in choice.why
    said = [line for line in out if "does not match its digest" in line]
    assert len(said) == 1 and str(array) in said[0] and "rebuilding it" in said[0], out
    assert len(decodes) == len(files) and again.array_path == first.array_path
    _good_rows_match_the_files(again, files)
    decodes.clear()
    assert "reused" in choose(FIT, files, SIZE, 1)[1].why and decodes == []  # the rebuilt cache holds again


def test_an_array_hashed_once_is_reused_unhashed_until_written(files, tmp_path, decodes, monkeypatch, capsys):
    """The stamp (inode, size, mtime, ctime) spares the hash only while nothing wrote to the array since it
    last hashed to its digest, and never the owner and mode checks."""
    import time

    folder = str(tmp_path / "c")
    first = open_or_build(folder, files, SIZE, threads=1)
    array = Path(first.array_path)
    hashed = []
    real = cache_mod.digest_file
    monkeypatch.setattr(cache_mod, "digest_file", lambda path: hashed.append(path) or real(path))
    decodes.clear()
    open_or_build(folder, files, SIZE, threads=1)  # the build's stamp is racy (taken as the array changed)
    assert hashed == [str(array)] and decodes == []
    monkeypatch.setattr(cache_mod, "_RACY_NS", -(10**15))  # as if that hash had been long after the build
    open_or_build(folder, files, SIZE, threads=1)
    assert len(hashed) == 1 and decodes == []  # reused, not hashed
    array.chmod(0o664)  # the owner and mode checks still run at every open
    open_or_build(folder, files, SIZE, threads=1)
    assert len(decodes) == len(files) and "writable by other users" in capsys.readouterr().out
    open_or_build(folder, files, SIZE, threads=1)  # hashed (racy again after the rebuild) and stamped
    hashed.clear()
    decodes.clear()
    st = array.stat()
    time.sleep(0.05)  # past a coarse timestamp tick: the write below gets a ctime of its own
    with open(array, "r+b") as f:  # same size, in place, and its mtime put back: only the ctime tells
        f.write(b"\xff" * st.st_size)
    os.utime(array, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert array.stat().st_ctime_ns != st.st_ctime_ns
    rebuilt = open_or_build(folder, files, SIZE, threads=1)
    assert hashed == [str(array)] and "does not match its digest" in capsys.readouterr().out
    assert len(decodes) == len(files)
    _good_rows_match_the_files(rebuilt, files)


@pytest.mark.parametrize("change", ["group-writable array", "world-writable header", "array of another user"])
def test_cache_files_another_user_may_write_are_rebuilt_owner_writable_only(files, tmp_path, decodes, capsys, change):
    old = os.umask(0o002)  # a umask that makes group-writable files: the cache's are not
    try:
        cache = open_or_build(str(tmp_path / "c"), files, SIZE, threads=1)
    finally:
        os.umask(old)
    array, header = Path(cache.array_path), Path(cache.array_path[:-3] + ".json")
    assert [stat.S_IMODE(p.stat().st_mode) for p in (array, header)] == [0o644, 0o644]
    if change == "group-writable array":
        array.chmod(0o664)
    elif change == "world-writable header":
        header.chmod(0o666)
    else:
        os.chown(array, 12345, 12345)  # the tests run as root
    decodes.clear()
    capsys.readouterr()
    rebuilt = open_or_build(str(tmp_path / "c"), files, SIZE, threads=1)
    out = capsys.readouterr().out
    assert len(decodes) == len(files) and "may have been changed: rebuilding it" in out, out
    assert array.stat().st_uid == os.getuid() and not array.stat().st_mode & 0o022
    _good_rows_match_the_files(rebuilt, files)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: d.chmod(0o777),
        lambda d: d.chmod(0o770),
        lambda d: os.chown(d, 12345, 12345),
        lambda d: (d.parent.chmod(0o777), d.chmod(0o700)),  # the folder above: another user could swap it
    ],
    ids=["world-writable", "group-writable", "another-users", "under-a-world-writable-folder"],
)
def test_a_cache_folder_another_user_may_write_in_is_refused_or_not_used(files, tmp_path, decodes, monkeypatch, make):
    folder = tmp_path / "shared" / "c"
    folder.mkdir(parents=True)
    make(folder)
    with pytest.raises(UserError, match=r"^--cache .*(writable by|owned by another user).*chmod go-w"):
        open_or_build(str(folder), files, SIZE, threads=1)
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(folder))
    cache, choice = choose(FIT, files, SIZE, 1)  # fit: one line, no cache, the files decoded every epoch
    assert cache is None and choice.path is None and ("writable by" in choice.why or "another user" in choice.why)
    assert decodes == [] and list(folder.iterdir()) == []


def test_a_sticky_world_writable_folder_above_is_fine_and_a_missing_folder_is_made_private(files, tmp_path):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp").chmod(0o1777)  # as /tmp: nobody may rename another user's entry
    folder = tmp_path / "tmp" / "mine" / "cache"
    cache = open_or_build(str(folder), files, SIZE, threads=1)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and Path(cache.array_path).parent == folder


def test_a_world_writable_cache_folder_is_one_line_and_exit_2(sample_data, tmp_path, capsys):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    run = tmp_path / "run"
    argv = [*flags(data=sample_data), *FAST, *flags(epochs=1, batch_size=16, num_workers=0, output_dir=run)]
    assert main(["train", *argv, "--cache", str(folder)]) == 2
    one_line(capsys, f"--cache {folder}: the cache folder {folder} is writable by every user (mode 0777)", "chmod")
    assert list(folder.iterdir()) == [] and (not run.exists() or not any(run.iterdir()))


def _header_of(cache) -> Path:
    return Path(cache.array_path[:-3] + ".json")


# A header with the right key but fields no build writes: read bounded and checked, rebuilt, never a traceback.
DAMAGED_HEADERS = [
    ("bad", [1]),  # an AttributeError before
    ("bad", {"x": ["a", "b"]}),  # a ValueError before
    ("bad", {"3": "broken"}),  # a ValueError (unpacking) before
    ("bad", {"99": ["a", "b"]}),  # a row past the array's end
    ("bad", {"3": [1, 2]}),  # a path and reason that are no texts
    ("digest", 5),
]


@pytest.mark.parametrize("field,value", DAMAGED_HEADERS)
def test_a_damaged_header_with_the_right_key_is_rebuilt(files, tmp_path, decodes, capsys, field, value):
    folder = str(tmp_path / "c")
    header = _header_of(open_or_build(folder, files, SIZE, threads=1))
    head = json.loads(header.read_text())
    header.write_text(json.dumps({**head, field: value}))
    decodes.clear()
    cache = open_or_build(folder, files, SIZE, threads=1)
    assert len(decodes) == len(files) and cache.bad.keys() == {3} and cache.bad[3][0] == files[3]
    assert f"the image cache header {header} is damaged: rebuilding it" in capsys.readouterr().out
    assert json.loads(header.read_text())["bad"] == head["bad"]  # as the build writes it again


def test_a_header_nested_past_the_parser_or_larger_than_any_build_writes_is_rebuilt(
    files, tmp_path, decodes, monkeypatch
):
    folder = str(tmp_path / "c")
    header = _header_of(open_or_build(folder, files, SIZE, threads=1))
    good = header.read_text()
    header.write_text("[" * 100_000)  # a RecursionError before
    decodes.clear()
    assert open_or_build(folder, files, SIZE, threads=1).bad.keys() == {3} and len(decodes) == len(files)
    monkeypatch.setattr(cache_mod, "MAX_HEADER", len(good) - 1)
    decodes.clear()
    open_or_build(folder, files, SIZE, threads=1)  # the header just written is one byte over: not read
    assert len(decodes) == len(files)


def test_a_stamp_that_is_no_stamp_hashes_the_array_again(files, tmp_path, decodes, monkeypatch):
    folder = str(tmp_path / "c")
    cache = open_or_build(folder, files, SIZE, threads=1)
    header, stamp = _header_of(cache), cache_mod._stamp(cache.array_path)
    head = json.loads(header.read_text())
    header.write_text(json.dumps({**head, "stamp": [*stamp[:5], "later"]}))  # a TypeError before
    hashed = []
    monkeypatch.setattr(cache_mod, "digest_file", lambda p: hashed.append(p) or digest_file(p))
    decodes.clear()
    assert open_or_build(folder, files, SIZE, threads=1).bad.keys() == {3}
    assert decodes == [] and len(hashed) == 1  # reused once its bytes hash to the digest again


# Any JSON value, to depth 3.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
HEADER_FIELDS = ["bad", "digest", "stamp", "count", "image_size", "version", "key"]


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> list[str]:
    """Three tiny images and a broken file: a cache that builds in milliseconds."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("small")
    paths = []
    for i in range(3):
        Image.new("RGB", (12, 10), (40 * i, 80, 120)).save(folder / f"{i}.png")
        paths.append(str(folder / f"{i}.png"))
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    return [*paths, str(folder / "broken.png")]


@fuzz_settings(60)
@given(
    changes=st.lists(st.tuples(st.sampled_from(HEADER_FIELDS), JSON), max_size=3),
    raw=st.none() | st.binary(max_size=120),
)
def test_fuzz_any_header_gives_a_checked_cache_or_a_rebuild(small_files, changes, raw):
    with tempfile.TemporaryDirectory() as folder:
        header = _header_of(open_or_build(folder, small_files, 8, threads=1))
        head = json.loads(header.read_text())
        for field, value in changes:
            head[field] = value
        header.write_bytes(json.dumps(head).encode() if raw is None else raw)
        cache = open_or_build(folder, small_files, 8, threads=1)
        assert cache.count == len(small_files)
        assert all(0 <= i < len(small_files) and all(isinstance(x, str) for x in pr) for i, pr in cache.bad.items())
        assert _load_back(cache) is not None  # what is there now is a cache the next start reads back whole


def _load_back(cache):
    return cache_mod._load(cache.array_path, str(_header_of(cache)), _key_of(cache), cache.count, cache.image_size)


def _key_of(cache):
    return json.loads(_header_of(cache).read_text())["key"]


# --- the build forked beside the run's own work (a run of one process started by the command) --------------


def _children() -> set[int]:
    """This process's live children, as Linux lists them."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found |= {int(pid) for pid in f.read().split()}
    return found


@pytest.fixture
def forks(monkeypatch):
    """As in the `visiontune` command's own process, where a child may be forked (the test worker's other
    threads aside); the children this process has already (a forkserver of the tests')."""
    monkeypatch.setattr(cache_mod.launch, "can_fork_helper", lambda: True)
    return _children()


@pytest.mark.slow
def test_a_build_forked_beside_this_processs_work_is_the_build_made_here(files, tmp_path, forks):
    seen = []
    beside = open_or_build(str(tmp_path / "beside"), files, SIZE, 2, meanwhile=lambda: seen.append(_children()))
    here = open_or_build(str(tmp_path / "here"), files, SIZE, 2)
    assert len(seen) == 1 and len(seen[0] - forks) == 1  # meanwhile ran here, while one child built
    assert Path(beside.array_path).read_bytes() == Path(here.array_path).read_bytes()
    assert beside.bad == here.bad and set(beside.bad) == {3}  # the broken file's row, and why, from the child
    assert beside == cache_mod._load(beside.array_path, beside.array_path[:-3] + ".json", *_key_count(files))
    _good_rows_match_the_files(beside, files)
    assert _children() <= forks


def _key_count(files):
    return cache_mod.cache_key(files, SIZE), len(files), SIZE


def _raises_in_child(kind):
    def build(*args, **kwargs):
        if kind == "full disk":
            raise cache_mod.NoSpaceError("no space left on the disk of /x while writing c.u8; free some space")
        if kind == "unwritable":
            raise PermissionError(13, "Permission denied")
        os.kill(os.getpid(), 9)  # a crash: nothing said on the pipe

    return build


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,why",
    [
        ("full disk", "no space was left in"),
        ("unwritable", "(Permission denied)"),
        ("killed", "(the process that built it was killed by signal 9)"),
    ],
)
def test_a_forked_build_that_fails_is_what_a_build_here_would_raise(
    files, tmp_path, forks, monkeypatch, capsys, kind, why
):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(cache_mod, "build", _raises_in_child(kind))  # the fork inherits it
    ran = []
    cache, choice = choose(FIT, files, SIZE, 2, meanwhile=lambda: ran.append(os.getpid()))
    assert cache is None and choice.path is None and why in choice.why, choice.why
    assert ran == [os.getpid()] and _children() <= forks
    assert f"no image cache: {choice.why}" in capsys.readouterr().out
    if kind == "killed":  # a folder named by the user: the one-line error, exit 2
        with pytest.raises(UserError, match=r"cannot write the image cache in .*killed by signal 9.*--cache off"):
            open_or_build(str(tmp_path / "named"), files, SIZE, 2, meanwhile=lambda: None)


@pytest.mark.slow
def test_stopped_meanwhile_the_child_stops_too_and_leaves_no_file(files, tmp_path, forks, monkeypatch):
    real = cache_mod.try_read
    monkeypatch.setattr(cache_mod, "try_read", lambda *a: (time.sleep(0.2), real(*a))[1])  # mid-build below

    def stopped():
        time.sleep(0.3)
        raise KeyboardInterrupt

    folder = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        open_or_build(str(folder), files, SIZE, 1, meanwhile=stopped)
    assert _children() <= forks and list(folder.iterdir()) == []  # its temp files removed as it stopped


def test_a_child_is_forked_only_from_the_commands_own_process_while_no_other_thread_runs(monkeypatch):
    from visiontune.cluster import launch

    monkeypatch.setattr(launch, "_COMMAND_LINE", [False])
    assert not launch.can_fork_helper()  # visiontune.train() in a user's program
    monkeypatch.setattr(launch, "_COMMAND_LINE", [True])
    monkeypatch.setattr(launch.threading, "active_count", lambda: 2)
    assert not launch.can_fork_helper()
    monkeypatch.setattr(launch.threading, "active_count", lambda: 1)
    assert launch.can_fork_helper()
    monkeypatch.setattr(launch.sys, "platform", "darwin")
    assert not launch.can_fork_helper()


@pytest.mark.slow
def test_without_a_fork_the_build_is_made_here_and_meanwhile_left_to_the_caller(files, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod.launch, "can_fork_helper", lambda: False)
    ran = []
    cache = open_or_build(str(tmp_path / "c"), files, SIZE, 2, meanwhile=lambda: ran.append(1))
    assert ran == [] and set(cache.bad) == {3}
    _good_rows_match_the_files(cache, files)
