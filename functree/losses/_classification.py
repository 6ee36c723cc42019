"""Classification and divergence losses, ``(predicted, expected)`` as in swift-apis.

``reduction="none"`` returns one value per example (the class axis is the last one).
float16 and bfloat16 inputs are computed in float32, and the loss is float32 (torch's
autocast; see :mod:`functree.losses`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._repr import first_index, short_array
from functree.losses._checks import element_weight
from functree.losses._hinge import clamp_min_zero
from functree.losses._reduction import (
    check_float,
    check_reduction,
    check_same_shape,
    first_outside,
    in_compute_dtype,
    reduce,
    reduced,
)
from functree.losses._weighted import WeightedMean, ratio

__all__ = [
    "softmax_cross_entropy",
    "sigmoid_cross_entropy",
    "kl_divergence",
    "hinge",
    "squared_hinge",
    "categorical_hinge",
]

NOT_INTEGER_LABELS = """\
softmax_cross_entropy: labels {given} have the shape of class indices {index_shape} but dtype \
{dtype}, not an integer dtype. Class indices must be integers; probabilities must have the \
logits' shape {prob_shape} and a floating dtype.

    wrong:  ft.losses.softmax_cross_entropy(logits, labels)            # labels {dtype}
    right:  ft.losses.softmax_cross_entropy(logits, labels.astype(jnp.int32))
       or:  ft.losses.softmax_cross_entropy(logits, jax.nn.one_hot(labels, {classes}))
"""

INTEGER_PROBABILITIES = """\
softmax_cross_entropy: labels {given} have the logits' shape {prob_shape}, so they would be read \
as probabilities over the {classes} classes, but their dtype is {dtype}. Probabilities need a \
floating dtype; class indices need the shape logits.shape[:-1] = {index_shape}. (Integer \
labels of the logits' shape are class indices broadcast by mistake, or one-hot rows: read as \
probabilities, the loss would be silently wrong.)

    wrong:  ft.losses.softmax_cross_entropy(logits, labels)                        # labels {given}
    right:  ft.losses.softmax_cross_entropy(logits, indices)                       # indices: int {index_shape}
       or:  ft.losses.softmax_cross_entropy(logits, labels.argmax(-1))             # one-hot rows
       or:  ft.losses.softmax_cross_entropy(logits, labels.astype(logits.dtype))   # probabilities
