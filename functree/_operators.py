"""Differential operators under the Swift proposal's names, over JAX transforms.

Each operator differentiates with respect to the arguments chosen by ``wrt`` (an argument
index, a tuple of indices, or key-path patterns over the first argument). A Module
argument is differentiated with respect to its *parameters* only: results have the
parameter view's structure (``None`` at non-parameters), so ``ft.move(model, along=g)``
and the model's key paths work on them directly.

=============================  ==========================================================
operator                       math
=============================  ==========================================================
``gradient(f)(x)``             ∇f(x) for scalar f
``value_with_gradient``        (f(x), ∇f(x))
``value_with_pullback``        (f(x), v ↦ vᵀ J_f(x))
``pullback``                   v ↦ vᵀ J_f(x)
``value_with_differential``    (f(x), t ↦ J_f(x) t)  (forward mode)
``differential``               t ↦ J_f(x) t
``derivative``                 df/dx for scalar x (any output)
``jacobian`` / ``hessian``     J_f(x) / ∇²f(x)
=============================  ==========================================================
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree import _diagnostics
from functree._module import Module
from functree._parameters import (
    _leaf_names,
    _matches,
    bounded_put,
    is_parameter_leaf,
    parameters,
    with_parameters,
)

__all__ = [
    "gradient",
    "value_with_gradient",
    "value_with_pullback",
    "pullback",
    "value_with_differential",
    "differential",
    "derivative",
    "jacobian",
    "hessian",
]

_MISSING: Any = object()

NON_SCALAR_RESULT = """\
{op} needs a scalar result, but {fn} returned shape {shape} ({dtype}).
Reduce it first, or ask for the operator that takes non-scalar results:

    wrong:  ft.gradient(f, at=x)                  # f returns shape {shape}
    right:  ft.gradient(lambda x: f(x).sum(), at=x)
       or:  value, pb = ft.value_with_pullback(f, at=x)   # then pb(cotangent)
       or:  ft.jacobian(f, at=x)
"""

NOT_DIFFERENTIABLE_ARGUMENT = """\
Cannot differentiate with respect to argument {index} of {fn}: {why}
Only floating-point values carry derivatives (integers and bools do not; \
no_derivative fields are carried, not differentiated).

    right:  ft.{op}(f, wrt={suggest})   # differentiate with respect to other arguments
       or:  pass the value as float: x.astype(jnp.float32)
"""

NOT_A_PYTREE_OF_ARRAYS = """\
Cannot differentiate at argument {index} of {fn}: the value at {path} is a \
{type}, not an array or number.
Differentiation points are pytrees of arrays. Keep configuration in a static field:

    class Model(ft.Module):
        name: str = ft.field(static=True)
"""

PATTERN_SELECTS_NOTHING = """\
wrt={patterns!r} selects no parameter of {fn}'s first argument{extra}.
Patterns are globs over dotted names such as {examples}.
"""

PATTERN_SELECTS_NON_PARAMETER = """\
wrt={patterns!r} selects {path}, which is not a parameter ({why}). \
Non-parameters are carried, not differentiated.
    right:  ft.{op}(f, wrt="{example}")   # select parameters only
"""

REVERSE_ONLY = """\
ft.{op}: {fn} calls a function whose custom derivative is reverse-mode only \
(@ft.derivative(of=f) returning (value, pullback)); forward mode cannot use a pullback.

    right:  @ft.derivative(of=f, mode="forward")   # register (value, differential) instead
       or:  use a reverse-mode operator: ft.gradient, ft.pullback, ft.jacobian(f, mode="reverse")
