"""``RUN/report.html``: one self-contained page that shows what a run did and how good it is.

The page is built from the run folder's own files -- ``config.json``,
``summary.json``, ``eval.json``, the PNGs and, when the run belongs to a
``bench``, its ``bench.json`` -- so it can be rebuilt at any time
(``visiontune report RUN``). The JSON files are read back checked
(``runs.runrecords``, ``runs.evalrecords``), the PNGs embedded up to ``MAX_PNG`` bytes each.
Images are embedded as data URIs and the page has no script and no external reference: it opens the
same offline, attached to an email or archived. Every number shown carries ``data-src``/``data-path``
naming the JSON value it shows, which is how the browser test checks them.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from pathlib import Path

from visiontune.errors import UserError
from visiontune.files import atomic_write
from visiontune.reports import evaluations, regression
from visiontune.reports.style import CSS
from visiontune.runs import evalrecords, runrecords
from visiontune.tasks import MULTI_LABEL, REGRESSION, SINGLE_LABEL
from visiontune.text import byte_size


def _evaluation_of(path: Path) -> dict | None:
    """``path``'s evaluation checked by its schema (``runs.evalrecords``), or None: none there, or one no
    evaluation this visiontune knows wrote."""
    return evalrecords.read_evaluation(path, evaluations.schemas())


# A value whose key has one of these words is a score (an accuracy, a loss, an F1, a probability): 4
# decimals, as the console prints them. Any other number (images/s, seconds, a share, an lr) is rounded
# to 3 significant digits, what it can tell; counts are whole, thousands separated as the start-up block.
SCORES = {"accuracy", "loss", "precision", "recall", "f1", "ap", "map", "ece", "probability", "threshold", "match"}


def _fmt(v, key=None) -> str:
    """How a JSON value at ``key`` is shown (the browser test formats the JSON the same way)."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(key, str) and SCORES & set(key.split("_")):
        return f"{v:.4f}"
    if not math.isfinite(v) or abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:#.3g}".rstrip(".")


def _num(src: str, data: dict, *path) -> str:
    """A table cell with the value at ``path`` in ``data`` and where it comes from."""
    v = data
    for key in path:  # a value a file does not hold (a row without a speedup: no single baseline) shows "-"
        try:
            v = v[key]
        except (KeyError, IndexError, TypeError):
            v = None
            break
    where = html.escape(json.dumps(list(path)), quote=True)
    return f'<td data-src="{src}" data-path="{where}">{html.escape(_fmt(v, path[-1] if path else None))}</td>'


MAX_PNG = 32 << 20  # bytes of one embedded figure: a run's largest (a 1,000-class confusion matrix) is a few MB


def _img(path: Path, alt: str) -> str:
    """``path`` embedded, or a note when it is larger than any figure visiontune draws (not read)."""
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        data = f.read(MAX_PNG + 1)  # never more, whatever the file grew to since
    if len(data) > MAX_PNG:
        return (
            f'<p class="note">{html.escape(path.name)} is larger than a page embeds ({byte_size(MAX_PNG)}) and '
            "is left out: open it beside the report.</p>"
        )
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def _rows(pairs: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f'<tr><th class="l">{html.escape(k)}</th>{cell}</tr>' for k, cell in pairs) + "</table>"


def _epochs(asked, stopped) -> str | int | None:
    """The epochs asked, and where the run stopped before them (--max-steps, early stop, a caller's reason)."""
    if not isinstance(stopped, dict) or not isinstance(asked, int):
        return asked
    done = stopped.get("epochs_done")
    reason = stopped.get("reason")
    why = f"--max-steps {stopped.get('optimizer_steps')}" if reason == "max-steps" else str(reason)
    ran = f"{done} epoch{'s' * (done != 1)}" if isinstance(done, int) else "fewer"
    return f"{asked} asked; stopped after {ran}: {why}"


