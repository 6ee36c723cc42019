"""Normalization layers: ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``BatchNorm``,
``InstanceNorm1D/2D/3D`` and ``LocalResponseNorm``.

Statistics are computed in float32 (or the input's dtype when wider) whatever the input
dtype: bfloat16 has 8 bits of mantissa, so ``mean(x)`` and ``x - mean`` lose the signal
at an input mean of 100. Outputs keep the input's dtype. Every scale and offset is
declared ``ft.field(decay=False)``: the decoupled weight decay of ``ft.optim.adamw``,
``ft.optim.lion`` and ``ft.optim.weight_decay`` leaves them alone (their default
``exclude``); the coupled ``weight_decay=`` of ``sgd``, ``adam``, ``rmsprop`` and the other
optimizers is torch's L2 term over every parameter, these included (as torch's).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._broadcast import plus, times
from functree._module import field
from functree._parameters import VIEW_CALLED
from functree._repr import short_array
from functree._traces import under_vmap
from functree.nn._check import (
    LayerInputError,
    check_input,
    check_unbatched,
    size_argument,
    size_arguments,
)
from functree.nn._conv import _channels_first
from functree.nn._mode import Layer
from functree.nn._precision import statistics_dtype
from functree.nn._state import record_state
from functree.nn._window import is_int

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm", "InstanceNorm1D", "InstanceNorm2D", "InstanceNorm3D",
           "LocalResponseNorm"]

BN_AXIS = """\
ft.nn.BatchNorm: axis must be an int, got {axis!r}. The arguments after the feature count are
(axis, momentum, epsilon), not torch's (eps, momentum):
    wrong:  ft.nn.BatchNorm({features}, {axis!r}, {momentum!r})
    right:  ft.nn.BatchNorm({features}, epsilon=1e-5, momentum=0.9)     # torch's momentum m is 1 - m here"""

BATCH_ONE = """\
ft.nn.BatchNorm in training needs more than one value per feature: {given} gives {count} at \
axis {axis}{why} (torch raises "Expected more than 1 value per channel when training").

    wrong:  ft.nn.training(bn)(x)          # x: {given}
    right:  ft.nn.training(bn)(x_batch)    # several rows (or positions) per feature
       or:  ft.nn.inference(bn)(x)         # one example: the running statistics"""

SYMBOLIC_COUNT = """\
ft.nn.{cls} takes its statistics over the {count} values per {unit} of {given}, a symbolic \
size that may be 1 (its variance is then 0, and torch raises "Expected more than 1 value per \
channel when training"), so the program cannot be traced. Declare that dimension at least 2 \
where it is made:

    wrong:  jax.export.symbolic_shape("b")
    right:  jax.export.symbolic_shape("b", constraints=("b >= 2",))"""

BATCH_ONE_WHY = (": its batch variance is 0, so every output would be the offset and the input's gradient 0",
                 ", and the unbiased variance (unbiased_running_variance=True) divides by count - 1")

MOMENTUM_NONE = """\
ft.nn.{cls}: momentum=None is torch's momentum 0 (F.instance_norm's None -> 0.0): training never \
updates the running statistics. ft.nn.{cls} takes a float, the weight of the old running \
statistics (torch's momentum=m is 1 - m here), and has no None.

    wrong:  ft.nn.{cls}({channels}, momentum=None)
    right:  ft.nn.{cls}({channels}, momentum=1.0)     # torch's: the running statistics kept as they are"""

NO_COUNT = """\
ft.nn.BatchNorm: momentum=None (torch's cumulative average: batch n weighs 1/n) needs the count \
of training batches, batches_tracked, and this layer holds none (None): it was built with a \
float momentum, or read from a file written by one, and given momentum=None after.

    wrong:  bn.replace(momentum=None)
    right:  ft.nn.BatchNorm({features}, momentum=None, ...)                      # counts from 0
       or:  bn.replace(momentum=None, batches_tracked=jnp.asarray(n, jnp.int32))   # n batches averaged so far"""

BN_AXIS_OUTSIDE = """\
Its axis {axis} is outside an input of {ndim} axes (axes -{ndim} .. {last}; a negative axis \
counts from the end). Name the features' axis of this input.

    wrong:  ft.nn.BatchNorm({features}, axis={axis})(x)     # x: {given}
    right:  ft.nn.BatchNorm({features}, axis={right})(x)"""

