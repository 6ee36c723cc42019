"""Custom derivatives (Swift's ``@differentiable`` and ``@derivative(of:)``), stopping
derivatives (``withoutDerivative(at:)``) and recomputation in pullbacks (checkpointing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from functree import _diagnostics, _operators
from functree._parameters import is_parameter_leaf, parameters
from functree._tree import is_none

__all__ = [
    "differentiable",
    "derivative",
    "DifferentiableFunction",
    "without_derivative",
    "with_recomputation_in_pullbacks",
]

_MISSING: Any = _operators._MISSING

BAD_MODE = """\
mode is "reverse" (the derivative returns (value, pullback)) or "forward" (it returns \
(value, differential)); got {mode!r}.
    @ft.derivative(of=f)                    # reverse: (value, pullback)
    @ft.derivative(of=f, mode="forward")    # forward: (value, differential)"""

BAD_DERIVATIVE_RESULT = """\
The derivative registered for {fn} must return a pair (value, {closure}); it returned {got}.
    @ft.derivative(of={fn})
    def d_{fn}(x):
        y = {fn}(x)
        return y, lambda v: v * ...   # the {closure}"""


class DifferentiableFunction:
    """A function that carries registered custom derivatives.

    Calling it evaluates the original function; differentiating it (alone, inside a larger
    function, jitted or not) uses the registered derivative. Create one with
    :func:`differentiable`; register derivatives with :func:`derivative`.

    Example:
      >>> import functree as ft
      >>> square = ft.differentiable(lambda x: x * x)
      >>> isinstance(square, ft.DifferentiableFunction), square(3.0)
      (True, 9.0)
    """

    def __init__(self, fn: Callable[..., Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.reverse: tuple[Callable[..., Any], tuple[int, ...] | None] | None = None
        self.forward: tuple[Callable[..., Any], tuple[int, ...] | None] | None = None

    def __repr__(self) -> str:
        modes = [m for m in ("reverse", "forward") if getattr(self, m) is not None]
        return f"<differentiable {getattr(self.fn, '__qualname__', self.fn)} custom={modes}>"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.reverse is None and self.forward is None:
            return self.fn(*args, **kwargs)
        fn = functools.partial(self.fn, **kwargs) if kwargs else self.fn
        if self.reverse is not None:
            deriv, wrt = self.reverse
            bound = functools.partial(deriv, **kwargs) if kwargs else deriv
            return _with_pullback(fn, bound, wrt, args)
        assert self.forward is not None
        deriv, wrt = self.forward
        bound = functools.partial(deriv, **kwargs) if kwargs else deriv
        return _with_differential(fn, bound, wrt, args)


def differentiable(fn: Callable[..., Any]) -> DifferentiableFunction:
    """Declare ``fn`` differentiable so that :func:`derivative` can register derivatives.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> @ft.differentiable
      ... def cube(x):
      ...     return x * x * x
      >>> @ft.derivative(of=cube)
      ... def d_cube(x):
      ...     return cube(x), lambda v: 3.0 * x * x * v
      >>> ft.gradient(cube, at=2.0)
      Array(12., dtype=float32, weak_type=True)
    """
    if isinstance(fn, DifferentiableFunction):
        return fn
    return DifferentiableFunction(fn)


def _normalize_wrt(wrt: Any) -> tuple[int, ...] | None:
    if wrt is None:
        return None
    if isinstance(wrt, int):
        return (wrt,)
    return tuple(wrt)


def derivative(
    f: Callable[..., Any] | None = None,
    at: Any = _MISSING,
    *,
    of: Callable[..., Any] | None = None,
    wrt: Any = None,
    mode: str = "reverse",
) -> Any:
    """Two Swift names in one: ``@ft.derivative(of=f)`` registers a custom derivative;
    ``ft.derivative(f, at=x)`` is the scalar derivative operator ``df/dx``.

    Registration: the decorated function takes ``f``'s arguments and returns
    ``(value, pullback)`` (``mode="reverse"``, pullback maps a result cotangent to the
    cotangents of the ``wrt`` arguments) or ``(value, differential)`` (``mode="forward"``,
    differential maps the tangents of the ``wrt`` arguments to a result tangent).
    ``wrt`` picks argument indices (default: every argument that carries floats; arguments
    that are not arrays, such as a string flag, are passed through as constants). If ``f`` was declared with
    :func:`differentiable`, the derivative is registered on it and the decorated function
    is returned unchanged; otherwise a new differentiable function carrying the derivative
    is returned.

    A reverse-mode derivative keeps the pullback's residuals (no recomputation). A forward
    derivative also serves reverse mode, by transposition, when the differential is linear.

    Example (seed 002's ``@derivative(of: expf)``):
      >>> import functree as ft, jax.numpy as jnp
      >>> @ft.derivative(of=jnp.exp)
      ... def exp(x):
      ...     y = jnp.exp(x)
      ...     return y, lambda v: v * y
      >>> ft.gradient(exp, at=0.0)
      Array(1., dtype=float32, weak_type=True)
    """
    if of is None:
        if f is None:
            raise TypeError("Use ft.derivative(f, at=x) or @ft.derivative(of=f).")
        return _operators.derivative(f, at, wrt=0 if wrt is None else wrt)
    if mode not in ("reverse", "forward"):
        raise ValueError(BAD_MODE.format(mode=mode))
    indices = _normalize_wrt(wrt)
    if getattr(of, "__ft_label_aware__", False):  # a Module's __call__, as Module wraps it
        of = of.__wrapped__  # type: ignore[union-attr]
    fn: Callable[..., Any] = of  # type: ignore[assignment]  # not None: checked above

    def register(deriv: Callable[..., Any]) -> Any:
        target = fn if isinstance(fn, DifferentiableFunction) else DifferentiableFunction(fn)
        setattr(target, mode, (deriv, indices))
        return deriv if target is fn else target

    return register


def _split(result: Any, fn: Callable[..., Any], closure: str) -> tuple[Any, Callable[..., Any]]:
    if not (isinstance(result, tuple) and len(result) == 2 and callable(result[1])):
        name = getattr(fn, "__name__", "f")
        raise TypeError(BAD_DERIVATIVE_RESULT.format(fn=name, closure=closure, got=type(result).__name__))
    return result


def _as_tuple(x: Any, n: int) -> tuple:
    if n == 1 and not (isinstance(x, tuple) and len(x) == 1):
        return (x,)
    return tuple(x)


def _is_data(x: Any) -> bool:
    """Whether every leaf of ``x`` is an array or a number (a valid JAX argument)."""
    return all(
        isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex))
        or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
        for leaf in jax.tree.leaves(x)
    )


