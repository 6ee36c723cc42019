"""Classification and divergence losses, ``(predicted, expected)`` as in swift-apis.

``reduction="none"`` returns one value per example (the class axis is the last one).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._repr import short_array
from functree.losses._reduction import check_float, check_same_shape, reduce

__all__ = [
    "softmax_cross_entropy",
    "sigmoid_cross_entropy",
    "kl_divergence",
    "hinge",
    "squared_hinge",
    "categorical_hinge",
]

FLOAT_LABELS = """\
softmax_cross_entropy: labels {given} have the shape of class indices {index_shape} but a \
floating dtype. Class indices must be integers; probabilities must have the logits' shape \
{prob_shape}.

    wrong:  ft.losses.softmax_cross_entropy(logits, labels)            # labels float
    right:  ft.losses.softmax_cross_entropy(logits, labels.astype(jnp.int32))
       or:  ft.losses.softmax_cross_entropy(logits, jax.nn.one_hot(labels, {classes}))
"""

LABEL_SHAPE = """\
softmax_cross_entropy: for logits {logits}, expected integer labels of shape {index_shape} \
or probabilities of shape {prob_shape}, got {given}.

    right:  ft.losses.softmax_cross_entropy(logits, labels.reshape({index_shape}))
"""


BAD_SMOOTHING = """\
softmax_cross_entropy: label_smoothing must be a number in [0, 1), got {given!r}.

    wrong:  ft.losses.softmax_cross_entropy(logits, labels, label_smoothing={given!r})
    right:  ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=0.1)
"""

LABEL_OUT_OF_RANGE = """\
softmax_cross_entropy: label {label} at labels{where} is not a class of logits {logits} \
(classes 0 to {last}) nor ignore_index ({ignore}). A label outside the classes is never read \
as one (a negative label would index from the end and train toward another token).

    wrong:  ft.losses.softmax_cross_entropy(logits, labels)                   # labels hold {label}
    right:  ft.losses.softmax_cross_entropy(logits, labels, ignore_index={label})   # to skip those positions
       or:  labels below {classes} (a vocabulary of {classes}: resize the head, or fix the collator)
"""

IGNORE_WITH_PROBABILITIES = """\
softmax_cross_entropy: ignore_index={index} needs integer class labels {index_shape}, got \
probabilities {given}. Mask probability targets by giving padded rows zero weight instead:

    wrong:  ft.losses.softmax_cross_entropy(logits, probabilities, ignore_index={index})
    right:  ft.losses.softmax_cross_entropy(logits, labels, ignore_index={index})   # labels int
       or:  (ft.losses.softmax_cross_entropy(logits, probabilities, reduction="none") * keep).sum() / keep.sum()
