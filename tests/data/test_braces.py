"""Brace patterns: braceexpand's grammar (steps, letter ranges, descending and negative ranges), every name
counted before braceexpand makes any, and the shell's plain letters (a backslash, an unclosed brace) kept."""

from __future__ import annotations

import tracemalloc

import pytest
from braceexpand import braceexpand
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from visiontune.data import braces
from visiontune.errors import UserError


def test_steps_letter_and_descending_ranges_name_what_braceexpand_names():
    assert braces.expand("s-{0..10..5}.tar") == ["s-0.tar", "s-5.tar", "s-10.tar"]
    assert braces.expand("s-{a..c}.tar") == ["s-a.tar", "s-b.tar", "s-c.tar"]
    assert braces.expand("s-{3..1}.tar") == ["s-3.tar", "s-2.tar", "s-1.tar"]
    assert braces.expand("s-{x}.tar") == ["s-{x}.tar"]  # no comma, no range: a plain group, as in bash
    assert braces.expand("a\\b{1,2}.tar") == ["a\\b1.tar", "a\\b2.tar"]  # a backslash is a letter


@pytest.mark.parametrize("pattern", ["{0..9999999999..2}", "{0..99999..1}{a..z}", "{a..z..1}{0..9999}"])
def test_stepped_and_letter_ranges_are_counted_before_any_name_is_made(pattern):
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"names [\d,]+ shards, more than the 100,000 visiontune reads"):
            braces.expand(f"shards-{pattern}.tar")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_stray_brace_is_a_letter_as_in_bash():
    # Found by the fuzz target: braceexpand leaves '}{,}{' whole, where bash (and visiontune) expand its pair.
    assert braces.expand("}{,}{") == ["}{", "}{"] and braces.expand("x{a,b}}") == ["xa}", "xb}"]


def test_a_range_of_numbers_longer_than_30_digits_is_one_line():
    with pytest.raises(UserError, match="more than 30 digits"):
        braces.expand("s-{0.." + "9" * 4400 + "}.tar")


@fuzz_settings(300)
@given(st.text("{},.01a-Z\\", max_size=16))
def test_the_count_is_the_number_of_names(pattern):
    names = braces.expand(pattern, limit=10**6)
    assert braces.expand(pattern, limit=len(names)) == names
    with pytest.raises(UserError, match="names"):
        braces.expand(pattern, limit=len(names) - 1)
    # Where every brace is paired, braceexpand reads the pattern as the shell does; a stray brace is a letter
    # here (as in bash) and either a refusal or, before a pair ('}{,}{'), the whole pattern left as it is there.
    paired = sum(map(pattern.count, "{}")) == 2 * len(braces._pairs(pattern))
    if "\\" not in pattern and paired:
        assert names == list(braceexpand(pattern))