"""

TOO_FEW_CLASSES = """\
softmax_cross_entropy: logits {logits} have {what}; a softmax needs a last axis of at least 2 \
classes. A softmax over one class is always 1: the loss would be 0 and every gradient zero \
whatever the labels (torch's cross_entropy returns that 0 silently). A binary head of one \
logit takes the sigmoid cross entropy:

    wrong:  ft.losses.softmax_cross_entropy(logits, labels)       # logits f32[N,1], labels 0/1
    right:  ft.losses.sigmoid_cross_entropy(logits, labels.reshape(logits.shape).astype(logits.dtype))
       or:  ft.losses.softmax_cross_entropy(logits2, labels.reshape(-1))   # a head of 2 logits f32[N,2]
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

SMOOTHING_NOT_A_NUMBER = """\
softmax_cross_entropy: label_smoothing must be a Python or NumPy number in [0, 1), got \
{given}. An array (a JAX array, or a value traced by jax.jit) is not supported: the smoothing \
is checked and fixed when the loss is traced.

    wrong:  ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=jnp.float32(0.1))
    right:  ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=0.1)
       or:  label_smoothing=float(smoothing)   # a concrete array; under jax.jit, a static argument
"""

LABEL_OUT_OF_RANGE = """\
softmax_cross_entropy: label {label} at labels{where} is not a class of logits {logits} \
(classes 0 to {last}) nor ignore_index ({ignore}). A label outside the classes is never read \
as one (a negative label would index from the end and train toward another token).

    wrong:  ft.losses.softmax_cross_entropy(logits, labels)                   # labels hold {label}
    right:  ft.losses.softmax_cross_entropy(logits, {skip})   # to skip those positions
       or:  labels below {classes} (a vocabulary of {classes}: resize the head, or fix the collator)
"""

TORCH_LAYOUT = """\
softmax_cross_entropy: logits {logits} and labels {given} are in torch's layout, the classes on \
axis 1 ([N, C, d1, ...] with labels [N, d1, ...]); here the classes are the last axis, and the \
labels would need the shape {index_shape}. Move the class axis last:

    wrong:  ft.losses.softmax_cross_entropy(logits, labels)                        # logits [N, C, ...]
    right:  ft.losses.softmax_cross_entropy(jnp.moveaxis(logits, 1, -1), labels)   # logits [N, ..., C]
"""

NEGATIVE_PROBABILITIES = """\
softmax_cross_entropy: labels {given} have the logits' shape, so they are read as probabilities \
over the {classes} classes, but labels{where} is {value}: a probability is never negative. \
These are logits (a teacher's, in distillation) or log-probabilities, and the loss would be \
silently another number (it can be negative).

    wrong:  ft.losses.softmax_cross_entropy(logits, teacher_logits)
    right:  ft.losses.softmax_cross_entropy(logits, jax.nn.softmax(teacher_logits))
       or:  ft.losses.softmax_cross_entropy(logits, jnp.exp(log_probabilities))
"""

BAD_WEIGHT = """\
softmax_cross_entropy: weight must be one floating weight per class, f32[{classes}] for logits \
{logits} (torch's CrossEntropyLoss(weight=)); got {given}.

    wrong:  ft.losses.softmax_cross_entropy(logits, labels, weight=w)                         # w {given}
    right:  ft.losses.softmax_cross_entropy(logits, labels, weight=jnp.asarray(w, jnp.float32))  # w [{classes}]
"""

IGNORE_WITH_PROBABILITIES = """\
softmax_cross_entropy: ignore_index={index} needs integer class labels {index_shape}, got \
probabilities {given}. Mask probability targets by giving padded rows zero weight instead:

    wrong:  ft.losses.softmax_cross_entropy(logits, probabilities, ignore_index={index})
    right:  ft.losses.softmax_cross_entropy(logits, labels, ignore_index={index})   # labels int
       or:  (ft.losses.softmax_cross_entropy(logits, probabilities, reduction="none") * keep).sum() / keep.sum()
"""

IGNORE_INDEX_TOO_WIDE = """\
softmax_cross_entropy: ignore_index={index} does not fit JAX's labels dtype {dtype} ({low} to \
{high}; JAX's integers are 32-bit unless jax_enable_x64 is set), so no label could be compared \
with it. Map those labels to the default ignore_index on the host first:

    wrong:  ft.losses.softmax_cross_entropy(logits, labels, ignore_index={index})
    right:  ft.losses.softmax_cross_entropy(logits, np.where(labels == {index}, -100, labels))
"""

BAD_IGNORE_INDEX = """\
{loss}: ignore_index must be a Python int (the label of the positions to skip, -100 by \
default, as torch's) or None (every label scored), got {given}. {why}

    wrong:  ft.losses.{loss}({args}, ignore_index={wrong})
    right:  ft.losses.{loss}({args}, ignore_index={right})
"""


def softmax_cross_entropy(
    logits: Any,
    labels: Any,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int | None = -100,
    weight: Any = None,
    reduction: str = "mean",
) -> Any:
    """``-sum_c target[c] * log_softmax(logits)[c]`` per example, averaged over examples.

    ``labels`` are integer class indices ``[...]`` (``optax.softmax_cross_entropy_with_integer_labels``)
    or floating probabilities with the logits' shape ``[..., classes]``
    (``optax.softmax_cross_entropy``). As torch's ``cross_entropy``, integer labels of the
    logits' shape are refused (class indices broadcast by mistake, or one-hot rows: give
    ``labels.argmax(-1)`` or ``labels.astype(logits.dtype)``), and so are logits of fewer
    than 2 classes (a softmax over one class is 1: a loss of 0 and no gradient whatever the
    labels; a one-logit binary head takes ``ft.losses.sigmoid_cross_entropy``). Concrete
    probabilities below 0 raise :data:`NEGATIVE_PROBABILITIES` (a teacher's logits given as
    targets: a silently wrong, possibly negative loss; traced ones make their example's loss
    NaN), and logits in torch's layout ``[N, C, d1, ...]`` with labels ``[N, d1, ...]``
    raise :data:`TORCH_LAYOUT` (``jnp.moveaxis(logits, 1, -1)``).

    ``label_smoothing=a`` (a Python or NumPy number, not an array) trains on
    ``target = (1 - a) * labels + a / classes`` (Szegedy et al. 2016; ``labels`` one-hot for
    class indices). ``ignore_index=i`` (integer labels
    only; ``-100`` by default, as torch's ``cross_entropy`` and Hugging Face's collators,
    which put -100 on the prompt and the padding) gives positions whose label is ``i`` a
    loss of zero; the mean is then taken over the other positions only (zero if every
    position is ignored), ``"sum"`` sums them, ``"none"`` returns zeros at ignored
    positions. ``ignore_index=None`` ignores nothing. ``reduction="weighted"`` returns the
    mean as its parts, ``ft.losses.WeightedMean(kept positions' summed loss, their count)``
    (with ``weight=``, their summed class weights): ``ft.optim.Optimizer(accumulate=k)``
    then takes the whole minibatch's gradient, ``Σ ∇total_i / Σ count_i``, where the mean
    of the microbatches' means weighs a microbatch of few kept tokens as one of many.

    ``weight=w`` (``[classes]``, torch's ``CrossEntropyLoss(weight=)``) weighs each class:
    with class indices a position counts ``w[label]``, its loss is ``w[label]`` times its
    cross entropy (with smoothing, ``(1 - a) w[y] (-log p_y) + (a / classes) sum_c w_c
    (-log p_c)``), and the mean divides by the kept positions' summed ``w[label]``, as
    torch's (zero if that sum is 0); with probabilities each class term is weighted and the
    mean is over positions.

    A label outside ``0 .. classes - 1`` (and not ``ignore_index``) is never read as a
    class: concrete labels raise, naming the label and where it is (NumPy ``int64`` labels
    are read before JAX's ``int32`` could wrap them); labels traced under a
    ``jax.jit`` of your own cannot be read, so such a position's loss is NaN (and with it
    the mean and the gradients: a training step's NaN check stops there), never a
    plausible number. Labels of any integer dtype (uint8 pixel masks, uint16 token ids)
    are compared as int32 (int64 under ``jax_enable_x64``), as torch's int64: in uint8 the
    default ``-100`` is not label 156, and 256 classes fit.

    float16 and bfloat16 logits are computed in float32 and the loss is float32 (torch's
    autocast runs ``cross_entropy`` in float32; Hugging Face's losses take
    ``logits.float()``): a float16 loss overflows under a loss scale of 65536.

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
      >>> ft.losses.softmax_cross_entropy(logits.astype(jnp.bfloat16), jnp.array([0, 1]))
      Array(0.12692..., dtype=float32)
    """
    name = "softmax_cross_entropy"
    logits = check_float(name, "logits", logits)  # (float32 for half: the kernel's)
    label_smoothing = _smoothing(label_smoothing)
    ignore_index = _ignore_index(name, ignore_index, "logits, labels")
    check_reduction(name, reduction)
    _check_classes(logits)
    # NumPy and Python labels are read on the host before jnp.asarray: with x64 off it wraps an
    # int64 label >= 2**31 into a small one, which the range check would take for a class.
    host = None if isinstance(labels, jax.Array) else np.asarray(labels)
    given = labels if host is None else host
    index_shape, prob_shape = list(logits.shape[:-1]), list(logits.shape)
    classes = logits.shape[-1]
    w = None if weight is None else _class_weights(weight, logits)
    if given.shape == logits.shape[:-1]:
        if not jnp.issubdtype(given.dtype, jnp.integer):
            raise TypeError(
                NOT_INTEGER_LABELS.format(
                    given=short_array(given), index_shape=index_shape, prob_shape=prob_shape,
                    classes=classes, dtype=given.dtype,
                )
            )
        _check_labels(given, classes, ignore_index, logits)
        indices = True
    elif given.shape == logits.shape:
        if not jnp.issubdtype(given.dtype, jnp.floating):
            # As torch: integer (or bool) targets of the logits' shape are refused, never read as
            # probabilities (class indices broadcast by mistake summed to 6 "probabilities").
            raise TypeError(
                INTEGER_PROBABILITIES.format(
                    given=short_array(given), prob_shape=prob_shape, classes=classes,
                    dtype=given.dtype, index_shape=index_shape,
                )
            )
        if ignore_index not in (None, -100):  # the default applies to class indices only
            raise ValueError(
                IGNORE_WITH_PROBABILITIES.format(
                    index=ignore_index, index_shape=index_shape, given=short_array(given)
                )
            )
        negative = first_outside(given, 0, np.inf)
        if negative is not None:
            raise ValueError(NEGATIVE_PROBABILITIES.format(given=short_array(given), classes=classes,
                                                           where=negative[0], value=f"{negative[1]:g}"))
        indices, ignore_index = False, None
    elif logits.ndim >= 3 and given.shape == logits.shape[:1] + logits.shape[2:]:
        raise ValueError(TORCH_LAYOUT.format(logits=short_array(logits), given=short_array(given),
                                             index_shape=index_shape))
    else:
        raise ValueError(
            LABEL_SHAPE.format(
                logits=short_array(logits), index_shape=index_shape, prob_shape=prob_shape,
                given=short_array(given),
            )
        )
    return _softmax_cross_entropy(logits, given, w, ignore_index=ignore_index, smoothing=label_smoothing,
                                  reduction=reduction, indices=indices)


@functools.partial(jax.jit, static_argnames=("ignore_index", "smoothing", "reduction", "indices"))
def _softmax_cross_entropy(logits: jax.Array, given: jax.Array, w: jax.Array | None, *, ignore_index: int | None,
                           smoothing: float, reduction: str, indices: bool) -> Any:
    """The arithmetic of :func:`softmax_cross_entropy` once its inputs are checked: one
    compiled program per shapes and options (called eagerly, ~30 operations were as many
    programs, each compiled at a new shape), inlined into a caller's own ``jax.jit``.
    ``indices``: ``given`` holds class indices (else probabilities)."""
    logits = in_compute_dtype(logits)
    w = None if w is None else w.astype(logits.dtype)
    classes = logits.shape[-1]
    keep = counted = None
    if indices:
        labels = _wide(given)
        keep = None if ignore_index is None else labels != ignore_index
        inside = (labels >= 0) & (labels < classes)
        labels = jnp.where(inside, labels, 0)
        if w is not None:
            values, counted = _weighted(logits, labels, w, smoothing)
        elif smoothing:
            values = _smoothed(logits, jax.nn.one_hot(labels, classes, dtype=logits.dtype), smoothing)
        else:
            values = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        # A traced label outside the classes (the check could not read it): NaN, never a class.
        outside = ~inside if keep is None else keep & ~inside
        values = jnp.where(outside, jnp.full((), jnp.nan, values.dtype), values)
    else:
        targets = given.astype(logits.dtype)
        values = _smoothed(logits, targets, smoothing, w)
        # A traced negative probability (the check could not read it): NaN, never a number.
        values = jnp.where(jnp.any(targets < 0, axis=-1), jnp.full((), jnp.nan, values.dtype), values)
    if keep is None and counted is None:
        return reduce("softmax_cross_entropy", values, reduction)
    zero = jnp.zeros((), values.dtype)
    if keep is not None:
        values = jnp.where(keep, values, zero)
    if reduction in ("mean", "weighted"):  # over the kept positions, each counted by its class's weight (torch's)
        per = jnp.ones_like(values) if counted is None else counted
        total = jnp.sum(per if keep is None else jnp.where(keep, per, zero))
        if reduction == "weighted":
            return WeightedMean(jnp.sum(values), total)
        return ratio(jnp.sum(values), total)
    return reduce("softmax_cross_entropy", values, reduction)


def _smoothing(value: Any) -> float:
    """``label_smoothing`` as a Python float in ``[0, 1)``: Python and NumPy numbers (not bools);
    an array or traced value raises :data:`SMOOTHING_NOT_A_NUMBER`, a number outside raises
    :data:`BAD_SMOOTHING`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        given = short_array(value) if isinstance(value, (jax.Array, np.ndarray)) else repr(value)
        raise TypeError(SMOOTHING_NOT_A_NUMBER.format(given=given))
    if not 0 <= value < 1:  # NaN fails too
        raise ValueError(BAD_SMOOTHING.format(given=value))
    return float(value)


def _check_classes(logits: jax.Array) -> None:
    """Raise :data:`TOO_FEW_CLASSES` unless ``logits`` has a last axis of 2 classes or more."""
    if logits.ndim and logits.shape[-1] >= 2:
        return
    what = "no class axis" if not logits.ndim else f"{logits.shape[-1]} class{'es' if logits.shape[-1] != 1 else ''} on their last axis"
    raise ValueError(TOO_FEW_CLASSES.format(logits=short_array(logits), what=what))


def _check_labels(labels: Any, classes: int, ignore_index: int | None, logits: jax.Array | jax.ShapeDtypeStruct) -> None:
    """Raise :data:`LABEL_OUT_OF_RANGE` for a concrete label outside ``[0, classes)`` that is
    not ``ignore_index`` (traced labels are left to the NaN of the caller). NumPy labels are
    read as given (int64 or uint64), before any conversion to JAX's int32."""
    try:
        given = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    bad = (given < 0) | (given >= classes)
    if ignore_index is not None:
        bad &= given != ignore_index
    if bad.any():
        where = first_index(bad)
        label = int(given[where])
        # An ignore_index beyond int32 cannot be compared with JAX's int32 labels: mask on the host.
        fits = -(2**31) <= label < 2**31
        skip = f"labels, ignore_index={label}" if fits else f"np.where(labels == {label}, -100, labels)"
        raise ValueError(LABEL_OUT_OF_RANGE.format(label=label, where=list(where), skip=skip,
                                                   logits=short_array(logits), last=classes - 1, classes=classes,
                                                   ignore=ignore_index))


def _ignore_index(loss: str, value: Any, args: str) -> int | None:
    """``ignore_index`` as a Python int (or None), in the range of JAX's labels
    (:func:`_check_ignore_width`), or :data:`BAD_IGNORE_INDEX`: it is a static option of the
    compiled kernel, where a JAX array (a traced one too) failed deep in ``jax.jit`` ("Non-hashable
    static arguments"), and torch refuses anything but an int. ``args``: the loss's leading
    arguments, for the message."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        _check_ignore_width(int(value))
        return int(value)
    if isinstance(value, (jax.Array, np.ndarray)):  # (a tracer is a jax.Array)
        given = short_array(value)
        why = ("An array (a JAX array, or a value traced by jax.jit) is not supported: the ignored label is "
               "fixed when the loss is traced (under a jax.jit of your own, pass it as a static argument).")
        wrong, right = "jnp.asarray(pad)", "int(pad)   # concrete; under a jax.jit, a static argument"
    elif isinstance(value, (bool, np.bool_)):
        given, why = repr(value), "A bool is no label (True would skip the class 1); None skips nothing."
        wrong, right = repr(value), "None"
    else:
        given, why = repr(value), "Class labels are integers (torch's ignore_index is an int too)."
        whole = isinstance(value, (float, np.floating)) and float(value).is_integer()
        wrong, right = repr(value), (int(value) if whole else -100)
    raise TypeError(BAD_IGNORE_INDEX.format(loss=loss, given=given, why=why, args=args, wrong=wrong, right=right))


def _check_ignore_width(ignore_index: int | None) -> None:
    """:data:`IGNORE_INDEX_TOO_WIDE` for an ``ignore_index`` beyond :func:`_wide`'s dtype."""
    wide = jax.dtypes.canonicalize_dtype(np.int64)
    info = np.iinfo(wide)
    if ignore_index is not None and not info.min <= ignore_index <= info.max:
        raise ValueError(IGNORE_INDEX_TOO_WIDE.format(index=ignore_index, dtype=wide, low=info.min, high=info.max))


def _wide(labels: jax.Array) -> jax.Array:
    """``labels`` as JAX's widest signed integer (int32; int64 under ``jax_enable_x64``), so
    ``-100`` and the class count compare as numbers: in uint8, ``ignore_index=-100`` wraps to
    156 (real labels 156 were ignored) and ``labels < 256`` casts 256 to 0 (every label was
    outside: NaN). An ``ignore_index`` beyond that dtype is refused first
    (:func:`_check_ignore_width`)."""
    return labels.astype(jax.dtypes.canonicalize_dtype(np.int64))


def _smoothed(logits: jax.Array, targets: jax.Array, smoothing: float, weight: jax.Array | None = None) -> jax.Array:
    """``-sum_c w[c] target[c] log_softmax(logits)[c]`` with the targets smoothed (``w`` = 1 without weights)."""
    if smoothing:
        targets = optax.smooth_labels(targets, smoothing)
    if weight is None:
        return optax.softmax_cross_entropy(logits, targets)
    return -jnp.sum(jax.lax.broadcast_to_rank(weight, targets.ndim) * targets * jax.nn.log_softmax(logits), axis=-1)


def _weighted(logits: jax.Array, labels: jax.Array, weight: jax.Array, smoothing: float) -> tuple[jax.Array, jax.Array]:
    """torch's weighted cross entropy of class indices (in range) and each position's count,
    ``w[y]``: ``(1 - a) w[y] (-log p[y]) + (a / C) sum_c w[c] (-log p[c])``, whose mean is
    their sum over the sum of the counts."""
    log_p = jax.nn.log_softmax(logits)
    counted = weight[labels]
    values = -counted * jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]
    if smoothing:
        values = (1 - smoothing) * values - smoothing / logits.shape[-1] * jnp.sum(jax.lax.broadcast_to_rank(weight, log_p.ndim) * log_p, axis=-1)
    return values, counted


