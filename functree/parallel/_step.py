"""The data-parallel training step: one compiled program over a device mesh.

``DataParallelStep(loss_fn, optimizer, mesh=mesh, data_axis="data", sharding=rules)`` runs,
inside one ``jax.jit``::

    batch  → split along its leading axis over data_axis          (NamedSharding P(data_axis))
    shard_map over data_axis, on each device:
        (loss, aux), g = optimizer.get_gradients(loss_fn, model, batch shard)   # per device
        g = optimizer.transform_unaggregated_gradients(g)                       # per replica
        g = optimizer.aggregate_gradients(g)        # data_axis bound: mean by default
        g = optimizer.transform_gradients(g)
    model, state = optimizer.apply_gradients(g, model, state, minibatch_size=global batch)
    model, state → placed by the sharding rules (None, "fsdp" or {pattern: P(...)})

Inside ``shard_map`` the model is replicated (under ``"fsdp"`` XLA all-gathers each
sharded parameter for the forward and backward pass) and marked *varying* over
``data_axis``, so every device differentiates its own shard and the aggregator receives
per-device gradients: a custom ``aggregate_gradients`` may ``psum``/``pmean``/
``all_gather`` them over ``data_axis``. A gradient the optimizer left varying (an optimizer
built without ``axis_name``) is averaged. The optimizer update runs outside ``shard_map``
on the parameters and moments in their own shardings (sharded under ``"fsdp"``).

Mixed precision: with ``compute_dtype`` the loss sees the parameters (``ft.cast``) and the
floating inputs in that dtype; the float32 master parameters, their float32 gradients and
the optimizer state never change dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from functree import nn
from functree.optim import Optimizer, OptimizerWrapper
from functree.optim._replicas import varying_axes
from functree.optim._skip import select
from functree.optim._subset import trained_view
from functree.parallel._cast import cast, cast_floating
from functree.parallel._mesh import auto_mesh, constrain, is_array, place
from functree.parallel._rules import (
    _check_rules,
    check_compute_dtype,
    check_data_axis,
    partition_specs,
)
from functree.train._metrics import batch_size_of
from functree.train._step import EvalStep, TrainStep, _first_nonfinite

__all__ = ["DataParallelStep", "DataParallelEvalStep", "DataParallelOptimizer", "shard_batch", "one_device_mesh"]

BATCH_NOT_DIVISIBLE = """\
The batch has {size} examples (leading axis of {path}), which the {n} devices of mesh axis \
{axis!r} cannot share evenly: each device takes the same number of examples.
Use a batch size that is a multiple of {n}:

    wrong:  ft.train.batches(data, batch_size={size})
    right:  ft.train.batches(data, batch_size={right}, drop_last=True)"""


def _axis_varies(x: Any, axis: str) -> bool:
    return axis in varying_axes(x)


class DataParallelOptimizer(OptimizerWrapper):
    """``inner`` inside ``shard_map`` over ``data_axis``: the data-parallel aggregation.

    ``aggregate_gradients`` runs ``inner.aggregate_gradients`` (the default mean over the
    optimizer's ``axis_name``, or a custom aggregator) on the per-device gradients; a
    gradient that still varies over ``data_axis`` afterwards (an optimizer without
    ``axis_name``, whose default aggregation is the identity) is averaged over it.

    Example:
      >>> import functree as ft
      >>> from functree.parallel import DataParallelOptimizer
      >>> opt = DataParallelOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1)), "data")
      >>> opt.axis_name                # the step's data axis, bound inside its shard_map
      'data'
    """

    data_axis: str

    def __init__(self, inner: Optimizer, data_axis: str):
        super().__init__(inner)
        object.__setattr__(self, "data_axis", data_axis)

    @property
    def axis_name(self) -> Any:
        return self.data_axis if self.inner.axis_name is None else self.inner.axis_name

    def aggregate_gradients(self, grads: Any) -> Any:
        grads = self.inner.aggregate_gradients(grads)
        axis = self.data_axis
        return jax.tree.map(lambda g: jax.lax.pmean(g, axis) if _axis_varies(g, axis) else g, grads)


def _check_batch(batch: Any, n: int, axis: str) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if np.ndim(x) >= 1 and np.shape(x)[0] % n:
            size = np.shape(x)[0]
            raise ValueError(BATCH_NOT_DIVISIBLE.format(
                size=size, path=jax.tree_util.keystr(path) or "the batch", n=n, axis=axis,
                right=max(n, size // n * n)))


def batch_specs(batch: Any, axis: str) -> Any:
    """``P(axis)`` for every leaf with a leading (example) axis, ``P()`` for scalars."""
    return jax.tree.map(lambda x: PartitionSpec(axis) if np.ndim(x) >= 1 else PartitionSpec(), batch)


def shard_batch(batch: Any, mesh: Mesh, data_axis: str = "data") -> Any:
    """The global batch from this process's share, split over ``data_axis`` of ``mesh``.

    Each leaf with a leading axis becomes a global ``jax.Array`` through
    ``jax.make_array_from_process_local_data``: in one process the share is the whole
    batch; in ``P`` processes each passes ``1/P`` of it (``ft.train.batches(...,
    shard=(jax.process_index(), jax.process_count()))``) and the global batch is their
    concatenation in process order. Arrays that are already global are kept.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> from functree.parallel import shard_batch
      >>> x = shard_batch(np.ones((8, 3)), jax.make_mesh((1,), ("data",)))
      >>> x.shape, x.sharding.spec
      ((8, 3), P('data',))
    """
    check_data_axis(mesh, data_axis, "ft.train.train_step")
    amesh = auto_mesh(mesh)

    def one(x: Any) -> Any:
        if np.ndim(x) == 0:
            return x
        sharding = NamedSharding(amesh, PartitionSpec(data_axis))
        if isinstance(x, jax.Array) and (x.sharding == sharding or not x.is_fully_addressable):
            return x
        if jax.process_count() == 1 and isinstance(x, jax.Array):
            _check_batch(x, amesh.shape[data_axis], data_axis)
            return jax.device_put(x, sharding)
        global_shape = (np.shape(x)[0] * jax.process_count(), *np.shape(x)[1:])
        _check_batch(np.empty((global_shape[0], 0)), amesh.shape[data_axis], data_axis)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), global_shape)

    return jax.tree.map(one, batch)


def one_device_mesh(data_axis: str = "data") -> Mesh:
    """A mesh of the default device alone (``compute_dtype`` without a mesh)."""
    return jax.make_mesh((1,), (data_axis,), devices=jax.devices()[:1])


def _on_mesh(tree: Any, mesh: Mesh) -> bool:
    return all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
               for x in jax.tree.leaves(tree) if is_array(x))


def _stack(x: Any) -> Any:
    return x[None] if is_array(x) else x


def _merge_devices(x: Any, local: int) -> Any:
    """A per-device output stacked over devices: per-example rows concatenated, else meaned."""
    if x.ndim >= 2 and x.shape[1] == local:
        return x.reshape(-1, *x.shape[2:])
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]


class DataParallelStep(TrainStep):
    """A :class:`ft.train.TrainStep` whose batch is split over ``data_axis`` of ``mesh``.

    Args (besides those of ``TrainStep``):
      mesh: a ``jax.sharding.Mesh``, e.g. ``jax.make_mesh((8,), ("data",))`` (default:
        the default device alone, for ``compute_dtype`` on one device).
      data_axis: the mesh axis the batch's leading axis is split over.
      sharding: ``None`` (parameters and optimizer state replicated), ``"fsdp"`` or
        ``{pattern: PartitionSpec}`` (see :func:`ft.partition_specs`).
      compute_dtype: a floating dtype the loss runs in (``jnp.bfloat16``); master
        parameters, gradients and optimizer state stay in their own dtype.

    Calling the step places the model and optimizer state by ``sharding`` (a no-op once
    they are placed) and the batch with :func:`shard_batch`. ``aux`` leaves whose leading
    axis is the per-device batch come back concatenated (one row per example); other aux
    leaves and recorded layer state (BatchNorm statistics) are averaged over devices.
    With a ``key`` each device's loss gets ``fold_in(key, device index)``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from functree.parallel import DataParallelStep
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> loss_fn = lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2)
      >>> opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
      >>> step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding="fsdp")
      >>> model = {"w": jnp.zeros(2)}
      >>> model, state, metrics = step(model, opt.init(model), (jnp.eye(2), jnp.array([1.0, 2.0])))
      >>> model["w"], ft.optim.context(state).samples_seen
      (Array([0.1, 0.2], dtype=float32), Array(2, dtype=int32))
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: Any,
        *,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        sharding: Any = None,
        compute_dtype: Any = None,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
        on_nan: str | None = None,
        donate: bool = True,
    ):
        mesh = one_device_mesh(data_axis) if mesh is None else mesh
        check_data_axis(mesh, data_axis, "ft.train.train_step")
        _check_rules(sharding)
        self.compute_dtype = None if compute_dtype is None else check_compute_dtype(compute_dtype)
        super().__init__(loss_fn, optimizer, metrics=metrics, on_nan=on_nan, donate=donate)
        self.mesh, self.data_axis, self.sharding = auto_mesh(mesh), data_axis, sharding
        self.data_parallel = DataParallelOptimizer(self.optimizer, data_axis)

    # --- placement -----------------------------------------------------------------------
    def model_specs(self, model: Any) -> Any:
        """The ``PartitionSpec`` tree of ``model`` under ``sharding``."""
        return partition_specs(model, self.sharding, mesh=self.mesh, data_axis=self.data_axis)

    def state_specs(self, opt_state: Any) -> Any:
        """The ``PartitionSpec`` tree of the optimizer state (moments follow parameters)."""
        return partition_specs(opt_state, self.sharding, mesh=self.mesh, data_axis=self.data_axis,
                               strict=False)

    def place(self, model: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(model, opt_state)`` placed on the mesh by the sharding rules.

        Arrays already on this mesh (a previous step's outputs) are passed as they are:
        the step's sharding constraints keep them placed by the rules.
        """
        if _on_mesh((model, opt_state), self.mesh):
            return model, opt_state
        return (place(model, self.model_specs(model), self.mesh),
                place(opt_state, self.state_specs(opt_state), self.mesh))

    def shard_batch(self, batch: Any) -> Any:
        """The global batch from this process's share (:func:`shard_batch` on this mesh)."""
        return shard_batch(batch, self.mesh, self.data_axis)

    # --- the step ------------------------------------------------------------------------
    def _per_device(self, model: Any, opt_state: Any, batch: Any, key: Any) -> tuple[Any, ...]:
        axis, dtype = self.data_axis, self.compute_dtype
        model = jax.tree.map(lambda x: jax.lax.pcast(x, axis, to="varying") if is_array(x) else x, model)
        if key is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))

        def objective(m: Any, b: Any) -> tuple[Any, Any]:
            if dtype is not None:
                m, b = cast(m, dtype), cast_floating(b, dtype)
            (loss, aux), updates = nn.collect_state(lambda mm: self.compute_loss(mm, b, key), m)
            return loss.astype(jnp.float32) if dtype is not None else loss, (aux, updates)

        (loss, (aux, updates)), grads = self.data_parallel.compute_gradients(
            objective, model, batch, has_aux=True, state=opt_state
        )
        if self.optimizer.accumulate > 1:  # microbatch outputs come stacked: (k, n / k, ...)
            aux = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]) if x.ndim >= 2 else x, aux)
            updates = jax.tree.map(lambda u: u[-1], updates)
        loss = jax.lax.pmean(loss, axis)
        return loss, grads, jax.tree.map(_stack, aux), jax.tree.map(_stack, updates)

    def apply(
        self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None,
        enabled: jax.Array | None = None,
    ) -> tuple[Any, Any, Any, Any, jax.Array | None]:
        """One data-parallel optimizer step: ``(model, opt_state, loss, aux, nonfinite)``."""
        mesh, axis = self.mesh, self.data_axis
        n = mesh.shape[axis]
        _check_batch(batch, n, axis)
        in_batch = batch_specs(batch, axis)
        batch = constrain(batch, in_batch, mesh)
        model_specs, state_specs = self.model_specs(model), self.state_specs(opt_state)
        replicated = jax.tree.map(lambda x: PartitionSpec(), model)
        gathered = constrain(model, replicated, mesh)  # FSDP: the all-gather
        opt_state = constrain(opt_state, state_specs, mesh)
        key_spec = None if key is None else PartitionSpec()
        loss, grads, aux, updates = jax.shard_map(
            self._per_device, mesh=mesh,
            in_specs=(PartitionSpec(), state_specs, in_batch, key_spec),
            out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axis), PartitionSpec(axis)),
        )(gathered, opt_state, batch, key)
        local = batch_size_of(batch) // n
        aux = jax.tree.map(lambda x: _merge_devices(x, local), aux)
        updates = jax.tree.map(lambda x: _merge_devices(x, -1), updates)
        grads = constrain(grads, partition_specs(trained_view(model, self.optimizer.wrt), self.sharding, mesh=mesh,
                                                 data_axis=axis, strict=False), mesh)
        nonfinite = keep = None
        if self.on_nan is not None or enabled is not None:  # the optimizer's one skipping rule
            nonfinite = _first_nonfinite(loss, grads)
            keep = nonfinite == -1 if enabled is None else (nonfinite == -1) & enabled
        new_model, new_state = self.optimizer.apply_gradients(
            grads, model, opt_state, minibatch_size=batch_size_of(batch), loss=loss, apply_if=keep
        )
        if updates:
            if self.compute_dtype is not None:  # statistics recorded in the compute dtype
                updates = jax.tree.map(lambda u: u.astype(jnp.float32) if u.dtype == self.compute_dtype else u,
                                       updates)
            new_model = nn.apply_state(new_model, updates)
        if keep is not None:  # the model, layer state included, as it was
            new_model = select(keep, new_model, model)
        new_model = constrain(new_model, model_specs, mesh)
        new_state = constrain(new_state, state_specs, mesh)
        return new_model, new_state, loss, aux, nonfinite

    def __call__(self, model: Any, opt_state: Any, batch: Any, key: jax.Array | None = None) -> Any:
        if self._guard.fresh(model, opt_state):  # a previous step's outputs are placed already
            model, opt_state = self.place(model, opt_state)
        return super().__call__(model, opt_state, self.shard_batch(batch), key)

    def __repr__(self) -> str:
        return (f"{super().__repr__()[:-1]}, mesh={dict(self.mesh.shape)}, data_axis={self.data_axis!r}, "
                f"sharding={self.sharding!r}, compute_dtype={self.compute_dtype})")


