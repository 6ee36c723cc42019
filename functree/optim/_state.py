"""``OptimizerState``: the one state of an :class:`ft.optim.Optimizer`.

An optimizer's state holds the :class:`LearningContext` once, next to the state of the
optax transformation doing the numerics::

    OptimizerState(context=LearningContext(step, sweep, samples_seen, minibatch_size, loss),
                   inner=<the transform's state: hyperparameters, moments, ...>)

Every functree transform inside reads the context from the optax extra argument
``context=`` that the optimizer passes to ``update``; their own ``HyperState`` then holds
no context (``context=None``). A functree transform used on its own, as a plain optax
``GradientTransformation``, keeps and advances a context of its own instead.

The context advances by one rule, in :meth:`Optimizer.update`: by one step and the
minibatch's samples when the update is applied, not at all when it is skipped (a
non-finite step under ``skip_non_finite``, a loss-scale overflow, ``on_nan="skip"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from functree.optim._context import LearningContext

__all__ = ["OptimizerState", "release_contexts", "unalias_state"]


@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """The state of an :class:`ft.optim.Optimizer`: one learning context and the transform's state.

    Attributes:
      context: the :class:`LearningContext` (read it with :func:`ft.optim.context`).
      inner: the optax transformation's state. Per-parameter moments in it have the
        model's parameter-view structure (read them with :func:`ft.optim.moments`);
        hyperparameters live in its ``HyperState`` nodes (:func:`ft.optim.hyperparameters`).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.Optimizer(ft.optim.adam(1e-3)).init({"w": jnp.ones(2)})
      >>> type(state).__name__, ft.optim.context(state).step
      ('OptimizerState', Array(0, dtype=int32))
    """

    context: LearningContext
    inner: Any

    def replace(self, **changes: Any) -> OptimizerState:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(OptimizerState, data_fields=["context", "inner"], meta_fields=[])


def _is_hyper(x: Any) -> bool:
    from functree.optim._hyper import HyperState

    return isinstance(x, HyperState)


def release_contexts(inner: Any) -> Any:
    """``inner`` with every functree transform's own context removed (the optimizer owns one)."""
    return jax.tree.map(lambda x: x.replace(context=None) if _is_hyper(x) else x, inner, is_leaf=_is_hyper)


def unalias_state(state: Any, model: Any) -> Any:
    """``state`` with fresh buffers wherever a leaf is a buffer the model or another leaf holds.

    Donating a step's model and state needs distinct buffers; a transform may keep the
    parameters themselves in its state (an EMA, lookahead), so the copy happens here,
    where the state is created, once.
    """
    seen = {id(x) for x in jax.tree.leaves(model) if isinstance(x, jax.Array)}

    def fresh(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if id(x) in seen:
            return x.copy()
        seen.add(id(x))
        return x

    return jax.tree.map(fresh, state)
