"""One compiled training step per configuration, shared by every TrainStep in the process.

``jax.jit(f)`` compiles once per function and shapes: a second ``jax.jit(f)`` of the same
``f`` reuses the program. A :class:`ft.train.TrainStep` jits its own method, so each new
one (each new Trainer) would trace and compile again. Here the jitted programs live in a
process-wide table keyed by what the program computes: the step's class, its loss
function, metrics, ``on_nan``, donation, mesh and sharding, compute dtype, and the
optimizer's configuration; a new step with an equal key takes the same programs (their
``jax.jit`` caches, one entry per shapes).

The key is built once per step (:func:`program_key`), conservatively: two values are
equal only when they compute the same thing.

* Functions of functree and optax compare by module, code, defaults
  and closure contents (two ``ft.optim.adam(1e-3)`` are one configuration); other
  functions (a notebook's, a script's, a user module's: ``importlib.reload`` makes new
  ones equal by code that read other values) compare by identity, as do
  objects other than containers, arrays, optimizers, placements and functree's and
  optax's plain records of settings (compared by their attributes), through a weak
  reference: when one of them is collected, its entries leave the table.
* Numbers compare by type and exact value (``0.1`` and ``0.1000001`` differ; ``1`` and
  ``1.0`` differ), small arrays by dtype, shape and bytes; a traced value, or an object
  that can be neither compared by value nor weakly referenced, means "do not share".

* What the Python of the user's code reads now (:func:`functree.nn._reads.reads_key`, as
  an eager ``ft.nn.Stack`` keys it): the globals, class attributes and methods that the
  model's user classes and the user functions of the configuration (the loss function, a
  metric) name. A notebook cell that sets ``G = 3.0`` read by ``Net.__call__`` or the loss,
  then makes a new Trainer, gets a new program, as the eager call sees the new value (the
  shared one had ``G = 1.0`` compiled in). One entry per configuration: a new value
  replaces the programs of the old (a step holding them keeps them, as ``jax.jit`` would);
  code whose reads cannot be keyed cheaply (a large NumPy global) is not shared.

Only the jitted programs are shared, not a step's own state (its donation guard, NaN
halt log, the flat-leaves fast path of its latest results). While tracing, a shared
program calls the step that called it (:attr:`Shared.owner`).
"""

from __future__ import annotations

import enum
import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from functree._tree import WeakIdentity
from functree.nn._eager_keys import code_roots
from functree.nn._reads import reads_key

__all__ = ["Shared", "shared", "program_key", "forget_programs", "Unshareable", "code_reads", "NO_MODEL"]

_MAX_DEPTH = 40
_MAX_ARRAY_BYTES = 1 << 14  # larger arrays compare by identity


_PROGRAMS: dict[Any, Any] = {}  # _Key -> Shared


class Unshareable(Exception):
    """Raised while building a key: this configuration is not shared."""


def _ref(obj: Any, holder: list[Any]) -> WeakIdentity:
    """``obj`` compared by identity, held weakly; its death evicts the entry it keys."""

    def evict(_: Any, holder: list[Any] = holder, table: dict[Any, Any] = _PROGRAMS) -> None:
        if holder:  # the key was stored: one of its referents is gone
            table.pop(holder[0], None)

    try:
        return WeakIdentity(obj, evict)
    except TypeError:
        raise Unshareable from None


class Shared:
    """The programs of one configuration: ``programs[kind]`` (a flat program table, see
    :class:`functree._flat.FlatJit`), and ``owner``, a weak reference to the step whose
    call is running (a retrace calls its stages)."""

    __slots__ = ("__weakref__", "owner", "programs", "reads")

    def __init__(self, reads: Any = None) -> None:
        self.owner: Any = None
        self.programs: dict[str, dict[Any, Any]] = {}
        self.reads = reads  # what the user's code read when these programs were traced (code_reads)


def forget_programs() -> None:
    """Empty the process-wide table (the next step compiles again); tests start from it."""
    _PROGRAMS.clear()


# A function compares by value only when it is functree's or optax's (:data:`_LIBRARIES`):
# their globals are code, never edited and reloaded while a process runs. A user's module
# is: ``importlib.reload`` / ``%autoreload`` re-runs it into the same globals, so its new
# functions equal the old ones by code while the values they read changed, and a step
# would have run the old program.


