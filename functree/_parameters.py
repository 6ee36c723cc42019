"""The parameter view of a model (Swift's ``allDifferentiableVariables``) and maps over it.

``ft.parameters(model)`` has the model's type and structure with every non-parameter
leaf (``no_derivative`` fields, integer and boolean arrays) replaced by ``None``. Gradients
and per-parameter optimizer state have exactly this structure, so one key path reads all
of them and ``ft.move(model, along=update)`` applies any of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import NO_DERIVATIVE, Module, field_kind, from_fields
from functree._naming import NothingSelected, check_patterns, selection
from functree._paths import KeyPath, children
from functree._tree import bound, bounded_put, is_none

__all__ = [
    "parameters",
    "with_parameters",
    "update",
    "tree_map",
    "select",
    "mask",
    "is_parameter_leaf",
    "floats_as_arrays",
    "first_difference",
]

STRUCTURE_MISMATCH = """\
{what}: the trees differ first at {path}: {detail}.
Trees passed together must have the structure of the first one (a model's parameter view, \
its gradient or optimizer moments). Build them from the same model, e.g. \
`ft.gradient(loss, at=model)` or `ft.parameters(model)`."""


# first_difference's detail where the two nodes are of two definitions of one class.
CLASS_DEFINED_AGAIN = (
    "the first has a {name} of {first}, the other a {name} of {other}: the `class {short}` statement "
    "ran again (a notebook cell re-run) after one of the trees was made, and JAX tells the two classes "
    "apart although their names, fields and shapes read alike. Make that tree again from the model of "
    "the class defined now, or carry its leaves over: "
    "jax.tree.unflatten(jax.tree.structure(new_tree), jax.tree.leaves(old_tree))")


VIEW_CALLED = """\
{layer}.{field} is None: this {layer} belongs to a parameter view (ft.parameters(model) holds \
None at the running statistics and every other non-parameter), not to a model. The view is \
what optimizers and gradients take; call the model, with the new parameters written back:

    wrong:  params = optax.apply_updates(ft.parameters(model), updates); params(x)
    right:  model = ft.with_parameters(model, optax.apply_updates(ft.parameters(model), updates)); model(x)
       or:  model = ft.move(model, along=updates); model(x)"""


def is_parameter_leaf(x: Any) -> bool:
    """Whether a leaf of a model is a parameter: a floating (or complex) array.

    Python numbers (``eqx.nn.MaxPool2d``'s ``init=-inf``, ``eqx.nn.Dropout``'s ``p``),
    functions and other objects are static data, carried and never differentiated (a
    value to train is an array: ``jnp.asarray(0.5)``). A Python float that is an
    ``ft.Module`` field's own value, or the whole differentiation point, is a parameter:
    see :func:`parameters`.

    Example:
      >>> import jax.numpy as jnp
      >>> is_parameter_leaf(jnp.ones(2)), is_parameter_leaf(0.5), is_parameter_leaf(jnp.arange(2))
      (True, False, False)
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    try:
        inexact = _INEXACT.get(dtype)
    except TypeError:  # an unhashable dtype-like: no cache
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    if inexact is None:
        inexact = bool(jnp.issubdtype(dtype, jnp.inexact))
        bounded_put(_INEXACT, dtype, inexact)
    return inexact


_INEXACT: dict[Any, bool] = {}  # dtype -> whether it is floating or complex


def field_mask(tree: Any, flagged: Callable[[dataclasses.Field], bool], inherited: bool = False) -> Any:
    """A tree of bools shaped like ``tree``: True at every leaf that lies under a Module
    field for which ``flagged(field)`` holds (``None`` leaves stay ``None``).

    The one walk behind the field rules that become masks: ``no_derivative`` fields (the
    parameter view) and ``ft.field(decay=False)`` (weight decay).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> from functree._parameters import field_mask
      >>> bn = ft.nn.BatchNorm(2)
      >>> field_mask(bn, lambda f: f.name == "running_mean").running_mean
      True
    """
    if isinstance(tree, Module):
        cls = type(tree)
        fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
        values = dict(tree.__dict__)
        for name in cls.__ft_fields__:
            if name not in cls.__ft_static__:
                values[name] = field_mask(values[name], flagged, inherited or flagged(fields[name]))
        return from_fields(cls, values)  # a mask shaped like the model, not a user's construction
    return jax.tree.map(
        lambda y: field_mask(y, flagged, inherited) if isinstance(y, Module) else inherited,
        tree,
        is_leaf=lambda y: isinstance(y, Module),
    )


def is_no_derivative_field(f: dataclasses.Field) -> bool:
    """Whether a layer declares the field ``ft.field(no_derivative=True)`` (a value, not a parameter)."""
    return field_kind(f) == NO_DERIVATIVE


def _is_leaf_value(v: Any) -> bool:
    return v is not None and jax.tree.structure(v).num_nodes == 1 and jax.tree.structure(v).num_leaves == 1


def _field_values(tree: Any) -> Any:
    """A tree of bools shaped like ``tree``: True at a leaf that is itself the value of an
    ``ft.Module`` field (``bias: float = 0.0``), False at leaves inside other containers
    (a dict, a list, an Equinox module)."""
    if isinstance(tree, Module):
        cls = type(tree)
        values = dict(tree.__dict__)
        for name in cls.__ft_fields__:
            if name not in cls.__ft_static__:
                v = values[name]
                values[name] = True if _is_leaf_value(v) else _field_values(v)
        return from_fields(cls, values)
    return jax.tree.map(lambda y: _field_values(y) if isinstance(y, Module) else False, tree,
                        is_leaf=lambda y: isinstance(y, Module))


# treedef -> (which leaf positions lie outside no_derivative fields, which are an ft.Module
# field's own value). Computed once per tree definition; afterwards parameters() is one
# flatten, a dtype test per leaf and one unflatten.
_MASK_CACHE: dict[Any, tuple[tuple[bool, ...], tuple[bool, ...]]] = {}


def _trainable_positions(x: Any, treedef: Any) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    positions = _MASK_CACHE.get(treedef)
    if positions is None:
        positions = (tuple(not b for b in jax.tree.leaves(field_mask(x, is_no_derivative_field))),
                     tuple(jax.tree.leaves(_field_values(x))))
        bounded_put(_MASK_CACHE, treedef, positions)
    return positions


def floats_as_arrays(view: Any) -> Any:
    """``view`` (a parameter view) with each Python ``float`` parameter as a 0-d array: an
    ``ft.Module`` field ``bias: float = 0.0`` is trained, and the transforms that read a
    parameter's ``dtype`` or ``shape`` (LAMB, Adafactor, an EMA's average) failed on it with
    "'float' object has no attribute 'dtype'", as did ``astype`` in ``ft.cast``. ``view`` itself
    when it holds none (one flatten).

    Example:
      >>> floats_as_arrays({"w": 0.5, "b": None})
      {'b': None, 'w': Array(0.5, dtype=float32, weak_type=True)}
    """
    leaves, treedef = jax.tree.flatten(view)
    if not any(type(x) is float for x in leaves):
        return view
    return treedef.unflatten([jnp.asarray(x) if type(x) is float else x for x in leaves])


def parameters(model: Any) -> Any:
    """The parameter view: ``model`` with every non-parameter leaf replaced by ``None``.

    Parameters are the floating (and complex) arrays outside ``no_derivative`` fields, in
    any pytree (an ``ft.Module``, an Equinox module, a dataclass, a dict). Non-parameters
    are leaves of ``no_derivative`` fields, integer and boolean arrays and every leaf that
    is not an array: Python numbers, functions, strings (static data, carried as they are;
    make a number an array to train it). Two exceptions, where a float is declared: a
    Python float that is itself the value of an ``ft.Module`` field (Swift's
    ``var bias: Float``) and a float or complex number that *is* the whole point
    (``ft.gradient(f, at=2.0)``, ``at=1 + 1j``).
    Static fields stay in the tree definition.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class BN(ft.Module):
      ...     scale: jnp.ndarray
      ...     mean: jnp.ndarray = ft.field(no_derivative=True)
      >>> ft.parameters(BN(jnp.ones(2), jnp.zeros(2)))
      BN(scale=f32[2], mean=None)
    """
    if isinstance(model, (float, complex)):  # a bare Python number point: ft.gradient(f, at=2.0)
        return model
    leaves, treedef = jax.tree.flatten(model)
    positions, fields = _trainable_positions(model, treedef)
    return jax.tree.unflatten(
        treedef,
        [x if keep and (is_parameter_leaf(x) or (field and isinstance(x, float))) else None
         for x, keep, field in zip(leaves, positions, fields)],
    )


def with_parameters(model: Any, params: Any) -> Any:
    """Write a parameter view back into ``model`` (Swift's ``allParameters`` setter).

    ``None`` in ``params`` keeps the model's leaf.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.with_parameters({"w": jnp.ones(2), "n": 3}, {"w": jnp.zeros(2), "n": None})
      {'n': 3, 'w': Array([0., 0.], dtype=float32)}
    """
    def written(p: Any, x: Any) -> Any:
        if p is None:
            return x
        if np.shape(p) != np.shape(x):  # another shape would reach the layer (or broadcast) silently
            raise ShapeMismatch(p, x)
        return p

    try:
        return map_checked("ft.with_parameters", written, params, model, is_leaf=is_none)
    except ShapeMismatch as e:
        hint = TRANSPOSED if len(e.given) == 2 and e.given == e.expected[::-1] else ""
        raise ValueError(PARAMETER_SHAPE.format(path=path_of(params, e.leaf), given=e.given, expected=e.expected,
                                                hint=hint)) from None


PARAMETER_SHAPE = """\
ft.with_parameters: the value at {path} has shape {given}; the model's parameter there has shape {expected}.
    wrong:  ft.with_parameters(model, params)      # params{path}: shape {given}
    right:  values with the shapes of ft.parameters(model){hint}"""

TRANSPOSED = """
A (out, in) matrix where the layer holds (in, out) is a torch Linear weight: transpose it
(value.T), or load torch weights with ft.interop.load_torch_state_dict, which does."""


class ShapeMismatch(Exception):
    """Raised inside a tree map: the leaf ``leaf`` has shape ``given`` where ``expected``
    belongs (the caller names its key path with :func:`path_of`: a map cannot)."""

    def __init__(self, leaf: Any, like: Any) -> None:
        super().__init__()
        self.leaf, self.given, self.expected = leaf, tuple(np.shape(leaf)), tuple(np.shape(like))


def path_of(tree: Any, leaf: Any) -> str:
    """The key path of ``leaf`` (found by identity) in ``tree`` (``None`` leaves counted)."""
    found = (jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)[0]
             if x is leaf)
    return next(found, "a leaf") or "<root>"


def update(params: Any, *, with_gradients: Any, updater: Callable[[Any, Any], Any]) -> Any:
    """Seed 001's ``update(withGradients:)``: ``updater(param, gradient)`` at every parameter.

    A ``None`` gradient (a parameter not differentiated, e.g. outside a ``wrt=`` pattern)
    or a ``None`` parameter (a non-parameter in a parameter view) is left as it is.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.update({"w": jnp.ones(2)}, with_gradients={"w": jnp.ones(2)},
      ...           updater=lambda p, g: p - 0.1 * g)["w"]
      Array([0.9, 0.9], dtype=float32)
    """
    def apply(gradient: Any, param: Any) -> Any:
        return param if gradient is None or param is None else updater(param, gradient)

    return map_checked("ft.update", apply, with_gradients, params, is_leaf=is_none)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn`` over the leaves of ``tree`` and of every tree in ``rest`` shaped like it.

    ``None`` leaves of the first tree (non-parameters in a parameter view) are skipped.
    A structure mismatch raises an error naming the first differing key path.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.tree_map(lambda p, g: p - 0.1 * g, {"w": jnp.ones(2)}, {"w": jnp.ones(2)})
      {'w': Array([0.9, 0.9], dtype=float32)}
    """
    return map_checked("ft.tree_map", fn, tree, *rest)


def map_checked(what: str, fn: Callable[..., Any], tree: Any, *rest: Any, **kw: Any) -> Any:
    """``jax.tree.map(fn, tree, *rest)``; trees that differ raise naming ``what`` and the first difference."""
    try:
        return jax.tree.map(fn, tree, *rest, **kw)
    except (ValueError, TypeError) as e:
        # A later tree may have the first as a prefix (jax.tree.map then hands a whole
        # subtree to fn, which fails with a TypeError): look for the difference either way.
        for other in rest:
            diff = first_difference(tree, other, none_is_leaf=bool(kw))
            if diff is not None:
                path, detail = diff
                raise ValueError(STRUCTURE_MISMATCH.format(what=what, path=path, detail=detail)) from None
        raise e


def _node_signature(x: Any, none_is_leaf: bool) -> Any:
    if x is None:
        return "leaf" if none_is_leaf else "None"
    if isinstance(x, Module):
        cls = type(x)
        return (cls.__name__, tuple(x.__dict__[n] for n in cls.__ft_static__))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, len(x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted(map(str, x))))
    leaves = jax.tree.leaves(x, is_leaf=lambda y: y is not x)
    return "leaf" if len(leaves) == 1 and leaves[0] is x else type(x).__name__


