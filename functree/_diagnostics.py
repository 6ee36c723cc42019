"""Differentiation diagnostics: activity analysis on the jaxpr (Swift's compiler checks).

Before differentiating, every operator traces the function once per abstract signature
(``jax.make_jaxpr``) and propagates, forward through the jaxpr, which differentiation
inputs each value depends on and how (below). The operator then differentiates that
jaxpr rather than trace the function a second time, so the user's Python runs once and
its warnings are emitted once; a function that hands a value out through a side channel
(a layer recording into a collector opened outside it, see :data:`SIDE_CHANNELS`) is
traced again instead. The dependences propagated:

* ``active``: through a differentiable path (the derivative can be nonzero);
* ``cut``: only through operations whose derivative is zero (comparisons, conversions to
  integers, ``round``/``floor``/``ceil``/``sign``, ``argmax``, bitwise operations, a
  ``stop_gradient`` that did not come from :func:`ft.without_derivative`);
* ``quiet``: only through :func:`ft.without_derivative` (an intentional zero);
* ``zeroed``: only through a product with a constant zero (a zero mask).

Nested jaxprs (``jit``, ``remat``, ``cond``, ``while``, ``scan``) are analysed
recursively, loops to a fixed point. A custom derivative (``custom_jvp``/``custom_vjp``,
``ft.derivative(of=)``) reaches the operands its rule gives a tangent or cotangent (its
rule is traced, not its body: a straight-through ``round`` stays differentiable), and an
operand it gives none (``None``, ``jnp.zeros_like``) is ``cut`` there; a rule that cannot
be traced alone, and unknown primitives, are assumed to depend differentiably on every
input: the analysis can miss a zero derivative but never invents one. Formally, with ``A(v)`` the active inputs of
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

This module holds the warnings, the findings made from the analysis and the driver
(``check``, ``diagnose``); the analysis itself is ``functree._activity`` and the cache key
of a function and signature ``functree._diagnostics_key``.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import inspect
import json
import re
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from functree._activity import (
    EMPTY,
    MARK,
    NEVER_SELECTED,
    STOP_GRADIENT,
    Op,
    Origin,
    State,
    analyse,
    cutting_at,
    is_inexact,
    is_known_zero,
    join_all,
)
from functree._config import config
from functree._diagnostics_key import cache_key
from functree._jit import positional_name, positional_parameters
from functree._module import DifferentiationWarning, Module
from functree._nan import nan_report
from functree._parameters import parameters
from functree._plan import Plan
from functree._source import function_name as _fn_name
from functree._source import unwrap as _unwrap
from functree._source import user_function as _user_function
from functree._traces import staged
from functree._tree import CACHE_LIMIT, bounded_put, dotted_name, is_none

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

    wrong:  {wrong}    # {first} never reaches the loss
    right:  {fix}
       or:  name: jax.Array = ft.field(no_derivative=True)   # carried, never trained
"""

NON_DIFFERENTIABLE_PARAMETERS = """\
{fn}: cannot differentiate through a non-differentiable result: {count} parameter(s) of \
{what} reach the result only through operations with a zero derivative, so their \
gradient is always zero:
{names}
Keep a differentiable path to them, or say that they are not trained:
{example}"""

CUT_EXAMPLE = """
    wrong:  jnp.where(x > self.threshold, y, 0.0)                  # no gradient for threshold
    right:  jax.nn.sigmoid((x - self.threshold) / 0.1) * y         # a smooth gate
       or:  threshold: jax.Array = ft.field(no_derivative=True)    # carried, never trained
"""

STOPPED_EXAMPLE = """
    wrong:  t = jax.lax.stop_gradient(model.target(x))       # a cut on purpose (a target network)?
    right:  t = ft.without_derivative(at=model.target(x))    # said so: no warning
       or:  ft.gradient(loss, at=model, wrt="online.*")      # differentiate only what trains
"""
"""The fix of :data:`NON_DIFFERENTIABLE_PARAMETERS` where every cut is a ``stop_gradient``:
no smooth surrogate to offer, the cut is meant (an EMA target, a frozen encoder)."""

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
            self.message, self.category, self.filename, self.lineno, registry=_REGISTRY,
            **_module_names(_module_of(self.filename)),
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


