"""Every read of JAX's internals, in one place, for every JAX version functree supports.

functree's diagnostics (``ft.diagnose``: activity analysis and NaN provenance) walk the
jaxpr of a function: they read equation parameters of the control-flow and call primitives
(scan, while, cond, jit, remat, custom_jvp/vjp) and re-bind equations one by one. Those
parameters are JAX internals whose form changes between releases; this module is the one
place that reads them, and it understands the forms of every version in the declared range
(``pyproject.toml``: ``jax>=0.9.2``; CI tests the oldest and this machine's newest, the
GPU runs the newest release):

============================  ==========================  ================================
read                          jax 0.9 - 0.10              jax 0.11 and later
============================  ==========================  ================================
scan's consts and carry       ``num_consts``, ``num_carry``  ``ft_in`` (a FlatTree packing
                                                          consts, carry, xs)
an equation re-bound          ``get_bind_params`` -> params  the same, or ``(subfuns, params)``
                                                          (older forms)
one level of a pytree         ``jax._src.tree_util``      ``jax.tree_util`` (public from
                              (0.9)                       0.10)
the current trace             ``core.trace_ctx.trace``    ``core.trace_state_strong_ref``
                              (a thread-local attribute)  ``.value`` (from 0.10, read in C)
============================  ==========================  ================================

Anything else read here (``cond``'s ``branches``, ``while``'s ``cond_nconsts``/
``body_nconsts``, the body parameter of each call primitive) has one form across the range.
A form this module does not know raises :class:`UnsupportedJaxError` naming the JAX version
and the primitive, never a ``KeyError`` deep in a diagnostic.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from functree import _compat
    >>> closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c), c, xs))(
    ...     0.0, jnp.ones(3))
    >>> (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    >>> _compat.scan_counts(eqn.params)
    (0, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = [
    "CALL_BODIES",
    "flatten_one_level",
    "flatten_one_level_with_keys",
    "UnsupportedJaxError",
    "bind",
    "bind_eqn",
    "body_of_call",
    "jax_version",
    "open_jaxpr",
    "scan_counts",
    "sub_jaxprs",
    "while_counts",
]

UNSUPPORTED_FORM = """\
functree cannot read the {primitive} equation of this JAX version ({version}): {detail}.
This is a functree bug for the JAX versions it declares (pyproject.toml); please report it with
your `jax.__version__`. Meanwhile diagnose without that construct, or use a declared JAX version:

    pip install "jax=={tested}" "jaxlib=={tested}"
"""

# The newest release the suite ran on (the device machine); CI runs the oldest declared.
_TESTED = "0.10.2"

# Call primitives whose body runs once with the call's operands, and where its body is.
CALL_BODIES = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "remat2": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr", "named_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
}


def _tree_util(name: str) -> Any:
    public = getattr(jax.tree_util, name, None)
    if public is not None:
        return public
    from jax._src import tree_util  # jax 0.9: the same function, not yet exported

    return getattr(tree_util, name)


# One level of a pytree: ``(children, aux)`` / ``((key, child) pairs, aux)``.
flatten_one_level = _tree_util("flatten_one_level")
flatten_one_level_with_keys = _tree_util("flatten_one_level_with_keys")


class _ThreadTrace:
    """JAX before 0.10: the current trace is ``trace_ctx.trace``, a thread-local attribute."""

    __slots__ = ()

    @property
    def value(self) -> Any:
        from jax._src import core

        return core.trace_ctx.trace


def _trace_reference() -> tuple[Any, Any]:
    from jax._src import core

    strong = getattr(core, "trace_state_strong_ref", None)
    return (_ThreadTrace() if strong is None else strong), core.eval_trace


# The current trace (``CURRENT_TRACE.value``; the top level's is ``TOP_TRACE``), read by
# functree/_traces.py. From JAX 0.10 ``.value`` is read in C: no Python frame on a training
# loop's call.
CURRENT_TRACE, TOP_TRACE = _trace_reference()


def trace_of(tracer: Any) -> Any:
    """The trace a tracer belongs to (``tracer._trace``), or None."""
    return getattr(tracer, "_trace", None)


def parent_trace(trace: Any) -> Any:
    """The trace ``trace`` was opened in (``parent_trace``), or None at the top."""
    return getattr(trace, "parent_trace", None)


def traced_for(trace: Any) -> str | None:
    """What a jaxpr trace was opened for (its ``frame.debug_info.traced_for``: ``"jit"``,
    ``"scan"``...), or None for another kind of trace."""
    info = getattr(getattr(trace, "frame", None), "debug_info", None)
    value = getattr(info, "traced_for", None)
    return value if isinstance(value, str) else None


def weakly_typed(x: jax.Array) -> Any:
    """``x`` weakly typed (as ``jnp.asarray(0.5)`` is): it promotes as a Python number does.
    JAX has no public call for it; ``convert_element_type``'s private form, with
    ``weak_type``, has one signature across the declared range.

    Example:
        >>> import jax.numpy as jnp
        >>> from functree import _compat
        >>> _compat.weakly_typed(jnp.ones(2)).weak_type
        True
    """
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, weak_type=True)


class UnsupportedJaxError(RuntimeError):
    """A jaxpr equation whose parameters have a form functree does not know."""


def _invalid_input() -> type[Exception]:
    """The error JAX raises for an argument that is no JAX type (a ``jax.ShapeDtypeStruct``
    passed to ``jnp`` or a jitted function): ``InvalidInputException``, a TypeError from jax
    0.10, a bare Exception in 0.9."""
    from jax._src import dtypes

    return getattr(dtypes, "InvalidInputException", TypeError)


NOT_A_JAX_TYPE: tuple[type[Exception], ...] = (TypeError, _invalid_input())
"""What a computation given a ``jax.eval_shape`` template's leaves raises: Python's operand
TypeError (``x @ ShapeDtypeStruct``) or JAX's invalid-input error (every version)."""


