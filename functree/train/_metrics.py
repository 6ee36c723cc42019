"""Metrics: per-minibatch values computed inside the jitted step, averaged on device.

A metric is any function ``metric(out) -> scalar`` of a :class:`StepOutput` (the loss,
the loss function's aux output, the batch and the model). The value of a metric over
several minibatches is the mean weighted by minibatch size,

    metric = Σ_b n_b · metric_b / Σ_b n_b,

the exact per-example mean of a mean-reduced loss. It is not one for accuracy, whose
minibatch value ``hits_b / counted_b`` counts labels, not examples (token labels, labels
of -100 left out): a counting metric's value (``accuracy``, ``binary_accuracy``, ``precision``,
``recall``, ``f1``, ``top_k_accuracy(k)``, their ``.of``, through any lambda or override, rescaled too) is weighed by its counted labels
instead, from two parts every train and eval step records beside it (:func:`measured`,
decided at trace time; the step's returned metrics leave them out) and
:func:`combine_parts` divides,

    accuracy = Σ_b hits_b / Σ_b counted_b       (torch's and HF's per-token accuracy).

Per-step values are written into a device buffer by the step and reach the host only when the
training loop reads it (at log intervals): no per-step synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree import _compat as compat
from functree._repr import first_index
from functree._source import call_refusal
from functree._warnings import user_stacklevel
from functree.losses._classification import _wide
from functree.losses._weighted import WeightedMean, ratio
from functree.nn._check import concrete
from functree.train._direction import rises

__all__ = ["StepOutput", "accuracy", "binary_accuracy", "mean", "resolve_metrics", "batch_size_of", "shared_batch_size",
           "with_parts", "without_parts", "counting_names", "combine_parts", "measured", "PART_SUM", "PART_COUNT",
           "PART_RATIO", "InexactMeanWarning", "BAD_IGNORE_INDEX", "BAD_THRESHOLD", "BINARY_LABEL_VALUE", "BINARY_LABEL_SIGNS",
           "ONE_HOT_ROW", "UNRECORDED_AUX", "METRIC_ARGUMENTS", "METRIC_NOT_A_NUMBER", "MetricCallError", "check_metric_call", "UnrecordedAuxWarning",
           "warn_unrecorded_aux"]

NO_LOGITS = """\
ft.train.accuracy needs the model's outputs (logits) as the loss function's aux output, \
got aux={aux}.

    wrong:  def loss_fn(model, batch): return ft.losses.softmax_cross_entropy(model(x), y)
    right:  def loss_fn(model, batch):
                logits = model(x)
                return ft.losses.softmax_cross_entropy(logits, y), logits     # (loss, aux)"""

NO_LABELS = """\
ft.train.accuracy could not find the labels in the batch ({batch}). It reads batch[-1] \
of a tuple/list or the first of batch["label"], ["labels"], ["y"], ["target"], ["targets"] \
of a dict, an array. Name them, e.g.

    metrics={{"accuracy": lambda out: ft.train.accuracy.of(out.aux, out.batch["target"])}}"""

LABELS_OR_WEIGHTS = """\
ft.train.{who} cannot tell which item of this batch of {n} items ({batch}) holds the labels. \
batch[-1] ({last}) is floating-point, one number per example, and batch[-2] ({prev}) has the \
shape of labels for these logits ({logits}). Two readings, and nothing but the values (unknown \
inside the traced step) tells them apart:
  - (x, y, sample_weight), Keras's layout: the labels are batch[-2], batch[-1] the weights \
(scoring the weights as labels casts and compares them, with no error);
  - (x, ..., y), e.g. (x, mask, y) for BCEWithLogitsLoss: the labels are batch[-1].
Name the labels:

    wrong:  metrics=[ft.train.{who}]
    right:  metrics={{"{who}": lambda out: ft.train.{who}.of({source}, out.batch[{i_prev}])}}   # (x, y, sample_weight)
       or:  metrics={{"{who}": lambda out: ft.train.{who}.of({source}, out.batch[{i_last}])}}   # labels last"""

FLOAT_CLASS_IDS_OR_WEIGHTS = """\
ft.train.accuracy cannot tell which item of this batch of {n} items ({batch}) holds the labels. \
batch[-1] ({last}) is floating-point of the class-index shape of these logits ({logits}: \
logits.shape[:-1]), and batch[-2] ({prev}) has that shape too. Float numbers are not class \
indices (torch's cross_entropy refuses them), and nothing but the values (unknown inside the \
traced step) tells the two readings apart:
  - (x, y, sample_weight), Keras's layout (per-token weights: sample_weight_mode="temporal"), \
or (input_ids, labels, loss_mask): the labels are batch[-2], batch[-1] the weights or mask \
(scoring them as class ids casts and compares them, with no error; accuracy does not apply \
the weights);
  - (x, ..., y) with class ids stored as floats: the labels are batch[-1], cast to integers.
Name the labels:

    wrong:  metrics=[ft.train.accuracy]
    right:  metrics={{"accuracy": lambda out: ft.train.accuracy.of({source}, {prev_fix})}}   # (x, y, sample_weight)
       or:  metrics={{"accuracy": lambda out: ft.train.accuracy.of({source}, {last_fix})}}   # labels last"""

FLOAT_CLASS_IDS = """\
ft.train.{who}: the labels {where}({labels}) are floating-point, of the class-index shape of \
the logits ({logits}: logits.shape[:-1]). Class indices are integers (torch's cross_entropy \
refuses float ones); floats of that shape are sample weights or a mask more often than labels, \
and scoring them as class ids (cast, compared) gives a wrong {who} with no error. If they \
are class ids, cast them; weights or a mask: name the labels instead.

    wrong:  {wrong}
    right:  {right}"""

SHAPES = """\
ft.train.accuracy: logits of shape {logits} do not fit labels of shape {labels}. Labels are \
class indices of shape logits.shape[:-1], one-hot/probabilities of shape logits.shape, or \
binary 0/1 targets with logits of shape labels.shape or labels.shape + (1,)."""

BAD_METRIC = """\
A metric must be a function of the step output (out.loss, out.aux, out.batch, out.model) \
returning a scalar, got {name}={value!r}.

    wrong:  metrics={{"accuracy": 0.5}}
    right:  metrics={{"accuracy": ft.train.accuracy, "mse": ft.train.mean("mse")}}"""

METRIC_ARGUMENTS = """\
The metric {name!r} is {fn}{signature}, but a metric is called with one argument, the step's \
output: fn(out), with out.loss, out.aux (the loss function's second result, as in \
return loss, logits), out.batch and out.model of this minibatch. Called so, it would fail \
inside the step (Python's "{problem}"). Take out and read what you need from it:

    wrong:  {wrong}   # {fn}{signature}
    right:  {right}{note}"""

class MetricCallError(TypeError):
    """:data:`METRIC_ARGUMENTS`: a metric that cannot be called as ``fn(out)``, read from its
    signature, never from a minibatch, or :data:`METRIC_NOT_A_NUMBER`, one that returns no
    number (None) whatever the minibatch: ``Trainer.fit`` raises it as it is, without the
    minibatch's location and shapes it adds to a step's other errors."""


_MODEL_NAMES = ("model", "m", "net", "network", "module", "params", "p")