def _stood_for(f: Any) -> Any:
    """The user's function that ``f``, a library wrapper (an optimizer's objective), stands
    for, else None."""
    inner = _user_function(f)
    return None if inner is f else inner


def _argument_name(f: Any, index: int) -> str:
    # a library wrapper's argument ``index`` is its user's function's (the model); past the
    # named parameters, as the function reads it (``args[1]`` of its ``*args``)
    params = positional_parameters(_stood_for(f) or f)
    if not params[0] and params[1] is None:
        return f"argument {index}"
    return f"argument {index} (`{positional_name(index, params)}`)"


def _contains_module(x: Any) -> bool:
    leaves = jax.tree.leaves(x, is_leaf=lambda y: isinstance(y, Module))
    return isinstance(x, Module) or any(isinstance(y, Module) for y in leaves)


def _ops(origins: frozenset[Origin], bits: int) -> list[Op]:
    """The zero-derivative operations that cut any of ``bits``, sorted by label and line."""
    return sorted({o.op for o in origins if o.bits & bits and o.op.label != NEVER_SELECTED})


def _masked_note(origins: frozenset[Origin], bit: int) -> str:
    """Why a leaf is masked: a jnp.where that never selects it (its line), else a zero factor."""
    found = sorted(o.op for o in origins if o.bits & bit and o.op.label == NEVER_SELECTED)
    if not found:
        return "multiplied by a constant zero"
    op = found[0]
    return f"in {op.label}, at {op.file}:{op.line}" if op.line else f"in {op.label}"


def _format_ops(ops: Sequence[Op]) -> str:
    return "\n".join(f"    {op.label}" + (f" at {op.file}:{op.line}" if op.line else "") for op in ops)


def _placed(ops: Sequence[Op], file: str, line: int) -> tuple[str, int]:
    """Where a finding is warned: its first operation's line, else the function's."""
    return next(((op.file, op.line) for op in ops if op.line), (file, line))


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
    bit = 1  # bit 0 is MARK
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


def _status(bit: int, total: State) -> str:
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
    fn: str, file: str, line: int, group: _Group, statuses: Sequence[tuple[_Leaf, str]], total: State,
    stepped: bool = False,
) -> Finding | None:
    unused = [
        (leaf.name, f"   ({_masked_note(total.origins, leaf.bit)})" if s == "zero mask" else "")
        for leaf, s in statuses if s in _UNUSED
    ]
    if not unused:
        return None
    used = [leaf.name for leaf, s in statuses if s not in _UNUSED]
    wrt = _wrt_literal(used_patterns(used, group.parameter_names or used))
    wrong = "ft.gradient(loss, at=model)"
    if stepped:  # an optimizer's objective (a train step, a Trainer): its wrt= selects
        wrong = "ft.optim.Optimizer(transform)"
        fix = f"ft.optim.Optimizer(transform, wrt={wrt})    # or ft.train.Trainer(..., wrt=...)"
    elif group.index == 0:
        fix = f'ft.gradient(loss, at=model, wrt={wrt})    # differentiate what is used'
    else:
        fix = f"ft.gradient(loss, wrt={wrt})(model, ...)   # patterns select in argument 0"
    listing = "\n".join(f"    {n}{note}" for n, note in unused)
    message = UNUSED_PARAMETERS.format(
        fn=fn, count=len(unused), what=group.what, names=listing, fix=fix, first=unused[0][0], wrong=wrong,
    )
    return Finding(UnusedParameterWarning, message, file, line, tuple(n for n, _ in unused))


