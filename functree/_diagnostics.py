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
import json
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import numpy as np
from jax.extend import core as jcore

from functree import _compat as compat
from functree._config import config
from functree._module import DifferentiationWarning, Module
from functree._nan import nan_report
from functree._parameters import parameters
from functree._plan import Plan
from functree._source import function_name as _fn_name
from functree._source import is_user_file as _is_user_file
from functree._source import unwrap as _unwrap
from functree._tree import CACHE_LIMIT, WeakIdentity, bounded_put, dotted_name

__all__ = [
    "UncoveredDerivativeError",
    "ZeroDerivativeWarning",
    "NonDifferentiableWarning",
    "UnusedParameterWarning",
    "DiagnosticReport",
    "Finding",
    "LeafActivity",
    "diagnose",
    "check",
]


class ZeroDerivativeWarning(DifferentiationWarning):
    """The result does not depend on the differentiation arguments: its derivative is zero.

    Example:
      >>> import functree as ft, jax.numpy as jnp, warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = ft.gradient(lambda x: jnp.sqrt(3.0), at=jnp.ones(2))
      >>> [type(w.message).__name__ for w in caught]
      ['ZeroDerivativeWarning']
    """


class NonDifferentiableWarning(DifferentiationWarning):
    """The result depends on the arguments only through non-differentiable operations.

    Example:
      >>> import functree as ft, jax.numpy as jnp, warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = ft.gradient(lambda x: jnp.round(x).sum(), at=jnp.ones(2))
      >>> [type(w.message).__name__ for w in caught]
      ['NonDifferentiableWarning']
    """


class UnusedParameterWarning(DifferentiationWarning):
    """Parameters of a differentiated Module that cannot affect the result.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, warnings
      >>> class Scale(ft.Module):
      ...     weight: jax.Array
      ...     unused: jax.Array
      ...     def __call__(self, x):
      ...         return x * self.weight
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = ft.gradient(lambda m: m(1.0).sum(), at=Scale(jnp.ones(2), jnp.ones(2)))
      >>> [type(w.message).__name__ for w in caught], "    unused" in str(caught[0].message)
      (['UnusedParameterWarning'], True)
    """


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

    wrong:  ft.gradient(loss, at=model)    # {first} never reaches the loss
    right:  {fix}
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



class _Op(NamedTuple):
    """A zero-derivative operation: its description and the user's source line."""

    label: str
    file: str
    line: int


class _Origin(NamedTuple):
    """Where differentiation inputs were cut: the inputs' bits and the operation."""

    bits: int
    op: _Op


class _State(NamedTuple):
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
    origins: frozenset[_Origin]
    is_zero: bool


_MARK = 1  # bit 0 of ``quiet``: the value passed through ft.without_derivative
_EMPTY = _State(0, 0, 0, 0, frozenset(), False)
_ZERO = _State(0, 0, 0, 0, frozenset(), True)


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
    return _State(
        a.active | b.active,
        a.cut | b.cut,
        a.quiet | b.quiet,
        a.zeroed | b.zeroed,
        a.origins | b.origins if b.origins else a.origins,
        a.is_zero and b.is_zero,
    )


def _join_all(states: Sequence[_State]) -> _State:
    out = _ZERO
    for s in states:
        out = _join(out, s)
    if len(out.origins) > _MAX_ORIGINS:
        out = out._replace(origins=frozenset(sorted(out.origins, key=repr)[:_MAX_ORIGINS]))
    return out


def _not_zero(s: _State) -> _State:
    return s._replace(is_zero=False) if s.is_zero else s


def _only_cut(s: _State) -> _State:
    """A dependence through a discrete choice (a branch index, a loop's predicate)."""
    return _State(0, s.cut | s.active, 0, 0, s.origins, False)


def _where(eqn: Any) -> tuple[str, int]:
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


