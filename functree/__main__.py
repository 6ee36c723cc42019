"""``python -m functree``: train Swift for TensorFlow's XOR classifier and print its progress.

The model is Swift for TensorFlow's ``Classifier`` (two ``Dense`` layers with relu),
trained with Adam (learning rate 0.02) for 3000 jitted steps on the four XOR points.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import functree as ft


class Classifier(ft.Module):
    """Seed 000's XOR classifier: ``l2(l1(x))`` with relu on both layers."""

    l1: ft.nn.Dense
    l2: ft.nn.Dense

    def __init__(self, hidden_size: int, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.l1 = ft.nn.Dense(2, hidden_size, jax.nn.relu, key=k1)
        self.l2 = ft.nn.Dense(hidden_size, 1, jax.nn.relu, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.l1(x))


def mean_squared_error(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    return jnp.mean((predicted - expected) ** 2)


def main(steps: int = 3000, log_every: int = 300) -> jax.Array:
    x = jnp.array([[0, 0], [0, 1], [1, 0], [1, 1]], jnp.float32)
    y = jnp.array([[0], [1], [1], [0]], jnp.float32)
    # A relu output layer can start dead for some initial weights (the seed's design);
    # this key trains on every backend because JAX's PRNG is the same everywhere.
    model = Classifier(hidden_size=4, key=jax.random.key(4))
    optimizer = ft.optim.adam(learning_rate=0.02)
    state = optimizer.init(model)  # pyright: ignore[reportArgumentType] (optax types Params narrowly)
    print(model)

    @ft.jit(donate=(0, 1))
    def step(model, state):
        loss, grad = ft.value_with_gradient(lambda m: mean_squared_error(m(x), y), at=model)
        updates, state = optimizer.update(grad, state, model)
        return ft.move(model, along=updates), state, loss

    start = time.perf_counter()
    model, state, loss = step(model, state)
    print(f"step     1/{steps}  loss {float(loss):.3e}  (compiled in {time.perf_counter() - start:.2f} s)")
    start = time.perf_counter()
    for i in range(2, steps + 1):
        model, state, loss = step(model, state)
        if i % log_every == 0:
            # Reading the loss waits for the device, so only at log intervals: in between,
            # Python queues steps while XLA runs them (asynchronous dispatch).
            lr = ft.optim.hyperparameters(state)["learning_rate"]
            rate = (i - 1) / (time.perf_counter() - start)
            print(f"step {i:5d}/{steps}  loss {float(loss):.3e}  lr {float(lr):g}  {rate:7.0f} steps/s")

    predictions = ft.nn.inferring(model, x)
    print("predictions:", [round(float(p), 4) for p in predictions.ravel()])
    print("expected:   ", [float(t) for t in y.ravel()])
    return predictions


if __name__ == "__main__":
    main()
