"""A regression model's evaluation: MAE, RMSE and R² of each target, the largest residuals, and the
predicted-vs-true scatter (``scatter.png``), all in the targets' own units.

R² is sklearn's ``r2_score`` of each target (1 - residual sum of squares / total sum of squares about the
true mean; None for a target that is constant on these images); the averages over the targets are plain
means, sklearn's ``uniform_average``.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from visiontune.reports.figures import pyplot, save_figure


def regression_metrics(pred: np.ndarray, true: np.ndarray, names: list[str]) -> dict:
    """The figures of ``pred`` against ``true`` (float [N, T]): per target and averaged."""
    pred, true = np.asarray(pred, np.float64), np.asarray(true, np.float64)
    err = pred - true
    sst = ((true - true.mean(0)) ** 2).sum(0) if len(true) else np.zeros(len(names))
    per = {}
    for t, name in enumerate(names):
        n = len(err)
        per[name] = {
            "mae": float(np.abs(err[:, t]).mean()) if n else None,
            "rmse": float(np.sqrt((err[:, t] ** 2).mean())) if n else None,
            "r2": float(1 - (err[:, t] ** 2).sum() / sst[t]) if n and sst[t] > 0 else None,
            "mean_true": float(true[:, t].mean()) if n else None,
        }
    r2s = [v["r2"] for v in per.values()]
    return {
        "count": len(err),
        "mae": float(np.abs(err).mean()) if len(err) else None,
        "rmse": float(np.sqrt((err**2).mean())) if len(err) else None,
        "r2": float(np.mean(r2s)) if r2s and None not in r2s else None,
        # what a model that always answers the mean of these images' targets would score
        "baseline_mae": float(np.abs(true - true.mean(0)).mean()) if len(err) else None,
        "per_target": per,
    }


def largest_residuals(pred: np.ndarray, true: np.ndarray, n: int) -> list[dict]:
    """The ``n`` images farthest off (mean absolute error over the targets), largest first."""
    off = np.abs(np.asarray(pred, np.float64) - np.asarray(true, np.float64)).mean(1)
    order = np.argsort(-off, kind="stable")[:n]
    return [
        {
            "index": int(i),
            "true": np.asarray(true[i]).tolist(),
            "predicted": np.asarray(pred[i]).tolist(),
            "error": float(off[i]),
        }
        for i in order
    ]


def plot_scatter(path: str | Path, pred: np.ndarray, true: np.ndarray, names: list[str]) -> None:
    """``scatter.png``: predicted against true, one panel a target, with the line of perfect answers."""
    plt = pyplot()
    cols = len(names)
    fig, axes = plt.subplots(1, cols, figsize=(4.0 * cols, 4.0), squeeze=False, layout="constrained")
    for ax, t, name in zip(axes.flat, range(cols), names):
        x, y = np.asarray(true)[:, t], np.asarray(pred)[:, t]
        ax.scatter(x, y, s=8, alpha=0.6)
        lo, hi = (float(min(x.min(), y.min())), float(max(x.max(), y.max()))) if len(x) else (0.0, 1.0)
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
        ax.set_xlabel(f"true {name}")
        ax.set_ylabel(f"predicted {name}")
    save_figure(path, fig)


def section(ev: dict, num) -> str:
    """The run page's section of a regression ``eval.json``: the figures per target and the largest residuals.
    ``num(*keys)`` renders a number of ``ev`` (the page's own formatting)."""
    out = ["<table><tr><th>target</th><th>MAE</th><th>RMSE</th><th>R²</th></tr>"]
    for name in ev.get("per_target") or {}:
        cells = "".join(num("eval", ev, "per_target", name, k) for k in ("mae", "rmse", "r2"))
        out.append(f"<tr><td class='name'>{html.escape(str(name))}</td>{cells}</tr>")
    out.append("</table><table><tr><th>rank</th><th>image</th><th>error</th></tr>")
    for i, it in enumerate(ev.get("largest_residuals") or []):
        out.append(
            f"<tr><td>{i + 1}</td><td class='name'>{html.escape(str(it.get('path')))}</td>"
            + num("eval", ev, "largest_residuals", i, "error")
            + "</tr>"
        )
    out.append("</table>")
    return "".join(out)