BAD_GROUPS = """\
GroupNorm: channels ({channels}) must be divisible by groups ({groups}).

    wrong:  ft.nn.GroupNorm({groups}, {channels})
    right:  ft.nn.GroupNorm({suggestion}, {channels})
"""


def _momentum(cls: str, momentum: Any, channels: Any) -> float:
    """An InstanceNorm's ``momentum`` as a float; torch's None refused by name
    (:data:`MOMENTUM_NONE`; BatchNorm takes None itself, a cumulative average)."""
    if momentum is None:
        raise TypeError(MOMENTUM_NONE.format(cls=cls, channels=channels))
    return float(momentum)


def _fewer_than_two(count: Any, cls: str, unit: str, x: jax.Array) -> bool:
    """Whether ``count`` values per ``unit`` are fewer than two; a symbolic count
    (``jax.export``'s shape ``"b"``) that may be 1 is refused by name (:data:`SYMBOLIC_COUNT`:
    JAX's comparison raised InconclusiveDimensionOperation, "'b' < '2' is inconclusive")."""
    try:
        return bool(count < 2)
    except jax.errors.InconclusiveDimensionOperation:
        raise ValueError(SYMBOLIC_COUNT.format(cls=cls, count=count, unit=unit, given=short_array(x))) from None


def _normalized_shape(cls: str, shape: Any) -> tuple[int, ...]:
    """An int (NumPy's too, as torch takes ``np.int64``) or a sequence of them, as a tuple of ints
    (``LayerNorm(np.int64(4))`` raised "'numpy.int64' object is not iterable"); a float
    (``d / 2``) or negative size is :data:`BAD_SIZE_ARGUMENT`, not an error inside jnp."""
    entries = shape if isinstance(shape, Sequence) or np.ndim(shape) == 1 else (shape,)
    return tuple(size_argument(cls, "shape", v) for v in entries)


def _scale_and_shift(
    y: jax.Array, scale: jax.Array | None, offset: jax.Array | None, dtype: Any
) -> jax.Array:
    """``y * scale + offset`` in ``y``'s (statistics) dtype, returned in ``dtype``; ``scale`` and
    ``offset`` are the trailing axes' (broadcast by hand: a user's rank promotion may raise)."""
    if scale is not None:
        y = times(y, scale.astype(y.dtype))
    if offset is not None:
        y = plus(y, offset.astype(y.dtype))
    return y.astype(dtype)


class LayerNorm(Layer):
    """Normalize over the trailing ``shape`` axes: ``y = (x - mean) / sqrt(var + epsilon) * scale + offset``.

    Mean and (biased) variance are taken per example over the last ``len(shape)`` axes,
    in float32 for bfloat16/float16 inputs (the output keeps the input dtype);
    ``scale`` starts at one and ``offset`` at zero (swift-apis' names). Either can be
    turned off with ``use_scale=False`` / ``use_offset=False``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ln = ft.nn.LayerNorm(3)
      >>> ln(jnp.array([[1.0, 2.0, 3.0]])).round(3)
      Array([[-1.225,  0.   ,  1.225]], dtype=float32)
    """

    scale: jax.Array | None = field(decay=False)
    offset: jax.Array | None = field(decay=False)
    shape: tuple[int, ...] = field(static=True, default=())
    epsilon: float = field(static=True, default=1e-5)

    def __init__(
        self,
        shape: int | Sequence[int],
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_offset: bool = True,
        *,
        dtype: Any = jnp.float32,
    ):
        self.shape = _normalized_shape("LayerNorm", shape)
        self.scale = jnp.ones(self.shape, dtype) if use_scale else None
        self.offset = jnp.zeros(self.shape, dtype) if use_offset else None
        self.epsilon = float(epsilon)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_unbatched(self, scale=len(self.shape), offset=len(self.shape))  # an ensemble's layer outside jax.vmap
        check_input(self, x, self.shape)
        axes = tuple(range(x.ndim - len(self.shape), x.ndim))
        xs = x.astype(statistics_dtype(x.dtype))
        mean = jnp.mean(xs, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(xs - mean), axis=axes, keepdims=True)
        y = (xs - mean) * jax.lax.rsqrt(var + jnp.asarray(self.epsilon, xs.dtype))
        return _scale_and_shift(y, self.scale, self.offset, x.dtype)


