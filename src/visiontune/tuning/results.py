"""What a study comes to: ``best.toml``, the terminal table and ``tune.html``.

``best.toml`` holds every setting of the best finished trial as it was trained (the fixed ones and the
sampled ones, resolved), so ``visiontune train --config OUT/best.toml`` repeats that trial: the same split,
seed and settings, the same metrics. ``tune.html`` is one self-contained page: each trial's value against
the time it finished, with the best so far and pruned trials marked, each trial's per-epoch curve, Optuna's
parameter importances, and a table of every trial linking its run folder's report.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
from pathlib import Path

from optuna.trial import TrialState

from visiontune import files

# Settings best.toml leaves out: where the trial's folder was (the new run gets its own) and unset ones.
_NOT_KEPT = ("output_dir", "resume")


def settings_of(cfg) -> dict:
    """A trial's settings as best.toml holds them: JSON/TOML values, no unset ones."""
    out = {}
    for k, v in cfg.to_dict().items():
        if k in _NOT_KEPT or v is None:
            continue
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a TOML basic string is JSON's string syntax for these values


def best_toml(trial, metric: str) -> str:
    comments = [
        f"visiontune tune: trial {trial.number}, best val {metric} {trial.value:.6g}",
        f"its run folder: {trial.user_attrs.get('run_dir')}",
        "repeat it with: visiontune train --config best.toml [--output-dir DIR]",
    ]
    return config_toml(trial.user_attrs["config"], comments)


def config_toml(settings: dict, comments: list[str]) -> str:
    """``settings`` (``settings_of``'s) as a TOML file ``train --config`` reads, under ``comments``."""
    lines = [f"# {c}" for c in comments] + [f"{k} = {_toml_value(v)}" for k, v in settings.items()]
    return "\n".join(lines) + "\n"


def _state(t) -> str:
    if t.state == TrialState.FAIL and t.system_attrs.get("visiontune:failed"):
        return "failed (tuner stopped; retried)"
    if t.system_attrs.get("failed_trial") is not None:
        return f"{t.state.name.lower()} (retry of {t.system_attrs['failed_trial']})"
    return t.state.name.lower()


def _value(t) -> float | None:
    if t.state == TrialState.COMPLETE:
        return t.value
    if t.state == TrialState.PRUNED and t.intermediate_values:
        return t.intermediate_values[max(t.intermediate_values)]
    return None


def rows(study) -> list[dict]:
    out = []
    for t in study.get_trials(deepcopy=False):
        ended = t.datetime_complete and t.datetime_start
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() if ended else None
        out.append(
            {
                "trial": t.number,
                "state": _state(t),
                "value": _value(t),
                "epochs": len(t.intermediate_values),
                "seconds": seconds,
                "params": dict(t.params),
                "run_dir": t.user_attrs.get("run_dir"),
            }
        )
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(study, metric: str) -> str:
    """The terminal table: one line a trial, the best marked with *."""
    best = _best(study)
    names = sorted({k for t in study.get_trials(deepcopy=False) for k in t.params})
    head = ["", "trial", "state", metric, "epochs", "seconds", *names]
    body = [
        [
            "*" if best is not None and r["trial"] == best.number else "",
            str(r["trial"]),
            r["state"],
            _fmt(r["value"]),
            str(r["epochs"]),
            _fmt(r["seconds"]),
            *(_fmt(r["params"].get(n)) for n in names),
        ]
        for r in rows(study)
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    return "\n".join(lines)


def _best(study):
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return study.best_trial if done else None


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _figures(study, metric: str) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t for t in study.get_trials(deepcopy=False) if t.datetime_complete]
    out = []
    if not trials:
        return out
    start = min(t.datetime_start for t in trials if t.datetime_start)
    minutes = lambda t: (t.datetime_complete - start).total_seconds() / 60  # noqa: E731
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for state, marker, colour, label in (
        (TrialState.COMPLETE, "o", "tab:blue", "complete"),
        (TrialState.PRUNED, "x", "tab:red", "pruned (last reported value)"),
    ):
        pts = [(minutes(t), _value(t)) for t in trials if t.state == state and _value(t) is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=colour, label=label, zorder=3)
    done = sorted((t for t in trials if t.state == TrialState.COMPLETE), key=minutes)
    if done:
        pick = min if study.direction.name == "MINIMIZE" else max
        best, xs, ys = None, [], []
        for t in done:
            best = t.value if best is None else pick(best, t.value)
            xs.append(minutes(t))
            ys.append(best)
        ax.step(xs, ys, where="post", color="black", label="best so far")
    ax.set_xlabel("minutes since the first trial started")
    ax.set_ylabel(f"val {metric}")
    ax.legend(loc="best", fontsize=8)
    out.append(("trials over time", _png(fig)))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for t in trials:
        if t.intermediate_values:
            steps = sorted(t.intermediate_values)
            pruned = t.state == TrialState.PRUNED
            ax.plot(
                [s + 1 for s in steps],
                [t.intermediate_values[s] for s in steps],
                linestyle="--" if pruned else "-",
                marker="x" if pruned else ".",
                label=f"{t.number}{' (pruned)' if pruned else ''}",
            )
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"val {metric}")
    ax.legend(loc="best", fontsize=7, ncol=2)
    out.append(("each trial's epochs", _png(fig)))
    plt.close(fig)
    return out


