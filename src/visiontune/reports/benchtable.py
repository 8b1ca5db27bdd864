"""``visiontune bench``'s results as text and a chart: the blog's table with the machine and
load lines (``bench.md``), the load line that ``bench.json`` also keeps, and the epoch-time and
images/s bars (``bench.png``). It renders rows ``bench`` measured; it measures nothing.
"""

from __future__ import annotations

from pathlib import Path

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
    plt = pyplot()
    done = [r for r in rows if "images_per_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["strategy"] for r in done]
    axes[0].bar(names, [r["epoch_seconds"] for r in done], color="tab:blue")
    axes[0].set_title("Epoch time (s)")
    axes[1].bar(names, [r["images_per_s"] for r in done], color="tab:green")
    axes[1].set_title("Training images/s (after warm-up)")
    fig.tight_layout()
    save_figure(path, fig)
