"""The activity analysis of the differentiation diagnostics, on the jaxpr.

Propagates, forward through a traced program, which differentiation inputs each value
depends on and how (a :class:`State`: ``active``, ``cut``, ``quiet``, ``zeroed``, the
origins of its cuts, known zero): ``A(prim(u₁…uₙ)) = ⋃ A(uᵢ)`` for differentiable
primitives, ``∅`` for zero-derivative ones (whose inputs move to ``cut``); nested jaxprs
recursively, loop carries to the least fixed point of ``A(c) = A(c₀) ∪ A(body(c))``.
Reads JAX's equations through ``functree._compat`` only. The findings and warnings made
from its result are ``functree._diagnostics``'s.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from functree._activity import State, analyse
  >>> closed = jax.make_jaxpr(lambda x, y: jnp.round(x) + y)(1.0, 2.0)
  >>> x, y = State(1 << 1, 0, 0, 0, frozenset(), False), State(1 << 2, 0, 0, 0, frozenset(), False)
  >>> (out,) = analyse(closed.jaxpr, closed.consts, [x, y], False)
  >>> (out.active, out.cut)   # y reaches the result differentiably, x only through round
  (4, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import numpy as np

from functree import _compat as compat
from functree._source import is_user_file as _is_user_file

__all__ = [
    "EMPTY", "MARK", "SCOPE", "Op", "Origin", "State", "analyse", "is_inexact", "is_known_zero", "join_all",
    "where",
]

# Primitives with floating results whose derivative is zero (wherever it exists).
_ZERO_DERIVATIVE_FLOAT = frozenset({"floor", "ceil", "round", "sign", "nextafter"})
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
# Calls whose body is the program itself (analysed recursively, constants included).
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "named_call"}
)
# Result is zero when every floating operand is a known zero.
_ZERO_PRESERVING = frozenset(
    {
        "broadcast_in_dim", "reshape", "convert_element_type", "transpose", "squeeze",
        "expand_dims", "slice", "dynamic_slice", "gather", "neg", "copy", "copy_p",
        "reduce_sum", "rev", "concatenate", "pad", "select_n", "add", "sub", "add_any",
    }
)
# Result is zero when any operand is a known zero.
_ANNIHILATING = frozenset({"mul", "dot_general"})
SCOPE = "ft.without_derivative"
_MAX_ORIGINS = 16
_MAX_FIXED_POINT = 64
_ZERO_TEST_MAX_SIZE = 1 << 16



class Op(NamedTuple):
    """A zero-derivative operation: its description and the user's source line."""

    label: str
    file: str
    line: int


class Origin(NamedTuple):
    """Where differentiation inputs were cut: the inputs' bits and the operation."""

    bits: int
    op: Op


class State(NamedTuple):
    """What the analysis knows about one value of the program.

    Four bitmasks over the differentiation input leaves (bit ``k + 1`` is leaf ``k``): on
    which the value depends ``active``-ly, only through a ``cut`` (zero-derivative
    operation), only through ``ft.without_derivative`` (``quiet``), only through a product
    with a constant zero (``zeroed``); the ``origins`` of its cuts; and whether the value
    is a known constant zero.
    """

    active: int
    cut: int
    quiet: int
    zeroed: int
    origins: frozenset[Origin]
    is_zero: bool


MARK = 1  # bit 0 of ``quiet``: the value passed through ft.without_derivative, and nothing unstopped since
EMPTY = State(0, 0, 0, 0, frozenset(), False)
_ZERO = State(0, 0, 0, 0, frozenset(), True)


# ----------------------------------------------------------------------------- analysis


def is_inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    try:
        return dtype is not None and bool(jax.dtypes.issubdtype(dtype, np.inexact))
    except TypeError:
        return False


def is_known_zero(value: Any) -> bool:
    """``value`` is concrete (not a tracer) and every element is 0 (small arrays only)."""
    if isinstance(value, jax.core.Tracer):
        return False
    size = getattr(value, "size", 1)
    if size > _ZERO_TEST_MAX_SIZE:
        return False
    try:
        return bool(np.all(np.asarray(value) == 0))
    except Exception:
        return False


