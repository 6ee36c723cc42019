"""Which JAX trace a value belongs to, and whether code runs under a transformation.

JAX (0.4.36 and later) keeps one current trace per thread: the evaluation trace at top
level, and inside ``jax.jit``, ``jax.vmap``, ``jax.lax.scan``... a trace whose
``parent_trace`` is the trace it was opened in. A tracer belongs to one trace
(``tracer._trace``). A value recorded while some trace ``T`` was current may be used at
``T`` or inside it, never outside: a tracer of a trace that is neither ``T`` nor one of
``T``'s ancestors leaked out of a transformation opened after ``T``.

JAX exposes the current trace only privately; :mod:`functree._compat` reads it (every read
of JAX's internals is there), for every JAX version functree supports.
"""

from __future__ import annotations

from typing import Any

from jax.core import Tracer

from functree._compat import CURRENT_TRACE, TOP_TRACE, parent_trace, trace_of, traced_for

__all__ = ["CURRENT", "TOP", "current_trace", "inner_trace", "staged", "transform_name", "under_transformation", "under_vmap"]

# ``CURRENT.value is not TOP``: under a transformation (read in C from JAX 0.10).
CURRENT: Any = CURRENT_TRACE
TOP: Any = TOP_TRACE


def under_transformation() -> bool:
    """Whether code runs inside a JAX transformation (``jax.jit``, ``jax.vmap``,
    ``lax.scan``, ``jax.grad``...): the current trace is not the top-level evaluation.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._traces import under_transformation
      >>> under_transformation()
      False
      >>> bool(jax.jit(lambda x: jnp.asarray(under_transformation()))(1.0))
      True
    """
    return CURRENT.value is not TOP


def staged() -> bool:
    """Whether a jaxpr is being built around the code (``jax.jit``, ``jax.make_jaxpr``,
    ``jax.eval_shape``, ``jax.checkpoint``, ``lax.scan``'s body...): what it binds is
    compiled later as a whole. False at top level and under transformations that run
    eagerly, operation by operation (``jax.grad``, ``jax.vmap`` called outside any jit).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._traces import staged
      >>> seen = []
      >>> _ = jax.jit(lambda x: seen.append(staged()) or x)(1.0), jax.grad(lambda x: seen.append(staged()) or x)(1.0)
      >>> seen
      [True, False]
    """
    trace = CURRENT.value
    while trace is not None and trace is not TOP:
        if traced_for(trace) is not None:
            return True
        trace = parent_trace(trace)
    return False


def under_vmap() -> bool:
    """Whether a ``jax.vmap`` is open around the call (a loop or jit inside it included):
    a per-example vmap, whose layers see one example at a time.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._traces import under_vmap
      >>> seen = []
      >>> _ = jax.vmap(lambda x: seen.append(under_vmap()) or x)(jnp.ones(2)), jax.jit(lambda x: seen.append(under_vmap()) or x)(1.0)
      >>> seen
      [True, False]
    """
    trace = CURRENT.value
    while trace is not None:
        if transform_name(trace) == "jax.vmap":
            return True
        trace = parent_trace(trace)
    return False


def current_trace() -> Any:
    """The trace current now (an opaque object: compare it with :func:`inner_trace`)."""
    return CURRENT.value


def opened_inside(trace: Any) -> Any | None:
    """The current trace if it was opened inside ``trace`` (a transformation the code runs
    under that ``trace`` does not include), else None.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._traces import current_trace, opened_inside, transform_name
      >>> top, seen = current_trace(), []
      >>> _ = jax.vmap(lambda x: seen.append(opened_inside(top)) or x)(jnp.ones(2))
      >>> transform_name(seen[0]), opened_inside(top)
      ('jax.vmap', None)
    """
    now = current_trace()
    return None if id(now) in _ancestry(trace) else now


def _ancestry(trace: Any) -> set[int]:
    """``id`` of ``trace`` and of every trace it was opened in."""
    ids = set()
    while trace is not None:
        ids.add(id(trace))
        trace = parent_trace(trace)
    return ids


def inner_trace(values: Any, trace: Any) -> tuple[int, Any] | None:
    """``(index, trace)`` of the first of ``values`` that is a tracer of a trace opened
    inside ``trace`` (neither ``trace`` nor one of its ancestors: it leaked out of a
    transformation), else None. Concrete values and tracers of ``trace`` or of the
    traces around it are fine.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._traces import current_trace, inner_trace
      >>> top, kept = current_trace(), []
      >>> _ = jax.vmap(lambda x: kept.append(x * 2) or x)(jnp.ones(3))
      >>> inner_trace([jnp.ones(2), kept[0]], top)[0]
      1
    """
    known: set[int] | None = None
    for i, value in enumerate(values):
        if not isinstance(value, Tracer):
            continue
        owner = trace_of(value)
        if known is None:
            known = _ancestry(trace)
        if owner is not None and id(owner) not in known:
            return i, owner
    return None


# What a DynamicJaxprTrace was opened for (JAX's debug_info.traced_for), as the user wrote it.
_TRACED_FOR = {
    "jit": "jax.jit",
    "pjit": "jax.jit",
    "scan": "jax.lax.scan (or jax.lax.map)",
    "cond": "jax.lax.cond (or jax.lax.switch)",
    "switch": "jax.lax.switch",
    "while_body": "jax.lax.while_loop",
    "while_cond": "jax.lax.while_loop",
    "fori_loop": "jax.lax.fori_loop",
    "checkpoint / remat": "jax.checkpoint",
    "make_jaxpr": "jax.make_jaxpr",
}

_TRACE_TYPES = {
    "BatchTrace": "jax.vmap",
    "JVPTrace": "jax.jvp",
    "LinearizeTrace": "jax.grad / jax.vjp / jax.linearize",
    "ShardMapTrace": "jax.shard_map",
}


def transform_name(trace: Any) -> str:
    """The transformation that opened ``trace``, as the user calls it (``"jax.vmap"``,
    ``"jax.lax.scan (or jax.lax.map)"``), best effort.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._traces import current_trace, transform_name
      >>> seen = []
      >>> _ = jax.lax.scan(lambda c, x: (seen.append(current_trace()), (c, x))[1], 0.0, jnp.ones(2))
      >>> transform_name(seen[0])
      'jax.lax.scan (or jax.lax.map)'
    """
    kind = type(trace).__name__
    if kind in _TRACE_TYPES:
        return _TRACE_TYPES[kind]
    opened_for = traced_for(trace)
    if opened_for is not None:
        return _TRACED_FOR.get(opened_for, opened_for)
    return f"a JAX transformation ({kind})"
