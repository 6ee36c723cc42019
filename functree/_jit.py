"""``ft.jit``: jit for functions of Modules, with no per-call filtering.

Static fields already live in each Module's tree definition, so a Module passes through
``jax.jit`` as it is: flattening runs in JAX's C++ dataclass path, nothing is
partitioned in Python, and the call returns without blocking (asynchronous dispatch).
"""

from __future__ import annotations

import functools
import inspect
import linecache
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["jit"]

TRACED_BOOL = """\
Python control flow on a traced value inside ft.jit{where}:
{source}
Under jit the value is not known until run time, so Python cannot branch on it. Use

    wrong:  if x > 0: y = f(x)
            else:     y = g(x)
    right:  y = jnp.where(x > 0, f(x), g(x))               # choose between two values
       or:  y = jax.lax.cond(x > 0, f, g, x)               # choose between two computations
       or:  jax.lax.while_loop(cond_fn, body_fn, init)     # a loop on a traced condition

or, if the value is configuration, make it static: ft.jit(f, static_argnames=("flag",)).

JAX said: {error}"""

TRACED_INTEGER = """\
A traced value is used as a Python integer inside ft.jit{where}:
{source}
Under jit the value is not known until run time (`range(n)`, `int(x)`, `my_list[i]` need it \
now). Use

    wrong:  for i in range(n): x = step(i, x)
    right:  x = jax.lax.fori_loop(0, n, step, x)       # a loop with a traced bound
       or:  y = jnp.asarray(my_list)[i]                  # index an array, not a list

or, if the value is configuration, make it static: ft.jit(f, static_argnames=("n",)).

JAX said: {error}"""

_INTERNAL = ("/jax/", "/jaxlib/", "functree/_jit.py")


def _user_frame(tb: Any) -> Any:
    """The innermost traceback entry outside JAX and this module (the user's line)."""
    found = None
    while tb is not None:
        if not any(part in tb.tb_frame.f_code.co_filename for part in _INTERNAL):
            found = tb
        tb = tb.tb_next
    return found


def _explain(template: str, error: Exception) -> str:
    tb = _user_frame(error.__traceback__)
    if tb is None:
        return template.format(where="", source="", error=error)
    filename, lineno = tb.tb_frame.f_code.co_filename, tb.tb_lineno
    line = linecache.getline(filename, lineno).strip()
    source = f"\n    {line}\n" if line else ""
    return template.format(where=f" at {filename}:{lineno}", source=source, error=error)


def _explain_control_flow(f: Callable[..., Any]) -> Callable[..., Any]:
    # Runs at trace time only: steady-state calls never enter this wrapper.
    @functools.wraps(f)
    def traced(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except jax.errors.TracerBoolConversionError as e:
            error = ControlFlowError(_explain(TRACED_BOOL, e))
            raise error.with_traceback(e.__traceback__) from None
        except jax.errors.TracerIntegerConversionError as e:
            error = ControlFlowError(_explain(TRACED_INTEGER, e))
            raise error.with_traceback(e.__traceback__) from None

    return traced


class ControlFlowError(TypeError):
    """Python control flow on a traced value inside ``ft.jit``: ``if``/``while``/``bool()``
    on a traced value, or a traced value used as a Python integer (``range(n)``).

    The message names the file and line and shows the ``jnp.where`` / ``jax.lax.cond`` /
    ``jax.lax.fori_loop`` rewrite. It is a ``TypeError``, like JAX's own errors.
    """


def jit(
    f: Callable[..., Any] | None = None,
    *,
    donate: int | str | Sequence[int | str] | None = None,
    **jax_jit_options: Any,
) -> Any:
    """``jax.jit`` for functions of Modules.

    ``donate`` names arguments whose buffers XLA may reuse for the outputs (argument
    indices or names; a training step donates the model and optimizer state). Other
    options (``static_argnames``, ``in_shardings``, ``out_shardings`` ...) pass through to
    ``jax.jit``. Usable as ``@ft.jit`` or ``@ft.jit(donate=(0, 1))``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> @ft.jit
      ... def f(x):
      ...     return 2 * x
      >>> f(jnp.ones(2))
      Array([2., 2.], dtype=float32)
    """
    if f is None:
        return functools.partial(jit, donate=donate, **jax_jit_options)
    if donate is not None:
        nums, names = _donated(f, donate)
        jax_jit_options["donate_argnums"] = nums
        jax_jit_options["donate_argnames"] = names
    return jax.jit(_explain_control_flow(f), **jax_jit_options)


def _donated(
    f: Callable[..., Any], donate: int | str | Sequence[int | str]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Both the indices and the names of the donated arguments.

    JAX applies ``donate_argnums`` to positional and ``donate_argnames`` to keyword
    arguments; giving both complete sets donates an argument however it is passed.
    """
    items = (donate,) if isinstance(donate, (int, str)) else tuple(donate)
    try:
        params = [
            p.name
            for p in inspect.signature(f).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # no signature (some builtins): take items as given
        params = []
    nums = {i for i in items if isinstance(i, int)}
    names = {i for i in items if isinstance(i, str)}
    nums |= {params.index(n) for n in names if n in params}
    names |= {params[i] for i in nums if -len(params) <= i < len(params)}
    return tuple(sorted(nums)), tuple(sorted(names))
