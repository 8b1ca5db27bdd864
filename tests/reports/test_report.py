"""report.html: self-contained, rebuilt by `visiontune report`, and checked in a real headless Chromium
(marked ``browser``; `make test` installs Chromium, the rest of the suite never needs it)."""

from __future__ import annotations

import html
import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from browser import CHECK, dump_dom
from trained import one_thread  # noqa: F401  (one_thread: autouse fixture)
from visiontune.cli.commands import main


@pytest.fixture(scope="module")
def run(tmp_path_factory, sample_data, trained_run) -> Path:
    """A copy of the shared trained run, evaluated (which refreshes its report) on class folders where a few
    images sit in the wrong folder, so that there are top losses to show."""
    tmp = tmp_path_factory.mktemp("report")
    out = Path(shutil.copytree(trained_run, tmp / "run", ignore=shutil.ignore_patterns("checkpoints")))
    cats, dogs = (sorted((sample_data / "train").glob(f"{c}.*.jpg")) for c in ("cat", "dog"))
    for folder, files in (("cat", cats[:8] + dogs[:3]), ("dog", dogs[10:18] + cats[10:12])):
        (tmp / "pets" / folder).mkdir(parents=True)
        for f in files:
            shutil.copy(f, tmp / "pets" / folder / f.name)
    assert main(["evaluate", "--run", str(out), "--data", str(tmp / "pets"), "--no-progress", "--top-losses", "4"]) == 0
    return out


