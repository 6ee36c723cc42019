"""``ft.shard``: a model, parameter view or optimizer state placed on a mesh by sharding rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from functree._module import Module
from functree._tree import has_shape_and_dtype, is_array_value
from functree.parallel._mesh import auto_mesh, place
from functree.parallel._rules import check_data_axis, partition_specs

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
    check_data_axis(mesh, data_axis, "ft.shard")  # named as the user called it
    if _builder(tree):
        return _built_in_shards(tree, rules, mesh, data_axis)
    specs = partition_specs(tree, rules, mesh=mesh, data_axis=data_axis)
    return place(tree, specs, mesh)


def _built_in_shards(build: Callable[[], Any], rules: Any, mesh: Mesh, data_axis: str) -> Any:
    """``build()`` built in its shards: its array leaves are the jitted program's outputs
    (``out_shardings`` from the rules); its other leaves (an Equinox module's functions,
    which a jitted program cannot return) are kept as the trace built them."""
    built: dict[str, Any] = {}

    def arrays() -> list[Any]:
        leaves, built["def"] = jax.tree.flatten(build())
        built["rest"] = [None if is_array_value(x) else x for x in leaves]
        return [x for x in leaves if is_array_value(x)]

    shapes = iter(jax.eval_shape(arrays))
    rest = built["rest"]
    tree = jax.tree.unflatten(built["def"], [next(shapes) if x is None else x for x in rest])
    amesh = auto_mesh(mesh)
    specs = built["def"].flatten_up_to(partition_specs(tree, rules, mesh=mesh, data_axis=data_axis))
    array_specs = [spec for spec, x in zip(specs, rest) if x is None]
    placed = iter(jax.jit(arrays, out_shardings=[NamedSharding(amesh, s) for s in array_specs])())
    return jax.tree.unflatten(built["def"], [next(placed) if x is None else x for x in built["rest"]])

