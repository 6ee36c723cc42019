"""``ft.nn.update_bn``: every BatchNorm's running statistics recomputed over a pass of data
(torch's ``torch.optim.swa_utils.update_bn``).

An averaged model (SWA's ``uniform_average``, an ``ema``) holds averaged weights but the last
step's running statistics, which belong to other weights; the statistics of the averaged
weights are recomputed by running it over the training data once with each BatchNorm's
cumulative average (``momentum=None``), from scratch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from functree._source import call_refusal
from functree._where import following
from functree.nn._eager_keys import model_reads, traced_afresh
from functree.nn._normalization import BatchNorm
from functree.nn._precision import statistics_dtype
from functree.nn._state import apply_state, collect_state

__all__ = ["update_bn", "NO_BATCH_NORM", "NO_BATCHES", "CALL_ARGUMENTS"]

NO_BATCH_NORM = """\
ft.nn.update_bn: the model holds no ft.nn.BatchNorm with running statistics \
(track_running_stats=True), so there is nothing to recompute. It recomputes ft.nn.BatchNorm's \
statistics only (another library's BatchNorm inside the model is not seen).

    wrong:  ft.nn.update_bn(model_without_batch_norm, batches)
    right:  model = ft.nn.update_bn(model, batches)     # a model holding ft.nn.BatchNorm layers"""

NO_BATCHES = """\
ft.nn.update_bn: `batches` gave no batch, so every BatchNorm's statistics would be reset to \
mean 0, variance 1 (torch's update_bn does that without a word). Pass the data itself, not an \
iterator already used up:

    wrong:  it = iter(batches); list(it); ft.nn.update_bn(model, it)
    right:  model = ft.nn.update_bn(model, ft.train.batches((x, y), 64))"""

CALL_ARGUMENTS = """\
ft.nn.update_bn calls call(model, batch) once per batch, with the batch whole (a tuple (x, y) \
as it is, not its first element); {name}{signature} cannot be called so (Python's "{problem}"). \
Take the model it is given and the batch, and call the model on the batch's input:

    wrong:  ft.nn.update_bn(model, batches, call={name})   # {name}{signature}
    right:  ft.nn.update_bn(model, batches, call=lambda m, batch: m(batch[0]))   # your call, on the batch given"""


def _check_call(call: Callable[..., Any]) -> None:
    """:data:`CALL_ARGUMENTS` for a ``call`` that cannot take ``(model, batch)`` (``lambda m:
    m(x)``), which failed inside the jitted pass with Python's bare arity error. A callable
    without a readable signature is left to its call."""
    refused = call_refusal(call, None, None)
    if refused is not None:
        name, signature, problem = refused
        raise TypeError(CALL_ARGUMENTS.format(name=name, signature=signature, problem=problem))


def _is_batch_norm(node: Any) -> bool:
    return isinstance(node, BatchNorm)


def _tracking(bn: Any) -> bool:
    return isinstance(bn, BatchNorm) and bn.running_mean is not None and bn.running_variance is not None


def _reset(bn: BatchNorm) -> BatchNorm:
    """``bn`` counting from scratch: statistics 0 and 1 (torch's ``reset_running_stats``),
    a cumulative average (``momentum=None``) with its count at 0 (per member in a Stack), in
    training mode. Kept in float32 for a bfloat16/float16 layer while they are summed: the
    ``n``-th batch's share ``1/n`` of a change rounds away in bfloat16 once it is below half
    its spacing (:func:`_restored` rounds the result once)."""
    assert bn.running_mean is not None and bn.running_variance is not None
    shape, wide = jnp.shape(bn.running_mean), statistics_dtype(bn.running_mean.dtype)
    return bn.replace(running_mean=jnp.zeros(shape, wide), running_variance=jnp.ones(shape, wide),
                      batches_tracked=jnp.zeros(shape[:-1], jnp.int32), momentum=None, training=True)


def _restored(original: BatchNorm, computed: BatchNorm) -> BatchNorm:
    """``original`` holding ``computed``'s statistics in its own dtype (and its count where
    ``original`` counts: momentum None)."""
    assert original.running_mean is not None and computed.running_mean is not None
    assert original.running_variance is not None and computed.running_variance is not None
    count = computed.batches_tracked if original.batches_tracked is not None else None
    return original.replace(running_mean=computed.running_mean.astype(original.running_mean.dtype),
                            running_variance=computed.running_variance.astype(original.running_variance.dtype),
                            batches_tracked=count)


