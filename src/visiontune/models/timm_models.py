"""timm and Hugging Face Hub models: their specs (from timm's pretrained config, or the Hub
model's ``config.json``), building them with a ``num_classes`` head (timm sizes it itself), and
the one line a Hub failure gets (offline, not cached, no such repository). timm itself is imported
inside the functions, only when a ``timm/NAME`` or ``hf-hub:ORG/NAME`` model is asked for: it takes a
while to import.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from visiontune.errors import UserError
from visiontune.models.spec import ModelSpec, Preprocess, is_weights_file

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


def spec(name: str) -> ModelSpec:
    """The spec of ``timm/NAME[.TAG]`` or ``hf-hub:ORG/NAME``, or a ``UserError`` saying what is wrong."""
    if name.startswith("hf-hub:"):
        from huggingface_hub.errors import HFValidationError
        from timm.models import _hub

        repo = name[len("hf-hub:") :]
        try:
            with hub_access(name, repo, ("config.json",)), hub_quiet():
                cfg, arch, model_args = _hub.load_model_config_from_hf(repo)[:3]
        except OSError as e:  # hub errors are OSErrors: offline, not cached, no such repository
            raise hub_error(name, e) from None
        except HFValidationError as e:  # no repository name at all (hf-hub:../../etc/passwd)
            said = (str(e).strip().splitlines() or ["invalid"])[0][:200]
            raise UserError(f"{name!r} is no Hugging Face Hub model name ({said}); write hf-hub:ORG/NAME") from None
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
    try:
        with hub_access(spec.name, *files) if files else contextlib.nullcontext(), hub_quiet():
            return timm.create_model(
                spec.arch, pretrained=pretrained, num_classes=num_classes, **size_kwargs(spec, image_size)
            )
    except OSError as e:  # timm fetches through huggingface_hub (or torch hub): all OSErrors
        raise hub_error(spec.name, e) from None
