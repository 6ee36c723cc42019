"""Sequential: layers applied in order (swift-apis' ``Sequential``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from functree._module import Module, field
from functree._paths import INDEX, Entry
from functree.nn._check import LayerInputError
from functree.nn._mode import Layer

__all__ = ["Sequential", "Lambda"]

NOT_A_LAYER = """\
Sequential layer {index} is a {type}, not a layer or function. Pass Modules or callables:

    wrong:  ft.nn.Sequential(ft.nn.Dense(2, 4, key=k), {value!r})
    right:  ft.nn.Sequential(ft.nn.Dense(2, 4, key=k), jax.nn.relu)
"""


class Lambda(Layer):
    """A parameter-free layer wrapping a function, kept static (``Lambda(jax.nn.relu)``).

    ``Sequential`` wraps plain functions in ``Lambda`` automatically, so models hold no
    function leaves (jit and optax see only arrays).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.Lambda(jnp.tanh)(jnp.zeros(2))
      Array([0., 0.], dtype=float32)
    """

    fn: Callable[..., Any] = field(static=True)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, x: Any) -> Any:
        return self.fn(x)


_TAKES_KEY: dict[type, bool] = {}


def takes_key(layer: Any) -> bool:
    """Whether ``layer.__call__`` accepts a ``key=`` argument (cached per class)."""
    cls = type(layer)
    found = _TAKES_KEY.get(cls)
    if found is None:
        try:
            found = "key" in inspect.signature(layer).parameters
        except (TypeError, ValueError):
            found = False
        _TAKES_KEY[cls] = found
    return found


class Sequential(Layer):
    """``layers[-1](...layers[1](layers[0](x)))``: layers applied in order.

    ``key=`` is split among the layers that accept one (``Dropout``, nested
    ``Sequential``). Plain functions are wrapped in :class:`Lambda`. A single list or tuple
    of layers is accepted too (``Sequential([a, b])``).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> mlp = ft.nn.Sequential(
      ...     ft.nn.Dense(2, 8, jax.nn.relu, key=k1), ft.nn.Dropout(0.1), ft.nn.Dense(8, 1, key=k2))
      >>> mlp(jnp.ones((4, 2))).shape
      (4, 1)
      >>> ft.nn.training(mlp)(jnp.ones((4, 2)), key=jax.random.key(1)).shape
      (4, 1)
    """

    layers: tuple[Any, ...]

    def __init__(self, *layers: Any):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        self.layers = tuple(_as_layer(i, layer) for i, layer in enumerate(layers))

    def __call__(self, x: Any, *, key: jax.Array | None = None) -> Any:
        needs = [takes_key(layer) for layer in self.layers]
        keys = iter(jax.random.split(key, max(sum(needs), 1))) if key is not None else None
        for i, (layer, need) in enumerate(zip(self.layers, needs)):
            try:
                x = layer(x, key=next(keys)) if need and keys is not None else layer(x)
            except LayerInputError as e:
                raise e.under((Entry("attr", "layers"), Entry(INDEX, i))) from None
        return x

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return Sequential(*self.layers[index])
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Any:
        return iter(self.layers)


def _as_layer(index: int, layer: Any) -> Any:
    if isinstance(layer, Module):
        return layer
    if callable(layer):
        return Lambda(layer)
    raise TypeError(NOT_A_LAYER.format(index=index, type=type(layer).__name__, value=layer))
