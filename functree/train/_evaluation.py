"""Evaluation and prediction over data, for ``Trainer.evaluate`` / ``Trainer.predict``:
sums accumulated on device and read once; a fixed evaluation key for functions that take
``key=``."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree import nn
from functree._alias import is_deletion_error, is_stale_error, stale_error
from functree._jit import has_untraceable_leaves, unchecked_jit
from functree._repr import short_array
from functree._tree import bounded_put, cached, is_array_value
from functree._warnings import warn
from functree._where import devices_error, placement_of, put
from functree.optim._average import averaged as averaged_parameters
from functree.parallel._cast import cast as cast_to
from functree.parallel._cast import cast_floating
from functree.train._data import Batches, batches, to_arrays
from functree.train._epochs import (
    VALIDATION,
    as_data,
    batch_size,
    check_row_minibatch,
    cut_by_batch_size,
    endless,
    with_location,
)
from functree.train._metrics import (
    PART_COUNT,
    PART_RATIO,
    PART_SUM,
    combine_parts,
    describe_batch,
    metric_dtype,
)
from functree.train._programs import code_reads

__all__ = ["Evaluation", "EVAL_KEY_SALT", "ENDLESS_EVAL_DATA", "check_ends", "eval_key", "evaluate", "predict",
           "key_parameter", "signature", "NoLabelWarning", "NO_LABEL", "NO_METRIC_LABEL"]

EVAL_KEY_SALT = 0x5EED
"""Folded into the trainer's key for evaluation and prediction keys (distinct from the
training steps' ``fold_in(key, step)`` and the shuffling key ``fold_in(key, 1)``)."""


def key_parameter(fn: Callable[..., Any]) -> str | None:
    """Whether ``fn`` takes ``key=``: ``"required"``, ``"optional"`` (a default, or
    ``**kwargs``) or None (no such keyword, or no signature to read).

    Example:
      >>> from functree.train._evaluation import key_parameter
      >>> key_parameter(lambda m, b, *, key: 0), key_parameter(lambda m, b, key=None: 0)
      ('required', 'optional')
      >>> key_parameter(lambda m, b: 0) is None
      True
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    p = params.get("key")
    if p is None:
        return "optional" if any(q.kind is q.VAR_KEYWORD for q in params.values()) else None
    if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL):
        return None
    return "required" if p.default is p.empty else "optional"


def signature(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""


def eval_key(fn: Callable[..., Any], key: Any) -> Any:
    """A fixed key for ``fn`` when it takes ``key=`` (else None): derived from the
    trainer's ``key``, the same for every evaluation."""
    if key_parameter(fn) is None:
        return None
    return jax.random.fold_in(jax.random.key(0) if key is None else key, EVAL_KEY_SALT)


EMPTY_EVAL_DATA = """\
{which} gave no minibatch to {what} ({kind}): {why}

    wrong:  {wrong}
    right:  {right}
       or:  {other}"""

# EMPTY_EVAL_DATA's lines per use: fit's validation_data, evaluate's and predict's data.
_EMPTY_EVAL = {
    "validation": ("The validation data (fit's validation_data=)",
                   "an iterator (a generator) is used up by the first validation, and validation_data is "
                   "read at every epoch's end: give something re-iterable",
                   "trainer.fit(data, epochs=5, validation_data=(b for b in val_batches))",
                   "trainer.fit(data, epochs=5, validation_data=list(val_batches))",
                   "trainer.fit(data, epochs=5, validation_data=ft.train.batches((x_val, y_val), 32, shuffle=False))"),
    "evaluate": ("The data given to trainer.evaluate",
                 "it is empty, or an iterator (a generator) an earlier call used up (it is read once)",
                 "trainer.evaluate(val_iterator)           # read by an earlier evaluate",
                 "trainer.evaluate(list(val_batches))      # a list is read anew by every call",
                 "trainer.evaluate(ft.train.batches((x_val, y_val), 32, shuffle=False))"),
    "predict": ("The data given to trainer.predict",
                "it is empty, or an iterator (a generator) an earlier call used up (it is read once)",
                "trainer.predict(iterator)                # read by an earlier call",
                "trainer.predict(list(batches))           # a list is read anew by every call",
                "trainer.predict(x, batch_size=32)"),
}


