"""The default split is stratified by class: each class's share of validation is --val-fraction, in whole
images; the shuffle stays as --split-method random; split.json says which, and old records read as shuffles."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from visiontune import tasks
from visiontune.data.imageset import ImageSet
from visiontune.data.sources import discover
from visiontune.data.split import (
    ITERATIVE,
    RANDOM,
    STRATIFIED,
    Split,
    make_split,
    make_stratified_split,
    method_of,
    split_of,
    split_summary,
)
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import load_config_file, validate
from visiontune.tasks import AUTO


def _folder(counts: list[int]) -> ImageSet:
    labels = np.repeat(np.arange(len(counts)), counts)
    paths = [f"/d/c{c}/{i}.png" for i, c in enumerate(labels)]
    return ImageSet("/d", "imagefolder", paths, labels, [f"c{c}" for c in range(len(counts))])


def test_a_balanced_folder_gives_every_class_its_share_of_validation():
    # The folder: 20 images a class. The shuffle gave a class between 0 and 8 validation images.
    images = _folder([20] * 10)
    shuffled = []
    for seed in range(20):
        split = split_of(images, 0.2, seed)
        assert np.bincount(images.labels[split.val], minlength=10).tolist() == [4] * 10
        assert split.method == STRATIFIED and split == make_stratified_split(images.labels, 0.2, seed)
        old = split_of(images, 0.2, seed, method="random")
        assert old == make_split(len(images), 0.2, seed) and old.method == RANDOM
        shuffled += np.bincount(images.labels[old.val], minlength=10).tolist()
    assert min(shuffled) <= 1 and max(shuffled) >= 7  # what the stratified split is for


def test_the_stratified_split_has_the_shuffles_sizes_and_is_seeded_and_private():
    labels = np.repeat(np.arange(7), [50, 30, 15, 4, 1, 9, 2])
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    for fraction in (0.1, 0.2, 0.25, 0.5, 0.9):
        split = make_stratified_split(labels, fraction, 42)
        plain = make_split(len(labels), fraction, 42)
        assert (len(split.train), len(split.val)) == (len(plain.train), len(plain.val))
        assert sorted([*split.train, *split.val]) == list(range(len(labels)))
        assert np.all(np.diff(split.train) > 0) and np.all(np.diff(split.val) > 0)
    assert torch.equal(before, torch.rand(1)), "the split must not consume the global RNG"
    assert make_stratified_split(labels, 0.2, 42) == make_stratified_split(labels, 0.2, 42)
    assert make_stratified_split(labels, 0.2, 42) != make_stratified_split(labels, 0.2, 43)
    with pytest.raises(UserError, match="leaves an empty train or val set"):
        make_stratified_split(np.zeros(1, np.int64), 0.2, 0)


def test_each_class_is_held_out_by_its_share_rounded_to_whole_images():
    # 111 images, 23 in val (111 - int(111 * 0.8)); shares 50*23/111 = 10.4, 30*23/111 = 6.2, 15 -> 3.1,
    # 4 -> 0.8, 1 -> 0.2, 9 -> 1.9, 2 -> 0.4: rounded down 10, 6, 3, 0, 0, 1, 0 (20), then one more each to
    # the three furthest below their share: 4 (0.83), 9 (0.86 short), 2 (0.41); the class of one stays in train.
    labels = np.repeat(np.arange(7), [50, 30, 15, 4, 1, 9, 2])
    split = make_stratified_split(labels, 0.2, 42)
    assert np.bincount(labels[split.val], minlength=7).tolist() == [10, 6, 3, 1, 0, 2, 1]
    # Every class keeps a training image while another class can give one to validation instead.
    assert np.bincount(labels[split.train], minlength=7).min() >= 1
    # 1,000 classes of one image: 200 must go to validation, so 200 classes have no training image.
    split = make_stratified_split(np.arange(1000), 0.2, 0)
    assert len(split.val) == 200 and np.all(np.bincount(split.train, minlength=1000)[split.val] == 0)


def test_split_json_names_the_method_and_a_record_without_one_is_a_shuffle():
    images = _folder([6, 4])
    for method, recorded in (("stratified", STRATIFIED), ("random", RANDOM)):
        split = split_of(images, 0.2, 1, method)
        summary = split_summary(split, images.paths, images.root, 1, 0.2)
        assert summary["method"] == recorded and method_of(summary) == method
    assert method_of({"seed": 42}) == "random"  # every single-label run before the stratified split
    assert method_of({"method": ITERATIVE}) == "stratified"  # multi-label runs recorded theirs
    own = ImageSet("/d", "hf", ["/d/a", "/d/b"], [0, 1], ["x", "y"], val_mask=[False, True], split_note="its own")
    assert split_of(own, 0.2, 0).val.tolist() == [1] and split_of(own, 0.2, 0, "random").val.tolist() == [1]


def test_multi_label_data_is_iteratively_stratified_unless_random_is_asked_for(tmp_path):
    (tmp_path / "train.csv").write_text("filename,labels\n" + "".join(f"{i}.png,{'ab'[i % 2]};c\n" for i in range(10)))
    for i in range(10):
        (tmp_path / f"{i}.png").write_bytes(b"x")
    images = discover(str(tmp_path), task=AUTO)
    assert split_of(images, 0.2, 0).method == ITERATIVE
    assert split_of(images, 0.2, 0, "random") == make_split(10, 0.2, 0)


def test_split_method_is_a_checked_setting_and_an_earlier_runs_config_keeps_its_split(tmp_path):
    assert TrainConfig().split_method == "stratified"
    with pytest.raises(UserError, match="--split-method must be one of stratified, random, got 'shuffle'"):
        validate(TrainConfig(data="d", split_method="shuffle"))
    # A run's config.json from before --split-method: its split was the shuffle (multi-label: iterative).
    config = TrainConfig(data="d").to_dict()
    del config["split_method"]
    for multi_label, method in ((False, "random"), (True, "stratified")):
        record = {"config": config, "model": {"multi_label": multi_label}}
        (tmp_path / "config.json").write_text(json.dumps(record))
        assert load_config_file(str(tmp_path / "config.json"))["split_method"] == method
    newer = {"config": {**config, "split_method": "stratified"}, "model": {"multi_label": False}}
    (tmp_path / "config.json").write_text(json.dumps(newer))
    assert load_config_file(str(tmp_path / "config.json"))["split_method"] == "stratified"
    (tmp_path / "c.toml").write_text("epochs = 3\n")  # a settings file of the user's: the default applies
    assert "split_method" not in load_config_file(str(tmp_path / "c.toml"))


def _said(images: ImageSet, split, **settings) -> list[str]:
    from visiontune.runs import records

    said: list[str] = []
    accelerator = SimpleNamespace(print=lambda *a: said.append(" ".join(map(str, a))))
    setup = SimpleNamespace(
        strategy="single", devices=["cpu"], world_size=1, per_process_batch=4, global_batch=4, lr=0.1
    )
    cfg = validate(TrainConfig(data="d", image_size=32, **settings))
    records.announce(records.RunFacts(accelerator, "/run", cfg, setup, tasks.get(images.task), images, split))
    return [s for s in said if "warning" in s]


def test_classes_only_in_the_datas_own_validation_split_are_named_at_the_start():

    labels = [0] * 8 + [1] * 8 + [2] * 4 + [3] * 3
    own = np.r_[np.zeros(16, bool), np.ones(7, bool)]  # its validation split: classes 2 and 3 only
    names = ["cat", "dog", "fox", "owl"]
    images = ImageSet("hf:x", "hf", [f"hf:x/{i}" for i in range(23)], labels, names, val_mask=own, split_note="own")
    warnings = _said(images, split_of(images, 0.2, 0))
    assert (
        "visiontune: warning: 2 of 4 classes have no training image ('fox', 'owl'), so the model cannot learn "
        "them, and scores 0 on their 7 validation images; the data's own train split lacks them: add training "
        "images of them, or leave them out of validation"
    ) in warnings
    rare = next(w for w in warnings if "the rarest class" in w)
    assert rare.endswith("the data's own validation split holds few of it: add validation images of it there")


def test_the_rare_class_warning_says_what_made_it_rare():

    images = _folder([60, 60])
    # A shuffle that drew 3 of a class's 60 (12 wanted): the stratified split is the fix, not more images.
    split = Split(np.r_[np.arange(57), np.arange(60, 108)], np.r_[np.arange(57, 60), np.arange(108, 120)], RANDOM)
    (rare,) = _said(images, split, split_method="random")
    assert rare.startswith("visiontune: warning: the rarest class, 'c0', has 3 validation images (fewer than 10)")
    assert rare.endswith(
        "it has 60 images, but the random split drew few of them: --split-method stratified (the default) "
        "holds out --val-fraction of every class"
    )
    small = _folder([60, 20])  # 20 images at 0.2: 4 in validation, however split
    (rare,) = _said(small, split_of(small, 0.2, 0))
    assert "'c1', has 4 validation images" in rare and rare.endswith(
        "it has 20 images: add images of it or raise --val-fraction"
    )
    unseen = Split(np.arange(60), np.arange(60, 80), RANDOM)  # a shuffle that sent a class wholly to val
    line = next(w for w in _said(small, unseen, split_method="random") if "no training image" in w)
    assert line.endswith("--split-method stratified (the default) keeps a training image of every class")
