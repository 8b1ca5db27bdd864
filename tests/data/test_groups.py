"""Grouped and k-fold splits: no group on both sides, classes balanced, folds a partition, seeded."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sklearn.model_selection import StratifiedGroupKFold

from fuzzing import fuzz_settings
from visiontune.data.groups import fold_split, group_names, grouped_split, split_for, split_images
from visiontune.data.imageset import ImageSet
from visiontune.data.sources import discover
from visiontune.data.split import split_record
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.tasks import AUTO

REGEX = r"/(p\d+)_"


def _patients(seed: int = 0, n_patients: int = 60) -> ImageSet:
    """Two classes; each patient has 1-8 photos, all of one class (a patient's label is their diagnosis)."""
    rng = np.random.default_rng(seed)
    paths, labels = [], []
    for p in range(n_patients):
        cls = int(rng.integers(0, 2)) if p > 1 else p  # both classes present whatever the draw
        for j in range(int(rng.integers(1, 9))):
            paths.append(f"/data/{('benign', 'malignant')[cls]}/p{p:03d}_{j}.png")
            labels.append(cls)
    return ImageSet("/data", "imagefolder", paths, labels, ["benign", "malignant"])


def _groups_of(names: list[str]) -> list[str]:
    return [re.search(REGEX, "/" + n).group(1) for n in names]  # the record's paths are relative to the root


def test_grouped_split_keeps_each_group_on_one_side_and_balances_classes():
    images = _patients()
    split, extra = grouped_split(images.labels, group_names(images, REGEX), 0.2, seed=7)
    record = split_record(split, images.paths, images.root, 7, 0.2)
    # Checked from the record's own lists, as a reader of split.json would.
    train, val = set(_groups_of(record["train"])), set(_groups_of(record["val"]))
    assert not train & val
    assert len(train | val) == 60 and extra == {"groups": {"train": len(train), "val": len(val)}}
    assert sorted(np.concatenate([split.train, split.val]).tolist()) == list(range(len(images)))
    for c in (0, 1):  # each class about 20% validation: within 5 points on 60 groups of 1-8 images
        share = np.isin(np.flatnonzero(images.labels == c), split.val).mean()
        assert abs(share - 0.2) <= 0.05, (c, share)
    # Seeded: the same split again; another seed another one.
    again, _ = grouped_split(images.labels, group_names(images, REGEX), 0.2, seed=7)
    assert again == split
    assert grouped_split(images.labels, group_names(images, REGEX), 0.2, seed=8)[0] != split


def test_the_split_is_the_same_whatever_the_global_rngs_hold():
    # Each process of a job seeds the global generators with seed + its rank: the split must not read them.
    import random

    import torch

    images = _patients()
    cfg = TrainConfig(data="/data", group_by=REGEX, folds=4, fold=1, seed=2)
    splits = []
    for rank in range(3):
        torch.manual_seed(rank)
        np.random.seed(rank)
        random.seed(rank)
        state = torch.get_rng_state()
        splits.append(split_for(images, cfg))
        assert torch.equal(torch.get_rng_state(), state)  # nor does it advance them
    assert splits[0][0] == splits[1][0] == splits[2][0] and splits[0][1] == splits[1][1] == splits[2][1]


def test_the_split_depends_on_the_groups_not_on_the_listing_order():
    images = _patients()
    order = np.random.default_rng(1).permutation(len(images))
    shuffled = images.take(order)
    a, _ = grouped_split(images.labels, group_names(images, REGEX), 0.25, seed=3)
    b, _ = grouped_split(shuffled.labels, group_names(shuffled, REGEX), 0.25, seed=3)
    assert sorted(images.paths[i] for i in a.val) == sorted(shuffled.paths[i] for i in b.val)


@pytest.mark.parametrize("grouped", [True, False])
def test_folds_partition_the_data(grouped):
    images = _patients(seed=2)
    names = group_names(images, REGEX) if grouped else None
    vals = [fold_split(images.labels, names, 5, i, seed=11)[0] for i in range(5)]
    every = np.concatenate([s.val for s in vals])
    assert len(every) == len(images) and sorted(every.tolist()) == list(range(len(images)))  # disjoint, complete
    for s in vals:  # each fold's training set is the rest
        assert sorted(np.concatenate([s.train, s.val]).tolist()) == list(range(len(images)))
        assert not set(s.train.tolist()) & set(s.val.tolist())
    if grouped:
        owner = {}
        for i, s in enumerate(vals):
            for g in {names[j] for j in s.val}:
                assert owner.setdefault(g, i) == i  # a group's images in one fold only
    else:  # a stratified k-fold: each class's count per fold within one of the others'
        for c in (0, 1):
            per_fold = [int((images.labels[s.val] == c).sum()) for s in vals]
            assert max(per_fold) - min(per_fold) <= 1, per_fold


def test_grouped_folds_balance_classes_as_well_as_sklearns_stratified_group_kfold():
    # The independent reference: scikit-learn's StratifiedGroupKFold on the same groups. Ours may
    # differ fold by fold, but its worst class share should be no further from 1/K than sklearn's
    # worst plus a few points.
    images = _patients(seed=4, n_patients=80)
    names = group_names(images, REGEX)
    codes = np.unique(names, return_inverse=True)[1]
    ours = [fold_split(images.labels, names, 4, i, seed=0)[0].val for i in range(4)]
    theirs = [
        val for _, val in StratifiedGroupKFold(4, shuffle=True, random_state=0).split(codes, images.labels, codes)
    ]

    def worst(folds):
        return max(abs(np.isin(np.flatnonzero(images.labels == c), v).mean() - 0.25) for v in folds for c in (0, 1))

    assert worst(ours) <= worst(theirs) + 0.03, (worst(ours), worst(theirs))


def test_group_by_a_manifest_column(tmp_path):
    rows = ["filename,label,patient"]
    for p in range(12):
        for j in range(3):
            (tmp_path / f"{p}_{j}.png").write_bytes(b"")
            rows.append(f"{p}_{j}.png,{'ab'[p % 2]},P{p}")
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    images = discover(str(tmp_path), task=AUTO)
    names = group_names(images, "patient", str(tmp_path))
    assert names[:3] == ["P0", "P0", "P0"] and len(set(names)) == 12
    cfg = TrainConfig(data=str(tmp_path), group_by="patient", val_fraction=0.25, seed=1)
    split, rec = split_for(images, cfg)
    val = {names[i] for i in split.val}
    assert not val & {names[i] for i in split.train}
    assert rec["group_by"] == "patient" and rec["groups"] == {"train": 9, "val": 3}
    assert rec["counts"] == {"train": 27, "val": 9}


def test_evaluate_knows_moved_data_by_its_grouped_split(tmp_path):
    from visiontune.inference.evaluate import _same_listing

    data, run = tmp_path / "moved", tmp_path / "run"
    data.mkdir()
    run.mkdir()
    rows = ["filename,label,patient"] + [f"{i}.png,{'ab'[i % 2]},P{i // 4}" for i in range(32)]
    for i in range(32):
        (data / f"{i}.png").write_bytes(b"")
    (data / "train.csv").write_text("\n".join(rows) + "\n")
    (run / "bad_files.csv").write_text("path,problem\n")
    images = discover(str(data), task=AUTO)
    for cfg in (
        TrainConfig(data=str(data), group_by="patient", seed=3),
        TrainConfig(data=str(data), group_by="patient", folds=4, fold=1, seed=3),
    ):
        _, record = split_for(images, cfg)
        assert _same_listing(images, str(run), record, "/where/it/was")
        ungrouped = {k: v for k, v in record.items() if k not in ("group_by", "folds", "fold")}
        assert not _same_listing(images, str(run), ungrouped, "/where/it/was")


def test_split_for_records_folds_and_plain_runs_are_unchanged():
    images = _patients()
    cfg = TrainConfig(data="/data", group_by=REGEX, folds=3, fold=2, seed=5)
    split, rec = split_for(images, cfg)
    assert rec["folds"] == 3 and rec["fold"] == 2 and rec["group_by"] == REGEX
    assert split == fold_split(images.labels, group_names(images, REGEX), 3, 2, 5)[0]
    plain, rec = split_for(images, TrainConfig(data="/data", seed=5))
    assert "groups" not in rec and split_images(images, 0.2, 5, None, 0, 0) is None


def test_bad_group_by_is_one_clear_error():
    images = _patients()
    with pytest.raises(UserError, match=r"does not match benign/p000_0.png"):
        group_names(images, r"(patient\d+)")
    with pytest.raises(UserError, match="neither a column"):
        group_names(images, "(")
    with pytest.raises(UserError, match="only one group"):
        grouped_split(images.labels, group_names(images, r"(p)\d"), 0.2, 0)
    with pytest.raises(UserError, match="needs at least 61 groups"):
        fold_split(images.labels, group_names(images, REGEX), 61, 0, 0)
    own = ImageSet("/d", "hf", ["/d/a", "/d/b"], [0, 1], ["x", "y"], val_mask=[False, True], split_note="its own")
    with pytest.raises(UserError, match="brings its own validation split"):
        split_images(own, 0.2, 0, "x", 0, 0)


def test_group_by_says_whether_the_regex_did_not_match_or_its_group_was_empty():
    images = ImageSet("/d", "imagefolder", ["/d/0/0.png", "/d/1/12.png"], [0, 1], ["0", "1"])
    typed = r"^\d/(\d*)\d\.png$"
    with pytest.raises(UserError) as empty:
        group_names(images, typed)
    # The pattern as typed (no doubled backslashes), the file, and what happened: it matched, its group is empty.
    assert str(empty.value).startswith(f"--group-by {typed} matches 0/0.png, but its first group captures nothing")
    with pytest.raises(UserError) as missed:
        group_names(images, r"^\d/(x\d)")
    assert str(missed.value).startswith(r"--group-by ^\d/(x\d) does not match 0/0.png;")
    with pytest.raises(UserError, match="matches 0/0.png, but it matches an empty string there"):
        group_names(images, "z*")
    assert group_names(images, r"^\d/(\d+)\.png$") == ["0", "12"]


def test_a_catastrophic_group_by_regex_runs_in_linear_time():
    # Python's backtracking re takes 2**40 steps for (a+)+$ on forty a's and a '!': this never returned.
    names = ["a" * 40 + "!", "a" * 39 + "!", "b/" + "a" * 40 + "!"]
    images = ImageSet("/d", "imagefolder", [f"/d/{n}" for n in names], [0, 1, 0], ["x", "y"])
    with pytest.raises(UserError, match=r"^--group-by \(a\+\)\+\$ does not match a{40}!;"):
        group_names(images, "(a+)+$")
    assert group_names(images, "((a+)+)!$") == ["a" * 40, "a" * 39, "a" * 40]  # the first group, as before


def test_group_by_syntax_that_needs_backtracking_is_one_line_naming_the_flag(capfd):
    images = _patients()
    for pattern in (r"(p\d+)_\1", r"(?=p)(p\d+)"):
        with pytest.raises(UserError, match=r"^--group-by .* is neither a column of /data nor a regex .*RE2 syntax"):
            group_names(images, pattern)
    assert capfd.readouterr().err == ""  # RE2's own error log stays off


@pytest.mark.slow
def test_train_with_group_by_records_the_grouped_split_and_resumes_only_with_it(
    tmp_path, small_data, monkeypatch, capsys
):
    from trainrun import train_argv
    from visiontune import cli

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "scan"))
    out, by = tmp_path / "run", r"(\d)\.jpg$"  # ten groups by the last digit: cat.3, cat.13, dog.3, ... together
    view = ["--augment", "light", "--hflip", "0", "--vflip", "0.5", "--crop-scale", "0.6", "1"]
    argv = train_argv(small_data, out, "--group-by", by, "--val-fraction", "0.3", *view)[3:]
    assert cli.main([*argv, "--epochs", "1"]) == 0
    record = json.loads((out / "split.json").read_text())
    train, val = ({re.search(by, p).group(1) for p in record[side]} for side in ("train", "val"))
    assert not train & val and len(train | val) == 10
    assert record["group_by"] == by and record["groups"] == {"train": len(train), "val": len(val)}
    assert record["counts"] == {"train": len(record["train"]), "val": len(record["val"])}
    assert len(record["train"]) + len(record["val"]) == 40 and len(val) == 3  # 30% of ten groups of 4
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["hflip"], config["vflip"], config["crop_scale"], config["group_by"]) == (0.0, 0.5, [0.6, 1.0], by)
    # Another grouping is another split: the checkpoint refuses it, and split.json stays as it was.
    capsys.readouterr()
    assert cli.main([*train_argv(small_data, out, "--group-by", r"(\d\d?)\.jpg$", *view)[3:], "--resume", "auto"]) == 2
    assert "the data split" in capsys.readouterr().err
    assert json.loads((out / "split.json").read_text()) == record
    assert cli.main([*argv, "--epochs", "2", "--resume", "auto"]) == 0
    assert json.loads((out / "split.json").read_text()) == record


