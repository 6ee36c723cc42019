"""Per-call cost of a jitted Adam step: functree Module vs raw jax.jit over a dict.

The work is the dispatch-bound case from ANCHORS.md: an MLP 8-16-16-1 on a batch of 4,
one Adam step per call. Both variants run interleaved in one process (blocks of calls,
alternating), so machine noise hits both alike; the table reports the median per-call
time of each and their ratio.

    python benchmarks/step_overhead.py [--rounds 30] [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import functree as ft

SIZES = (8, 16, 16, 1)


class MLP(ft.Module):
    layers: list

    def __init__(self, sizes, *, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [
            ft.nn.Dense(i, o, jax.nn.relu if n < len(sizes) - 2 else ft.nn.identity, key=k)
            for n, (i, o, k) in enumerate(zip(sizes[:-1], sizes[1:], keys))
        ]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def functree_step(lr: float):
    optimizer = ft.optim.adam(learning_rate=lr)

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @ft.jit(donate=(0, 1))
    def step(model, state, x, y):
        loss, grad = ft.value_with_gradient(loss_fn)(model, x, y)
        updates, state = optimizer.update(grad, state, model)
        return ft.move(model, along=updates), state, loss

    return optimizer, step


def minimize_step(lr: float):
    optimizer = ft.optim.Optimizer(ft.optim.adam(learning_rate=lr))

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @ft.jit(donate=(0, 1))
    def step(model, state, x, y):
        return optimizer.minimize(loss_fn, model, state, x, y)

    return optimizer, step


def train_step(lr: float):
    """``ft.train.train_step``: minimize + layer state + metrics + the non-finite check."""
    optimizer = ft.optim.Optimizer(ft.optim.adam(learning_rate=lr))

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    step = ft.train.train_step(loss_fn, optimizer)

    def call(model, state, x, y):
        return step(model, state, (x, y))

    return optimizer, call


def raw_step(lr: float):
    tx = optax.adam(lr)

    def forward(params, x):
        n = len(SIZES) - 1
        for i in range(n):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            if i < n - 1:
                x = jax.nn.relu(x)
        return x

    def loss_fn(params, x, y):
        return jnp.mean((forward(params, x) - y) ** 2)

    @jax.jit
    def step(params, state, x, y):
        loss, grad = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grad, state, params)
        return optax.apply_updates(params, updates), state, loss

    step = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
    return tx, step


def time_block(step, carry, x, y, calls):
    model, state = carry
    start = time.perf_counter()
    for _ in range(calls):
        model, state, loss = step(model, state, x, y)
    jax.block_until_ready(loss)
    return (time.perf_counter() - start) / calls * 1e6, (model, state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()

    key = jax.random.key(0)
    x = jax.random.normal(key, (4, SIZES[0]))
    y = jax.random.normal(jax.random.key(1), (4, 1))

    variants = {
        "functree Module + `ft.jit` + `ft.optim.adam` + `ft.move`": functree_step(1e-3),
        "functree `Optimizer.minimize` under `ft.jit`": minimize_step(1e-3),
        "functree `ft.train.train_step` (metrics, NaN check, layer state)": train_step(1e-3),
    }
    model = MLP(SIZES, key=key)
    carries = {}
    for name, (optimizer, _) in variants.items():
        fresh = jax.tree.map(jnp.array, model)  # each variant donates its own buffers
        carries[name] = (fresh, optimizer.init(fresh))

    params = {}
    for i, layer in enumerate(model.layers):
        params[f"w{i}"], params[f"b{i}"] = jnp.array(layer.weight), jnp.array(layer.bias)
    tx, jax_step = raw_step(1e-3)
    raw_carry = (params, tx.init(params))

    # Compile and warm up everything.
    for _ in range(3):
        _, raw_carry = time_block(jax_step, raw_carry, x, y, 50)
        for name, (_, step) in variants.items():
            _, carries[name] = time_block(step, carries[name], x, y, 50)

    raw_times: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        t, raw_carry = time_block(jax_step, raw_carry, x, y, args.calls)
        raw_times.append(t)
        for name, (_, step) in variants.items():
            t, carries[name] = time_block(step, carries[name], x, y, args.calls)
            times[name].append(t)

    raw = statistics.median(raw_times)
    device = jax.devices()[0]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{device.platform} ({device.device_kind}), jax {jax.__version__}")
    print(f"MLP {'-'.join(map(str, SIZES))}, batch 4, Adam; median of {args.rounds} rounds x {args.calls} calls")
    print("| step | µs per call | ratio |")
    print("|---|---|---|")
    print(f"| raw `jax.jit` + `optax.adam` over a dict | {raw:.1f} | 1.00 |")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {t:.1f} | {t / raw:.2f} |")


if __name__ == "__main__":
    main()
