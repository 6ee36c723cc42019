"""NaN provenance: the first operation whose result turned NaN or infinite, and where.

``ft.diagnose(f, at=x, nan=True)`` traces ``f`` once (``jax.make_jaxpr``, every array of
every argument an input) and runs the jaxpr equation by equation, eagerly, forward and
then backward:

* forward: each equation is bound on concrete values; nested programs (``jit``,
  ``remat``/``jax.checkpoint``, ``cond``, ``while``, ``scan`` iteration by iteration,
  ``custom_jvp``/``custom_vjp`` bodies) are entered, so the equation found is elementary;
* backward: the recorded equations in reverse, each one's pullback on its own
  (``jax.vjp`` of that single equation, so custom derivatives keep their rules), the
  cotangents summed per value as reverse mode does. Only values that depend on the
  differentiated parameters carry cotangents.

Every value carries an *origin*: where its non-finite entries came from. An equation
whose result has a NaN while none of its inputs (primal values and cotangents) has one,
or an infinity while its inputs are all finite, is an origin; any other result inherits
the origin of its first input of that kind. Non-finite literals (``-jnp.inf`` in a mask)
count as new at the equation that uses them, as *mask* origins: a NaN literal
(``jnp.var``'s, where ``ddof`` leaves no degree of freedom) is never preferred to a real
origin, and a pullback's result prefers its cotangents' origins to its primal inputs'. An
equation inside jnp's own jitted functions (``norm``, ``std``) records no frame of the
user's: its line is that of the user's call that reached it. The report names the origin of the loss
when the loss is not finite, else the earliest origin among the non-finite gradients:
primitive, the user's source line (the innermost frame outside JAX, functree and the
standard library), phase, and the parameters (dotted key paths) it depends on (forward)
or whose gradients it feeds (backward: the parameters its inputs depend on, bit masks
propagated with the values). A non-finite array given as an argument is the origin
itself: the report names the argument and key path. A loss and gradient that are finite
give a report with ``ok`` True, whatever intermediate infinities were masked away.

This costs one trace, one eager dispatch per equation and one compiled pullback per
distinct equation (cached by primitive, parameters and shapes): it runs only when asked,
or after a training step failed, never inside a jitted step.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree import _compat as compat
from functree._plan import Plan
from functree._source import function_name as _fn_name
from functree._source import is_user_file as _is_user_file
from functree._tree import dotted_name, is_array_or_numpy_scalar, is_none

__all__ = ["NaNReport", "nan_report", "provenance_text"]

CONSTANT_LOSS = "the loss is a non-finite constant: it is computed from no argument"
_FUNCTREE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CONTEXT_NAMES = {"remat2": "jax.checkpoint", "checkpoint": "jax.checkpoint", "remat": "jax.checkpoint",
                  "custom_jvp_call": "custom_jvp", "custom_vjp_call": "custom_vjp"}
# Custom derivatives: the body is entered forward; the pullback keeps the custom rule.
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call"})


# ----------------------------------------------------------------------------- the report


@dataclasses.dataclass(frozen=True)
class NaNReport:
    """Where a function's loss or gradient first turned non-finite (``ok``: it did not).

    ``kind`` is ``"operation"`` (an equation of the program; a non-finite constant or
    literal counts as made by the equation that reads it) or ``"input"`` (an argument
    already held NaN/inf: ``argument`` and ``path`` name it); ``"unknown"`` when the
    analysis could not run or found the run finite (``note`` says why). ``phase`` is ``"forward"`` (computing the loss),
    ``"backward"`` (computing the gradient) or ``"input"``. ``parameters`` are the dotted
    key paths of the differentiated parameters the operation depends on (forward) or
    whose gradients it feeds (backward); ``inputs`` the other arguments it reads.
    ``context`` lists the enclosing programs (``scan iteration 3 of 5``, ``remat2``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> def loss(w):
      ...     return jnp.sum(jnp.log(w))
      >>> report = ft.diagnose(loss, at=jnp.array([1.0, 0.0]), nan=True)
      >>> report.primitive, report.phase, report.value
      ('log', 'forward', '-inf (1 of 2 elements)')
      >>> ft.diagnose(loss, at=jnp.array([1.0, 2.0]), nan=True).ok
      True
    """

    function: str
    kind: str | None = None
    phase: str | None = None
    primitive: str | None = None
    file: str = ""
    line: int = 0
    value: str = ""
    parameters: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    argument: int | None = None
    path: str | None = None
    step: int | None = None
    note: str = ""
    # The error the function raised run eagerly on the same inputs (a label outside the
    # classes): the likely cause, which NonFiniteError chains as its __cause__.
    cause: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        """True when the loss and its gradient are finite (nothing to report)."""
        return self.kind is None

    @property
    def where(self) -> str:
        """``file.py:LINE`` of the operation (its file's base name)."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else "<unknown>"

    def summary(self) -> str:
        """One sentence: what turned non-finite, where, in which phase."""
        at = f" at step {self.step}" if self.step is not None else ""
        if self.kind is None:
            return f"{self.function}: loss and gradient are finite{at}"
        if self.kind == "input":
            return (f"{self.function}: {self.path} holds {self.value}{at}: given to the "
                    f"function, not computed")
        if self.kind != "operation":
            return f"{self.function}: no provenance{at}"
        what = f"the derivative of `{self.primitive}`" if self.phase == "backward" else f"`{self.primitive}`"
        return (f"{self.function}: {what} first produced {self.value} at {self.where} "
                f"({self.phase} pass{at})")

    def __str__(self) -> str:
        lines = ["NaNReport: " + self.summary()]
        if self.kind == "operation":
            lines.append(f"  line:       {self.file}:{self.line}")
            if self.context:
                lines.append(f"  inside:     {' > '.join(self.context)}")
            verb = "feeds the gradient of" if self.phase == "backward" else "depends on"
            lines.append(f"  {verb}: {', '.join(self.parameters) or '(no parameter)'}")
            if self.inputs:
                lines.append(f"  reads:      {', '.join(self.inputs)}")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = [("phase", self.phase), ("primitive", self.primitive),
                ("line", f"{self.file}:{self.line}" if self.file else None),
                ("inside", " > ".join(self.context)), ("parameters", ", ".join(self.parameters)),
                ("inputs", ", ".join(self.inputs)), ("note", self.note)]
        body = "".join(f"<tr><th>{k}</th><td><code>{html.escape(str(v))}</code></td></tr>"
                       for k, v in rows if v)
        return (f"<div><b>NaNReport</b>: {html.escape(self.summary())}"
                f"<table>{body}</table></div>")


# ----------------------------------------------------------------------------- origins


class _Origin(NamedTuple):
    """Where non-finite values were created: an equation (or an argument, a constant)."""

    order: int  # creation order: the earliest origin is the first failure
    kind: str
    phase: str
    eqn: Any
    deps: int  # bit k: depends on input leaf k (forward) / feeds its gradient (backward)
    value: str
    context: tuple[str, ...]
    leaf: int = -1
    mask: bool = False  # an intentional NaN or infinity (from a literal or constant)
    source: tuple[str, int] = ("", 0)  # the user's line (the enclosing call's inside jnp's jits)


def _inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        return False


def _flags(x: Any) -> tuple[bool, bool]:
    """(has a NaN, has an infinity), read on the host."""
    if x is None or not _inexact(x):
        return False, False
    a = np.asarray(x)
    return bool(np.isnan(a).any()), bool(np.isinf(a).any())


def _describe(x: Any) -> str:
    a = np.asarray(x)
    bad = ~np.isfinite(a)
    kinds = [name for name, m in (("nan", np.isnan(a)), ("inf", np.isposinf(a)),
                                  ("-inf", np.isneginf(a))) if m.any()]
    what = "/".join(kinds)
    return what if a.size == 1 else f"{what} ({int(bad.sum())} of {a.size} elements)"


class _Run:
    """One analysis: origin bookkeeping, the leaves' names, the parameter bits."""

    def __init__(self, param_bits: int) -> None:
        self.param_bits = param_bits
        self.count = 0

    def new(self, kind: str, phase: str, eqn: Any, deps: int, value: Any,
            context: tuple[str, ...], leaf: int = -1, enclosing: tuple[str, int] = ("", 0)) -> _Origin:
        self.count += 1
        source = ("", 0) if eqn is None else _source(eqn)
        return _Origin(self.count, kind, phase, eqn, deps, _describe(value), context, leaf,
                       source=source if source[1] else enclosing)

    def origin(self, outs: Sequence[Any], ins: Sequence[tuple[Any, _Origin | None]],
               make: Callable[[Any], _Origin], preferred: int = 0) -> list[_Origin | None]:
        """Each output's origin: inherited from a non-finite input, else new.

        NaNs and infinities from literals and constants (``-jnp.inf`` in a mask, the NaN
        ``jnp.var`` puts where ``ddof`` leaves no degree of freedom) are intentional: their
        origin is a *mask* origin, which a result inherits when it holds the same kind of
        value (an infinity from an infinity, a NaN from a NaN) and is never preferred to
        a real one (``-inf - -inf`` in a softmax of a fully masked row is new). The first
        ``preferred`` inputs' real origins come first: a pullback's cotangents (the
        gradient's own failure) before its primal inputs (a value masked forward).
        """
        out_flags = [_flags(x) for x in outs]
        if not any(n or i for n, i in out_flags):  # the common case: inputs never read back
            return [None] * len(outs)
        flags = [_flags(x) for x, _ in ins]
        real = _real(ins[:preferred], flags[:preferred]) or _real(ins, flags)
        masked = next((o for (_, o), (n, i) in zip(ins, flags) if (n or i) and o and o.mask), None)
        masked_nan = next((o for (_, o), (n, _i) in zip(ins, flags) if n and o and o.mask), None)
        loose = any((n or i) and o is None for (_, o), (n, i) in zip(ins, flags))
        loose_nan = any(n and o is None for (_, o), (n, _i) in zip(ins, flags))
        result: list[_Origin | None] = []
        for x, (n, i) in zip(outs, out_flags):
            if not (n or i):
                result.append(None)
            elif real:  # a NaN prefers an input that holds one
                result.append(next((o for o, has_nan in real if has_nan), real[0][0]) if n else real[0][0])
            elif n:
                result.append(masked_nan or (make(x)._replace(mask=True) if loose_nan else make(x)))
            else:
                result.append(masked or (make(x)._replace(mask=True) if loose else make(x)))
        return result


def _real(ins: Sequence[tuple[Any, _Origin | None]], flags: Sequence[tuple[bool, bool]]) -> list:
    """``(origin, holds a NaN)`` of the inputs that are non-finite from a real origin."""
    return [(o, n) for (_, o), (n, i) in zip(ins, flags) if (n or i) and o and not o.mask]


# ----------------------------------------------------------------------------- forward


class _Tape:
    """A jaxpr run forward: its values, dependence bits and origins, and each equation's
    nested tapes (one for a call, one per iteration for a loop, the branch for a cond)."""

    def __init__(self, jaxpr: Any, context: tuple[str, ...], enclosing: tuple[str, int]) -> None:
        self.jaxpr = jaxpr
        self.context = context
        self.enclosing = enclosing  # the user's line of the call that runs it (jnp.std's)
        self.env: dict[Any, Any] = {}
        self.deps: dict[Any, int] = {}
        self.origins: dict[Any, _Origin | None] = {}
        self.subs: list[Any] = []

    def read(self, v: Any) -> Any:
        from jax.extend import core as jcore
        return v.val if isinstance(v, jcore.Literal) else self.env[v]

    def dep(self, v: Any) -> int:
        from jax.extend import core as jcore
        return 0 if isinstance(v, jcore.Literal) else self.deps.get(v, 0)

    def org(self, v: Any) -> _Origin | None:
        from jax.extend import core as jcore
        return None if isinstance(v, jcore.Literal) else self.origins.get(v)


def _open(j: Any) -> tuple[Any, Sequence[Any]]:
    return compat.open_jaxpr(j)


def _forward(run: _Run, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
             deps: Sequence[int], origins: Sequence[_Origin | None],
             context: tuple[str, ...], enclosing: tuple[str, int] = ("", 0)) -> _Tape:
    tape = _Tape(jaxpr, context, enclosing)
    for v, c in zip(jaxpr.constvars, consts):
        tape.env[v], tape.deps[v], tape.origins[v] = c, 0, None
    for v, x, d, o in zip(jaxpr.invars, args, deps, origins):
        tape.env[v], tape.deps[v], tape.origins[v] = x, d, o
    for eqn in jaxpr.eqns:
        ins = [tape.read(v) for v in eqn.invars]
        in_deps = [tape.dep(v) for v in eqn.invars]
        in_orgs = [tape.org(v) for v in eqn.invars]
        outs, out_deps, out_orgs, sub = _forward_eqn(run, eqn, ins, in_deps, in_orgs, context, enclosing)
        tape.subs.append(sub)
        for v, x, d, o in zip(eqn.outvars, outs, out_deps, out_orgs):
            tape.env[v], tape.deps[v], tape.origins[v] = x, d, o
    return tape


def _forward_eqn(run: _Run, eqn: Any, ins: list, deps: list[int], orgs: list,
                 context: tuple[str, ...], enclosing: tuple[str, int]) -> tuple[list, list[int], list, Any]:
    name = eqn.primitive.name
    body = compat.body_of_call(eqn)
    # An equation inside jnp's own jitted functions records no frame of the user's: its
    # line is the user's call that reached it (as the activity analysis's _ENCLOSING).
    here = _source(eqn)
    inner = here if here[1] else enclosing
    if body is not None:
        jaxpr, consts = body
        label = _CONTEXT_NAMES.get(name) or name
        if name in ("jit", "pjit") and eqn.params.get("name"):
            label = f"jit({eqn.params['name']})"
        tape = _forward(run, jaxpr, consts, ins, deps, orgs, (*context, label), inner)
        outs = [tape.read(v) for v in jaxpr.outvars]
        sub = None if name in _CUSTOM else tape  # custom rules: pullback as a whole
        return outs, [tape.dep(v) for v in jaxpr.outvars], [tape.org(v) for v in jaxpr.outvars], sub
    if name == "cond":
        return _forward_cond(run, eqn, ins, deps, orgs, context, inner)
    if name == "scan":
        return _forward_scan(run, eqn, ins, deps, orgs, context, inner)
    if name == "while":
        return _forward_while(run, eqn, ins, deps, orgs, context, inner)
    outs = compat.bind_eqn(eqn, ins)
    dep = functools.reduce(lambda a, b: a | b, deps, 0)
    made = run.origin(outs, list(zip(ins, orgs)), lambda x: run.new(
        "operation", "forward", eqn, dep, x, context, enclosing=enclosing))
    return outs, [dep] * len(outs), made, None


def _forward_cond(run: _Run, eqn: Any, ins: list, deps: list[int], orgs: list,
                  context: tuple[str, ...], enclosing: tuple[str, int]) -> tuple[list, list[int], list, Any]:
    index = int(np.asarray(ins[0]))
    branches = eqn.params["branches"]
    index = min(max(index, 0), len(branches) - 1)
    jaxpr, consts = _open(branches[index])
    tape = _forward(run, jaxpr, consts, ins[1:], deps[1:], orgs[1:], (*context, f"cond branch {index}"), enclosing)
    pick = deps[0]
    outs = [tape.read(v) for v in jaxpr.outvars]
    return outs, [tape.dep(v) | pick for v in jaxpr.outvars], [tape.org(v) for v in jaxpr.outvars], (index, tape)


def _forward_scan(run: _Run, eqn: Any, ins: list, deps: list[int], orgs: list,
                  context: tuple[str, ...], enclosing: tuple[str, int]) -> tuple[list, list[int], list, Any]:
    p = eqn.params
    (nconst, ncarry), length = compat.scan_counts(p), p["length"]
    jaxpr, consts = _open(p["jaxpr"])
    c_in, carry, xs = ins[:nconst], ins[nconst:nconst + ncarry], ins[nconst + ncarry:]
    cd, carry_d, xs_d = deps[:nconst], deps[nconst:nconst + ncarry], deps[nconst + ncarry:]
    co, carry_o, xs_o = orgs[:nconst], orgs[nconst:nconst + ncarry], orgs[nconst + ncarry:]
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    tapes, ys, ys_d, ys_o = [], [], None, None
    for i in order:
        where = (*context, f"scan iteration {i} of {length}")
        tape = _forward(run, jaxpr, consts, [*c_in, *carry, *[x[i] for x in xs]],
                        [*cd, *carry_d, *xs_d], [*co, *carry_o, *xs_o], where, enclosing)
        tapes.append((i, tape))
        outs = [tape.read(v) for v in jaxpr.outvars]
        carry = outs[:ncarry]
        out_d = [tape.dep(v) for v in jaxpr.outvars]
        out_o = [tape.org(v) for v in jaxpr.outvars]
        carry_d = [a | b for a, b in zip(carry_d, out_d[:ncarry])]
        carry_o = out_o[:ncarry]
        ys.append((i, outs[ncarry:]))
        ys_d = out_d[ncarry:] if ys_d is None else [a | b for a, b in zip(ys_d, out_d[ncarry:])]
        ys_o = out_o[ncarry:] if ys_o is None else [a or b for a, b in zip(ys_o, out_o[ncarry:])]
    ys.sort(key=lambda t: t[0])
    if length == 0:
        stacked = compat.bind_eqn(eqn, ins)[ncarry:]
    else:
        stacked = [jnp.stack([y[k] for _, y in ys]) for k in range(len(jaxpr.outvars) - ncarry)]
    n_ys = len(jaxpr.outvars) - ncarry
    return ([*carry, *stacked], [*carry_d, *(ys_d or [0] * n_ys)],
            [*carry_o, *(ys_o or [None] * n_ys)], tapes)


def _forward_while(run: _Run, eqn: Any, ins: list, deps: list[int], orgs: list,
                   context: tuple[str, ...], enclosing: tuple[str, int]) -> tuple[list, list[int], list, Any]:
    p = eqn.params
    nc, nb = compat.while_counts(p)
    cj, cc = _open(p["cond_jaxpr"])
    bj, bc = _open(p["body_jaxpr"])
    c_in, b_in, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    b_d, carry_d = deps[nc:nc + nb], deps[nc + nb:]
    b_o, carry_o = orgs[nc:nc + nb], orgs[nc + nb:]
    stop = 0
    i = 0
    while True:
        test = _forward(run, cj, cc, [*c_in, *carry], [0] * (nc + len(carry)),
                        [None] * (nc + len(carry)), context, enclosing)
        stop |= functools.reduce(lambda a, b: a | b, deps[:nc] + carry_d, 0)
        if not bool(np.asarray(test.read(cj.outvars[0]))):
            break
        tape = _forward(run, bj, bc, [*b_in, *carry], [*b_d, *carry_d], [*b_o, *carry_o],
                        (*context, f"while iteration {i}"), enclosing)
        carry = [tape.read(v) for v in bj.outvars]
        carry_d = [a | tape.dep(v) for a, v in zip(carry_d, bj.outvars)]
        carry_o = [tape.org(v) for v in bj.outvars]
        i += 1
    return carry, [d | stop for d in carry_d], carry_o, None  # no pullback through while


# ----------------------------------------------------------------------------- backward


class _Cot(NamedTuple):
    value: Any
    origin: _Origin | None


def _add(run: _Run, a: _Cot | None, b: _Cot | None, eqn: Any, deps: int, tape: _Tape) -> _Cot | None:
    if a is None or b is None:
        return a or b
    total = jnp.add(a.value, b.value)
    (o,) = run.origin([total], [(a.value, a.origin), (b.value, b.origin)], lambda x: run.new(
        "operation", "backward", eqn, deps, x, tape.context, enclosing=tape.enclosing))
    return _Cot(total, o)


def _backward(run: _Run, tape: _Tape, out_cts: Sequence[_Cot | None]) -> list[_Cot | None]:
    """Cotangents of the tape's inputs from those of its outputs (None: zero)."""
    from jax.extend import core as jcore
    jaxpr = tape.jaxpr
    ct: dict[Any, _Cot | None] = {}

    def put(v: Any, c: _Cot | None, eqn: Any) -> None:
        if c is None or isinstance(v, jcore.Literal):
            return
        ct[v] = _add(run, ct.get(v), c, eqn, tape.dep(v) & run.param_bits, tape)

    for v, c in zip(jaxpr.outvars, out_cts):
        put(v, c, None)
    for eqn, sub in zip(reversed(jaxpr.eqns), reversed(tape.subs)):
        outs = [ct.pop(v, None) for v in eqn.outvars]
        if all(c is None for c in outs):
            continue
        need = [not isinstance(v, jcore.Literal) and tape.dep(v) & run.param_bits != 0
                and _inexact(v.aval) for v in eqn.invars]
        if not any(need):
            continue
        for v, c in zip(eqn.invars, _backward_eqn(run, tape, eqn, sub, outs, need)):
            put(v, c, eqn)
    return [ct.get(v) for v in jaxpr.invars]


def _backward_eqn(run: _Run, tape: _Tape, eqn: Any, sub: Any, outs: list,
                  need: list[bool]) -> list[_Cot | None]:
    name = eqn.primitive.name
    if name in compat.CALL_BODIES and isinstance(sub, _Tape):
        return _backward(run, sub, outs)
    if name == "cond" and sub is not None:
        return [None, *_backward(run, sub[1], outs)]
    if name == "scan" and sub is not None:
        return _backward_scan(run, eqn, sub, outs)
    return _pullback(run, tape, eqn, outs, need)


def _vjp(primitive: Any, params: tuple, where: tuple[int, ...], live: tuple[int, ...],
         ins: list, cts: list) -> Any:
    """The cotangents of ``ins[where]`` given those of the outputs ``live``."""
    def f(*xs: Any) -> list[Any]:
        args = list(ins)
        for k, x in zip(where, xs):
            args[k] = x
        results = compat.bind(primitive, params, args)
        return [results[k] for k in live]

    return jax.vjp(f, *[ins[k] for k in where])[1](cts)


# One executable per primitive, parameters, positions and abstract inputs (jit's cache):
# a loop body's runs, and later analyses, share it, and one compilation replaces the
# several small ones an eager jax.vjp would make.
_compiled_vjp = jax.jit(_vjp, static_argnums=(0, 1, 2, 3))


def _pullback_fn(eqn: Any, where: tuple[int, ...], live: tuple[int, ...]) -> Any:
    params = tuple(sorted(eqn.params.items()))
    try:
        hash(params)
    except TypeError:  # parameters jit cannot key on: run it eagerly
        return functools.partial(_vjp, eqn.primitive, params, where, live)
    return functools.partial(_compiled_vjp, eqn.primitive, params, where, live)


def _pullback(run: _Run, tape: _Tape, eqn: Any, outs: list, need: list[bool]) -> list[_Cot | None]:
    """The pullback of one elementary equation (custom rules included), its origins checked."""
    ins = [tape.read(v) for v in eqn.invars]
    where = [k for k, n in enumerate(need) if n]
    live = [k for k, c in enumerate(outs) if c is not None and _inexact(c.value)]
    if not live:
        return [None] * len(ins)

    cts = [outs[k].value for k in live]
    try:
        grads = _pullback_fn(eqn, tuple(where), tuple(live))(ins, cts)
    except Exception:
        try:  # a rule that needs concrete values
            grads = _vjp(eqn.primitive, tuple(eqn.params.items()), tuple(where), tuple(live), ins, cts)
        except Exception:  # no pullback (a while loop, an integer-valued rule): carries nothing
            return [None] * len(ins)
    deps = functools.reduce(lambda a, b: a | b, [tape.dep(eqn.invars[k]) for k in where], 0)
    # The cotangents first: a gradient's NaN is the backward pass's own (sqrt's derivative
    # at 0 in jnp.std) before a value the forward pass masked away (jnp.var's NaN literal).
    pairs = [(outs[k].value, outs[k].origin) for k in live]
    pairs += [(x, tape.org(v)) for v, x in zip(eqn.invars, ins)]
    made = run.origin(grads, pairs, lambda x: run.new(
        "operation", "backward", eqn, deps & run.param_bits, x, tape.context, enclosing=tape.enclosing),
        preferred=len(live))
    result: list[_Cot | None] = [None] * len(ins)
    for k, g, o in zip(where, grads, made):
        result[k] = _Cot(g, o)
    return result


def _backward_scan(run: _Run, eqn: Any, tapes: list, outs: list) -> list[_Cot | None]:
    p = eqn.params
    nconst, ncarry = compat.scan_counts(p)
    nx = len(eqn.invars) - nconst - ncarry
    carry_ct = outs[:ncarry]
    ys_ct = outs[ncarry:]
    const_ct: list[_Cot | None] = [None] * nconst
    xs_ct: dict[int, list[_Cot | None]] = {}
    for i, tape in reversed(tapes):
        body_out = [*carry_ct, *[None if c is None else _Cot(c.value[i], c.origin) for c in ys_ct]]
        in_ct = _backward(run, tape, body_out)
        const_ct = [_add(run, a, b, eqn, 0, tape) for a, b in zip(const_ct, in_ct[:nconst])]
        carry_ct = in_ct[nconst:nconst + ncarry]
        xs_ct[i] = in_ct[nconst + ncarry:]
    stacked: list[_Cot | None] = []
    for k in range(nx):
        column = [xs_ct[i][k] for i in sorted(xs_ct)]
        if all(c is None for c in column):
            stacked.append(None)
            continue
        x = eqn.invars[nconst + ncarry + k].aval
        rows = [jnp.zeros(x.shape[1:], x.dtype) if c is None else c.value for c in column]
        stacked.append(_Cot(jnp.stack(rows), next((c.origin for c in column if c and c.origin), None)))
    return [*const_ct, *carry_ct, *stacked]


# ----------------------------------------------------------------------------- driver


class _Leaf(NamedTuple):
    argument: int | None  # its position in the signature (None: a keyword it does not name)
    path: str  # dotted name inside the argument ("<root>" for the argument itself)
    parameter: bool
    keyword: str = ""  # passed by keyword: the keyword


def _leaves(plan: Plan) -> tuple[list[tuple[int, Any]], list[_Leaf], Any]:
    """The arguments' leaves that become the jaxpr's inputs, with their names."""
    views = dict(zip(plan.indices, plan.primals))
    flat, treedef = jax.tree_util.tree_flatten_with_path(plan.args, is_leaf=is_none)
    differentiated: list[bool] = []
    for i, arg in enumerate(plan.args):
        view = views.get(i, views.get(i - len(plan.args)))
        leaves = jax.tree.leaves(arg, is_leaf=is_none)
        marks = jax.tree.leaves(view, is_leaf=is_none) if view is not None else [None] * len(leaves)
        differentiated += [m is not None for m in marks]
    dynamic, names = [], []
    for k, ((path, x), d) in enumerate(zip(flat, differentiated)):
        if x is None or not (is_array_or_numpy_scalar(x) or (d and isinstance(x, (float, complex)))):
            continue
        dynamic.append((k, x))
        names.append(_Leaf(path[0].idx, dotted_name(path[1:]) or "<root>", d))
    return dynamic, names, (flat, treedef)


def _keyword_leaves(f: Any, keywords: dict[str, Any]) -> tuple[list[tuple[int, Any]], list[_Leaf], Any]:
    """The keyword arguments' array leaves, inputs as the positional ones' (never
    differentiated), each named by its keyword and its position in ``f``'s signature."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(keywords, is_leaf=is_none)
    positions = _signature(f)
    dynamic, names = [], []
    for k, (path, x) in enumerate(flat):
        if x is None or not is_array_or_numpy_scalar(x):
            continue
        keyword = str(path[0].key)
        dynamic.append((k, x))
        names.append(_Leaf(positions.index(keyword) if keyword in positions else None,
                           dotted_name(path[1:]) or "<root>", False, keyword))
    return dynamic, names, (flat, treedef)


def _signature(f: Any) -> list[str]:
    import inspect

    try:
        return list(inspect.signature(f).parameters)
    except (TypeError, ValueError):
        return []


def _argument_label(f: Any, index: int) -> str:
    import inspect

    try:
        return f"`{list(inspect.signature(f).parameters)[index]}`"
    except (TypeError, ValueError, IndexError):
        return f"argument {index}"


def _source(eqn: Any) -> tuple[str, int]:
    """The innermost frame of the equation's trace outside JAX, functree and the stdlib."""
    try:
        for frame in eqn.source_info.traceback.frames:
            name = frame.file_name
            if _is_user_file(name) and not name.startswith(_FUNCTREE):
                return name, int(frame.line_num)
    except Exception:
        pass
    return "", 0


def _label(leaf: _Leaf, labels: Sequence[str]) -> str:
    """The argument's name in backticks (a keyword's is its keyword)."""
    return f"`{leaf.keyword}`" if leaf.keyword else labels[leaf.argument or 0]


def _names(bits: int, leaves: Sequence[_Leaf], parameter: bool, labels: Sequence[str]) -> tuple[str, ...]:
    """Dotted key paths of the leaves in ``bits``: bare for the first argument's
    parameters, else prefixed by the argument's name (``batch.0``)."""
    out = []
    for k, leaf in enumerate(leaves):
        if bits >> k & 1 and leaf.parameter == parameter:
            if leaf.argument == 0 and parameter:
                out.append(leaf.path)
            else:
                name = _label(leaf, labels).strip("`")
                out.append(name if leaf.path == "<root>" else f"{name}.{leaf.path}")
    return tuple(out)


def _input_name(leaf: _Leaf, labels: Sequence[str]) -> str:
    where = "" if leaf.path == "<root>" else f", key path {leaf.path}"
    if leaf.argument is None:
        return f"keyword argument {_label(leaf, labels)}" + ("" if leaf.path == "<root>" else f" (key path {leaf.path})")
    return f"argument {leaf.argument} ({_label(leaf, labels)}{where})"


def _report(function: str, origin: _Origin, leaves: Sequence[_Leaf], labels: Sequence[str]) -> NaNReport:
    if origin.kind == "input":
        leaf = leaves[origin.leaf]
        return NaNReport(function, "input", "input", value=origin.value, argument=leaf.argument,
                         path=_input_name(leaf, labels))
    file, line = origin.source
    name = "add_any" if origin.eqn is None else origin.eqn.primitive.name  # summed cotangents
    return NaNReport(
        function, "operation", origin.phase, name, file, line, origin.value,
        _names(origin.deps, leaves, True, labels), _names(origin.deps, leaves, False, labels),
        origin.context,
    )


def nan_report(f: Callable[..., Any], args: tuple, *, wrt: Any = 0, has_aux: bool = False,
               keywords: dict[str, Any] | None = None) -> NaNReport:
    """The :class:`NaNReport` of ``f(*args, **keywords)`` and its gradient with respect to
    ``wrt`` (as in :func:`ft.gradient`); with ``has_aux`` only the first result is the
    loss. A keyword argument's arrays are inputs as a positional argument's are: a NaN
    given as ``mask=`` is named as that argument."""
    keywords = keywords or {}
    plan = Plan("diagnose", f, args, wrt)
    dynamic, leaves, (flat, treedef) = _leaves(plan)
    kw_dynamic, kw_leaves, (kw_flat, kw_treedef) = _keyword_leaves(f, keywords)
    leaves = [*leaves, *kw_leaves]
    values = [x for _, x in dynamic] + [x for _, x in kw_dynamic]

    def h(*xs: Any) -> Any:
        full, kw_full = [x for _, x in flat], [x for _, x in kw_flat]
        for (k, _), x in zip(dynamic, xs):
            full[k] = x
        for (k, _), x in zip(kw_dynamic, xs[len(dynamic):]):
            kw_full[k] = x
        return f(*jax.tree.unflatten(treedef, full), **jax.tree.unflatten(kw_treedef, kw_full))

    closed, shape = jax.make_jaxpr(h, return_shape=True)(*values)
    function = _fn_name(f)
    labels = [_argument_label(f, i) for i in range(len(args))]
    run = _Run(sum(1 << k for k, leaf in enumerate(leaves) if leaf.parameter))
    in_orgs = [run.new("input", "input", None, 1 << k, x, (), k) if any(_flags(x)) else None
               for k, x in enumerate(values)]
    tape = _forward(run, closed.jaxpr, closed.consts, values, [1 << k for k in range(len(values))],
                    in_orgs, ())
    n_loss = len(jax.tree.leaves(shape[0] if has_aux else shape))
    loss_vars = closed.jaxpr.outvars[:n_loss]
    bad = [v for v in loss_vars if any(_flags(tape.read(v)))]
    if bad:  # a non-finite value has an origin (an input, an equation) unless it is a constant
        found = [o for o in map(tape.org, bad) if o is not None]
        if not found:
            return NaNReport(function, "unknown", "forward", note=CONSTANT_LOSS)
        return _report(function, min(found, key=_order), leaves, labels)
    seeds = [_Cot(jnp.ones_like(tape.read(v)), None) if _inexact(tape.read(v)) else None for v in loss_vars]
    in_ct = _backward(run, tape, [*seeds, *[None] * (len(closed.jaxpr.outvars) - n_loss)])
    bad = [c.origin for c, leaf in zip(in_ct, leaves)
           if c is not None and leaf.parameter and c.origin is not None]
    if not bad:
        return NaNReport(function)
    return _report(function, min(bad, key=_order), leaves, labels)


def _order(origin: Any) -> int:
    return origin.order


def provenance_text(report: NaNReport | None) -> str:
    """The provenance as an error message's last paragraph ("" when there is none)."""
    return "" if report is None else "\n\nWhere it first happened:\n" + str(report)
