"""The shard reader on hostile tars: malformed pax and tar headers, labels that are no class number, a key used
twice; and property-based fuzzing of the tar walk from a shard ``visiontune shard`` wrote (``tests/fuzzing.py``
sizes it). Whatever the bytes, reading ends with a UserError naming the shard, or an index whose samples lie
inside the file (a bad sample is then recorded), never another exception and never a loop."""

from __future__ import annotations

import io
import itertools
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage

from fuzzing import FUZZ, examples
from visiontune.cli.commands import main
from visiontune.data import shards
from visiontune.errors import UserError

# deadline=None: a busy machine makes no example too slow; derandomize in make test: a failure there fails on
# every run and machine (make fuzz draws afresh); no example database written into the working tree.
SETTINGS = settings(
    max_examples=examples(60),
    deadline=None,
    derandomize=not FUZZ,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(np.full((6, 5, 3), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _header(name: bytes, size: int, kind: bytes = b"0", size_field: bytes | None = None) -> bytes:
    """A ustar header block with a correct checksum (``size_field``: the 12 size bytes as given)."""
    h = bytearray(512)
    h[: len(name)] = name
    h[100:108], h[108:116], h[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148], h[156:157], h[257:265] = b"00000000000\0", kind, b"ustar\x0000"
    return _checksummed(h)


def _checksummed(block: bytearray) -> bytes:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def _member(name: bytes, data: bytes, kind: bytes = b"0", size_field: bytes | None = None) -> bytes:
    return _header(name, len(data), kind, size_field) + data + bytes(-len(data) % 512)


def _tar(*members: bytes) -> bytes:
    return b"".join(members) + bytes(1024)


SAMPLES = _member(b"a.png", _png(10)) + _member(b"a.cls", b"0") + _member(b"b.png", _png(200))
SAMPLES += _member(b"b.cls", b"1")


_GUARD_S = 120


def _within(fn, *args):
    """``fn(*args)``'s result or exception. The thread and its join bound are a net only: a reader that loops
    fails the test instead of hanging the suite; every assertion is on what the reader gave."""
    out: list = []

    def run():
        try:
            out.append(("value", fn(*args)))
        except BaseException as e:  # handed to the test, which says what was allowed
            out.append(("error", e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_GUARD_S)
    assert out, f"{fn.__name__} still running after {_GUARD_S} s: a loop"
    return out[0]


@pytest.mark.parametrize(
    "bad, why",
    [
        (_member(b"pax", b"0 path=x\n", b"x"), "malformed pax record"),  # length 0: it never moved on
        (_member(b"pax", b"99 path=x\n", b"x"), "malformed pax record"),  # past its header
        (_member(b"pax", b"x path=x\n", b"x"), "malformed pax record"),
        (_member(b"pax", b"10 path=xy\n", b"x"), "malformed pax record"),  # not ended by its newline
        (_member(b"pax", b"12 size=-99\n", b"x"), "malformed pax size"),  # a negative size walked back
        (_header(b"a.png", 0, size_field=b"\xff" * 12), "ends past the end"),  # base-256 -1
        (_member(b"L", b"n" * (1 << 20 | 1), b"L"), "name header"),  # more than any name: not read
    ],
)
def test_a_malformed_header_is_one_line_naming_the_shard(tmp_path, capsys, bad, why):
    path = tmp_path / "s.tar"
    path.write_bytes(_tar(bad, SAMPLES))
    kind, error = _within(shards.read, str(path))
    assert kind == "error" and isinstance(error, UserError), error
    assert str(error).startswith(f"{path}: truncated or damaged shard (") and why in str(error)
    assert _within(main, ["check", str(path)]) == ("value", 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and str(path) in err[0]


def test_a_pax_header_is_read_as_tarfile_reads_it(tmp_path):
    """The stricter pax parser still reads valid ones: several records, values with spaces, '=', a newline."""
    name = "caf\u00e9 a=b/\u732b.png"
    path = tmp_path / "s.tar"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size, info.pax_headers = len(_png(7)), {"comment": "x = y\nz", "mtime": "1.5"}
        tar.addfile(info, io.BytesIO(_png(7)))
        end = tar.offset  # before its end blocks: the samples follow
    path.write_bytes(buf.getvalue()[:end] + SAMPLES + bytes(1024))
    with tarfile.open(path) as tar:
        assert tar.getnames() == [name, "a.png", "a.cls", "b.png", "b.cls"]
    found = shards.read(str(path))
    assert [p.rpartition("/")[2] for p in found.paths] == ["a", "b"]
    assert found.rejects == [(f"{path}/caf\u00e9 a=b/\u732b", "no .cls label")]  # its name, from the pax path


def test_a_cls_that_is_no_class_number_is_a_bad_sample(tmp_path, capsys):
    """An int64 overflow, a negative number, text or a 1 MB .cls: that sample is recorded bad (with its
    reason), the others are read; an empty .cls is no label."""
    cls = {b"c": b"99999999999999999999999", b"d": b"-3", b"e": b"cat", b"f": b"1" * 100_000, b"g": b"  "}
    cls |= {b"h": b"2147483648", b"i": b" 2147483647\n"}
    members = [_member(k + b".png", _png(9)) + _member(k + b".cls", v) for k, v in cls.items()]
    path = tmp_path / "s.tar"
    path.write_bytes(_tar(SAMPLES, *members))
    found = shards.read(str(path))
    assert found.classes == ["0", "1", "2147483647"] and found.labels.tolist() == [0, 1, 2]
    assert [p.rpartition("/")[2] for p in found.paths] == ["a", "b", "i"]
    bad = "its .cls is not a class number (a decimal from 0 to 2147483647)"
    assert sorted(found.rejects) == sorted([(f"{path}/g", "no .cls label")] + [(f"{path}/{k}", bad) for k in "cdefh"])
    assert main(["check", str(path)]) == 1  # the bad samples are reported, the run goes on
    out = capsys.readouterr().out
    assert f"{path}/c: {bad}" in out and "6 bad of 9" in out


@pytest.mark.parametrize(
    "second",
    [
        _member(b"a.png", _png(99)) + _member(b"a.cls", b"1"),  # the same files again: they replaced the first
        _member(b"a.json", b"{}"),  # a's files again, after b's
    ],
)
def test_a_key_used_twice_in_one_shard_is_refused_naming_shard_and_key(tmp_path, capsys, second):
    path = tmp_path / "s.tar"
    path.write_bytes(_tar(SAMPLES, second))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}: the sample key 'a' comes twice in this shard" in err[0]
    # A sample's files together, each once, are one sample, as webdataset reads them.
    path.write_bytes(_tar(SAMPLES, _member(b"c.png", _png(1)), _member(b"c.json", b"{}"), _member(b"c.cls", b"0")))
    assert [p.rpartition("/")[2] for p in shards.read(str(path)).paths] == ["a", "b", "c"]


# --- fuzzing: from a shard visiontune wrote -------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> bytes:
    """The bytes of a one-shard set ``visiontune shard`` wrote (webdataset's ShardWriter: pax headers)."""
    root = tmp_path_factory.mktemp("fuzz")
    for c, cls in enumerate(("cat", "dog")):
        (root / "src" / cls).mkdir(parents=True)
        for i in range(2):
            (root / "src" / cls / f"{i}.png").write_bytes(_png(60 * c + 20 * i))
    assert main(["shard", str(root / "src"), "--out", str(root / "sh")]) == 0
    (tar,) = (root / "sh").glob("*.tar")
    return tar.read_bytes()


_names = itertools.count()


def _read_holds(folder: Path, raw: bytes) -> None:
    """Reading ``raw`` as a shard: a UserError naming it, or samples whose bytes lie inside the file."""
    path = folder / f"f{next(_names)}.tar"  # a new name each time: the index cache never answers for another
    path.write_bytes(raw)
    kind, value = _within(shards.read, str(path))
    if kind == "error":
        assert isinstance(value, UserError) and str(value).startswith(str(path)), repr(value)
        return
    offsets, sizes = value.reader.offset, value.reader.size
    assert np.all(offsets >= 0) and np.all(offsets + sizes <= len(raw))
    assert [len(value.reader[i]) for i in range(len(value))] == sizes.tolist()
    assert len(value.classes) == len(set(value.classes)) and np.all(value.labels < len(value.classes))


def _headers(raw: bytes) -> list[int]:
    return [i for i in range(0, len(raw) - 511, 512) if raw[i + 257 : i + 262] == b"ustar"]


@SETTINGS
@given(data=st.binary(max_size=3000))
def test_fuzz_random_bytes(tmp_path, data):
    _read_holds(tmp_path, data)


@SETTINGS
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8), cut=st.data())
def test_fuzz_mutated_and_truncated_shard(tmp_path, written, flips, cut):
    raw = bytearray(written)
    for at, value in flips:
        raw[at % len(raw)] = value
    _read_holds(tmp_path, bytes(raw[: cut.draw(st.integers(0, len(raw)))]))


# Where a header's fields are (name, mode, size -- drawn most often --, type, magic, prefix), and what to put
# there: any bytes, or the forms a size takes (octal, GNU base-256: near 0, where a negative one walked back).
_FIELDS = st.sampled_from([(0, 100), (100, 8), (124, 12), (124, 12), (124, 12), (156, 1), (257, 8), (345, 155)])
_VALUES = st.one_of(
    st.binary(min_size=1, max_size=12),
    st.integers(0, 8**11 - 1).map(lambda n: b"%011o\0" % n),
    st.builds(lambda blocks, rest: blocks * 512 + rest, st.integers(-3, 3), st.integers(-511, 511)).map(
        lambda n: bytes([0o377 if n < 0 else 0o200]) + (n % 256**11).to_bytes(11, "big")
    ),
)


@SETTINGS
@given(which=st.integers(0, 99), edits=st.lists(st.tuples(_FIELDS, st.integers(0, 154), _VALUES), max_size=4))
def test_fuzz_header_fields_with_their_checksum_fixed(tmp_path, written, which, edits):
    """Header fields changed and the checksum made to fit, so the walk goes past the checksum check."""
    raw = bytearray(written)
    at = _headers(written)[which % len(_headers(written))]
    block = bytearray(raw[at : at + 512])
    for (start, width), shift, value in edits:
        piece = value[:width]  # clipped to its field, anywhere in it
        where = start + shift % (width - len(piece) + 1)
        block[where : where + len(piece)] = piece
    raw[at : at + 512] = _checksummed(block)
    _read_holds(tmp_path, bytes(raw))


@SETTINGS
@given(
    which=st.integers(0, 99),
    records=st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.builds(
                lambda n, k, v: b"%d %s=%s\n" % (n, k, v),
                st.integers(-5, 60),
                st.sampled_from([b"path", b"size", b"linkpath", b"x"]),
                st.binary(max_size=20),
            ),
        ),
        max_size=4,
    ),
)
def test_fuzz_inserted_pax_records(tmp_path, written, which, records):
    """A pax header of random or nearly well-formed records put in front of one of the members."""
    at = _headers(written)[which % len(_headers(written))]
    _read_holds(tmp_path, written[:at] + _member(b"pax", b"".join(records), b"x") + written[at:])


