"""`visiontune models`: the names sorted by name, and `--pretrained` with the names that have weights
(and their parameter counts where the source records them), read from a per-version cache."""

from __future__ import annotations

import pytest

from visiontune.cli.commands import main
from visiontune.models import names


def test_names_are_sorted_by_name_and_those_starting_with_the_filter_come_first():
    listed = ["timm/vit_b", "resnet152", "timm/a_resnet", "resnet18", "alexnet", "timm/resnet18", "wide_resnet50"]
    assert names.matching(listed, "") == [
        "timm/a_resnet",
        "alexnet",
        "resnet152",
        "resnet18",
        "timm/resnet18",
        "timm/vit_b",
        "wide_resnet50",
    ]
    assert names.matching(listed, "RESNET") == [
        "resnet152",
        "resnet18",
        "timm/resnet18",
        "timm/a_resnet",
        "wide_resnet50",
    ]


def test_models_lists_torchvision_by_name_and_pretrained_with_the_weights_parameter_counts(
    tmp_path, capsys, monkeypatch
):
    import torchvision

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path))
    every = torchvision.models.list_models(module=torchvision.models)
    assert main(["models"]) == 0
    assert capsys.readouterr().out.splitlines() == sorted(every)  # was: by length
    with_weights = {
        n: torchvision.models.get_model_weights(n).DEFAULT.meta["num_params"]
        for n in every
        if len(torchvision.models.get_model_weights(n))
    }
    assert main(["models", "--pretrained"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(with_weights)
    for line in lines:
        name, count, unit = line.split()
        assert count == f"{with_weights[name] / 1e6:.1f}M" and unit == "parameters"
    assert "resnet18" in with_weights and f"{11_689_512 / 1e6:.1f}M" == "11.7M"
    # Read from the cache after that: no listing, no torchvision call.
    monkeypatch.setattr(names, "_listed_pretrained", lambda source: pytest.fail("listed again"))
    assert main(["models", "--pretrained", "--filter", "resnet1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["resnet101", "resnet152", "resnet18", "wide_resnet101_2"]


def test_a_filter_that_no_pretrained_name_matches_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(names, "_listed_pretrained", lambda source: [["resnet18", 11_689_512]])
    assert main(["models", "--pretrained", "--filter", "vgg"]) == 2
    assert capsys.readouterr().err == "visiontune: error: no pretrained torchvision model name contains 'vgg'\n"


@pytest.mark.slow  # timm's import and registry: seconds
def test_timm_pretrained_names_are_those_timm_has_weights_for(tmp_path, capsys, monkeypatch):
    import timm

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path))
    expected = sorted({f"timm/{n.split('.', 1)[0]}" for n in timm.list_models(pretrained=True)})
    assert main(["models", "--source", "timm", "--pretrained"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == expected  # no parameter count: timm would build each model to count it
    without = sorted(set(f"timm/{n}" for n in timm.list_models()) - set(expected))
    assert without and without[0] not in listed and len(listed) < len(timm.list_models())
