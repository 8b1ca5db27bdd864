"""What a run leaves behind: JSON records, metrics.csv, the curves, the best model.

Every file is written whole or not at all (temp file + ``os.replace``), and only
by the main process: callers invoke these helpers after
``accelerator.wait_for_everyone()`` inside ``if accelerator.is_main_process``,
which is safe because none of them runs a collective.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from visiontune.config import UserError

PHASES = ("train", "val")


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` whole or not at all: a unique temp file beside it, fsync, rename.

    Its mode is what the user's umask makes of 0666, as for any new file (and Accelerate's own). A full
    disk (or quota) is a ``UserError`` saying that ``path`` is as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its files are mode 0600; 0666 here is narrowed by the user's umask, like any new file.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            # The temp file is gone and ``path`` was never touched: say so, in one line, not a traceback.
            kept = f"the previous {path.name} is kept whole" if path.exists() else f"no {path.name} was written"
            raise UserError(
                f"no space left on the disk of {path.parent} while writing {path.name} ({e.strerror}); "
                f"{kept}; free some space and run the command again"
            ) from None
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` to ``path`` whole or not at all (see ``atomic_file``).

    Text is UTF-8 with surrogate escapes: a file name that is not UTF-8 (read from the disk as
    lone surrogates) is written back as the bytes it has on disk, as the split and the scan cache
    store it, so a CSV row names the file it came from.
    """
    with atomic_file(path) as f:
        f.write(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)


def save_figure(path: str | os.PathLike, fig, dpi: int = 80) -> None:
    """A matplotlib figure as a PNG, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def versions() -> dict[str, str]:
    """The library versions a run records in ``config.json`` (and ``bench`` in its results)."""
    import platform

    import accelerate
    import torchvision

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "accelerate": accelerate.__version__,
    }


def write_json(path: str | os.PathLike, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the unwrapped model's tensors (no ``module.``/``_orig_mod.``)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def save_model(
    run_dir: str | os.PathLike,
    state: dict[str, torch.Tensor],
    stem: str = "best",
    metadata: dict[str, str] | None = None,
    pth: bool = False,
) -> None:
    """``<stem>.safetensors`` (carrying ``metadata``), and with ``pth`` the same tensors as ``<stem>.pth``
    (loads with weights_only=True)."""
    from safetensors.torch import save as st_save

    atomic_write(Path(run_dir) / f"{stem}.safetensors", st_save(state, metadata=metadata))
    if pth:  # opt-in: a second copy of every tensor (about 0.5 GB for VGG16)
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write(Path(run_dir) / f"{stem}.pth", buf.getvalue())


def write_metrics_csv(path: str | os.PathLike, history: list[dict]) -> None:
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["epoch", "phase", "loss", "accuracy", "images", "seconds", "images_per_s"])
    for row in history:
        for phase in PHASES:
            r = row[phase]
            w.writerow(
                [
                    row["epoch"],
                    phase,
                    f"{r['loss']:.6f}",
                    f"{r['accuracy']:.6f}",
                    r["images"],
                    f"{r['seconds']:.3f}",
                    f"{r['images_per_s']:.2f}",
                ]
            )
    atomic_write(path, out.getvalue())


def plot_history(path: str | os.PathLike, history: list[dict]) -> None:
    """``training_results.png``: the figure of ``history_figure``."""
    save_figure(path, history_figure(history))


def history_figure(history: list[dict]):
    """Accuracy and loss, train against val, and the learning rate; the best epoch marked.

    The legend sits below the panels, never over a curve; the best epoch (``best_epoch``) is a
    dotted line with its val points starred, so the curve and the saved model can be matched.
    """
    import matplotlib.ticker

    plt = pyplot()
    epochs = [row["epoch"] for row in history]
    best = best_epoch(history)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, key, title in ((axes[0], "accuracy", "Accuracy"), (axes[1], "loss", "Loss")):
        for phase, label in (("train", "Training"), ("val", "Validation")):
            ax.plot(epochs, [row[phase][key] for row in history], marker="o", label=label)
        ax.plot(
            [best["epoch"]],
            [best["val"][key]],
            marker="*",
            markersize=16,
            color="tab:red",
            linestyle="none",
            label=f"best epoch ({best['epoch']}): val accuracy {best['val']['accuracy']:.4f}",
        )
        ax.set_title(f"Training and Validation {title}")
    lrs = [(row["epoch"], row["lr"]) for row in history if "lr" in row]
    axes[2].plot([e for e, _ in lrs], [lr for _, lr in lrs], marker="o", color="tab:gray", label="learning rate")
    axes[2].set_title("Learning rate (at the end of each epoch)")
    axes[2].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in axes:
        ax.axvline(best["epoch"], color="tab:red", linestyle=":", linewidth=1)
        ax.set_xlabel("epoch")
        if len(epochs) <= 15:  # every epoch a tick (a one-epoch run would otherwise get fractional ones)
            ax.set_xticks(epochs)
        else:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    legend = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}  # one per label
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room below the panels for the legend
    return fig


def best_epoch(history: list[dict]) -> dict:
    """Highest val accuracy; ties go to the lower val loss, then the earlier epoch."""
    return max(history, key=lambda r: (r["val"]["accuracy"], -r["val"]["loss"], -r["epoch"]))
