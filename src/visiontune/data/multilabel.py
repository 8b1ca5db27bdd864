"""Multi-label data's split: iterative stratification of its multi-hot rows [N, K] (``tasks/multi.py`` reads
the label sets and picks this split).

The split is iterative stratification (Sechidis, Tsoumakas and Vlahavas, 2011,
"On the stratification of multi-label data"), the method scikit-multilearn and
iterative-stratification implement: the rarest label still to place goes first,
each of its images to the subset that wants most of that label (ties: most
images wanted, then a seeded draw), so every label's positives are shared as
``--val-fraction`` says, as far as the label sets allow. Images with no label
come last, each to the subset that wants most images. The draws come from a
private ``numpy`` generator seeded with ``--seed``: the same listing and seed give
the same split on any machine, and the global RNG is untouched. The subsets have
the plain split's sizes exactly (``int(n * (1 - val_fraction))`` train): unlike the
published method, a subset that has all its images takes no more. Without that
rule, data of many rare labels (40 images with 3 labels each out of 10,000) cannot
be split: a label of one positive goes to the subset that wants most of it, train,
so every image does, and validation is empty. With it, the rare labels fill train
first and the images left fill validation; a label of one positive is on one side
whatever the method.
"""

from __future__ import annotations

import numpy as np


def iterative_split(targets: np.ndarray, n_val: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices, ascending, with ``n_val`` images in val: iterative stratification (module docstring)."""
    y = np.asarray(targets, bool)
    n, k = y.shape
    rng = np.random.default_rng(seed)
    ratios = np.array([(n - n_val) / n, n_val / n])  # subset 0: train, 1: val
    want = np.array([n - n_val, n_val], np.float64)  # images each subset still wants
    want_label = np.outer(ratios, y.sum(0)).astype(np.float64)  # [2, K]: positives of each label wanted
    left = np.ones(n, bool)
    side = np.full(n, -1, np.int8)
    remaining = y.sum(0).astype(np.int64)  # per label, its images not placed yet
    # A seeded order of the images, so that ties between images are broken by the seed, not the file order.
    order = rng.permutation(n)
    y_ordered = y[order]
    while True:
        open_labels = np.flatnonzero(remaining > 0)
        if not len(open_labels):
            break
        label = open_labels[np.argmin(remaining[open_labels])]  # the rarest label still to place (lowest index)
        rows = order[y_ordered[:, label] & left[order]]
        for i in rows:
            # Only a subset that still wants images may take one: otherwise a label of one positive (which
            # train, wanting 80% of it, always takes) sends every image of data made of rare labels to train.
            wanted = np.where(want > 0, want_label[:, label], -np.inf)
            best = np.flatnonzero(wanted == wanted.max())
            if len(best) > 1:
                most = want[best]
                best = best[most == most.max()]
            s = best[0] if len(best) == 1 else rng.choice(best)
            side[i], left[i] = s, False
            want[s] -= 1
            want_label[s] -= y[i]
            remaining -= y[i]
    for i in order[left[order]]:  # images without a label
        best = np.flatnonzero(want == want.max())
        s = best[0] if len(best) == 1 else rng.choice(best)
        side[i] = s
        want[s] -= 1
    return np.flatnonzero(side == 0), np.flatnonzero(side == 1)


def positives(targets: np.ndarray) -> np.ndarray:
    """How many images have each class."""
    return np.asarray(targets, np.int64).sum(0)
