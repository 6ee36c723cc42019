"""What a block's Python reads while it is traced: the part of an eager Stack's cache key
that keeps its compiled scan current in a notebook.

A traced program bakes in every Python value the traced code read: a global ``GAIN``, a
class attribute, the ``__call__`` that ran. An eager :class:`ft.nn.Stack` call reuses one
compiled scan per structure (:func:`functree.nn._stack._eager_scan`), so its key also holds
:func:`reads_key` of the blocks' classes: after ``GAIN = 0.0`` in a later cell, or
``Block.__call__ = patched``, the key differs and the scan is traced again, as the Python
loop and a raw eager ``jax.lax.scan`` would see it.

What is read, for each user class (one not defined by an installed package):

* its ``__call__`` (by identity; through a wrapper's closure, to the user's function),
* the special methods user classes of its MRO define themselves (``__init__``,
  ``__post_init__``, operators such as ``__rmul__``, ``__getitem__``): traced code runs
  them when it builds an instance (``Cfg()``) or applies an operator; a dataclass's default
  factories (the generated ``__init__``'s closure, a Module's fields) with them,
* the functions, properties and class attributes its code names as attributes, found on
  the class itself (``self.helper(x)``, ``self.EPS``); for code calling ``super()``, every
  user class's definition of them along the MRO (``super().__call__(x)`` runs the base's),
* each function's globals named by its code (``co_names`` read as globals, nested
  lambdas and comprehensions included), its defaults and closure cells; user functions
  named there are followed the same way, :data:`MAX_DEPTH` deep.

Values are keyed as the program keeps them: ``None``, bools, ints, floats, strings and
their tuples by type and exact value (``1``, ``1.0`` and ``True`` differ; ``-0.0`` is not
``0.0``); lists and dicts by contents (a cell may change them in place), as are the attributes of
a user's mutable object (a config, a ``SimpleNamespace``); NumPy arrays by dtype, shape
and bytes; a user's own module (not an installed package: ``import mycfg``) by identity and by
the attributes of it the code names (``mycfg.GAIN``); an ``ft.differentiable`` function and
a user's ``jax.custom_vjp`` / ``jax.custom_jvp`` by identity and by their function and rules,
read as above (``@ft.derivative(of=f)``, ``f.defvjp`` and ``f.defjvp`` set them in place: a
rule cell run again, edited); an instance of a user class also by
its class, read as above (``y * g`` runs ``type(g).__rmul__``); library modules, library functions,
classes, JAX arrays, Modules and frozen dataclasses (immutable) and other objects by
identity, weakly held where they allow it. A NumPy array over
:data:`MAX_ARRAY_BYTES`, a container over :data:`MAX_ITEMS` or code deeper than
:data:`MAX_DEPTH` cannot be keyed cheaply: :func:`reads_key` returns None and the call
takes the plain (uncached) scan, never a stale program.

Functions and classes of installed packages (site-packages, the standard library, and
functree, JAX, NumPy wherever they are installed) are compared by identity alone: their
globals are code, not edited while a process runs.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import os
import sys
import sysconfig
import types
import weakref
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from functree._derivative import DifferentiableFunction
from functree._module import GENERATED_INIT, Module
from functree._tree import WeakIdentity, bounded_put

__all__ = ["reads_key", "is_library", "library_class", "carries_rules", "MAX_DEPTH", "MAX_ITEMS",
           "MAX_ARRAY_BYTES"]

MAX_DEPTH = 8  # functions followed from a block's __call__ (a helper's helper ...)
MAX_ITEMS = 256  # entries of a list, tuple or dict keyed by contents
MAX_ARRAY_BYTES = 1 << 14  # a NumPy global keyed by its bytes up to this size

_PACKAGES = frozenset({"functree", "jax", "jaxlib", "numpy", "optax", "chex", "ml_dtypes", "flax",
                       "equinox", "torch", "transformers", "scipy", "einops"})
_INSTALLED = tuple({os.path.join(sysconfig.get_path(k), "") for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_LIBRARY: dict[str, bool] = {}  # module name -> whether its globals are library code
_NAMES: dict[int, tuple[types.CodeType, tuple[tuple[str, ...], tuple[str, ...], bool]]] = {}
_CLASSES: dict[type, bool] = {}  # held as the tree definitions hold classes
_PLANS: dict[int, tuple[Any, ...]] = {}  # id(function) -> _plan(function), checked against it
_MEMBERS: dict[tuple[type, int], tuple[types.CodeType, tuple[str, ...]]] = {}
_MISSING = object()  # a global not (yet) defined, an empty cell: defining it later changes the key
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
_CODE_KINDS = (types.FunctionType, staticmethod, classmethod, property, functools.partial)


class Unkeyable(Exception):
    """Raised while building a key: what the code reads cannot be keyed cheaply."""


class _Same:
    """Identity held strongly, for an object that takes no weak reference (a builtin function)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def _identity(obj: Any) -> Any:
    try:
        return WeakIdentity(obj)
    except TypeError:
        return _Same(obj)


