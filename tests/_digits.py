"""The multi-process tests' problem, written once for the workers and for the one-process
runs they are compared with: scikit-learn's digits, an MLP 64-128-10, cross-entropy.

functree is imported inside the functions: a worker imports this module after
``jax.distributed.initialize``, which must come before any computation.
"""

import jax
import jax.numpy as jnp
import numpy as np


def digits(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` digits: pixels scaled to [0, 1] and labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data[:n] / 16.0).astype(np.float32), d.target[:n].astype(np.int32)


def mlp(inputs: int = 64, classes: int = 10):
    """An MLP inputs-128-classes from a fixed key."""
    import functree as ft

    k = jax.random.split(jax.random.key(0), 2)
    return ft.nn.Sequential(ft.nn.Dense(inputs, 128, jax.nn.relu, key=k[0]), ft.nn.Dense(128, classes, key=k[1]))


def loss_fn(model, batch):
    """Mean cross-entropy of integer labels."""
    x, y = batch
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(model(x)), y[:, None], axis=1))