def _cut(s: _State, eqn: Any) -> _State:
    """Moves the active bits of ``s`` to ``cut``, recording where."""
    if not s.active:
        return _not_zero(s)
    origin = _Origin(s.active, _Op(_label(eqn), *_where(eqn)))
    return _State(0, s.cut | s.active, s.quiet, s.zeroed, s.origins | {origin}, False)


def _scoped(eqn: Any, scoped: bool) -> bool:
    return scoped or _SCOPE in str(eqn.source_info.name_stack)


_open = compat.open_jaxpr


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
        body = compat.body_of_call(eqn) if name in _CALLS else None
        if body is not None:
            return _analyse(*body, ins, inner)
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
    name = eqn.primitive.name
    u = _join_all(ins) if ins else _EMPTY
    if name == "stop_gradient":
        if scoped:  # ft.without_derivative: all of it is intentional, and marked as such
            quiet = u.quiet | u.cut | u.active | _MARK
            return [_State(0, 0, quiet, u.zeroed, u.origins, u.is_zero)] * len(eqn.outvars)
        return [_cut(u, eqn)] * len(eqn.outvars)
    if name in _ZERO_DERIVATIVE_FLOAT:
        return [_cut(u, eqn)] * len(eqn.outvars)
    if name in _ANNIHILATING and any(s.is_zero for s in ins):
        live = u.active | u.cut
        return [_State(0, u.cut, u.quiet, u.zeroed | live, u.origins, True)] * len(eqn.outvars)
    floats = [s for v, s in zip(eqn.invars, ins) if _is_inexact(v.aval)]
    zero = name in _ZERO_PRESERVING and bool(floats) and all(s.is_zero for s in floats)
    out_state = u._replace(is_zero=zero)
    return [out_state if _is_inexact(v.aval) else _cut(u, eqn) for v in eqn.outvars]


def _cond(eqn: Any, ins: list, scoped: bool) -> list:
    index, operands = ins[0], ins[1:]
    results = []
    for branch in eqn.params["branches"]:
        jaxpr, consts = _open(branch)
        results.append(_analyse(jaxpr, consts, operands, scoped))
    outs = [_join_all(column) for column in zip(*results)]
    # The branch taken depends on the (integer) index: a non-differentiable dependence.
    pick = _only_cut(index)
    return [o if o.is_zero else _not_zero(_join(o, pick)) for o in outs]


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
    nc, nb = compat.while_counts(p)
    cond_consts, body_consts = ins[:nc], ins[nc : nc + nb]
    init = [_not_zero(s) for s in ins[nc + nb :]]
    body, body_c = _open(p["body_jaxpr"])
    carry = _fixed_point(lambda c: _analyse(body, body_c, [*body_consts, *c], scoped), init)
    cond, cond_c = _open(p["cond_jaxpr"])
    (pred,) = _analyse(cond, cond_c, [*cond_consts, *carry], scoped)
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
        if len(_REGISTRY) >= CACHE_LIMIT:  # the one bounded policy, for warnings' registry too
            _REGISTRY.clear()
        warnings.warn_explicit(
            self.message, self.category, self.filename, self.lineno, registry=_REGISTRY
        )


class LeafActivity(NamedTuple):
    """One differentiated leaf of a :class:`DiagnosticReport`: its dotted name and status."""

    name: str
    status: str


@dataclasses.dataclass(frozen=True)
class DiagnosticReport:
    """Every finding of the differentiation diagnostics for one function and signature.

    ``activity`` lists each differentiated leaf as a :class:`LeafActivity` (dotted name,
    status): ``active`` (the derivative can be nonzero), ``non-differentiable`` (reaches
    the result only through zero-derivative operations), ``without_derivative``
    (intentionally stopped), ``zero mask`` (multiplied by a constant zero) or ``unused``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.diagnose(lambda x: jnp.sum(x ** 2), at=jnp.ones(2)).ok
      True
      >>> ft.diagnose(lambda x: jnp.round(x), at=1.0).activity
      (LeafActivity(name='<root>', status='non-differentiable'),)
    """

    function: str
    findings: tuple[Finding, ...]
    activity: tuple[LeafActivity, ...]
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


