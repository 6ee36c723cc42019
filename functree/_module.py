"""Module: an immutable model whose data leaves are its parameters.

A subclass of :class:`Module` with annotated fields becomes a dataclass registered
with JAX's *native* dataclass pytree path (``jax.tree_util.register_dataclass``), so
flattening and unflattening run in C++ and ``jax.jit``, ``jax.grad``, ``jax.vmap``,
optax and orbax accept models directly.

Three kinds of field, as in Swift:

* parameters (the default): differentiable data leaves;
* ``field(no_derivative=True)``: data leaves carried and traced but never
  differentiated (Swift's ``@noDerivative var``);
* ``field(static=True)``: configuration kept in the tree definition (Swift's ``let``).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import jax
import numpy as np

__all__ = [
    "Module",
    "field",
    "FrozenModuleError",
    "NonDifferentiableFieldWarning",
    "DifferentiationWarning",
]

_KIND = "functree.kind"
PARAMETER, NO_DERIVATIVE, STATIC = "parameter", "no_derivative", "static"
_INIT_FLAG = "__ft_initializing__"
# Non-empty while a user's __init__ runs: only then can a full-keyword call be a
# subclass's super().__init__(...) rather than a construction (or JAX's unflatten).
_USER_INITS_RUNNING: list[Module] = []

FROZEN_MESSAGE = """\
Cannot assign to field {field!r} of {cls}: modules are immutable values.

    wrong:  model.{field} = value
    right:  model = model.replace({field}=value)
       or:  model = ft.set(model, ".{field}", value)
"""

UNHASHABLE_STATIC = """\
Static field {cls}.{field} holds an unhashable {type} ({error}). Static fields live in \
the tree definition, which JAX hashes and compares on every jit call.

    wrong:  {field}: list = ft.field(static=True)      # e.g. [1, 2]
    right:  {field}: tuple = ft.field(static=True)     # e.g. (1, 2)
"""

ARRAY_IN_STATIC = """\
Static field {cls}.{field} holds an array ({shape} {dtype}). Arrays in static fields are \
hashed by identity, recompile every jit call and are invisible to grad and optimizers.

    wrong:  {field}: jax.Array = ft.field(static=True)
    right:  {field}: jax.Array = ft.field(no_derivative=True)   # carried, not trained
       or:  {field}: jax.Array                                   # a trained parameter
"""

MODULE_IN_STATIC = """\
Static field {cls}.{field} holds a {type} with {count} array leaves. A static field is \
part of the tree definition: its arrays would be invisible to grad and optimizers (never \
trained) and every new instance would recompile jitted functions.

    wrong:  {field}: {type} = ft.field(static=True)
    right:  {field}: {type}                          # a submodule is a parameter field
"""

MISSING_FIELDS = """\
{cls}.__init__ did not set field(s) {names}. Every field must be assigned in __init__:

    def __init__(self, ...):
        self.{first} = ...
"""

NON_DIFFERENTIABLE_FIELD = """\
{cls}.{field} is a parameter field but its {what} is not differentiable ({type}). \
It will be carried, not trained. Say which it is:

    {field}: {type} = ft.field(static=True)          # configuration (Swift's `let`)
    {field}: {type} = ft.field(no_derivative=True)   # state (Swift's `@noDerivative var`)
"""

UNKNOWN_FIELD = "{cls} has no field {name!r}; its fields are {fields}."

NOT_A_FIELD = """\
{cls}.__init__ assigns self.{name}, which is not a declared field: it would be lost the \
first time JAX rebuilds the module (jit, grad, tree_map). Declare it in the class body:

    {name}: int = ft.field(static=True)          # configuration, e.g. a size or a flag
    {name}: jax.Array                            # a parameter
    {name}: jax.Array = ft.field(no_derivative=True)   # carried state
"""


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
    """Root of functree's differentiation diagnostics (filter it to silence them all)."""


class NonDifferentiableFieldWarning(DifferentiationWarning):
    """A parameter field whose type or value can never carry a derivative."""


_T = TypeVar("_T")


def field(
    *,
    static: bool = False,
    no_derivative: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    **metadata: Any,
) -> Any:
    """Declare a Module field of one of three kinds.

    Args:
      static: configuration kept in the tree definition (activation functions, flags,
        sizes). Must be hashable; arrays are rejected.
      no_derivative: a data leaf that is carried and traced but never differentiated
        (running statistics, a step counter, a previous weight).
      default, default_factory: as in :func:`dataclasses.field`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Scaled(ft.Module):
      ...     weight: jnp.ndarray
      ...     steps: jnp.ndarray = ft.field(no_derivative=True, default=0)
      ...     name: str = ft.field(static=True, default="scaled")
      >>> Scaled(jnp.ones(2)).name
      'scaled'
    """
    if static and no_derivative:
        raise ValueError("A field is either static=True or no_derivative=True, not both.")
    kind = STATIC if static else NO_DERIVATIVE if no_derivative else PARAMETER
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={**metadata, _KIND: kind}
    )


