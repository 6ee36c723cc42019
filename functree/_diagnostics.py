"""Differentiation diagnostics: activity analysis on the jaxpr (Swift's compiler checks).

Before differentiating, every operator traces the function once more per abstract
signature (``jax.make_jaxpr``) and propagates, forward through the jaxpr, which
differentiation inputs each value depends on and how:

* ``active``: through a differentiable path (the derivative can be nonzero);
* ``cut``: only through operations whose derivative is zero (comparisons, conversions to
  integers, ``round``/``floor``/``ceil``/``sign``, ``argmax``, bitwise operations, a
  ``stop_gradient`` that did not come from :func:`ft.without_derivative`);
* ``quiet``: only through :func:`ft.without_derivative` (an intentional zero);
* ``zeroed``: only through a product with a constant zero (a zero mask).

Nested jaxprs (``jit``, ``remat``, ``cond``, ``while``, ``scan``) are analysed
recursively, loops to a fixed point. Custom derivatives (``custom_jvp``/``custom_vjp``) and
unknown primitives are assumed to depend differentiably on every input: the analysis can
miss a zero derivative but never invents one. Formally, with ``A(v)`` the active inputs of
value ``v``, ``A(prim(u₁…uₙ)) = ⋃ A(uᵢ)`` for differentiable primitives, ``∅`` for
zero-derivative ones (whose inputs move to ``cut``), and loop carries take the least fixed
point of ``A(c) = A(c₀) ∪ A(body(c))``.

Findings become warnings (:class:`ZeroDerivativeWarning`,
:class:`NonDifferentiableWarning`, :class:`UnusedParameterWarning`, all
:class:`ft.DifferentiationWarning`) or a :class:`DiagnosticReport` from :func:`diagnose`.
Each is warned once, when its function and abstract signature are first analysed; later
calls only look the signature up, and a jitted step never calls back into Python, so it
pays nothing. ``ft.config.diagnostics = False`` or
``FUNCTREE_DIAGNOSTICS=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from functree._config import config
from functree._module import DifferentiationWarning, Module

__all__ = [
    "ZeroDerivativeWarning",
    "NonDifferentiableWarning",
    "UnusedParameterWarning",
    "DiagnosticReport",
    "Finding",
    "diagnose",
    "check",
]


class ZeroDerivativeWarning(DifferentiationWarning):
    """The result does not depend on the differentiation arguments: its derivative is zero."""


class NonDifferentiableWarning(DifferentiationWarning):
    """The result depends on the arguments only through non-differentiable operations."""


class UnusedParameterWarning(DifferentiationWarning):
    """Parameters of a differentiated Module that cannot affect the result."""


ZERO_DERIVATIVE = """\
{fn}: result does not depend on differentiation arguments and will always have a zero \
derivative{what}.
If the zero derivative is intentional, add ft.without_derivative(at=...) to silence this:

    wrong:  ft.gradient(lambda x: jnp.sqrt(3.0), at=x)
    right:  ft.gradient(lambda x: ft.without_derivative(at=jnp.sqrt(3.0)), at=x)
"""

NON_DIFFERENTIABLE = """\
{fn}: cannot differentiate through a non-differentiable result: it depends on {what} only \
through operations with a zero derivative, so its derivative is always zero:
{ops}
Keep a differentiable path (choose between values with jnp.where, keep floats floating, \
use smooth surrogates such as jax.nn.softmax for argmax or jax.nn.sigmoid for a \
comparison), or, if the zero derivative is intentional, say so:

    wrong:  y = jnp.round(x)
    right:  y = ft.without_derivative(at=jnp.round(x))
"""

UNUSED_PARAMETERS = """\
{fn}: {count} parameter(s) of {what} cannot affect the result and will always have a \
zero gradient:
{names}
Call the layers you defined, or stop differentiating these parameters:

    wrong:  ft.gradient(loss, at=model)                  # {first} never reaches the loss
    right:  ft.gradient(loss, at=model, wrt="{keep}")    # differentiate what is used
       or:  name: jax.Array = ft.field(no_derivative=True)   # carried, never trained
