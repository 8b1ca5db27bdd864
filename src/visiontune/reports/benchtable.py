"""``visiontune bench``'s results as text and a chart: the blog's table with the machine and
load lines (``bench.md``), the load line that ``bench.json`` also keeps, and the epoch-time and
images/s bars (``bench.png``). It renders rows ``bench`` measured; it measures nothing.
"""

from __future__ import annotations

from pathlib import Path

from visiontune.cluster import strategies as registry
from visiontune.reports.figures import pyplot, save_figure


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def _spread(r: dict) -> str:
    return f" ±{r['spread'] / 2:.0%}" if r.get("spread") is not None else ""


def load_line(rows: list[dict], info: dict) -> str:
    loads = [r["load_per_core"] for r in rows if "load_per_core" in r]
    where = f"; before each run {min(loads):.2f}-{max(loads):.2f}" if loads else ""
    return (
        f"Repeats per strategy: {info['repeats']} (the median run is shown; ± is half the range of images/s). "
        f"Load average per core at the start: {info['load_per_core']:.2f}{where}."
    )


def batch_line(rows: list[dict], same: str) -> str:
    """Why each strategy trains at its batch: with ``--same global`` one process takes the whole global batch
    (nproc x --batch-size), so a single run at batch 100 beside ddp's 2 x 50 is by design, not a mistake."""
    planned = [r for r in rows if "global_batch" in r]
    each = ", ".join(f"{r['strategy']} {r['processes']} x {r['per_process_batch']}" for r in planned)
    if same == "global":
        size = planned[0]["global_batch"] if planned else "-"
        return (
            f"Batches: every strategy trains on the same global batch of {size} (--same global), so their "
            f"accuracies compare; processes x batch per process: {each}. --same per-device gives each "
            "device --batch-size instead, as the blog did."
        )
    return (
        f"Batches: --batch-size per device (--same per-device, the blog's setting); processes x batch per "
        f"process: {each}. The global batches differ, so the accuracies do not compare."
    )


def unreliable_line(rows: list[dict]) -> str | None:
    """A warning above the table when a load made speedups meaningless: said before any figure is read."""
    reasons = sorted({r["unreliable"] for r in rows if r.get("unreliable")})
    if not reasons:
        return None
    return (
        f"UNRELIABLE speedup and efficiency ({'; '.join(reasons)}): other work competed for the cores, so the "
        "figures say nothing about scaling; rerun on an idle machine, or with --repeats 3."
    )


def _speedup_cells(r: dict) -> str:
    if r.get("unreliable"):
        return "unreliable | unreliable"
    return f"{_fmt(r.get('speedup'), '.2f')}x | {_fmt(r.get('efficiency'), '.0%')}"


def table(rows: list[dict], info: dict) -> str:
    head = (
        "| strategy | processes | batch/process | global batch | epoch time (s) | images/s | speedup | "
        "efficiency | data stall | train loss | train acc | val loss | val acc | note |"
    )
    lines = [
        (
            f"# visiontune bench: {info['model']} at {info['image_size']} px, {info['epochs']} epoch(s), "
            f"same {info['same']} batch"
        ),
        "",
        (
            f"Machine: {info['machine']['cpu']}, {info['machine']['cores']} cores, "
            f"GPUs: {', '.join(g['name'] for g in info['machine']['gpus']) or 'none'}; "
            f"torch {info['machine']['torch']}, torchvision {info['machine']['torchvision']}, "
            f"accelerate {info['machine']['accelerate']}"
        ),
        "",
        load_line(rows, info),
        "",
        batch_line(rows, info["same"]),
        "",
        *([warning, ""] if (warning := unreliable_line(rows)) else []),
        head,
        "|" + "---|" * 14,
    ]
    for r in rows:
        if "skipped" in r or "failed" in r:
            lines.append(f"| {r['strategy']} | | | | | | | | | | | | | not run: {r.get('skipped') or r['failed']} |")
            continue
        lines.append(
            f"| {r['strategy']} | {r['processes']} | {r['per_process_batch']} | {r['global_batch']} | "
            f"{r['epoch_seconds']:.1f} | {r['images_per_s']:.1f}{_spread(r)} | {_speedup_cells(r)} | "
            f"{r['data_stall']:.0%} | {r['train_loss']:.4f} | "
            f"{r['train_accuracy']:.4f} | {r['val_loss']:.4f} | {r['val_accuracy']:.4f} | {r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def chart(path: Path, rows: list[dict]) -> None:
    """``bench.png``: the figure of ``chart_figure``."""
    save_figure(path, chart_figure(rows))


def chart_figure(rows: list[dict]):
    """Epoch time and images/s per strategy, each bar labelled with its value and speedup. A bar whose
    speedup a loaded machine made meaningless is hatched and says "unreliable", and the figure's
    heading carries the warning ``bench.md`` opens with, so the picture cannot be read without it."""
    import textwrap

    plt = pyplot()
    done = [r for r in rows if "images_per_s" in r]
    warning = unreliable_line(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6 if warning else 4), layout="constrained")
    # Each strategy's batch under its name: the equal global batch is why single trains at nproc x --batch-size.
    names = [f"{r['strategy']}\n{r['processes']} x {r['per_process_batch']} = batch {r['global_batch']}" for r in done]
    for ax, key, color, title, fmt in (
        (axes[0], "epoch_seconds", "tab:blue", "Epoch time (s)", "{:.1f} s"),
        (axes[1], "images_per_s", "tab:green", "Training images/s (after warm-up)", "{:.1f}/s"),
    ):
        bars = ax.bar(names, [r[key] for r in done], color=color)
        labels = []
        for bar, r in zip(bars, done):
            baseline = registry.get(r["strategy"]).one_device  # its 1.00x says nothing
            speed = "" if r.get("speedup") is None or baseline else f", {r['speedup']:.2f}x"
            if r.get("unreliable"):
                bar.set_hatch("//")
                bar.set_alpha(0.45)
                speed += " (unreliable)"
            labels.append(fmt.format(r[key]) + speed)
        ax.bar_label(bars, labels, fontsize=8, padding=2)
        ax.margins(y=0.15)  # room above the tallest bar for its label
        ax.set_title(title)
    if warning:
        heading = "\n".join(textwrap.wrap(warning, 110, break_on_hyphens=False))
        fig.suptitle(heading, color="tab:red", fontsize=9, fontweight="bold")
    return fig
