"""Module: an immutable model whose data leaves are its parameters.

A subclass of :class:`Module` with annotated fields becomes a dataclass and a JAX
pytree (``jax.tree_util.register_pytree_with_keys``), so ``jax.jit``, ``jax.grad``,
``jax.vmap``, optax and orbax accept models directly.

Construction and reconstruction are separate paths:

* ``Cls(...)`` is a user construction: it runs the class's ``__init__`` exactly as
  for a normal class (or a generated dataclass-style one), then freezes and validates;
* JAX's unflatten (every jit output, ``tree_map``, gradient) never calls ``__init__``:
  small per-class functions, generated once from the field names, read and fill the
  instance dict directly (``object.__new__`` plus the fields, no checks).

Three kinds of field, as in Swift (declared with :func:`functree._fields.field`):

* parameters (the default): differentiable data leaves;
* ``field(no_derivative=True)``: data leaves carried and traced but never
  differentiated (Swift's ``@noDerivative var``);
* ``field(static=True)``: configuration kept in the tree definition (Swift's ``let``).

``copy.deepcopy`` copies the data fields and keeps static values (functions, classes)
by identity, so a copy has the original's tree definition and trains with its optimizer
state; ``pickle`` stores jax.nn and ft.nn activations by their public names
(:mod:`functree._functions`, the table checkpoints use).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import keyword
import sys
import typing
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Self, TypeVar

import jax

from functree import _functions
from functree._field_checks import (
    check_dict_keys,
    refuse_hidden_fields,
    refuse_init_vars,
    refuse_kw_only_marker,
)
from functree._fields import NO_DERIVATIVE, PARAMETER, STATIC, field, field_kind, is_missing
from functree._foreign_arguments import foreign_argument
from functree._foreign_methods import missing_attribute
from functree._labels import label_calls
from functree._module_flatten import pytree_functions
from functree._parameter_warnings import (
    FLOATS_IN_CONTAINER,
    INT_FOR_FLOAT,
    annotation_warned,
    floats_only_container,
    non_differentiable_field,
)
from functree._repr import module_html, module_repr
from functree._tree import is_array_value
from functree._undeclared import not_a_field

# field, field_kind and the kinds (functree._fields) are imported from here by other modules.
__all__ = [
    "Module",
    "field",
    "FrozenModuleError",
    "NonDifferentiableFieldWarning",
    "DifferentiationWarning",
]

# In an instance's dict while its outermost __init__ runs (field assignment allowed);
# removed before the instance is returned. Unflattened instances never carry it.
_BUILDING = "__ft_building__"
# Marks the __init__ functions this module installs: "user" (a user's __init__ wrapped to
# freeze and validate after the outermost call) or "generated" (dataclass-style binding).
_INIT_KIND = "__ft_init__"

FROZEN_MESSAGE = """\
Cannot assign to field {field!r} of {cls}: modules are immutable values.

    wrong:  model.{field} = value
    right:  model = model.replace({field}=value)
       or:  model = ft.set(model, ".{field}", value)
"""

NOT_A_FIELD = """\
Cannot set {name!r} on {cls}: it is not one of its fields ({fields}), and a constructed \
module is an immutable value (state kept on the module between calls, as in NNX or torch, \
has no place to go). Declare the field on the class and build a new model with it, or \
return the value from the call:

    wrong:  model.{name} = value
    right:  {name}: jax.Array = ft.field(no_derivative=True)   # in class {cls}, then
            model = model.replace({name}=value)
       or:  return out, value                                   # from __call__, beside its output
"""

UNHASHABLE_STATIC = """\
Static field {cls}.{field} holds an unhashable {type} ({error}). Static fields live in \
the tree definition, which JAX hashes and compares on every jit call.

    wrong:  {field}: {type} = ft.field(static=True)      # e.g. {wrong}
    right:  {field}: {right_type} = ft.field(static=True)     # e.g. {right}
