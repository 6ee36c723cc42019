"""Random draws that XLA:CPU compiles fast: the same bits, drawn flat.

A threefry draw of ``shape`` hashes the counters ``0 .. prod(shape) - 1`` (``jax.random``'s
partitionable threefry counts in row-major order, and so did the one before it), so drawing
``prod(shape)`` values and reshaping them gives the very same array. XLA:CPU's fusion emitters
(the only ones from jaxlib 0.11.1 on) compile the draw's hash far slower when the array has
three axes or more (measured on a 2-core CPU, jaxlib 0.10.2, XLA's default flags):

========================================================  ========  =======
a first draw, compile CPU-s                                 shaped     flat
========================================================  ========  =======
``he_normal()`` of a 3x3 conv kernel ``(3, 3, 8, 16)``        7.25     0.63
``glorot_uniform`` of ``(64, 64)`` under ``vmap`` of 12       1.31     0.67
``normal`` of ``(16, 16)`` under ``vmap`` of 4                3.23     0.66
========================================================  ========  =======

so a model's first build (a conv net's kernels, a ``Stack``'s layers drawn under ``vmap``,
whose draws are one axis more) and a training step's dropout masks (``[batch, time,
features]``) paid seconds of compile for nothing. :func:`flat_key` gives a key whose draws
are flat, for the initializers and masks functree draws with; the values are bit for bit the
ones the key itself gives (tests/test_random.py), so no number changes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jax_random

_THREEFRY = jax_random.threefry_prng_impl


def _flat_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """Threefry's bits for ``shape``, hashed as one flat run of counters and reshaped."""
    return _THREEFRY.random_bits(key, bit_width, (math.prod(shape),)).reshape(shape)


# Threefry in every way but the shape its bits are hashed in: the same seed, split, fold_in.
FLAT_THREEFRY = jax_random.define_prng_impl(
    key_shape=_THREEFRY.key_shape, seed=_THREEFRY.seed, split=_THREEFRY.split,
    random_bits=_flat_bits, fold_in=_THREEFRY.fold_in, name="threefry2x32_flat", tag="fryf",
)


TRAINER_KEY = (
    "       or:  ft.train.Trainer(model, opt, lambda m, b, key: loss_fn(m(b[0], key=key), b[1]),\n"
    "                             key=jax.random.key(0))   # a Trainer: its key, another each step\n"
)
"""The line of a layer's missing-key message for a Trainer's loss: ``key=jax.random.key(step)``
written there with a constant in place of ``step`` would draw one mask for every step."""

NOT_A_KEY = """\
A PRNG key was expected, got {given}: functree's layers, initializers and Dropout take keys \
made by jax.random (as Equinox's do), not integer seeds (torch's manual_seed, Flax's \
nnx.Rngs(0)).

    wrong:  ft.nn.Dense(4, 3, key=0)                   # or model(x, key=step)
    right:  ft.nn.Dense(4, 3, key=jax.random.key(0))   # split it for several layers
       or:  model(x, key=jax.random.fold_in(jax.random.key(0), step))   # a fresh key every step"""


_RAW_SIZES: dict[str, int] = {}  # the default generator's name -> its raw key data's size


def _raw_size() -> int:
    """The size of raw key data of the default generator (``jax.random.PRNGKey``'s: 2 for
    threefry), once per generator name: no computation, an abstract evaluation."""
    impl = str(getattr(jax.config, "jax_default_prng_impl", ""))
    size = _RAW_SIZES.get(impl)
    if size is None:
        size = _RAW_SIZES[impl] = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape[-1]
    return size


def key_batch(key: Any) -> tuple[int, ...] | None:
    """The batch shape of ``key``: ``()`` for one PRNG key, typed (``jax.random.key``) or raw
    ``uint32`` key data (``jax.random.PRNGKey``: ``[2]``); the leading shape of several (a
    whole ``jax.random.split``); None for no key (an integer seed, a float array, a ``uint32``
    array of labels). The one reading of a ``key=`` that the layers', the Trainer's data's,
    a train step's and ``generate``'s checks share, each with its own message.

    Example:
      >>> import jax
      >>> key_batch(jax.random.key(0)), key_batch(jax.random.split(jax.random.PRNGKey(0), 3)), key_batch(0)
      ((), (3,), None)
    """
    dtype = getattr(key, "dtype", None)
    if dtype is None:
        return None
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(np.shape(key))
    if dtype == jnp.uint32 and np.shape(key)[-1:] == (_raw_size(),):
        return tuple(np.shape(key)[:-1])
    return None


def _check_key(key: Any) -> None:
    """Refuse what no jax.random function reads as a key (a Python or NumPy integer, a float
    array, a ``uint32`` scalar): JAX's own error for it names no key (``'int' object has no
    attribute 'dtype'``)."""
    if key_batch(key) is None:
        dtype = getattr(key, "dtype", None)
        plain = dtype is None or not (getattr(key, "shape", ()) or isinstance(key, jax.Array))  # 0, np.int32(0)
        given = f"{type(key).__name__} {key!r}" if plain else f"an array of {dtype}{list(key.shape)}"
        raise TypeError(NOT_A_KEY.format(given=given))


