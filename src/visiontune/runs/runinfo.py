"""A run's self-description: which model, which classes, and how images must be fed to it.

``RunInfo`` is decided once, when training starts -- the model name and its
source, the class names in label order, the image size, the mean/std the
images were normalised with, the resize (interpolation, and timm's centre
crop ``crop_pct`` or None for a plain squash to size), the decode
(``--decode``: exact, fast with its DCT-scaled JPEGs, or device, read as exact), the visiontune
version, the task by name (``task``: ``tasks.TASKS``), for a multi-label model the per-class
``thresholds`` of its best epoch (``EpochOutputs`` adds them to the file), and what a
fitted task keeps of its train split (``task_state``: a regression's target scale) --
and written into the run's ``config.json`` (its ``"model"`` section). The same
record travels inside every model file the run produces:
``best.safetensors`` metadata, ONNX ``metadata_props``, the ``.pt2`` archive's
extra files, always under the one key ``"visiontune"`` as JSON. So
``predict --weights best.safetensors`` needs no other flag, and a flag that
says otherwise is caught by ``reconcile`` instead of silently running the model
at the wrong size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from visiontune import tasks
from visiontune.data.decode import DECODES
from visiontune.errors import UserError
from visiontune.models.spec import INTERPOLATIONS, MAX_IMAGE_SIZE, SOURCES
from visiontune.tasks import Task

KEY = "visiontune"
# Fields added after descriptions were first written, with what older files mean by leaving them out.
LATER: dict[str, Any] = {"interpolation": "bilinear", "crop_pct": None, "decode": "exact"}
# Written only where they say something (a single-label description stays as it was but for its task's
# name): the per-class thresholds a multi-label model's best epoch tuned on the validation split (None until
# one is known), and what a fitted task keeps (``Task.state``; its ``restored`` checks it).
BY_TASK: dict[str, Any] = {"thresholds": None, "task_state": None}

# A model file may come from anyone, and every field below sizes an allocation or shapes an output: the
# bounds keep a hostile or damaged description from asking for exabytes, or from giving NaN for every image.
MAX_DESCRIPTION = 1 << 20  # characters of JSON: 100,000 class names of ten characters fit
MAX_CLASSES = 100_000
MAX_RESIZE = 8192  # the side an image is resized to before its centre crop: image_size / crop_pct


def _number(v: Any, lo: float, hi: float) -> bool:
    # bool is an int to Python, and JSON's true is no size. The range first: JSON's integers have no bound, and
    # math.isfinite raises on one beyond a float's range.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi and math.isfinite(v)


def _three(lo: float, hi: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (list, tuple)) and len(v) == 3 and all(_number(x, lo, hi) for x in v)


def _classes(v: Any) -> bool:
    # A string is a sequence too: "abc" must not become the classes a, b and c. (A regression's one target
    # is a "class" too: the task checks the count it needs, ``Task.min_classes``.)
    if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= MAX_CLASSES:
        return False
    return all(isinstance(c, str) and 0 < len(c) <= 1000 for c in v) and len(set(v)) == len(v)


# Each field: the test it must pass, and what it should have been (said in the error).
SCHEMA: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: isinstance(v, str) and 0 < len(v) <= 300 and v.isprintable(), "a model name"),
    "source": (lambda v: v in SOURCES, f"one of {', '.join(SOURCES)}"),
    "classes": (_classes, f"a list of 1 to {MAX_CLASSES} distinct, non-empty class names"),
    "image_size": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_IMAGE_SIZE,
        f"an integer from 1 to {MAX_IMAGE_SIZE}",
    ),
    "mean": (_three(0.0, 1.0), "three finite numbers in [0, 1]"),
    "std": (_three(0.01, 1.0), "three finite numbers in [0.01, 1]"),
    "interpolation": (lambda v: v in INTERPOLATIONS, f"one of {', '.join(INTERPOLATIONS)}"),
    "version": (lambda v: isinstance(v, str) and len(v) <= 100 and v.isprintable(), "a version string"),
    "crop_pct": (lambda v: v is None or _number(v, 1e-6, 2.0), "null or a number in (0, 2]"),
    "decode": (lambda v: v in DECODES, f"one of {', '.join(DECODES)}"),
    "task": (lambda v: isinstance(v, str) and v in tasks.TASKS, f"one of {', '.join(tasks.TASKS)}"),
    "task_state": (lambda v: v is None or isinstance(v, dict), "null or an object"),
    "thresholds": (
        lambda v: v is None or (isinstance(v, (list, tuple)) and all(_number(x, 0.0, 1.0) for x in v)),
        "null or a list of numbers in [0, 1], one per class",
    ),
}


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check(d: dict[str, Any], where: str) -> None:
    """Each field of a description against ``SCHEMA``: else one line naming the file and the field."""
    for name, (ok, wanted) in SCHEMA.items():
        if not ok(d[name]):
            raise UserError(
                f"{where}: damaged model description: {name} is {_shown(d[name])}, expected {wanted} "
                "(use a model file written by visiontune)"
            )
    if len(d["classes"]) < tasks.get(d["task"]).min_classes:
        raise UserError(
            f"{where}: damaged model description: classes has {len(d['classes'])}, a {d['task']} model has at "
            f"least {tasks.get(d['task']).min_classes} (use a model file written by visiontune)"
        )
    if d["thresholds"] is not None and len(d["thresholds"]) != len(d["classes"]):
        raise UserError(
            f"{where}: damaged model description: {len(d['thresholds'])} thresholds for {len(d['classes'])} "
            "classes (use a model file written by visiontune)"
        )
    if d["crop_pct"] is not None and d["image_size"] / d["crop_pct"] > MAX_RESIZE:
        raise UserError(
            f"{where}: damaged model description: crop_pct {d['crop_pct']!r} with image_size {d['image_size']} "
            f"resizes every image to more than {MAX_RESIZE} px (use a model file written by visiontune)"
        )


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
    task_name: str = "classify"  # recorded as "task": its name in tasks.TASKS
    thresholds: tuple[float, ...] | None = None  # multi-label: per class, tuned on the validation split
    decode: str = "exact"  # decode.DECODES: how files were decoded before the resize (--decode)
    task_state: dict | None = None  # Task.state() of the fitted task (a regression's target scale)

    def to_dict(self) -> dict[str, Any]:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        d["task"] = d.pop("task_name")
        for k in BY_TASK:
            if d[k] is None:
                del d[k]
        return d

    @property
    def task(self) -> Task:
        """What the model predicts (``tasks``), as fitted: what its output means, its answers and its CSV rows."""
        return tasks.get(self.task_name).restored(self.task_state or {}, len(self.classes))

    @property
    def decision_thresholds(self) -> list[float] | None:
        """The per-class thresholds its task decides at (its recorded ones, or the default), or None."""
        return self.task.thresholds(self.thresholds, len(self.classes))

    def with_thresholds(self, thresholds) -> RunInfo:
        return replace(self, thresholds=tuple(float(t) for t in thresholds))

    def metadata(self) -> dict[str, str]:
        """String-to-string metadata for safetensors, ONNX and .pt2 files."""
        return {KEY: json.dumps(self.to_dict())}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> RunInfo:
        names = [f.name for f in fields(cls) if f.name not in LATER and f.name not in BY_TASK and f.name != "task_name"]
        if not isinstance(d, dict) or set(names) - set(d):
            raise UserError(f"{where}: not a visiontune model description (expected fields {', '.join(names)})")
        # Files written before the crop was recorded were all resized bilinearly, whatever interpolation
        # they name: they load as they were made.
        d = {**d, **LATER} if "crop_pct" not in d else {**LATER, **d}
        d = {**BY_TASK, **d}
        if "task" not in d:  # written before the task had a name: a multi-label model said so, the rest classify
            d["task"] = "multilabel" if d.get("multi_label") is True else "classify"
        check(d, where)
        info = cls(
            **{k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in d.items() if k in SCHEMA and k != "task"},
            task_name=d["task"],
        )
        try:
            _ = info.task  # the task checks its own state
        except ValueError as e:
            raise UserError(
                f"{where}: damaged model description: {e} (use a model file written by visiontune)"
            ) from None
        return info


def metadata_with_thresholds(metadata: dict[str, str], thresholds) -> dict[str, str]:
    """A model file's metadata with a multi-label description's per-class thresholds set."""
    d = json.loads(metadata[KEY])
    d["thresholds"] = [float(t) for t in thresholds]
    return {**metadata, KEY: json.dumps(d)}


def describe(
    model: str,
    source: str,
    classes: list[str],
    image_size: int,
    mean,
    std,
    interpolation: str,
    crop_pct: float | None = None,
    task: Task = tasks.SINGLE_LABEL,
    decode: str = "exact",
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
        task.name,
        decode=decode,
        task_state=task.state() or None,
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
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError) as e:  # truncated, or not a safetensors file at all
        reason = str(e).splitlines()[0][:200] if str(e) else e.__class__.__name__
        raise UserError(
            f"{path} is not a readable safetensors file ({reason}); pass a model file visiontune wrote"
        ) from None
    if KEY not in meta:
        return None
    if len(meta[KEY]) > MAX_DESCRIPTION:
        raise UserError(f"{path}: its model description is over {MAX_DESCRIPTION} characters; it is not visiontune's")
    try:
        d = json.loads(meta[KEY])
    except (ValueError, RecursionError) as e:  # broken JSON, or nesting deep enough to exhaust the stack
        raise UserError(f"{path}: its model description is not JSON ({str(e)[:100]})") from None
    return RunInfo.from_dict(d, path)


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