def importances(study) -> dict[str, float]:
    """Optuna's parameter importances (PED-ANOVA by default); empty when the study has too few trials."""
    import optuna

    try:
        return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError, ZeroDivisionError):
        return {}


CSS = (
    "body{font-family:sans-serif;max-width:1100px;margin:1em auto;padding:0 1em}"
    "table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
    "tr.pruned td{color:#b00}tr.best td{font-weight:bold}.bar{background:#4a7ab0;height:0.8em;display:inline-block}"
)


def page(study, metric: str, out: Path) -> str:
    esc = html.escape
    best = _best(study)
    body = [f"<h1>visiontune tune: study {esc(study.study_name)}</h1>"]
    counts = {s.name.lower(): len(study.get_trials(deepcopy=False, states=(s,))) for s in TrialState}
    body.append(
        "<p>" + ", ".join(f"{v} {k}" for k, v in counts.items() if v) + f"; metric: val {esc(metric)} "
        f"({study.direction.name.lower()})</p>"
    )
    if best is not None:
        body.append(
            f'<p id="best">best: trial <b>{best.number}</b>, val {esc(metric)} '
            f'<b data-value="{best.value!r}">{best.value:.4f}</b>; '
            'its settings in <a href="best.toml">best.toml</a></p>'
        )
    for title, data in _figures(study, metric):
        body.append(f'<h2>{esc(title)}</h2><img alt="{esc(title)}" src="data:image/png;base64,{data}">')
    imp = importances(study)
    body.append("<h2>parameter importances</h2>")
    if imp:
        body.append('<table id="importances">')
        for name, v in imp.items():
            width = 0 if not math.isfinite(v) else round(300 * v)
            body.append(
                f'<tr><th>{esc(name)}</th><td data-value="{v!r}">{v:.3f}</td>'
                f'<td style="text-align:left"><span class="bar" style="width:{width}px"></span></td></tr>'
            )
        body.append("</table>")
    else:
        body.append("<p>not enough finished trials yet</p>")
    names = sorted({k for t in study.get_trials(deepcopy=False) for k in t.params})
    body.append(
        '<h2>trials</h2><table id="trials"><tr><th>trial</th><th>state</th>'
        f"<th>{esc(metric)}</th><th>epochs</th><th>seconds</th>"
        + "".join(f"<th>{esc(n)}</th>" for n in names)
        + "<th>run</th></tr>"
    )
    for r in rows(study):
        kind = "pruned" if r["state"].startswith("pruned") else "best" if best and r["trial"] == best.number else ""
        link = "-"
        if r["run_dir"]:
            rel = Path(r["run_dir"]).name
            target = f"{rel}/report.html" if (out / rel / "report.html").exists() else rel
            link = f'<a href="{esc(target)}">{esc(rel)}</a>'
        value = "" if r["value"] is None else f' data-value="{r["value"]!r}"'
        body.append(
            f'<tr class="{kind}" data-trial="{r["trial"]}"><td>{r["trial"]}</td><td>{esc(r["state"])}</td>'
            f"<td{value}>{_fmt(r['value'])}</td><td>{r['epochs']}</td><td>{_fmt(r['seconds'])}</td>"
            + "".join(f"<td>{esc(_fmt(r['params'].get(n)))}</td>" for n in names)
            + f"<td>{link}</td></tr>"
        )
    body.append("</table>")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body.append(f"<p><small>written {stamp}</small></p>")
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>visiontune tune</title>'
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_all(study, out: str, metric: str) -> str:
    """best.toml (when a trial finished), tune.html and trials.json in ``out``; the terminal table."""
    folder = Path(out)
    best = _best(study)
    if best is not None:
        files.atomic_write(str(folder / "best.toml"), best_toml(best, metric))
    files.write_json(str(folder / "trials.json"), rows(study))
    files.atomic_write(str(folder / "tune.html"), page(study, metric, folder))
    lines = [table(study, metric), ""]
    if best is not None:
        where = best.user_attrs["run_dir"]
        lines.append(f"visiontune: best trial {best.number}: val {metric} {best.value:.4f} ({where})")
        lines.append(f"visiontune: repeat it with `visiontune train --config {folder / 'best.toml'}`")
    else:
        lines.append("visiontune: no trial finished yet")
    lines.append(f"visiontune: wrote {folder / 'tune.html'}")
    return "\n".join(lines)
