"""A checkpoint's arrays: their checksums, where they are restored, and the check.

Every array gets a CRC-32 of its bytes in C order. An array held whole by this process
gets one (``crc32``); an array spread over processes gets one per shard (``shards``:
``{"0:8,0:128": crc}``), taken by the process writing that shard (its replica 0) and
gathered into the metadata, so nothing is ever gathered whole. Restore verifies each
written shard in a process that read it whole, whatever the new mesh, and all processes
agree on the outcome.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping
from typing import Any, cast

import jax
import numpy as np

from functree._where import default_device
from functree.parallel import sharded_target
from functree.train.checkpoint._processes import gather
from functree.train.checkpoint._treespec import CheckpointError, encode

__all__ = ["checksum", "describe", "verify", "saved_arrays", "written_on", "placement", "via_host", "put"]

PLACEMENT_MISMATCH = """\
The checkpoint's array {key!r} ({saved}) cannot be placed by {sharding} in this process \
({problem}). It was written on {written}; where it goes is chosen by the reader, never by \
the devices that wrote it. Give a placement that holds it:

    wrong:  ft.train.load(path, template, sharding=<a sharding that does not divide {saved}>)
    right:  ft.train.load(path, template, sharding=jax.devices()[0])        # one device
       or:  ft.train.load(path, template, mesh=mesh, sharding="fsdp")   # by the rules"""

SHARDING_NEEDS_MESH = """\
sharding={given!r} names sharding rules, which need a mesh; without a mesh, sharding= is \
where every array goes: a jax.sharding.Sharding or a device.

    wrong:  ft.train.load(path, template, sharding={given!r})
    right:  ft.train.load(path, template, mesh=mesh, sharding={given!r})
       or:  ft.train.load(path, template, sharding=jax.devices()[0])"""


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


def saved_arrays(directory: Any) -> dict[str, tuple[tuple[int, ...], np.dtype, bool]]:
    """``{key: (shape, dtype, on_host)}`` of the arrays orbax wrote in ``directory`` (a
    checkpoint's ``arrays`` item), from its metadata: what is stored, whatever the
    checkpoint's own metadata claims (the checksums' check compares the two after the
    read). ``on_host``: written as a NumPy array (it comes back as one)."""
    import orbax.checkpoint as ocp  # on first use: import functree stays light
    tree: dict[Any, Any] = dict(cast(Any, ocp.StandardCheckpointHandler().metadata(directory)).items())
    return {str(k): (tuple(int(n) for n in m.shape), np.dtype(m.dtype), getattr(m, "sharding", True) is None)
            for k, m in tree.items()}


