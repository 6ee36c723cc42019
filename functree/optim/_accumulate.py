"""``ft.optim.Optimizer(accumulate=k)``: each batch split into ``k`` microbatches along its
leading axis, their gradients averaged inside one ``lax.scan`` (memory of one microbatch),
the model's layer state (running statistics, counts) threaded from one microbatch to the
next, as ``k`` torch forwards update it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from functree._examples import check_example_axis
from functree._traces import staged
from functree._tree import bounded_put, cached, is_array_value
from functree.losses._weighted import WeightedMean, ratio
from functree.nn._eager_keys import code_roots
from functree.nn._precision import statistics_dtype
from functree.nn._reads import library_class, reads_key
from functree.nn._salt import salted_call
from functree.nn._state import apply_state, threaded_state
from functree.optim._subset import trained_view

if TYPE_CHECKING:
    from functree.optim._optimizer import Optimizer

__all__ = ["accumulated_gradients", "check_accumulation", "leading_dimension", "BAD_ACCUMULATION", "BAD_ACCUMULATION_ON_MESH"]

BAD_ACCUMULATION = """\
accumulate={k} needs the batch's leading dimension to be a multiple of {k}; \
the leaf at {path} has shape {shape}.
Each step splits the batch into {k} microbatches and averages their gradients (on a mesh, \
each device splits its own share: the batch must be a multiple of devices x {k}):

    wrong:  opt.minimize(loss_fn, model, state, x, y)
    right:  x, y = jax.tree.map(lambda a: a[: {k} * (len(a) // {k})], (x, y))   # every batch argument
            opt.minimize(loss_fn, model, state, x, y)
"""


BAD_ACCUMULATION_ON_MESH = """\
accumulate={k} on the {n} devices of mesh axis {axis!r} needs the batch's leading dimension to \
be a multiple of {n} x {k} = {nk}: each device splits its share ({share} examples here) into \
{k} microbatches. The leaf at {path} has {size} examples.

    wrong:  ft.train.batches(data, batch_size={size})
    right:  ft.train.batches(data, batch_size={right}, drop_last=True)   # a multiple of {nk}
       or:  ft.optim.Optimizer(transform, accumulate={fewer})   # divides each device's {share}
"""


def check_accumulation(batch: Any, devices: int, k: int, axis: str) -> None:
    """Before a step on a mesh splits each device's share into ``k`` microbatches: a
    ``ValueError`` (:data:`BAD_ACCUMULATION_ON_MESH`) naming the leaf, the global batch
    size and the multiple of ``devices * k`` it needs; the microbatch split inside the
    device would name the share's shape and a fix for one device."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(x)
        if shape and shape[0] % (devices * k):
            size, share = shape[0], shape[0] // devices
            raise ValueError(BAD_ACCUMULATION_ON_MESH.format(
                k=k, n=devices, axis=axis, nk=devices * k, share=share, size=size,
                path=jax.tree_util.keystr(path) or "<root>", right=max(devices * k, size // (devices * k) * devices * k),
                fewer=max(d for d in range(1, k + 1) if share % d == 0) if share else 1))


def leading_dimension(batch: Sequence[Any]) -> int:
    """The minibatch size of ``batch``: the leading dimension of its first array (1 if none)."""
    for leaf in jax.tree.leaves(batch):
        shape = getattr(leaf, "shape", ())
        if len(shape) >= 1:
            return int(shape[0])
    return 1


def _split(path: Any, x: Any, k: int) -> Any:
    shape = jnp.shape(x)
    if not shape or shape[0] % k:
        raise ValueError(BAD_ACCUMULATION.format(k=k, path=jax.tree_util.keystr(path) or "<root>", shape=shape))
    return jnp.reshape(x, (k, shape[0] // k, *shape[1:]))


def _threaded(carried: dict[Any, Any], recorded: dict[Any, Any]) -> dict[Any, Any]:
    """The next microbatch's layer state: what this one recorded, in the carried dtypes
    (a field recorded in another shape, or not recorded, keeps its carried value)."""
    out = {}
    for path, value in carried.items():
        new = recorded.get(path)
        same = new is not None and jnp.shape(new) == jnp.shape(value)
        out[path] = jnp.asarray(new).astype(value.dtype) if same else value
    return out


# An eager step's compiled accumulation, one per optimizer, loss function, flags and value
# of what their Python and the model's reads (``_reads.reads_key``, as an eager Stack's):
# jax.jit keys the rest (tree definitions, shapes, dtypes). Bounded like every such cache.
_RUNS: dict[Any, Callable[..., Any]] = {}


def accumulated_gradients(opt: Optimizer, loss_fn: Callable[..., Any], model: Any, batch: tuple, has_aux: bool,
                          state: Any, key: Any = None) -> tuple[Any, Any]:
    """:func:`_accumulated`, run eagerly (no jaxpr staged around it: a notebook's
    ``opt.minimize``) in a ``jax.jit`` made once per optimizer, loss function and what
    their Python reads: the scan's body, a fresh closure over the model at each call, was
    traced and compiled again at every eager step."""
    if not staged():
        run = _eager_run(opt, loss_fn, model, batch, has_aux, state, key)
        if run is not None:
            return run(model, batch, state, key)
    return _accumulated(opt, loss_fn, model, batch, has_aux, state, key)


def _eager_run(opt: Optimizer, loss_fn: Callable[..., Any], model: Any, batch: tuple, has_aux: bool,
               state: Any, key: Any) -> Callable[..., Any] | None:
    """The compiled accumulation of this optimizer and loss function, or None where an
    argument holds a value that is not an array (a Python number the loss may branch on)
    or something read cannot be keyed (then the plain scan: traced afresh, never stale)."""
    if not all(map(is_array_value, jax.tree.leaves((model, batch, state, key)))):
        return None
    classes, functions = code_roots(model)
    overrides = tuple(c for c in type(opt).__mro__ if c is not object and not library_class(c))
    reads = reads_key((*classes, *overrides), (*functions, loss_fn))
    if reads is None:
        return None
    signature, run = cached(_RUNS, (id(opt), has_aux, key is None, reads))
    if signature is None:
        return None
    if run is None:
        def accumulate(model: Any, batch: tuple, state: Any, key: Any) -> tuple[Any, Any]:
            return _accumulated(opt, loss_fn, model, batch, has_aux, state, key)

        run = jax.jit(accumulate)
        bounded_put(_RUNS, signature, run)
    return run


def _accumulated(opt: Optimizer, loss_fn: Callable[..., Any], model: Any, batch: tuple, has_aux: bool,
                 state: Any, key: Any = None) -> tuple[Any, Any]:
    """``(loss, grads)`` of :meth:`Optimizer.compute_gradients` with ``opt.accumulate = k``:
    ``batch`` split into ``k`` microbatches along its leading axis, each one's gradients
    from ``opt.get_gradients`` (microbatch ``i`` given ``jax.random.fold_in(key, i)``),
    summed in one ``lax.scan`` (memory of one microbatch) and divided by ``k``; the
    outputs come stacked, ``(k, ...)``, the loss their mean. A
    :class:`~functree.losses.WeightedMean` loss weighs microbatch ``i`` by its ``count``
    (kept tokens): ``Σ count_i ∇value_i / Σ count_i``, the whole minibatch's gradient, and
    the loss is ``WeightedMean(Σ total_i, Σ count_i)``."""
    k = opt.accumulate
    check_example_axis(batch, f"accumulate={k} microbatches")
    micro = jax.tree_util.tree_map_with_path(lambda p, x: _split(p, x, k), batch)

    # Floating layer state (running statistics) is threaded through the microbatches, as
    # torch's k forwards update it k times; the gradients are unchanged (training mode
    # normalises with the batch's statistics). PRNG keys are not: see threaded_state.
    threaded = threaded_state(model) if getattr(loss_fn, "__ft_records_state__", False) else {}

    def body(carry: Any, xs: tuple) -> tuple[Any, Any]:
        (total, carried), (mb, i) = carry, xs
        m = apply_state(model, carried) if carried else model
        fn = loss_fn if key is None else functools.partial(loss_fn, key=jax.random.fold_in(key, i))
        out, grads = opt.get_gradients(salted_call(fn, i), m, *mb, has_aux=has_aux, state=state)
        if carried:
            carried = _threaded(carried, out[1][1])
        loss = out[0] if has_aux else out
        if isinstance(loss, WeightedMean):  # weighed by its count (kept tokens): see _weighted
            return (jax.tree.map(lambda t, g: t + g.astype(t.dtype) * loss.count.astype(t.dtype), total, grads),
                    carried), out
        return (jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads), carried), out

    trained = trained_view(model, opt.wrt)
    # zeros_like: on a mesh the model is varying over the data axis (each device's gradients
    # are), and scan's carry must keep that type from the start
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, _sum_dtype(p)), trained)
    (total, _), outs = jax.lax.scan(body, (zeros, threaded), (micro, jnp.arange(k, dtype=jnp.uint32)))
    if isinstance(outs[0] if has_aux else outs, WeightedMean):
        return _weighted(total, outs, has_aux, trained)
    grads = jax.tree.map(lambda g, p: (g / k).astype(jnp.result_type(p)), total, trained)
    if has_aux:
        return (jnp.mean(outs[0]), outs[1]), grads
    return jnp.mean(outs), grads


def _sum_dtype(p: Any) -> Any:
    """The dtype the microbatches' gradients of parameter ``p`` are summed in: float32 for a
    bfloat16/float16 one (in bfloat16 a sum of 256 and seven 1s stays 256: the mean of 8
    microbatches came out 32, not 32.875), rounded to ``p``'s dtype once, after the mean."""
    dtype = jnp.result_type(p)
    return statistics_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else dtype


def _weighted(total: Any, outs: Any, has_aux: bool, trained: Any) -> tuple[Any, Any]:
    """The loss and gradients of :func:`accumulated_gradients` for a
    :class:`~functree.losses.WeightedMean` loss, from the sum ``total = Σ_i count_i ∇value_i``:
    ``total / Σ_i count_i`` (``= Σ_i ∇total_i / Σ_i count_i``, the whole minibatch's
    gradient: the counts hold no derivative), zero when every count is 0, in the dtypes of
    the ``trained`` parameters; the loss ``WeightedMean(Σ total_i, Σ count_i)``."""
    stacked = outs[0] if has_aux else outs
    loss = WeightedMean(jnp.sum(stacked.total), jnp.sum(stacked.count))
    grads = jax.tree.map(lambda g, p: ratio(g, loss.count.astype(g.dtype)).astype(jnp.result_type(p)), total, trained)
    return ((loss, outs[1]) if has_aux else loss), grads
