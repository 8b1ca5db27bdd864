"""timm and Hugging Face Hub models: their specs (from timm's pretrained config, or the Hub
model's ``config.json``), building them with a ``num_classes`` head (timm sizes it itself), and
the one line a Hub failure gets (offline, not cached, no such repository). timm itself is imported
inside the functions, only when a ``timm/NAME`` or ``hf-hub:ORG/NAME`` model is asked for: it takes a
while to import.

A Hub repository is someone else's: its ``config.json`` is read once here (``hub_config``), bounded and
checked field by field (``check_hub_config``) before timm acts on it, and weights that do not load
(``weights_only`` refusals, a damaged file) are one line naming the model.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import pickle
import re
from typing import Any

import torch
from torch import nn

from visiontune.errors import UserError
from visiontune.models.spec import INTERPOLATIONS, MAX_IMAGE_SIZE, ModelSpec, Preprocess, is_weights_file
from visiontune.models.statedict import load_error

# One request with this timeout (seconds; $HF_HUB_ETAG_TIMEOUT if set) and no retries decides whether the
# Hub can be reached, before the client's own download, which retries a dead network for a minute.
PROBE_SECONDS = 3.0


def hub_error(name: str, e: Exception | str) -> UserError:
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(e, RepositoryNotFoundError):
        return UserError(
            f"no model {name!r} on the Hugging Face Hub (or it is private); check the name "
            f"at https://huggingface.co/{name.split(':', 1)[-1].lstrip('/')}"
        )
    todo = (
        "copy that cache from a machine that has it"
        if name.startswith("hf-hub:")
        else "pass --weights none (train from scratch) or --weights PATH"
    )  # a Hub model needs its config.json even untrained
    why = e if isinstance(e, str) else e.__class__.__name__
    return UserError(
        f"cannot fetch {name} ({why}): offline or not in the Hugging Face cache "
        f"{constants.HF_HUB_CACHE} (HF_HOME) nor torch hub's {torch.hub.get_dir()}; run once with "
        f"network access to fill the cache, or {todo}"
    )


@contextlib.contextmanager
def hub_access(name: str, repo: str, filenames: tuple[str, ...]):
    """Around a Hub download of one of ``filenames`` of ``repo`` for model ``name``: no request at all when
    one is cached, and the one line of ``hub_error`` within seconds when the Hub cannot be reached."""
    from huggingface_hub import constants, try_to_load_from_cache

    repo_id, _, revision = repo.partition("@")
    if any(isinstance(try_to_load_from_cache(repo_id, f, revision=revision or None), str) for f in filenames):
        # Cached: offline for this call, or the client asks the Hub for a newer revision first.
        offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
        try:
            yield
        finally:
            constants.HF_HUB_OFFLINE = offline
        return
    if constants.HF_HUB_OFFLINE:
        raise hub_error(name, "HF_HUB_OFFLINE is set")
    _probe(name, repo_id, revision or None, filenames[0])
    yield


def _probe(name: str, repo_id: str, revision: str | None, filename: str) -> None:
    import os

    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or PROBE_SECONDS)
    try:
        with hub_quiet():
            get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision), timeout=timeout)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise hub_error(name, e) from None
    except HfHubHTTPError:  # the Hub answered (a missing file: the download tries the next name)
        return
    except Exception as e:  # no connection, a timeout, a proxy's refusal: the download would retry for a minute
        raise hub_error(name, e) from None


def _weight_files(arch: str) -> tuple[str, tuple[str, ...]] | None:
    """The Hub repository and file names timm downloads ``arch``'s pretrained weights from (None: a URL)."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(arch)
    repo = cfg.hf_hub_id if cfg is not None else None
    if not repo:
        return None
    given = cfg.hf_hub_filename
    if given:
        return repo, (given, given.removesuffix(".bin") + ".safetensors") if given.endswith(".bin") else (given,)
    return repo, ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors")


@contextlib.contextmanager
def hub_quiet():
    """The hub client logs each retry; the one line that matters is ours."""
    from huggingface_hub.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _preprocess(cfg: dict, arch: str, model_args: dict | None = None) -> Preprocess:
    from timm.data import resolve_data_config

    data = resolve_data_config(pretrained_cfg=cfg)
    return Preprocess(
        int(data["input_size"][-1]),
        tuple(data["mean"]),
        tuple(data["std"]),
        str(data["interpolation"]),
        float(data["crop_pct"]),
        bool(cfg.get("fixed_input_size", False)) and not _sizes_itself(arch, model_args or {}),
    )


@functools.lru_cache(maxsize=64)
def _sizes_itself_cached(arch: str, args: str) -> bool:
    import json

    import timm

    try:
        with torch.device("meta"):  # the architecture only: no memory, no weights, a fraction of a second
            model = timm.create_model(arch, pretrained=False, **json.loads(args))
    except Exception:  # noqa: BLE001  (an init that cannot run on meta: taken as fixed, built for the size asked)
        return False
    return bool(getattr(model, "dynamic_img_size", False))


