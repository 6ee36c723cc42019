"""Placement for a step over a mesh: where the batch, the model and the optimizer state live.

``Placement(mesh, data_axis, sharding)`` answers the questions a data-parallel step asks
(``ft.train.TrainStep(..., mesh=mesh)`` runs the step itself): the ``PartitionSpec`` trees
of the model and of the optimizer state under the sharding rules, arrays placed by them,
and the global batch split along ``data_axis`` (:func:`shard_batch`). Nothing here runs a
step or imports ``functree.train``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import KeyPath

from functree._examples import check_example_axis
from functree._host_buffers import own_host, private_arrays
from functree._tree import has_shape_and_dtype
from functree.parallel._mesh import auto_mesh, constrain, place
from functree.parallel._rules import check_data_axis, check_rules, partition_specs

__all__ = ["Placement", "shard_batch", "place_batch", "batch_specs", "check_batch", "one_device_mesh"]

_NOT_SHARED = """\
The batch has {size} examples (leading axis of {path}), which the {n} devices of mesh axis \
{axis!r} cannot share evenly: each device takes the same number of examples."""

BATCH_NOT_DIVISIBLE = _NOT_SHARED + """ Use a batch size that is a multiple of {n}, with \
drop_last=True: {size} examples may also be the short last minibatch of data whose length is \
not a multiple of the batch size (then keep your batch size and drop that minibatch):

    wrong:  ft.train.batches(data, batch_size={size})   # or a batch size whose last minibatch has {size}
    right:  ft.train.batches(data, batch_size={right}, drop_last=True)"""

SHORT_LAST_BATCH = _NOT_SHARED + """ The batches before it had {earlier}: this is most likely \
the data's short last minibatch (the data's length is not a multiple of {earlier}). Drop it:

    wrong:  ft.train.batches(data, batch_size={earlier})
    right:  ft.train.batches(data, batch_size={earlier}, drop_last=True)   # or a multiple of {n} that divides the data"""


