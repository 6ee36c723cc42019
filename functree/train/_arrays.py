"""A checkpoint's arrays: their checksums, where they are restored, and the check.

Every array gets a CRC-32 of its bytes in C order. An array held whole by this process
gets one (``crc32``); an array spread over processes gets one per shard (``shards``:
``{"0:8,0:128": crc}``), taken by the process writing that shard (its replica 0) and
gathered into the metadata, so nothing is ever gathered whole. Restore verifies each
written shard in a process that read it whole, whatever the new mesh, and all processes
agree on the outcome.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any, cast

import jax
import numpy as np

from functree.parallel import sharded_target
from functree.train._processes import gather
from functree.train._treespec import encode

__all__ = ["checksum", "describe", "verify", "default_placement", "placement", "committed"]


def checksum(x: Any) -> int:
    """CRC-32 (zlib) of an array's bytes in C order."""
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    return zlib.crc32(cast(Any, a.view(np.uint8)))


def _spread(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _where(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    return ",".join(f"{s.start or 0}:{n if s.stop is None else s.stop}" for s, n in zip(index, shape))


def describe(arrays: dict[str, Any]) -> dict[str, Any]:
    """Each array's dtype, shape and CRC-32 (per written shard when spread): collective."""
    mine = {}
    for k, v in arrays.items():
        entry: dict[str, Any] = {"dtype": str(v.dtype), "shape": list(np.shape(v))}
        if _spread(v):
            entry["shards"] = {_where(s.index, v.shape): checksum(s.data)
                               for s in v.addressable_shards if s.replica_id == 0}
        else:
            entry["crc32"] = checksum(v)
        mine[k] = entry
    every = gather(mine)
    for other in every[1:]:
        for k, entry in other.items():
            every[0][k].get("shards", {}).update(entry.get("shards", {}))
    return every[0]


def _slices(where: Any, shape: tuple[int, ...]) -> tuple[slice, ...]:
    bounds = [tuple(int(b) for b in part.split(":")) for part in where.split(",")] if shape else []
    if len(bounds) != len(shape) or any(len(b) != 2 or not 0 <= b[0] <= b[1] <= n for b, n in zip(bounds, shape)):
        raise ValueError(where)
    return tuple(slice(a, b) for a, b in bounds)


def _contains(outer: tuple[slice, ...], inner: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    return all((o.start or 0) <= i.start and i.stop <= (n if o.stop is None else o.stop)
               for o, i, n in zip(outer, inner, shape))


def _local_part(x: Any, slices: tuple[slice, ...]) -> Any:
    """This process's copy of ``x[slices]`` (``x`` spread over processes); None if it holds
    no shard containing it."""
    for s in x.addressable_shards:
        if _contains(s.index, slices, x.shape):
            start = [i.start or 0 for i in s.index]
            return np.asarray(s.data)[tuple(slice(a.start - b, a.stop - b) for a, b in zip(slices, start))]
    return None


def _problem(want: Any, x: Any) -> str | None:
    """What is wrong with array ``x`` against its metadata entry ``want`` (None if fine)."""
    if not isinstance(want, dict):
        return "has a damaged checksum entry"
    shape = tuple(np.shape(x))
    if str(x.dtype) != want.get("dtype") or list(shape) != want.get("shape"):
        return f"is {x.dtype}{list(shape)}, written as {want.get('dtype')}{want.get('shape')}"
    sums = want["shards"] if "shards" in want else {",".join(f"0:{n}" for n in shape): want.get("crc32")}
    try:
        shards = {where: _slices(where, shape) for where in sums}
    except (ValueError, AttributeError, TypeError):
        return "has a damaged checksum entry"
    if sum(math.prod(b.stop - b.start for b in s) for s in shards.values()) != math.prod(shape):
        return "has shards in its checksum entry that do not cover it"
    devices = x.sharding.devices_indices_map(shape).values() if _spread(x) else ()
    whole = None if devices else np.asarray(x)
    if devices and not all(any(_contains(i, s, shape) for i in devices) for s in shards.values()):
        from jax.experimental import multihost_utils  # no process read some shard whole

        whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))  # collective
    for where, slices in shards.items():
        part = whole[slices] if whole is not None else _local_part(x, slices)
        if part is not None and checksum(part) != sums[where]:  # None: another process checks it
            at = f" (shard {where})" if "shards" in want else ""
            return f"fails its CRC-32 check{at} (stored {sums[where]}, read {checksum(part)})"
    return None


def verify(sums: Any, arrays: dict[str, Any]) -> tuple[str, str] | None:
    """``(key, what is wrong)`` for the first array that fails its checksums, as agreed by
    every process (each checks the shards it read)."""
    if not isinstance(sums, dict):
        found: Any = ("<all>", "has no checksums in the metadata")
    elif set(sums) != set(arrays):
        differ = sorted(set(sums) ^ set(arrays))[:5]
        found = (differ[0], f"is missing or unexpected (arrays {differ} differ from the metadata)")
    else:
        problems = [(k, _problem(sums[k], x)) for k, x in arrays.items()]  # all: each may gather
        found = next(((k, p) for k, p in problems if p), None)
    return next((tuple(f) for f in gather(found) if f), None)  # type: ignore[return-value]


def default_placement(meta: Any) -> Any:
    """Arrays written from a mesh, restored without one: onto the default device (orbax
    refuses to guess a target for another topology). None: restore as saved."""
    sums = meta.get("checksums") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not meta.get("mesh") or not isinstance(sums, dict):
        return None
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def one(w: dict[str, Any]) -> Any:
        dtype = np.dtype(w["dtype"])
        if jax.dtypes.canonicalize_dtype(dtype) != dtype:  # float64 without x64: on the host
            return np.zeros(tuple(w["shape"]), dtype)
        return jax.ShapeDtypeStruct(tuple(w["shape"]), dtype, sharding=device)

    return {k: one(w) for k, w in sums.items()}


def placement(parts: Mapping[str, Any], mesh: Any, sharding: Any, data_axis: str) -> Any:
    """Orbax's restore target on ``mesh`` (a function of the metadata): the arrays of each
    part with a template (``{name: template or None}``, ``""`` for a lone tree) placed by
    the rules, the others (shape and dtype from the metadata) on the host."""
    known, _ = encode({p: None if t is None else sharded_target(t, mesh, sharding, data_axis=data_axis)
                       for p, t in parts.items()})

    def target(meta: Any) -> Any:
        sums = meta.get("checksums") if isinstance(meta, dict) else None
        if not isinstance(sums, dict):  # damaged: restored as saved, refused after
            return None
        return {k: known[k] if k in known else np.zeros(tuple(w["shape"]), np.dtype(w["dtype"]))
                for k, w in sums.items()}

    return target


def committed(tree: Any) -> Any:
    """``tree`` with each array committed to the device it is on (the same buffers).

    Restored arrays are committed (orbax places them as saved), and ``jax.jit`` keys its
    cache on that: a job whose fresh arrays were not would compile its step again after
    an in-process restore. Committed from the start, both hit one program.
    """
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array)
                        and not getattr(x, "committed", True) else x, tree)
