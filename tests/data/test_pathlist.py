"""The compact listing: the same (path, label) pairs as a plain listing, and the same split record; a text file
listing image paths (``predict --data FILE``) read bounded, any bytes as one a listing or one line."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bounded import past_and_under
from fuzzing import fuzz_settings
from visiontune.data import imageset, layouts, pathlist, sources
from visiontune.data.split import make_split, split_summary, write_split
from visiontune.errors import UserError
from visiontune.inference.predict import list_inputs
from visiontune.loading import jobdata
from visiontune.runs import runrecords
from visiontune.tasks import AUTO

# split.json's sha256 for odd_tree() (seed 3, val fraction 0.25), written by the code before the
# compact listing (commit 0ac2dd9): resume compares it, so the same data must keep the same hash.
OLD_CODE_SPLIT_SHA256 = "d3652863c396527e88258a2e7804fb4119cdfc03fe00ea01aeb5bd1b262f258f"

ODD_FILES = [
    "cat/a b.jpg",
    "cat/é.JPG",
    "cat/sub dir/x.jpg",
    "cat/.hidden/never.jpg",  # hidden subfolder: not entered
    "cat/Thumbs.db",  # OS metadata: not data
    "cat/._a b.jpg",
    "dög café/1.png",
    "dög café/10.png",
    "dög café/2.png",
    "日本/猫 1.jpg",
    "日本/deep/er/z.jpg",
    "empty/.keep/ignored.jpg",  # a class folder with nothing listable: not a class
]


def odd_tree(root) -> str:
    """A small ImageFolder with unicode, spaces, nesting, skipped entries and a non-UTF-8 name."""
    root = os.fspath(root)
    for rel in ODD_FILES:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()
    # A name that is not valid UTF-8 (Linux allows any bytes): it must round-trip as os.fsdecode gives it.
    open(os.path.join(os.fsencode(root), b"cat", b"bad\xff name.jpg"), "wb").close()
    return root


def walk_listing(root: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, [(path, label)]) by plain os.walk: the layout's rules written out independently."""
    classes, pairs = [], []
    for name in sorted(os.listdir(root)):
        if name.startswith(".") or not os.path.isdir(os.path.join(root, name)):
            continue
        files = []
        for folder, dirs, names in os.walk(os.path.join(root, name)):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [os.path.join(folder, f) for f in names if f not in layouts.OS_METADATA and not f.startswith("._")]
        if files:
            classes.append(name)
            pairs += [(p, len(classes) - 1) for p in sorted(files)]
    return classes, pairs


def test_compact_listing_gives_the_pairs_of_a_plain_walk(tmp_path):
    root = odd_tree(tmp_path / "data")
    found = sources.discover(root, task=AUTO)
    classes, pairs = walk_listing(root)
    assert len(pairs) == 9 and classes == ["cat", "dög café", "日本"]
    assert found.classes == classes
    assert list(zip(found.paths, found.labels.tolist())) == pairs
    assert [found.paths[i] for i in range(-len(pairs), 0)] == [p for p, _ in pairs]  # negative indices too
    assert all(os.path.exists(p) for p in found.paths)  # materialised paths name the real files
    # The compact form: the bytes of the names under the root, not an object per file.
    assert found.paths.prefix == os.path.join(root, "")
    assert len(found.paths.blob) == sum(len(os.fsencode(p)) - len(os.fsencode(root)) - 1 for p, _ in pairs)
    # Carried to another process (the launcher's hand-over) and back: the same pairs.
    jobdata.save_listing(found, str(tmp_path / "list.bin"), {"k": 1})
    back, extra = jobdata.load_listing(str(tmp_path / "list.bin"), AUTO)
    assert extra == {"k": 1} and back.classes == classes
    assert list(zip(back.paths, back.labels.tolist())) == pairs
    # A view (a split's subset): the chosen pairs, in order, and it travels the same way.
    pick = [7, 0, 3]
    view = found.paths.take(pick)
    assert list(view) == [pairs[i][0] for i in pick] and view[1:] == [pairs[0][0], pairs[3][0]]
    jobdata.save_listing(
        imageset.ImageSet(root, "imagefolder", view, found.labels[pick], classes), str(tmp_path / "v.bin")
    )
    assert list(jobdata.load_listing(str(tmp_path / "v.bin"), AUTO)[0].paths) == [pairs[i][0] for i in pick]
    # A loader worker gets the arrays: pickling costs the bytes, not an object per file.
    from visiontune.loading.pipeline import ImageDataset

    ds = ImageDataset(view, found.labels[pick], 8)
    assert ds.paths is view and pickle.loads(pickle.dumps(ds)).paths == [pairs[i][0] for i in pick]


def test_split_record_is_unchanged_by_the_compact_listing(tmp_path):
    root = odd_tree(tmp_path / "data")
    images = sources.discover(root, task=AUTO)
    split = make_split(len(images), 0.25, 3)
    summary = split_summary(split, images.paths, images.root, 3, 0.25)
    write_split(str(tmp_path / "split.json"), summary, split, images.paths, images.root)
    back = runrecords.read_split_record(tmp_path / "split.json")
    # Independently: the seeded permutation, the plain walk's paths relative to the root, the json hash.
    _, pairs = walk_listing(root)
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(3))
    lists = {
        name: [os.path.relpath(pairs[i][0], root) for i in sorted(idx.tolist())]
        for name, idx in (("train", perm[:6]), ("val", perm[6:]))  # int(9 * 0.75) train
    }
    assert {k: back[k] for k in ("train", "val")} == lists
    expected = hashlib.sha256(json.dumps(lists, sort_keys=True).encode("utf-8", "surrogateescape")).hexdigest()
    assert back["sha256"] == summary["sha256"] == expected == OLD_CODE_SPLIT_SHA256


