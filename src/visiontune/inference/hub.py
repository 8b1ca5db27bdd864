"""``visiontune export --format hub`` and ``visiontune push``: a run's best model as a folder in timm's
Hugging Face Hub layout, and that folder uploaded to the Hub.

The folder is what ``timm.create_model("local-dir:DIR", pretrained=True)`` (or ``"hf-hub:ORG/NAME"`` once
pushed) reads: ``config.json`` -- written by timm's own ``save_config_for_hf``: architecture,
num_classes, label_names (the run's classes in label order) and a ``pretrained_cfg`` whose input size,
interpolation, crop (``crop_pct`` and ``crop_mode``: ``squash`` for visiontune's whole-image resize,
``center`` for timm's eval crop) and mean/std are the run's, so timm's ``resolve_data_config`` feeds the
model as it was trained -- and ``model.safetensors`` in timm's keys, carrying the run's description under
the metadata key ``visiontune`` as every visiontune model file does (``visiontune.load`` reads it back).
config.json holds that description too, under ``"visiontune"``: a multi-label model's per-class thresholds
are there. The folder's model gives what its task answers with no code after it where the task says so
(``Task.folded_into``): a regression's map back to the targets' units is folded into its last Linear layer,
so timm's model outputs the values as ONNX and OpenVINO files do (its description then says ``folded``, and
``visiontune.load`` applies no map again). A timm or Hub model is saved as it is. torchvision's ResNet
family has timm twins with the same state-dict keys, shapes and forward pass (``TIMM_TWINS``: checked key by
key, and output by output), so those weights load into the timm model unchanged; any other architecture is
refused in one line naming the formats that fit. Before the folder takes its name it is loaded back through
timm's ``local-dir:`` and its output compared with the run's (``TOLERANCE``), so a folder on disk is one
that timm loads. ``README.md`` is the model card (``reports.modelcard``), beside the curves picture.
transformers' timm wrapper (``AutoModelForImageClassification``) loads the same folder.

``push`` builds that folder in a temporary directory and uploads it as one commit (``create_repo``,
``upload_folder``), with the token from ``HF_TOKEN`` or the Hub's login cache (``get_token``); without a
token, offline, or when the Hub cannot be reached, it says which in one line and reports nothing as done.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from visiontune.errors import UserError
from visiontune.inference.loaded import LoadedModel, load_model
from visiontune.models.build import resized_from
from visiontune.reports import modelcard
from visiontune.runs import runrecords
from visiontune.runs.runinfo import RunInfo

# torchvision models whose timm namesake has the same state-dict keys and shapes and computes the same
# logits from them (each checked against timm 1.0.31: identical keys, max difference 0.0 on random input).
TIMM_TWINS = frozenset(
    (
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "resnext50_32x4d",
        "resnext101_32x8d",
        "resnext101_64x4d",
        "wide_resnet50_2",
        "wide_resnet101_2",
    )
)
TOLERANCE = 1e-5
CURVES = "training_results.png"
# timm's pretrained_cfg fields that describe timm's own published weights (their tag, licence, paper), not
# the run's: left out, so the folder claims nothing about weights it does not hold.
NOT_OURS = ("tag", "license", "origin_url", "paper_ids", "paper_name", "notes", "hf_hub_filename")


def timm_model(loaded: LoadedModel) -> nn.Module:
    """The run's model as a timm module (itself for timm and Hub models), or one line saying what fits."""
    info = loaded.info
    if info.source in ("timm", "hf-hub"):
        return loaded.model
    if info.model not in TIMM_TWINS:
        raise UserError(
            f"{info.model} has no timm twin with the same weights layout, so no timm Hub folder can hold it; "
            f"export it with --format onnx or --format pt2 (--format hub takes timm and Hub models and "
            f"torchvision's {', '.join(sorted(TIMM_TWINS))})"
        )
    import timm

    twin = timm.create_model(info.model, pretrained=False, num_classes=len(info.classes))
    twin.load_state_dict(loaded.model.state_dict(), strict=True)  # the same keys and shapes: nothing renamed
    return twin.eval()