def first_difference(a: Any, b: Any, *, none_is_leaf: bool = False) -> tuple[KeyPath, str] | None:
    """The first key path where two trees' structures differ, with a description."""
    def describe(x: Any) -> str:
        sig = _node_signature(x, none_is_leaf)
        return "a leaf" if sig == "leaf" else "None" if x is None else f"{type(x).__name__} {sig}"

    stack = [(KeyPath(), a, b)]
    while stack:
        path, x, y = stack.pop()
        sx, sy = _node_signature(x, none_is_leaf), _node_signature(y, none_is_leaf)
        if sx == "leaf" and sy == "leaf":
            continue
        if sx != sy:
            return path, f"the first has {describe(x)}, the other has {describe(y)}"
        if type(x) is not type(y) and sx != "leaf":  # two classes of one name (_node_signature's)
            return path, _two_classes(type(x), type(y))
        kx, ky = children(x), children(y)
        for (ex, vx), (_, vy) in reversed(list(zip(kx, ky))):
            if isinstance(x, Module) and ex.key in type(x).__ft_static__:
                continue
            stack.append((path + (ex,), vx, vy))
    return None


def _two_classes(a: type, b: type) -> str:
    """The difference between nodes of classes ``a`` and ``b`` whose short names match:
    :data:`CLASS_DEFINED_AGAIN` for two definitions of one module's name, else their
    qualified names."""
    name, other = (f"{c.__module__}.{c.__qualname__}" for c in (a, b))
    if name != other:
        return f"the first has a {name}, the other a {other}"

    def which(cls: type) -> str:
        now = bound(cls.__module__, cls.__qualname__)
        return "the class defined now" if now is cls else "an earlier definition of it" if now is not None \
            else "another definition of it"

    return CLASS_DEFINED_AGAIN.format(name=name, first=which(a), other=which(b), short=a.__name__)


