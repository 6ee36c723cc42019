"""Where functree's warnings point: the user's line, found by walking out of library frames.

A fixed ``stacklevel`` lands on whichever functree frame happens to sit that many calls
up (a ``Module.__call__`` wrapper, a ``Sequential``), which changes with the call path.
:func:`user_stacklevel` counts the frames instead: the first one outside functree and the
libraries it calls through (JAX while tracing, ``functools``, ``contextlib``) is the
user's ``model(x)`` or ``Trainer(...)`` line.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["user_stacklevel", "warn"]

_FUNCTREE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(
    os.sep + name + os.sep for name in ("jax", "jaxlib", "equinox", "flax", "optax")
) + (os.sep + "functools.py", os.sep + "contextlib.py", os.sep + "warnings.py")


def _internal(filename: str) -> bool:
    return (filename.startswith(_FUNCTREE) or filename == "<functree: generated __init__>"
            or any(part in filename for part in _LIBRARIES))


def user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the innermost frame
    outside functree and the libraries it calls through; 2 (the caller's caller) if none.

    Example:
      >>> import warnings
      >>> from functree._warnings import user_stacklevel
      >>> user_stacklevel() >= 1
      True
    """
    frame = sys._getframe(1)  # the function that will call warnings.warn
    level = 1
    while frame is not None:
        if not _internal(frame.f_code.co_filename):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` at the user's line (:func:`user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
