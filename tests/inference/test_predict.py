"""visiontune predict: Kaggle submission format, agreement with an independent forward pass,
input order, --nproc 2 byte-identical, unreadable files reported, loading without unpickling."""

from __future__ import annotations

import csv
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import trainrun
from trained import one_thread, preprocess, reference_model, reference_probs  # noqa: F401  (one_thread: autouse fixture)
from trainrun import PYTHON, flags
from visiontune.cli.commands import main

TOL = 1e-5


@pytest.fixture(scope="module")
def run(trained_run, sample_data, tmp_path_factory) -> Path:
    """The shared trained run (one training for the predict, evaluate and export tests) with its head set
    by the test: P(dog) over test/ then spreads evenly, logits -4 to 4 along the features' main direction.

    What a tiny training reaches moves with the machine: one run gave P(dog) within 1e-5 of 0 or 1 for
    every test image, so the clip fixture's EPS rounded to 0 and nothing was clipped.
    """
    out = shutil.copytree(trained_run, tmp_path_factory.mktemp("spread") / "run")
    model = reference_model(out)
    head, model.fc = model.fc, torch.nn.Identity()
    with torch.no_grad():
        features = model(preprocess(sorted((sample_data / "test").iterdir()))).double()
    centre = features.mean(0)
    direction = torch.linalg.svd(features - centre, full_matrices=False).Vh[0]
    along = (features - centre) @ direction
    scale = 8 / (along.max() - along.min())
    weight, bias = torch.zeros_like(head.weight, dtype=torch.float64), torch.zeros_like(head.bias, dtype=torch.float64)
    weight[1] = scale * direction  # P(dog) = sigmoid(logit_dog - logit_cat), logit_cat = 0
    bias[1] = -4 - scale * along.min() - scale * (centre @ direction)
    with safe_open(str(out / "best.safetensors"), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors.update({"fc.weight": weight.float(), "fc.bias": bias.float()})
    save_file(tensors, str(out / "best.safetensors"), metadata=metadata)
    p = reference_probs(out, sorted((sample_data / "test").iterdir()))[:, 1]
    assert p.min() < 0.03 and p.max() > 0.97 and len(set(p.tolist())) == len(p)  # the head the test chose
    return out


@pytest.fixture(scope="module")
def corrupt_test(tmp_path_factory, sample_data) -> Path:
    """A copy of the Kaggle test/ folder whose 7.jpg is not an image."""
    out = tmp_path_factory.mktemp("corrupt") / "test"
    shutil.copytree(sample_data / "test", out)
    (out / "7.jpg").write_bytes(b"this is not a JPEG" * 10)
    return out


def read_submission(path: Path) -> tuple[list[str], list[int], list[float]]:
    rows = list(csv.reader(path.open()))
    return rows[0], [int(r[0]) for r in rows[1:]], [float(r[1]) for r in rows[1:]]


@pytest.mark.slow
def test_a_run_from_an_earlier_version_still_predicts(run, sample_data, tmp_path):
    # Its config.json holds settings in the forms they had then: --augment a switch, --nnodes a count.
    old = shutil.copytree(run, tmp_path / "old")
    record = json.loads((old / "config.json").read_text())
    record["config"].update(augment=True, nnodes=1)
    (old / "config.json").write_text(json.dumps(record))
    outs = [tmp_path / "new.csv", tmp_path / "old.csv"]
    for folder, out in zip((run, old), outs):
        assert main(["predict", *flags(run=folder, data=sample_data / "test", out=out, no_progress=True)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()


@pytest.mark.slow
def test_kaggle_submission_is_p_dog_in_numeric_id_order(run, sample_data, tmp_path):
    out = tmp_path / "submission.csv"
    assert (
        main(["predict", "--run", str(run), "--data", str(sample_data / "test"), "--out", str(out), "--no-progress"])
        == 0
    )
    header, ids, labels = read_submission(out)
    n = len(list((sample_data / "test").iterdir()))
    assert header == ["id", "label"]
    assert ids == list(range(1, n + 1))  # 1, 2, ..., 10, not 1, 10, 11, ...
    assert all(0.0 <= p <= 1.0 for p in labels)
    ref = reference_probs(run, [sample_data / "test" / f"{i}.jpg" for i in ids])[:, 1]  # classes: cat, dog
    assert torch.allclose(torch.tensor(labels, dtype=torch.float32), ref, atol=TOL, rtol=0)
    assert not Path(f"{out}.skipped.txt").exists()


@pytest.fixture(scope="module")
def clip(run, sample_data) -> float:
    """An EPS that clamps about half of this model's P(dog) values, so the clip is exercised."""
    p = reference_probs(run, sorted((sample_data / "test").iterdir()))[:, 1]
    return round(torch.minimum(p, 1 - p).median().item(), 4)


@pytest.fixture(scope="module")
def clipped_single(run, corrupt_test, clip, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "submission.csv"
    rc = main(["predict", *flags(run=run, data=corrupt_test, out=out, clip=clip, no_progress=True)])
    return rc, out


@pytest.mark.slow
def test_unreadable_image_is_reported_and_the_rest_predicted_and_clipped(run, corrupt_test, clip, clipped_single):
    rc, out = clipped_single
    assert rc == 1
    bad = str(corrupt_test / "7.jpg")
    assert Path(f"{out}.skipped.txt").read_text() == f"{bad}\tnot an image\n"
    _, ids, labels = read_submission(out)
    assert ids == list(range(1, 31))
    assert labels[6] == 0.5
    good = [i for i in ids if i != 7]
    ref = reference_probs(run, [corrupt_test / f"{i}.jpg" for i in good])[:, 1]
    got = torch.tensor([p for i, p in zip(ids, labels) if i != 7])
    assert torch.allclose(got, ref.clamp(clip, 1 - clip), atol=TOL, rtol=0)
    assert all(clip <= p <= 1 - clip for p in labels)
    assert ((ref < clip) | (ref > 1 - clip)).sum() >= 5  # rows the clip changed


@pytest.mark.slow
def test_threshold_on_a_model_that_picks_one_class_is_one_line_and_writes_nothing(run, sample_data, tmp_path, capsys):
    out = tmp_path / "p.csv"
    assert main(["predict", *flags(run=run, data=sample_data / "test", out=out, threshold=0.5, no_progress=True)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["visiontune: error: --threshold is for multi-label models; this one picks the most probable class"]
    assert not out.exists()


@pytest.mark.slow
def test_unreadable_image_is_named_on_stderr(run, corrupt_test, tmp_path, capsys):
    assert main(["predict", *flags(run=run, data=corrupt_test, out=tmp_path / "s.csv", no_progress=True)]) == 1
    assert f"{corrupt_test / '7.jpg'}: not an image" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_write_the_same_bytes(run, corrupt_test, clip, clipped_single, tmp_path, worker_env):
    _, single = clipped_single
    out = tmp_path / "submission.csv"
    # The run's batch of 8 over 30 files: the second process's batch is ragged and Accelerate pads it.
    argv = ["predict", *flags(run=run, data=corrupt_test, out=out, clip=clip, no_progress=True, nproc=2)]
    done = trainrun.run([PYTHON, "-m", "visiontune", *argv], worker_env)  # the command, forked where it can be
    assert done.returncode == 1, done.stderr[-3000:]  # the skipped file, reported by the launching process
    assert out.read_bytes() == single.read_bytes()
    assert Path(f"{out}.skipped.txt").read_bytes() == Path(f"{single}.skipped.txt").read_bytes()
    assert done.stderr.count("skipped unreadable image") == 1  # the main process reports once


@pytest.mark.slow
def test_file_list_keeps_input_order_and_weights_file_gives_same_output(run, sample_data, tmp_path):
    train = sorted((sample_data / "train").iterdir())
    paths = [train[i] for i in (50, 3, 100, 7, 61, 0, 119, 64)]  # cats and dogs, out of order
    listing = tmp_path / "list.txt"
    listing.write_text("# images to classify\n" + "\n".join(map(str, paths)) + "\n\n")
    out = tmp_path / "pred.csv"
    assert main(["predict", *flags(run=run, data=listing, out=out, no_progress=True, batch_size=3)]) == 0
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["path", "prediction", "prob_cat", "prob_dog"]
    assert [r[0] for r in rows[1:]] == [str(p) for p in paths]
    ref = reference_probs(run, paths)
    got = torch.tensor([[float(r[2]), float(r[3])] for r in rows[1:]])
    assert torch.allclose(got, ref, atol=TOL, rtol=0)
    assert [r[1] for r in rows[1:]] == [("cat", "dog")[int(i)] for i in ref.argmax(1)]
    # The same model from best.safetensors alone: it says what model, classes, size and normalisation it needs.
    out3 = tmp_path / "pred3.csv"
    assert (
        main(
            [
                "predict",
                *flags(weights=run / "best.safetensors", data=listing, out=out3, no_progress=True, batch_size=3),
            ]
        )
        == 0
    )
    assert out3.read_bytes() == out.read_bytes()
    # The same model from a state_dict file and flags instead of the run folder: the run's safetensors
    # and a .pth of it (read with weights_only=True; runs write one only with --save-pth).
    pth = tmp_path / "best.pth"
    torch.save(load_file(str(run / "best.safetensors")), pth)
    for weights in (run / "best.safetensors", pth):
        out2 = tmp_path / f"pred-{weights.suffix[1:]}.csv"
        assert (
            main(
                [
                    "predict",
                    *flags(
                        weights=weights,
                        model="resnet18",
                        classes="cat,dog",
                        image_size=32,
                        data=listing,
                        out=out2,
                        no_progress=True,
                        batch_size=3,
                    ),
                ]
            )
            == 0
        )
        assert out2.read_bytes() == out.read_bytes()


class _Payload:
    """Unpickling this creates a file: proof that a loader unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.slow
def test_loading_never_unpickles(run, sample_data, tmp_path, capsys):
    marker = tmp_path / "unpickled"
    evil = tmp_path / "evil_run"
    shutil.copytree(run, evil)
    with open(evil / "best.pth", "wb") as f:
        pickle.dump({"fc.weight": _Payload(marker)}, f)
    out = tmp_path / "s.csv"
    # The run folder loads from best.safetensors; the poisoned best.pth is never read.
    assert (
        main(["predict", "--run", str(evil), "--data", str(sample_data / "test"), "--out", str(out), "--no-progress"])
        == 0
    )
    (evil / "best.safetensors").unlink()
    for argv in (
        ["--run", str(evil)],
        ["--weights", str(evil / "best.pth"), "--model", "resnet18", "--classes", "cat,dog"],
    ):
        assert (
            main(["predict", *argv, *flags(data=sample_data / "test", out=tmp_path / "x.csv", no_progress=True)]) == 2
        )
        assert "cannot load weights" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "x.csv").exists()


@pytest.mark.slow
def test_mixed_precision_bf16_stays_close(run, sample_data, tmp_path):
    out32, out16 = tmp_path / "fp32.csv", tmp_path / "bf16.csv"
    data = ["--data", str(sample_data / "test"), "--no-progress", "--run", str(run)]
    assert main(["predict", *data, "--out", str(out32)]) == 0
    AcceleratorState._reset_state()  # one process, two precisions: Accelerate keeps the first otherwise
    try:
        assert main(["predict", *data, "--out", str(out16), "--mixed-precision", "bf16"]) == 0
    finally:
        AcceleratorState._reset_state()
    p32, p16 = (torch.tensor(read_submission(o)[2]) for o in (out32, out16))
    assert torch.allclose(p16, p32, atol=0.05) and not torch.equal(p16, p32)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "{test}"], "give --run RUN_DIR"),
        (["--run", "{run}", "--weights", "{run}/best.pth", "--data", "{test}"], "not both"),
        (["--weights", "{run}/best.pth", "--data", "{test}"], "give --model NAME and --classes a,b"),
        (
            ["--weights", "{run}/best.safetensors", "--image-size", "64", "--data", "{test}"],
            "--image-size 64 contradicts {run}/best.safetensors, which says image size 32",
        ),
        (
            ["--weights", "{run}/best.safetensors", "--classes", "dog,cat", "--data", "{test}"],
            "--classes dog,cat contradicts {run}/best.safetensors, which says classes cat,dog",
        ),
        (
            ["--weights", "{run}/best.safetensors", "--model", "resnet34", "--data", "{test}"],
            "--model resnet34 contradicts {run}/best.safetensors, which says model resnet18",
        ),
        (["--run", "{run}", "--data", "{empty}"], "no images"),
        (["--run", "{run}", "--data", "{test}", "--clip", "0.5"], "--clip must be in"),
        (["--run", "{empty}", "--data", "{test}"], "not a visiontune run folder"),
        pytest.param(
            ["--run", "{run}", "--data", "{test}", "--mixed-precision", "fp16"],
            "use --mixed-precision bf16",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused on a CPU only"),
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(run, sample_data, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    fill = {"test": sample_data / "test", "run": run, "empty": tmp_path / "empty"}
    out = tmp_path / "out.csv"
    assert main(["predict", *(a.format(**fill) for a in argv), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow
def test_tta_flip_is_the_mean_of_the_plain_and_mirrored_passes(run, sample_data, tmp_path):
    from trained import preprocess, reference_model

    files = sorted((sample_data / "train").glob("*.jpg"))[::10]
    out = tmp_path / "p.csv"
    assert main(["predict", *flags(run=run, data=sample_data / "train", out=out, tta="flip", no_progress=True)]) == 0
    rows = {r["path"]: [float(r["prob_cat"]), float(r["prob_dog"])] for r in csv.DictReader(out.open())}
    with torch.no_grad():
        x, model = preprocess(files), reference_model(run)
        want = (model(x).softmax(1) + model(x.flip(-1)).softmax(1)) / 2
    got = torch.tensor([rows[str(f)] for f in files])
    assert torch.allclose(got, want, atol=TOL)
    assert not torch.allclose(got, reference_probs(run, files), atol=1e-3)  # the flip changed something


@pytest.mark.slow
def test_a_listed_file_name_that_is_not_utf8_is_predicted_and_written_back_as_its_bytes(run, sample_data, tmp_path):
    named = os.fsencode(tmp_path) + b"/caf\xe9 \xff.jpg"  # Latin-1 and a stray byte: a name Linux allows
    shutil.copyfile(sample_data / "test" / "3.jpg", named)
    listed = tmp_path / "list.txt"
    listed.write_bytes(named + b"\n" + os.fsencode(sample_data / "test" / "1.jpg") + b"\n")
    out = tmp_path / "p.csv"
    assert main(["predict", *flags(run=run, data=listed, out=out, no_progress=True)]) == 0
    rows = out.read_bytes().splitlines()[1:]
    # Before, the bytes read as U+FFFD: no such file, listed as unreadable, and one row short.
    assert [r.split(b",")[0] for r in rows] == [named, os.fsencode(sample_data / "test" / "1.jpg")]
    with_3 = tmp_path / "p3.csv"
    assert main(["predict", *flags(run=run, out=with_3, no_progress=True), str(sample_data / "test" / "3.jpg")]) == 0
    assert rows[0].split(b",")[1:] == with_3.read_bytes().splitlines()[1].split(b",")[1:]  # the same image's row


@pytest.mark.slow
def test_images_as_arguments_and_the_csv_on_stdout_without_out(run, sample_data, tmp_path, capsys):
    images = [str(sample_data / "test" / name) for name in ("3.jpg", "1.jpg", "12.jpg")]
    listed = tmp_path / "list.txt"
    listed.write_text("\n".join(images) + "\n")
    out = tmp_path / "p.csv"
    assert main(["predict", *flags(run=run, data=listed, out=out, no_progress=True)]) == 0
    capsys.readouterr()
    assert main(["predict", "--run", str(run), *images, "--no-progress"]) == 0
    said = capsys.readouterr()
    assert said.out == out.read_text()  # the same rows, in the order given, and nothing else on stdout
    assert [r[0] for r in csv.reader(said.out.splitlines()[1:])] == images
    assert said.err.strip() == "visiontune: predicted 3 of 3 images"
    assert main(["predict", "--run", str(run), "--no-progress"]) == 2  # nothing to predict: one line
    assert "IMAGE... or --data" in capsys.readouterr().err
