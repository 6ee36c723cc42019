"""Precision, recall, F1 and top-k accuracy: counting metrics, exact over an epoch.

Each is a ratio of two counts, so it has its parts ``(hits, counted)`` as
:func:`functree.train.accuracy` has (``_metrics.measured``, ``combine_parts``), and its
value over many minibatches is the ratio of the summed counts, the whole epoch's:

    precision = Σ TP / Σ (TP + FP)        recall = Σ TP / Σ (TP + FN)
    F1 = Σ 2TP / Σ (2TP + FP + FN)        top-k = Σ [label in top k] / Σ counted

(scikit-learn's ``precision_score``, ``recall_score``, ``f1_score``, ``top_k_accuracy_score``
over the epoch's predictions). The mean of per-minibatch precisions (torch users' habit,
``ft.train.mean(lambda out: per_batch_precision)``) is another number. A ratio with nothing
to count (no predicted positive for precision, no positive label for recall, neither for
F1) is 0, scikit-learn's ``zero_division`` default (which also warns; a step cannot).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._repr import first_index
from functree.losses._classification import _wide
from functree.nn._check import concrete
from functree.train._metrics import (
    IGNORE_INDEX,
    StepOutput,
    _accuracy_fits,
    _binary_actual,
    _binary_fits,
    _check_binary_labels,
    _describe,
    _find_labels,
    _find_logits,
    _float_class_ids,
    _kept,
    _logits_source,
    _noted,
    _one_hot_ids,
)

__all__ = ["precision", "recall", "f1", "top_k_accuracy"]

NEEDS_POSITIVE = """\
ft.train.{who}: logits of shape {logits} hold {classes} classes and the labels ({labels}) are \
class ids: {who} is of one class against the others. Name the positive class (a mean over \
classes, sklearn's average="macro", is no ratio of counts, and the micro average is the accuracy):

    wrong:  metrics=[ft.train.{who}]
    right:  metrics={{"{who}_{last}": lambda out: ft.train.{who}.of(out.aux, out.batch[-1], positive={last})}}"""

BINARY_SHAPES = """\
ft.train.{who}: logits of shape {logits} do not fit labels of shape {labels}. Binary 0/1 labels \
take one logit each (logits of the labels' shape, or the labels' shape + (1,)); class ids \
(logits.shape[:-1]) or one-hot labels (logits.shape) take positive=c:

    right:  ft.train.{who}.of(logits, labels)                 # binary: logit > threshold
       or:  ft.train.{who}.of(logits, class_ids, positive=2)  # class 2 of logits [..., C]"""

CLASS_SHAPES = """\
ft.train.{who}.of(..., positive={positive}): logits of shape {logits} and labels of shape \
{labels} are no classes: positive=c scores class c of logits [..., C] (C >= 2) against class \
ids of shape logits.shape[:-1] or one-hot labels of shape logits.shape.

    wrong:  ft.train.{who}.of(binary_logits, labels, positive=1)
    right:  ft.train.{who}.of(binary_logits, labels)   # one logit per label: positive is logit > threshold"""

BAD_POSITIVE = """\
ft.train.{who}.of: positive must be a Python int, a class of the logits' last axis \
(0 <= positive < {classes}), or None (binary labels), got {given!r}.

    wrong:  ft.train.{who}.of(logits, labels, positive={given!r})
    right:  ft.train.{who}.of(logits, labels, positive=1)"""

BAD_OPTION = """\
ft.train.{who}.of: {option} must be {expected}, got {given!r}.

    wrong:  ft.train.{who}.of(logits, labels, {option}={given!r})
    right:  ft.train.{who}.of(logits, labels, {option}={right})"""

BAD_K = """\
ft.train.top_k_accuracy: k must be a Python int >= 1, got {given}. It builds the metric \
(a function of the step output): call it with k.

    wrong:  metrics=[ft.train.top_k_accuracy]
    right:  metrics=[ft.train.top_k_accuracy(5)]    # recorded as 'top_5_accuracy'"""

K_NOT_BELOW_CLASSES = """\
ft.train.top_k_accuracy: k={k} is not below the number of classes ({classes}, logits of shape \
{logits}): every label is among the top {k}, a top-{k} accuracy of 1 whatever the model \
(sklearn warns of it). Take k below the classes:

    wrong:  ft.train.top_k_accuracy({k})
    right:  ft.train.top_k_accuracy({right})"""

TOP_K_SHAPES = """\
ft.train.top_k_accuracy: logits of shape {logits} do not fit labels of shape {labels}. It \
takes logits [..., C] (C >= 2) with class ids of shape logits.shape[:-1] or one-hot labels of \
shape logits.shape; binary logits (one per label) have no top k."""

TOP_K_LABEL_OUTSIDE = """\
ft.train.top_k_accuracy: label {label} at labels{where} is not a class of logits of shape {logits} \
(classes 0 to {last}) nor ignore_index ({ignore}). scikit-learn's top_k_accuracy_score raises \
here; the gather of the label's logit would read another class's in its place (-1: the last \
class's, a hit wherever that class ranks high), and under jax.jit, where the labels are not \
seen, the metric is NaN. Leave those labels out, or map them into the classes:

    wrong:  {wrong}
    right:  {right}
       or:  labels in 0 .. {last}"""


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_ignore_index(who: str, ignore_index: Any) -> int | None:
    if ignore_index is not None and not _is_int(ignore_index):
        raise TypeError(BAD_OPTION.format(who=who, option="ignore_index", given=ignore_index, right=255,
                                          expected="a Python int (the label of the positions left out) or None"))
    return None if ignore_index is None else int(ignore_index)


def _check_threshold(who: str, threshold: Any) -> float:
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, (int, float, np.integer, np.floating)):
        raise TypeError(BAD_OPTION.format(who=who, option="threshold", given=threshold, right=0.5,
                                          expected="a Python number (a logit's, 0 by default, or a probability's, 0.5)"))
    return float(threshold)


