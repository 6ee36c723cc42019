"""Trace-time checks of layer inputs, with errors that name the layer and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._paths import KeyPath, walk
from functree._repr import short_array
from functree.nn._window import is_int

__all__ = ["LayerInputError", "BatchedLayerError", "FIX_BATCHED", "check_input", "check_unbatched", "concrete",
           "size_argument", "size_arguments", "optional_sizes"]


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array, or None when it is traced (under ``jax.jit``): what a check of
    an input's values (token ids, cache positions) reads, eagerly only."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


BAD_SIZE_ARGUMENT = """\
ft.nn.{layer}: {name}={given} is {problem}; {name} is an int >= {least}.

    wrong:  ft.nn.{layer}(..., {name}={given})
    right:  ft.nn.{layer}(..., {name}={right}){note}"""

SIZE_PROBLEMS = {  # the kind of a refused size: (what it is, the right code, a comment on it)
    "float": ("a float", "int(d // 2)", "     # d / 2 is a float in Python 3, even for an even d"),
    "array": ("an array", "int(n)", "     # a Python int: a layer's sizes are static"),
    "bool": ("a bool", "n", "     # an int >= {least}"),
    "small": ("below {least}", "n", "     # an int >= {least}"),
    "other": ("not an int ({type})", "n", "     # an int >= {least}"),
}


def size_argument(layer: str, name: str, value: Any, least: int = 0) -> int:
    """``value`` as a Python int, else :data:`BAD_SIZE_ARGUMENT` naming ``layer``'s argument
    ``name``, the value and the fix (a TypeError; a ValueError below ``least``). A float
    (``d / 2``), array, sequence or negative size failed deep inside ``jax.random`` or an
    initializer, a bool built a layer of size 1. NumPy ints are ints; 0 is a size by default
    (torch's ``Linear(0, 3)``)."""
    if is_int(value) and value >= least:
        return int(value)
    kind = ("float" if isinstance(value, (float, np.floating)) else "bool" if isinstance(value, (bool, np.bool_))
            else "small" if is_int(value) else "array" if hasattr(value, "shape") else "other")
    problem, right, note = SIZE_PROBLEMS[kind]
    given = short_array(value) if kind == "array" else repr(value)
    error = ValueError if kind == "small" else TypeError
    raise error(BAD_SIZE_ARGUMENT.format(
        layer=layer, name=name, given=given, least=least, right=right, note=note.format(least=least),
        problem=problem.format(least=least, type=type(value).__name__)))


def size_arguments(layer: str, least: int = 0, **named: Any) -> tuple[int, ...]:
    """Each of ``named`` as a Python int (:func:`size_argument`), in order: one line that
    checks every size a layer's constructor takes."""
    return tuple(size_argument(layer, name, value, least) for name, value in named.items())


def optional_sizes(layer: str, least: int = 0, **named: Any) -> tuple[int | None, ...]:
    """:func:`size_arguments` of sizes that may be None (derived from another by default)."""
    return tuple(None if value is None else size_argument(layer, name, value, least) for name, value in named.items())


WRONG_INPUT = """\
{layer}{where} expects inputs {expected}, got {given}.
{fix}"""

FIX_FLOAT = "Pass a floating array, e.g. layer(x.astype(jnp.float32))."
FIX_INT = "Pass integer indices, e.g. layer(tokens.astype(jnp.int32))."
FIX_SHAPE = "Pass a batch whose last axes are {pattern}, or build the layer for the size you have ({given_last})."

BATCHED_LAYER = """\
{layer}{where} holds {given}, but {expected}: the leading axes are a batch of \
layers, as in models built with jax.vmap (an ensemble), which a call outside jax.vmap would mix \
or misread. Call the models inside jax.vmap, one at a time:
{fix}"""

FIX_BATCHED = """\
    wrong:  models(x)
    right:  jax.vmap(lambda m: m(x))(models)            # the same x for every model
       or:  jax.vmap(lambda m, x: m(x))(models, xs)     # each model its own x"""


class LayerInputError(ValueError):
    """A batch with the wrong shape or dtype for a layer (raised at trace time).

    ``path`` is the layer's key path inside the model when known (``Sequential`` and
    ``ft.nn.collect_state`` fill it in as the error travels out).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Sequential(ft.nn.Dense(3, 2, key=jax.random.key(0)))
      >>> try:
      ...     model(jnp.ones((4, 5)))
      ... except ft.nn.LayerInputError as e:
      ...     print(e.path)
      ...     print(e)
      .layers[0]
      Dense at .layers[0] expects inputs [..., 3] (float), got f32[4,5].
      Pass a batch whose last axes are [3], or build the layer for the size you have (last axis 5).
    """

    template = WRONG_INPUT

    def __init__(
        self, layer: Any, expected: str, given: str, fix: str, path: Any = None
    ) -> None:
        self.layer, self.expected, self.given, self.fix, self.path = (
            layer, expected, given, fix, path
        )
        where = "" if path is None else f" at {path}"
        super().__init__(
            self.template.format(
                layer=type(layer).__name__, where=where, expected=expected, given=given, fix=fix
            )
        )

    def at(self, path: Any) -> LayerInputError:
        """The same error with the layer's key path set to ``path``."""
        return type(self)(self.layer, self.expected, self.given, self.fix, path)

    def under(self, prefix: Any) -> LayerInputError:
        """The same error with ``prefix`` prepended to the key path."""
        return self.at(KeyPath(prefix) + (self.path or KeyPath()))

    def within(self, container: Any, prefix: Any) -> LayerInputError:
        """The error raised while ``container`` (at ``prefix``) ran: its path without one
        is the raising layer's own key path inside ``container`` (found by identity: a
        user block calling ``self.attn(x)`` raises from ``container.attn``)."""
        if self.path is None and self.layer is not container:
            found = next((path for path, node in walk(container) if node is self.layer), None)
            if found is not None:
                return self.at(found).under(prefix)
        return self.under(prefix)


class BatchedLayerError(LayerInputError):
    """A layer whose parameters have more axes than its kind holds: a batch of layers (models
    built with ``jax.vmap``) called outside ``jax.vmap`` (:func:`check_unbatched`)."""

    template = BATCHED_LAYER


def check_unbatched(layer: Any, **ranks: int) -> None:
    """Raise :class:`BatchedLayerError` where a parameter of ``layer`` (named by ``ranks``,
    None skipped) has more axes than its rank: an ensemble's layer called outside
    ``jax.vmap``. Its first check read the batch size as the input size (``Dense expects
    inputs [..., 5]`` for 5 models of 4 inputs), and where the two were equal ``x @ weight``
    broadcast over the models and the biases over the batch rows, silently."""
    for name, rank in ranks.items():
        value = getattr(layer, name)
        if value is not None and jnp.ndim(value) > rank:
            kind = type(layer).__name__
            owner = kind + ("'" if kind.endswith("s") else "'s")  # one Experts' gate_up_proj
            expected = f"one {owner} {name} has {rank} ax{'i' if rank == 1 else 'e'}s"
            raise BatchedLayerError(layer, expected, f"{name} {short_array(value)}", FIX_BATCHED)


def _pattern(trailing: Sequence[int | str | None], leading: str) -> str:
    dims = [str(d) if d is not None else "_" for d in trailing]
    return "[" + ", ".join(([leading] if leading else []) + dims) + "]"


def check_input(
    layer: Any,
    x: Any,
    trailing: Sequence[int | str | None],
    *,
    kind: str = "float",
    leading: str = "...",
    min_rank: int | None = None,
) -> None:
    """Raise :class:`LayerInputError` unless ``x`` is ``[..., *trailing]`` of dtype ``kind``.

    ``trailing`` entries are sizes, or a name/None for any size. ``kind`` is ``"float"``
    (inexact dtypes) or ``"int"`` (integer dtypes).
    """
    shape = jnp.shape(x)
    dtype = getattr(x, "dtype", None)
    dtype = jnp.result_type(x) if dtype is None else dtype
    expected = f"{_pattern(trailing, leading)} ({kind})"
    given = short_array(x) if hasattr(x, "shape") else f"{type(x).__name__} {shape}"
    need = len(trailing) if min_rank is None else max(min_rank, len(trailing))
    ok_kind = jnp.issubdtype(dtype, jnp.inexact if kind == "float" else jnp.integer)
    if not ok_kind:
        raise LayerInputError(layer, expected, given, FIX_FLOAT if kind == "float" else FIX_INT)
    ok_shape = len(shape) >= need and all(
        not isinstance(d, int) or d == s for d, s in zip(trailing, shape[len(shape) - len(trailing):])
    )
    if not ok_shape:
        given_last = f"last axis {shape[-1]}" if shape else "a scalar"
        fix = FIX_SHAPE.format(pattern=_pattern(trailing, ""), given_last=given_last)
        raise LayerInputError(layer, expected, given, fix)