def _contains_module(x: Any) -> bool:
    leaves = jax.tree.leaves(x, is_leaf=lambda y: isinstance(y, Module))
    return isinstance(x, Module) or any(isinstance(y, Module) for y in leaves)


def _ops(origins: frozenset[_Origin], bits: int) -> list[_Op]:
    """The zero-derivative operations that cut any of ``bits``, sorted by label and line."""
    return sorted({o.op for o in origins if o.bits & bits})


def _format_ops(ops: Sequence[_Op]) -> str:
    return "\n".join(f"    {op.label} at {op.file}:{op.line}" for op in ops)


class _Leaf(NamedTuple):
    """A differentiated leaf: its dotted name and its bit in the analysis' masks."""

    name: str
    bit: int


class _Group(NamedTuple):
    """One differentiated argument of the function."""

    what: str  # "argument 0 (`model`)"
    index: int
    leaves: tuple[_Leaf, ...]
    is_module: bool
    parameter_names: tuple[str, ...]  # every parameter of the argument, differentiated or not

    @property
    def bits(self) -> int:
        return functools.reduce(lambda x, y: x | y, [leaf.bit for leaf in self.leaves], 0)


def _groups(f: Any, plan: Plan) -> tuple[_Group, ...]:
    groups = []
    bit = 1  # bit 0 is _MARK
    for index, primal in zip(plan.indices, plan.primals):
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(primal)[0]]
        leaves = tuple(_Leaf(dotted_name(p) or "<root>", 1 << (bit + k)) for k, p in enumerate(paths))
        bit += len(leaves)
        arg = plan.args[index]
        is_module = _contains_module(arg)
        every = jax.tree_util.tree_flatten_with_path(parameters(arg))[0] if is_module else []
        names = tuple(dotted_name(p) for p, _ in every)
        groups.append(_Group(_argument_name(f, index), index, leaves, is_module, names))
    return tuple(groups)


def _all_bits(groups: Sequence[_Group]) -> int:
    return functools.reduce(lambda x, y: x | y, [g.bits for g in groups], 0)


def _status(bit: int, total: _State) -> str:
    if total.active & bit:
        return "active"
    if total.quiet & bit:
        return "without_derivative"
    if total.cut & bit:
        return "non-differentiable"
    if total.zeroed & bit:
        return "zero mask"
    return "unused"


_UNUSED = ("unused", "zero mask")
_GLOB_SPECIAL = re.compile(r"([*?\[])")


def used_patterns(used: Sequence[str], every: Sequence[str]) -> tuple[str, ...]:
    """``wrt=`` patterns that select every ``used`` parameter and no other of ``every``.

    For each used dotted name, its shortest prefix under which no other parameter lies
    (``layers.0`` when ``layers.1`` is unused; ``layers`` when all layers are used).

    Example:
      >>> from functree._diagnostics import used_patterns
      >>> every = ["layers.0.w", "layers.0.b", "layers.1.w", "layers.2.w", "head.w"]
      >>> used_patterns(["layers.0.w", "layers.0.b", "layers.2.w", "head.w"], every)
      ('layers.0', 'layers.2', 'head')
    """
    used_set = set(used)
    others = [n for n in every if n not in used_set]
    out: list[str] = []
    for name in used:
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if not any(o == prefix or o.startswith(prefix + ".") for o in others):
                break
        pattern = _GLOB_SPECIAL.sub(r"[\1]", prefix)
        if pattern not in out:
            out.append(pattern)
    return tuple(out)


def _wrt_literal(patterns: Sequence[str]) -> str:
    quoted = [json.dumps(p, ensure_ascii=False) for p in patterns]
    return quoted[0] if len(quoted) == 1 else "(" + ", ".join(quoted) + ")"


