"""How many examples a property test draws: its own count in CI, ten times it when exploring.

``conftest.py`` loads the "ci" hypothesis profile (derandomized, no example database), so
CI runs the same examples on every machine. ``pytest -m hypothesis tests
--hypothesis-profile=explore`` draws fresh random examples instead, :data:`EXPLORE` times
each test's count. A test states its count as ``settings(max_examples=examples(50))``:
a test's own ``max_examples`` would override the profile's.
"""

from __future__ import annotations

from hypothesis import settings

EXPLORE = 10


def examples(n: int) -> int:
    """``n`` under the "ci" profile; ``EXPLORE * n`` under "explore" (read when the test is defined)."""
    return n * EXPLORE if settings.get_current_profile_name() == "explore" else n
