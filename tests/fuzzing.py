"""The fuzz tier's size: property-based tests draw ``examples(n)`` cases, n in ``make test`` (the same
cases every run) and 50 x n, drawn afresh, when ``VISIONTUNE_FUZZ=1`` (``make fuzz``)."""

from __future__ import annotations

import os

FUZZ = os.environ.get("VISIONTUNE_FUZZ") == "1"


def examples(default: int) -> int:
    """How many examples a property-based test draws: ``default``, or 50 times as many under ``make fuzz``."""
    return default * 50 if FUZZ else default
