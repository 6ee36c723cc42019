"""Other libraries' habits on the differential operators, refused with functree's way.

A JAX user writes ``ft.gradient(loss, argnums=1)`` or ``ft.gradient(loss, 1)`` (JAX's
``argnums``, by keyword or position), ``allow_int=`` or ``reduce_axes=``; a torch user
passes a value (``torch.autograd.grad(loss, x)``: no tape records it here) or
``create_graph=True``; anyone may swap the function and the point, or give ``has_aux=True``
to a function that returns no ``(result, aux)`` pair. Python's "unexpected keyword
argument", JAX's "two-element tuple" or an ``IndexError`` name none of functree's ways;
each error here shows the wrong line and a right one that runs.

The checks cost one dictionary look-up per keyword at the operator's call (not per call of
the function it returns) and one ``isinstance`` per traced result with ``has_aux``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import jax

from functree._plan import fn_name

__all__ = [
    "FOREIGN_KEYWORD",
    "FOREIGN_KEYWORDS",
    "ARGUMENTS_SWAPPED",
    "VALUE_GIVEN",
    "ARGNUMS_AS_POINT",
    "AUX_NOT_A_PAIR",
    "named_keywords",
    "check_function",
    "aux_pair",
]

P = ParamSpec("P")
R = TypeVar("R")

FOREIGN_KEYWORD = """\
ft.{op} takes no {name}=: {why}

    wrong:  ft.{op}(f, {name}={value!r})
    right:  {right}"""

_PULLBACK_AUX = "y, pb, aux = ft.value_with_pullback(f, at=x, has_aux=True)"
_DIFFERENTIAL_AUX = "y, df, aux = ft.value_with_differential(f, at=x, has_aux=True)"
_HOLOMORPHIC_WHY = ("complex functions are differentiated as they are (only gradient, value_with_gradient "
                    "and jacobian, which pull back a real 1, need the flag); ")

# keyword -> (why, right line) or op -> (why, right line); "{op}" and "{value!r}" filled in.
FOREIGN_KEYWORDS: dict[str, Any] = {
    "argnums": ("JAX's argnums is wrt= here (an argument index, a tuple of them, or key-path "
                "patterns over the first argument, such as \"head.*\")",
                "ft.{op}(f, wrt={value!r})(a, b)"),
    "allow_int": ("JAX's allow_int differentiates integer inputs to float0 zeros; here integer "
                  "leaves are carried, not differentiated, and their derivative is None: drop it",
                  "ft.{op}(f, at=x)"),
    "reduce_axes": ("JAX's reduce_axes (removed from JAX) summed the derivative over a named "
                    "axis; sum it with jax.lax.psum under the mapped axis",
                    "jax.vmap(lambda x: jax.lax.psum(ft.gradient(f, at=x), \"batch\"), axis_name=\"batch\")(xs)"),
    "create_graph": ("torch's create_graph=True keeps the graph for a higher derivative; JAX's "
                     "operators compose: differentiate the derivative function",
                     "ft.hessian(f, at=x)                        # or ft.jacobian(ft.gradient(f), at=x)"),
    "retain_graph": ("torch's retain_graph=True keeps the tape for another backward; JAX records no "
                     "tape: call the operator again, or keep the pullback",
                     "y, pb = ft.value_with_pullback(f, at=x)    # pb can be called many times"),
    "holomorphic": {
        "pullback": (_HOLOMORPHIC_WHY + "pull back the cotangent you mean",
                     "ft.pullback(f, at=z)(jnp.ones_like(f(z)))   # f'(z) for a holomorphic f"),
        "value_with_pullback": (_HOLOMORPHIC_WHY + "pull back the cotangent you mean",
                                "y, pb = ft.value_with_pullback(f, at=z);  pb(jnp.ones_like(y))   # f'(z), holomorphic f"),
        "differential": (_HOLOMORPHIC_WHY + "forward mode pushes a complex tangent forward",
                         "ft.differential(f, at=z)(jnp.ones_like(z))   # f'(z) for a holomorphic f"),
        "value_with_differential": (_HOLOMORPHIC_WHY + "forward mode pushes a complex tangent forward",
                                    "y, df = ft.value_with_differential(f, at=z);  df(jnp.ones_like(z))   # f'(z)"),
        "derivative": (_HOLOMORPHIC_WHY + "forward mode pushes a complex tangent forward",
                       "ft.derivative(f, at=z)                     # f'(z) for a holomorphic f of a complex scalar"),
        "hessian": ("ft.hessian takes real parameters (the Hessian of a real function of complex "
                    "ones mixes ∂²/∂z∂z and ∂²/∂z∂z̄); JAX's takes a holomorphic f",
                    "jax.hessian(f, holomorphic=True)(z)"),
    },
    "has_aux": {
        "pullback": ("ft.pullback returns the pullback alone; the value, the pullback and the aux "
                     "come from value_with_pullback", _PULLBACK_AUX),
        "differential": ("ft.differential returns the differential alone; the value, the differential "
                         "and the aux come from value_with_differential", _DIFFERENTIAL_AUX),
        "derivative": ("ft.derivative returns the derivative alone; with an aux, take the "
                       "differential and push 1.0 forward", _DIFFERENTIAL_AUX + ";  dfdx = df(1.0)"),
        "hessian": ("ft.hessian differentiates a scalar function twice; differentiate the loss "
                    "alone and compute the aux apart",
                    "ft.hessian(lambda x: f(x)[0], at=x);  aux = f(x)[1]"),
    },
}


def _foreign(op: str, name: str, value: Any) -> TypeError | None:
    entry = FOREIGN_KEYWORDS.get(name)
    if isinstance(entry, dict):
        entry = entry.get(op)
    if entry is None:
        return None
    why, right = entry
    return TypeError(FOREIGN_KEYWORD.format(op=op, name=name, value=value, why=why,
                                            right=right.format(op=op, value=value)))


def named_keywords(operator: Callable[P, R]) -> Callable[P, R]:
    """``operator``, refusing JAX's and torch's keywords it does not take
    (:data:`FOREIGN_KEYWORDS`) by name (any other keyword keeps Python's error), and a
    Python int (or a tuple of them) given as the point by position, JAX's positional
    ``argnums`` (:data:`ARGNUMS_AS_POINT`; ``at=3`` by keyword keeps the point's error)."""
    op = operator.__name__
    accepted = frozenset(inspect.signature(operator).parameters)

    @functools.wraps(operator)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for name in kwargs:
            if name not in accepted and (error := _foreign(op, name, kwargs[name])) is not None:
                raise error
        given: tuple[Any, ...] = args
        if len(given) == 2 and callable(given[0]) and _integers(given[1]):  # jax.grad(f, 1): argnums
            raise _argnums_as_point(op, given[1])
        return operator(*args, **kwargs)

    return checked


ARGUMENTS_SWAPPED = """\
ft.{op} takes the function first, then the point: got {given} as the function and the \
function {fn} as the point.

    wrong:  ft.{op}(x, {f})
    right:  ft.{op}({f}, at=x)"""

VALUE_GIVEN = """\
ft.{op} takes the function to differentiate, got {given}, which is not callable. JAX \
records no tape: a value computed already (torch's torch.autograd.grad(loss, x)) carries \
no derivative; give the function that computes it (a loss of a model and a batch: \
ft.{op}(lambda m: loss_fn(m, batch), at=model)).

    wrong:  y = f(x);  ft.{op}(y, at=x)
    right:  ft.{op}(f, at=x)"""

ARGNUMS_AS_POINT = """\
ft.{op}(f, {at!r}): the second argument is the point at=, not JAX's argnums \
(jax.grad(f, {at!r})); an integer point has no derivative.

    right:  ft.{op}(f, wrt={at!r})(a, b)   # the arguments to differentiate, by index
       or:  ft.{op}(f, at={point})   # the point, as a float"""


def _argnums_as_point(op: str, at: Any) -> TypeError:
    point = f"{float(at)!r}" if type(at) is int else f"{tuple(float(i) for i in at)!r}"
    return TypeError(ARGNUMS_AS_POINT.format(op=op, at=at, point=point))


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {x.dtype} array of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _is_function_leaf(x: Any) -> bool:
    """A plain function (or partial): callable and a leaf. A Module is callable but a tree."""
    return callable(x) and jax.tree.leaves(x) == [x]


def _integers(at: Any) -> bool:
    if type(at) is int:
        return True
    return isinstance(at, tuple) and len(at) > 0 and all(type(i) is int for i in at)


def check_function(op: str, f: Any, at: Any, missing: Any) -> None:
    """Refuse a non-callable ``f``: the arguments swapped, or a value given (torch's way)."""
    if not callable(f):
        if at is not missing and _is_function_leaf(at):
            name = fn_name(at)
            raise TypeError(ARGUMENTS_SWAPPED.format(op=op, given=_describe(f), fn=name,
                                                     f=name if name.isidentifier() else "f"))
        raise TypeError(VALUE_GIVEN.format(op=op, given=_describe(f)))


AUX_NOT_A_PAIR = """\
ft.{op}(..., has_aux=True) takes a function that returns a pair (result, aux), but {fn} \
returned {what}.

    wrong:  return loss   # with has_aux=True
    right:  return loss, {{"logits": logits}}   # aux: any pytree, the pair's second item
       or:  ft.{op}(f, at=x)   # no aux: drop has_aux"""


def aux_pair(op: str, f: Callable[..., Any], has_aux: bool) -> Callable[[Any], Any]:
    """The check of ``f``'s traced result that ``has_aux`` asks for: a pair (a tuple or a
    list of two, as JAX takes it). The identity when ``has_aux`` is False."""
    if not has_aux:
        return _same

    def pair(out: Any) -> Any:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            what = f"a {type(out).__name__} of {len(out)} items" if isinstance(out, (tuple, list)) else _describe(out)
            raise TypeError(AUX_NOT_A_PAIR.format(op=op, fn=fn_name(f), what=what))
        return out

    return pair


def _same(out: Any) -> Any:
    return out