def no_eval_minibatch(which: str, data: Any) -> ValueError:
    """:data:`EMPTY_EVAL_DATA` for ``which`` (``"validation"``, ``"evaluate"``, ``"predict"``):
    the data named as the caller gave it, not as training data."""
    name, why, wrong, right, other = _EMPTY_EVAL[which]
    what = "predict" if which == "predict" else "evaluate"
    return ValueError(EMPTY_EVAL_DATA.format(which=name, what=what, kind=type(data).__name__, why=why,
                                             wrong=wrong, right=right, other=other))


ENDLESS_EVAL_DATA = """\
trainer.{method}(data) reads all of data, but the data ({kind}) never ends: {why}. \
{method} would never return. It takes no step count (Keras's steps=): give it the \
minibatches to read, or data that ends:

    wrong:  trainer.{method}(data)
    right:  trainer.{method}(itertools.islice(data, 100))    # its first 100 minibatches
       or:  trainer.{method}({finite})    # {note}"""


def check_ends(method: str, data: Any) -> None:
    """:data:`ENDLESS_EVAL_DATA` for data known never to end (:func:`endless`): evaluate
    and predict read all of it, and hung (a generator may end: read as it comes)."""
    ends = endless(data)
    if ends is not None:
        finite, _, note = ends[1].partition("  # ")
        raise ValueError(ENDLESS_EVAL_DATA.format(method=method, kind=type(data).__name__, why=ends[0],
                                                  finite=finite, note=note))


MALFORMED_EVAL_MINIBATCH = """\
{what}: minibatch {index} (counted from 0) failed. Its shapes: {shapes}{first}. The error:
{error}"""


EMPTY_EVAL_MINIBATCH = """\
{what}: minibatch {index} (counted from 0) is empty (shapes {shapes}): its mean is NaN, and
NaN times its weight 0 made the whole result NaN. Leave empty minibatches out:
    right:  [b for b in minibatches if len(b[0])]   (np.array_split gives empty ones past len(x))"""


MIXED_EVAL_LEAVES = """\
The minibatch's leaves do not share one example axis: {first} has {rows} rows, {other} has \
{given}. The mean over minibatches weighs each by its examples, the leading axis every array \
leaf shares (training counts them so too), so this minibatch's weight is ambiguous. Keep \
values that are not per example out of the batch (in the loss's closure), or give them one \
row per example:

    wrong:  batch = {{"x": x, "y": y, "class_weights": w}}               # w: one per class
    right:  loss_fn = functools.partial(weighted_loss, class_weights=w)    # or w[y]: one per example"""

# The minibatch errors' first words per use (EMPTY_EVAL_DATA names the data alike).
NO_LABEL = """\
{what}: the loss is a ft.losses.WeightedMean (reduction="weighted") whose count is 0 over every \
minibatch: no position was scored (every label is ignore_index, -100: a collator that \
truncated each response away, or labels shifted off the end). Its mean is 0/0, reported as \
NaN, as torch's and Hugging Face's eval_loss; each minibatch's 0 would read as a perfect \
loss (EarlyStopping and ModelCheckpoint would keep this model as the best). Give data with \
labels to score:

    wrong:  labels = np.full_like(input_ids, -100)            # every position ignored
    right:  labels = np.where(response_mask, input_ids, -100)  # the response's tokens scored"""


NO_METRIC_LABEL = """\
{what}: the metric {name!r} returns a ft.losses.WeightedMean whose count is 0 over every \
minibatch: no position was scored (every label is ignore_index, -100: a collator that \
truncated each response away, or labels shifted off the end). Its mean is 0/0, reported as \
NaN, not its minibatches' 0s, which would read as a perfect {name!r} (EarlyStopping and \
ModelCheckpoint monitoring it would keep this model as the best). Give data with labels to \
score:

    wrong:  labels = np.full_like(input_ids, -100)            # every position ignored
    right:  labels = np.where(response_mask, input_ids, -100)  # the response's tokens scored"""


