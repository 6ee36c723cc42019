"""Family 8: key paths on a 1000-leaf model (500 ``Dense(4, 4)`` layers in a Sequential).

Host-side operations, no jit: listing every key path, reading and writing the deepest
parameter (``kp.get`` / ``kp.set``, and ``ft.get`` with a dotted string that is parsed
each call), and the flat state dict, also of a model rebuilt each call (as a jit output
is: no result known for that object). ``jax.tree_util.tree_flatten_with_path`` and
``jax.tree.unflatten`` are shown for scale.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _harness import Row, Table, interleave

import functree as ft

LAYERS = 500  # weight + bias each: 1000 leaves


def model_of(layers: int = LAYERS) -> Any:
    keys = jax.random.split(jax.random.key(0), layers)
    return ft.nn.Sequential([ft.nn.Dense(4, 4, jax.nn.relu, key=k) for k in keys])


def key_paths(quick: bool) -> list[Table]:
    rounds, calls = (5, 20) if quick else (15, 50)
    model = model_of()
    leaves = len(jax.tree.leaves(model))
    paths = ft.recursively_all_key_paths(model)
    deepest = [p for p in paths if isinstance(p.get(model), jax.Array)][-1]
    name = deepest.name
    value = jnp.zeros_like(deepest.get(model))
    leaves_, treedef = jax.tree.flatten(model)
    operations: dict[str, Callable[[], Any]] = {
        "ft.recursively_all_key_paths(model)": lambda: ft.recursively_all_key_paths(model),
        "ft.recursively_all_key_paths(model, to=jax.Array)":
            lambda: ft.recursively_all_key_paths(model, to=jax.Array),
        "kp.get(model)": lambda: deepest.get(model),
        "kp.set(model, value)": lambda: deepest.set(model, value),
        f'ft.get(model, "{name}")': lambda: ft.get(model, name),
        f'ft.set(model, "{name}", value)': lambda: ft.set(model, name, value),
        "ft.to_flat_dict(model)": lambda: ft.to_flat_dict(model),
        "ft.to_flat_dict(a new model: tree_unflatten each call)":
            lambda: ft.to_flat_dict(jax.tree.unflatten(treedef, leaves_)),
        "jax.tree.unflatten (for scale)": lambda: jax.tree.unflatten(treedef, leaves_),
        "jax.tree_util.tree_flatten_with_path (for scale)":
            lambda: jax.tree_util.tree_flatten_with_path(model),
    }

    def block(op: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                op()
            return (time.perf_counter() - start) / calls
        return run

    for op in operations.values():
        op()
    values = interleave({k: block(op) for k, op in operations.items()}, rounds)
    rows = []
    for label, vs in values.items():
        row = Row(label, [v * 1e6 for v in vs])
        if not label.startswith("jax."):
            row.ok = row.median < 1000
        rows.append(row)
    table = Table("keypaths", f"8. Key paths on a {leaves}-leaf model ({LAYERS} Dense(4, 4) "
                  "in a Sequential)", "µs", "each sub-millisecond", rows, ratio_label="—")
    table.notes.append(f"median of {rounds} interleaved rounds × {calls} calls; "
                       f"{len(paths)} key paths; the deepest is {name}")
    return [table]
