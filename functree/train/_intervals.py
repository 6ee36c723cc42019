"""The Trainer's log intervals: closed on device, read one interval late.

Every step writes its metrics into the Trainer's device buffer (``TrainStep.record``).
Every ``log_every`` steps the Trainer closes the buffer into an :class:`Interval` and
starts the next one with :func:`next_buffer` (one dispatch, nothing waited for), then reads
the interval closed *before*: its steps have long finished, so the read never waits for the
steps still queued, and the asynchronous pipeline stays full. Epoch ends and the end of a
fit read every interval, the open one included.

A stop (``on_nan="stop"``) in an interval not read yet must still close the gate of the
steps after it: :func:`next_buffer` carries it into the new buffer as
:data:`STOPPED_EARLIER`, an index no step of the new buffer has, so that every step there
is gated off and the interval that stopped is the one reported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._tree import bounded_put, cached
from functree._where import put
from functree.optim import context
from functree.optim._hyper import applied_learning_rates, learning_rate_names
from functree.train._metrics import metric_dtype

__all__ = ["Interval", "MetricLog", "Reading", "next_buffer", "snapshot", "STOPPED_EARLIER", "to_host"]

STOPPED_EARLIER = 2**30
"""``halt[1]`` of a buffer opened after an earlier buffer's step stopped."""


@dataclass
class Interval:
    """A closed log interval: its device buffer, the learning context and rate after its
    last step (copies, on device; None when no callback reads them), its first step
    (1-based), its step count, its ``(minibatch, size)`` pairs (references; the sizes,
    known when each step ran, weigh the means) and whether it ended at a log point
    (``on_log`` is called when it is read)."""

    buffer: Any
    context: Any
    first: int
    steps: int
    inflight: list[tuple[Any, int]]
    log: bool


def _snapshot(opt_state: Any) -> tuple[Any, Any]:
    """Copies of the learning context and the learning rates by name (``{"learning_rate":
    ...}``, one ``"<group>/learning_rate"`` per group of ``ft.optim.groups``, or none), traced."""
    names = learning_rate_names(opt_state)
    rates = applied_learning_rates(opt_state, names)  # a reduce_on_plateau's scale included
    return jax.tree.map(jnp.copy, (context(opt_state), rates))  # copies: the next step donates the state


snapshot = jax.jit(_snapshot)
"""``(learning context, learning rates by name)`` of an optimizer state, copied on device: one
dispatch, the tree work done once at trace time."""


def _open(halt: jax.Array, rows: jax.Array) -> dict[str, jax.Array]:
    """An empty buffer shaped like ``rows`` whose ``halt`` carries a stop of ``halt``."""
    stopped = jnp.where(halt[1] >= 0, STOPPED_EARLIER, -1).astype(jnp.int32)
    return {"halt": jnp.stack([jnp.zeros((), jnp.int32), stopped, halt[2]]), "rows": jnp.zeros_like(rows)}


_open_jitted = jax.jit(_open)


def _next_buffer(treedef: Any, used: tuple[int, ...], n: int, halt: jax.Array, rows: jax.Array,
                 picked: list[Any]) -> tuple[Any, Any]:
    leaves: list[Any] = [None] * n  # the leaves _snapshot never reads stay None
    for i, x in zip(used, picked):
        leaves[i] = x
    return _open(halt, rows), _snapshot(treedef.unflatten(leaves))


def _read_leaves(treedef: Any, leaves: list[Any]) -> tuple[int, ...]:
    """The positions of the leaves of an optimizer state that :func:`_snapshot` reads (the
    learning context and the packed hyperparameters), found by tracing it once."""
    closed = jax.make_jaxpr(lambda ls: _snapshot(treedef.unflatten(ls)))(leaves)
    read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
    read |= {id(v) for v in closed.jaxpr.outvars}
    return tuple(i for i, v in enumerate(closed.jaxpr.invars) if id(v) in read)


@jax.jit
def _next_buffer_whole(halt: jax.Array, rows: jax.Array, opt_state: Any) -> tuple[Any, Any]:
    leaves, treedef = jax.tree.flatten(opt_state)
    return _next_buffer(treedef, tuple(range(len(leaves))), len(leaves), halt, rows, leaves)


_NEXT: dict[Any, Any] = {}  # optimizer state treedef -> next_buffer's program over the leaves it reads


def next_buffer(halt: jax.Array, rows: jax.Array, opt_state: Any = None) -> tuple[Any, Any]:
    """``(buffer, snapshot)``: an empty buffer shaped like ``rows`` whose ``halt`` carries
    a stop of ``halt``, and :data:`snapshot` of ``opt_state`` (after the buffer's steps),
    or None without ``opt_state`` (a fit without callbacks reads no learning context).
    One dispatch that passes only the state's leaves the snapshot reads (a handful, not the
    moments): 72 µs a call on the tiny Adam step's state was mostly passing 36 arrays."""
    if opt_state is None:
        return _open_jitted(halt, rows), None
    leaves, treedef = jax.tree.flatten(opt_state)
    key, entry = cached(_NEXT, treedef)
    if key is None:  # a tree definition that cannot be hashed: one program over the whole state
        return _next_buffer_whole(halt, rows, opt_state)
    if entry is None:
        used = _read_leaves(treedef, leaves)
        entry = (used, jax.jit(functools.partial(_next_buffer, treedef, used, len(leaves))))
        bounded_put(_NEXT, key, entry)
    used, program = entry
    return program(halt, rows, [leaves[i] for i in used])


def to_host(tree: Any) -> Any:
    """``jax.device_get(tree)`` for arrays whose copies were already started
    (``copy_to_host_async`` when their interval closed): NumPy arrays, leaf by leaf.
    ``jax.device_get`` costs about six times as much for a handful of small arrays
    (48 against 10 µs for six), and the Trainer reads an interval every ``log_every`` steps."""
    return jax.tree.map(np.asarray, tree)


