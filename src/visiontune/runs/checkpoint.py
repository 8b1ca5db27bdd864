"""Full training state on disk: written atomically, resumed to the exact batch.

A checkpoint is a folder named as the console counts epochs (from 1):
``RUN/checkpoints/epoch0001-batch0000012`` is taken in "Epoch 1/N" after 12 of its
batches (of the per-process train loader), ``epoch0001-end`` when that epoch and its
validation are done; ``ls`` lists them in order. Its ``visiontune.json`` keeps the
position as training resumes it: ``epoch`` (0-based) and ``batch``, the next batch to
run. Folders named by older visiontune (``e<epoch>-b<batch>``: that position, so the
end of the first epoch is ``e0001-b0000000``) are still found and resumed. It holds
what ``Accelerator.save_state`` writes (model, optimizer, gradient scaler, every
process's RNG state), the LR scheduler's state, and
``visiontune.json``: position, history, partial epoch totals, the split's
sha256, the model, the global batch, the config and the size and sha256 of every
other file in the folder. Every process writes into ``.tmp-<name>``; the main
process adds ``visiontune.json`` last and renames the folder, so a folder under
a final name is always complete, and a folder whose files no longer match their
recorded hashes (a truncated copy, a full disk) is skipped in favour of the
previous one. A checkpoint may come from anyone, as its run folder may: ``read_meta`` is
the one reader of ``visiontune.json`` -- at most ``MAX_META`` bytes, every field it
holds checked against ``SCHEMA`` (the files plain paths inside the folder) -- and a
checkpoint that fails is skipped as a damaged one is. Before writing, the main process checks that the disk has room
for the checkpoint; when it has not, or the disk fills up while writing, the
temp folder is removed, the previous checkpoint stays, and the run ends with
one line saying how much room it needs. The position is also recorded in
samples, so a run resumed with the same global batch split differently between
--batch-size, --grad-accum and processes starts at the same sample. Everything
is read back by ``resume``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visiontune.cluster import strategies
from visiontune.errors import UserError
from visiontune.runs import runrecords
from visiontune.runs.diskspace import MB, needed_bytes, out_of_space
from visiontune.settings.validation import check_types

SUBDIR = "checkpoints"
META = "visiontune.json"
SCHEDULER = "lr_scheduler.pt"
FORMAT = 1
_NAME = re.compile(r"^epoch(\d{4,})-(?:batch(\d{7,})|end)$")
_OLD_NAME = re.compile(r"^e(\d{4,})-b(\d{7,})$")  # before names counted from 1: the 0-based next position
MAX_META = 64 << 20  # bytes of visiontune.json: its history grows a row an epoch; a million epochs fit
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _member(name: str) -> bool:
    """A file of the checkpoint's folder (or of a folder in it), never a path out of it."""
    parts = name.split("/")
    return (
        len(name) <= 4096 and name.isprintable() and "\\" not in name and all(p not in ("", ".", "..") for p in parts)
    )


def _files(v: Any) -> bool:
    return isinstance(v, dict) and all(
        _member(k) and isinstance(x, list) and len(x) == 2 and _count(x[0]) and isinstance(x[1], str)
        and _SHA256.fullmatch(x[1]) is not None
        for k, x in v.items()
    )  # fmt: skip


def _optional(ok):
    return lambda v: v is None or ok(v)


def _reals(v: Any) -> bool:
    return isinstance(v, list) and all(_real(x) for x in v)


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= runrecords.MAX_TEXT


# visiontune.json, as ``save`` writes it (the identity a resume must match: ``training.trainer._identity``).
# Fields not named here are only compared for equality with this run's values.
SCHEMA: dict[str, tuple[Any, str]] = {
    "format": (lambda v: v == FORMAT and not isinstance(v, bool), f"{FORMAT}"),
    "files": (_files, "an object of the folder's files, each [size, sha256]"),
    "epoch": (_count, "a whole number"),
    "batch": (_count, "a whole number"),
    "samples": (_count, "a whole number"),
    "world_size": (_count, "a whole number"),
    "global_batch": (_count, "a whole number"),
    "batch_samples": (_count, "a whole number"),
    "grad_accum": (_count, "a whole number"),
    "num_classes": (_count, "a whole number"),
    "optimizer_steps": (_count, "a whole number"),
    "split_sha256": (_text, "a sha256 text"),
    "model": (_text, "a model name"),
    "sampler": (_text, "a sampler name"),
    "decode": (_text, "a decode name"),
    "history": (lambda v: isinstance(v, list), "a list of epochs"),
    "partial_totals": (_optional(_reals), "a list of numbers or null"),
    "class_weights": (_optional(_reals), "a list of numbers or null"),
    "lora": (_optional(lambda v: isinstance(v, dict)), "an object or null"),
    "config": (lambda v: isinstance(v, dict), "the run's settings, an object"),
}
_REQUIRED = ("format", "files", "epoch", "batch", "history", "config")


