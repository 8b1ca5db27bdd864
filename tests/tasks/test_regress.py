"""Regression as a task: its loss on standardised targets, its exact metrics against sklearn, its state in
the model description, and its labels read from a manifest (one line naming the file and row when bad)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

from fuzzing import fuzz_settings
from visiontune import tasks
from visiontune.data import sources
from visiontune.data.split import split_of
from visiontune.errors import UserError
from visiontune.runs import runinfo
from visiontune.settings.config import TrainConfig
from visiontune.tasks import AUTO, reader
from visiontune.tasks.regress import Regression


def _fitted(y: np.ndarray, loss: str = "mse") -> Regression:
    return tasks.REGRESSION.configured(TrainConfig(data="d", loss=loss)).fitted(y)


def test_the_registry_names_every_task_and_reads_old_records():
    assert set(tasks.TASKS) >= {"classify", "multilabel", "regress"}
    assert tasks.get("regress") is tasks.REGRESSION
    assert tasks.recorded({"task": "regress"}) is tasks.REGRESSION
    assert tasks.recorded({"multi_label": True}) is tasks.MULTI_LABEL  # written before the task had a name
    assert tasks.recorded({}) is tasks.SINGLE_LABEL and tasks.recorded({"task": "detect"}) is None


def test_metrics_are_sklearns_in_the_targets_units_and_an_unreadable_row_counts_nowhere():
    rng = np.random.default_rng(0)
    y = rng.normal(50, 10, (40, 2))
    task = _fitted(y[:30])
    z = torch.tensor(rng.normal(0, 1, (40, 2)))
    labels = torch.tensor(y, dtype=torch.float32)
    labels[7] = float("nan")  # an unreadable image
    got = task.ranking(z, labels)
    ok = np.arange(40) != 7
    pred = z.numpy() * np.std(y[:30], 0) + np.mean(y[:30], 0)
    true = labels.double().numpy()
    assert got["mae"] == pytest.approx(mean_absolute_error(true[ok], pred[ok]), rel=1e-6)
    assert got["rmse"] == pytest.approx(math.sqrt(mean_squared_error(true[ok], pred[ok])), rel=1e-6)
    assert got["r2"] == pytest.approx(r2_score(true[ok], pred[ok]), rel=1e-6)
    hits = task.hits(z.float(), labels)
    assert hits[7] == 0 and hits.sum().item() / 39 == pytest.approx(got["mae"], rel=1e-5)
    assert task.readable(labels).tolist() == ok.tolist()


@pytest.mark.parametrize("loss", ["mse", "l1", "huber"])
def test_the_loss_is_on_the_standardised_targets_over_the_readable_rows(loss):
    y = np.array([[0.0], [10.0], [20.0], [30.0]])
    task = _fitted(y, loss)
    out = torch.tensor([[0.5], [-0.2], [1.0], [3.0]])
    labels = torch.tensor([[5.0], [10.0], [float("nan")], [30.0]])
    z = (labels - 15.0) / float(np.std(y))
    fn = {"mse": torch.nn.functional.mse_loss, "l1": torch.nn.functional.l1_loss}.get(
        loss, torch.nn.functional.huber_loss
    )
    want = fn(out[[0, 1, 3]], z[[0, 1, 3]])
    assert task.mean_loss(out, labels).item() == pytest.approx(want.item(), rel=1e-6)
    assert task.eval_loss(out, labels)[2] == 0


def test_the_model_description_carries_the_target_scale_and_a_damaged_one_is_one_line():
    task = _fitted(np.array([[1.0, 100.0], [3.0, 300.0]]))
    info = runinfo.describe(
        "resnet18", "torchvision", ["age", "score"], 32, (0.5,) * 3, (0.25,) * 3, "bilinear", None, task
    )
    back = runinfo.RunInfo.from_dict(json.loads(info.metadata()[runinfo.KEY]), "m.safetensors")
    assert back.task.mean == [2.0, 200.0] and back.task.std == [1.0, 100.0] and back.task_name == "regress"
    out = torch.tensor([[1.5, -0.5]])
    assert back.task.probabilities(out).tolist() == [[3.5, 150.0]]
    assert back.task.logits_of(back.task.probabilities(out)).tolist()[0] == pytest.approx([1.5, -0.5])
    for bad in ({"mean": [1.0], "std": [0.0]}, {"mean": "x"}, {"mean": [1.0, 2.0], "std": [1.0]}):
        with pytest.raises(UserError) as e:
            runinfo.RunInfo.from_dict({**info.to_dict(), "task_state": bad}, "m.safetensors")
        assert "m.safetensors: damaged model description" in str(e.value) and "\n" not in str(e.value)


def _manifest(tmp_path, rows: list[str]) -> str:
    (tmp_path / "train").mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (tmp_path / "train" / name).write_bytes(b"")
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    return str(tmp_path)


def test_a_manifest_of_several_targets_reads_their_names_and_numbers(tmp_path):
    found = sources.discover(
        _manifest(tmp_path, ["filename,age,score", "a.png,3,0.5", "b.png,4,1e2"]), task=reader("regress")
    )
    assert found.task == "regress" and found.classes == ["age", "score"]
    assert found.targets.tolist() == [[3.0, 0.5], [4.0, 100.0]] and found.label_array.dtype == np.float32


def test_a_regression_manifest_read_without_task_regress_says_to_ask_for_it(tmp_path):
    with pytest.raises(UserError) as e:
        sources.discover(_manifest(tmp_path, ["filename,value", "a.png,1", "b.png,2"]), task=AUTO)
    assert "row 1: header 'filename,value' names no label column" in str(e.value) and "--task regress" in str(e.value)


@pytest.mark.parametrize(
    "row, said",
    [("b.png,nan", "'nan', not a finite number"), ("b.png,", "target empty"), ("b.png,ten", "'ten', not a finite")],
)
def test_a_bad_target_is_one_line_naming_the_file_and_row(tmp_path, row, said):
    with pytest.raises(UserError) as e:
        sources.discover(_manifest(tmp_path, ["filename,value", "a.png,1", row]), task=reader("regress"))
    assert "train.csv row 3 (b.png)" in str(e.value) and said in str(e.value) and "\n" not in str(e.value)


def test_the_split_holds_out_each_quantile_bin_of_the_target(tmp_path):
    from visiontune.data.imageset import ImageSet

    values = np.arange(100, dtype=np.float32)
    paths = [f"/r/{i}.png" for i in range(100)]
    images = ImageSet("/r", "manifest", paths, np.zeros(100), ["v"], targets=values, reading=tasks.REGRESSION)
    split = split_of(images, 0.2, seed=3)
    assert len(split.val) == 20 and "quantile" in split.method
    # two val images in each tenth of the range: the val split spans it as the train split does
    assert np.bincount(values[split.val].astype(int) // 10, minlength=10).tolist() == [2] * 10


def test_an_exported_file_is_scored_by_the_share_of_values_within_a_tenth_of_a_std():
    task = _fitted(np.array([[0.0, 0.0], [10.0, 100.0]]))  # std 5 and 50: tolerances 0.5 and 5
    out = np.array([[1.0, 4.0], [10.4, 106.0]])
    assert task.right(out, np.array([[0.0, 0.0], [10.0, 100.0]]), None) == (2, 4)


def test_settings_a_regression_has_no_use_for_are_refused_in_one_line():
    task = tasks.REGRESSION
    assert "--cutmix" in task.refusal(TrainConfig(data="d", cutmix=1.0))
    assert "--label-smoothing" in task.refusal(TrainConfig(data="d", label_smoothing=0.1))
    assert task.refusal(TrainConfig(data="d", mixup=0.2)) is None  # mixup mixes the targets
    assert "--loss l1 is a regression loss" in tasks.SINGLE_LABEL.refusal(TrainConfig(data="d", loss="l1"))


JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@fuzz_settings(200)
@given(
    st.dictionaries(st.sampled_from(["mean", "std", "loss", "x"]), JSON, max_size=4),
    st.sampled_from(["regress", "classify", ["regress"], None, 3]),
)
def test_fuzz_any_task_and_task_state_give_a_described_model_or_one_line(state, task):
    """A model file's ``task`` and ``task_state`` are untrusted: a description whose task answers in
    finite numbers of the right count, or one line naming the file."""
    info = runinfo.describe("resnet18", "torchvision", ["a", "b"], 32, (0.5,) * 3, (0.25,) * 3, "bilinear")
    try:
        back = runinfo.RunInfo.from_dict({**info.to_dict(), "task": task, "task_state": state}, "m.safetensors")
    except UserError as e:
        assert str(e).startswith("m.safetensors: ") and "\n" not in str(e)
        return
    values = back.task.probabilities(torch.zeros(1, 2))
    assert values.shape == (1, 2) and torch.isfinite(values).all()


def test_an_hf_numeric_column_is_a_regression_target_and_a_missing_value_is_one_line(tmp_path):
    import io

    import datasets
    from PIL import Image as PILImage

    def png(v: int) -> bytes:
        buf = io.BytesIO()
        PILImage.fromarray(np.full((8, 8, 3), v, np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    features = datasets.Features({"img": datasets.Image(), "age": datasets.Value("float32")})
    rows = {"img": [{"bytes": png(i), "path": None} for i in range(4)], "age": [1.5, 2.0, None, 4.0]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(UserError) as e:
        sources.discover(f"hf:{tmp_path / 'bad'}", label_column="age", task=reader("regress"))
    assert "row 2: column 'age' holds 'None', not a finite number" in str(e.value) and "\n" not in str(e.value)
    rows["age"][2] = 3.0
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ok"))
    found = sources.discover(f"hf:{tmp_path / 'ok'}", label_column="age", task=reader("regress"))
    assert found.task == "regress" and found.classes == ["age"] and found.targets[:, 0].tolist() == [1.5, 2, 3, 4]


def test_the_map_back_folds_into_the_last_layer_exactly_and_is_applied_once():
    """``folded_into``: the Linear head then gives the values themselves (float64 fold, float32 weights); the
    folded task's state says so, and a model described by it is read with no map again."""
    task = tasks.REGRESSION.fitted(np.array([[10.0, -3.0], [30.0, 5.0], [20.0, 1.0]]))
    head = torch.nn.Linear(4, 2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = task.values(head(x))
        folded_head = torch.nn.Linear(4, 2)
        folded_head.load_state_dict(head.state_dict())
        folded = task.folded_into(folded_head)
        got = folded_head(x).double()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert folded.state() == {**task.state(), "folded": True}
    back = tasks.REGRESSION.restored(folded.state(), 2)
    assert back.values(got).tolist() == got.tolist() and isinstance(back.activation(), torch.nn.Identity)
    assert tasks.SINGLE_LABEL.folded_into(torch.nn.Linear(4, 2)) is None  # a classifier keeps its logits
    with pytest.raises(TypeError, match="not a Linear layer"):
        task.folded_into(torch.nn.Identity())
    with pytest.raises(ValueError, match="folded"):
        tasks.REGRESSION.restored({**task.state(), "folded": "yes"}, 2)