class NoLabelWarning(UserWarning):
    """An evaluation or a training log window or epoch whose ``ft.losses.WeightedMean`` loss
    (:data:`NO_LABEL`) or metric (:data:`NO_METRIC_LABEL`) counted nothing over all of its
    data: its mean is NaN."""


_WHAT = {"validation": "validation (fit's validation_data=)", "evaluate": "evaluate", "predict": "predict"}


def _minibatches(data: Any) -> Iterable[Any]:
    """Every example once, in order: a ``Batches`` (the training data's, shuffled, maybe
    dropping its last minibatch) is read :meth:`~Batches.in_order`."""
    return data.in_order().iterate(0) if isinstance(data, Batches) else data


def _check_examples(batch: Any) -> None:
    """:data:`MIXED_EVAL_LEAVES` unless the array leaves share their leading axis: the
    examples the mean weighs the minibatch by. The example axis is the size most leaves
    share (the larger on a tie); the first leaf of another size is named."""
    leaves = [(jax.tree_util.keystr(path) or "the batch", np.shape(x)[0])
              for path, x in jax.tree_util.tree_flatten_with_path(batch)[0] if np.ndim(x) >= 1]
    sizes = Counter(rows for _, rows in leaves)
    if len(sizes) > 1:
        rows = max(sizes, key=lambda n: (sizes[n], n))
        first = next(where for where, n in leaves if n == rows)
        other, given = next((where, n) for where, n in leaves if n != rows)
        raise ValueError(MIXED_EVAL_LEAVES.format(first=first, rows=rows, other=other, given=given))


def _check_not_empty(what: str, index: int, batch: Any) -> None:
    _check_examples(batch)  # (before batch_size's error, whose reason is a split's)
    if batch_size(batch) == 0:
        raise ValueError(EMPTY_EVAL_MINIBATCH.format(what=what, index=index, shapes=describe_batch(batch)))


def _numbered(data: Any) -> Iterator[tuple[int, Any, Any]]:
    """``(index, minibatch, first minibatch)`` over :func:`_minibatches`."""
    first = None
    for i, batch in enumerate(_minibatches(data)):
        first = batch if i == 0 else first
        yield i, batch, first