"""

NON_DIFFERENTIABLE_PARAMETERS = """\
{fn}: cannot differentiate through a non-differentiable result: {count} parameter(s) of \
{what} reach the result only through operations with a zero derivative, so their \
gradient is always zero:
{names}
Keep a differentiable path to them, or say that they are not trained:

    wrong:  jnp.where(x > self.threshold, y, 0.0)                  # no gradient for threshold
    right:  jax.nn.sigmoid((x - self.threshold) / 0.1) * y         # a smooth gate
       or:  threshold: jax.Array = ft.field(no_derivative=True)    # carried, never trained
"""

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
_SCOPE = "ft.without_derivative"
_MAX_ORIGINS = 16
_MAX_FIXED_POINT = 64
_ZERO_TEST_MAX_SIZE = 1 << 16

# A state is (active, cut, quiet, zeroed, origins, is_zero): four bitmasks over the
# differentiation input leaves, the frozenset of (bits, label, file, line) cuts that made
# bits inactive, and whether the value is a known constant zero.
_State = tuple
_MARK = 1  # bit 0 of ``quiet``: the value passed through ft.without_derivative
_EMPTY: _State = (0, 0, 0, 0, frozenset(), False)
_ZERO: _State = (0, 0, 0, 0, frozenset(), True)


# ----------------------------------------------------------------------------- analysis


def _is_inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    try:
        return dtype is not None and bool(jax.dtypes.issubdtype(dtype, np.inexact))
    except TypeError:
        return False


def _is_known_zero(value: Any) -> bool:
    if isinstance(value, jax.core.Tracer):
        return False
    size = getattr(value, "size", 1)
    if size > _ZERO_TEST_MAX_SIZE:
        return False
    try:
        return bool(np.all(np.asarray(value) == 0))
    except Exception:
        return False


def _const_state(value: Any) -> _State:
    return _ZERO if _is_known_zero(value) else _EMPTY


def _join(a: _State, b: _State) -> _State:
    origins = a[4] | b[4] if b[4] else a[4]
    return (a[0] | b[0], a[1] | b[1], a[2] | b[2], a[3] | b[3], origins, a[5] and b[5])


def _join_all(states: Sequence[_State]) -> _State:
    out = (0, 0, 0, 0, frozenset(), True)
    for s in states:
        out = _join(out, s)
    if len(out[4]) > _MAX_ORIGINS:
        out = (*out[:4], frozenset(sorted(out[4], key=repr)[:_MAX_ORIGINS]), out[5])
    return out


def _not_zero(s: _State) -> _State:
    return s if not s[5] else (*s[:5], False)


def _where(eqn: Any) -> tuple[str, int]:
    try:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:
        frame = None
    if frame is None:
        return ("<unknown>", 0)
    return (frame.file_name, frame.start_line)


def _label(eqn: Any) -> str:
    name = eqn.primitive.name
    if name == "convert_element_type":
        return f"conversion to {eqn.params.get('new_dtype')}"
    if name in _COMPARISONS:
        return f"comparison `{name}`"
    if name == "stop_gradient":
        return "jax.lax.stop_gradient (not ft.without_derivative)"
    return f"`{name}`"


def _cut(s: _State, eqn: Any) -> _State:
    """Moves the active bits of ``s`` to ``cut``, recording where."""
    if not s[0]:
        return (*s[:5], False)
    origin = (s[0], _label(eqn), *_where(eqn))
    return (0, s[1] | s[0], s[2], s[3], s[4] | {origin}, False)


def _scoped(eqn: Any, scoped: bool) -> bool:
    return scoped or _SCOPE in str(eqn.source_info.name_stack)


def _open(j: Any) -> tuple[Any, Sequence[Any]]:
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, j.consts
    return j, ()


def _analyse(jaxpr: Any, consts: Sequence[Any], ins: Sequence[_State], scoped: bool) -> list:
    env: dict[Any, _State] = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _const_state(c)
    for v, s in zip(jaxpr.invars, ins):
        env[v] = s

    def read(v: Any) -> _State:
        if isinstance(v, jcore.Literal):
            return _const_state(v.val)
        return env.get(v, _EMPTY)

    for eqn in jaxpr.eqns:
        outs = _transfer(eqn, [read(v) for v in eqn.invars], scoped)
        for v, s in zip(eqn.outvars, outs):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _transfer(eqn: Any, ins: list, scoped: bool) -> list:
    name = eqn.primitive.name
    inner = _scoped(eqn, scoped)
    try:
        if name in _CALLS and "jaxpr" in eqn.params:
            jaxpr, consts = _open(eqn.params["jaxpr"])
            if len(jaxpr.invars) == len(ins) and len(jaxpr.outvars) == len(eqn.outvars):
                return _analyse(jaxpr, consts, ins, inner)
        elif name == "cond":
            return _cond(eqn, ins, inner)
        elif name == "while":
            return _while(eqn, ins, inner)
        elif name == "scan":
            return _scan(eqn, ins, inner)
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # an unfamiliar form: fall through to the conservative rule
    return _elementary(eqn, ins, inner)


def _elementary(eqn: Any, ins: list, scoped: bool) -> list:
    name = eqn.primitive.name
    u = _join_all(ins) if ins else _EMPTY
    if name == "stop_gradient":
        if scoped:  # ft.without_derivative: all of it is intentional, and marked as such
            quiet = u[2] | u[1] | u[0] | _MARK
            return [(0, 0, quiet, u[3], u[4], u[5])] * len(eqn.outvars)
        return [_cut(u, eqn)] * len(eqn.outvars)
    if name in _ZERO_DERIVATIVE_FLOAT:
        return [_cut(u, eqn)] * len(eqn.outvars)
    if name in _ANNIHILATING and any(s[5] for s in ins):
        live = u[0] | u[1]
        return [(0, u[1], u[2], u[3] | live, u[4], True)] * len(eqn.outvars)
    floats = [s for v, s in zip(eqn.invars, ins) if _is_inexact(v.aval)]
    zero = name in _ZERO_PRESERVING and bool(floats) and all(s[5] for s in floats)
    out_state = (*u[:5], zero)
    return [out_state if _is_inexact(v.aval) else _cut(u, eqn) for v in eqn.outvars]


def _cond(eqn: Any, ins: list, scoped: bool) -> list:
    index, operands = ins[0], ins[1:]
    results = []
    for branch in eqn.params["branches"]:
        jaxpr, consts = _open(branch)
        results.append(_analyse(jaxpr, consts, operands, scoped))
    outs = [_join_all(column) for column in zip(*results)]
    # The branch taken depends on the (integer) index: a non-differentiable dependence.
    pick = (0, index[1] | index[0], 0, 0, index[4], False)
    return [_not_zero(_join(o, pick)) if not o[5] else o for o in outs]


def _fixed_point(step: Callable[[list], list], carry: list) -> list:
    for _ in range(_MAX_FIXED_POINT):
        new = [_join(c, n) for c, n in zip(carry, step(carry))]
        if new == carry:
            return carry
        carry = new
    everything = _join_all(carry)
    return [everything] * len(carry)


def _while(eqn: Any, ins: list, scoped: bool) -> list:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = ins[:nc], ins[nc : nc + nb]
    init = [_not_zero(s) for s in ins[nc + nb :]]
    body, body_c = _open(p["body_jaxpr"])
    carry = _fixed_point(lambda c: _analyse(body, body_c, [*body_consts, *c], scoped), init)
    cond, cond_c = _open(p["cond_jaxpr"])
    (pred,) = _analyse(cond, cond_c, [*cond_consts, *carry], scoped)
    # How many iterations run depends on the predicate: a non-differentiable dependence.
    stop = (0, pred[1] | pred[0], 0, 0, pred[4], False)
    return [_join(c, stop) for c in carry]


def _scan(eqn: Any, ins: list, scoped: bool) -> list:
    p = eqn.params
    nconst, ncarry = p["num_consts"], p["num_carry"]
    consts = ins[:nconst]
    init = [_not_zero(s) for s in ins[nconst : nconst + ncarry]]
    xs = [_not_zero(s) for s in ins[nconst + ncarry :]]
    body, body_c = _open(p["jaxpr"])
    ys: list = []

    def step(carry: list) -> list:
        outs = _analyse(body, body_c, [*consts, *carry, *xs], scoped)
        ys[:] = outs[ncarry:]
        return outs[:ncarry]

    carry = _fixed_point(step, init)
    step(carry)
    return [*carry, *ys]


# ----------------------------------------------------------------------------- findings


@dataclasses.dataclass(frozen=True)
class Finding:
    """One diagnostic: its warning category, message, and the source location it names."""

    category: type[Warning]
    message: str
    filename: str
    lineno: int
    paths: tuple[str, ...] = ()

    def emit(self) -> None:
        warnings.warn_explicit(
            self.message, self.category, self.filename, self.lineno, registry=_REGISTRY
        )


@dataclasses.dataclass(frozen=True)
class DiagnosticReport:
    """Every finding of the differentiation diagnostics for one function and signature.

    ``activity`` lists each differentiated leaf (dotted name) with its status: ``active``
    (the derivative can be nonzero), ``non-differentiable`` (reaches the result only
    through zero-derivative operations), ``without_derivative`` (intentionally stopped),
    ``zero mask`` (multiplied by a constant zero) or ``unused``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.diagnose(lambda x: jnp.sum(x ** 2), at=jnp.ones(2)).ok
      True
      >>> ft.diagnose(lambda x: jnp.round(x), at=1.0).activity
      (('<root>', 'non-differentiable'),)
    """

    function: str
    findings: tuple[Finding, ...]
    activity: tuple[tuple[str, str], ...]
    analysed: bool = True
    note: str = ""

    @property
    def ok(self) -> bool:
        """True when the analysis ran and found nothing."""
        return self.analysed and not self.findings

    def __str__(self) -> str:
        head = f"DiagnosticReport({self.function}): "
        if not self.analysed:
            return head + f"not analysed ({self.note})"
        lines = [head + (f"{len(self.findings)} finding(s)" if self.findings else "no findings")]
        for f in self.findings:
            lines.append(f"  {f.category.__name__} at {f.filename}:{f.lineno}")
            lines.extend("    " + line for line in f.message.rstrip().splitlines())
        if self.activity:
            lines.append("  activity:")
            width = max(len(n) for n, _ in self.activity)
            lines.extend(f"    {n.ljust(width)}  {s}" for n, s in self.activity)
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        esc = html.escape
        rows = "".join(
            f"<tr><td><code>{esc(n)}</code></td><td>{esc(s)}</td></tr>" for n, s in self.activity
        )
        items = "".join(
            f"<li><b>{esc(f.category.__name__)}</b> at <code>{esc(f.filename)}:{f.lineno}</code>"
            f"<pre>{esc(f.message)}</pre></li>"
            for f in self.findings
        )
        status = "no findings" if self.ok else f"{len(self.findings)} finding(s)"
        if not self.analysed:
            status = f"not analysed ({esc(self.note)})"
        return (
            f"<div><b>DiagnosticReport</b> <code>{esc(self.function)}</code>: {status}"
            f"<ul>{items}</ul><table><tr><th>leaf</th><th>status</th></tr>{rows}</table></div>"
        )


_REGISTRY: dict[Any, Any] = {}


def _fn_name(f: Any) -> str:
    f = _unwrap(f)
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__name__


def _unwrap(f: Any) -> Any:
    for _ in range(8):
        if isinstance(f, functools.partial):
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


def _location(f: Any) -> tuple[str, int]:
    f = _unwrap(f)
    code = getattr(f, "__code__", None)
    if code is None:
        call = type(f).__call__ if callable(f) else None
        code = getattr(call, "__code__", None)
    if code is not None:
        return (code.co_filename, code.co_firstlineno)
    return ("<unknown>", 0)


def _argument_name(f: Any, index: int) -> str:
    try:
        names = list(inspect.signature(f).parameters)
        return f"argument {index} (`{names[index]}`)"
    except (TypeError, ValueError, IndexError):
        return f"argument {index}"


def _leaf_name(path: Any) -> str:
    from functree._parameters import _jax_path_name

    return _jax_path_name(path) or "<root>"


def _contains_module(x: Any) -> bool:
    leaves = jax.tree.leaves(x, is_leaf=lambda y: isinstance(y, Module))
    return isinstance(x, Module) or any(isinstance(y, Module) for y in leaves)


def _ops(origins: Any, bits: int) -> list[tuple[str, str, int]]:
    found = sorted({(label, file, line) for b, label, file, line in origins if b & bits})
    return found


def _format_ops(ops: list[tuple[str, str, int]]) -> str:
    return "\n".join(f"    {label} at {file}:{line}" for label, file, line in ops)


class _Arguments:
    """The differentiated arguments: their leaves' bits, names and Module-ness."""

    def __init__(self, f: Any, plan: Any):
        self.groups: list[tuple[str, list[tuple[str, int]], bool]] = []
        bit = 1  # bit 0 is _MARK
        for index, primal in zip(plan.indices, plan.primals):
            leaves = jax.tree_util.tree_flatten_with_path(primal)[0]
            names = [(_leaf_name(path), 1 << (bit + k)) for k, (path, _) in enumerate(leaves)]
            bit += len(leaves)
            is_module = _contains_module(plan.args[index])
            self.groups.append((_argument_name(f, index), names, is_module))
        self.all_bits = (1 << bit) - 2