REGEX_TOKENS = [*"()[]^$.*+?|\\/{},-_0123ab", "(?P<", "(?=", "\\1", "\\d", "\udcff", "\n"]


@fuzz_settings(50)
@given(
    st.lists(st.sampled_from(REGEX_TOKENS), max_size=12).map("".join) | st.text(max_size=12),
    st.lists(st.text(st.characters(blacklist_characters="/\x00"), min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_fuzz_any_group_by_pattern_gives_a_group_per_image_or_one_user_error(pattern, names):
    """``--group-by`` from a command line or a run's config.json: RE2 compiles it (or refuses it in a UserError)
    and every image gets a non-empty group, or the first it cannot name is a UserError -- never re's errors,
    a backtracking hang or RE2's own log."""
    paths = [f"/data/{name}/{i}.png" for i, name in enumerate(names)]
    try:  # (a name no file system holds, a lone surrogate from a JSON listing, is refused when it is listed)
        images = ImageSet("/data", "imagefolder", paths, [0] * len(paths), ["a", "b"])
        groups = group_names(images, pattern)
    except UserError:
        return
    assert len(groups) == len(paths) and all(isinstance(g, str) and g for g in groups)


def test_a_name_with_a_lone_surrogate_is_one_user_error():
    # Found by the fuzz target: a JSON listing can hold "\ud800", which no file system name decodes to.
    paths = ["/data/\ud800/0.png"]
    with pytest.raises(UserError, match="not text a file system holds"):
        ImageSet("/data", "imagefolder", paths, [0], ["a", "b"])
