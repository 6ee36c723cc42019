"""Label trees shaped like a model, given to optax (``multi_transform``, ``partition``,
``masked``).

A label tree built by ``jax.tree.map(fn, model)`` or ``ft.mask(model, ...)`` has the
model's class, and a Module with ``__call__`` is callable, so optax takes it for a label
*function* and calls ``labels(params)``: the model's forward pass runs on a tree of
strings. Every ``Module.__call__`` is therefore wrapped once, at class creation: called
*by optax* (the calling frame's module is ``optax`` or one of its submodules) with one
argument of its own class while its leaves are labels (strings, bools, ints), it returns
itself (the labels) instead of running the model. A user's own call never takes that
path: ``Offset(2)(Offset(3))`` of a module holding Python ints runs its ``__call__``.

Every ``__call__`` a Module class runs at its creation is wrapped: the one its body defines,
and one it inherits from a class that is not a Module (a mixin: wrapped as a forwarder to
it, so that a later patch of the mixin is run). A function assigned as ``__call__`` after
the class was made is not (seeing it would need a metaclass, which would refuse
``class M(ft.Module, abc.ABC)``): wrap it with :func:`label_aware` to use such a class's
label trees with optax.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import jax

from functree._alias import is_deletion_error, is_stale_error, stale_error
from functree._compat import NOT_A_JAX_TYPE
from functree._repr import short_array
from functree._tree import abstract_leaf

__all__ = ["label_aware", "label_calls", "is_label_tree", "LAYOUT"]

_LABEL_TYPES = (str, bool, int)

ABSTRACT_CALLED = """\
{cls} called with abstract leaves: {path} is {leaf}, a jax.ShapeDtypeStruct (jax.eval_shape's \
template), which holds a shape and dtype but no values to compute with. Build the model, or load \
its weights into the template, then call it; or trace the call abstractly too:
    wrong:  template = jax.eval_shape(lambda: build(key)); template(x)
    right:  model = jax.jit(build)(key); model(x)             # or ft.train.load(path, template)
       or:  jax.eval_shape(lambda m, x: m(x), template, x)    # the output's shape and dtype only"""


class AbstractModelError(TypeError):
    """A module whose leaves include ``jax.ShapeDtypeStruct`` (a ``jax.eval_shape`` template)
    was called: JAX's own error named an operand type (``unsupported operand type(s) for @``)."""


def _abstract_error(model: Any) -> AbstractModelError | None:
    """:data:`ABSTRACT_CALLED` naming ``model``'s first abstract leaf, or None: read on a
    failed call only (each enclosing call builds its own, so the user's model names the path)."""
    found = abstract_leaf(model)
    if found is None:
        return None
    path, leaf = found
    return AbstractModelError(ABSTRACT_CALLED.format(cls=type(model).__name__, path=path or "it", leaf=short_array(leaf)))

# How labels are laid onto the definition of the parameters they are called with when the
# two differ (in static layer modes: ``ft.nn.training(model)``'s labels, the Optimizer's
# mode-free parameters): set by ``functree.nn._mode`` (the core imports no subpackage).
# Identity until then.
LAYOUT: list[Callable[[Any, Any], Any]] = []


def is_label_tree(tree: Any) -> bool:
    """Whether every leaf of ``tree`` is a label (a string, bool or int) and it has one.

    Example:
      >>> is_label_tree({"w": "adam", "b": True}), is_label_tree({"w": 1.0}), is_label_tree({})
      (True, False, False)
    """
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, _LABEL_TYPES) for x in leaves)


def _called_by_optax() -> bool:
    """Whether the caller of the wrapped ``__call__`` (two frames up from here) is optax's
    code: its ``multi_transform``/``partition`` and ``masked`` call a callable label tree
    with the parameters. Read only for a call with one argument of the module's own class."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name == "optax" or name.startswith("optax.")


def label_aware(call: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Module's ``__call__`` so that a label tree called as a label function by
    optax returns itself; every other call (every call of the user's) runs ``call``
    unchanged.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, optax
      >>> class Scale(ft.Module):
      ...     w: jax.Array
      ...     __call__ = label_aware(lambda self, x: self.w * x)
      >>> model = Scale(jnp.ones(2))
      >>> labels = jax.tree.map(lambda p: "adam", model)
      >>> tx = optax.multi_transform({"adam": optax.sgd(0.5)}, labels)  # optax calls labels(params)
      >>> tx.update(model, tx.init(model))[0].w
      Array([-0.5, -0.5], dtype=float32)
      >>> model(jnp.ones(2))
      Array([1., 1.], dtype=float32)
    """
    if getattr(call, "__ft_label_aware__", False):
        return call

    @functools.wraps(call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (len(args) == 1 and not kwargs and type(args[0]) is type(self) and _called_by_optax()
                and is_label_tree(self)):
            return LAYOUT[0](self, args[0]) if LAYOUT else self
        try:
            return call(self, *args, **kwargs)
        except NOT_A_JAX_TYPE:  # jax.eval_shape's template called: JAX names only an operand type
            abstract = _abstract_error(self)
            if abstract is None:
                raise
            raise abstract from None
        except (RuntimeError, ValueError) as e:  # a donated model used again: name the key path
            # JAX's error, or an inner layer's (``model.weight`` of the layer): the outermost
            # call's names the path from the model the user called (``model.conv.weight``)
            stale = stale_error([("model", self), *((f"args[{i}]", a) for i, a in enumerate(args)),
                                 *kwargs.items()]) if is_deletion_error(e) or is_stale_error(e) else None
            if stale is None:
                raise
            raise stale from None

    __call__.__ft_label_aware__ = True  # type: ignore[attr-defined]
    return __call__


def label_calls(cls: type) -> None:
    """At a Module class's creation: the ``__call__``
    it runs made label-aware: its own, or one inherited from a class that is not a Module
    (a mixin), through a forwarder to the next class's (``super()``: a later patch of the
    mixin runs, as Python would run it)."""
    own = cls.__dict__.get("__call__")
    if own is not None:
        type.__setattr__(cls, "__call__", label_aware(own))
        return
    inherited = next((k.__dict__["__call__"] for k in cls.__mro__[1:] if "__call__" in k.__dict__), None)
    if isinstance(inherited, types.FunctionType) and not getattr(inherited, "__ft_label_aware__", False):
        type.__setattr__(cls, "__call__", label_aware(_forwarder(cls, inherited)))


def _forwarder(cls: type, inherited: types.FunctionType) -> Callable[..., Any]:
    """``__call__`` running the one after ``cls`` in the instance's MRO (read at each call),
    named and documented as ``inherited``; marked ``__ft_forwards__`` for the readers of a
    class's code (an eager Stack's cache key reads the one it runs)."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return super(cls, self).__call__(*args, **kwargs)  # type: ignore[misc]

    functools.update_wrapper(__call__, inherited)
    __call__.__ft_forwards__ = True  # type: ignore[attr-defined]
    return __call__
