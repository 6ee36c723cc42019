"""Convolutions over channels-last inputs: ``Conv1D``, ``Conv2D``, ``Conv3D`` and their transposes.

Inputs are ``[..., *spatial, in_channels]`` (swift-apis' NWC / NHWC / NDHWC) with any number of
leading batch axes (none included); filters are ``[*kernel_size, in_channels // groups,
out_channels]`` (WIO / HWIO / DHWIO), glorot-uniform, biases zero. In bfloat16 and float16 the bias
is added in float32 (``_linear.add_bias``: its gradient sums every position).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._activations import activation_argument, identity
from functree._module import field
from functree._repr import short_array
from functree.nn import _window as window
from functree.nn._abstract import initialized
from functree.nn._check import LayerInputError, check_input, check_unbatched, size_arguments
from functree.nn._linear import Dense, Initializer, add_bias, glorot_uniform
from functree.nn._mode import Layer
from functree.nn._xla_conv import dilated_axes_at_risk, pads_at_risk

__all__ = ["Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose", "check_window_fits",
           "transpose_padding", "SPATIAL"]

BAD_GROUPS = """\
{cls}: in_channels ({cin}) and out_channels ({cout}) must be divisible by groups ({groups}).

    wrong:  {cls}(3, 8, 3, groups=2, key=k)
    right:  {cls}(4, 8, 3, groups=2, key=k)
"""

GROUPS_NOT_POSITIVE = """\
{cls}: groups must be an int >= 1 (the number of channel groups, as torch's groups=), got {groups!r}.

    wrong:  {cls}(4, 8, 3, groups={groups!r}, key=k)
    right:  {cls}(4, 8, 3, groups=2, key=k)     # or groups=1: one group, an ordinary convolution
"""

Padding = str | int | Sequence[int] | Sequence[tuple[int, int]]

PADDING_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}  # -> jnp.pad's

BAD_PADDING_MODE = """\
{cls}: padding_mode={given!r} is not one of torch's {modes}.

    wrong:  {cls}(4, 8, 3, padding=1, padding_mode={given!r}, key=k)
    right:  {cls}(4, 8, 3, padding=1, padding_mode="reflect", key=k)
"""

TRANSPOSE_PADDING_MODE = """\
{cls}: padding_mode={given!r}; a transposed convolution pads with zeros only (torch: 'Only "zeros" \
padding mode is supported for ConvTranspose'): its padding pads the stride-dilated input.

    wrong:  {cls}(4, 8, 3, strides=2, padding_mode={given!r}, key=k)
    right:  {cls}(4, 8, 3, strides=2, key=k)     # padding_mode="zeros"
"""

PAD_TOO_LARGE_FOR_MODE = """\
Its {axis} ({size}) is too short for {mode} padding {pads} ({lo} before, {hi} after): {why} \
(torch raises here too).

    wrong:  {cls}(..., padding={padding}, padding_mode="{mode}")(x)     # x's {axis}: {size}
    right:  {cls}(..., padding={padding}, padding_mode="replicate")(x)     # or an input whose {axis} is >= {need}"""

_MODE_LIMITS = {  # a mode's need of an axis of length L, for pads (lo, hi): (fits, L needed, why)
    "reflect": (lambda length, lo, hi: max(lo, hi) < length, lambda lo, hi: max(lo, hi) + 1,
                "a reflection reads each side's pad from the axis without its edge, so each pad must be "
                "less than the length"),
    "circular": (lambda length, lo, hi: max(lo, hi) <= length, lambda lo, hi: max(lo, hi),
                 "each side's pad wraps the axis around at most once"),
    "replicate": (lambda length, lo, hi: length > 0 or lo + hi == 0, lambda lo, hi: 1,
                  "an empty axis has no edge to repeat"),
    "zeros": (lambda length, lo, hi: True, lambda lo, hi: 0, ""),  # (padded by hand: _xla_conv)
}

_SPEC = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}
SPATIAL = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}  # the axes' names in errors