@contextlib.contextmanager
def _located(what: str, index: int, batch: Any, first: Any) -> Iterator[None]:
    """An error of minibatch ``index`` of an evaluation or prediction (raised while tracing,
    or by the batch's checks), located as ``fit``'s are: which minibatch, its shapes, and
    the first minibatch's."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if is_stale_error(e):  # the model's (donated meanwhile), not the minibatch's
            raise
        before = f"; the first minibatch had {describe_batch(first)}" if index else ""
        raise with_location(e, MALFORMED_EVAL_MINIBATCH.format(
            what=what, index=index, shapes=describe_batch(batch), first=before, error=e)) from e.__cause__


def evaluate(step: Any, summing: Callable[..., Any], model: Any, data: Any, key: Any,
             which: str = "evaluate") -> dict[str, float]:
    """The means of ``step``'s loss and metrics over ``data``, weighted by minibatch size,
    and a counting metric's (accuracy) over its counted labels, Σ hits / Σ counted (the
    ratio of its parts' means, which every eval step computes: ``combine_parts``):
    ``summing`` (``EvalStep.summing``) adds each minibatch on device; one read at the end.
    ``which``: whose data, for the error of data with no minibatch (``"validation"``)."""
    sums: Any = None
    what = _WHAT[which]  # (a validation minibatch's error says so, as its empty data's does)
    for i, given, first in _numbered(data):
        if not i and not isinstance(data, Batches):
            check_row_minibatch(given, data, VALIDATION if which == "validation" else "trainer.evaluate")
        with _located(what, i, given, first):
            batch = step.shard_batch(to_arrays(given))
            _check_not_empty(what, i, batch)
            try:
                sums = _summed(step, summing, model, sums, batch, key)
            except (RuntimeError, ValueError) as e:
                better = _explained(what, e, model, batch)
                if better is None:
                    raise
                raise better from None
    if sums is None:
        raise no_eval_minibatch(which, data)
    host = jax.device_get(sums)
    lost = host["compensation"]  # each sum's rounding errors (EvalStep.summed): exact in float64
    weight = float(host["weight"]) + float(lost["weight"])
    means = {k: (float(v) + float(lost["values"][k])) / weight for k, v in host["values"].items()}
    return _no_label_nan(what, means, combine_parts(means))


def _no_label_nan(what: str, means: Mapping[str, float], combined: dict[str, float]) -> dict[str, float]:
    """``combined`` with a NaN loss where the loss is a ``WeightedMean`` whose count summed to
    0 (:data:`NO_LABEL`: warned). In an eval step only such a loss records parts (a plain
    loss none), so a count of 0 is nothing scored; each minibatch's loss is 0 there, as
    training's must be (no gradient), which the mean would report as perfect. Likewise a
    metric whose value is a ``WeightedMean``'s (its mark, :data:`PART_RATIO`: an accuracy
    that counted nothing has none and stays 0) is NaN (:data:`NO_METRIC_LABEL`)."""
    if means.get("loss" + PART_COUNT) == 0.0 and "loss" + PART_SUM in means:
        warn(NO_LABEL.format(what=what), NoLabelWarning)
        combined["loss"] = math.nan
    for name in [k[: -len(PART_RATIO)] for k in means if k.endswith(PART_RATIO)]:
        if means.get(name + PART_COUNT) == 0.0:
            warn(NO_METRIC_LABEL.format(what=what, name=name), NoLabelWarning)
            combined[name] = math.nan
    return combined


def _explained(what: str, error: Exception, model: Any, batch: Any) -> Exception | None:
    """A minibatch program's ``error`` named by key path: the model donated since the call
    began (a training thread's step: the stale-array error), or the model and the minibatch
    on other devices; None for another error (raised as it is)."""
    named = [("model", model), ("batch", batch)]
    return stale_error(named) if is_deletion_error(error) else devices_error(what, error, named)


def _summed(step: Any, summing: Callable[..., Any], model: Any, sums: Any, batch: Any, key: Any) -> Any:
    """``sums`` with ``batch``'s added (the first minibatch's made first, zero)."""
    if sums is None:
        shapes = step.metric_shapes(model, batch, key)  # traced once per signature
        dtype = metric_dtype()  # float64 under jax_enable_x64: sums as precise as the values
        zeros = {"values": {k: np.zeros((), dtype) for k in shapes}, "weight": np.zeros((), dtype)}
        # Compensated sums (EvalStep.summed): a plain float32 sum past 2²⁴ rounds each add
        # (a count of 32752 a minibatch added 32768 past 2²⁸: an accuracy 2.9e-4 too low).
        sums = {**zeros, "count": np.zeros((), np.int32), "compensation": jax.tree.map(np.zeros_like, zeros)}
        # From the host in one explicit transfer (eager jnp.zeros were a dispatch and an
        # implicit transfer each, refused under jax.transfer_guard("disallow")), committed
        # where the model lives, as the sums the program returns: one program
        # (uncommitted first sums compiled it twice per evaluation's shapes).
        where = placement_of(model)
        sums = put(jax.device_put(sums, where), where)
    return summing(model, sums, batch, key)


def predict(step: Any, program: Callable[..., Any], model: Any, data: Any, fn: Callable[..., Any], key: Any) -> Any:
    """``fn(model, batch)`` over ``data`` by ``program`` (jitted), concatenated along axis 0;
    ``fold_in(key, i)`` for the i-th minibatch when ``key`` is given. With ``step``'s
    ``compute_dtype``, the model and the floating inputs are cast inside the program, as
    :meth:`evaluate` casts them (the outputs are what the model returns in that dtype)."""
    dtype = getattr(step, "compute_dtype", None)
    if dtype is not None:  # one hashable wrapper per (fn, dtype): the program's static argument
        fn = InDtype(fn, dtype)
    outputs = []
    for i, given, first in _numbered(data):
        if not i and not isinstance(data, Batches):
            check_row_minibatch(given, data, "trainer.predict")
        with _located("predict", i, given, first):
            batch = step.shard_batch(to_arrays(given))
            rows = _predict_examples(batch)  # (an ambiguous batch is refused before its program runs)
            try:
                outputs.append(program(model, batch, fn, None if key is None else jax.random.fold_in(key, i)))
            except (RuntimeError, ValueError) as e:
                better = _explained("predict", e, model, batch)
                if better is None:
                    _note_default_call(e, fn, batch)
                    raise
                raise better from None
            except Exception as e:
                _note_default_call(e, fn, batch)
                raise
            _check_per_example(fn, outputs[-1], rows)
    if not outputs:
        raise no_eval_minibatch("predict", data)
    _check_rows(fn, outputs[0])
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outputs)


PREDICT_NO_ROWS = """\
trainer.predict(data, fn): fn's outputs are concatenated along their first axis, one row \
per example, but {fn} returned {output} at {path} for the first minibatch: no example axis \
to concatenate. Return a value per example, and reduce after predict:

    wrong:  trainer.predict(data, lambda m, b: jnp.sum(m(b)))
    right:  jnp.sum(trainer.predict(data, lambda m, b: m(b)))
       or:  trainer.evaluate(data)      # a loss or metric averaged over the data"""