def _class_weights(weight: Any, logits: jax.Array | jax.ShapeDtypeStruct) -> Any:
    """``weight`` as a ``[classes]`` floating array, or :data:`BAD_WEIGHT`."""
    w = weight if isinstance(weight, (jax.Array, np.ndarray)) else np.asarray(weight)
    if w.shape != logits.shape[-1:] or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(BAD_WEIGHT.format(classes=logits.shape[-1], logits=short_array(logits), given=short_array(w)))
    return w  # (in the logits' compute dtype: the kernel's cast)


LABELS_OUTSIDE_UNIT = """\
sigmoid_cross_entropy: labels must be probabilities in [0, 1] (0/1 targets, or soft ones), but \
labels{where} is {value}. Outside [0, 1] the loss is silently another number, unbounded below: \
logits [2, -2, 0.3, -0.4] on labels [1, 0, 1, 0] give 0.3303, on the same labels as -1/1 \
(the hinge losses') -0.2697 and as 0/255 (an image mask's) -145.7, as torch's \
binary_cross_entropy_with_logits returns them. Map them to [0, 1]:

    wrong:  ft.losses.sigmoid_cross_entropy(logits, labels)                      # labels hold {value}
    right:  ft.losses.sigmoid_cross_entropy(logits, (labels + 1) / 2)            # -1/1 labels
       or:  ft.losses.sigmoid_cross_entropy(logits, (labels > 0).astype(logits.dtype))   # 0/255 masks
"""