OUTPUT_SIZE = """\
{cls}: output_size={given!r} does not fit: from {axes} {lengths} at kernel {k}, strides {s}, \
dilation {d} and padding {padding} the outputs are {low} (torch's (L - 1) s - 2 p + d (k - 1) + 1) \
and torch's output_size picks each between that and that plus the stride minus 1 (its \
output_padding): {ranges}. Give the spatial sizes, one per axis (not torch's [N, C, ...]).

    wrong:  conv(x, output_size={given!r})
    right:  conv(x, output_size={low!r})"""

CHANNELS_FIRST = """\
Its channels ({channels}) are on axis {axis}: a channels-first batch (torch's {layout}). \
{takes} channels last: jnp.moveaxis(x, {axis}, -1){also}."""

WINDOW_TOO_LARGE = """\
Its {axis} ({size}) is shorter than the window needs: {window}. The output's {axis} would \
be empty ({out}), and a mean over it NaN (torch raises here); it needs {axis} >= {need}.

    wrong:  {cls}(..., {settings})(x)     # x's {axis}: {size}
    right:  {cls}(..., {fixed})(x)     # or an input whose {axis} is >= {need}"""


def _channels_first(
    error: LayerInputError, x: Any, n: int, channels: int,
    takes: str = "ft.nn convolutions take", also: str = "",
) -> LayerInputError:
    """``error``, whose fix names the channels-last move when the channels sit where torch puts
    them (its "build the layer for the size you have" read an image's width as channels).

    ``n`` is the number of spatial axes; ``takes`` names who takes channels last and ``also``
    adds another fix (BatchNorm's ``axis=1``).
    """
    shape = jnp.shape(x)
    if n >= 1 and len(shape) >= n + 1 and shape[-(n + 1)] == channels and shape[-1] != channels:
        axis = -(n + 1)
        layout = "NCL" if n == 1 else ("NCHW" if n == 2 else "NCDHW")
        fix = CHANNELS_FIRST.format(channels=channels, axis=axis, layout=layout, takes=takes, also=also)
        return LayerInputError(error.layer, error.expected, error.given, fix, error.path)
    return error


def _show(values: tuple[int, ...]) -> Any:
    """One axis's settings as the int a user writes, several as the tuple."""
    return values[0] if len(values) == 1 else values


def _shown_padding(padding: Any) -> str:
    """``padding`` as a user writes it: ``"SAME"``, ``3`` (every side of every axis), or the pairs."""
    if isinstance(padding, str):
        return f'"{padding}"'
    return str(padding[0][0]) if len({v for pair in padding for v in pair}) == 1 else repr(padding)


def check_window_fits(
    layer: Any, x: Any, spatial: Sequence[str], kernel: tuple[int, ...], strides: tuple[int, ...],
    dilation: tuple[int, ...], padding: Any, *, transpose: bool = False, kernel_name: str = "kernel_size",
) -> None:
    """Raise :class:`LayerInputError` where a window leaves an empty output axis.

    ``x`` is ``[..., *spatial, channels]``; the check reads static shapes only (free under
    ``jit``). With the window spanning ``e = d (k - 1) + 1`` and ``(lo, hi)`` padding, an axis of
    length ``L`` gives ``floor((L + lo + hi - e) / s) + 1`` outputs when ``L + lo + hi >= e`` and
    none otherwise; a transpose pads the stride-dilated input, ``(L - 1) s + 1 + lo + hi - e + 1``.
    ``"SAME"`` (and a transpose's ``"VALID"``) keep every axis non-empty: nothing to check.
    """
    if padding == "SAME" or (transpose and padding == "VALID"):
        return
    n = len(spatial)
    lengths = jnp.shape(x)[len(jnp.shape(x)) - n - 1:-1]
    pads = ((0, 0),) * n if padding == "VALID" else padding
    for name, length, k, s, d, (lo, hi) in zip(spatial, lengths, kernel, strides, dilation, pads):
        span = d * (k - 1) + 1
        if transpose:
            out = (length - 1) * s + 1 + lo + hi - span + 1 if length else 0
            need = 1 + math.ceil(max(span - 1 - lo - hi, 0) / s)
        else:
            out = (length + lo + hi - span) // s + 1 if length + lo + hi >= span else 0
            need = span - lo - hi
        if out > 0:
            continue
        shown = f'"{padding}"' if isinstance(padding, str) else repr(padding)
        window = (f"{kernel_name} {k}" + (f" with dilation {d} spans {span}" if d != 1 else "")
                  + f", padding {shown} adds {lo + hi} ({lo} before, {hi} after)"
                  + (f", strides {s} spread the input to {(length - 1) * s + 1}" if transpose and length else ""))
        settings = f"{kernel_name}={_show(kernel)}" + ("" if dilation == (1,) * n else f", dilation={_show(dilation)}")
        settings += f", strides={_show(strides)}" if transpose else ""
        fixed = settings + (', padding="VALID"' if transpose else ', padding="SAME"')
        settings += f", padding={shown}"
        pattern = "[..., " + ", ".join(spatial) + f", {jnp.shape(x)[-1]}]"
        fix = WINDOW_TOO_LARGE.format(axis=name, size=length, window=window,
                                      out=f"{name} {max(out, 0)}", need=need, cls=type(layer).__name__,
                                      settings=settings, fixed=fixed)
        raise LayerInputError(layer, f"{pattern} (float) with {name} >= {need}", short_array(x), fix)