def field_kind(f: dataclasses.Field) -> str:
    """The kind ('parameter', 'no_derivative', 'static') of a dataclass field."""
    return f.metadata.get(_KIND, PARAMETER)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _check_static(cls: type, name: str, value: Any) -> None:
    if isinstance(value, Module):
        count = len(jax.tree.leaves(value))
        if count:
            raise TypeError(
                MODULE_IN_STATIC.format(
                    cls=cls.__name__, field=name, type=type(value).__name__, count=count
                )
            )
    if _is_array(value):
        raise TypeError(
            ARRAY_IN_STATIC.format(
                cls=cls.__name__, field=name, shape=tuple(getattr(value, "shape", ())),
                dtype=getattr(value, "dtype", None),
            )
        )
    try:
        hash(value)
    except TypeError as e:
        raise TypeError(
            UNHASHABLE_STATIC.format(
                cls=cls.__name__, field=name, type=type(value).__name__, error=e
            )
        ) from None


def _non_differentiable_type_name(value: Any) -> str | None:
    """Name of value's type when a parameter field can never differentiate it."""
    if isinstance(value, (bool, int, str)) and not isinstance(value, float):
        return type(value).__name__
    if callable(value) and not isinstance(value, (Module, jax.Array)):
        return "callable"
    return None


_ANNOTATION_TYPES = {bool: "bool", int: "int", str: "str"}


def _user_stacklevel() -> int:
    """The ``stacklevel`` that lands a warning on the user's line: the first frame
    outside this module (the class statement, or the constructor call)."""
    frame, level = inspect.currentframe(), 1
    frame = frame.f_back if frame is not None else None  # the function that warns
    while frame is not None and frame.f_code.co_filename == __file__:
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
            NON_DIFFERENTIABLE_FIELD.format(
                cls=cls.__name__, field=f.name, what="annotation", type=type_name
            ),
            NonDifferentiableFieldWarning,
            stacklevel=_user_stacklevel(),
        )