def _check_rows(fn: Any, output: Any) -> None:
    """:data:`PREDICT_NO_ROWS` for an output leaf without a leading axis."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(output)[0]:
        if np.ndim(leaf) == 0:
            raise ValueError(PREDICT_NO_ROWS.format(fn=getattr(fn, "__name__", "fn"), output=short_array(jnp.asarray(leaf)),
                                                    path=jax.tree_util.keystr(path) or "its root"))


PREDICT_NOT_PER_EXAMPLE = """\
trainer.predict(data, fn): fn's outputs are concatenated along their first axis, one row \
per example, but {fn} returned {output} at {path} for a minibatch of {rows} examples \
({where}): its first axis is not the examples'. Concatenated, its rows would not be the \
data's examples, nor its length the data's. Return one row per example, and reduce or \
reshape after predict:

    wrong:  trainer.predict(data, lambda m, b: jnp.mean(m(b[0]), axis=0))
    right:  jnp.mean(trainer.predict(data, lambda m, b: m(b[0])), axis=0)
       or:  trainer.predict(data, lambda m, b: m(b[0])).reshape(-1, num_classes)   # for .reshape(-1, num_classes) inside"""

PREDICT_EXAMPLES_UNKNOWN = """\
trainer.predict(data, fn): fn's outputs are concatenated along their first axis, one row \
per example, and the minibatch's examples are ambiguous: its leaves do not share one \
leading axis ({first} has {rows} rows, {other} has {given}), and no inputs entry of one \
leading axis says which is the examples' (batch[0] of a tuple; batch["x"], "inputs", \
"input", "image", "images" or "features" of a dict). Keep values that are not per example \
out of the batch (in fn's closure), or name the examples' entry:

    wrong:  batch = {{"ids": ids, "class_weights": w}}                 # w: one per class
    right:  trainer.predict(data, functools.partial(fn, class_weights=w))   # batch = {{"ids": ids}}
       or:  batch = {{"x": ids, "class_weights": w}}                   # the examples: batch["x"]'s rows"""