"""

BAD_WRT = "wrt must be an argument index, a tuple of indices, or key-path pattern(s); got {wrt!r}."


def _fn_name(f: Callable[..., Any]) -> str:
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or repr(f)


def _is_none(x: Any) -> bool:
    return x is None


def _check_point(f: Callable[..., Any], index: int, x: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            continue
        if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
            continue
        if callable(leaf):  # a function kept as a leaf (Equinox modules): not differentiated
            continue
        raise TypeError(
            NOT_A_PYTREE_OF_ARRAYS.format(
                index=index,
                fn=_fn_name(f),
                path=jax.tree_util.keystr(path) or "<root>",
                type=type(leaf).__name__,
            )
        )


class _Plan:
    """How to split the call's arguments into differentiated views and the rest."""

    def __init__(self, op: str, f: Callable[..., Any], args: tuple, wrt: Any):
        self.op, self.f, self.args = op, f, args
        self.patterns: tuple[str, ...] | None = None
        if isinstance(wrt, str):
            wrt = (wrt,)
        if isinstance(wrt, (list, tuple)) and wrt and all(isinstance(w, str) for w in wrt):
            self.patterns, self.indices, self.single = tuple(wrt), (0,), True
        elif isinstance(wrt, int) and not isinstance(wrt, bool):
            self.indices, self.single = (wrt,), True
        elif isinstance(wrt, tuple) and wrt and all(isinstance(i, int) for i in wrt):
            self.indices, self.single = tuple(wrt), False
        else:
            raise TypeError(BAD_WRT.format(wrt=wrt))
        for i in self.indices:
            if not -len(args) <= i < len(args):
                raise IndexError(f"wrt={wrt!r} but {_fn_name(f)} was called with {len(args)} argument(s).")
        self.primals = tuple(self._view(i) for i in self.indices)

    def _view(self, i: int) -> Any:
        x = self.args[i]
        _check_point(self.f, i, x)
        view = parameters(x)
        if self.patterns is not None:
            view = self._select(x, view)
        if not jax.tree.leaves(view):
            raise TypeError(self._why_not(i, x))
        return view

    def _select(self, x: Any, view: Any) -> Any:
        assert self.patterns is not None
        leaves, treedef = jax.tree.flatten(view, is_leaf=_is_none)
        key = (jax.tree.structure(x, is_leaf=_is_none), treedef, self.patterns)
        chosen = _SELECTION_CACHE.get(key)
        if chosen is None:
            chosen = self._choose(x, leaves)
            bounded_put(_SELECTION_CACHE, key, chosen)
        return jax.tree.unflatten(
            treedef, [leaf if pick else None for leaf, pick in zip(leaves, chosen)]
        )

    def _choose(self, x: Any, leaves: list[Any]) -> tuple[bool, ...]:
        """Which parameter leaves the patterns select; computed once per tree definition.

        Each pattern must select at least one parameter. Non-parameters under a selected
        node are skipped (``wrt="encoder"`` takes encoder's parameters, not its running
        statistics); a pattern that selects only non-parameters is an error.
        """
        assert self.patterns is not None
        names = _leaf_names(x)
        model_leaves = jax.tree.leaves(x, is_leaf=_is_none)
        parameter_names = [n for n, leaf in zip(names, leaves) if leaf is not None]
        chosen = [False] * len(names)
        for pattern in self.patterns:
            hits = [
                i for i, n in enumerate(names)
                if model_leaves[i] is not None and _matches(n, (pattern,))
            ]
            if not hits:
                raise ValueError(
                    PATTERN_SELECTS_NOTHING.format(
                        patterns=pattern, fn=_fn_name(self.f), extra="", examples=parameter_names[:3]
                    )
                )
            usable = [i for i in hits if leaves[i] is not None]
            if not usable:
                orig = model_leaves[hits[0]]
                why = (
                    "a no_derivative field"
                    if is_parameter_leaf(orig)
                    else f"dtype {getattr(orig, 'dtype', type(orig).__name__)}"
                )
                raise ValueError(
                    PATTERN_SELECTS_NON_PARAMETER.format(
                        patterns=pattern,
                        path=names[hits[0]],
                        why=why,
                        op=self.op,
                        example=parameter_names[0] if parameter_names else "*",
                    )
                )
            for i in usable:
                chosen[i] = True
        return tuple(chosen)

    def _why_not(self, i: int, x: Any) -> str:
        if isinstance(x, Module):
            why = f"{type(x).__name__} has no parameters (only no_derivative, integer or bool leaves)."
        else:
            dtypes = sorted({str(getattr(leaf, "dtype", type(leaf).__name__)) for leaf in jax.tree.leaves(x)})
            why = f"it holds only non-differentiable values ({', '.join(dtypes) or 'no leaves'})."
        others = [j for j in range(len(self.args)) if j not in self.indices]
        suggest = (others[0] if len(others) == 1 else tuple(others)) if others else "..."
        return NOT_DIFFERENTIABLE_ARGUMENT.format(
            index=i, fn=_fn_name(self.f), why=why, op=self.op, suggest=suggest
        )

    def rebuild(self, primals: Sequence[Any]) -> tuple:
        args = list(self.args)
        for i, p in zip(self.indices, primals):
            args[i] = with_parameters(self.args[i], p)
        return tuple(args)

    def wrap(self, pack: Callable[[Any], Any] = lambda out: out) -> Callable[..., Any]:
        def g(*primals: Any) -> Any:
            return pack(self.f(*self.rebuild(primals)))

        return g

    @property
    def argnums(self) -> int | tuple[int, ...]:
        return 0 if self.single else tuple(range(len(self.primals)))

    def result(self, tangents: Sequence[Any]) -> Any:
        return tangents[0] if self.single else tuple(tangents)

    def split_input(self, t: Any) -> tuple:
        if self.single:
            return (t,)
        if not isinstance(t, tuple) or len(t) != len(self.indices):
            raise TypeError(
                f"This differential takes a tuple of {len(self.indices)} tangents (wrt={self.indices})."
            )
        return t


