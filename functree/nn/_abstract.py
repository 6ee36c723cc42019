"""Shapes only: layers built inside :func:`shapes_only` skip their initializers.

An abstract template (``jax.eval_shape`` of a model's construction: what ``ft.nn.from_hf``
fills with a checkpoint's weights) keeps only each leaf's shape and dtype, but tracing the
initializers' draws is most of tracing the construction (a Llama of 8 layers: 33 ms of
``jax.eval_shape``, 8 ms with the draws skipped; benchmarks/_startup.py). Inside
:func:`shapes_only`, :func:`initialized` returns zeros of the shape and dtype an initializer
is asked for (its contract: ``init(key, shape, dtype)`` is an array of that shape and
dtype), so the tree, its static fields, shapes and dtypes are the same
(tests/test_hf_load.py compares every Hugging Face family's template with the traced build).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from functree._random import flat_key

_SHAPES_ONLY = contextvars.ContextVar("functree_shapes_only", default=False)

NOT_TRACED = """\
shapes_only(): a layer was built outside a trace, so its parameters would be zeros, not drawn \
by its initializer. Build the template under jax.eval_shape inside shapes_only().
    wrong:  with shapes_only(): model = build(key)
    right:  with shapes_only(): template = jax.eval_shape(lambda: build(jax.random.key(0)))"""


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Layers built inside take zeros for their initializers' draws: for a construction
    traced by ``jax.eval_shape`` only (eagerly, zeros would be a model's values), of a
    function made for it (JAX caches a traced function's jaxpr by the function, and the
    cache does not see this flag: a jitted builder traced here would give zeros later).

    Example:
      >>> import functree as ft, jax
      >>> with shapes_only():
      ...     layer = jax.eval_shape(lambda: ft.nn.Dense(3, 2, key=jax.random.key(0)))
      >>> layer.weight
      ShapeDtypeStruct(shape=(3, 2), dtype=float32)
    """
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def initialized(init: Callable[..., jax.Array], key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``init(key, shape, dtype)``, or zeros of that shape and dtype inside :func:`shapes_only`
    and for a shape with no elements (``Dense(0, 3)``, as torch's ``Linear(0, 3)``)."""
    if _SHAPES_ONLY.get():
        if not isinstance(key, jax.core.Tracer):  # eager: zeros would be the model's values
            raise RuntimeError(NOT_TRACED)
        return jnp.zeros(shape, dtype)
    if 0 in shape:  # no values to draw (JAX's variance-scaling initializers divide by the zero fan)
        return jnp.zeros(shape, dtype)
    return init(flat_key(key), shape, dtype)  # the key's own draws, compiled fast (functree/_random.py)
