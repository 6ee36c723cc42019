"""Host copies of loaded tensors: each file tensor copied once, in its parameter's layout
and dtype, into memory of its own (never a view of the file's memory map).

A torch ``Linear`` weight is ``[out, in]`` and a ``Dense`` weight ``[in, out]``, so most
bytes of a checkpoint are copied through a transpose. Where the dtype stays, XLA's host
transpose does it (:func:`transposed`: a strided ``jax.device_put`` to the CPU device, no
program compiled; on a 2-core CPU 1.5 to 4 times NumPy's blocks on 4096 x 4096 and
11008 x 4096 bfloat16). A cast one goes through NumPy: a transposed view copied element by
element across the whole source misses the cache on every element of a large matrix;
copying it in blocks of :data:`BLOCK` columns keeps each block's source rows in cache (twice
as fast on a 32000 x 512 bfloat16 embedding, and on 2048 x 2048 float32).

Each copy lands in memory aligned to :data:`ALIGNMENT` bytes, which XLA's CPU client takes as
the device buffer itself (``jax.device_put(a, may_alias=True)``); NumPy's own allocations are
16-byte aligned, which it copies again (40 ms for a 32000 x 512 bfloat16 matrix on a 2-core
CPU): one copy per tensor instead of two. :func:`copy_all` runs a load's copies on the host's
cores, cut into pieces of about :data:`PIECE` bytes (NumPy and the transfers release the GIL:
a 32000 x 512 bfloat16 transpose in NumPy's blocks takes 20 ms on one core of an idle 2-core
CPU, 10 ms on two; four 4096 x 4096 host transposes 142 ms, 89 ms). Measured by
benchmarks/_startup.py's split and by hand.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from functree._host_buffers import ALIGNMENT as ALIGNMENT  # (re-exported: its tests read it here)
from functree._host_buffers import empty

BLOCK = 128  # columns per block: measured best of 32 ... 512 on float32 and bfloat16
PIECE = 2 << 20  # bytes per piece of a parallel copy: many pieces per core on a large load, balanced
PARALLEL = 8 << 20  # bytes below which a load's copies run on this thread (a thread pool costs ~1 ms)
THREADS = 8  # at most: memory bandwidth, not cores, bounds a copy beyond a few


def copy_into(out: np.ndarray, value: np.ndarray) -> None:
    """``out[...] = value`` (cast as ``astype`` casts); a transposed 2-D ``value`` of
    ``out``'s dtype by XLA's host transpose (:func:`transposed`), another by blocks of
    columns.

    Example:
      >>> import numpy as np
      >>> a = np.arange(600.0).reshape(200, 3)
      >>> out = np.empty((3, 200), np.float32)
      >>> copy_into(out, a.T)
      >>> bool((out == a.T).all()), out.dtype
      (True, dtype('float32'))
    """
    if not _transposed(value) or value.shape[1] <= BLOCK:
        out[...] = value
        return
    if value.dtype == out.dtype and _held(value.dtype) and _cpu() is not None:
        out[...] = transposed(value)
        return
    for j in range(0, value.shape[1], BLOCK):
        out[:, j:j + BLOCK] = value[:, j:j + BLOCK]


def _held(dtype: np.dtype) -> bool:
    """JAX holds arrays of ``dtype`` as they are (float64 is float32 without jax_enable_x64)."""
    return jax.dtypes.canonicalize_dtype(dtype) == dtype


@functools.cache
def _cpu() -> Any:
    """The host's CPU device, None where JAX runs without one (``JAX_PLATFORMS=cuda``)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def transposed(value: np.ndarray) -> np.ndarray:
    """A transposed 2-D view's values in C order, in memory of XLA's CPU client: read-only.

    ``jax.device_put`` of a strided host array transposes it in XLA's blocked, vectorized
    copy (a 4096 x 4096 bfloat16 matrix: 29 ms, NumPy's blocks 53 ms, on a 2-core CPU). No program
    is compiled; the view is not aliased (a strided layout cannot be).
    """
    return np.asarray(jax.device_put(value, _cpu()))


def _transposed(value: np.ndarray) -> bool:
    """A 2-D view whose rows are the source's columns (a torch ``Linear`` weight's ``.T``)."""
    return value.ndim == 2 and 0 < abs(value.strides[0]) < abs(value.strides[1])


def _pieces(out: np.ndarray, value: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``out[...] = value`` cut into copies of about :data:`PIECE` bytes writing disjoint
    parts of ``out``: a transposed matrix by columns (whole blocks of :data:`BLOCK`), else by rows."""
    if out.ndim == 0 or out.nbytes <= PIECE or value.shape != out.shape:
        return [(out, value)]
    axis = 1 if _transposed(value) else 0
    n = out.shape[axis]
    step = max(1, n * PIECE // out.nbytes)
    if axis == 1:
        step = -(-step // BLOCK) * BLOCK
        return [(out[:, j:j + step], value[:, j:j + step]) for j in range(0, n, step)]
    return [(out[i:i + step], value[i:i + step]) for i in range(0, n, step)]


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def copy_all(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Every ``out[...] = value`` of ``copies`` (each by :func:`copy_into`; the outputs
    disjoint), in pieces on up to :data:`THREADS` of the host's cores where they hold at
    least :data:`PARALLEL` bytes. Bit for bit the copies one after the other make.

    Example:
      >>> import numpy as np
      >>> a, b = np.empty((2, 3), np.float32), np.empty(4, np.float32)
      >>> copy_all([(a, np.ones((3, 2)).T), (b, np.arange(4.0))])
      >>> a.sum(), b
      (np.float32(6.0), array([0., 1., 2., 3.], dtype=float32))
    """
    workers = min(THREADS, _cores())
    if workers < 2 or sum(out.nbytes for out, _ in copies) < PARALLEL:
        for out, value in copies:
            copy_into(out, value)
        return
    pieces = [piece for out, value in copies for piece in _pieces(out, value)]
    pieces.sort(key=lambda piece: -piece[0].nbytes)  # the largest first: the last to finish are small
    with ThreadPoolExecutor(min(workers, len(pieces))) as pool:
        for _ in pool.map(lambda piece: copy_into(*piece), pieces):
            pass  # (an error in a copy is raised here)


def copied(value: np.ndarray, dtype: Any) -> np.ndarray:
    """A fresh C-contiguous copy of ``value`` as ``dtype``, aligned (:func:`empty`):
    ``value.astype(dtype)`` by :func:`copy_into`."""
    out = empty(value.shape, dtype)
    copy_into(out, value)
    return out
