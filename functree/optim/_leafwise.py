"""The gated update leaf by leaf: one small ``lax.cond`` per parameter instead of one large one.

A gated step (``on_nan="stop"``/``"skip"``, ``enabled=``) applies the update only when its
gate is open. :func:`functree.optim._skip.apply_or_keep` puts the whole update inside one
``lax.cond``. On XLA:CPU every kernel of that branch (about three per parameter for Adam:
the parameter and its two moments) becomes ready at the same moment, when the predicate
is known; the thunk executor then hands half of the ready kernels to its thread pool and
waits for them, and a tiny step pays that hand-off each call (1.5–5× raw JAX's ungated
step, the more the busier the machine). In an ungated step the same kernels become ready
one by one as the backward pass produces the gradients.

For a transform that is **separable** (each parameter's update and moments depend on that
parameter's gradient, value and moments and on shared scalars only: step counts,
hyperparameters, the learning context) the update splits exactly: parameter ``i``'s branch
runs the transform on a tree holding parameter ``i`` alone (``None`` elsewhere, so names
and masks by key path still see the model's structure) and writes that parameter and its
moments in place. Each branch holds a few kernels, which XLA:CPU runs in order on the
calling thread; the shared state (counts, hyperparameters) comes from the first branch
and the learning context from a select on the gate. A closed gate keeps every buffer, bit
for bit, as the one large ``cond`` does.

What is separable is declared, never guessed: :func:`separable` marks the transforms that
are (functree's optimizer functions mark themselves); any other transform, chain or
wrapper runs through the one large ``cond``. So do optimizers with hooks that change the
update (``apply_updates=``, a subclass overriding ``update``), ``wrt=``, ``average=``,
complex parameters, partial gradients, recorded layer state, and every backend but the
CPU: on an accelerator the kernels of a branch are queued in order on the device, with
no thread pool to hand them to, while a conditional per parameter would multiply whatever
a conditional costs there (reasoning; no accelerator was measured).

No host synchronisation: the gate's predicate is computed inside the step (``is_finite``,
``reduce``, ``compare`` on the gradients) and the lowered program holds no callback,
transfer, infeed/outfeed or token (tests/test_step_structure.py checks the StableHLO).
A ``stablehlo.case`` on a device value is device control flow: on the CPU the predicate
is in the memory the host runs from; on a TPU the core branches itself. On a GPU
(measured on an H100 with jax 0.11.2, ``benchmarks/gate_pipeline.py``) 20 back-to-back
gated steps of a 4.3 ms step return after 4.7% of their time, as raw JAX's ungated ones
(3.3%) do, and the gate costs that step 1.03×: the host is not made to wait. The compiled
GPU program holds the one ``conditional`` and no host transfer.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp

from functree._tangent import move_leaf
from functree.optim._context import advance, current
from functree.optim._skip import select
from functree.optim._state import OptimizerState

__all__ = ["separable", "is_separable", "leafwise_gated_update", "ENABLED", "MAX_PARAMETERS"]

ENABLED = True
"""Whether gated steps of separable transforms on the CPU run leaf by leaf (read while the
step traces; tests and benchmarks compare both ways by switching it off)."""

MAX_PARAMETERS = 48
"""Leaf by leaf only up to this many parameters. Measured on the 2-core machine, loaded by
other processes (issue 30; ratios to raw JAX's ungated step, wall and CPU time): MLPs of
width 16, batch 4, Adam, gated step leaf by leaf against one ``cond``: 6 parameters 1.51×
against 2.86×, 24 parameters 1.18× (CPU 1.25×) against 1.48× (1.80×), 40 parameters 1.32×
(1.27×) against 1.54× (1.59×), 64 parameters 1.14× (1.18×) against 1.00× (1.32×): no
clear gain; the update of 150 parameters (a 12-layer transformer at d=64) 1.65× against
1.45× optax's, with 1.5–2× the trace and compile time."""

_SEPARABLE: weakref.WeakSet[Any] = weakref.WeakSet()


def separable(transform: Any) -> Any:
    """``transform``, declared separable: its update of each parameter (and that parameter's
    moments) reads only that parameter's gradient, value and moments, and state shared by
    all parameters (counts, hyperparameters). Returns ``transform``.

    Declaring a transform that is not (a per-tensor norm, a global norm, a matrix
    orthogonalisation, state mixing parameters) would change its numbers: only functree's
    optimizer functions, whose numerics are elementwise, are declared.
    """
    _SEPARABLE.add(transform.update)
    return transform


def is_separable(transform: Any) -> bool:
    """Whether ``transform`` was declared with :func:`separable`."""
    update = getattr(transform, "update", None)
    try:
        return update in _SEPARABLE
    except TypeError:  # not weakly referenceable: never declared
        return False


def _floating(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def leafwise_gated_update(transform: Any, ok: Any, grads: Any, model: Any, state: Any, params: Any, *,
                          minibatch_size: Any = None, loss: Any = None) -> tuple[Any, Any] | None:
    """``(new_params, new_state)`` of one gated step of the separable ``transform`` (the
    Optimizer's wrapped transform; ``state`` its :class:`OptimizerState`), one ``lax.cond``
    on ``ok`` per parameter; ``None`` when this does not apply (then the caller runs its
    one ``cond``): switched off, not the CPU, fewer than two parameters or more than
    :data:`MAX_PARAMETERS`, a parameter
    that is not a real floating array, or gradients that are not one array per parameter
    of the parameter's shape and dtype (the caller's checks report those)."""
    if not ENABLED or jax.default_backend() != "cpu" or not isinstance(state, OptimizerState):
        return None
    p_leaves, p_def = jax.tree.flatten(params)
    g_leaves, g_def = jax.tree.flatten(grads)
    if (not 2 <= len(p_leaves) <= MAX_PARAMETERS or g_def != p_def or not all(_floating(p) for p in p_leaves)
            or any(not isinstance(g, jax.Array) or g.shape != p.shape or g.dtype != p.dtype
                   for g, p in zip(g_leaves, p_leaves))):
        return None

    def per_parameter(x: Any) -> bool:  # a subtree shaped like the parameters: moments
        return jax.tree.structure(x) == p_def

    nodes, s_def = jax.tree.flatten(state.inner, is_leaf=per_parameter)
    moments = [i for i, x in enumerate(nodes) if per_parameter(x)]
    shared = [i for i, x in enumerate(nodes) if not per_parameter(x) and isinstance(x, jax.Array)]
    moment_leaves = {k: jax.tree.leaves(nodes[k]) for k in moments}
    for k in moments:
        if any(m.shape != p.shape for m, p in zip(moment_leaves[k], p_leaves)):
            return None
    ctx = current(state.context, minibatch_size, loss)
    n = len(p_leaves)

    def alone(i: int, x: Any) -> Any:  # the parameter tree holding x at parameter i, None elsewhere
        return p_def.unflatten([x if j == i else None for j in range(n)])

    def branch(i: int) -> Any:
        def apply(ops: tuple[Any, list[Any], list[Any]]) -> tuple[Any, list[Any], list[Any]]:
            p, ms, sh = ops
            inner = list(nodes)
            for k, m in zip(moments, ms):
                inner[k] = alone(i, m)
            for k, v in zip(shared, sh if i == 0 else [nodes[k] for k in shared]):
                inner[k] = v
            with jax.numpy_dtype_promotion("standard"):  # optax mixes float hyperparameters and int counts
                updates, new = transform.update(alone(i, g_leaves[i]), s_def.unflatten(inner), alone(i, p),
                                                context=ctx)
            new_nodes = s_def.flatten_up_to(new)
            new_ms = [jax.tree.leaves(new_nodes[k])[0] for k in moments]
            new_sh = [new_nodes[k] for k in shared] if i == 0 else []
            return move_leaf(jax.tree.leaves(updates)[0], p), new_ms, new_sh

        return apply

    def keep(ops: Any) -> Any:
        return ops

    new_p, new_m, new_shared = [], {k: [] for k in moments}, []
    for i in range(n):
        ops = (p_leaves[i], [moment_leaves[k][i] for k in moments], [nodes[k] for k in shared] if i == 0 else [])
        p, ms, sh = jax.lax.cond(ok, branch(i), keep, ops)
        new_p.append(p)
        for k, m in zip(moments, ms):
            new_m[k].append(m)
        if i == 0:
            new_shared = sh
    out = list(nodes)
    for k in moments:
        out[k] = p_def.unflatten(new_m[k])
    for k, v in zip(shared, new_shared):
        out[k] = v
    new_state = OptimizerState(select(ok, advance(state.context, minibatch_size, loss), state.context),
                               s_def.unflatten(out))
    return p_def.unflatten(new_p), new_state