def _predict_examples(batch: Any) -> tuple[int, str] | None:
    """The minibatch's examples for :func:`_check_per_example`, ``(rows, where they are
    read)``: the leading axis every array leaf shares, else (leaves of several sizes: a
    per-minibatch ``prototypes`` beside ``x``) that of the model inputs (:func:`inputs`:
    ``batch[0]``, ``batch["x"]``) where its leaves share one; None for a batch without
    arrays. Neither: :data:`PREDICT_EXAMPLES_UNKNOWN` (any leaf's size taken, a
    per-minibatch mean of as many columns as another leaf's rows passed)."""
    leaves = [(jax.tree_util.keystr(path) or "the batch", int(np.shape(x)[0]))
              for path, x in jax.tree_util.tree_flatten_with_path(batch)[0] if np.ndim(x) >= 1]
    sizes = {n for _, n in leaves}
    if len(sizes) <= 1:
        return None if not sizes else (sizes.pop(), "the leading axis its leaves share")
    entry = _inputs_entry(batch)  # (a dict without an inputs key: None)
    shared = set() if entry is None else {int(np.shape(x)[0]) for x in jax.tree.leaves(entry[1]) if np.ndim(x) >= 1}
    if entry is not None and entry[0] and len(shared) == 1:
        return shared.pop(), f"the leading axis of its inputs, batch{entry[0]}"
    (first, rows), (other, size) = leaves[0], next(leaf for leaf in leaves if leaf[1] != leaves[0][1])
    raise ValueError(PREDICT_EXAMPLES_UNKNOWN.format(first=first, rows=rows, other=other, given=size))


def _check_per_example(fn: Any, output: Any, examples: tuple[int, str] | None) -> None:
    """:data:`PREDICT_NOT_PER_EXAMPLE` for an output leaf whose first axis is not the
    minibatch's examples (``examples``, :func:`_predict_examples`'s; a per-minibatch mean, a
    transposed output): concatenated, a minibatch of 4 gave 3 rows, or JAX's "Cannot
    concatenate arrays" at a short last one. Scalars are :func:`_check_rows`'s; a batch with
    no example axis (None) leaves any output."""
    if examples is None:
        return
    rows, where = examples
    for path, leaf in jax.tree_util.tree_flatten_with_path(output)[0]:
        if np.ndim(leaf) >= 1 and np.shape(leaf)[0] != rows:
            raise ValueError(PREDICT_NOT_PER_EXAMPLE.format(
                fn=getattr(fn.fn if isinstance(fn, InDtype) else fn, "__name__", "fn"), output=short_array(leaf),
                path=jax.tree_util.keystr(path) or "its root", rows=rows, where=where))


@dataclasses.dataclass(frozen=True)
class InDtype:
    """``fn(model, batch)`` with the model (``ft.cast``) and the floating leaves of ``batch``
    cast to ``dtype`` first: ``TrainStep(compute_dtype=)``'s cast, for ``Trainer.predict``.
    Equal for an equal ``fn`` and ``dtype``: a jitted program keeps one compilation."""

    fn: Callable[..., Any]
    dtype: Any

    def __call__(self, model: Any, batch: Any, **kw: Any) -> Any:
        return self.fn(cast_to(model, self.dtype), cast_floating(batch, self.dtype), **kw)


def inputs(batch: Any) -> Any:
    """The model inputs of a batch: ``batch[0]``, ``batch["x"]``-like, or the batch."""
    entry = _inputs_entry(batch)
    if entry is None:
        raise ValueError(NO_INPUTS.format(keys=sorted(map(str, batch))))
    return entry[1]


def _inputs_entry(batch: Any) -> tuple[str, Any] | None:
    """:func:`inputs` with where it is read (``"[0]"``, ``"['x']"``; ``""``: the batch
    itself), or None for a dict without an inputs key."""
    if isinstance(batch, (tuple, list)):
        return "[0]", batch[0]
    if isinstance(batch, Mapping):
        name = next((n for n in ("x", "inputs", "input", "image", "images", "features") if n in batch), None)
        return None if name is None else (f"[{name!r}]", batch[name])
    return "", batch


NO_INPUTS = """\
Trainer.predict: the default fn calls model(inputs) with batch["x"] (or "inputs", "input",
"image", "images", "features"); this batch has {keys}. Say how to call the model:
    right:  trainer.predict(data, lambda model, batch: model(batch["input_ids"], attention_mask=batch["attention_mask"]))"""


