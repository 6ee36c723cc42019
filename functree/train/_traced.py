"""A training step called inside the user's own JAX transformation.

``jax.jit(lambda m, s: step(m, s, batch))``, ``jax.vmap(step)`` over an ensemble, or a
``lax.scan`` of ``step`` calls: the step's arguments are the transformation's tracers. A
plain call keeps concrete bookkeeping across calls (``on_nan="stop"``'s halt log and the
inputs of the calls in flight); a traced call must not (its values die with the
transformation; kept, they broke the next plain call with UnexpectedTracerError). So it
runs the same computation, :meth:`TrainStep._logged` without a log: ``on_nan="stop"``
skips a non-finite step there (``metrics["nonfinite"]`` reports it) and raises nothing
later. Without a mesh it is the step's own jitted program (one compiled, batched
program under ``jax.vmap``, where an unjitted step would run op by op); with one, the
unjitted program body (placing concrete arrays on the mesh cannot be done to tracers;
the body constrains them itself).
"""

from __future__ import annotations

from typing import Any

__all__ = ["traced_call"]


def traced_call(step: Any, model: Any, opt_state: Any, batch: Any, key: Any) -> Any:
    """``(model, opt_state, metrics)`` of ``step`` called under a transformation.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
      >>> step = ft.train.train_step(lambda m, x: jnp.mean(m(x) ** 2), opt, donate=False)
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> m1, s1, _ = jax.jit(lambda m, s: step(m, s, jnp.ones((4, 2))))(model, opt.init(model))
      >>> m2, s2, _ = step(m1, s1, jnp.ones((4, 2)))      # a plain call afterwards
      >>> int(ft.optim.context(s2).step)
      2
    """
    if step.placement is None:
        return step.run(model, opt_state, batch, key)[:3]
    body = step._logged if step.steps_per_call == 1 else step._scanned_logged
    return body(model, opt_state, batch, key, None)[:3]
