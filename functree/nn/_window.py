"""A sliding window's settings, checked once when a layer is built: kernel and pool sizes,
strides, dilation and padding for ``n`` spatial axes (``Conv1D``/``Conv2D`` and their
transposes, the pooling layers).

Each is an int (every axis) or one entry per spatial axis; padding is ``"SAME"``,
``"VALID"``, an int, or one int or ``(low, high)`` pair per axis. Anything else is refused
naming the layer, the setting and the form that fits, instead of failing inside
``lax.conv_general_dilated`` or ``lax.reduce_window`` at the first call.

Example:
  >>> from functree.nn._window import padding, sizes
  >>> sizes("Conv2D", "strides", 2, 2), padding("Conv1D", ((2, 1),), 1)
  ((2, 2), ((2, 1),))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["sizes", "padding", "is_int", "BAD_WINDOW"]

BAD_WINDOW = """\
{cls}: {name}={given!r} does not fit {n} spatial {axes}: {what}.

    wrong:  {cls}(..., {name}={given!r})
    right:  {cls}(..., {name}={right})"""

PADDINGS = ("SAME", "VALID")


def is_int(x: Any) -> bool:
    """A Python or NumPy int, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x: Any) -> bool:
    """A Python or NumPy real number (``np.float32(16)``, a config read with NumPy), not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _error(cls: str, name: str, given: Any, n: int, what: str, right: Any) -> ValueError:
    return ValueError(BAD_WINDOW.format(cls=cls, name=name, given=given, n=n, axes="axis" if n == 1 else "axes",
                                        what=what, right=right))


def sizes(cls: str, name: str, value: Any, n: int) -> tuple[int, ...]:
    """``value`` (an int, or ``n`` ints) as ``n`` positive ints."""
    entries = (value,) * n if is_int(value) else tuple(value) if isinstance(value, Sequence) else None
    if entries is None or len(entries) != n or not all(is_int(v) and v >= 1 for v in entries):
        example = 2 if n == 1 else (2, 2)
        raise _error(cls, name, value, n, f"an int >= 1, or {n} of them (one per axis)", example)
    return tuple(int(v) for v in entries)


def padding(cls: str, value: Any, n: int, signed: bool = False) -> str | tuple[tuple[int, int], ...]:
    """``"SAME"``/``"VALID"`` (any case), or an int >= 0 or ``n``
    entries, each an int >= 0 or a ``(low, high)`` pair of them, as ``n`` pairs. ``signed`` (a
    transposed convolution's pads of its stride-dilated input) takes negative pair entries too:
    they crop, as torch's ``ConvTranspose`` ``padding`` above ``d (k - 1)`` does."""
    if isinstance(value, str):
        if value.upper() in PADDINGS:
            return value.upper()
        raise _error(cls, "padding", value, n, f"a padding string is one of {PADDINGS}", '"SAME"')
    if is_int(value) and value >= 0:
        return ((int(value), int(value)),) * n

    def pair(p: Any) -> tuple[int, int] | None:
        if is_int(p) and p >= 0:
            return (int(p), int(p))
        if isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2 and all(
                is_int(v) and (signed or v >= 0) for v in p):
            return (int(p[0]), int(p[1]))
        return None

    pairs = [pair(p) for p in value] if isinstance(value, Sequence) else [None]
    if len(pairs) != n or any(p is None for p in pairs):
        right = "((1, 2),)" if n == 1 else "((1, 1), (0, 2))"
        raise _error(cls, "padding", value, n, f'"SAME", "VALID", an int >= 0, or {n} entries (one per axis), each '
                     f"an int >= 0 or a (low, high) pair" + (" (negative: cropped)" if signed else " of ints >= 0"), right)
    return tuple(p for p in pairs if p is not None)
