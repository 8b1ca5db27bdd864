"""visiontune compare: one self-contained page (and a terminal table) with runs side by side."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from visiontune.cli.commands import main
from visiontune.runs.runinfo import describe
from visiontune.tasks import MULTI_LABEL, SINGLE_LABEL


class Page(HTMLParser):
    """The page's tables as rows of cell texts, and its images' sources."""

    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.images: list[str] = []
        self.differs: list[str] = []
        self._cell: list[str] | None = None
        self._row_differs = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
            self._row_differs = a.get("class") == "differs"
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(a["src"])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            if self._row_differs and len(self.tables[-1][-1]) == 1:
                self.differs.append(self.tables[-1][-1][0])
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture
def runs(tmp_path, trained_run) -> list[Path]:
    """The shared trained run, and a copy of it that says it trained with another lr and recipe."""
    first = Path(shutil.copytree(trained_run, tmp_path / "first", ignore=shutil.ignore_patterns("checkpoints")))
    second = Path(shutil.copytree(first, tmp_path / "second"))
    record = json.loads((second / "config.json").read_text())
    record["config"].update(lr=0.5, recipe="modern")
    (second / "config.json").write_text(json.dumps(record))
    history = json.loads((second / "history.json").read_text())
    for row in history:
        row["val"]["accuracy"] /= 2
    (second / "history.json").write_text(json.dumps(history))
    return [first, second]


@pytest.mark.slow
def test_the_page_lists_the_differing_settings_first_and_embeds_one_figure(runs, tmp_path, capsys):
    out = tmp_path / "cmp.html"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    text = out.read_text()
    page = Page()
    page.feed(text)
    metrics, differing, shared = page.tables
    names = [row[0] for row in differing[1:]]
    assert names == ["recipe", "lr"] and page.differs == ["recipe", "lr"]  # the two that differ, first
    assert differing[1][1:] == ["blog", "modern"] and differing[2][1:] == ["0.005", "0.5"]
    # The settings the runs share are folded away below them, said as the report says them.
    assert ["model", "resnet18", "resnet18"] in shared and ["lr_schedule", "constant", "constant"] in shared
    folded = text[text.index("<details>") : text.index("</details>")]
    assert f"<summary>{len(shared) - 1} setting(s) the runs share</summary>" in folded and "resnet18" in folded
    assert "<details>" not in text[: text.index("<h2>Settings")]
    assert len(page.images) == 1 and page.images[0].startswith("data:image/png;base64,")
    assert not re.search(r"(?<![\w-])(src|href)\s*=\s*[\"'](?!data:)", text) and "<script" not in text
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert [
        "best val accuracy",
        f"{summary['best_val_accuracy']:.4g}",
        f"{summary['best_val_accuracy']:.4g}",
    ] in metrics
    said = capsys.readouterr().out.splitlines()
    assert said[0].split() == ["run", "first", "second"] and said[1].split() == ["recipe", "blog", "modern"]
    assert said[2].split() == ["lr", "0.005", "0.5"] and said[-1] == f"visiontune: wrote {out}"
    assert main(["compare", str(runs[0])]) == 2  # one run: nothing to compare
    assert main(["compare", str(runs[0]), str(tmp_path)]) == 2  # not a run folder
    assert "is not a visiontune run folder" in capsys.readouterr().err


def _fabricated_run(folder: Path, maps: list | None) -> Path:
    """A run folder as an older training left it (epochs counted from 0 in history.json and summary.json),
    written by hand: multi-label when ``maps`` gives its val mAPs."""
    folder.mkdir()
    history = []
    for epoch, m in enumerate(maps or [None, None]):
        phase = {"loss": 0.5 - 0.1 * epoch, "accuracy": 0.7 + 0.1 * epoch, "images": 8, "seconds": 1.0}
        history.append({"epoch": epoch, "train": phase, "val": {**phase, **({"map": m} if maps else {})}})
    summary = {"best_val_accuracy": 0.8, "best_val_loss": 0.4, "best_epoch": 1, "epochs": 2}
    summary.update({"best_val_map": max(maps)} if maps else {})
    config = {"model": "resnet18", "multi_label": bool(maps), "output_dir": str(folder)}
    # A run's model record names its task as runinfo writes it (the whole description: it is checked on reading).
    model = describe(
        "resnet18",
        "torchvision",
        ["a", "b"],
        32,
        (0.5,) * 3,
        (0.25,) * 3,
        "bilinear",
        task=MULTI_LABEL if maps else SINGLE_LABEL,
    )
    model = model.to_dict()
    (folder / "config.json").write_text(json.dumps({"config": config, "data": {"root": "/d"}, "model": model}))
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "history.json").write_text(json.dumps(history))
    return folder


def test_multi_label_runs_are_compared_by_their_map_too(tmp_path, capsys):
    import matplotlib.pyplot as plt

    from visiontune.reports import compare

    ml = _fabricated_run(tmp_path / "ml", [0.55, 0.75])
    single = _fabricated_run(tmp_path / "single", None)
    out = tmp_path / "cmp.html"
    assert main(["compare", str(ml), str(single), "--out", str(out)]) == 0
    page = Page()
    page.feed(out.read_text())
    metrics = page.tables[0]
    assert ["best epoch", "2", "2"] in metrics  # an older summary.json's 0-based best_epoch 1, shown from 1
    assert ["best val mAP", "0.75", "-"] in metrics and ["last epoch val mAP", "0.75", "-"] in metrics
    assert "best val mAP" in capsys.readouterr().out
    runs = [compare.read_run(ml), compare.read_run(single)]
    fig = compare.curves_figure(runs)
    map_ax = fig.axes[2]
    assert map_ax.get_title() == "Validation mAP" and [list(line.get_ydata()) for line in map_ax.get_lines()] == [
        [0.55, 0.75]  # the multi-label run's line only
    ]
    plt.close(fig)
    two_single = [compare.read_run(single), compare.read_run(single)]
    assert not any("mAP" in label for label, _ in compare.metrics_table(two_single))


def test_the_curves_and_final_metrics_come_before_the_settings(tmp_path, capsys):
    """The page opens with what the runs did; the settings (sixty rows and more) follow them."""
    runs = [_fabricated_run(tmp_path / "a", None), _fabricated_run(tmp_path / "b", None)]
    out = tmp_path / "cmp.html"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    text = out.read_text()
    headings = re.findall(r"<h2>(.*?)</h2>", text)
    assert headings == ["Curves", "Final metrics", "Settings"]
    assert text.index("<img") < text.index("<h2>Final metrics") < text.index("<h2>Settings")


@pytest.mark.slow
@pytest.mark.browser
def test_the_page_in_a_headless_browser(runs, tmp_path):
    from browser import CHECK, dump_dom  # fails, saying how to install it, when there is none

    out = tmp_path / "cmp.html"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    page = tmp_path / "page.html"
    page.write_text(out.read_text().replace("</body>", CHECK + "</body>"))
    done = dump_dom(page, tmp_path / "profile")
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'data-images="1"' in done.stdout and 'data-broken="0"' in done.stdout


@pytest.mark.parametrize("counted_from", [0, 1])
def test_runs_of_either_epoch_count_are_read_counting_from_1(tmp_path, counted_from):
    """Files written counting epochs from 1 and an older run's, counting from 0, read the same: the best
    epoch (the second) is 2 on the report and in compare, and the curves' epochs are 1 and 2."""
    from visiontune.reports import compare, report

    run = _fabricated_run(tmp_path / "run", None)  # the older files: epochs 0 and 1, best_epoch 1
    if counted_from == 1:  # as visiontune writes them now
        history = json.loads((run / "history.json").read_text())
        (run / "history.json").write_text(json.dumps([{**row, "epoch": row["epoch"] + 1} for row in history]))
        summary = {**json.loads((run / "summary.json").read_text()), "best_epoch": 2, "epochs_counted_from": 1}
        (run / "summary.json").write_text(json.dumps(summary))
    read = compare.read_run(run)
    assert [row["epoch"] for row in read.history] == [1, 2]
    assert ["best epoch", ["2"]] in [[label, cells] for label, cells in compare.metrics_table([read])]
    assert '<th class="l">best epoch</th><td class="l">2</td>' in report.build(run)
