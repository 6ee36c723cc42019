"""The Differentiable protocol as functions: move along tangents, zero tangents, arithmetic.

A tangent vector of a model has the model's parameter view structure (``None`` at
non-parameters). These functions are pure and jit-friendly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from functree._parameters import _map_checked, parameters
from functree._tree import is_none

__all__ = [
    "move",
    "zero_tangent_vector",
    "zero_tangent_vector_initializer",
    "tangent_add",
    "tangent_subtract",
    "tangent_scale",
    "inner_product",
    "tangent_norm",
]


def _step(t: Any, x: Any) -> Any:
    if t is None:
        return x
    if isinstance(x, float):
        return x + t
    # Keep each parameter's dtype: a float32 update moves a bfloat16 weight as bfloat16.
    return x + jnp.asarray(t).astype(jnp.result_type(x))


def move(x: Any, *, along: Any) -> Any:
    """Swift's ``move(along:)``: ``x + along`` at every parameter; ``None`` means unchanged.

    ``along`` has the parameter view's structure: a gradient, an optimizer update, a
    tangent. Each parameter keeps its dtype.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.move({"w": jnp.ones(2), "n": 3}, along={"w": -0.5 * jnp.ones(2), "n": None})
      {'n': 3, 'w': Array([0.5, 0.5], dtype=float32)}
    """
    return _map_checked("ft.move", _step, along, x, is_leaf=is_none)


def _zeros(spec: Any) -> Any:
    return jnp.zeros(spec.shape, spec.dtype)


def zero_tangent_vector(x: Any) -> Any:
    """Zeros shaped like the parameter view of ``x``: ``move(x, along=zero) == x``.

    Non-parameters (here an integer array) are ``None`` in the result.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.zero_tangent_vector({"w": jnp.ones(2), "n": jnp.zeros((), jnp.int32)})
      {'n': None, 'w': Array([0., 0.], dtype=float32)}
    """
    return jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.result_type(a)), parameters(x))


def zero_tangent_vector_initializer(x: Any) -> Callable[[], Any]:
    """A closure making :func:`zero_tangent_vector` of ``x`` that holds only shapes and dtypes.

    The closure never references ``x``'s arrays, so it can outlive them (Swift's
    ``zeroTangentVectorInitializer``: "does not capture self").

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> init = ft.zero_tangent_vector_initializer({"w": jnp.ones(3)})
      >>> init()["w"]
      Array([0., 0., 0.], dtype=float32)
    """
    specs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), parameters(x)
    )
    return lambda: jax.tree.map(_zeros, specs)


def tangent_add(a: Any, b: Any) -> Any:
    """``a + b`` leafwise over two tangent trees.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_add({"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 4.0])})
      {'w': Array([4., 6.], dtype=float32)}
    """
    return _map_checked("ft.tangent_add", jnp.add, a, b)


def tangent_subtract(a: Any, b: Any) -> Any:
    """``a - b`` leafwise over two tangent trees.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_subtract({"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 4.0])})
      {'w': Array([-2., -2.], dtype=float32)}
    """
    return _map_checked("ft.tangent_subtract", jnp.subtract, a, b)


def tangent_scale(a: Any, scale: Any) -> Any:
    """``scale * a`` at every leaf, keeping each leaf's dtype.

    ``scale`` may be a Python number or a scalar array of any float dtype (a learning rate
    held as a float32 array scales bfloat16 leaves without a promotion error).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_scale({"w": jnp.array([1.0, 2.0])}, 0.5)
      {'w': Array([0.5, 1. ], dtype=float32)}
    """

    def scaled(t: Any) -> Any:
        dtype = jnp.result_type(t)
        return (t * jax.lax.convert_element_type(scale, dtype)).astype(dtype)

    return jax.tree.map(scaled, a)


def _accumulation_dtype(leaves: list[Any]) -> Any:
    dtypes = {jnp.result_type(x) for x in leaves}
    return jnp.float64 if jnp.dtype("float64") in dtypes else jnp.float32


def inner_product(a: Any, b: Any) -> jax.Array:
    """``Σ ⟨a_i, b_i⟩`` over leaves, accumulated in float32 (float64 if any leaf is).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.inner_product({"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, 4.0])})
      Array(11., dtype=float32)
    """
    products = jax.tree.leaves(
        _map_checked("ft.inner_product", lambda x, y: jnp.vdot(x, y), a, b)
    )
    if not products:
        return jnp.zeros((), jnp.float32)
    acc = _accumulation_dtype(products)
    return sum((p.astype(acc) for p in products), start=jnp.zeros((), acc))


def tangent_norm(a: Any) -> jax.Array:
    """The Euclidean norm ``sqrt(⟨a, a⟩)`` of a tangent tree.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tangent_norm({"w": jnp.array([3.0, 4.0])})
      Array(5., dtype=float32)
    """
    return jnp.sqrt(inner_product(a, a))