def _class_ids(who: str, logits: jax.Array, labels: jax.Array, extra: str, where: str | None = None,
               source: str = "out.aux") -> tuple[jax.Array, jax.Array]:
    """``(ids, bad)``: ``labels`` as class ids in JAX's widest int (float ones refused:
    ``_metrics.FLOAT_CLASS_IDS``), or the argmax of one-hot / probability labels of the
    logits' shape, and the rows of those that hold no class (``_metrics.ONE_HOT_ROW``: raised
    where concrete; all False for class ids)."""
    if labels.shape == logits.shape:
        return _one_hot_ids(who, labels, where, source, extra)
    if jnp.issubdtype(labels.dtype, jnp.floating):
        raise ValueError(_float_class_ids(logits, labels, None, who=who, extra=extra, name="float_ids"))
    return _wide(labels), jnp.zeros(labels.shape, bool)  # int64 under x64 (int32 read 2**32 + 1 as class 1)


def _binary(who: str, logits: jax.Array, labels: jax.Array, threshold: float, ignore_index: int | None,
            where: str | None, source: str) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(predicted, actual, kept, bad)`` per label for binary labels: ``logit > threshold``,
    ``label == 1``, ``label != ignore_index``, and a scored label that is no binary label
    (``_metrics._binary_actual``: raised where concrete, ``where`` its path in ``out.batch``)."""
    if not _binary_fits(logits.shape, labels.shape):
        if len(logits.shape) >= 1 and logits.shape[-1] > 1 and labels.shape == logits.shape[:-1]:
            last = logits.shape[-1] - 1
            raise ValueError(NEEDS_POSITIVE.format(who=who, logits=logits.shape, classes=logits.shape[-1],
                                                   labels=_describe(labels), last=last))
        raise ValueError(BINARY_SHAPES.format(who=who, logits=logits.shape, labels=labels.shape))
    kept = _kept(labels, ignore_index)
    actual, bad = _binary_actual(labels, kept)
    _check_binary_labels(who, labels, kept, bad, ignore_index, where, source)
    return logits.reshape(labels.shape) > threshold, actual, kept, bad


def _one_class(who: str, logits: jax.Array, labels: jax.Array, positive: Any,
               ignore_index: int | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(predicted, actual, kept, bad)`` per label for class ``positive`` of logits ``[..., C]``:
    ``argmax(logits) == positive``, ``label == positive``, ``label != ignore_index``, and a
    one-hot row that holds no class (``_class_ids``)."""
    shape = logits.shape
    if not (len(shape) >= 1 and shape[-1] > 1 and (labels.shape == shape[:-1] or
                                                   (labels.shape == shape and len(shape) >= 2))):
        raise ValueError(CLASS_SHAPES.format(who=who, positive=positive, logits=shape, labels=labels.shape))
    if not _is_int(positive) or not 0 <= int(positive) < shape[-1]:
        raise (ValueError if _is_int(positive) else TypeError)(BAD_POSITIVE.format(
            who=who, classes=shape[-1], given=positive))
    ids, bad = _class_ids(who, logits, labels, f", positive={positive}")
    kept = _kept(ids, ignore_index) if labels.shape != shape else jnp.ones(ids.shape, bool)
    return jnp.argmax(logits, axis=-1) == int(positive), ids == int(positive), kept, bad


