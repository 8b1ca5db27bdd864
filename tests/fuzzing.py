"""The fuzz tier's size: property-based tests draw ``examples(n)`` cases, n in ``make test`` and 50 x n
when ``VISIONTUNE_FUZZ=1`` (``make fuzz``)."""

from __future__ import annotations

import os


def examples(default: int) -> int:
    """How many examples a property-based test draws: ``default``, or 50 times as many under ``make fuzz``."""
    return default * 50 if os.environ.get("VISIONTUNE_FUZZ") == "1" else default
