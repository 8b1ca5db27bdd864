"""The fuzz tier's two speeds, for every hypothesis test (the parsers of untrusted input: tar shards and
their index, image bytes, manifests, serve's request bodies).

``make test`` runs each fuzz test with its default example count (a few seconds at most) and the same
examples every run (``derandomize``: a failure there is a failure on every machine, never a flake);
``make fuzz`` (``VISIONTUNE_FUZZ=1``) runs 50 times as many, drawn afresh each run, to find new cases.
A case it finds is printed with ``@reproduce_failure`` and its example: add that as a plain regression
test beside the fuzz test. Use::

    from fuzzing import fuzz_settings

    @fuzz_settings(200)
    @given(st.binary())
    def test_a_parser(data): ...

(or ``settings(max_examples=examples(200), ...)`` by hand). ``deadline=None``: a busy machine must not turn
a slow example into a failure. No example database: nothing is written under the working tree.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FUZZ = os.environ.get("VISIONTUNE_FUZZ") == "1"
FACTOR = 50  # make fuzz's examples per make test example

# Registered for ``pytest --hypothesis-profile=...`` too; ``fuzz_settings`` starts from the one in force.
settings.register_profile(
    "visiontune-ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("visiontune-fuzz", settings.get_profile("visiontune-ci"), derandomize=False)
PROFILE = "visiontune-fuzz" if FUZZ else "visiontune-ci"


def examples(default: int) -> int:
    """Examples for a fuzz test whose ``make test`` count is ``default``: 50x that under ``make fuzz``."""
    return default * FACTOR if FUZZ else default


def fuzz_settings(default: int, **overrides) -> settings:
    """A fuzz test's hypothesis settings: the tier's profile, ``examples(default)`` examples."""
    return settings(settings.get_profile(PROFILE), max_examples=examples(default), **overrides)
