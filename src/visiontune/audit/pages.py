"""What the audit writes: ``audit.csv`` (one row per flagged file), ``audit.json`` (counts, settings,
versions) and ``audit.html`` (a grid of thumbnails for each kind, the worst first).

Every file is written whole or not at all (``files.atomic_write``). The page is one self-contained file:
the shared stylesheet (``reports.style``) and each thumbnail inlined; file names and class names come from
the data, so each is escaped where it is shown, and the CSV's cells that a spreadsheet would run as a
formula are kept as text.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json

from visiontune.audit.issues import FIELDS
from visiontune.files import atomic_write

KINDS = ("label", "leak", "duplicate", "outlier")
SHOWN = 48  # thumbnails a kind shows on the page; the CSV lists every row
TITLES = {
    "label": "Probable label errors (cleanlab's label quality, lowest first)",
    "leak": "Leaks: copies on both sides of the split",
    "duplicate": "Duplicates: exact or near copies",
    "outlier": "Outliers: far from every class, blank or nearly constant, extreme aspect ratio",
}


def _cell(value) -> str:
    text = "" if value is None else str(value)
    # A name from the data that a spreadsheet would run as a formula is kept as text (OWASP's rule).
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") and not _number(text) else text


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _cell(r.get(k)) for k in FIELDS})
    return out.getvalue()


def _thumb(source) -> str:
    """A 64 px PNG of the image as a data URL ('' when it cannot be read)."""
    from torchvision.io import encode_png

    from visiontune.data.decode import BadImage, read_source, resize_uint8

    try:
        img = resize_uint8(read_source(source), 64)
    except (BadImage, OSError):
        return ""
    return "data:image/png;base64," + base64.b64encode(encode_png(img).numpy().tobytes()).decode()


def _caption(r: dict) -> str:
    if r["kind"] == "label":  # a regression's rows have numbers, not a probability
        sure = f" ({r['probability']:.2f})" if r.get("probability") is not None else ""
        return f"{r['given']} → {r['suggested']}{sure}"
    if r["kind"] in ("leak", "duplicate"):
        return f"group {r['group']}, {r['split']}"
    return r.get("note", "")


def page(rows: list[dict], summary: dict, source_of) -> str:
    """audit.html; ``source_of(file)``: what to read a flagged file's pixels from."""
    from visiontune.reports.style import CSS

    counts = ", ".join(f"{summary['counts'][k]} {k}" for k in KINDS)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>visiontune audit</title>",
        "<style>" + CSS + ".grid{display:flex;flex-wrap:wrap;gap:8px}.grid figure{margin:0;width:9em}"
        ".grid figcaption{font-size:11px;overflow-wrap:anywhere}</style></head><body>",
        f"<h1>Audit of {html.escape(summary['data'])}</h1>",
        f"<p>{summary['images']} images; {html.escape(counts)}; out-of-fold probabilities from "
        f"{summary['settings']['folds']} folds. Every row is in audit.csv.</p>",
    ]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        parts.append(f"<h2 id='{kind}'>{html.escape(TITLES[kind])}: {len(mine)}</h2>")
        if len(mine) > SHOWN:
            parts.append(f"<p class='note'>The first {SHOWN} shown.</p>")
        parts.append("<div class='grid'>")
        for r in mine[:SHOWN]:
            src = _thumb(source_of(r["file"]))
            img = f"<img alt='{html.escape(r['file'], quote=True)}' src='{src}'>" if src else "<p>(unreadable)</p>"
            parts.append(
                f"<figure class='{kind}'>{img}<figcaption><b>{html.escape(_caption(r))}</b><br>"
                f"{html.escape(r['file'])}</figcaption></figure>"
            )
        parts.append("</div>")
    parts.append("</body></html>")
    return "".join(parts)


def write(out: str, rows: list[dict], summary: dict, source_of) -> None:
    """audit.csv, audit.json and audit.html in ``out``, each replaced whole."""
    import os

    atomic_write(os.path.join(out, "audit.csv"), csv_text(rows))
    atomic_write(os.path.join(out, "audit.json"), json.dumps(summary, indent=2) + "\n")
    atomic_write(os.path.join(out, "audit.html"), page(rows, summary, source_of))