def _status(bit: int, total: _State) -> str:
    if total[0] & bit:
        return "active"
    if total[2] & bit:
        return "without_derivative"
    if total[1] & bit:
        return "non-differentiable"
    if total[3] & bit:
        return "zero mask"
    return "unused"


def _findings(f: Any, args: _Arguments, total: _State, quiet_constant: bool) -> list[Finding]:
    fn = _fn_name(f)
    file, line = _location(f)
    if not total[0] & args.all_bits:
        return _whole_function(fn, file, line, args, total, quiet_constant)
    out: list[Finding] = []
    for what, names, is_module in args.groups:
        statuses = [(n, _status(b, total), b) for n, b in names]
        if not any(s in ("active", "without_derivative") for _, s, _ in statuses):
            out.extend(_whole_function(fn, file, line, _only(args, what), total, False))
            continue
        if not is_module:
            continue
        unused = [(n, s) for n, s, _ in statuses if s in ("unused", "zero mask")]
        if unused:
            keep = next(n for n, s, _ in statuses if s == "active")
            keep = keep.split(".")[0] + ".*" if "." in keep else keep
            listing = "\n".join(
                f"    {n}" + ("   (multiplied by a constant zero)" if s == "zero mask" else "")
                for n, s in unused
            )
            message = UNUSED_PARAMETERS.format(
                fn=fn, count=len(unused), what=what, names=listing, keep=keep, first=unused[0][0]
            )
            out.append(
                Finding(UnusedParameterWarning, message, file, line, tuple(n for n, _ in unused))
            )
        cut = [(n, b) for n, s, b in statuses if s == "non-differentiable"]
        if cut:
            listing = "\n".join(
                f"    {n}   (through {', '.join(label for label, _, _ in _ops(total[4], b))})"
                for n, b in cut
            )
            ops = _ops(total[4], functools.reduce(lambda x, y: x | y, [b for _, b in cut]))
            where = ops[0][1:] if ops else (file, line)
            message = NON_DIFFERENTIABLE_PARAMETERS.format(
                fn=fn, count=len(cut), what=what, names=listing + "\n" + _format_ops(ops)
            )
            out.append(
                Finding(NonDifferentiableWarning, message, *where, tuple(n for n, _ in cut))
            )
    return out


