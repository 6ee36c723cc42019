"""Data-parallel replicas: the axis an optimizer aggregates over, and the mean over it.

An ``axis_name`` is bound by ``jax.shard_map``, ``jax.vmap(axis_name=...)`` or
``jax.pmap``. Aggregation is the mean of the replicas' gradients; how to take it depends
on what arrives:

* a gradient that varies over the axis (``vmap``, ``shard_map(check_vma=False)``, or a
  sharded parameter) holds each replica's own gradient: ``pmean``;
* under ``shard_map`` with JAX's varying-axes checking (``check_vma=True``, the default),
  the gradient of a replicated parameter arrives already *summed* over the axis (JAX
  inserts the ``psum`` when it transposes the parameter's broadcast): divide by the
  axis size.

A :class:`~functree.losses.WeightedMean` loss (``reduction="weighted"``) asks for the
global batch's mean, so its replicas are weighed by their counts
(:func:`replica_weighted_mean`), which needs each replica's own gradient:
:func:`as_varying` makes the parameters varying before they are differentiated, where
:func:`all_varying` finds that the gradients came summed.

Whether the checking is on is read structurally, from the type of ``axis_index``.
"""

from __future__ import annotations

from typing import Any

import jax

from functree.losses._weighted import WeightedMean, ratio

__all__ = ["all_varying", "as_varying", "axis_size", "replica_mean", "replica_weighted_mean", "tracks_varying",
           "varying_axes", "UNBOUND_AXIS"]

UNBOUND_AXIS = """\
The optimizer aggregates gradients over axis_name={name!r}, but no axis of that name is \
bound where the step runs{bound}. Run the step inside the transformation that binds it, \
or drop axis_name on one device:

    wrong:  opt = ft.optim.Optimizer(tx, axis_name={name!r}); opt.minimize(...)
    right:  jax.shard_map(step, mesh=mesh, in_specs=..., out_specs=...)   # mesh axis {name!r}
       or:  jax.vmap(step, axis_name={name!r})
       or:  ft.train.train_step(loss_fn, opt, mesh=mesh)                  # functree binds it
"""


def axis_size(name: Any) -> int:
    """The number of replicas along ``name``; a ``ValueError`` naming it when it is unbound."""
    try:
        return int(jax.lax.axis_size(name))
    except NameError:  # turned into an error that names the axis and the fix
        raise ValueError(UNBOUND_AXIS.format(name=name, bound="")) from None


def varying_axes(x: Any) -> frozenset[Any]:
    """The mapped axes ``x`` varies over (JAX's varying-axes type; jax 0.10 names it
    ``manual_axis_type.varying``, later versions ``vma``)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def tracks_varying(name: Any) -> bool:
    """Whether JAX tracks which values vary over ``name`` (shard_map with check_vma=True)."""
    return name in varying_axes(jax.lax.axis_index(name))


def replica_mean(tree: Any, name: Any, *, reduced: str = "sum") -> Any:
    """The mean over the replicas along ``name`` of every array leaf of ``tree``.

    ``reduced`` says what a leaf that does *not* vary over ``name`` already holds, when
    JAX tracks varying axes: ``"sum"`` (a gradient of a replicated parameter: divide by
    the axis size) or ``"value"`` (a value equal on every replica, e.g. a loss computed
    from replicated data: kept).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree.optim._replicas import replica_mean
      >>> jax.vmap(lambda x: replica_mean(x, "r"), axis_name="r")(jnp.arange(4.0))
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    n = axis_size(name)
    tracked = tracks_varying(name)

    def one(x: Any) -> Any:
        if x is None:
            return None
        if not tracked or name in varying_axes(x):
            return jax.lax.pmean(x, name)
        return x / n if reduced == "sum" else x

    return jax.tree.map(one, tree)


def all_varying(tree: Any, name: Any) -> bool:
    """Whether every array leaf of ``tree`` holds each replica's own value: JAX tracks no
    varying axes for ``name`` (``vmap``, ``pmap``, ``shard_map(check_vma=False)``), or each
    varies over it."""
    if not tracks_varying(name):
        return True
    return all(name in varying_axes(x) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def as_varying(tree: Any, name: Any) -> Any:
    """``tree`` with every array leaf varying over ``name`` where JAX tracks varying axes
    (``shard_map(check_vma=True)``): differentiated, each replica then gets its own
    gradient, not the sum JAX would insert (elsewhere ``tree`` as it is)."""
    if not tracks_varying(name):
        return tree

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and name not in varying_axes(x):
            return jax.lax.pcast(x, name, to="varying")
        return x

    return jax.tree.map(one, tree)


def replica_weighted_mean(record: WeightedMean, grads: Any, name: Any) -> tuple[WeightedMean, Any]:
    """The replicas' :class:`~functree.losses.WeightedMean` losses as one, ``Σ total_r /
    Σ count_r``, and their own gradients (varying over ``name``: :func:`as_varying`)
    weighed by count, ``Σ count_r ∇value_r / Σ count_r``: the global batch's mean (an
    equal-weight mean would weigh a replica of 2 kept tokens as one of 200); zero
    gradients when no replica counted any.

    .. math:: L = \\frac{\\sum_r t_r}{\\sum_r c_r},\\quad
       \\nabla L = \\sum_r \\frac{c_r}{\\sum_s c_s} \\nabla \\frac{t_r}{c_r}

    Example:
      >>> import jax, jax.numpy as jnp, functree as ft
      >>> from functree.optim._replicas import replica_weighted_mean
      >>> def per_replica(t, c, g):
      ...     whole, grads = replica_weighted_mean(ft.losses.WeightedMean(t, c), g, "r")
      ...     return whole.value, grads
      >>> value, grads = jax.vmap(per_replica, axis_name="r")(jnp.array([2.0, 30.0]), jnp.array([1.0, 3.0]), jnp.array([4.0, 8.0]))
      >>> float(value[0]), float(grads[0])  # 32 / 4; (1 * 4 + 3 * 8) / 4
      (8.0, 7.0)
    """
    n = axis_size(name)
    tracked = tracks_varying(name)

    def summed(x: Any) -> Any:  # a value equal on every replica sums to n times itself
        return jax.lax.psum(x, name) if not tracked or name in varying_axes(x) else x * n

    count = summed(record.count)
    share = ratio(record.count, count)
    weighed = jax.tree.map(lambda x: None if x is None else summed(x * share.astype(x.dtype)), grads)
    return WeightedMean(summed(record.total), count), weighed