BAD_POS_WEIGHT = """\
sigmoid_cross_entropy: pos_weight must be a floating array that broadcasts to the labels' shape \
{labels} (torch's BCEWithLogitsLoss(pos_weight=): one weight per class, f32[{classes}]); got \
{given}.

    wrong:  ft.losses.sigmoid_cross_entropy(logits, labels, pos_weight=w)                          # w {given}
    right:  ft.losses.sigmoid_cross_entropy(logits, labels, pos_weight=jnp.asarray(w, jnp.float32))  # w [{classes}]
"""


def sigmoid_cross_entropy(logits: Any, labels: Any, *, pos_weight: Any = None, weight: Any = None,
                          reduction: str = "mean") -> jax.Array:
    """``-(labels * log(sigmoid(logits)) + (1 - labels) * log(1 - sigmoid(logits)))``,
    elementwise (``optax.sigmoid_binary_cross_entropy``); ``labels`` in [0, 1], same shape.

    Concrete labels outside [0, 1] raise :data:`LABELS_OUTSIDE_UNIT` (-1/1 labels, a 0/255
    mask: torch's ``binary_cross_entropy_with_logits`` returns a number for them, negative
    for labels above 1); a traced one (under a ``jax.jit`` of your own, or ``ft.train``'s
    step) cannot be read, and its loss is NaN (a training step's NaN check stops there).

    ``pos_weight=w`` (torch's ``BCEWithLogitsLoss(pos_weight=)``: a floating array that
    broadcasts to the labels' shape, e.g. one weight per class ``[classes]``) weighs the
    positive term: ``-(w * labels * log(sigmoid(logits)) + (1 - labels) * log(1 - sigmoid(logits)))``;
    the mean is over elements, as torch's. ``weight=`` (torch's ``BCEWithLogitsLoss(weight=)``:
    a floating array broadcasting to the labels' shape, per element or per class) rescales each
    element's loss; the mean is still over elements (``mean(weight * loss)``, torch's), not over
    the weights' sum.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.sigmoid_cross_entropy(jnp.array([0.0, 0.0]), jnp.array([0.0, 1.0]))
      Array(0.6931472, dtype=float32)
      >>> ft.losses.sigmoid_cross_entropy(jnp.array([0.0, 0.0]), jnp.array([0.0, 1.0]), pos_weight=jnp.array([3.0, 3.0]))
      Array(1.3862944, dtype=float32)
    """
    logits, labels = check_same_shape("sigmoid_cross_entropy", logits, labels)
    outside = first_outside(labels, 0, 1)
    if outside is not None:
        raise ValueError(LABELS_OUTSIDE_UNIT.format(where=outside[0], value=f"{outside[1]:g}"))
    w = None if pos_weight is None else _positive_weight(pos_weight, labels)
    scale = element_weight("sigmoid_cross_entropy", weight, labels.shape, "BCEWithLogitsLoss")
    return reduced("sigmoid_cross_entropy", _sigmoid_terms, reduction, logits, labels, w, scale)