def _is_typed(key: Any) -> bool:
    return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


SEVERAL_KEYS = """\
One PRNG key was expected, got {n} keys ({what} of shape {shape}: a jax.random.split's whole \
output): functree's layers, initializers and Dropout take one key and split it themselves for \
their parts (JAX's split and draws refuse a batch of keys).

    wrong:  ft.nn.Dense(4, 3, key=jax.random.split(key, {n}))      # or model(x, key=keys)
    right:  ft.nn.Dense(4, 3, key=jax.random.split(key, {n})[0])   # one of them
       or:  jax.vmap(lambda k: model(x, key=k))(keys)              # a call for each key"""


def one_key(key: Any) -> Any:
    """``key`` if it is one PRNG key (typed, or ``jax.random.PRNGKey``'s raw ``uint32`` data):
    the check a layer runs where it first splits or draws with its ``key=``, so an integer
    seed (:data:`NOT_A_KEY`) or a whole ``jax.random.split`` (:data:`SEVERAL_KEYS`) is named
    at the call, not inside JAX's split (``invalid PRNG key data``). Trace-time only under
    ``jit`` (a tracer's shape and dtype are static); a key under ``vmap`` is one key."""
    _check_key(key)
    batch = key_batch(key)
    if batch:
        raise ValueError(SEVERAL_KEYS.format(n=math.prod(batch), shape=tuple(key.shape),
                                             what="a key array" if _is_typed(key) else "raw uint32 key data"))
    return key


def flat_key(key: jax.Array) -> jax.Array:
    """``key`` as a key whose draws are hashed flat (:data:`FLAT_THREEFRY`): every draw equals
    the key's own bit for bit. A threefry key, typed (``jax.random.key``) or raw
    (``jax.random.PRNGKey``), under ``vmap`` or not; a key of another generator (``rbg``) is
    returned as it is. For draws made here only: never store the key it returns.

    Example:
      >>> import jax
      >>> key = jax.random.key(0)
      >>> bool((jax.random.normal(flat_key(key), (2, 3, 4)) == jax.random.normal(key, (2, 3, 4))).all())
      True

    Anything else than one key raises: an integer seed :data:`NOT_A_KEY`, a batch of keys
    (a whole ``jax.random.split``, which the draw would refuse inside JAX) :data:`SEVERAL_KEYS`
    (:func:`one_key`). Under ``vmap`` a batch of keys is one key each.
    """
    one_key(key)
    if _is_typed(key):
        if str(jax.random.key_impl(key)) != _THREEFRY.name:
            return key  # another generator's key, or one flat already
        data = jax.random.key_data(key)
    elif key.dtype == jnp.uint32 and key.shape[-1:] == (2,) and getattr(jax.config, "jax_default_prng_impl", "") == _THREEFRY.name:
        data = key  # a raw key of the default generator, threefry
    else:
        return key
    return jax.random.wrap_key_data(data, impl=FLAT_THREEFRY)


# Elements in one run of normal_runs: 2**26 float32 values, 256 MB, the most a build holds
# twice (the run and the arrays sliced from it).
RUN = 2**26


def normal_runs(key: jax.Array, shapes: list[tuple[int, ...]], dtype: Any = jnp.float32) -> list[jax.Array]:
    """Standard normal ``dtype`` arrays of ``shapes`` drawn as a few flat runs: the shapes in
    order, each run up to :data:`RUN` values (an array larger than that is a run of its own)
    drawn with ``fold_in(key, run)`` and sliced. One threefry hash for a whole model where an
    array each made XLA compile one (a 2-layer Llama's initialization from its config: 1.4 →
    0.6 compile CPU-s on a 2-core CPU), for any number of arrays; the draws are independent
    standard normals, so the model's distribution is the one an array each gave. ``dtype``
    float64 (under x64) for a float64 model: float32 draws cast up have float32's resolution.

    Example:
      >>> import jax
      >>> a, b = normal_runs(jax.random.key(0), [(2, 3), (4,)])
      >>> a.shape, b.shape, a.dtype
      ((2, 3), (4,), dtype('float32'))
    """
    runs: list[list[tuple[int, ...]]] = []
    size = 0
    for shape in shapes:
        if not runs or size + math.prod(shape) > RUN:
            runs.append([])
            size = 0
        runs[-1].append(shape)
        size += math.prod(shape)
    drawn: list[jax.Array] = []
    for i, run in enumerate(runs):
        values = jax.random.normal(jax.random.fold_in(key, i), (sum(math.prod(s) for s in run),), dtype)
        start = 0
        for shape in run:
            drawn.append(values[start:start + math.prod(shape)].reshape(shape))
            start += math.prod(shape)
    return drawn
