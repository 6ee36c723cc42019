"""Several training steps in one compiled call: ``lax.scan`` over the one-step program.

``ft.train.TrainStep(loss_fn, opt, steps_per_call=k)`` runs ``k`` steps per call: its
batch holds ``k`` minibatches stacked along a new leading axis (:func:`stack_batches`),
and the jitted program is

    (model, opt_state, log), metrics = lax.scan(one_step, (model, opt_state, log), batch)

where ``one_step`` is the step's own single-step program (its gate, its log record, its
key folding by the learning context's step) on ``batch[i]``: the numbers are those of
``k`` separate calls, and the metrics come back with a leading axis of size ``k``. On
the dispatch-bound steps of small models (RL, scientific loops) one call then costs the
Python dispatch once for ``k`` steps. Nothing here knows what one step does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from functree._host_buffers import own_host, private
from functree.parallel._placement import check_batch

__all__ = ["stack_batches", "check_steps_per_call", "check_stacked", "scan_steps", "shard_stacked",
           "step_slice"]

BAD_STEPS_PER_CALL = """\
steps_per_call must be a positive int (the number of steps one compiled call runs), got {given!r}.

    wrong:  ft.train.TrainStep(loss_fn, opt, steps_per_call=0)
    right:  ft.train.TrainStep(loss_fn, opt, steps_per_call=16)"""

NOT_STACKED = """\
A step with steps_per_call={k} takes {k} minibatches stacked along a new leading axis \
(one slice per step), but batch leaf {path} has shape {shape}; expected ({k}, ...).
Stack the minibatches with ft.train.stack_batches:

    wrong:  step(model, opt_state, batch)
    right:  step(model, opt_state, ft.train.stack_batches([batch_1, ..., batch_{k}]))"""

EMPTY_GROUP = """\
ft.train.stack_batches needs at least one minibatch, got none.

    right:  ft.train.stack_batches([batch_1, batch_2, batch_3, batch_4])"""

UNEVEN_BATCHES = """\
ft.train.stack_batches needs minibatches of one structure and shape: {what}.
The last minibatch of an epoch is often shorter; drop it, or run it as a step of its own:

    wrong:  ft.train.stack_batches(list(ft.train.batches(data, batch_size=32)))
    right:  ft.train.stack_batches(list(ft.train.batches(data, batch_size=32, drop_last=True)))"""


MIXED_DTYPES = """\
ft.train.stack_batches stacks each leaf's minibatches into one array of one dtype, but leaf \
{path} has dtype {first} in minibatch 0 and {other} in minibatch {i}: stacked, both would \
become {promoted}{changed}. Give the minibatches one dtype where they are made:

    wrong:  ft.train.stack_batches([(x, labels_int64), (x, labels_uint64)])
    right:  ft.train.stack_batches([(x, labels.astype(np.int32)) for x, labels in group])"""


def check_steps_per_call(k: Any) -> int:
    """``k`` when it is a positive int, else a ``ValueError`` naming the fix."""
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(BAD_STEPS_PER_CALL.format(given=k))
    return int(k)


def _path(path: Any) -> str:
    return jax.tree_util.keystr(path) or "(the batch itself)"


def stack_batches(batches: Sequence[Any]) -> Any:
    """``k`` minibatches of one structure as one batch whose leaves have a new leading
    axis of size ``k``: the input of a step with ``steps_per_call=k``.

    ``out[leaf][i] = batches[i][leaf]``; NumPy leaves are stacked on the host (one
    transfer when the step runs), JAX arrays on their device. A leaf's minibatches share
    one shape and one kind of dtype (one may be wider: ``float32`` beside ``float64``
    stacks as ``float64``); others are refused (:data:`MIXED_DTYPES`), not promoted.

    Example:
      >>> import functree as ft, numpy as np
      >>> group = [(np.zeros((4, 3)), np.zeros(4)) for _ in range(16)]
      >>> x, y = ft.train.stack_batches(group)
      >>> x.shape, y.shape
      ((16, 4, 3), (16, 4))
    """
    batches = list(batches)
    if not batches:
        raise ValueError(EMPTY_GROUP)
    first, treedef = jax.tree_util.tree_flatten_with_path(batches[0])
    columns: list[list[Any]] = [[x] for _, x in first]
    for i, batch in enumerate(batches[1:], 1):
        leaves, other = jax.tree.flatten(batch)
        if other != treedef:
            raise ValueError(UNEVEN_BATCHES.format(
                what=f"minibatch {i} is a {other}, minibatch 0 a {treedef}"))
        for (path, x0), x, column in zip(first, leaves, columns):
            if np.shape(x) != np.shape(x0):
                raise ValueError(UNEVEN_BATCHES.format(
                    what=f"leaf {_path(path)} has shape {np.shape(x0)} in minibatch 0 but "
                         f"{np.shape(x)} in minibatch {i}"))
            if hasattr(x, "dtype") and hasattr(x0, "dtype") and x.dtype != x0.dtype:  # (Python numbers: weak)
                _check_promotion(path, x0.dtype, x.dtype, i)
            column.append(x)
    on_host = [all(isinstance(x, np.ndarray | np.generic | int | float) for x in c) for c in columns]
    device_columns = [c for c, host in zip(columns, on_host) if not host]
    on_device = _stack_columns(device_columns) if device_columns else []  # one dispatch
    it = iter(on_device)
    stacked = [np.stack(c) if host else next(it) for c, host in zip(columns, on_host)]
    return jax.tree_util.tree_unflatten(treedef, stacked)


def _check_promotion(path: Any, first: Any, other: Any, i: int) -> None:
    """:data:`MIXED_DTYPES` unless stacking ``first`` with ``other`` only widens one of
    them within its kind (``float32`` beside ``float64``: values kept). ``np.stack`` would
    make ``int64`` beside ``uint64`` ``float64`` (values rounded), ``bool`` beside ``int32``
    ``int32`` (a mask read as indices), ``int32`` beside ``float32`` ``float64``."""
    try:
        promoted = np.result_type(first, other)
    except TypeError:  # (no common NumPy dtype: a PRNG key beside an array, bfloat16 beside float16)
        promoted = None
    if promoted is not None and first.kind == other.kind and promoted in (first, other):
        return
    changed = ", changing values" if promoted is not None and promoted.kind == "f" and \
        {first.kind, other.kind} <= set("iub") else ""
    raise ValueError(MIXED_DTYPES.format(path=_path(path), first=first, other=other, i=i,
                                         promoted=promoted or "an error", changed=changed))


@jax.jit
def _stack_columns(columns: list[list[Any]]) -> list[Any]:
    return [jnp.stack(c) for c in columns]


def check_stacked(batch: Any, k: int) -> None:
    """A ``ValueError`` naming the leaf, its shape and the fix unless every leaf of
    ``batch`` has leading axis ``k``."""
    if all(np.shape(x)[:1] == (k,) for x in jax.tree.leaves(batch)):
        return  # the common case: no key paths built
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if np.shape(x)[:1] != (k,):
            raise ValueError(NOT_STACKED.format(k=k, path=_path(path), shape=tuple(np.shape(x))))


def step_slice(batch: Any, i: int) -> Any:
    """The minibatch of step ``i`` in a stacked batch."""
    return jax.tree.map(lambda x: x[i], batch)


def scan_steps(one: Callable[..., Any], model: Any, opt_state: Any, batch: Any, key: Any, log: Any) -> Any:
    """``one(model, opt_state, batch[i], key, log) -> (model, opt_state, metrics, log)``
    for ``i = 0 .. k-1`` under ``lax.scan``: ``(model, opt_state, metrics, log)`` with
    every leaf of ``metrics`` stacked along a leading axis of size ``k``.

    Leaves that are not arrays (an Equinox module's functions, kept static by the jit)
    stay out of the carry and are put back around each step.
    """
    leaves, treedef = jax.tree.flatten((model, opt_state))
    traced = [isinstance(x, jax.Array) for x in leaves]
    fixed = [None if t else x for x, t in zip(leaves, traced)]

    def rebuild(arrays: list[Any]) -> Any:
        it = iter(arrays)
        return jax.tree.unflatten(treedef, [next(it) if t else x for x, t in zip(fixed, traced)])

    def body(carry: Any, b: Any) -> Any:
        arrays, log = carry
        m, s = rebuild(arrays)
        m, s, metrics, log = one(m, s, b, key, log)
        out = jax.tree.leaves((m, s))
        return ([x for x, t in zip(out, traced) if t], log), metrics

    start = [x for x, t in zip(leaves, traced) if t]
    (arrays, log), metrics = jax.lax.scan(body, (start, log), batch)
    model, opt_state = rebuild(arrays)
    return model, opt_state, metrics, log


def shard_stacked(mesh: Any, data_axis: str, batch: Any) -> Any:
    """A stacked batch on ``mesh``: each step's minibatch (axis 1) split over
    ``data_axis``, the step axis whole; in several processes, each process's share of
    every minibatch (the global minibatch is their concatenation in process order)."""
    sharding = NamedSharding(mesh, PartitionSpec(None, data_axis))
    whole = NamedSharding(mesh, PartitionSpec())
    devices = mesh.shape[data_axis]

    def one(x: Any) -> Any:
        if np.ndim(x) < 2:
            return x if isinstance(x, jax.Array) and x.sharding == whole else jax.device_put(private(x), whole)
        if isinstance(x, jax.Array) and (x.sharding == sharding or not x.is_fully_addressable):
            return x
        if jax.process_count() == 1:
            check_batch(np.empty((np.shape(x)[1], 0)), devices, data_axis)
            return jax.device_put(private(x), sharding)  # (a copy of NumPy: JAX would alias it)
        shape = (np.shape(x)[0], np.shape(x)[1] * jax.process_count(), *np.shape(x)[2:])
        check_batch(np.empty((shape[1], 0)), devices, data_axis)
        return jax.make_array_from_process_local_data(sharding, own_host(x), shape)

    return jax.tree.map(one, batch)