class RMSNorm(Layer):
    """Root-mean-square normalization: ``y = x / sqrt(mean(x^2) + epsilon) * scale``.

    Zhang & Sennrich (2019): LayerNorm without centering and without offset. The mean
    square is taken per example over the last ``len(shape)`` axes, in float32 for
    bfloat16/float16 inputs (the output keeps the input dtype); ``scale`` starts at one
    (``use_scale=False`` drops it). ``epsilon=None`` is torch's ``RMSNorm(eps=None)`` (its
    default): the machine epsilon of the input's dtype, ``jnp.finfo(x.dtype).eps`` (1.19e-7
    for float32, 7.8e-3 for bfloat16).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> norm = ft.nn.RMSNorm(2)
      >>> y = norm(jnp.array([[3.0, 4.0]]))                # rms = sqrt(12.5)
      >>> [round(v, 3) for v in y[0].tolist()]
      [0.849, 1.131]
    """

    scale: jax.Array | None = field(decay=False)
    shape: tuple[int, ...] = field(static=True, default=())
    epsilon: float | None = field(static=True, default=1e-6)

    def __init__(
        self,
        shape: int | Sequence[int],
        epsilon: float | None = 1e-6,
        use_scale: bool = True,
        *,
        dtype: Any = jnp.float32,
    ):
        self.shape = _normalized_shape("RMSNorm", shape)
        self.scale = jnp.ones(self.shape, dtype) if use_scale else None
        self.epsilon = None if epsilon is None else float(epsilon)  # None: torch's eps=None ("float() ... not 'NoneType'")

    def __call__(self, x: jax.Array) -> jax.Array:
        check_unbatched(self, scale=len(self.shape))  # an ensemble's layer outside jax.vmap
        check_input(self, x, self.shape)
        axes = tuple(range(x.ndim - len(self.shape), x.ndim))
        xs = x.astype(statistics_dtype(x.dtype))
        mean_square = jnp.mean(jnp.square(xs), axis=axes, keepdims=True)
        epsilon = float(jnp.finfo(x.dtype).eps) if self.epsilon is None else self.epsilon  # torch's: the input's dtype
        y = xs * jax.lax.rsqrt(mean_square + jnp.asarray(epsilon, xs.dtype))
        return _scale_and_shift(y, self.scale, None, x.dtype)