def _only(args: _Arguments, what: str) -> _Arguments:
    sub = object.__new__(_Arguments)
    sub.groups = [g for g in args.groups if g[0] == what]
    sub.all_bits = functools.reduce(
        lambda x, y: x | y, [b for g in sub.groups for _, b in g[1]], 0
    )
    return sub


def _whole_function(
    fn: str, file: str, line: int, args: _Arguments, total: _State, quiet_constant: bool
) -> list[Finding]:
    bits = args.all_bits
    what = ", ".join(g[0] for g in args.groups)
    paths = tuple(n for g in args.groups for n, _ in g[1])
    if total[1] & bits:
        ops = _ops(total[4], total[1] & bits)
        where = ops[0][1:] if ops else (file, line)
        message = NON_DIFFERENTIABLE.format(fn=fn, what=what, ops=_format_ops(ops))
        return [Finding(NonDifferentiableWarning, message, *where, paths)]
    if total[2] & (bits | _MARK) or quiet_constant:
        return []
    detail = " with respect to " + what
    if total[3] & bits:
        detail += " (it is multiplied by a constant zero)"
    message = ZERO_DERIVATIVE.format(fn=fn, what=detail)
    return [Finding(ZeroDerivativeWarning, message, file, line, paths)]


# ----------------------------------------------------------------------------- driver


