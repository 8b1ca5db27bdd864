"""``visiontune predict``: a trained model over a folder, a file list, Kaggle's ``test/``, every row of an
``hf:`` data set or every sample of tar shards.

The model and the forward pass come from ``inference`` (training's own image
code, sharded over N processes and gathered back in input order), so the
output file has the same bytes however many processes made it. An unreadable
file keeps its row, which says "no prediction", and is listed on stderr and in
``OUT.skipped.txt``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visiontune import files
from visiontune.data.imageset import IMAGE_EXTENSIONS
from visiontune.data.pathlist import read_list
from visiontune.errors import UserError
from visiontune.inference import loaded as inference
from visiontune.inference import tta
from visiontune.inference.loaded import InferenceConfig, LoadedModel, unreadable_reasons
from visiontune.tasks import UNREADABLE


@dataclass(frozen=True)
class Inputs:
    paths: list[str]
    kaggle_ids: list[int] | None  # a Kaggle test folder (every file <number>.<ext>): rows are id,label
    reader: Any = None  # data in a container: paths are the samples' names, reader[i] their bytes


def list_inputs(data: str, columns: tuple[str | None, str | None] = (None, None)) -> Inputs:
    """A folder (images anywhere below it, a folder in an object store included), one image, a text file
    listing one path per line, every row of every split of ``hf:`` data, or every sample of tar shards."""
    from visiontune.data import sources

    source = sources.find(data)
    local = source.folder_copy(data) if source.folder_copy else None
    if local is not None:  # a folder in an object store: its copy's images, named by their URLs
        inputs = _folder(Path(local), data)
        names = [f"{data.rstrip('/')}/{Path(p).relative_to(local).as_posix()}" for p in inputs.paths]
        return Inputs(names, inputs.kaggle_ids, inputs.paths)
    if source.container:  # hf: data, shards: listed as train lists them
        from visiontune.tasks import AUTO  # the labels are not used: read as they say they are

        images = sources.discover(data, *columns, every_split=True, task=AUTO)
        return Inputs(list(images.paths), None, images.reader)
    p = Path(data)
    if p.is_dir():
        return _folder(p, data)
    if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS:
        return Inputs([str(p)], None)
    if p.is_file():
        return Inputs(read_list(data), None)
    raise UserError(f"not found: {data} (expected a folder of images, an image, or a file listing image paths)")


def _folder(p: Path, data: str) -> Inputs:
    """The images anywhere below the folder ``p`` (hidden ones aside), in Kaggle's id order where every file
    is ``<number>.<ext>``."""
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file()
        and f.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        raise UserError(f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in {data}")
    if all(f.parent == p and f.stem.isdigit() for f in files):
        files.sort(key=lambda f: int(f.stem))  # Kaggle's ids: 2.jpg before 10.jpg
        return Inputs([str(f) for f in files], [int(f.stem) for f in files])
    return Inputs([str(f) for f in files], None)


def list_many(items: list[str], columns: tuple[str | None, str | None] = (None, None)) -> Inputs:
    """``list_inputs`` of one item, or the images of several (files or folders) in the order given."""
    if len(items) == 1:
        return list_inputs(items[0], columns)
    listed = [list_inputs(item, columns) for item in items]
    if any(inputs.reader is not None for inputs in listed):
        raise UserError(
            "hf: data, tar shards and object-store data are predicted on their own: give them alone as --data"
        )
    return Inputs([path for inputs in listed for path in inputs.paths], None)


def check_clip(clip: float) -> None:
    if not 0.0 <= clip < 0.5:
        raise UserError(f"--clip must be in [0, 0.5), got {clip}")


def skipped_path(out: str) -> Path:
    return Path(f"{out}.skipped.txt")


def predict(
    loaded: LoadedModel,
    icfg: InferenceConfig,
    inputs: Inputs,
    out: str | None,
    clip: float = 0.0,
    tta_mode: str = "none",
) -> int:
    """Write ``out`` (and ``out.skipped.txt`` when files were unreadable), or with no ``out`` the CSV on
    stdout and the rest on stderr; return how many were skipped."""
    check_clip(clip)
    classes = loaded.classes
    accelerator = inference.start(icfg)
    logits, labels = inference.forward(
        accelerator,
        tta.wrap_loaded(loaded, tta_mode),
        icfg,
        inputs.paths,
        [0] * len(inputs.paths),
        "predict",
        inputs.reader,
    )
    readable = labels != UNREADABLE
    skipped = []
    if accelerator.is_main_process:
        skipped = unreadable_reasons(inputs.paths, labels, inputs.reader)
        task = loaded.info.task
        probs = task.probabilities(logits)
        rows = task.csv_text(
            inputs.paths, classes, probs, readable, loaded.info.decision_thresholds, clip, inputs.kaggle_ids
        )
        if out is None:  # a pipe's data: the CSV alone on stdout
            sys.stdout.write(rows)
            sys.stdout.flush()
            print(
                f"visiontune: predicted {int(readable.sum())} of {len(inputs.paths)} images"
                + "".join(f"\nvisiontune: unreadable {p}: {r}" for p, r in skipped),
                file=sys.stderr,
            )
            accelerator.wait_for_everyone()
            return int((~readable).sum())
        files.atomic_write(out, rows)
        if skipped:
            files.atomic_write(skipped_path(out), "".join(f"{p}\t{r}\n" for p, r in skipped))
        else:
            skipped_path(out).unlink(missing_ok=True)  # an earlier run's list would now be wrong
        print(
            f"visiontune: predicted {int(readable.sum())} of {len(inputs.paths)} images -> {out}"
            + (f"; {len(skipped)} unreadable, listed in {skipped_path(out)}" if skipped else "")
        )
    accelerator.wait_for_everyone()
    return int((~readable).sum())
