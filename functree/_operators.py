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
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from functree import _activity, _diagnostics
from functree import _compat as compat
from functree._naming import broadcast
from functree._operator_habits import aux_pair, check_function, named_keywords
from functree._parameters import first_difference, is_parameter_leaf, parameters
from functree._plan import Plan
from functree._plan import fn_name as _fn_name
from functree._tangent import Advice, check_tangent, matched_dtypes
from functree._tree import is_none

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

    wrong:  {op}(f, at=x)                  # f returns shape {shape}
    right:  {op}(lambda x: f(x).sum(), at=x)
       or:  value, pb = ft.value_with_pullback(f, at=x)   # then pb(cotangent)
       or:  ft.jacobian(f, at=x)
"""

REVERSE_ONLY = """\
ft.{op}: {fn} calls a function whose custom derivative is reverse-mode only \
(@ft.derivative(of=f) returning (value, pullback)); forward mode cannot use a pullback.

    right:  @ft.derivative(of=f, mode="forward")   # register (value, differential) instead
       or:  use a reverse-mode operator: ft.gradient, ft.pullback, ft.jacobian(f, mode="reverse")
"""

HESSIAN_REVERSE_ONLY = """\
ft.hessian: {fn} calls a function whose custom derivative is reverse-mode only \
(@ft.derivative(of=f) returning (value, pullback)), and the Hessian's forward pass reached \
it outside a pullback. The Hessian is forward over reverse: it differentiates the rule's \
own code in forward mode, and a rule whose value (or pullback) calls a reverse-only \
function, such as f itself, hands forward mode a pullback again.

    wrong:  return cube(x), lambda v: 3.0 * x * x * v     # the value from the decorated function
    right:  return x * x * x, lambda v: 3.0 * x * x * v   # the value computed directly
       or:  @ft.derivative(of=f, mode="forward")   # register (value, differential) too
"""

SCALAR_ARGUMENT = """\
ft.derivative takes a scalar floating argument, got shape {shape} dtype {dtype} \
(argument {index}). For arrays use ft.gradient, ft.jacobian or ft.differential:

    wrong:  ft.derivative(f, at=jnp.ones(3))
    right:  ft.jacobian(f, at=jnp.ones(3), mode="forward")
"""

BAD_JACOBIAN_MODE = """\
mode is 'reverse' or 'forward', got {mode!r}.

    right:  ft.jacobian(f, at=x, mode="forward")   # columns from differentials
