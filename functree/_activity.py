"""The activity analysis of the differentiation diagnostics, on the jaxpr.

Propagates, forward through a traced program, which differentiation inputs each value
depends on and how (a :class:`State`: ``active``, ``cut``, ``quiet``, ``zeroed``, the
origins of its cuts, known zero): ``A(prim(u₁…uₙ)) = ⋃ A(uᵢ)`` for differentiable
primitives, ``∅`` for zero-derivative ones (whose inputs move to ``cut``); nested jaxprs
recursively, loop carries to the least fixed point of ``A(c) = A(c₀) ∪ A(body(c))``; a
custom derivative by its rule (:func:`_rule_reach`).
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

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import numpy as np

from functree import _compat as compat
from functree._source import is_user_file as _is_user_file

__all__ = [
    "CALLBACKS", "WHILE_LOOPS", "EMPTY", "MARK", "NEVER_SELECTED", "SCOPE", "Op", "Origin", "State", "analyse", "cutting_at", "is_inexact",
    "is_known_zero", "join_all", "where",
]

# Primitives with floating results whose derivative is zero (wherever it exists).
_ZERO_DERIVATIVE_FLOAT = frozenset({"floor", "ceil", "round", "sign", "nextafter"})
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
# Calls whose body is the program itself (analysed recursively, constants included).
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "named_call"}
)
# Custom derivatives (``jax.custom_jvp``/``custom_vjp``, ``ft.derivative(of=)``): their rule,
# not their body, says which operands the derivative reaches (:func:`_rule_reach`).
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
# Host callbacks: JAX cannot differentiate them (an error, not a zero); cut only while an
# operator's failure is explained (:func:`cutting_at`), to name what reached them, as is a
# while loop in reverse mode.
CALLBACKS = frozenset({"pure_callback", "io_callback"})
WHILE_LOOPS = frozenset({"while"})
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
NEVER_SELECTED = "a jnp.where branch its constant condition never selects"
STOP_GRADIENT = "jax.lax.stop_gradient (not ft.without_derivative)"
"""The label of a ``stop_gradient`` that ``ft.without_derivative`` did not mark: a cut on
purpose (a target network), which the diagnostics' fix says how to mark."""
_MAX_ORIGINS = 16
_MAX_FIXED_POINT = 64
_ZERO_TEST_MAX_SIZE = 1 << 16
_KNOWN_MAX_SIZE = 1 << 12



class Op(NamedTuple):
    """A zero-derivative operation: its description and the user's source line."""

    label: str
    file: str
    line: int


class Origin(NamedTuple):
    """Where differentiation inputs were cut: the inputs' bits and the operation."""

    bits: int
    op: Op


class Known:
    """A small constant array's value, compared and hashed by its contents (a loop's fixed
    point compares states)."""

    __slots__ = ("_key", "array")

    def __init__(self, array: np.ndarray):
        self.array = array
        self._key = (array.shape, array.dtype.str, array.tobytes())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Known) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


class State(NamedTuple):
    """What the analysis knows about one value of the program.

    Four bitmasks over the differentiation input leaves (bit ``k + 1`` is leaf ``k``): on
    which the value depends ``active``-ly, only through a ``cut`` (zero-derivative
    operation), only through ``ft.without_derivative`` (``quiet``), only through a product
    with a constant zero or in a ``jnp.where`` branch a constant condition never selects
    (``zeroed``); the ``origins`` of its cuts; whether the value is a known constant zero;
    and, for a small constant, its value.
    """

    active: int
    cut: int
    quiet: int
    zeroed: int
    origins: frozenset[Origin]
    is_zero: bool
    value: Known | None = None  # a small constant's value (a where's condition): see _folded


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


def _known(value: Any) -> Known | None:
    """``value``'s contents when it is a small concrete array (not a tracer), else None."""
    if isinstance(value, jax.core.Tracer) or getattr(value, "size", 1) > _KNOWN_MAX_SIZE:
        return None
    try:
        array = np.asarray(value)
    except Exception:
        return None
    return Known(array) if array.dtype.kind in "biuf" else None


