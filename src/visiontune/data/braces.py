"""Brace patterns that name shards: ``shards-{000000..000127}.tar``, ``{a,b}``, nested or repeated.

Local shards (``data/shards.py``), shards at a URL (``data/remote.py``) and in an object store
(``data/stores.py``) name their files with WebDataset's brace patterns. ``braceexpand`` (webdataset's
own) expands them; this module counts the names first, from braceexpand's own grammar (its range
regexes, its steps, letter ranges, descending and negative ranges, a group without a comma kept with
its braces), because braceexpand builds every group's names before the first one comes out:
``{0..9999999999}`` would be 10^10 strings in memory. A backslash, or a brace that is not closed, is a
plain letter here, as in the shell (braceexpand would read the one as an escape and refuse the other),
so both are escaped before it sees them.
"""

from __future__ import annotations

from braceexpand import alphabet, braceexpand, char_range_re, int_range_re

from visiontune.errors import UserError

MAX_NAMES = 100_000  # shards one brace pattern or index.json may name: ample, and a bound on the work
_DIGITS = 30  # the longest number a range may have: past it only a mistake (and int() slows, then refuses)


def expand(pattern: str, limit: int = MAX_NAMES) -> list[str]:
    """A brace pattern's names, in the shell's order: ``{000..012}`` (zero-padded), ``{a,b}``, nested or
    repeated. How many there are is counted from the pattern before any name is made, so
    ``{0..9999999999}`` is one line, not 10^10 names in memory."""
    pairs = _pairs(pattern)
    count = _count(pattern, 0, len(pattern), pairs)
    if count > limit:
        many = f"{count:,}" if count < 10**15 else "more than 10^15"
        raise UserError(f"{pattern} names {many} shards, more than the {limit:,} visiontune reads; check the braces")
    matched = {*pairs, *pairs.values()}
    escaped = "".join("\\" + c if c == "\\" or (c in "{}" and i not in matched) else c for i, c in enumerate(pattern))
    return list(braceexpand(escaped))


def _pairs(pattern: str) -> dict[int, int]:
    """Where each ``{`` that is closed is closed (an unmatched brace is a plain letter)."""
    pairs, opened = {}, []
    for i, c in enumerate(pattern):
        if c == "{":
            opened.append(i)
            if len(opened) > 16:  # (each level is a recursion here and in braceexpand)
                raise UserError(f"{pattern[:80]}...: braces nested more than 16 deep; check the pattern")
        elif c == "}" and opened:
            pairs[opened.pop()] = i
    return pairs


def _count(text: str, start: int, end: int, pairs: dict[int, int]) -> int:
    """How many names ``text[start:end]`` makes: the product of its groups'."""
    n, i = 1, start
    while i < end:
        close = pairs.get(i)
        if close is None:
            i += 1
            continue
        n *= _group(text, i + 1, close, pairs)
        i = close + 1
    return n


def _group(text: str, start: int, end: int, pairs: dict[int, int]) -> int:
    """How many names the group ``{text[start:end]}`` makes, as braceexpand reads it: a range of numbers or
    letters (with an optional step), else the sum of its alternatives, else (no comma of its own) its
    inside's, braces kept."""
    expr = text[start:end]
    r = int_range_re.match(expr)
    if r:
        first, last, step = (_number(d, text) for d in (r[1], r[2], r[3] or "1"))
        return abs(last - first) // (step or 1) + 1
    r = char_range_re.match(expr)
    if r:
        first, last = alphabet.index(r[1]), alphabet.index(r[2])
        step = min(_number(r[3] or "1", text), len(alphabet)) or 1
        return abs(last - first) // step + 1
    alts, at, j = [], start, start
    while j < end:  # split at this group's own commas, not at those of a group inside it
        if j in pairs:
            j = pairs[j]
        elif text[j] == ",":
            alts.append(_count(text, at, j, pairs))
            at = j + 1
        j += 1
    return sum(alts) + _count(text, at, end, pairs) if alts else _count(text, start, end, pairs)


def _number(digits: str, pattern: str) -> int:
    if len(digits.lstrip("-0")) > _DIGITS:
        raise UserError(f"{pattern[:80]}: a range's number has more than {_DIGITS} digits; check the braces")
    return int(digits)