def _called(model: Any, x: Any) -> Any:
    return model(x)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _recorded(model: Any, x: Any, call: Callable[[Any, Any], Any], reads: Any = None) -> Any:
    """``model`` after ``call(model, x)``: the state its layers recorded written back (one
    program per model structure, input shape, ``call`` and ``reads``, what their Python
    reads now: :func:`~functree.nn._eager_keys.model_reads`)."""
    return apply_state(model, collect_state(lambda m: call(m, x), model)[1])


def update_bn(model: Any, batches: Iterable[Any], call: Callable[[Any, Any], Any] | None = None) -> Any:
    """``model`` with every ``ft.nn.BatchNorm``'s running statistics recomputed over
    ``batches``: torch's ``torch.optim.swa_utils.update_bn(loader, model)``.

    Each BatchNorm (with running statistics) starts from mean 0, variance 1 and, in training
    mode with a cumulative average (``momentum=None``), takes every batch's statistics with
    the same weight: after ``n`` batches ::

        running_mean = (1/n) Σ_i mean_i,     running_variance = (1/n) Σ_i var_i

    (``var_i`` unbiased where the layer's ``unbiased_running_variance=True``, as torch's).
    A batch that is a tuple or list gives its first element as the input (torch's rule for a
    loader of ``(x, y)``), called as ``model(x)``, or ``call(model, batch)`` with the batch
    whole. The returned model keeps every other field as ``model`` had it: each BatchNorm's
    momentum, epsilon and mode, every other layer's mode (a layer in inference mode, such as
    dropout, stays so; torch's ``update_bn`` puts the whole model in training mode) and the
    model's other state (dropout keys). A batch committed to another device than the model's
    is put on the model's (torch's ``device=``), as ``Trainer.evaluate`` puts its data. A BatchNorm with ``momentum=None`` keeps the new
    count (torch's ``num_batches_tracked``). A bfloat16 or float16 BatchNorm's statistics are
    summed in float32 and rounded once to its dtype (kept), where torch's sum in the buffer's
    dtype stalls: in bfloat16 a batch's ``1/n`` share of a change rounds away once below half
    its spacing. Each batch is one compiled call (a new batch
    shape compiles again, and so does a new value of what the model's Python reads: a
    notebook's global its ``__call__`` reads); run it eagerly, not under ``jax.jit``.

    Example: the statistics of averaged weights (SWA)
      >>> import functree as ft, jax, jax.numpy as jnp, numpy as np
      >>> model = ft.nn.Sequential(ft.nn.Dense(3, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4))
      >>> x = np.random.default_rng(0).normal(size=(12, 3)).astype(np.float32)
      >>> fresh = ft.nn.update_bn(model, [x[:6], x[6:]])
      >>> h = np.asarray(model.layers[0](x))
      >>> bool(np.allclose(fresh.layers[1].running_mean, (h[:6].mean(0) + h[6:].mean(0)) / 2, atol=1e-6))
      True
      >>> fresh.layers[1].momentum, fresh.layers[1].training     # as the model had them
      (0.99, False)
    """
    if call is not None:
        _check_call(call)
    nodes, treedef = jax.tree.flatten(model, is_leaf=_is_batch_norm)
    if not any(_tracking(node) for node in nodes):
        raise ValueError(NO_BATCH_NORM)
    working = treedef.unflatten([_reset(node) if _tracking(node) else node for node in nodes])
    call = call if call is not None else _called
    reads = model_reads(model, (call,))  # a notebook's global the model reads: a key of the program
    recorded = _recorded if reads is not None else traced_afresh(_recorded, static_argnums=(2, 3))
    seen = 0
    for batch in batches:
        x = batch[0] if call is _called and isinstance(batch, (tuple, list)) else batch
        x = following(working, x)  # a batch committed to another device than the model's: moved there
        working = recorded(working, x, call, reads)
        seen += 1
    if not seen:
        raise ValueError(NO_BATCHES)
    computed = jax.tree.flatten(working, is_leaf=_is_batch_norm)[0]
    return treedef.unflatten([_restored(node, new) if _tracking(node) else node for node, new in zip(nodes, computed)])
