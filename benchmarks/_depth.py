"""Family 10: first call (trace + compile + run) of an Adam train step against depth.

A residual block (LayerNorm, Dense d→4d, GELU, Dense 4d→d) repeated 4, 16 and 64 times:
functree's ``ft.nn.Stack`` (``lax.scan`` over stacked parameters), functree's
``ft.nn.Sequential`` of the same blocks (unrolled) and raw JAX + optax with the
parameters stacked by hand and applied with ``jax.lax.scan``. Targets: a 64-block Stack
≤ 2× a 4-block Stack, and ≤ 1.3× raw ``lax.scan`` at 64 blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import Table, interleave, paired_rows, timed

import functree as ft

D, BATCH = 64, 32
RAW_SCAN, STACK, SEQUENTIAL = "raw lax.scan", "functree Stack", "functree Sequential"


class Block(ft.Module):
    norm: ft.nn.LayerNorm
    up: ft.nn.Dense
    down: ft.nn.Dense

    def __init__(self, d: int, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm = ft.nn.LayerNorm(d)
        self.up = ft.nn.Dense(d, 4 * d, jax.nn.gelu, key=k1)
        self.down = ft.nn.Dense(4 * d, d, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(self.up(self.norm(x)))


def _batch() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32), jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32)


def _mse(model: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _functree(n: int, unrolled: bool) -> Callable[[], Any]:
    """A fresh train step and its inputs; the returned call is its first call."""
    model: Any = ft.nn.Stack(lambda k: Block(D, key=k), n, key=jax.random.key(0))
    if unrolled:
        model = model.unstack()
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
    step, state, batch = ft.train.train_step(_mse, opt), opt.init(model), _batch()
    return lambda: step(model, state, batch)


def _raw_block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["offset"]
    h = jax.nn.gelu(h @ p["w1"] + p["b1"])
    return x + h @ p["w2"] + p["b2"]


def _raw(n: int) -> Callable[[], Any]:
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "scale": jnp.ones((n, D)), "offset": jnp.zeros((n, D)),
        "w1": jax.random.normal(keys[0], (n, D, 4 * D)) / np.sqrt(D), "b1": jnp.zeros((n, 4 * D)),
        "w2": jax.random.normal(keys[1], (n, 4 * D, D)) / np.sqrt(4 * D), "b2": jnp.zeros((n, D)),
    }
    tx = optax.adam(1e-3)

    def loss(p: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        out, _ = jax.lax.scan(lambda h, q: (_raw_block(h, q), None), x, p)
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(p: Any, s: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    state, batch = tx.init(params), _batch()
    return lambda: step(params, state, batch)


def _first_call(build: Callable[[], Callable[[], Any]]) -> Callable[[], float]:
    def run() -> float:
        call = build()  # model construction and step building not timed
        return timed(call)
    return run


def depth(quick: bool) -> list[Table]:
    """10. First call of the train step at 4, 16 and 64 blocks: Stack, Sequential, raw scan."""
    jax.block_until_ready(jnp.ones(1))
    rounds = 1 if quick else 3
    tables, medians = [], {}
    for n in (4, 16, 64):
        variants = {RAW_SCAN: lambda n=n: _raw(n), STACK: lambda n=n: _functree(n, False)}
        if not (quick and n == 64):  # unrolled 64 blocks takes minutes to compile
            variants[SEQUENTIAL] = lambda n=n: _functree(n, True)
        values = interleave({name: _first_call(b) for name, b in variants.items()}, rounds)
        rows = paired_rows(values, RAW_SCAN, scale=1e3)
        for row in rows:
            medians[(row.name, n)] = row.median
        table = Table(f"depth-{n}", f"10. First call (trace + compile + run), Adam step: {n} residual blocks "
                      f"(LayerNorm, Dense {D}→{4 * D}, GELU, Dense {4 * D}→{D}), batch {BATCH}", "ms",
                      "functree Stack ≤ 1.3× raw lax.scan at 64 blocks", rows)
        table.notes.append(f"median of {rounds} interleaved rounds, each on a freshly built step")
        tables.append(table)
    growth = medians[(STACK, 64)] / medians[(STACK, 4)]
    scan_ratio = next(r.ratio for r in tables[-1].rows if r.name == STACK)
    for row in tables[-1].rows:
        if row.name == STACK:
            row.ok = growth <= 2.0 and scan_ratio is not None and scan_ratio <= 1.3
    tables[-1].notes.append(f"Stack at 64 blocks / Stack at 4 blocks: {growth:.2f}× (target ≤ 2×)")
    tables[-1].checks = {"stack_64_over_4": growth}
    return tables