class GroupNorm(Layer):
    """Group normalization (Wu & He 2018) of channels-last inputs ``[batch, ..., channels]``.

    The channels are split into ``groups`` consecutive groups of ``channels // groups``;
    for each example and group, mean and (biased) variance are taken over every axis but
    the batch (first) axis and the channels outside the group:
    ``y = (x - mean_g) / sqrt(var_g + epsilon) * scale + offset`` with per-channel
    ``scale`` (ones) and ``offset`` (zeros). ``groups=1`` normalizes each example over all
    its values (LayerNorm over ``[..., channels]``); ``groups=channels`` is instance norm.
    Statistics in float32 for bfloat16/float16 inputs; the output keeps the input dtype.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> norm = ft.nn.GroupNorm(2, 4)
      >>> x = jnp.array([[[0.0, 2.0, 10.0, 30.0]]])  # batch 1, length 1, 4 channels
      >>> norm(x).round(3)                           # groups (0, 2) and (10, 30)
      Array([[[-1.,  1., -1.,  1.]]], dtype=float32)
    """

    scale: jax.Array | None = field(decay=False)
    offset: jax.Array | None = field(decay=False)
    groups: int = field(static=True, default=1)
    channels: int = field(static=True, default=1)
    epsilon: float = field(static=True, default=1e-5)

    def __init__(
        self,
        groups: int,
        channels: int,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_offset: bool = True,
        *,
        dtype: Any = jnp.float32,
    ):
        channels, = size_arguments("GroupNorm", channels=channels)
        groups, = size_arguments("GroupNorm", least=1, groups=groups)
        if channels % groups:
            divisors = [g for g in range(1, channels + 1) if channels % g == 0]
            nearest = min(divisors, key=lambda g: abs(g - groups))
            raise ValueError(BAD_GROUPS.format(channels=channels, groups=groups, suggestion=nearest))
        self.groups = groups
        self.scale = jnp.ones((channels,), dtype) if use_scale else None
        self.offset = jnp.zeros((channels,), dtype) if use_offset else None
        self.channels = channels
        self.epsilon = float(epsilon)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_unbatched(self, scale=1, offset=1)  # an ensemble's layer outside jax.vmap: [models, C] scaled rows
        try:
            check_input(self, x, (self.channels,), leading="batch, ...", min_rank=2)
        except LayerInputError as e:  # torch's [N, C, *spatial]: move the channels, not another size
            raise _channels_first(e, x, jnp.ndim(x) - 2, self.channels, "ft.nn.GroupNorm takes") from None
        xs = x.astype(statistics_dtype(x.dtype))
        grouped = xs.reshape((*x.shape[:-1], self.groups, self.channels // self.groups))
        axes = (*range(1, x.ndim - 1), x.ndim)  # all but batch and group
        mean = jnp.mean(grouped, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(grouped - mean), axis=axes, keepdims=True)
        y = ((grouped - mean) * jax.lax.rsqrt(var + jnp.asarray(self.epsilon, xs.dtype))).reshape(x.shape)
        return _scale_and_shift(y, self.scale, self.offset, x.dtype)


class BatchNorm(Layer):
    """Batch normalization over every axis but ``axis`` (swift-apis' ``BatchNorm``).

    Training: ``y = (x - mean_B) / sqrt(var_B + epsilon) * scale + offset`` with the batch
    mean and biased variance, and new running statistics recorded for
    ``ft.nn.collect_state``::

        running_mean     <- momentum * running_mean     + (1 - momentum) * mean_B
        running_variance <- momentum * running_variance + (1 - momentum) * var_B

    ``var_B`` is the biased variance (swift-apis', Keras' and Flax's);
    ``unbiased_running_variance=True`` records ``var_B * n / (n - 1)`` (``n`` values per
    feature) as torch's ``running_var`` does, its ``momentum=m`` being ``momentum=1 - m`` here:
    torch's ``BatchNorm1d(c)`` trains as ``ft.nn.BatchNorm(c, momentum=0.9, epsilon=1e-5,
    unbiased_running_variance=True)`` (with the biased variance and 4 rows a batch, torch's
    ``running_var`` ends 25% above ft's and eval outputs 15% apart). Training needs ``n >= 2``
    (torch's rule: with one value per feature every output is the offset; refused by name,
    :data:`BATCH_ONE`).

    ``momentum=None`` is torch's cumulative average: the running statistics are the plain
    mean of every training batch's so far. The layer then counts its training batches in
    ``batches_tracked`` (an int32 ``no_derivative`` scalar, torch's ``num_batches_tracked``,
    read and written by ``load_torch_state_dict`` / ``torch_state_dict``), and batch
    ``n = batches_tracked + 1`` updates::

        running_mean <- (1 - 1/n) * running_mean + (1/n) * mean_B     (variance alike)

    so torch's ``BatchNorm2d(c, momentum=None)`` is ``ft.nn.BatchNorm(c, momentum=None,
    epsilon=1e-5, unbiased_running_variance=True)``. With a float momentum
    ``batches_tracked`` is None (nothing reads a count). The average is in the statistics'
    dtype, float32 for float32 ones, as torch's: ``1 - 1/n`` rounds to float32's spacing
    near 1 (6e-8, a relative error of ``6e-8 · n`` in the step's weight), so over a long
    run the average drifts from the exact mean (batch means ``1 ± 0.01``: 3e-5 off after
    10⁴ batches, 9e-5 after 10⁵). It is meant for a pass over the data
    (:func:`ft.nn.update_bn` after weight averaging), not for a whole training.

    ``use_scale=False`` / ``use_offset=False`` leave out ``scale`` / ``offset`` (None; as
    ``LayerNorm``'s): ``y = (x - mean) / sqrt(var + epsilon)``, torch's ``BatchNorm*d(c,
    affine=False)``, whose state dict (no ``weight`` or ``bias``) loads into
    ``ft.nn.BatchNorm(c, use_scale=False, use_offset=False)``. Without scale, offset and
    running statistics, the layer holds no array of ``feature_count`` features and normalizes
    every feature the input has (torch's).

    ``track_running_stats=False`` (torch's): no running statistics (``running_mean`` and
    ``running_variance`` are None); the batch statistics normalize in inference too, and
    nothing is recorded. A torch ``BatchNorm*d(c, track_running_stats=False)`` (its state dict
    holds no ``running_mean``) loads into ``ft.nn.BatchNorm(c, track_running_stats=False)``.

    Inference (the default): the running statistics replace the batch ones. Statistics
    and normalization run in float32 for bfloat16/float16 inputs; the output keeps the
    input dtype. The running statistics are stored in ``dtype`` (a bfloat16 or float16
    model keeps bfloat16 or float16 ones, as torch's buffers): each step's blend is
    computed in float32 and rounded once to ``dtype`` (torch's float16 numbers exactly;
    torch's bfloat16 CPU kernel rounds every operation, further from the true mean), but
    with ``dtype=jnp.bfloat16`` their average still stalls: a change below half bfloat16's
    spacing (0.4 % of the value) rounds away. Build it in float32 and cast the model with
    ``ft.cast``, which keeps them float32 (:func:`ft.nn.update_bn` sums them in float32).
    ``running_mean`` / ``running_variance`` are ``no_derivative`` fields (carried, not
    trained); swift-apis' defaults ``momentum=0.99, epsilon=1e-3``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> bn = ft.nn.BatchNorm(2)
      >>> x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
      >>> y, updates = ft.nn.collect_state(lambda m: m(x), ft.nn.training(bn))
      >>> y.round(3)
      Array([[-1., -1.],
             [ 1.,  1.]], dtype=float32)
      >>> [round(v, 3) for v in ft.nn.apply_state(bn, updates).running_variance.tolist()]
      [1.0, 1.03]
      >>> plain = ft.nn.BatchNorm(2, use_scale=False, use_offset=False)   # torch's affine=False
      >>> plain.scale is None, bool(jnp.allclose(ft.nn.collect_state(lambda m: m(x), ft.nn.training(plain))[0], y))
      (True, True)
    """

    scale: jax.Array | None = field(decay=False)
    offset: jax.Array | None = field(decay=False)
    running_mean: jax.Array | None = field(no_derivative=True)
    running_variance: jax.Array | None = field(no_derivative=True)
    batches_tracked: jax.Array | None = field(no_derivative=True, default=None)  # momentum=None's count
    axis: int = field(static=True, default=-1)
    momentum: float | None = field(static=True, default=0.99)
    epsilon: float = field(static=True, default=1e-3)
    training: bool = field(static=True, default=False)
    unbiased_running_variance: bool = field(static=True, default=False)
    track_running_stats: bool = field(static=True, default=True)
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("momentum", "unbiased_running_variance")  # a restore's template decides them (how it trains its running statistics)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("unbiased_running_variance", "track_running_stats",
                                                      "batches_tracked")  # files written before them: False, True, None
    __ft_repr_if_set__: ClassVar[tuple[str, ...]] = ("batches_tracked",)  # None but with momentum=None

    def __init__(
        self,
        feature_count: int,
        axis: int = -1,
        momentum: float | None = 0.99,
        epsilon: float = 1e-3,
        *,
        dtype: Any = jnp.float32,
        training: bool = False,
        unbiased_running_variance: bool = False,
        track_running_stats: bool = True,
        use_scale: bool = True,
        use_offset: bool = True,
    ):
        try:  # a float here is torch's order: (features, eps, momentum)
            axis = operator.index(axis)
        except TypeError:
            raise TypeError(BN_AXIS.format(axis=axis, momentum=momentum, features=feature_count)) from None
        feature_count, = size_arguments("BatchNorm", feature_count=feature_count)
        self.scale = jnp.ones((feature_count,), dtype) if use_scale else None
        self.offset = jnp.zeros((feature_count,), dtype) if use_offset else None
        track = bool(track_running_stats)
        self.running_mean = jnp.zeros((feature_count,), dtype) if track else None
        self.running_variance = jnp.ones((feature_count,), dtype) if track else None
        self.axis, self.epsilon = axis, float(epsilon)
        self.momentum = None if momentum is None else float(momentum)  # None: a cumulative average
        self.batches_tracked = jnp.zeros((), jnp.int32) if track and momentum is None else None
        self.training = training
        self.unbiased_running_variance = bool(unbiased_running_variance)
        self.track_running_stats = track

    def __call__(self, x: jax.Array) -> jax.Array:
        for name in ("running_mean", "running_variance"):  # None only in ft.parameters(model): not a model
            if self.track_running_stats and getattr(self, name) is None:
                raise TypeError(VIEW_CALLED.format(layer=type(self).__name__, field=name))
        check_unbatched(self, scale=1, offset=1, running_mean=1, running_variance=1,  # an ensemble's layer
                        batches_tracked=0)                                         # outside jax.vmap
        held = [a for a in (self.scale, self.offset, self.running_mean) if a is not None]
        features = held[0].shape[0] if held else _features_at(x, self.axis)  # none held: any count (torch's)
        try:
            check_input(self, x, (features,) if self.axis == -1 else ())
        except LayerInputError as e:  # torch's [N, C, *spatial]: move the channels, or say where they are
            raise _channels_first(e, x, jnp.ndim(x) - 2, features, "ft.nn.BatchNorm takes",
                                  f", or normalize that axis: ft.nn.BatchNorm({features}, axis=1)") from None
        if not -x.ndim <= self.axis < x.ndim:  # -5 on 4 axes silently normalized axis 3
            matching = [i for i, size in enumerate(x.shape) if size == features]
            raise LayerInputError(
                self, f"with {features} features at axis {self.axis} (float)", short_array(x),
                BN_AXIS_OUTSIDE.format(axis=self.axis, ndim=x.ndim, last=x.ndim - 1,
                                       features=features, given=short_array(x),
                                       right=matching[-1] if matching else x.ndim - 1),
            )
        axis = self.axis % x.ndim
        if self.axis != -1 and x.shape[axis] != features:
            raise LayerInputError(
                self, f"with {features} features at axis {self.axis} (float)", short_array(x),
                f"Build the layer for this size: ft.nn.BatchNorm({x.shape[axis]}, axis={self.axis}).",
            )
        shape = [1] * x.ndim
        shape[axis] = features
        reduce = tuple(i for i in range(x.ndim) if i != axis)
        xs = x.astype(statistics_dtype(x.dtype))
        if self.training or self.running_mean is None or self.running_variance is None:  # batch statistics
            mean = jnp.mean(xs, axis=reduce)
            var = jnp.mean(jnp.square(xs - mean.reshape(shape)), axis=reduce)
            count = x.size // features
            # torch's refusal: a batch variance of 0 (n - 1 = 0 for the unbiased one); a
            # per-example vmap's is collect_state's error
            if _fewer_than_two(count, "BatchNorm", "feature", x) and not (self.training and under_vmap()):
                raise ValueError(BATCH_ONE.format(given=short_array(x), count=count, axis=self.axis,
                                                  why=BATCH_ONE_WHY[self.unbiased_running_variance]))
            if self.training and self.running_mean is not None and self.running_variance is not None:
                recorded = var
                if self.unbiased_running_variance:  # torch's running_var: var * n / (n - 1)
                    recorded = var * jnp.asarray(count / (count - 1), var.dtype)
                self._record(mean, recorded)
        else:
            mean, var = self.running_mean.astype(xs.dtype), self.running_variance.astype(xs.dtype)
        inv = jax.lax.rsqrt(var + jnp.asarray(self.epsilon, xs.dtype))
        if self.scale is not None:
            inv = inv * self.scale.astype(xs.dtype)
        y = (xs - mean.reshape(shape)) * inv.reshape(shape)
        if self.offset is not None:
            y = y + self.offset.astype(xs.dtype).reshape(shape)
        return y.astype(x.dtype)

    def _record(self, mean: jax.Array, variance: jax.Array) -> None:
        """Record the running statistics moved towards a training batch's ``mean`` and
        ``variance``: by ``1 - momentum``, or by ``1 / n`` for the ``n``-th batch (momentum
        None); a held ``batches_tracked`` counts the batch either way (torch's
        ``num_batches_tracked``)."""
        assert self.running_mean is not None and self.running_variance is not None
        dtype, count = self.running_mean.dtype, self.batches_tracked
        wide = statistics_dtype(dtype)  # the blend in float32, rounded once to a bfloat16/float16 buffer (torch's)
        counted = {} if count is None else {"batches_tracked": count + jnp.ones((), count.dtype)}
        if self.momentum is not None:
            old, new = self.momentum, 1 - self.momentum
        elif count is None:  # built with a float momentum, then given None
            raise TypeError(NO_COUNT.format(features=self.running_mean.shape[0]))
        else:
            new = 1 / counted["batches_tracked"].astype(wide)  # torch's exponential_average_factor
            old = 1 - new

        def blend(running: jax.Array, batch: jax.Array) -> jax.Array:
            return (old * running.astype(wide) + new * batch.astype(wide)).astype(dtype)

        record_state(self, running_mean=blend(self.running_mean, mean),
                     running_variance=blend(self.running_variance, variance), **counted)


def _features_at(x: Any, axis: int) -> int:
    """The size of ``x``'s axis ``axis`` (0 where there is none: the layer's checks name it)."""
    ndim = jnp.ndim(x)
    return int(jnp.shape(x)[axis]) if -ndim <= axis < ndim else 0


INSTANCE_ONE = """\
{cls} normalizes each channel over its {spatial} positions, and {given} has one: its \
variance is 0 and every output the offset (torch raises "Expected more than 1 spatial \
element when training").

    wrong:  ft.nn.{cls}({channels})(x)     # x: {given}
    right:  ft.nn.{cls}({channels})(x)     # x with more than one position per channel"""

_INSTANCE_AXES = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}


