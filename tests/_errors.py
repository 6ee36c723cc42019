"""The check of a named error: raised as ``kind``, its message the constant's text (up to the
first placeholder) with the fix in it."""

from collections.abc import Callable
from typing import Any

import pytest


def raises_named(call: Callable[[], Any], kind: type[Exception], constant: str, fix: str) -> None:
    """``call()`` raises ``kind`` whose message holds ``constant``'s fixed start and ``fix``."""
    with pytest.raises(kind) as info:
        call()
    assert constant.split("{")[0] in str(info.value) and fix in str(info.value)