# (structure of x, structure of its parameter view, patterns) -> chosen leaf positions.
_SELECTION_CACHE: dict[Any, tuple[bool, ...]] = {}


@contextlib.contextmanager
def _explain_reverse_only(op: str, fn: Callable[..., Any]) -> Iterator[None]:
    """Turn JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function"."""
    try:
        yield
    except TypeError as e:
        if "forward-mode autodiff (jvp) to a custom_vjp" not in str(e):
            raise
        raise TypeError(REVERSE_ONLY.format(op=op, fn=_fn_name(fn))) from e


def _check_scalar(op: str, f: Callable[..., Any], has_aux: bool) -> Callable[[Any], Any]:
    def pack(out: Any) -> Any:
        value = out[0] if has_aux else out
        shape = jnp.shape(value)
        if shape != ():
            raise TypeError(
                NON_SCALAR_RESULT.format(
                    op=op, fn=_fn_name(f), shape=shape, dtype=jnp.result_type(value)
                )
            )
        return out

    return pack


def _operator(op: str, f: Callable[..., Any], at: Any, impl: Callable[..., Any]) -> Any:
    """Return the derivative function, or its value at ``at`` when given."""

    @functools.wraps(f)
    def derived(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            bound = functools.partial(f, **kwargs)
            return impl(bound, args)
        return impl(f, args)

    derived.__name__ = f"{op}_of_{getattr(f, '__name__', 'f')}"
    return derived if at is _MISSING else derived(at)


def value_with_gradient(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, has_aux: bool = False
) -> Any:
    """``(f(x), ∇f(x))``: the value and the gradient of a scalar function.

    Returns ``((value, aux), gradient)`` when ``has_aux=True``.

    Example:
      >>> import functree as ft
      >>> ft.value_with_gradient(lambda x: x * x, at=3.0)
      (Array(9., dtype=float32, weak_type=True), Array(6., dtype=float32, weak_type=True))
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _value_and_grad("value_with_gradient", fn, args, wrt, has_aux)

    return _operator("value_with_gradient", f, at, impl)


def _value_and_grad(op: str, fn: Callable[..., Any], args: tuple, wrt: Any, has_aux: bool) -> Any:
    plan = _Plan(op, fn, args, wrt)
    g = plan.wrap(_check_scalar(f"ft.{op}", fn, has_aux))
    _diagnostics.check("gradient", fn, g, plan)
    return jax.value_and_grad(g, argnums=plan.argnums, has_aux=has_aux)(*plan.primals)


def gradient(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, has_aux: bool = False
) -> Any:
    """``∇f``: the gradient function of a scalar ``f``, or the gradient at ``at``.

    Differentiating with respect to a Module gives a tree with the parameter view's
    structure (``None`` at non-parameters).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> dfdx = ft.gradient(lambda x: (x * x).sum())
      >>> dfdx(jnp.array([3.0, 1.0]))
      Array([6., 2.], dtype=float32)
      >>> ft.gradient(lambda x, y: x * y, wrt=(0, 1))(2.0, 5.0)
      (Array(5., dtype=float32, weak_type=True), Array(2., dtype=float32, weak_type=True))
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        value, grads = _value_and_grad("gradient", fn, args, wrt, has_aux)
        return (grads, value[1]) if has_aux else grads

    return _operator("gradient", f, at, impl)


def value_with_pullback(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, has_aux: bool = False
) -> Any:
    """``(f(x), pullback)`` where ``pullback(v) = vᵀ J_f(x)`` (reverse mode).

    Returns ``(value, pullback, aux)`` when ``has_aux=True``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> y, pb = ft.value_with_pullback(jnp.sin, at=jnp.zeros(2))
      >>> pb(jnp.ones(2))
      Array([1., 1.], dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _vjp("value_with_pullback", fn, args, wrt, has_aux)

    return _operator("value_with_pullback", f, at, impl)


def _vjp(op: str, fn: Callable[..., Any], args: tuple, wrt: Any, has_aux: bool) -> Any:
    plan = _Plan(op, fn, args, wrt)
    g = plan.wrap()
    _diagnostics.check("pullback", fn, g, plan)
    out = jax.vjp(g, *plan.primals, has_aux=has_aux)

    def pullback_fn(cotangent: Any) -> Any:
        return plan.result(out[1](cotangent))

    return (out[0], pullback_fn, *out[2:])  # out[2:] is (aux,) when has_aux


def pullback(f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0) -> Any:
    """The pullback ``v ↦ vᵀ J_f(x)`` at ``at`` (or a function of the point giving it).

    Example (seed 002: rows of a Jacobian from basis vectors):
      >>> import functree as ft, jax.numpy as jnp
      >>> pb = ft.pullback(lambda x: jnp.stack([x[0] * x[1], x[0] + x[1]]), at=jnp.array([1.0, 2.0]))
      >>> pb(jnp.array([1.0, 0.0]))
      Array([2., 1.], dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _vjp("pullback", fn, args, wrt, False)[1]

    return _operator("pullback", f, at, impl)


def value_with_differential(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, has_aux: bool = False
) -> Any:
    """``(f(x), differential)`` where ``differential(t) = J_f(x) t`` (forward mode).

    Returns ``(value, differential, aux)`` when ``has_aux=True``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> y, df = ft.value_with_differential(lambda x: x ** 3, at=2.0)
      >>> df(1.0)
      Array(12., dtype=float32, weak_type=True)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _linearize("value_with_differential", fn, args, wrt, has_aux)

    return _operator("value_with_differential", f, at, impl)


def _linearize(op: str, fn: Callable[..., Any], args: tuple, wrt: Any, has_aux: bool) -> Any:
    plan = _Plan(op, fn, args, wrt)
    g = plan.wrap()
    _diagnostics.check("differential", fn, g, plan)
    with _explain_reverse_only(op, fn):
        out = jax.linearize(g, *plan.primals, has_aux=has_aux)

    def differential_fn(tangent: Any) -> Any:
        with _explain_reverse_only(op, fn):
            return out[1](*plan.split_input(tangent))

    return (out[0], differential_fn, *out[2:])  # out[2:] is (aux,) when has_aux


def differential(f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0) -> Any:
    """The differential ``t ↦ J_f(x) t`` at ``at`` (forward mode).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> df = ft.differential(lambda x: x ** 2, at=jnp.array([1.0, 2.0]))
      >>> df(jnp.array([1.0, 1.0]))
      Array([2., 4.], dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _linearize("differential", fn, args, wrt, False)[1]

    return _operator("differential", f, at, impl)


def derivative(f: Callable[..., Any], at: Any = _MISSING, *, wrt: int = 0) -> Any:
    """``df/dx`` for a scalar argument ``x`` (the result may have any shape), by forward mode.

    Example:
      >>> import functree as ft
      >>> ft.derivative(lambda x: x ** 2, at=3.0)
      Array(6., dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        x = args[wrt]
        if jnp.shape(x) != () or not is_parameter_leaf(x):
            raise TypeError(
                f"ft.derivative takes a scalar floating argument, got shape {jnp.shape(x)} "
                f"dtype {jnp.result_type(x)}. For arrays use ft.gradient, ft.jacobian or ft.differential."
            )
        _, df = _linearize("derivative", fn, args, wrt, False)
        return df(jnp.ones((), jnp.result_type(x)))

    return _operator("derivative", f, at, impl)


def jacobian(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, mode: str = "reverse", has_aux: bool = False
) -> Any:
    """The Jacobian ``J_f(x)``, built from pullbacks (``mode="reverse"``) or differentials
    (``mode="forward"``) of basis vectors.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.jacobian(lambda x: 2.0 * x, at=jnp.ones(2))
      Array([[2., 0.],
             [0., 2.]], dtype=float32)
    """
    if mode not in ("reverse", "forward"):
        raise ValueError(f"mode is 'reverse' or 'forward', got {mode!r}.")
    transform = jax.jacrev if mode == "reverse" else jax.jacfwd

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        plan = _Plan("jacobian", fn, args, wrt)
        g = plan.wrap()
        if not has_aux:  # with aux, the analysis cannot tell the result from the aux
            _diagnostics.check("pullback", fn, g, plan)
        with _explain_reverse_only("jacobian", fn):
            return transform(g, argnums=plan.argnums, has_aux=has_aux)(*plan.primals)

    return _operator("jacobian", f, at, impl)


def hessian(f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0) -> Any:
    """The Hessian ``∇²f(x)`` of a scalar function (forward-over-reverse).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.hessian(lambda x: (x ** 3).sum(), at=jnp.array([1.0, 2.0]))
      Array([[ 6.,  0.],
             [ 0., 12.]], dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        plan = _Plan("hessian", fn, args, wrt)
        g = plan.wrap(_check_scalar("ft.hessian", fn, False))
        _diagnostics.check("gradient", fn, g, plan)
        return jax.hessian(g, argnums=plan.argnums)(*plan.primals)

    return _operator("hessian", f, at, impl)
