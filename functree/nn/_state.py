"""Layer state (BatchNorm's running statistics) as explicit, pure values.

A layer in training mode calls ``ft.nn.record_state(self, running_mean=...)`` with new
values for its ``no_derivative`` fields. ``ft.nn.collect_state(fn, model)`` runs
``fn(model)`` while collecting those records and returns them as ``{KeyPath: value}``;
``ft.nn.apply_state(model, updates)`` writes them back. Nothing is mutated: the records
are ordinary outputs of the traced function, so they pass through ``jax.jit``,
``jax.grad(..., has_aux=True)`` and ``ft.value_with_gradient(..., has_aux=True)``.
Outside ``collect_state`` (or in inference mode) nothing is recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from functree._module import Module
from functree._paths import ATTR, Entry, KeyPath, walk
from functree.nn._check import LayerInputError

__all__ = ["record_state", "collect_state", "apply_state"]

NOT_STATE_FIELD = """\
ft.nn.record_state({cls}, {name}=...): {cls}.{name} is not a no_derivative field; only \
those hold layer state. Its no_derivative fields are {fields}.

    wrong:  {name}: jax.Array
    right:  {name}: jax.Array = ft.field(no_derivative=True)
"""

NOT_IN_MODEL = """\
A {cls} recorded state inside ft.nn.collect_state, but it is not part of the model passed \
to collect_state (or fn is jit-compiled, which rebuilds the model), so its key path is \
unknown. Call the layers of the model fn receives, and put jit around collect_state:

    wrong:  ft.nn.collect_state(lambda m: other_model(x), model)
    wrong:  ft.nn.collect_state(jax.jit(lambda m: m(x)), model)
    right:  jax.jit(lambda model: ft.nn.collect_state(lambda m: m(x), model))(model)
"""


class _Collector:
    def __init__(self, model: Any) -> None:
        self.paths: dict[int, list[KeyPath]] = {}
        if isinstance(model, Module):
            self.paths[id(model)] = [KeyPath()]
        for path, value in walk(model):
            if isinstance(value, Module):
                self.paths.setdefault(id(value), []).append(path)
        self.updates: dict[KeyPath, Any] = {}


_LOCAL = threading.local()


def _stack() -> list[_Collector]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def record_state(layer: Module, **values: Any) -> None:
    """Record new values for ``layer``'s ``no_derivative`` fields (no-op outside collect_state).

    Called by layers in training mode; values are stopped from carrying gradients and cast
    to the field's dtype.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Counter(ft.Module):
      ...     count: jnp.ndarray = ft.field(no_derivative=True)
      ...     def __call__(self, x):
      ...         ft.nn.record_state(self, count=self.count + 1)
      ...         return x
      >>> y, updates = ft.nn.collect_state(lambda m: m(2.0), Counter(jnp.zeros(())))
      >>> updates
      {KeyPath('.count'): Array(1., dtype=float32)}
    """
    stack = _stack()
    if not stack:
        return
    cls = type(layer)
    for name in values:
        if name not in cls.__ft_no_derivative__:
            raise TypeError(
                NOT_STATE_FIELD.format(cls=cls.__name__, name=name, fields=list(cls.__ft_no_derivative__))
            )
    collector = next((c for c in reversed(stack) if id(layer) in c.paths), None)
    if collector is None:
        raise ValueError(NOT_IN_MODEL.format(cls=cls.__name__))
    for name, value in values.items():
        old = layer.__dict__[name]
        value = jax.lax.stop_gradient(value)
        if hasattr(old, "dtype"):
            value = jnp.asarray(value).astype(old.dtype)
        for path in collector.paths[id(layer)]:
            collector.updates[KeyPath((*path, Entry(ATTR, name)))] = value


def collect_state(fn: Callable[[Any], Any], model: Any) -> tuple[Any, dict[KeyPath, Any]]:
    """``(fn(model), updates)``: run ``fn`` and collect the state its layers record.

    ``updates`` maps key paths to new values (``{KeyPath('.layers[1].running_mean'): ...}``);
    it is a pytree, so a training step returns it as ``aux`` of a gradient and then calls
    :func:`apply_state`. Layer input errors raised inside ``fn`` get the layer's key path.
    Jit-compile around ``collect_state`` (the whole step), not ``fn`` alone.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.training(ft.nn.BatchNorm(2))
      >>> def loss(m, x):
      ...     y, updates = ft.nn.collect_state(lambda m: m(x), m)
      ...     return jnp.sum(y ** 2), updates
      >>> x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
      >>> grads, updates = jax.grad(loss, has_aux=True)(model, x)
      >>> ft.nn.apply_state(model, updates).running_mean
      Array([0.01, 0.03], dtype=float32)
    """
    collector = _Collector(model)
    stack = _stack()
    stack.append(collector)
    try:
        out = fn(model)
    except LayerInputError as e:
        paths = collector.paths.get(id(e.layer))
        if paths:
            raise e.at(paths[0]) from None
        raise
    finally:
        stack.pop()
    return out, collector.updates


def apply_state(model: Any, updates: dict[KeyPath, Any]) -> Any:
    """``model`` with the recorded state written back (``ft.set`` at each key path).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> bn = ft.nn.BatchNorm(1)
      >>> ft.nn.apply_state(bn, {ft.key_path(bn, ".running_mean"): jnp.ones(1)}).running_mean
      Array([1.], dtype=float32)
    """
    for path, value in updates.items():
        model = path.set(model, value) if isinstance(path, KeyPath) else _set_named(model, path, value)
    return model


def _set_named(model: Any, path: Any, value: Any) -> Any:
    from functree._paths import key_path

    return key_path(model, path).set(model, value)