def is_library(module: str | None) -> bool:
    """Whether the globals of ``module`` are library code (an installed package, the standard
    library, a builtin module), not a notebook's, a script's or the user's own module.

    Example:
      >>> is_library("jax.numpy"), is_library("os"), is_library("__main__")
      (True, True, False)
    """
    if not module:
        return False
    known = _LIBRARY.get(module)
    if known is None:
        known = _LIBRARY[module] = _installed(module)
    return known


def library_class(cls: type) -> bool:
    """Whether ``cls`` is a class of library code: defined in a library module and bound
    there under its name (a class a doctest or ``exec`` defines with a library's
    ``__name__`` is the user's). The module is the one ``__module__`` names or the one its
    methods were defined in: ``functree.hf`` records its ports under
    ``functree.nn._hf_models``, a module only a pickle imports, so read by ``__module__``
    alone they were the user's until one was unpickled (their code re-read at every
    ``generate`` call, 2.6 ms against 0.02 ms for a tiny GPT-2)."""
    known = _CLASSES.get(cls)
    if known is None:
        known = any(_binds(home, cls) for home in _homes(cls))
        bounded_put(_CLASSES, cls, known)
    return known


def _homes(cls: type) -> set[str]:
    """The modules ``cls`` may be bound in: its ``__module__`` and its own methods'."""
    functions = (getattr(v, "__func__", v) for v in vars(cls).values())
    return {cls.__module__, *(f.__module__ for f in functions if isinstance(f, types.FunctionType))}


def _binds(home: str | None, cls: type) -> bool:
    """Whether library module ``home`` is imported and binds ``cls`` under its name."""
    module = sys.modules.get(home) if is_library(home) else None  # type: ignore[arg-type]
    return module is not None and getattr(module, cls.__name__, None) is cls


