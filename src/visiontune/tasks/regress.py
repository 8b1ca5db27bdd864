"""Image regression: one or more numbers an image, float32 rows [N, T].

Its labels are numbers: a manifest's columns after the file name (``filename,value`` or
``filename,age,score``: a header names them, else they are ``value`` or ``value1``, ``value2``...), or an
``hf:`` numeric column. Every cell must be a finite number: an empty, NaN or non-numeric one is one line
naming its file and row. The split holds out the same share of each quantile bin of the (first) target, so
that the val split spans the range as the train split does.

The model learns the targets standardised by the train split's mean and standard deviation (``fitted``),
so one lr suits targets in any unit; its output is that standardised value, and everything a person or a
program reads is back in the targets' units: the metrics (MAE, RMSE and R², counted from every gathered
output, each val image once), predict's values, the API's and serve's answers, and an exported graph,
which ends in the affine map back (``activation``). The loss is MSE, L1 or Huber (``--loss``) on the
standardised targets. An unreadable sample's row is NaN. The "accuracy" a run's epochs record is the
mean absolute error, in the targets' units (lower is better: ``--best-metric auto`` is mae).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from visiontune.data.imageset import Cells, Labelled
from visiontune.errors import UserError
from visiontune.tasks._torch import F, nn, torch
from visiontune.tasks.base import Loss, Task
from visiontune.tasks.single import refuse_class_cells
from visiontune.text import printable

LOSSES = {"mse": "mse_loss", "l1": "l1_loss", "huber": "huber_loss"}  # --loss: torch.nn.functional's


BINS = 10  # quantile bins the split stratifies by (fewer when there are few images)
QUANTILES = "stratified by quantile bins of the target: each bin held out at --val-fraction (tasks/regress.py)"


def target_names(header: list[str] | None, count: int) -> list[str]:
    """The targets' names: a header's, else ``value`` (one) or ``value1``.. (several)."""
    if header is not None:
        return [c.strip() for c in header]
    return ["value"] if count == 1 else [f"value{i + 1}" for i in range(count)]


def _number(cell) -> float | None:
    if isinstance(cell, bool):
        return None
    try:
        v = float(cell.strip() if isinstance(cell, str) else cell)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def parse_numbers(cells: list[str], where: str) -> list[float]:
    """A row's target cells as numbers; else one line naming ``where`` (the file and row)."""
    out = []
    for cell in cells:
        v = _number(cell)
        if v is None:
            what = "empty" if not cell.strip() else f"{cell.strip()[:40]!r}, not a finite number"
            raise UserError(f"{where}: target {what}; give every image a number (regression data)")
        out.append(v)
    return out


