"""What a study comes to: ``best.toml``, the terminal table and ``tune.html``.

``best.toml`` holds the recipe of the best finished trial: this tuner's fixed settings with the trial's
sampled values, checked again as a training run checks them, written by a TOML writer (``tomli_w``), so
``visiontune train --config OUT/best.toml`` trains with the trial's settings on the whole data: the search's
own budget (``--limit-images``, ``--max-steps``) is left out, and said so in a comment. Every trial is read
through ``store`` (the study's one reader): a value from the store reaches the terminal through
``visiontune.text`` and the page through ``html.escape``, and a trial's run folder becomes a link only as a
folder of the tune folder, never as a URL. ``tune.html`` is one self-contained page in the reports' style:
each trial's value against the time it finished, with the best so far and pruned trials marked, each trial's
per-epoch curve, Optuna's parameter importances (with a caveat while the trials are few), and a table of
every trial linking its run folder's report.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import math
from pathlib import Path
from urllib.parse import quote

import tomli_w
from optuna.trial import TrialState

from visiontune import files
from visiontune.errors import UserError
from visiontune.reports.style import CSS
from visiontune.settings.validation import check_types, validate
from visiontune.text import printable
from visiontune.tuning import space, store

# Settings best.toml leaves out: where the trial's folder was (the new run gets its own) and unset ones.
_NOT_KEPT = ("output_dir", "resume")
# The search's budget, not the recipe: a trial's subset and step cap would make the final run a trial again.
BUDGET = ("limit_images", "max_steps")
# Importances from fewer finished trials than this are a guess (PED-ANOVA compares the best tenth with the rest).
FEW_TRIALS = 10


def settings_of(cfg) -> dict:
    """A trial's settings as best.toml holds them: JSON/TOML values, no unset ones."""
    out = {}
    for k, v in cfg.to_dict().items():
        if k in _NOT_KEPT or v is None:
            continue
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def config_toml(settings: dict, comments: list[str]) -> str:
    """``settings`` (``settings_of``'s) as a TOML file ``train --config`` reads, under ``comments`` (each made
    printable: a newline in a stored value cannot end its comment line and start a live one)."""
    return "".join(f"# {printable(c)}\n" for c in comments) + tomli_w.dumps(settings)


def best_settings(best: store.Row, cfg) -> dict:
    """The settings best.toml holds: ``cfg`` (this tuner's fixed ones) with ``best``'s sampled values, each a
    setting a study searches, of its type, and valid together; anything else is one line."""
    where = f"trial {best.number} (the best in the study store)"
    unknown = [k for k in best.params if k not in space.SEARCHABLE]
    if unknown:
        raise UserError(f"{where}: {printable(unknown[0])!r} is not a setting a study searches; give another --study")
    check_types(best.params, where)
    try:
        return settings_of(validate(cfg.replace(**best.params)))
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def best_toml(best: store.Row, metric: str, cfg) -> str:
    settings = best_settings(best, cfg)
    budget = {k: settings.pop(k) for k in BUDGET if k in settings}
    comments = [
        f"visiontune tune: trial {best.number}, best val {metric} {best.value:.6g}",
        f"its run folder: {best.run_dir}",
        "repeat it with: visiontune train --config best.toml [--output-dir DIR]",
    ]
    if budget:
        said = ", ".join(f"{k} = {v}" for k, v in budget.items())
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in budget.items())
        comments.append(f"the search's budget, left out to train on all the data: {said} ({flags} repeats it)")
    return config_toml(settings, comments)


def describe(values: dict) -> str:
    """A trial's sampled settings on one line: numbers to 3 significant digits, text escaped."""
    return ", ".join(f"{printable(k)}={_short(v)}" for k, v in values.items())