def _const_state(value: Any) -> State:
    return State(0, 0, 0, 0, frozenset(), is_known_zero(value), _known(value))


def _opaque(s: State) -> State:
    """``s`` as a loop's carry or slice sees it: neither a known zero nor a known value."""
    return s._replace(is_zero=False, value=None) if s.is_zero or s.value is not None else s


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


def where(eqn: Any, *, past_core: bool = False) -> tuple[str, int]:
    """The user's source line of an equation: the innermost traced frame outside JAX,
    jaxlib and the standard library (functree's own layers count as the user's); with
    ``past_core``, outside functree's core modules too (``ft.derivative(of=)`` binds its
    ``custom_vjp`` in ``_derivative.py``: the user's line is the call).

    Reads only public attributes (``eqn.source_info.traceback.frames``, each frame's
    ``file_name`` and ``line_num``), and never raises: anything unexpected (a JAX that
    records no traceback) gives ``("<unknown>", 0)``.
    """
    try:
        for frame in eqn.source_info.traceback.frames:
            if _is_user_file(frame.file_name) and not (past_core and _in_core(frame.file_name)):
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
        return STOP_GRADIENT
    return f"`{name}`"


# The user's lines of the calls being analysed, innermost last: an equation inside a jitted
# library function (jnp.round's body) records no frame of the user's, and is located at the
# call that reached it instead of "<unknown>:0".
_ENCLOSING: list[tuple[str, int]] = []


def _located(eqn: Any, *, past_core: bool = False) -> tuple[str, int]:
    found = where(eqn, past_core=past_core)
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
    if name in _CUTTING.names:  # an explanation's cut (a while loop): not looked into
        return _elementary(eqn, ins, inner)
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
        elif name in _CUSTOM:
            return _custom(eqn, ins, inner)
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # an unfamiliar form: fall through to the conservative rule
    return _elementary(eqn, ins, inner)


class _Cutting(threading.local):
    names: frozenset[str] = frozenset()


_CUTTING = _Cutting()


@contextlib.contextmanager
def cutting_at(names: frozenset[str]) -> Iterator[None]:
    """Analyse the primitives ``names`` as cuts (their origins then say which inputs reach
    them, and where): the explanation of a failed operator, never its diagnostics."""
    saved, _CUTTING.names = _CUTTING.names, names
    try:
        yield
    finally:
        _CUTTING.names = saved


def _elementary(eqn: Any, ins: list, scoped: bool) -> list:
    from jax.extend import core as jcore
    name = eqn.primitive.name
    if name in _CUTTING.names:
        # a while loop's condition constants are never differentiated (JAX's refusal is
        # for its body's constants and its carry): a leaf read only there did not cause it
        reaching = ins[eqn.params["cond_nconsts"]:] if name == "while" else ins
        return [_cut(join_all(reaching) if reaching else EMPTY, eqn)] * len(eqn.outvars)
    if ins and all(x.value is not None for x in ins):
        folded = _folded(eqn, [x.value.array for x in ins if x.value is not None])
        if folded is not None:
            return [_const_state(folded)]
    if name == "select_n" and ins[0].value is not None and is_inexact(eqn.outvars[0].aval):
        return [_selected(eqn, ins)]
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


