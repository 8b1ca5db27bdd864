"""timm models through the whole command line, and runs that start from earlier weights.

Three timm families (a convnet, a transformer, a model whose classifier is not
``fc``) train at 32 px with ``--weights none``; their ``best.safetensors`` then
drives ``predict`` on its own (the file says model, classes, size and
normalisation), and the predictions are compared with a forward pass computed
here with timm and the textbook preprocessing. The exported file is run back
and compared with the same reference. Then a run continues an earlier one on
new data (same classes: every weight carries over; new classes: the body does,
the head is new and named), and a local ImageNet-headed checkpoint starts a run.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from torchvision.io import decode_image

from trained import one_thread, preprocess  # noqa: F401  (one_thread: autouse)
from trainrun import flags
from visiontune.cli.commands import main
from visiontune.runs.runinfo import read_file

TINY = ["--image-size", "32", "--no-progress", "--num-workers", "0", "--epochs", "1", "--batch-size", "8"]
TOL = 1e-4


def _train(data: Path, out: Path, *extra: str) -> Path:
    assert main(["train", "--data", str(data), "--output-dir", str(out), *TINY, *extra]) == 0
    return out


@torch.no_grad()
def _reference(run: Path, arch: str, classes: int, x: torch.Tensor) -> torch.Tensor:
    model = timm.create_model(arch, num_classes=classes)
    model.load_state_dict(load_file(str(run / "best.safetensors")))
    return model.eval()(x)


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt", [("test_convnext", "onnx"), ("test_vit", "pt2"), ("test_efficientnet", "pt2")])
def test_timm_family_trains_predicts_from_its_file_alone_and_exports(arch, fmt, small_data, tmp_path):
    run = _train(small_data, tmp_path / "run", "--model", f"timm/{arch}", "--weights", "none")
    described = json.loads((run / "config.json").read_text())["model"]
    assert described["model"] == f"timm/{arch}" and described["source"] == "timm"
    assert described["classes"] == ["cat", "dog"] and described["image_size"] == 32
    assert read_file(str(run / "best.safetensors")).to_dict() == described
    files = sorted((small_data / "train").iterdir())[::7]
    assert (described["interpolation"], described["crop_pct"]) == ("bicubic", 0.95)  # test models' pretrained_cfg
    x = preprocess(files, 32, "bicubic", 0.95)
    eager = _reference(run, arch, 2, x)

    out = tmp_path / "pred.csv"
    assert (
        main(
            ["predict", *flags(weights=run / "best.safetensors", data=small_data / "train", out=out, no_progress=True)]
        )
        == 0
    )
    rows = {r["path"]: r for r in csv.DictReader(out.open())}
    got = torch.tensor([[float(rows[str(f)]["prob_cat"]), float(rows[str(f)]["prob_dog"])] for f in files])
    assert torch.allclose(got, eager.softmax(1), atol=TOL, rtol=0)

    exported = tmp_path / f"model.{fmt}"
    assert main(["export", "--run", str(run), "--format", fmt, "--out", str(exported)]) == 0
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
        back = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
    else:
        back = torch.export.load(str(exported)).module()(x)
    assert (back - eager).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def earlier(small_data, tmp_path_factory) -> Path:
    """A finished timm/test_vit run (LayerNorm only: frozen weights stay bit-exact while the head trains),
    with a centre crop other than the model's (0.95)."""
    out = tmp_path_factory.mktemp("earlier") / "run"
    return _train(small_data, out, "--model", "timm/test_vit", "--weights", "none", "--crop-pct", "0.8")


def _three_classes(small_data: Path, root: Path) -> Path:
    """New data in the class-folder layout: a, b, c."""
    files = sorted((small_data / "train").iterdir())
    for i, f in enumerate(files):
        (root / "abc"[i % 3]).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, root / "abc"[i % 3] / f.name)
    return root


@pytest.mark.slow
def test_init_from_same_classes_carries_every_weight(earlier, small_data, tmp_path, capsys):
    new_data = tmp_path / "more"
    shutil.copytree(small_data, new_data)  # "new" data with the same classes
    capsys.readouterr()
    # No --model, no --image-size: the earlier run's. A vanishing lr keeps the head where it was.
    run = _train(new_data, tmp_path / "run", "--init-from", str(earlier), "--freeze-backbone", "--lr", "1e-12")
    assert "left out" not in capsys.readouterr().out
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["model"] == "timm/test_vit" and cfg["model"]["image_size"] == 32
    assert cfg["model"]["crop_pct"] == 0.8  # the earlier run's resize too
    before, after = load_file(str(earlier / "best.safetensors")), load_file(str(run / "best.safetensors"))
    assert before.keys() == after.keys()
    for k in before:
        assert torch.allclose(before[k], after[k], atol=1e-8, rtol=0), k


