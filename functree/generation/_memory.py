"""Generation's key-value cache against the memory there is: checked before it is allocated.

``generate`` allocates the whole cache up front (``model.init_cache(rows, prompt + new)``);
a cache larger than the device's free memory would abort the interpreter (an allocation
failure XLA does not turn into an exception on every backend). :func:`checked_cache` sums the
cache's bytes from its shapes while the loop is traced (nothing is allocated yet) and raises
:class:`CacheTooLarge` when they pass what :func:`available_bytes` finds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import jax
from jax.core import Tracer

from functree._where import default_device

CACHE_TOO_LARGE = """\
generate: the key-value cache for {rows} sequences of {length} positions (the prompt's {prompt} \
tokens and max_new_tokens = {new}{rounded}) needs {need} bytes ({need_h}), but the {where} has \
{available} bytes ({available_h}) available. generate allocates the whole cache up \
front, before the first token.

    wrong:  ft.nn.generate(model, input_ids, {new})
    right:  {right}"""


class CacheTooLarge(ValueError):
    """Raised while the loop is traced (so nothing was allocated): the cache's bytes, the
    bytes available, where, and the loop's cache shape; :meth:`explained` names the caller's
    sizes."""

    def __init__(self, need: int, available: int, where: str, rows: int, length: int):
        super().__init__(f"generate: the cache needs {need} bytes, {available} are available ({where})")
        self.need, self.available, self.where, self.rows, self.length = need, available, where, rows, length

    def explained(self, prompt: int, new: int) -> ValueError:
        """The error for the caller's ``prompt`` and ``new`` (the loop's length rounds them up
        to their buckets): the bytes, and the largest ``max_new_tokens`` whose cache fits."""
        room = int(self.available // (self.need / self.length)) - bucket(prompt)
        fit = min(1 << (room.bit_length() - 1), new - 1) if room >= 8 else 0
        right = (f"ft.nn.generate(model, input_ids, {fit})       # or fewer rows, or a model in bfloat16" if fit
                 else "ft.nn.generate(model, input_ids[:1], 8)    # fewer rows, a shorter prompt or a smaller model")
        return ValueError(CACHE_TOO_LARGE.format(
            rows=self.rows, length=self.length, prompt=prompt, new=new, need=self.need, need_h=_human(self.need),
            available=self.available, available_h=_human(self.available), where=self.where, right=right,
            rounded="" if self.length == prompt + new else ", each rounded up to its compiled size"))


def bucket(n: int) -> int:
    """The compiled size of a prompt length or token count ``n``: the next power of two, at
    least 8 (a notebook's next prompt of another length reuses the compiled loop)."""
    return max(8, 1 << (n - 1).bit_length())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def checked_cache(model: Any, rows: int, length: int, *, abstract: bool = False,
                  devices: Sequence[Any] | None = None) -> Any:
    """``model.init_cache(rows, length)`` (its shapes only with ``abstract``: None), after
    checking its bytes against the least any of ``devices`` has (:func:`least_available`):
    by default the model's (:func:`model_devices`). Call it while tracing (a traced model's
    devices are unknown there: a caller that knows them passes them)."""
    cache = jax.eval_shape(lambda: model.init_cache(rows, length)) if abstract else model.init_cache(rows, length)
    need = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    available, where = least_available(model_devices(model) if devices is None else devices)
    if available is not None and need > available:
        raise CacheTooLarge(need, available, where, rows, length)
    return None if abstract else cache


def model_devices(model: Any) -> tuple[Any, ...]:
    """The devices ``model``'s arrays live on (the cache is made beside them: a model on
    device 2, or on a mesh), by id; the default device where none is concrete (a traced
    model, or NumPy leaves)."""
    found = {d for x in jax.tree.leaves(model) if isinstance(x, jax.Array) and not isinstance(x, Tracer)
             for d in x.devices()}
    return tuple(sorted(found, key=lambda d: d.id)) or (default_device(),)


def least_available(devices: Sequence[Any]) -> tuple[int | None, str]:
    """The fewest bytes any of ``devices`` can still allocate (:func:`available_bytes`), and
    what they are: min over the devices, so the cache, whole or in shards, fits on each
    (conservative for a sharded cache). None where no device's is known."""
    known = [(n, where) for n, where in map(available_bytes, devices) if n is not None]
    if not known:
        return None, "host's memory"
    n, where = min(known, key=lambda found: found[0])
    return n, where if len(devices) == 1 else f"{where} (the least of the model's {len(devices)} devices)"


def available_bytes(device: Any) -> tuple[int | None, str]:
    """The bytes ``device`` can still allocate, and what they are: the accelerator's
    ``memory_stats()`` (``bytes_limit - bytes_in_use``) where it has them, else the host's
    available memory (``/proc/meminfo``'s MemAvailable, or free pages) within the process's
    cgroup limit; None where neither is known."""
    try:
        stats = device.memory_stats()
    except Exception:  # (a backend without the call)
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.platform} device's memory"
    found = [n for n in (_meminfo(), _cgroup()) if n is not None]
    return (min(found), "host's memory") if found else (None, "host's memory")


def _meminfo() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup() -> int | None:
    """The cgroup (v2) memory limit less its usage, where the process has one."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) - used