def _confusion(who: str, logits: Any, labels: Any, positive: Any = None, threshold: Any = 0.0,
               ignore_index: Any = IGNORE_INDEX, where: str | None = None,
               source: str = "out.aux") -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(TP, TP + FP, TP + FN)``: the true positives, the predicted positives and the
    positive labels among the scored labels, as float32 counts; TP NaN where a traced label
    is no binary label (``positive=None``; concrete: raised), so every ratio of them is."""
    threshold, ignore_index = _check_threshold(who, threshold), _check_ignore_index(who, ignore_index)
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if positive is None:
        predicted, actual, kept, bad = _binary(who, logits, labels, threshold, ignore_index, where, source)
    else:
        if threshold != 0.0:  # a class is predicted by argmax: no threshold applies
            raise TypeError(BAD_OPTION.format(who=who, option="threshold", given=threshold, right=0.0,
                                              expected="0 with positive=c (a class is predicted by argmax)"))
        predicted, actual, kept, bad = _one_class(who, logits, labels, positive, ignore_index)
    predicted, actual = predicted & kept, actual & kept
    count = lambda x: jnp.sum(x, dtype=jnp.float32)  # noqa: E731
    tp = jnp.where(bad, jnp.nan, (predicted & actual).astype(jnp.float32))  # traced: NaN, never a label misread
    return count(tp), count(predicted), count(actual)


def _ratio(hits: jax.Array, counted: jax.Array) -> jax.Array:
    """``hits / counted`` (0 where nothing is counted), its parts noted: exact means."""
    return _noted(hits / jnp.maximum(counted, 1.0), hits, counted)


def _precision_parts(tp: jax.Array, predicted: jax.Array, actual: jax.Array) -> tuple[jax.Array, jax.Array]:
    return tp, predicted


def _recall_parts(tp: jax.Array, predicted: jax.Array, actual: jax.Array) -> tuple[jax.Array, jax.Array]:
    return tp, actual


def _f1_parts(tp: jax.Array, predicted: jax.Array, actual: jax.Array) -> tuple[jax.Array, jax.Array]:
    return 2.0 * tp, predicted + actual  # 2TP / (2TP + FP + FN)


def _out_confusion(who: str, out: StepOutput) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The confusion counts of ``out.aux`` (the logits) against the batch's labels (found as
    :func:`functree.train.binary_accuracy` finds them)."""
    logits, source = _find_logits(out.aux), _logits_source(out.aux)
    where, labels = _find_labels(out.batch, logits, _binary_fits, who, source=source)
    return _confusion(who, logits, labels, where=where, source=source)


def _of(parts: Any, name: str) -> Any:
    """``ft.train.<name>.of``: the metric of logits and labels you name."""

    def of(logits: Any, labels: Any, *, positive: int | None = None, threshold: float = 0.0,
           ignore_index: int | None = IGNORE_INDEX) -> jax.Array:
        return _ratio(*parts(*_confusion(name, logits, labels, positive, threshold, ignore_index)))

    of.__qualname__, of.__doc__ = f"{name}.of", OF_DOC.format(name=name, value=OF_VALUES[name])
    return of


def _out_counts(parts: Any, name: str) -> Any:
    """``out -> (hits, counted)`` of the metric ``name`` (its ``__ft_counts__``)."""

    def out_counts(out: StepOutput) -> tuple[jax.Array, jax.Array]:
        return parts(*_out_confusion(name, out))

    return out_counts


