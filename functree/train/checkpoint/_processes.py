"""The processes of one job acting as one checkpoint writer or reader.

Every process of a multi-process job calls ``save`` and ``restore``; orbax writes each
process's shards and the primary process (0) writes the metadata. What only one process
may decide (taking the directory's lock, which steps to delete) the primary decides and
:func:`agreed` hands to the others; what each process knows (the checksums of the shards
it wrote) :func:`gather` collects. With one process both are plain calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["gather", "agreed"]

PRIMARY_FAILED = """\
The checkpoint's primary process (process 0) stopped this {what}: {error}
Every process of the job raises this error; fix what process 0 reports."""


def gather(value: Any) -> list[Any]:
    """``value`` (JSON) of every process, by process index: a collective call."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes)]


def agreed(fn: Callable[[], Any], what: str = "save") -> Any:
    """``fn()`` run by the primary process alone; its result, or its error, on every process."""
    if jax.process_count() == 1:
        return fn()
    error: BaseException | None = None
    outcome: Any = None
    if jax.process_index() == 0:
        try:
            outcome = {"value": fn()}
        except Exception as e:
            error, outcome = e, {"error": str(e)}
    outcome = gather(outcome)[0]
    if error is not None:
        raise error
    if "error" in outcome:
        raise CheckpointError(PRIMARY_FAILED.format(what=what, error=outcome["error"]))
    return outcome["value"]
