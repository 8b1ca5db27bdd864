"""What a run leaves behind: JSON records, metrics.csv, the curves, the best model.

Every file is written whole or not at all (temp file + ``os.replace``), and only
by the main process: callers invoke these helpers after
``accelerator.wait_for_everyone()`` inside ``if accelerator.is_main_process``,
which is safe because none of them runs a collective.
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

import torch

PHASES = ("train", "val")


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``path`` whole or not at all: a unique temp file beside it, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the unwrapped model's tensors (no ``module.``/``_orig_mod.``)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def save_model(run_dir: str | os.PathLike, state: dict[str, torch.Tensor], stem: str = "best") -> None:
    """``<stem>.pth`` (loads with weights_only=True) and ``<stem>.safetensors``."""
    from safetensors.torch import save as st_save

    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write(Path(run_dir) / f"{stem}.pth", buf.getvalue())
    atomic_write(Path(run_dir) / f"{stem}.safetensors", st_save(state))


def write_metrics_csv(path: str | os.PathLike, history: list[dict]) -> None:
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["epoch", "phase", "loss", "accuracy", "images", "seconds", "images_per_s"])
    for row in history:
        for phase in PHASES:
            r = row[phase]
            w.writerow([row["epoch"], phase, f"{r['loss']:.6f}", f"{r['accuracy']:.6f}", r["images"],
                        f"{r['seconds']:.3f}", f"{r['images_per_s']:.2f}"])
    atomic_write(path, out.getvalue())


def plot_history(path: str | os.PathLike, history: list[dict]) -> None:
    """``training_results.png``: the figure of ``history_figure``."""
    import matplotlib.pyplot as plt

    fig = history_figure(history)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def history_figure(history: list[dict]):
    """Accuracy and loss, train against val, and the learning rate; the best epoch marked.

    The legend sits below the panels, never over a curve; the best epoch (``best_epoch``) is a
    dotted line with its val points starred, so the curve and the saved model can be matched.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    epochs = [row["epoch"] for row in history]
    best = best_epoch(history)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, key, title in ((axes[0], "accuracy", "Accuracy"), (axes[1], "loss", "Loss")):
        for phase, label in (("train", "Training"), ("val", "Validation")):
            ax.plot(epochs, [row[phase][key] for row in history], marker="o", label=label)
        ax.plot([best["epoch"]], [best["val"][key]], marker="*", markersize=16, color="tab:red", linestyle="none",
                label=f"best epoch ({best['epoch']}): val accuracy {best['val']['accuracy']:.4f}")
        ax.set_title(f"Training and Validation {title}")
    lrs = [(row["epoch"], row["lr"]) for row in history if "lr" in row]
    axes[2].plot([e for e, _ in lrs], [lr for _, lr in lrs], marker="o", color="tab:gray", label="learning rate")
    axes[2].set_title("Learning rate (at the end of each epoch)")
    axes[2].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in axes:
        ax.axvline(best["epoch"], color="tab:red", linestyle=":", linewidth=1)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    legend = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}  # one per label
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room below the panels for the legend
    return fig


def best_epoch(history: list[dict]) -> dict:
    """Highest val accuracy; ties go to the lower val loss, then the earlier epoch."""
    return max(history, key=lambda r: (r["val"]["accuracy"], -r["val"]["loss"], -r["epoch"]))
