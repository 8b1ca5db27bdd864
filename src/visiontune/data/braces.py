"""Brace patterns that name shards: ``shards-{000000..000127}.tar``, ``{a,b}``, nested or repeated.

Local shards (``data/shards.py``) and shards at a URL (``data/remote.py``) name their files
with WebDataset's brace patterns; both expand them here, bounded before any name is made.

Kept rather than ``braceexpand`` (webdataset's): the bound needs the count before any name is made,
from the same grammar that expands. braceexpand's grammar is wider than this one -- steps
(``{1..9..4}``), letter ranges, backslash escapes -- so a count taken here would not bound what it
expands (``{0..9999999999..1}`` is one name here, ten billion there), and it raises on an unmatched
brace, which the shell (and this module) keeps as a letter.
"""

from __future__ import annotations

import itertools
import re

from visiontune.errors import UserError

MAX_NAMES = 100_000  # shards one brace pattern or index.json may name: ample, and a bound on the work


def expand(pattern: str, limit: int = MAX_NAMES) -> list[str]:
    """A brace pattern's names: ``{000..012}`` (zero-padded as written) and ``{a,b}``, nested or repeated,
    in the shell's order. How many there are is counted from the pattern before any name is made (the
    product of the groups, the sum of the alternatives), so ``{0..9999999999}`` is one line, not 10^10 names
    in memory."""
    parts = _parse(pattern, 0, len(pattern), _pairs(pattern))
    count = _count(parts)
    if count > limit:
        many = f"{count:,}" if count < 10**15 else "more than 10^15"
        raise UserError(f"{pattern} names {many} shards, more than the {limit:,} visiontune reads; check the braces")
    return ["".join(name) for name in _names(parts)]


def _pairs(pattern: str) -> dict[int, int]:
    """Where each ``{`` that is closed is closed (an unmatched brace is a plain letter)."""
    pairs, opened = {}, []
    for i, c in enumerate(pattern):
        if c == "{":
            opened.append(i)
            if len(opened) > 16:  # (each level is a recursion in _parse)
                raise UserError(f"{pattern[:80]}...: braces nested more than 16 deep; check the pattern")
        elif c == "}" and opened:
            pairs[opened.pop()] = i
    return pairs


def _parse(text: str, start: int, end: int, pairs: dict[int, int]) -> list:
    """``text[start:end]`` as parts: a string, a range ``(first, last, width)``, or a list of alternatives
    (each a list of parts)."""
    parts, i, literal = [], start, start
    while i < end:
        close = pairs.get(i)
        if close is None:
            i += 1
            continue
        parts.append(text[literal:i])
        r = re.fullmatch(r"(\d+)\.\.(\d+)", text[i + 1 : close])
        if r:
            parts.append((_bound(r[1]), _bound(r[2]), len(r[1])))
        else:  # alternatives: split at this group's own commas, not at those of a group inside it
            alts, at, j = [], i + 1, i + 1
            while j < close:
                if j in pairs:
                    j = pairs[j]
                elif text[j] == ",":
                    alts.append(_parse(text, at, j, pairs))
                    at = j + 1
                j += 1
            parts.append([*alts, _parse(text, at, close, pairs)])
        i = literal = close + 1
    parts.append(text[literal:end])
    return parts


def _bound(digits: str) -> int:
    """A range's end: past 10^30 it only needs to be too many (and int() refuses 4,300 digits and more)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 30 else 10**30


def _count(parts: list) -> int:
    n = 1
    for p in parts:
        if isinstance(p, tuple):
            n *= max(0, p[1] - p[0] + 1)
        elif isinstance(p, list):
            n *= sum(map(_count, p))
    return n


def _names(parts: list):
    """Each name as a tuple of its pieces, the leftmost group varying slowest."""
    choices = []
    for p in parts:
        if isinstance(p, str):
            choices.append((p,))
        elif isinstance(p, tuple):
            choices.append([f"{i:0{p[2]}d}" for i in range(p[0], p[1] + 1)])
        else:
            choices.append(["".join(name) for alt in p for name in _names(alt)])
    return itertools.product(*choices)