class _InstanceNorm(Layer):
    scale: jax.Array | None = field(decay=False)
    offset: jax.Array | None = field(decay=False)
    running_mean: jax.Array | None = field(no_derivative=True)
    running_variance: jax.Array | None = field(no_derivative=True)
    channels: int = field(static=True, default=1)
    epsilon: float = field(static=True, default=1e-5)
    momentum: float = field(static=True, default=0.9)
    track_running_stats: bool = field(static=True, default=False)
    training: bool = field(static=True, default=False)
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("momentum",)  # a restore's template decides it

    _rank: ClassVar[int] = 1

    def __init__(
        self,
        channels: int,
        epsilon: float = 1e-5,
        *,
        momentum: float = 0.9,
        affine: bool = False,
        track_running_stats: bool = False,
        dtype: Any = jnp.float32,
        training: bool = False,
    ):
        self.channels = channels = size_argument(type(self).__name__, "channels", channels)
        self.scale = jnp.ones((channels,), dtype) if affine else None
        self.offset = jnp.zeros((channels,), dtype) if affine else None
        self.running_mean = jnp.zeros((channels,), dtype) if track_running_stats else None
        self.running_variance = jnp.ones((channels,), dtype) if track_running_stats else None
        self.epsilon = float(epsilon)
        self.momentum = _momentum(type(self).__name__, momentum, channels)
        self.track_running_stats, self.training = bool(track_running_stats), training

    def __call__(self, x: jax.Array) -> jax.Array:
        n, cls = self._rank, type(self).__name__
        spatial = _INSTANCE_AXES[n]
        if self.track_running_stats:
            for name in ("running_mean", "running_variance"):  # None only in ft.parameters(model): not a model
                if getattr(self, name) is None:
                    raise TypeError(VIEW_CALLED.format(layer=cls, field=name))
        check_unbatched(self, scale=1, offset=1, running_mean=1, running_variance=1)  # an ensemble's, outside vmap
        try:
            check_input(self, x, (*spatial, self.channels))
        except LayerInputError as e:  # torch's [N, C, *spatial]: move the channels
            raise _channels_first(e, x, n, self.channels, f"ft.nn.{cls} takes") from None
        axes = tuple(range(x.ndim - n - 1, x.ndim - 1))
        count = math.prod(x.shape[a] for a in axes)
        xs = x.astype(statistics_dtype(x.dtype))
        if self.training or not self.track_running_stats:
            if _fewer_than_two(count, cls, "channel of each instance", x):
                raise LayerInputError(self, f"[..., {', '.join(spatial)}, {self.channels}] with 2 positions or more",
                                      short_array(x), INSTANCE_ONE.format(cls=cls, spatial=" x ".join(spatial),
                                                                          given=short_array(x), channels=self.channels))
            mean = jnp.mean(xs, axis=axes, keepdims=True)
            var = jnp.mean(jnp.square(xs - mean), axis=axes, keepdims=True)
            if self.training and self.track_running_stats:
                assert self.running_mean is not None and self.running_variance is not None
                batch = tuple(range(x.ndim - n - 1))  # torch: the instances' statistics averaged over the batch
                new_mean = jnp.mean(mean, axis=(*batch, *axes))
                new_var = jnp.mean(var, axis=(*batch, *axes)) * jnp.asarray(count / (count - 1), var.dtype)
                m = self.momentum
                record_state(
                    self,
                    running_mean=m * self.running_mean + (1 - m) * new_mean.astype(self.running_mean.dtype),
                    running_variance=m * self.running_variance + (1 - m) * new_var.astype(self.running_variance.dtype),
                )
        else:
            assert self.running_mean is not None and self.running_variance is not None
            mean, var = (jax.lax.broadcast_to_rank(s.astype(xs.dtype), xs.ndim) for s in (self.running_mean, self.running_variance))
        y = (xs - mean) * jax.lax.rsqrt(var + jnp.asarray(self.epsilon, xs.dtype))
        return _scale_and_shift(y, self.scale, self.offset, x.dtype)