def check_batch(batch: Any, n: int, axis: str, where: KeyPath = (), *, earlier: int = 0) -> None:
    """A ``ValueError`` naming the leaf and the fix when ``n`` devices cannot share ``batch``;
    ``where``: the key path of ``batch`` itself (one leaf of a larger batch); ``earlier``:
    the examples of the batches a step took before (0: unknown). A batch shorter than those
    is most likely the data's short last minibatch (:data:`SHORT_LAST_BATCH`: drop it at the
    user's batch size), else :data:`BATCH_NOT_DIVISIBLE` (a multiple of ``n``)."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if np.ndim(x) >= 1 and np.shape(x)[0] % n:
            size = np.shape(x)[0]
            text = SHORT_LAST_BATCH if size < earlier else BATCH_NOT_DIVISIBLE
            raise ValueError(text.format(
                size=size, path=jax.tree_util.keystr((*where, *path)) or "the batch", n=n, axis=axis,
                right=max(n, size // n * n), earlier=earlier))


def batch_specs(batch: Any, axis: str) -> Any:
    """``P(axis)`` for every leaf with a leading (example) axis, ``P()`` for scalars."""
    return jax.tree.map(lambda x: PartitionSpec(axis) if np.ndim(x) >= 1 else PartitionSpec(), batch)


def shard_batch(batch: Any, mesh: Mesh, data_axis: str = "data") -> Any:
    """The global batch from this process's share, split over ``data_axis`` of ``mesh``.

    Each leaf with a leading axis becomes a global ``jax.Array`` through
    ``jax.make_array_from_process_local_data``: in one process the share is the whole
    batch; in ``P`` processes each passes ``1/P`` of it (``ft.train.batches(...,
    shard=(jax.process_index(), jax.process_count()))``) and the global batch is their
    concatenation in process order. Arrays that are already global are kept. Leaves whose
    lengths differ are refused first, naming two of them and their rows
    (:data:`functree._examples.MIXED_EXAMPLE_AXIS`: each device's rows would no longer pair
    up, even where every length splits); then a leaf the devices cannot share, by its key
    path (:data:`BATCH_NOT_DIVISIBLE`).

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> from functree.parallel import shard_batch
      >>> x = shard_batch(np.ones((8, 3)), jax.make_mesh((1,), ("data",)))
      >>> x.shape, x.sharding.spec
      ((8, 3), P('data',))
    """
    return place_batch(batch, mesh, data_axis)


def place_batch(batch: Any, mesh: Mesh, data_axis: str, earlier: int = 0) -> Any:
    """:func:`shard_batch`, ``earlier``: the examples of the batches before (for
    :func:`check_batch`'s message)."""
    check_data_axis(mesh, data_axis, "ft.train.train_step")
    amesh = auto_mesh(mesh)
    sharding = NamedSharding(amesh, PartitionSpec(data_axis))
    devices = amesh.shape[data_axis]
    # The global batch's rows (a process's share counted P times) must agree before any is cut.
    check_example_axis(jax.tree.map(lambda x: np.empty((global_rows(x), 0)) if np.ndim(x) else x, batch),
                       f"the {devices} devices of mesh axis {data_axis!r}")

    def one(path: KeyPath, x: Any) -> Any:  # the path names the leaf in BATCH_NOT_DIVISIBLE
        if np.ndim(x) == 0:
            return x
        if isinstance(x, jax.Array) and (x.sharding == sharding or not x.is_fully_addressable):
            return x
        check_batch(np.empty((global_rows(x), 0)), devices, data_axis, path, earlier=earlier)
        if jax.process_count() == 1 and isinstance(x, jax.Array):
            return jax.device_put(x, sharding)
        global_shape = (global_rows(x), *np.shape(x)[1:])
        # (a copy: JAX takes an aligned NumPy buffer as the device's, and the caller may refill it)
        return jax.make_array_from_process_local_data(sharding, own_host(x), global_shape)

    return jax.tree_util.tree_map_with_path(one, batch)


def global_rows(x: Any) -> int:
    """The rows of ``x`` in the global batch: a global array's own, a process's share times
    the process count."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.shape(x)[0]
    return np.shape(x)[0] * jax.process_count()


def _stacked_rows(x: Any) -> int:
    """The rows of one step's global minibatch in a stacked leaf ``(steps, rows, ...)``."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.shape(x)[1]
    return np.shape(x)[1] * jax.process_count()


def one_device_mesh(data_axis: str = "data") -> Mesh:
    """A mesh of the default device alone (sharding rules without a mesh)."""
    return jax.make_mesh((1,), (data_axis,), devices=jax.devices()[:1])


def _examples(batch: Any) -> int:
    """The rows of ``batch``'s first leaf with a leading axis (0: none)."""
    return next((np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x) >= 1), 0)


def _on_mesh(tree: Any, mesh: Mesh) -> bool:
    return all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
               for x in jax.tree.leaves(tree) if has_shape_and_dtype(x))


