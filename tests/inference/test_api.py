"""The Python API: ``visiontune.load(run).predict(...)`` and ``.evaluate(...)`` give what the CLI gives."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from PIL import Image

import visiontune
from trained import one_thread, reference_probs  # noqa: F401  (one_thread: autouse fixture)
from trainrun import flags
from visiontune.cli import main
from visiontune.data.decode import read_image


@pytest.fixture(scope="module")
def predictor(trained_run):
    return visiontune.load(trained_run)


@pytest.mark.slow
def test_predict_on_paths_equals_the_cli_and_an_independent_forward_pass(predictor, trained_run, sample_data, tmp_path):
    paths = sorted((sample_data / "train").iterdir())[::17]  # cats and dogs
    listing, out = tmp_path / "list.txt", tmp_path / "pred.csv"
    listing.write_text("\n".join(map(str, paths)) + "\n")
    assert main(["predict", *flags(run=trained_run, data=listing, out=out, no_progress=True)]) == 0
    cli_rows = list(csv.reader(out.open()))[1:]

    got = predictor.predict(paths)
    assert predictor.classes == ["cat", "dog"]
    assert [r["label"] for r in got] == [r[1] for r in cli_rows]
    probs = _probs(got)
    assert torch.allclose(probs, torch.tensor([[float(x) for x in r[2:]] for r in cli_rows]), atol=1e-6, rtol=0)
    assert torch.allclose(probs, reference_probs(trained_run, paths), atol=1e-4, rtol=0)
    assert [r["score"] for r in got] == [max(r["probabilities"].values()) for r in got]


@pytest.mark.slow
def test_bytes_tensors_and_pil_images_predict_as_their_files(predictor, sample_data, tmp_path):
    jpeg = sorted((sample_data / "train").iterdir())[3]
    png = tmp_path / "same.png"
    Image.open(jpeg).save(png)  # lossless: PIL's pixels of the PNG are the file's pixels
    by_path = _probs(predictor.predict([jpeg, png]))
    other = _probs(predictor.predict([jpeg.read_bytes(), read_image(jpeg), Image.open(png)]))
    # The same pixels each time; only the batch around them differs (kernels may sum in another order).
    assert torch.allclose(other, by_path[[0, 0, 1]], atol=1e-6, rtol=0)
    one = predictor.predict(str(jpeg))  # one image in, one dict out
    assert one["label"] == "cat" and abs(one["probabilities"]["cat"] - by_path[0, 0].item()) < 1e-6


def _probs(rows: list[dict]) -> torch.Tensor:
    return torch.tensor([[r["probabilities"]["cat"], r["probabilities"]["dog"]] for r in rows])


@pytest.mark.slow
def test_a_model_file_alone_loads_and_unreadable_images_keep_their_slot(predictor, trained_run, sample_data):
    from_file = visiontune.load(trained_run / "best.safetensors")
    image = sorted((sample_data / "train").iterdir())[0]
    rows = from_file.predict([b"not an image", image])
    assert rows[0] == {"label": None, "score": None, "probabilities": None}
    assert torch.allclose(_probs(rows[1:]), _probs([predictor.predict(image)]), atol=1e-6, rtol=0)
    with pytest.raises(visiontune.UserError, match="cannot predict on a dict"):
        predictor.predict([{}])


@pytest.mark.slow
def test_evaluate_returns_the_report_the_cli_writes(predictor, trained_run, sample_data, tmp_path):
    out = tmp_path / "cli" / "eval.json"
    out.parent.mkdir()
    assert main(["evaluate", *flags(run=trained_run, data=sample_data, out=out, no_progress=True)]) == 0
    written = json.loads(out.read_text())
    api_out = tmp_path / "api" / "eval.json"
    api_out.parent.mkdir()
    report = predictor.evaluate(out=api_out)  # the run's own data, recorded in config.json: its val split
    assert report == json.loads(api_out.read_text())
    for key in ("accuracy", "confusion_matrix", "per_class", "scored", "split"):
        assert report[key] == written[key], key
    assert sum(map(sum, report["confusion_matrix"])) == len(json.loads((trained_run / "split.json").read_text())["val"])
    # A model file knows no run: the folder given is scored whole, the report kept in a temporary folder.
    whole = visiontune.load(trained_run / "best.safetensors").evaluate(sample_data)
    assert sum(map(sum, whole["confusion_matrix"])) == 120 and whole["split"] == "all"


@pytest.mark.parametrize(
    "image, says",
    [
        (torch.zeros(3, 0, 0, dtype=torch.uint8), "torch.uint8 [3, 0, 0]"),  # was torchvision's RuntimeError
        (torch.zeros(3, 8, 0, dtype=torch.uint8), "H, W > 0"),
        (torch.rand(3, 8, 8), "(image * 255).round().to(torch.uint8)"),  # these three were label None, no reason
        (torch.zeros(3, 8, 8, dtype=torch.int64), "torch.int64 [3, 8, 8]"),
        (torch.zeros(8, 8, 3, dtype=torch.uint8), "image.permute(2, 0, 1)"),
        (torch.zeros(1, 8, 8, dtype=torch.uint8), "[1, 8, 8]"),
    ],
)
def test_a_tensor_that_is_not_uint8_rgb_chw_is_a_value_error_saying_what_is_expected(image, says):
    """Checked before the model is touched (there is none here): a wrong argument, not an unreadable image."""
    from visiontune.inference.api import Predictor

    with pytest.raises(ValueError, match="must be uint8 \\[3, H, W\\]") as raised:
        Predictor(loaded=None).predict([torch.zeros(3, 4, 4, dtype=torch.uint8), image])
    assert says in str(raised.value) and "\n" not in str(raised.value)
