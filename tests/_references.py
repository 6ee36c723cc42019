"""Reference loops written with the libraries alone, that functree's results are compared with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest

import functree as ft


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


def torch_mlp() -> tuple[Any, Any, Any, Any, Any]:
    """A torch 4-8-3 MLP and the functree model holding its weights, with 16-row batches."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = ft.nn.Sequential(ft.nn.Dense(4, 8, key=jax.random.key(0)), ft.nn.tanh,
                             ft.nn.Dense(8, 3, key=jax.random.key(1)))
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(5, 16, 4)).astype(np.float32), rng.normal(size=(5, 16, 3)).astype(np.float32)
    return torch, net, ft.nn.load_torch_state_dict(model, net.state_dict()), xs, ys