@dataclass(frozen=True)
class Checkpoint:
    path: str
    meta: dict

    @property
    def epoch(self) -> int:
        return self.meta["epoch"]

    @property
    def batch(self) -> int:
        return self.meta["batch"]


def name(epoch: int, batch: int) -> str:
    """The folder of the position "next: batch ``batch`` of 0-based epoch ``epoch``", named as people count."""
    if batch == 0 and epoch > 0:  # the start of an epoch is the end of the one before it
        return f"epoch{epoch:04d}-end"
    return f"epoch{epoch + 1:04d}-batch{batch:07d}"


def _order(folder: str) -> tuple[int, int, int] | None:
    """Where a checkpoint folder's name puts it, old names and new alike; None for other folders."""
    if m := _NAME.match(folder):
        return int(m[1]), m[2] is None, int(m[2] or 0)
    if m := _OLD_NAME.match(folder):
        epoch, batch = int(m[1]), int(m[2])
        return (epoch, True, 0) if batch == 0 and epoch > 0 else (epoch + 1, False, batch)
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_dir():  # a strategy's own part (a sharded EMA's ema/)
            _fsync_tree(p)
            continue
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listed(run_dir: str) -> list[str]:
    """Final-named checkpoint folders of ``run_dir``, newest first (temp folders ignored)."""
    root = Path(run_dir) / SUBDIR
    if not root.is_dir():
        return []
    found = [(key, p) for p in root.iterdir() if p.is_dir() and (key := _order(p.name)) is not None]
    return [str(p) for _, p in sorted(found, reverse=True)]


