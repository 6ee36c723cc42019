"""The learning context (CNTK): where training stands, carried in the optimizer state.

An :class:`ft.optim.Optimizer`'s state holds one :class:`LearningContext`;
``opt.update(..., minibatch_size=n, loss=l)`` advances it and passes it to every
transform (optax extra argument ``context=``); the training loop advances the sweep with
:func:`next_sweep`. Schedules and rate units read it. A functree transform used alone as
an optax transformation keeps a context of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree._alias import is_deleted
from functree._repr import shown_repr
from functree._tree import bounded_put, cached, register_record

__all__ = ["LearningContext", "context", "next_sweep", "initial_context", "advance"]

NO_CONTEXT = """\
This optimizer state holds no ft.optim.LearningContext.
Build the state with a functree optimizer, which adds one to any optax transform:

    wrong:  state = optax.adam(1e-3).init(params)
    right:  opt = ft.optim.Optimizer(optax.adam(1e-3)); state = opt.init(model)
       or:  state = ft.optim.adam(1e-3).init(model)
"""


COUNTERS = ("step", "sweep", "samples_seen", "minibatch_size")

# The counters array's last axis: step, sweep, samples_seen's low 31 bits, minibatch size,
# samples_seen's high word (samples_seen = high · 2³¹ + low). Four int32 words held every
# count but samples_seen, which a long job passes 2³¹ − 1 in (1600 epochs of ImageNet): one
# int32 wrapped negative there and a schedule in samples started over, silently. The high
# word goes last so that files written with four counters read by appending a 0
# (:func:`widen_counters`).
SLOTS = 5
LOW_BITS = 31

STACKED_ALONG_ANOTHER_AXIS = """\
This learning context's counters have shape {shape}; the counts are packed along the last \
axis (size 5), so stacked optimizer states must put their member axes first:

    wrong:  states = jax.tree.map(lambda *x: jnp.stack(x, axis=-1), *member_states)
    right:  states = jax.tree.map(lambda *x: jnp.stack(x), *member_states)   # or jax.vmap(opt.init)