def check_metric_call(name: str, fn: Any, spelling: str = "metrics={{{name!r}: {fn}}}") -> None:
    """Refuse a metric that cannot be called as ``fn(out)`` (:data:`METRIC_ARGUMENTS`): a
    loss-like ``fn(model, batch)`` or Keras's ``fn(y_true, y_pred)`` failed at the first
    step with Python's "missing 1 required positional argument", which named neither the
    metric nor what it is given. ``spelling``: how the user passed it (``{name}``, ``{fn}``
    filled in). A callable without a readable signature is left to its call."""
    refused = call_refusal(fn, None)
    if refused is None:
        return
    label, signature, problem = refused
    right, note = _metric_fix(label, [p.name for p in signature.parameters.values()
                                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    raise MetricCallError(METRIC_ARGUMENTS.format(
        name=name, fn=label, signature=signature, problem=problem, note=note,
        wrong=spelling.format(name=name, fn=label), right=spelling.format(name=name, fn=right)))


def _metric_fix(label: str, params: list[str]) -> tuple[str, str]:
    """The ``fn(out)`` that calls a metric written with ``params``, and a note for the line."""
    note = ""
    if len(params) >= 2 and params[0] in _MODEL_NAMES:  # a loss-like fn(model, batch)
        args = "out.model, out.batch" if len(params) == 2 else "out.model, *out.batch"
    elif len(params) == 2:  # Keras's (y_true, y_pred): the labels, then the predictions
        args, note = "out.batch[-1], out.aux", "   # the loss function returns (loss, predictions)"
    else:
        args = ", ".join(f"out.{p}" if p in StepOutput._fields else "..." for p in params)
    if label == "<lambda>":  # its body, with the arguments read from out
        return "lambda out: ...", (f"   # {', '.join(params)} read as {args}{note}" if params else "")
    return f"lambda out: {label}({args})", note


NOT_SCALAR = """\
The metric {name!r} returned shape {shape}; a metric returns one number per minibatch.
    right:  {name!r}: lambda out: jnp.mean(...)"""

METRIC_NOT_A_NUMBER = """\
The metric {name!r} returned {given}, not a number: a metric returns one number per \
minibatch (an array of shape ()).{why}

    wrong:  {wrong}
    right:  {right}"""

_NONE_WHY = (" A function without a return statement returns None, and out.aux is None when the loss"
             " function returns the loss alone (return loss, logits sets it).")

MISSING_AUX_KEY = """\
ft.train.mean({key!r}) reads aux[{key!r}], but the loss function's aux is {aux}.
    right:  def loss_fn(model, batch): ...; return loss, {{{key!r}: value}}"""

KERAS_METRIC_NAME = """
{key!r} is Keras's metric name, but a name in metrics is a key of the loss function's aux \
here (ft.train.mean({key!r})). functree's {what}:

    wrong:  metrics=[{key!r}]
    right:  metrics={right}   # {needs}"""

_ACCURACY = ("[ft.train.accuracy]", "accuracy", "the loss function returns (loss, logits)")
_TOP_K = "[ft.train.top_k_accuracy(5)]"  # Keras's k=5; recorded as "top_5_accuracy"
_BINARY = ("the loss function returns (loss, logits); binary labels, positive where logit > 0 (Keras's threshold "
           "0.5 is on probabilities: a sigmoid-last model needs ft.train.{name}.of(out.aux, out.batch[-1], "
           "threshold=0.5)); class c of several: ft.train.{name}.of(out.aux, out.batch[-1], positive=c)")
KERAS_METRICS: dict[str, tuple[str, str, str]] = {
    # Keras's metric name: (functree's metrics=, what it is, what it needs). The one that is
    # said depends only on the name, so a loss returning {"accuracy": ...} as aux keeps working.
    "accuracy": _ACCURACY, "acc": _ACCURACY,
    "sparse_categorical_accuracy": _ACCURACY,
    "categorical_accuracy": _ACCURACY,  # ft.train.accuracy reads one-hot labels too
    "binary_accuracy": ("[ft.train.binary_accuracy]", "binary accuracy",
                        "the loss function returns (loss, logits)"),
    **dict.fromkeys(("mae", "mean_absolute_error"), (
        '{"mae": ft.train.mean(lambda out: jnp.abs(out.aux - out.batch[-1]))}', "mean absolute error",
        "the loss function returns (loss, predictions)")),
    **dict.fromkeys(("mse", "mean_squared_error"), (
        '{"mse": ft.train.mean(lambda out: jnp.square(out.aux - out.batch[-1]))}', "mean squared error",
        "the loss function returns (loss, predictions)")),
    **dict.fromkeys(("top_k_accuracy", "sparse_top_k_categorical_accuracy"), (
        _TOP_K, "top-5 accuracy", "the loss function returns (loss, logits); labels: class ids")),
    "top_k_categorical_accuracy": (_TOP_K, "top-5 accuracy", "the loss function returns (loss, logits); labels: one-hot"),
    "precision": ("[ft.train.precision]", "precision, TP / (TP + FP) over the epoch", _BINARY.format(name="precision")),
    "recall": ("[ft.train.recall]", "recall, TP / (TP + FN) over the epoch", _BINARY.format(name="recall")),
    "f1_score": ("[ft.train.f1]", "F1, 2TP / (2TP + FP + FN) over the epoch, of one class (Keras's F1Score "
                 "gives one per class)", _BINARY.format(name="f1")),
}

KERAS_NOT_PROVIDED = """
{key!r} is Keras's metric name (keras.metrics.AUC), but a name in metrics is a key of the loss \
function's aux here (ft.train.mean({key!r})), and functree has no AUC metric: the area under the \
ROC curve ranks every example of the epoch against every other, which no per-minibatch counts \
give exactly (Keras's AUC interpolates 200 thresholds: an approximation). Compute it from the \
epoch's scores (logits or probabilities: the same ranks):

    wrong:  metrics=[{key!r}]
    right:  sklearn.metrics.roc_auc_score(y_val, np.ravel(trainer.predict(val_data)))   # binary: one logit each"""
"""The end of :data:`MISSING_AUX_KEY` for Keras's ``"auc"``: its recipe from the epoch's
predictions (``Trainer.predict``), scikit-learn's exact ``roc_auc_score``.

Example:
  >>> print(KERAS_NOT_PROVIDED.format(key="auc").splitlines()[-1].strip())
  right:  sklearn.metrics.roc_auc_score(y_val, np.ravel(trainer.predict(val_data)))   # binary: one logit each
"""

KERAS_NOT_PROVIDED_NAMES = ("auc",)


def _missing_aux_key(key: str, aux: Any) -> str:
    """:data:`MISSING_AUX_KEY`, with :data:`KERAS_METRIC_NAME` for a name Keras users write."""
    message = MISSING_AUX_KEY.format(key=key, aux=_describe(aux))
    if key.lower() in KERAS_METRICS:
        right, what, needs = KERAS_METRICS[key.lower()]
        message += KERAS_METRIC_NAME.format(key=key, right=right, what=what, needs=needs)
    elif key.lower() in KERAS_NOT_PROVIDED_NAMES:
        message += KERAS_NOT_PROVIDED.format(key=key)
    return message


AUX_WEIGHTED_MEAN = """\
ft.train.mean({key!r}) averages the array aux[{key!r}], but it is a ft.losses.WeightedMean \
(total, count): a mean already, whose means over minibatches are Σ total / Σ count when a \
metric function returns it. Return it from one:

    wrong:  metrics={{{key!r}: ft.train.mean({key!r})}}
    right:  metrics={{{key!r}: lambda out: out.aux[{key!r}]}}"""


class StepOutput(NamedTuple):
    """What a metric sees: this minibatch's loss and aux output, the batch, the model.

    A metric is ``fn(out: StepOutput) -> scalar``; ``aux`` is the second item of a loss
    function returning ``(loss, aux)`` (else None), ``model`` the model before the update.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> max_abs = lambda out: jnp.max(jnp.abs(out.aux))
      >>> loss_fn = lambda m, b: (jnp.mean(b * m), b * m)  # (loss, aux)
      >>> evaluate = ft.train.eval_step(loss_fn, metrics={"max_abs": max_abs})
      >>> evaluate(jnp.float32(2.0), jnp.array([1.0, -3.0]))
      {'loss': Array(-2., dtype=float32), 'max_abs': Array(6., dtype=float32)}
    """

    loss: jax.Array
    aux: Any
    batch: Any
    model: Any
    parts: Any = None
    """The loss as ``ft.losses.WeightedMean(total, count)`` when the loss function returned
    one (``reduction="weighted"``; ``loss`` is then its value): the means over minibatches
    weigh each by its ``count`` (kept tokens), Σ total / Σ count. None otherwise."""


def _describe(x: Any) -> str:
    return str(jax.tree.map(lambda a: f"{getattr(a, 'dtype', type(a).__name__)}{list(np.shape(a))}", x))


def describe_batch(batch: Any) -> str:
    """A batch's structure with each leaf as ``dtype[shape]``, for error messages.

    Example:
      >>> import numpy as np
      >>> describe_batch((np.zeros((4, 3), np.float32), np.zeros(4, np.int32)))
      "('float32[4, 3]', 'int32[4]')"
    """
    return _describe(batch)


LOGITS_KEYS = ("logits", "outputs", "predictions", "y_pred")  # an aux dict's logits, by the first of these


def _find_logits(aux: Any) -> Any:
    if isinstance(aux, Mapping):
        for name in LOGITS_KEYS:
            if name in aux:
                return aux[name]
    if isinstance(aux, (tuple, list)) and aux:
        return aux[0]
    if hasattr(aux, "shape"):
        return aux
    raise ValueError(NO_LOGITS.format(aux=_describe(aux)))


def _logits_source(aux: Any) -> str:
    """Where :func:`_find_logits` read the logits, as code for an error's fix line."""
    if isinstance(aux, Mapping):
        name = next((n for n in LOGITS_KEYS if n in aux), None)
        if name is not None:
            return f'out.aux["{name}"]'
    if isinstance(aux, (tuple, list)) and aux:
        return "out.aux[0]"
    return "out.aux"


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_float(x: Any) -> bool:
    return _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


LABEL_KEYS = ("label", "labels", "y", "target", "targets")


def _find_labels(batch: Any, logits: Any, fits: Callable[[tuple, tuple], bool], who: str,
                 class_ids: bool = False, source: str = "out.aux") -> tuple[str, Any]:
    """``(where, labels)``: the labels of ``batch`` (a dict's by name, a tuple's last) and
    their path for error messages (``out.batch[2]``, ``out.batch["labels"]``).

    Keras's ``(x, y, sample_weight)`` puts float weights last, where a ``(x, mask, y)``
    batch (torch's BCEWithLogitsLoss: float 0/1 targets) puts its labels. Only types and
    shapes are known (the step is traced), so a float last item of three or more is checked
    against ``batch[-2]`` (:func:`_two_readings`): where both read as labels, an error names both."""
    where, found = "", None
    if isinstance(batch, Mapping):
        key = next((n for n in LABEL_KEYS if n in batch), None)
        where, found = (f'out.batch["{key}"]', batch[key]) if key is not None else ("", None)
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        where, found = f"out.batch[{len(batch) - 1}]", batch[-1]
        if len(batch) >= 3 and _is_float(found) and _is_array(batch[-2]):
            _two_readings(batch, logits, fits, who, class_ids, source)
    if found is None or not hasattr(found, "shape"):  # absent, or a nested dict / list
        raise ValueError(NO_LABELS.format(batch=_describe(batch)))
    return where, found


def _two_readings(batch: Sequence[Any], logits: Any, fits: Callable[[tuple, tuple], bool], who: str,
                  class_ids: bool, source: str = "out.aux") -> None:
    """Raise where a float ``batch[-1]`` and ``batch[-2]`` both read as labels.

    - ``batch[-1]`` of the class-index shape ``logits.shape[:-1]`` (``class_ids``: accuracy)
      is no class ids as it is (floats never are): a ``batch[-2]`` of that shape is the
      labels of Keras's ``(x, y, sample_weight)`` (per-token weights too) or of
      ``(input_ids, labels, loss_mask)``, unless the floats are class ids to cast. Of no
      other ``batch[-2]``, :func:`_accuracy_counts` refuses the floats, naming the cast.
    - one float per example (binary targets or weights): a ``batch[-2]`` that ``fits`` the
      logits is the labels of ``(x, y, sample_weight)``, or ``(x, mask, y)``'s mask; one that
      does not (a ``[N, D]`` mask) leaves the last as labels.
    - float labels of the logits' shape (one-hot, probabilities, 0/1 targets) are read."""
    last, prev, n, shape = batch[-1], batch[-2], len(batch), tuple(np.shape(logits))
    if class_ids and _class_ids_shape(shape, tuple(last.shape)):
        if tuple(prev.shape) == tuple(last.shape):
            raise ValueError(FLOAT_CLASS_IDS_OR_WEIGHTS.format(
                n=n, batch=_describe(batch), last=_describe(last), prev=_describe(prev),
                logits=_describe(logits), prev_fix=_as_class_ids(f"out.batch[{n - 2}]", prev),
                last_fix=_as_class_ids(f"out.batch[{n - 1}]", last), source=source))
        return
    if last.ndim <= 1 and fits(shape, tuple(prev.shape)):
        raise ValueError(LABELS_OR_WEIGHTS.format(
            who=who, n=n, batch=_describe(batch), last=_describe(last), prev=_describe(prev),
            logits=_describe(logits), i_prev=n - 2, i_last=n - 1, source=source))


def _as_class_ids(path: str, x: Any) -> str:
    """``path``, cast to int32 where ``x`` is floating-point (class ids must be integers)."""
    return f"{path}.astype(jnp.int32)" if _is_float(x) else path


IGNORE_INDEX = -100
"""A class-index label :func:`accuracy` leaves out (HF's and torch's ``ignore_index``; the
default of ``ft.losses.softmax_cross_entropy``)."""


def _class_ids_shape(logits: tuple, labels: tuple) -> bool:
    """Whether labels of this shape are class indices for these logits: ``logits.shape[:-1]``
    with two classes or more."""
    return len(logits) >= 1 and logits[-1] > 1 and labels == logits[:-1]


def _accuracy_fits(logits: tuple, labels: tuple) -> bool:
    """Whether :func:`accuracy` scores labels of this shape against logits of that one."""
    return _class_ids_shape(logits, labels) or labels == logits or logits == (*labels, 1)


def _float_class_ids(logits: jax.Array, labels: jax.Array, where: str | None, source: str = "out.aux", *,
                     who: str = "accuracy", extra: str = "", name: str = "labels") -> str:
    """:data:`FLOAT_CLASS_IDS` for labels at ``where`` in ``out.batch`` (None: ``<who>.of``
    of labels shown as ``name``, ``extra`` its other arguments: ``, positive=1``)."""
    if where is None:
        wrong = f"ft.train.{who}.of(logits, {name}{extra})"
        right = f"ft.train.{who}.of(logits, {name}.astype(jnp.int32){extra})"
    else:
        wrong = f"metrics=[ft.train.{who}]"
        right = f'metrics={{"{who}": lambda out: ft.train.{who}.of({source}, {where}.astype(jnp.int32){extra})}}'
    return FLOAT_CLASS_IDS.format(who=who, where=f"{where} " if where else "", labels=_describe(labels),
                                  logits=_describe(logits), wrong=wrong, right=right)


def _accuracy_counts(logits: Any, labels: Any, where: str | None = None, source: str = "out.aux",
                     ignore_index: int | None = IGNORE_INDEX) -> tuple[jax.Array, jax.Array]:
    """``(hits, counted)``: the labels whose predicted class is theirs, and the labels
    scored (class indices equal to ``ignore_index`` left out; None: none), as float32 counts.
    Float class indices are refused (:data:`FLOAT_CLASS_IDS`; ``where``: their path in
    ``out.batch``): floats of that shape are weights or a mask more often than labels."""
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if _class_ids_shape(logits.shape, labels.shape):  # class indices
        if jnp.issubdtype(labels.dtype, jnp.floating):
            raise ValueError(_float_class_ids(logits, labels, where, source))
        wide = _wide(labels)  # (a uint8 mask's 255 compares as 255, never as -1; int64 under x64, see _kept)
        hits = jnp.argmax(logits, axis=-1).astype(wide.dtype) == wide  # (int64 under x64: strict promotion refuses it)
        if ignore_index is not None:
            counted = wide != ignore_index
            return jnp.sum(hits & counted, dtype=jnp.float32), jnp.sum(counted, dtype=jnp.float32)
    elif labels.shape == logits.shape and logits.ndim >= 2 and logits.shape[-1] > 1:  # one-hot / probabilities
        ids, bad = _one_hot_ids("accuracy", labels, where, source)
        hits = jnp.where(bad, jnp.nan, (jnp.argmax(logits, axis=-1).astype(jnp.int32) == ids).astype(jnp.float32))
    elif labels.shape == logits.shape or logits.shape == (*labels.shape, 1):  # binary: one logit each
        return _binary_counts(logits, labels, 0.0, ignore_index, who="accuracy", where=where, source=source)
    else:
        raise ValueError(SHAPES.format(logits=logits.shape, labels=labels.shape))
    return jnp.sum(hits, dtype=jnp.float32), jnp.float32(hits.size)


ONE_HOT_ROW = """\
ft.train.{who}: labels of the logits' shape ({labels}) are one-hot rows or probabilities, \
their argmax the class, but the row at labels{index} is {row}: {why}. Its argmax read it as \
class {argmax} with no error; under jax.jit, where the labels are not seen, the metric is NaN. \
{fix_why}:

    wrong:  {wrong}
    right:  {right}"""
"""A row of one-hot / probability labels that holds no class (``jax.nn.one_hot`` of an
ignored -100 is all 0), a negative or NaN entry, or an integer one other than 0 and 1.

Example:
  >>> import functree as ft, jax, jax.numpy as jnp
  >>> logits = jnp.array([[3.0, 0.0], [0.0, 2.0]])
  >>> try:
  ...     ft.train.accuracy.of(logits, jax.nn.one_hot(jnp.array([0, -100]), 2))
  ... except ValueError as e:
  ...     print(str(e).splitlines()[-1].strip())
  right:  ft.train.accuracy.of(logits, jnp.where(labels.max(-1) > 0, labels.argmax(-1), -100))   # class ids, -100 left out
"""


def _fix_call(who: str, where: str | None, source: str, labels: str, extra: str = "") -> str:
    """The call of ``<who>.of`` on ``labels`` (code) for an error's fix line: on ``logits``
    (``where`` None: a ``.of`` call), or in ``metrics=`` on ``source`` (a metric's)."""
    if where is None:
        return f"ft.train.{who}.of(logits, {labels}{extra})"
    return f'metrics={{"{who}": lambda out: ft.train.{who}.of({source}, {labels}{extra})}}'


def _fix_lines(wrong: str, rights: list[tuple[str, str]], shown: str) -> dict[str, str]:
    """``wrong`` and ``right`` of an error: the calls aligned, each with its comment."""
    pad = max(len(wrong), *(len(r) for r, _ in rights)) + 3
    right = "\n       or:  ".join(f"{r:<{pad}}# {why}" for r, why in rights)
    return {"wrong": f"{wrong:<{pad}}# labels hold {shown}", "right": right}


def _one_hot_bad(labels: jax.Array) -> jax.Array:
    """Per row of one-hot / probability labels: whether it holds no class (no entry above 0),
    an entry below 0 or NaN, or (integer labels) an entry other than 0 and 1."""
    if labels.dtype == jnp.bool_:
        return ~jnp.any(labels, axis=-1)
    if jnp.issubdtype(labels.dtype, jnp.floating):
        return jnp.any((labels < 0) | jnp.isnan(labels), axis=-1) | ~jnp.any(labels > 0, axis=-1)
    return jnp.any((labels != 0) & (labels != 1), axis=-1) | ~jnp.any(labels == 1, axis=-1)


def _one_hot_ids(who: str, labels: jax.Array, where: str | None = None, source: str = "out.aux",
                 extra: str = "") -> tuple[jax.Array, jax.Array]:
    """``(ids, bad)``: the class of each row of one-hot / probability labels (its argmax, as
    int32), and the rows that hold none (:func:`_one_hot_bad`): :data:`ONE_HOT_ROW` where
    the labels are concrete (``where``: their path in ``out.batch``; ``extra``: the call's
    other arguments), the caller's NaN where traced."""
    ids, bad = jnp.argmax(labels, axis=-1).astype(jnp.int32), _one_hot_bad(labels)
    flags = concrete(bad)
    if flags is None or not flags.any():
        return ids, bad
    first = first_index(flags)
    row = np.asarray(labels)[first]
    shown = np.array2string(row[:8], separator=", ", threshold=8)[:-1] + (", ...]" if row.size > 8 else "]")
    name = "labels" if where is None else where
    wrong = f"ft.train.{who}.of(logits, labels{extra})" if where is None else f"metrics=[ft.train.{who}]"
    if where is not None and extra.startswith(", k="):  # top_k_accuracy(k), the metric built
        wrong = f"metrics=[ft.train.{who}({extra[len(', k='):]})]"
    if np.issubdtype(row.dtype, np.floating) and ((row < 0) | np.isnan(row)).any():
        why, fix_why = "an entry below 0 or NaN (probabilities are not negative)", "Give probabilities"
        rights = [(_fix_call(who, where, source, f"jax.nn.softmax({name})", extra), "logits or log-probabilities")]
    elif not np.issubdtype(row.dtype, np.floating) and row.dtype != np.bool_ and ((row != 0) & (row != 1)).any():
        why, fix_why = "an integer other than 0 and 1 (one-hot rows are 0/1)", "Give class ids, or counts as floats"
        rights = [(_fix_call(who, where, source, f"{name}[..., 0]", extra), "class ids broadcast to the logits' shape"),
                  (_fix_call(who, where, source, f"{name}.astype(jnp.float32)", extra), "counts, read as probabilities")]
    else:
        why = "no entry above 0, no class (jax.nn.one_hot of an ignored -100 is all 0)"
        fix_why = "Give class ids, -100 where a row has no class (left out, as accuracy leaves -100 out)"
        ids_code = f"jnp.where({name}.max(-1) > 0, {name}.argmax(-1), -100)"
        rights = [(_fix_call(who, where, source, ids_code, extra), "class ids, -100 left out")]
    raise ValueError(ONE_HOT_ROW.format(who=who, labels=_describe(labels), index=list(first), row=shown, why=why,
                                        argmax=int(np.argmax(row)), fix_why=fix_why,
                                        **_fix_lines(wrong, rights, shown)))


BAD_IGNORE_INDEX = """\
ft.train.{who}.of: ignore_index must be a Python int (the label of the positions left \
out, as the loss's ignore_index) or None (every label scored), got {given!r}.

    wrong:  ft.train.{who}.of(logits, labels, ignore_index={given!r})
    right:  ft.train.{who}.of(logits, labels, ignore_index=255)   # e.g. a segmentation mask's void label"""


def _ignore_index(who: str, ignore_index: Any) -> int | None:
    """``ignore_index`` as an int or None, else :data:`BAD_IGNORE_INDEX`."""
    if ignore_index is not None and (isinstance(ignore_index, (bool, np.bool_))
                                     or not isinstance(ignore_index, (int, np.integer))):
        raise TypeError(BAD_IGNORE_INDEX.format(who=who, given=ignore_index))
    return None if ignore_index is None else int(ignore_index)


def _accuracy_of(logits: Any, labels: Any, *, ignore_index: int | None = IGNORE_INDEX) -> jax.Array:
    """Fraction of examples whose predicted class equals the label (class indices equal to
    ``ignore_index``, -100 by default, left out; 0 where every label of the minibatch is).
    ``ignore_index`` names another (torch's ``ignore_index=255`` of segmentation masks, -1);
    None scores every label. It reads class indices only; in a step its means are
    Σ hits / Σ counted, as :func:`accuracy`'s.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
      >>> ft.train.accuracy.of(logits, jnp.array([0, 0, 255]))                    # 255 scored: a miss
      Array(0.33333334, dtype=float32)
      >>> ft.train.accuracy.of(logits, jnp.array([0, 0, 255]), ignore_index=255)  # left out
      Array(0.5, dtype=float32)
    """
    hits, counted = _accuracy_counts(logits, labels, ignore_index=_ignore_index("accuracy", ignore_index))
    return _noted(hits / jnp.maximum(counted, 1.0), hits, counted)  # its parts too: exact means


def _accuracy_out_counts(out: StepOutput) -> tuple[jax.Array, jax.Array]:
    logits, source = _find_logits(out.aux), _logits_source(out.aux)
    where, labels = _find_labels(out.batch, logits, _accuracy_fits, "accuracy", class_ids=True, source=source)
    return _accuracy_counts(logits, labels, where, source)


def accuracy(out: StepOutput) -> jax.Array:
    """Classification accuracy of ``out.aux`` (the logits) against the batch's labels.

    Labels are ``batch[-1]`` (tuple) or ``batch["label"]`` (dict); logits are the aux
    output (or ``aux["logits"]``). In a batch of three or more items whose last is
    floating-point, of the class-index shape or one number per example, and whose
    ``batch[-2]`` has a labels' shape (below), either may be the labels (Keras's
    ``(x, y, sample_weight)``, per-token weights too, ``(input_ids, labels, loss_mask)``, or
    ``(x, mask, y)``): an error, naming both; name the labels with ``accuracy.of``. A
    ``batch[-2]`` of no labels' shape (a ``[N, D]`` mask) leaves the last as labels. By shape:

    - class indices ``logits.shape[:-1]`` compare with ``argmax(logits)``; labels equal to
      -100 (:data:`IGNORE_INDEX`, HF's padding of token labels) are left out; another
      ignored label (torch's ``ignore_index=255`` of segmentation masks, -1) is no class and
      counts as a miss, as in Keras and scikit-learn: name it,
      ``lambda out: ft.train.accuracy.of(out.aux, out.batch[-1], ignore_index=255)``. They are
      integers: float ones are refused (torch's cross_entropy refuses them too; floats of
      that shape are weights or a mask more often), naming the cast ``.astype(jnp.int32)``;
    - labels of the logits' shape ``[..., C]`` (two axes or more) are one-hot or
      probabilities: ``argmax`` of both. A multi-label target (several 1s a row) is
      scored as its first 1: use ``ft.train.binary_accuracy`` for it. A row that holds no
      class (no entry above 0: ``jax.nn.one_hot`` of a -100), a negative or NaN entry, or
      an integer one other than 0 and 1 (class ids broadcast to the logits' shape) raises
      :data:`ONE_HOT_ROW` where concrete (its argmax read it as class 0) and makes the
      metric NaN under ``jax.jit``;
    - one logit per example (logits ``[N]`` or ``[N, 1]`` with labels ``[N]``): binary,
      ``logits > 0`` against labels 0/1 or -1/1, labels equal to -100 left out (as
      :func:`binary_accuracy` reads them: another label raises :data:`BINARY_LABEL_VALUE`,
      NaN under ``jax.jit``).

    ``ft.train.accuracy.of(logits, labels)`` is the same from logits and labels you name;
    in a step, its value (or an affine function of it, ``100 * acc``) still has its
    means over minibatches Σ hits / Σ counted (``_metrics.measured``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
      >>> out = ft.train.StepOutput(jnp.zeros(()), logits, (None, jnp.array([0, 1, 1])), None)
      >>> ft.train.accuracy(out)
      Array(0.6666667, dtype=float32)
    """
    hits, counted = _accuracy_out_counts(out)
    return _noted(hits / jnp.maximum(counted, 1.0), hits, counted)


accuracy.of = _accuracy_of  # type: ignore[attr-defined]
accuracy.__ft_counts__ = _accuracy_out_counts  # type: ignore[attr-defined]  # marks it counting (counting_names)
accuracy.higher_is_better = True  # type: ignore[attr-defined]  # a monitor's mode=None reads it (_direction.py)


BINARY_LABEL_VALUE = """\
ft.train.{who}: label {value} at labels{index} is no binary label. Binary labels are 0/1 \
(int, bool or float) or -1/1 (-1 the negative, as the hinge losses'), and labels equal to \
ignore_index ({ignore}) are left out. Read as label > 0.5, a class id 2 of three classes, a \
soft label 0.7 or a mask's 255 counted as positive with no error; under jax.jit, where the \
labels are not seen, the metric is NaN. Map them to 0/1, or name the label to leave out:

    wrong:  {wrong}
    right:  {right}"""

BINARY_LABEL_SIGNS = """\
ft.train.{who}: the labels hold both 0 (at labels{zero}) and -1 (at labels{minus}): three \
values, no binary labels. Binary labels are 0/1 or -1/1; read as label > 0.5, -1/0/1 labels \
(three classes: negative, neutral, positive) counted -1 and 0 alike as negative with no error; \
under jax.jit, where the labels are not seen, the metric is NaN. Score one class against the \
others, or name the label to leave out:

    wrong:  {wrong}
    right:  {right}"""


def _binary_actual(labels: jax.Array, kept: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(positive, bad)`` per label: whether it is 1 (True), and whether it is scored
    (``kept``) and no binary label: neither 0, 1 nor -1, or a -1 where a 0 is scored too
    (-1/0/1: three values). Bool labels are all binary."""
    if labels.dtype == jnp.bool_:
        return labels, jnp.zeros(labels.shape, bool)
    one, zero = labels == 1, labels == 0
    if jnp.issubdtype(labels.dtype, jnp.unsignedinteger):  # no -1 to read
        return one, kept & ~(one | zero)
    minus = labels == -1
    other = ~(one | zero | minus)
    return one, kept & (other | (minus & jnp.any(kept & zero)))


def _check_binary_labels(who: str, labels: jax.Array, kept: jax.Array, bad: jax.Array, ignore_index: int | None,
                         where: str | None, source: str) -> None:
    """:data:`BINARY_LABEL_VALUE` (or :data:`BINARY_LABEL_SIGNS`) where the concrete ``bad``
    holds a label (traced: the caller's NaN)."""
    flags = concrete(bad)
    if flags is None or not flags.any():
        return
    given, scored = np.asarray(labels), np.asarray(kept)
    first = first_index(flags)
    value = given[first].item()
    name, shown = ("labels" if where is None else where), (f"{value:g}" if isinstance(value, float) else str(value))
    call = functools.partial(_fix_call, who, where, source)
    wrong = f"ft.train.{who}.of(logits, labels)" if where is None else f"metrics=[ft.train.{who}]"
    if value == -1:  # a -1 beside a scored 0
        zero = first_index((given == 0) & scored)
        rights = [(call(f"{name} == 1"), "class 1 against -1 and 0"),
                  (call(name, ", ignore_index=0"), "0 left out: -1/1 labels")]
        message, fields = BINARY_LABEL_SIGNS, {"zero": list(zero), "minus": list(first)}
    else:
        rights = []
        if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
            c = int(value)  # (a float label 2.0 too: ignore_index compares it as 2)
            rights += [(call(f"{name} == {c}"), f"class {c} against the others"),
                       (call(name, f", ignore_index={c}"), f"{c} marks the labels left out")]
        rights.append((call(f"{name} > 0.5"), "soft labels, probabilities, a 0/255 mask: thresholded"))
        message, fields = BINARY_LABEL_VALUE, {"value": shown, "index": list(first), "ignore": ignore_index}
    raise ValueError(message.format(who=who, **_fix_lines(wrong, rights, shown), **fields))


def _binary_hits(logits: jax.Array, positive: jax.Array, threshold: float = 0.0) -> jax.Array:
    """Per label: whether its one output is on its side of ``threshold`` (``logit > 0``
    against ``positive``, the labels that are 1, by default)."""
    return (logits.reshape(positive.shape) > threshold) == positive


def _binary_fits(logits: tuple, labels: tuple) -> bool:
    """Whether :func:`binary_accuracy` scores labels of this shape: one logit per label."""
    return logits == labels or logits == (*labels, 1)


def _kept(labels: jax.Array, ignore_index: int | None) -> jax.Array:
    """Per label: whether it is scored (not ``ignore_index``; None: every one)."""
    if ignore_index is None or labels.dtype == jnp.bool_:
        return jnp.ones(labels.shape, bool)
    if jnp.issubdtype(labels.dtype, jnp.floating):
        return labels.astype(jnp.float32) != ignore_index
    return _wide(labels) != ignore_index  # in int32, an int64 2**32 - 100 (under x64) was -100: left out


def _binary_counts(logits: Any, labels: Any, threshold: float = 0.0, ignore_index: int | None = IGNORE_INDEX, *,
                   who: str = "binary_accuracy", where: str | None = None,
                   source: str = "out.aux") -> tuple[jax.Array, jax.Array]:
    """``(hits, counted)`` of :func:`binary_accuracy`, as float32 counts: labels equal to
    ``ignore_index`` (-100, HF's padding of token labels; None: none) left out. A scored label
    that is no binary label (:func:`_binary_actual`) raises :data:`BINARY_LABEL_VALUE` where
    concrete (``where``: its path in ``out.batch``; None: ``<who>.of``) and makes ``hits``
    NaN where traced."""
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if not _binary_fits(logits.shape, labels.shape):
        raise ValueError(BINARY_SHAPES.format(logits=logits.shape, labels=labels.shape))
    kept = _kept(labels, ignore_index)
    positive, bad = _binary_actual(labels, kept)
    _check_binary_labels(who, labels, kept, bad, ignore_index, where, source)
    hits = jnp.where(bad, jnp.nan, (_binary_hits(logits, positive, threshold) & kept).astype(jnp.float32))
    return jnp.sum(hits, dtype=jnp.float32), jnp.sum(kept, dtype=jnp.float32)


BAD_THRESHOLD = """\
ft.train.binary_accuracy.of: threshold must be a Python number (a logit's, 0 by default, or a \
probability's, 0.5), got {given!r}.

    wrong:  ft.train.binary_accuracy.of(probabilities, labels, threshold={given!r})
    right:  ft.train.binary_accuracy.of(probabilities, labels, threshold=0.5)"""


def _binary_accuracy_of(logits: Any, labels: Any, *, threshold: float = 0.0,
                        ignore_index: int | None = IGNORE_INDEX) -> jax.Array:
    """Fraction of 0/1 labels whose output is on their side of ``threshold``: ``logit > 0``
    by default (a sigmoid's logit, ``ft.losses.sigmoid_cross_entropy``'s input); a model
    that outputs probabilities (a sigmoid last, as for ``ft.losses.binary_cross_entropy``
    or torch's ``BCELoss``) needs ``threshold=0.5`` (Keras's ``BinaryAccuracy`` default).
    The step cannot tell probabilities from logits: at the default, every probability
    above 0 counts as a 1. Labels equal to ``ignore_index`` (-100 by default, HF's padding
    of token labels, as :func:`accuracy` and ``precision.of``; None: none) are left out.
    Labels are 0/1 or -1/1, as :func:`binary_accuracy` reads them (another raises
    :data:`BINARY_LABEL_VALUE`; NaN under ``jax.jit``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> probabilities, labels = jnp.array([0.9, 0.2, 0.4, 0.7]), jnp.array([1, 0, 0, 1])
      >>> float(ft.train.binary_accuracy.of(probabilities, labels, threshold=0.5))
      1.0
      >>> float(ft.train.binary_accuracy.of(probabilities, labels))  # read as logits: all 1
      0.5
    """
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, (int, float, np.integer, np.floating)):
        raise TypeError(BAD_THRESHOLD.format(given=threshold))
    hits, counted = _binary_counts(logits, labels, float(threshold), _ignore_index("binary_accuracy", ignore_index))
    return _noted(hits / jnp.maximum(counted, 1.0), hits, counted)


def _binary_out_counts(out: StepOutput) -> tuple[jax.Array, jax.Array]:
    logits, source = _find_logits(out.aux), _logits_source(out.aux)
    where, labels = _find_labels(out.batch, logits, _binary_fits, "binary_accuracy", source=source)
    return _binary_counts(logits, labels, where=where, source=source)


def binary_accuracy(out: StepOutput) -> jax.Array:
    """The fraction of 0/1 targets whose logit has their sign (``logit > 0`` against
    ``label == 1``), over every element: multi-label heads and per-token binary tags, with
    logits of the labels' shape (``ft.losses.sigmoid_cross_entropy``'s layout), where
    :func:`accuracy` reads labels of the logits' shape as one-hot. Labels of -100 (HF's
    padding of token labels) are left out, as :func:`accuracy` and :func:`precision` leave
    them (they were scored as negatives: a padded token with a negative logit a hit); another
    through ``binary_accuracy.of(..., ignore_index=255)``.

    Binary labels are 0/1 (int, bool or float) or -1/1 (-1 the negative: the hinge losses'
    labels). Any other scored label (a class id 2 of three classes, a soft label 0.7, a
    0/255 mask's 255, NaN, or -1 beside 0: -1/0/1 labels) raises :data:`BINARY_LABEL_VALUE`
    (:data:`BINARY_LABEL_SIGNS`) naming the first and the fix (``labels == c``,
    ``labels > 0.5``, ``ignore_index=``) where the labels are concrete, and makes the metric
    NaN under ``jax.jit`` (a Trainer's step): read as ``label > 0.5`` they were counted
    positive or negative with no error. A model that outputs
    probabilities (a sigmoid last) is scored with ``threshold=0.5``:
    ``lambda out: ft.train.binary_accuracy.of(out.aux, out.batch[-1], threshold=0.5)``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits = jnp.array([[2.0, -1.0, 0.5], [-3.0, 1.0, -0.2]])
      >>> labels = jnp.array([[1, 0, 0], [0, 1, 1]])
      >>> float(ft.train.binary_accuracy(ft.train.StepOutput(jnp.zeros(()), logits, (None, labels), None)))
      0.6666666865348816
    """
    hits, counted = _binary_out_counts(out)
    return _noted(hits / jnp.maximum(counted, 1.0), hits, counted)


binary_accuracy.of = _binary_accuracy_of  # type: ignore[attr-defined]
binary_accuracy.__ft_counts__ = _binary_out_counts  # type: ignore[attr-defined]  # marks it counting (counting_names)
binary_accuracy.higher_is_better = True  # type: ignore[attr-defined]

BINARY_SHAPES = """\
ft.train.binary_accuracy: logits of shape {logits} do not fit 0/1 labels of shape {labels}; it
takes one logit per label (logits of the labels' shape, or the labels' shape + (1,))."""


def mean(source: str | Callable[[StepOutput], Any]) -> Callable[[StepOutput], jax.Array]:
    """A metric averaging ``aux[source]`` (a name) or ``source(out)`` (a function); a
    ``source`` returning ``ft.losses.WeightedMean`` gives it as it is (a token mean).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> out = ft.train.StepOutput(jnp.zeros(()), {"mse": jnp.array([1.0, 3.0])}, None, None)
      >>> ft.train.mean("mse")(out)
      Array(2., dtype=float32)
    """
    if isinstance(source, str):
        key = source

        def from_aux(out: StepOutput) -> jax.Array:
            if not isinstance(out.aux, Mapping) or key not in out.aux:
                raise ValueError(_missing_aux_key(key, out.aux))
            if isinstance(out.aux[key], WeightedMean):  # its parts need the columns a plain mean has not
                raise TypeError(AUX_WEIGHTED_MEAN.format(key=key))
            return jnp.mean(jnp.asarray(out.aux[key]).astype(metric_dtype()))

        from_aux.__name__ = source
        from_aux.__ft_plain__ = True  # type: ignore[attr-defined]  # reads aux alone: no counting metric's value
        return from_aux

    check_metric_call(getattr(source, "__name__", "source"), source, "ft.train.mean({fn})")

    def of_fn(out: StepOutput) -> Any:
        value = source(out)
        if isinstance(value, WeightedMean):  # a mean already, as its parts (its means Σ total / Σ count)
            return value
        return jnp.mean(jnp.asarray(value).astype(metric_dtype()))

    of_fn.__name__ = getattr(source, "__name__", "mean")
    if rises(source) is not None:  # the mean improves the way its source does (a monitor's mode=None)
        of_fn.higher_is_better = rises(source)  # type: ignore[attr-defined]
    return of_fn


def resolve_metrics(
    metrics: Mapping[str, Any] | Sequence[Any] | None,
) -> dict[str, Callable[[StepOutput], Any]]:
    """``{name: fn}`` from a dict, a list of functions (named by ``__name__``) or None."""
    if metrics is None:
        return {}
    items = metrics.items() if isinstance(metrics, Mapping) else (
        (m if isinstance(m, str) else getattr(m, "__name__", repr(m)), m) for m in metrics
    )
    out = {}
    for name, fn in items:
        if isinstance(fn, str):
            fn = mean(fn)
        fn = _unpartial(fn)  # a bare partial of accuracy is accuracy (counting_names finds it)
        if not callable(fn):
            raise TypeError(BAD_METRIC.format(name=name, value=fn))
        if str(name) in out or str(name) == "loss":  # one would replace the other's column
            raise ValueError(DUPLICATE_METRIC.format(name=str(name)))
        if _is_part(str(name)):  # it would be read as a counting metric's part, and hidden
            raise ValueError(PART_NAME.format(name=str(name), suffix=str(name)[str(name).rindex("#"):],
                                              right=str(name).replace("#", "_")))
        out[str(name)] = fn
    return out


DUPLICATE_METRIC = """\
Two metrics are named {name!r} (a list names each by __name__, and every lambda is
'<lambda>'; "loss" is the loss's own): one would replace the other. Name them in a dict:
    right:  metrics={{"acc": ft.train.accuracy, "mae": ft.train.mean(lambda out: ...)}}"""


PART_NAME = """\
The metric name {name!r} ends in {suffix!r}, which names a hidden part of a counting metric
(ft.train.accuracy's hits and counted labels, recorded by every step for its exact mean):
its values would be left out of the history and divided as another metric's part.
    wrong:  metrics={{{name!r}: ...}}
    right:  metrics={{{right!r}: ...}}"""


def metric_dtype() -> np.dtype:
    """The dtype of logged metrics: float32, and float64 under ``jax_enable_x64``, so that a
    float64 model's loss is logged as computed (float32 rounded it: 0.5648236274719238
    for 0.5648236194...). Read once per trace or buffer: the flag is process-wide."""
    return jax.dtypes.canonicalize_dtype(np.float64)


def evaluate_metrics(fns: Mapping[str, Callable[[StepOutput], Any]], out: StepOutput) -> dict[str, Any]:
    """Every metric on one minibatch, as scalars of :func:`metric_dtype` (checked at trace
    time). Inside :func:`measured`, each value is remembered as plain (its metric called no
    counting metric) or as the counting value it returned (cast): no probe needed for them.
    A metric returning ``ft.losses.WeightedMean`` is passed on as it is: :func:`measured`
    notes its value with its parts, as such a loss's, so its means are ``Σ total / Σ count``."""
    dtype, frame = metric_dtype(), _frame()
    values: dict[str, Any]
    if out.parts is None:
        values = {"loss": _known(jnp.asarray(out.loss).astype(dtype), None, frame)}
    else:  # a WeightedMean loss: its means over minibatches are Σ total / Σ count (parts as accuracy's)
        values = {"loss": _noted(jnp.asarray(out.loss).astype(dtype), out.parts.total, out.parts.count)}
    for name, fn in fns.items():
        before = len(frame.calls) if frame is not None else 0
        check_metric_call(name, fn)  # here, where it is called: an override of compute_metrics may call it otherwise
        raw = fn(out)
        if isinstance(raw, WeightedMean):  # a token-level metric: measured() notes its parts (_values)
            values[name] = raw
            continue
        value = _metric_number(name, fn, raw)
        if value.shape != ():
            raise ValueError(NOT_SCALAR.format(name=name, shape=value.shape))
        values[name] = value.astype(dtype)
        if frame is not None and frame.probes is None:
            if len(frame.calls) == before:  # no counting metric called: a plain mean
                _known(values[name], None, frame)
            elif id(raw) in frame.known and frame.known[id(raw)][0] is raw:  # a counting value as returned
                _known(values[name], frame.known[id(raw)][1], frame)
            else:  # derived from one (a lambda's 1.0 * acc): measured() probes it
                frame.derived.add(name)
    return values


def _metric_number(name: str, fn: Any, raw: Any) -> jax.Array:
    """``raw`` as an array, or :data:`METRIC_NOT_A_NUMBER` (a :class:`MetricCallError`: any
    minibatch would get it) where it is none: a metric returning None (a ``def`` that
    forgot its ``return``, ``out.aux`` of a loss without aux) failed in ``jnp.asarray`` with
    "None is not a valid value for jnp.array", which ``fit`` blamed on minibatch 0."""
    try:
        return jnp.asarray(raw)
    except (TypeError, ValueError):
        pass
    label = getattr(fn, "__name__", type(fn).__name__)
    if raw is None and label != "<lambda>":
        wrong, right = f"def {label}(out): jnp.mean(...)", f"def {label}(out): return jnp.mean(...)"
    else:
        wrong, right = f"metrics={{{name!r}: {label}}}", f"metrics={{{name!r}: lambda out: jnp.mean(...)}}"
    given = "None" if raw is None else f"a {type(raw).__name__}"
    raise MetricCallError(METRIC_NOT_A_NUMBER.format(
        name=name, given=given, why=_NONE_WHY if raw is None else "", wrong=wrong, right=right)) from None


def _values(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A step's metrics, a ``WeightedMean`` among them (a metric's, or a ``compute_metrics``
    override's) as its value noted with its parts (:func:`_weighted`), in the order given:
    the real run and :func:`measured`'s probe trace note them alike."""
    dtype = metric_dtype()
    return {k: _weighted(v, dtype) if isinstance(v, WeightedMean) else v for k, v in metrics.items()}


def _weighted(metric: WeightedMean, dtype: Any) -> jax.Array:
    """A metric's ``WeightedMean(total, count)`` as its value ``total / count``, noted with
    its parts (in ``dtype``: a bfloat16 total's parts divided in float32), so that its means
    over minibatches are ``Σ total_b / Σ count_b`` (a token mean), not size-weighted."""
    total, count = jnp.asarray(metric.total).astype(dtype), jnp.asarray(metric.count).astype(dtype)
    return _noted(ratio(total, count), total, count, weighted=True)


def batch_size_of(batch: Any) -> int:
    """The number of examples in a batch: the leading axis of its first array leaf (a plain
    step takes a batch whose other leaves are not per example, such as a per-class table;
    the Trainer, which counts samples and weighs its means by them, checks they agree:
    :func:`shared_batch_size`)."""
    for leaf in jax.tree.leaves(batch):
        if np.ndim(leaf) >= 1:
            return int(np.shape(leaf)[0])
    return 1


def shared_batch_size(batch: Any) -> int:
    """The leading axis the batch's array leaves share (1 for a batch of scalars). Leaves that
    disagree are refused (:func:`check_example_axis`, naming both key paths and sizes): read
    from the first leaf in key order, a per-batch ``class_weights`` of shape ``(3,)`` beside
    ``x: (10, 2)`` counted 3 examples, silently (samples_seen, ``per_samples`` rates, the
    means' weights)."""
    size = None
    for leaf in jax.tree.leaves(batch):
        shape = np.shape(leaf)
        if shape and size is None:
            size = int(shape[0])
        elif shape and shape[0] != size:
            from functree._examples import check_example_axis  # (only on this error's path)

            check_example_axis(batch, None)  # counted here; a mesh or accumulate=k cuts it later
    return 1 if size is None else size


COUNTS = "__ft_counts__"
"""The attribute that marks functree's counting metrics (``accuracy``, ``binary_accuracy``):
``fn.__ft_counts__(out) -> (hits, counted)``. A private name: a user metric's own ``counts``
(a precision's ``(tp, fp)``) must not be read as labels hit and counted."""

PLAIN = "__ft_plain__"
"""The attribute that marks a metric that never reports a counting metric's value
(``ft.train.mean("key")``: reads the aux alone): it records no parts."""

PART_SUM, PART_COUNT = "#sum", "#count"
"""Suffixes of a counting metric's two parts (:func:`measured`): per example of the
minibatch, its hits and its counted labels."""

PART_RATIO = "#ratio"
"""Suffix of the train step's mark beside the loss's parts (``"loss#ratio"``): per example, 1
where the loss is a ratio noted with its parts (a ``ft.losses.WeightedMean``), else 0. Its
parts' count sums to 0 both over steps that scored no label and under a plain loss (parts
``(0, 0)``): the mark tells them apart, so that a log window or an epoch that scored nothing
is 0/0, NaN (``Means.no_label``), not its steps' 0s, nor a plain loss's mean made NaN.
A metric with parts has its own mark (``"tok#ratio"``): 1 where its value is a
``WeightedMean``'s (a token-level metric), 0 for a counting metric (an accuracy that counted
nothing stays 0, as torchmetrics') or a plain one; an eval step records it for the former only."""


def _is_part(name: str) -> bool:
    return name.endswith((PART_SUM, PART_COUNT, PART_RATIO))


def _unpartial(fn: Any) -> Any:
    """``fn``, or the counting metric a bare ``functools.partial`` of it wraps (its mark kept)."""
    while isinstance(fn, functools.partial) and not fn.args and not fn.keywords:
        fn = fn.func
    return fn


def _parted(fn: Any) -> bool:
    """Whether a step records parts for this metric: all but the plain ones (:data:`PLAIN`).
    A counting metric's value can come through any function (a lambda of ``accuracy.of``),
    known only at trace time, while the Trainer reads the names before (``with_parts``)."""
    return not getattr(fn, PLAIN, False)


def with_parts(metrics: Mapping[str, Callable[[StepOutput], Any]]) -> dict[str, Any]:
    """``metrics`` and the names of their parts ``name#sum``, ``name#count`` (None): the
    names, in order, of what a step built from ``metrics`` records (:func:`measured`) after
    ``"loss"``. Every metric but a plain one (``ft.train.mean("key")``) has them: one that
    reports a counting metric's value (``accuracy``, or a lambda of ``accuracy.of``) is
    known only when the step traces. A metric that turns out plain records ``(0, 0)``,
    which :func:`combine_parts` reads as its size-weighted mean.

    Example:
      >>> import functree as ft
      >>> sorted(with_parts({"acc": ft.train.accuracy, "mse": ft.train.mean("mse")}))
      ['acc', 'acc#count', 'acc#sum', 'mse']
    """
    out: dict[str, Any] = dict(metrics)
    for name, fn in metrics.items():
        if _parted(fn):
            out[name + PART_SUM] = out[name + PART_COUNT] = None
    return out


def step_names(metrics: Mapping[str, Callable[[StepOutput], Any]]) -> list[str]:
    """The names, in order, of what a train step built from ``metrics`` records
    (:func:`measured`): ``"loss"``, the metrics, the loss's parts (a
    ``ft.losses.WeightedMean`` loss's total and count per example; 0 for another loss,
    whose means stay size-weighted), the metrics' parts (:func:`with_parts`), then the
    loss's mark and the marks of the metrics with parts (:data:`PART_RATIO`).

    Example:
      >>> import functree as ft
      >>> step_names({"acc": ft.train.accuracy})
      ['loss', 'acc', 'loss#sum', 'loss#count', 'acc#sum', 'acc#count', 'loss#ratio', 'acc#ratio']
    """
    names = list(with_parts(metrics))
    marks = [name + PART_RATIO for name, fn in metrics.items() if _parted(fn)]
    return ["loss", *metrics, "loss" + PART_SUM, "loss" + PART_COUNT, *names[len(metrics):], "loss" + PART_RATIO,
            *marks]


INEXACT_MEAN = """The metric {name!r} reports a value computed from {what}; its parts (hits, counted labels) are not known, so its means over minibatches are size-weighted (Σ n_b·v_b / Σ n_b), not Σ hits / Σ counted. Report the counting metric's value itself, or an affine function of one (100 * acc, 1 - acc: exact), under its own name:

    wrong:  {{"{name}": ft.train.accuracy(out) * ft.train.binary_accuracy(out)}}
    right:  {{"accuracy": ft.train.accuracy(out), "binary_accuracy": ft.train.binary_accuracy(out)}}"""


MIXED = ("a counting metric's value and other traced values (or host code, such as a jax.debug.callback or "
         "pure_callback around the value, which is never run on anything but the step's own values)")
"""What :data:`INEXACT_MEAN` says a value mixed its counting value with."""


UNRECORDED_AUX = """\
The loss function returns {names} in its aux, and the step records no metric: {they} no \
history, progress bar or log (a step records the metrics it is given, read from the aux). \
Record {them}:

    wrong:  ft.train.Trainer(model, opt, loss_fn)              # loss_fn returns (loss, {{{key!r}: ...}})
    right:  ft.train.Trainer(model, opt, loss_fn, metrics=[{fix}])"""


class UnrecordedAuxWarning(UserWarning):
    """A loss function's aux holds scalars (``{"accuracy": acc}``, Flax's and Equinox's way
    of returning metrics) that a step with no metrics records nowhere (:data:`UNRECORDED_AUX`)."""


def warn_unrecorded_aux(aux: Any) -> None:
    """Warn (:class:`UnrecordedAuxWarning`) where ``aux`` is a dict holding scalars: called
    at trace time by a step that records no metric, once per compilation.

    Example:
      >>> import warnings, jax.numpy as jnp
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     warn_unrecorded_aux({"accuracy": jnp.float32(0.5), "logits": jnp.zeros((4, 3))})
      >>> "metrics=[ft.train.mean('accuracy')]" in str(caught[0].message)
      True
    """
    if not isinstance(aux, Mapping):
        return
    names = [k for k, v in aux.items() if isinstance(k, str) and getattr(v, "ndim", None) == 0]
    if names:
        shown = ", ".join(repr(n) for n in names)
        fix = ", ".join(f"ft.train.mean({n!r})" for n in names)
        warnings.warn(UNRECORDED_AUX.format(names=shown, they="they reach" if len(names) > 1 else "it reaches",
                                            them="them" if len(names) > 1 else "it", key=names[0], fix=fix),
                      UnrecordedAuxWarning, stacklevel=user_stacklevel())


class InexactMeanWarning(UserWarning):
    """A metric computed from counting metrics' values in a way whose parts are not known
    (two of them combined, squared, or mixed with other traced values): its means are
    size-weighted (:data:`INEXACT_MEAN`)."""


class _Frame:
    """The counting values of one :func:`measured` run. ``calls``: each counting metric's
    ``(hits, counted)``, in call order; ``known``: ``id(value) -> (value, how)`` where ``how``
    is ``(call, a, b)`` (``value = a·hits/counted + b``) or None (plain); ``derived``: names
    whose metric called a counting one but returned another value; ``probes``: None (the
    real run) or what each call returns instead: the inputs of :func:`_probe_jaxpr`'s trace."""

    def __init__(self, probes: Sequence[Any] | None = None):
        self.calls: list[tuple[Any, Any]] = []
        self.weighted: set[int] = set()  # the calls that are a WeightedMean's (its count: no label scored)
        self.known: dict[int, tuple[Any, tuple[int, float, float] | None]] = {}
        self.derived: set[str] = set()
        self.probes = probes


_FRAMES = threading.local()  # .top: the innermost _Frame while measured() runs


def _frame() -> _Frame | None:
    return getattr(_FRAMES, "top", None)


@contextlib.contextmanager
def _framed(frame: _Frame) -> Iterator[_Frame]:
    outer, _FRAMES.top = _frame(), frame
    try:
        yield frame
    finally:
        _FRAMES.top = outer


def _known(value: Any, how: tuple[int, float, float] | None, frame: _Frame | None) -> Any:
    if frame is not None and frame.probes is None:
        frame.known[id(value)] = (value, how)
    return value


def _noted(value: jax.Array, hits: jax.Array, counted: jax.Array, weighted: bool = False) -> jax.Array:
    """``value`` (``hits / max(counted, 1)``), its parts noted in the running :func:`measured`
    (``weighted``: a ``WeightedMean``'s, whose count of 0 is no label scored); in its probe
    trace, that trace's input instead (:func:`_probe_jaxpr`)."""
    frame = _frame()
    if frame is None:
        return value
    i = len(frame.calls)
    frame.calls.append((hits, counted))
    if weighted:
        frame.weighted.add(i)
    if frame.probes is not None:
        return jnp.asarray(frame.probes[i] if i < len(frame.probes) else frame.probes[-1], value.dtype)
    return _known(value, (i, 1.0, 0.0), frame)


def _number(x: Any) -> float | None:
    """``x`` as a float where it is one number, else None."""
    try:
        return float(np.asarray(x, np.float64))
    except (TypeError, ValueError):
        return None


LOW, HIGH, MID = 0.25, 0.75, 0.5  # probe numbers: exact in binary, away from 0 and 1

HOST_CODE = frozenset({"pure_callback", "io_callback", "debug_callback", "ffi_call"})
"""Primitives that run code outside JAX (a user's Python callback, a foreign function):
never run on probe numbers, even where they declare no effect (``pure_callback``)."""


class _Unknown:
    """A jaxpr variable's value the probe does not compute (``_UNKNOWN``)."""


_UNKNOWN = _Unknown()


def _runs_host_code(eqn: Any) -> bool:
    """Whether an equation has effects or runs host code (:data:`HOST_CODE`), itself or in
    one of its bodies: the probe never runs it."""
    if eqn.effects or eqn.primitive.name in HOST_CODE:
        return True
    return any(_runs_host_code(e) for j in compat.sub_jaxprs(eqn.params) for e in j.eqns)


def _probe_jaxpr(run: Callable[[], Mapping[str, Any]], calls: int, names: Sequence[str]) -> tuple[Any, list[str]] | None:
    """``run`` traced once more into a throwaway jaxpr whose inputs are the values of its
    ``calls`` counting metrics (each ``_noted`` returns its input instead), and the names
    among ``names`` it returns, its outputs in that order; None where that trace calls
    counting metrics another number of times (nothing to compare). The jaxpr is never
    compiled into the step: its callbacks add nothing to it."""
    present: list[str] = []

    def traced(*counting: jax.Array) -> list[jax.Array]:
        with _framed(_Frame(counting)) as frame:
            values = _values(run())
        if len(frame.calls) != calls:
            return []
        present[:] = [n for n in names if n in values and jnp.shape(values[n]) == ()]
        return [jnp.asarray(values[n]) for n in present]

    closed = jax.make_jaxpr(traced)(*[jax.ShapeDtypeStruct((), jnp.float32)] * calls)
    return (closed, present) if present else None


def _needed(jaxpr: Any) -> list[Any]:
    """The equations of ``jaxpr`` its outputs read (backwards from them): the rest (the
    counting metrics' own hits and counts, read from traced values) is not looked at."""
    from jax.extend import core as jcore
    need = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in need for v in eqn.outvars):
            kept.append(eqn)
            need.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return kept[::-1]


def _on_counting(jaxpr: Any, eqns: Sequence[Any]) -> list[bool]:
    """Per output of ``jaxpr``: whether it is computed from its inputs (the counting values)."""
    from jax.extend import core as jcore
    on = set(jaxpr.invars)
    for eqn in eqns:
        if any(v in on for v in eqn.invars if not isinstance(v, jcore.Literal)):
            on.update(eqn.outvars)
    return [not isinstance(v, jcore.Literal) and v in on for v in jaxpr.outvars]


def _evaluate(closed: Any, eqns: Sequence[Any], probes: Sequence[float]) -> list[float | None]:
    """The outputs of ``closed`` with its inputs at ``probes``, evaluated equation by
    equation where they depend on the inputs and constants alone, through no effect and
    no host code; None for the others (they read the step's traced values: its constants
    that are tracers, or an equation never run)."""
    from jax.extend import core as jcore
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {v: _UNKNOWN if isinstance(c, Tracer) else c
                           for v, c in zip(jaxpr.constvars, closed.consts)}
    env.update({v: np.float32(p) for v, p in zip(jaxpr.invars, probes)})

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env.get(v, _UNKNOWN)

    with jax.ensure_compile_time_eval():  # concrete inputs: computed now, not staged
        for eqn in eqns:
            ins = [read(v) for v in eqn.invars]
            outs: Sequence[Any] = [_UNKNOWN] * len(eqn.outvars)
            if not any(x is _UNKNOWN for x in ins) and not _runs_host_code(eqn):
                outs = compat.bind_eqn(eqn, ins)
            env.update(zip(eqn.outvars, outs))
    found = [read(v) for v in jaxpr.outvars]
    return [None if x is _UNKNOWN else _number(x) for x in found]


def _probe(run: Callable[[], Mapping[str, Any]], calls: int, names: Sequence[str]) -> dict[str, Any]:
    """How each of ``names`` depends on the ``calls`` counting values of ``run``: ``(i, a, b)``
    where it is ``a·value_i + b`` of one of them, ``"plain"`` where on none, ``"combined"``
    where on them alone but not so (two combined, or not affine), ``"mixed"`` where on them
    and on other traced values or through host code (a callback), ``"traced"`` where on
    other traced values alone (or ``run`` called them otherwise).

    ``run`` is traced once more into a throwaway jaxpr of the counting values
    (:func:`_probe_jaxpr`), whose equations on them alone are evaluated (:func:`_evaluate`)
    with all at ``LOW``; call ``i`` alone at ``HIGH`` (``a_i = 2·(f_i - f)``); all at
    ``MID``, which an affine function of one of them must give as ``f + (MID - LOW)·Σ a_i``.
    Nothing runs in the step but ``run`` itself: its callbacks run once a step, on the
    real values (not on probe numbers, which no equation with effects or host code sees)."""
    probed = _probe_jaxpr(run, calls, names)
    if probed is None:
        return {name: "traced" for name in names}
    closed, present = probed
    eqns = _needed(closed.jaxpr)
    on = dict(zip(present, _on_counting(closed.jaxpr, eqns)))
    base, mid = _evaluate(closed, eqns, [LOW] * calls), _evaluate(closed, eqns, [MID] * calls)
    ups = [_evaluate(closed, eqns, [HIGH if j == i else LOW for j in range(calls)]) for i in range(calls)]
    found: dict[str, Any] = {name: "traced" for name in names}
    for k, name in enumerate(present):
        f, m, us = base[k], mid[k], [u[k] for u in ups]
        if f is None or m is None or any(u is None for u in us):
            found[name] = "mixed" if on[name] else "traced"
            continue
        slopes = [(u - f) / (HIGH - LOW) for u in us]  # type: ignore[operator]
        tol = 1e-5 * (1.0 + abs(f) + sum(abs(a) for a in slopes))
        using = [i for i, a in enumerate(slopes) if not abs(a) <= tol]  # NaN counts as used
        if not using:
            found[name] = "plain"
        elif len(using) == 1 and abs(m - (f + (MID - LOW) * slopes[using[0]])) <= tol:
            a = slopes[using[0]]
            found[name] = (using[0], a, f - LOW * a)
        else:
            found[name] = "combined"
    return found


def measured(run: Callable[[], Mapping[str, Any]], metrics: Mapping[str, Any], out: StepOutput, *,
             listed: bool = True) -> dict[str, Any]:
    """``run()`` (a step's ``compute_metrics(out)``) with the parts ``name#sum``, ``name#count``
    of every value that is a counting metric's (``accuracy``, ``.of``, ``binary_accuracy``)
    or an affine function of one, through any function (a lambda, a partial, an override):
    per example of the minibatch, ``(a·hits + b·counted) / n`` and ``counted / n`` for
    ``v = a·hits/counted + b``, so that the size-weighted means of the parts divide to
    the exact ``a·Σ hits/Σ counted + b`` (:func:`combine_parts`).

    Decided at trace time: a value that is the one a counting metric returned (or a
    metric's cast of it) is known by identity; any other, where counting metrics were
    called, by tracing ``run`` again into a throwaway jaxpr of them and evaluating it at
    numbers (:func:`_probe`: the step gains no equation, a callback runs once a step, on
    real values). A value computed from them otherwise (two combined, squared, mixed with
    traced values or passed through host code) or another traced value under a counting
    metric's name gets an :class:`InexactMeanWarning` and its size-weighted mean,
    as a plain metric's: parts ``(0, 0)`` where ``listed`` (the train step: the Trainer
    reads the names :func:`with_parts` lists before tracing), none otherwise (an eval
    step's names are traced: ``EvalStep.metric_shapes``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> out = ft.train.StepOutput(jnp.zeros(()), jnp.array([[2.0, 0.0]]), (None, jnp.array([0])), None)
      >>> values = measured(lambda: {"pct": 100 * ft.train.accuracy(out)}, {}, out)
      >>> {k: float(v) for k, v in values.items()}
      {'pct': 100.0, 'pct#sum': 100.0, 'pct#count': 1.0, 'pct#ratio': 0.0}
    """
    with _framed(_Frame()) as frame:
        values = _values(run())
    scalars = [n for n, v in values.items() if not _is_part(n) and jnp.shape(v) == () and n + PART_SUM not in values]
    how: dict[str, Any] = {}
    for name in scalars:
        seen = frame.known.get(id(values[name]))
        how[name] = (seen[1] or "plain") if seen is not None and seen[0] is values[name] else "unknown"
    unknown = [n for n in scalars if how[n] == "unknown"]
    if unknown and frame.calls:
        how.update(_probe(run, len(frame.calls), unknown))
    counting = set(counting_names(metrics))
    dtype, n = metric_dtype(), batch_size_of(out.batch)
    for name in scalars:
        h = how[name]
        if h in ("combined", "mixed") or (h == "traced" and (name in counting or name in frame.derived)):
            what = "counting metrics' values" if h == "combined" else MIXED
            warnings.warn(INEXACT_MEAN.format(name=name, what=what), InexactMeanWarning, stacklevel=3)
        if isinstance(h, tuple):
            i, a, b = h
            hits, counted = (jnp.asarray(x).astype(dtype) for x in frame.calls[i])  # (float32 counts: the parts
            values[name + PART_SUM] = (a * hits + b * counted) / n                   # divided in float64 under x64)
            values[name + PART_COUNT] = counted / n
        elif listed and (name == "loss" or (name in metrics and _parted(metrics[name])) or name in counting):  # step_names's
            values[name + PART_SUM] = values[name + PART_COUNT] = jnp.zeros((), dtype)
    if listed and "loss" in values:  # whether the loss's parts are a ratio's (a count of 0: no label scored)
        values["loss" + PART_RATIO] = jnp.asarray(isinstance(how.get("loss"), tuple), dtype)
    for name in scalars:  # a metric's: whether its parts are a WeightedMean's (listed: every parted one's)
        is_ratio = isinstance(how[name], tuple) and how[name][0] in frame.weighted
        if name != "loss" and name + PART_SUM in values and (listed or is_ratio):
            values[name + PART_RATIO] = jnp.asarray(is_ratio, dtype)
    return values


def without_parts(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without the parts of :func:`with_parts`: what a step returns to its caller
    (the parts are the running means' bookkeeping, not metrics)."""
    return {k: v for k, v in values.items() if not _is_part(k)}


def counting_names(metrics: Mapping[str, Any]) -> list[str]:
    """The names of the counting metrics (``fn.__ft_counts__``) among ``metrics``: those whose
    means are Σ hits / Σ counted."""
    return [name for name, fn in metrics.items() if getattr(fn, COUNTS, None) is not None]


def part_names(names: Any) -> set[str]:
    """The names among ``names`` that are parts (:func:`with_parts`)."""
    return {n for n in names if _is_part(n)}


def combine_parts(values: Mapping[str, float], sums: Mapping[str, float] | None = None) -> dict[str, float]:
    """``values`` with each counting metric's mean ``Σ hits / Σ counted`` (its parts'
    ``sums``, default ``values``: the parts' means, whose ratio is the same), the parts left
    out. Parts that counted nothing (a metric that turned out plain records ``(0, 0)``, or
    every label -100) leave the value's own size-weighted mean (0 for an accuracy all of
    whose labels were -100, as each minibatch's is); NaN parts (a NaN step under
    ``on_nan="ignore"``, no step) give NaN."""
    sums = values if sums is None else sums
    out = {k: v for k, v in values.items() if k not in part_names(values)}
    for name in [k[: -len(PART_COUNT)] for k in sums if k.endswith(PART_COUNT)]:
        hits, counted = sums.get(name + PART_SUM, math.nan), sums[name + PART_COUNT]
        if math.isnan(hits) or math.isnan(counted):
            out[name] = math.nan
        elif counted:
            out[name] = hits / counted
        else:
            out[name] = out.get(name, 0.0)
    return out
