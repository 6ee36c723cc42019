"""Custom derivatives (Swift's ``@differentiable`` and ``@derivative(of:)``), stopping
derivatives (``withoutDerivative(at:)``) and recomputation in pullbacks (checkpointing).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, overload

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from functree import _diagnostics, _operators, _warnings
from functree._activity import SCOPE
from functree._diagnostics import UncoveredDerivativeError
from functree._module import DifferentiationWarning
from functree._operator_habits import named_keywords
from functree._parameters import is_parameter_leaf, parameters
from functree._remat_policy import jax_policy, policy_names, remat_policy
from functree._source import call_refusal
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

RULE_ARITY = """\
@ft.derivative(of={fn}{mode_arg}): the rule {name}{signature} cannot be called with {fn}'s \
arguments ({args}): {error}. The rule is called as {fn} is, with its own arguments, and \
returns {fn}'s value with the {closure} (not JAX's {jax} signature):

    wrong:  def {name}{signature}: ...
    right:  def {name}({args}):
                return value, lambda {var}: ...    # {what}"""

BAD_DERIVATIVE_RESULT = """\
The derivative registered for {fn} must return a pair (value, {closure}); it returned {got}.
    @ft.derivative(of={fn})
    def d_{fn}(x):
        y = {fn}(x)
        return y, lambda v: v * ...   # the {closure}"""


UNCOVERED_ARGUMENT = """\
{fn} is differentiated with respect to {what}, which its registered {mode}-mode \
derivative does not cover (registered with wrt={wrt}): the derivative there would \
silently be zero. Swift makes this an error; so does functree.
Register a derivative that covers it, differentiate only what is covered, or mark the \
zero as intended:

    wrong:  @ft.derivative(of={fn}, wrt={wrt})     # and {name} is differentiated
    right:  @ft.derivative(of={fn}, wrt={suggest})  # the {closure} covers {name} too
       or:  ft.gradient(f, wrt=...)                  # differentiate only covered arguments
       or:  {fn}(..., ft.without_derivative(at={name}), ...)   # an intentional zero"""

PULLBACK_COUNT = """\
The pullback registered for {fn} returned {got}; it covers {count} arguments (wrt={wrt}: \
{names}) and returns one cotangent per argument, in wrt's order. Missing: {missing}. \
A missing cotangent would silently be zero.

    wrong:  return y, lambda v: {wrong}
    right:  return y, lambda v: ({right})
       or:  @ft.derivative(of={fn}, wrt={fewer})   # cover fewer arguments"""

PULLBACK_TOO_MANY = """\
The pullback registered for {fn} returned a tuple of {got} cotangents; this call covers \
{count} arguments (wrt={wrt}: {names}), one cotangent each, in wrt's order: {extra} too many.\
{defaulted}

    wrong:  return y, lambda v: ({wrong})
    right:  {right}
       or:  {other}"""

LEFT_AT_DEFAULT = """ {names} {verb} left at {its} default, a constant of the call: with \
wrt left out, only arguments passed are covered, so {its} cotangent has no place. \
Register wrt= with every parameter, in order: one left at its default then covers \
nothing and its cotangent is dropped."""

UNCOVERED_KEY_PATH = """\
The pullback registered for {fn} returned None for {what}, which is being \
differentiated: the derivative there would silently be zero.
Return its cotangent (zeros, if the zero is intended):

    wrong:  return y, lambda v: (..., None)                   # None at {name}
    right:  return y, lambda v: (..., jnp.zeros_like({name}))  # an intentional zero
       or:  return y, lambda v: (..., <the cotangent of {name}>)"""

COTANGENT_DTYPE = """\
The pullback registered for {fn} returned a cotangent of {given} for {what}, which is \
{expected}: a cotangent has its argument's dtype (Swift's TangentVector), or the gradient \
would silently be {given_dtype}.

    wrong:  return y, lambda v: (..., ct)                      # ct: {given}
    right:  return y, lambda v: (..., ct.astype({name}.dtype))  # computed in another dtype"""

COTANGENT_SHAPE = """\
The pullback registered for {fn} returned a cotangent of {given} for {what}, which is \
{expected}: a cotangent has its argument's shape.

    wrong:  return y, lambda v: (..., ct)   # ct: {given}
    right:  return y, lambda v: (..., ct)   # ct: {expected}, shaped like {name}"""

COTANGENT_STRUCTURE = """\
The pullback registered for {fn} returned a cotangent for {what} whose structure is not \
the argument's: {problem}. A cotangent has its argument's structure, with None (or \
zeros) where no derivative flows.

    wrong:  return y, lambda v: (..., ct)   # ct with {wrong}
    right:  return y, lambda v: (..., ct)   # ct with {right}, as `{name}`"""

RULE_VALUE = """\
The derivative registered for {fn} returned a value of {given}{where}, but {fn} itself \
returns {expected}: the rule's value stands for {fn}'s result wherever it is \
differentiated, so the result and its derivative would silently be another function's.

    wrong:  return y, lambda {v}: ...   # y: {given}{where}
    right:  return y, lambda {v}: ...   # y: {expected}{where}, the value {fn}(...) returns"""

UNDECORATED_METHOD = """\
@ft.derivative(of={qualname}) names a method that was not declared with \
@ft.differentiable: the rule is registered on the function @ft.derivative returns \
(bound to `{rule}`), not on {cls}'s method, so calls through the class \
(`{call}`) keep differentiating by autodiff and do not use the rule. \
A function object does not know its class, so the rule cannot be put on it from here. \
Either declare the method differentiable in the class, so the rule applies to the class \
(and its subclasses), or call the returned function:

    wrong:  class {cls}{bases}:
                {static}def {name}({params}): ...
            {call}  # autodiff, not the rule
    right:  class {cls}{bases}:
                @ft.differentiable
                {static}def {name}({params}): ...
            @ft.derivative(of={qualname})  # then registers on the class's method
            def {rule}({params}): ...
       or:  {rule}({args})  # the returned function uses the rule"""


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
        # With both rules, forward-mode operators use the forward rule, all else the reverse.
        use_forward = self.forward is not None and (
            self.reverse is None or _operators.in_forward_mode()
        )
        deriv, wrt = self.forward if use_forward else self.reverse  # type: ignore[misc]
        fn: Callable[..., Any] = self.fn
        names = None
        if kwargs:  # keyword arguments become positional ones: JAX sees (and differentiates) them
            args, fn, deriv, wrt, names = _Keywords(self).positional(args, kwargs, deriv, wrt)
        call = _Call(self.fn, deriv, wrt, args, fn, names)
        return call.with_differential() if use_forward else call.with_pullback()


class _Names(NamedTuple):
    """How a keyword call's flattened arguments are named in messages: ``labels[i]`` and
    ``places[i]`` (the parameter's index, as ``wrt`` counts it) for flattened position
    ``i``, and the ``wrt`` the rule was registered with."""

    labels: list[str]
    places: list[int]
    registered: tuple[int, ...] | None


class _Keywords:
    """A call's keyword arguments as positional ones (a keyword array is a dynamic argument).

    ``inspect.signature(fn).bind`` moves every keyword naming a positional parameter to its
    place (``f(x, scale=s)`` is ``f(x, s)``: ``wrt=1`` covers it); keywords left over (a
    keyword-only parameter, one after a default left out) are appended after the
    positional ones. Positions exist for JAX only: ``fn`` and the rule get every keyword
    back by name (a rule may declare it keyword-only). Defaults are not filled in.

    ``wrt`` is remapped by parameter name: an index whose parameter was not passed (its
    default, a constant) points past the arguments, so that it covers nothing yet keeps
    its cotangent's place in the pullback's tuple; a passed argument outside ``wrt`` stays
    uncovered (an :class:`UncoveredDerivativeError` when differentiated).
    """

    def __init__(self, target: DifferentiableFunction):
        self.target = target

    def positional(
        self, args: tuple, kwargs: dict[str, Any], deriv: Callable[..., Any], wrt: tuple[int, ...] | None,
    ) -> tuple[tuple, Callable[..., Any], Callable[..., Any], tuple[int, ...] | None, _Names]:
        signature = _signature(self.target.fn)
        given = len(args)  # passed positionally: passed back positionally
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
                args, kwargs = bound.args, bound.kwargs
            except TypeError:
                pass  # the call itself raises Python's error below
        params = list(signature.parameters) if signature is not None else []
        n, left = len(args), list(kwargs)
        flat = (*args, *kwargs.values())
        # bind puts a keyword in args only at its own parameter's place (no *args before it)
        by_name = [params[k] for k in range(given, n)] + left
        labels = [params[i] if i < len(params) else f"args[{i}]" for i in range(n)] + left
        places = list(range(n)) + [params.index(k) if k in params else n + j for j, k in enumerate(left)]
        registered = wrt
        if wrt is not None:
            wrt = tuple(self._place(i, n, params, left, labels, places) for i in wrt)

        def spread(f: Callable[..., Any]) -> Callable[..., Any]:
            return lambda *a: f(*a[:given], **dict(zip(by_name, a[given:])))

        return flat, spread(self.target.fn), spread(deriv), wrt, _Names(labels, places, registered)

    @staticmethod
    def _place(i: int, n: int, params: list[str], left: list[str], labels: list[str], places: list[int]) -> int:
        """The flattened position of ``wrt`` index ``i`` (a parameter's index)."""
        if i < n:  # a positional argument (or bound to its place), or -1 (the last)
            return i
        name = params[i] if i < len(params) else None
        if name in left:
            return n + left.index(name)
        # Not passed: its default is a constant. A position past the arguments keeps the
        # cotangent's slot in the pullback's tuple and covers nothing.
        labels.append(name or f"args[{i}]")
        places.append(i)
        return len(labels) - 1


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """``inspect.signature(fn)``, cached; an unhashable callable (an eq-dataclass or a
    Module holding arrays) is looked up uncached."""
    try:
        return _cached_signature(fn)
    except (TypeError, ValueError):  # hashing (or comparing) fn failed
        return _uncached_signature(fn)


@functools.lru_cache(maxsize=256)
def _cached_signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    return _uncached_signature(fn)


def _uncached_signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@overload
def differentiable(fn: Callable[..., Any]) -> DifferentiableFunction: ...
@overload
def differentiable() -> Callable[[Callable[..., Any]], DifferentiableFunction]: ...
def differentiable(fn: Callable[..., Any] = _MISSING) -> Any:
    """Declare ``fn`` differentiable so that :func:`derivative` can register derivatives.

    ``@ft.differentiable()``, with parentheses, is the same decorator.

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
    if fn is _MISSING:
        return differentiable
    if isinstance(fn, DifferentiableFunction):
        return fn
    return DifferentiableFunction(fn)


def _normalize_wrt(wrt: Any) -> tuple[int, ...] | None:
    if wrt is None:
        return None
    if isinstance(wrt, int):
        return (wrt,)
    return tuple(wrt)


@named_keywords  # JAX's argnums / has_aux / holomorphic named with functree's way
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
    that are not arrays, such as a string flag, and Python ints and bools, such as an axis,
    are passed through as constants, as ``nondiff_argnums`` would make them; a Python float
    is data). An argument passed by keyword counts at its parameter's position
    (``f(x, scale=s)`` is ``f(x, s)``: ``wrt=1`` covers it) and reaches the rule by name
    (the rule may declare it keyword-only); a ``wrt`` index whose parameter is left at its
    default covers nothing (its cotangent is still returned). A forward rule may give ``None`` as the tangent
    of an integer output (an argmax). With
    several covered arguments the pullback returns a tuple, one cotangent per argument in
    ``wrt``'s order (one missing is an error, never a zero), where only a bare Python number
    (``scale=2.0``, a constant) may be left out. The rule is called with the call's own
    arguments: ``of``'s defaults are not filled in (``of=jnp.round`` takes ``x`` alone).
    If ``f`` was declared with
    :func:`differentiable`, the derivative is registered on it (replacing one of the same
    mode, and one of the other mode registered under the rule's own name from another cell:
    a notebook cell run again with ``mode=`` changed; name the two rules apart, or ``_``, to
    keep both) and the decorated function is returned unchanged, unless it has ``f``'s name: then
    ``f`` is returned (``@ft.derivative(of=q)`` over ``def q``, in a notebook cell run
    again, replaces the rule and leaves ``q`` differentiable, as the first run did);
    otherwise a new differentiable function carrying the derivative is returned. A method
    (``of=Model.__call__``) not declared with :func:`differentiable` in its class gets the
    rule on the returned function only: calls through the class keep autodiff, so a
    :class:`DifferentiationWarning` (:data:`UNDECORATED_METHOD`) is issued at registration.

    A reverse-mode derivative keeps the pullback's residuals (no recomputation). A forward
    derivative also serves reverse mode, by transposition, when the differential is linear.
    With both registered, forward-mode operators (``ft.differential``,
    ``ft.jacobian(mode="forward")``, ``ft.derivative``, ``ft.hessian``) use the forward rule
    and every other transformation the reverse rule.

    The rule covers the ``wrt`` arguments only (Swift's rule): differentiating with respect
    to another argument, or to a parameter the pullback returns ``None`` for, is an
    :class:`UncoveredDerivativeError` naming it and the fix, never a silent zero. A
    cotangent has its argument's structure (``None`` for a subtree nothing flows to), shape
    and float dtype: another is a ``TypeError`` naming the argument's key path (JAX would
    return a float32 parameter's gradient in the float16 a rule computed in).

    Example (Swift's ``@derivative(of: expf)``):
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
        _check_rule_arity(fn, deriv, mode)
        _warn_undecorated_method(fn, deriv)
        target = fn if isinstance(fn, DifferentiableFunction) else DifferentiableFunction(fn)
        other = "forward" if mode == "reverse" else "reverse"
        if _earlier_run(getattr(target, other), deriv):
            setattr(target, other, None)
        setattr(target, mode, (deriv, indices))
        return deriv if target is fn and not _rebinds(deriv, target) else target

    return register


def _check_rule_arity(fn: Callable[..., Any], deriv: Callable[..., Any], mode: str) -> None:
    """:data:`RULE_ARITY` at registration when the rule cannot take ``fn``'s required
    arguments, by position or by name (a rule may take a keyword argument keyword-only):
    a JAX-style rule (custom_vjp's ``bwd(res, g)``, custom_jvp's ``jvp(primals, tangents)``)
    failed at the first gradient with Python's bare TypeError."""
    original = fn.fn if isinstance(fn, DifferentiableFunction) else fn
    try:
        params = inspect.signature(original).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the call tells
        return
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    keywords = dict.fromkeys(p.name for p in params if p.default is p.empty and p.kind is inspect.Parameter.KEYWORD_ONLY)
    refusal = call_refusal(deriv, *required, **keywords)
    if refusal is None or call_refusal(deriv, **dict.fromkeys(required), **keywords) is None:
        return
    name, signature, error = refusal
    forward = mode == "forward"
    raise TypeError(RULE_ARITY.format(
        fn=getattr(original, "__name__", "f"), mode_arg=', mode="forward"' if forward else "", name=name,
        signature=signature, args=", ".join(required), error=error,
        closure="differential" if forward else "pullback",
        jax="custom_jvp's jvp(primals, tangents)" if forward else "custom_vjp's fwd / bwd(residuals, g)",
        var=", ".join(f"t_{a}" for a in required) if forward else "v",
        what="the result's tangent from the arguments' tangents" if forward
        else "one cotangent per argument from the result's cotangent v"))


def _warn_undecorated_method(fn: Callable[..., Any], deriv: Callable[..., Any]) -> None:
    """Warn (:data:`UNDECORATED_METHOD`) when ``fn`` is a plain function defined in a class
    body (``Q.__call__``, ``Q.loss``, a ``staticmethod``): the rule goes on a new
    differentiable copy, which the returned function uses, while the class keeps calling
    its own method. Not refused: calling the returned function is right, and a library's
    class cannot be edited. A rule defined in the same class body under the method's own
    name (``@ft.derivative(of=loss)`` over ``def loss``) replaces the class attribute
    itself: no warning."""
    if not inspect.isfunction(fn):
        return
    parts = fn.__qualname__.split(".")
    if len(parts) < 2 or parts[-2] == "<locals>":  # a module's or a function's own function
        return
    if getattr(deriv, "__qualname__", None) == fn.__qualname__:  # rebinds the method in its class body
        return
    cls, name = parts[-2], parts[-1]
    is_method = next(iter(inspect.signature(fn).parameters), None) == "self"  # not a staticmethod
    call = "model(...)" if name == "__call__" else f"model.{name}(...)" if is_method else f"{cls}.{name}(...)"
    _warnings.warn(UNDECORATED_METHOD.format(
        qualname=f"{cls}.{name}", cls=cls, name=name, call=call, rule=getattr(deriv, "__name__", "rule"),
        bases="(ft.Module)" if is_method else "", static="" if is_method else "@staticmethod\n                ", params="self, ..." if is_method else "...",
        args="model, ..." if is_method else "..."), DifferentiationWarning)


def _earlier_run(registered: tuple[Callable[..., Any], Any] | None, deriv: Callable[..., Any]) -> bool:
    """Whether the other mode's ``registered`` rule is an earlier run of ``deriv``'s
    definition: a notebook cell run again with ``mode=`` changed. Kept, the old rule would
    still serve its mode (the gradient with a stale reverse rule). The same rule is known
    by its module and qualified name, defined in another cell (another file name) or at the
    same place of the same file (``%run`` again); two rules of one cell or file, at
    different places, are both kept, as registered on purpose, and so are rules without a
    name of their own (``def _``, a lambda): nothing tells their cells apart."""
    if registered is None:
        return False
    old, new = registered[0], deriv
    old_code, new_code = getattr(old, "__code__", None), getattr(new, "__code__", None)
    if old_code is None or new_code is None or getattr(new, "__name__", "_") in ("_", "<lambda>"):
        return False
    same_name = _rule_name(old) == _rule_name(new)
    other_place = old_code.co_filename != new_code.co_filename or old_code.co_firstlineno == new_code.co_firstlineno
    return same_name and other_place


def _rule_name(rule: Callable[..., Any]) -> tuple[Any, Any]:
    return getattr(rule, "__module__", None), getattr(rule, "__qualname__", None)


def _rebinds(deriv: Callable[..., Any], target: DifferentiableFunction) -> bool:
    """Whether the rule is defined under the name of the function it differentiates
    (``@ft.derivative(of=q)`` over ``def q``): the decorator binds that name, which must stay
    the differentiable function. A notebook cell re-run passes ``of=`` the wrapper its first
    run bound there; returning the bare rule would make ``q(x)`` return ``(value, pullback)``."""
    name = getattr(deriv, "__name__", None)
    return name is not None and name != "<lambda>" and name == getattr(target, "__name__", None)


def _split(result: Any, fn: Callable[..., Any], closure: str) -> tuple[Any, Callable[..., Any]]:
    if not (isinstance(result, tuple) and len(result) == 2 and callable(result[1])):
        name = getattr(fn, "__name__", "f")
        raise TypeError(BAD_DERIVATIVE_RESULT.format(fn=name, closure=closure, got=type(result).__name__))
    return result


def _is_number(x: Any) -> bool:
    """A bare Python number (``scale=2.0``): a constant of the call, never differentiated."""
    return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def _positional(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` seen through ``*args``: JAX's custom_vjp and custom_jvp bind a call to their
    function's signature and fill its defaults, so a call leaving a default out
    (``jnp.round(x)``'s ``decimals``) would hand the rule arguments it never got."""

    def call(*args: Any) -> Any:
        return fn(*args)

    # No functools.wraps: its __wrapped__ would lead inspect.signature back to fn's defaults.
    call.__name__ = getattr(fn, "__name__", "f")
    call.__qualname__ = getattr(fn, "__qualname__", call.__name__)
    return call


def _hoisted(pb: Callable[..., Any], value: Any) -> tuple[Callable[..., Any], list[Any]]:
    """The pullback ``pb`` as a function of a cotangent and explicit residuals.

    ``pb`` is traced once to a jaxpr; every traced value it reads becomes a residual,
    integers and bools included (a ReLU mask, labels, an argmax). ``jax.closure_convert``
    hoists only the values that may carry a derivative: an integer it leaves in the closure
    is a tracer of the forward trace, which the backward pass then reads outside it
    (UnexpectedTracerError under ``ft.gradient``'s diagnostics, jit, checkpoint, cond, scan).
    Concrete constants stay in the jaxpr. The forward pass is not recomputed.
    """
    from jax.extend import core as jcore
    closed, shape = jax.make_jaxpr(pb, return_shape=True)(value)
    out_tree = jax.tree.structure(shape)
    traced = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    residuals = [c for c, t in zip(closed.consts, traced) if t]
    fixed = [c for c, t in zip(closed.consts, traced) if not t]
    jaxpr = closed.jaxpr

    def converted(cotangent: Any, *residuals: Any) -> Any:
        hoisted, kept = iter(residuals), iter(fixed)
        consts = [next(hoisted) if t else next(kept) for t in traced]
        run = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, consts))
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(cotangent)))

    return converted, residuals


def _is_data(x: Any) -> bool:
    """Whether every leaf of ``x`` is an array or a number (a valid JAX argument)."""
    return all(
        isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex))
        or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
        for leaf in jax.tree.leaves(x)
    )


def _is_static_integer(x: Any) -> bool:
    """A Python int or bool, or a tree of them only (``axis=1``, ``axes=(0, 2)``): a
    constant of the call, as JAX's ``nondiff_argnums`` makes it; traced, an axis or a size
    would fail under ``jax.jit`` (a Python float stays data: it may be differentiated)."""
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(leaf, int) for leaf in leaves)  # bool is an int


def _is_primal(x: Any) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _is_symbolic_zero(x: Any) -> bool:
    return isinstance(x, SymbolicZero)


def _instantiate(t: Any) -> Any:
    """A symbolic zero (JAX's "not differentiated") as the zeros it stands for."""
    if not isinstance(t, SymbolicZero):
        return t
    aval: Any = t.aval  # a ShapedArray
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, jax.dtypes.float0)
    return jnp.zeros(aval.shape, aval.dtype)


def _keyed_leaves(tree: Any, is_leaf: Any = None) -> list[tuple[str, Any]]:
    """``tree``'s leaves with their key paths as printed (``['b']``, ``.weight``)."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in with_paths]


def _structure_problem(given: dict[str, Any], expected: dict[str, Any]) -> tuple[str, str, str] | None:
    """What differs between a cotangent's leaf paths and its primal's (a cotangent's None
    stands for every primal leaf below it), with the entries as written; None if nothing."""
    def covered(path: str) -> bool:
        return path in given or any(
            g is None and path.startswith(q) and path[len(q):][:1] in ("[", ".") for q, g in given.items()
        )

    def shown(paths: Any) -> str:  # the root's path is "": an array where a tuple was returned
        return ", ".join(p or "<root>" for p in paths)

    missing = [p for p in expected if not covered(p)]
    extra = [q for q, g in given.items() if g is not None and q not in expected]
    if not missing and not extra:
        return None
    parts = []
    if missing:
        parts.append(f"missing {shown(missing)}")
    if extra:
        parts.append(f"{shown(extra)} not in the argument")
    wrong = shown(given) or "no entries"
    right = shown(expected)
    return "; ".join(parts), wrong, right


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    return tuple(np.shape(x)), np.dtype(jnp.result_type(x))


def _type_str(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def _parameter_flags(x: Any) -> list[bool]:
    """For each leaf of ``x`` (flattened as JAX does), whether it is a parameter."""
    return [p is not None for p in jax.tree.leaves(parameters(x), is_leaf=is_none)]


class _Call:
    """One call of a function carrying a custom derivative, as JAX sees it.

    Arguments that are not arrays (a string flag, a callable) and Python ints and bools
    (an axis, a size) are bound as constants; the rest are the *dynamic* arguments JAX
    differentiates (a Python float among them: it may be differentiated). ``wrt`` (original positions) are
    the arguments the registered derivative covers, by default every one carrying floats.

    Differentiating with respect to an argument (or key path) the rule does not cover is
    an :class:`UncoveredDerivativeError`, found at trace time from JAX's own record of
    what is differentiated (``perturbed`` primals in reverse mode, symbolic-zero tangents in
    forward mode): never a silent zero, and no work on values.
    """

    def __init__(
        self, original: Callable[..., Any], deriv: Callable[..., Any], wrt: tuple[int, ...] | None,
        args: tuple, fn: Callable[..., Any], names: _Names | None = None,
    ):
        self.original, self.names, self.nargs = original, names, len(args)
        self.registered = wrt if names is None else names.registered  # as the user wrote it
        self.dynamic = [i for i, a in enumerate(args) if _is_data(a) and not _is_static_integer(a)]
        if wrt is None:
            wrt = tuple(i for i in self.dynamic if jax.tree.leaves(parameters(args[i])))
        else:  # wrt=-1 is the last argument
            wrt = tuple(i % len(args) if -len(args) <= i < 0 else i for i in wrt)
        self.position = {i: k for k, i in enumerate(self.dynamic)}
        self.covered = [self.position[i] for i in wrt if i in self.position]  # in wrt's order
        self.wrt = wrt
        # A bare Python number is a constant (never a tracer): a pullback may leave its
        # cotangent out (`scale=2.0`), never an array's.
        self.constant = {i for i in wrt if i < len(args) and _is_number(args[i])}
        self.dyn_args = tuple(args[i] for i in self.dynamic)
        if len(self.dynamic) == len(args):
            self.fn, self.deriv = fn, deriv
        else:

            def full(dyn: tuple) -> list[Any]:
                out = list(args)
                for i, value in zip(self.dynamic, dyn):
                    out[i] = value
                return out

            self.fn = lambda *dyn: fn(*full(dyn))
            self.deriv = lambda *dyn: deriv(*full(dyn))

    # -- errors

    def _name(self, i: int) -> str:
        if self.names is not None and i < len(self.names.labels):
            return self.names.labels[i]
        try:
            return list(inspect.signature(self.original).parameters)[i]
        except (TypeError, ValueError, IndexError):
            return f"args[{i}]"

    def _place(self, i: int) -> int:
        """The parameter index (as ``wrt`` counts) of flattened position ``i``."""
        if self.names is not None and 0 <= i < len(self.names.places):
            return self.names.places[i]
        return i

    def _what(self, i: int, path: str = "") -> str:
        return f"argument {self._place(i)} (`{self._name(i)}`)" + (f" at {path}" if path else "")

    def _uncovered(self, k: int, mode: str) -> UncoveredDerivativeError:
        i = self.dynamic[k]
        fn = getattr(self.original, "__name__", "f")
        registered = self.registered if self.registered is not None else tuple(map(self._place, self.wrt))
        shown = registered[0] if len(registered) == 1 else registered
        suggest = tuple(sorted({*registered, self._place(i)}))
        message = UNCOVERED_ARGUMENT.format(
            fn=fn, what=self._what(i), mode=mode, wrt=shown, suggest=suggest, name=self._name(i),
            closure="pullback" if mode == "reverse" else "differential",
        )
        return UncoveredDerivativeError(message, self._what(i))

    def _none_returned(self, k: int, path: str) -> UncoveredDerivativeError:
        i = self.dynamic[k]
        fn = getattr(self.original, "__name__", "f")
        name = self._name(i) + path
        message = UNCOVERED_KEY_PATH.format(fn=fn, what=self._what(i, path), name=name)
        return UncoveredDerivativeError(message, self._what(i, path))

    # -- reverse mode

    def with_pullback(self) -> Any:
        pullback_of_call: list[tuple[Callable[..., Any], list[list[bool]], tuple]] = []
        custom = jax.custom_vjp(_positional(self.fn))

        def fwd(*primals: Any) -> Any:
            values = jax.tree.map(lambda p: p.value, primals, is_leaf=_is_primal)
            perturbed = [
                [p.perturbed for p in jax.tree.leaves(arg, is_leaf=_is_primal)] for arg in primals
            ]
            for k, (value, flags) in enumerate(zip(values, perturbed)):
                if k not in self.covered and any(
                    f and p for f, p in zip(flags, _parameter_flags(value))
                ):
                    raise self._uncovered(k, "reverse")
            value, pb = _split(self.deriv(*values), self.fn, "pullback")
            self._check_value(value, values, "v")
            converted, residuals = _hoisted(pb, value)
            live = [
                [f and p for f, p in zip(flags, _parameter_flags(v))]
                for v, flags in zip(values, perturbed)
            ]
            pullback_of_call.append((converted, live, values))
            return value, residuals

        def bwd(residuals: Any, cotangent: Any) -> tuple:
            converted, live, values = pullback_of_call[-1]
            cotangent = jax.tree.map(_instantiate, cotangent, is_leaf=_is_symbolic_zero)
            cts = self._cotangents(converted(cotangent, *residuals))
            out: list[Any] = [None] * len(self.dyn_args)
            for i, ct in zip(self.wrt, cts):
                k = self.position.get(i)
                if k is not None:  # not a constant bound outside JAX (a string flag)
                    self._check_returned(k, ct, live[k])
                    self._check_type(k, ct, values[k])
                    out[k] = ct
            return tuple(out)

        custom.defvjp(fwd, bwd, symbolic_zeros=True)
        return custom(*self.dyn_args)

    def _cotangents(self, returned: Any) -> tuple:
        """The pullback's result as one cotangent per ``wrt`` argument.

        One covered argument: the result is its cotangent (or a 1-tuple of it). More: a
        tuple in ``wrt``'s order, where only bare Python numbers (constants) may be left
        out; a single array is never split into cotangents.
        """
        n = len(self.wrt)
        if n <= 1:
            one = isinstance(returned, tuple) and len(returned) == 1
            return returned if one else (returned,)
        cts = tuple(returned) if isinstance(returned, (tuple, list)) else (returned,)
        missing = [i for i in self.wrt[len(cts):] if i not in self.constant]
        if missing or len(cts) > n:
            raise TypeError(self._count_error(returned, cts, missing))
        return cts + (None,) * (n - len(cts))

    def _too_many(self, cts: tuple) -> str:
        """:data:`PULLBACK_TOO_MANY`: more cotangents than covered arguments, naming the
        parameters left at their defaults (with ``wrt`` left out they are not covered) and
        the explicit ``wrt`` over every parameter that works for every call."""
        fn = getattr(self.original, "__name__", "f")
        names = [self._name(i) for i in self.wrt]
        wrt = tuple(map(self._place, self.wrt))
        signature = _signature(self.original)
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        params = [] if signature is None else list(signature.parameters.values())
        passed = {self._name(i) for i in range(self.nargs)}
        defaulted = [p.name for p in params if p.kind not in variadic and p.default is not p.empty
                     and p.name not in passed] if self.registered is None else []
        extra = len(cts) - len(self.wrt)
        wrong = ", ".join([*(f"<ct of {n}>" for n in names), f"<{extra} more>"])
        right = f"return y, lambda v: ({', '.join(f'<ct of {n}>' for n in names)})"
        if not defaulted:
            return PULLBACK_TOO_MANY.format(
                fn=fn, got=len(cts), count=len(wrt), wrt=wrt, names=", ".join(names), extra=extra,
                defaulted="", wrong=wrong, right=right,
                other=f"@ft.derivative(of={fn}, wrt=...)   # cover the arguments the others are for",
            )
        every = tuple(i for i, p in enumerate(params) if p.kind not in variadic)
        shown = ", ".join(f"`{n}`" for n in defaulted)
        note = LEFT_AT_DEFAULT.format(names=shown, verb="was" if len(defaulted) == 1 else "were",
                                      its="its" if len(defaulted) == 1 else "their")
        passing = ", ".join(f"{n}=..." for n in defaulted)
        return PULLBACK_TOO_MANY.format(
            fn=fn, got=len(cts), count=len(wrt), wrt=wrt, names=", ".join(names), extra=extra,
            defaulted=note, wrong=wrong, right=f"@ft.derivative(of={fn}, wrt={every})",
            other=f"{fn}(..., {passing})   # pass {shown} at every call",
        )

    def _count_error(self, returned: Any, cts: tuple, missing: list[int]) -> str:
        fn = getattr(self.original, "__name__", "f")
        if not missing and len(cts) > len(self.wrt):
            return self._too_many(cts)
        if isinstance(returned, (tuple, list)):
            got = f"a tuple of {len(cts)} cotangent(s)"
        else:
            got = "one value, not a tuple"
        names = [self._name(i) for i in self.wrt]
        shown = ", ".join(f"{self._what(i)}" for i in missing)  # some (too many: _too_many)
        wrong = ", ".join(f"<ct of {n}>" for n in names[: len(cts)])
        wrong = f"({wrong},)" if isinstance(returned, (tuple, list)) and len(cts) == 1 else (
            f"({wrong})" if isinstance(returned, (tuple, list)) else wrong)
        right = ", ".join(f"<ct of {n}>" for n in names)
        wrt = tuple(map(self._place, self.wrt))
        fewer = wrt[0] if len(wrt) else 0
        return PULLBACK_COUNT.format(
            fn=fn, got=got, count=len(wrt), wrt=wrt, names=", ".join(names),
            missing=shown, wrong=wrong, right=right, fewer=fewer,
        )

    def _check_returned(self, k: int, ct: Any, live: list[bool]) -> None:
        """A pullback's ``None`` where a parameter is differentiated is an error."""
        if not any(live):
            return
        if ct is None:
            raise self._none_returned(k, "")
        with_paths, _ = jax.tree_util.tree_flatten_with_path(ct, is_leaf=is_none)
        if len(with_paths) != len(live):
            return  # another structure: JAX's own check names the mismatch
        for (path, leaf), differentiated in zip(with_paths, live):
            if leaf is None and differentiated:
                raise self._none_returned(k, jax.tree_util.keystr(path))

    def _check_type(self, k: int, ct: Any, primal: Any) -> None:
        """The cotangent has the primal's structure (None standing for a zero subtree), and
        each array the primal's shape and, for a float primal, its dtype: JAX accepts a
        cotangent of another float dtype and returns the gradient in it (a float16
        gradient of a float32 parameter), and names a wrong structure or shape by JAX's
        positions only (traced once: no per-call cost)."""
        if ct is None:
            return
        fn = getattr(self.original, "__name__", "f")
        name = self._name(self.dynamic[k])
        given = dict(_keyed_leaves(ct, is_leaf=is_none))
        expected = dict(_keyed_leaves(primal))
        problem = _structure_problem(given, expected)
        if problem is not None:
            problem, wrong, right = problem
            raise TypeError(COTANGENT_STRUCTURE.format(
                fn=fn, what=self._what(self.dynamic[k]), problem=problem, name=name, wrong=wrong, right=right))
        for path, c in given.items():
            if c is None:
                continue
            shape, dtype = _shape_dtype(expected[path])
            c_shape, c_dtype = _shape_dtype(c)
            float_primal = jnp.issubdtype(dtype, jnp.inexact)
            if c_shape == shape and (c_dtype == dtype or not float_primal):
                continue
            template = COTANGENT_SHAPE if c_shape != shape else COTANGENT_DTYPE
            raise TypeError(template.format(
                fn=fn, what=self._what(self.dynamic[k], path), name=name + path,
                given=_type_str(c_shape, c_dtype), expected=_type_str(shape, dtype),
                given_dtype=np.dtype(c_dtype).name,
            ))

    def _check_value(self, value: Any, args: tuple, v: str) -> None:
        """:data:`RULE_VALUE` when the rule's value is not of the structure, shapes and
        dtypes of ``fn``'s own result (read by ``jax.eval_shape``): JAX checks this only where
        it traced ``fn`` too (under ``jax.jit``, in its own words) and otherwise takes the
        rule's value as the result (``jnp.sum(sq(x) * w)`` of a rule returning ``sum(x ** 2)``
        gave another loss and gradient). At trace time: no per-call cost."""
        try:
            expected = jax.eval_shape(self.fn, *args)
        except Exception:  # fn cannot be traced abstractly: nothing to compare (JAX speaks)
            return
        given_leaves, given_tree = jax.tree_util.tree_flatten_with_path(value)
        expected_leaves, expected_tree = jax.tree_util.tree_flatten_with_path(expected)
        fn = getattr(self.original, "__name__", "f")

        def shown(tree: Any) -> str:  # float32[3], or the tree of them: (float32[3], int32[])
            if jax.tree_util.treedef_is_leaf(jax.tree.structure(tree)):
                return _type_str(*_shape_dtype(tree))
            return str(jax.tree.map(lambda x: _type_str(*_shape_dtype(x)), tree)).replace("'", "")

        if given_tree != expected_tree:
            raise TypeError(RULE_VALUE.format(fn=fn, given=shown(value), expected=shown(expected), where="", v=v))
        for (path, g), (_, e) in zip(given_leaves, expected_leaves):
            if _shape_dtype(g) != _shape_dtype(e):
                where = f" at {jax.tree_util.keystr(path)}" if path else ""
                raise TypeError(RULE_VALUE.format(fn=fn, given=_type_str(*_shape_dtype(g)),
                                                  expected=_type_str(*_shape_dtype(e)), where=where, v=v))

    # -- forward mode

    def with_differential(self) -> Any:
        custom = jax.custom_jvp(_positional(self.fn))

        def jvp(primals: tuple, tangents: tuple) -> tuple:
            for k, (primal, tangent) in enumerate(zip(primals, tangents)):
                if k not in self.covered and any(
                    p and not _is_symbolic_zero(t)
                    for p, t in zip(
                        _parameter_flags(primal), jax.tree.leaves(tangent, is_leaf=_is_symbolic_zero)
                    )
                ):
                    raise self._uncovered(k, "forward")
            value, df = _split(self.deriv(*primals), self.fn, "differential")
            self._check_value(value, primals, "t")
            chosen = [
                _tangent_view(primals[k], jax.tree.map(_instantiate, tangents[k], is_leaf=_is_symbolic_zero))
                for k in self.covered
            ]
            return value, _filled_tangent(value, df(*chosen))

        custom.defjvp(jvp, symbolic_zeros=True)
        return custom(*self.dyn_args)


def _filled_tangent(value: Any, tangent: Any) -> Any:
    """The differential's result with ``None`` as JAX's zeros: float0 at an integer or bool
    output (an argmax: no tangent), zeros at a float one (the reverse rule's ``None``).
    A result of another structure is returned as is, for JAX's own error."""
    def fill(y: Any, t: Any) -> Any:
        if t is not None:
            return t
        if isinstance(y, float) or is_parameter_leaf(y):
            return jnp.zeros(jnp.shape(y), jnp.result_type(y))
        return np.zeros(jnp.shape(y), jax.dtypes.float0)

    try:
        return jax.tree.map(fill, value, tangent)
    except (ValueError, TypeError):
        return tangent


def _tangent_view(primal: Any, tangent: Any) -> Any:
    """JAX's tangent for an argument, reduced to its parameter view (None elsewhere)."""
    view = parameters(primal)
    return jax.tree.map(lambda p, t: None if p is None else t, view, tangent, is_leaf=is_none)


NOT_A_CONTEXT_MANAGER = """\
ft.without_derivative takes a value (Swift's withoutDerivative(at:)) and returns it with a \
zero derivative; it is not a context manager (torch's `with torch.no_grad():`). Nothing is \
recorded outside ft.gradient, so evaluation code needs nothing; inside a differentiated \
function, mark the value itself:

    wrong:  with ft.without_derivative(): y = model(x)
    right:  y = model(x)                               # outside ft.gradient: nothing is recorded
       or:  y = ft.without_derivative(model(x))        # inside a differentiated function: a constant
       or:  y = jax.lax.stop_gradient(model(x))        # the same, in JAX's words"""

FUNCTION_GIVEN = """\
ft.without_derivative({name}) got a function: it takes a value, and a function has no \
derivative to remove, so {name} would come back unchanged and its results would still be \
differentiated (torch's `@torch.no_grad()` decorator habit). Mark what it returns:

    wrong:  @ft.without_derivative
            def {name}(...): ...
    right:  y = ft.without_derivative({name}(x))
       or:  {name}_constant = lambda *args: ft.without_derivative({name}(*args))"""


def without_derivative(at: Any = _MISSING) -> Any:
    """Swift's ``withoutDerivative(at:)``: ``at`` unchanged, with a zero derivative.

    Marks an intentional zero derivative, so the differentiation diagnostics stay quiet.
    ``at`` is a value (an array, a model, any pytree): called with nothing (torch's
    ``with torch.no_grad():``) it raises :data:`NOT_A_CONTEXT_MANAGER`, and given a plain
    function (torch's ``@torch.no_grad()``; the function would come back unchanged, its
    results still differentiated) :data:`FUNCTION_GIVEN`.

    Example:
      >>> import functree as ft
      >>> ft.gradient(lambda x: x * ft.without_derivative(at=x), at=3.0)
      Array(3., dtype=float32, weak_type=True)
    """
    if at is _MISSING:
        raise TypeError(NOT_A_CONTEXT_MANAGER)
    if callable(at) and not is_parameter_leaf(at) and jax.tree.leaves(at) == [at]:  # a function, not a model
        raise TypeError(FUNCTION_GIVEN.format(name=getattr(at, "__name__", "f").replace("<lambda>", "f")))
    # The named scope marks the stop_gradient in the jaxpr as intentional; a constant (no
    # tracer, so no equation) is reported to the analysis directly.
    with jax.named_scope(SCOPE):
        out = jax.tree.map(lambda x: jax.lax.stop_gradient(x) if is_parameter_leaf(x) else x, at)
    _diagnostics.note_without_derivative(out)
    return out


_RECOMPUTATION_USAGE = (
    "ft.with_recomputation_in_pullbacks(f, policy={given!r})",
    'ft.with_recomputation_in_pullbacks(f, policy="dots_with_no_batch_dims_saveable")\n'
    "       or:  ft.with_recomputation_in_pullbacks(f)   # save nothing: recompute all of f",
)


NOT_A_FUNCTION_TO_RECOMPUTE = """\
ft.with_recomputation_in_pullbacks takes the function to recompute first, got {given}: a \
policy is the keyword policy= (jax.checkpoint's order: the function, then the policy).

    wrong:  ft.with_recomputation_in_pullbacks({given})
    right:  ft.with_recomputation_in_pullbacks(f, policy={given})
       or:  @ft.with_recomputation_in_pullbacks(policy={given})   # over def f"""


def _policy_text(f: Any) -> str | None:
    """How ``f`` is written when it is a policy given where the function goes (a name, a flag,
    one of ``jax.checkpoint_policies``), else None."""
    if isinstance(f, (str, bool)) or f is None:
        return repr(f)
    named = [n for n in policy_names() if getattr(jax.checkpoint_policies, n) is f]
    return f"jax.checkpoint_policies.{named[0]}" if named else None


def with_recomputation_in_pullbacks(
    f: Callable[..., Any] = _MISSING, policy: Callable[..., Any] | str | bool | None = None
) -> Callable[..., Any]:
    """Checkpointing: ``f`` whose pullback recomputes its intermediate values.

    Without ``f`` it is a decorator (``@ft.with_recomputation_in_pullbacks(policy=...)``); a
    policy where ``f`` goes is :data:`NOT_A_FUNCTION_TO_RECOMPUTE`.

    ``policy`` chooses what may be saved instead: ``None`` or ``True`` (nothing but the
    inputs), the name of a policy in ``jax.checkpoint_policies``
    (``"dots_with_no_batch_dims_saveable"``; a factory such as ``save_only_these_names`` is
    called first: ``jax.checkpoint_policies.save_only_these_names("a")``) or a policy
    function; anything else is an error listing the names. ``False`` is off: ``f`` itself.

    Arguments that are not arrays (a string flag, a callable) and Python ints and bools
    (an axis) are constants of the call, positional or keyword, as ``jax.checkpoint``'s
    ``static_argnums`` would make them.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> f = ft.with_recomputation_in_pullbacks(lambda x: jnp.sin(jnp.sin(x)))
      >>> round(float(ft.gradient(f, at=0.5)), 4)
      0.7786
    """
    given = _policy_text(f)
    if given is not None:  # a policy first (jax.checkpoint takes the function first too)
        raise TypeError(NOT_A_FUNCTION_TO_RECOMPUTE.format(given=given))
    checked = remat_policy(policy, arg="policy", usage=_RECOMPUTATION_USAGE)
    if f is _MISSING:  # @ft.with_recomputation_in_pullbacks(policy=...): the policy checked now
        return functools.partial(with_recomputation_in_pullbacks, policy=policy)
    if checked is False:
        return f
    policy = jax_policy(checked)
    whole = jax.checkpoint(f, policy=policy)  # pyright: ignore[reportArgumentType]

    @functools.wraps(f)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if _collecting():  # layers in f may record state (BatchNorm in training mode)
            return _collecting_call(f, policy, args, kwargs)
        if all(is_dynamic(a) for a in args) and all(is_dynamic(v) for v in kwargs.values()):
            return whole(*args, **kwargs)  # the common case: every argument is data
        return _with_constants(f, policy, args, kwargs)

    return recomputed


def is_dynamic(x: Any) -> bool:
    """Whether ``x`` is data JAX traces: arrays and numbers, but not a Python int or bool
    (an axis, a flag) nor a non-array (a string), which are a call's constants."""
    return _is_data(x) and not _is_static_integer(x)


class StateCollection(NamedTuple):
    """What ``functree.nn``'s layer-state collector gives recomputation (registered by
    ``functree/nn/_remat.py`` when it is imported: the core imports no subpackage)."""

    collecting: Callable[[], bool]  # whether ft.nn.collect_state is collecting now
    call_collecting: Callable[..., Any]  # a call whose recorded state is returned with its key paths
    record_in: Callable[..., None]  # that state filed under an argument's key paths


_STATE_COLLECTION: list[StateCollection] = []  # empty until functree.nn is imported


def register_state_collection(collection: StateCollection) -> None:
    """Give recomputation ``functree.nn``'s layer-state collector (once, at its import)."""
    _STATE_COLLECTION[:] = [collection]


def _collecting() -> bool:
    """Whether ``ft.nn.collect_state`` is collecting layer state now (``Optimizer.step``,
    ``ft.train``, ``value_with_gradient_and_state`` on a model with layer state)."""
    return bool(_STATE_COLLECTION) and _STATE_COLLECTION[0].collecting()


def _collecting_call(f: Callable[..., Any], policy: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``f(*args, **kwargs)`` checkpointed while layer state is collected. ``jax.checkpoint``
    calls ``f`` on rebuilt arguments, new objects the collector does not know, so the state
    their layers record (BatchNorm's running statistics) is collected inside the checkpoint,
    against the arguments, and filed under the key paths of the layers given, as
    ``ft.nn.Remat`` does: the statistics of the layers not recomputed."""
    call_collecting, record_in = _STATE_COLLECTION[0].call_collecting, _STATE_COLLECTION[0].record_in

    paths: list[Any] = []
    dyn, rebuilt = _split_dynamic(args, kwargs)

    def inner(*dyn: Any) -> Any:
        return call_collecting(lambda given: f(*given[0], **given[1]), rebuilt(dyn), paths)

    out, values = jax.checkpoint(inner, policy=policy)(*dyn)  # pyright: ignore[reportArgumentType]
    by_argument: dict[tuple[int, Any], tuple[list[Any], list[Any]]] = {}
    for path, value in zip(paths, values):  # path: (args or kwargs, position or name, *inside)
        where, name, *inside = tuple(path)
        owned = by_argument.setdefault((where.key, name.key), ([], []))
        owned[0].append(type(path)(tuple(inside)))
        owned[1].append(value)
    for (where, name), (inside, recorded) in by_argument.items():
        record_in(args[name] if where == 0 else kwargs[name], inside, recorded)
    return out


def _with_constants(f: Callable[..., Any], policy: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``f(*args, **kwargs)`` checkpointed with its non-data arguments bound as constants."""
    dyn, rebuilt = _split_dynamic(args, kwargs)

    def inner(*dyn: Any) -> Any:
        full, kw = rebuilt(dyn)
        return f(*full, **kw)

    return jax.checkpoint(inner, policy=policy)(*dyn)  # pyright: ignore[reportArgumentType]


def _split_dynamic(args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], Callable[[Any], tuple[tuple, dict]]]:
    """The data arguments (positional, then keyword: what ``jax.checkpoint`` traces) and a
    function rebuilding ``(args, kwargs)`` from new values of them, the others bound as they are."""
    dyn_pos = [i for i, a in enumerate(args) if is_dynamic(a)]
    dyn_kw = [k for k, v in kwargs.items() if is_dynamic(v)]

    def rebuilt(dyn: Any) -> tuple[tuple, dict]:
        full = list(args)
        for i, value in zip(dyn_pos, dyn):
            full[i] = value
        kw = dict(kwargs)
        kw.update(zip(dyn_kw, dyn[len(dyn_pos):]))
        return tuple(full), kw

    return [args[i] for i in dyn_pos] + [kwargs[k] for k in dyn_kw], rebuilt