_NUMPY = {
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "not": np.invert, "and": np.bitwise_and, "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}


def _folded(eqn: Any, values: list) -> np.ndarray | None:
    """The value of an equation on constants that builds a condition (a broadcast
    ``True``, ``jnp.zeros(3) > 1``), computed with NumPy; None for any other equation."""
    name, p = eqn.primitive.name, eqn.params
    try:
        if name in _NUMPY:
            return np.asarray(_NUMPY[name](*values))
        (x,) = values
        if name == "broadcast_in_dim":
            shape = [1] * len(p["shape"])
            for axis, size in zip(p["broadcast_dimensions"], x.shape):
                shape[axis] = size
            return np.broadcast_to(x.reshape(shape), p["shape"])
        if name == "convert_element_type":
            return x.astype(np.dtype(p["new_dtype"]))
        if name in ("reshape", "squeeze"):
            return x.reshape(eqn.outvars[0].aval.shape)
    except Exception:  # a form NumPy does not take (a float0, a new parameter): not folded
        return None
    return None


def _selected(eqn: Any, ins: list) -> State:
    """``select_n`` with a constant condition (``jnp.where(True, a, b)``): only the cases
    it picks somewhere reach the result; one it never picks is masked, as by a zero
    factor (``zeroed``), its origin naming the line."""
    picked = {int(k) for k in np.unique(ins[0].value.array)}
    cases = ins[1:]
    out = join_all([c for k, c in enumerate(cases) if k in picked])
    dropped = join_all([c for k, c in enumerate(cases) if k not in picked])
    masked = (dropped.active | dropped.cut | dropped.zeroed) & ~(out.active | out.cut)
    if not masked:
        return out
    origin = Origin(masked, Op(NEVER_SELECTED, *_located(eqn)))
    return out._replace(zeroed=out.zeroed | masked, origins=out.origins | {origin})


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
    init = [_opaque(s) for s in ins[nc + nb :]]
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
    init = [_opaque(s) for s in ins[nconst : nconst + ncarry]]
    xs = [_opaque(s) for s in ins[nconst + ncarry :]]
    body, body_c = _open(p["jaxpr"])
    ys: list = []

    def step(carry: list) -> list:
        outs = analyse(body, body_c, [*consts, *carry, *xs], scoped)
        ys[:] = outs[ncarry:]
        return outs[:ncarry]

    carry = _fixed_point(step, init)
    last = step(carry)
    # The fixed point joins the initial carry in (a while loop may run no step); a scan of
    # at least one step returns the body's carry: fori_loop(0, 2, lambda i, c:
    # jnp.round(c), w) depends on w only through round, never actively as w itself.
    return [*(last if p.get("length", 0) >= 1 else carry), *ys]


def _custom(eqn: Any, ins: list, scoped: bool) -> list:
    """A custom derivative: the conservative rule (every operand reaches every output),
    except that an operand whose cotangent the rule never gives (a pullback returning
    ``None`` or zeros for it, a tangent rule ignoring its tangent) is cut for that output.

    ``∂out_o/∂b`` can be nonzero only if some operand ``i`` with ``b ∈ A(in_i)`` has a
    cotangent that depends on ``out_o``'s: the rule's reach (:func:`_rule_reach`)."""
    outs = _elementary(eqn, ins, scoped)
    if not any(s.active for s in ins):
        return outs
    reach = _rule_reach(eqn)
    if reach is None:  # the rule could not be traced: assume it reaches everything
        return outs
    op = Op(f"the custom derivative of `{_custom_name(eqn)}` (its rule gives a zero cotangent)", *_located(eqn, past_core=True))
    result = []
    for o, (v, s) in enumerate(zip(eqn.outvars, outs)):
        keep = 0
        for i, state in enumerate(ins):
            if reach[i] >> o & 1:
                keep |= state.active
        moved = s.active & ~keep
        if not is_inexact(v.aval) or not moved:
            result.append(s)
            continue
        result.append(State(keep, s.cut | moved, s.quiet, s.zeroed, s.origins | {Origin(moved, op)}, False))
    return result


_CORE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


def _in_core(file: str) -> bool:
    """Whether ``file`` is one of functree's core modules (``functree/_*.py``; not its layers)."""
    return file.startswith(_CORE) and os.sep not in file[len(_CORE):]


def _custom_name(eqn: Any) -> str:
    """The name of the function a custom derivative is defined for (as JAX prints it)."""
    found = compat.custom_function(eqn)
    return found[0] if found is not None else str(eqn.primitive.name)  # (no record: the primitive's)


# id(eqn) -> (eqn, reach): a loop's body is analysed up to _MAX_FIXED_POINT times, its
# custom derivatives traced once (the eqn is held so that its id is not reused). JAX's own
# rules (relu, logsumexp: module-level functions) are keyed by their source and operand
# types instead, traced once per process.
_REACH: dict[Any, tuple[Any, list[int] | None]] = {}
_JAX_SOURCE = os.path.join(os.path.dirname(os.path.abspath(jax.__file__)), "")  # not jaxopt/, jaxtyping/


def _jax_rule_key(eqn: Any) -> Any:
    """The key of a custom derivative defined in JAX's own source, else None."""
    found = compat.custom_function(eqn)
    source = found[1] if found is not None else ""
    if _JAX_SOURCE not in source:
        return None
    return (eqn.primitive.name, source, tuple((v.aval.shape, str(v.aval.dtype)) for v in eqn.invars),
            tuple((v.aval.shape, str(v.aval.dtype)) for v in eqn.outvars))


def _rule_reach(eqn: Any) -> list[int] | None:
    """Per operand of a custom-derivative equation, the bitmask of the outputs its
    derivative reaches through the rule (bit ``o``: output ``o``), or None when the rule
    cannot be traced (it then counts as reaching everything).

    Traced, never run: ``jax.jvp`` of the equation (``custom_jvp``), or ``jax.vjp``
    (``custom_vjp``, which has no forward mode), as a function of its float operands, and
    that jaxpr analysed with the tangents (cotangents) as its inputs. A tangent that
    depends on none (JAX's symbolic zero for a ``None``, ``jnp.zeros_like``) reaches
    nothing."""
    from functree._tree import bounded_put

    key = _jax_rule_key(eqn)
    hit = _REACH.get(key if key is not None else id(eqn))
    if hit is not None and (key is not None or hit[0] is eqn):
        return hit[1]
    try:
        with warnings.catch_warnings():  # the user's rule runs once more here: its warnings are not news
            warnings.simplefilter("ignore")
            reach = _traced_reach(eqn)
    except Exception:  # a rule JAX cannot differentiate here (Python control flow on a value)
        reach = None
    bounded_put(_REACH, key if key is not None else id(eqn), (eqn if key is None else None, reach))
    return reach


def _traced_reach(eqn: Any) -> list[int]:
    avals = [v.aval for v in eqn.invars]
    floats_in = [i for i, a in enumerate(avals) if is_inexact(a)]
    floats_out = [o for o, v in enumerate(eqn.outvars) if is_inexact(v.aval)]
    forward = eqn.primitive.name == "custom_jvp_call"

    def of_floats(primals: list) -> Callable[..., list]:
        def call(*xs: Any) -> list:
            args = list(primals)
            for i, x in zip(floats_in, xs):
                args[i] = x
            outs = compat.bind(eqn.primitive, eqn.params, args)
            return [outs[o] for o in floats_out]
        return call

    def pushed_forward(primals: list, tangents: list) -> list:
        return list(jax.jvp(of_floats(primals), [primals[i] for i in floats_in], tangents)[1])

    def pulled_back(primals: list, cotangents: list) -> list:
        _, pullback = jax.vjp(of_floats(primals), *[primals[i] for i in floats_in])
        return list(pullback(cotangents))

    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    seeds = [avals[i] for i in floats_in] if forward else [eqn.outvars[o].aval for o in floats_out]
    closed = jax.make_jaxpr(pushed_forward if forward else pulled_back)(
        [spec(a) for a in avals], [spec(a) for a in seeds]
    )
    bits = [State(1 << (k + 1), 0, 0, 0, frozenset(), False) for k in range(len(seeds))]
    results = analyse(closed.jaxpr, closed.consts, [EMPTY] * len(avals) + bits, False)
    # Any dependence counts: the rule is run, not differentiated (a round in it is a value).
    deps = [0 if r.is_zero else (r.active | r.cut | r.quiet) >> 1 for r in results]
    reach = [0] * len(avals)
    for a, i in enumerate(floats_in):
        for b, o in enumerate(floats_out):
            if (deps[b] >> a & 1) if forward else (deps[a] >> b & 1):
                reach[i] |= 1 << o
    return reach
