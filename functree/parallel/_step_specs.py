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

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from functree.parallel._mesh import is_array

__all__ = ["stack_devices", "merge_devices", "merge_aux", "UNMERGEABLE_AUX", "is_spec", "without_axis", "only_axis"]

def stack_devices(x: Any) -> Any:
    return x[None] if is_array(x) else x


UNMERGEABLE_AUX = """\
The loss's aux value {path} has shape {shape} ({dtype}) per {part}, not one row per example \
(a leading axis of {rows}, the {part}'s examples) nor a floating mean: {how}, each {part} \
computes it on its own part of the batch, and how to combine them (a sum? a mean? a maximum?) \
is not something the step can know. Return per-example values from the loss and reduce them \
in the metric:

    wrong:  return loss, {{"correct": jnp.sum(pred == y)}}            # one count per {part}
    right:  return loss, {{"correct": pred == y}}                     # one row per example
            metrics={{"accuracy": lambda out: jnp.mean(out.aux["correct"])}}"""


def merge_devices(x: Any) -> Any:
    """A per-device layer state stacked over devices: meaned (floating), else device 0's."""
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]


def merge_aux(aux: Any, rows: int, part: str, how: str, per_example: Any) -> Any:
    """The loss's aux outputs of several parts of one batch (devices or microbatches), each
    stacked along a new leading axis, as one: per-example rows (``rows`` per part)
    concatenated, a floating scalar meaned (taken to be a per-example mean, as the loss is:
    a floating maximum or sum comes back as the parts' mean, which the step cannot tell
    apart), anything else refused (:data:`UNMERGEABLE_AUX`): an integer count or a
    per-class table of the parts cannot be combined without knowing what it is. ``per_example``: aux's structure of
    bools, which leaves hold one row per example of the whole batch (read from its shapes
    there, so sizes that coincide decide nothing)."""
    def one(path: Any, x: Any, rowwise: bool) -> Any:
        if not is_array(x):
            return x
        if rowwise and x.ndim >= 2 and x.shape[1] == rows:
            return x.reshape(-1, *x.shape[2:])
        if x.ndim == 1 and jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.mean(x, axis=0)
        raise ValueError(UNMERGEABLE_AUX.format(path=f"aux{jax.tree_util.keystr(path)}", shape=tuple(x.shape[1:]),
                                                dtype=x.dtype, part=part, rows=rows, how=how))
    return jax.tree_util.tree_map_with_path(one, aux, per_example)


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