class _TraceState(threading.local):
    active: bool = False
    quiet_constant: bool = False


_TRACE = _TraceState()


def note_without_derivative(value: Any) -> None:
    """Called by ``ft.without_derivative``: a constant marked while we trace is intentional."""
    if _TRACE.active and not any(
        isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value)
    ):
        _TRACE.quiet_constant = True


@dataclasses.dataclass(frozen=True)
class _Result:
    report: DiagnosticReport


def _trace(g: Callable[..., Any], primals: Sequence[Any]) -> tuple[Any, Any, bool]:
    # Nested operators (a gradient inside a differentiated function) trace inside ours.
    saved = (_TRACE.active, _TRACE.quiet_constant)
    _TRACE.active, _TRACE.quiet_constant = True, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the real trace that follows will warn
            closed, shape = jax.make_jaxpr(g, return_shape=True)(*primals)
        return closed, shape, _TRACE.quiet_constant
    finally:
        _TRACE.active, _TRACE.quiet_constant = saved


def _run(f: Any, g: Callable[..., Any], plan: Any, first_output_only: bool, strict: bool) -> _Result:
    """Trace ``g`` and analyse it; never raises unless ``strict`` (then tracing errors do)."""
    name = _fn_name(f)
    try:
        closed, shape, quiet_constant = _trace(g, plan.primals)
    except Exception as e:
        if strict:
            raise
        return _Result(DiagnosticReport(name, (), (), False, f"tracing failed: {type(e).__name__}"))
    try:
        args = _Arguments(f, plan)
        nin = len(closed.jaxpr.invars)
        ins = [(1 << (i + 1), 0, 0, 0, frozenset(), False) for i in range(nin)]
        outs = _analyse(closed.jaxpr, closed.consts, ins, False)
        if first_output_only and isinstance(shape, tuple) and len(shape) == 2:
            outs = outs[: len(jax.tree.leaves(shape[0]))]
        total = _join_all(outs) if outs else _EMPTY
        findings = tuple(_findings(f, args, total, quiet_constant))
        activity = tuple((n, _status(b, total)) for g_ in args.groups for n, b in g_[1])
        return _Result(DiagnosticReport(name, findings, activity))
    except Exception as e:  # an analysis bug must never break differentiation
        return _Result(DiagnosticReport(name, (), (), False, f"analysis failed: {e!r}"))


