"""What the audit flags, as rows: probable label errors, duplicate groups and leaks, outliers.

Label issues are cleanlab's confident learning on the out-of-fold probabilities (``find_label_issues``,
ranked by ``get_label_quality_scores``), with the task's own labels: class indices for a single-label set,
label sets for a multi-label one; a regression's are its largest out-of-fold errors. Each task's way is one function in
``LABELS``, keyed by the task's name, as the report's sections are. Outliers are cleanlab's
out-of-distribution score from the same probabilities (the lowest ``OUTLIER_SHARE``), and images that are
blank, nearly constant or a thin strip whatever any model says.

A row's ``score`` reads by its kind: ``label``, cleanlab's label quality (0: surely wrong); ``outlier``,
cleanlab's out-of-distribution score (0: most atypical; 0 too for a degenerate image); a regression's
``label`` rows, the out-of-fold error in the targets' units (largest first); ``duplicate`` and
``leak``, how alike the group's closest pair is (1: the same bytes). Each kind is listed worst first.
"""

from __future__ import annotations

import numpy as np

from visiontune.audit import hashing

OUTLIER_SHARE = 0.01  # the share of images flagged as the most atypical (at least one)
FIELDS = ("file", "kind", "score", "given", "suggested", "probability", "group", "split", "note")


def _row(file: str, kind: str, score: float, **more) -> dict:
    return {"file": file, "kind": kind, "score": round(float(score), 6), **more}


def _single(images, names: list[str], probs: np.ndarray, scored: np.ndarray) -> list[dict]:
    from cleanlab.filter import find_label_issues
    from cleanlab.rank import get_label_quality_scores

    labels, p = images.labels[scored], probs[scored]
    flagged = find_label_issues(labels, p, n_jobs=1)  # no process pool: see _multi
    quality = get_label_quality_scores(labels, p)
    rows = []
    for j in np.flatnonzero(flagged)[np.argsort(quality[flagged], kind="stable")]:
        best = int(p[j].argmax())
        i = int(scored[j])
        rows.append(
            _row(
                names[i],
                "label",
                quality[j],
                given=images.classes[labels[j]],
                suggested=images.classes[best],
                probability=round(float(p[j, best]), 6),
            )
        )
    return rows


def _multi(images, names: list[str], probs: np.ndarray, scored: np.ndarray) -> list[dict]:
    from cleanlab.filter import find_label_issues
    from cleanlab.multilabel_classification.rank import get_label_quality_scores

    sets = [np.flatnonzero(images.targets[i]).tolist() for i in scored]
    p = probs[scored]
    # n_jobs=1: cleanlab's default forks a multiprocessing pool from this process, whose torch and loader
    # threads may hold a lock at the fork; a pool worker then waits on it for ever (seen as a hung audit).
    flagged = find_label_issues(sets, p, multi_label=True, n_jobs=1)
    quality = get_label_quality_scores(sets, p)
    words = lambda idx: ";".join(images.classes[k] for k in idx)  # noqa: E731 -- a label set as a manifest writes it
    rows = []
    for j in np.flatnonzero(flagged)[np.argsort(quality[flagged], kind="stable")]:
        predicted = np.flatnonzero(p[j] >= 0.5)
        rows.append(
            _row(
                names[int(scored[j])],
                "label",
                quality[j],
                given=words(sets[j]),
                suggested=words(predicted),
                probability=round(float(p[j][predicted].min()) if len(predicted) else float(p[j].max()), 6),
            )
        )
    return rows


def _residuals(images, names: list[str], values: np.ndarray, scored: np.ndarray) -> list[dict]:
    """A regression's largest out-of-fold errors: those more than ``RESIDUAL_Z`` robust deviations (1.4826
    times the median absolute deviation) above the median error, largest first; the score is the error, in
    the targets' units (the mean over the targets)."""
    given, predicted = images.targets[scored].astype(np.float64), values[scored]
    error = np.abs(predicted - given).mean(1)
    spread = 1.4826 * np.median(np.abs(error - np.median(error))) or float(error.std()) or 1.0
    rows = []
    for j in np.argsort(-error, kind="stable"):
        if (error[j] - np.median(error)) / spread <= RESIDUAL_Z:
            break
        rows.append(
            _row(
                names[int(scored[j])],
                "label",
                error[j],
                given=";".join(f"{v:.6g}" for v in given[j]),
                suggested=";".join(f"{v:.6g}" for v in predicted[j]),
            )
        )
    return rows


RESIDUAL_Z = 3.0
# Each task's label issues, keyed by its name (as the report's sections are); the tasks whose out-of-fold
# rows are probabilities (cleanlab's input), and the one whose images cleanlab's out-of-distribution
# score is made for (one class an image).
LABELS = {"classify": _single, "multilabel": _multi, "regress": _residuals}
PROBABILITIES = frozenset({"classify", "multilabel"})
ONE_CLASS = "classify"


def label_issues(task, images, names: list[str], probs: np.ndarray) -> list[dict]:
    """Probable label errors among the images that have out-of-fold probabilities, worst first; ``names``:
    each image as the rows name it."""
    scored = np.flatnonzero(~np.isnan(probs).any(1))
    return LABELS[task.name](images, names, probs, scored)


def outliers(task, images, names: list[str], probs: np.ndarray, hashes: hashing.Hashes) -> list[dict]:
    """Degenerate images, then the most atypical by cleanlab's out-of-distribution score (single-label)."""
    rows = []
    for i in range(len(images)):
        if hashes.failed[i] is not None:
            continue
        if hashes.spread[i] < hashing.FLAT_STD:
            rows.append(
                _row(names[i], "outlier", 0.0, note=f"blank or nearly constant (spread {hashes.spread[i]:.1f})")
            )
        elif hashes.aspect[i] > hashing.MAX_ASPECT:
            rows.append(_row(names[i], "outlier", 0.0, note=f"extreme aspect ratio ({hashes.aspect[i]:.1f}:1)"))
    if task.name != ONE_CLASS:  # cleanlab's score from probabilities assumes one class an image
        return rows
    from cleanlab.outlier import OutOfDistribution

    scored = np.flatnonzero(~np.isnan(probs).any(1))
    score = OutOfDistribution().fit_score(pred_probs=probs[scored], labels=images.labels[scored], verbose=False)
    shown = {r["file"] for r in rows}
    for j in np.argsort(score, kind="stable")[: max(1, round(OUTLIER_SHARE * len(scored)))]:
        file = names[int(scored[j])]
        if file not in shown:
            rows.append(_row(file, "outlier", score[j], note="far from every class"))
    return rows


def duplicates(names: list[str], splits: list[str], hashes: hashing.Hashes, similarity: float) -> list[dict]:
    """Every member of each group of copies: ``leak`` where a group spans train and val (or test), else
    ``duplicate``; groups numbered from 1, the closest first."""
    found = []
    for members in hashing.groups(hashes, similarity):
        thumbs = hashes.thumb[members]
        alike = thumbs @ thumbs.T
        np.fill_diagonal(alike, -1.0)
        exact = len({hashes.sha[m] for m in members}) < len(members)
        closest = 1.0 if exact else float(np.clip(alike.max(), -1.0, 1.0))
        where = {splits[m] for m in members}
        kind = "leak" if "train" in where and len(where) > 1 else "duplicate"
        found.append((kind != "leak", -closest, members, kind, closest))
    rows = []
    for number, (_, _, members, kind, closest) in enumerate(sorted(found, key=lambda f: f[:2]), 1):
        for m in members:
            rows.append(_row(names[m], kind, closest, group=number, split=splits[m]))
    return rows
