"""The adaptive softmax (Grave et al. 2017): torch's ``nn.AdaptiveLogSoftmaxWithLoss``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import field
from functree._random import one_key
from functree.nn._check import LayerInputError, check_input, concrete, size_arguments
from functree.nn._initializers import torch_default
from functree.nn._linear import Dense
from functree.nn._mode import Layer

__all__ = ["AdaptiveLogSoftmaxWithLoss", "AdaptiveSoftmaxOutput"]

BAD_CUTOFFS = """\
AdaptiveLogSoftmaxWithLoss: cutoffs must be unique integers, increasing, each in [1, n_classes - 1] \
= [1, {last}] (torch's rule), got cutoffs={cutoffs!r} for n_classes={n_classes}.

    wrong:  ft.nn.AdaptiveLogSoftmaxWithLoss({in_features}, {n_classes}, cutoffs={cutoffs!r}, key=key)
    right:  ft.nn.AdaptiveLogSoftmaxWithLoss({in_features}, {n_classes}, cutoffs={right!r}, key=key)"""

BAD_TARGET = """\
AdaptiveLogSoftmaxWithLoss: target values must be class indices in [0, {last}] (n_classes={n_classes}), \
got values in [{low}, {high}] (torch raises too). Under jit such a row's output is NaN.

    wrong:  asm(x, target)          # target: {given}
    right:  asm(x, target)          # target: int[{shape}] in [0, {last}]"""

BAD_TARGET_SHAPE = """\
AdaptiveLogSoftmaxWithLoss: target must be integer class indices shaped as x without its feature axis: \
{want} for x {x}, got {given}.

    wrong:  asm(x, target)          # target: {given}
    right:  asm(x, target)          # target: int{want}"""


class AdaptiveSoftmaxOutput(NamedTuple):
    """The forward's result, torch's ``_ASMoutput``: each row's ``log p(target)`` and the loss
    ``mean(-output)``."""

    output: jax.Array
    loss: jax.Array


class AdaptiveLogSoftmaxWithLoss(Layer):
    """``log p(y | x)`` over ``n_classes`` by a head over the shortlist and one tail per cluster:
    torch's ``nn.AdaptiveLogSoftmaxWithLoss``.

    ``cutoffs = [c_0, ..., c_{k-1}]`` split the classes into the shortlist ``[0, c_0)`` and
    clusters ``[c_i, c_{i+1})`` (``c_k = n_classes``). The head ``Dense(in_features, c_0 + k)``
    scores the shortlist and one entry per cluster; cluster ``i``'s tail is
    ``Dense(in_features, in_features // div_value^(i+1))`` then ``Dense(.., c_{i+1} - c_i)``
    (no biases). ``log p(y) = head_y`` in the shortlist and ``head_{c_0 + i} + tail_i(y - c_i)`` in
    cluster ``i`` (each a ``log_softmax``). The parameters' names are torch's (``head``,
    ``tail.i.0``, ``tail.i.1``): ``ft.nn.load_torch_state_dict`` reads a torch state dict as it
    is. ``x`` is ``[..., in_features]``; torch's is ``[N, in]`` or ``[in]``.

    Every tail is computed for every row (shapes are static under ``jit``): the forward costs
    what ``log_prob`` costs, not torch's rows-per-cluster subset; the numbers are the same.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> asm = ft.nn.AdaptiveLogSoftmaxWithLoss(8, 10, cutoffs=[4, 7], key=jax.random.key(0))
      >>> x = jax.random.normal(jax.random.key(1), (3, 8))
      >>> out, loss = asm(x, jnp.array([0, 5, 9]))
      >>> out.shape, loss.shape
      ((3,), ())
      >>> bool(jnp.allclose(jnp.exp(asm.log_prob(x)).sum(-1), 1.0))
      True
      >>> asm.predict(x).shape
      (3,)
    """

    head: Dense
    tail: tuple[tuple[Dense, Dense], ...]
    in_features: int = field(static=True, default=1)
    n_classes: int = field(static=True, default=2)
    cutoffs: tuple[int, ...] = field(static=True, default=(1,))   # torch's: the given ones and n_classes
    div_value: float = field(static=True, default=4.0)
    head_bias: bool = field(static=True, default=False)

    def __init__(self, in_features: int, n_classes: int, cutoffs: Sequence[int], div_value: float = 4.0,
                 head_bias: bool = False, *, key: jax.Array, dtype: Any = jnp.float32):
        in_features, n_classes = size_arguments("AdaptiveLogSoftmaxWithLoss", in_features=in_features,
                                                n_classes=n_classes)
        given = list(cutoffs)
        ok = (all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in given) and given
              and given == sorted(set(given)) and given[0] >= 1 and given[-1] <= n_classes - 1)
        if not ok:
            right = sorted({min(max(int(c), 1), n_classes - 1) for c in given if isinstance(c, (int, float))}) or [
                max(1, n_classes // 2)]
            raise ValueError(BAD_CUTOFFS.format(last=n_classes - 1, cutoffs=cutoffs, n_classes=n_classes,
                                                in_features=in_features, right=right))
        self.in_features, self.n_classes = in_features, n_classes
        self.cutoffs = (*(int(c) for c in given), n_classes)
        self.div_value, self.head_bias = float(div_value), bool(head_bias)
        init = torch_default()  # torch's Linear weights: U(±1/sqrt(fan_in))
        keys = jax.random.split(one_key(key), 1 + 2 * len(given))
        self.head = Dense(in_features, given[0] + len(given), use_bias=self.head_bias, key=keys[0], dtype=dtype,
                          weight_initializer=init)
        tail = []
        for i in range(len(given)):
            hidden = int(in_features // (self.div_value ** (i + 1)))  # torch's size
            size = self.cutoffs[i + 1] - self.cutoffs[i]
            tail.append((Dense(in_features, hidden, use_bias=False, key=keys[1 + 2 * i], dtype=dtype,
                               weight_initializer=init),
                         Dense(hidden, size, use_bias=False, key=keys[2 + 2 * i], dtype=dtype,
                               weight_initializer=init)))
        self.tail = tuple(tail)

    @property
    def shortlist_size(self) -> int:
        return self.cutoffs[0]

    def _cluster_log_prob(self, i: int, x: jax.Array) -> jax.Array:
        first, second = self.tail[i]
        return jax.nn.log_softmax(second(first(x)), axis=-1)

    def _check(self, x: jax.Array) -> None:
        check_input(self, x, (self.in_features,))

    def log_prob(self, x: jax.Array) -> jax.Array:
        """``[..., n_classes]``: every class's ``log p(y | x)`` (torch's ``log_prob``)."""
        self._check(x)
        head = jax.nn.log_softmax(self.head(x), axis=-1)
        n = self.shortlist_size
        parts = [head[..., :n]]
        parts += [self._cluster_log_prob(i, x) + head[..., n + i: n + i + 1] for i in range(len(self.tail))]
        return jnp.concatenate(parts, axis=-1)

    def predict(self, x: jax.Array) -> jax.Array:
        """``[...]``: the most likely class (torch's ``predict``: the head's choice where it is a
        shortlist class, else the argmax of ``log_prob``; the same class but at exact ties)."""
        self._check(x)
        head = jnp.argmax(self.head(x), axis=-1)
        return jnp.where(head < self.shortlist_size, head, jnp.argmax(self.log_prob(x), axis=-1))

    def __call__(self, x: jax.Array, target: jax.Array) -> AdaptiveSoftmaxOutput:
        """``(output, loss)``: ``output[...] = log p(target | x)``, ``loss = mean(-output)``."""
        self._check(x)
        self._check_target(x, target)
        target = jnp.asarray(target)
        head = jax.nn.log_softmax(self.head(x), axis=-1)
        n = self.shortlist_size
        cluster = sum((target >= c).astype(target.dtype) for c in self.cutoffs[:-1])  # 0: the shortlist
        output = jnp.zeros(target.shape, head.dtype)
        for i in range(len(self.tail)):
            low, high = self.cutoffs[i], self.cutoffs[i + 1]
            relative = jnp.clip(target - low, 0, high - low - 1)
            local = jnp.take_along_axis(self._cluster_log_prob(i, x), relative[..., None], axis=-1)[..., 0]
            output = jnp.where(cluster == i + 1, local, output)
        column = jnp.where(cluster == 0, target, n + cluster - 1)
        column = jnp.clip(column, 0, head.shape[-1] - 1)
        output = output + jnp.take_along_axis(head, column[..., None], axis=-1)[..., 0]  # torch's order of sums
        # a target outside [0, n_classes) under jit: NaN, never another class's number
        output = jnp.where((target >= 0) & (target < self.n_classes), output, jnp.nan)
        return AdaptiveSoftmaxOutput(output, jnp.mean(-output))

    def _check_target(self, x: jax.Array, target: Any) -> None:
        want = x.shape[:-1]
        dtype = getattr(target, "dtype", None) or jnp.result_type(target)
        if jnp.shape(target) != want or not jnp.issubdtype(dtype, jnp.integer):
            given = f"{jnp.dtype(dtype).name}{list(jnp.shape(target))}"
            raise LayerInputError(self, f"target int{list(want)}", given, BAD_TARGET_SHAPE.format(
                want=list(want), x=f"{jnp.dtype(x.dtype).name}{list(x.shape)}", given=given))
        values = concrete(target)
        if values is not None and values.size and (values.min() < 0 or values.max() >= self.n_classes):
            raise ValueError(BAD_TARGET.format(last=self.n_classes - 1, n_classes=self.n_classes, low=values.min(),
                                               high=values.max(), given=f"int{list(values.shape)}",
                                               shape=", ".join(map(str, values.shape))))