def default_predict(model: Any, batch: Any) -> Any:
    return model(inputs(batch))


DEFAULT_PREDICT_CALL = """\
trainer.predict(data) without fn called model(batch{entry}): the minibatch's inputs alone \
(its default for a {kind} minibatch). A model that takes the whole minibatch, or more of it \
(a mask beside the inputs), is called by an fn of yours:
    right:  trainer.predict(data, lambda model, batch: model(batch))"""


def _note_default_call(error: Exception, fn: Any, batch: Any) -> None:
    """:data:`DEFAULT_PREDICT_CALL` on the error of the default ``fn`` that called the model
    with one entry of a tuple or dict minibatch: a model of ``model(batch)`` (an HF-style
    dict) failed deep inside with JAX's "does not support string indexing", which named
    neither the call predict made nor the ``fn`` that makes another."""
    base = fn.fn if isinstance(fn, InDtype) else fn
    entry = _inputs_entry(batch) if base is default_predict else None
    if entry is not None and entry[0]:
        error.add_note(DEFAULT_PREDICT_CALL.format(entry=entry[0], kind="dict" if isinstance(batch, Mapping) else "tuple"))


def call_predict(model: Any, batch: Any, fn: Callable[..., Any], key: Any) -> Any:
    return fn(model, batch) if key is None else fn(model, batch, key=key)


_PREDICTORS: dict[Any, Callable[..., Any]] = {}  # (what the code reads, static leaves) -> call_predict jitted


