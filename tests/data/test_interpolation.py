"""The model's resize -- interpolation and timm's centre crop -- reaches every image a run touches.

Each check compares visiontune's pixels or probabilities with a pipeline built here from
torchvision's own ``transforms.v2`` (decode, resize or resize + centre crop, normalise), and with
the bilinear one, which must differ: so a bilinear resize where bicubic was asked for fails.
Files whose description predates the field load as bilinear squashes, as they were made.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from safetensors.torch import save_file
from torchvision.io import ImageReadMode, decode_image, write_png
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode

from conftest import FAST
from trained import hand_resize, one_thread  # noqa: F401  (one_thread: autouse)
from trainrun import SQUEEZENET  # a torchvision model (squashed by default), smaller than resnet18
from visiontune.cli.commands import main
from visiontune.loading.augment import EpochIndex, derive_seed, sample_augment, seeded
from visiontune.loading.cache import open_or_build
from visiontune.loading.pipeline import ImageDataset
from visiontune.models.build import input_view
from visiontune.runs import runinfo, runrecords

SIZE = 24


def hand_batch(paths, size: int, interpolation: str, crop_pct: float | None, mean, std) -> torch.Tensor:
    imgs = [hand_resize(decode_image(str(p), mode=ImageReadMode.RGB), size, interpolation, crop_pct) for p in paths]
    x = torch.stack(imgs).float() / 255
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


@pytest.fixture
def noisy(tmp_path) -> list[Path]:
    """Four non-square noise PNGs: every interpolation and every crop gives other pixels."""
    g = torch.Generator().manual_seed(0)
    paths = []
    (tmp_path / "images").mkdir()
    for i, (h, w) in enumerate([(50, 70), (61, 45), (40, 40), (90, 33)]):
        paths.append(tmp_path / "images" / f"{'ab'[i % 2]}.{i}.png")
        write_png(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g), str(paths[-1]))
    return paths


def test_each_source_resizes_as_its_pretrained_config_says_unless_the_flag_does():
    assert input_view("resnet18") == ("bilinear", None)  # the reference job's squash, unchanged
    assert input_view("efficientnet_b0") == ("bicubic", None)  # torchvision's weights say bicubic
    assert input_view("timm/test_vit") == ("bicubic", 0.95)  # timm's pretrained_cfg
    assert input_view("timm/test_vit", "nearest") == ("nearest", 0.95)
    assert input_view("resnet18", "bicubic") == ("bicubic", None)


@pytest.mark.parametrize(
    "interpolation,crop_pct", [("bicubic", None), ("bicubic", 0.875), ("bilinear", 0.95), ("bicubic", 1.15)]
)
def test_a_bicubic_or_cropping_model_pipeline_resizes_so(noisy, interpolation, crop_pct):
    ds = ImageDataset([str(p) for p in noisy], [0] * 4, SIZE, interpolation=interpolation, crop_pct=crop_pct)
    for (img, _), path in zip(ds, noisy):
        decoded = decode_image(str(path), mode=ImageReadMode.RGB)
        assert torch.equal(img, hand_resize(decoded, SIZE, interpolation, crop_pct))
        if (interpolation, crop_pct) != ("bilinear", None) and decoded.shape[1:] != (40, 40):
            assert not torch.equal(img, hand_resize(decoded, SIZE, "bilinear", None))


def test_random_crops_use_the_model_interpolation(noisy):
    img = decode_image(str(noisy[0]), mode=ImageReadMode.RGB)
    aug = sample_augment("flip-crop", SIZE, seed=3, interpolation="bicubic")
    crop = v2.RandomResizedCrop(SIZE, interpolation=InterpolationMode.BICUBIC, antialias=True)
    with seeded(derive_seed(3, 1, 2)):
        expected = v2.Compose([crop, v2.RandomHorizontalFlip()])(img)
    assert torch.equal(aug(img, EpochIndex(2, 1)), expected)


def test_the_cache_is_keyed_by_the_resize(noisy, tmp_path, capsys):
    files, folder = [str(p) for p in noisy], str(tmp_path / "cache")
    bilinear = open_or_build(folder, files, SIZE, threads=1)
    bicubic = open_or_build(folder, files, SIZE, threads=1, interpolation="bicubic")
    cropped = open_or_build(folder, files, SIZE, threads=1, interpolation="bicubic", crop_pct=0.875)
    assert len({bilinear.array_path, bicubic.array_path, cropped.array_path}) == 3  # side by side
    assert capsys.readouterr().out.count("building the image cache") == 3
    assert open_or_build(folder, files, SIZE, threads=1).array_path == bilinear.array_path
    assert open_or_build(folder, files, SIZE, threads=1, interpolation="bicubic") == bicubic
    assert "building" not in capsys.readouterr().out  # both reused, neither rebuilt
    for cache, (mode, crop) in (
        (bilinear, ("bilinear", None)),
        (bicubic, ("bicubic", None)),
        (cropped, ("bicubic", 0.875)),
    ):
        rows = torch.frombuffer(bytearray(Path(cache.array_path).read_bytes()), dtype=torch.uint8).view(
            4, SIZE, SIZE, 3
        )
        for row, path in zip(rows, noisy):
            want = hand_resize(decode_image(str(path), mode=ImageReadMode.RGB), SIZE, mode, crop)
            assert torch.equal(row.permute(2, 0, 1), want)


def _predict(weights: Path, data: Path, out: Path) -> torch.Tensor:
    assert main(["predict", "--weights", str(weights), "--data", str(data), "--out", str(out), "--no-progress"]) == 0
    rows = {Path(r["path"]).name: r for r in csv.DictReader(out.open())}
    return torch.tensor([[float(rows[f"{c}.{i}.png"][f"prob_{c2}"]) for c2 in "ab"] for i, c in enumerate("abab")])


@torch.no_grad()
def test_predict_resizes_as_the_file_says_and_an_old_file_is_bilinear(noisy, tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=2).eval()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    said = {}
    for name in ("bicubic", "cropped", "old"):
        info = runinfo.describe("resnet18", "torchvision", ["a", "b"], SIZE, mean, std, "bicubic")
        meta = info.to_dict()
        if name == "cropped":
            meta["crop_pct"] = 0.8
        if name == "old":  # written before the resize was applied: bicubic named, bilinear done
            del meta["crop_pct"]
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), metadata={runinfo.KEY: json.dumps(meta)})
        said[name] = runinfo.read_file(str(tmp_path / f"{name}.safetensors"))
    assert (said["old"].interpolation, said["old"].crop_pct) == ("bilinear", None)
    assert (said["cropped"].interpolation, said["cropped"].crop_pct) == ("bicubic", 0.8)

    probs = {n: _predict(tmp_path / f"{n}.safetensors", noisy[0].parent, tmp_path / f"{n}.csv") for n in said}
    hand = {
        view: model(hand_batch(noisy, SIZE, *view, mean, std)).softmax(1)
        for view in (("bicubic", None), ("bicubic", 0.8), ("bilinear", None))
    }
    assert torch.allclose(probs["bicubic"], hand["bicubic", None], atol=1e-5, rtol=0)
    assert torch.allclose(probs["cropped"], hand["bicubic", 0.8], atol=1e-5, rtol=0)
    assert torch.allclose(probs["old"], hand["bilinear", None], atol=1e-5, rtol=0)
    # The three pipelines give visibly different probabilities, so the checks above can tell them apart.
    assert (hand["bicubic", None] - hand["bilinear", None]).abs().max() > 1e-3
    assert (hand["bicubic", 0.8] - hand["bicubic", None]).abs().max() > 1e-3


def test_an_old_run_folder_without_the_field_is_bilinear(tmp_path):
    info = runinfo.describe("resnet18", "torchvision", ["a", "b"], 32, (0.5,) * 3, (0.5,) * 3, "bilinear")
    old = {k: v for k, v in info.to_dict().items() if k not in ("interpolation", "crop_pct")}
    (tmp_path / "config.json").write_text(json.dumps({"config": {"model": "resnet18"}, "model": old}))
    (tmp_path / "classes.json").write_text(json.dumps(["a", "b"]))
    assert runrecords.read_run(str(tmp_path)) == info


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag,interpolation,crop,decode,suffix",
    [
        (["--interpolation", "bicubic"], "bicubic", None, "exact", "px-bicubic.u8"),
        (["--crop-pct", "0.5"], "bilinear", 0.5, "exact", "px-crop0.5.u8"),
        (["--decode", "fast"], "bilinear", None, "fast", "px-fast.u8"),
    ],
    ids=["interpolation", "crop-pct", "decode"],
)
def test_the_resize_flags_reach_the_cache_the_loaders_and_the_record(
    small_data, tmp_path, flag, interpolation, crop, decode, suffix
):
    run, cache = tmp_path / "run", tmp_path / "cache"
    argv = ["train", "--data", str(small_data), "--output-dir", str(run), *SQUEEZENET, "--epochs", "1"]
    argv += ["--batch-size", "16", "--num-workers", "0", *flag, "--cache", str(cache)]
    assert main(argv) == 0
    record = json.loads((run / "config.json").read_text())
    assert record["config"]["interpolation"] == record["model"]["interpolation"] == interpolation
    assert record["config"]["crop_pct"] == record["model"]["crop_pct"] == crop  # a torchvision model: squash by default
    assert record["config"]["decode"] == record["model"]["decode"] == decode
    described = runinfo.read_file(str(run / "best.safetensors"))
    assert (described.interpolation, described.crop_pct, described.decode) == (interpolation, crop, decode)
    [array] = cache.glob("*.u8")
    assert array.name.endswith(suffix)
    files = json.loads((run / "split.json").read_text())
    listed = sorted(small_data.rglob("*.jpg"))
    rows = torch.frombuffer(bytearray(array.read_bytes()), dtype=torch.uint8).view(-1, 32, 32, 3)
    assert len(rows) == len(listed) == len(files["train"]) + len(files["val"])
    want = [hand_resize(decoded(p, 32, decode), 32, interpolation, crop) for p in listed]
    assert {r.permute(2, 0, 1).contiguous().numpy().tobytes() for r in rows} == {w.numpy().tobytes() for w in want}


def decoded(path: Path, size: int, decode: str) -> torch.Tensor:
    """The full decode, or (fast) PIL's own DCT-scaled one for a size x size request."""
    if decode == "exact":
        return decode_image(str(path), mode=ImageReadMode.RGB)
    with Image.open(path) as im:
        im.draft("RGB", (size, size))
        return torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)


def test_a_crop_pct_out_of_range_is_one_line(sample_data, capsys):
    assert main(["train", "--data", str(sample_data), *FAST, "--crop-pct", "1.5"]) == 2
    assert "--crop-pct must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_an_unknown_interpolation_is_one_line(sample_data, capsys):
    assert main(["train", "--data", str(sample_data), *FAST, "--interpolation", "lanczos"]) == 2
    err = capsys.readouterr().err
    assert "--interpolation" in err and "lanczos" in err and "Traceback" not in err