def _const_state(value: Any) -> State:
    return _ZERO if is_known_zero(value) else EMPTY


def _join(a: State, b: State) -> State:
    return State(
        a.active | b.active,
        a.cut | b.cut,
        a.quiet | b.quiet,
        a.zeroed | b.zeroed,
        a.origins | b.origins if b.origins else a.origins,
        a.is_zero and b.is_zero,
    )


def join_all(states: Sequence[State]) -> State:
    out = _ZERO
    for s in states:
        out = _join(out, s)
    if len(out.origins) > _MAX_ORIGINS:
        out = out._replace(origins=frozenset(sorted(out.origins, key=repr)[:_MAX_ORIGINS]))
    return out


def _not_zero(s: State) -> State:
    return s._replace(is_zero=False) if s.is_zero else s


def _only_cut(s: State) -> State:
    """A dependence through a discrete choice (a branch index, a loop's predicate)."""
    return State(0, s.cut | s.active, 0, 0, s.origins, False)


def where(eqn: Any) -> tuple[str, int]:
    """The user's source line of an equation: the innermost traced frame outside JAX,
    jaxlib and the standard library (functree's own layers count as the user's).

    Reads only public attributes (``eqn.source_info.traceback.frames``, each frame's
    ``file_name`` and ``line_num``), and never raises: anything unexpected (a JAX that
    records no traceback) gives ``("<unknown>", 0)``.
    """
    try:
        for frame in eqn.source_info.traceback.frames:
            if _is_user_file(frame.file_name):
                return (frame.file_name, int(frame.line_num))
    except Exception:
        pass
    return ("<unknown>", 0)


def _label(eqn: Any) -> str:
    name = eqn.primitive.name
    if name == "convert_element_type":
        return f"conversion to {eqn.params.get('new_dtype')}"
    if name in _COMPARISONS:
        return f"comparison `{name}`"
    if name == "stop_gradient":
        return "jax.lax.stop_gradient (not ft.without_derivative)"
    return f"`{name}`"


# The user's lines of the calls being analysed, innermost last: an equation inside a jitted
# library function (jnp.round's body) records no frame of the user's, and is located at the
# call that reached it instead of "<unknown>:0".
_ENCLOSING: list[tuple[str, int]] = []


def _located(eqn: Any) -> tuple[str, int]:
    found = where(eqn)
    return _ENCLOSING[-1] if found[1] == 0 and _ENCLOSING else found


def _cut(s: State, eqn: Any) -> State:
    """Moves the active bits of ``s`` to ``cut``, recording where."""
    if not s.active:
        return _not_zero(s)
    origin = Origin(s.active, Op(_label(eqn), *_located(eqn)))
    return State(0, s.cut | s.active, s.quiet, s.zeroed, s.origins | {origin}, False)


def _scoped(eqn: Any, scoped: bool) -> bool:
    return scoped or SCOPE in str(eqn.source_info.name_stack)


_open = compat.open_jaxpr


def analyse(jaxpr: Any, consts: Sequence[Any], ins: Sequence[State], scoped: bool) -> list:
    from jax.extend import core as jcore
    env: dict[Any, State] = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _const_state(c)
    for v, s in zip(jaxpr.invars, ins):
        env[v] = s

    def read(v: Any) -> State:
        if isinstance(v, jcore.Literal):
            return _const_state(v.val)
        return env.get(v, EMPTY)

    for eqn in jaxpr.eqns:
        outs = _transfer(eqn, [read(v) for v in eqn.invars], scoped)
        for v, s in zip(eqn.outvars, outs):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _transfer(eqn: Any, ins: list, scoped: bool) -> list:
    name = eqn.primitive.name
    inner = _scoped(eqn, scoped)
    try:
        body = compat.body_of_call(eqn) if name in _CALLS else None
        if body is not None:
            _ENCLOSING.append(_located(eqn))
            try:
                return analyse(*body, ins, inner)
            finally:
                _ENCLOSING.pop()
        if name == "cond":
            return _cond(eqn, ins, inner)
        elif name == "while":
            return _while(eqn, ins, inner)
        elif name == "scan":
            return _scan(eqn, ins, inner)
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # an unfamiliar form: fall through to the conservative rule
    return _elementary(eqn, ins, inner)