# --- the kept index (the walk's result in the cache folder) -------------------------------------------------


def _kept_index(path: Path) -> tuple[Path, object]:
    """Read ``path`` as shards once; the index file that read kept in the cache folder, and what it read."""
    from visiontune.cluster.host import user_cache_dir

    before = set(Path(user_cache_dir()).glob("shards-*.npz"))
    found = shards.read(str(path))
    (kept,) = set(Path(user_cache_dir()).glob("shards-*.npz")) - before
    return kept, found


def _same(a, b) -> bool:
    return (list(a.paths), a.labels.tolist(), a.rejects) == (list(b.paths), b.labels.tolist(), b.rejects) and [
        a.reader[i] for i in range(len(a))
    ] == [b.reader[i] for i in range(len(b))]


def _savez(path: Path, npy=False, **arrays) -> None:
    """``arrays`` into ``path`` as an .npz (np.savez on a path would add ".npz"); ``npy=None``: a .npy there."""
    with open(path, "wb") as f:
        np.save(f, np.arange(3)) if npy is None else np.savez(f, **arrays)


def test_a_damaged_or_foreign_kept_index_is_walked_again(tmp_path):
    """A cut file (was: BadZipFile), a zip version zipfile cannot read (was: NotImplementedError), a .npy, a
    missing column, and indexes whose images lie outside the shard (past its end, or where offset + size wraps
    around int64), a shard or label out of range: each is walked again, and reads the same."""
    path = tmp_path / "s.tar"
    path.write_bytes(_tar(SAMPLES, _member(b"c.cls", b"1")))  # (c: no image, a recorded bad sample)
    kept, want = _kept_index(path)
    good = dict(np.load(kept))
    assert want.rejects == [(f"{path}/c", "no image in the sample")] and len(want) == 2
    cases = [
        lambda: kept.write_bytes(kept.read_bytes()[:100]),
        lambda: kept.write_bytes(kept.read_bytes()[:4] + b"\x40\x00" + kept.read_bytes()[6:]),  # "zip version 6.4"
        lambda: _savez(kept, npy=None),
        lambda: _savez(kept, **{k: v for k, v in good.items() if k != "label"}),
        lambda: _savez(kept, **good | {"offset": good["offset"] + 10**6}),
        lambda: _savez(kept, **good | {"offset": np.full(3, 2**62), "size": np.full(3, 2**62)}),
        lambda: _savez(kept, **good | {"shard": np.full(3, 5, np.int32)}),
        lambda: _savez(kept, **good | {"label": np.full(3, 2**40)}),
    ]
    for damage in cases:
        damage()
        assert _same(shards.read(str(path)), want)


@settings(SETTINGS, max_examples=examples(25))
@given(flips=st.lists(st.tuples(st.integers(0, 10**5), st.integers(0, 255)), min_size=1, max_size=6))
def test_fuzz_a_mutated_kept_index(tmp_path, written, flips):
    """Whatever the kept index's bytes, reading the shard gives samples inside it, or a UserError."""
    folder = tmp_path / f"k{next(_names)}"
    folder.mkdir()
    path = folder / "s.tar"
    path.write_bytes(written)
    kept, _ = _kept_index(path)
    raw = bytearray(kept.read_bytes())
    for at, value in flips:
        raw[at % len(raw)] = value
    kept.write_bytes(bytes(raw))
    kind, value = _within(shards.read, str(path))
    assert kind == "value" or isinstance(value, UserError), repr(value)
    if kind == "value":
        assert np.all(value.reader.offset + value.reader.size <= len(written)) and np.all(value.reader.offset >= 0)