_INSTANCE_DOC = """Instance normalization (Ulyanov et al. 2016) of ``[..., {spatial}, channels]`` (torch's ``InstanceNorm{n}d``, channels last).

    Each channel of each example (every leading index) is normalized over its {n}-D map:
    ``y = (x - mean) / sqrt(var + epsilon) * scale + offset``, mean and biased variance over
    the {spatial} axes, in float32 for bfloat16/float16 inputs. Defaults are torch's:
    ``epsilon=1e-5``, ``affine=False`` (``affine=True``: a per-channel ``scale`` of ones and
    ``offset`` of zeros, torch's ``weight`` and ``bias``), ``track_running_stats=False``.

    ``track_running_stats=True`` keeps ``running_mean`` / ``running_variance`` as ``BatchNorm``
    does (``no_derivative`` fields; ``ft.nn.collect_state``): training records
    ``momentum * running + (1 - momentum) * stat``, ``stat`` the instances' means and
    unbiased variances averaged over the batch (torch's), and inference normalizes with them.
    ``momentum`` (keyword) weighs the old statistics, torch's ``momentum=m`` is ``1 - m`` here
    (default 0.9: torch's 0.1). Without it both modes use each instance's own statistics.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([1., 10., 3., 30.]).reshape({shape})   # two positions of two channels
      >>> ft.nn.{name}(2)(x).ravel().round(3)
      Array([-1., -1.,  1.,  1.], dtype=float32)
    """