def _cut_finding(
    fn: str, file: str, line: int, group: _Group, statuses: Sequence[tuple[_Leaf, str]], total: State
) -> Finding | None:
    cut = [leaf for leaf, s in statuses if s == "non-differentiable"]
    if not cut:
        return None
    listing = "\n".join(
        f"    {leaf.name}   (through {', '.join(op.label for op in _ops(total.origins, leaf.bit))})"
        for leaf in cut
    )
    ops = _ops(total.origins, functools.reduce(lambda x, y: x | y, [leaf.bit for leaf in cut]))
    where = _placed(ops, file, line)
    stopped = all(op.label == STOP_GRADIENT for op in ops)
    message = NON_DIFFERENTIABLE_PARAMETERS.format(
        fn=fn, count=len(cut), what=group.what, names=listing + "\n" + _format_ops(ops),
        example=STOPPED_EXAMPLE if stopped else CUT_EXAMPLE,
    )
    return Finding(NonDifferentiableWarning, message, *where, tuple(leaf.name for leaf in cut))


def _findings(
    f: Any, groups: Sequence[_Group], total: State, quiet_constant: bool
) -> list[Finding]:
    fn = _fn_name(f)
    file, line = _location(f)
    if not total.active & _all_bits(groups):
        return _whole_function(fn, file, line, groups, total, quiet_constant)
    out: list[Finding] = []
    for group in groups:
        statuses = [(leaf, _status(leaf.bit, total)) for leaf in group.leaves]
        if not any(s in ("active", "without_derivative") for _, s in statuses):
            # Another argument is active, so the result is not wholly a marked constant: a
            # stopped output beside it silences nothing for this argument (its own bits do).
            out.extend(_whole_function(fn, file, line, [group], total, False, result_marked=False))
            continue
        if not group.is_module:
            continue
        found = (
            _unused_finding(fn, file, line, group, statuses, total, _stood_for(f) is not None),
            _cut_finding(fn, file, line, group, statuses, total),
        )
        out.extend(x for x in found if x is not None)
    return out


def _whole_function(
    fn: str, file: str, line: int, groups: Sequence[_Group], total: State, quiet_constant: bool,
    result_marked: bool = True,
) -> list[Finding]:
    bits = _all_bits(groups)
    what = ", ".join(g.what for g in groups)
    paths = tuple(leaf.name for g in groups for leaf in g.leaves)
    if total.cut & bits:
        ops = _ops(total.origins, total.cut & bits)
        where = _placed(ops, file, line)
        message = NON_DIFFERENTIABLE.format(fn=fn, what=what, ops=_format_ops(ops))
        return [Finding(NonDifferentiableWarning, message, *where, paths)]
    if total.quiet & (bits | (MARK if result_marked else 0)) or quiet_constant:
        return []
    detail = " with respect to " + what
    if total.zeroed & bits:
        detail += f" (it is {_masked_note(total.origins, total.zeroed & bits)})"
    message = ZERO_DERIVATIVE.format(fn=fn, what=detail)
    return [Finding(ZeroDerivativeWarning, message, file, line, paths)]


# ----------------------------------------------------------------------------- driver


class _TraceState(threading.local):
    active: bool = False  # the check's trace is running
    marked: list[Any] | None = None  # constants ft.without_derivative returned while it ran
    holding: bool = False  # and the warnings it catches will be emitted (its jaxpr may be replayed)
    confirming: bool = False  # a second trace with the call's data abstract (_confirmed) is running
    depth: int = 0  # check traces running, nested (a collector opened outside one sees its records replaced)


_TRACE = _TraceState()


def note_without_derivative(value: Any) -> None:
    """Called by ``ft.without_derivative`` with its result: a constant marked while we trace
    is intentional where the function returns it (Swift's ``withoutDerivative(at:)`` of its
    result), not where it only took part (a stopped data target beside an unused model)."""
    leaves = jax.tree.leaves(value)
    if _TRACE.active and _TRACE.marked is not None and not any(isinstance(x, jax.core.Tracer) for x in leaves):
        _TRACE.marked.extend(leaves)


