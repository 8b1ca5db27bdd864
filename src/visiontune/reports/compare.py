"""``visiontune compare RUN RUN...``: runs side by side, as one self-contained HTML page and a terminal table.

Built from each run folder's own files (``config.json``, ``summary.json``, ``history.json``): the
runs' validation (and training) curves come first, drawn on shared axes in one embedded figure, then
the final metrics (and, for the folds of one cross-validation, their spread); the settings close the
page, those that differ between the runs first, then the ones they share. Epochs are counted from 1,
as training prints them and the files hold them (an older run's 0-based files too: ``runs.epochs``). Like
``report.html``, the page has no script and no external reference.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path

from visiontune.errors import UserError
from visiontune.files import atomic_write
from visiontune.reports import crossval
from visiontune.reports.style import CSS
from visiontune.runs import runrecords
from visiontune.settings.config import LR_SCHEDULE_SAID
from visiontune.tasks import SINGLE_LABEL, Task, recorded

# Differ by nature between any two runs, and say nothing about how they trained.
NOT_SETTINGS = ("output_dir", "resume", "progress")
METRICS = (
    ("best val accuracy", "best_val_accuracy"),
    ("best val loss", "best_val_loss"),
    # here, a row for each metric the runs' tasks add (multi-label: mAP)
    ("best epoch", "best_epoch"),  # shown from 1, as training prints it
    ("best epoch chosen by", "best_metric"),
    ("epochs run", "epochs"),
    ("train images/s", "train_images_per_s"),
    ("total seconds", "total_seconds"),
)


@dataclass(frozen=True)
class Run:
    name: str
    settings: dict
    summary: dict
    history: list
    task: Task  # what the run learnt, as its config.json's model record says


def read_run(folder: str | Path) -> Run:
    """The run's records, checked (``runs.runrecords``): one line naming the file and field that is damaged."""
    config = runrecords.read_config(folder)
    if config is None:
        raise UserError(f"{folder} is not a visiontune run folder (no config.json)")
    settings = {"data": config["data"].get("root")}
    settings.update({k: v for k, v in config["config"].items() if k not in NOT_SETTINGS and k != "data"})
    settings.update({f"setup: {k}": v for k, v in config["setup"].items() if k in ("global_batch", "lr")})
    task = recorded(config["model"]) or SINGLE_LABEL
    summary = runrecords.read_summary(folder) or {}
    return Run(str(folder).rstrip("/"), settings, summary, runrecords.read_history(folder), task)


def _text(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"  # thousands separated, as the report and the start-up block
    return str(v)


def _setting(key: str, v) -> str:
    """A setting as the report says it: --lr-schedule none is a constant lr there and here."""
    return LR_SCHEDULE_SAID.get(v, v) if key == "lr_schedule" else _text(v)


def settings_table(runs: list[Run]) -> tuple[list[tuple[str, list[str]]], int]:
    """(setting, one text per run) rows, the differing ones first; and how many differ."""
    keys = list(dict.fromkeys(k for r in runs for k in r.settings))
    rows = [(k, [_setting(k, r.settings.get(k)) for r in runs]) for k in keys]
    differ = [row for row in rows if len(set(row[1])) > 1]
    return differ + [row for row in rows if len(set(row[1])) == 1], len(differ)


def _curves(runs: list[Run]) -> dict[str, str]:
    """The metrics the runs' tasks add to accuracy and loss (multi-label: mAP), key: name."""
    return {key: name for r in runs for key, name in r.task.curves}


def _shown(summary: dict, key: str):
    """A summary value as a person reads it (``runrecords`` counts the best epoch from 1, an older run's too)."""
    return summary.get(key)


def metrics_table(runs: list[Run]) -> list[tuple[str, list[str]]]:
    curves = _curves(runs)
    # a task whose epochs score something else than accuracy (a regression's MAE) shows it beside
    scores = {
        f"best val {r.task.score_name}": f"best_val_{r.task.score_key}" for r in runs if r.task.score_key != "accuracy"
    }
    added = [*scores.items(), *((f"best val {name}", f"best_val_{key}") for key, name in curves.items())]
    shown = [*METRICS[:2], *added, *METRICS[2:]]
    rows = [(label, [_text(_shown(r.summary, key)) for r in runs]) for label, key in shown]
    last = [r.history[-1] if r.history else {} for r in runs]
    names = {"accuracy": "accuracy", "loss": "loss", **curves}
    rows += [
        (f"last epoch {phase} {names[key]}", [_text((h.get(phase) or {}).get(key)) for h in last])
        for phase in ("val", "train")
        for key in ("accuracy", "loss", *(curves if phase == "val" else ()))  # measured on val only
    ]
    return rows


def curves_figure(runs: list[Run]):
    """Validation (solid) and training (dashed) accuracy and loss of every run, on shared axes; with
    multi-label runs, their validation mAP beside them."""
    import matplotlib.ticker

    from visiontune.reports.figures import pyplot

    plt = pyplot()
    curves = _curves(runs)
    keys = ["accuracy", "loss", *curves]
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.4), sharex=True)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        epochs = [row["epoch"] for row in run.history]  # from 1, as the terminal counts them (runrecords)
        for ax, key in zip(axes, keys):
            if key in curves and key not in dict(run.task.curves):
                continue  # a single-label run has no mAP: no line rather than a flat one
            val = [float("nan") if row["val"].get(key) is None else row["val"][key] for row in run.history]
            ax.plot(epochs, val, marker="o", color=color, label=run.name)
            if key not in curves:  # these are measured on the validation split only
                ax.plot(epochs, [row["train"][key] for row in run.history], linestyle="--", color=color, alpha=0.6)
    titles = {
        "accuracy": "Accuracy (solid: validation, dashed: training)",
        "loss": "Loss (solid: validation, dashed: training)",
    }
    titles.update({key: f"Validation {name}" for key, name in curves.items()})
    for ax, key in zip(axes, keys):
        ax.set_title(titles[key])
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(runs), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def figure_png(runs: list[Run]) -> bytes:
    from visiontune.reports.figures import pyplot

    fig = curves_figure(runs)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    pyplot().close(fig)
    return buf.getvalue()


