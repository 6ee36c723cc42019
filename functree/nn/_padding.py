"""Padding layers over channels-last inputs: torch's ``ZeroPad``, ``ConstantPad``,
``ReflectionPad``, ``ReplicationPad`` and ``CircularPad`` (1-D, 2-D and 3-D).

An ``n``-D pad pads the ``n`` spatial axes before the channels, ``[..., *spatial,
channels]``, any leading axes kept. ``padding`` is an int (every side of every axis) or one
entry per spatial axis **in the input's axis order** (``(depth,) height, width``), each an int
or a ``(low, high)`` pair, as ``ft.nn.Conv2D``'s ``padding``. torch's flat tuple runs the
other way, last axis first (``ZeroPad2d((left, right, top, bottom))``), so a flat tuple of
``2 n`` ints is refused with the pairs it means (:data:`TORCH_ORDER`): read in either
order it would pad another axis, silently. A 1-D pad takes torch's ``(left, right)`` as it is.

Modes (``jnp.pad``'s names in brackets): zeros / a constant (``lax.pad``: a negative pad
crops, as torch's; the crops of an axis at most its length, as torch's), reflection without the edge (``reflect``: ``[a b c]`` padded 2 is ``[c b a
b c b a]``; each pad less than the axis), replication of the edge (``edge``) and circular
(``wrap``; each pad at most the axis).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import field
from functree._repr import short_array
from functree.nn._check import LayerInputError
from functree.nn._mode import Layer
from functree.nn._window import is_int

__all__ = [
    "ZeroPad1D", "ZeroPad2D", "ZeroPad3D",
    "ConstantPad1D", "ConstantPad2D", "ConstantPad3D",
    "ReflectionPad1D", "ReflectionPad2D", "ReflectionPad3D",
    "ReplicationPad1D", "ReplicationPad2D", "ReplicationPad3D",
    "CircularPad1D", "CircularPad2D", "CircularPad3D",
    "spatial_pairs",
]

TORCH_ORDER = """\
{cls}: padding={given!r} is torch's flat order, the last axis first ({names}); ft.nn pads \
axis by axis in the input's order, one (low, high) pair per spatial axis ({axes}).

    wrong:  {cls}({given!r})
    right:  {cls}({right!r})     # torch's {torch}({given!r})"""

BAD_PADDING = """\
{cls}: padding={given!r} does not fit {n} spatial {axes_word}: an int{sign}, or {n} entries \
(one per axis: {axes}), each an int{sign} or a (low, high) pair{negative}.

    wrong:  {cls}({given!r})
    right:  {cls}({right!r})"""

NEGATIVE_PAD = """\
{cls}: padding={given!r} has a negative pad; only ZeroPad and ConstantPad crop (a {mode} pad \
reads the cropped axis).

    wrong:  {cls}({given!r})
    right:  {crop}({given!r})     # crop with a zero pad, or pad >= 0 here"""

PAD_TOO_LARGE = """\
Its {axis} ({size}) is too short for {cls}'s pad {pads}: {why} (torch raises here too).

    wrong:  ft.nn.{cls}({padding!r})(x)     # x's {axis}: {size}
    right:  ft.nn.{replicate}({padding!r})(x)     # or an input whose {axis} is >= {need}"""

CROPS_ALL = """\
Its {axis} ({size}) is cropped by {crop} by the negative pads of {pads}: a crop cannot remove more \
than the axis holds, whatever the other side pads (torch crops first and raises "narrow(): length \
must be non-negative").

    wrong:  ft.nn.{cls}({padding!r})(x)     # x's {axis}: {size}
    right:  ft.nn.{cls}({padding!r})(x)     # x with {axis} >= {need}, or pads that crop less"""

BAD_VALUE = """\
{cls}: value={given!r} is not a number (torch's value= is the fill).

    wrong:  ft.nn.{cls}(1, {given!r})
    right:  ft.nn.{cls}(1, 0.5)"""

FILL_NOT_REPRESENTABLE = """\
{cls}: value={value!r} does not fit the input's dtype {dtype} ({cast}); torch truncates a \
fraction without a word and refuses an out-of-range fill.

    wrong:  ft.nn.{cls}(1, {value!r})(x)                        # x: {dtype}
    right:  ft.nn.{cls}(1, {value!r})(x.astype(jnp.float32))    # or a fill that {dtype} holds"""

