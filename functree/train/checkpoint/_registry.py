"""The names a checkpoint may use for types and static functions: an explicit registry.

A checkpoint is data. Loading one never imports, calls or constructs anything *because
the checkpoint names it*: a stored name is only looked up in this registry (functree's
own types, the optax states its optimizers use, ``jax.nn`` and functree activations,
elementwise ``jax.numpy`` functions, and what the user registered with :func:`register`)
or among the :class:`functree.Module` subclasses already defined in the running process.

Names are public and stable (``functree.nn.Dense``, ``optax.ScaleByAdamState``), never a
private module path, so moving a class between private modules does not break old
checkpoints. Names written by format 1 (``functree.nn._linear:Dense``) are translated
once, by :func:`functree.train.migrate`, through :data:`ALIASES` and the private paths
of registered objects; reading never accepts them.

To add a type functree's optimizers put into their states, add its name to
:data:`FUNCTREE_TYPES` below.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Iterator
from typing import Any

from functree._functions import builtin_functions
from functree._module import Module
from functree._tree import bound

__all__ = ["register", "type_name", "function_name", "lookup_type", "lookup_function", "bound",
           "current_definitions"]

# Old (format 1) names of objects that have since moved or been renamed: old -> public.
ALIASES: dict[str, str] = {}

# optax state classes that functree optimizers (and optax chains around them) produce.
OPTAX_STATES = (
    "AddDecayedWeightsState", "AddNoiseState", "ApplyIfFiniteState", "ClipByGlobalNormState",
    "ClipState", "EmaState", "EmptyState", "FactoredState", "InjectHyperparamsState",
    "InjectStatefulHyperparamsState", "MaskedNode", "MaskedState", "MultiStepsState",
    "MultiTransformState", "NonNegativeParamsState", "PartitionState", "ScaleByAdaDeltaState",
    "ScaleByAdamState", "ScaleByAmsgradState", "ScaleByBeliefState", "ScaleByLionState",
    "ScaleByNovogradState", "ScaleByRmsState", "ScaleByRStdDevState", "ScaleByRssState",
    "ScaleByScheduleState", "ScaleByTrustRatioState", "ScaleState", "TraceState", "LookaheadState",
    "ZeroNansState",
)

NOT_REGISTRABLE = """\
ft.train.register takes a class (a NamedTuple, a dataclass registered with JAX, a \
Module subclass or an Enum) or a function, got {given!r}.

    wrong:  ft.train.register({given!r})
    right:  ft.train.register(MyState)        # or register(my_activation){own}"""

# Added for a class: one registered with jax.tree_util by its own functions cannot be
# told apart without running them, so the message names that case too.
OWN_FLATTEN = """

A class JAX flattens with functions of its own (jax.tree_util.register_pytree_node / \
register_pytree_with_keys) needs no registration: a checkpoint never runs those \
functions, so such a tree saves as it is and loads with a template built the same way:

    right:  ft.train.load(path, template=tree)"""

NAME_TAKEN = """\
The checkpoint name {name!r} is already registered for {old!r}, another object than {new!r} \
(a re-run of the cell that defined it, the same module and qualified name, replaces it; \
this one is {new_name!r}). Checkpoints written with the registered one keep reading it; \
register this one under a name of its own, or read such a checkpoint through a template:

    wrong:  ft.train.register(obj, name={name!r})
    right:  ft.train.register(obj, name="{module}.{short}_2")
       or:  ft.train.load(path, template=model)     # a model built with the new object"""

_types: dict[str, type] = {}
_functions: dict[str, Any] = {}
_names: dict[int, str] = {}  # id(obj) -> public name (objects are kept alive above)
_builtins_loaded = False


# functree's own state types by public name: package -> class names. Looked up in the
# already-imported modules of that package (private module moves do not matter). Add a
# name here when an optimizer or layer puts a new NamedTuple or dataclass into a tree.
FUNCTREE_TYPES = {
    "functree.optim": (
        "LearningContext", "HyperState", "OptimizerState", "SkipState", "LossScaleState",
        "AdagradState", "AMSGradState", "UnitGainState", "NoiseState", "PlateauState",
        "AverageState", "SlowState", "NAdamState", "RpropState", "ASGDState", "DampenedTraceState",
        "ContextState",  # format 1's wrapper of plain optax states; ft.optim.upgrade_state reads it
    ),
    "functree.nn": ("LSTMState", "RopeScaling"),  # RopeScaling: a static record (_treespec)
    "functree.train": ("DataContext", "StepOutput"),
}


def _find(package: str, name: str) -> type | None:
    """``name`` in ``package`` or one of its already-imported private modules."""
    for module_name, module in list(sys.modules.items()):
        if module_name == package or module_name.startswith(package + "."):
            obj = getattr(module, name, None)
            if isinstance(obj, type) and obj.__module__.startswith(package):
                return obj
    return None


_packages: tuple[Any, ...] = ()  # functree and its subpackages: see register_packages


def register_packages(*packages: Any) -> None:
    """Make the public Module subclasses of ``packages`` (and the state types of
    :data:`FUNCTREE_TYPES`, defined in their private modules) builtin names.

    Called once, by ``functree/train/__init__.py`` (the package every save and load goes
    through; ``import functree`` imports its subpackages on first read): the registry sits
    below them and imports none of them.
    """
    global _packages
    _packages = packages


def _functree_types() -> dict[str, type]:
    """functree's and optax's state types by public name."""
    import optax

    table: dict[str, type] = {}
    for package, names in FUNCTREE_TYPES.items():
        for name in names:
            cls = _find(package, name)
            if cls is not None:
                table[f"{package}.{name}"] = cls
    for name in OPTAX_STATES:
        cls = getattr(optax, name, None)
        if isinstance(cls, type):
            table[f"optax.{name}"] = cls
    return table