"""

# The hashable spelling of an unhashable static value, by its type: (type, example, fixed).
_HASHABLE_FORMS: dict[type, tuple[str, str, str]] = {
    list: ("tuple", "[1, 2]", "(1, 2)"),
    dict: ("tuple", '{"a": 1}', '(("a", 1),)       # dict(self.FIELD) where it is read'),
    set: ("frozenset", "{1, 2}", "frozenset({1, 2})"),
    tuple: ("tuple", "(1, [2, 3])", "(1, (2, 3))       # its items hashable too"),
}
_OTHER_FORM = ("...", "an object without __hash__",
               "a tuple, a frozenset, or a @dataclasses.dataclass(frozen=True) instance")

ARRAY_IN_STATIC = """\
Static field {cls}.{field} holds an array ({shape} {dtype}){at}. Arrays in static fields are \
hashed by identity, recompile every jit call and are invisible to grad and optimizers.

    wrong:  {field}: {annotation} = ft.field(static=True)
    right:  {field}: {annotation} = ft.field(no_derivative=True)   # carried, not trained
       or:  {field}: {annotation}                                   # a trained parameter
"""

MODULE_IN_STATIC = """\
Static field {cls}.{field} holds a {type} with {count} array leaves{at}. A static field is \
part of the tree definition: its arrays would be invisible to grad and optimizers (never \
trained) and every new instance would recompile jitted functions.

    wrong:  {field}: {annotation} = ft.field(static=True)
    right:  {field}: {annotation}                          # a submodule is a parameter field
"""

MISSING_FIELDS = """\
{cls}.__init__ did not set field(s) {names}. Every field must be assigned in __init__:

    def __init__(self, ...):
        self.{first} = ...
