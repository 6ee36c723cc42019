"""The partition specs and per-device outputs of a step over a mesh's data axis.

A training step on a mesh computes each device's gradients on its slice of the batch:
these helpers turn the model's partition specs into the step's in/out specs (an axis
removed from every dimension, or kept alone) and its per-device outputs back into one.

Example:
  >>> from jax.sharding import PartitionSpec as P
  >>> from functree.parallel._step_specs import only_axis, without_axis
  >>> without_axis(P(("data", "model"), None), "data"), only_axis(P(("data", "model"), None), "data")
  (P('model', None), P('data', None))
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from functree.parallel._mesh import is_array

__all__ = ["stack_devices", "merge_devices", "is_spec", "without_axis", "only_axis"]

def stack_devices(x: Any) -> Any:
    return x[None] if is_array(x) else x


def merge_devices(x: Any, local: int) -> Any:
    """A per-device output stacked over devices: per-example rows concatenated, else meaned."""
    if x.ndim >= 2 and x.shape[1] == local:
        return x.reshape(-1, *x.shape[2:])
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def without_axis(spec: Any, axis: str) -> Any:
    """``spec`` with ``axis`` removed from every dimension (that dimension whole over it)."""
    if not isinstance(spec, PartitionSpec):
        return spec

    def one(entry: Any) -> Any:
        if isinstance(entry, tuple):
            rest = tuple(e for e in entry if e != axis)
            return rest if len(rest) > 1 else (rest[0] if rest else None)
        return None if entry == axis else entry

    return PartitionSpec(*(one(e) for e in spec))


def only_axis(spec: Any, axis: str) -> Any:
    """``spec`` with every axis but ``axis`` removed."""
    if not isinstance(spec, PartitionSpec):
        return spec

    def one(entry: Any) -> Any:
        entries = entry if isinstance(entry, tuple) else (entry,)
        return axis if axis in entries else None

    return PartitionSpec(*(one(e) for e in spec))