def _unused_finding(
    fn: str, file: str, line: int, group: _Group, statuses: Sequence[tuple[_Leaf, str]]
) -> Finding | None:
    unused = [(leaf.name, s) for leaf, s in statuses if s in _UNUSED]
    if not unused:
        return None
    used = [leaf.name for leaf, s in statuses if s not in _UNUSED]
    wrt = _wrt_literal(used_patterns(used, group.parameter_names or used))
    if group.index == 0:
        fix = f'ft.gradient(loss, at=model, wrt={wrt})    # differentiate what is used'
    else:
        fix = f"ft.gradient(loss, wrt={wrt})(model, ...)   # patterns select in argument 0"
    listing = "\n".join(
        f"    {n}" + ("   (multiplied by a constant zero)" if s == "zero mask" else "")
        for n, s in unused
    )
    message = UNUSED_PARAMETERS.format(
        fn=fn, count=len(unused), what=group.what, names=listing, fix=fix, first=unused[0][0]
    )
    return Finding(UnusedParameterWarning, message, file, line, tuple(n for n, _ in unused))


def _cut_finding(
    fn: str, file: str, line: int, group: _Group, statuses: Sequence[tuple[_Leaf, str]], total: _State
) -> Finding | None:
    cut = [leaf for leaf, s in statuses if s == "non-differentiable"]
    if not cut:
        return None
    listing = "\n".join(
        f"    {leaf.name}   (through {', '.join(op.label for op in _ops(total.origins, leaf.bit))})"
        for leaf in cut
    )
    ops = _ops(total.origins, functools.reduce(lambda x, y: x | y, [leaf.bit for leaf in cut]))
    where = (ops[0].file, ops[0].line) if ops else (file, line)
    message = NON_DIFFERENTIABLE_PARAMETERS.format(
        fn=fn, count=len(cut), what=group.what, names=listing + "\n" + _format_ops(ops)
    )
    return Finding(NonDifferentiableWarning, message, *where, tuple(leaf.name for leaf in cut))


def _findings(
    f: Any, groups: Sequence[_Group], total: _State, quiet_constant: bool
) -> list[Finding]:
    fn = _fn_name(f)
    file, line = _location(f)
    if not total.active & _all_bits(groups):
        return _whole_function(fn, file, line, groups, total, quiet_constant)
    out: list[Finding] = []
    for group in groups:
        statuses = [(leaf, _status(leaf.bit, total)) for leaf in group.leaves]
        if not any(s in ("active", "without_derivative") for _, s in statuses):
            out.extend(_whole_function(fn, file, line, [group], total, False))
            continue
        if not group.is_module:
            continue
        found = (
            _unused_finding(fn, file, line, group, statuses),
            _cut_finding(fn, file, line, group, statuses, total),
        )
        out.extend(x for x in found if x is not None)
    return out


def _whole_function(
    fn: str, file: str, line: int, groups: Sequence[_Group], total: _State, quiet_constant: bool
) -> list[Finding]:
    bits = _all_bits(groups)
    what = ", ".join(g.what for g in groups)
    paths = tuple(leaf.name for g in groups for leaf in g.leaves)
    if total.cut & bits:
        ops = _ops(total.origins, total.cut & bits)
        where = (ops[0].file, ops[0].line) if ops else (file, line)
        message = NON_DIFFERENTIABLE.format(fn=fn, what=what, ops=_format_ops(ops))
        return [Finding(NonDifferentiableWarning, message, *where, paths)]
    if total.quiet & (bits | _MARK) or quiet_constant:
        return []
    detail = " with respect to " + what
    if total.zeroed & bits:
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


