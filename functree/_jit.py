"""``ft.jit``: jit for functions of Modules, with no per-call filtering.

Static fields already live in each Module's tree definition, so a Module passes through
``jax.jit`` as it is: flattening runs in JAX's C++ dataclass path, nothing is
partitioned in Python, and the call returns without blocking (asynchronous dispatch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["jit"]

TRACED_BOOL = """\
{error}

functree: Python control flow (`if`, `while`, `and`, `bool(...)`) on a traced value inside \
ft.jit{where}. Under jit the value is not known until run time. Use
    jnp.where(cond, a, b)                        # choose between two values
    jax.lax.cond(cond, true_fn, false_fn, x)     # choose between two computations
    jax.lax.while_loop / jax.lax.fori_loop       # loops with traced bounds
or mark the argument static: ft.jit(f, static_argnames=("flag",))."""


def _where(tb: Any) -> str:
    """The innermost user frame of a traceback (outside jax), as ' at file:line'."""
    frame = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "/jax/" not in name and "/jaxlib/" not in name and "functree/_jit" not in name:
            frame = tb
        tb = tb.tb_next
    if frame is None:
        return ""
    return f" at {frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}"


def _explain_control_flow(f: Callable[..., Any]) -> Callable[..., Any]:
    # Runs at trace time only: steady-state calls never enter this wrapper.
    @functools.wraps(f)
    def traced(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except jax.errors.TracerBoolConversionError as e:
            message = TRACED_BOOL.format(error=e, where=_where(e.__traceback__))
            raise ControlFlowError(message) from None

    return traced


class ControlFlowError(TypeError):
    """Python control flow on a traced value inside ``ft.jit``."""


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
        items = (donate,) if isinstance(donate, (int, str)) else tuple(donate)
        nums = tuple(i for i in items if isinstance(i, int))
        names = tuple(i for i in items if isinstance(i, str))
        if nums:
            jax_jit_options["donate_argnums"] = nums
        if names:
            jax_jit_options["donate_argnames"] = names
    return jax.jit(_explain_control_flow(f), **jax_jit_options)
