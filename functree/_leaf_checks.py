"""What ``ft.set`` checks at a leaf: the new value has the old one's shape and dtype.

An array leaf takes an array of its shape and dtype, or a number of its kind (a Python
``int`` fits a float leaf); a Python-number leaf takes a number or a 0-d array of its kind
and keeps its Python type. Anything else raises naming the key path, what the leaf is,
what it takes, and the conversion that fixes it.

Example:
  >>> import jax.numpy as jnp
  >>> from functree._leaf_checks import check_leaf
  >>> check_leaf(".w", jnp.zeros(2), jnp.ones(2))
  Array([1., 1.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._tree import is_array_or_numpy_scalar

__all__ = ["leaf_spec", "quoted", "check_leaf"]

SHAPE_MISMATCH = """\
ft.set({path}): expected shape {expected_shape} and dtype {expected_dtype}, \
got shape {given_shape} and dtype {given_dtype}.
    wrong:  ft.set(tree, {quoted}, value)
    right:  ft.set(tree, {quoted}, {fix}){hint}"""

TRANSPOSED = """
A matrix of the reversed shape is the transpose, as a torch Linear weight (out, in) is of a \
Dense's (in, out): value.T puts each number in place, where a reshape would scramble them \
(ft.interop.load_torch_state_dict transposes torch weights itself)."""

SAME_SIZE = """
Both hold {size} numbers, but only a reshape that adds or removes axes of length 1 keeps \
them in place: put the axes in the leaf's order (value.T, jnp.transpose(value, axes)), \
then reshape if the layouts agree."""

LEAF_MISMATCH = """\
ft.set({path}): the value there is {expected}, so it takes {accepts}; given {given}.
    right:  ft.set(tree, {quoted}, {fix}){note}"""


def leaf_spec(x: Any) -> tuple[tuple[int, ...], Any] | None:
    if is_array_or_numpy_scalar(x) or isinstance(x, jax.ShapeDtypeStruct):
        return tuple(x.shape), x.dtype
    return None


# ----------------------------------------------------------------- leaf checks of ft.set
# Kinds: "b" bool, "i" integer, "f" floating, "c" complex. A Python number fits a leaf of
# its own kind or of a wider one (an int fits a float leaf, a float fits a complex leaf).
_WIDER = {"b": "b", "i": "ifc", "f": "fc", "c": "c"}
_PY_TYPES = {"b": bool, "i": int, "f": float, "c": complex}
_PY_EXAMPLES = {"b": "True", "i": "2", "f": "2.0", "c": "1.0 + 2.0j"}
_PY_ACCEPTS = {
    "b": "a bool or a 0-d bool array",
    "i": "an int or a 0-d integer array",
    "f": "a float, an int or a 0-d floating array",
    "c": "a number or a 0-d floating or complex array",
}
_PY_NUMBERS = {"b": "bool", "i": "int", "f": "float or int", "c": "complex, float or int"}


def _number_kind(x: Any) -> str | None:
    """The kind of a Python number (``True`` → "b", ``2`` → "i"), None for anything else."""
    if isinstance(x, (np.generic, jax.Array)):
        return None
    for kind in "bifc":  # bool before int: a bool is an int
        if isinstance(x, _PY_TYPES[kind]):
            return kind
    return None


def _dtype_kind(dtype: Any) -> str | None:
    for kind, generic in (("b", jnp.bool_), ("i", jnp.integer), ("f", jnp.floating), ("c", jnp.complexfloating)):
        if jnp.issubdtype(dtype, generic):
            return kind
    return None


def quoted(path: Any) -> str:
    """``path`` as a string literal for a fix in an error message, double-quoted when it can be."""
    text = str(path)
    plain = '"' not in text and "\\" not in text and text.isprintable()
    return f'"{text}"' if plain else repr(text)


def _describe(x: Any) -> str:
    spec = leaf_spec(x)
    if spec is not None:
        return f"an array of shape {spec[0]} and dtype {spec[1]}"
    text = repr(x)
    shown = f" {text}" if len(text) <= 40 else ""
    return f"a {type(x).__name__}{shown}" if _number_kind(x) is None else f"a Python {type(x).__name__}{shown}"


