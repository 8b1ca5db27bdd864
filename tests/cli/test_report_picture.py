"""The README's picture of a report (docs/report.png) shows the page as it is now: docs/report.json records the
run the picture was taken of (its commands) and the page's sections and Setup rows then; the slow test makes
that run again and compares its page's sections and rows with the record, as test_demo compares the demo block.

Run this file (`python tests/cli/test_report_picture.py`) to take the picture again: it makes the run, takes a
headless Chromium screenshot of its report.html and writes the record beside the picture.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PICTURE, RECORD = ROOT / "docs" / "report.png", ROOT / "docs" / "report.json"
TRAIN = ["--model", "resnet18", "--weights", "none", "--image-size", "64", "--epochs", "3", "--batch-size", "16"]
TRAIN += ["--lr", "0.01", "--no-progress"]
MISFILED = 5  # images filed under the wrong class in the evaluated folder: the top losses have something to show


class Outline(HTMLParser):
    """The page's title, its headings (h2, h3) in order, and the Setup table's row labels."""

    def __init__(self):
        super().__init__()
        self.title, self.sections, self.setup_rows = "", [], []
        self._tag, self._section = None, None

    def handle_starttag(self, tag, attrs):
        self._tag = tag

    def handle_endtag(self, tag):
        self._tag = None

    def handle_data(self, data):
        if self._tag == "h1":
            self.title += data
        elif self._tag in ("h2", "h3"):
            self.sections.append(data)
            self._section = data if self._tag == "h2" else self._section
        elif self._tag == "th" and self._section == "Setup" and len(self.sections) == 1:
            self.setup_rows.append(data)


def outline(page: str) -> dict:
    o = Outline()
    o.feed(page)
    return {"title": o.title, "sections": o.sections, "setup_rows": o.setup_rows}


def make_run(work: Path, per_class: int = 200, image_size: int = 64) -> Path:
    """The picture's run: `make demo`'s (its synthetic data, its training), evaluated on a folder of class
    subfolders where MISFILED images sit under the wrong class (``per_class``, ``image_size``: the test's
    smaller copy of it)."""
    from visiontune.cli.commands import main

    data, run, pets = work / "demo-data", work / "runs" / "demo", work / "pets"
    train = [*TRAIN]
    train[train.index("--image-size") + 1] = str(image_size)
    assert main(["sample-data", str(data), "--per-class", str(per_class)]) == 0
    assert main(["train", "--data", str(data), "--output-dir", str(run), *train]) == 0
    cats, dogs = (sorted((data / "train").glob(f"{c}.*.jpg"))[:40] for c in ("cat", "dog"))
    for folder, files in (("cat", cats[MISFILED:] + dogs[:MISFILED]), ("dog", dogs[MISFILED:])):
        (pets / folder).mkdir(parents=True)
        for f in files:
            shutil.copy(f, pets / folder / f.name)
    assert main(["evaluate", "--run", str(run), "--data", str(pets), "--no-progress", "--top-losses", "5"]) == 0
    return run


def record(run: Path) -> dict:
    return {
        "run": {
            "sample-data": ["demo-data", "--per-class", "200"],
            "train": ["--data", "demo-data", "--output-dir", "runs/demo", *TRAIN],
            "evaluate": f"cat/ ({40 - MISFILED} cats, {MISFILED} dogs) and dog/ ({40 - MISFILED} dogs): --top-losses 5",
        },
        **outline((run / "report.html").read_text()),
    }


def test_the_record_describes_the_picture_and_the_readme_shows_it():
    """Cheap: the record is of a run named as the README says (not `run`), and the README shows the picture."""
    saved = json.loads(RECORD.read_text())
    assert saved["title"] == "visiontune run demo" and saved["sections"][0] == "Setup"
    assert saved["run"]["train"][saved["run"]["train"].index("--output-dir") + 1] == "runs/demo"
    assert "](docs/report.png)" in (ROOT / "README.md").read_text() and PICTURE.is_file()


@pytest.mark.slow
def test_the_picture_s_run_has_today_s_page(tmp_path):
    """The page of the picture's run, made again now, has the sections and Setup rows the picture shows: a
    report that gains or loses a section or a row fails here until the picture is taken again (run this file).
    The run is the picture's commands on 50 images a class at 32 px: which sections and rows a page has follows
    from the commands' flags, not from the number or size of the images."""
    assert outline((make_run(tmp_path, per_class=50, image_size=32) / "report.html").read_text()) == {
        k: v for k, v in json.loads(RECORD.read_text()).items() if k != "run"
    }, "docs/report.png is stale: run `python tests/cli/test_report_picture.py` to take it again"


def take_picture(run: Path) -> None:
    """A headless Chromium screenshot of the run's report at 1280 px, cut to the page's height."""
    sys.path.insert(0, str(ROOT / "tests"))
    from PIL import Image, ImageChops

    from browser import chromium

    with tempfile.TemporaryDirectory() as profile:
        shot = Path(profile) / "shot.png"
        subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             f"--user-data-dir={profile}/p", "--window-size=1280,6000", f"--screenshot={shot}",
             (run / "report.html").as_uri()],
            check=True, capture_output=True, timeout=180,
        )  # fmt: skip
        with Image.open(shot) as im:
            page = im.convert("RGB")
    background = Image.new("RGB", page.size, page.getpixel((page.width - 1, page.height - 1)))
    box = ImageChops.difference(page, background).getbbox()
    page = page.crop((0, 0, page.width, min(page.height, box[3] + 16)))
    page.quantize(256).save(PICTURE, optimize=True)  # a page of flat colours: a palette keeps it small


if __name__ == "__main__":
    import os

    # A folder named as a user's, so that the paths the page shows read as they would on a user's machine.
    work = Path.home() / "visiontune-demo"
    shutil.rmtree(work, ignore_errors=True)
    os.environ["VISIONTUNE_CACHE_DIR"] = str(work / ".cache")
    made = make_run(work)
    take_picture(made)
    RECORD.write_text(json.dumps(record(made), indent=2) + "\n")
    shutil.rmtree(work)
    print(f"wrote {PICTURE} and {RECORD}")