def quantile_bins(values: np.ndarray, val_fraction: float) -> np.ndarray:
    """int per image: its quantile bin of the first target (as many bins as keep two val images in each)."""
    first = np.asarray(values, np.float64).reshape(len(values), -1)[:, 0]
    bins = max(1, min(BINS, int(len(first) * val_fraction) // 2))
    edges = np.quantile(first, np.linspace(0, 1, bins + 1)[1:-1]) if bins > 1 else np.array([])
    return np.searchsorted(edges, first, side="right").astype(np.int64)


def _finite_list(v, n: int | None) -> bool:
    return (
        isinstance(v, list)
        and (n is None or len(v) == n)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
    )


class Regression(Task):
    name, title, min_classes, classes_word = "regress", "regression", 1, "targets"
    supports_label_smoothing = False
    # an exported file is scored by the share of images it answers within a tenth of a standard deviation
    ranks, thresholded, accuracy_name = True, False, "share_within_a_tenth_std"
    best_metric, metrics = "mae", ("mae", "rmse", "r2", "loss")
    score_key, score_name, lower_is_better = "mae", "MAE", True
    curves = (("rmse", "RMSE"), ("r2", "R²"))
    accuracy_title, labels_per_image = "Mean absolute error (the targets' units)", "numbers"
    # the Hub folder's model answers in the targets' units: the map back is folded into its last layer
    card_verb, activation_code = "predict", "logits"
    card_note = (
        "A regression model: its output is each target in its own units (the map back from the standardised "
        "targets it learnt is folded into its last layer; an exported file ends in it too); the model file "
        "records the train split's mean and std (`visiontune.task_state`)."
    )

    def __init__(self, loss: str = "mse", mean=None, std=None, folded: bool = False):
        # ``folded``: the model's output is already in the targets' units (``folded_into`` its last layer)
        self.loss, self.mean, self.std, self.folded = loss, mean, std, folded

    # -- the run's settings and its train split --

    def refusal(self, cfg) -> str | None:
        for flag, value in (("--cutmix", cfg.cutmix), ("--label-smoothing", cfg.label_smoothing)):
            if value:
                return f"{flag} has no meaning for regression (--task regress): drop it (--mixup mixes targets)"
        if cfg.class_weights != "none":
            return "--class-weights weighs classes, and regression has none: drop it"
        return None

    def configured(self, cfg) -> Regression:
        return type(self)(cfg.loss or "mse", self.mean, self.std)  # (a folded model is not trained on)

    def fitted(self, labels) -> Regression:
        y = np.asarray(labels, np.float64).reshape(len(labels), -1)
        y = y[np.isfinite(y).all(1)]
        mean = y.mean(0) if len(y) else np.zeros(y.shape[1])
        std = y.std(0) if len(y) else np.ones(y.shape[1])
        std = np.where(std > 1e-12, std, 1.0)  # a constant target: learnt as its offset alone
        return type(self)(self.loss, mean.tolist(), std.tolist())

    def state(self) -> dict:
        if self.mean is None:
            return {}
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "loss": self.loss,
            **({"folded": True} if self.folded else {}),
        }

    def restored(self, state: dict, outputs: int) -> Regression:
        mean, std, loss = state.get("mean"), state.get("std"), state.get("loss", "mse")
        if not (_finite_list(mean, outputs) and _finite_list(std, outputs) and all(s > 0 for s in std)):
            raise ValueError("task_state needs mean and std, one finite number each per target (std above 0)")
        if not isinstance(loss, str) or loss not in LOSSES:
            raise ValueError(f"task_state's loss must be one of {', '.join(LOSSES)}")
        if not isinstance(state.get("folded", False), bool):
            raise ValueError("task_state's folded must be true or false")
        return type(self)(loss, mean, std, state.get("folded", False))

    def _scale(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mean is None:
            raise RuntimeError("a regression task is fitted to its train split before it is used")
        return (
            torch.tensor(self.mean, dtype=like.dtype, device=like.device),
            torch.tensor(self.std, dtype=like.dtype, device=like.device),
        )

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """The model's standardised output in the targets' units (a folded model's: itself)."""
        if self.folded:
            return out.double()
        mean, std = self._scale(out.double())
        return out.double() * std + mean

    def folded_into(self, head: nn.Module) -> Regression:
        """The map back to the targets' units folded into the model's last layer ``head`` (changed in place):
        ``W' = std W``, ``b' = std b + mean`` row by row, in float64, so that the model's output is the values."""
        if not isinstance(head, nn.Linear) or head.out_features != len(self.std):
            raise TypeError(f"the model's last layer is {type(head).__name__}, not a Linear layer of its targets")
        mean, std = self._scale(torch.zeros((), dtype=torch.float64))
        with torch.no_grad():
            weight = head.weight.double() * std[:, None]
            bias = (head.bias.double() if head.bias is not None else torch.zeros_like(mean)) * std + mean
            head.weight.copy_(weight.to(head.weight.dtype))
            if head.bias is None:
                head.bias = nn.Parameter(bias.to(head.weight.dtype))
            else:
                head.bias.copy_(bias.to(head.bias.dtype))
        return type(self)(self.loss, self.mean, self.std, folded=True)

    # -- its label cells --

    def names_columns(self, row: list[str], where: str = "") -> bool:
        """A header's target cells are not numbers."""
        return any(_number(c) is None for c in row[1:])

    def parse(self, cells: Cells) -> Labelled:
        if cells.rows is None:
            raise UserError(f"{cells.origin}: regression needs a numeric column; pass --label-column NAME")
        if cells.names is not None:
            refuse_class_cells(
                cells, self.name, "numbers: a manifest (train.csv: filename,value) or an hf: numeric column"
            )
        if not cells.per_row:  # an hf: column: one number a row
            for i, v in enumerate(cells.rows):
                if not isinstance(v, (int, float)) or _number(v) is None:  # text is not a number column
                    raise UserError(
                        f"{cells.where(i)}: column {cells.column!r} holds {str(v)[:40]!r}, not a finite number; "
                        "give every row a number (regression data)"
                    )
            values = np.asarray([float(v) for v in cells.rows], np.float32).reshape(-1, 1)
            return Labelled(self, np.zeros(len(values), np.int32), [cells.column], values)
        width = len(cells.header) if cells.header is not None else max((len(r) for r in cells.rows), default=1)
        values = []
        for i, row in enumerate(cells.rows):
            where = cells.where(i) if cells.files is None else f"{cells.where(i)} ({printable(cells.files[i])})"
            row = (row + [""] * width)[:width] if len(row) <= width else row
            if len(row) != width:
                raise UserError(f"{where}: {len(row)} targets, expected {width}")
            values.append(parse_numbers(row, where))
        values = np.asarray(values, np.float32).reshape(len(values), width)
        return Labelled(self, np.zeros(len(values), np.int32), target_names(cells.header, width), values)

    def split(self, images, val_fraction: float, seed: int):
        from visiontune.data.split import make_stratified_split  # (torch: imported when a split is made)

        bins = quantile_bins(images.targets, val_fraction)
        return replace(make_stratified_split(bins, val_fraction, seed), method=QUANTILES)

    def class_counts(self, images, idx) -> dict[str, int]:
        return {}  # no classes

    def describe(self, images) -> str:
        values = images.targets
        ranges = ", ".join(
            f"{printable(name)} {lo:g} to {hi:g}" for name, lo, hi in zip(images.classes, values.min(0), values.max(0))
        )
        return f"visiontune: {len(images.paths)} images, regression ({images.layout}): {ranges}"

    def relabelled(self, images, cells: dict[int, str], where: str):
        """A cell is the suggested numbers, one a target, joined by ``;``."""
        values = images.targets.copy()
        for i, cell in cells.items():
            try:
                row = [float(v) for v in cell.split(";")]
            except ValueError:
                row = []
            if len(row) != values.shape[1] or not np.isfinite(row).all():
                shown = printable(cell)[:100]
                raise UserError(f"{where}: '{shown}' (for {images.paths[i]}) is not {values.shape[1]} number(s)")
            values[i] = row
        return replace(images, targets=values)

    # -- its labels in a run --

    def label_array(self, labels) -> np.ndarray:
        arr = np.asarray(labels, np.float32)
        return arr.reshape(len(arr), -1)

    def sample_label(self, labels: np.ndarray, i: int):
        return torch.from_numpy(labels[i])

    def unreadable_label(self, labels: np.ndarray):
        return torch.full((labels.shape[1],), float("nan"))

    def readable(self, labels: torch.Tensor) -> torch.Tensor:
        return ~labels.reshape(len(labels), -1).isnan().any(1)

    def _per_sample(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ok = self.readable(labels)
        mean, std = self._scale(out.float())
        z = ((labels.float() - mean) / std).nan_to_num(0.0)  # an unreadable row: 0, and left out below
        per = getattr(F, LOSSES[self.loss])(out.float(), z, reduction="none").mean(1)
        return per * ok

    def mean_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._per_sample(logits, labels).sum() / self.readable(labels).sum().clamp(min=1)

    def eval_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._per_sample(logits, labels)

    def smoothed_loss(self, label_smoothing: float, class_weights: torch.Tensor | None) -> Loss:
        return self.mean_loss  # mixed targets are numbers as any: the same loss (smoothing and weights refused)

    def probabilities(self, out: torch.Tensor, given: bool = False) -> torch.Tensor:
        """The values in the targets' units (``given``: an exported graph that ends in them)."""
        return out.double() if given else self.values(out)

    def hits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per sample, its absolute error in the targets' units (the mean over the targets); 0 unreadable."""
        err = (self.values(logits.detach()) - labels.double()).abs().mean(1)
        return err.nan_to_num(0.0).float() * self.readable(labels)

    def mixed_classes(self, num_classes: int) -> int:
        return 2  # the pair's two positions are the "classes" v2 mixes, as for multi-label rows

    def mix_pair(self, mix: Callable, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = labels.float().nan_to_num(0.0)
        pair = torch.arange(len(images), device=labels.device)
        x, shares = mix(images, pair)  # shares[r, p]: image p's part of output r (mixup's lambda)
        return x, shares[:, : len(pair)].to(rows.dtype) @ rows

    def mixed_targets(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.where(self.readable(labels).unsqueeze(1), targets, torch.full_like(targets, float("nan")))

    def counted(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets

    def ranking(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        """MAE, RMSE and R² (the mean over the targets of each one's, sklearn's ``r2_score``), readable rows."""
        ok = self.readable(labels)
        pred, y = self.values(logits[ok]), labels[ok].double()
        if not len(y):
            return {"mae": None, "rmse": None, "r2": None}
        err = pred - y
        sst = (y - y.mean(0)).square().sum(0)
        r2 = 1 - err.square().sum(0) / sst
        return {
            "mae": float(err.abs().mean()),
            "rmse": float(err.square().mean().sqrt()),
            "r2": float(r2.mean()) if bool((sst > 0).all()) else None,
        }

    def label_text(self, labels: torch.Tensor, classes: list[str]) -> list[str]:
        return [
            "unreadable" if not ok else ", ".join(f"{c} {v:.4g}" for c, v in zip(classes, row))
            for row, ok in zip(labels.reshape(len(labels), -1).tolist(), self.readable(labels).tolist())
        ]

    def balancing_weights(self, labels: np.ndarray, num_classes: int, beta: float | None) -> torch.Tensor:
        raise NotImplementedError("refused: --class-weights has no meaning for regression")

    def weighting_text(self, how: str | None) -> str:
        return "none"

    def sampler_refusal(self, sampler: str) -> str | None:
        if sampler != "balanced":
            return None
        return "--sampler balanced draws classes evenly, and regression has none: leave it out"

    def loss_text(self, label_smoothing: float, class_weights: str) -> str:
        scale = ", ".join(f"mean {m:.4g} std {s:.4g}" for m, s in zip(self.mean or [], self.std or []))
        return f"{self.loss} on the standardised targets ({scale})"

    # -- what a trained model's output means --

    def activation(self) -> nn.Module:
        from visiontune.tasks.heads import Destandardise

        if self.folded:
            return nn.Identity()
        mean, std = self._scale(torch.zeros(()))
        return Destandardise(mean, std)

    def logits_of(self, probs: torch.Tensor) -> torch.Tensor:
        if self.folded:
            return probs.double()
        mean, std = self._scale(probs.double())
        return (probs.double() - mean) / std

    def exports_probabilities(self, asked: bool) -> bool:
        return True  # an exported regression model answers in the targets' units

    def output_name(self, probabilities: bool) -> str:
        return "values"

    def output_text(self, probabilities: bool) -> str:
        return "values in the targets' units"

    def averaged(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs.float().mean(0)  # the standardisation is affine: the mean of the values, standardised

    def thresholds(self, recorded, num_classes: int) -> list[float] | None:
        return None

    def right(self, out: np.ndarray, y: np.ndarray, thresholds) -> tuple[int, int]:
        """An exported file's values (``out``, the targets' units) within a tenth of each target's standard
        deviation of the truth ``y``: right; one decision a target and image."""
        off = np.abs(np.asarray(out, np.float64).reshape(len(y), -1) - np.asarray(y, np.float64).reshape(len(y), -1))
        ok = off <= 0.1 * np.asarray(self.std, np.float64)
        return int(ok.sum()), ok.size

    def answer(self, row: list[float] | None, classes, thresholds, top_k: int | None = None) -> dict:
        if row is None:
            return {"value": None, "values": None}
        return {"value": row[0], "values": dict(zip(classes, row))}

    def csv_text(
        self, paths, classes, probs: torch.Tensor, readable: torch.Tensor, thresholds, clip: float, kaggle_ids=None
    ) -> str:
        """``path,<target>...``: each image's predicted values in the targets' units (empty: unreadable)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["path", *classes])
        for path, ok, row in zip(paths, readable.tolist(), probs.tolist()):
            w.writerow([path, *((repr(float(v)) for v in row) if ok else [""] * len(classes))])
        return buf.getvalue()


REGRESSION = Regression()