def via_host(wanted: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(orbax's target, {key: sharding})``: ``wanted`` (:func:`placement`'s target) with
    each array bound for one device read as a NumPy array, to be put there by :func:`put`.

    Orbax's NumPy read costs about half the CPU of its jax-array read, and an array bound
    for one device passes through the host either way. A NumPy target gives the stored
    shape and the target's dtype, here the stored one (:func:`saved_arrays`); the zeros
    are never touched (a lazily zeroed allocation). Arrays sharded over several devices
    are read by orbax into their shards, each device reading its own."""
    target, moves = {}, {}
    for key, x in wanted.items():
        if isinstance(x, jax.ShapeDtypeStruct) and isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
            target[key], moves[key] = np.zeros(x.shape, x.dtype), x.sharding
        else:
            target[key] = x
    return target, moves


def put(arrays: dict[str, Any], moves: Mapping[str, Any]) -> dict[str, Any]:
    """``arrays`` with those :func:`via_host` read on the host put on their device (one call)."""
    if not moves:
        return arrays
    keys = list(moves)
    placed = jax.device_put([arrays[k] for k in keys], [moves[k] for k in keys])
    return {**arrays, **dict(zip(keys, placed))}


def written_on(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """Where ``arrays`` were written from (information only: no reader consults it)."""
    from functree import __version__  # (functree imports this module)
    devices = sorted({str(d) for x in arrays.values() if isinstance(x, jax.Array) for d in x.sharding.device_set})
    return {"functree": __version__, "jax": jax.__version__, "processes": jax.process_count(),
            "device_count": len(devices), "devices": devices[:16]}


def _writer(meta: Any) -> str:
    about = meta.get("written_on") if isinstance(meta, dict) else None
    if not isinstance(about, dict):
        return "devices not recorded (an older checkpoint)"
    devices = ", ".join(map(str, about.get("devices", []))) or "the host"
    return f"{devices} ({about.get('processes')} process(es), jax {about.get('jax')})"


def _as_sharding(sharding: Any) -> Any:
    """``sharding=`` without a mesh: a ``Sharding`` or a device (every array there)."""
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if isinstance(sharding, jax.Device):
        return jax.sharding.SingleDeviceSharding(sharding)
    raise CheckpointError(SHARDING_NEEDS_MESH.format(given=sharding))


def _template_placements(parts: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{key: (shape, sharding)}`` of the templates' placed arrays (jax arrays and
    ``ShapeDtypeStruct`` with a sharding), by the checkpoint's key names."""
    flat, _ = encode(dict(parts))
    return {k: (tuple(x.shape), x.sharding) for k, x in flat.items()
            if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and getattr(x, "sharding", None) is not None}


def _one_device(placed: Mapping[str, tuple[tuple[int, ...], Any]]) -> Any:
    """The templates' device when they all live on one: the rest of the job goes there too."""
    devices = {d for _, s in placed.values() for d in s.device_set}
    return jax.sharding.SingleDeviceSharding(devices.pop()) if len(devices) == 1 else None


def _fits(key: str, shape: tuple[int, ...], dtype: np.dtype, where: Any, meta: Any) -> Any:
    """``where`` if it can hold the saved array, else the error naming both sides."""
    try:
        where.shard_shape(shape)
    except Exception as e:  # jax raises ValueError / TypeError / IndexError by sharding kind
        raise CheckpointError(PLACEMENT_MISMATCH.format(
            key=key, saved=f"{dtype}{list(shape)}", sharding=where, problem=str(e).splitlines()[0][:200],
            written=_writer(meta))) from None
    return where


@functools.cache
def jax_holds(dtype: np.dtype) -> bool:
    """Whether this JAX makes arrays of ``dtype``. NumPy's own types, yes; of ml_dtypes'
    narrow ones each JAX holds its own set (float6_e2m3fn from jax 0.12, float8_e5m3fnu in
    none yet), and a checkpoint of another JAX, or a zero-size NumPy leaf of this one, may
    hold another: placed on a device it failed inside JAX (a TypeError, or XLA's 'Unknown
    NumPy dtype'), so it comes back on the host, as NumPy, as a 64-bit array does without
    x64. Asked by putting an empty array on the default device, once per dtype.

    >>> import jax.numpy as jnp
    >>> jax_holds(np.dtype(np.float32)), jax_holds(np.dtype(jnp.bfloat16))
    (True, True)
    """
    if dtype.kind != "V":
        return True
    try:
        jax.device_put(np.zeros(0, dtype))
    except Exception:  # JAX's TypeError or XLA's runtime error, by version
        return False
    return True


def _ruled_part(parts: Mapping[str, Any]) -> str | None:
    """The part the sharding rules are checked against, as ``ft.shard`` and the Trainer
    check them (a typo's rule matching nothing is an error, not a replicated leaf): the
    model (``""``, a lone tree, or ``"model"``), else an optimizer state restored without
    the model's template (its moments carry the parameters' names)."""
    return next((p for p in ("", "model", "opt_state") if parts.get(p) is not None), None)


def placement(parts: Mapping[str, Any], mesh: Any = None, sharding: Any = None, data_axis: str = "data") -> Any:
    """Orbax's restore target: a function of the stored arrays (:func:`saved_arrays`) and
    the checkpoint's metadata (its ``written_on``, for messages, and ``process_local``).

    Arrays go where the reading process says, never to the writer's devices: with
    ``mesh``, each part with a template (``{name: template or None}``, ``""`` for a lone
    tree) placed by the rules, checked strictly against the model's template
    (:func:`_ruled_part`), and the rest on the host (NumPy arrays, as before meshes); else with
    ``sharding`` (a ``Sharding`` or a device) every array there; else each template array
    where the template's is, the others on the templates' one device or the default device.
    Arrays saved as NumPy arrays, 64-bit ones without ``jax_enable_x64`` and those of a
    dtype this JAX cannot hold (:func:`jax_holds`) come back on the host. Shapes and dtypes are the saved ones (a template never casts: it is checked).
    """
    if mesh is not None:
        everywhere = None
        ruled = _ruled_part(parts)
        placed = _template_placements({p: None if t is None else sharded_target(
            t, mesh, sharding, data_axis=data_axis, strict=p == ruled) for p, t in parts.items()})
    else:
        everywhere = _as_sharding(sharding)
        placed = _template_placements(parts)

    def target(saved: Mapping[str, tuple[tuple[int, ...], np.dtype, bool]], meta: Any) -> dict[str, Any]:
        device_local = set(meta.get("process_local", ())) if isinstance(meta, dict) else set()
        rest = None if mesh is not None else everywhere or _one_device(placed) or jax.sharding.SingleDeviceSharding(
            default_device())
        out = {}
        for key, (shape, dtype, on_host) in saved.items():
            on_host = on_host and key not in device_local
            like = placed.get(key)
            where = like[1] if like is not None and like[0] == shape else None  # a wrong shape: checked later
            if everywhere is not None and (where is not None or not on_host):
                where = everywhere
            elif where is None and not on_host:
                where = rest
            if where is None or jax.dtypes.canonicalize_dtype(dtype) != dtype or not jax_holds(dtype):
                out[key] = np.zeros(shape, dtype)
            else:
                out[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=_fits(key, shape, dtype, where, meta))
        return out

    return target
