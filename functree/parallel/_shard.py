"""``ft.shard``: a model, parameter view or optimizer state placed on a mesh by sharding rules."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from functree._module import Module
from functree._tree import has_shape_and_dtype
from functree.parallel._mesh import auto_mesh, place
from functree.parallel._rules import partition_specs

__all__ = ["shard"]


def _builder(tree: Any) -> bool:
    """A zero-argument function that builds the tree. A callable pytree node (a Module, an
    Equinox module, ``jax.tree_util.Partial``) is data: only a callable JAX sees as one leaf
    (a function, a lambda, ``functools.partial``) builds."""
    if not callable(tree) or isinstance(tree, Module) or has_shape_and_dtype(tree):
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree.structure(tree))


def shard(tree: Any, mesh: Mesh, rules: Any = None, *, data_axis: str = "data") -> Any:
    """``tree`` with its arrays placed on ``mesh`` by ``rules`` (see :func:`ft.partition_specs`).

    ``rules`` is ``None`` (replicated), ``"fsdp"`` or ``{pattern: PartitionSpec}``. Given a
    zero-argument function instead of a tree (``lambda: MLP(key=key)``), the tree is built
    directly in its shards — ``jax.eval_shape`` for the shapes, then one ``jax.jit`` with
    ``out_shardings`` — so no device ever holds it whole. In several processes every
    process passes the same values and keeps its own shards.

    Example:
      >>> import functree as ft, jax
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> model = ft.shard(lambda: ft.nn.Dense(64, 32, key=jax.random.key(0)), mesh, "fsdp")
      >>> model.weight.sharding.spec, model.weight.shape
      (P(), (64, 32))
    """
    if _builder(tree):
        shapes = jax.eval_shape(tree)
        specs = partition_specs(shapes, rules, mesh=mesh, data_axis=data_axis)
        amesh = auto_mesh(mesh)
        shardings = jax.tree.map(lambda s: NamedSharding(amesh, s), specs)
        return jax.jit(tree, out_shardings=shardings)()
    specs = partition_specs(tree, rules, mesh=mesh, data_axis=data_axis)
    return place(tree, specs, mesh)