OF_VALUES = {"precision": "0.5", "recall": "1.0", "f1": "0.6666666865348816"}  # TP 1, FP 1, FN 0
OF_DOC = """``ft.train.{name}`` of logits and labels you name:

- ``positive=None`` (default): binary labels, 0/1 (int, bool or float) or -1/1 (-1 the
  negative), one logit each (logits of the labels' shape or it + ``(1,)``), predicted
  positive where ``logit > threshold`` (``threshold=0.5`` for a model that outputs
  probabilities, Keras's default). Another label (a class id 2, a soft 0.7, a 0/255 mask's
  255, -1 beside 0) raises ``BINARY_LABEL_VALUE`` where concrete and makes the value NaN
  under ``jax.jit``;
- ``positive=c``: class ``c`` of logits ``[..., C]`` against class ids (``logits.shape[:-1]``)
  or one-hot labels (``logits.shape``), predicted where ``argmax(logits) == c``; a one-hot
  row that holds no class (``jax.nn.one_hot`` of a -100) raises ``ONE_HOT_ROW`` where
  concrete, NaN under ``jax.jit``.

Labels equal to ``ignore_index`` (-100 by default; None: none) are left out. In a step its
means over minibatches are the ratio of the summed counts, as ``ft.train.accuracy``'s.

Example:
  >>> import functree as ft, jax.numpy as jnp
  >>> float(ft.train.{name}.of(jnp.array([0.9, 0.2, 0.7]), jnp.array([1, 0, 0]), threshold=0.5))
  {value}
"""


def precision(out: StepOutput) -> jax.Array:
    """The fraction of predicted positives that are positive, ``TP / (TP + FP)``.

    Labels are the batch's (``batch[-1]`` of a tuple, ``batch["label"]`` of a dict; logits
    the aux or ``aux["logits"]``), binary with one logit each, predicted positive where
    ``logit > 0`` (a sigmoid's logit). Binary labels are 0/1 (int, bool or float) or -1/1
    (-1 the negative); any other (a class id 2 of three classes, a soft label 0.7, a 0/255
    mask's 255, -1 beside 0) raises :data:`functree.train._metrics.BINARY_LABEL_VALUE`
    naming the first and the fix where the labels are concrete, and makes the metric NaN
    under ``jax.jit`` (a Trainer's step): read as ``label > 0.5``, they were counted with
    no error. Labels of the logits' shape
    ``[N, C]`` are multi-label and every element counts (the micro average, as Keras's
    ``Precision``). Labels of -100 are left out. Class ``c`` of a multiclass output, a
    probability threshold or another ignore label:
    ``lambda out: ft.train.precision.of(out.aux, out.batch[-1], positive=c)``
    (``threshold=0.5``, ``ignore_index=255``; :func:`precision.of`). Over minibatches its
    value is Σ TP / Σ (TP + FP) (scikit-learn's ``precision_score`` over the epoch), not
    the mean of the minibatches' precisions; no predicted positive gives 0, as
    scikit-learn's ``zero_division`` default (which also warns; a step cannot).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits, labels = jnp.array([2.0, -1.0, 0.5, 3.0]), jnp.array([1, 1, 0, -100])
      >>> float(ft.train.precision.of(logits, labels))   # TP 1, FP 1 (the -100 left out)
      0.5
      >>> float(ft.train.precision.of(jnp.array([[2.0, 0.0, 1.0], [0.0, 0.0, 3.0]]), jnp.array([0, 2]), positive=2))
      1.0
    """
    return _ratio(*_precision_counts(out))


def recall(out: StepOutput) -> jax.Array:
    """The fraction of positive labels predicted positive, ``TP / (TP + FN)``.

    Labels and logits as :func:`precision` reads them (binary, one logit each, multi-label
    elements, -100 left out; ``recall.of(..., positive=c)`` for class ``c``). Over
    minibatches its value is Σ TP / Σ (TP + FN) (scikit-learn's ``recall_score`` over the
    epoch); no positive label gives 0, as scikit-learn's ``zero_division`` default.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits, labels = jnp.array([2.0, -1.0, 0.5, 3.0]), jnp.array([1, 1, 0, -100])
      >>> float(ft.train.recall.of(logits, labels))   # TP 1, FN 1
      0.5
    """
    return _ratio(*_recall_counts(out))