(A last axis of 4 is also a context saved before samples_seen took two words: ft.train's \
checkpoint readers widen it; a state kept another way reads with \
ft.optim.upgrade_state(old_state, optimizer, model).)
"""


@dataclasses.dataclass(frozen=True, repr=False)
class LearningContext:
    """Where training stands. All of it is arrays, so a jitted step never recompiles.

    Attributes:
      step: optimizer steps taken (updates applied).
      sweep: passes over the data set (epochs), advanced by :func:`next_sweep`.
      samples_seen: examples consumed by the steps taken (exact to 2⁶² − 1, see below).
      minibatch_size: size of the latest minibatch (1 until one is given).
      loss: the latest loss given to ``update(..., loss=)`` (NaN until one is given).

    The counts are packed along the last axis of one int32 array (``counters``) and
    the loss is a scalar of JAX's default float when the context was made (float32;
    float64 under ``jax_enable_x64``, where a float32 loss would round a float64 one to 7
    digits), and every loss written into it is cast to that dtype, so a carried state's
    dtypes never change between steps: two leaves, so the context adds almost nothing to a jitted
    step's dispatch. ``samples_seen`` takes two of its int32 words (``high · 2³¹ + low``), so
    a job past 2³¹ − 1 examples (2.1 billion: 1600 epochs of ImageNet) counts on: read on
    the host it is exact (a NumPy int64 without ``jax_enable_x64``, JAX's int64 with it);
    traced inside a jitted step without x64 it is float32 (exact to 2²⁴, then to 7
    significant digits: what a schedule needs; :func:`ft.optim.piecewise` compares both
    words, exactly). Stacked states (a vmapped ensemble or learning-rate sweep) add leading
    axes: ``counters`` is ``(..., 5)`` and every field reads one value per member.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.sgd(0.1)
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> _, state = tx.update({"w": jnp.ones(2)}, state, minibatch_size=8, loss=0.5)
      >>> ctx = ft.optim.context(state)
      >>> int(ctx.step), int(ctx.samples_seen), float(ctx.loss)
      (1, 8, 0.5)
      >>> ctx.replace(step=10)
      LearningContext(step=10, sweep=0, samples_seen=8, minibatch_size=8, loss=0.5)
    """

    counters: jax.Array
    loss: jax.Array
    # A checkpoint's loss is a running value, not a parameter: a float32 one restores into a
    # float64 context under jax_enable_x64 and back (functree.train's checkpoint reader).
    __ft_cast_on_restore__ = ("loss",)
    # A file written before samples_seen took two words (four counters) reads with its
    # high word 0 (functree.train's checkpoint reader, with a template or without).
    __ft_upgrade_on_restore__: ClassVar[Mapping[str, Callable[[Any], Any]]] = MappingProxyType(
        {"counters": lambda saved: widen_counters(saved)})

    @property
    def step(self) -> jax.Array:
        return self.counters[..., 0]

    @property
    def sweep(self) -> jax.Array:
        return self.counters[..., 1]

    @property
    def samples_seen(self) -> Any:
        return samples(self.counters)

    @property
    def minibatch_size(self) -> jax.Array:
        return self.counters[..., 3]

    def replace(self, **changes: Any) -> LearningContext:
        """A context with some fields changed (``step=``, ``sweep=``, ..., ``loss=``)."""
        loss = changes.pop("loss", self.loss)
        unknown = set(changes) - set(COUNTERS)
        if unknown:
            raise TypeError(f"LearningContext has no field(s) {sorted(unknown)}; fields: {[*COUNTERS, 'loss']}.")
        counters = self.counters
        batch = counters.shape[:-1]  # stacked contexts (vmapped ensembles, sweeps): leading axes
        if changes:
            columns = [counters[..., i] for i in range(SLOTS)]
            for i, n in enumerate(COUNTERS):
                if n in changes and n != "samples_seen":
                    columns[i] = jnp.broadcast_to(jnp.asarray(changes[n]).astype(jnp.int32), batch)
            if "samples_seen" in changes:
                columns[2], columns[4] = (jnp.broadcast_to(w, batch) for w in _words(changes["samples_seen"]))
            counters = jnp.stack(columns, axis=-1)
        return LearningContext(counters, jnp.broadcast_to(jnp.asarray(loss).astype(self.loss.dtype), batch))

    _replace = replace

    def __repr__(self) -> str:
        if is_deleted(self.counters) or is_deleted(self.loss):  # donated to a step: no values to read
            return f"LearningContext(counters={shown_repr(self.counters)}, loss={shown_repr(self.loss)})"
        try:  # stacked contexts show one list per field, a member per entry
            values = [np.asarray(getattr(self, n)).tolist() for n in COUNTERS]
            values.append(np.asarray(self.loss).tolist())
        except (TypeError, jax.errors.ConcretizationTypeError):
            return f"LearningContext(counters={self.counters!r}, loss={self.loss!r})"
        return "LearningContext(" + ", ".join(f"{n}={v}" for n, v in zip((*COUNTERS, "loss"), values)) + ")"


register_record(LearningContext, ["counters", "loss"])


def initial_context() -> LearningContext:
    """The context before the first step: zeros, minibatch size 1, loss NaN (of JAX's
    default float: float64 under ``jax_enable_x64``, the dtype every step then writes).

    Example:
      >>> import functree as ft
      >>> ft.optim.initial_context()
      LearningContext(step=0, sweep=0, samples_seen=0, minibatch_size=1, loss=nan)
      >>> float(ft.optim.linear_warmup(1.0, 10)(ft.optim.initial_context().replace(step=5)))
      0.5
    """
    # Host values put on the device: no program is compiled for them (on a GPU each eager
    # operation is a compile of its own before the first step).
    loss = np.array(np.nan, jnp.result_type(float))  # float32, or float64 under x64
    return LearningContext(jax.device_put(np.array([0, 0, 0, 1, 0], np.int32)), jax.device_put(loss))


def current(ctx: LearningContext, minibatch_size: Any = None, loss: Any = None) -> LearningContext:
    """The context seen *during* a step: this minibatch's size and loss, counts before it."""
    counters = ctx.counters
    if minibatch_size is not None:
        counters = _with_size(counters, _size(minibatch_size))
    return LearningContext(counters, _loss(ctx, loss))


def advance(ctx: LearningContext, minibatch_size: Any = None, loss: Any = None) -> LearningContext:
    """The context after a step on a minibatch of ``minibatch_size`` examples (the last
    step's size when None)."""
    counters = ctx.counters
    size = counters[..., 3:4] if minibatch_size is None else _size(minibatch_size)
    counters = counters + size * _SAMPLES + _STEP  # one step and its m samples
    # samples_seen's low word holds 31 bits: low + m (both below 2³¹) passes 2³¹ − 1 exactly
    # when the int32 sum wraps negative; then the high word takes the carry and the low word
    # keeps its 31 bits. Elementwise with a slice: the same one fusion as before (5 more
    # scalar equations: tests/test_step_structure.py's budget).
    carry = jax.lax.shift_right_logical(counters[..., 2:3], np.int32(31))  # the sign bit: 1 where it wrapped
    counters = (counters + carry * _HIGH) & _KEEP
    if minibatch_size is not None:
        counters = _with_size(counters, size)
    return LearningContext(counters, _loss(ctx, loss))


def _size(minibatch_size: Any) -> jax.Array:
    """The minibatch size as int32, broadcast along the counters' last axis."""
    return jnp.asarray(minibatch_size).astype(jnp.int32)[..., None]


def _with_size(counters: jax.Array, size: jax.Array) -> jax.Array:
    # A select, not ``.at[..., 3].set``: elementwise in the counters read, it fuses with the
    # step's sum into one kernel that writes the donated buffer in place (a scatter is a
    # dynamic-update-slice kernel of its own; reading the counters' own slot 3 while writing
    # the others, a copy).
    return jnp.where(_MINIBATCH_SLOT, size, counters)


def _loss(ctx: LearningContext, loss: Any) -> jax.Array:
    """``loss`` in the context's loss dtype (made by :func:`initial_context`): a jitted
    step's carried state keeps its dtypes (a float64 loss into a context made without x64
    is rounded to its float32)."""
    return ctx.loss if loss is None else jnp.asarray(loss).astype(ctx.loss.dtype)


def samples(counters: Any) -> Any:
    """samples_seen, ``high · 2³¹ + low``: exact on the host (NumPy int64; JAX's int64 under
    ``jax_enable_x64``, traced too); traced without x64, float32 (JAX has no int64 there)."""
    if x64():
        return samples_int64(counters)
    if isinstance(counters, Tracer):
        return samples_float32(counters)
    low, high = np.asarray(counters[..., 2]), np.asarray(counters[..., 4])
    return (high.astype(np.int64) << LOW_BITS) | low.astype(np.int64)


def x64() -> bool:
    """Whether JAX's default int is int64 (``jax_enable_x64``, its context manager too)."""
    return jax.dtypes.canonicalize_dtype(jnp.int64) == jnp.int64


def samples_int64(counters: Any) -> jax.Array:
    """samples_seen exact, as JAX's int64 (under ``jax_enable_x64`` only)."""
    low, high = jnp.asarray(counters[..., 2]), jnp.asarray(counters[..., 4])
    return (high.astype(jnp.int64) << LOW_BITS) | low.astype(jnp.int64)


def samples_float32(counters: Any) -> jax.Array:
    """samples_seen as float32 (to 7 significant digits): JAX's number for it without x64."""
    return counters[..., 4].astype(jnp.float32) * float(2**LOW_BITS) + counters[..., 2].astype(jnp.float32)


def _words(value: Any) -> tuple[Any, Any]:
    """A samples_seen count as its (low, high) int32 words: split on the host in int64 when
    concrete (a count past 2³¹ − 1 too), in JAX's default int when traced."""
    if isinstance(value, Tracer):
        v = jnp.asarray(value).astype(jax.dtypes.canonicalize_dtype(jnp.int64))
        return (v & (2**LOW_BITS - 1)).astype(jnp.int32), (v >> LOW_BITS).astype(jnp.int32)
    v = np.asarray(value).astype(np.int64)
    return jnp.asarray((v & (2**LOW_BITS - 1)).astype(np.int32)), jnp.asarray((v >> LOW_BITS).astype(np.int32))


def widen_counters(saved: Any) -> Any:
    """Counters written with four words (samples_seen one int32, before it took two) in
    today's layout: the high word 0 appended; five are returned as they are."""
    shape = getattr(saved, "shape", None)  # an array (a reader's placeholder passes through)
    if shape is None or tuple(shape)[-1:] != (4,):
        return saved
    return jnp.concatenate([saved, jnp.zeros_like(saved[..., :1])], axis=-1)


def _is_context(x: Any) -> bool:
    return isinstance(x, LearningContext)


def contexts(state: Any) -> list[LearningContext]:
    """Every learning context in an optimizer state, in flatten order (stacked: members first)."""
    found = [x for x in jax.tree.leaves(state, is_leaf=_is_context) if _is_context(x)]
    for ctx in found:
        if jnp.shape(ctx.counters)[-1:] != (SLOTS,):
            raise ValueError(STACKED_ALONG_ANOTHER_AXIS.format(shape=jnp.shape(ctx.counters)))
    return found


def context(state: Any) -> LearningContext:
    """The learning context of an optimizer state.

    An :class:`ft.optim.Optimizer`'s state holds exactly one. A state of functree
    transforms used alone (``optax.chain(ft.optim.clip(1.0), ft.optim.adam())``) holds
    one per transform; this returns the first, in flatten order.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> tx = ft.optim.sgd(0.1)
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> _, state = tx.update({"w": jnp.ones(2)}, state, minibatch_size=16)
      >>> ft.optim.context(state)
      LearningContext(step=1, sweep=0, samples_seen=16, minibatch_size=16, loss=nan)

    Stacked states (``jax.vmap`` over members) read one value per member:

      >>> states = jax.vmap(lambda w: tx.init({"w": w}))(jnp.ones((3, 2)))
      >>> ft.optim.context(states).step
      Array([0, 0, 0], dtype=int32)
    """
    found = contexts(state)
    if not found:
        raise ValueError(NO_CONTEXT)
    return found[0]


_SWEEP = np.array([0, 1, 0, 0, 0], np.int32)
_STEP = np.array([1, 0, 0, 0, 0], np.int32)
_SAMPLES = np.array([0, 0, 1, 0, 0], np.int32)
_HIGH = np.array([0, 0, 0, 0, 1], np.int32)
_KEEP = np.array([-1, -1, 2**LOW_BITS - 1, -1, -1], np.int32)  # -1: every bit; the low word: 31
_MINIBATCH_SLOT = np.array([False, False, False, True, False])


_COUNTERS_AT: dict[Any, tuple[int, ...]] = {}  # state tree definition -> its contexts' counters leaves


def _counters_at(treedef: Any) -> tuple[int, ...]:
    """The positions, among a state's leaves, of each learning context's counters."""
    marked = treedef.unflatten(list(range(treedef.num_leaves)))  # each leaf replaced by its position
    return tuple(x.counters for x in jax.tree.leaves(marked, is_leaf=_is_context) if _is_context(x))


@jax.jit
def _plus_sweep(counters: jax.Array) -> jax.Array:
    return counters + jax.lax.broadcast_to_rank(jnp.asarray(_SWEEP), counters.ndim)


def next_sweep(state: Any) -> Any:
    """``state`` with every learning context's sweep advanced by one (call once per epoch).

    The contexts' places among the state's leaves are found once per state structure: a
    Trainer's epoch end costs one small dispatch per context, not a walk of the state.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> state = ft.optim.adam().init({"w": jnp.ones(2)})
      >>> int(ft.optim.context(ft.optim.next_sweep(state)).sweep)
      1
    """
    leaves, treedef = jax.tree.flatten(state)
    key, where = cached(_COUNTERS_AT, treedef)
    if where is None:
        where = _counters_at(treedef)
        if key is not None:
            bounded_put(_COUNTERS_AT, key, where)
    if not where:
        raise ValueError(NO_CONTEXT)
    for i in where:
        if jnp.shape(leaves[i])[-1:] != (SLOTS,):
            raise ValueError(STACKED_ALONG_ANOTHER_AXIS.format(shape=jnp.shape(leaves[i])))
        leaves[i] = _plus_sweep(leaves[i])
    return treedef.unflatten(leaves)
