"""Tests for visiontune.data.check: finds exactly the bad files, caches verdicts, writes atomically."""

from __future__ import annotations

import csv
import json
import os
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

import visiontune.data.check as check
from badfiles import EXPECTED_REASON, SMALL_MAX_PIXELS, make_bad_files, make_odd_mode_images, natural_ish
from fuzzing import fuzz_settings
from visiontune.data.check import scan, write_report


@pytest.fixture
def tree(tmp_path):
    """A folder mixing good, odd and bad files; returns (paths in a scrambled order, {path: kind})."""
    kinds = {}
    for name, kind in make_bad_files(tmp_path / "bad").items():
        kinds[str(tmp_path / "bad" / name)] = kind
    for name in make_odd_mode_images(tmp_path / "odd"):
        kinds[str(tmp_path / "odd" / name)] = "good"
    for i in range(4):
        path = tmp_path / f"good{i}.jpg"
        Image.fromarray(natural_ish(seed=i)).save(path)
        kinds[str(path)] = "good"
    paths = sorted(kinds, key=lambda p: (zlib.crc32(p.encode()) % 7, p))  # not grouped by kind
    return paths, kinds


@pytest.fixture
def decodes(monkeypatch):
    """The list of paths the scan actually decodes."""
    seen = []
    real = check.read_image

    def counting(path, **kwargs):
        seen.append(str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(check, "read_image", counting)
    return seen


def test_scan_reports_exactly_the_bad_files_in_input_order(tree):
    paths, kinds = tree
    bad = scan(paths, workers=2, max_pixels=SMALL_MAX_PIXELS)
    assert [p for p, _ in bad] == [p for p in paths if kinds[p] != "good"]
    for path, reason in bad:
        assert EXPECTED_REASON[kinds[path]] in reason, (path, reason)


def test_scan_gives_same_answer_for_any_worker_count(tree):
    paths, _ = tree
    one = scan(paths, workers=1, max_pixels=SMALL_MAX_PIXELS)
    assert scan(paths, workers=4, max_pixels=SMALL_MAX_PIXELS) == one


def test_default_limit_lets_the_big_image_through(tree):
    paths, kinds = tree
    bad = {p for p, _ in scan(paths)}
    assert bad == {p for p in paths if kinds[p] not in ("good", "too_large")}


def test_missing_file_is_reported_not_raised(tmp_path):
    missing = str(tmp_path / "gone.jpg")
    [(path, reason)] = scan([missing], cache_path=str(tmp_path / "cache.json"))
    assert path == missing and "cannot read file" in reason


def test_second_scan_of_unchanged_files_decodes_nothing(tree, tmp_path, decodes):
    paths, _ = tree
    cache = str(tmp_path / "scan-cache.json")
    first = scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS)
    assert sorted(decodes) == sorted(paths)
    decodes.clear()
    assert scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS) == first
    assert decodes == []
    with open(cache + ".bad") as f:
        bad_lines = [json.loads(line) for line in f]
    assert os.path.getsize(cache) // 8 + len(bad_lines) == len(paths)
    assert sorted(r for _, r in bad_lines) == sorted(r for _, r in first)
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []


