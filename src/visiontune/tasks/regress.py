"""Image regression: one or more numbers an image, float32 rows [N, T] (``data/targets.py`` reads them).

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

import numpy as np

from visiontune.tasks._torch import F, nn, torch
from visiontune.tasks.base import Loss, Task

LOSSES = {"mse": "mse_loss", "l1": "l1_loss", "huber": "huber_loss"}  # --loss: torch.nn.functional's


def _finite_list(v, n: int | None) -> bool:
    return (
        isinstance(v, list)
        and (n is None or len(v) == n)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
    )


class Regression(Task):
    name, title, min_classes, classes_word = "regress", "regression", 1, "targets"
    reads = "regress"
    supports_label_smoothing = False
    # an exported file is scored by the share of images it answers within a tenth of a standard deviation
    ranks, thresholded, accuracy_name = True, False, "share_within_a_tenth_std"
    best_metric, metrics = "mae", ("mae", "rmse", "r2", "loss")
    score_key, score_name, lower_is_better = "mae", "MAE", True
    curves = (("rmse", "RMSE"), ("r2", "R²"))
    accuracy_title, labels_per_image = "Mean absolute error (the targets' units)", "numbers"
    card_verb, activation_code = "predict", "logits * std + mean  # std, mean: visiontune.task_state"
    card_note = (
        "A regression model: its output is each target in its own units (an exported file's too); the "
        "model file records the train split's mean and std it was standardised by (`visiontune.task_state`)."
    )

    def __init__(self, loss: str = "mse", mean=None, std=None):
        self.loss, self.mean, self.std = loss, mean, std

    # -- the run's settings and its train split --

    def refusal(self, cfg) -> str | None:
        for flag, value in (("--cutmix", cfg.cutmix), ("--label-smoothing", cfg.label_smoothing)):
            if value:
                return f"{flag} has no meaning for regression (--task regress): drop it (--mixup mixes targets)"
        if cfg.class_weights != "none":
            return "--class-weights weighs classes, and regression has none: drop it"
        return None

    def configured(self, cfg) -> Regression:
        return type(self)(cfg.loss or "mse", self.mean, self.std)

    def fitted(self, labels) -> Regression:
        y = np.asarray(labels, np.float64).reshape(len(labels), -1)
        y = y[np.isfinite(y).all(1)]
        mean = y.mean(0) if len(y) else np.zeros(y.shape[1])
        std = y.std(0) if len(y) else np.ones(y.shape[1])
        std = np.where(std > 1e-12, std, 1.0)  # a constant target: learnt as its offset alone
        return type(self)(self.loss, mean.tolist(), std.tolist())

    def state(self) -> dict:
        return {} if self.mean is None else {"mean": list(self.mean), "std": list(self.std), "loss": self.loss}

    def restored(self, state: dict, outputs: int) -> Regression:
        mean, std, loss = state.get("mean"), state.get("std"), state.get("loss", "mse")
        if not (_finite_list(mean, outputs) and _finite_list(std, outputs) and all(s > 0 for s in std)):
            raise ValueError("task_state needs mean and std, one finite number each per target (std above 0)")
        if not isinstance(loss, str) or loss not in LOSSES:
            raise ValueError(f"task_state's loss must be one of {', '.join(LOSSES)}")
        return type(self)(loss, mean, std)

    def _scale(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mean is None:
            raise RuntimeError("a regression task is fitted to its train split before it is used")
        return (
            torch.tensor(self.mean, dtype=like.dtype, device=like.device),
            torch.tensor(self.std, dtype=like.dtype, device=like.device),
        )

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """The model's standardised output in the targets' units."""
        mean, std = self._scale(out.double())
        return out.double() * std + mean

    # -- labels, loss, counts --

    def best_figures(self, row: dict) -> dict:
        return {f"best_val_{k}": row.get(k) for k in ("rmse", "r2")}

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

        mean, std = self._scale(torch.zeros(()))
        return Destandardise(mean, std)

    def logits_of(self, probs: torch.Tensor) -> torch.Tensor:
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
