"""A run's self-description: which model, which classes, and how images must be fed to it.

``RunInfo`` is decided once, when training starts -- the model name and its
source, the class names in label order, the image size, the mean/std the
images were normalised with, the resize (interpolation, and timm's centre
crop ``crop_pct`` or None for a plain squash to size), the visiontune
version -- and written into the run's ``config.json`` (its ``"model"``
section). The same record travels inside every model file the run produces:
``best.safetensors`` metadata, ONNX ``metadata_props``, the ``.pt2`` archive's
extra files, always under the one key ``"visiontune"`` as JSON. So
``predict --weights best.safetensors`` needs no other flag, and a flag that
says otherwise is caught by ``reconcile`` instead of silently running the model
at the wrong size.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from visiontune.data.decode import INTERPOLATIONS
from visiontune.errors import UserError
from visiontune.settings.config import MEAN, STD

KEY = "visiontune"
# Fields added after descriptions were first written, with what older files mean by leaving them out.
LATER: dict[str, Any] = {"interpolation": "bilinear", "crop_pct": None}


@dataclass(frozen=True)
class RunInfo:
    model: str
    source: str
    classes: tuple[str, ...]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str
    version: str
    crop_pct: float | None = None  # None: the whole image squashed to size (decode.resize_uint8)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def metadata(self) -> dict[str, str]:
        """String-to-string metadata for safetensors, ONNX and .pt2 files."""
        return {KEY: json.dumps(self.to_dict())}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> RunInfo:
        names = [f.name for f in fields(cls) if f.name not in LATER]
        if not isinstance(d, dict) or set(names) - set(d):
            raise UserError(f"{where}: not a visiontune model description (expected fields {', '.join(names)})")
        # Files written before the crop was recorded were all resized bilinearly, whatever interpolation
        # they name: they load as they were made.
        d = {**d, **LATER} if "crop_pct" not in d else {**LATER, **d}
        info = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names or k in LATER})
        classes_ok = len(info.classes) >= 2 and all(isinstance(c, str) and c for c in info.classes)
        if not classes_ok or not isinstance(info.image_size, int) or info.image_size < 1:
            raise UserError(
                f"{where}: damaged model description (classes {info.classes!r}, image size {info.image_size!r})"
            )
        crop_ok = info.crop_pct is None or (isinstance(info.crop_pct, (int, float)) and info.crop_pct > 0)
        if info.interpolation not in INTERPOLATIONS or not crop_ok:
            raise UserError(
                f"{where}: damaged model description (interpolation {info.interpolation!r}, crop_pct {info.crop_pct!r})"
            )
        return info


def describe(
    model: str,
    source: str,
    classes: list[str],
    image_size: int,
    mean,
    std,
    interpolation: str,
    crop_pct: float | None = None,
) -> RunInfo:
    from visiontune.version import __version__

    return RunInfo(
        model,
        source,
        tuple(classes),
        image_size,
        tuple(float(m) for m in mean),
        tuple(float(s) for s in std),
        interpolation,
        __version__,
        crop_pct,
    )


def read_run(run_dir: str) -> RunInfo:
    """The description in ``RUN/config.json``; runs from before it existed are described from their files."""
    run = Path(run_dir)
    for name in ("config.json", "classes.json"):
        if not (run / name).is_file():
            raise UserError(f"{run_dir} is not a visiontune run folder ({name} is missing)")
    try:
        record = json.loads((run / "config.json").read_text())
        if "model" in record:
            return RunInfo.from_dict(record["model"], str(run / "config.json"))
        cfg, classes = record["config"], json.loads((run / "classes.json").read_text())
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {run_dir}'s config.json/classes.json: {e}") from None
    # Written before runs described themselves: torchvision, the blog's statistics, a bilinear resize.
    return RunInfo.from_dict(
        {
            "model": cfg.get("model"),
            "source": "torchvision",
            "classes": classes,
            "image_size": cfg.get("image_size"),
            "mean": MEAN,
            "std": STD,
            "interpolation": "bilinear",
            "version": "unknown",
        },
        str(run / "config.json"),
    )


def best_weights(run_dir: str) -> str:
    for name in ("best.safetensors", "best.pth"):
        if (Path(run_dir) / name).is_file():
            return str(Path(run_dir) / name)
    raise UserError(f"{run_dir} has no best.safetensors or best.pth: did its training finish an epoch?")


def read_file(path: str) -> RunInfo | None:
    """The description inside a ``.safetensors`` file, or None (a ``.pth``, or a file saved elsewhere)."""
    if not path.endswith(".safetensors") or not Path(path).is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        return RunInfo.from_dict(json.loads(meta[KEY]), path) if KEY in meta else None
    except (OSError, ValueError) as e:  # not a safetensors file, or broken JSON in it
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def reconcile(info: RunInfo, where: str, **given: Any) -> None:
    """Every flag given (not None) must agree with the description: else one line naming both values."""
    for name, value in given.items():
        have = getattr(info, name)
        if value is not None and value != have:
            flag = "--" + name.replace("_", "-")
            shown = ",".join(have) if name == "classes" else have
            wanted = ",".join(value) if name == "classes" else value
            raise UserError(
                f"{flag} {wanted} contradicts {where}, which says {name.replace('_', ' ')} {shown}; "
                f"drop {flag} or use a matching file"
            )