def test_changed_files_are_checked_again(tree, tmp_path, decodes):
    paths, kinds = tree
    cache = str(tmp_path / "scan-cache.json")
    scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS)
    good = next(p for p in paths if kinds[p] == "good" and p.endswith("good0.jpg"))
    empty = next(p for p in paths if kinds[p] == "empty")
    data = open(good, "rb").read()
    with open(good, "wb") as f:  # the good file gets cut short...
        f.write(data[: len(data) // 2])
    Image.fromarray(natural_ish()).save(empty, "JPEG")  # ...and the empty one gets fixed
    st = os.stat(empty)
    os.utime(empty, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # distinct even on coarse clocks
    decodes.clear()
    bad = dict(scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS))
    assert sorted(decodes) == sorted([good, empty])
    assert "truncated" in bad[good] and empty not in bad


def test_same_size_touch_is_rechecked(tree, tmp_path, decodes):
    paths, _ = tree
    cache = str(tmp_path / "scan-cache.json")
    scan(paths, cache_path=cache)
    st = os.stat(paths[0])
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    decodes.clear()
    scan(paths, cache_path=cache)
    assert decodes == [paths[0]]


def test_cache_is_ignored_when_limit_changes_or_file_is_corrupt(tree, tmp_path, decodes):
    paths, kinds = tree
    cache = tmp_path / "scan-cache.json"
    scan(paths, cache_path=str(cache))
    decodes.clear()
    bad = scan(paths, cache_path=str(cache), max_pixels=SMALL_MAX_PIXELS)
    assert len(decodes) == len(paths)
    assert any(kinds[p] == "too_large" for p, _ in bad)
    cache.write_bytes(b"\x01" * 13)  # garbage with a torn record...
    (tmp_path / "scan-cache.json.bad").write_text('[1, "x"]\n[2, "y')  # ...and a torn line
    decodes.clear()
    assert scan(paths, cache_path=str(cache), max_pixels=SMALL_MAX_PIXELS) == bad
    assert len(decodes) == len(paths)


def test_one_changed_file_appends_to_the_cache_instead_of_rewriting_it(tree, tmp_path, decodes):
    paths, _ = tree
    cache = str(tmp_path / "scan-cache")
    scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS)
    inode, size = os.stat(cache).st_ino, os.path.getsize(cache)
    good = next(p for p in paths if p.endswith("good1.jpg"))
    st = os.stat(good)
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    decodes.clear()
    scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS)
    assert decodes == [good]
    assert os.stat(cache).st_ino == inode and os.path.getsize(cache) == size + 8


def test_scan_keeps_a_bounded_number_of_files_in_flight(tmp_path, monkeypatch):
    in_flight, peak = [0], [0]
    real = check._check_one
    import threading

    lock = threading.Lock()

    def counting(path, max_pixels):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            return real(path, max_pixels)
        finally:
            with lock:
                in_flight[0] -= 1

    submitted = []
    real_map = check.bounded_map

    def watching(fn, items, threads, window=None):
        for out in real_map(fn, items, threads, window):
            submitted.append(out)
            yield out

    monkeypatch.setattr(check, "_check_one", counting)
    bad = scan([str(tmp_path / f"missing{i}.jpg") for i in range(500)], workers=2)
    assert len(bad) == 500 and peak[0] <= 2
    # The window: a generator over 10**9 items is consumed lazily, never listed up front.
    seen = []
    for out in check.bounded_map(lambda i: i * i, iter(range(10**9)), 2, window=8):
        seen.append(out)
        if len(seen) == 50:
            break
    assert seen == [i * i for i in range(50)]


def test_write_report_round_trips_awkward_paths(tmp_path):
    bad = [('a,b/"quoted".jpg', "empty file"), ("c/d.jpg", "truncated JPEG"), ("é.png", "not an image")]
    out = tmp_path / "bad.csv"
    out.write_text("old contents\n")
    write_report(bad, str(out))
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["path", "problem"]
    assert [tuple(r) for r in rows[1:]] == bad
    assert sorted(os.listdir(tmp_path)) == ["bad.csv"]


def test_write_report_with_nothing_bad_writes_just_the_header(tmp_path):
    out = tmp_path / "bad.csv"
    write_report([], str(out))
    assert out.read_text() == "path,problem\n"