def _sizes_itself(arch: str, model_args: dict) -> bool:
    """Whether ``arch`` is built to take any input size already (timm's ``dynamic_img_size``, as its test_vit
    is): its weights then keep their pretrained shapes, loadable into ``timm.create_model(arch)`` as they are."""
    import json

    return _sizes_itself_cached(arch, json.dumps(model_args, sort_keys=True))


def size_kwargs(spec: ModelSpec, image_size: int | None) -> dict:
    """``create_model``'s arguments that build a fixed-size model (a ViT) for ``image_size`` rather than its
    pretrained size, as timm's own train.py does with ``img_size``; pretrained weights then have their position
    embeddings resampled by timm as they load."""
    return {"img_size": image_size} if spec.resized_from(image_size) else {}


def fit_positions(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with its position embeddings resampled to ``model``'s size where the two differ (a file saved
    at another --image-size), by the filter timm itself loads that model family's pretrained weights with."""
    import sys

    own = model.state_dict()
    if all(k not in own or v.shape == own[k].shape for k, v in state.items()):
        return state
    fit = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if fit is None:
        return state
    try:
        return fit(dict(state), model)
    except Exception:  # noqa: BLE001  (a file that does not fit is named by load_fitting's own check)
        return state


MAX_CONFIG_BYTES = 16 << 20  # a config.json: label names and descriptions of 21,000 classes fit
_ARCH = re.compile(r"[A-Za-z0-9_]{1,200}(\.[A-Za-z0-9_]{1,100})?")  # a timm name, with its tag
_CROP_MODES = ("center", "squash", "border")


def _number(v: Any, lo: float, hi: float) -> bool:
    # The range first: JSON's integers have no bound, and math.isfinite raises on one beyond a float's range.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi and math.isfinite(v)


def _three(lo: float, hi: float):
    return lambda v: isinstance(v, (list, tuple)) and len(v) == 3 and all(_number(x, lo, hi) for x in v)