def _run(
    f: Any, g: Callable[..., Any], plan: Plan, first_output_only: bool, strict: bool
) -> DiagnosticReport:
    """Trace ``g`` and analyse it; never raises unless ``strict`` (then tracing errors do)."""
    name = _fn_name(f)
    try:
        closed, shape, quiet_constant = _trace(g, plan.primals)
    except Exception as e:
        if strict:
            raise
        return DiagnosticReport(name, (), (), False, f"tracing failed: {type(e).__name__}")
    try:
        groups = _groups(f, plan)
        nin = len(closed.jaxpr.invars)
        ins = [_State(1 << (i + 1), 0, 0, 0, frozenset(), False) for i in range(nin)]
        outs = _analyse(closed.jaxpr, closed.consts, ins, False)
        if first_output_only and isinstance(shape, tuple) and len(shape) == 2:
            outs = outs[: len(jax.tree.leaves(shape[0]))]
        total = _join_all(outs) if outs else _EMPTY
        findings = tuple(_findings(f, groups, total, quiet_constant))
        activity = tuple(
            LeafActivity(leaf.name, _status(leaf.bit, total)) for g_ in groups for leaf in g_.leaves
        )
        return DiagnosticReport(name, findings, activity)
    except Exception as e:  # an analysis bug must never break differentiation
        return DiagnosticReport(name, (), (), False, f"analysis failed: {e!r}")


# (kind, function key, signature) -> the report. Keys hold code objects, tree definitions
# and abstract values, not the user's arrays; bounded like every tree-definition cache.
_CACHE: dict[Any, DiagnosticReport] = {}


_TRACER, _ARRAY, _NUMPY, _PYTHON, _OTHER = range(5)
_KINDS: dict[type, int] = {}  # a leaf's type -> how its key is made (one isinstance per type)


def _kind(t: type) -> int:
    kind = _KINDS.get(t)
    if kind is None:
        if issubclass(t, jax.core.Tracer):
            kind = _TRACER
        elif issubclass(t, jax.Array):
            kind = _ARRAY
        elif issubclass(t, (np.ndarray, np.generic)):
            kind = _NUMPY
        elif t in (bool, int, float, complex, str, type(None)):
            kind = _PYTHON
        else:
            kind = _OTHER
        bounded_put(_KINDS, t, kind)
    return kind


def _leaf_key(x: Any, depth: int, baked: bool = True) -> Any:
    """A leaf's part of the signature: its abstract value (arrays; a tracer's differs from a
    concrete array's, whose zeros the analysis can see) or its value (Python scalars)."""
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _kind(type(x))
    if kind <= _ARRAY:
        aval = x.aval
        return (kind, aval.shape, aval.dtype, getattr(aval, "weak_type", False))
    if kind == _NUMPY:
        return (kind, x.shape, x.dtype)
    if kind == _PYTHON:
        # Python values are baked into the trace, except where they are differentiated.
        return (type(x), x) if baked else type(x)
    if callable(x) and not isinstance(x, type):
        return _callable_key(x, depth + 1)
    try:
        hash(x)
    except TypeError:
        return ("id", type(x), id(x))
    return _held(x)


def _held(x: Any) -> Any:
    """``x`` as a key part, held weakly if it is equal only to itself (a ``TrainStep`` in a
    loss function's closure: the bounded cache of checks kept it, and its last model and
    state, alive after the user dropped it)."""
    if type(x).__hash__ is object.__hash__:
        try:
            return WeakIdentity(x)
        except TypeError:  # no weak references to it
            pass
    return x


def _value_key(v: Any, depth: int, baked: bool = True) -> Any:
    leaves, treedef = jax.tree.flatten(v)
    return (treedef, tuple([_leaf_key(x, depth, baked) for x in leaves]))


def _callable_key(f: Any, depth: int = 0) -> Any:
    if depth > 3:
        return ("deep", _held(f)) if _hashable(f) else ("id", id(f))
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
    return _held(f) if _hashable(f) else ("id", id(f))


def _hashable(x: Any) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _signature(kind: str, f: Any, plan: Plan) -> Any:
    differentiated = {i % len(plan.args) for i in plan.indices}
    return (
        kind,
        _callable_key(f),
        plan.indices,
        plan.patterns,  # with the arguments' signature, fixes the primals' structure
        tuple(_value_key(a, 0, i not in differentiated) for i, a in enumerate(plan.args)),
    )