def read_meta(path: str) -> dict:
    """The checkpoint's ``visiontune.json``, bounded and checked against ``SCHEMA``; ValueError naming the first
    field that fails (``latest`` then skips the checkpoint, as a damaged one)."""
    file = Path(path) / META
    try:
        size = file.stat().st_size
        if size > MAX_META:
            raise ValueError(f"{META} is {size:,} bytes, more than any checkpoint writes ({MAX_META:,})")
        meta = json.loads(file.read_text(encoding="utf-8", errors="surrogateescape"))
    except (OSError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise ValueError(f"{META} unreadable ({e.__class__.__name__})") from None
    except ValueError as e:
        raise ValueError(f"{META} unreadable ({str(e)[:80]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{META} is not a visiontune checkpoint record")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise ValueError(f"{META} lacks {', '.join(missing)}")
    for key, (ok, wanted) in SCHEMA.items():
        if key in meta and not ok(meta[key]):
            shown = repr(meta[key])
            raise ValueError(f"{META}: {key} is {shown if len(shown) <= 60 else shown[:57] + '...'}, expected {wanted}")
    try:
        # Runs from before the named augmentations recorded `augment = true/false`, which `validate` reads still.
        settings = {k: v for k, v in meta["config"].items() if not (k == "augment" and isinstance(v, bool))}
        check_types(settings, f"{META}: config")
        runrecords.check_history(meta["history"], f"{META}: history")
    except UserError as e:
        raise ValueError(str(e)) from None
    # What resume names the position by (and counts it from, in checkpoints from before it was kept in samples).
    if not all(_count(meta["config"].get(k)) and meta["config"][k] > 0 for k in ("batch_size", "grad_accum")):
        raise ValueError(f"{META}: config lacks the batch size and gradient accumulation of its position")
    return meta


def verify(path: str) -> dict:
    """The checkpoint's metadata, or ValueError naming what is missing or damaged."""
    folder = Path(path)
    meta = read_meta(path)
    for fname, (size, digest) in meta["files"].items():
        f = folder / fname
        if not f.is_file():
            raise ValueError(f"{fname} is missing")
        if f.stat().st_size != size:
            raise ValueError(f"{fname} has {f.stat().st_size} bytes, expected {size} (truncated?)")
        if _sha256(f) != digest:
            raise ValueError(f"{fname} does not match its recorded sha256")
    return meta


def latest(run_dir: str, say=print) -> Checkpoint | None:
    """The newest intact checkpoint; each damaged newer one is named through ``say``."""
    skipped = []
    for path in listed(run_dir):
        try:
            meta = verify(path)
        except ValueError as e:
            skipped.append(path)
            say(f"visiontune: checkpoint {path} is unusable ({e}); trying the previous one")
            continue
        if skipped:
            say(f"visiontune: falling back to checkpoint {path}")
        return Checkpoint(path, meta)
    if skipped:
        raise UserError(
            f"no intact checkpoint in {run_dir}/{SUBDIR} ({len(skipped)} damaged); start over "
            f"in a new folder: the same command with --output-dir NEW_DIR and without --resume"
        )
    return None


def _free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _no_space(root: Path, what: str, needed: int, free: int) -> UserError:
    previous = listed(str(root.parent))
    kept = f"{previous[0]} is kept" if previous else "no earlier checkpoint exists"
    return UserError(
        f"no space left on the disk of {root} for checkpoint {what}: it needs about "
        f"{needed / MB:.0f} MB, {free / MB:.0f} MB are free; {kept}. Free some space "
        f"(or move the run folder) and continue with --resume {root.parent}"
    )


def save(
    accelerator,
    run_dir: str,
    epoch: int,
    batch: int,
    meta: dict[str, Any],
    scheduler=None,
    keep_last: int = 2,
    strategy: strategies.Strategy | None = None,
) -> str:
    """Write a checkpoint from every process (a collective), the way ``strategy`` takes its state (by default
    every process's whole state, as Accelerate saves it); return its final path."""
    strategy = strategy or strategies.one_device()
    from accelerate.utils import broadcast_object_list

    root = Path(run_dir) / SUBDIR
    final, tmp = root / name(epoch, batch), root / f".tmp-{name(epoch, batch)}"
    needed, problem = needed_bytes(accelerator), [None]
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a killed process; this run holds the folder's lock
            shutil.rmtree(stale, ignore_errors=True)
        if _free_bytes(root) < needed:
            problem = [str(_no_space(root, final.name, needed, _free_bytes(root)))]
        else:
            tmp.mkdir()
    if accelerator.num_processes > 1:
        broadcast_object_list(problem)  # every process stops here, not in the next collective
    if problem[0]:
        raise UserError(problem[0])
    accelerator.wait_for_everyone()
    try:
        strategy.save_checkpoint(accelerator, str(tmp))  # each process writes its own RNG file
        if scheduler is not None:
            strategy.save_schedule(accelerator, scheduler.state_dict(), str(tmp / SCHEDULER))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            # Every file, those a strategy keeps in a folder of its own too (a sharded EMA's ``ema/``).
            written = sorted(p for p in tmp.rglob("*") if p.is_file())
            files = {p.relative_to(tmp).as_posix(): [p.stat().st_size, _sha256(p)] for p in written}
            record = {"format": FORMAT, "epoch": epoch, "batch": batch, **meta, "files": files}
            if "batch_samples" in meta:  # the position in the units any split of the global batch shares
                record["samples"] = batch * meta["batch_samples"]
            (tmp / META).write_text(json.dumps(record, indent=1, default=str))
            _fsync_tree(tmp)
    except (OSError, RuntimeError) as e:
        full, free = out_of_space(e, tmp, needed), shutil.disk_usage(root).free
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise _no_space(root, final.name, needed, free) from None
        raise
    if accelerator.is_main_process:
        _publish(tmp, final)
        for old in listed(run_dir)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return str(final)


def _publish(tmp: Path, final: Path) -> None:
    # A resumed run can reach a position it saved before: swap, never delete first.
    if final.exists():
        trash = final.with_name(f".old-{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