# Cache: (kind, function key, signature) -> _Result. Keys hold code objects, tree
# definitions and abstract values, not the user's arrays.
_CACHE: dict[Any, _Result] = {}
_CACHE_SIZE = 1024


def _leaf_key(x: Any, depth: int, baked: bool = True) -> Any:
    if isinstance(x, jax.core.Tracer):
        aval: Any = x.aval
        return ("T", aval.shape, aval.dtype, getattr(aval, "weak_type", False))
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return ("A", x.shape, x.dtype, getattr(x, "weak_type", False))
    if isinstance(x, (bool, int, float, complex, str)) or x is None:
        # Python values are baked into the trace, except where they are differentiated.
        return (type(x), x) if baked else type(x)
    if callable(x) and not isinstance(x, type):
        return _callable_key(x, depth + 1)
    try:
        hash(x)
        return x
    except TypeError:
        return ("id", type(x), id(x))


def _value_key(v: Any, depth: int, baked: bool = True) -> Any:
    leaves, treedef = jax.tree.flatten(v)
    return (treedef, tuple(_leaf_key(x, depth, baked) for x in leaves))


def _callable_key(f: Any, depth: int = 0) -> Any:
    if depth > 3:
        return ("deep", f) if _hashable(f) else ("id", id(f))
    if isinstance(f, functools.partial):
        keywords = tuple(sorted(f.keywords.items()))
        return ("partial", _callable_key(f.func, depth + 1), _value_key((f.args, keywords), depth))
    if inspect.ismethod(f):
        return ("method", _callable_key(f.__func__, depth + 1), _value_key(f.__self__, depth))
    if inspect.isfunction(f):
        cells = []
        for cell in f.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append(None)
        return (f.__code__, _value_key((cells, f.__defaults__, f.__kwdefaults__), depth))
    if isinstance(f, Module):
        return ("module", _value_key(f, depth))
    return f if _hashable(f) else ("id", id(f))