class Placement:
    """Where a data-parallel step's arrays live: ``mesh`` (``None``: the default device
    alone), the batch split along ``data_axis``, the model and optimizer state placed by
    ``sharding`` (``None`` replicated, ``"fsdp"`` or ``{pattern: PartitionSpec}``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree.parallel._placement import Placement
      >>> where = Placement(jax.make_mesh((1,), ("data",)), "data", "fsdp", "ft.train.train_step")
      >>> where.model_specs({"w": jnp.ones((2, 2))})
      {'w': P()}
    """

    def __init__(self, mesh: Mesh | None, data_axis: str, sharding: Any, call: str):
        mesh = one_device_mesh(data_axis) if mesh is None else mesh
        check_data_axis(mesh, data_axis, call)
        check_rules(sharding)
        self.mesh, self.data_axis, self.sharding = auto_mesh(mesh), data_axis, sharding
        self.devices = self.mesh.shape[data_axis]
        # The largest training batch placed so far: a shorter one the devices cannot share is
        # most likely the data's short last minibatch (check_batch's message says so).
        self.earlier = 0

    def model_specs(self, model: Any) -> Any:
        """The ``PartitionSpec`` tree of ``model`` under ``sharding``."""
        return partition_specs(model, self.sharding, mesh=self.mesh, data_axis=self.data_axis)

    def state_specs(self, opt_state: Any) -> Any:
        """The ``PartitionSpec`` tree of an optimizer state (moments follow parameters)."""
        return partition_specs(opt_state, self.sharding, mesh=self.mesh, data_axis=self.data_axis, strict=False)

    def place(self, model: Any, opt_state: Any = None) -> Any:
        """``(model, opt_state)`` (or ``model`` alone) placed on the mesh by the rules.

        Arrays already on this mesh (a previous step's outputs) are passed as they are:
        the step's sharding constraints keep them placed by the rules.
        """
        if opt_state is None:
            return model if _on_mesh(model, self.mesh) else place(model, self.model_specs(model), self.mesh)
        if _on_mesh((model, opt_state), self.mesh):
            return model, opt_state
        return (place(model, self.model_specs(model), self.mesh),
                place(opt_state, self.state_specs(opt_state), self.mesh))

    def shard_batch(self, batch: Any, *, whole: bool = False) -> Any:
        """The global batch from this process's share (:func:`shard_batch` on this mesh).

        ``whole=True`` (evaluation): a one-process batch the data axis cannot split evenly
        (the last, short batch of a dataset) is replicated over the mesh instead of refused.
        """
        if whole and jax.process_count() == 1 and not self.divides(batch):
            return self.replicate(batch)
        placed = place_batch(batch, self.mesh, self.data_axis, self.earlier)
        if not whole:  # (an evaluation's batch sizes are its own)
            self.earlier = max(self.earlier, _examples(placed))
        return placed

    def check_stacked(self, batch: Any) -> None:
        """Before a stacked batch ``(steps, rows, ...)`` is placed (``steps_per_call > 1``):
        each step's minibatch (axis 1, a process's share counted ``P`` times) checked as
        :meth:`shard_batch` checks one, and remembered in ``earlier``, so that the data's
        short last minibatch, run alone after stacked calls, is named as such."""
        rows = {path: _stacked_rows(x) for path, x in jax.tree_util.tree_flatten_with_path(batch)[0] if np.ndim(x) >= 2}
        for path, n in rows.items():  # the path names the leaf in check_batch's message
            check_batch(np.empty((n, 0)), self.devices, self.data_axis, path, earlier=self.earlier)
        self.earlier = max(self.earlier, *rows.values(), 0)

    def replicate(self, tree: Any) -> Any:
        """``tree`` copied whole to every device of the mesh (a step's replicated outputs live
        there: its NaN halt log, the Trainer's log buffer)."""
        return jax.device_put(private_arrays(tree), NamedSharding(self.mesh, PartitionSpec()))

    @property
    def _split(self) -> str:
        return f"the {self.devices} devices of mesh axis {self.data_axis!r}"

    def divides(self, batch: Any) -> bool:
        """Whether every leaf's leading (example) axis splits evenly over the data axis."""
        return all(np.shape(x)[0] % self.devices == 0 for x in jax.tree.leaves(batch) if np.ndim(x) >= 1)

    def constrain_batch(self, batch: Any, *, whole: bool = False) -> tuple[Any, Any]:
        """Inside a jitted step: ``(batch, specs)`` with the batch split along the data axis
        (``whole=True``: replicated when it does not split evenly, as :meth:`shard_batch`)."""
        if whole and not self.divides(batch):
            specs = jax.tree.map(lambda _: PartitionSpec(), batch)
            return constrain(batch, specs, self.mesh), specs
        if not whole:  # (an evaluation computes on the whole batch: any leaves)
            check_example_axis(batch, self._split)
        check_batch(batch, self.devices, self.data_axis, earlier=self.earlier)
        specs = batch_specs(batch, self.data_axis)
        return constrain(batch, specs, self.mesh), specs

    def constrain(self, tree: Any, specs: Any) -> Any:
        """``tree`` constrained to ``specs`` on this mesh (inside a jitted step)."""
        return constrain(tree, specs, self.mesh)

    def __repr__(self) -> str:
        return f"mesh={dict(self.mesh.shape)}, data_axis={self.data_axis!r}, sharding={self.sharding!r}"