SIDE_CHANNELS: list[Callable[[], Any]] = []
"""Probes of the places where a function being traced can hand values out by a side
effect rather than return them (``functree.nn``'s state collectors register theirs): each
returns a snapshot that changes when something was handed out. The check's jaxpr stands
in for a second trace of the function only when no snapshot changed while it traced."""


class _Traced(NamedTuple):
    """The check's trace of ``g``: its jaxpr, its result's shape, whether a constant was
    marked with ``ft.without_derivative``, the warnings ``g``'s Python raised (held back:
    they are the user's, emitted once, by whichever trace stands for the operator's), and
    whether ``g`` handed a value out through a side channel."""

    closed: Any
    shape: Any
    quiet_constant: bool
    caught: list[Any]
    side_effect: bool
    returned: list[Any]  # g's result leaves, for those the jaxpr returns as literals


def _trace(g: Callable[..., Any], primals: Sequence[Any], holding: bool = False) -> _Traced:
    # Nested operators (a gradient inside a differentiated function) trace inside ours.
    saved = (_TRACE.active, _TRACE.marked, _TRACE.holding, _TRACE.depth)
    _TRACE.active, _TRACE.marked, _TRACE.holding, _TRACE.depth = True, [], holding, _TRACE.depth + 1
    before = [probe() for probe in SIDE_CHANNELS]
    results: list[Any] = []

    def kept(*args: Any) -> Any:
        out = g(*args)
        results.append(out)
        return out

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            closed, shape = jax.make_jaxpr(kept, return_shape=True)(*primals)
        side_effect = [probe() for probe in SIDE_CHANNELS] != before
        returned = jax.tree.leaves(results[0])
        quiet_constant = any(r is m for r in returned for m in _TRACE.marked or ())
        return _Traced(closed, shape, quiet_constant, caught, side_effect, returned)
    finally:
        _TRACE.active, _TRACE.marked, _TRACE.holding, _TRACE.depth = saved


def _replay(traced: _Traced) -> Callable[..., Any] | None:
    """A function of the primals equal to the traced one, evaluating its jaxpr (the
    operator differentiates that instead of running the user's Python a second time), or
    None where the jaxpr cannot stand for it: a value handed out through a side channel
    (it would belong to the finished trace; the function is traced again, and warns then).
    The warnings the function raised while traced are emitted now, once. The operator
    calls the result with its own tracers (every primal is differentiated), as it would
    call the function."""
    from jax.extend import core as jcore
    outvars = traced.closed.jaxpr.outvars
    if traced.side_effect or len(traced.returned) != len(outvars):
        return None
    for w in traced.caught:
        # As Python's own warn: the module's name (a filter's module= matches it) and registry.
        module = _module_of(w.filename)
        warnings.warn_explicit(
            w.message, w.category, w.filename, w.lineno, source=w.source, **_module_names(module),
            registry=None if module is None else module.__dict__.setdefault("__warningregistry__", {}),
        )
    run = jcore.jaxpr_as_fun(traced.closed)
    # A result the jaxpr holds as a literal (not computed) is what the function returns
    # as it is: a Python number in its aux stays that number; a constant array
    # (``jnp.int32(3)``) is an array, as the function's own run makes it.
    literal = [
        None if not isinstance(v, jcore.Literal) else (x,) if type(x) in _NUMBERS else ()
        for v, x in zip(outvars, traced.returned)
    ]
    treedef = jax.tree.structure(traced.shape)  # g's result's, its leaves as shapes

    def replayed(*args: Any) -> Any:
        out = run(*jax.tree.leaves(args))
        return treedef.unflatten([
            x if kept is None else kept[0] if kept else jnp.asarray(x) for x, kept in zip(out, literal)
        ])

    return replayed


_NUMBERS = (bool, int, float, complex)


