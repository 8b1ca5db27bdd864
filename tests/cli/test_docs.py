"""The docs stay true to the code: every `visiontune ...` command in a fenced code block parses with the
CLI's own parser, every relative link points to a file that exists, and the README stays short."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest

from visiontune.cli.commands import build_parser
from visiontune.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines inside fenced code blocks, lines outside them), each with its 1-based line number."""
    inside, outside, fence = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            continue
        (inside if fence else outside).append((number, line))
    return inside, outside


def doc_commands(text: str) -> list[tuple[int, str]]:
    """Every `visiontune ...` command of the fenced code blocks, continuation lines joined, with its line number."""
    commands, pending, start = [], None, 0
    for number, line in split_fences(text)[0]:
        line = line.strip()
        if pending is None:
            line = line.removeprefix("$ ")
            if not line.startswith("visiontune "):
                continue
            pending, start = "", number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append((start, pending + line))
        pending = None
    if pending is not None:
        commands.append((start, pending))
    return commands


@functools.cache
def strict_parser() -> argparse.ArgumentParser:
    """The CLI's parser, without prefix matching: a doc spells each flag in full (`--epoch` is not `--epochs`)."""
    parser = build_parser()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return parser


def parse_error(command: str) -> str | None:
    """None when the command parses (`--help` exits 0), else what the parser said. visiontune's parser
    raises UserError (exit 2 in `main`) where plain argparse would exit 2; both count as a failure."""
    argv = shlex.split(command, comments=True)[1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            strict_parser().parse_args(argv)
    except UserError as e:
        return str(e)
    except SystemExit as e:
        if e.code == 0 and ("-h" in argv or "--help" in argv):
            return None
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    for _, line in split_fences(text)[1]:
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            seen[slug + (f"-{seen[slug]}" if slug in seen else "")] = 0
            seen[slug] = seen.get(slug, 0) + 1
    return set(seen)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def test_the_docs_exist_and_hold_commands():
    assert all(doc.is_file() for doc in DOCS), [rel(d) for d in DOCS if not d.is_file()]
    assert len(doc_commands((ROOT / "README.md").read_text())) >= 10


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_visiontune_command_in_a_code_block_parses(doc):
    bad = [
        f"{rel(doc)}:{number}: {command}  ->  {error}"
        for number, command in doc_commands(doc.read_text())
        if (error := parse_error(command))
    ]
    assert not bad, "\n".join(bad)


def dead_links(doc: Path) -> list[str]:
    """Relative links of ``doc`` whose file, or whose #heading in a markdown file, does not exist."""
    dead = []
    for number, line in split_fences(doc.read_text())[1]:
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = doc.parent / path if path else doc
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file.read_text())):
                dead.append(f"{rel(doc)}:{number}: {target}")
    return dead


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(doc):
    dead = dead_links(doc)
    assert not dead, "\n".join(dead)


def test_the_readme_is_at_most_250_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material into docs/"


def test_the_checks_catch_a_misspelt_flag_a_bad_choice_and_dead_links(tmp_path):
    text = "\n".join(
        [
            "See [the guide](missing.md).",
            "```bash",
            "$ visiontune train --data DIR --epochs 2   # fine",
            "visiontune train --data DIR \\",
            "    --epcohs 2",
            "visiontune train --data DIR --epoch 2",
            "visiontune train --data DIR --strategy dpp",
            "visiontune predict --help",
            "python -m visiontune train --data DIR --bogus",
            "```",
        ]
    )
    commands = doc_commands(text)
    assert [n for n, _ in commands] == [3, 4, 6, 7, 8]
    assert commands[1][1].split() == ["visiontune", "train", "--data", "DIR", "--epcohs", "2"]
    assert [parse_error(c) is None for _, c in commands] == [True, False, False, False, True]
    assert "--epcohs" in parse_error(commands[1][1])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## The run folder: `runs/X`\n")
    page = tmp_path / "page.md"
    page.write_text(
        text
        + "\n[ok](docs/guide.md#the-run-folder-runsx) [ok](#guide) [web](https://example.com/x)"
        + "\n[dead](docs/guide.md#no-such-heading) [dead](docs/gone.md)\n# Guide\n"
    )
    assert [d.split(": ", 1)[1] for d in dead_links(page)] == [
        "missing.md",
        "docs/guide.md#no-such-heading",
        "docs/gone.md",
    ]


def test_the_untrusted_inputs_table_names_readers_and_fuzz_targets_that_exist():
    """docs/reliability.md's table of untrusted inputs: every `module:function` reader is importable, every
    `tests/...py::test` fuzz target is a test in that file; a renamed reader or target fails here."""
    import importlib

    text = (ROOT / "docs" / "reliability.md").read_text()
    block = text.split("<!-- untrusted-inputs: one block, one row per kind -->", 1)[1].split(
        "<!-- /untrusted-inputs -->"
    )[0]
    rows = [line.split(" | ") for line in block.strip().splitlines()[2:]]
    assert len(rows) >= 15 and all(len(r) == 5 for r in rows)
    readers = targets = 0
    for _, reader, _, _, fuzz in rows:
        module = None
        wings = {p.name for p in (ROOT / "src" / "visiontune").iterdir() if p.is_dir()}
        for name in re.findall(r"`([A-Za-z_.]+(?::[A-Za-z_]+)?)`", reader):
            if ":" in name:
                module, name = name.split(":")
            elif "." in name:  # a module (`inference.decodepool`), or a file's name (`split.json`)
                if name.split(".")[0] in wings:
                    importlib.import_module(f"visiontune.{name}")
                continue
            if module is None or not name.islower() and not name.isupper():  # words, not names (`RunInfo`...)
                continue
            assert hasattr(importlib.import_module(f"visiontune.{module}"), name), f"{module}:{name}"
            readers += 1
        path = None
        for found, test in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", fuzz):
            path = found or path
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), f"{path}::{test}"
            targets += 1
    assert readers >= 25 and targets >= 10
