"""Training vs inference: a static ``training`` flag, switched for a whole model at once.

Layers whose behaviour differs between the two phases (``Dropout``, ``BatchNorm``) carry
``training: bool = ft.field(static=True, default=False)``. As in swift-apis, inference is
the default. The flag lives in the tree definition, so switching it changes the jit cache
key (one compilation per phase) and costs nothing per call inside a compiled step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from functree import _labels
from functree._alias import stale_error
from functree._module import Module
from functree._tree import bounded_put, cached, is_none

__all__ = ["Layer", "training", "inference", "inferring", "is_training", "mode_free", "mode_free_def", "in_mode"]

TRAINING_FIELD = "training"

TRAINING_NOT_STATIC = """\
{cls}.training holds a bool but is a {kind} field, not a static one: ft.nn.training and \
ft.nn.inference switch a layer's mode flag only where it is static (the flag lives in the \
tree definition), so this layer would stay in the mode it was built in (its dropout or \
batch statistics never on). Declare the flag static:

    wrong:  training: bool = {declared}
    right:  training: bool = ft.field(static=True, default=False)
"""

# (treedef, flag) -> (plan, the leaf positions of foreign `inference` flags): where the
# `training` flags to set are (:func:`_plan`), found once per tree definition (bounded).
# Only positions are cached, never a definition: a later model whose definition is equal
# (static values compared with ==, so 0.0 and -0.0, 0.5 and np.float32(0.5), a dataclass
# field with compare=False all match) is switched along the same positions from its own
# tree, keeping its own static values.
_MODE_CACHE: dict[tuple[Any, bool], tuple[Any, tuple[int, ...]]] = {}

# Equinox's convention (eqx.nn.Dropout, BatchNorm, MultiheadAttention ...): a layer's mode is
# an attribute ``inference`` holding a Python bool, a pytree *leaf* (so not in the tree
# definition). ``eqx.nn.inference_mode`` sets every such attribute; ft's modes do too, so
# a model mixing both kinds of layers switches as one. The leaf positions of such
# attributes are found with the new definition (no equinox import: any node's attribute).
FOREIGN_FIELD = "inference"


def _is_flag(value: Any) -> bool:
    """A Python bool, or a bool array without axes: ``jax.device_put(model)`` makes one of
    an Equinox flag, and the user's ``jax.jit`` traces it (a bool[] tracer). Left an array,
    ``if inference`` fails (TracerBoolConversionError); it is set to a Python bool, as
    ``eqx.nn.inference_mode`` sets it, traced or not."""
    if type(value) is bool:
        return True
    return (isinstance(value, (np.ndarray, np.bool_, jax.Array))
            and np.shape(value) == () and value.dtype == np.bool_)


def _foreign_training(model: Any) -> bool:
    """Whether an Equinox-style flag of ``model`` says training (``inference`` False; a
    traced flag's value is unknown and not counted)."""
    leaves = jax.tree.leaves(model)
    for i in _foreign_flags(model):
        value = leaves[i]
        if _is_flag(value) and not isinstance(value, Tracer) and not bool(value):
            return True
    return False


def _foreign_flags(model: Any) -> tuple[int, ...]:
    """The leaf indices of ``model`` at an attribute named ``inference`` (whether the leaf
    is a flag is checked at each switch)."""
    paths = jax.tree_util.tree_flatten_with_path(model)[0]
    return tuple(i for i, (path, _) in enumerate(paths)
                 if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == FOREIGN_FIELD)


def _mode_plan(model: Any, treedef: Any, flag: bool) -> tuple[Any, tuple[int, ...]]:
    """``(plan, foreign)``: where ``model``'s ``training`` fields differ from ``flag``
    (:func:`_plan`) and its foreign flags' leaf positions: found once per definition."""
    key, found = cached(_MODE_CACHE, (treedef, flag))
    if found is None:
        found = _plan(model, flag), _foreign_flags(model)
        if key is not None:
            bounded_put(_MODE_CACHE, key, found)
    return found


def _is_module(x: Any) -> bool:
    return isinstance(x, Module)


def _one_level(node: Any) -> tuple[list[Any], Any] | None:
    """``(children, definition of one level)`` of a pytree node other than a Module, or
    None for a leaf."""
    children, node_def = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    return None if jax.tree_util.treedef_is_leaf(node_def) else (children, node_def)


def _plan(node: Any, flag: bool) -> Any:
    """Where ``node``'s ``training`` flags are to be set to ``flag``: None where nothing in
    ``node`` changes, else ``(set here, ((child, plan), ...))``, a child being a Module's
    field name or a container's child position. It depends only on what the tree
    definition holds (types, fields, children, the flags' values), so it serves every
    tree of the definition."""
    if isinstance(node, Module):
        cls = type(node)
        static = cls.__ft_static__  # type: ignore[attr-defined]
        if TRAINING_FIELD in cls.__ft_field_set__ and TRAINING_FIELD not in static:  # type: ignore[attr-defined]
            _check_flag_declaration(cls, node.__dict__.get(TRAINING_FIELD))
        kids = tuple((n, p) for n in cls.__ft_fields__ if n not in static  # type: ignore[attr-defined]
                     and (p := _plan(node.__dict__[n], flag)) is not None)
        here = TRAINING_FIELD in static and node.__dict__[TRAINING_FIELD] is not flag
        return (here, kids) if here or kids else None
    if isinstance(node, (jax.Array, np.ndarray, np.generic, int, float, complex, str)) or node is None:
        return None  # a leaf: nothing below
    level = _one_level(node)
    if level is None:
        return None
    kids = tuple((i, p) for i, child in enumerate(level[0]) if (p := _plan(child, flag)) is not None)
    return (False, kids) if kids else None


def _apply(node: Any, plan: Any, flag: bool) -> Any:
    """``node`` with the ``training`` flags ``plan`` names set to ``flag``: only the nodes on
    the way to a flag are rebuilt, each from its own fields (its own static values)."""
    here, kids = plan
    if isinstance(node, Module):
        changes = {n: _apply(node.__dict__[n], p, flag) for n, p in kids}
        if here:
            changes[TRAINING_FIELD] = flag
        return node.replace(**changes)
    children, node_def = _one_level(node)  # type: ignore[misc]  # the plan names a node
    for i, p in kids:
        children[i] = _apply(children[i], p, flag)
    return jax.tree_util.tree_unflatten(node_def, children)


def _check_flag_declaration(cls: type, value: Any) -> None:
    """Raise :data:`TRAINING_NOT_STATIC` when a non-static field named ``training`` holds a
    bool (a Python bool, or a bool scalar array or tracer: what a bool leaf becomes under
    jit): a mode flag the switch cannot reach. Runs while a definition's mode form is made
    (once per tree definition), never per call."""
    if type(value) is not bool and not (getattr(value, "dtype", None) == np.bool_ and np.shape(value) == ()):
        return
    kind = cls.__ft_kinds__[TRAINING_FIELD]  # type: ignore[attr-defined]
    declared = "False" if kind == "parameter" else "ft.field(no_derivative=True, default=False)"
    raise TypeError(TRAINING_NOT_STATIC.format(cls=cls.__name__, kind=kind.replace("_", "-"), declared=declared))


def _with_mode(model: Any, flag: bool) -> Any:
    leaves, treedef = jax.tree.flatten(model)
    if any(isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted() for x in leaves):
        raise stale_error([("model", model)])  # type: ignore[misc]  # donated: say so now, not at a later use
    plan, foreign = _mode_plan(model, treedef, flag)
    for i in foreign:
        if _is_flag(leaves[i]):  # an Equinox-style flag: inference = not training
            leaves[i] = not flag
    tree = jax.tree.unflatten(treedef, leaves)  # model's own definition: its static values
    return tree if plan is None else _apply(tree, plan, flag)


def mode_free(tree: Any) -> Any:
    """``tree`` with every ``training`` flag off: the form an optimizer keeps its state in,
    so that a state made before ``ft.nn.training(model)`` serves the model in either mode
    (the flag is static: it is in the tree definition, not in any array). ``tree`` itself
    when it has no flag set (one flatten; where the flags are is cached per definition).

    Example:
      >>> import functree as ft
      >>> mode_free(ft.nn.training(ft.nn.Dropout(0.5))).training
      False
    """
    plan = _mode_plan(tree, jax.tree.structure(tree), False)[0]
    return tree if plan is None else _apply(tree, plan, False)


def mode_free_def(treedef: Any) -> Any:
    """The tree definition :func:`mode_free` gives a tree of ``treedef``."""
    return jax.tree.structure(mode_free(treedef.unflatten([0] * treedef.num_leaves)))


def in_mode(updates: Any, given: tuple[Any, ...]) -> Any:
    """``updates`` (mode-free: an optimizer's, whose state is kept so) in the mode of the
    gradients or parameters given, as tree definitions: the first of ``given`` (``None``
    skipped) whose :func:`mode_free_def` is ``updates``' definition, with ``updates``'
    leaves (they differ only in static flags); ``updates`` as it is when none is.

    Example:
      >>> import functree as ft, jax
      >>> drop = ft.nn.training(ft.nn.Dropout(0.5))
      >>> in_mode(mode_free(drop), (jax.tree.structure(drop),)).training
      True
    """
    treedef = jax.tree.structure(updates)
    for candidate in given:
        if candidate is None or candidate == treedef:
            continue
        if candidate.num_leaves == treedef.num_leaves and mode_free_def(candidate) == treedef:
            return candidate.unflatten(jax.tree.leaves(updates))
    return updates


def _labels_in_mode(labels: Any, params: Any) -> Any:
    """A label tree (a model's shape, strings or bools at its leaves) laid onto ``params``:
    optax needs the two definitions equal. Labels built from ``ft.nn.training(model)`` meet
    the Optimizer's mode-free parameters, and labels at a model's non-parameter leaves
    (BatchNorm's running statistics) meet the parameter view's ``None`` there. Labels that
    differ otherwise are returned as they are (optax's own error names the mismatch)."""
    target = jax.tree.structure(params)
    if jax.tree.structure(labels) == target:
        return labels
    try:  # both mode-free: the same metadata; None where the parameter view has None
        laid = jax.tree.map(lambda p, label: None if p is None else label, mode_free(params), mode_free(labels),
                            is_leaf=is_none)
    except ValueError:
        return labels
    return in_mode(laid, (target,))


_labels.LAYOUT[:] = [_labels_in_mode]


def training(model: Any) -> Any:
    """``model`` with every layer in training mode (Dropout drops, BatchNorm normalizes
    with batch statistics and records new running statistics). Foreign layers following
    Equinox's convention (a Python-bool attribute ``inference``: ``eqx.nn.Dropout``,
    ``eqx.nn.BatchNorm``) get ``inference=False``, as ``eqx.nn.inference_mode(m, False)``.

    A new tree over the *same* arrays (no array is copied): once a donating train step
    consumes either tree, both are invalid (using one is an error naming the key path).

    Example:
      >>> import functree as ft, jax
      >>> model = ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.Dropout(0.5))
      >>> ft.nn.training(model).layers[1].training
      True
    """
    return _with_mode(model, True)


def inference(model: Any) -> Any:
    """``model`` with every layer in inference mode (the default); a foreign layer's
    Python-bool attribute ``inference`` (Equinox's layers) is set to ``True``, as
    ``eqx.nn.inference_mode(m)`` does.

    A new tree over the *same* arrays, not a copy: after a donating train step has
    consumed ``model``, ``inference(model)`` is an error naming the key path. Keep an
    evaluation copy with ``jax.tree.map(jnp.copy, ft.nn.inference(model))``.

    Example:
      >>> import functree as ft
      >>> ft.nn.inference(ft.nn.training(ft.nn.Dropout(0.5))).training
      False
    """
    return _with_mode(model, False)


def inferring(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)`` run in inference mode (swift-apis' ``inferring(from:)``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> drop = ft.nn.training(ft.nn.Dropout(0.5))
      >>> ft.nn.inferring(drop, jnp.ones(3))
      Array([1., 1., 1.], dtype=float32)
    """
    return inference(model)(*args, **kwargs)


def is_training(model: Any) -> bool:
    """Whether any layer of ``model`` is in training mode: a functree layer's static
    ``training`` flag is True, or a foreign layer's Equinox-style ``inference`` flag is
    False (``eqx.nn.Dropout(0.1)`` is built in training mode). A flag traced by the
    caller's ``jax.jit`` has no known value and is not counted.

    Example:
      >>> import functree as ft
      >>> ft.nn.is_training(ft.nn.Dropout(0.1)), ft.nn.is_training(ft.nn.training(ft.nn.Dropout(0.1)))
      (False, True)
    """
    found = []

    def visit(y: Any) -> Any:
        if isinstance(y, Module):
            cls = type(y)
            if TRAINING_FIELD in cls.__ft_static__ and y.__dict__[TRAINING_FIELD]:
                found.append(True)
            for n in cls.__ft_fields__:
                if n not in cls.__ft_static__:
                    jax.tree.map(visit, y.__dict__[n], is_leaf=_is_module)
        return y

    jax.tree.map(visit, model, is_leaf=_is_module)
    return bool(found) or _foreign_training(model)


class Layer(Module):
    """Base class of functree's layers: a :class:`functree.Module` with ``inferring``.

    Any Module works with ``ft.nn.training`` / ``ft.nn.inference``; subclassing ``Layer``
    adds the method form of Swift's ``model.inferring(from: x)``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> dense = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> dense.inferring(jnp.ones((4, 2))).shape
      (4, 1)
    """

    def inferring(self, *args: Any, **kwargs: Any) -> Any:
        """``self(*args, **kwargs)`` with every layer in inference mode."""
        return inferring(self, *args, **kwargs)