def data_config(info: RunInfo) -> dict:
    """timm's preprocessing for the run's own resize: ``squash`` (the whole image to size) or ``center``."""
    if info.interpolation not in ("bilinear", "bicubic", "nearest"):
        raise UserError(
            f"timm has no {info.interpolation} resize, which this run was trained with; "
            "export it with --format onnx or --format pt2"
        )
    s = info.image_size
    return {
        "input_size": (3, s, s),
        "interpolation": info.interpolation,
        "crop_pct": 1.0 if info.crop_pct is None else info.crop_pct,
        "crop_mode": "squash" if info.crop_pct is None else "center",
        "mean": tuple(info.mean),
        "std": tuple(info.std),
    }


def _write_folder(loaded: LoadedModel, run_dir: str, folder: Path, repo: str | None) -> float:
    """The Hub folder's files into the existing, empty ``folder``; the largest |timm - run's model| seen."""
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf

    model, info = _folded(timm_model(loaded).float().eval().cpu(), loaded.info)
    # A model built for another size than its pretrained one (a ViT's position embeddings) is built so again.
    sized = {"img_size": info.image_size} if resized_from(info.model, info.image_size) else None
    labels = {"label_names": list(info.classes)}
    save_config_for_hf(model, str(folder / "config.json"), labels, sized, data_config(info))
    config = json.loads((folder / "config.json").read_text())
    for key in NOT_OURS:
        config["pretrained_cfg"].pop(key, None)
    # timm reads num_classes from the top level; in model_args too, transformers' timm wrapper (5.23) is handed
    # it twice and fails.
    config.get("model_args", {}).pop("num_classes", None)
    config["visiontune"] = info.to_dict()  # the description, with a multi-label model's thresholds
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata=info.metadata())
    curves = Path(run_dir) / CURVES
    if curves.is_file():
        shutil.copyfile(curves, folder / CURVES)
    # The run folder's records, checked (``runs.runrecords``), as the report and compare read them.
    run_config, summary = runrecords.read_config(run_dir), runrecords.read_summary(run_dir)
    if run_config is None or summary is None:
        missing = "summary.json" if run_config is not None else "config.json"
        raise UserError(
            f"{Path(run_dir) / missing} is missing: --format hub needs a finished run folder (its summary and config)"
        )
    try:
        text = modelcard.card(
            run_config,
            summary,
            config["architecture"],
            repo,
            CURVES if curves.is_file() else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a run folder may come from anyone
        raise UserError(
            f"{run_dir}/summary.json or config.json lacks what the model card shows ({e.__class__.__name__}: "
            f"{str(e)[:80]}); use a run folder visiontune finished"
        ) from None
    (folder / "README.md").write_text(text)
    return _check(loaded, folder, info)


def _folded(model: nn.Module, info: RunInfo) -> tuple[nn.Module, RunInfo]:
    """The model as the folder holds it, and its description: with its task's output map folded into its last
    layer (a regression's map back to the targets' units: the folder's model answers with the values, as
    ONNX and OpenVINO files do), or as it is (a classifier's logits)."""
    head = copy.deepcopy(model.get_classifier())
    try:
        task = info.task.folded_into(head)
    except TypeError as e:
        raise UserError(f"{info.model}: {e}; export it with --format onnx or --format openvino") from None
    if task is None:
        return model, info
    model = copy.deepcopy(model)
    model.get_classifier().load_state_dict(head.state_dict())
    return model.eval(), dataclasses.replace(info, task_state=task.state())


def _check(loaded: LoadedModel, folder: Path, held: RunInfo) -> float:
    """The folder loaded back as timm loads it, against the run's model on a random batch: its output as the
    folder's description ``held`` says it is (logits, or a regression's values), within TOLERANCE of the
    output's scale; the largest difference."""
    import timm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    s = loaded.info.image_size
    x = torch.randn(2, 3, s, s, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = loaded.model.float().eval().cpu()(x)
        if held is not loaded.info:  # its task's output map folded in: the run's answer (a regression's values)
            want = loaded.info.task.probabilities(want)
        diff = (back(x).double() - want.double()).abs().max().item()
    if not diff <= TOLERANCE * max(1.0, want.abs().max().item()):
        raise RuntimeError(f"timm's reading of the Hub folder differs from the run's model by {diff:.2e}")
    return diff


def export_hub(loaded: LoadedModel, run_dir: str, out: str, repo: str | None = None) -> float:
    """Write the Hub folder ``out`` whole or not at all (built beside it, then renamed); the check's difference."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; name a new folder or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        diff = _write_folder(loaded, run_dir, tmp, repo)
        _as_umask_allows(tmp)
        tmp.rename(target)  # onto an empty folder, or a new name: the folder appears whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return diff


def _as_umask_allows(folder: Path) -> None:
    """The modes any new folder and file get (mkdtemp's folder is 0700, some writers' files 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def described(out: str, info: RunInfo, diff: float) -> str:
    s = info.image_size
    return (
        f"visiontune: wrote {out}: a timm Hub folder (config.json, model.safetensors, README.md) of "
        f"{info.model} for {', '.join(info.classes)} at {s} x {s} px; load it with "
        f'timm.create_model("local-dir:{out}", pretrained=True); checked through timm, max difference {diff:.1e}'
    )


def _token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise UserError(
            "push needs a Hugging Face token: set HF_TOKEN or log in once with `hf auth login`; nothing was uploaded"
        )
    return token


def push(run_dir: str, repo: str, private: bool = False, revision: str | None = None) -> str:
    """Upload the run's Hub folder to ``repo`` as one commit; the commit's URL. What is missing (the token,
    the network) is said before the model is even loaded."""
    from huggingface_hub import HfApi, constants

    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UserError(f"--repo must be ORG/NAME (a user or organisation, and a model name), got {repo!r}")
    token = _token()
    if constants.HF_HUB_OFFLINE:
        raise UserError(
            "push needs the network, but HF_HUB_OFFLINE is set; unset it and run again; nothing was uploaded"
        )
    loaded = load_model(run_dir)
    api = HfApi(endpoint=constants.ENDPOINT, token=token, library_name="visiontune")
    with tempfile.TemporaryDirectory(prefix="visiontune-hub-") as tmp:
        folder = Path(tmp) / "hub"
        export_hub(loaded, run_dir, str(folder), repo)
        try:
            made = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
            if revision:
                api.create_branch(made.repo_id, branch=revision, exist_ok=True)
            commit = api.upload_folder(
                repo_id=made.repo_id,
                folder_path=str(folder),
                revision=revision,
                commit_message=f"visiontune: {loaded.info.model} for {', '.join(loaded.info.classes)}"[:200],
            )
        except Exception as e:  # no connection, a refused token, no rights: the commit was not made
            if not _from_the_hub(e):
                raise  # a bug: its traceback is what a report needs
            raise UserError(_failure(repo, e)) from None
    return str(getattr(commit, "commit_url", commit))


def _from_the_hub(e: Exception) -> bool:
    """An answer of the Hub, or no answer: its errors, OS-level ones, or its HTTP client's (httpx2)."""
    from huggingface_hub.errors import HfHubHTTPError

    client = type(e).__module__.partition(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
    return client or isinstance(e, (HfHubHTTPError, OSError))


def _failure(repo: str, e: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(e, HfHubHTTPError) and e.response is not None:
        status = e.response.status_code
        why = {401: "the token was refused", 403: "the token may not write there"}.get(status, f"HTTP {status}")
        return f"push to {repo} failed: {why} ({constants.ENDPOINT}); nothing was uploaded"
    reason = str(e).splitlines()[0][:160] if str(e) else e.__class__.__name__
    return (
        f"push to {repo} failed: cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({reason}); "
        "check the network (or HF_ENDPOINT); nothing was uploaded"
    )
