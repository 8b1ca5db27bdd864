"""``visiontune audit DATA``: the wrong labels, the copies, the leaks and the outliers of a data set, found
before a model is trained on it.

The order keeps bad input cheap: the data is listed and its folds checked, a ``--test`` folder and the data
are hashed (an undecodable test image is one line) and the output folder checked, all before the first fold
trains or anything is written. Then the folds give every image its out-of-fold probabilities
(``folds``), ``issues`` turns them and the hashes into rows, and ``pages`` writes them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from visiontune.audit import folds, hashing, issues, pages
from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig

SIMILARITY = 0.998  # thumbnails this alike are near copies (hashing: copies >= 0.999, distinct digits <= 0.9963)


def _test_files(folder: str) -> list[str]:
    from visiontune.data.imageset import IMAGE_EXTENSIONS

    if not os.path.isdir(folder):
        raise UserError(f"--test {folder}: no such folder")
    found = sorted(str(p) for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not found:
        raise UserError(f"--test {folder}: no images in it")
    return found


def _check_out(out: str, resume: bool) -> None:
    if os.path.isdir(os.path.join(out, "folds")) and not resume:
        raise UserError(f"{out} holds an audit already; add --resume auto to continue it, or give another --out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file; give a folder")


def _versions() -> dict:
    import cleanlab
    import torch

    from visiontune.version import __version__

    return {"visiontune": __version__, "cleanlab": cleanlab.__version__, "torch": torch.__version__}


def audit(
    cfg: TrainConfig, out: str, test: str | None = None, similarity: float | None = None, resume: bool = False
) -> dict:
    """Audit ``cfg.data`` with ``cfg.folds`` folds into ``out`` (``resume``: continue the audit there);
    returns audit.json's contents."""
    from visiontune.data.groups import split_for
    from visiontune.data.sources import discover
    from visiontune.data.split import relative_paths
    from visiontune.tasks import reader
    from visiontune.training.plan import task_of

    similarity = SIMILARITY if similarity is None else similarity
    if not 0.0 < similarity <= 1.0:
        raise UserError(f"--similarity must be above 0 and at most 1, got {similarity}")
    images = discover(cfg.data, cfg.image_column, cfg.label_column, task=reader(cfg.task))
    task = task_of(cfg, images)  # as train resolves it: --task, or what the data was read as
    split_for(images, cfg.replace(fold=0))  # too few images (or groups) for the folds: one line now
    split, _ = split_for(images, cfg.replace(folds=0, fold=0))  # the split train would make: what a leak is
    names = relative_paths(images.paths, range(len(images)), images.root)
    where = np.full(len(images), "train", dtype=object)
    where[split.val] = "val"
    tests = _test_files(test) if test else []
    test_hashes = hashing.hash_all(tests)
    for path, failed in zip(tests, test_hashes.failed, strict=True):
        if failed is not None:
            raise UserError(f"--test {test}: {path} cannot be decoded ({failed}); remove or replace it")
    _check_out(out, resume)
    print(f"visiontune: audit hashing {len(images) + len(tests)} images", flush=True)
    data_hashes = hashing.hash_all(images.source(i) for i in range(len(images)))
    os.makedirs(out, exist_ok=True)
    probs = folds.out_of_fold(cfg, out, images, resume, task.name in issues.PROBABILITIES)

    rows = issues.label_issues(task, images, names, probs)
    both = hashing.Hashes(
        *(
            a + b if isinstance(a, list) else np.concatenate([a, b])
            for a, b in zip(
                (data_hashes.sha, data_hashes.thumb, data_hashes.spread, data_hashes.aspect, data_hashes.failed),
                (test_hashes.sha, test_hashes.thumb, test_hashes.spread, test_hashes.aspect, test_hashes.failed),
                strict=True,
            )
        )
    )
    rows += issues.duplicates([*names, *tests], [*where.tolist(), *["test"] * len(tests)], both, similarity)
    rows += issues.outliers(task, images, names, probs, data_hashes)
    counts = {k: sum(r["kind"] == k for r in rows) for k in pages.KINDS}
    summary = {
        "data": cfg.data,
        "root": images.root,  # what a run's config.json records of its data: how its report finds this audit
        "images": len(images),
        "task": task.name,
        "scored": int((~np.isnan(probs).any(1)).sum()),
        "counts": counts,
        "groups": len({r["group"] for r in rows if r["kind"] in ("duplicate", "leak")}),
        "settings": {
            "folds": cfg.folds,
            "seed": cfg.seed,
            "model": cfg.model,
            "epochs": cfg.epochs,
            "image_size": cfg.image_size,
            "similarity": similarity,
            "test": test,
        },
        "versions": _versions(),
    }
    sources = {n: images.source(i) for i, n in enumerate(names)}
    pages.write(out, rows, summary, lambda f: sources.get(f, f))
    print(
        f"visiontune: audit of {len(images)} images: " + ", ".join(f"{v} {k}" for k, v in counts.items()),
        file=sys.stdout,
    )
    print(f"visiontune: wrote {out}/audit.csv, audit.json and audit.html")
    return summary
