"""The README's demo block is what `make demo` prints: the slow test runs the Makefile's own demo commands and
compares the lines with the numbers masked (timings, losses and accuracies vary from machine to machine), on
fewer of its images."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from trainrun import run

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- demo output"  # the README's demo block is the first fenced block after this comment
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
PATH = re.compile(r"(?<![\w.])/[\w./+-]+")  # an absolute path: the image cache is in the user's cache folder


def readme_block(text: str) -> list[str]:
    """The lines of the first fenced code block after the demo marker."""
    after = text[text.index(MARKER) :].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("```")) + 1
    end = next(i for i in range(start, len(after)) if after[i].startswith("```"))
    return after[start:end]


def demo_commands(makefile: str) -> list[list[str]]:
    """The `visiontune` commands of the Makefile's `demo` recipe, as argv lists, its variables filled in."""
    variables = dict(re.findall(r"^(\w+)\s*:=\s*(.*?)\s*$", makefile, re.M))
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    commands = []
    for line in recipe.replace("\\\n", " ").splitlines():
        line = line.split(" # ")[0].strip()
        line = re.sub(r"\$\((\w+)\)", lambda m: "" if m[1] == "BIN" else variables[m[1]], line)
        argv = shlex.split(line)
        if argv and argv[0] == "/visiontune":  # $(BIN)/visiontune: the venv's command
            commands.append(argv[1:])
    return commands


# Why the threads row chose its count depends on what else the machine is running (a busy machine cuts it): the
# README shows a quiet machine's reason; the count and the rest of the row are compared.
THREADS_WHY = re.compile(r"^(  threads +N for the model )\(.*?\)(?=;)")


# When the machine's load changes mid-run, visiontune says so between epochs and changes its thread count: a
# line a quiet machine (the README's) never prints.
RECHOSEN = re.compile(r"^visiontune: N intra-op threads from the next epoch, not N ")


def masked(lines: list[str]) -> list[str]:
    lines = [NUMBER.sub("N", PATH.sub("PATH", line.rstrip())) for line in lines if line.strip()]
    return [THREADS_WHY.sub(r"\1(WHY)", line) for line in lines if not RECHOSEN.match(line)]


def test_the_readme_block_shows_every_epoch_of_the_makefile_demo():
    """Cheap: the block holds one "Epoch k/N" line for each of the demo's epochs, and nothing elided."""
    block = readme_block((ROOT / "README.md").read_text())
    [train] = [argv for argv in demo_commands((ROOT / "Makefile").read_text()) if argv[0] == "train"]
    epochs = int(train[train.index("--epochs") + 1])
    shown = [line for line in block if line.startswith("Epoch ")]
    assert shown == [f"Epoch {k}/{epochs}" for k in range(1, 1 + epochs)]
    assert "..." not in block and block[0].startswith("visiontune: wrote a SYNTHETIC data set")
    # One demo block: benchmarks/README points to it instead of a copy of its own.
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    assert "Training complete in" not in bench and "README.md#quickstart" in bench


def smaller(argv: list[str], per_class: int = 60) -> list[str]:
    """The demo's command with 60 of its 200 images a class: 12 a class in the val split (no class is rare there,
    under 10, which would add a warning line) and 96 train images, whole batches of 16 as the demo's 320 (a
    partial one would change the train row): the same lines, only their (masked) numbers differ."""
    return [str(per_class) if i and argv[i - 1] == "--per-class" else a for i, a in enumerate(argv)]


@pytest.mark.slow
def test_the_readme_demo_block_is_what_make_demo_prints(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["VISIONTUNE_CACHE_DIR"] = str(tmp_path / "cache")
    env.pop("OMP_NUM_THREADS", None)  # set for the suite's workers; `make demo` leaves the choice to visiontune
    printed = []
    commands = demo_commands((ROOT / "Makefile").read_text())
    assert "--per-class" in commands[0]  # what `smaller` shrinks
    for argv in map(smaller, commands):
        done = run([sys.executable, "-m", "visiontune", *argv], env, cwd=tmp_path)  # forked where it can be
        assert done.returncode == 0, done.stderr[-2000:]
        printed += done.stdout.splitlines()
    assert masked(printed) == masked(readme_block((ROOT / "README.md").read_text()))
