"""Where a tree's arrays go on a mesh, before they exist: checkpoints moved between
device counts.

``ft.train.save`` writes a sharded tree through orbax without gathering it (each process
writes its shards). Restoring onto another mesh (``ft.train.load(path, template,
mesh=mesh, sharding=rules)``) needs *sharded targets*: every array's shape, dtype and
``NamedSharding`` on the new mesh, which :func:`sharded_target` builds from a template
and the sharding rules; orbax then reads each device's shard directly, so no host holds
the whole state. :func:`mesh_shape` is what a checkpoint records of the mesh it left.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from functree._tree import has_shape_and_dtype
from functree.parallel._mesh import auto_mesh
from functree.parallel._rules import partition_specs

__all__ = ["sharded_target", "mesh_shape"]


def mesh_shape(tree: Any) -> dict[str, int]:
    """``{axis: size}`` of the mesh the tree's arrays live on (``{}`` off any mesh).

    What a checkpoint records about where it was written from.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from functree.parallel import mesh_shape
      >>> mesh_shape(ft.shard({"w": jnp.ones(4)}, jax.make_mesh((1,), ("data",)))), mesh_shape({"w": 1.0})
      ({'data': 1}, {})
    """
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    return {}


def sharded_target(template: Any, mesh: Mesh, rules: Any = None, *, data_axis: str = "data",
                   strict: bool = True) -> Any:
    """``template`` with every array leaf a ``jax.ShapeDtypeStruct`` placed by ``rules``.

    ``template`` may be the tree itself, or ``jax.eval_shape`` of the function building
    it (nothing is allocated). The rules are checked as ``ft.shard`` checks them: a rule
    that matches no leaf, or only leaves an earlier rule took, raises (naming the closest
    names); ``strict=False`` skips that check, for a tree that holds only part of the
    model (an optimizer state, whose moments follow the model's rules).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from functree.parallel import sharded_target
      >>> t = sharded_target({"w": jnp.ones((4, 256))}, jax.make_mesh((1,), ("data",)), "fsdp")
      >>> t["w"].shape, t["w"].sharding.spec
      ((4, 256), P())
    """
    specs = partition_specs(template, rules, mesh=mesh, data_axis=data_axis, strict=strict)
    amesh = auto_mesh(mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(amesh, s))
        if has_shape_and_dtype(x) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        template, specs,
    )