def _html_table(runs: list[Run], rows: list[tuple[str, list[str]]], marked: int = 0) -> str:
    head = "<tr><th class='l'>setting</th>" + "".join(f"<th class='l'>{html.escape(r.name)}</th>" for r in runs)
    body = "".join(
        f"<tr{' class=differs' if i < marked else ''}><th class='l'>{html.escape(k)}</th>"
        + "".join(f"<td class='l'>{html.escape(v)}</td>" for v in values)
        + "</tr>"
        for i, (k, values) in enumerate(rows)
    )
    return f"<table>{head}</tr>{body}</table>"


def build(runs: list[Run]) -> str:
    settings, differ = settings_table(runs)
    png = base64.b64encode(figure_png(runs)).decode()
    title = "visiontune compare: " + ", ".join(Path(r.name).name for r in runs)
    said = f"{differ} setting(s) differ" if differ else "no setting differs"
    # What the runs did first; the settings (sixty rows and more) below, where they do not push the curves away.
    body = [
        f"<h1>{html.escape(title)}</h1>",
        "<h2>Curves</h2>",
        f'<img alt="curves of every run on shared axes" src="data:image/png;base64,{png}">',
        "<h2>Final metrics</h2>",
        _html_table(runs, metrics_table(runs)),
    ]
    cv = crossval.summary(runs)
    if cv is not None:  # the runs are folds of one cross-validation: their metrics over the folds
        head, *rows = crossval.lines(cv)
        body += [f"<h2>Cross-validation</h2><p class='note'>{html.escape(head)}</p>"]
        body += [f"<pre>{html.escape(chr(10).join(row.strip() for row in rows))}</pre>"]
    # The settings that differ, then the ones every run shares folded away: most are the same.
    same = len(settings) - differ
    body += [
        f"<h2>Settings</h2><p class='note'>{said}; {same} the runs share are folded below them.</p>",
        _html_table(runs, settings[:differ], differ) if differ else "",
        f"<details><summary>{same} setting(s) the runs share</summary>{_html_table(runs, settings[differ:])}</details>"
        if same
        else "",
    ]
    return (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def terminal_table(runs: list[Run]) -> str:
    """The differing settings and the final metrics, one column per run."""
    settings, differ = settings_table(runs)
    rows = [("run", [Path(r.name).name for r in runs]), *settings[:differ], *metrics_table(runs)]
    width = max(len(k) for k, _ in rows)
    cols = [max(len(values[i]) for _, values in rows) for i in range(len(runs))]
    lines = [f"{k:<{width}}  " + "  ".join(f"{v:<{w}}" for v, w in zip(values, cols)) for k, values in rows]
    if not differ:
        lines.insert(1, "(no setting differs)")
    cv = crossval.summary(runs)
    lines += crossval.lines(cv) if cv is not None else []
    return "\n".join(line.rstrip() for line in lines)


def compare(folders: list[str], out: str | Path) -> Path:
    """Write the page comparing ``folders`` to ``out``, print the terminal table; return ``out``."""
    if len(folders) < 2:
        raise UserError("compare needs two or more run folders")
    runs = [read_run(f) for f in folders]
    out = Path(out)
    atomic_write(out, build(runs))
    print(terminal_table(runs))
    return out