class Conv(Layer):
    weight: jax.Array
    bias: jax.Array | None = field(decay=False)
    strides: tuple[int, ...] = field(static=True, default=(1,))
    padding: Any = field(static=True, default="SAME")
    dilation: tuple[int, ...] = field(static=True, default=(1,))
    groups: int = field(static=True, default=1)
    activation: Callable[[Any], Any] = field(static=True, default=identity)
    padding_mode: str = field(static=True, default="zeros")
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("padding_mode",)  # files written before it: "zeros"

    _rank: ClassVar[int] = 1
    _transpose: ClassVar[bool] = False

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] = 1,
        padding: Padding = "SAME",
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        activation: Callable[[Any], Any] = identity,
        use_bias: bool = True,
        *,
        key: jax.Array,
        dtype: Any = jnp.float32,
        weight_initializer: Initializer = glorot_uniform,
        bias_initializer: Initializer = jax.nn.initializers.zeros,
        padding_mode: str = "zeros",
    ):
        n = self._rank
        if padding_mode not in PADDING_MODES:
            raise ValueError(BAD_PADDING_MODE.format(cls=type(self).__name__, given=padding_mode,
                                                     modes=tuple(PADDING_MODES)))
        if self._transpose and padding_mode != "zeros":
            raise ValueError(TRANSPOSE_PADDING_MODE.format(cls=type(self).__name__, given=padding_mode))
        self.padding_mode = padding_mode
        in_channels, out_channels = size_arguments(type(self).__name__, in_channels=in_channels,
                                                   out_channels=out_channels)
        if not window.is_int(groups) or groups < 1:  # 0 raised ZeroDivisionError, -1 an MLIRError inside XLA
            raise ValueError(GROUPS_NOT_POSITIVE.format(cls=type(self).__name__, groups=groups))
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                BAD_GROUPS.format(cls=type(self).__name__, cin=in_channels, cout=out_channels, groups=groups)
            )
        name = type(self).__name__
        kernel, self.strides, self.dilation = (window.sizes(name, setting, value, n) for setting, value in (
            ("kernel_size", kernel_size), ("strides", strides), ("dilation", dilation)))
        self.padding = window.padding(name, padding, n, signed=self._transpose)  # a transpose's negative pads crop
        # A transpose's is torch's [in, out // groups, *k] moved: each input channel feeds its group's outputs.
        shape = (*kernel, in_channels, out_channels // groups) if self._transpose else (
            *kernel, in_channels // groups, out_channels)
        self.weight = initialized(weight_initializer, key, shape, dtype)  # the key's draws (functree/_random.py)
        bias_key = jax.random.fold_in(key, 1)
        self.bias = bias_initializer(bias_key, (out_channels,), dtype) if use_bias else None
        self.groups = int(groups)
        self.activation = activation_argument(type(self).__name__, activation)  # None: none (Keras's)

    @property
    def in_channels(self) -> int:
        return self.weight.shape[-2] * (1 if self._transpose else self.groups)

    @property
    def out_channels(self) -> int:
        return self.weight.shape[-1] * (self.groups if self._transpose else 1)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._apply(x, self.padding)

    def _apply(self, x: jax.Array, padding: Any) -> jax.Array:
        n = self._rank
        spatial = SPATIAL[n]
        check_unbatched(self, weight=n + 2, bias=1)  # an ensemble's layer outside jax.vmap
        try:
            check_input(self, x, (*spatial, self.in_channels), leading="...")
        except LayerInputError as e:
            raise _channels_first(e, x, n, self.in_channels) from None
        check_window_fits(self, x, spatial, self.weight.shape[:n], self.strides, self.dilation, padding,
                          transpose=self._transpose)  # on the input as given: its lengths are the error's
        if self.padding_mode != "zeros" or (not self._transpose and pads_at_risk(
                self.weight.shape[:n], self.strides, self.dilation, self._pairs(x))):
            # (zeros too where XLA would abort compiling the input gradient: _xla_conv)
            x, padding = self._padded(x, spatial), "VALID"
        batch = x.shape[: x.ndim - n - 1]
        # The batch's size, not -1: reshape cannot infer it when an axis is empty.
        flat = x.reshape((math.prod(batch), *x.shape[x.ndim - n - 1:]))
        y = self._convolve(flat, padding)
        if self.bias is not None:
            y = add_bias(y, self.bias)  # float32 for bfloat16: its gradient sums over every position
        return self.activation(y.reshape((*batch, *y.shape[1:])))

    def _padded(self, x: jax.Array, spatial: Sequence[str]) -> jax.Array:
        """``x`` padded as torch's ``padding_mode`` pads (``jnp.pad``'s ``reflect``, ``edge``,
        ``wrap``), by ``padding``'s pairs (``"SAME"``: lax's, ``d (k - 1) + 1 - s`` in all
        at stride ``s``, the smaller half first, as torch's ``padding="same"``); refused where
        an axis is too short for the mode (:data:`PAD_TOO_LARGE_FOR_MODE`)."""
        n = self._rank
        lengths = x.shape[x.ndim - n - 1:-1]
        pads = self._pairs(x)
        fits, need, why = _MODE_LIMITS[self.padding_mode]
        for name, length, (lo, hi) in zip(spatial, lengths, pads):
            if not fits(length, lo, hi):
                shown = _shown_padding(self.padding)
                fix = PAD_TOO_LARGE_FOR_MODE.format(axis=name, size=length, mode=self.padding_mode, pads=(lo, hi),
                                                    lo=lo, hi=hi, why=why, cls=type(self).__name__, padding=shown,
                                                    need=need(lo, hi))
                pattern = "[..., " + ", ".join(spatial) + f", {self.in_channels}]"
                raise LayerInputError(self, f"{pattern} (float) with {name} >= {need(lo, hi)}", short_array(x), fix)
        lead = x.ndim - n - 1
        return jnp.pad(x, ((0, 0),) * lead + tuple(pads) + ((0, 0),), mode=PADDING_MODES[self.padding_mode])

    def _pairs(self, x: jax.Array) -> tuple[tuple[int, int], ...]:
        """``padding`` as ``(low, high)`` per spatial axis of ``x`` (``"SAME"``: lax's)."""
        n = self._rank
        lengths = x.shape[x.ndim - n - 1:-1]
        spans = [d * (k - 1) + 1 for k, d in zip(self.weight.shape[:n], self.dilation)]
        return (((0, 0),) * n if self.padding == "VALID" else
                tuple(jax.lax.padtype_to_pads(lengths, spans, self.strides, "SAME")) if self.padding == "SAME"
                else self.padding)

    def _convolve(self, x: jax.Array, padding: Any) -> jax.Array:
        x, weight = _promoted(x, self.weight)
        return jax.lax.conv_general_dilated(
            x,
            weight,
            window_strides=self.strides,
            padding=padding,
            rhs_dilation=self.dilation,
            dimension_numbers=_SPEC[self._rank],
            feature_group_count=self.groups,
        )


def _promoted(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` and ``weight`` in their promoted dtype, as Dense's ``x @ weight`` (lax's convolution
    takes one dtype): promoted under "standard", jax's TypePromotionError under "strict"."""
    dtype = jnp.result_type(x, weight)
    return x.astype(dtype), weight.astype(dtype)


class ConvTranspose(Conv):
    _transpose: ClassVar[bool] = True

    def __call__(self, x: jax.Array, output_size: int | Sequence[int] | None = None) -> jax.Array:
        """``output_size=`` (torch's ``forward(x, output_size)``): the spatial sizes, each
        between the size of padding ``(lo, lo)`` and that plus ``strides - 1``; it picks the
        high padding ``lo + output_padding`` (``lo`` the padding's low side, torch's
        ``d (k - 1) - p``), whatever high side the layer was built with, as torch's
        ignores its ``output_padding``."""
        if output_size is None:
            return self._apply(x, self.padding)
        check_unbatched(self, weight=self._rank + 2, bias=1)
        check_input(self, x, (*SPATIAL[self._rank], self.in_channels), leading="...")
        return self._apply(x, self._picked(x, output_size))

    def _picked(self, x: jax.Array, output_size: int | Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The padding whose outputs are ``output_size`` (:data:`OUTPUT_SIZE` where none is)."""
        n = self._rank
        kernel = self.weight.shape[:n]
        lengths = x.shape[x.ndim - n - 1:-1]
        pads = transpose_padding(kernel, self.strides, self.dilation, self.padding)
        low = tuple((length - 1) * s + 2 * lo - d * (k - 1) + 1 for length, s, (lo, _), d, k in
                    zip(lengths, self.strides, pads, self.dilation, kernel))
        given: Any = (output_size,) if window.is_int(output_size) else (
            tuple(output_size) if isinstance(output_size, Sequence) else None)
        if (given is None or len(given) != n or not all(window.is_int(v) for v in given)
                or not all(m <= v < m + s for v, m, s in zip(given, low, self.strides))):
            raise ValueError(OUTPUT_SIZE.format(
                cls=type(self).__name__, given=output_size, axes="length" if n == 1 else "sizes", lengths=lengths,
                k=_show(kernel), s=_show(self.strides), d=_show(self.dilation), padding=_shown_padding(self.padding),
                low=low, ranges=", ".join(f"{m}..{m + s - 1}" for m, s in zip(low, self.strides))))
        return tuple((lo, lo + int(v) - m) for (lo, _), v, m in zip(pads, given, low))

    def _convolve(self, x: jax.Array, padding: Any) -> jax.Array:
        """The adjoint of a strided convolution, ``y[i*stride + k] += x[i] @ weight[k]``: the
        input dilated by the strides (``lhs_dilation``), padded, and correlated with the
        spatially flipped filter. With ``groups`` the filter ``[*k, in, out // g]`` becomes
        ``[*k, in // g, out]`` (group ``j``'s outputs read its inputs only), as
        ``feature_group_count`` takes it (``lax.conv_transpose`` has no groups)."""
        n = self._rank
        kernel = self.weight.shape[:n]
        x, weight = _promoted(x, self.weight)
        w = jnp.flip(weight, axis=tuple(range(n)))
        if self.groups > 1:
            cin, per_group = self.weight.shape[n:]
            w = w.reshape((*kernel, self.groups, cin // self.groups, per_group))
            w = jnp.swapaxes(w, n, n + 1).reshape((*kernel, cin // self.groups, self.groups * per_group))
        pads = transpose_padding(kernel, self.strides, self.dilation, padding)
        risky = dilated_axes_at_risk(kernel, self.strides, self.dilation, pads)
        # An axis XLA's compiler would abort on (_xla_conv) is padded by one more on both
        # sides, and the two extra outputs are cropped.
        pads = tuple((lo + 1, hi + 1) if i in risky else (lo, hi) for i, (lo, hi) in enumerate(pads))
        y = jax.lax.conv_general_dilated(
            x, w, window_strides=(1,) * n, padding=pads, lhs_dilation=self.strides, rhs_dilation=self.dilation,
            dimension_numbers=_SPEC[n], feature_group_count=self.groups,
        )
        if not risky:
            return y
        return y[(slice(None), *(slice(1, -1) if i in risky else slice(None) for i in range(n)), slice(None))]


def transpose_padding(kernel: Sequence[int], strides: Sequence[int], dilation: Sequence[int],
                      padding: Any) -> tuple[tuple[int, int], ...]:
    """A transpose's ``(low, high)`` padding of the stride-dilated input, as
    ``lax.conv_transpose`` reads ``padding`` (pairs as given).

    With the window spanning ``e = d (k - 1) + 1``: ``"VALID"`` pads ``e - 1`` low and
    ``e - 1 + max(e - s, 0) + s - e`` high, an output of ``(L - 1) s + max(e, s)``; ``"SAME"``
    pads ``e + s - 2`` in all, ``e - 1`` low where ``s > e - 1`` and half (rounded up) else,
    an output of ``L s``.
    """
    if not isinstance(padding, str):
        return tuple(padding)
    pads = []
    for k, s, d in zip(kernel, strides, dilation):
        span = d * (k - 1) + 1
        total = span + s - 2 + (max(span - s, 0) if padding == "VALID" else 0)
        low = span - 1 if padding == "VALID" or s > span - 1 else -(-total // 2)
        pads.append((low, total - low))
    return tuple(pads)


_DOC = """{what} over ``[..., {spatial}, in_channels]`` inputs (channels last).

    {math}

    Args: ``in_channels, out_channels, kernel_size, strides=1, padding="SAME"`` (``"SAME"``,
    ``"VALID"``, an int or per-axis ``(low, high)`` pairs){groups_arg}, ``dilation=1``,
    ``activation=identity, use_bias=True``; keyword-only ``key``, ``dtype``,
    ``weight_initializer``, ``bias_initializer``{mode_arg}. ``weight`` is ``[{kernel}, in_channels{per_group},
    out_channels{out_per_group}]``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> conv = ft.nn.{name}(3, 8, {ks}, {stride_arg}key=jax.random.key(0))
      >>> conv.weight.shape
      {wshape}
      >>> conv(jnp.ones((2, {xshape}, 3))).shape
      {yshape}
    """

_MODE_ARG = (', ``padding_mode="zeros"`` (torch\'s; ``"reflect"``, ``"replicate"`` and ``"circular"`` '
             "pad the input by ``padding``'s amounts, mirrored without the edge, the edge repeated or wrapped "
             "around, before the convolution)")

_CONV_MATH = (
    "``y[b, i, o] = activation(bias[o] + sum_{k, c} x[b, i*stride + k*dilation - pad, c] "
    "* weight[k, c, o])`` (a cross-correlation, as in lax and every framework)."
)
_TRANSPOSE_MATH = (
    "The transpose (adjoint) of a strided convolution, used to upsample: "
    "``y[b, i*stride + k, o] += x[b, i, c] * weight[k, c, o]`` for ``VALID`` padding; "
    "the output is ``stride`` times longer with ``SAME`` padding (``lax.conv_transpose``).\n\n"
    "    An int or ``(low, high)`` padding pads the stride-dilated input, as "
    "``lax.conv_transpose`` reads it, not torch's ``ConvTranspose`` ``padding=p, "
    "output_padding=op``, which is ``padding=((d*(k-1) - p, d*(k-1) - p + op),)`` per axis "
    "here (``k`` the kernel size, ``d`` the dilation; negative where ``p > d*(k-1)``: it crops); "
    "the two can give one output shape "
    "with other numbers, so port torch's by that formula."
)


class Conv1D(Conv):
    _rank: ClassVar[int] = 1
    __doc__ = _DOC.format(
        what="A 1-D convolution", spatial="length", math=_CONV_MATH, kernel="width",
        groups_arg=", ``groups=1`` (grouped / depthwise)", mode_arg=_MODE_ARG, per_group=" // groups", out_per_group="",
        name="Conv1D", ks=3, stride_arg="", wshape="(3, 3, 8)", xshape=10, yshape="(2, 10, 8)",
    )


class Conv2D(Conv):
    _rank: ClassVar[int] = 2
    __doc__ = _DOC.format(
        what="A 2-D convolution", spatial="height, width", math=_CONV_MATH, kernel="height, width",
        groups_arg=", ``groups=1`` (grouped / depthwise)", mode_arg=_MODE_ARG, per_group=" // groups", out_per_group="",
        name="Conv2D", ks="(3, 3)", stride_arg="strides=2, ", wshape="(3, 3, 3, 8)",
        xshape="10, 10", yshape="(2, 5, 5, 8)",
    )


class Conv3D(Conv):
    _rank: ClassVar[int] = 3
    __doc__ = _DOC.format(
        what="A 3-D convolution (video, volumes)", spatial="depth, height, width", math=_CONV_MATH,
        kernel="depth, height, width", groups_arg=", ``groups=1`` (grouped / depthwise)", mode_arg=_MODE_ARG, per_group=" // groups",
        out_per_group="", name="Conv3D", ks="(3, 3, 3)", stride_arg="strides=(1, 2, 2), ",
        wshape="(3, 3, 3, 3, 8)", xshape="4, 10, 10", yshape="(2, 4, 5, 5, 8)",
    )


class Conv1DTranspose(ConvTranspose):
    _rank: ClassVar[int] = 1
    __doc__ = _DOC.format(
        what="A 1-D transposed convolution", spatial="length", math=_TRANSPOSE_MATH, kernel="width",
        groups_arg=", ``groups=1`` (torch's grouped transpose)", mode_arg="", per_group="", out_per_group=" // groups",
        name="Conv1DTranspose", ks=3, stride_arg="strides=2, ",
        wshape="(3, 3, 8)", xshape=10, yshape="(2, 20, 8)",
    )


class Conv2DTranspose(ConvTranspose):
    _rank: ClassVar[int] = 2
    __doc__ = _DOC.format(
        what="A 2-D transposed convolution", spatial="height, width", math=_TRANSPOSE_MATH,
        kernel="height, width", groups_arg=", ``groups=1`` (torch's grouped transpose)", mode_arg="", per_group="",
        out_per_group=" // groups", name="Conv2DTranspose", ks="(3, 3)",
        stride_arg="strides=2, ", wshape="(3, 3, 3, 8)", xshape="5, 5", yshape="(2, 10, 10, 8)",
    )


class Conv3DTranspose(ConvTranspose):
    _rank: ClassVar[int] = 3
    __doc__ = _DOC.format(
        what="A 3-D transposed convolution", spatial="depth, height, width", math=_TRANSPOSE_MATH,
        kernel="depth, height, width", groups_arg=", ``groups=1`` (torch's grouped transpose)", mode_arg="", per_group="",
        out_per_group=" // groups", name="Conv3DTranspose", ks="(3, 3, 3)",
        stride_arg="strides=2, ", wshape="(3, 3, 3, 3, 8)", xshape="2, 5, 5", yshape="(2, 4, 10, 10, 8)",
    )


def torch_weight_axes(layer: Any) -> tuple[int, ...] | None:
    """``perm`` with ft's weight axis ``j`` holding torch's axis ``perm[j]`` (``torch_weight.
    transpose(perm)`` is ft's), for a Dense (torch's Linear ``[out, in]``, ft's ``[in, out]``)
    or a convolution (torch's ``[out, in / groups, *k]``, a transpose's ``[in, out / groups,
    *k]``; ft's ``[*k, in / groups, out]``, ``[*k, in, out / groups]``); None for another layer."""
    if isinstance(layer, Dense):
        return (1, 0)
    if isinstance(layer, Conv):
        n = layer._rank
        return (*range(2, n + 2), 0, 1) if isinstance(layer, ConvTranspose) else (*range(2, n + 2), 1, 0)
    return None
