"""Static functions by public name: the one table checkpoints, pickles and copies share.

``jax.nn``'s functions, functree's activations (``functree.nn.relu`` is ``jax.nn.relu``:
the first name wins, as in checkpoints), elementwise ``jax.numpy`` functions, ``jax.lax``'s
binary reductions (a pooling layer's) and ``jax.numpy`` scalar types. Several of these are objects, not plain functions
(``jax.nn.relu`` is a ``custom_jvp``, ``jax.nn.sigmoid`` a jitted function): Python's
pickle cannot store them by reference and ``copy.deepcopy`` would rebuild them, which
changes a model's tree definition. A Module pickles them as :class:`ByName` (a name
that unpickles through :func:`function`, a lookup in this table and nothing else) and
deep-copies them by identity.

The checkpoint registry (``functree.train.checkpoint._registry``) starts from this table.
"""

from __future__ import annotations

from typing import Any

from functree import _activations

__all__ = ["JNP_FUNCTIONS", "JNP_SCALAR_TYPES", "builtin_functions", "builtin_name", "function", "ByName"]

# Pure jax.numpy functions of one array allowed as static values: elementwise ones (Lambda
# layers), and transpose (ft.nn.Shared's tie of a head to an embedding's transpose).
JNP_FUNCTIONS = (
    "abs", "arccos", "arcsin", "arctan", "arctanh", "cos", "cosh", "exp", "exp2", "expm1",
    "log", "log1p", "log2", "negative", "reciprocal", "sign", "sin", "sinh", "sqrt",
    "square", "tan", "tanh", "ravel", "transpose",
)

# jax.lax's binary reductions a pooling layer holds (Equinox's MaxPool2d holds jax.lax.max,
# its AvgPool2d jax.lax.add).
LAX_FUNCTIONS = ("max", "min", "add", "mul")

# Scalar types allowed as static values (dtype arguments).
JNP_SCALAR_TYPES = (
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bfloat16", "float16", "float32", "float64", "complex64", "complex128",
)

UNKNOWN_FUNCTION = """\
This pickle names the function {name!r}, which is not among functree's registered \
functions (jax.nn, functree.nn, elementwise jax.numpy, jax.lax's max/min/add/mul); loading \
builds nothing else by name.
    right:  pickle a model whose static functions are jax.nn / ft.nn activations, or \
module-level functions (pickled by reference)"""

_table: dict[str, Any] = {}
_names: dict[int, str] = {}  # id(function) -> its first public name


def _load() -> None:
    import jax
    import jax.numpy as jnp

    table: dict[str, Any] = {}
    for name in dir(jax.nn):
        obj = getattr(jax.nn, name)
        if not name.startswith("_") and callable(obj) and not isinstance(obj, type):
            table[f"jax.nn.{name}"] = obj
    for name in _activations.__all__:
        table[f"functree.nn.{name}"] = getattr(_activations, name)
    for name in JNP_FUNCTIONS + JNP_SCALAR_TYPES:
        table[f"jax.numpy.{name}"] = getattr(jnp, name)
    for name in LAX_FUNCTIONS:
        table[f"jax.lax.{name}"] = getattr(jax.lax, name)
    names: dict[int, str] = {}
    for name, obj in table.items():
        names.setdefault(id(obj), name)
    _names.update(names)
    _table.update(table)  # last: another thread never sees names without functions


def builtin_functions() -> dict[str, Any]:
    """Public name -> function, for every builtin entry (a new dict)."""
    if not _table:
        _load()
    return dict(_table)


def builtin_name(obj: Any) -> str | None:
    """The public name of ``obj`` if it is a builtin entry (``jax.nn.relu``), else None.

    Example:
      >>> import jax, functree as ft
      >>> from functree._functions import builtin_name
      >>> builtin_name(ft.nn.relu), builtin_name(jax.nn.sigmoid), builtin_name(print)
      ('jax.nn.relu', 'jax.nn.sigmoid', None)
    """
    if not _table:
        _load()
    return _names.get(id(obj))


def function(name: str) -> Any:
    """The builtin function stored as ``name``: what a pickled :class:`ByName` loads as."""
    if not _table:
        _load()
    if name not in _table:
        raise ValueError(UNKNOWN_FUNCTION.format(name=name))
    return _table[name]


class ByName:
    """A builtin function in a pickle: stored as its public name, loaded by :func:`function`.

    Example:
      >>> import pickle, functree as ft
      >>> from functree._functions import ByName
      >>> pickle.loads(pickle.dumps(ByName("jax.nn.relu"))) is ft.nn.relu
      True
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return function, (self.name,)