def _sigmoid_terms(logits: jax.Array, labels: jax.Array, w: jax.Array | None, scale: jax.Array | None) -> jax.Array:
    if w is None:
        values = optax.sigmoid_binary_cross_entropy(logits, labels)
    else:
        w = jnp.broadcast_to(w.astype(labels.dtype), labels.shape)  # (it broadcasts: _positive_weight)
        values = -(w * labels * jax.nn.log_sigmoid(logits) + (1 - labels) * jax.nn.log_sigmoid(-logits))
    if scale is not None:
        values = values * jax.lax.broadcast_to_rank(scale.astype(values.dtype), values.ndim)
    # A traced label outside [0, 1] (the check could not read it): NaN, never a plausible number.
    return jnp.where((labels < 0) | (labels > 1), jnp.full((), jnp.nan, values.dtype), values)


def _positive_weight(pos_weight: Any, labels: jax.Array) -> Any:
    """``pos_weight`` as a floating array broadcasting to the labels' shape (cast to their
    compute dtype by the kernel), or :data:`BAD_POS_WEIGHT`."""
    w = pos_weight if isinstance(pos_weight, (jax.Array, np.ndarray)) else np.asarray(pos_weight)
    try:
        fits = jnp.broadcast_shapes(w.shape, labels.shape) == labels.shape
    except ValueError:
        fits = False
    if not (fits and jnp.issubdtype(w.dtype, jnp.floating)):
        raise ValueError(BAD_POS_WEIGHT.format(given=short_array(w), labels=short_array(labels),
                                               classes=labels.shape[-1] if labels.ndim else 1))
    return w


