"""NumPy inputs copied before JAX reads them: a buffer the caller refills cannot change a step.

On the CPU, JAX takes a NumPy array whose data is aligned to :data:`ALIGNMENT` bytes as the
device buffer itself, without copying (``jax.device_put`` does, even with
``may_alias=False``, and so does a ``jax.jit`` call given NumPy arguments: JAX issue 37830),
and a call returns before its program has read its inputs (asynchronous dispatch). A loop
that refills one batch buffer each step::

    for i in range(steps):
        buffer[...] = data[i]                      # the next batch, into the same memory
        model, state, metrics = step(model, state, buffer)

then trains on whatever the buffer holds when each queued step runs: some batches twice,
others never, and no error (measured: weights 3.5e-4 apart after 200 SGD steps of a linear
model on 4096 x 64 batches, the same loop with a fresh array per step as the reference).
Whether it happens depends on where NumPy's allocator put the buffer: large allocations
are page-aligned and always aliased, small ones by chance.

So functree copies the NumPy arrays of what it puts on a device for a call that may run
later (a training or evaluation step's batch, a batch or model placed on a mesh, an
optimizer's NumPy hyperparameters) into memory of its own: one host copy, aligned so that
XLA takes it as it is (no second copy). Arrays already on a device are passed as they are.
``jax.jit`` and ``ft.jit`` themselves pass NumPy arguments as JAX does; pass a fresh array,
or copy a buffer you refill (``np.array(buffer)``), there.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import jax
import numpy as np

ALIGNMENT = 64  # XLA's CPU minimum alignment (kMinimumAlignment): a buffer aligned so is aliased, not copied

# Below this many bytes a plain copy (NumPy's, ~0.3 us): XLA copies it once more where it is
# not aligned, which costs less than aligning it (np.empty, a slice and a view: ~3 us).
ALIGNED_FROM = 1 << 16

_flatten = jax.tree_util.default_registry.flatten  # jax.tree.flatten without its Python frames
# The copies private_copy made, while they live (by id: an entry goes with its array, before
# the id can name another): copying one again is a no-op.
_COPIES: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
JAX_ARRAYS: set[type] = set()  # the classes of jax.Array seen (ArrayImpl, tracers): a set lookup


def _jax_array(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` (its class remembered: the next check is a set lookup)."""
    if isinstance(x, jax.Array):
        JAX_ARRAYS.add(x.__class__)
        return True
    return False


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data begins at a multiple of
    :data:`ALIGNMENT` bytes (a view into a slightly larger byte buffer it keeps alive).

    Example:
      >>> import numpy as np
      >>> a = empty((3, 5), np.float32)
      >>> a.shape, a.dtype, a.flags.c_contiguous, a.ctypes.data % ALIGNMENT
      ((3, 5), dtype('float32'), True, 0)
    """
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + size].view(dtype).reshape(shape)


def private_copy(x: np.ndarray) -> np.ndarray:
    """``x``'s values in read-only memory no one else holds; from :data:`ALIGNED_FROM` bytes
    on, aligned (XLA's CPU client then uses it as the device buffer: the copy is the only
    one). A copy this made is returned as it is: a batch passes the train step's call, its
    ``run`` and a mesh placement copied once.

    Example:
      >>> import numpy as np
      >>> buffer = np.ones(3, np.float32)
      >>> copy = private_copy(buffer)
      >>> buffer[...] = 5.0
      >>> copy, private_copy(copy) is copy
      (array([1., 1., 1.], dtype=float32), True)
    """
    if _COPIES.get(id(x)) is x:
        return x
    if x.nbytes < ALIGNED_FROM or x.dtype.hasobject:  # (objects: no buffer to align, never put on a device)
        out = x.copy()
    else:
        out = empty(x.shape, x.dtype)
        np.copyto(out, x, casting="no")
    out.flags.writeable = False
    _COPIES[id(out)] = out
    return out


def private_arrays(tree: Any) -> Any:
    """``tree`` with each NumPy array leaf replaced by :func:`private_copy` of it (the
    same tree, not rebuilt, where it holds none: arrays already on a device, Python numbers).

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> x, y = np.zeros(2, np.float32), jnp.ones(2)
      >>> batch = private_arrays((x, y))
      >>> batch[0] is x, batch[1] is y, bool((batch[0] == x).all())
      (False, True, True)
    """
    kind = tree.__class__
    if kind is tuple or kind is dict:  # a step's usual batch, checked without flattening it
        for x in (tree.values() if kind is dict else tree):
            if x.__class__ not in JAX_ARRAYS and not _jax_array(x):
                break
        else:
            return tree
    leaves, treedef = _flatten(tree)
    for leaf in leaves:
        if isinstance(leaf, np.ndarray) and _COPIES.get(id(leaf)) is not leaf:
            return treedef.unflatten([private(x) for x in leaves])
    return tree


def private(x: Any) -> Any:
    """:func:`private_copy` of a NumPy array; anything else as it is."""
    return private_copy(x) if isinstance(x, np.ndarray) else x


def own_host(x: Any) -> Any:
    """``x`` as host values no caller can change: :func:`private_copy` of a NumPy array; a
    ``jax.Array`` as it is; anything else (lists, Python numbers) through ``np.asarray``,
    which builds a fresh array."""
    if isinstance(x, np.ndarray):
        return private_copy(x)
    return x if isinstance(x, jax.Array) else np.asarray(x)
