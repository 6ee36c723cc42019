"""The repr of a model: ``Dense(weight=f32[2,4], bias=f32[4], activation=relu)``.

``Module.__repr__`` and ``_repr_html_`` call :func:`module_repr` / :func:`module_html`;
layers' error messages show arrays as :func:`short_array`. Below ``functree._module``: a
Module is recognised by its class's ``__ft_fields__``, not by importing the class.

An array a step donated (``model, state, out = step(model, state, batch)``: the old ones'
buffers are the new ones') is shown as ``<deleted f32[4,4]>``: JAX's own repr of it raises
"Array has been deleted", and printed inside a state or a model that error came from deep
in the repr. :func:`shown_repr` is the repr of any tree with such stand-ins.
"""

from __future__ import annotations

import html
from typing import Any

import jax
import numpy as np

from functree._alias import is_deleted

__all__ = ["short_array", "first_index", "module_repr", "module_html", "shown_repr"]

_SHORT_DTYPES = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int32": "i32", "int64": "i64", "int8": "i8", "int16": "i16", "uint8": "u8",
    "uint32": "u32", "bool": "bool", "complex64": "c64", "complex128": "c128",
}


def first_index(flags: Any) -> tuple[int, ...]:
    """The index of the first true entry of a host boolean array (row-major), as Python ints:
    where an error message points (``labels[1, 0]``). The caller knows one is true.

    Example:
      >>> import numpy as np
      >>> first_index(np.array([[False, False], [True, True]]))
      (1, 0)
    """
    return tuple(int(i) for i in np.argwhere(flags)[0])


def short_array(x: Any) -> str:
    """``f32[2,4]`` for an array (or ShapeDtypeStruct / tracer)."""
    dtype = _SHORT_DTYPES.get(str(x.dtype), str(x.dtype))
    return f"{dtype}[{','.join(map(str, x.shape))}]"


class _Deleted:
    """A deleted array's stand-in in a repr: its shape and dtype, which JAX still reads."""

    __slots__ = ("text",)

    def __init__(self, x: Any):
        self.text = f"<deleted {short_array(x)}>"

    def __repr__(self) -> str:
        return self.text


def shown_repr(tree: Any) -> str:
    """``repr(tree)`` with each deleted (donated) array shown as ``<deleted f32[4,4]>``
    (:class:`_Deleted`, in a copy of the tree); the tree's own repr when none is. A tree
    that cannot be rebuilt with the stand-ins names its type and how many were deleted.

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.ones((2, 3))
      >>> w.delete()
      >>> shown_repr({"w": w, "step": 3})
      "{'step': 3, 'w': <deleted f32[2,3]>}"
    """
    leaves = jax.tree.leaves(tree)
    deleted = sum(map(is_deleted, leaves))
    if not deleted:
        return repr(tree)
    try:
        shown = jax.tree.map(lambda x: _Deleted(x) if is_deleted(x) else x, tree)
    except Exception:  # a node whose unflatten checks its leaves
        return f"<{type(tree).__name__}: {deleted} of its {len(leaves)} arrays deleted>"
    return repr(shown)


def _value_repr(x: Any, indent: int) -> str:
    if hasattr(type(x), "__ft_fields__"):  # a Module (functree._module imports this module)
        return module_repr(x, indent)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"<deleted {short_array(x)}>" if is_deleted(x) else short_array(x)
    if isinstance(x, list):
        return _sequence([_value_repr(v, indent + 2) for v in x], "[", "]", indent)
    if isinstance(x, tuple) and type(x).__repr__ is tuple.__repr__:  # not a NamedTuple, KeyPath
        items = [_value_repr(v, indent + 2) for v in x]
        return _sequence(items, "(", ",)" if len(x) == 1 else ")", indent)
    if isinstance(x, dict):
        items = [f"{k!r}: {_value_repr(v, indent + 2)}" for k, v in x.items()]
        return _sequence(items, "{", "}", indent)
    if callable(x) and hasattr(x, "__name__"):
        return x.__name__
    # Another library's multi-line repr (an Equinox module): indent it under its field.
    return shown_repr(x).replace("\n", "\n" + " " * indent)


def _sequence(items: list[str], open_: str, close: str, indent: int) -> str:
    """One line when it fits; otherwise one item per line, indented under the opener."""
    one_line = open_ + ", ".join(items) + close
    if len(one_line) + indent <= 88 and "\n" not in one_line:
        return one_line
    pad = " " * (indent + 2)
    return open_ + "\n" + "".join(f"{pad}{item},\n" for item in items) + " " * indent + close.lstrip(",")


def module_repr(m: Any, indent: int = 0) -> str:
    """``Dense(weight=f32[2,4], bias=f32[4], activation=relu)``; nested models on lines."""
    cls = type(m)
    hidden = getattr(cls, "__ft_repr_hidden__", ())  # bookkeeping a user never sets (a Stack's ranks)
    if_set = getattr(cls, "__ft_repr_if_set__", ())  # shown when not None (a BatchNorm's count: momentum=None's)
    parts = [f"{n}={_value_repr(m.__dict__.get(n, '?'), indent + 2)}" for n in cls.__ft_fields__
             if n not in hidden and not (n in if_set and m.__dict__.get(n) is None)]
    one_line = f"{cls.__name__}({', '.join(parts)})"
    if len(one_line) + indent <= 88 and "\n" not in one_line:
        return one_line
    pad = " " * (indent + 2)
    return f"{cls.__name__}(\n" + "".join(f"{pad}{p},\n" for p in parts) + " " * indent + ")"


def module_html(m: Any) -> str:
    return f"<pre>{html.escape(module_repr(m))}</pre>"