def _setup(run: Path, config: dict, summary: dict | None) -> str:
    # ``config`` as runs.runrecords read it: each section, when there, of the type the schema says.
    cfg, setup, view = config.get("config") or {}, config.get("setup") or {}, config.get("model") or {}
    resize = view.get("interpolation")
    if resize:  # as the run resized every image (runinfo's record)
        crop = view.get("crop_pct")
        resize += f", short side to size / {crop}, centre crop" if crop else ", whole image squashed to size"
    overview = config.get("overview") or {}  # the resolved setup the run announced (older runs recorded none)
    plain = [
        ("data", (config.get("data") or {}).get("root")),
        ("layout", (config.get("data") or {}).get("layout")),
        ("model", cfg.get("model")),
        ("weights", cfg.get("weights")),
        ("image size", cfg.get("image_size")),
        ("resize", resize),
        ("epochs", _epochs(cfg.get("epochs"), (summary or {}).get("stopped"))),
        ("strategy", setup.get("strategy")),
        ("processes", setup.get("world_size")),
        ("batch per process", setup.get("per_process_batch")),
        ("global batch", setup.get("global_batch")),
        ("learning rate", setup.get("lr")),
        ("devices", ", ".join(sorted(set(setup.get("devices") or [])))),
        ("versions", ", ".join(f"{k} {v}" for k, v in (config.get("versions") or {}).items())),
    ]
    if overview:  # its rows say the model, resize, batch and lr in full: one row each, not two or three
        said = {"model", "weights", "image size", "resize", "processes", "batch per process", "global batch"}
        plain = [(k, v) for k, v in plain if k not in said | {"learning rate"}]
        plain += list(overview.items())
    out = [_rows([(k, f'<td class="l">{html.escape(_fmt(v))}</td>') for k, v in plain])]
    if summary:
        keys = [
            ("best val accuracy", "best_val_accuracy"),
            ("best val loss", "best_val_loss"),
            ("best val mAP", "best_val_map"),
            ("best val MAE", "best_val_mae"),
            ("best val RMSE", "best_val_rmse"),
            ("best val R²", "best_val_r2"),
            ("epochs run", "epochs"),
            ("train images", "train_split_size"),
            ("val images", "val_split_size"),
            ("train images/s", "train_images_per_s"),
            ("data-stall share", "data_wait_fraction"),
            ("total seconds", "total_seconds"),
        ]
        rows = [(label, _num("summary", summary, k)) for label, k in keys if k in summary]
        best = summary.get("best_epoch")  # counted from 1, as the console and the curves (runrecords)
        if isinstance(best, int):
            metric = {"map": "mAP"}.get(summary.get("best_metric"), summary.get("best_metric"))
            chosen = f"{best}" + (f", chosen by val {metric}" if metric else "")
            rows.insert(0, ("best epoch", f'<td class="l">{html.escape(chosen)}</td>'))
        out += ["<h3>Results</h3>", _rows(rows)]
    else:
        out.append('<p class="note">No summary.json: the training did not finish.</p>')
    return "".join(out)


def beside(eval_json: str | Path, name: str) -> Path:
    """Where an evaluation's file ``name`` (confusion_matrix.png, top_losses.csv, ...) goes: beside its JSON,
    and named after it for an exported model's evaluation (``eval-best.int8.json``: ``eval-best.int8-NAME``),
    so that it never replaces the run's own."""
    p = Path(eval_json)
    return p.parent / (f"{p.stem}-{name}" if p.name.startswith(BESIDE) else name)


BESIDE = "eval-"  # RUN/eval-NAME.json: the evaluation of another file of the run (an export), beside eval.json
MAX_BESIDE = 20  # evaluations shown side by side at most (a folder may hold any number of files)


def is_beside(run_dir: str | Path, eval_json: str | Path) -> bool:
    p = Path(eval_json)
    return p.name.startswith(BESIDE) and p.suffix == ".json" and p.parent.resolve() == Path(run_dir).resolve()


def _side_by_side(run: Path) -> str:
    """The run's own evaluation and those of its exported files (``eval-NAME.json``), one column each: which
    file each scored (name, sha256), on which images, and its headline figures."""
    found = [run / "eval.json", *sorted(run.glob(f"{BESIDE}*.json"))[:MAX_BESIDE]]
    evals = [(p, ev) for p in found if (ev := _evaluation_of(p)) and "averages" in ev]
    if not any(p.name != "eval.json" for p, _ in evals):
        return ""
    rows = [
        ("model file", ("model_file", "name")),
        ("sha256", ("model_file", "sha256")),
        ("scored", ("scored",)),
        ("accuracy", ("accuracy",)),
        ("mAP (macro)", ("map",)),
        ("macro f1", ("averages", "macro", "f1")),
        ("log loss", ("log_loss",)),
        ("MAE", ("mae",)),
    ]

    def cell(ev: dict, path: tuple) -> str:
        v = ev
        for key in path:
            v = v.get(key) if isinstance(v, dict) else None
        text = _fmt(v, path[-1])
        return text[:12] + "..." if path[-1] == "sha256" and v else text

    shown = [(label, path) for label, path in rows if any(cell(ev, path) != "-" for _, ev in evals)]
    head = "<tr><th class='l'>evaluation</th>" + "".join(f"<th class='l'>{html.escape(p.name)}</th>" for p, _ in evals)
    body = "".join(
        f"<tr><th class='l'>{html.escape(label)}</th>"
        + "".join(f"<td class='l'>{html.escape(cell(ev, path))}</td>" for _, ev in evals)
        + "</tr>"
        for label, path in shown
    )
    return f"<h3>Side by side</h3><table>{head}</tr>{body}</table>"