MISSING_AXES = """\
{cls} pads {n} spatial {axes_word} before the channels, [..., {axes}, channels]: an input of {need} \
axes or more, got {given}.

    wrong:  ft.nn.{cls}(1)(x)     # x: {given}
    right:  ft.nn.{cls}(1)(x[..., None])     # one channel on a last axis of its own"""

_AXES = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}
_TORCH_SIDES = {2: "left, right, top, bottom", 3: "left, right, top, bottom, front, back"}

# mode -> (jnp.pad's mode, whether the axis fits pads (lo, hi), the length it needs, why)
_MODES: dict[str, tuple[str, Any, Any, str]] = {
    "reflect": ("reflect", lambda length, lo, hi: max(lo, hi) < length, lambda lo, hi: max(lo, hi) + 1,
                "a reflection reads each pad from the axis without its edge, so each pad must be less "
                "than the length"),
    "replicate": ("edge", lambda length, lo, hi: length > 0 or lo + hi == 0, lambda lo, hi: 1,
                  "an empty axis has no edge to repeat"),
    "circular": ("wrap", lambda length, lo, hi: max(lo, hi) <= length, lambda lo, hi: max(lo, hi),
                 "each pad wraps the axis around at most once"),
}


def _show(pairs: tuple[tuple[int, int], ...]) -> Any:
    """Pairs as a user writes them: one int where every side of every axis has it."""
    return pairs[0][0] if len({v for pair in pairs for v in pair}) == 1 else pairs


def spatial_pairs(cls: str, value: Any, n: int, negative: bool) -> tuple[tuple[int, int], ...]:
    """``padding`` as ``n`` ``(low, high)`` pairs in axis order (refusals: module doc).

    Example:
      >>> spatial_pairs("ZeroPad2D", (1, (0, 2)), 2, negative=False)
      ((1, 1), (0, 2))
    """
    ok = is_int  # a negative pad is read here, refused by the layer that cannot crop (NEGATIVE_PAD)
    if ok(value):
        return ((int(value), int(value)),) * n
    entries = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
    if n == 1 and entries is not None and len(entries) == 2 and all(ok(v) for v in entries):
        return ((int(entries[0]), int(entries[1])),)  # torch's (left, right): one axis, no order to mistake
    if n > 1 and entries is not None and len(entries) == 2 * n and all(is_int(v) for v in entries):
        pairs = tuple((int(entries[2 * i]), int(entries[2 * i + 1])) for i in range(n))[::-1]
        raise ValueError(TORCH_ORDER.format(cls=cls, given=value, names=_TORCH_SIDES[n], axes=", ".join(_AXES[n]),
                                            right=pairs, torch=cls[:-1] + "d"))

    def pair(p: Any) -> tuple[int, int] | None:
        if ok(p):
            return (int(p), int(p))
        if isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2 and all(ok(v) for v in p):
            return (int(p[0]), int(p[1]))
        return None

    pairs = [pair(p) for p in entries] if entries is not None else []
    if len(pairs) != n or any(p is None for p in pairs):
        sign = "" if negative else " >= 0"
        raise ValueError(BAD_PADDING.format(cls=cls, given=value, n=n, axes_word="axis" if n == 1 else "axes",
                                            axes=", ".join(_AXES[n]), sign=sign,
                                            negative=" (negative: cropped)" if negative else "",
                                            right=(1, 2) if n == 1 else ((1, 1), (0, 2), (2, 0))[3 - n:]))
    return tuple(p for p in pairs if p is not None)


