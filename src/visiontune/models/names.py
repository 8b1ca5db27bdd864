"""The model names ``--model`` accepts, for ``visiontune models``: torchvision's classifiers and timm's
registry, listed once per installed version into a small JSON file and read from it after that, so
the command answers without importing torch, torchvision or timm (seconds each). Matches that start
with the text come before the ones that only contain it.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

from visiontune.errors import UserError
from visiontune.files import atomic_write
from visiontune.models.spec import is_weights_file

UNKNOWN = "unknown model {!r}; see `visiontune models` (timm models: timm/NAME, Hub models: hf-hub:ORG/NAME)"


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


def all_names(source: str, cache_dir: str | os.PathLike | None = None) -> list[str]:
    """Every name of ``source`` (torchvision or timm), from ``cache_dir``'s list for the installed version."""
    path = Path(cache_dir) / f"model-names-{source}-{_version(source)}.json" if cache_dir else None
    if path is not None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    names = _listed(source)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(names))
        except OSError:  # a read-only home: list again next time
            pass
    return names


def matching(names: list[str], text: str) -> list[str]:
    """``names`` containing ``text`` (any case): those that start with it (``timm/`` aside) first, the
    shortest (the closest to what was typed) first among them; then the others, in listing order."""
    text = text.lower()

    def bare(name: str) -> str:
        return name.lower().removeprefix("timm/")

    found = [n for n in names if text in n.lower()]
    starting = sorted((n for n in found if bare(n).startswith(text)), key=lambda n: len(bare(n)))  # stable
    return starting + [n for n in found if not bare(n).startswith(text)]


def model_names(source: str = "torchvision", text: str = "", cache_dir: str | os.PathLike | None = None) -> list[str]:
    """Names ``--model`` accepts from ``source`` (torchvision, timm or all) that contain ``text``."""
    sources = ("torchvision", "timm") if source == "all" else (source,)
    return matching([n for s in sources for n in all_names(s, cache_dir)], text)


def check_model(name: str, weights: str, cache_dir: str | os.PathLike | None = None) -> None:
    """Refuse what ``build.get_spec`` and ``build.ensure_weights`` refuse, and fetch named weights, in the
    process that only launches the workers: a torchvision name is looked up in the cached list, so that
    process imports neither torchvision nor the torch.compile machinery its import pulls in (seconds).
    """
    if name.startswith(("hf-hub:", "timm/")) or not (weights.lower() == "none" or is_weights_file(weights)):
        from visiontune.models import build  # timm's and the Hub's names, and downloads, need the model code

        build.ensure_weights(name, weights)
    elif name not in all_names("torchvision", cache_dir):
        raise UserError(UNKNOWN.format(name))
