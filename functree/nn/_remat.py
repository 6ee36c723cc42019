"""Rematerialisation: recompute a layer in the backward pass instead of storing its activations.

``jax.checkpoint`` (remat) saves only what its ``policy`` allows of the forward pass;
the backward pass recomputes the rest, trading one more forward computation for the
memory of the activations. :class:`Remat` wraps any layer; ``ft.nn.Stack(...,
remat=...)`` wraps each block of a stack.

A layer rebuilt inside a JAX transformation (``jax.checkpoint``, ``jax.lax.scan``) is a
new object that ``ft.nn.collect_state`` does not know; :func:`call_collecting` runs it
under its own collection and :func:`record_under` files the state it recorded under the
wrapping layer's key path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax

from functree._derivative import StateCollection, is_dynamic, register_state_collection
from functree._module import Module, field
from functree._paths import ATTR, Entry, KeyPath
from functree._remat_policy import checkpointed, remat_policy
from functree._tree import is_array_value
from functree.nn._mode import Layer
from functree.nn._sequential import takes_key
from functree.nn._state import collect_records, collector_stack, record_in

__all__ = ["Remat", "remat_policy", "call_collecting", "record_under", "record_in"]

A_FUNCTION = """\
ft.nn.Remat wraps a layer (a Module, or a pytree of arrays it calls), got the {type} \
{name}: jax.checkpoint takes the layer as an argument, and a plain function is not an \
array (JAX fails with "Cannot interpret value of type {type}"). Keep the function static \
in ft.nn.Lambda, or write it as a Module:

    wrong:  ft.nn.Remat({name})
    right:  ft.nn.Remat(ft.nn.Lambda({name}))"""


def collecting() -> bool:
    """Whether ``ft.nn.collect_state`` is collecting layer state now."""
    return bool(collector_stack())


def call_collecting(call: Callable[[Any], Any], layer: Any, paths: list[KeyPath]) -> tuple[Any, tuple[Any, ...]]:
    """``(call(layer), values)``: what ``layer`` (a rebuilt copy) records (layer state and
    recorded intermediates), its key paths (relative to ``layer``) stored into ``paths``
    while tracing."""
    out, updates = collect_records(call, layer)
    paths[:] = list(updates)
    return out, tuple(updates.values())


def record_under(owner: Any, field_name: str, paths: list[KeyPath], values: Any) -> None:
    """File state recorded by ``owner.<field_name>`` (at ``paths``) under ``owner``'s key path."""
    record_in(owner, [KeyPath((Entry(ATTR, field_name), *path)) for path in paths], values)


class Remat(Layer):
    """``layer`` recomputed in the backward pass (``jax.checkpoint``) instead of stored.

    ``policy`` chooses what the forward pass keeps: None saves nothing but the inputs
    (the least memory, one more forward pass); a name from ``jax.checkpoint_policies``
    (``"dots_with_no_batch_dims_saveable"`` keeps matrix products) or a policy function.
    Values and gradients equal those of ``layer``; layer state and ``key=`` pass through.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> dense = ft.nn.Dense(3, 3, jax.nn.gelu, key=jax.random.key(0))
      >>> remat = ft.nn.Remat(dense, policy="dots_saveable")
      >>> x = jnp.ones((2, 3))
      >>> g1 = jax.grad(lambda m: jnp.sum(m(x)))(dense)
      >>> g2 = jax.grad(lambda m: jnp.sum(m(x)))(remat).layer
      >>> bool(jnp.allclose(g1.weight, g2.weight))
      True
    """

    layer: Any
    policy: Any = field(static=True, default=True)
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("policy",)  # a restore's template decides them (how it spends memory)

    def __init__(self, layer: Any, *, policy: Any = None):
        _check_layer(layer)
        self.layer = layer
        self.policy = True if policy is None else remat_policy(policy)

    def __call__(self, *args: Any, key: jax.Array | None = None, **kwargs: Any) -> Any:
        if key is not None and takes_key(self.layer):
            kwargs["key"] = key
        dyn, full = constants_bound(args)
        if not collecting():
            return checkpointed(lambda layer, *d: layer(*full(d), **kwargs), self.policy)(self.layer, *dyn)
        paths: list[KeyPath] = []

        def run(layer: Any, *d: Any) -> Any:
            return call_collecting(lambda m: m(*full(d), **kwargs), layer, paths)

        out, values = checkpointed(run, self.policy)(self.layer, *dyn)
        record_under(self, "layer", paths, values)
        return out


def constants_bound(args: tuple) -> tuple[tuple, Callable[[tuple], tuple]]:
    """``(dynamic, full)``: the positional arguments ``jax.checkpoint`` traces, and
    ``full(dynamic)``, all of them back in their places.

    A Python bool or int (``train``, an axis) and a non-array (a string flag) are
    constants of the call, as ``static_argnums`` would make them: traced, a
    ``True`` is a bool[] tracer and ``if train:`` fails (TracerBoolConversionError) where
    the bare layer runs. A Python float stays data (it may be differentiated). Keyword
    arguments reach the layer by closure already.
    """
    dynamic = [i for i, a in enumerate(args) if is_dynamic(a)]

    def full(dyn: tuple) -> tuple:
        out = list(args)
        for i, value in zip(dynamic, dyn):
            out[i] = value
        return tuple(out)

    return tuple(args[i] for i in dynamic), full


def _check_layer(layer: Any) -> None:
    """Raise :data:`A_FUNCTION` for a layer that is a callable pytree leaf (a plain function,
    a ``functools.partial``): it cannot cross into ``jax.checkpoint``. A Module, a
    ``jax.tree_util.Partial`` (a pytree) and arrays pass."""
    if isinstance(layer, Module) or not callable(layer) or is_array_value(layer):
        return
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(layer)):
        name = getattr(layer, "__name__", None) or type(layer).__name__
        raise TypeError(A_FUNCTION.format(type=type(layer).__name__, name=name))


register_state_collection(StateCollection(collecting, call_collecting, record_in))  # for ft.with_recomputation_in_pullbacks
