"""``visiontune predict``: a trained model over a folder, a file list or Kaggle's ``test/``.

A run folder loads without unpickling anything: ``best.safetensors`` (or a
``.pth`` read with ``weights_only=True``), ``config.json`` for the model name
and image size, ``classes.json`` for the class names. Images go through
training's own code -- ``read_image`` and ``resize_uint8`` in the loader,
``DeviceNormalize`` on the device -- and the forward pass is
``engine.evaluate``'s, so with N processes Accelerate shards the files and
``gather_for_metrics`` hands every prediction back exactly once, in input
order: the output file has the same bytes however many processes made it. An
unreadable file keeps its slot (a blank image labelled ``UNREADABLE``) so the
sharding and the order stay the same; its row says "no prediction" and the
file is listed on stderr and in ``OUT.skipped.txt``.
"""
from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from visiontune import engine, outputs
from visiontune.config import TrainConfig, UserError, load_config_file
from visiontune.data.decode import IMAGE_EXTENSIONS, BadImage, read_image
from visiontune.data.pipeline import UNREADABLE, DeviceNormalize, ImageDataset, make_loader
from visiontune.models import build_model
from visiontune.strategy import decode_threads, loader_workers, make_accelerator

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt")


def _check_classes(classes, where: str) -> list[str]:
    if not (isinstance(classes, list) and len(classes) >= 2 and all(isinstance(c, str) and c for c in classes)):
        raise UserError(f"{where}: expected at least two class names, got {classes!r}")
    return classes


def load_run(run_dir: str) -> tuple[nn.Module, TrainConfig, list[str]]:
    """The run's best model (eval mode, CPU), its training config and its class names."""
    run = Path(run_dir)
    for name in ("config.json", "classes.json"):
        if not (run / name).is_file():
            raise UserError(f"{run_dir} is not a visiontune run folder ({name} is missing)")
    cfg = TrainConfig(**load_config_file(str(run / "config.json")))
    try:
        classes = json.loads((run / "classes.json").read_text())
    except ValueError as e:
        raise UserError(f"cannot parse {run / 'classes.json'}: {e}") from None
    _check_classes(classes, str(run / "classes.json"))
    weights = next((run / f"best{s}" for s in (".safetensors", ".pth") if (run / f"best{s}").is_file()), None)
    if weights is None:
        raise UserError(f"{run_dir} has no best.safetensors or best.pth: did its training finish an epoch?")
    return build_model(cfg.model, len(classes), str(weights)).eval(), cfg, classes


def load_weights(weights: str, model: str, classes: list[str], image_size: int) -> tuple[nn.Module, TrainConfig,
                                                                                          list[str]]:
    """``--weights FILE --model NAME --classes a,b``: a state_dict saved outside a run folder."""
    if Path(weights).suffix not in WEIGHT_SUFFIXES:
        raise UserError(f"--weights must be a {'/'.join(WEIGHT_SUFFIXES)} file, got {weights!r}")
    _check_classes(classes, "--classes")
    if image_size < 1:
        raise UserError(f"--image-size must be a positive integer, got {image_size}")
    cfg = TrainConfig(data="", model=model, weights=weights, image_size=image_size)
    return build_model(model, len(classes), weights).eval(), cfg, classes


@dataclass(frozen=True)
class Inputs:
    paths: list[str]
    kaggle_ids: list[int] | None  # a Kaggle test folder (every file <number>.<ext>): rows are id,label