def _multilabel_evaluation(eval_json: Path, ev: dict) -> str:
    """A multi-label eval.json: mAP and the averages, per-class AP at the threshold used, the worst images."""
    overall = [
        ("images", ("images",)),
        ("mAP (macro)", ("map",)),
        ("mAP (micro)", ("map_micro",)),
        ("exact match", ("exact_match",)),
        ("label accuracy (Hamming)", ("hamming_accuracy",)),
    ] + [(f"{kind} {m}", ("averages", kind, m)) for kind in ("macro", "micro") for m in ("precision", "recall", "f1")]
    out = [
        (
            f"<p>Multi-label. Scored: {html.escape(ev['scored'])}; test-time augmentation: {html.escape(ev['tta'])}; "
            f"thresholds: {html.escape(ev['thresholds_from'])}; data {html.escape(ev['data'])}.</p>"
        ),
        _rows([(label, _num("eval", ev, *path)) for label, path in overall]),
        (
            "<h3>Per class</h3><table><tr><th>#</th><th class='l'>class</th><th>AP</th><th>threshold</th>"
            "<th>precision</th><th>recall</th><th>f1</th><th>positives</th></tr>"
        ),
    ]
    for i, name in enumerate(ev["per_class"]):
        keys = ("ap", "threshold", "precision", "recall", "f1", "support")
        out.append(
            f"<tr><td>{i}</td><td class='name'>{html.escape(name)}</td>"
            + "".join(_num("eval", ev, "per_class", name, k) for k in keys)
            + "</tr>"
        )
    out.append(
        "</table><h3>Worst images per class</h3><table><tr><th class='l'>class</th><th>#</th>"
        "<th class='l'>image</th><th class='l'>labelled</th><th>probability</th></tr>"
    )
    for name, items in (ev.get("worst_per_class") or {}).items():
        for i, it in enumerate(items):
            out.append(
                f"<tr><td class='name'>{html.escape(name)}</td><td>{i + 1}</td>"
                f"<td class='name'>{html.escape(it['path'])}</td><td class='l'>{'yes' if it['positive'] else 'no'}</td>"
                + _num("eval", ev, "worst_per_class", name, i, "probability")
                + "</tr>"
            )
    out.append("</table>")
    return "".join(out)


def _evaluation(eval_json: Path, ev: dict) -> str:
    """The section of an ``eval.json`` read back checked (its figures ``beside`` it), as the evaluation that
    wrote it (``evaluations``, by its name) shows it, and which model file it scored."""
    scored = ev.get("model_file") or {}
    named_file = (
        f"<p>Model file: {html.escape(str(scored.get('name')))} (sha256 {html.escape(str(scored.get('sha256')))}).</p>"
        if scored
        else ""
    )
    return named_file + evaluations.EVALUATIONS[ev["report"]].section(eval_json, ev)


def _single_label_evaluation(eval_json: Path, ev: dict) -> str:
    """A single-label eval.json: accuracy and the averages, per-class precision and recall, the confusion
    matrix and the top losses."""
    top = f"top-{ev['top_k']} accuracy" if ev.get("top_k") else None
    overall = [
        ("images", "images"),
        ("accuracy", "accuracy"),
        ("balanced accuracy", "balanced_accuracy"),
        ("macro average precision", "macro_average_precision"),
        (top, "top_k_accuracy"),
        ("log loss", "log_loss"),
        (f"ECE ({ev['ece_bins']} bins)", "ece"),
    ]
    avgs = [
        (f"{kind} {m}", ("averages", kind, m)) for kind in ("macro", "weighted") for m in ("precision", "recall", "f1")
    ]
    out = [
        (
            f"<p>Scored: {html.escape(ev['scored'])}; test-time augmentation: {html.escape(ev['tta'])}; "
            f"data {html.escape(ev['data'])}.</p>"
        ),
        _rows(
            [(label, _num("eval", ev, k)) for label, k in overall if label]
            + [(label, _num("eval", ev, *path)) for label, path in avgs]
        ),
        (
            "<h3>Per class</h3><table><tr><th>#</th><th class='l'>class</th><th>precision</th><th>recall</th>"
            "<th>f1</th><th>images</th></tr>"
        ),
    ]
    for i, name in enumerate(ev["per_class"]):
        out.append(
            f"<tr><td>{i}</td><td class='name'>{html.escape(name)}</td>"
            + "".join(_num("eval", ev, "per_class", name, k) for k in ("precision", "recall", "f1", "support"))
            + "</tr>"
        )
    out += [
        "</table><h3>Confusion matrix</h3>",
        _img(beside(eval_json, "confusion_matrix.png"), "confusion matrix"),
        "<h3>Top losses</h3>",
        _img(beside(eval_json, "top_losses.png"), "top losses"),
    ]
    if ev.get("top_losses"):
        out.append(
            "<table><tr><th>#</th><th class='l'>image</th><th class='l'>true</th><th class='l'>predicted</th>"
            "<th>probability</th><th>loss</th></tr>"
        )
        for i, it in enumerate(ev["top_losses"]):
            out.append(
                f"<tr><td>{i + 1}</td><td class='name'>{html.escape(it['path'])}</td>"
                f"<td class='name'>{html.escape(ev['classes'][it['true']])}</td>"
                f"<td class='name'>{html.escape(ev['classes'][it['predicted']])}</td>"
                + _num("eval", ev, "top_losses", i, "probability")
                + _num("eval", ev, "top_losses", i, "loss")
                + "</tr>"
            )
        out.append("</table>")
    return "".join(out)


