"""Checkpoints that move between device counts: restore straight into sharded arrays.

``ft.train.save`` writes a sharded tree through orbax without gathering it (each process
writes its shards). Restoring onto another mesh needs *sharded targets*: every array's
shape, dtype and ``NamedSharding`` on the new mesh, which :func:`sharded_target` builds
from a template and the sharding rules; orbax then reads each device's shard directly,
so no host holds the whole state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding

from functree.parallel._mesh import auto_mesh, is_array
from functree.parallel._rules import partition_specs
from functree.train._checkpoint import FORMAT, _rebuild_single
from functree.train._treespec import CheckpointError, encode

__all__ = ["sharded_target", "load", "mesh_shape"]

NEEDS_TEMPLATE = """\
Restoring onto a mesh needs a template (the tree's structure, shapes and dtypes) to place \
each array by the sharding rules:

    wrong:  ft.parallel.load(path, None, mesh=mesh)
    right:  ft.parallel.load(path, (model, opt_state), mesh=mesh, sharding="fsdp")"""


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


def sharded_target(template: Any, mesh: Mesh, rules: Any = None, *, data_axis: str = "data") -> Any:
    """``template`` with every array leaf a ``jax.ShapeDtypeStruct`` placed by ``rules``.

    ``template`` may be the tree itself, or ``jax.eval_shape`` of the function building
    it (nothing is allocated).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from functree.parallel import sharded_target
      >>> t = sharded_target({"w": jnp.ones((4, 256))}, jax.make_mesh((1,), ("data",)), "fsdp")
      >>> t["w"].shape, t["w"].sharding.spec
      ((4, 256), P())
    """
    specs = partition_specs(template, rules, mesh=mesh, data_axis=data_axis, strict=False)
    amesh = auto_mesh(mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(amesh, s))
        if is_array(x) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        template, specs,
    )


def load(path: str | os.PathLike[str], template: Any, *, mesh: Mesh, sharding: Any = None,
         data_axis: str = "data") -> Any:
    """A tree written by ``ft.train.save``, restored onto ``mesh`` placed by ``sharding``.

    Works whatever mesh or device count wrote it (an 8-device FSDP run restores on one
    device, and back): orbax reads each target shard directly.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, tempfile
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> model = ft.nn.Dense(64, 32, key=jax.random.key(0))
      >>> with tempfile.TemporaryDirectory() as d:
      ...     ft.train.save(d + "/m", model)
      ...     restored = ft.parallel.load(d + "/m", model, mesh=mesh, sharding="fsdp")
      >>> bool(jnp.all(restored.weight == model.weight)), restored.weight.sharding.spec
      (True, P())
    """
    if template is None:
        raise CheckpointError(NEEDS_TEMPLATE)
    target, _ = encode(sharded_target(template, mesh, sharding, data_axis=data_axis))
    path = Path(path).absolute()
    args = ocp.args.Composite(arrays=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(path, args=args)
    meta = restored["meta"]
    if not isinstance(meta, dict) or not str(meta.get("format", "")).startswith(FORMAT.rsplit("-", 1)[0]):
        raise CheckpointError(f"{path} is not a functree checkpoint (no {FORMAT} metadata).")
    return _rebuild_single(meta["spec"], dict(restored["arrays"]), template)