def check_leaf(path: Any, old: Any, new: Any) -> Any:
    """``new`` if it fits the leaf ``old`` (same shape and dtype, or a number of its kind)."""
    old_kind = _number_kind(old)
    if old_kind is not None:
        return _check_python_scalar(path, old_kind, new)
    old_spec = leaf_spec(old)
    if old_spec is None:
        return new  # not a leaf (a submodule, None, a static value): anything goes
    new_spec = leaf_spec(new)
    shape, dtype = old_spec
    if new_spec is not None:
        if new_spec != old_spec:
            fix, hint = _conversion(new_spec[0], new_spec[1], shape, dtype)
            raise ValueError(
                SHAPE_MISMATCH.format(
                    path=path, quoted=quoted(path), expected_shape=shape,
                    expected_dtype=dtype, given_shape=new_spec[0], given_dtype=new_spec[1],
                    fix=fix, hint=hint,
                )
            )
        return new
    kind, leaf_kind = _number_kind(new), _dtype_kind(dtype)
    if shape == () and kind is not None and leaf_kind is not None and leaf_kind in _WIDER[kind]:
        return new
    accepts = "an array of that shape and dtype"
    if shape == () and leaf_kind is not None:
        accepts += f" or a Python {_PY_NUMBERS[leaf_kind]}"
    raise ValueError(
        LEAF_MISMATCH.format(
            path=path, quoted=quoted(path), expected=f"an array of shape {shape} and dtype {dtype}",
            accepts=accepts, given=_describe(new), fix=f"jnp.asarray(value, jnp.{dtype}).reshape({shape})", note="",
        )
    )


def _conversion(given: tuple[int, ...], given_dtype: Any, shape: tuple[int, ...], dtype: Any) -> tuple[str, str]:
    """``(code, hint)``: the code that converts a value of shape ``given`` to the leaf's, and
    what follows the ``right:`` line.

    Only conversions that keep every number at its place are code: a cast, the transpose of
    a 2-D matrix of the reversed shape (a torch Linear weight), a reshape that adds or
    removes axes of length 1, a broadcast. A reshape between other layouts of the same
    size would silently scramble the values (``(3, 2)`` read as ``(2, 3)`` is not its
    transpose), so it is described, not offered (a batched leaf of a vmapped ensemble
    needs one value per member)."""
    cast = "" if given_dtype == dtype else f".astype(jnp.{dtype})"
    if given == shape:
        return f"value{cast}", ""
    if len(given) == 2 and given == shape[::-1]:
        return f"value.T{cast}", TRANSPOSED
    if _without_unit_axes(given) == _without_unit_axes(shape):
        return f"value{cast}.reshape({shape})", ""
    try:
        if np.broadcast_shapes(given, shape) == shape:
            return f"jnp.broadcast_to(value{cast}, {shape})", ""
    except ValueError:
        pass
    size, leaf_size = int(np.prod(given)), int(np.prod(shape))
    if size == leaf_size:
        return "new_value", f"   # of shape {shape}{SAME_SIZE.format(size=size)}"
    return "new_value", f"   # of shape {shape} (this one has {size} elements, the leaf {leaf_size})"


def _without_unit_axes(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _check_python_scalar(path: Any, old_kind: str, new: Any) -> Any:
    """A Python scalar leaf takes a number or a 0-d array of its kind; a number keeps its type."""
    kind = _number_kind(new)
    spec = leaf_spec(new)
    if kind is None and spec is not None and spec[0] == ():
        kind = _dtype_kind(spec[1])
    if kind is not None and old_kind in _WIDER[kind]:
        return _PY_TYPES[old_kind](new) if _number_kind(new) is not None else new
    py = _PY_TYPES[old_kind].__name__
    fix, note = f"{py}(value)", ""
    if spec is not None and int(np.prod(spec[0])) != 1:  # float(value) of 2 numbers fails
        fix = _PY_EXAMPLES[old_kind]
        note = f"   # one {py}: the leaf holds one number, the value {int(np.prod(spec[0]))}"
    raise ValueError(
        LEAF_MISMATCH.format(
            path=path, quoted=quoted(path), expected=f"a Python {py}", accepts=_PY_ACCEPTS[old_kind],
            given=_describe(new), fix=fix, note=note,
        )
    )
