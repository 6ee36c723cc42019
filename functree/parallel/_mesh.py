"""Placing arrays on a mesh: outside a jitted program (``place``) and inside one (``constrain``).

functree places arrays with ``NamedSharding``s on the *Auto*-typed twin of the user's mesh
(same devices, same axis names): ``jax.make_mesh`` gives Explicit axes by default, whose
sharding-in-types rules would leak into every model's code; with Auto axes XLA's SPMD
partitioner propagates the shardings through the step instead.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from functree._host_buffers import own_host, private
from functree._tree import has_shape_and_dtype

__all__ = ["auto_mesh", "place", "constrain", "is_array"]


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis of type Auto (the mesh itself when it already is):
    ``jax.make_mesh`` gives Explicit axes, and functree places arrays by sharding rules.

    Example:
      >>> import jax
      >>> from functree.parallel import auto_mesh
      >>> auto_mesh(jax.make_mesh((1,), ("data",))).axis_types
      (Auto,)
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


is_array = has_shape_and_dtype
"""The leaves that get a sharding: :func:`functree._tree.has_shape_and_dtype` (this name
stays for the modules that import it from here)."""


def _place_leaf(x: Any, sharding: NamedSharding) -> Any:
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(private(x), sharding)  # (JAX would alias it)
    host = own_host(x)  # the same value in every process: each takes its own shards
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``tree`` with each array leaf put on ``NamedSharding(mesh, spec)`` (outside jit)."""
    mesh = auto_mesh(mesh)
    return jax.tree.map(
        lambda x, s: _place_leaf(x, NamedSharding(mesh, s)) if has_shape_and_dtype(x) else x,
        tree, specs,
    )


def constrain(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``tree`` with each array leaf constrained to ``NamedSharding(mesh, spec)`` (inside jit)."""
    mesh = auto_mesh(mesh)
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)) if has_shape_and_dtype(x) else x,
        tree, specs,
    )


def replicated(tree: Any) -> Any:
    """A spec tree giving every array leaf of ``tree`` ``P()``."""
    return jax.tree.map(lambda x: PartitionSpec() if has_shape_and_dtype(x) else x, tree)