def shown(v, key) -> str:
    """How the page must show a JSON value: a score (accuracy, loss, F1, probability...) with 4 decimals,
    another number to 3 significant digits, a count thousands-separated."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return f"{v:,}"
    scores = {"accuracy", "loss", "precision", "recall", "f1", "ap", "map", "ece", "probability", "threshold", "match"}
    if scores & set(str(key).split("_")):
        return f"{v:.4f}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:#.3g}".rstrip(".")


class Cells(HTMLParser):
    """(source, path, text) of every cell that says which JSON value it shows; the <img> sources."""

    def __init__(self):
        super().__init__()
        self.cells, self.images, self._open = [], [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-src" in a:
            self._open = [a["data-src"], json.loads(a["data-path"]), ""]
        if tag == "img":
            self.images.append(a["src"])

    def handle_data(self, data):
        if self._open:
            self._open[2] += data

    def handle_endtag(self, tag):
        if self._open and tag == "td":
            self.cells.append(tuple(self._open))
            self._open = None


def parse(page: str) -> Cells:
    cells = Cells()
    cells.feed(page)
    return cells


def value(data, path):
    for key in path:
        data = data[key]
    return data


@pytest.mark.slow
def test_the_page_is_self_contained_and_rebuilt_the_same(run, capsys):
    page = (run / "report.html").read_text()
    cells = parse(page)
    assert len(cells.images) == 3 and all(s.startswith("data:image/png;base64,") for s in cells.images)
    assert not re.search(r"(?<![\w-])(src|href)\s*=\s*[\"'](?!data:)", page) and "<script" not in page
    # The resize said once: the start-up block's row, which names each choice and where it came from.
    resize = "32 px (--image-size), bilinear interpolation (the torchvision weights' transforms), no crop: the whole"
    assert (
        page.count('<th class="l">resize</th>') == 1
        and f'<th class="l">resize</th><td class="l">{html.escape(resize)}' in page
    )
    # The resolved setup the run announced at its start is in the Setup table.
    for label, text in (("optimizer steps", "12 per epoch x 2 epochs = 24"), ("lr schedule", "constant")):
        assert f'<th class="l">{label}</th><td class="l">{text}</td>' in page
    (run / "report.html").unlink()
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").read_text() == page
    assert f"wrote {run / 'report.html'}" in capsys.readouterr().out


def test_report_of_a_folder_that_is_no_run_is_a_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a visiontune run folder" in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()


@pytest.mark.slow
@pytest.mark.browser
def test_the_page_in_a_headless_browser(run, tmp_path):
    page = tmp_path / "page.html"
    page.write_text((run / "report.html").read_text().replace("</body>", CHECK + "</body>"))
    done = dump_dom(page, tmp_path / "profile", "--enable-logging=stderr", "--v=0")
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    assert re.search(r'data-images="3"', done.stdout) and re.search(r'data-broken="0"', done.stdout)
    sources = {
        "summary": json.loads((run / "summary.json").read_text()),
        "eval": json.loads((run / "eval.json").read_text()),
    }
    cells = parse(done.stdout).cells
    for src, path, text in cells:
        assert text == shown(value(sources[src], path), path[-1]), (src, path)
    ev = sources["eval"]
    checked = {(src, tuple(path)) for src, path, _ in cells}
    for name in ev["classes"]:
        assert ("eval", ("per_class", name, "f1")) in checked
    assert {
        ("eval", ("accuracy",)),
        ("eval", ("ece",)),
        ("eval", ("averages", "macro", "f1")),
        ("summary", ("best_val_accuracy",)),
        ("eval", ("top_losses", 0, "loss")),
    } <= checked


def test_a_bench_row_without_a_speedup_shows_a_dash():
    # The single row failed, so the ddp row has no baseline to be a speedup of: the page still renders.
    from visiontune.reports.report import _bench

    rows = [
        {"strategy": "single", "failed": "exit code 1"},
        {"strategy": "ddp", "processes": 2, "global_batch": 16, "images_per_s": 10.0, "data_stall": 0.1},
    ]
    page = _bench({"rows": rows})
    assert "not run: exit code 1" in page
    assert '<td data-src="bench" data-path="[&quot;rows&quot;, 1, &quot;speedup&quot;]">-</td>' in page
    assert '<td data-src="bench" data-path="[&quot;rows&quot;, 1, &quot;images_per_s&quot;]">10.0</td>' in page


def test_a_cropping_model_s_resize_is_named():
    from visiontune.reports.report import _setup

    page = _setup(Path("no-run"), {"model": {"interpolation": "bicubic", "crop_pct": 0.95}}, None)
    assert '<th class="l">resize</th><td class="l">bicubic, short side to size / 0.95, centre crop</td>' in page


@pytest.mark.parametrize(
    "ev,says",
    [
        ({"averages": {}}, "a classify evaluation without its data, scored, tta, classes, ece_bins, per_class"),
        ({"report": "regress", "largest_residuals": [1]}, "largest_residuals is [1], expected a list of objects"),
        ({"report": "classify", "per_class": 3}, "per_class is 3, expected an object of classes"),
    ],
)
def test_an_eval_json_visiontune_did_not_write_is_one_line_and_no_page(tmp_path, capsys, ev, says):
    config = {"config": {"model": "resnet18", "epochs": 1}, "data": {"root": "/d", "layout": "kaggle"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path / 'eval.json'}: damaged run record: " in err and says in err and len(err.splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "report.html").exists()


def test_numbers_are_rounded_to_what_they_tell_one_row_a_thing_and_a_smoke_run_says_where_it_stopped(tmp_path):
    """Rates and seconds at 3 significant digits, scores at 4 decimals, counts in one thousands style; the
    batch said once (the start-up block's row); epochs say the run stopped at --max-steps."""
    from visiontune.reports.report import build

    overview = {
        "train images": "1,437",
        "batch": "16 per process x 1 process = global batch 16",
        "lr schedule": "constant",
    }
    config = {
        "config": {"model": "resnet18", "epochs": 2, "image_size": 64},
        "setup": {"strategy": "single", "world_size": 1, "per_process_batch": 16, "global_batch": 16, "lr": 0.01},
        "overview": overview,
        "data": {"root": "/d", "layout": "kaggle"},
    }
    summary = {
        "best_val_accuracy": 0.975,
        "best_val_loss": 0.14213,
        "train_split_size": 1437,
        "train_images_per_s": 21.9931,
        "total_seconds": 202.021,
        "data_wait_fraction": 0.01234,
        "epochs": 1,
        "stopped": {"reason": "max-steps", "optimizer_steps": 5, "epochs_done": 1},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = build(tmp_path)
    rows = dict(re.findall(r'<tr><th class="l">([^<]*)</th><td[^>]*>([^<]*)</td></tr>', page))
    assert rows["train images/s"] == "22.0" and rows["total seconds"] == "202" and rows["data-stall share"] == "0.0123"
    assert rows["best val accuracy"] == "0.9750" and rows["best val loss"] == "0.1421"
    assert rows["train images"] == "1,437"  # the Results row, as the setup row says it
    assert not [v for v in rows.values() if re.fullmatch(r"\d{4,}", v)]  # no count without its separator
    assert rows["batch"] == overview["batch"]
    assert not {"batch per process", "global batch", "processes", "learning rate"} & set(rows)
    assert rows["epochs"] == "2 asked; stopped after 1 epoch: --max-steps 5"


@pytest.mark.slow
def test_the_report_links_the_audit_of_its_data_and_no_other(run, tmp_path):
    out = Path(shutil.copytree(run, tmp_path / "runs" / "run"))
    root = json.loads((out / "config.json").read_text())["data"]["root"]
    audit, other = tmp_path / "runs" / "audit", tmp_path / "runs" / "other"
    for folder, data in ((audit, root), (other, str(tmp_path / "elsewhere"))):
        folder.mkdir()
        (folder / "audit.json").write_text(json.dumps({"root": data, "counts": {}}))
        (folder / "audit.html").write_text("<html></html>")
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert page.count("audit.html</a>") == 1 and 'href="../audit/audit.html"' in page
    # An audit.json that is no audit's (too large, or not an object) links nothing.
    (audit / "audit.json").write_text("[" * 100 + "]" * 100)
    (other / "audit.json").write_text(json.dumps({"root": root, "pad": "x" * (2 << 20)}))
    assert main(["report", str(out)]) == 0
    assert "audit.html" not in (out / "report.html").read_text()