@dataclass
class Reading:
    """An interval read on the host: its first step, its steps, their values by metric (float32 columns; float64 under x64),
    the learning rates' columns, each step's minibatch size, its ``nonfinite`` code (-1: a
    finite step), the buffer's ``halt`` and the learning context after its last step."""

    first: int
    steps: list[int]
    values: dict[str, np.ndarray]
    rates: dict[str, list[float]]
    weights: np.ndarray
    nonfinite: np.ndarray
    halt: np.ndarray
    context: Any
    inflight: list[tuple[Any, int]]
    log: bool


class MetricLog:
    """The Trainer's metric buffer on device and its closed intervals (see the module's
    docstring): ``buffer`` (open; ``buffered`` steps written, ``capacity`` rows),
    ``pending`` (closed, not read), ``inflight`` (the open buffer's ``(minibatch, size)``),
    the metric and learning-rate names of its columns, and the last interval's learning
    context and log means (for the contexts of save points)."""

    def __init__(self, nonfinite: str) -> None:
        self.nonfinite = nonfinite  # the name of the column that says which step stopped
        self.buffer: Any = None
        self.buffered = 0
        self.capacity = 0  # rows of the buffer: log_every + steps_per_call - 1
        self.pending: list[Interval] = []
        self.inflight: list[tuple[Any, int]] = []
        self.names: list[str] | None = None  # the step's metrics, in its order
        self.rates: list[str] = []  # the learning rates' names: the buffer's last columns
        self.last_context: Any = None  # the host context after the last step read, until the next step
        # The learning rates the last step read applied (its history row's), kept for the
        # contexts built from the state later: a callback may have set the next step's since.
        self.last_rates: dict[str, float] | None = None

    def open(self, opt_state: Any, place: Any = None) -> Any:
        """The open buffer (a new one: one row per step, ``TrainStep.record`` writes it);
        ``place`` puts it where the step returns it (``TrainStep._place_log``)."""
        if self.buffer is None:
            self.rates = learning_rate_names(opt_state)  # "learning_rate", or "<group>/learning_rate" each
            columns = len(self.names or ()) + len(self.rates)
            # From the host: an eager jnp.array or jnp.zeros compiles a program of its own before step 1.
            buffer = jax.device_put({"halt": np.array([0, -1, -1], np.int32),  # steps, the step that stopped, its report
                                     "rows": np.zeros((self.capacity, columns), metric_dtype())})
            # committed as the trainer's other arrays are (one compiled step: _where.put)
            self.buffer = put(buffer if place is None else place(buffer), None)
        return self.buffer

    def resize(self, rows: int) -> None:
        """Room for ``rows`` steps, rounded up to a power of two (8 at least): the buffer's
        shape is part of the step program's signature, so ``log_every`` 10 and 16 (and a
        ``steps_per_call`` that changes the rows by a few) share one compiled step."""
        capacity = max(8, 1 << (rows - 1).bit_length())
        if self.capacity != capacity:
            self.buffer, self.capacity = None, capacity

    def drop(self) -> None:
        """Forget every step not read (a stop, a restore)."""
        self.buffer, self.buffered, self.inflight, self.pending = None, 0, [], []
        self.last_rates = None

    def close(self, steps_run: int, opt_state: Any, log: bool) -> None:
        """The open buffer's steps (all dispatched) become a pending interval; the next
        buffer opens on device, carrying a stop (one dispatch, no wait). ``opt_state``:
        the state whose learning context callbacks will see (None: no callbacks)."""
        buffer, ctx = next_buffer(self.buffer["halt"], self.buffer["rows"], opt_state)
        if jax.default_backend() != "cpu":  # (the CPU's arrays are in host memory: nothing to copy)
            for x in jax.tree.leaves((self.buffer, ctx)):
                x.copy_to_host_async()  # queued behind the interval's steps: done when it is read
        closed = Interval(self.buffer, ctx, steps_run - self.buffered + 1, self.buffered, self.inflight, log)
        # the caller's critical section: the steps move to the pending interval at once
        self.pending.append(closed)
        self.buffer, self.buffered, self.inflight = buffer, 0, []

    def read(self) -> Reading:
        """The oldest pending interval, on the host (it stays pending: the caller pops it
        when it commits it)."""
        interval = self.pending[0]
        host, ctx = to_host((interval.buffer, interval.context))
        n = int(host["halt"][0])
        assert self.names is not None
        rows = host["rows"][:n]
        values = {k: rows[:, i] for i, k in enumerate(self.names) if k != self.nonfinite}
        nonfinite = rows[:, self.names.index(self.nonfinite)] if self.nonfinite in self.names else np.full(n, -1.0)
        return Reading(interval.first, list(range(interval.first, interval.first + n)), values,
                       {name: rows[:, len(self.names) + i].tolist() for i, name in enumerate(self.rates)},
                       np.array([size for _, size in interval.inflight[:n]], np.float32),
                       nonfinite.astype(np.int32), host["halt"], ctx, interval.inflight, interval.log)

    def applied_later(self) -> int:
        """Steps applied after the intervals read so far (blocks: the first skip's report only)."""
        col = self.names.index(self.nonfinite) if self.names and self.nonfinite in self.names else None
        buffers = [i.buffer for i in self.pending] + ([self.buffer] if self.buffered else [])
        if col is None:
            return sum(i.steps for i in self.pending) + self.buffered
        return sum(int(np.sum(b["rows"][: int(b["halt"][0]), col] == -1)) for b in jax.device_get(buffers))