def _side(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_IMAGE_SIZE


# The pretrained_cfg fields that decide how images are fed, each with its test and what it should be (the
# bounds a model file's description is held to); absent ones take timm's defaults.
HUB_PREPROCESS = {
    "input_size": (
        lambda v: isinstance(v, (list, tuple)) and len(v) == 3 and v[0] == 3 and _side(v[1]) and _side(v[2]),
        f"[3, H, W] with H and W from 1 to {MAX_IMAGE_SIZE}",
    ),
    "interpolation": (lambda v: v in INTERPOLATIONS, f"one of {', '.join(INTERPOLATIONS)}"),
    "mean": (_three(0.0, 1.0), "three finite numbers in [0, 1]"),
    "std": (_three(0.01, 1.0), "three finite numbers in [0.01, 1]"),
    "crop_pct": (lambda v: _number(v, 1e-6, 2.0), "a number in (0, 2]"),
    "crop_mode": (lambda v: v in _CROP_MODES, f"one of {', '.join(_CROP_MODES)}"),
}


def _arg(v: Any, inner: bool = False) -> bool:
    """A value a model's constructor may take from a config.json: None, true/false, a name, a number of at most
    a million (a depth or a width: what a model is built with is bounded), or a short list of those."""
    if v is None or isinstance(v, bool) or (isinstance(v, str) and len(v) <= 100):
        return True
    if isinstance(v, (int, float)):
        return _number(v, -(1 << 20), 1 << 20)
    return not inner and isinstance(v, list) and len(v) <= 16 and all(_arg(x, inner=True) for x in v)


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(name: str, what: str) -> UserError:
    return UserError(f"{name}: its config.json {what}; use a Hub model saved by timm (or remove it from the cache)")


def check_hub_config(name: str, cfg: Any) -> tuple[dict, str, dict]:
    """A Hub model's parsed ``config.json`` as timm reads it -- (pretrained_cfg, architecture, model_args) --
    once every field timm acts on has passed its test; else one ``UserError`` naming the model and the field."""
    import timm
    from timm.models import _hub

    if not isinstance(cfg, dict):
        raise _bad(name, "is not a JSON object")
    pretrained = cfg.get("pretrained_cfg", cfg)  # an old config.json is the pretrained_cfg itself
    if not isinstance(pretrained, dict):
        raise _bad(name, f"has pretrained_cfg {_shown(pretrained)}, expected an object")
    arch = cfg.get("architecture", pretrained.get("architecture"))
    if not (isinstance(arch, str) and _ARCH.fullmatch(arch) and timm.is_model(arch)):
        raise _bad(name, f"has architecture {_shown(arch)}, expected the name of a timm model")
    args = cfg.get("model_args", {})
    if not (
        isinstance(args, dict) and all(isinstance(k, str) and k.isidentifier() and _arg(v) for k, v in args.items())
    ):
        raise _bad(name, f"has model_args {_shown(args)}, expected keyword arguments of numbers, names or short lists")
    if args.get("in_chans") not in (None, 3):
        raise _bad(name, f"has model_args.in_chans {_shown(args['in_chans'])}, expected 3 (RGB)")
    size = args.get("img_size")
    if size is not None and not (_side(size) or (isinstance(size, list) and len(size) == 2 and all(map(_side, size)))):
        raise _bad(
            name, f"has model_args.img_size {_shown(size)}, expected a side or [H, W] from 1 to {MAX_IMAGE_SIZE}"
        )
    classes = cfg.get("num_classes")
    if classes is not None and not (isinstance(classes, int) and not isinstance(classes, bool) and classes >= 0):
        raise _bad(name, f"has num_classes {_shown(classes)}, expected a whole number")
    try:
        parsed, arch, args = _hub._parse_model_cfg(dict(cfg), {"hf_hub_id": name[len("hf-hub:") :], "source": "hf-hub"})
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise _bad(name, f"cannot be read as timm reads it ({e.__class__.__name__}: {str(e)[:80]})") from None
    for field, (ok, wanted) in HUB_PREPROCESS.items():
        if field in parsed and not ok(parsed[field]):
            raise _bad(name, f"has pretrained_cfg.{field} {_shown(parsed[field])}, expected {wanted}")
    return parsed, arch, args


def hub_config(name: str) -> tuple[dict, str, dict]:
    """The checked ``config.json`` of ``hf-hub:ORG/NAME`` (``check_hub_config``), from the cache or the Hub."""
    from huggingface_hub.errors import HFValidationError
    from timm.models import _hub

    repo = name[len("hf-hub:") :]
    try:
        with hub_access(name, repo, ("config.json",)), hub_quiet():
            path = _hub.download_from_hf(repo, "config.json")
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:  # hub errors are OSErrors: offline, not cached, no such repository
        raise hub_error(name, e) from None
    except HFValidationError as e:  # no repository name at all (hf-hub:../../etc/passwd)
        said = (str(e).strip().splitlines() or ["invalid"])[0][:200]
        raise UserError(f"{name!r} is no Hugging Face Hub model name ({said}); write hf-hub:ORG/NAME") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise _bad(name, f"is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise _bad(name, f"is not JSON ({str(e)[:80]})") from None
    return check_hub_config(name, cfg)


def spec(name: str) -> ModelSpec:
    """The spec of ``timm/NAME[.TAG]`` or ``hf-hub:ORG/NAME``, or a ``UserError`` saying what is wrong."""
    if name.startswith("hf-hub:"):
        cfg, arch, model_args = hub_config(name)
        return ModelSpec(name, "hf-hub", name, _preprocess(cfg, arch, model_args))
    import timm
    from timm.models import get_pretrained_cfg

    arch = name[len("timm/") :]
    if not timm.is_model(arch):
        raise UserError(f"unknown timm model {arch!r}; see `visiontune models --source timm --filter TEXT`")
    try:
        cfg = get_pretrained_cfg(arch)
    except RuntimeError as e:  # an unknown pretrained tag
        raise UserError(f"{name}: {e}") from None
    return ModelSpec(name, "timm", arch, _preprocess(cfg.to_dict() if cfg else {}, arch))


def build(spec: ModelSpec, num_classes: int, weights: str, image_size: int | None = None) -> nn.Module:
    """``spec``'s model with a ``num_classes`` head, for ``image_size`` where it has one fixed input size;
    ``weights`` DEFAULT (pretrained) or none."""
    import timm

    if weights not in ("DEFAULT", "none") and not is_weights_file(weights):
        raise UserError(
            f"--weights for {spec.name} is DEFAULT, none or a .safetensors/.pth path; "
            f"a pretrained tag goes in the name: --model {spec.name}.TAG"
        )
    pretrained = weights == "DEFAULT"
    if not pretrained:
        files = None
    elif spec.source == "hf-hub":
        files = spec.arch[len("hf-hub:") :], ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors")
    else:
        files = _weight_files(spec.arch)
    if spec.source == "hf-hub":
        hub_config(spec.name)  # timm reads the same config.json again: checked first
    try:
        with hub_access(spec.name, *files) if files else contextlib.nullcontext(), hub_quiet():
            return timm.create_model(
                spec.arch, pretrained=pretrained, num_classes=num_classes, **size_kwargs(spec, image_size)
            )
    except OSError as e:  # timm fetches through huggingface_hub (or torch hub): all OSErrors
        raise hub_error(spec.name, e) from None
    except (RuntimeError, ValueError, TypeError, EOFError, KeyError, pickle.UnpicklingError) as e:
        if spec.source != "hf-hub":
            raise  # timm's own models: a bug
        # Someone else's repository: weights_only refusals, damaged or mismatched weights, model_args the
        # architecture does not take.
        if "weights_only" in str(e):
            why = "they hold Python objects other than tensors, which visiontune never unpickles"
        elif isinstance(e, KeyError):  # timm's conversion of the weights looked for a tensor they lack
            why = f"its weights do not fit its architecture (no {str(e)[:80]})"
        else:
            why = load_error(e)
        raise UserError(f"cannot build {spec.name} from its Hub files: {why}; use a Hub model saved by timm") from None