def _module_names(module: Any) -> dict[str, Any]:
    """``warn_explicit``'s ``module=`` for ``module``, or nothing: given as None, CPython
    matches no filter and drops the warning (omitted, it names the file)."""
    return {} if module is None else {"module": module.__name__}


def _module_of(filename: str) -> Any:
    """The module loaded from ``filename``, if any: a warning emitted again takes its name
    and ``__warningregistry__`` (shown once per place), as Python's own ``warn`` would."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == filename:
            return module
    return None


def _run(
    f: Any, g: Callable[..., Any], plan: Plan, first_output_only: bool, strict: bool,
    traced: list[_Traced] | None = None,
) -> DiagnosticReport:
    """Trace ``g`` and analyse it; never raises unless ``strict`` (then tracing errors do).
    ``traced``: a list that receives the trace (when it succeeded), whose warnings are held
    for the caller, which emits them if it replays the trace (see :class:`_TraceState`)."""
    name = _fn_name(f)
    try:
        trace = _trace(g, plan.primals, holding=traced is not None)
    except Exception as e:
        if strict:
            raise
        return DiagnosticReport(name, (), (), False, f"tracing failed: {type(e).__name__}")
    if traced is not None:
        traced.append(trace)
    closed, shape, quiet_constant = trace.closed, trace.shape, trace.quiet_constant
    try:
        groups = _groups(f, plan)
        outputs = None
        if first_output_only and isinstance(shape, tuple) and len(shape) == 2:
            outputs = len(jax.tree.leaves(shape[0]))
        total = _total(closed, len(closed.jaxpr.invars), call_data(plan).leaves, outputs)
        total = _settled(g, plan, total, _all_bits(groups), outputs, trace.side_effect)
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



_DATA = object()  # a constant of the trace that is the caller's data: never a known zero


class CallKeywords(functools.partial):
    """``f`` with a call's keyword arguments bound (``ft.gradient(loss)(m, x, mask=m0)``):
    the operators and :func:`diagnose` bind them so, and their leaves are the call's data,
    as its positional arguments' are. A user's own ``functools.partial`` stays a closure."""


def bind_keywords(f: Any, kwargs: dict[str, Any]) -> Any:
    """``f`` with the call's keyword arguments bound (``f`` itself when there are none)."""
    return CallKeywords(f, **kwargs) if kwargs else f


def _is_data_leaf(x: Any) -> bool:
    """A leaf a call could pass other values in: an array or a number (not a callable, a
    string array or another object carried in the tree)."""
    if isinstance(x, (jax.Array, bool, int, float, complex)):
        return True
    return isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "biufc"


class _CallData(NamedTuple):
    """The call's data (:func:`call_data`): its leaves and where they sit."""

    leaves: list[Any]
    slots: list[tuple[Any, list[Any], list[int]]]  # per tree: (treedef, its leaves, data positions)
    keywords: bool  # the last tree is the keyword arguments of a CallKeywords

    def put(self, plan: Plan, values: Sequence[Any]) -> tuple[tuple, Any]:
        """``(args, f)`` of the call with ``values`` in the data's places."""
        trees, it = [], iter(values)
        for treedef, leaves, positions in self.slots:
            leaves = list(leaves)
            for k in positions:
                leaves[k] = next(it)
            trees.append(treedef.unflatten(leaves))
        if not self.keywords:
            return tuple(trees), plan.f
        f = plan.f
        assert isinstance(f, CallKeywords)
        return tuple(trees[:-1]), CallKeywords(f.func, *f.args, **trees[-1])


