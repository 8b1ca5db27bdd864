"""Real runs on a 95/5 set (190 cats, 10 dogs): --sampler balanced and --class-weights auto raise the
dogs' recall over the plain run, measured on a balanced held-out set; a balanced, weighted run resumed
mid-epoch ends with the uninterrupted run's tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainrun import assert_same_weights, final_weights, flags
from visiontune import cli
from visiontune.data.sample import make_sample_data

MINORITY = 10


@pytest.fixture(scope="module")
def imbalanced(tmp_path_factory) -> tuple[Path, Path]:
    """(a 190/10 cats/dogs train folder, a 25/25 labelled folder to measure recall on)."""
    root = tmp_path_factory.mktemp("imbalanced")
    make_sample_data(root / "data", per_class=190, test_count=0, seed=3)
    for dog in (root / "data" / "train").glob("dog.*.jpg"):
        if int(dog.name.split(".")[1]) >= MINORITY:
            dog.unlink()
    make_sample_data(root / "heldout", per_class=25, test_count=0, seed=4)
    return root / "data", root / "heldout"


# resnet18 from scratch at 16 px, 3 epochs: the plain run learns to say "cat" (dog recall 0 on the
# held-out set), as a model does on 95/5 data before it has seen the minority often enough.
RUN = flags(model="resnet18", weights="none", image_size=16, no_progress=True, num_workers=0, batch_size=8)
RUN += flags(epochs=3, lr=0.01, threads=1)


@pytest.fixture(scope="module")
def imbalanced_runs(imbalanced, tmp_path_factory) -> dict[str, dict]:
    """eval.json on the held-out set of the plain, the balanced-sampler and the class-weighted run."""
    data, heldout = imbalanced
    root = tmp_path_factory.mktemp("imbalanced_runs")
    cache = ["--cache", str(root / "cache")]  # decoded once for the three runs
    out = {}
    for name, choice in (("plain", []), ("balanced", ["--sampler", "balanced"]), ("auto", ["--class-weights", "auto"])):
        run = root / name
        assert cli.main(["train", "--data", str(data), "--output-dir", str(run), *RUN, *cache, *choice]) == 0
        assert cli.main(["evaluate", "--run", str(run), "--data", str(heldout), "--out", str(run / "held.json")]) == 0
        out[name] = json.loads((run / "held.json").read_text())
        out[name]["config"] = json.loads((run / "config.json").read_text())
    return out


def test_balanced_sampling_and_class_weights_raise_the_minority_recall(imbalanced_runs):
    recall = {name: ev["per_class"]["dog"]["recall"] for name, ev in imbalanced_runs.items()}
    assert imbalanced_runs["plain"]["per_class"]["dog"]["support"] == 25
    assert recall["balanced"] > recall["plain"] + 0.5 and recall["auto"] > recall["plain"] + 0.5, recall
    for name in ("balanced", "auto"):
        assert imbalanced_runs[name]["balanced_accuracy"] > imbalanced_runs["plain"]["balanced_accuracy"]
    # The choices are in the run record.
    cfg = {name: ev["config"]["config"] for name, ev in imbalanced_runs.items()}
    assert (cfg["balanced"]["sampler"], cfg["balanced"]["class_weights"]) == ("balanced", "none")
    assert (cfg["auto"]["sampler"], cfg["auto"]["class_weights"]) == ("random", "auto")
    overview = {name: ev["config"]["overview"] for name, ev in imbalanced_runs.items()}
    assert overview["auto"]["loss"].startswith("cross-entropy, class weights inverse frequency: cat ")
    assert overview["balanced"]["sampler"].startswith("balanced: the 2 classes drawn equally often")


def test_a_balanced_weighted_run_resumed_mid_epoch_ends_with_the_uninterrupted_tensors(imbalanced, tmp_path):
    data, _ = imbalanced
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = ["--data", str(data), *flags(model="timm/test_resnet", weights="none", image_size=16, no_progress=True)]
    args += flags(num_workers=0, batch_size=8, epochs=2, augment="flip-crop", save_every_steps=25, keep_last=20)
    args += flags(sampler="balanced", class_weights="auto")
    assert cli.main(["train", *args, "--output-dir", str(full)]) == 0
    # Step 25 of 40: mid-epoch 1, a balanced epoch's repeats of the dogs on both sides of it.
    ckpt = "e0001-b0000005"
    shutil.copytree(full / "checkpoints" / ckpt, resumed / "checkpoints" / ckpt)
    assert cli.main(["train", *args, "--output-dir", str(resumed), "--resume", "auto"]) == 0
    assert_same_weights(final_weights(resumed), final_weights(full))
    # Another sampler on the same checkpoint: refused, in one line, before training.
    again = tmp_path / "again"
    shutil.copytree(full / "checkpoints" / ckpt, again / "checkpoints" / ckpt)
    other = [a if a != "balanced" else "random" for a in args]
    assert cli.main(["train", *other, "--output-dir", str(again), "--resume", "auto"]) == 2