def _hashable(x: Any) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _signature(kind: str, f: Any, plan: Any) -> Any:
    differentiated = {i % len(plan.args) for i in plan.indices}
    return (
        kind,
        _callable_key(f),
        plan.indices,
        tuple(jax.tree.structure(p) for p in plan.primals),
        tuple(_value_key(a, 0, i not in differentiated) for i, a in enumerate(plan.args)),
    )


def _cache_key(kind: str, f: Any, plan: Any) -> Any:
    try:
        key = _signature(kind, f, plan)
        hash(key)
        return key
    except Exception:
        return None


def check(kind: str, fn: Any, g: Any, plan: Any) -> None:
    """Analyse ``g`` (the function being differentiated) before differentiation.

    Called by every differential operator. The analysis and its warnings happen once per
    function and abstract signature (later calls only compute the cache key); nothing
    happens when ``ft.config.diagnostics`` is off.
    """
    if not config.diagnostics:
        return
    key = _cache_key(kind, fn, plan)
    if key is not None and key in _CACHE:
        return
    result = _run(fn, g, plan, first_output_only=kind == "gradient", strict=False)
    if key is not None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = result
    for finding in result.report.findings:
        finding.emit()


def diagnose(
    f: Callable[..., Any], at: Any = inspect.Parameter.empty, *, wrt: Any = 0, has_aux: bool = False
) -> Any:
    """The differentiation diagnostics of ``f`` at ``at`` as a report, without warnings.

    ``wrt`` is as in :func:`ft.gradient`; with ``has_aux=True`` only the first result is
    analysed. Without ``at``, returns a function of ``f``'s arguments giving the report.
    Runs afresh on every call (no cache), whatever ``ft.config.diagnostics`` says.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> report = ft.diagnose(lambda x: x.astype(jnp.int32).astype(jnp.float32), at=1.0)
      >>> report.findings[0].category.__name__
      'NonDifferentiableWarning'
      >>> report.activity
      (('<root>', 'non-differentiable'),)
      >>> ft.diagnose(lambda x: jnp.maximum(x, 0.0), at=1.0).ok
      True
    """
    from functree._operators import _Plan

    def run(*args: Any, **kwargs: Any) -> DiagnosticReport:
        fn = functools.partial(f, **kwargs) if kwargs else f
        plan = _Plan("diagnose", fn, args, wrt)
        return _run(fn, plan.wrap(), plan, first_output_only=has_aux, strict=True).report

    return run if at is inspect.Parameter.empty else run(at)
