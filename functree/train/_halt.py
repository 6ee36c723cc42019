"""A train step's NaN halt log (``on_nan="stop"``): ``{"halt": [steps, step that stopped
(-1), its nonfinite]}``, kept by the step from call to call, made on the host and placed as
the model it is passed with.

``jax.jit`` keys its cache on each argument's committedness and devices, and a program
given one committed argument returns every result committed. A log kept from a call on
committed (restored) arrays, passed with a fresh uncommitted model, compiled the step
again; so did an uncommitted log passed with restored arrays, and the call after (its
results all committed): 4 compiles over a sequence that raw ``jax.jit`` compiles twice.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from functree.train._halt import new_halt_log, placed_as
  >>> restored = {"w": jax.device_put(jnp.ones(2), jax.devices()[0])}
  >>> log = placed_as(new_halt_log(), restored)
  >>> log["halt"].committed, placed_as(log, {"w": jnp.ones(2)})["halt"].committed
  (True, False)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import SingleDeviceSharding

from functree._where import default_device, placement_of, put

__all__ = ["new_halt_log", "placed_as"]


def new_halt_log() -> dict[str, jax.Array]:
    """An empty log, uncommitted on the default device. From the host: an eager operation
    would compile a program of its own before step 1."""
    return {"halt": jax.device_put(np.array([0, -1, -1], np.int32))}


def _committed(tree: Any) -> bool:
    """Whether an array of ``tree`` is committed to its devices (a restored one, or put)."""
    return any(isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.committed for x in jax.tree.leaves(tree))


def placed_as(log: dict[str, Any], model: Any) -> dict[str, Any]:
    """``log`` committed as ``model``'s arrays are, and where they are (the same log when it
    is). The step calls it off the loop's fast path only: a loop passes the log the
    previous call returned, placed as the model it returned. An array cannot be uncommitted
    on device: its three numbers go through the host, the one wait (for the steps queued)
    of a step given uncommitted arrays after committed ones."""
    halt = log["halt"]
    if not _committed(model):
        return {"halt": jax.device_put(np.asarray(halt))} if halt.committed else log
    where = placement_of(model) or SingleDeviceSharding(default_device())  # (None: the default device's)
    return put(log, where)  # an array committed there already stays as it is