class _Pad(Layer):
    padding: tuple[tuple[int, int], ...] = field(static=True, default=((0, 0),))

    _rank: ClassVar[int] = 1
    _mode: ClassVar[str] = "constant"

    def __init__(self, padding: int | Sequence[Any]):
        name, crops = type(self).__name__, self._mode == "constant"
        self.padding = spatial_pairs(name, padding, self._rank, crops)
        if not crops and any(v < 0 for pair in self.padding for v in pair):
            raise ValueError(NEGATIVE_PAD.format(cls=name, given=padding, mode=self._mode,
                                                 crop=f"ZeroPad{self._rank}D"))

    @property
    def _fill(self) -> float:
        return 0.0

    def _check(self, x: Any) -> None:
        n, name = self._rank, type(self).__name__
        names = _AXES[n]
        pattern = "[..., " + ", ".join(names) + ", channels]"
        if jnp.ndim(x) < n + 1:
            given = short_array(x) if hasattr(x, "shape") else repr(x)
            raise LayerInputError(self, pattern, given, MISSING_AXES.format(
                cls=name, n=n, axes_word="axis" if n == 1 else "axes", axes=", ".join(names), need=n + 1, given=given))
        lengths = jnp.shape(x)[jnp.ndim(x) - n - 1:-1]
        for axis, length, (lo, hi) in zip(names, lengths, self.padding):
            if self._mode == "constant":
                need = -min(lo, 0) - min(hi, 0)  # torch crops before it pads: (-4, 1) on 3 is refused, not [0, 0]
                if length < need:
                    raise LayerInputError(self, f"{pattern} with {axis} >= {need}", short_array(x),
                                          CROPS_ALL.format(axis=axis, size=length, crop=need, pads=(lo, hi), cls=name,
                                                           padding=_show(self.padding), need=need))
                continue
            _, fits, need, why = _MODES[self._mode]
            if not fits(length, lo, hi):
                raise LayerInputError(self, f"{pattern} with {axis} >= {need(lo, hi)}", short_array(x),
                                      PAD_TOO_LARGE.format(axis=axis, size=length, cls=name, pads=(lo, hi), why=why,
                                                           padding=_show(self.padding), replicate=f"ReplicationPad{n}D",
                                                           need=need(lo, hi)))

    def __call__(self, x: jax.Array) -> jax.Array:
        self._check(x)
        lead = x.ndim - self._rank - 1
        pads = ((0, 0),) * lead + self.padding + ((0, 0),)
        if self._mode == "constant":  # lax.pad: a negative pad crops
            fill = jnp.asarray(self._fill, x.dtype)
            return jax.lax.pad(x, fill, [(lo, hi, 0) for lo, hi in pads])
        return jnp.pad(x, pads, mode=_MODES[self._mode][0])


_DOC = """{what} the {n}-D spatial axes of ``[..., {spatial}, channels]`` (torch's ``{torch}``, channels last).

    ``padding``: an int (every side), or one int or ``(low, high)`` pair per spatial axis in
    the input's order ({spatial}){order}. {rule}

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([1., 2., 3.]).reshape({shape})
      >>> ft.nn.{name}({example})(x).ravel()
      {out}
    """

_ORDER = {1: "; torch's ``(left, right)`` too", 2: " (torch's flat ``(left, right, top, bottom)`` is refused: "
          "``((top, bottom), (left, right))``)", 3: " (torch's flat six ints, last axis first, are refused)"}
_RULES = {
    "zero": "``y`` is ``x`` with zeros around it; a negative pad crops.",
    "constant": "``y`` is ``x`` with ``value`` around it (torch's ``value=``, static); a negative pad crops. "
                "A fill an integer or bool input cannot hold (0.5, 300 for uint8) is refused, where torch truncates.",
    "reflect": "Each pad mirrors the axis without its edge, ``x[lo], ..., x[1], x[0], x[1], ...`` (each pad < the axis).",
    "replicate": "Each pad repeats the edge element, ``x[0], ..., x[0], x[0], x[1], ...``.",
    "circular": "Each pad wraps around, ``x[L - lo], ..., x[L - 1], x[0], ...`` (each pad <= the axis).",
}
_OUT = {"zero": "Array([0., 0., 1., 2., 3., 0.], dtype=float32)",
        "constant": "Array([-1., -1.,  1.,  2.,  3., -1.], dtype=float32)",
        "reflect": "Array([3., 2., 1., 2., 3., 2.], dtype=float32)",
        "replicate": "Array([1., 1., 1., 2., 3., 3.], dtype=float32)",
        "circular": "Array([2., 3., 1., 2., 3., 1.], dtype=float32)"}
_WHAT = {"zero": "Pad with zeros", "constant": "Pad with a constant", "reflect": "Pad by reflection",
         "replicate": "Pad by replicating the edge", "circular": "Pad circularly"}