def test_paths_outside_the_root_and_the_warm_scan_lookup():
    import numpy as np

    from visiontune.data.check import _isin

    # Paths not under the root are kept whole (no prefix), and read back as given.
    odd = ["/a/x.jpg", "/b/ü y.jpg", "rel/z.jpg"]
    images = imageset.ImageSet("/a", "manifest", odd, [0, 1, 1], ["p", "q"])
    assert images.paths.prefix == "" and list(images.paths) == odd and images.class_counts() == {"p": 1, "q": 2}
    # The scan's key lookup is np.isin: absent keys, duplicates, an empty cache, the largest uint64.
    rng = np.random.default_rng(0)
    members = rng.integers(0, 2**63, 5000, dtype=np.uint64)
    keys = np.concatenate([members[::3], rng.integers(0, 2**63, 4000, dtype=np.uint64), members[:10]])
    keys = np.append(keys, np.uint64(2**64 - 1))
    assert np.array_equal(_isin(keys, members), np.isin(keys, members))
    assert np.array_equal(
        _isin(keys, np.append(members, np.uint64(2**64 - 1))), np.isin(keys, np.append(members, np.uint64(2**64 - 1)))
    )
    assert not _isin(keys, np.zeros(0, np.uint64)).any()


def test_image_cache_file_name_is_unchanged_for_a_compact_listing(tmp_path):
    from visiontune.loading.cache import _files

    # More paths than one chunk, some not UTF-8: the name the earlier code gave the cache files.
    paths = [f"/d/c{i % 7}/ü {i}.jpg" for i in range(70_000)] + [os.fsdecode(b"/d/c1/\xff.jpg")]
    ident = hashlib.sha256("\n".join(["", *paths]).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    expected = os.path.join(str(tmp_path), f"{ident}-32px")
    compact = imageset.ImageSet("/d", "imagefolder", paths, [0] * len(paths), ["a", "b"]).paths
    assert (
        _files(str(tmp_path), paths, 32, "")
        == _files(str(tmp_path), compact, 32, "")
        == (
            expected + ".u8",
            expected + ".json",
        )
    )


# A list of image paths (predict --data FILE) comes from elsewhere: read bounded (data/pathlist.py), each bound
# one line naming the file. Before, it was read whole with read_text, any size, and a NUL or a line longer than
# any path became a path.
LIST = "a.jpg\n\n#c\n  sub/b c.png  \r\nd.jpg\n"  # 3 paths, 33 bytes, 16 characters its longest line (read)


@pytest.mark.parametrize(
    "bound,value,says",
    [
        ("MAX_LIST_BYTES", 20, "is 33 bytes, more than the 20 of a list of image paths visiontune reads"),
        ("MAX_LIST_PATHS", 2, "more than the 2 paths of a list of image paths visiontune reads"),
        ("MAX_LIST_LINE", 8, "line 4: longer than 8 characters; a list's line is one image path"),
    ],
)
def test_a_path_list_past_a_bound_is_one_line_naming_it(tmp_path, monkeypatch, bound, value, says):
    listed = tmp_path / "list.txt"
    listed.write_bytes(LIST.encode())
    inputs = past_and_under(monkeypatch, pathlist, bound, value, lambda: list_inputs(str(listed)), str(listed), says)
    assert inputs.paths == ["a.jpg", "sub/b c.png", "d.jpg"] and inputs.reader is None


@pytest.mark.parametrize(
    "text,says",
    [
        ("a.jpg\n" + "x" * 5000 + ".jpg\n", "line 2: longer than 4,096 characters"),  # no path is that long
        ("a.jpg\nb\x00.jpg\n", "line 2: holds a NUL character, which no path does"),
        ("\n# only a comment\n", "no paths listed; expected one image path per line"),
    ],
)
def test_a_path_list_no_file_system_could_hold_is_one_line(tmp_path, text, says):
    listed = tmp_path / "list.txt"
    listed.write_text(text)
    with pytest.raises(UserError) as e:
        list_inputs(str(listed))
    assert f"{listed}" in str(e.value) and says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_huge_path_list_is_refused_unread_in_one_line(tmp_path):
    listed = tmp_path / "list.txt"
    with open(listed, "wb") as f:  # sparse: no disk, and nothing of it is read
        f.truncate(pathlist.MAX_LIST_BYTES + 1)
    with pytest.raises(UserError) as e:
        list_inputs(str(listed))
    assert f"{listed} is {pathlist.MAX_LIST_BYTES + 1:,} bytes, more than the" in str(e.value)
    assert "\n" not in str(e.value)


# Any bytes, and lines of the pieces a list's lines are made of (paths, comments, blanks, line ends, NUL, non-UTF-8).
PIECES = st.lists(st.sampled_from([b"a.jpg", b"#", b" ", b"\n", b"\r", b"\x00", b"\xff"])).map(b"".join)


@fuzz_settings(200)
@given(st.binary(max_size=600) | PIECES)
def test_fuzz_any_bytes_as_a_path_list_give_a_listing_or_one_line(tmp_path_factory, data):
    listed = tmp_path_factory.mktemp("fuzz") / "list.txt"
    listed.write_bytes(data)
    try:
        inputs = list_inputs(str(listed))
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert inputs.paths and inputs.reader is None and inputs.kaggle_ids is None
    for path in inputs.paths:
        assert path == path.strip() and not path.startswith("#") and "\n" not in path and "\x00" not in path
        assert len(path) <= pathlist.MAX_LIST_LINE