def _module_function(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is a function of functree's or optax's modules, compared by value; any
    other function (a notebook's, a script's, a user module's) is compared by
    identity, as ``jax.jit`` compares it."""
    name = getattr(fn, "__module__", None) or ""
    module = sys.modules.get(name)
    return (name.split(".", 1)[0] in _LIBRARIES and module is not None
            and getattr(module, "__dict__", None) is fn.__globals__)


class _Builder:
    def __init__(self) -> None:
        self.holder: list[Any] = []
        self.active: set[int] = set()
        self.code: list[Any] = []  # the user's functions and objects met, compared by identity: their reads too

    def ref(self, x: Any) -> WeakIdentity:
        return _ref(x, self.holder)

    def key(self, x: Any, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise Unshareable
        kind = type(x)
        if x is None or kind in (bool, int, str, bytes):
            return (kind.__name__, x)
        if kind is float:
            return ("float", x.hex())  # -0.0 and 0.0 differ; NaN equals NaN
        if kind is complex:
            return ("complex", x.real.hex(), x.imag.hex())
        if isinstance(x, Tracer):
            raise Unshareable
        if isinstance(x, np.dtype):
            return ("dtype", str(x))
        if isinstance(x, type):
            return ("type", self.ref(x))
        if isinstance(x, types.ModuleType):
            return ("module", x.__name__) if sys.modules.get(x.__name__) is x else ("module", self.ref(x))
        if id(x) in self.active:  # a cycle: compared by identity alone
            return ("cycle", self.ref(x))
        self.active.add(id(x))
        try:
            return self._container(x, kind, depth + 1)
        finally:
            self.active.discard(id(x))

    def _container(self, x: Any, kind: type, depth: int) -> Any:
        if isinstance(x, (tuple, list)):
            return (self.ref(kind) if kind not in (tuple, list) else kind.__name__,
                    tuple(self.key(v, depth) for v in x))
        if isinstance(x, dict):
            if kind is not dict:
                return ("object", self.ref(x))
            return ("dict", tuple((self.key(k, depth), self.key(v, depth)) for k, v in x.items()))
        if isinstance(x, functools.partial):
            return ("partial", self.key(x.func, depth), self.key(x.args, depth), self.key(x.keywords, depth))
        if isinstance(x, types.FunctionType):
            if not _module_function(x):
                self.code.append(x)
                return ("function", self.ref(x))
            cells = tuple(self.key(_cell(c), depth) for c in (x.__closure__ or ()))
            return ("function", x.__module__, x.__code__, self.key(x.__defaults__, depth),
                    self.key(x.__kwdefaults__, depth), cells, self.key(dict(x.__dict__), depth))
        if isinstance(x, types.MethodType):
            return ("method", self.key(x.__func__, depth), self.key(x.__self__, depth))
        if isinstance(x, (jax.sharding.Mesh, jax.sharding.PartitionSpec)):
            return (kind.__name__, x)  # compared by value: devices and axis names, entries
        if isinstance(x, enum.Enum):
            return ("enum", self.ref(kind), x.name)
        if isinstance(x, (np.ndarray, np.generic, jax.Array)):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return ("array", self.ref(x))
            a = np.asarray(x)
            if a.nbytes > _MAX_ARRAY_BYTES:
                return ("array", self.ref(x))
            return ("array", kind.__name__, str(a.dtype), a.shape, a.tobytes())
        fields = _configuration(x)
        if fields is not None:
            return ("object", self.ref(kind), tuple((n, self.key(v, depth)) for n, v in fields))
        self.code.append(x)
        return ("object", self.ref(x))


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return "<empty cell>"


def _configuration(x: Any) -> list[tuple[str, Any]] | None:
    """The attributes that say what ``x`` computes, for the classes whose instances are pure
    configuration (optimizers, placements); None for any other object."""
    from functree.optim._optimizer import Optimizer
    from functree.parallel._placement import Placement

    if isinstance(x, Optimizer):  # immutable: its attributes are its configuration
        return sorted(vars(x).items())
    if isinstance(x, Placement):
        return [("mesh", x.mesh), ("data_axis", x.data_axis), ("sharding", x.sharding)]
    module = getattr(type(x), "__module__", "") or ""
    if module.split(".")[0] in _LIBRARIES and hasattr(x, "__dict__") and not hasattr(type(x), "__slots__"):
        return sorted(vars(x).items())  # functree's and optax's records of settings (a hyperparameter's)
    return None


_LIBRARIES = ("functree", "optax")  # whose functions and records of settings compare by value


NO_MODEL = object()  # program_key without a model: its classes' reads are not keyed


def code_reads(model: Any, code: Any = ()) -> Any:
    """What the Python of ``model``'s user classes (and the functions it holds as static
    values) and of ``code`` (user functions and objects) reads now: a
    :func:`~functree.nn._reads.reads_key`, or None where a read cannot be keyed cheaply."""
    classes, functions = code_roots(model) if model is not NO_MODEL else ((), ())
    return reads_key(classes, (*functions, *code))


def program_key(kind: str, owner: Any, state: tuple[str, ...], model: Any = NO_MODEL) -> Any:
    """The key of ``owner``'s (a TrainStep's) ``kind`` program: its class and every instance
    attribute but the run-time ``state`` ones, with what the user's code run on ``model``
    reads (:func:`code_reads`); None when it cannot be shared."""
    builder = _Builder()
    try:
        fields = tuple((name, builder.key(value)) for name, value in sorted(vars(owner).items())
                       if name not in state)
        key = (kind, builder.ref(type(owner)), fields)
        hash(key)
        reads = code_reads(model, builder.code)
        hash(reads)
    except Exception:  # Unshareable, an unhashable value, a deleted array ...: not shared
        return None
    return None if reads is None else _Key(key, builder.holder, reads)


class _Key:
    """A key and the holder its weak references evict it by."""

    __slots__ = ("hash", "holder", "reads", "value")

    def __init__(self, value: Any, holder: list[Any], reads: Any = None):
        self.value, self.holder, self.hash, self.reads = value, holder, hash(value), reads

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.value == other.value


def shared(key: Any) -> Shared:
    """The :class:`Shared` programs of ``key`` (from :func:`program_key`; None: a new,
    private one)."""
    if key is None:
        return Shared()
    found = _PROGRAMS.get(key)
    if found is None or found.reads != key.reads:  # new, or the user's code reads other values now
        if found is None:
            key.holder.append(key)  # from now on, a collected referent evicts this entry
        found = _PROGRAMS[key] = Shared(key.reads)  # (the stored key, equal to this one, stays)
    return found


def trampoline(entry: Shared, method: str) -> Callable[..., Any]:
    """The function a shared program traces: ``method`` of the step now calling it."""
    return lambda: getattr(entry.owner(), method)
