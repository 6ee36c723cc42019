"""Family 4: optimizer update throughput — Adam over 16M parameters in 16 leaves, GB/s.

One jitted, donated update per call (gradients given): optax's ``adam`` +
``apply_updates`` against functree's ``Optimizer(ft.optim.adam)`` ``update`` + ``ft.move``
and ``apply_gradients``. Throughput counts the memory Adam must touch, 28 bytes per
float32 parameter: read parameter, gradient, m and v; write parameter, m and v.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from _harness import Table, carried_updates, interleave, paired_rows
from _impls import functree_apply, optax_update
from _models import LEARNING_RATE

import functree as ft

LEAVES = 16
LEAF_SHAPE = (1024, 1024)  # 16 × 1 048 576 = 16.8M parameters
BYTES_PER_PARAM = 7 * 4


def _tree(seed: int) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), LEAVES)
    return {f"w{i:02d}": jax.random.normal(k, LEAF_SHAPE, jnp.float32) for i, k in enumerate(keys)}


def _functree_update():
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))

    @ft.jit(donate=(0, 1))
    def update(model, state, grads):
        updates, state = opt.update(grads, state, model)
        return ft.move(model, along=updates), state

    model = _tree(0)
    return update, model, opt.init(model)


def optimizer_throughput(quick: bool) -> list[Table]:
    rounds, calls = (3, 2) if quick else (15, 5)
    if jax.default_backend() != "cpu":  # an update takes ~0.2 ms there: amortise the first call's dispatch
        calls *= 10
    grads = _tree(1)
    n = LEAVES * LEAF_SHAPE[0] * LEAF_SHAPE[1]
    gigabytes = n * BYTES_PER_PARAM / 1e9
    variants = {"optax adam + apply_updates": optax_update(_tree(0)),
                "functree opt.update + ft.move": _functree_update(),
                "functree opt.apply_gradients": functree_apply(_tree(0))}
    per_update = carried_updates(variants, grads, calls)

    def block(name: str):
        run = per_update(name)
        return lambda: gigabytes / run()

    for name in variants:
        block(name)()
    values = interleave({name: block(name) for name in variants}, rounds)
    rows = paired_rows(values, "optax adam + apply_updates")
    for row in rows[1:]:
        row.ok = row.ratio is not None and row.ratio >= 0.98
    table = Table("optimizer", f"4. Adam update throughput: {n / 1e6:.1f}M float32 parameters "
                  f"in {LEAVES} leaves", "GB/s", "functree ≥ optax (within 2% noise)", rows,
                  ratio_label="× optax")
    table.notes.append(f"median of {rounds} interleaved rounds × {calls} updates; "
                       f"{BYTES_PER_PARAM} bytes per parameter per update")
    return [table]