def predictor(model: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`call_predict` jitted (``fn`` static), one function per what the Python of
    ``model``'s user classes and of ``fn`` reads now (:func:`code_reads`): JAX's caches key
    on the function, so a global that a later notebook cell changed (``G = 3.0`` read by
    ``Net.__call__``) traces anew, where one process-wide function ran the program traced
    with the old value; the same reads share their programs (a new Trainer compiles nothing).
    Code whose reads cannot be keyed is traced at each call, never stale."""
    static = has_untraceable_leaves(model)
    reads = code_reads(model, (fn,))
    key, found = cached(_PREDICTORS, (reads, static)) if reads is not None else (None, None)
    if found is None:
        def run(model: Any, batch: Any, fn: Callable[..., Any], key: Any) -> Any:
            return call_predict(model, batch, fn, key)

        found = unchecked_jit(run, static_argnums=2, static_leaves=static)
        if key is not None:
            bounded_put(_PREDICTORS, key, found)
    return found


class Evaluation:
    """A trainer's evaluation and prediction over data (the model in inference mode),
    reading ``self.model``, ``self.opt_state``, ``self.key`` and ``self.eval_step``
    (``Trainer`` derives from it)."""

    model: Any
    opt_state: Any
    key: Any
    eval_step: Any
    _eval_fused: Callable[..., Any]

    @property
    def inference_model(self) -> Any:
        """The trained model in inference mode (``ft.nn.inference(trainer.model)``): call
        it for predictions. ``trainer.model`` is in training mode, where Dropout needs a
        key.

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp
          >>> model = ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.Dropout(0.5))
          >>> trainer = ft.train.Trainer(model, ft.optim.sgd(0.1), lambda m, b: 0.0)
          >>> ft.nn.is_training(trainer.model), ft.nn.is_training(trainer.inference_model)
          (True, False)
          >>> trainer.inference_model(jnp.ones((1, 2))).shape
          (1, 2)
        """
        return nn.inference(self.model)

    @property
    def averaged_model(self) -> Any:
        """The model with the optimizer's averaged parameters (``ft.optim.averaged``:
        ``Optimizer(tx, average=ft.optim.ema(0.999))``, or lookahead's slow weights), in
        inference mode."""
        return nn.inference(averaged_parameters(self.opt_state, self.model))

    def evaluate(self, data: Any, *, batch_size: int | None = None, averaged: bool = False) -> dict[str, float]:
        """The loss and metrics of the model (inference mode) over ``data``: means
        weighted by minibatch size, a counting metric's (``accuracy``) Σ hits / Σ counted
        over every minibatch (labels of -100 left out), accumulated on device, read once
        at the end.
        ``averaged=True`` evaluates :attr:`averaged_model` instead.

        A loss function that takes ``key=`` gets ``fold_in(eval_key, batch index)`` with a
        fixed evaluation key derived from the trainer's: evaluations are reproducible.

        Several processes (a Trainer over a mesh that spans them): every process calls it
        with **its share** of each minibatch, as in ``fit``
        (``ft.train.batches(..., shard=(jax.process_index(), jax.process_count()))``); the
        global minibatch is the shares concatenated in process order, and every process
        gets the same means. The same rows given to every process are each counted once
        per process: the means are still the data's, but the work is done ``P`` times;
        give each process its share to evaluate the data once. ``fit``'s
        ``validation_data`` is read the same way.
        """
        return self._evaluate(data, batch_size, averaged, "evaluate")

    def _evaluate(self, data: Any, batch_size: int | None, averaged: bool, which: str) -> dict[str, float]:
        """:meth:`evaluate` of ``which``'s data (``"validation"``: fit's, named so in its errors)."""
        if which == "validation" and not cut_by_batch_size(data):
            batch_size = None  # fit's batch_size= cuts its training arrays; a loader validates as it is
        caller = VALIDATION if which == "validation" else "trainer.evaluate"
        check_ends("evaluate", data)  # (fit refuses endless validation data with its own message)
        data = as_data(data, batch_size, self.key, shuffle=False, caller=caller)
        model = self.averaged_model if averaged else self.inference_model
        key = eval_key(self.eval_step.loss_fn, self.key)
        return evaluate(self.eval_step, self._eval_fused, model, data, key, which)

    def predict(self, data: Any, fn: Callable[[Any, Any], Any] | None = None, *,
                batch_size: int | None = None) -> Any:
        """``fn(model, batch)`` over ``data`` (inference mode), concatenated along axis 0:
        every output leaf holds one row per example, in the data's order (a leaf whose first
        axis is not the minibatch's examples, a per-minibatch mean, is refused: reduce after).
        A minibatch's examples are the leading axis its array leaves share; where they differ
        (a per-minibatch ``prototypes`` beside ``x``), that of its inputs (``batch[0]``,
        ``batch["x"]``), and a minibatch that names neither is refused.

        ``fn`` defaults to ``model(inputs)`` with inputs ``batch[0]`` (tuples),
        ``batch["x"]`` (dicts) or the batch itself (arrays). An ``fn`` that takes ``key=``
        gets ``fold_in(eval_key, batch index)`` (see :meth:`evaluate`). With the Trainer's
        ``compute_dtype`` the model and the floating inputs are cast to it first, as in
        training and :meth:`evaluate` (the outputs come in the dtype the model computes
        them in: ``bfloat16`` for most layers). For one batch, call
        :attr:`inference_model` directly (in the parameters' dtype).

        Several processes (a Trainer over a mesh that spans them): every process calls it
        with **its share** of each minibatch, as in ``fit``
        (``ft.train.batches(..., shard=(jax.process_index(), jax.process_count()))``). The
        result is one global array over the mesh, each minibatch's rows the processes'
        shares in process order; no process holds it whole (``np.asarray`` raises JAX's
        "spans non-addressable devices"): ``jax.experimental.multihost_utils.process_allgather(
        out, tiled=True)`` gives every process all of it. The same rows given to every
        process come back once per process: 64 rows in each of 2 processes give 128 rows,
        each twice.
        """
        fn = fn or default_predict
        check_ends("predict", data)
        if is_array_value(data):
            data = batches(data, batch_size or 32, shuffle=False)
        data = as_data(data, batch_size, self.key, shuffle=False, caller="trainer.predict")
        model = self.inference_model
        return predict(self.eval_step, predictor(model, fn), model, data, fn, eval_key(fn, self.key))