"""


UNKNOWN_FIELD = "{cls} has no field {name!r}; its fields are {fields}."

class FrozenModuleError(dataclasses.FrozenInstanceError):
    """Raised when assigning to a field of a constructed :class:`Module`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Linear(ft.Module):
      ...     w: jnp.ndarray
      >>> try:
      ...     Linear(jnp.ones(2)).w = jnp.zeros(2)
      ... except ft.FrozenModuleError as e:
      ...     print(type(e).__name__)
      FrozenModuleError
    """


class DifferentiationWarning(UserWarning):
    """Root of functree's differentiation diagnostics (filter it to silence them all).

    Example:
      >>> import functree as ft, jax.numpy as jnp, warnings
      >>> issubclass(ft.ZeroDerivativeWarning, ft.DifferentiationWarning)
      True
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore", ft.DifferentiationWarning)  # every diagnostic
      ...     ft.gradient(lambda x: jnp.sqrt(3.0), at=jnp.ones(2))
      Array([0., 0.], dtype=float32)
    """


class NonDifferentiableFieldWarning(DifferentiationWarning):
    """A parameter field whose type or value can never carry a derivative.

    Example:
      >>> import functree as ft, warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     class Named(ft.Module):
      ...         name: str                   # right: ft.field(static=True)
      >>> [type(w.message).__name__ for w in caught]
      ['NonDifferentiableFieldWarning']
    """


def check_static(cls: type, name: str, value: Any) -> None:
    """Refuse a static field's value that holds arrays (a module with leaves, an array), itself
    or in a tuple, list or dict of it: a tuple of layers hashes (by the layers' identity), so
    only this check keeps their weights from going untrained."""
    found = _held_arrays(value, name)
    if found is not None:
        at, held = found
        where = "" if at == name else f" at {at}"
        annotation = type(value).__name__ if where else None
        if isinstance(held, Module):
            raise TypeError(MODULE_IN_STATIC.format(
                cls=cls.__name__, field=name, type=type(held).__name__, count=len(jax.tree.leaves(held)),
                at=where, annotation=annotation or type(held).__name__))
        raise TypeError(ARRAY_IN_STATIC.format(
            cls=cls.__name__, field=name, shape=tuple(held.shape), dtype=held.dtype, at=where,
            annotation=annotation or "jax.Array"))
    try:
        hash(value)
    except TypeError as e:
        right_type, wrong, right = next(
            (form for kind, form in _HASHABLE_FORMS.items() if isinstance(value, kind)), _OTHER_FORM)
        raise TypeError(UNHASHABLE_STATIC.format(
            cls=cls.__name__, field=name, type=type(value).__name__, error=e, wrong=wrong,
            right_type=right_type, right=right.replace("FIELD", name))) from None


# Values a static container holds that hold no array: skipped at C speed (a vocabulary tuple).
_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})


def _held_arrays(value: Any, at: str) -> tuple[str, Any] | None:
    """``(where, item)`` of the first array or module with leaves in ``value`` (``at``:
    its name), looking through tuples, lists and dicts; None if it holds none."""
    if isinstance(value, Module):
        return (at, value) if jax.tree.leaves(value) else None
    if is_array_value(value):
        return at, value
    if isinstance(value, (tuple, list)):
        items: Any = enumerate(value)
    elif type(value) is dict:
        items = value.items()
    else:
        return None
    if _PLAIN.issuperset(map(type, value.values() if type(value) is dict else value)):
        return None
    for key, item in items:
        if type(item) not in _PLAIN:
            found = _held_arrays(item, f"{at}[{key!r}]")
            if found is not None:
                return found
    return None


def _non_differentiable_type_name(value: Any) -> str | None:
    """Name of value's type when a parameter field can never differentiate it."""
    if isinstance(value, (bool, int, str)) and not isinstance(value, float):
        return type(value).__name__
    if callable(value) and not isinstance(value, (Module, jax.Array)):
        # A callable pytree with array leaves (an Equinox module) is a submodule.
        if any(is_array_value(leaf) for leaf in jax.tree.leaves(value)):
            return None
        return "callable"
    return None


_ANNOTATION_TYPES = {bool: "bool", int: "int", str: "str"}


def _frozen(module: Any, name: str) -> FrozenModuleError:
    """The error for assigning (or deleting) ``name`` on a constructed module: a field's shows
    the functional update; another name's (an attribute NNX or torch would keep) says it is
    no field, since ``model.replace(name=...)`` would fail too."""
    cls = type(module)
    if name in cls.__ft_field_set__:
        return FrozenModuleError(FROZEN_MESSAGE.format(field=name, cls=cls.__name__))
    fields = ", ".join(f.name for f in dataclasses.fields(cls)) or "none"
    return FrozenModuleError(NOT_A_FIELD.format(name=name, cls=cls.__name__, fields=fields))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that lands a warning on the user's line: the first frame
    outside this module (the class statement, or the constructor call)."""
    frame, level = inspect.currentframe(), 1
    frame = frame.f_back if frame is not None else None  # the function that warns
    while frame is not None and frame.f_code.co_filename in (__file__, GENERATED_INIT):
        frame, level = frame.f_back, level + 1
    return level


def _warn_annotation(cls: type, f: dataclasses.Field) -> None:
    """Swift's synthesis warning, at class definition: a non-differentiable parameter."""
    ann = f.type
    if isinstance(ann, str):
        names = {"bool": "bool", "int": "int", "str": "str"}
        type_name = names.get(ann)
        if ann.startswith(("Callable", "typing.Callable", "collections.abc.Callable")):
            type_name = "Callable"
    else:
        type_name = _ANNOTATION_TYPES.get(ann)
        if typing.get_origin(ann) is Callable or ann is Callable:
            type_name = "Callable"
    if type_name is not None:
        warnings.warn(
            non_differentiable_field(cls.__name__, f.name, "annotation", type_name),
            NonDifferentiableFieldWarning,
            stacklevel=_user_stacklevel(),
        )


class Module:
    """Base class of functree models: a frozen dataclass and a JAX pytree.

    Subclasses declare annotated fields; each is a parameter unless marked with
    :func:`field`. ``__init__`` may be written as for a normal class (assigning
    ``self.x = ...``; wrong arguments raise ``TypeError`` as usual); without one, a
    dataclass-style ``__init__`` takes the fields positionally or by name. After
    construction the instance is immutable and :meth:`replace` returns modified copies.
    JAX rebuilds instances (jit outputs, ``tree_map``) without calling ``__init__``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from collections.abc import Callable
      >>> class Dense(ft.Module):
      ...     weight: jax.Array
      ...     bias: jax.Array
      ...     activation: Callable = ft.field(static=True, default=jax.nn.relu)
      ...     def __call__(self, x):
      ...         return self.activation(x @ self.weight + self.bias)
      >>> d = Dense(jnp.ones((2, 4)), jnp.zeros(4))
      >>> d
      Dense(weight=f32[2,4], bias=f32[4], activation=relu)
      >>> d(jnp.ones((1, 2))).shape
      (1, 4)
      >>> jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(d)[0][0][0])
      '.weight'
    """

    # Filled per subclass by __init_subclass__; read on hot paths, so plain attributes.
    __ft_fields__: ClassVar[tuple[str, ...]] = ()
    __ft_field_set__: ClassVar[frozenset[str]] = frozenset()
    __ft_kinds__: ClassVar[dict[str, str]] = {}
    __ft_static__: ClassVar[tuple[str, ...]] = ()
    __ft_no_derivative__: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        annotations = inspect.get_annotations(cls)
        refuse_kw_only_marker(cls, annotations)
        refuse_init_vars(cls, annotations)
        dataclasses.dataclass(init=False, repr=False, eq=False)(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        cls.__ft_fields__ = tuple(f.name for f in fields)
        refuse_hidden_fields(cls, cls.__ft_fields__, _MODULE_METHODS)
        cls.__ft_field_set__ = frozenset(cls.__ft_fields__)
        cls.__ft_kinds__ = {f.name: field_kind(f) for f in fields}
        cls.__ft_static__ = tuple(n for n, k in cls.__ft_kinds__.items() if k == STATIC)
        cls.__ft_no_derivative__ = tuple(
            n for n, k in cls.__ft_kinds__.items() if k == NO_DERIVATIVE
        )
        for f in fields:
            if field_kind(f) == STATIC and not is_missing(f.default):
                check_static(cls, f.name, f.default)
            if field_kind(f) == PARAMETER and f.name in annotations:
                _warn_annotation(cls, f)
        _install_init(cls)
        label_calls(cls)  # optax calls a label tree shaped like the model
        flatten, flatten_with_keys, unflatten = pytree_functions(cls)
        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)

    def __setattr__(self, name: str, value: Any) -> None:
        if _BUILDING in self.__dict__:
            if name not in type(self).__ft_field_set__:
                raise not_a_field(self, name, value, Module)
            self.__dict__[name] = value
            return
        raise _frozen(self, name)

    if not typing.TYPE_CHECKING:  # hidden from type checkers: `model.weigth` stays an error there

        def __getattr__(self, name: str) -> Any:
            # Only for a name normal lookup did not find: another library's method (model.apply,
            # model.eval) names functree's equivalent (functree/_foreign_methods.py). A property
            # whose own code raised AttributeError lands here too: run it again to raise its error.
            if any(name in k.__dict__ for k in type(self).__mro__):
                return object.__getattribute__(self, name)
            raise missing_attribute(self, name)

    def __delattr__(self, name: str) -> None:
        raise _frozen(self, name)

    def __eq__(self, other: object) -> bool:
        """Identity, except for modules without leaves (a module used as a static value: an
        activation with a slope): those of one class with equal fields are equal, so two
        models built alike have one tree definition (jit traces once, a state fits both)."""
        if self is other:
            return True
        if type(other) is not type(self) or not _leafless(self) or not _leafless(other):
            return False
        d, e = self.__dict__, other.__dict__  # type: ignore[union-attr]
        return all(d.get(n) == e.get(n) for n in type(self).__ft_fields__)

    def __hash__(self) -> int:
        if not _leafless(self):
            return object.__hash__(self)
        try:
            return hash((type(self), tuple(self.__dict__.get(n) for n in type(self).__ft_fields__)))
        except TypeError:  # a list of Nones, say: the class alone (equal modules still hash alike)
            return hash(type(self))

    def __getstate__(self) -> dict[str, Any]:
        """pickle carries the fields only (not cached properties); builtin functions
        (``jax.nn.relu``, a ``custom_jvp``) as their public names (:mod:`functree._functions`)."""
        d = self.__dict__
        return {n: by_name(d[n]) for n in type(self).__ft_fields__ if n in d}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The pickled fields; a static field the class gained since the pickle was written
        at its default (:func:`added_static`), as a checkpoint reads it."""
        defaults = added_static(type(self), state)
        self.__dict__.update({**defaults, **state})
        derive_added(self, defaults)

    def __copy__(self) -> Self:
        d = self.__dict__
        return from_fields(type(self), {n: d[n] for n in type(self).__ft_fields__ if n in d})

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """Data fields deep-copied; static fields (functions, classes, hashable
        configuration) and builtin functions anywhere kept by identity, so the copy's tree
        definition equals the original's."""
        cls = type(self)
        copied = object.__new__(cls)
        memo[id(self)] = copied  # a field that holds this module gets the copy
        if id(_functions.ByName) not in memo:
            memo.update({id(f): f for f in _functions.builtin_functions().values()})
            memo[id(_functions.ByName)] = _functions.ByName
        d, kinds = self.__dict__, cls.__ft_kinds__
        copied.__dict__.update({
            n: d[n] if kinds[n] == STATIC else copy.deepcopy(d[n], memo) for n in cls.__ft_fields__ if n in d
        })
        return copied

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields replaced: ``model.replace(weight=w)``.

        The copy holds the fields only: values cached on ``self`` (a
        ``functools.cached_property``) are not carried over, so they are computed
        afresh from the new fields.

        ``replace`` is a copy, not a construction: neither ``__init__`` nor the class's
        ``__post_init__`` runs (JAX and functree rebuild modules this way, with parameter
        views, gradients and label trees at the leaves), so a field derived there is not
        recomputed and its checks do not run. Derive a value in a property instead of a
        field, or construct anew (``dataclasses.replace(model, w=...)`` runs the
        generated ``__init__`` and ``__post_init__``).

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp, dataclasses
          >>> class P(ft.Module):
          ...     w: jnp.ndarray
          >>> P(jnp.zeros(2)).replace(w=jnp.ones(2)).w
          Array([1., 1.], dtype=float32)
          >>> class Wide(ft.Module):
          ...     w: jax.Array
          ...     n_out: int = ft.field(static=True, default=0)
          ...     def __post_init__(self):
          ...         self.n_out = self.w.shape[1]            # derived: stale after replace
          ...     @property
          ...     def width(self):
          ...         return self.w.shape[1]                  # derived: always current
          >>> m = Wide(jnp.ones((3, 4))).replace(w=jnp.ones((3, 5)))
          >>> m.n_out, m.width, dataclasses.replace(m, w=jnp.ones((3, 5))).n_out
          (4, 5, 5)
        """
        cls = type(self)
        for name, value in changes.items():
            if name not in cls.__ft_field_set__:  # type: ignore[attr-defined]
                raise AttributeError(
                    UNKNOWN_FIELD.format(
                        cls=cls.__name__, name=name, fields=list(cls.__ft_fields__)  # type: ignore[attr-defined]
                    )
                )
            if cls.__ft_kinds__[name] == STATIC:  # type: ignore[attr-defined]
                check_static(cls, name, value)
            else:
                check_dict_keys(cls, name, value)
        d = self.__dict__
        values = {n: d[n] for n in cls.__ft_fields__ if n in d}  # type: ignore[attr-defined]
        values.update(changes)
        return from_fields(cls, values)

    def __repr__(self) -> str:
        return module_repr(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))

    def _repr_html_(self) -> str:
        return module_html(self)


_M = TypeVar("_M", bound=Module)

# ft.Module's own methods (replace, __eq__, _repr_html_ ...): a field of one of these names
# would hide it on the instance, where functree and notebooks call it.
_MODULE_METHODS = frozenset(
    n for n, v in vars(Module).items() if callable(v) or isinstance(v, (classmethod, staticmethod, property))
)


def from_fields(cls: type[_M], values: dict[str, Any]) -> _M:
    """An instance of ``cls`` holding exactly ``values`` (field name -> value), built
    without ``__init__`` and without checks: the one way functree copies a Module.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> from functree._module import from_fields
      >>> class P(ft.Module):
      ...     w: jnp.ndarray
      ...     def __init__(self, n: int):
      ...         self.w = jnp.zeros(n)
      >>> from_fields(P, {"w": jnp.ones(2)}).w
      Array([1., 1.], dtype=float32)
    """
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def added_static(cls: type, given: Any) -> dict[str, Any]:
    """The defaults of the fields ``cls`` gained after files and pickles were written
    without them (named in its ``__ft_added_static__``: ``LoraDense``'s ``saved_modules``,
    static, and ``member_scale``, a data field that is None by default) that ``given`` (the
    names a file holds) lacks. Any other missing field is not filled.

    Example:
      >>> import functree as ft
      >>> added_static(ft.nn.LoraDense, {"alpha": 4.0})
      {'member_scale': None, 'saved_modules': ()}
      >>> added_static(ft.nn.Dense, {})
      {}
    """
    added = getattr(cls, "__ft_added_static__", ())
    return {f.name: f.default for f in dataclasses.fields(cls)  # pyright: ignore[reportArgumentType]
            if f.name in added and f.name not in given and not is_missing(f.default)}


def derive_added(obj: Any, filled: Any) -> None:
    """Replace the defaults :func:`added_static` gave ``obj`` (the ``filled`` names) by what
    its class derives from the other fields, where it can (``__ft_derive_added__(obj,
    names) -> {name: value}``: a Stack's member ranks from its leaves), so a model read from
    an older file has the tree structure of one built now."""
    derive = getattr(type(obj), "__ft_derive_added__", None)
    if derive is not None and filled:
        obj.__dict__.update(derive(obj, frozenset(filled)))


def by_name(value: Any) -> Any:
    """``value`` with each builtin function in it (also inside lists, tuples and dicts) as a
    :class:`functree._functions.ByName`; submodules are left to their own ``__getstate__``."""
    name = _functions.builtin_name(value)
    if name is not None:
        return _functions.ByName(name)
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(by_name(v) for v in value)
    return {k: by_name(v) for k, v in value.items()} if kind is dict else value


def _install_init(cls: type) -> None:
    """Give ``cls`` an ``__init__`` that freezes and validates after the outermost call.

    The class's own ``__init__`` is wrapped (behaving exactly as written: unknown
    arguments raise ``TypeError``); an ``__init__`` inherited from a Module base is
    already wrapped and kept; a class without one (or inheriting a generated one) gets a
    dataclass-style ``__init__`` over its fields.
    """
    own = cls.__dict__.get("__init__")
    if own is not None:
        if getattr(own, _INIT_KIND, None) is None:
            cls.__init__ = _constructor(own)  # type: ignore[misc]
        return
    inherited = cls.__init__  # type: ignore[misc]
    kind = getattr(inherited, _INIT_KIND, None)
    if kind == "user":
        return
    if inherited is object.__init__ or kind == "generated":
        cls.__init__ = _dataclass_init(cls)  # type: ignore[misc]
    else:  # a non-Module base's __init__ (a mixin)
        cls.__init__ = _constructor(inherited)  # type: ignore[misc]


def _constructor(init: Callable[..., None], kind: str = "user") -> Callable[..., None]:
    """Wrap ``init``: the outermost call (a construction) allows field assignment while
    it runs, then fills defaults, checks every field is set, validates and freezes.
    A nested call (a subclass's ``super().__init__(...)``) only runs ``init``."""

    @functools.wraps(init)
    def __init__(self: Module, /, *args: Any, **kwargs: Any) -> None:
        d = self.__dict__
        if _BUILDING in d:
            init(self, *args, **kwargs)
            return
        d[_BUILDING] = True
        try:
            init(self, *args, **kwargs)
        except TypeError:
            # Only when the signature itself refuses a keyword: another library's name
            # (torch's bias=, eps=, p=) named with functree's (nothing runs on success).
            better = foreign_argument(type(self), init, args, kwargs)
            if better is None:
                raise
            raise better from None
        finally:
            self.__dict__.pop(_BUILDING, None)
        _finish(self)

    setattr(__init__, _INIT_KIND, kind)
    return __init__


def _dataclass_init(cls: type) -> Callable[..., None]:
    """A dataclass-style ``__init__``: positional or keyword arguments bound to fields.

    It is generated with one parameter per field (``def __init__(self, weight=<required>,
    bias=<required>, *more, **named)``), annotated with the fields' annotations, so that
    beartype's decorator and import hook and jaxtyping check the arguments as they do a
    dataclass's; binding errors are functree's (a missing or unknown field named).
    """
    names: tuple[str, ...] = cls.__ft_fields__  # type: ignore[attr-defined]
    hints = _field_hints(cls)
    if all(n.isidentifier() and not keyword.iskeyword(n) and n != "self" and not n.startswith("_ft_")
           for n in names):
        namespace = {"_ft_run": functools.partial(_run_init, cls), "_ft_R": _REQUIRED}
        params = "".join(f"{n}=_ft_R, " for n in names)
        values = "".join(f"{n}, " for n in names)
        source = (f"def __init__(self, {params}*_ft_more, **_ft_named):\n"
                  f"    _ft_run(self, ({values}), _ft_more, _ft_named)\n")
        exec(compile(source, GENERATED_INIT, "exec"), namespace)  # field names only (identifiers), checked above
        __init__ = namespace["__init__"]
    else:  # a field name no parameter can have: arguments bound by name at run time
        def __init__(self: Module, /, *args: Any, **kwargs: Any) -> None:
            _run_init(cls, self, (), args, kwargs)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    # The fields' annotations, as a dataclass's __init__ has them: beartype (its decorator
    # and import hook) and jaxtyping check the arguments against them.
    __init__.__annotations__ = {**hints, "return": None}
    signature = _fields_signature(cls, hints)
    if signature is not None:
        __init__.__signature__ = signature  # type: ignore[attr-defined]
    setattr(__init__, _INIT_KIND, "generated")
    return __init__


GENERATED_INIT = "<functree: generated __init__>"
"""The file name of generated ``__init__`` functions (warnings skip their frames)."""


def _leafless(module: Module, seen: set[int] | None = None) -> bool:
    """Whether ``module`` holds no leaf: only static values, and Nones, leafless modules and
    containers of them in its other fields. Read field by field, never flattened (a module
    that holds itself is no static value: False, not a recursion)."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return False
    seen.add(id(module))
    d = module.__dict__
    return all(kind == STATIC or _holds_no_leaf(d.get(n), seen) for n, kind in type(module).__ft_kinds__.items())


def _holds_no_leaf(value: Any, seen: set[int]) -> bool:
    if value is None:
        return True
    if isinstance(value, Module):
        return _leafless(value, seen)
    if type(value) in (list, tuple):
        return all(_holds_no_leaf(v, seen) for v in value)
    if type(value) is dict:
        return all(_holds_no_leaf(v, seen) for v in value.values())
    return False


class _Required:
    """The default of every parameter of a generated ``__init__``: not given.

    One object, compared by type: cloudpickle rebuilds a ``__main__`` class's ``__init__``
    by value, defaults included, and a copy of the marker must still read as "not given"
    (it pickles as a reference to the one object, and the test is ``isinstance``)."""

    def __repr__(self) -> str:
        return "<required>"

    def __reduce__(self) -> str:
        return "_REQUIRED"  # the module's one object, by name


_REQUIRED = _Required()


def _run_init(cls: type, self: Module, given: tuple, more: tuple, named: dict[str, Any]) -> None:
    """The generated ``__init__``'s body: ``given`` are the field parameters (``_REQUIRED``
    where not passed), ``more`` and ``named`` the extra positional and keyword arguments."""
    names: tuple[str, ...] = cls.__ft_fields__  # type: ignore[attr-defined]
    values = {n: v for n, v in zip(names, given) if not isinstance(v, _Required)}
    if more:
        if given:
            raise TypeError(f"{cls.__name__}() takes {len(names)} field(s) {list(names)}, "
                            f"got {len(names) + len(more)} positional")
        values = _bind_fields(cls, more, named)  # the fallback form: all arguments here
    elif named:
        values = _bind_fields(cls, (), {**values, **named})
    else:
        values = _bind_fields(cls, (), values)
    d = self.__dict__
    if _BUILDING in d:  # a subclass's super().__init__(...)
        d.update(values)
        return
    d[_BUILDING] = True
    try:
        d.update(values)
    finally:
        d.pop(_BUILDING, None)
    _finish(self)


def _field_hints(cls: type) -> dict[str, Any]:
    """The fields' annotations as objects (strings evaluated in the class's module; one
    that does not resolve yet, such as the class itself, is left out: nothing checks it).
    ``ClassVar`` and static fields included, as a dataclass's ``__init__`` has them."""
    module = sys.modules.get(cls.__module__)
    namespace = dict(vars(module)) if module is not None else {}
    hints: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = f.type
        if isinstance(kind, str):
            owner = next((c for c in cls.__mro__ if f.name in inspect.get_annotations(c)), cls)
            owner_module = sys.modules.get(owner.__module__)
            scope = dict(vars(owner_module)) if owner_module is not None else namespace
            scope.setdefault(owner.__name__, owner)
            try:  # the class's own annotation, in its module: what typing.get_type_hints does
                kind = eval(kind, scope)
            except Exception:
                continue
        hints[f.name] = kind
    return hints