def _regression_evaluation(eval_json: Path, ev: dict) -> str:
    """A regression eval.json: MAE, RMSE and R² against the mean's MAE, per target, the largest residuals and
    the predicted-vs-true scatter."""
    overall = [("images", ("count",)), ("MAE", ("mae",)), ("RMSE", ("rmse",)), ("R²", ("r2",))]
    overall.append(("MAE of always the mean", ("baseline_mae",)))
    return (
        f"<p>Regression. Scored: {html.escape(str(ev.get('scored')))}; data {html.escape(str(ev.get('data')))}.</p>"
        + _rows([(label, _num("eval", ev, *path)) for label, path in overall])
        + regression.section(ev, _num)
        + _img(beside(eval_json, "scatter.png"), "predicted against true")
    )


# The page section of each built-in task's evaluation; its eval.json writer is registered beside it by
# ``inference.evaluate``.
# The fields each shows are checked when its eval.json is read back (``evalrecords.EVALUATIONS``).
evaluations.register(SINGLE_LABEL.name, section=_single_label_evaluation, fields=evalrecords.EVALUATIONS["classify"])
evaluations.register(MULTI_LABEL.name, section=_multilabel_evaluation, fields=evalrecords.EVALUATIONS["multilabel"])
evaluations.register(REGRESSION.name, section=_regression_evaluation, fields=evalrecords.EVALUATIONS["regress"])


def _bench(bench: dict) -> str:
    cols = [
        ("processes", "processes"),
        ("global batch", "global_batch"),
        ("images/s", "images_per_s"),
        ("spread", "spread"),
        ("speedup", "speedup"),
        ("data stall", "data_stall"),
        ("val acc", "val_accuracy"),
    ]
    from visiontune.reports.benchtable import unreliable_line

    warning = unreliable_line(bench.get("rows", []))
    out = [
        f"<p>{html.escape(bench.get('load_note', ''))}</p>"
        + (f"<p class='note'><b>{html.escape(warning)}</b></p>" if warning else "")
        + "<table><tr><th class='l'>strategy</th>"
        + "".join(f"<th>{c}</th>" for c, _ in cols)
        + "<th class='l'>note</th></tr>"
    ]
    for i, r in enumerate(bench.get("rows", [])):
        if "images_per_s" not in r:
            out.append(
                f"<tr><td class='l'>{html.escape(r['strategy'])}</td><td colspan='{len(cols)}'></td>"
                f"<td class='l'>not run: {html.escape(r.get('skipped') or r.get('failed', ''))}</td></tr>"
            )
            continue
        out.append(
            f"<tr><td class='l'>{html.escape(r['strategy'])}</td>"
            + "".join(
                "<td>unreliable</td>" if k == "speedup" and r.get("unreliable") else _num("bench", bench, "rows", i, k)
                for _, k in cols
            )
            + f"<td class='l'>{html.escape(r.get('note', ''))}</td></tr>"
        )
    return "".join(out) + "</table>"


def _bench_of(run: Path) -> tuple[Path | None, dict | None]:
    """The bench folder's own ``bench.json``, or the parent's when this run is one of its rows."""
    own = evalrecords.read_bench(run / "bench.json")
    if own is not None:
        return run / "bench.json", own
    parent = evalrecords.read_bench(run.parent / "bench.json")
    mine = parent is not None and any(
        Path(r["run_dir"]).resolve() == run.resolve() for r in parent.get("rows", []) if r.get("run_dir")
    )
    return (run.parent / "bench.json", parent) if mine else (None, None)


