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

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from functree.optim import context, hyperparameters
from functree.optim._hyper import learning_rate_names

__all__ = ["Interval", "next_buffer", "snapshot", "STOPPED_EARLIER"]

STOPPED_EARLIER = 2**30
"""``halt[1]`` of a buffer opened after an earlier buffer's step stopped."""


@dataclass
class Interval:
    """A closed log interval: its device buffer, the learning context and rate after its
    last step (copies, on device), its first step (1-based), its step count, its
    minibatches (references) and whether it ended at a log point (``on_log`` is called
    when it is read)."""

    buffer: Any
    context: Any
    first: int
    steps: int
    inflight: list[Any]
    log: bool


def _snapshot(opt_state: Any) -> tuple[Any, Any]:
    """Copies of the learning context and the learning rates by name (``{"learning_rate":
    ...}``, one ``"<group>/learning_rate"`` per group of ``ft.optim.groups``, or none), traced."""
    names = learning_rate_names(opt_state)
    values = hyperparameters(opt_state) if names else {}
    rates = {name: values[name] for name in names}
    return jax.tree.map(jnp.copy, (context(opt_state), rates))  # copies: the next step donates the state


snapshot = jax.jit(_snapshot)
"""``(learning context, learning rates by name)`` of an optimizer state, copied on device: one
dispatch, the tree work done once at trace time."""


@jax.jit
def next_buffer(halt: jax.Array, rows: jax.Array, opt_state: Any) -> tuple[Any, Any]:
    """``(buffer, snapshot)``: an empty buffer shaped like ``rows`` whose ``halt`` carries
    a stop of ``halt``, and :data:`snapshot` of ``opt_state`` (after the buffer's steps)."""
    stopped = jnp.where(halt[1] >= 0, STOPPED_EARLIER, -1).astype(jnp.int32)
    new = {"halt": jnp.stack([jnp.zeros((), jnp.int32), stopped, halt[2]]), "rows": jnp.zeros_like(rows)}
    return new, _snapshot(opt_state)
