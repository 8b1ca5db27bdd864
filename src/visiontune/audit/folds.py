"""Out-of-fold probabilities: K ordinary training runs (``--folds K --fold I``), each scoring the fold it held out.

Each fold is a run of ``training.job.run`` -- the one entry of ``visiontune train``, so ``--strategy ddp``
starts its workers per fold as train does -- into ``FOLDER/folds/fold-I``, then its best model scores that
run's own validation images (its ``split.json``) through ``inference.loaded``: no model scores an image it
trained on. The probabilities are kept beside the run (``oof.npz``: the images' indices in the listing and
their rows), so a stopped audit continues at the fold it stopped in: a fold with its probabilities is read
back, a trained fold is scored, a fold stopped mid-training resumes from its last checkpoint. The file is
read back as untrusted (no pickle, its shape, bounds and values checked): one line when it is not a fold's.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig

OOF = "oof.npz"


def fold_dir(out: str, fold: int) -> str:
    return os.path.join(out, "folds", f"fold-{fold}")


def read_oof(path: str, n: int, width: int, unit: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A fold's saved (indices, probabilities), checked against the listing's ``n`` images and ``width`` columns
    (``unit``: each a probability; a regression's values are any finite numbers)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            idx, probs = z["index"], z["probs"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, NotImplementedError) as e:
        raise UserError(
            f"{path}: not a fold's probabilities ({str(e)[:120]}); delete it to score the fold again"
        ) from None
    ok = (
        idx.ndim == 1
        and idx.dtype.kind == "i"
        and probs.shape == (len(idx), width)
        and probs.dtype.kind == "f"
        and (len(idx) == 0 or (idx.min() >= 0 and idx.max() < n))
        and len(np.unique(idx)) == len(idx)
        and np.isfinite(probs).all()
        and (not unit or ((probs >= 0) & (probs <= 1)).all())
    )
    if not ok:
        raise UserError(f"{path}: not this data's fold probabilities; delete it to score the fold again")
    return idx.astype(np.int64), probs.astype(np.float64)


def _score(run: str, images, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """The fold's best model on its own validation images: their indices in ``images`` and probabilities."""
    from visiontune.inference import loaded as inference
    from visiontune.inference.evaluate import select

    model = inference.load_model(run)
    chosen, _ = select(images, run, "val")
    where = {p: i for i, p in enumerate(images.paths)}
    idx = np.asarray([where[p] for p in chosen.paths], np.int64)
    icfg = inference.InferenceConfig(model.batch_size, "no", cfg.progress, num_workers=cfg.num_workers)
    accelerator = inference.start(icfg)
    paths, labels, task = list(chosen.paths), chosen.label_array, model.info.task
    logits, got = inference.forward(accelerator, model, icfg, paths, labels, "score", chosen.reader, task)
    readable = task.readable(got).numpy()  # an image the loader could not read gets no probabilities
    probs = task.probabilities(logits).numpy()
    return idx[readable], probs[readable]


def out_of_fold(cfg: TrainConfig, out: str, images, resume: bool, unit: bool = True) -> np.ndarray:
    """[N, C] probabilities (a regression's values) of every image from the fold that held it out (NaN rows:
    images no fold could read). ``cfg`` is the audit's training request; ``resume``: continue folds found in
    ``out``; ``unit``: the rows are probabilities."""
    from visiontune.training import job

    n, width = len(images), len(images.classes)
    probs = np.full((n, width), np.nan)
    for fold in range(cfg.folds):
        run = fold_dir(out, fold)
        saved = os.path.join(run, OOF)
        if not (resume and os.path.isfile(saved)):
            if not (resume and Path(run, "summary.json").is_file()):  # trained already: only to be scored
                fold_cfg = cfg.replace(fold=fold, output_dir=run, resume="auto" if resume else None)
                print(f"visiontune: audit fold {fold} of {cfg.folds} (folds 0 to {cfg.folds - 1}): {run}", flush=True)
                job.summary_of(job.run(fold_cfg))
            idx, rows = _score(run, images, cfg)
            from visiontune.files import atomic_file

            with atomic_file(saved) as f:
                np.savez(f, index=idx, probs=rows)
        idx, rows = read_oof(saved, n, width, unit)
        probs[idx] = rows
    return probs