def test_check_writes_its_report_in_the_working_folder_never_into_the_data(tmp_path, monkeypatch, capsys):
    from visiontune.cli.commands import main

    data = tmp_path / "data"
    for label in ("cat", "dog"):
        (data / label).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(natural_ish(seed=i)).save(data / label / f"{i}.jpg")
    (data / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["check", str(data)]) == 1
    rows = list(csv.reader((work / "bad_files.csv").open()))
    assert [r[0] for r in rows[1:]] == [str(data / "dog" / "broken.jpg")]
    assert sorted(p.name for p in data.rglob("*") if p.is_file()) == ["0.jpg", "0.jpg", "1.jpg", "1.jpg", "broken.jpg"]
    assert "report in bad_files.csv" in capsys.readouterr().out
    assert main(["check", str(data), "--out", str(tmp_path / "elsewhere.csv")]) == 1  # --out, as elsewhere
    assert (tmp_path / "elsewhere.csv").is_file()


# The scan's cache is a file on disk that a crash, a full disk or another program may have left anything in:
# whatever it holds, a scan gives the verdicts a scan without it gives (a damaged record's file decoded again).
DAMAGED_BAD_LINES = [
    '[Infinity, "x"]\n',  # an OverflowError before
    '[-1, "x"]\n',  # a key no uint64 holds: an OverflowError before
    "[" * 5000 + "\n",  # a RecursionError before
    '[1, ["x"]]\n',  # a reason that is no text (was shown as one)
    '[1, "\\u001b[2J"]\n',  # a terminal escape as a reason
    '[1, "' + "x" * 100_000 + '"]\n',  # a line longer than any verdict
]


@pytest.mark.parametrize("line", DAMAGED_BAD_LINES)
def test_a_damaged_bad_verdict_is_ignored_and_the_scan_gives_its_verdicts(tree, tmp_path, line):
    paths, _ = tree
    cache = str(tmp_path / "scan-cache")
    first = scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS)
    with open(cache + ".bad", "a") as f:
        f.write(line)
    assert scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS) == first
    good, bad, _ = check._load_cache(cache, len(paths))
    assert all(type(k) is int and 0 < k < 2**64 and r.isprintable() and len(r) < 5000 for k, r in bad.items())


def test_a_scan_cache_larger_than_any_scan_leaves_is_read_up_to_its_bound_and_compacted(tree, tmp_path, monkeypatch):
    paths, _ = tree
    cache = str(tmp_path / "scan-cache")
    first = scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS)
    with open(cache, "ab") as f:  # stale keys past the bound: 4 x max(files, 1024)
        f.write(b"\x07" * 8 * 4 * 1024)
    with open(cache + ".bad", "a") as f:
        f.write('[7, "stale"]\n' * 5)
    monkeypatch.setattr(check, "MAX_BAD_VERDICTS", 3)
    good, bad, compact = check._load_cache(cache, len(paths))
    assert len(good) == 4 * 1024 and len(bad) <= 3 and compact
    assert scan(paths, cache_path=cache, max_pixels=SMALL_MAX_PIXELS) == first
    assert os.path.getsize(cache) // 8 <= len(paths)  # compacted to the live keys
    monkeypatch.undo()  # every bad verdict of the tree read back: none stale left
    good, bad, compact = check._load_cache(cache, len(paths))
    assert not compact and 7 not in bad


@fuzz_settings(60)
@given(st.binary(max_size=200), st.lists(st.binary(max_size=40) | st.text(max_size=40), max_size=4), st.booleans())
def test_fuzz_any_bytes_as_the_scan_cache_give_the_scan_s_verdicts(keys, lines, keep_real):
    with tempfile.TemporaryDirectory() as folder:
        good, bad = Path(folder) / "good.png", Path(folder) / "bad.png"
        Image.fromarray(natural_ish(seed=1)[:16, :16]).save(good)
        bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
        paths, cache = [str(good), str(bad)], str(Path(folder) / "scan-cache")
        first = scan(paths, cache_path=cache)
        with open(cache, "ab" if keep_real else "wb") as f:
            f.write(keys)
        with open(cache + ".bad", "ab" if keep_real else "wb") as f:
            for line in lines:
                f.write((line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")) + b"\n")
        found = scan(paths, cache_path=cache)
        assert [p for p, _ in found] == [p for p, _ in first] == [str(bad)]
        assert all(isinstance(r, str) and r.isprintable() for _, r in found)