def _fields_signature(cls: type, hints: dict[str, Any] | None = None) -> inspect.Signature | None:
    """``(self, weight: Array, bias: Array, activation=relu) -> None``: the generated
    ``__init__``'s signature, annotated with ``hints`` (field name -> type). A field
    without a default after one with a default (a subclass's new field) is shown
    keyword-only; None where no signature fits (a field named ``self``)."""
    p = inspect.Parameter
    hints = hints or {}
    params, kind = [p("self", p.POSITIONAL_OR_KEYWORD)], p.POSITIONAL_OR_KEYWORD
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        default = f.default
        if is_missing(default) and not is_missing(f.default_factory):
            default = _Factory(f.default_factory)  # pyright: ignore[reportArgumentType]
        annotation = hints.get(f.name, p.empty)
        if is_missing(default):
            if params[-1].default is not p.empty:
                kind = p.KEYWORD_ONLY
            params.append(p(f.name, kind, annotation=annotation))
        else:
            params.append(p(f.name, kind, default=default, annotation=annotation))
    try:
        return inspect.Signature(params, return_annotation=None)
    except ValueError:
        return None


class _Factory:
    """Shown as the default of a field with a ``default_factory``."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory

    def __repr__(self) -> str:
        return f"<factory {getattr(self.factory, '__name__', self.factory)}>"


def _finish(self: Module) -> None:
    """After the outermost ``__init__``: fill defaults, require every field, validate."""
    cls = type(self)
    d = self.__dict__
    missing = [n for n in cls.__ft_fields__ if n not in d and not _fill_default(self, n)]
    if missing:
        raise TypeError(MISSING_FIELDS.format(cls=cls.__name__, names=missing, first=missing[0]))
    post_init = getattr(cls, "__post_init__", None)
    if post_init is not None:  # as a dataclass's: its checks raise, its fields may still be set
        d[_BUILDING] = True
        try:
            post_init(self)
        finally:
            d.pop(_BUILDING, None)
    _validate(self)


def _fill_default(self: Module, name: str) -> bool:
    f = type(self).__dataclass_fields__[name]  # type: ignore[attr-defined]
    if not is_missing(f.default):
        self.__dict__[name] = f.default
    elif not is_missing(f.default_factory):
        self.__dict__[name] = f.default_factory()
    else:
        return False
    return True


def _bind_fields(cls: type, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Dataclass-style binding of positional and keyword arguments to fields."""
    names: tuple[str, ...] = cls.__ft_fields__  # type: ignore[attr-defined]
    if len(args) > len(names):
        raise TypeError(f"{cls.__name__}() takes {len(names)} field(s) {list(names)}, got {len(args)} positional")
    values = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in cls.__ft_field_set__:  # type: ignore[attr-defined]
            raise TypeError(UNKNOWN_FIELD.format(cls=cls.__name__, name=name, fields=list(names)))
        if name in values:
            raise TypeError(f"{cls.__name__}() got multiple values for field {name!r}")
        values[name] = value
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    for name in names:
        if name in values:
            continue
        f = fields[name]
        if not is_missing(f.default):
            values[name] = f.default
        elif not is_missing(f.default_factory):
            values[name] = f.default_factory()
        else:
            missing = [n for n in names if n not in values and is_missing(fields[n].default) and is_missing(fields[n].default_factory)]
            raise TypeError(f"{cls.__name__}() missing field(s) {missing}")
    return values


