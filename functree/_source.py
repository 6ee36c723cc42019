"""Where user code is: which source files are the user's, and a function's name.

Shared by the differentiability diagnostics (``functree._diagnostics``) and the NaN
provenance (``functree._nan``), which both point at the user's own line: the innermost
frame outside JAX, jaxlib and the standard library (functree's own layers count as the
user's), and the function by its qualified name through ``functools.partial``, bound
methods, ``functools.wraps`` and ``ft.DifferentiableFunction``.
"""

from __future__ import annotations

import functools
import inspect
import os
import reprlib
import sysconfig
from typing import Any

import jax
import jaxlib

from functree._tree import bounded_put

__all__ = ["is_user_file", "function_name", "call_refusal", "unwrap", "user_function", "USER_FUNCTION"]

# Source directories that are never the user's line: JAX, jaxlib and the standard library
# (whose site-packages, where user code can live, is not excluded).
_LIBRARIES = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (jax, jaxlib))
_STDLIB = os.path.join(sysconfig.get_path("stdlib"), "")
_SITE = tuple({os.path.join(sysconfig.get_path(k), "") for k in ("purelib", "platlib")})
_USER_FILES: dict[str, bool] = {}


def is_user_file(name: str) -> bool:
    """Whether the source file ``name`` is the user's (not JAX, jaxlib or the standard library).

    Example:
      >>> is_user_file(os.__file__), is_user_file("/home/me/train.py")
      (False, True)
    """
    user = _USER_FILES.get(name)
    if user is None:
        stdlib = name.startswith(_STDLIB) and not name.startswith(_SITE)
        user = not (stdlib or name.startswith(_LIBRARIES))
        bounded_put(_USER_FILES, name, user)
    return user


def function_name(f: Any) -> str:
    """``f``'s qualified name, looking through partials, bound methods and wrappers.

    Example:
      >>> function_name(functools.partial(os.path.join, "a"))
      'join'
    """
    f = unwrap(f)
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__name__


def call_refusal(f: Any, *args: Any, **kwargs: Any) -> tuple[str, inspect.Signature, TypeError] | None:
    """Why ``f`` cannot be called with ``args`` and ``kwargs`` (stand-ins: only their count
    and names are read), as ``(its name, its signature, Python's error)``; None where it can,
    or where it has no signature to read (the call itself then tells). For refusals made
    where a user's function is given, before a step runs it: a metric, a Stack's ``make``,
    predict's ``fn``.

    Example:
      >>> name, signature, error = call_refusal(lambda batch: batch, None, None)
      >>> name, str(signature), str(error)
      ('<lambda>', '(batch)', 'too many positional arguments')
    """
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):  # a builtin, a callable without one
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        return getattr(f, "__name__", None) or reprlib.repr(f), signature, e
    return None


USER_FUNCTION = "__ft_user_function__"
"""The attribute by which a library wrapper names the user's function it stands for (the
optimizer's objective, a train step's loss): warnings and reports name that function and
its line, not the wrapper's. Unlike ``__wrapped__``, ``inspect.signature`` ignores it."""


def user_function(f: Any) -> Any:
    """The user's function a library wrapper stands for (:data:`USER_FUNCTION`), else ``f``.

    Example:
      >>> def loss(model, batch): ...
      >>> def objective(m): ...
      >>> setattr(objective, USER_FUNCTION, loss)
      >>> user_function(objective) is loss, user_function(loss) is loss
      (True, True)
    """
    for _ in range(8):
        inner = _marked_under(f)
        if inner is None:
            break
        f = inner
    return f


def _marked_under(f: Any) -> Any:
    """The function the first :data:`USER_FUNCTION` at or under ``f`` names, looking
    through the library's ``functools.partial`` and ``functools.wraps`` layers (a loss
    given its key, the accumulation loop's salted call), else None."""
    for _ in range(8):
        inner = getattr(f, USER_FUNCTION, None)
        if inner is not None:
            return inner
        f = f.func if isinstance(f, functools.partial) else getattr(f, "__wrapped__", None)
        if f is None:
            return None
    return None


def unwrap(f: Any) -> Any:
    """The function under ``functools.partial``, a bound method, ``functools.wraps``, a
    ``ft.DifferentiableFunction`` or a library wrapper (:func:`user_function`), at most 8
    layers."""
    for _ in range(8):
        if getattr(f, USER_FUNCTION, None) is not None:
            f = getattr(f, USER_FUNCTION)
        elif isinstance(f, functools.partial):
            f = f.func
        elif inspect.ismethod(f):
            f = f.__func__
        elif getattr(f, "__wrapped__", None) is not None:
            f = f.__wrapped__
        elif getattr(f, "fn", None) is not None and callable(f.fn):
            f = f.fn  # ft.DifferentiableFunction
        else:
            break
    return f
