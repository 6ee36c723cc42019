"""``optax.MultiSteps``: around a functree optimizer, refused; around optax's own, the
gradients it holds unapplied at the end of ``Trainer.fit``, named.

MultiSteps calls the optimizer it wraps at every micro-step, with the extra arguments it
was given: a functree optimizer there would read a learning context that counts micro-steps
as steps (a schedule k times too fast), or none at all. functree accumulates gradients
itself, the same mean: ``Optimizer(tx, accumulate=k)``. optax's own optimizers inside
MultiSteps are untouched.

MultiSteps sums the gradients of ``k`` steps (minibatches) and updates at every ``k``-th:
a fit whose step count is not a multiple of ``k`` ends with the last ``mini_step``
minibatches summed and not applied (Keras's ``gradient_accumulation_steps`` too; Hugging
Face's Trainer applies a partial sum at every epoch's end). They are kept (a later fit, or
a checkpoint, goes on summing), but the model ``fit`` returns has not learnt from them:
:func:`warn_unapplied` names it (:class:`UnappliedGradientsWarning`).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import optax

__all__ = ["check_multisteps", "multisteps_in", "unapplied_microsteps", "warn_unapplied", "UnappliedGradientsWarning",
           "UNAPPLIED_GRADIENTS"]

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


class UnappliedGradientsWarning(UserWarning):
    """``Trainer.fit`` ended with gradients summed by ``optax.MultiSteps`` and not applied."""


UNAPPLIED_GRADIENTS = """\
trainer.fit ended at step {step} with the gradients of the last {n} minibatch(es) summed in \
optax.MultiSteps's state (mini_step={n}) and not applied: MultiSteps updates the parameters at \
every k-th step (every_k_schedule) only, so the model fit returns has not learnt from them. \
They are kept (another fit, or a restore of a checkpoint saved now, goes on summing them). For \
a model that has learnt from every minibatch:

    wrong:  opt = ft.optim.Optimizer(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4))
            trainer.fit(ft.train.batches(data, 8), epochs=1)    # 6 minibatches: 1 update, 2 left summed
    right:  opt = ft.optim.Optimizer(optax.adam(1e-3), accumulate=4)   # the same mean, every minibatch applied
            trainer.fit(ft.train.batches(data, 32), epochs=1)       # a last minibatch of 16: 4 of 4
       or:  trainer.fit(data, steps=n)    # n a multiple of every_k_schedule"""


def _is_multisteps(x: Any) -> bool:
    return isinstance(x, optax.MultiStepsState)


def multisteps_in(state: Any) -> list[Any]:
    """Every ``optax.MultiSteps`` state in ``state`` (a chain's member, inside a wrapper's
    state), outermost first: what the average, the lookahead and ``Trainer.fit`` read of it.

    Example:
      >>> import optax, jax.numpy as jnp
      >>> from functree.optim._multisteps import multisteps_in
      >>> state = optax.chain(optax.clip(1.0), optax.MultiSteps(optax.sgd(0.1), 2)).init({"w": jnp.ones(2)})
      >>> [int(s.mini_step) for s in multisteps_in(state)], multisteps_in(optax.sgd(0.1).init({"w": jnp.ones(2)}))
      ([0], [])
    """
    return [n for n in jax.tree.leaves(state, is_leaf=_is_multisteps) if _is_multisteps(n)]


def unapplied_microsteps(state: Any) -> int:
    """The most micro-steps an ``optax.MultiSteps`` in ``state`` has summed and not yet
    applied (its ``mini_step``; 0 where there is none). Reads the device.

    Example:
      >>> import optax, jax, jax.numpy as jnp
      >>> from functree.optim._multisteps import unapplied_microsteps
      >>> tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> with jax.numpy_dtype_promotion("standard"):  # (optax's MultiSteps divides by its int32 count)
      ...     for _ in range(6):
      ...         _, state = tx.update({"w": jnp.ones(2)}, state, params)
      >>> unapplied_microsteps(state), unapplied_microsteps(optax.sgd(0.1).init(params))
      (2, 0)
    """
    return max((int(n.mini_step) for n in multisteps_in(state)), default=0)


def warn_unapplied(state: Any, step: int, stacklevel: int = 3) -> None:
    """:class:`UnappliedGradientsWarning` (:data:`UNAPPLIED_GRADIENTS`) where ``state``
    holds gradients an ``optax.MultiSteps`` summed and has not applied, at the job's
    ``step``."""
    n = unapplied_microsteps(state)
    if n:
        warnings.warn(UNAPPLIED_GRADIENTS.format(step=step, n=n), UnappliedGradientsWarning, stacklevel=stacklevel)