def call_data(plan: Plan) -> _CallData:
    """Every leaf of the call's arguments outside the differentiated views: the batch, the
    keyword arguments, a model's ``no_derivative`` leaves and the parameters ``wrt=``
    patterns leave out (a LoRA ``B`` that is 0 now while ``A`` is trained)."""
    views = dict(zip(plan.indices, plan.primals))
    trees = [(a, views.get(i)) for i, a in enumerate(plan.args)]
    keywords = isinstance(plan.f, CallKeywords)
    if isinstance(plan.f, CallKeywords):
        trees.append((plan.f.keywords, None))
    slots, data = [], []
    for tree, view in trees:
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_none)
        marks = [None] * len(leaves) if view is None else jax.tree.leaves(view, is_leaf=is_none)
        if len(marks) != len(leaves):  # not the argument's structure: its view's leaves by identity
            chosen = {id(x) for x in jax.tree.leaves(view)}
            marks = [x if id(x) in chosen else None for x in leaves]
        positions = [k for k, (x, m) in enumerate(zip(leaves, marks)) if m is None and _is_data_leaf(x)]
        slots.append((treedef, leaves, positions))
        data += [leaves[k] for k in positions]
    return _CallData(data, slots, keywords)


def _data_as_unknown(consts: Sequence[Any], data: Sequence[Any]) -> list[Any]:
    """The trace's constants with those that are the call's data (:func:`call_data`)
    replaced by :data:`_DATA`: they are baked into the trace as constants, but another call
    passes other values, so an all-zero batch must not make a parameter read as "always a
    zero gradient" (a closure's or a literal's zero still does). Matched by identity: a
    Python number (a literal) or a NumPy array (converted) is another object in the trace;
    :func:`_confirmed` settles a zero those leave."""
    given = {id(leaf) for leaf in data}
    return [_DATA if id(c) in given else c for c in consts]


def _total(closed: Any, primals: int, data: Sequence[Any], outputs: int | None) -> State:
    """The joined state of the traced result (its first ``outputs`` leaves when given): the
    first ``primals`` inputs are the differentiated leaves, any later ones data."""
    nin = len(closed.jaxpr.invars)
    ins = [State(1 << (i + 1), 0, 0, 0, frozenset(), False) if i < primals else EMPTY for i in range(nin)]
    outs = analyse(closed.jaxpr, _data_as_unknown(closed.consts, data), ins, False)
    outs = outs if outputs is None else outs[:outputs]
    return join_all(outs) if outs else EMPTY


def _confirmed(g: Callable[..., Any], plan: Plan, data: _CallData, outputs: int | None) -> State | None:
    """The analysis on a trace where the call's data are inputs, not values, or None when
    ``g`` cannot be traced so (Python control flow on a number it is given).

    Run only when a zero mask was found and some data leaf is all zeros now
    (``ft.gradient(loss)(m, x, 0.0)``, ``np.zeros(2)``): a Python number enters the first
    trace as a literal, a NumPy array converted, so neither is known as data there. ``g``
    is ``plan.wrap()``'s (it reads ``plan.args`` and ``plan.f`` when called): they are
    swapped for the call with tracers in the data's places while it is traced."""
    def with_data_traced(primals: tuple, values: list) -> Any:
        saved = plan.args, plan.f
        plan.args, plan.f = data.put(plan, values)
        try:
            return g(*primals)
        finally:
            plan.args, plan.f = saved

    _TRACE.confirming, was = True, _TRACE.confirming  # nested operators: no check of their own
    try:
        again = _trace(with_data_traced, (tuple(plan.primals), list(data.leaves)))
    except Exception:
        return None
    finally:
        _TRACE.confirming = was
    return _total(again.closed, len(jax.tree.leaves(plan.primals)), (), outputs)


def _settled(g: Callable[..., Any], plan: Plan, total: State, bits: int, outputs: int | None,
             side_effect: bool) -> State:
    """``total``, or, when a leaf reads as zero-masked and the call's data hold an all-zero
    leaf (which may be the mask) or, for a jnp.where's constant condition, a NumPy array
    or a Python number (in the trace as a constant: it may be the condition), the
    analysis of :func:`_confirmed`; when that cannot
    run, the masked leaves count as active (the analysis may miss a zero, never invent one)."""
    if not total.zeroed & bits & ~total.active:
        return total
    data = call_data(plan)
    selected = any(o.op.label == NEVER_SELECTED for o in total.origins)
    if not any(is_known_zero(x) or (selected and not isinstance(x, jax.Array)) for x in data.leaves):
        return total
    again = None if side_effect else _confirmed(g, plan, data, outputs)
    return again if again is not None else total._replace(active=total.active | total.zeroed, zeroed=0)


