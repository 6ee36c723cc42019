"""Sequential: layers applied in order (swift-apis' ``Sequential``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from functree._module import Module, field
from functree._paths import INDEX, Entry
from functree._random import one_key
from functree._repr import short_array
from functree._tree import bounded_put, is_array_value
from functree.nn._check import LayerInputError
from functree.nn._mode import FOREIGN_FIELD, Layer

__all__ = ["Sequential", "Lambda"]

NO_INIT_CACHE = """\
{container}.init_cache: {what} is a {type}, which has no init_cache(batch_size, max_length, \
dtype=None). Every layer that a cache passes through owns one (MultiheadAttention does; a \
block returns its attention's).

    right:  class Block(ft.Module):
                def init_cache(self, batch_size, max_length, dtype=None):
                    return self.attn.init_cache(batch_size, max_length, dtype)
                def __call__(self, x, *, cache, positions, mask=None):
                    y, cache = self.attn(x, mask=mask, cache=cache, positions=positions)
                    return x + y, cache
"""

NOT_A_PAIR = """\
{container}: called with cache=, {what} (a {type}) must return (x, cache), got {given}.

    wrong:  return x + self.attn(x, cache=cache, positions=positions)
    right:  y, cache = self.attn(x, cache=cache, positions=positions); return x + y, cache
"""

BAD_CACHES = """\
Sequential of {n} layers: cache= is a tuple of one cache per layer, got {given}.

    right:  caches = seq.init_cache(batch_size, max_length); x, caches = seq(x, cache=caches, ...)
"""

NOT_A_LAYER = """\
Sequential layer {index} is a {type}, not a layer or function. Pass Modules or callables:

    wrong:  ft.nn.Sequential(ft.nn.Dense(2, 4, key=k), {value!r})
    right:  ft.nn.Sequential(ft.nn.Dense(2, 4, key=k), jax.nn.relu)
"""

UNHASHABLE_CALLABLE = """\
Sequential layer {index} is a {type}: a callable Sequential keeps static (in ft.nn.Lambda), \
and a static value must be hashable (JAX hashes the tree definition at every jit call). A \
layer with arrays is a pytree: register it (a Module or a JAX pytree), or keep the \
function without its arrays:

    wrong:  ft.nn.Sequential(ft.nn.Dense(2, 4, key=k), layer_{index})
    right:  class Layer{index}(ft.Module):  # its arrays are trained, jit sees them
                weight: jax.Array
                def __call__(self, x): return x @ self.weight
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


# A Module class's ``__call__`` (the function itself, so a patched ``__call__`` is looked
# up afresh) -> whether it takes ``key=``. Only Modules are cached: a callable of another
# type (a ``jax.tree_util.Partial``, a ``functools.partial``) wraps a different function in
# each instance, so its type says nothing about its signature.
_TAKES_KEY: dict[Any, bool] = {}


def takes_key(layer: Any) -> bool:
    """Whether ``layer(...)`` accepts a ``key=`` argument: cached per Module class and
    ``__call__``; inspected at each call for any other callable."""
    if not isinstance(layer, Module):
        return _has_key(layer)
    call = type(layer).__call__
    found = _TAKES_KEY.get(call)
    if found is None:
        found = _has_key(layer)
        bounded_put(_TAKES_KEY, call, found)
    return found


def _has_key(layer: Any) -> bool:
    try:
        return "key" in inspect.signature(layer).parameters
    except (TypeError, ValueError):  # no signature (a builtin): called without a key
        return False


class Sequential(Layer):
    """``layers[-1](...layers[1](layers[0](x)))``: layers applied in order.

    ``key=`` is split among the layers that accept one (``Dropout``, nested
    ``Sequential``). Other arguments go to every layer: ``seq(x, *args, **kwargs)``
    computes ``x = layer(x, *args, **kwargs)`` in turn (as :class:`Stack` does, so
    ``stack.unstack()`` takes the Stack's arguments). With ``cache=`` (a tuple of one cache
    per layer, from :meth:`init_cache`) each layer is called ``x, c = layer(x, cache=c,
    **kwargs)`` and the call returns ``(x, caches)``. Plain functions are wrapped in
    :class:`Lambda`; a foreign layer (``eqx.nn.Linear``, ``eqx.nn.Dropout``: a callable
    pytree with arrays or an ``inference`` flag) is kept as it is, trained and switched
    with the model, and gets ``key=`` where it takes one. A single list or tuple of layers is accepted too (``Sequential([a, b])``).

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

    def __call__(self, x: Any, *args: Any, key: jax.Array | None = None, cache: Any = None,
                 **kwargs: Any) -> Any:
        needs = [takes_key(layer) for layer in self.layers]
        keys = iter(jax.random.split(one_key(key), max(sum(needs), 1))) if key is not None else None
        if cache is not None and (not isinstance(cache, (tuple, list)) or len(cache) != len(self.layers)):
            given = f"a {type(cache).__name__}" + (f" of {len(cache)}" if isinstance(cache, (tuple, list)) else "")
            raise ValueError(BAD_CACHES.format(n=len(self.layers), given=given))
        caches = []
        for i, (layer, need) in enumerate(zip(self.layers, needs)):
            kw = {**kwargs, "key": next(keys)} if need and keys is not None else kwargs
            if cache is not None:
                kw = {**kw, "cache": cache[i]}
            try:
                out = layer(x, *args, **kw)
            except LayerInputError as e:
                raise e.within(layer, (Entry("attr", "layers"), Entry(INDEX, i))) from None
            if cache is None:
                x = out
            else:
                x, c = cache_pair(out, layer, f"layer {i}", "Sequential")
                caches.append(c)
        return x if cache is None else (x, tuple(caches))

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> tuple[Any, ...]:
        """One cache per layer (each layer's ``init_cache``), for ``seq(x, cache=caches, ...)``.

        Example:
          >>> import functree as ft, jax
          >>> attn = ft.nn.MultiheadAttention(4, 2, key=jax.random.key(0))
          >>> caches = ft.nn.Sequential(attn, attn).init_cache(1, 8)
          >>> len(caches), caches[0].keys.shape
          (2, (1, 8, 2, 2))
        """
        return tuple(
            member_cache(layer, f"layer {i}", "Sequential", batch_size, max_length, dtype)
            for i, layer in enumerate(self.layers)
        )

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return Sequential(*self.layers[index])
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Any:
        return iter(self.layers)


def _as_layer(index: int, layer: Any) -> Any:
    """``layer`` as Sequential holds it: a Module, or a foreign layer (a callable pytree with
    arrays or an Equinox ``inference`` flag: ``eqx.nn.Linear``, ``eqx.nn.Dropout``) as a
    child that jit, gradients and the mode switches see; a plain function in a static
    :class:`Lambda`."""
    if isinstance(layer, Module):
        return layer
    if not callable(layer):
        raise TypeError(NOT_A_LAYER.format(index=index, type=type(layer).__name__, value=layer))
    if _is_foreign_layer(layer):
        return layer
    try:
        hash(layer)
    except TypeError:
        raise TypeError(UNHASHABLE_CALLABLE.format(index=index, type=type(layer).__name__)) from None
    return Lambda(layer)


def _is_foreign_layer(layer: Any) -> bool:
    """A callable pytree holding an array, or a bool ``inference`` attribute (Equinox's mode
    flag: ``eqx.nn.Dropout`` holds no array)."""
    if isinstance(getattr(layer, FOREIGN_FIELD, None), bool):
        return True
    leaves = jax.tree.leaves(layer)
    return not (len(leaves) == 1 and leaves[0] is layer) and any(is_array_value(x) for x in leaves)


def member_cache(layer: Any, what: str, container: str, batch_size: int, max_length: int, dtype: Any) -> Any:
    """``layer.init_cache(...)``, or an error naming the layer that has none."""
    make = getattr(layer, "init_cache", None)
    if not callable(make):
        raise TypeError(NO_INIT_CACHE.format(container=container, what=what, type=type(layer).__name__))
    return make(batch_size, max_length, dtype)


def cache_pair(out: Any, layer: Any, what: str, container: str) -> tuple[Any, Any]:
    """A layer's ``(x, cache)`` result, or an error saying it returned something else."""
    if not isinstance(out, tuple) or len(out) != 2:
        if hasattr(out, "shape") and hasattr(out, "dtype"):
            given = f"an array {short_array(out)}"
        else:
            given = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, tuple) else "")
        raise TypeError(NOT_A_PAIR.format(container=container, what=what, type=type(layer).__name__, given=given))
    return out[0], out[1]