def _short(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else printable(v)


def _setting(v) -> str:
    """A sampled setting in the table and the page: as ``describe`` shows it, ``-`` where the trial has none."""
    return "-" if v is None else _short(v)


def _state(r: store.Row) -> str:
    if r.note:
        return f"failed ({r.note})"
    if r.state == TrialState.FAIL and r.tuner_stopped:
        return "failed (tuner stopped; retried)"
    if r.failed_trial is not None:
        return f"{r.state.name.lower()} (retry of {r.failed_trial})"
    return r.state.name.lower()


def rows(trials: list[store.Row]) -> list[dict]:
    """trials.json's rows: one a trial, as read through the store."""
    out = []
    for r in trials:
        seconds = (r.completed - r.started).total_seconds() if r.completed and r.started else None
        out.append(
            {
                "trial": r.number,
                "state": _state(r),
                "value": r.value,
                "epochs": len(r.reported),
                "seconds": seconds,
                "params": r.params,
                "run_dir": r.run_dir,
            }
        )
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return printable(v)


def table(trials: list[store.Row], best: store.Row | None, metric: str) -> str:
    """The terminal table: one line a trial, the best marked with *; stored text escaped."""
    names = sorted({k for r in trials for k in r.params})
    head = ["", "trial", "state", metric, "epochs", "seconds", *map(printable, names)]
    body = [
        [
            "*" if best is not None and r["trial"] == best.number else "",
            str(r["trial"]),
            r["state"],
            _fmt(r["value"]),
            str(r["epochs"]),
            _fmt(r["seconds"]),
            *(_setting(r["params"].get(n)) for n in names),
        ]
        for r in rows(trials)
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    return "\n".join(lines)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _figures(trials: list[store.Row], direction: str, metric: str) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    trials = [r for r in trials if r.completed and r.started]
    out = []
    if not trials:
        return out
    start = min(r.started for r in trials)
    minutes = lambda r: (r.completed - start).total_seconds() / 60  # noqa: E731
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for state, marker, colour, label in (
        (TrialState.COMPLETE, "o", "tab:blue", "complete"),
        (TrialState.PRUNED, "x", "tab:red", "pruned (last reported value)"),
    ):
        pts = [(minutes(r), r.value) for r in trials if r.state == state and r.value is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=colour, label=label, zorder=3)
    done = sorted((r for r in trials if r.state == TrialState.COMPLETE and r.value is not None), key=minutes)
    if done:
        pick = min if direction == "minimize" else max
        best, xs, ys = None, [], []
        for r in done:
            best = r.value if best is None else pick(best, r.value)
            xs.append(minutes(r))
            ys.append(best)
        ax.step(xs, ys, where="post", color="black", label="best so far")
    ax.set_xlabel("minutes since the first trial started")
    ax.set_ylabel(f"val {metric}")
    if ax.collections or ax.lines:
        ax.legend(loc="best", fontsize=8)
    out.append(("trials over time", _png(fig)))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in trials:
        if r.reported:
            steps = sorted(r.reported)
            pruned = r.state == TrialState.PRUNED
            ax.plot(
                [s + 1 for s in steps],
                [r.reported[s] for s in steps],
                linestyle="--" if pruned else "-",
                marker="x" if pruned else ".",
                label=f"{r.number}{' (pruned)' if pruned else ''}",
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole: no tick at 1.2
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"val {metric}")
    if ax.lines:
        ax.legend(loc="best", fontsize=7, ncol=2)
    out.append(("each trial's epochs", _png(fig)))
    plt.close(fig)
    return out


def importances(study) -> dict[str, float]:
    """Optuna's parameter importances (PED-ANOVA by default); empty when the study has too few trials."""
    import warnings

    import optuna

    try:
        with warnings.catch_warnings():  # "too few trials": the page says so itself, under the table
            warnings.simplefilter("ignore", UserWarning)
            return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError, ZeroDivisionError):
        return {}


def run_link(run_dir: str | None, out: Path) -> str:
    """A trial's run folder in the table: a link only to a folder of the tune folder (its report when it has
    one), as a relative ``./NAME`` path, so a stored ``javascript:...`` or ``https://...`` is never a URL."""
    if not run_dir:
        return "-"
    name = Path(run_dir).name
    shown = html.escape(printable(name))
    if name in ("", ".", "..") or not (out / name).is_dir() or (out / name).is_symlink():
        return shown
    target = f"{name}/report.html" if (out / name / "report.html").is_file() else f"{name}/"
    return f'<a href="./{html.escape(quote(target))}">{shown}</a>'


def page(study, trials: list[store.Row], best: store.Row | None, metric: str, out: Path) -> str:
    esc = lambda v: html.escape(printable(v))  # noqa: E731
    direction = study.direction.name.lower()
    body = [f"<h1>visiontune tune: study {esc(study.study_name)}</h1>"]
    counts = {s.name.lower(): store.count(trials, s) for s in TrialState}
    body.append(
        "<p>" + ", ".join(f"{v} {k}" for k, v in counts.items() if v) + f"; metric: val {esc(metric)} ({direction})</p>"
    )
    if best is not None:
        body.append(
            f'<p id="best">best: trial <b>{best.number}</b>, val {esc(metric)} '
            f'<b data-value="{best.value!r}">{best.value:.4f}</b>; '
            'its settings in <a href="best.toml">best.toml</a></p>'
        )
    for title, data in _figures(trials, direction, metric):
        body.append(f'<h2>{esc(title)}</h2><img alt="{esc(title)}" src="data:image/png;base64,{data}">')
    imp = importances(study)
    body.append("<h2>parameter importances</h2>")
    finished = counts["complete"]
    if imp and finished < FEW_TRIALS:
        body.append(
            f'<p class="note" id="caveat">from {finished} finished trial{"s" * (finished != 1)} only: with fewer '
            f"than {FEW_TRIALS}, which setting matters is a guess; read them again after more trials</p>"
        )
    if imp:
        body.append('<table id="importances">')
        for name, v in imp.items():
            width = 0 if not math.isfinite(v) else round(300 * v)
            body.append(
                f'<tr><th>{esc(name)}</th><td data-value="{v!r}">{v:.3f}</td>'
                f'<td class="l"><span class="bar" style="width:{width}px"></span></td></tr>'
            )
        body.append("</table>")
    else:
        body.append("<p>not enough finished trials yet</p>")
    names = sorted({k for r in trials for k in r.params})
    body.append(
        '<h2>trials</h2><div class="wide"><table id="trials"><tr><th>trial</th><th>state</th>'
        f"<th>{esc(metric)}</th><th>epochs</th><th>seconds</th>"
        + "".join(f"<th>{esc(n)}</th>" for n in names)
        + "<th>run</th></tr>"
    )
    for r in rows(trials):
        kind = "pruned" if r["state"].startswith("pruned") else "best" if best and r["trial"] == best.number else ""
        value = "" if r["value"] is None else f' data-value="{r["value"]!r}"'
        body.append(
            f'<tr class="{kind}" data-trial="{r["trial"]}"><td>{r["trial"]}</td><td>{esc(r["state"])}</td>'
            f"<td{value}>{_fmt(r['value'])}</td><td>{r['epochs']}</td><td>{_fmt(r['seconds'])}</td>"
            + "".join(f"<td>{html.escape(_setting(r['params'].get(n)))}</td>" for n in names)
            + f"<td>{run_link(r['run_dir'], out)}</td></tr>"
        )
    body.append("</table></div>")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body.append(f"<p><small>written {stamp}</small></p>")
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>visiontune tune</title>'
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_all(study, out: str, metric: str, cfg) -> str:
    """best.toml (when a trial finished), tune.html and trials.json in ``out``, every trial read through the
    store and everything made before anything is written; the terminal table. ``cfg``: the fixed settings."""
    folder = Path(out)
    trials = store.trials(study)
    best = store.best(trials, study.direction.name.lower())
    toml = None if best is None else best_toml(best, metric, cfg)
    html_page = page(study, trials, best, metric, folder)
    if toml is not None:
        files.atomic_write(str(folder / "best.toml"), toml)
    files.write_json(str(folder / "trials.json"), rows(trials))
    files.atomic_write(str(folder / "tune.html"), html_page)
    lines = [table(trials, best, metric), ""]
    if best is not None:
        where = printable(best.run_dir or "-")
        lines.append(f"visiontune: best trial {best.number}: val {metric} {best.value:.4f} ({where})")
        lines.append(f"visiontune: repeat it with `visiontune train --config {printable(folder / 'best.toml')}`")
    else:
        lines.append("visiontune: no trial finished yet")
    lines.append(f"visiontune: wrote {printable(folder / 'tune.html')}")
    return "\n".join(lines)