def list_inputs(data: str) -> Inputs:
    """A folder (images anywhere below it), one image, or a text file listing one path per line."""
    p = Path(data)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise UserError(f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in {data}")
        if all(f.parent == p and f.stem.isdigit() for f in files):
            files.sort(key=lambda f: int(f.stem))  # Kaggle's ids: 2.jpg before 10.jpg
            return Inputs([str(f) for f in files], [int(f.stem) for f in files])
        return Inputs([str(f) for f in files], None)
    if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS:
        return Inputs([str(p)], None)
    if p.is_file():
        lines = [line.strip() for line in p.read_text(errors="replace").splitlines()]
        paths = [line for line in lines if line and not line.startswith("#")]
        if not paths:
            raise UserError(f"{data}: no paths listed; expected one image path per line")
        return Inputs(paths, None)
    raise UserError(f"not found: {data} (expected a folder of images, an image, or a file listing image paths)")


def forward_all(cfg: TrainConfig, model: nn.Module, paths: list[str], labels: list[int], *, batch_size: int,
                progress: bool, desc: str):
    """Logits and labels of every path, in order, on every process; and the Accelerator."""
    accelerator = make_accelerator(cfg)
    dataset = ImageDataset(paths, labels, cfg.image_size, report=False,  # reported once, below
                           threads=decode_threads(cfg))
    loader = make_loader(dataset, batch_size, train=False, seed=cfg.seed, num_workers=loader_workers(cfg),
                         pin_memory=torch.cuda.is_available())
    # evaluation_mode: device placement and mixed precision, no DDP wrapper (nothing to synchronise).
    model = accelerator.prepare_model(model, evaluation_mode=True)
    loader = accelerator.prepare_data_loader(loader)
    kept: list = []
    engine.evaluate(accelerator, model, loader, DeviceNormalize(accelerator.device), progress=progress,
                    desc=desc, keep=kept)
    logits = torch.cat([lg for lg, _ in kept]).cpu()
    return accelerator, logits, torch.cat([lb for _, lb in kept]).cpu()


def unreadable_reasons(paths: list[str], labels: torch.Tensor) -> list[tuple[str, str]]:
    """(path, reason) for each file that came back ``UNREADABLE``, printed on stderr."""
    skipped = []
    for i in (labels == UNREADABLE).nonzero().flatten().tolist():
        try:
            read_image(paths[i])
            reason = "unreadable while predicting"  # it failed in the loader, not now
        except BadImage as e:
            reason = str(e)
        print(f"visiontune: skipped unreadable image {paths[i]}: {reason}", file=sys.stderr)
        skipped.append((paths[i], reason))
    return skipped


def positive_class(classes: list[str]) -> int:
    """Kaggle's ``label`` is P(dog); for other two-class models, P(the second class)."""
    lower = [c.lower() for c in classes]
    return lower.index("dog") if "dog" in lower else 1


def check_clip(clip: float) -> None:
    if not 0.0 <= clip < 0.5:
        raise UserError(f"--clip must be in [0, 0.5), got {clip}")


def format_rows(inputs: Inputs, classes: list[str], probs: torch.Tensor, readable: torch.Tensor,
                clip: float) -> str:
    """The CSV text: ``id,label`` for a Kaggle test folder, else ``path,prediction,prob_<class>...``."""
    predicted = probs.argmax(1).tolist()
    probs = probs.clamp(clip, 1 - clip) if clip > 0 else probs
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if inputs.kaggle_ids is not None and len(classes) == 2:
        pos = positive_class(classes)
        w.writerow(["id", "label"])
        for i, ok, p in zip(inputs.kaggle_ids, readable.tolist(), probs[:, pos].tolist()):
            w.writerow([i, f"{p if ok else 0.5:.6f}"])  # 0.5: the log-loss-safest guess for a missing image
        return buf.getvalue()
    w.writerow(["path", "prediction", *(f"prob_{c}" for c in classes)])
    for path, ok, c, row in zip(inputs.paths, readable.tolist(), predicted, probs.tolist()):
        if ok:
            w.writerow([path, classes[c], *(f"{p:.6f}" for p in row)])
        else:  # no prediction: empty fields rather than numbers that look real
            w.writerow([path, "", *([""] * len(classes))])
    return buf.getvalue()


def skipped_path(out: str) -> Path:
    return Path(f"{out}.skipped.txt")


def predict(model: nn.Module, cfg: TrainConfig, classes: list[str], inputs: Inputs, out: str, *,
            batch_size: int, clip: float = 0.0, progress: bool = True, tta_mode: str = "none") -> int:
    """Write ``out`` (and ``out.skipped.txt`` when files were unreadable); return how many were skipped."""
    from visiontune import tta

    check_clip(clip)
    accelerator, logits, labels = forward_all(cfg, tta.wrap(model, tta_mode), inputs.paths, [0] * len(inputs.paths),
                                              batch_size=batch_size, progress=progress, desc="predict")
    readable = labels != UNREADABLE
    skipped = []
    if accelerator.is_main_process:
        skipped = unreadable_reasons(inputs.paths, labels)
        outputs.atomic_write(out, format_rows(inputs, classes, logits.softmax(1), readable, clip))
        if skipped:
            outputs.atomic_write(skipped_path(out), "".join(f"{p}\t{r}\n" for p, r in skipped))
        else:
            skipped_path(out).unlink(missing_ok=True)  # an earlier run's list would now be wrong
        print(f"visiontune: predicted {int(readable.sum())} of {len(inputs.paths)} images -> {out}"
              + (f"; {len(skipped)} unreadable, listed in {skipped_path(out)}" if skipped else ""))
    accelerator.wait_for_everyone()
    return int((~readable).sum())