_TORCH = {"zero": "ZeroPad", "constant": "ConstantPad", "reflect": "ReflectionPad", "replicate": "ReplicationPad",
          "circular": "CircularPad"}


def _doc(kind: str, n: int) -> str:
    name = f"{_TORCH[kind]}{n}D"
    shape = ", ".join(["1"] * (n - 1) + ["3", "1"])
    pads = "(2, 1)" if n == 1 else "(" + ", ".join(["0"] * (n - 1) + ["(2, 1)"]) + ")"
    example = pads + (", -1.0" if kind == "constant" else "")
    return _DOC.format(what=_WHAT[kind], n=n, spatial=", ".join(_AXES[n]), torch=f"{_TORCH[kind]}{n}d",
                       order=_ORDER[n], rule=_RULES[kind], shape=shape, name=name, example=example, out=_OUT[kind])


class _ConstantPad(_Pad):
    value: float = field(static=True, default=0.0)

    def __init__(self, padding: int | Sequence[Any], value: float = 0.0):
        super().__init__(padding)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)  # a NumPy scalar
            except (TypeError, ValueError):
                raise TypeError(BAD_VALUE.format(cls=type(self).__name__, given=value)) from None
        self.value = float(value)

    @property
    def _fill(self) -> float:
        return self.value

    def _check(self, x: Any) -> None:
        super()._check(x)
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
            return
        with np.errstate(invalid="ignore", over="ignore"):
            cast = np.asarray(self.value).astype(dtype) if np.isfinite(self.value) else None
        if cast is None or float(cast) != self.value:  # a fraction, out of range, inf or NaN
            raise ValueError(FILL_NOT_REPRESENTABLE.format(cls=type(self).__name__, value=self.value,
                                                           dtype=dtype.name,
                                                           cast="no such value" if cast is None
                                                           else f"it would pad with {cast.item()!r}"))


class ZeroPad1D(_Pad):
    _rank: ClassVar[int] = 1
    __doc__ = _doc("zero", 1)


class ZeroPad2D(_Pad):
    _rank: ClassVar[int] = 2
    __doc__ = _doc("zero", 2)


class ZeroPad3D(_Pad):
    _rank: ClassVar[int] = 3
    __doc__ = _doc("zero", 3)


class ConstantPad1D(_ConstantPad):
    _rank: ClassVar[int] = 1
    __doc__ = _doc("constant", 1)


class ConstantPad2D(_ConstantPad):
    _rank: ClassVar[int] = 2
    __doc__ = _doc("constant", 2)


class ConstantPad3D(_ConstantPad):
    _rank: ClassVar[int] = 3
    __doc__ = _doc("constant", 3)


class ReflectionPad1D(_Pad):
    _rank: ClassVar[int] = 1
    _mode: ClassVar[str] = "reflect"
    __doc__ = _doc("reflect", 1)


class ReflectionPad2D(_Pad):
    _rank: ClassVar[int] = 2
    _mode: ClassVar[str] = "reflect"
    __doc__ = _doc("reflect", 2)


class ReflectionPad3D(_Pad):
    _rank: ClassVar[int] = 3
    _mode: ClassVar[str] = "reflect"
    __doc__ = _doc("reflect", 3)


class ReplicationPad1D(_Pad):
    _rank: ClassVar[int] = 1
    _mode: ClassVar[str] = "replicate"
    __doc__ = _doc("replicate", 1)


class ReplicationPad2D(_Pad):
    _rank: ClassVar[int] = 2
    _mode: ClassVar[str] = "replicate"
    __doc__ = _doc("replicate", 2)


class ReplicationPad3D(_Pad):
    _rank: ClassVar[int] = 3
    _mode: ClassVar[str] = "replicate"
    __doc__ = _doc("replicate", 3)


class CircularPad1D(_Pad):
    _rank: ClassVar[int] = 1
    _mode: ClassVar[str] = "circular"
    __doc__ = _doc("circular", 1)


class CircularPad2D(_Pad):
    _rank: ClassVar[int] = 2
    _mode: ClassVar[str] = "circular"
    __doc__ = _doc("circular", 2)


class CircularPad3D(_Pad):
    _rank: ClassVar[int] = 3
    _mode: ClassVar[str] = "circular"
    __doc__ = _doc("circular", 3)
