"""The model names ``--model`` accepts, for ``visiontune models``: torchvision's classifiers and timm's
registry, listed once per installed version into a small JSON file and read from it after that, so
the command answers without importing torch, torchvision or timm (seconds each); a file there that is not
such a list (bounded, checked) is listed again and replaced. Names are sorted by
name; matches that start with the text come before the ones that only contain it. ``pretrained=True``
keeps the names with pretrained weights (timm's ``list_models(pretrained=True)``, torchvision's weight
enums), each with its parameter count where the source records it (torchvision's weights' meta; timm
would have to build each model to count them).
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

from visiontune.errors import UserError
from visiontune.files import atomic_write
from visiontune.models.spec import UNKNOWN, is_weights_file


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def _listed(source: str) -> list[str]:
    if source == "torchvision":
        import torchvision

        return torchvision.models.list_models(module=torchvision.models)
    import timm

    return [f"timm/{n}" for n in timm.list_models()]


def _listed_pretrained(source: str) -> list[list]:
    """[name, parameters or None] of each name with pretrained weights."""
    if source == "torchvision":
        import torchvision

        out = []
        for name in torchvision.models.list_models(module=torchvision.models):
            enum = torchvision.models.get_model_weights(name)
            if len(enum):  # the DEFAULT weights' count: what --weights DEFAULT loads (a ViT at 384 px has more)
                out.append([name, enum.DEFAULT.meta.get("num_params")])
        return out
    import timm

    # timm lists NAME.TAG per weight; --model timm/NAME takes the default tag's.
    bare = dict.fromkeys(n.split(".", 1)[0] for n in timm.list_models(pretrained=True))
    return [[f"timm/{n}", None] for n in bare]


MAX_LIST = 16 << 20  # bytes of a cached list: timm's ~1,600 names take ~50 KB
MAX_NAME = 1000  # characters of one model name


def _name(v) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME


def _names(listed) -> bool:
    return isinstance(listed, list) and bool(listed) and all(_name(n) for n in listed)


def _names_and_counts(listed) -> bool:
    """[[name, parameters or None], ...]: what ``_listed_pretrained`` lists."""
    return (
        isinstance(listed, list)
        and bool(listed)
        and all(
            isinstance(p, list) and len(p) == 2 and _name(p[0]) and (p[1] is None or type(p[1]) is int and p[1] >= 0)
            for p in listed
        )
    )


def _read_cached(path: Path, valid) -> list | None:
    """The list cached at ``path`` when it is one ``valid`` accepts, else None (listed again). The file is any
    file by then (a damaged disk, another tool, a hand), so it is read bounded and checked."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_LIST + 1)
        listed = json.loads(text) if len(text) <= MAX_LIST else None
    except (OSError, ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        return None
    return listed if valid(listed) else None


def _cached(path: Path | None, make, valid):
    if path is not None:
        listed = _read_cached(path, valid)
        if listed is not None:
            return listed
    listed = make()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(listed))
        except OSError:  # a read-only home: list again next time
            pass
    return listed


def pretrained_names(source: str, cache_dir: str | os.PathLike | None = None) -> dict[str, int | None]:
    """Each name of ``source`` with pretrained weights, and its parameter count when known."""
    path = Path(cache_dir) / f"model-names-{source}-pretrained-{_version(source)}.json" if cache_dir else None
    return {name: params for name, params in _cached(path, lambda: _listed_pretrained(source), _names_and_counts)}


def all_names(source: str, cache_dir: str | os.PathLike | None = None) -> list[str]:
    """Every name of ``source`` (torchvision or timm), from ``cache_dir``'s list for the installed version."""
    path = Path(cache_dir) / f"model-names-{source}-{_version(source)}.json" if cache_dir else None
    return _cached(path, lambda: _listed(source), _names)


def matching(names: list[str], text: str) -> list[str]:
    """``names`` containing ``text`` (any case), sorted by name (``timm/`` aside): those that start with it
    first, then the others."""
    text = text.lower()

    def bare(name: str) -> str:
        return name.lower().removeprefix("timm/")

    found = sorted((n for n in names if text in n.lower()), key=lambda n: (bare(n), n))
    return [n for n in found if bare(n).startswith(text)] + [n for n in found if not bare(n).startswith(text)]


def model_names(
    source: str = "torchvision", text: str = "", cache_dir: str | os.PathLike | None = None, pretrained: bool = False
) -> list[str]:
    """Names ``--model`` accepts from ``source`` (torchvision, timm or all) that contain ``text``;
    ``pretrained``: only those with pretrained weights."""
    sources = ("torchvision", "timm") if source == "all" else (source,)
    listed = pretrained_names if pretrained else all_names
    return matching([n for s in sources for n in listed(s, cache_dir)], text)


def with_parameters(names: list[str], cache_dir: str | os.PathLike | None = None) -> list[str]:
    """Each pretrained name with its parameter count (``11.7M parameters``) where its source records one."""
    counts = {
        n: p
        for s in {"timm" if n.startswith("timm/") else "torchvision" for n in names}
        for n, p in pretrained_names(s, cache_dir).items()
    }
    width = max(map(len, names), default=0)
    return [f"{n:<{width}}  {counts[n] / 1e6:.1f}M parameters" if counts.get(n) else n for n in names]


def check_model(name: str, weights: str, cache_dir: str | os.PathLike | None = None) -> None:
    """Refuse what ``build.get_spec`` and ``build.ensure_weights`` refuse, and fetch named weights, before a
    run imports its models: a torchvision name is looked up in the cached list, so that a refusal does not wait
    for torchvision's import and the torch.compile machinery it pulls in (seconds).
    """
    timm = name.startswith(("hf-hub:", "timm/"))
    if not timm and name not in all_names("torchvision", cache_dir):
        raise UserError(UNKNOWN.format(name))
    if timm or not (weights.lower() == "none" or is_weights_file(weights)):
        from visiontune.models import build  # timm's and the Hub's names, and downloads, need the model code

        build.ensure_weights(name, weights)