"""


class _Mode(threading.local):
    forward: int = 0  # how many forward-mode operators are tracing (nested calls count)


_MODE = _Mode()


def _jax_flag() -> Any:
    """A ``jax.make_user_context`` flag: part of the keys of JAX's trace caches.

    The mode changes the program traced (a function registered with both rules is a
    ``custom_jvp`` in forward mode, a ``custom_vjp`` otherwise), so ``jax.jit`` and the
    control-flow primitives must not reuse a trace of the other mode. ``None`` on a JAX
    without it (the thread-local count still decides; a cache could then reuse the other
    mode's trace).
    """
    make = getattr(jax, "make_user_context", None)
    return None if make is None else make(default_value=False)


_FLAG = _jax_flag()


@contextlib.contextmanager
def _forward_mode() -> Iterator[None]:
    """While a forward-mode operator traces: functions registered with both a reverse and a
    forward rule use the forward one (JAX's forward mode cannot use a pullback)."""
    _MODE.forward += 1
    try:
        with _FLAG(True) if _FLAG is not None else contextlib.nullcontext():
            yield
    finally:
        _MODE.forward -= 1


def in_forward_mode() -> bool:
    """Whether a forward-mode operator (differential, jacobian(mode="forward"), derivative,
    hessian) is tracing on this thread."""
    return _MODE.forward > 0


_DIFFERENTIAL = Advice(
    effect="the differential takes no tangent there.",
    wrong="df(jax.tree.map(jnp.ones_like, model))   # a value at every leaf",
    right="df(jax.tree.map(jnp.ones_like, ft.zero_tangent_vector(model)))   # None at non-parameters",
)


# The right code for a tangent with values outside wrt= patterns: None there (ft.select's
# False; a stacked leaf partly selected is whole in the view, its mask an array).
_OUTSIDE = ("df(jax.tree.map(lambda t, keep: None if keep is False else jnp.where(jnp.reshape(keep, jnp.shape(keep) "
            "+ (1,) * (t.ndim - jnp.ndim(keep))), t, 0), tangent, ft.select(model, {patterns})))")


_PULLBACK = Advice(
    effect="the pullback takes no cotangent there (its derivative is not taken).",
    wrong="pb(jax.tree.map(jnp.ones_like, y))   # y holds a no_derivative field",
    right="pb(jax.tree.map(jnp.ones_like, ft.parameters(y)))   # None at non-parameters",
)


def _zeros_for(y: Any) -> Any:
    """JAX's zero cotangent for a result leaf: float0 zeros for an integer or bool one."""
    if isinstance(y, float) or is_parameter_leaf(y):
        return jnp.zeros(jnp.shape(y), jnp.result_type(y))
    return np.zeros(jnp.shape(y), jax.dtypes.float0)


COTANGENT_STRUCTURE = """\
{what}: the cotangent's structure is not the result's: they differ first at {path}, where \
the result has {expected} and the cotangent {given}. A cotangent has the structure of the \
result's parameter view: None stands for one leaf (a non-parameter, or a zero cotangent), \
never for a subtree.

    wrong:  pb(cotangent)   # at {path}: {given}
    right:  pb(jax.tree.map(jnp.ones_like, ft.parameters(y)))   # y = f(x), the result; then your values
"""


def _result_cotangent(what: str, value: Any, cotangent: Any) -> Any:
    """The cotangent JAX's pullback takes, from one shaped like the result's parameter view.

    A cotangent is a tangent of the result: a value at one of its non-parameters is refused
    like any tangent's (:func:`ft.check_tangent`); ``None`` there becomes JAX's zero, and
    stays ``None`` where the result itself holds ``None`` (an empty subtree to JAX). Another
    structure (a list for a tuple, a missing key or item) is :data:`COTANGENT_STRUCTURE`,
    naming the key path; JAX's own error named a position in functree's wrapper. A
    Python number is cast to its result leaf's dtype; an array of another dtype is refused
    (:func:`matched_dtypes`).
    """
    check_tangent(what, cotangent, value, advice=_PULLBACK, allow_float0=True)
    filled = _zero_at_none(cotangent, value)
    if filled is None:
        _refuse_structure(what, value, cotangent)
        filled = cotangent  # (JAX's own check then speaks)
    return matched_dtypes(what, "cotangent", filled, value)


def _zero_at_none(tangent: Any, like: Any) -> Any:
    """``tangent`` as JAX's linearized or transposed function takes it: ``None`` at a leaf
    of ``like`` (a result or a parameter view) is its zero, and stays ``None`` where ``like``
    holds ``None`` (an empty subtree to JAX). ``None`` when the structures differ with
    ``None`` counted as a leaf (the caller names the key path)."""
    if jax.tree.structure(tangent) == jax.tree.structure(like):
        return tangent
    t_leaves, t_def = jax.tree.flatten(tangent, is_leaf=is_none)
    l_leaves, l_def = jax.tree.flatten(like, is_leaf=is_none)
    if t_def != l_def:
        return None
    return l_def.unflatten([None if y is None else _zeros_for(y) if t is None else t for t, y in zip(t_leaves, l_leaves)])


def _refuse_structure(what: str, value: Any, cotangent: Any) -> None:
    """:data:`COTANGENT_STRUCTURE` at the first key path where ``cotangent``'s structure
    leaves the result's (``None`` counting as a leaf); nothing where none is found (JAX's
    own check then speaks)."""
    try:  # (an error message's helper: never a second error in JAX's place)
        diff = first_difference(value, cotangent, none_is_leaf=True)
        if diff is None:
            return
        path = diff[0]
        expected, given = _node_text(path.get(value)), _node_text(path.get(cotangent))
    except Exception:
        return
    raise ValueError(COTANGENT_STRUCTURE.format(what=what, path=str(path) or "<root>", expected=expected,
                                                given=given))


def _node_text(x: Any) -> str:
    """How :data:`COTANGENT_STRUCTURE` shows one node: a tuple of 2 items, a dict with keys
    ['a', 'b'], a Net, None, an array."""
    if x is None:
        return "None"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} item(s)"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if jax.tree.leaves(x, is_leaf=lambda y: y is not x) == [x]:
        return "an array" if hasattr(x, "shape") else f"a {type(x).__name__}"
    return f"a {type(x).__name__}"


def _calls_reverse_only(g: Callable[..., Any], primals: Sequence[Any]) -> bool:
    """Whether ``g``'s program calls a reverse-only custom derivative on a value that
    depends on the primals (read from its jaxpr): what forward mode cannot differentiate.

    A ``custom_vjp`` call (what ``@ft.derivative(of=f)`` registers) anywhere in the
    program, nested calls and control flow included, except inside a ``custom_jvp`` call
    (forward mode uses that rule, not its body). One applied to data alone (the batch, a
    closure's constant) carries no tangent, as JAX's forward mode runs it. Never raises: a
    program that cannot be traced reports ``False``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the failed operator's own trace warned already
            closed = jax.make_jaxpr(g)(*primals)
    except Exception:
        return False
    return _has_reverse_only(closed.jaxpr)


def _has_reverse_only(jaxpr: Any, active: Sequence[bool] | None = None) -> bool:
    """Whether ``jaxpr`` calls a ``custom_vjp`` on a value depending on its inputs marked
    ``active`` (every input by default)."""
    return _reverse_only_in(jaxpr, [True] * len(jaxpr.invars) if active is None else list(active))[0]


def _reverse_only_in(jaxpr: Any, active: list[bool]) -> tuple[bool, list[bool]]:
    """``(found, outputs)``: whether a reverse-only call takes a value depending on the
    ``active`` inputs, and which outputs depend on them (forward, through every equation;
    control flow's carries to a fixed point; an equation of another form counts every
    output of an active one as active and searches its jaxprs with all inputs active)."""
    from jax.extend import core as jcore
    live = {v for v, a in zip(jaxpr.invars, active) if a}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, jcore.Literal) and v in live for v in eqn.invars]
        if not any(ins):
            continue
        name = eqn.primitive.name
        if name.startswith("custom_vjp_call"):
            return True, []
        if name.startswith("custom_jvp_call"):  # forward mode takes its rule, not its body
            outs = [True] * len(eqn.outvars)
        else:
            found, outs = _reverse_only_eqn(eqn, ins)
            if found:
                return True, []
        live.update(v for v, a in zip(eqn.outvars, outs) if a)
    return False, [not isinstance(v, jcore.Literal) and v in live for v in jaxpr.outvars]


def _reverse_only_eqn(eqn: Any, ins: list[bool]) -> tuple[bool, list[bool]]:
    """:func:`_reverse_only_in` of one equation with inner jaxprs (a call, cond, while, scan)."""
    name, p = eqn.primitive.name, eqn.params
    try:
        body = compat.body_of_call(eqn)
        if body is not None:
            return _reverse_only_in(body[0], ins)
        if name == "cond":
            results = [_reverse_only_in(compat.open_jaxpr(b)[0], ins[1:]) for b in p["branches"]]
            if any(found for found, _ in results):
                return True, []
            return False, [any(column) for column in zip(*(outs for _, outs in results))]
        if name == "while":
            nc, nb = compat.while_counts(p)
            body_jaxpr = compat.open_jaxpr(p["body_jaxpr"])[0]
            found, carry = _carried(lambda c: _reverse_only_in(body_jaxpr, [*ins[nc:nc + nb], *c]), ins[nc + nb:])
            return found or _reverse_only_in(compat.open_jaxpr(p["cond_jaxpr"])[0], [*ins[:nc], *carry])[0], carry
        if name == "scan":
            nconst, ncarry = compat.scan_counts(p)
            body_jaxpr = compat.open_jaxpr(p["jaxpr"])[0]
            consts, xs = ins[:nconst], ins[nconst + ncarry:]
            found, carry = _carried(lambda c: _reverse_only_in(body_jaxpr, [*consts, *c, *xs]),
                                    ins[nconst:nconst + ncarry])
            if found:
                return True, []
            return _reverse_only_in(body_jaxpr, [*consts, *carry, *xs])  # the carries and ys
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # an unfamiliar form: the conservative rule below
    subs = compat.sub_jaxprs(p)
    return any(_has_reverse_only(j) for j in subs), [True] * len(eqn.outvars)


def _carried(step: Callable[[list[bool]], tuple[bool, list[bool]]], carry: list[bool]) -> tuple[bool, list[bool]]:
    """A loop's carries that depend on the active inputs (the least fixed point of ``step``,
    whose outputs begin with the new carries), or ``found`` as soon as a step finds a call."""
    while True:
        found, outs = step(carry)
        if found:
            return True, carry
        new = [a or b for a, b in zip(carry, outs)]
        if new == carry:
            return False, carry
        carry = new


def _refuse_reverse_only(op: str, fn: Callable[..., Any], g: Callable[..., Any], primals: Sequence[Any]) -> None:
    """Under a transformation (``jax.jit``), raise :data:`REVERSE_ONLY` at trace time.

    There JAX stages the forward-mode call of a reverse-only rule and fails only when the
    outer program is processed, outside functree (its explanation lost). A traced point is
    traced once per compilation; eager calls skip this (JAX fails inside the operator, and
    :func:`_explain_reverse_only` explains it).
    """
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(primals)):
        return
    shapes = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(primals)]
    abstract = jax.tree.unflatten(jax.tree.structure(primals), shapes)
    if _calls_reverse_only(g, abstract):
        raise TypeError(REVERSE_ONLY.format(op=op, fn=_fn_name(fn)))


@contextlib.contextmanager
def _explain_reverse_only(
    op: str, fn: Callable[..., Any], g: Callable[..., Any], primals: Sequence[Any], message: str = REVERSE_ONLY,
) -> Iterator[None]:
    """Explain a forward-mode failure caused by a reverse-only custom derivative.

    Costs nothing when forward mode succeeds. When JAX raises a ``TypeError``, the program
    of ``g`` is inspected (not the error's text): if it calls a reverse-only rule, that is
    the cause and :data:`REVERSE_ONLY` says how to fix it; otherwise JAX's error propagates.
    """
    try:
        yield
    except TypeError as e:
        if not _calls_reverse_only(g, primals):
            raise
        raise TypeError(message.format(op=op, fn=_fn_name(fn))) from e


CALLBACK_NOT_DIFFERENTIABLE = """\
ft.{op}: {fn} passes {count} differentiated parameter(s) to a host callback, which JAX \
cannot differentiate (`{primitive}` at {where}):
{names}
Give the callback's function a derivative, or pass the callback values that are not \
differentiated:

    wrong:  y = jax.pure_callback(host_fn, shape, x)
    right:  y = jax.pure_callback(host_fn, shape, ft.without_derivative(at=x))   # not trained through it
       or:  on_host = ft.derivative(of=on_host)(rule)   # on_host(x) calls the callback; rule(x) returns (y, pullback)
"""

WHILE_NOT_REVERSE = """\
ft.{op}: {fn} carries {count} differentiated parameter(s) through a jax.lax.while_loop \
(at {where}), which reverse mode cannot differentiate (its number of steps is unknown \
until it runs):
{names}
Loop a known number of times, or take the derivative in forward mode:

    wrong:  jax.lax.while_loop(cond, body, carry)
    right:  jax.lax.scan(lambda c, _: (body(c), None), carry, length=n)[0]   # or fori_loop(0, n, ...) with a Python n
       or:  ft.differential(f, at=x)   # forward mode runs a while loop
"""

# (what JAX's ValueError says, the primitives that cause it, the explanation)
_REFUSALS = (
    ("callbacks do not support JVP", _activity.CALLBACKS, CALLBACK_NOT_DIFFERENTIABLE),
    ("does not work for lax.while_loop", _activity.WHILE_LOOPS, WHILE_NOT_REVERSE),
)


@contextlib.contextmanager
def _explain_refusal(op: str, fn: Callable[..., Any], g: Callable[..., Any], plan: Plan) -> Iterator[None]:
    """Explain JAX's refusal to differentiate a host callback ("Pure callbacks do not
    support JVP") or, in reverse mode, a while loop, by the key paths that reach it and
    where it is (:data:`CALLBACK_NOT_DIFFERENTIABLE`, :data:`WHILE_NOT_REVERSE`), read from
    ``g``'s program; any other error propagates as JAX raised it. Costs nothing when
    differentiation succeeds."""
    try:
        yield
    except ValueError as e:
        for says, primitives, message in _REFUSALS:
            found = _diagnostics.reached(fn, g, plan, primitives) if says in str(e) else None
            if found is not None:
                where, names = found
                raise ValueError(message.format(
                    op=op, fn=_fn_name(fn), count=len(names), primitive=where.label.strip("`"),
                    where=f"{where.file}:{where.line}", names="\n".join(f"    {n}" for n in names),
                )) from e
        raise


RESULT_WITH_AUX = """\
{op} needs a scalar result, but {fn} returned a {kind}: {how}
    wrong:  {op}(loss_fn, at=model)              # loss_fn returns (loss, aux)
    right:  {right}
"""

# (how, right): ft.hessian has no has_aux, the loss alone is differentiated twice; a dict of
# outputs is no (loss, aux) pair: the loss is picked by its key.
_WITH_AUX = ("a loss with an aux output is\ndifferentiated with has_aux=True (the first item is the loss, the rest "
             "comes back as is):", "{op}(loss_fn, at=model, has_aux=True)")
_HESSIAN_WITH_AUX = ("ft.hessian takes no aux output:\ndifferentiate the loss alone and compute the aux apart:",
                     "ft.hessian(lambda m: loss_fn(m)[0], at=model);  aux = loss_fn(model)[1]")
_DICT_WITH_AUX = ("a dict of outputs is\nnot a loss: pick the loss by its key, and keep the dict as the aux output "
                  "(has_aux=True takes a pair):", "{op}(lambda m: (loss_fn(m)[\"loss\"], loss_fn(m)), at=model, has_aux=True)")
_HESSIAN_DICT = ("ft.hessian takes no aux output:\ndifferentiate the loss alone, picked by its key:",
                 "ft.hessian(lambda m: loss_fn(m)[\"loss\"], at=model)")


def _check_scalar(op: str, f: Callable[..., Any], has_aux: bool) -> Callable[[Any], Any]:
    paired = aux_pair(op.removeprefix("ft."), f, has_aux)

    def pack(out: Any) -> Any:
        value = paired(out)[0] if has_aux else out
        if isinstance(value, (tuple, list, dict)):  # (loss, aux) without has_aux: a crash in JAX's conversion
            hessian, named = op == "ft.hessian", isinstance(value, dict)
            how, right = (_HESSIAN_DICT if named else _HESSIAN_WITH_AUX) if hessian else (
                _DICT_WITH_AUX if named else _WITH_AUX)
            raise TypeError(RESULT_WITH_AUX.format(op=op, fn=_fn_name(f), kind=type(value).__name__, how=how,
                                                   right=right.format(op=op)))
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
    check_function(op, f, at, _MISSING)

    @functools.wraps(f)
    def derived(*args: Any, **kwargs: Any) -> Any:
        # Keyword arguments bound so that the diagnostics count their leaves as data.
        return impl(_diagnostics.bind_keywords(f, kwargs), args)

    derived.__name__ = f"{op}_of_{getattr(f, '__name__', 'f')}"
    return derived if at is _MISSING else derived(at)


@named_keywords
def value_with_gradient(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, has_aux: bool = False,
    holomorphic: bool = False,
) -> Any:
    """``(f(x), ∇f(x))``: the value and the gradient of a scalar function.

    Returns ``((value, aux), gradient)`` when ``has_aux=True``. ``holomorphic=True``: a
    complex ``f`` of complex arguments, as :func:`gradient`'s.

    Example:
      >>> import functree as ft
      >>> ft.value_with_gradient(lambda x: x * x, at=3.0)
      (Array(9., dtype=float32, weak_type=True), Array(6., dtype=float32, weak_type=True))
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _value_and_grad("value_with_gradient", fn, args, wrt, has_aux, holomorphic)

    return _operator("value_with_gradient", f, at, impl)


def _value_and_grad(
    op: str, fn: Callable[..., Any], args: tuple, wrt: Any, has_aux: bool, holomorphic: bool = False
) -> Any:
    plan = Plan(op, fn, args, wrt)
    g = plan.wrap(_check_scalar(f"ft.{op}", fn, has_aux))
    g = _diagnostics.check("gradient", fn, g, plan)  # the check's trace, replayed where it can be
    grad = jax.value_and_grad(g, argnums=plan.argnums, has_aux=has_aux, holomorphic=holomorphic)
    with _explain_refusal(op, fn, g, plan):
        return grad(*plan.primals)


@named_keywords
def gradient(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, has_aux: bool = False,
    holomorphic: bool = False,
) -> Any:
    """``∇f``: the gradient function of a scalar ``f``, or the gradient at ``at``.

    Differentiating with respect to a Module gives a tree with the parameter view's
    structure (``None`` at non-parameters).

    Complex parameters: ``ft.gradient`` returns JAX's convention, the conjugate of the
    steepest-ascent direction: for a real ``f`` of ``z = x + iy``, ``∂f/∂x − i ∂f/∂y``
    (torch's ``z.grad`` is ``∂f/∂x + i ∂f/∂y``). ``ft.optim.Optimizer`` takes these
    gradients and conjugates them itself; a hand-written step descends along
    ``jnp.conj(grad)``, and a raw optax transform (which expects torch's convention)
    needs ``jnp.conj`` too.

    ``holomorphic=True`` differentiates a complex ``f`` of complex arguments that is
    holomorphic (``z ** 2``): the result is ``f'(z)`` itself, as ``jax.grad(f,
    holomorphic=True)`` (every differentiated leaf must then be complex). A
    non-holomorphic complex result (``|z|``, ``conj(z)``) has no such derivative: take
    :func:`value_with_pullback` and pull back the cotangent you mean.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> dfdx = ft.gradient(lambda x: (x * x).sum())
      >>> dfdx(jnp.array([3.0, 1.0]))
      Array([6., 2.], dtype=float32)
      >>> ft.gradient(lambda x, y: x * y, wrt=(0, 1))(2.0, 5.0)
      (Array(5., dtype=float32, weak_type=True), Array(2., dtype=float32, weak_type=True))
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        value, grads = _value_and_grad("gradient", fn, args, wrt, has_aux, holomorphic)
        return (grads, value[1]) if has_aux else grads

    return _operator("gradient", f, at, impl)


@named_keywords
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
    plan = Plan(op, fn, args, wrt)
    g = plan.wrap(aux_pair(op, fn, has_aux))
    g = _diagnostics.check("pullback", fn, g, plan, has_aux)  # the check's trace, replayed where it can be
    with _explain_refusal(op, fn, g, plan):
        out = jax.vjp(g, *plan.primals, has_aux=has_aux)

    def pullback_fn(cotangent: Any) -> Any:
        return plan.result(out[1](_result_cotangent(f"ft.{op}", out[0], cotangent)))

    return (out[0], pullback_fn, *out[2:])  # out[2:] is (aux,) when has_aux


@named_keywords
def pullback(f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0) -> Any:
    """The pullback ``v ↦ vᵀ J_f(x)`` at ``at`` (or a function of the point giving it).

    Example (rows of a Jacobian from basis vectors, as in Swift's differentiable programming):
      >>> import functree as ft, jax.numpy as jnp
      >>> pb = ft.pullback(lambda x: jnp.stack([x[0] * x[1], x[0] + x[1]]), at=jnp.array([1.0, 2.0]))
      >>> pb(jnp.array([1.0, 0.0]))
      Array([2., 1.], dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _vjp("pullback", fn, args, wrt, False)[1]

    return _operator("pullback", f, at, impl)


@named_keywords
def value_with_differential(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, has_aux: bool = False
) -> Any:
    """``(f(x), differential)`` where ``differential(t) = J_f(x) t`` (forward mode).

    Returns ``(value, differential, aux)`` when ``has_aux=True``.

    The tangent has the parameter view's structure (``None`` at a parameter is its zero,
    as in a cotangent). With ``wrt=`` patterns it holds ``None``
    at every parameter they leave out (the structure ``ft.gradient(f, at=x, wrt=...)``
    returns), and zeros at the members of a stacked leaf they leave out (``wrt="h.2.*"``); a
    value there is an error naming its key path, as the direction would be cut to the
    selected parameters. A tangent traced under ``jax.jit`` is not read: its values at
    left-out members are dropped.

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
    plan = Plan(op, fn, args, wrt)
    g = plan.wrap(aux_pair(op, fn, has_aux))
    with _forward_mode():
        g = _diagnostics.check("differential", fn, g, plan, has_aux)  # the check's trace, replayed where it can be
        _refuse_reverse_only(op, fn, g, plan.primals)  # reads the replayed trace: no Python run again
        with _explain_reverse_only(op, fn, g, plan.primals), _explain_refusal(op, fn, g, plan):
            out = jax.linearize(g, *plan.primals, has_aux=has_aux)

    advice = _DIFFERENTIAL if plan.patterns is None else _DIFFERENTIAL._replace(outside=_OUTSIDE.format(
        patterns=", ".join(map(repr, plan.patterns))))

    def differential_fn(tangent: Any) -> Any:
        tangents = plan.split_input(tangent)
        for t, view, i in zip(tangents, plan.primals, plan.indices):
            check_tangent(f"ft.{op}", t, plan.args[i], view, advice=advice, structure=True)
        # None at a parameter is its zero, as in a cotangent (JAX's own error, "expected
        # PyTreeDef(...)", named no key path); another structure, named above, goes on as it is
        filled = [_zero_at_none(t, view) for t, view in zip(tangents, plan.primals)]
        tangents = tuple(matched_dtypes(f"ft.{op}", "tangent", t if f is None else f, view,
                                        "" if plan.single else f"[{k}]")
                         for k, (t, f, view) in enumerate(zip(tangents, filled, plan.primals)))
        _refuse_unselected_members(op, plan, tangents[0])
        with _forward_mode(), _explain_reverse_only(op, fn, g, plan.primals):  # JAX may fail here
            # The result's tangent in its parameter view (None at a no_derivative field, and
            # at an integer leaf, whose tangent is float0), as ft.move and pullbacks take it.
            return parameters(out[1](*tangents))

    return (out[0], differential_fn, *out[2:])  # out[2:] is (aux,) when has_aux


TANGENT_OUTSIDE_MEMBERS = """\
ft.{op}: the tangent at {path} has values at member(s) {members} of a stacked leaf, which \
wrt={patterns} leaves out (it selects member(s) {selected} there). The differential is \
taken along the selected members only, so that part of the direction would be dropped \
without a word.
    wrong:  df(tangent)   # {path}: nonzero at member(s) {members}
    right:  {outside}
"""


def _members_text(mask: np.ndarray) -> str:
    """The members where ``mask`` holds, as a message lists them (``[0, 2]``; of nested
    stacks, tuples of indices)."""
    where = np.argwhere(mask)
    if mask.ndim == 1:
        return str([int(i) for i in where[:, 0]])
    return str([tuple(int(i) for i in row) for row in where])


def _refuse_unselected_members(op: str, plan: Plan, tangent: Any) -> None:
    """:data:`TANGENT_OUTSIDE_MEMBERS` for a nonzero value at a stacked leaf's member that
    ``wrt=`` patterns leave out (``wrt="h.2.*"``: the leaf is whole in the view, its other
    members' derivatives zero), as a value at a parameter outside ``wrt=`` is refused; a
    traced tangent (under ``jax.jit``) is not read."""
    members = plan.members[0] if plan.members else ()
    if not any(m is not None for m in members):
        return
    for (path, t), m in zip(jax.tree_util.tree_flatten_with_path(tangent, is_leaf=is_none)[0], members):
        if m is None or t is None or isinstance(t, jax.core.Tracer):
            continue
        nonzero = np.asarray(t) != 0
        nonzero = nonzero.reshape(m.shape + (-1,)).any(axis=-1)
        outside = nonzero & ~np.asarray(broadcast(m, t)).reshape(m.shape)
        if outside.any():
            raise ValueError(TANGENT_OUTSIDE_MEMBERS.format(
                op=op, path=jax.tree_util.keystr(path), members=_members_text(outside), patterns=plan.patterns,
                selected=_members_text(m), outside=_OUTSIDE.format(patterns=", ".join(map(repr, plan.patterns or ())))))


@named_keywords
def differential(f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0) -> Any:
    """The differential ``t ↦ J_f(x) t`` at ``at`` (forward mode). Its tangent is as
    :func:`value_with_differential`'s.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> df = ft.differential(lambda x: x ** 2, at=jnp.array([1.0, 2.0]))
      >>> df(jnp.array([1.0, 1.0]))
      Array([2., 4.], dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        return _linearize("differential", fn, args, wrt, False)[1]

    return _operator("differential", f, at, impl)


@named_keywords
def derivative(f: Callable[..., Any], at: Any = _MISSING, *, wrt: int = 0) -> Any:
    """``df/dx`` for a scalar argument ``x`` (the result may have any shape), by forward mode.

    Example:
      >>> import functree as ft
      >>> ft.derivative(lambda x: x ** 2, at=3.0)
      Array(6., dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        x = args[wrt]
        if jnp.shape(x) != () or not (isinstance(x, float) or is_parameter_leaf(x)):
            raise TypeError(
                SCALAR_ARGUMENT.format(index=wrt, shape=jnp.shape(x), dtype=jnp.result_type(x))
            )
        _, df = _linearize("derivative", fn, args, wrt, False)
        return df(jnp.ones((), jnp.result_type(x)))

    return _operator("derivative", f, at, impl)


@named_keywords
def jacobian(
    f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0, mode: str = "reverse", has_aux: bool = False,
    holomorphic: bool = False,
) -> Any:
    """The Jacobian ``J_f(x)``, built from pullbacks (``mode="reverse"``) or differentials
    (``mode="forward"``) of basis vectors.

    The rows are the result's parameter view: ``None`` at a ``no_derivative`` field and at
    an integer or bool result leaf (an argmax has no derivative), in both modes.
    ``holomorphic=True``: a holomorphic complex ``f`` of complex arguments, whose Jacobian
    is ``∂f/∂z`` (as ``jax.jacrev(f, holomorphic=True)``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.jacobian(lambda x: 2.0 * x, at=jnp.ones(2))
      Array([[2., 0.],
             [0., 2.]], dtype=float32)
    """
    if mode not in ("reverse", "forward"):
        raise ValueError(BAD_JACOBIAN_MODE.format(mode=mode))
    transform = jax.jacrev if mode == "reverse" else jax.jacfwd

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        plan = Plan("jacobian", fn, args, wrt)
        forward = mode == "forward"
        # Both modes differentiate the result's parameter view: an integer or bool leaf (no
        # row) is None there. (Forward mode's float0 columns of a bool leaf crashed inside
        # jax.jacfwd: "a bytes-like object is required, not 'int'".)
        paired = aux_pair("jacobian", fn, has_aux)
        g = plan.wrap(lambda out: _result_view(has_aux)(paired(out)))
        with _forward_mode() if forward else contextlib.nullcontext():
            g = _diagnostics.check("pullback", fn, g, plan, has_aux)  # the check's trace, replayed where it can be
            if forward:
                _refuse_reverse_only("jacobian", fn, g, plan.primals)
            jac = transform(g, argnums=plan.argnums, has_aux=has_aux, holomorphic=holomorphic)
            if not forward:
                out = jac(*plan.primals)
            else:
                with _explain_reverse_only("jacobian", fn, g, plan.primals):
                    out = jac(*plan.primals)
            # In the result's parameter view, as the differential's (the result's Modules
            # hold the Jacobian's rows: a no_derivative field's are None).
            return (parameters(out[0]), *out[1:]) if has_aux else parameters(out)

    return _operator("jacobian", f, at, impl)


def _result_view(has_aux: bool) -> Callable[[Any], Any]:
    def view(out: Any) -> Any:
        return (parameters(out[0]), *out[1:]) if has_aux else parameters(out)

    return view


COMPLEX_HESSIAN = """\
ft.hessian: {fn} is differentiated at a complex parameter ({where}, {dtype}). The Hessian \
of a real function of complex parameters is not one complex matrix (it mixes ∂²/∂z∂z and \
∂²/∂z∂z̄); JAX's forward-over-reverse Hessian takes real parameters only. Differentiate \
with respect to the real and imaginary parts as real arrays:

    wrong:  ft.hessian(f, at=z)
    right:  ft.hessian(lambda re, im: f(jax.lax.complex(re, im)), wrt=(0, 1))(z.real, z.imag)
       or:  jax.hessian(f, holomorphic=True)(z)   # a holomorphic complex f
"""


def _refuse_complex(fn: Callable[..., Any], plan: Plan) -> None:
    for i, view in zip(plan.indices, plan.primals):
        for path, leaf in jax.tree_util.tree_flatten_with_path(view)[0]:
            if jnp.iscomplexobj(leaf):
                where = f"argument {i}" + (f" at {jax.tree_util.keystr(path)}" if path else "")
                raise TypeError(COMPLEX_HESSIAN.format(fn=_fn_name(fn), where=where, dtype=jnp.result_type(leaf)))


@named_keywords
def hessian(f: Callable[..., Any], at: Any = _MISSING, *, wrt: Any = 0) -> Any:
    """The Hessian ``∇²f(x)`` of a scalar function (forward-over-reverse).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.hessian(lambda x: (x ** 3).sum(), at=jnp.array([1.0, 2.0]))
      Array([[ 6.,  0.],
             [ 0., 12.]], dtype=float32)
    """

    def impl(fn: Callable[..., Any], args: tuple) -> Any:
        plan = Plan("hessian", fn, args, wrt)
        _refuse_complex(fn, plan)
        g = plan.wrap(_check_scalar("ft.hessian", fn, False))
        with _forward_mode():  # forward over reverse: a reverse-only rule cannot be used
            g = _diagnostics.check("gradient", fn, g, plan)  # the check's trace, replayed where it can be
            # Forward over a reverse-only rule works where forward mode meets only the rule's
            # code (its pullback transposed inside the reverse pass) and fails, while this call
            # traces (under jax.jit too), where the rule calls one again: explained, not
            # refused beforehand (_refuse_reverse_only would refuse every such Hessian).
            with _explain_reverse_only("hessian", fn, g, plan.primals, HESSIAN_REVERSE_ONLY):
                return jax.hessian(g, argnums=plan.argnums)(*plan.primals)

    return _operator("hessian", f, at, impl)