SELECT_EXCLUDE_NOTHING = """\
ft.select: the exclude pattern {pattern!r} matches no name in the tree, so it excludes \
nothing and those parameters stay selected. Closest names: {close}.
    wrong:  ft.select(model, ..., exclude=[{pattern!r}])
    right:  ft.select(model, ..., exclude=[{right!r}])"""


def select(tree: Any, *patterns: str, exclude: Sequence[str] = ()) -> Any:
    """A boolean tree shaped like the parameter view: True where a pattern matches.

    Patterns are globs over dotted names (``layers.0.weight``), one semantics with every
    other consumer of names (see :mod:`functree._naming`): ``"encoder.*"``, ``"*.bias"``,
    ``"layers.[01].*"``. A pattern also matches everything under a matching node
    (``"encoder"`` selects ``encoder.weight``). ``exclude=`` patterns win over
    ``patterns``. Non-parameters are ``None``. A pattern that selects no parameter, or an
    ``exclude=`` pattern that matches no name (non-parameters' count), is an error naming
    the closest names.

    A leaf of an ``ft.nn.Stack`` partly selected by member patterns (``"h.2.*"``,
    ``"h.[0-1].*"``) gets a boolean array over its members (shape ``(n,)``) instead of
    a bool; ``ft.optim.masked`` takes such a mask (``optax.masked`` takes whole leaves).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> params = {"encoder": {"w": jnp.ones(2), "b": jnp.ones(2)}, "head": jnp.ones(2)}
      >>> ft.select(params, "encoder.*", exclude=["*.b"])
      {'encoder': {'b': False, 'w': True}, 'head': False}
      >>> h = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 4, key=jax.random.key(0))
      >>> ft.select({"h": h}, "h.[2-3].*")["h"].layers.weight
      array([False, False,  True,  True])
    """
    if not patterns:
        raise ValueError("ft.select needs at least one pattern, e.g. ft.select(model, '*.bias').")
    check_patterns((*patterns, *exclude))
    return selected(tree, patterns, exclude, exclude_message=SELECT_EXCLUDE_NOTHING)  # a typo excludes nothing


def selected(tree: Any, patterns: Sequence[str], exclude: Sequence[str] = (), strict: bool = True,
             exclude_whole: Sequence[str] = (), exclude_message: str | None = None) -> Any:
    """:func:`select`; without ``strict``, a pattern may select nothing (``decay_mask``'s
    ``"*"`` on a tree without parameters). ``exclude_whole``: exclude patterns matched
    against whole names only (no dotted prefix); ``exclude_message``: the error for an
    exclude pattern matching no name (checked once per tree definition)."""
    view = parameters(tree)
    leaves, treedef = jax.tree.flatten(view, is_leaf=is_none)
    only = tuple(leaf is not None for leaf in leaves)
    try:
        chosen = selection(tree, tuple(patterns), tuple(exclude), what="ft.select", only=only, strict=strict,
                           exclude_whole=tuple(exclude_whole), exclude_message=exclude_message)
    except NothingSelected as e:
        raise ValueError(str(e)) from None
    return jax.tree.unflatten(treedef, [None if leaf is None else c for leaf, c in zip(leaves, chosen)])


mask = select
"""Alias of :func:`select`, named for its use as a weight-decay or freezing mask."""
