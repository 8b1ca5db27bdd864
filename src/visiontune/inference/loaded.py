"""What ``predict`` and ``evaluate`` share: a trained model loaded, and one forward pass over files.

A run folder or a weights file loads without unpickling anything (an exported ``.onnx`` or OpenVINO
``.xml`` file opens on its own runtime through ``formats``, as a module giving logits):
``best.safetensors`` (or a ``.pth`` read with ``weights_only=True``), and the
run's description (``runinfo``: model, classes, image size, mean/std, resize)
from ``config.json`` or from the file's own metadata. Images go through
training's own code -- ``read_image`` and ``resize_uint8`` (with the run's
interpolation and crop) in the loader,
``DeviceNormalize`` on the device -- and the forward pass is
``engine.evaluate``'s, so with N processes Accelerate shards the files and
``gather_for_metrics`` hands every output back exactly once, in input order.
An unreadable file keeps its slot (a blank image labelled ``UNREADABLE``) so
the sharding and the order stay the same.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from visiontune.cluster.strategies.base import no_datasets_import
from visiontune.cluster.strategy import ProcessSettings, make_accelerator, resolve_threads
from visiontune.data.decode import BadImage, read_source
from visiontune.errors import UserError
from visiontune.inference import formats
from visiontune.loading.pipeline import DeviceNormalize, ImageDataset, make_loader
from visiontune.models.build import build_model, get_spec, input_view
from visiontune.models.spec import WEIGHT_SUFFIXES
from visiontune.runs import runinfo, runrecords
from visiontune.runs.runinfo import RunInfo
from visiontune.settings.config import MEAN, STD, TrainConfig
from visiontune.settings.validation import load_config_file
from visiontune.tasks import SINGLE_LABEL, Task
from visiontune.training import engine


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module  # eval mode, on the CPU
    info: RunInfo  # what it is and how it must be fed: name, classes, image size, mean/std
    batch_size: int  # the run's per-process batch: the default for inference
    thresholds_from: str = "the run's validation split"  # multi-label: where info.thresholds come from
    file: str | None = (
        None  # the file the model was read from (a run's best.safetensors, an export): evaluations name it
    )

    @property
    def name(self) -> str:
        return self.info.model

    @property
    def image_size(self) -> int:
        return self.info.image_size

    @property
    def classes(self) -> list[str]:
        return list(self.info.classes)


@dataclass(frozen=True)
class InferenceConfig:
    """How the forward pass runs: its process's settings (``process``) and the loader's."""

    batch_size: int  # per process
    mixed_precision: str = "no"
    progress: bool = True
    num_workers: int | None = None  # None: strategy.resolve_threads' choice
    timeout: float = 600.0  # seconds any collective may wait
    decode: str | None = None  # decode.DECODES; None: as the model was trained (its RunInfo)
    threads: int | None = None  # None: this process's share of the cores

    def process(self) -> ProcessSettings:
        return ProcessSettings(self.mixed_precision, self.timeout, self.threads)


def _check_classes(classes, where: str) -> list[str]:
    if not (isinstance(classes, list) and len(classes) >= 2 and all(isinstance(c, str) and c for c in classes)):
        raise UserError(f"{where}: expected at least two class names, got {classes!r}")
    return classes


def _describe(weights: str, model: str | None, classes: list[str] | None, image_size: int | None) -> RunInfo:
    """A file that does not describe itself, described by the flags (and the model's pretrained size)."""
    if not model or not classes:
        raise UserError(
            f"{weights} does not say what it is (a .pth, or saved outside visiontune): "
            "give --model NAME and --classes a,b (the class names in training order)"
        )
    if image_size is not None and image_size < 1:
        raise UserError(f"--image-size must be a positive integer, got {image_size}")
    spec = get_spec(model)
    return runinfo.describe(
        model,
        spec.source,
        _check_classes(classes, "--classes"),
        image_size or spec.preprocess.size,
        MEAN,
        STD,
        *input_view(model),
    )


def load_model(
    run: str | None = None,
    weights: str | None = None,
    *,
    model: str | None = None,
    classes: list[str] | None = None,
    image_size: int | None = None,
) -> LoadedModel:
    """A run's best model, or a weights file's, with its description.

    A file made by visiontune describes itself (``best.safetensors`` metadata); ``model``, ``classes``
    and ``image_size`` are then only checked against it. A file that does not needs ``model`` and ``classes``.
    """
    if weights is None and not run:
        raise UserError("give --run RUN_DIR (a training run folder), or --weights FILE")
    if weights and run:
        raise UserError("give --run RUN_DIR or --weights FILE, not both")
    batch = TrainConfig.batch_size
    if formats.is_exported(weights):  # an .onnx or OpenVINO .xml from `visiontune export`, on its runtime
        exported = formats.open_exported(weights, torch.get_num_threads())
        given = {"model": model, "classes": tuple(classes) if classes else None, "image_size": image_size}
        runinfo.reconcile(exported.info, weights, **given)
        return LoadedModel(formats.AsLogits(exported).eval(), exported.info, batch, "the exported file", weights)
    if run:
        info, path, where = runrecords.read_run(run), runinfo.best_weights(run), f"{run}/config.json"
        batch = TrainConfig(**load_config_file(where)).batch_size
        if info.task.thresholded:  # the thresholds are the best epoch's, known after config.json was written
            in_file = runinfo.read_file(path)
            if in_file is not None and in_file.thresholds is not None:
                info = info.with_thresholds(in_file.thresholds)
    else:
        if Path(weights).suffix not in WEIGHT_SUFFIXES:
            raise UserError(f"--weights must be a {'/'.join(WEIGHT_SUFFIXES)} file, got {weights!r}")
        path, where = weights, weights
        info = runinfo.read_file(weights) or _describe(weights, model, classes, image_size)
    runinfo.reconcile(info, where, model=model, classes=tuple(classes) if classes else None, image_size=image_size)
    net = build_model(info.model, len(info.classes), path, image_size=info.image_size, head_may_differ=False).eval()
    _check_size(net, info, where)
    return LoadedModel(net, info, batch, file=path)


def _check_size(net: nn.Module, info: RunInfo, where: str) -> None:
    """One blank image through the model at the described size: a size the model cannot take (too small for
    its pooling, or not the one a ViT's position embedding was made for) is one line naming the file now,
    not a traceback after the images were read."""
    try:
        with torch.inference_mode():
            net(torch.zeros(1, 3, info.image_size, info.image_size))
    except (RuntimeError, AssertionError, ValueError) as e:  # timm checks sizes with assertions
        raise UserError(
            f"{where}: {info.model} cannot take its image size {info.image_size} "
            f"({str(e).splitlines()[0][:120]}); use a model file written by visiontune"
        ) from None


def start(icfg: InferenceConfig) -> Accelerator:
    """The process's one Accelerator (mixed precision, the process group under a launcher)."""
    return make_accelerator(icfg.process())


def forward(
    accelerator: Accelerator,
    loaded: LoadedModel,
    icfg: InferenceConfig,
    paths: list[str],
    labels: list[int],
    desc: str,
    reader=None,
    task: Task = SINGLE_LABEL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels (the ``task``'s unreadable label for files that failed) of every path (or sample of
    ``reader``, whose names ``paths`` are), in order, on every process. ``labels`` are as ``task`` keeps them:
    the model's own task to evaluate, or placeholder class indices (the default) to predict."""
    # The model's threads as ``start`` chose them (the machine's load observed once): decoding takes as many.
    cores = resolve_threads(replace(icfg.process(), threads=torch.get_num_threads()), icfg.num_workers)
    dataset = ImageDataset(
        paths,
        labels,
        loaded.image_size,
        report=False,  # reported once, by the caller
        threads=cores.decode,
        interpolation=loaded.info.interpolation,  # resized as the model was trained
        crop_pct=loaded.info.crop_pct,
        reader=reader,
        decode=icfg.decode or loaded.info.decode,
        task=task,
    )
    loader = make_loader(
        dataset,
        icfg.batch_size,
        train=False,
        seed=0,
        num_workers=cores.loader_workers,
        pin_memory=torch.cuda.is_available(),
    )
    # evaluation_mode: device placement and mixed precision, no DDP wrapper (nothing to synchronise).
    model = accelerator.prepare_model(loaded.model, evaluation_mode=True)
    with no_datasets_import():
        loader = accelerator.prepare_data_loader(loader)
    kept: list = []
    engine.evaluate(
        accelerator,
        model,
        loader,
        DeviceNormalize(accelerator.device, False, loaded.info.mean, loaded.info.std),
        progress=icfg.progress,
        desc=desc,
        keep=kept,
        task=task,
    )
    return torch.cat([lg for lg, _ in kept]).cpu(), torch.cat([lb for _, lb in kept]).cpu()


def unreadable_reasons(
    paths: list[str], labels: torch.Tensor, reader=None, task: Task = SINGLE_LABEL
) -> list[tuple[str, str]]:
    """(path, reason) for each file that came back unreadable (``labels`` as ``task`` keeps them), printed on
    stderr."""
    skipped = []
    for i in (~task.readable(labels)).nonzero().flatten().tolist():
        try:
            read_source(paths[i] if reader is None else reader[i])
            reason = "unreadable while predicting"  # it failed in the loader, not now
        except BadImage as e:
            reason = str(e)
        print(f"visiontune: skipped unreadable image {paths[i]}: {reason}", file=sys.stderr)
        skipped.append((paths[i], reason))
    return skipped