"""


def softmax_cross_entropy(
    logits: Any,
    labels: Any,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int | None = -100,
    reduction: str = "mean",
) -> jax.Array:
    """``-sum_c target[c] * log_softmax(logits)[c]`` per example, averaged over examples.

    ``labels`` are integer class indices ``[...]`` (``optax.softmax_cross_entropy_with_integer_labels``)
    or probabilities with the logits' shape ``[..., classes]`` (``optax.softmax_cross_entropy``).

    ``label_smoothing=a`` trains on ``target = (1 - a) * labels + a / classes`` (Szegedy et
    al. 2016; ``labels`` one-hot for class indices). ``ignore_index=i`` (integer labels
    only; ``-100`` by default, as torch's ``cross_entropy`` and Hugging Face's collators,
    which put -100 on the prompt and the padding) gives positions whose label is ``i`` a
    loss of zero; the mean is then taken over the other positions only (zero if every
    position is ignored), ``"sum"`` sums them, ``"none"`` returns zeros at ignored
    positions. ``ignore_index=None`` ignores nothing.

    A label outside ``0 .. classes - 1`` (and not ``ignore_index``) is never read as a
    class: concrete labels raise, naming the label and where it is; labels traced under a
    ``jax.jit`` of your own cannot be read, so such a position's loss is NaN (and with it
    the mean and the gradients: a training step's NaN check stops there), never a
    plausible number.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> logits = jnp.array([[2.0, 0.0], [0.0, 2.0]])
      >>> ft.losses.softmax_cross_entropy(logits, jnp.array([0, 1]))
      Array(0.12692..., dtype=float32)
      >>> ft.losses.softmax_cross_entropy(logits, jax.nn.one_hot(jnp.array([0, 1]), 2))
      Array(0.12692..., dtype=float32)
      >>> ft.losses.softmax_cross_entropy(logits, jnp.array([0, -100]))     # -100: ignored
      Array(0.12692..., dtype=float32)
      >>> ft.losses.softmax_cross_entropy(logits, jnp.array([0, 1]), label_smoothing=0.2)
      Array(0.32692..., dtype=float32)
    """
    name = "softmax_cross_entropy"
    logits = check_float(name, "logits", logits)
    labels = jnp.asarray(labels)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0 <= label_smoothing < 1:
        raise ValueError(BAD_SMOOTHING.format(given=label_smoothing))
    index_shape, prob_shape = list(logits.shape[:-1]), list(logits.shape)
    classes = logits.shape[-1]
    keep = None
    if labels.shape == logits.shape[:-1]:
        if not jnp.issubdtype(labels.dtype, jnp.integer):
            raise TypeError(
                FLOAT_LABELS.format(
                    given=short_array(labels), index_shape=index_shape, prob_shape=prob_shape,
                    classes=classes,
                )
            )
        _check_labels(labels, classes, ignore_index, logits)
        keep = None if ignore_index is None else labels != ignore_index
        inside = (labels >= 0) & (labels < classes)
        labels = jnp.where(inside, labels, 0)
        if label_smoothing:
            values = _smoothed(logits, jax.nn.one_hot(labels, classes, dtype=logits.dtype), label_smoothing)
        else:
            values = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        # A traced label outside the classes (the check above could not read it): NaN, never a class.
        outside = ~inside if keep is None else keep & ~inside
        values = jnp.where(outside, jnp.full((), jnp.nan, values.dtype), values)
    elif labels.shape == logits.shape:
        if ignore_index not in (None, -100):  # the default applies to class indices only
            raise ValueError(
                IGNORE_WITH_PROBABILITIES.format(
                    index=ignore_index, index_shape=index_shape, given=short_array(labels)
                )
            )
        values = _smoothed(logits, labels.astype(logits.dtype), label_smoothing)
    else:
        raise ValueError(
            LABEL_SHAPE.format(
                logits=short_array(logits), index_shape=index_shape, prob_shape=prob_shape,
                given=short_array(labels),
            )
        )
    if keep is None:
        return reduce(name, values, reduction)
    values = jnp.where(keep, values, jnp.zeros((), values.dtype))
    if reduction == "mean":
        count = jnp.sum(keep).astype(values.dtype)
        return jnp.sum(values) / jnp.maximum(count, jnp.ones((), values.dtype))
    return reduce(name, values, reduction)


def _check_labels(labels: jax.Array, classes: int, ignore_index: int | None, logits: jax.Array) -> None:
    """Raise :data:`LABEL_OUT_OF_RANGE` for a concrete label outside ``[0, classes)`` that is
    not ``ignore_index`` (traced labels are left to the NaN of the caller)."""
    try:
        given = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    bad = (given < 0) | (given >= classes)
    if ignore_index is not None:
        bad &= given != ignore_index
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(LABEL_OUT_OF_RANGE.format(label=int(given[where]), where=list(where),
                                                   logits=short_array(logits), last=classes - 1, classes=classes,
                                                   ignore=ignore_index))


def _smoothed(logits: jax.Array, targets: jax.Array, smoothing: float) -> jax.Array:
    if smoothing:
        targets = optax.smooth_labels(targets, smoothing)
    return optax.softmax_cross_entropy(logits, targets)


def sigmoid_cross_entropy(logits: Any, labels: Any, *, reduction: str = "mean") -> jax.Array:
    """``-(labels * log(sigmoid(logits)) + (1 - labels) * log(1 - sigmoid(logits)))``,
    elementwise (``optax.sigmoid_binary_cross_entropy``); ``labels`` in [0, 1], same shape.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.sigmoid_cross_entropy(jnp.array([0.0, 0.0]), jnp.array([0.0, 1.0]))
      Array(0.6931472, dtype=float32)
    """
    logits, labels = check_same_shape("sigmoid_cross_entropy", logits, labels)
    return reduce("sigmoid_cross_entropy", optax.sigmoid_binary_cross_entropy(logits, labels), reduction)


def kl_divergence(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``KL(expected || predicted) = sum expected * log(expected / predicted)`` over the last
    axis, for probabilities (``optax.kl_divergence``), averaged over examples (swift-apis'
    ``kullbackLeiblerDivergence`` sums them: ``reduction="sum"``). Terms with
    ``expected == 0`` are zero.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.kl_divergence(jnp.array([0.5, 0.5]), jnp.array([1.0, 0.0]))
      Array(0.6931472, dtype=float32)
    """
    predicted, expected = check_same_shape("kl_divergence", predicted, expected)
    values = optax.kl_divergence(jnp.log(predicted), expected)
    return reduce("kl_divergence", values, reduction)


def hinge(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(max(0, 1 - expected * predicted))`` for labels in {-1, 1}, elementwise.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.hinge(jnp.array([0.5, -2.0]), jnp.array([1.0, -1.0]))
      Array(0.25, dtype=float32)
    """
    predicted, expected = check_same_shape("hinge", predicted, expected)
    return reduce("hinge", jax.nn.relu(1 - expected * predicted), reduction)


def squared_hinge(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(max(0, 1 - expected * predicted)^2)`` for labels in {-1, 1}, elementwise.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.squared_hinge(jnp.array([0.5, -2.0]), jnp.array([1.0, -1.0]))
      Array(0.125, dtype=float32)
    """
    predicted, expected = check_same_shape("squared_hinge", predicted, expected)
    return reduce("squared_hinge", jnp.square(jax.nn.relu(1 - expected * predicted)), reduction)


def categorical_hinge(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``max(0, 1 + max_c((1 - expected) * predicted) - sum_c(expected * predicted))`` per
    example, for one-hot ``expected`` over the last axis.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.categorical_hinge(jnp.array([[2.0, 0.5]]), jnp.array([[1.0, 0.0]]))
      Array(0., dtype=float32)
    """
    predicted, expected = check_same_shape("categorical_hinge", predicted, expected)
    positive = jnp.sum(expected * predicted, axis=-1)
    negative = jnp.max((1 - expected) * predicted, axis=-1)
    return reduce("categorical_hinge", jax.nn.relu(1 + negative - positive), reduction)