def _split_static(
    fn: Callable[..., Any], deriv: Callable[..., Any], wrt: tuple[int, ...] | None, args: tuple
) -> tuple[Callable[..., Any], Callable[..., Any], tuple[int, ...], tuple, Callable[[int], int | None]]:
    """Bind arguments that are not arrays (a string flag, a callable) as constants.

    Returns the function and derivative of the array arguments only, the differentiated
    positions among them (``wrt``, by default every argument that carries floats), the
    array arguments, and a map from an original position to its new one (None if bound).
    """
    dynamic = [i for i, a in enumerate(args) if _is_data(a)]
    position = {i: k for k, i in enumerate(dynamic)}
    if wrt is None:
        wrt = tuple(i for i in dynamic if jax.tree.leaves(parameters(args[i])))
    if len(dynamic) == len(args):
        return fn, deriv, wrt, args, position.get

    def full(dyn: tuple) -> list[Any]:
        out = list(args)
        for i, value in zip(dynamic, dyn):
            out[i] = value
        return out

    return (
        lambda *dyn: fn(*full(dyn)),
        lambda *dyn: deriv(*full(dyn)),
        wrt,
        tuple(args[i] for i in dynamic),
        position.get,
    )


def _with_pullback(
    fn: Callable[..., Any], deriv: Callable[..., Any], wrt: tuple[int, ...] | None, args: tuple
) -> Any:
    fn, deriv, indices, dyn_args, new_position = _split_static(fn, deriv, wrt, args)
    pullback_of_call: list[Callable[..., Any]] = []
    custom = jax.custom_vjp(fn)

    def fwd(*primals: Any) -> Any:
        value, pb = _split(deriv(*primals), fn, "pullback")
        # Turn the pullback closure into a function of explicit residual arrays, so the
        # forward pass is not recomputed in the backward pass.
        converted, residuals = jax.closure_convert(pb, value)
        pullback_of_call.append(converted)
        return value, residuals

    def bwd(residuals: Any, cotangent: Any) -> tuple:
        cts = _as_tuple(pullback_of_call[-1](cotangent, *residuals), len(indices))
        out: list[Any] = [None] * len(dyn_args)
        for i, ct in zip(indices, cts):
            k = new_position(i)
            if k is not None:
                out[k] = ct
        return tuple(out)

    custom.defvjp(fwd, bwd)
    return custom(*dyn_args)


