"""The bounds of a reader of untrusted files, tested alike: past a bound, one line naming the file and the
bound; under it, what the reader reads. Use::

    from bounded import past_and_under

    got = past_and_under(monkeypatch, layouts, "MAX_MANIFEST_ROWS", 3, read, "train.csv", "more than the 3 rows")
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from visiontune.errors import UserError


def past_and_under(monkeypatch, module: ModuleType, bound: str, value: int, read: Callable, names: str, says: str):
    """``read()`` with ``module.bound`` lowered to ``value`` is one ``UserError`` line naming ``names`` and saying
    ``says``; with the bound at twice ``value`` (the file is made to fit it), what ``read()`` returns."""
    monkeypatch.setattr(module, bound, value)
    with pytest.raises(UserError) as e:
        read()
    said = str(e.value)
    assert names in said and says in said and "\n" not in said, said
    monkeypatch.setattr(module, bound, value * 2)
    return read()