def f1(out: StepOutput) -> jax.Array:
    """The F1 score, the harmonic mean of precision and recall,

        F1 = 2·TP / (2·TP + FP + FN),

    a ratio of counts (its parts ``2·TP`` and ``2·TP + FP + FN``): over minibatches, the F1
    of the summed counts (scikit-learn's ``f1_score`` over the epoch), not the mean of the
    minibatches' F1s. Labels and logits as :func:`precision` reads them (``f1.of(...,
    positive=c)`` for class ``c``); no positive label nor prediction gives 0, as
    scikit-learn's ``zero_division`` default.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits, labels = jnp.array([2.0, -1.0, 0.5, 3.0, -2.0]), jnp.array([1, 1, 0, 1, 0])
      >>> round(float(ft.train.f1.of(logits, labels)), 6)   # TP 2, FP 1, FN 1: 4 / 6
      0.666667
    """
    return _ratio(*_f1_counts(out))


_precision_counts = _out_counts(_precision_parts, "precision")
_recall_counts = _out_counts(_recall_parts, "recall")
_f1_counts = _out_counts(_f1_parts, "f1")
precision.of = _of(_precision_parts, "precision")  # type: ignore[attr-defined]
recall.of = _of(_recall_parts, "recall")  # type: ignore[attr-defined]
f1.of = _of(_f1_parts, "f1")  # type: ignore[attr-defined]
precision.__ft_counts__ = _precision_counts  # type: ignore[attr-defined]  # marks it counting (counting_names)
recall.__ft_counts__ = _recall_counts  # type: ignore[attr-defined]
f1.__ft_counts__ = _f1_counts  # type: ignore[attr-defined]
for _rising in (precision, recall, f1):  # a monitor's mode=None reads it (functree/train/_direction.py)
    _rising.higher_is_better = True  # type: ignore[attr-defined]


def _top_k_counts(logits: Any, labels: Any, k: int, ignore_index: int | None, of: bool = False,
                  where: str | None = None, source: str = "out.aux") -> tuple[jax.Array, jax.Array]:
    """``(hits, counted)``: the scored labels among the top ``k`` logits (Keras's
    ``in_top_k``: rank ``1 + #(logits > the label's)`` at most ``k``, ties in; a NaN logit at
    the label ranks last), and the labels scored (``ignore_index`` left out). A scored class
    id outside ``[0, C)`` raises :data:`TOP_K_LABEL_OUTSIDE` where concrete (``of``: the
    ``.of`` call named in it) and makes ``hits`` NaN where traced."""
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    shape = logits.shape
    ids_shape = len(shape) >= 1 and labels.shape == shape[:-1]
    one_hot = len(shape) >= 2 and labels.shape == shape
    if not (len(shape) >= 1 and shape[-1] > 1 and (ids_shape or one_hot)):
        raise ValueError(TOP_K_SHAPES.format(logits=shape, labels=labels.shape))
    if k >= shape[-1]:
        raise ValueError(K_NOT_BELOW_CLASSES.format(k=k, classes=shape[-1], logits=shape, right=max(1, shape[-1] - 1)))
    ids, bad = _class_ids("top_k_accuracy", logits, labels, f", k={k}", None if of else where, source)
    kept = _kept(ids, ignore_index) if labels.shape != shape else jnp.ones(ids.shape, bool)
    outside = kept & ((ids < 0) | (ids >= shape[-1]))  # (one-hot labels' argmax: never)
    _check_top_k_labels(ids, outside, shape, k, ignore_index, of)
    at_label = jnp.take_along_axis(logits, jnp.where(kept & ~outside, ids, 0)[..., None], axis=-1)
    at_label = jnp.where(jnp.isnan(at_label), -jnp.inf, at_label)
    hits = (jnp.sum(logits > at_label, axis=-1) < k) & kept
    hits = jnp.where(outside | bad, jnp.nan, hits.astype(jnp.float32))  # traced: NaN, never another class's rank
    return jnp.sum(hits, dtype=jnp.float32), jnp.sum(kept, dtype=jnp.float32)


