"""A user's optax transformation as one that takes optax's extra arguments.

functree's optimizers receive their learning context (and a loss, for a schedule that
reads it) as extra arguments of ``update``. ``optax.with_extra_args_support`` passes them
only to a ``GradientTransformationExtraArgs``; a transformation of another class whose
``update`` takes them anyway (a user's class with ``update(updates, state, params,
**extra_args)``) gets them here. ``optax.MultiSteps`` forwards them to the optimizer it
wraps at every micro-step: a functree optimizer there would count micro-steps as steps
(a schedule k times too fast), so it is refused for ``Optimizer(tx, accumulate=k)``.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import optax

__all__ = ["with_extra_args", "check_multisteps"]

FUNCTREE_IN_MULTISTEPS = """\
optax.MultiSteps wraps a functree optimizer: its learning context (steps, samples seen, the \
minibatch size of per-sample rates) would count each micro-batch as a step, so a schedule \
would run k times too fast. functree accumulates gradients itself, the same mean:

    wrong:  ft.optim.Optimizer(optax.MultiSteps(ft.optim.adam(schedule), every_k_schedule=4))
    right:  ft.optim.Optimizer(ft.optim.adam(schedule), accumulate=4)"""


def with_extra_args(transform: Any) -> optax.GradientTransformationExtraArgs:
    """``transform`` taking ``update``'s extra keyword arguments where its ``update`` does.

    Example:
      >>> import optax
      >>> from functree.optim._extra_args import with_extra_args
      >>> isinstance(with_extra_args(optax.MultiSteps(optax.adam(0.1), 2)), optax.GradientTransformationExtraArgs)
      True
    """
    if isinstance(transform, optax.GradientTransformationExtraArgs):
        return transform
    if isinstance(transform, optax.MultiSteps):
        return _multisteps(transform)
    if not isinstance(transform, optax.GradientTransformation) and _takes_extra_args(transform.update):
        return optax.GradientTransformationExtraArgs(transform.init, transform.update)
    return optax.with_extra_args_support(transform)


def _takes_extra_args(update: Any) -> bool:
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _multisteps(transform: optax.MultiSteps) -> optax.GradientTransformationExtraArgs:
    """``optax.MultiSteps`` taking its inner optimizer's extra arguments (a functree one is
    refused by ``Optimizer.init``: :func:`check_multisteps`)."""
    return optax.GradientTransformationExtraArgs(transform.init, transform.update)  # pyright: ignore[reportArgumentType]


def check_multisteps(state: Any, functree_state: type) -> None:
    """Refuse an ``optax.MultiSteps`` state (anywhere in ``state``: a chain's member, its
    ``gradient_transformation()``) whose inner optimizer is functree's (its state holds a
    ``functree_state``: ``HyperState``, passed in: this module imports no optimizer)."""

    def is_node(x: Any) -> bool:
        return isinstance(x, (functree_state, optax.MultiStepsState))

    for node in jax.tree.leaves(state, is_leaf=is_node):
        if isinstance(node, optax.MultiStepsState) and any(
                isinstance(x, functree_state) for x in jax.tree.leaves(node.inner_opt_state, is_leaf=is_node)):
            raise TypeError(FUNCTREE_IN_MULTISTEPS)