def check(kind: str, fn: Any, g: Any, plan: Plan, has_aux: bool = False) -> Callable[..., Any]:
    """Analyse ``g`` (the function being differentiated) before differentiation, and return
    the function the operator differentiates.

    Called by every differential operator. The analysis and its warnings happen once per
    function and abstract signature (later calls only compute the cache key); nothing
    happens when ``ft.config.diagnostics`` is off. The function returned is, when ``g`` was
    traced now inside a jaxpr being built (``jax.jit``, a train step) and its jaxpr can
    stand for it (:func:`_replay`), a replay of that jaxpr (``g``'s Python runs once per
    compile, and its warnings are emitted once); otherwise ``g``.

    Called eagerly (no jaxpr built around: at top level, under ``jax.grad`` or ``jax.vmap``),
    ``g`` is returned even on the first call: eager differentiation compiles each operation
    it runs, and the replay's operations are not those of ``g``'s Python (jnp's jitted
    functions are inlined into primitives in a jaxpr), so a replay on the first call and
    ``g`` on the next compiled the forward pass twice, in two forms. ``g``'s Python runs
    twice on the first eager call (the check's trace, whose warnings are dropped, then the
    operator's run, which warns), then once per call, as under ``jax.grad``. With
    ``has_aux`` (``g`` returns ``(result, aux)``) only the result is analysed: a parameter
    read only by the aux has a zero derivative.
    """
    if not config.diagnostics or _TRACE.confirming:
        return g
    key = cache_key(kind + (" with aux" if has_aux else ""), fn, plan)
    if key is not None and key in _CACHE:
        return g
    traced: list[_Traced] | None = [] if staged() else None
    report = _run(fn, g, plan, first_output_only=kind == "gradient" or has_aux, strict=False, traced=traced)
    if key is not None:
        bounded_put(_CACHE, key, report)
    for finding in report.findings:
        finding.emit()
    return (_replay(traced[0]) if traced else None) or g


def reached(f: Any, g: Callable[..., Any], plan: Plan, names: frozenset[str]) -> tuple[Op, tuple[str, ...]] | None:
    """The first equation of a primitive in ``names`` (a host callback, a while loop) that
    differentiated leaves reach in ``g``'s program, and their dotted names; None when none
    does (or ``g`` cannot be traced again). Read when JAX has refused to differentiate one."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the failed operator's own trace warned already
            closed = jax.make_jaxpr(g)(*plan.primals)
        with cutting_at(names):
            total = _total(closed, len(closed.jaxpr.invars), call_data(plan).leaves, None)
    except Exception:
        return None
    leaves = [leaf for group in _groups(f, plan) for leaf in group.leaves]
    for origin in sorted(total.origins, key=lambda o: (o.op.file, o.op.line)):
        found = tuple(leaf.name for leaf in leaves if leaf.bit & origin.bits)
        if found and origin.op.label.strip("`") in names:
            return origin.op, found
    return None


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
    dtype = jax.dtypes.float0 if not is_inexact(y) else y.dtype
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
        fn = bind_keywords(f, kwargs)
        if nan:
            return nan_report(f, args, wrt=wrt, has_aux=has_aux, keywords=kwargs)
        plan = Plan("diagnose", fn, args, wrt)
        report = _run(fn, plan.wrap(), plan, first_output_only=has_aux, strict=True)
        uncovered = _uncovered_derivative(fn, plan, has_aux)
        if uncovered is None:
            return report
        return dataclasses.replace(report, findings=(*report.findings, uncovered))

    return run if at is inspect.Parameter.empty else run(at)
