"""The seeded split of existing data is the one earlier releases made: the task reads the labels and says how
to split them, and the files each side gets are the same (their sha256, as split.json records it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from visiontune.data.sample import make_multilabel_data, make_regression_data, make_sample_data
from visiontune.data.sources import discover
from visiontune.data.split import split_of, split_summary
from visiontune.tasks import reader


def _folder(out: Path) -> None:
    for c, n in (("b", 7), ("a", 13), ("c", 5)):
        (out / c).mkdir(parents=True)
        for i in range(n):
            (out / c / f"{i}.png").write_bytes(b"x")


def _numbered(out: Path) -> None:
    """A manifest of classes named by numbers (sorted as numbers: 2, 9, 10)."""
    out.mkdir()
    rows = ["filename,label"] + [f"{i}.png,{['10', '9', '2'][i % 3] if i % 5 else '2'}" for i in range(31)]
    for i in range(31):
        (out / f"{i}.png").write_bytes(b"x")
    (out / "train.csv").write_text("\n".join(rows) + "\n")


DATA = {
    "classify": (lambda d: make_sample_data(d, per_class=20, test_count=0, seed=0), "classify"),
    "folder": (_folder, "auto"),
    "numbered": (_numbered, "auto"),
    "multilabel": (lambda d: make_multilabel_data(d, count=40, size=8, seed=0), "multilabel"),
    "regress": (lambda d: make_regression_data(d, count=40, size=8, seed=0), "regress"),
}
# sha256 of the split lists (split.json's "sha256") of each data set at seed 7, val fraction 0.25, as the
# release before the tasks read their own labels made them.
BEFORE = {
    ("classify", "stratified"): "0ccb8f30177cb2c3ecfe04b9701803b942882704a4fcf589ff5a552c26e00800",
    ("classify", "random"): "910c3469808f8c01fcd52af008a56beda9f1d734f6bf8debb34e250b5f1f2a11",
    ("folder", "stratified"): "f60112ee75aa13123e2e610be3c9e5048290602b6b7fd143dded2477e776d316",
    ("folder", "random"): "530ca9d18a09356ee60de3d1cf9821b919d24ba3f7f7f90233ce7e6134cf6129",
    ("numbered", "stratified"): "f5ff92ca711015624fcd5a9c75ac48af45cc731d4f1b36d8fb761a51e1718a14",
    ("numbered", "random"): "a1b8354563f16db7e2a2a720677c10691501bf25b80296f728fe31220a0d5cbb",
    ("multilabel", "stratified"): "36761cefa6af00f8448bd2c648b73195171a989247111eb547adf658553a890b",
    ("multilabel", "random"): "7ab5969f1ee00b5673e748dd10fa08b7695fb28dbe3a01caecef27e4129aa894",
    ("regress", "stratified"): "37073c98cc8fa0c86c51088fcbbb8424e621c713790075d72899c9e22a4f41ca",
    ("regress", "random"): "7ab5969f1ee00b5673e748dd10fa08b7695fb28dbe3a01caecef27e4129aa894",
}


@pytest.mark.parametrize("name", list(DATA))
def test_the_split_of_existing_data_is_unchanged(name, tmp_path):
    make, task = DATA[name]
    make(tmp_path / name)
    images = discover(str(tmp_path / name), task=reader(task))
    for method in ("stratified", "random"):
        split = split_of(images, 0.25, 7, method)
        assert split_summary(split, images.paths, images.root, 7, 0.25)["sha256"] == BEFORE[name, method], method