def _library_function(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is library code: its globals are a library module's (a wrapper's
    ``__module__`` is the function it wraps'; a doctest's globals only carry a name)."""
    name = fn.__globals__.get("__name__")
    module = sys.modules.get(name) if is_library(name) else None  # type: ignore[arg-type]
    return module is not None and module.__dict__ is fn.__globals__


def _installed(module: str) -> bool:
    if module.split(".", 1)[0] in _PACKAGES:
        return True
    if module == "__main__" or module not in sys.modules:
        return False
    path = getattr(sys.modules[module], "__file__", None)
    if path is None:
        return module in sys.builtin_module_names
    return os.path.abspath(path).startswith(_INSTALLED)


def _names(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """``(globals read, attributes read, calls super())`` by ``code`` and the code nested in
    it (lambdas, comprehensions), read from its bytecode once per code object."""
    entry = _NAMES.get(id(code))  # by id, the code held in the entry: hashing a code object
    if entry is None or entry[0] is not code:  # reads all its bytecode, at every call
        found: tuple[dict[str, None], dict[str, None]] = ({}, {})
        _collect(code, found)
        entry = code, (tuple(found[0]), tuple(found[1]), _calls_super(code))
        bounded_put(_NAMES, id(code), entry)
    return entry[1]


def _calls_super(code: types.CodeType) -> bool:
    """Whether ``code`` (or code nested in it) calls ``super()``: zero-argument ``super``
    reads the ``__class__`` cell; ``super(Block, self)`` names the builtin."""
    return ("super" in code.co_names or "__class__" in code.co_freevars
            or any(_calls_super(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _collect(code: types.CodeType, found: tuple[dict[str, None], dict[str, None]]) -> None:
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            found[0][ins.argval] = None
        elif ins.opname in _ATTR_OPS:
            found[1][ins.argval] = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _collect(const, found)


def _members(owner: type, code: types.CodeType, attributes: tuple[str, ...], every: bool) -> tuple[str, ...]:
    """The attribute names of ``code`` found on a user class of ``owner``'s MRO (a method,
    a property, a class constant), once per class and code: the others are fields of the
    instance (``self.lin``) or attributes of other objects (``x.shape``, ``jnp.tanh``). For
    code calling ``super()`` (``every``), each name defined on any user class of the MRO,
    special names too (``super().__call__(x)`` runs a base class's ``__call__``)."""
    entry = _MEMBERS.get((owner, id(code)))
    if entry is None or entry[0] is not code:
        if every:
            names = tuple(n for n in attributes if _definitions(owner, n))
        else:
            names = tuple(n for n in attributes if not n.startswith("__") and _class_attribute(owner, n)[0])
        entry = code, names
        bounded_put(_MEMBERS, (owner, id(code)), entry)
    return entry[1]


def _class_attribute(owner: type, name: str) -> tuple[bool, Any]:
    """``(found on a user class, value)`` of ``name`` looked up on ``owner``'s MRO without
    running descriptors; an attribute of a library class is library code (not keyed). A
    ``__call__`` forwarding to the next class's (a mixin's, wrapped by ``ft.Module``) is
    passed over: the one it runs is read."""
    for k in owner.__mro__:
        if name in k.__dict__:
            v = k.__dict__[name]
            if name == "__call__" and getattr(v, "__ft_forwards__", False):
                continue
            return not library_class(k), v
    return False, None


def _specials(cls: type) -> list[Any]:
    """The special methods user classes of ``cls``'s MRO define themselves, but ``__call__``
    (read apart): ``__init__`` and ``__post_init__``, operators (``__rmul__``),
    ``__getitem__``... traced code runs them as it runs ``__call__`` (``Cfg()``, ``x * g``).
    A dataclass's generated ``__init__`` holds its default factories in its closure and its
    defaults in ``__defaults__``; a Module's (functree's generic one) reads them from the
    fields when it runs: they are listed instead. Read from the class dicts at every call:
    a later cell may define or replace one."""
    found = []
    for k in cls.__mro__:
        if not library_class(k):
            for name, v in k.__dict__.items():  # (the type test first: most entries are data)
                if isinstance(v, _CODE_KINDS) and name[:2] == "__" == name[-2:] and name != "__call__" \
                        and not _generated_init(v):
                    found.append(v)
    if _generated_init(getattr(cls, "__init__", None)):
        for f in cls.__dataclass_fields__.values():  # type: ignore[attr-defined]
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                found += (f.default, f.default_factory)
    return found


def _generated_init(v: Any) -> bool:
    """Whether ``v`` is a Module's generated ``__init__``: library code calling ``_run_init``."""
    return type(v) is types.FunctionType and v.__code__.co_filename == GENERATED_INIT


def _definitions(owner: type, name: str) -> tuple[Any, ...]:
    """Every value of ``name`` on a user class of ``owner``'s MRO, nearest first: what
    ``super()`` may reach."""
    return tuple(k.__dict__[name] for k in owner.__mro__ if name in k.__dict__ and not library_class(k))


class _Builder:
    """One key: the values read, each object followed once."""

    def __init__(self) -> None:
        self.seen: dict[Any, Any] = {}

    def value(self, v: Any, depth: int) -> Any:
        kind = type(v)
        if v is _MISSING:
            return "missing"
        if v is None or kind in (bool, int, str, bytes):
            return kind, v
        if kind is float:
            return kind, v.hex()  # -0.0 and 0.0 differ; a NaN equals itself
        if kind is complex:
            return kind, v.real.hex(), v.imag.hex()
        if isinstance(v, np.generic):
            return kind, v.tobytes()
        if kind in (tuple, list, dict) and (len(v) > MAX_ITEMS or depth > 2 * MAX_DEPTH):
            raise Unkeyable  # (a list holding itself ends here too)
        if kind in (tuple, list):
            return kind, tuple(self.value(x, depth + 1) for x in v)
        if kind is dict:
            return kind, tuple((self.value(k, depth + 1), self.value(x, depth + 1)) for k, x in v.items())
        if isinstance(v, np.ndarray):
            if v.nbytes > MAX_ARRAY_BYTES or v.dtype.hasobject:
                raise Unkeyable
            return np.ndarray, str(v.dtype), v.shape, v.tobytes()
        if isinstance(v, types.FunctionType):
            return self.function(v, depth, None)
        if isinstance(v, type):
            return self.cls(v, depth)
        if isinstance(v, types.MethodType):
            return "method", self.value(v.__func__, depth), _identity(v.__self__)
        if isinstance(v, functools.partial):
            return "partial", self.value(v.func, depth), self.value(v.args, depth), self.value(v.keywords, depth)
        if isinstance(v, (staticmethod, classmethod)):
            return kind, self.value(v.__func__, depth)
        if isinstance(v, property):
            return kind, self.value(v.fget, depth)
        if isinstance(v, types.ModuleType):
            return v  # code, alive for the process: compared by identity (its __eq__)
        rules = _rules(v)
        if rules is not None:
            return _identity(v), tuple(self.value(part, depth + 1) for part in rules)
        # a user class's instance: its class too (``x * g`` runs ``type(g).__rmul__``)
        own = () if library_class(kind) else self.cls(kind, depth + 1)
        if _mutable_record(v):  # a notebook's config object: a later cell may set its fields
            return _identity(v), self.value(dict(vars(v)), depth + 1), own
        return _identity(v), own  # a JAX array, a Module, a frozen dataclass: immutable; others by identity

    def cls(self, cls: type, depth: int) -> Any:
        """A user class by identity and by what its ``__call__`` reads; a library class by identity."""
        if library_class(cls):
            return cls  # compared by identity; held as the tree definitions hold classes
        if id(cls) in self.seen:
            return "seen", cls
        self.seen[id(cls)] = cls
        user, call = _class_attribute(cls, "__call__")
        if isinstance(call, types.FunctionType):
            read = self.function(call, depth, cls)
        else:
            read = self.value(call, depth)
        if not user:  # a library's __call__ calling this class's overrides: each of them
            read = read, tuple(self.attribute(cls, name, depth + 1) for k in cls.__mro__
                               if not library_class(k) for name in list(k.__dict__))
        return cls, read, tuple(self.member(v, cls, depth + 1) for v in _specials(cls))

    def function(self, fn: types.FunctionType, depth: int, owner: type | None) -> Any:
        """``fn`` by identity, with its closure cells; a user function also with its
        defaults, the globals its code reads and, for a method of ``owner``, the class
        attributes it names."""
        if id(fn) in self.seen:
            return "seen", _identity(fn)
        if depth > MAX_DEPTH:
            raise Unkeyable
        self.seen[id(fn)] = fn
        plan = _PLANS.get(id(fn))
        if plan is None or plan[0]() is not fn or plan[1] is not fn.__code__:
            plan = _plan(fn)
        _, code, ident, library, global_names, attributes, every = plan
        contents = [_cell(c) for c in fn.__closure__ or ()]
        if library:  # library code, alive for the process; its closure: a wrapped user function
            return fn, tuple(self.function(c, depth + 1, owner) for c in contents if isinstance(c, types.FunctionType))
        cells = tuple(self.read(c, attributes, depth + 1) for c in contents)
        scope = fn.__globals__
        reads = tuple(self.read(scope.get(name, _MISSING), attributes, depth + 1) for name in global_names)
        members = () if owner is None else tuple(self.attribute(owner, name, depth + 1, every)
                                                 for name in _members(owner, code, attributes, every))
        return (ident, cells, reads, members, self.value(fn.__defaults__, depth), self.value(fn.__kwdefaults__, depth))

    def read(self, v: Any, attributes: tuple[str, ...], depth: int) -> Any:
        """A global or cell the code reads: a user's module (``import mycfg``) by identity and
        by the attributes of it the code names (``mycfg.GAIN``, a later cell may set it),
        followed as they are; another value by :meth:`value`."""
        if not isinstance(v, types.ModuleType) or is_library(v.__name__):
            return self.value(v, depth)
        seen = id(v), id(attributes)  # (another function may name other attributes of it)
        if seen in self.seen:
            return "seen", v
        self.seen[seen] = v, attributes
        scope = vars(v)
        return v, tuple((name, self.read(scope[name], attributes, depth + 1)) for name in attributes if name in scope)

    def attribute(self, owner: type, name: str, depth: int, every: bool = False) -> Any:
        """The class attribute ``name`` of ``owner`` the code reads; with ``every`` (code
        calling ``super()``), each of its definitions on a user class of the MRO."""
        if every:
            return tuple(self.member(v, owner, depth) for v in _definitions(owner, name))
        user, v = _class_attribute(owner, name)
        if not user or name.startswith("__"):
            return None
        return self.member(v, owner, depth)

    def member(self, v: Any, owner: type, depth: int) -> Any:
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        if isinstance(v, property):
            v = v.fget
        if isinstance(v, types.FunctionType):
            return self.function(v, depth, owner)
        return self.value(v, depth)


_JAX_RULES = (jax.custom_vjp, jax.custom_jvp)
_RULE_FIELDS = ("fun", "fwd", "bwd", "jvp", "nondiff_argnums")


def _rules(v: Any) -> tuple[Any, ...] | None:
    """The function and derivative rules of ``v`` as they are now, where they are set on it in
    place: ``@ft.derivative(of=f)`` on an ``ft.differentiable`` function, ``f.defvjp(fwd, bwd)``
    and ``f.defjvp(jvp)`` on a user's ``jax.custom_vjp`` / ``jax.custom_jvp`` (a notebook's rule
    cell run again, edited; a global a rule reads). None for anything else (a library's
    ``jax.nn.relu``, a ``custom_jvp``, is its code)."""
    if isinstance(v, DifferentiableFunction):
        return v.fn, v.reverse, v.forward
    if isinstance(v, _JAX_RULES) and not is_library(getattr(v, "__module__", None)):
        return tuple(getattr(v, name, None) for name in _RULE_FIELDS)
    return None


def carries_rules(v: Any) -> bool:
    """Whether ``v`` is a function whose derivative rules are set on it in place (an
    ``ft.differentiable`` function, a user's ``jax.custom_vjp`` / ``custom_jvp``): held as a
    static value (an activation), it is keyed by its rules as they are now."""
    return _rules(v) is not None


def _mutable_record(v: Any) -> bool:
    """Whether ``v`` is an object whose attributes a cell may set in place (a user class's
    instance, a ``SimpleNamespace``): not a Module or frozen dataclass, not a library's."""
    kind = type(v)
    if kind is types.SimpleNamespace:
        return True
    if isinstance(v, Module) or library_class(kind) or not hasattr(v, "__dict__"):
        return False
    params = getattr(kind, "__dataclass_params__", None)
    return not (params is not None and params.frozen)


def _plan(fn: types.FunctionType) -> tuple[Any, ...]:
    """What of ``fn`` is fixed, made once per function (and code): ``(weak reference, code,
    key part of its identity and code, library?, globals read, attributes read)``; the
    values it reads are read at every call."""
    code = fn.__code__
    ident = _identity(fn), _Same(code)  # (a code object's own hash would read all its bytecode)
    plan = (weakref.ref(fn), code, ident, _library_function(fn), *_names(code))
    bounded_put(_PLANS, id(fn), plan)
    return plan


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell (a name assigned later in the enclosing function)
        return _MISSING


def reads_key(classes: Iterable[type], functions: Iterable[Any] = ()) -> Any:
    """A hashable key of what the Python of ``classes`` (each one's ``__call__``, the methods
    and class attributes it names, the globals their code reads) and of ``functions`` (a
    layer's static activation) reads now, or None where something read cannot be keyed
    cheaply (see the module's docstring): equal keys trace to the same program.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> GAIN = 1.0
      >>> class Block(ft.Module):
      ...     def __call__(self, x):
      ...         return x * GAIN
      >>> before = reads_key([Block])
      >>> before == reads_key([Block])
      True
      >>> GAIN = 0.0
      >>> before == reads_key([Block])
      False
    """
    build = _Builder()
    try:
        return (tuple(build.cls(c, 0) for c in classes)
                + tuple(build.value(f, 0) for f in functions))
    except Unkeyable:
        return None
