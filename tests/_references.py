"""Reference loops written with the libraries alone, that functree's results are compared with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax


def optax_lbfgs(fn: Callable[[Any], Any], params: Any, steps: int) -> Any:
    """``params`` after ``steps`` of optax's documented L-BFGS loop on ``fn``:
    ``value_and_grad_from_state``, then ``update(grad, state, params, value=, grad=, value_fn=)``."""
    with jax.numpy_dtype_promotion("standard"):  # optax's line search mixes weak and strong types
        tx, value_and_grad = optax.lbfgs(), optax.value_and_grad_from_state(fn)

        @jax.jit
        def step(p: Any, s: Any) -> Any:
            value, grad = value_and_grad(p, state=s)
            updates, s = tx.update(grad, s, p, value=value, grad=grad, value_fn=fn)
            return optax.apply_updates(p, updates), s

        state = tx.init(params)
        for _ in range(steps):
            params, state = step(params, state)
    return params