class DataParallelEvalStep(EvalStep):
    """An :class:`ft.train.EvalStep` on a batch split over ``data_axis`` of ``mesh``.

    The forward pass is partitioned by XLA from the batch's and the model's shardings
    (no collectives of functree's own); metrics are over the global batch.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from functree.parallel import DataParallelEvalStep
      >>> evaluate = DataParallelEvalStep(lambda m, b: jnp.mean(b * m), mesh=jax.make_mesh((1,), ("data",)))
      >>> evaluate(jnp.float32(2.0), jnp.arange(4.0))
      {'loss': Array(3., dtype=float32)}
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        sharding: Any = None,
        compute_dtype: Any = None,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
    ):
        mesh = one_device_mesh(data_axis) if mesh is None else mesh
        check_data_axis(mesh, data_axis, "ft.train.eval_step")
        _check_rules(sharding)
        self.compute_dtype = None if compute_dtype is None else check_compute_dtype(compute_dtype)
        self.mesh, self.data_axis, self.sharding = auto_mesh(mesh), data_axis, sharding
        super().__init__(loss_fn, metrics=metrics)

    def compute_loss(self, model: Any, batch: Any, key: jax.Array | None = None) -> tuple[Any, Any]:
        if self.compute_dtype is not None:
            model, batch = cast(model, self.compute_dtype), cast_floating(batch, self.compute_dtype)
        loss, aux = super().compute_loss(model, batch, key)
        return (loss.astype(jnp.float32) if self.compute_dtype is not None else loss), aux

    def step(self, model: Any, batch: Any, key: jax.Array | None = None) -> dict[str, jax.Array]:
        _check_batch(batch, self.mesh.shape[self.data_axis], self.data_axis)
        batch = constrain(batch, batch_specs(batch, self.data_axis), self.mesh)
        return super().step(model, batch, key)

    def shard_batch(self, batch: Any) -> Any:
        """The global batch from this process's share (:func:`shard_batch` on this mesh)."""
        return shard_batch(batch, self.mesh, self.data_axis)

    def place(self, model: Any) -> Any:
        """``model`` placed on the mesh by the sharding rules."""
        return place(model, partition_specs(model, self.sharding, mesh=self.mesh, data_axis=self.data_axis),
                     self.mesh)

    def __call__(self, model: Any, batch: Any, key: jax.Array | None = None) -> dict[str, jax.Array]:
        return super().__call__(self.place(model), self.shard_batch(batch), key)