def _functree_modules() -> Iterator[tuple[str, type]]:
    for package in _packages:
        for name in package.__all__:
            obj = getattr(package, name)
            if isinstance(obj, type) and issubclass(obj, Module) and obj is not Module:
                yield f"{package.__name__}.{name}", obj


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded or not _packages:  # not before functree's import has finished
        return
    for name, cls in [*_functree_types().items(), *_functree_modules()]:
        _add(_types, name, cls)
    for name, fn in builtin_functions().items():
        _add(_functions, name, fn)
    _builtins_loaded = True  # last: another thread never sees a half-filled table as done


def _add(table: dict[str, Any], name: str, obj: Any) -> None:
    table[name] = obj
    _names.setdefault(id(obj), name)


def default_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def register(obj: Any, name: str | None = None) -> Any:
    """Allow checkpoints to rebuild ``obj`` (a class) or refer to it (a function) by name.

    Restoring without a template builds only registered types (and Module subclasses
    defined in the running process); a static function (an activation, a Lambda's
    function) is only looked up among registered ones. ``name`` defaults to
    ``module.qualname``; returns ``obj``, so it works as a decorator.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, tempfile, typing
      >>> @ft.train.register
      ... class Counter(typing.NamedTuple):
      ...     count: jax.Array
      >>> path = tempfile.mkdtemp() + "/c"
      >>> ft.train.save(path, Counter(jnp.array(3)))
      >>> ft.train.load(path)
      Counter(count=Array(3, dtype=int32, weak_type=True))
    """
    _load_builtins()
    is_class = isinstance(obj, type)
    if not callable(obj) or (is_class and not _is_buildable(obj)):
        raise TypeError(NOT_REGISTRABLE.format(given=obj, own=OWN_FLATTEN if is_class else ""))
    name = name or default_name(obj)
    table: dict[str, Any] = _types if is_class else _functions
    old = table.get(name)
    if old is not None and old is not obj:
        if not _same_definition(old, obj):
            raise ValueError(NAME_TAKEN.format(name=name, old=old, new=obj, new_name=default_name(obj),
                                               module=name.rsplit(".", 1)[0], short=name.rsplit(".", 1)[-1]))
        if _names.get(id(old)) == name:  # a re-run cell: the new definition takes the name
            del _names[id(old)]  # (the old object may die, and its id be reused)
    table[name] = obj
    _names[id(obj)] = name
    return obj


def _same_definition(old: Any, new: Any) -> bool:
    """Whether ``new`` is a re-run of the definition of ``old``: the same kind of object, the
    same module and qualified name (a notebook cell or a reloaded module run again)."""
    return (type(old) is type(new) and getattr(old, "__module__", None) == getattr(new, "__module__", 0)
            and getattr(old, "__qualname__", None) == getattr(new, "__qualname__", 0))


def _current(obj: Any) -> Any:
    """``obj``, or its re-run definition bound in its place now (a notebook cell run again
    defines a new class or function under the same module and qualified name)."""
    now = bound(getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
    return now if now is not None and now is not obj and _same_definition(obj, now) else obj


def current_definitions(found: list[type]) -> list[type]:
    """Of several classes that share a stored name, the one bound at its module's name now
    (pickle's rule: the class a re-run cell defined last); all of them where none, or
    more than one, is (a class local to a function: still ambiguous)."""
    if len(found) < 2:
        return found
    now = [c for c in found if bound(c.__module__, c.__qualname__) is c]
    return now if len(now) == 1 else found


def _is_buildable(cls: type) -> bool:
    return (
        issubclass(cls, Module)
        or (issubclass(cls, tuple) and hasattr(cls, "_fields"))
        or dataclasses.is_dataclass(cls)
        or issubclass(cls, enum.Enum)  # a static field's member, stored by its name (_treespec)
    )


def type_name(cls: type) -> str:
    """The name a checkpoint stores for ``cls``."""
    _load_builtins()
    return _names.get(id(cls)) or default_name(cls)


def function_name(fn: Any) -> str | None:
    """The registered name of a static function or scalar type, or None. A re-run
    definition of a registered function (same module and qualified name, bound there in
    its place now) has its name."""
    _load_builtins()
    name = _names.get(id(fn))
    if name is None and callable(fn):
        old = _functions.get(default_name(fn))
        if old is not None and _current(old) is fn:
            return default_name(fn)
    return name


def _module_subclasses() -> Iterator[type]:
    stack = list(Module.__subclasses__())
    seen: set[int] = set()
    while stack:
        cls = stack.pop()
        if id(cls) not in seen:
            seen.add(id(cls))
            yield cls
            stack.extend(cls.__subclasses__())


def lookup_type(name: str) -> list[type]:
    """The classes a stored type name may mean (registered first), without importing."""
    _load_builtins()
    if name in _types:
        return [_current(_types[name])]
    return current_definitions([c for c in _module_subclasses() if type_name(c) == name])


def lookup_function(name: str) -> Any:
    """The registered function or scalar type stored as ``name``, or None: where a cell
    re-ran its definition (same module and qualified name, bound there now), the new one."""
    _load_builtins()
    fn = _functions.get(name)
    return None if fn is None else _current(fn)


def public_name(old: str, kind: str) -> str:
    """The name format 2 stores for a format-1 name (``module:qualname``) of a ``"class"``
    or a ``"function"``; unknown names are returned as they are, and refused on reading."""
    _load_builtins()
    old = ALIASES.get(old, old)
    if ":" not in old:
        return old
    known = [*_types.items(), *((type_name(c), c) for c in _module_subclasses())] if kind == "class" \
        else list(_functions.items())
    private = [n for n, obj in known if f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', '?')}" == old]
    return private[0] if private else old.replace(":", ".")