def _tangent_view(primal: Any, tangent: Any) -> Any:
    """JAX's tangent for an argument, reduced to its parameter view (None elsewhere)."""
    view = parameters(primal)
    return jax.tree.map(lambda p, t: None if p is None else t, view, tangent, is_leaf=is_none)


def _with_differential(
    fn: Callable[..., Any], deriv: Callable[..., Any], wrt: tuple[int, ...] | None, args: tuple
) -> Any:
    fn, deriv, indices, dyn_args, new_position = _split_static(fn, deriv, wrt, args)
    chosen_positions = [k for k in map(new_position, indices) if k is not None]
    custom = jax.custom_jvp(fn)

    def jvp(primals: tuple, tangents: tuple) -> tuple:
        value, df = _split(deriv(*primals), fn, "differential")
        chosen = [_tangent_view(primals[k], tangents[k]) for k in chosen_positions]
        return value, df(*chosen)

    custom.defjvp(jvp)
    return custom(*dyn_args)


def without_derivative(at: Any) -> Any:
    """Swift's ``withoutDerivative(at:)``: ``at`` unchanged, with a zero derivative.

    Marks an intentional zero derivative, so the differentiation diagnostics stay quiet.

    Example:
      >>> import functree as ft
      >>> ft.gradient(lambda x: x * ft.without_derivative(at=x), at=3.0)
      Array(3., dtype=float32, weak_type=True)
    """
    # The named scope marks the stop_gradient in the jaxpr as intentional; a constant (no
    # tracer, so no equation) is reported to the analysis directly.
    _diagnostics.note_without_derivative(at)
    with jax.named_scope(_diagnostics._SCOPE):
        return jax.tree.map(
            lambda x: jax.lax.stop_gradient(x) if is_parameter_leaf(x) else x, at
        )


def with_recomputation_in_pullbacks(
    f: Callable[..., Any], policy: Callable[..., Any] | str | None = None
) -> Callable[..., Any]:
    """Checkpointing: ``f`` whose pullback recomputes its intermediate values.

    ``policy`` is a ``jax.checkpoint_policies`` policy or its name
    (``"dots_with_no_batch_dims_saveable"``) choosing what may be saved instead.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> f = ft.with_recomputation_in_pullbacks(lambda x: jnp.sin(jnp.sin(x)))
      >>> round(float(ft.gradient(f, at=0.5)), 4)
      0.7786
    """
    if isinstance(policy, str):
        if not hasattr(jax.checkpoint_policies, policy):
            names = [n for n in dir(jax.checkpoint_policies) if not n.startswith("_")]
            raise ValueError(f"Unknown checkpoint policy {policy!r}; choose one of {names}.")
        policy = getattr(jax.checkpoint_policies, policy)
    return functools.wraps(f)(jax.checkpoint(f, policy=policy))  # pyright: ignore[reportArgumentType]

