"""The `visiontune` command imports torchvision without torch._dynamo (visiontune.imports); dynamo is imported,
and works, where something needs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PYTHON
from visiontune import imports


def test_the_stand_ins_are_only_for_a_checked_torchvision_release_and_only_while_dynamo_is_not_imported(
    monkeypatch,
):
    import torch._dynamo  # noqa: F401 (the real one, as torch imports it)
    import torchvision.tv_tensors  # noqa: F401

    finder = imports._Finder()
    assert finder.find_spec("torchvision.tv_tensors", None) is None  # the real dynamo is imported
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # as at a command's start
    for name in imports._MODULES:
        spec = finder.find_spec(name, sys.modules[name.rpartition(".")[0]].__path__)
        assert isinstance(spec.loader, imports._Loader) and spec.name == name
    assert finder.find_spec("torchvision.ops.roi_pool", None) is None  # another module: as it comes
    monkeypatch.setattr(imports, "TESTED", ("9.",))
    assert imports._Finder().find_spec("torchvision.tv_tensors", None) is None  # a release it was not checked on
    # A program that imports visiontune keeps its imports: only the command installs the finder.
    assert not any(isinstance(f, imports._Finder) for f in sys.meta_path)
    imports.defer_dynamo()  # and not where torchvision is imported already
    assert not any(isinstance(f, imports._Finder) for f in sys.meta_path)


def test_each_stand_in_does_what_dynamos_own_does_from_its_first_call():
    import torch._dynamo

    for device in ("cpu", "cuda"):
        assert imports._is_compile_supported(device) == torch._dynamo.utils.is_compile_supported(device)

    def double(x):
        return 2 * x

    for disabled in (imports._disable(double), imports._disable(recursive=False)(double)):
        assert disabled.__name__ == "double" and disabled(21) == 42 and disabled(1) == 2


@pytest.mark.slow
def test_the_command_forks_its_cache_builder_before_dynamo_is_imported_and_torchvision_works_after(
    sample_data, tmp_path
):
    """The `visiontune` command's train: torchvision imported without dynamo, the image cache's builder forked,
    and dynamo imported meanwhile, which the optimizer needs; after the run, torchvision's modules that were
    imported with the stand-ins work as ever, with the real dynamo."""
    probe = r"""
import atexit, os, sys
forks, fork = [], os.fork
os.fork = lambda: forks.append("torch._dynamo" in sys.modules) or fork()

def after():
    import torch, torchvision.transforms.v2 as T
    from torchvision import ops, tv_tensors
    out = ops.roi_align(torch.full((1, 1, 8, 8), 3.0), torch.tensor([[0, 0.0, 0.0, 7.0, 7.0]]), output_size=2)
    assert torch.equal(out, torch.full((1, 1, 2, 2), 3.0)), out  # a constant image's boxes average to it
    assert T.Resize(4, antialias=True)(torch.zeros(3, 8, 8, dtype=torch.uint8)).shape == (3, 4, 4)
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[0, 0, 4, 4]]), format="XYXY", canvas_size=(8, 8))
    wrapped = tv_tensors.wrap(torch.tensor([[1, 1, 2, 2]]), like=boxes)  # dynamo's disable, on its first call
    assert type(wrapped) is tv_tensors.BoundingBoxes and tuple(wrapped.canvas_size) == (8, 8)
    assert torch._dynamo is sys.modules["torch._dynamo"] and torch._dynamo.__file__, "the real module"
    print("forks made with dynamo imported", forks)

atexit.register(after)
from visiontune.cli.commands import command
sys.argv[0] = "visiontune"
command()
"""
    # A torchvision model: timm's import needs dynamo (its models use torch.compiler.disable as they are defined).
    argv = ["train", "--data", str(sample_data), "--model", "squeezenet1_1", "--weights", "none", "--image-size"]
    argv += ["32", "--batch-size", "8", "--epochs", "1", "--limit-images", "40", "--no-progress"]
    argv += ["--output-dir", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "VISIONTUNE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([PYTHON, "-c", probe, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "forks made with dynamo imported [False]", done.stderr[-3000:]
    assert "building the image cache" in done.stdout and (tmp_path / "run" / "best.safetensors").exists()
