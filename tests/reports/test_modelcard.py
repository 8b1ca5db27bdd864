"""The model card from a run folder someone else wrote: class names, the data set's name and the recipe lines
show as the text they are -- no heading, list, link, front-matter line or HTML tag made of them -- and the
YAML front matter parses back to what visiontune put there. Rendered as CommonMark (markdown-it), as a
reader's page would be; the fuzz target feeds it any text."""

from __future__ import annotations

import json
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from fuzzing import fuzz_settings
from visiontune.errors import UserError
from visiontune.reports import modelcard
from visiontune.runs import runrecords
from visiontune.runs.runinfo import describe

HOSTILE = [
    "cat\n# Owned\n---\nlicense: evil",
    "<script>alert(1)</script>",
    "[click](javascript:alert(1))",
    "![x](http://tracker.example/p.png)",
    "a | b",
    "`code` *bold* _em_ ~~gone~~",
    "\x1b]0;title\x07dog",
]
HEADINGS = ["Data", "Recipe", "Validation results", "How to use"]
# What the card's own markdown makes; anything else was made of text from the run folder.
TAGS = {"p", "h1", "h2", "ul", "li", "table", "thead", "tbody", "tr", "th", "td", "code", "pre", "img", "hr"}


def _records(classes, data="/data/my-set", overview=None, weights="raw"):
    model = describe("resnet18", "torchvision", classes, 32, (0.5,) * 3, (0.25,) * 3, "bilinear").to_dict()
    config = {
        "config": {"data": data},
        "data": {"root": data, "layout": "folder", "source": data},
        "model": model,
        "overview": overview or {"optimizer": "SGD, lr 0.001", "batch": "4 per process"},
    }
    summary = {"best_val_accuracy": 0.75, "best_val_loss": 0.5, "best_epoch": 1, "epochs": 2, "best_weights": weights,
               "val_images_counted": 4, "val_split_size": 4, "train_split_size": 8}  # fmt: skip
    summary["classes"] = list(classes)
    return config, summary


def _read_back(config, summary):
    """The records as the Hub folder's export reads them: written to a run folder, read through runrecords."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        (Path(folder) / "summary.json").write_text(json.dumps(summary))
        return runrecords.read_config(folder), runrecords.read_summary(folder)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: dict[str, list[str]] = {}
        self._open: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._open.append(tag)
        if tag == "img":
            self.tags.append(f"img:{dict(attrs)['src']}")

    def handle_endtag(self, tag):
        if self._open and self._open[-1] == tag:
            self._open.pop()

    def handle_data(self, data):
        if self._open:
            self.text.setdefault(self._open[-1], []).append(data)


def _check(card: str, config: dict, summary: dict, classes) -> None:
    lines = card.split("\n")
    assert lines[0] == "---"
    end = lines.index("---", 1)
    assert yaml.safe_load("\n".join(lines[1:end])) == modelcard.front_matter(config, summary, "model")
    assert lines.count("---") == 2  # nothing else that reads as the front matter's fence
    page = _Tags()
    page.feed(MarkdownIt("commonmark").enable("table").render("\n".join(lines[end + 1 :])))
    assert set(page.tags) <= TAGS | {"img:training_results.png"}, set(page.tags) - TAGS
    assert page.tags.count("h1") == 1 and page.text["h2"] == HEADINGS
    shown = "".join(page.text["p"])
    for name in classes:  # each name shows as its text, on one line
        assert " ".join("".join(c if c.isprintable() else " " for c in name).split()) in shown


def test_class_names_that_look_like_markdown_or_html_show_as_their_text():
    classes = ["dog", *HOSTILE]
    config, summary = _read_back(*_records(classes, overview={"optimizer": "<b>x</b> | y\n## z"}))
    card = modelcard.card(config, summary, "resnet18", "me/model", "training_results.png")
    assert "<script" not in card and "\n# Owned" not in card and "\nlicense: evil" not in card and "\x1b" not in card
    _check(card, config, summary, classes)


@fuzz_settings(80)
@given(
    st.lists(st.text(min_size=1, max_size=30), min_size=2, max_size=5, unique=True),
    st.text(min_size=1, max_size=30),
    st.dictionaries(st.sampled_from(modelcard.RECIPE), st.text(max_size=40), max_size=4),
    st.text(max_size=20),
)
def test_fuzz_model_card_inputs_show_as_text(classes, data, overview, weights):
    try:
        config, summary = _read_back(*_records(classes, "/d/" + data.replace("/", "_"), overview, weights))
    except UserError:  # a description the model file's schema refuses (a class name of only spaces...)
        return
    _check(modelcard.card(config, summary, "resnet18", "me/model", None), config, summary, classes)