class Module:
    """Base class of functree models: a frozen dataclass and a JAX pytree.

    Subclasses declare annotated fields; each is a parameter unless marked with
    :func:`field`. ``__init__`` may be written as for a normal class (assigning
    ``self.x = ...``); after construction the instance is immutable and
    :meth:`replace` returns modified copies.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
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
    """

    # Filled per subclass by __init_subclass__; read on hot paths, so plain attributes.
    __ft_fields__: ClassVar[tuple[str, ...]] = ()
    __ft_field_set__: ClassVar[frozenset[str]] = frozenset()
    __ft_kinds__: ClassVar[dict[str, str]] = {}
    __ft_static__: ClassVar[tuple[str, ...]] = ()
    __ft_no_derivative__: ClassVar[tuple[str, ...]] = ()
    __ft_user_init__: ClassVar[Callable[..., None] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        user_init = cls.__dict__.get("__init__")
        if user_init is not None:
            # Keep the user's __init__ for user calls; JAX's C++ unflatten calls
            # cls(**fields), which must take the fast field-setting path instead.
            cls.__ft_user_init__ = user_init
            del cls.__init__  # type: ignore[misc]
        dataclasses.dataclass(init=False, repr=False, eq=False)(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        cls.__ft_fields__ = tuple(f.name for f in fields)
        cls.__ft_field_set__ = frozenset(cls.__ft_fields__)
        cls.__ft_kinds__ = {f.name: field_kind(f) for f in fields}
        cls.__ft_static__ = tuple(n for n, k in cls.__ft_kinds__.items() if k == STATIC)
        cls.__ft_no_derivative__ = tuple(
            n for n, k in cls.__ft_kinds__.items() if k == NO_DERIVATIVE
        )
        for f in fields:
            if field_kind(f) == STATIC and f.default is not dataclasses.MISSING:
                _check_static(cls, f.name, f.default)
            if field_kind(f) == PARAMETER and f.name in inspect.get_annotations(cls):
                _warn_annotation(cls, f)
        cls.__init__ = _make_init(cls)  # type: ignore[method-assign]
        jax.tree_util.register_dataclass(
            cls,
            data_fields=[n for n in cls.__ft_fields__ if n not in cls.__ft_static__],
            meta_fields=list(cls.__ft_static__),
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if _INIT_FLAG in self.__dict__:
            if name not in type(self).__ft_field_set__:
                raise AttributeError(NOT_A_FIELD.format(cls=type(self).__name__, name=name))
            object.__setattr__(self, name, value)
            return
        raise FrozenModuleError(FROZEN_MESSAGE.format(field=name, cls=type(self).__name__))

    def __delattr__(self, name: str) -> None:
        raise FrozenModuleError(FROZEN_MESSAGE.format(field=name, cls=type(self).__name__))

    def replace(self: _T, **changes: Any) -> _T:
        """A copy with some fields replaced: ``model.replace(weight=w)``.

        Example:
          >>> import functree as ft, jax.numpy as jnp
          >>> class P(ft.Module):
          ...     w: jnp.ndarray
          >>> P(jnp.zeros(2)).replace(w=jnp.ones(2)).w
          Array([1., 1.], dtype=float32)
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
                _check_static(cls, name, value)
        new = object.__new__(cls)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def __repr__(self) -> str:
        from functree._display import module_repr

        return module_repr(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))

    def _repr_html_(self) -> str:
        from functree._display import module_html

        return module_html(self)


def _make_init(cls: type) -> Callable[..., None]:
    """The class's ``__init__``: JAX's unflatten calls ``cls(**fields)`` on every jit
    output, so that exact call takes the cheapest path there is (a closure holding the
    field set, the kwargs dict installed as the instance dict, no copy)."""
    fields = cls.__ft_field_set__  # type: ignore[attr-defined]
    statics = cls.__ft_static__  # type: ignore[attr-defined]
    set_dict = object.__setattr__

    running = _USER_INITS_RUNNING

    # While a user's __init__ runs, a non-empty instance dict means a subclass's __init__
    # called super().__init__(...): that must not replace the dict (slow path). Reading
    # self.__dict__ would create one, so it is looked at only then.
    def __init__(self: Module, *args: Any, **kwargs: Any) -> None:
        if args or kwargs.keys() != fields or (running and self.__dict__):
            _construct(self, cls, args, kwargs)
            return
        set_dict(self, "__dict__", kwargs)

    def __init_with_statics__(self: Module, *args: Any, **kwargs: Any) -> None:
        if args or kwargs.keys() != fields or (running and self.__dict__):
            _construct(self, cls, args, kwargs)
            return
        # A full keyword construction is a construction too: static values must hash.
        # (Unhashable values, arrays included, raise TypeError from hash.)
        try:
            for name in statics:
                hash(kwargs[name])
        except TypeError:
            for name in statics:
                _check_static(cls, name, kwargs[name])
        set_dict(self, "__dict__", kwargs)

    if statics:
        __init__ = __init_with_statics__
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _construct(self: Module, owner: type, args: tuple, kwargs: dict) -> None:
    """A user's construction: their ``__init__``, or dataclass-style field binding.

    ``owner`` is the class whose ``__init__`` runs: ``type(self)``, or a base class when a
    subclass's ``__init__`` calls ``super().__init__(...)``, which then only sets fields
    (the outermost call checks missing fields and validates).
    """
    if _INIT_FLAG in self.__dict__:
        base_init = owner.__ft_user_init__  # type: ignore[attr-defined]
        if base_init is not None:
            base_init(self, *args, **kwargs)
        else:
            self.__dict__.update(_bind_fields(owner, args, kwargs))
        return
    cls = type(self)
    user_init = cls.__ft_user_init__
    if user_init is not None:
        self.__dict__[_INIT_FLAG] = True
        _USER_INITS_RUNNING.append(self)
        try:
            user_init(self, *args, **kwargs)
        finally:
            _USER_INITS_RUNNING.pop()
            del self.__dict__[_INIT_FLAG]
        missing = [n for n in cls.__ft_fields__ if n not in self.__dict__]
        missing = [n for n in missing if not _fill_default(self, n)]
        if missing:
            raise TypeError(MISSING_FIELDS.format(cls=cls.__name__, names=missing, first=missing[0]))
    else:
        self.__dict__.update(_bind_fields(cls, args, kwargs))
    _validate(self)


def _fill_default(self: Module, name: str) -> bool:
    f = type(self).__dataclass_fields__[name]  # type: ignore[attr-defined]
    if f.default is not dataclasses.MISSING:
        self.__dict__[name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
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
        if f.default is not dataclasses.MISSING:
            values[name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[name] = f.default_factory()
        else:
            missing = [n for n in names if n not in values and fields[n].default is dataclasses.MISSING and fields[n].default_factory is dataclasses.MISSING]
            raise TypeError(f"{cls.__name__}() missing field(s) {missing}")
    return values


def _validate(self: Module) -> None:
    cls = type(self)
    for name in cls.__ft_static__:
        _check_static(cls, name, self.__dict__[name])
    for name, kind in cls.__ft_kinds__.items():
        if kind != PARAMETER:
            continue
        type_name = _non_differentiable_type_name(self.__dict__[name])
        if type_name is not None and not _annotation_warned(cls, name):
            warnings.warn(
                NON_DIFFERENTIABLE_FIELD.format(
                    cls=cls.__name__, field=name, what="value", type=type_name
                ),
                NonDifferentiableFieldWarning,
                stacklevel=_user_stacklevel(),
            )


def _annotation_warned(cls: type, name: str) -> bool:
    ann = cls.__dataclass_fields__[name].type  # type: ignore[attr-defined]
    return ann in ("bool", "int", "str", bool, int, str) or "Callable" in str(ann)


def is_module_class(x: Any) -> bool:
    return inspect.isclass(x) and issubclass(x, Module)
