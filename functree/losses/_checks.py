"""Input checks shared by torch's losses (:mod:`functree.losses._likelihood`, ``_margin``,
``_distance``, ``_sequence``): labels in {-1, 1}, class indices, class weights, shapes.

Each check reads concrete inputs on the host; traced ones (under a ``jax.jit`` of your own)
cannot be read, and the loss's kernel makes an invalid position's loss NaN instead, never
a plausible number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._repr import first_index, short_array
from functree.losses._reduction import _array, _describe

__all__ = ["check_signed", "check_indices", "class_weight", "check_shape", "check_number", "host_or_none",
           "SIGNED_LABELS", "INDEX_LABELS", "INDEX_OUT_OF_RANGE", "BAD_CLASS_WEIGHT", "SHAPES", "BAD_NUMBER",
           "NO_CLASS_AXIS", "check_class_axis"]

SIGNED_LABELS = """\
{loss}: {what} must be -1 or 1 (the sign says which side of the margin), but {what}{where} is \
{value}. torch's {torch} takes any other value silently ({effect}); 0/1 labels are read here as \
neither. Map them to -1/1:

    wrong:  ft.losses.{loss}({call})            # {what} in {{0, 1}}
    right:  ft.losses.{loss}({fixed})   # {what} in {{-1, 1}}
"""

INDEX_LABELS = """\
{loss}: {what} must be integer class indices {shape}, got {given}.

    wrong:  ft.losses.{loss}(scores, labels)                      # labels {given}
    right:  ft.losses.{loss}(scores, labels.astype(jnp.int32))    # labels int {shape}
"""

INDEX_OUT_OF_RANGE = """\
{loss}: label {label} at {what}{where} is not a class of {scores} (classes 0 to {last}{allowed}). \
A label outside the classes is never read as one (a gather would clamp it to the last class, or \
a negative one index from the end).

    wrong:  ft.losses.{loss}(scores, labels)          # labels hold {label}
    right:  labels in 0 .. {last}{fix}