def _smoothing_note(config: dict) -> str:
    """Why the val loss can sit below the train loss: the one line a run with label smoothing needs."""
    smoothing = (config.get("config") or {}).get("label_smoothing")
    if not isinstance(smoothing, (int, float)) or isinstance(smoothing, bool) or not smoothing > 0:
        return ""
    return (
        f'<p class="note">Label smoothing {smoothing:g}: the train loss is measured against softened targets, '
        "which no prediction brings to 0, and the val loss against the true labels (plain cross-entropy), so "
        "the val loss can sit below the train loss.</p>"
    )


AUDIT_JSON_BYTES = 1 << 20  # audit.json holds counts and settings: a larger one is not an audit's
AUDITS_LOOKED_AT = 64  # folders beside the run looked into for an audit of its data


def _audit_data(folder: Path) -> str | None:
    """The data an audit folder audited (its ``audit.json``'s ``root``), or None when it is not an audit's;
    the file is read bounded, as any file found on disk."""
    path = folder / "audit.json"
    try:
        if not (folder / "audit.html").is_file() or path.stat().st_size > AUDIT_JSON_BYTES:
            return None
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    data = found.get("root") if isinstance(found, dict) else None
    return data if isinstance(data, str) and len(data) < 4096 else None


def _audit_of(run: Path, config: dict) -> Path | None:
    """The audit of this run's data: the folder of its ``--exclude``/``--relabel`` CSV, the audit this run is
    a fold of, or an audit folder beside the run; each must name the run's data."""
    settings = config.get("config") or {}
    root = (config.get("data") or {}).get("root")
    csvs = [settings.get(k) for k in ("exclude", "relabel") if isinstance(settings.get(k), str)]
    beside = sorted(p for p in run.parent.iterdir() if p.is_dir())[:AUDITS_LOOKED_AT] if run.parent.is_dir() else []
    for folder in [*(Path(c).parent for c in csvs), run.parent.parent, *beside]:
        data = _audit_data(folder)
        if data is not None and isinstance(root, str) and os.path.realpath(data) == os.path.realpath(root):
            return folder
    return None


def _audit_link(run: Path, config: dict) -> str:
    found = _audit_of(run, config)
    if found is None:
        return ""
    href = html.escape(Path(os.path.relpath(found / "audit.html", run)).as_posix(), quote=True)
    shown = html.escape(f"{found}/audit.html")
    return f'<p>The data\'s audit (label issues, duplicates, leaks, outliers): <a href="{href}">{shown}</a></p>'


def build(run_dir: str | Path, eval_json: str | Path | None = None) -> str:
    """The page's HTML for ``run_dir`` (``eval_json`` defaults to ``RUN/eval.json``)."""
    run = Path(run_dir)
    config, summary = runrecords.read_config(run), runrecords.read_summary(run)
    bench_file, bench = _bench_of(run)
    if config is None and bench is None:
        raise UserError(f"{run} is not a visiontune run folder (no config.json) nor a bench folder (no bench.json)")
    eval_path = Path(eval_json) if eval_json else run / "eval.json"
    ev = _evaluation_of(eval_path)  # None: not evaluated, or by an older visiontune (evaluate again)
    title = f"visiontune run {run.name}" if config else f"visiontune bench {run.name}"
    body = [f"<h1>{html.escape(title)}</h1>"]
    if config:
        body += [
            "<h2>Setup</h2>",
            _setup(run, config, summary),
            _audit_link(run, config),
            "<h2>Training curves</h2>",
            _img(run / "training_results.png", "training curves") or '<p class="note">No epoch finished.</p>',
            _smoothing_note(config),
            "<h2>Evaluation</h2>",
        ]
        body.append(_side_by_side(run))
        body.append(
            _evaluation(eval_path, ev)
            if ev
            else f'<p class="note">Not evaluated yet: <code>visiontune evaluate --run {html.escape(str(run))} '
            f"--data DATA</code> adds per-class metrics, the confusion matrix and the top losses.</p>"
        )
    if bench:
        body += ["<h2>Benchmark</h2>", _bench(bench), _img(bench_file.parent / "bench.png", "benchmark")]
    return (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write(run_dir: str | Path, eval_json: str | Path | None = None) -> Path:
    """Write ``RUN/report.html`` and return its path."""
    out = Path(run_dir) / "report.html"
    atomic_write(out, build(run_dir, eval_json))
    return out
