"""Resuming a run: the checkpoint ``--resume`` or an elastic restart names (the newest intact one),
checked against this run (``compatible``), and loaded into the Accelerator -- model,
optimizer, scaler, every process's RNG state and the lr scheduler. Everything is read back with
``weights_only=True`` or safetensors; Accelerate's RNG files are plain tensors and numpy arrays,
and one that does not load is refused. A run resumed into another folder takes its best weights along.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from visiontune.cluster import launch, strategies
from visiontune.cluster.strategy import effective
from visiontune.errors import UserError
from visiontune.models.statedict import load_error
from visiontune.runs.checkpoint import SCHEDULER, SUBDIR, Checkpoint, latest, listed
from visiontune.settings.config import TrainConfig

# The settings that decide a training sample's random view (checked on resume, like the resize).
AUGMENTATION = ("augment", "hflip", "vflip", "crop_scale")


def _same_form(value):
    return list(value) if isinstance(value, (list, tuple)) else value  # JSON gives a list for a tuple


def _flag_text(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(f"{v:g}" for v in value)
    return "(none)" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def compatible(ckpt: Checkpoint, current: dict) -> Checkpoint:
    """``ckpt`` with its position in this run's batches; refuse a different split, model or global batch.

    ``current["batch_samples"]`` is this run's samples per loader batch over all processes. The position
    is kept in samples: with the same global batch, a checkpoint (taken at an optimizer step) lands on an
    optimizer step of any split between --batch-size, --grad-accum and processes.
    """
    meta = ckpt.meta
    what = {
        "split_sha256": "the data split (split.json sha256)",
        "model": "the model",
        "num_classes": "the number of classes",
        "global_batch": "the global batch",
    }
    for key, label in what.items():
        if meta.get(key) != current[key]:
            raise UserError(
                f"cannot resume: {label} differs from the checkpoint's ({meta.get(key)!r} there, "
                f"{current[key]!r} now); use the same data, --model, --batch-size x --grad-accum "
                "x processes, or start a new run"
            )
    if meta.get("lora") != current.get("lora"):  # adapters fit only the base and the layers they were made for
        there, here = meta.get("lora"), current.get("lora")
        raise UserError(
            f"cannot resume: the LoRA adapters differ from the checkpoint's ({_lora_text(there)} there, "
            f"{_lora_text(here)} now); resume with the run's --weights and --lora settings, or start a new run"
        )
    # The remaining steps must draw and weigh the images as the first ones did (older checkpoints: neither).
    for key, flag, default in (("sampler", "--sampler", "random"), ("class_weights", "--class-weights", None)):
        there, here = meta.get(key, default), current.get(key, default)
        if there != here:
            there, here = ("none" if v is None else v for v in (there, here))
            raise UserError(
                f"cannot resume: {flag} differs from the checkpoint's ({there!r} there, {here!r} now); "
                f"resume with the run's {flag}, or start a new run"
            )
    # The remaining steps must see the images the first ones saw; another size is a new run (--init-from).
    saved = meta.get("config", {})
    view = [k for k in ("image_size", "interpolation", "crop_pct") if k in saved and k in current]  # older: fewer
    if any(saved[k] != current[k] for k in view):
        words = {"image_size": "{} px", "interpolation": "{}", "crop_pct": "crop {}"}
        there, here = (
            " ".join("no crop" if d[k] is None else words[k].format(d[k]) for k in view) for d in (saved, current)
        )
        raise UserError(
            f"cannot resume: the images are resized differently from the checkpoint's ({there} there, {here} now);"
            " resume with the same --image-size, --interpolation and --crop-pct, or train on from its weights in"
            " a new run with --init-from"
        )
    # The rest of the epoch's draws must be the ones the first steps were drawn with: the same flips and crop.
    drawn = [k for k in AUGMENTATION if k in saved and k in current]  # checkpoints from before a setting: fewer
    changed = [k for k in drawn if _same_form(saved[k]) != _same_form(current[k])]
    if changed:
        there, here = (
            ", ".join(f"--{k.replace('_', '-')} {_flag_text(d[k])}" for k in changed) for d in (saved, current)
        )
        raise UserError(
            f"cannot resume exactly: the augmentation differs from the checkpoint's ({there} there, {here} now);"
            " resume with the checkpoint's settings, or train on from its weights in a new run with --init-from"
        )
    # The same pixels too: a checkpoint from before --decode existed decoded exactly.
    there = saved.get("decode", "exact")
    if "decode" in current and there != current["decode"]:
        raise UserError(
            f"cannot resume: the checkpoint's images were decoded with --decode {there}, this run's with "
            f"--decode {current['decode']}; resume with --decode {there}, or train on from its weights in a "
            "new run with --init-from"
        )
    # Checkpoints written before the position was kept in samples: the batch was in the saving run's units.
    samples = meta.get("samples", meta["batch"] * meta["config"]["batch_size"] * meta.get("world_size", 1))
    batch, rest = divmod(samples, current["batch_samples"])
    if rest or (batch and batch % current["grad_accum"]):
        raise UserError(
            f"cannot resume exactly: the checkpoint is {samples} samples into Epoch {meta['epoch'] + 1}, "
            f"which is not an optimizer step of --batch-size {current['batch_samples']} (all processes)"
            f" x --grad-accum {current['grad_accum']}; resume with the checkpoint's settings "
            f"(--batch-size {meta['config']['batch_size']} --grad-accum {meta['config']['grad_accum']}"
            f" on {meta.get('world_size', 1)} process(es))"
        )
    return Checkpoint(ckpt.path, {**meta, "batch": batch})


def _lora_text(lora: dict | None) -> str:
    if not lora:
        return "no --lora"
    shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in lora.items() if k != "base" and v is not None)
    return f"{shown}, frozen base {str(lora.get('base'))[:8]}"


def _check_rng_file(accelerator, ckpt: Checkpoint, say) -> None:
    """Accelerate skips an RNG file it cannot load without a word: refuse it, and say when one is missing."""
    from accelerate.utils import load as accelerate_load

    folder = Path(ckpt.path)
    missing = [r for r in range(accelerator.num_processes) if not (folder / f"random_states_{r}.pkl").is_file()]
    if missing:  # resumed on more processes than saved it: the new ones start from the seed
        say(
            f"visiontune: {ckpt.path} has no RNG state for process(es) {', '.join(map(str, missing))}; their "
            "random draws will differ from the original run's"
        )
    rng = folder / f"random_states_{accelerator.process_index}.pkl"
    if accelerator.process_index in missing:
        return
    try:
        states = accelerate_load(rng, map_location="cpu")
    except Exception as e:
        raise UserError(f"cannot load checkpoint {ckpt.path}: {rng.name}: {load_error(e)}") from None
    if not isinstance(states, dict) or not {"random_state", "torch_manual_seed"} <= set(states):
        raise UserError(f"cannot load checkpoint {ckpt.path}: {rng.name} holds no RNG states")


def load(accelerator, ckpt: Checkpoint, scheduler=None, say=print, strategy: strategies.Strategy | None = None) -> None:
    """Restore model, optimizer, scaler, RNG states (and the scheduler) from ``ckpt``, the way ``strategy``
    restores its state (by default as Accelerate saved it)."""
    strategy = strategy or strategies.one_device()
    sched_file = Path(ckpt.path) / SCHEDULER
    _check_rng_file(accelerator, ckpt, say)
    try:
        # A --lora checkpoint holds the adapters, the head and the buffers (runs.adapters checks them all there).
        strategy.load_checkpoint(accelerator, ckpt.path, strict=not ckpt.meta.get("lora"))
        if scheduler is not None and sched_file.is_file():
            strategy.load_schedule(accelerator, scheduler, str(sched_file))
    except UserError:
        raise
    except Exception as e:  # weights_only refusals, shape mismatches: the files are not this run's
        raise UserError(f"cannot load checkpoint {ckpt.path}: {load_error(e)}") from None


def find_resume(resume: str | None, run_dir: str, restarted: bool, say=print) -> Checkpoint | None:
    """What ``--resume`` (or an elastic restart) points at; None for a fresh start."""
    if resume is None and not restarted:
        if listed(run_dir):
            raise UserError(
                f"{run_dir} already holds checkpoints of a run; to continue it, add --resume auto "
                f"(with --output-dir {run_dir}); to start over, give another --output-dir"
            )
        return None
    source = run_dir if resume in (None, "auto") else resume
    if resume not in (None, "auto") and not Path(source).is_dir():
        raise UserError(f"--resume {resume}: no such run folder")
    found = latest(source, say)
    if found is None and resume not in (None, "auto"):
        raise UserError(f"--resume {resume}: no checkpoint in {source}/{SUBDIR}")
    if found is None:
        say(f"visiontune: no checkpoint in {source}; starting from the beginning")
    return found


def resumed_folder(cfg: TrainConfig, run_dir: str) -> str | None:
    """The run folder whose checkpoint this run will continue, or None for a fresh start."""
    found = find_resume(cfg.resume, run_dir, launch.restart_count() > 0, say=lambda *_: None)
    return None if found is None else os.path.dirname(os.path.dirname(found.path))


def restore(accelerator, cfg: TrainConfig, run_dir: str, current: dict, scheduler) -> Checkpoint | None:
    """Load the checkpoint ``--resume`` (or an elastic restart) names; return it or None."""
    found = find_resume(cfg.resume, run_dir, launch.restart_count() > 0, accelerator.print)
    if found is None:
        return None
    found = compatible(found, current)
    load(accelerator, found, scheduler, accelerator.print, effective(cfg))
    source = os.path.dirname(os.path.dirname(found.path))
    if accelerator.is_main_process and os.path.abspath(source) != os.path.abspath(run_dir):
        for name in ("best.pth", "best.safetensors"):  # the best epoch may be one trained there
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), os.path.join(run_dir, name))
    # The epoch as the run prints it and the checkpoint folders are named (from 1); the records keep the 0-based index.
    accelerator.print(
        f"visiontune: resuming from {found.path} (Epoch {found.epoch + 1}/{cfg.epochs}, after batch {found.batch})"
    )
    return found