KL_NOT_PROBABILITIES = """\
kl_divergence: {what} must be probabilities (non-negative, summing to 1 over the last axis), \
but {what}{where} is {value}: log-probabilities (torch's kl_div takes its input as log q, and \
with log_target=True its target as log p) or logits. The divergence would be NaN. Give \
probabilities:

    wrong:  ft.losses.kl_divergence(log_q, p)                # torch: F.kl_div(log_q, p)
    right:  ft.losses.kl_divergence(jnp.exp(log_q), p)       # or jax.nn.softmax(logits)
"""


def kl_divergence(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``KL(expected || predicted) = sum expected * log(expected / predicted)`` over the last
    axis, for probabilities (``optax.kl_divergence``), averaged over examples (swift-apis'
    ``kullbackLeiblerDivergence`` sums them: ``reduction="sum"``). Terms with
    ``expected == 0`` are zero (the limit of ``e * log e``), also where ``predicted == 0``
    there (an underflowed float32 softmax), and so is their gradient; ``predicted == 0``
    where ``expected > 0`` is an infinite divergence. Concrete negative inputs raise
    :data:`KL_NOT_PROBABILITIES` (log-probabilities, as torch's ``kl_div`` takes them, were
    NaN); traced ones are not checked.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.kl_divergence(jnp.array([0.5, 0.5]), jnp.array([1.0, 0.0]))
      Array(0.6931472, dtype=float32)
      >>> ft.losses.kl_divergence(jnp.array([1.0, 0.0]), jnp.array([1.0, 0.0]))
      Array(0., dtype=float32)
    """
    predicted, expected = check_same_shape("kl_divergence", predicted, expected)
    for what, x in (("predicted", predicted), ("expected", expected)):
        negative = first_outside(x, 0, np.inf)
        if negative is not None:
            raise ValueError(KL_NOT_PROBABILITIES.format(what=what, where=negative[0], value=f"{negative[1]:g}"))
    return reduced("kl_divergence", _kl_terms, reduction, predicted, expected)


def _kl_terms(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    zero = expected == 0
    # Both branches of the outer where are differentiated: the inner wheres keep log(0) out of
    # the zero terms' branch, so their value and their gradient are 0, never 0 * inf = NaN.
    one = jnp.ones((), expected.dtype)
    e, p = jnp.where(zero, one, expected), jnp.where(zero, one, predicted)
    return jnp.sum(jnp.where(zero, jnp.zeros((), e.dtype), e * (jnp.log(e) - jnp.log(p))), axis=-1)


ZERO_ONE_LABELS = """\
{loss}: labels must be in {{-1, 1}} (the margin is expected * predicted); given labels in \
{{0, 1}}: expected{where} is 0. A 0 label has margin 0 whatever the prediction, so its term is \
a constant {term} with no gradient, and the loss is silently another (hinge of [2, -2, 0.3, \
-0.4] on [1, 0, 1, 0]: 0.675, where Keras, which maps 0/1 labels to -1/1, gives 0.325). Map \
them to -1/1:

    wrong:  ft.losses.{loss}(predicted, labels)              # labels in {{0, 1}}
    right:  ft.losses.{loss}(predicted, 2 * labels - 1)      # labels in {{-1, 1}}
"""


def _check_signed_labels(loss: str, expected: Any, term: str) -> None:
    """Raise :data:`ZERO_ONE_LABELS` when concrete labels are all 0 or 1 and some are 0:
    0/1 labels, where the hinge losses take -1/1. Traced labels (under ``jax.jit``) cannot
    be read and are taken as given."""
    try:
        given = np.asarray(expected)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    zero = given == 0
    if zero.any() and np.all(zero | (given == 1)):
        where = "".join(f"[{i}]" for i in first_index(zero))
        raise ValueError(ZERO_ONE_LABELS.format(loss=loss, where=where, term=term))


def hinge(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(max(0, 1 - expected * predicted))`` for labels in {-1, 1}, elementwise.

    At the kink (``expected * predicted = 1``) the derivative is ``-expected``: TF's, on which
    Keras's ``maximum(1 - y * p, 0)`` runs (``tf.maximum``'s gradient goes to its first
    argument where they are equal), and torch's ``clamp_min``'s; a margin met exactly still
    learns (``jax.nn.relu``'s 0 there would not; Keras on JAX splits it, ``-expected / 2``).

    Concrete 0/1 labels (all 0 or 1, some 0) raise :data:`ZERO_ONE_LABELS`: their 0s would
    each add a constant 1, silently; give ``2 * labels - 1``. Traced labels are not checked.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.hinge(jnp.array([0.5, -2.0]), jnp.array([1.0, -1.0]))
      Array(0.25, dtype=float32)
    """
    predicted, expected = check_same_shape("hinge", predicted, expected)
    _check_signed_labels("hinge", expected, "max(0, 1 - 0) = 1")
    return reduced("hinge", _hinge_terms, reduction, predicted, expected)


def squared_hinge(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``mean(max(0, 1 - expected * predicted)^2)`` for labels in {-1, 1}, elementwise.

    Concrete 0/1 labels raise :data:`ZERO_ONE_LABELS`, as :func:`hinge`'s (traced ones are
    not checked): give ``2 * labels - 1``. The derivative at the kink is 0 (``2 max(0, z)``
    is 0 there, whatever convention the ``max`` takes).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.squared_hinge(jnp.array([0.5, -2.0]), jnp.array([1.0, -1.0]))
      Array(0.125, dtype=float32)
    """
    predicted, expected = check_same_shape("squared_hinge", predicted, expected)
    _check_signed_labels("squared_hinge", expected, "max(0, 1 - 0)^2 = 1")
    return reduced("squared_hinge", _squared_hinge_terms, reduction, predicted, expected)


def categorical_hinge(predicted: Any, expected: Any, *, reduction: str = "mean") -> jax.Array:
    """``max(0, 1 + max_c((1 - expected) * predicted) - sum_c(expected * predicted))`` per
    example, for one-hot ``expected`` over the last axis (Keras's). At the kink (the margin
    met exactly) the outer ``max(0, .)`` passes the gradient, as TF's ``tf.maximum`` (see
    :func:`hinge`); tied largest wrong scores share it equally, as TF's ``reduce_max``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.losses.categorical_hinge(jnp.array([[2.0, 0.5]]), jnp.array([[1.0, 0.0]]))
      Array(0., dtype=float32)
    """
    predicted, expected = check_same_shape("categorical_hinge", predicted, expected)
    return reduced("categorical_hinge", _categorical_hinge_terms, reduction, predicted, expected)


# The hinge losses' terms (module-level: each keys its compiled program; see reduced).
# Keras's max(z, 0) is tf.maximum(z, 0), whose gradient goes to z where z >= 0 (TF's
# _MaximumGrad: greater_equal): at the kink z = 0 the derivative is 1, torch's clamp_min's
# too (relu's is 0). squared_hinge's derivative there is 0 whichever (2 max(z, 0)).
def _hinge_terms(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    return clamp_min_zero(1 - expected * predicted)


def _squared_hinge_terms(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    return jnp.square(clamp_min_zero(1 - expected * predicted))


def _categorical_hinge_terms(predicted: jax.Array, expected: jax.Array) -> jax.Array:
    positive = jnp.sum(expected * predicted, axis=-1)
    negative = jnp.max((1 - expected) * predicted, axis=-1)  # tied maxima share the gradient, as TF's reduce_max
    return clamp_min_zero(1 + negative - positive)