def _validate(self: Module) -> None:
    cls = type(self)
    for name in cls.__ft_static__:
        check_static(cls, name, self.__dict__[name])
    for name, kind in cls.__ft_kinds__.items():
        if kind != PARAMETER:
            if kind == NO_DERIVATIVE:
                check_dict_keys(cls, name, self.__dict__[name])
            continue
        value = self.__dict__[name]
        check_dict_keys(cls, name, value)
        type_name = _non_differentiable_type_name(value)
        if type_name == "int" and cls.__dataclass_fields__[name].type in ("float", float):  # type: ignore[attr-defined]
            warnings.warn(INT_FOR_FLOAT.format(cls=cls.__name__, field=name, value=value),
                          NonDifferentiableFieldWarning, stacklevel=_user_stacklevel())
        elif type_name is not None and not annotation_warned(cls, name):
            warnings.warn(
                non_differentiable_field(cls.__name__, name, "value", type_name),
                NonDifferentiableFieldWarning,
                stacklevel=_user_stacklevel(),
            )
        elif floats_only_container(value):
            warnings.warn(FLOATS_IN_CONTAINER.format(cls=cls.__name__, field=name, kind=type(value).__name__,
                                                     preview=repr(value)[:60]),
                          NonDifferentiableFieldWarning, stacklevel=_user_stacklevel())


def is_module_class(x: Any) -> bool:
    return inspect.isclass(x) and issubclass(x, Module)
