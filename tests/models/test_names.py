"""`visiontune models`: the names sorted by name, and `--pretrained` with the names that have weights
(and their parameter counts where the source records them), read from a per-version cache."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from visiontune.cli.commands import main
from visiontune.models import names

# Any JSON value, to depth 3: what a damaged cache file may hold.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


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


# A cached list of names is a file anyone with the cache folder (or a damaged disk) may have changed: whatever
# it holds, `visiontune models` and `train`'s model check list the names again, never a traceback.
DAMAGED = [
    '{"resnet18": 1}',  # an object: its keys were listed as names before
    "[1, 2]",  # an AttributeError before
    '[["resnet18", "11M"]]',  # a pretrained list where the names' was
    "[" * 100_000,  # a RecursionError before
    '["resnet18"',  # torn
    '[""]',
]


def _torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


@pytest.mark.parametrize("text", DAMAGED)
def test_a_damaged_names_cache_is_listed_again_and_replaced(tmp_path, capsys, monkeypatch, text):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path))
    assert main(["models"]) == 0 and main(["models", "--pretrained"]) == 0
    capsys.readouterr()
    caches = sorted(tmp_path.glob("model-names-torchvision-*.json"))
    assert len(caches) == 2
    for cache in caches:
        cache.write_text(text)
    assert main(["models"]) == 0
    assert capsys.readouterr().out.splitlines() == _torchvision_names()
    assert main(["models", "--pretrained", "--filter", "resnet1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["resnet101", "resnet152", "resnet18", "wide_resnet101_2"]
    names.check_model("resnet18", "none", tmp_path)  # train's check reads the same list
    for cache in caches:  # replaced by the list made again
        assert cache.read_text() != text


def test_a_names_cache_larger_than_any_list_is_not_read(tmp_path, monkeypatch):
    cache = tmp_path / "model-names-torchvision-x.json"
    cache.write_text('["resnet18", "resnet34"]')
    monkeypatch.setattr(names, "_version", lambda source: "x")
    assert names.all_names("torchvision", tmp_path) == ["resnet18", "resnet34"]  # a cached list is used as is
    monkeypatch.setattr(names, "MAX_LIST", 10)
    assert sorted(names.all_names("torchvision", tmp_path)) == _torchvision_names()


@fuzz_settings(60)
@given(st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode())), st.booleans())
def test_fuzz_any_bytes_as_the_names_cache_list_the_names(data, pretrained):
    with tempfile.TemporaryDirectory() as folder:
        kind = "-pretrained" if pretrained else ""
        cache = Path(folder) / f"model-names-torchvision{kind}-{names._version('torchvision')}.json"
        cache.write_bytes(data)
        kept = names._read_cached(cache, names._names_and_counts if pretrained else names._names)
        listed = names.model_names("torchvision", "", folder, pretrained=pretrained)
        assert all(isinstance(n, str) and n for n in listed)
        if kept is None:  # not a list of names (with counts): listed again
            assert "resnet18" in listed and set(listed) <= set(_torchvision_names())
        else:  # a well-formed list is used as it is (names checked when a model is built)
            assert len(listed) == len(kept)