@pytest.mark.slow
def test_init_from_new_classes_keeps_the_body_and_names_the_new_head(earlier, small_data, tmp_path, capsys):
    data = _three_classes(small_data, tmp_path / "abc")
    capsys.readouterr()
    run = _train(data, tmp_path / "run", "--init-from", str(earlier), "--freeze-backbone")
    said = capsys.readouterr().out
    assert (
        f"{earlier}/best.safetensors: its head does not fit these classes; re-initialised, "
        "left out: head.bias, head.weight"
        in said
        and said.count("left out") == 1
    )
    before, after = load_file(str(earlier / "best.safetensors")), load_file(str(run / "best.safetensors"))
    assert after["head.weight"].shape == (3, before["head.weight"].shape[1])
    for k in before:
        if not k.startswith("head."):
            assert torch.equal(before[k], after[k]), k  # frozen, so exactly the earlier run's
    assert read_file(str(run / "best.safetensors")).classes == ("a", "b", "c")


@pytest.mark.slow
def test_imagenet_headed_local_checkpoint_starts_a_run(small_data, tmp_path, capsys):
    ckpt = tmp_path / "imagenet.safetensors"
    save_file(timm.create_model("test_efficientnet", num_classes=1000).state_dict(), str(ckpt))
    run = _train(small_data, tmp_path / "run", "--model", "timm/test_efficientnet", "--weights", str(ckpt))
    assert "left out: classifier.bias, classifier.weight" in capsys.readouterr().out
    assert load_file(str(run / "best.safetensors"))["classifier.weight"].shape[0] == 2


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda p: p.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":'), "cannot load weights from"),
        (
            lambda p: save_file(timm.create_model("test_vit", num_classes=2).state_dict(), str(p)),
            "does not fit this model",
        ),  # another architecture's weights
    ],
)
def test_broken_or_foreign_checkpoint_is_one_line(make, msg, small_data, tmp_path, capsys):
    ckpt = tmp_path / "w.safetensors"
    make(ckpt)
    code = main(
        [
            "train",
            *flags(data=small_data, output_dir=tmp_path / "run"),
            *TINY,
            *flags(model="timm/test_convnext", weights=ckpt),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.distributed
def test_timm_under_ddp_saves_a_self_describing_model_counts_val_once_and_equals_one_process(
    small_data, tmp_path, worker_env
):
    """A timm model (bicubic, crop 0.95) trained by two gloo processes: its best.safetensors builds back from
    its metadata alone, and the val metrics are those of the saved model over each val image once. ConvNeXt
    has neither BatchNorm (SyncBatchNorm does not run on the CPU) nor dropout, so DDP with batch b computes
    what one process computes with batch 2b: the same weights, beside it in this process."""
    from trained import hand_resize
    from trainrun import env_for, relative_difference, train_ddp_beside_one
    from visiontune.inference.loaded import load_model

    # 40 images: 30 train (5 global batches of 6, none partial) and 10 val (the last batch of 2 x 3 padded).
    batch = 3
    common = [*flags(data=small_data, model="timm/test_convnext", weights="none", val_fraction=0.25), *TINY]
    # DDP asks for its lr through --scale-lr (0.005 x 6 / 3), the single run states it: equal weights then
    # also prove that the scaled lr is the one the optimizer used.
    ddp = flags(strategy="ddp", nproc=2, batch_size=batch, lr=0.005, scale_lr=True, reference_batch=batch)
    train_ddp_beside_one(common, ddp, flags(batch_size=2 * batch, lr=0.01), tmp_path, env_for(worker_env, tmp_path))
    run = tmp_path / "ddp"
    summary = json.loads((run / "summary.json").read_text())
    val = json.loads((run / "split.json").read_text())["val"]
    assert summary["world_size"] == 2 and len(val) % (2 * batch) != 0  # the last val batch is padded
    assert summary["val_images_counted"] == summary["val_split_size"] == len(val)
    steps = [
        [h["train"]["images"] for h in json.loads((tmp_path / d / "history.json").read_text())] for d in ("ddp", "one")
    ]
    assert steps == [[30], [30]]
    # One epoch: best is the final model.
    assert relative_difference(*(load_file(str(tmp_path / d / "best.safetensors")) for d in ("ddp", "one"))) < 1e-5

    loaded = load_model(weights=str(run / "best.safetensors"))  # nothing but the file
    info = loaded.info
    assert (info.model, info.classes, info.image_size) == ("timm/test_convnext", ("cat", "dog"), 32)
    assert (info.interpolation, info.crop_pct) == ("bicubic", 0.95)
    saved = load_file(str(run / "best.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in loaded.model.state_dict().items())

    model = timm.create_model("test_convnext", num_classes=2)
    model.load_state_dict(saved)
    mean, std = torch.tensor(info.mean).view(3, 1, 1), torch.tensor(info.std).view(3, 1, 1)
    images = [hand_resize(decode_image(str(small_data / f)), 32, "bicubic", 0.95) for f in val]
    x = torch.stack([(img.float() / 255 - mean) / std for img in images])
    y = torch.tensor([info.classes.index(Path(f).name.split(".")[0]) for f in val])
    with torch.no_grad():
        logits = model.eval()(x)
    assert summary["best_val_accuracy"] == pytest.approx((logits.argmax(1) == y).float().mean().item(), abs=1e-9)
    assert summary["best_val_loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), abs=1e-4)