def _check_top_k_labels(ids: jax.Array, outside: jax.Array, shape: tuple[int, ...], k: int,
                        ignore_index: int | None, of: bool) -> None:
    """:data:`TOP_K_LABEL_OUTSIDE` where the concrete ``outside`` holds a label."""
    bad = concrete(outside)
    if bad is None or not bad.any():
        return
    where = first_index(bad)
    label = int(np.asarray(ids)[where])
    if of:
        wrong = f"ft.train.top_k_accuracy.of(logits, labels, k={k})"
        right = f"ft.train.top_k_accuracy.of(logits, labels, k={k}, ignore_index={label})"
    else:
        wrong, right = f"ft.train.top_k_accuracy({k})", f"ft.train.top_k_accuracy({k}, ignore_index={label})"
    pad = len(right) + 3
    raise ValueError(TOP_K_LABEL_OUTSIDE.format(
        label=label, where=list(where), logits=shape, last=shape[-1] - 1, ignore=ignore_index,
        wrong=f"{wrong:<{pad}}# labels hold {label}", right=f"{right:<{pad}}# left out"))


def _check_k(k: Any) -> int:
    if not _is_int(k) or int(k) < 1:
        given = repr(k) if isinstance(k, (int, float, np.number)) else f"a {type(k).__name__}"
        raise TypeError(BAD_K.format(given=given))
    return int(k)


def top_k_accuracy(k: int = 5, *, ignore_index: int | None = IGNORE_INDEX) -> Any:
    """A metric (named ``"top_{k}_accuracy"``): the fraction of labels among the ``k``
    largest logits,

        top-k accuracy = Σ [rank(label) <= k] / Σ counted,    rank = 1 + #(logits > logit of label),

    Keras's ``TopKCategoricalAccuracy`` / ``SparseTopKCategoricalAccuracy`` (ties with the
    label's logit count for it, as Keras's ``in_top_k``) and scikit-learn's
    ``top_k_accuracy_score`` (equal but for ties). Labels are class ids of shape
    ``logits.shape[:-1]`` (token labels too; labels equal to ``ignore_index``, -100 by
    default, left out, as :func:`accuracy` does) or one-hot labels of ``logits.shape``. A
    counting metric: over minibatches it is Σ hits / Σ counted, the whole epoch's.
    ``ft.train.top_k_accuracy.of(logits, labels, k=5)`` is the same from logits and labels
    you name. ``k`` must be below the number of classes (else every label is in the top k).
    A class id outside ``0 .. C - 1`` (and not ``ignore_index``) raises
    :data:`TOP_K_LABEL_OUTSIDE` where the labels are concrete (scikit-learn raises) and
    makes the metric NaN under ``jax.jit``, never another class's rank; so does a one-hot
    row that holds no class (``jax.nn.one_hot`` of a -100: read as class 0 by its argmax),
    :data:`functree.train._metrics.ONE_HOT_ROW`.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits = jnp.array([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 0.0]])
      >>> metric = ft.train.top_k_accuracy(2)
      >>> metric.__name__
      'top_2_accuracy'
      >>> float(metric(ft.train.StepOutput(jnp.zeros(()), logits, (None, jnp.array([1, 1, -100])), None)))
      0.5
    """
    k = _check_k(k)
    ignore = _check_ignore_index("top_k_accuracy", ignore_index)

    def out_counts(out: StepOutput) -> tuple[jax.Array, jax.Array]:
        logits, source = _find_logits(out.aux), _logits_source(out.aux)
        where, labels = _find_labels(out.batch, logits, _accuracy_fits, "top_k_accuracy", class_ids=True, source=source)
        return _top_k_counts(logits, labels, k, ignore, where=where, source=source)

    def metric(out: StepOutput) -> jax.Array:
        return _ratio(*out_counts(out))

    metric.__name__ = metric.__qualname__ = f"top_{k}_accuracy"
    metric.__ft_counts__ = out_counts  # type: ignore[attr-defined]  # marks it counting (counting_names)
    metric.higher_is_better = True  # type: ignore[attr-defined]
    return metric


def _top_k_accuracy_of(logits: Any, labels: Any, *, k: int = 5, ignore_index: int | None = IGNORE_INDEX) -> jax.Array:
    """:func:`top_k_accuracy` of logits and labels you name (``k`` 5 by default, Keras's).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits = jnp.array([[3.0, 2.0, 1.0], [0.0, 1.0, 2.0]])
      >>> float(ft.train.top_k_accuracy.of(logits, jnp.array([1, 0]), k=2))
      0.5
    """
    k, ignore = _check_k(k), _check_ignore_index("top_k_accuracy", ignore_index)
    return _ratio(*_top_k_counts(logits, labels, k, ignore, of=True))


top_k_accuracy.of = _top_k_accuracy_of  # type: ignore[attr-defined]