def jax_version() -> tuple[int, ...]:
    """JAX's version as integers (``"0.10.2"`` -> ``(0, 10, 2)``; suffixes dropped)."""
    parts = []
    for piece in jax.__version__.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _unsupported(primitive: str, detail: str) -> UnsupportedJaxError:
    return UnsupportedJaxError(UNSUPPORTED_FORM.format(
        primitive=primitive, version=jax.__version__, detail=detail, tested=_TESTED))


def open_jaxpr(j: Any) -> tuple[Any, Sequence[Any]]:
    """``(jaxpr, consts)`` of a ``ClosedJaxpr`` or a bare ``Jaxpr`` (no consts)."""
    from jax.extend import core as jcore
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, j.consts
    return j, ()


def scan_counts(params: Any) -> tuple[int, int]:
    """How many of a scan equation's inputs are constants and carries: ``(consts, carry)``.

    The inputs are ``[*consts, *carry, *xs]`` and the body's outputs ``[*carry, *ys]`` in
    every version; only where the two counts are written changed (jax 0.11: ``ft_in``).
    """
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    packed = params.get("ft_in")
    if packed is not None and hasattr(packed, "unpack"):
        consts, carry, _ = packed.unpack()
        return len(consts), len(carry)
    raise _unsupported("scan", f"parameters {sorted(params)} name neither num_consts nor ft_in")


def while_counts(params: Any) -> tuple[int, int]:
    """How many of a while equation's inputs are the condition's and the body's constants."""
    try:
        return int(params["cond_nconsts"]), int(params["body_nconsts"])
    except KeyError:
        raise _unsupported("while", f"parameters {sorted(params)}") from None


def body_of_call(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """The ``(jaxpr, consts)`` a call equation runs once with its own operands, or None
    (not a call, or a body whose inputs and outputs are not the equation's)."""
    key = CALL_BODIES.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    jaxpr, consts = open_jaxpr(eqn.params[key])
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr, consts


def custom_function(eqn: Any) -> tuple[str, str] | None:
    """``(name, source)`` of the function a ``custom_jvp``/``custom_vjp`` equation was
    defined for (its body's ``debug_info``: ``("relu", "relu at .../jax/_src/nn/functions.py:61")``),
    or None where this JAX records neither."""
    try:
        info = eqn.params["call_jaxpr"].jaxpr.debug_info
        return str(info.func_name), str(info.func_src_info)
    except (KeyError, AttributeError):
        return None


def bind(primitive: Any, params: Any, ins: Sequence[Any]) -> list[Any]:
    """Applies a primitive with an equation's parameters to ``ins``; its outputs as a list."""
    bound = primitive.get_bind_params(dict(params))
    subfuns, kwargs = bound if isinstance(bound, tuple) else ((), bound)
    out = primitive.bind(*subfuns, *ins, **kwargs)
    return list(out) if primitive.multiple_results else [out]


def bind_eqn(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    """Runs one equation on concrete inputs, in the equation's own context."""
    with eqn.ctx.manager:  # the equation's context (compute type, thread resources)
        return bind(eqn.primitive, eqn.params, ins)


def sub_jaxprs(params: Any) -> list[Any]:
    """The jaxprs an equation's parameters hold (bodies, branches), opened."""
    return [open_jaxpr(j)[0] for j in _jaxprs_in_params(params)]


def _jaxprs_in_params(params: Any) -> list[Any]:
    """``jax.extend.core.jaxprs_in_params`` (JAX 0.10+); on 0.9, the same walk over the
    parameters' values and the tuples and lists of them (its definition there)."""
    from jax.extend import core as jcore
    found = getattr(jcore, "jaxprs_in_params", None)
    if found is not None:
        return list(found(params))
    kinds = (jcore.Jaxpr, jcore.ClosedJaxpr)
    out = []
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, kinds):
                out.append(x)
    return out
