"""``optax.MultiSteps`` around a functree optimizer, refused.

MultiSteps calls the optimizer it wraps at every micro-step, with the extra arguments it
was given: a functree optimizer there would read a learning context that counts micro-steps
as steps (a schedule k times too fast), or none at all. functree accumulates gradients
itself, the same mean: ``Optimizer(tx, accumulate=k)``. optax's own optimizers inside
MultiSteps are untouched.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

__all__ = ["check_multisteps"]

FUNCTREE_IN_MULTISTEPS = """\
optax.MultiSteps wraps a functree optimizer: its learning context (steps, samples seen, the \
minibatch size of per-sample rates) would count each micro-batch as a step, so a schedule \
would run k times too fast. functree accumulates gradients itself, the same mean:

    wrong:  ft.optim.Optimizer(optax.MultiSteps(ft.optim.adam(schedule), every_k_schedule=4))
    right:  ft.optim.Optimizer(ft.optim.adam(schedule), accumulate=4)"""


def check_multisteps(state: Any, functree_state: type) -> None:
    """Refuse an ``optax.MultiSteps`` state (anywhere in ``state``: a chain's member, its
    ``gradient_transformation()``) whose inner optimizer is functree's (its state holds a
    ``functree_state``: ``HyperState``, passed in by ``Optimizer.init``).

    Example:
      >>> import optax, functree as ft, jax.numpy as jnp
      >>> from functree.optim._hyper import HyperState
      >>> state = optax.MultiSteps(ft.optim.sgd(0.1), 2).init({"w": jnp.ones(2)})
      >>> try:
      ...     check_multisteps(state, HyperState)
      ... except TypeError as e:
      ...     print(str(e).split(":")[0])
      optax.MultiSteps wraps a functree optimizer
    """

    def is_node(x: Any) -> bool:
        return isinstance(x, (functree_state, optax.MultiStepsState))

    for node in jax.tree.leaves(state, is_leaf=is_node):
        if isinstance(node, optax.MultiStepsState) and any(
                isinstance(x, functree_state) for x in jax.tree.leaves(node.inner_opt_state, is_leaf=is_node)):
            raise TypeError(FUNCTREE_IN_MULTISTEPS)