def _cache_key(kind: str, f: Any, plan: Plan) -> Any:
    try:
        key = _signature(kind, f, plan)
        hash(key)
        return key
    except Exception:
        return None


def check(kind: str, fn: Any, g: Any, plan: Plan) -> None:
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
    report = _run(fn, g, plan, first_output_only=kind == "gradient", strict=False)
    if key is not None:
        bounded_put(_CACHE, key, report)
    for finding in report.findings:
        finding.emit()


class UncoveredDerivativeError(TypeError):
    """Differentiation with respect to an argument (or key path) that the registered custom
    derivative does not cover (Swift: an error). ``where`` names the argument or key path.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> def scaled(x, scale):
      ...     return scale * x
      >>> @ft.derivative(of=scaled, wrt=0)
      ... def scaled(x, scale):
      ...     return scale * x, lambda v: v * scale
      >>> try:
      ...     ft.gradient(scaled, wrt=1)(2.0, 3.0)
      ... except ft.UncoveredDerivativeError as e:
      ...     print(e.where)
      argument 1 (`scale`)
    """

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


def _zero_cotangent(y: Any) -> Any:
    dtype = jax.dtypes.float0 if not _is_inexact(y) else y.dtype
    return np.zeros(y.shape, dtype) if dtype == jax.dtypes.float0 else jax.numpy.zeros(y.shape, dtype)


def _uncovered_derivative(f: Any, plan: Plan, has_aux: bool) -> Finding | None:
    """A custom derivative that does not cover what is differentiated (the operators raise
    it), found by differentiating ``f`` abstractly (``jax.eval_shape``: no arithmetic)."""
    g = plan.wrap()

    def pulled_back(*primals: Any) -> Any:
        out = jax.vjp(g, *primals, has_aux=has_aux)
        return out[1](jax.tree.map(_zero_cotangent, out[0]))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.eval_shape(pulled_back, *plan.primals)
    except UncoveredDerivativeError as e:
        return Finding(ZeroDerivativeWarning, str(e), *_location(f), (e.where,))
    except Exception:  # any other failure is the operators' to report
        return None
    return None


def diagnose(
    f: Callable[..., Any], at: Any = inspect.Parameter.empty, *, wrt: Any = 0, has_aux: bool = False,
    nan: bool = False,
) -> Any:
    """The differentiation diagnostics of ``f`` at ``at`` as a report, without warnings.

    ``wrt`` is as in :func:`ft.gradient`; with ``has_aux=True`` only the first result is
    analysed. Without ``at``, returns a function of ``f``'s arguments giving the report.
    Runs afresh on every call (no cache), whatever ``ft.config.diagnostics`` says.

    With ``nan=True`` the report is a :class:`ft.NaNReport` instead: ``f`` and its
    gradient are run equation by equation on these values and the first operation whose
    result turned NaN or infinite is named, with its source line, phase (forward or
    backward) and the parameters' key paths (see ``functree._nan``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> report = ft.diagnose(lambda x: x.astype(jnp.int32).astype(jnp.float32), at=1.0)
      >>> report.findings[0].category.__name__
      'NonDifferentiableWarning'
      >>> report.activity
      (LeafActivity(name='<root>', status='non-differentiable'),)
      >>> ft.diagnose(lambda x: jnp.maximum(x, 0.0), at=1.0).ok
      True
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        fn = functools.partial(f, **kwargs) if kwargs else f
        if nan:
            return nan_report(fn, args, wrt=wrt, has_aux=has_aux)
        plan = Plan("diagnose", fn, args, wrt)
        report = _run(fn, plan.wrap(), plan, first_output_only=has_aux, strict=True)
        uncovered = _uncovered_derivative(fn, plan, has_aux)
        if uncovered is None:
            return report
        return dataclasses.replace(report, findings=(*report.findings, uncovered))

    return run if at is inspect.Parameter.empty else run(at)