def _elementary(eqn: Any, ins: list, scoped: bool) -> list:
    from jax.extend import core as jcore
    name = eqn.primitive.name
    u = join_all(ins) if ins else EMPTY
    if name == "stop_gradient":
        if scoped:  # ft.without_derivative: all of it is intentional, and marked as such
            quiet = u.quiet | u.cut | u.active | MARK
            return [State(0, 0, quiet, u.zeroed, u.origins, u.is_zero)] * len(eqn.outvars)
        return [_cut(u, eqn)] * len(eqn.outvars)
    if name in _ZERO_DERIVATIVE_FLOAT:
        return [_cut(u, eqn)] * len(eqn.outvars)
    if name in _ANNIHILATING and any(s.is_zero for s in ins):
        live = u.active | u.cut
        return [State(0, u.cut, u.quiet, u.zeroed | live, u.origins, True)] * len(eqn.outvars)
    floats = [s for v, s in zip(eqn.invars, ins) if is_inexact(v.aval)]
    zero = name in _ZERO_PRESERVING and bool(floats) and all(s.is_zero for s in floats)
    out_state = u._replace(is_zero=zero)
    if u.quiet & MARK and not all(s.quiet & MARK for v, s in zip(eqn.invars, ins) if not isinstance(v, jcore.Literal)):
        # Mixed with a value that was not stopped (data, a model's output): the result is no
        # longer the one the user declared constant (Swift's withoutDerivative(at:) of it).
        out_state = out_state._replace(quiet=u.quiet & ~MARK)
    return [out_state if is_inexact(v.aval) else _cut(u, eqn) for v in eqn.outvars]


def _cond(eqn: Any, ins: list, scoped: bool) -> list:
    index, operands = ins[0], ins[1:]
    # Every branch, even for a literal index: the check's trace bakes the call's data (a
    # NumPy flag) into the jaxpr as literals, and another call takes the other branch.
    results = []
    for branch in eqn.params["branches"]:
        jaxpr, consts = _open(branch)
        results.append(analyse(jaxpr, consts, operands, scoped))
    outs = [join_all(column) for column in zip(*results)]
    # The branch taken depends on the (integer) index: a non-differentiable dependence.
    pick = _only_cut(index)
    return [o if o.is_zero else _not_zero(_join(o, pick)) for o in outs]


def _fixed_point(step: Callable[[list], list], carry: list) -> list:
    for _ in range(_MAX_FIXED_POINT):
        new = [_join(c, n) for c, n in zip(carry, step(carry))]
        if new == carry:
            return carry
        carry = new
    everything = join_all(carry)
    return [everything] * len(carry)


def _while(eqn: Any, ins: list, scoped: bool) -> list:
    p = eqn.params
    nc, nb = compat.while_counts(p)
    cond_consts, body_consts = ins[:nc], ins[nc : nc + nb]
    init = [_not_zero(s) for s in ins[nc + nb :]]
    body, body_c = _open(p["body_jaxpr"])
    carry = _fixed_point(lambda c: analyse(body, body_c, [*body_consts, *c], scoped), init)
    cond, cond_c = _open(p["cond_jaxpr"])
    (pred,) = analyse(cond, cond_c, [*cond_consts, *carry], scoped)
    # How many iterations run depends on the predicate: a non-differentiable dependence.
    stop = _only_cut(pred)
    return [_join(c, stop) for c in carry]


def _scan(eqn: Any, ins: list, scoped: bool) -> list:
    p = eqn.params
    nconst, ncarry = compat.scan_counts(p)
    consts = ins[:nconst]
    init = [_not_zero(s) for s in ins[nconst : nconst + ncarry]]
    xs = [_not_zero(s) for s in ins[nconst + ncarry :]]
    body, body_c = _open(p["jaxpr"])
    ys: list = []

    def step(carry: list) -> list:
        outs = analyse(body, body_c, [*consts, *carry, *xs], scoped)
        ys[:] = outs[ncarry:]
        return outs[:ncarry]

    carry = _fixed_point(step, init)
    step(carry)
    return [*carry, *ys]
