"""Writing files from a model held by several processes (a multi-process FSDP/TP job).

An array sharded over a mesh that spans several processes is not whole in any one of them
(``np.asarray`` raises JAX's "spans non-addressable devices"). :func:`host_array` gathers
such a leaf (a collective: every process calls it, on the same leaves in the same order)
and :func:`on_primary` runs the write on process 0 alone, its error raised on every
process. With one process both are plain calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["host_array", "on_primary"]

PRIMARY_FAILED = """\
{what}: process 0, which writes the files of this multi-process job, failed: {error}
Every process raises this error; fix what process 0 reports."""


def host_array(leaf: Any) -> np.ndarray:
    """``leaf`` whole as a NumPy array in this process.

    A jax.Array spread over other processes' devices is gathered (every process gets it
    whole, one leaf at a time so that no device holds more than that leaf replicated); a
    replicated one is read from a local copy. A collective call in a multi-process job
    when ``leaf`` spans other processes' devices.
    """
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if leaf.is_fully_replicated:  # every process holds it whole: no communication
            return np.asarray(leaf.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def on_primary(fn: Callable[[], Any], what: str) -> None:
    """``fn()`` (a write) on process 0 alone; every process returns when it is done and
    raises when it failed (its own error on process 0, :data:`PRIMARY_FAILED` on the
    others). A collective call in a multi-process job."""
    if jax.process_count() == 1:
        fn()
        return
    from jax.experimental import multihost_utils

    error: BaseException | None = None
    message = b""
    if jax.process_index() == 0:
        try:
            fn()
        except Exception as e:  # handed to the others before raising here
            error, message = e, f"{type(e).__name__}: {e}".encode()
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array(len(message), np.int32))))
    data = np.zeros(max(size, 1), np.uint8)
    data[: len(message)] = np.frombuffer(message, np.uint8)
    text = bytes(np.asarray(multihost_utils.broadcast_one_to_all(data))[:size]).decode(errors="replace")
    if error is not None:
        raise error
    if text:
        raise RuntimeError(PRIMARY_FAILED.format(what=what, error=text))