class InstanceNorm1D(_InstanceNorm):
    _rank: ClassVar[int] = 1
    __doc__ = _INSTANCE_DOC.format(n=1, name="InstanceNorm1D", spatial="length", shape="1, 2, 2")


class InstanceNorm2D(_InstanceNorm):
    _rank: ClassVar[int] = 2
    __doc__ = _INSTANCE_DOC.format(n=2, name="InstanceNorm2D", spatial="height, width", shape="1, 1, 2, 2")


class InstanceNorm3D(_InstanceNorm):
    _rank: ClassVar[int] = 3
    __doc__ = _INSTANCE_DOC.format(n=3, name="InstanceNorm3D", spatial="depth, height, width", shape="1, 1, 1, 2, 2")


BAD_LRN = """\
LocalResponseNorm: size={given!r}; it is an int >= 1, the number of neighbouring channels summed.

    wrong:  ft.nn.LocalResponseNorm({given!r})
    right:  ft.nn.LocalResponseNorm(5)     # AlexNet's"""


class LocalResponseNorm(Layer):
    """Local response normalization across channels (Krizhevsky et al. 2012; torch's
    ``nn.LocalResponseNorm``, channels last).

    ``y_c = x_c / (k + alpha / size * sum_{c'} x_{c'}^2)^beta`` over the ``size`` channels
    ``c - size // 2 <= c' <= c + (size - 1) // 2`` (zeros past the ends, still divided by
    ``size``), on the last axis of ``[..., channels]``, in float32 for bfloat16/float16.
    Defaults torch's: ``alpha=1e-4, beta=0.75, k=1``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.nn.LocalResponseNorm(2, alpha=1.0, beta=1.0, k=0.0)(jnp.array([1., 1.]))
      Array([2., 1.], dtype=float32)
    """

    size: int = field(static=True, default=5)
    alpha: float = field(static=True, default=1e-4)
    beta: float = field(static=True, default=0.75)
    k: float = field(static=True, default=1.0)

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0):
        if not is_int(size) or size < 1:
            raise ValueError(BAD_LRN.format(given=size))
        self.size, self.alpha, self.beta, self.k = int(size), float(alpha), float(beta), float(k)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_input(self, x, ("channels",))
        xs = x.astype(statistics_dtype(x.dtype))
        window = (1,) * (x.ndim - 1) + (self.size,)
        pads = ((0, 0),) * (x.ndim - 1) + ((self.size // 2, (self.size - 1) // 2),)
        sums = jax.lax.reduce_window(jnp.square(xs), 0.0, jax.lax.add, window, (1,) * x.ndim, pads)
        c = jnp.asarray(self.alpha / self.size, xs.dtype)
        return (xs / jnp.power(jnp.asarray(self.k, xs.dtype) + c * sums, jnp.asarray(self.beta, xs.dtype))).astype(
            x.dtype)