"""

BAD_CLASS_WEIGHT = """\
{loss}: weight must be one floating weight per class, f32[{classes}] for {scores} (torch's \
{torch}(weight=)); got {given}.

    wrong:  ft.losses.{loss}(scores, labels, weight=w)                           # w {given}
    right:  ft.losses.{loss}(scores, labels, weight=jnp.asarray(w, jnp.float32))   # w [{classes}]
"""

SHAPES = """\
{loss}: {what} must have the shape {expected}, got {given}. Broadcasting would silently pair \
every element with every other.

    wrong:  ft.losses.{loss}({call})     # {what} {given}
    right:  ft.losses.{loss}({fixed})
"""

NO_CLASS_AXIS = """\
{loss}: {what} must have a class axis (the last), got {given}.

    wrong:  ft.losses.{loss}(score, label)             # one example's scalar
    right:  ft.losses.{loss}(scores, labels)           # {what} [..., classes]
"""

BAD_NUMBER = """\
{loss}: {name} must be {rule}, got {given!r}.

    wrong:  ft.losses.{loss}(..., {name}={given!r})
    right:  ft.losses.{loss}(..., {name}={default!r})
"""


BAD_ELEMENT_WEIGHT = """\
{loss}: weight must be a floating array that broadcasts to {shape} (torch's {torch}(weight=): \
a weight per element, or per class f32[{last}]); got {given}.

    wrong:  ft.losses.{loss}(predicted, expected, weight=w)                            # w {given}
    right:  ft.losses.{loss}(predicted, expected, weight=jnp.asarray(w, jnp.float32))    # w [{last}]
"""

def host_or_none(x: Any) -> np.ndarray | None:
    """``x`` read on the host, or None where it is traced (under ``jax.jit`` or ``jax.grad``)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_signed(loss: str, what: str, y: Any, *, torch: str, effect: str, call: str) -> Any:
    """``y`` as an array, or :data:`SIGNED_LABELS` where a concrete entry is neither -1 nor 1.
    ``call`` is the loss's call with ``{what}`` in it (``x1, x2, y``)."""
    y = _array(y)
    given = host_or_none(y)
    if given is None:
        return y
    bad = (given != 1) & (given != -1)
    if bad.any():
        index = first_index(bad)
        where = str(list(index)) if index else ""
        raise ValueError(SIGNED_LABELS.format(loss=loss, what=what, where=where, value=f"{float(given[index]):g}",
                                              torch=torch, effect=effect, call=call,
                                              fixed=call.replace(what, f"2 * {what} - 1", 1)))
    return y


def check_indices(loss: str, what: str, labels: Any, shape: tuple[int, ...], scores: Any, *,
                  low: int = 0, ignore: int | None = None, allowed: str = "", fix: str = "") -> Any:
    """``labels`` as an array of integer class indices of ``shape`` whose concrete values lie in
    ``[low, classes)`` or equal ``ignore`` (``low=-1``: torch's terminator of multilabel
    targets; ``allowed`` and ``fix`` say so), or :data:`INDEX_LABELS` /
    :data:`INDEX_OUT_OF_RANGE`. NumPy labels are read as given, before JAX's int32 could wrap
    an int64."""
    labels = _array(labels)
    if labels.shape != shape or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(INDEX_LABELS.format(loss=loss, what=what, shape=list(shape), given=_describe(labels)))
    given = host_or_none(labels)
    if given is None:
        return labels
    classes = scores.shape[-1]
    bad = (given < low) | (given >= classes)
    if ignore is not None:
        bad &= given != ignore
    if bad.any():
        index = first_index(bad)
        raise ValueError(INDEX_OUT_OF_RANGE.format(loss=loss, what=what, where=list(index) if index else "",
                                                   label=int(given[index]), scores=short_array(scores),
                                                   last=classes - 1, allowed=allowed, fix=fix))
    return labels


def class_weight(loss: str, weight: Any, scores: Any, torch: str) -> Any:
    """``weight`` as a ``[classes]`` floating array (None stays None), or :data:`BAD_CLASS_WEIGHT`."""
    if weight is None:
        return None
    w = _array(weight)
    classes = scores.shape[-1] if scores.ndim else 1
    if w.shape != (classes,) or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(BAD_CLASS_WEIGHT.format(loss=loss, classes=classes, scores=short_array(scores), torch=torch,
                                                 given=_describe(w)))
    return w


def check_shape(loss: str, what: str, x: Any, expected: tuple[int, ...], *, call: str, fixed: str) -> Any:
    """``x`` as an array of ``expected`` shape, or :data:`SHAPES`."""
    x = _array(x)
    if x.shape != expected:
        raise ValueError(SHAPES.format(loss=loss, what=what, expected=list(expected), given=_describe(x), call=call,
                                       fixed=fixed))
    return x


def check_number(loss: str, name: str, value: Any, rule: str, default: Any, ok: Callable[[float], bool]) -> float:
    """``value`` as a Python float (a static option of the compiled kernel) where it is a
    Python or NumPy number and ``ok(value)`` holds (NaN fails), else :data:`BAD_NUMBER`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not ok(float(value)):
        raise ValueError(BAD_NUMBER.format(loss=loss, name=name, rule=rule, given=value, default=default))
    return float(value)


def check_class_axis(loss: str, what: str, x: Any) -> None:
    """:data:`NO_CLASS_AXIS` for a scalar ``x``."""
    if not x.ndim:
        raise ValueError(NO_CLASS_AXIS.format(loss=loss, what=what, given=_describe(x)))


def element_weight(loss: str, weight: Any, shape: tuple[int, ...], torch: str) -> Any:
    """``weight`` as a floating array broadcasting to ``shape`` (None stays None), or
    :data:`BAD_ELEMENT_WEIGHT`."""
    if weight is None:
        return None
    w = _array(weight)
    try:
        fits = jnp.broadcast_shapes(w.shape, shape) == shape
    except ValueError:
        fits = False
    if not (fits and jnp.issubdtype(w.dtype, jnp.floating)):
        raise ValueError(BAD_ELEMENT_WEIGHT.format(loss=loss, shape=list(shape), torch=torch, given=_describe(w),
                                                   last=shape[-1] if shape else 1))
    return w
