"""torch's ``ctc_loss`` as :func:`ctc`: the connectionist temporal classification loss
(Graves et al. 2006), computed by ``optax.ctc_loss``, with torch's lengths, blank, infinite
loss of an impossible alignment (``zero_infinity``) and mean (over target lengths).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._repr import first_index
from functree.losses._checks import check_number, host_or_none
from functree.losses._reduction import (
    _array,
    _describe,
    check_float,
    check_reduction,
    in_compute_dtype,
    reduce,
)

__all__ = ["ctc", "CTC_SHAPE", "CTC_LENGTH", "CTC_LABEL"]

CTC_SHAPE = """\
ctc: {what} must be {expected}, got {given}.{hint}

    wrong:  {wrong}
    right:  {right}
"""

CTC_LENGTH = """\
ctc: {what}[{index}] is {value}, outside 0 .. {high} ({why}). A length past the padded axis \
would read padding as frames or labels.

    wrong:  ft.losses.ctc(logits, labels, input_lengths, label_lengths)     # {what}[{index}] = {value}
    right:  {what} <= {high}, one per sequence
"""

CTC_LABEL = """\
ctc: labels[{index}] is {value}, within label_lengths but {why}. Labels are the classes \
0 .. {last} other than the blank ({blank}); padding past a sequence's length may hold anything.

    wrong:  ft.losses.ctc(logits, labels, input_lengths, label_lengths)           # labels hold {value}
    right:  ft.losses.ctc(logits, labels, input_lengths, label_lengths, blank={blank})   # blank: the blank's class
"""


def ctc(logits: Any, labels: Any, input_lengths: Any, label_lengths: Any, *, blank: int = 0,
        zero_infinity: bool = False, reduction: str = "mean") -> Any:
    """torch's ``ctc_loss``, batch first: ``logits`` ``[B, T, classes]`` (log-probabilities as
    torch takes them, or logits: the loss takes their ``log_softmax``, which leaves
    log-probabilities as they are), padded ``labels`` ``[B, S]`` (integers), the sequences'
    ``input_lengths`` ``[B]`` and ``label_lengths`` ``[B]``. Each sequence's loss is
    ``-log p(labels | logits)`` summed over alignments (``optax.ctc_loss``); ``blank`` is the
    blank's class (torch's ``blank``, default 0).

    An impossible alignment (fewer frames than labels plus their repeats) has an infinite
    loss, as torch's; ``zero_infinity=True`` makes it 0 with a zero gradient. The mean is
    torch's: each loss divided by its label length (at least 1), averaged over the batch
    (``"weighted"``: that as ``WeightedMean(sum, B)``); ``"sum"`` and ``"none"`` are the
    losses undivided. torch's time-major ``[T, B, C]`` logits and concatenated 1-D targets
    are refused with the fix (:data:`CTC_SHAPE`), and concrete lengths and labels are
    checked (:data:`CTC_LENGTH`, :data:`CTC_LABEL`).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> logits = jnp.zeros((1, 3, 3))      # uniform over {blank, 1, 2}: 5 alignments of [1, 2], -log(5 / 27)
      >>> ft.losses.ctc(logits, jnp.array([[1, 2]]), jnp.array([3]), jnp.array([2]), reduction="sum")
      Array(1.68639..., dtype=float32)
    """
    name = "ctc"
    logits = check_float(name, "logits", logits)
    check_reduction(name, reduction)
    if logits.ndim != 3:
        _refuse("logits", "[batch, time, classes]", logits, hint=" An unbatched [time, classes] needs a batch axis.",
                right="ft.losses.ctc(logits[None], labels[None], input_lengths[None], label_lengths[None])")
    batch, frames, classes = logits.shape
    blank = int(check_number(name, "blank", blank, f"a class, 0 .. {classes - 1}", 0,
                             lambda b: b == int(b) and 0 <= b < classes))
    input_lengths, label_lengths, labels = _array(input_lengths), _array(label_lengths), _array(labels)
    if input_lengths.shape != (batch,):
        time_major = input_lengths.shape == (frames,)
        _refuse("input_lengths", f"one length per sequence, [{batch}] for logits {_describe(logits)}", input_lengths,
                hint=" These logits look time-major, torch's [T, B, C]; here the batch is first." if time_major else "",
                right="ft.losses.ctc(jnp.swapaxes(log_probs, 0, 1), labels, input_lengths, label_lengths)"
                if time_major else "input_lengths: int [B]")
    if labels.ndim != 2 or labels.shape[0] != batch:
        concatenated = labels.ndim == 1
        _refuse("labels", f"padded integer labels [batch, max_label_length], [{batch}, S]", labels,
                hint=" torch's concatenated 1-D targets are not read: pad them per sequence." if concatenated else "",
                right="labels = np.zeros((B, max(label_lengths)), int); "
                      "for b, t in enumerate(np.split(targets, np.cumsum(label_lengths)[:-1])): labels[b, :len(t)] = t")
    if label_lengths.shape != (batch,):
        _refuse("label_lengths", f"one length per sequence, [{batch}]", label_lengths, right="label_lengths: int [B]")
    for what, x in (("labels", labels), ("input_lengths", input_lengths), ("label_lengths", label_lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            _refuse(what, "integers", x, right=f"{what}.astype(jnp.int32)")
    _check_values(labels, input_lengths, label_lengths, frames, classes, blank)
    return _ctc(logits, labels, input_lengths, label_lengths, blank=blank, zero_infinity=bool(zero_infinity),
                reduction=reduction)


def _refuse(what: str, expected: str, given: Any, *, right: str, hint: str = "") -> None:
    raise ValueError(CTC_SHAPE.format(what=what, expected=expected, given=_describe(given), hint=hint,
                                      wrong="ft.losses.ctc(logits, labels, input_lengths, label_lengths)", right=right))


def _check_values(labels: Any, input_lengths: Any, label_lengths: Any, frames: int, classes: int, blank: int) -> None:
    """:data:`CTC_LENGTH` and :data:`CTC_LABEL` for concrete lengths and labels (traced ones are
    left to the kernel: their sequence's loss is NaN)."""
    for what, x, high, why in (("input_lengths", input_lengths, frames, "the logits' time axis"),
                               ("label_lengths", label_lengths, labels.shape[1], "the labels' padded axis")):
        given = host_or_none(x)
        if given is not None:
            bad = np.flatnonzero((given < 0) | (given > high))
            if bad.size:
                raise ValueError(CTC_LENGTH.format(what=what, index=int(bad[0]), value=int(given[bad[0]]), high=high,
                                                   why=why))
    given, lengths = host_or_none(labels), host_or_none(label_lengths)
    if given is None or lengths is None:
        return
    within = np.arange(given.shape[1]) < lengths[:, None]
    bad = within & ((given < 0) | (given >= classes) | (given == blank))
    if bad.any():
        index = first_index(bad)
        value = int(given[index])
        why = "the blank" if value == blank else f"not a class of {classes}"
        raise ValueError(CTC_LABEL.format(index=list(index), value=value, why=why, last=classes - 1, blank=blank))


@functools.partial(jax.jit, static_argnames=("blank", "zero_infinity", "reduction"))
def _ctc(logits: jax.Array, labels: jax.Array, input_lengths: jax.Array, label_lengths: jax.Array, *, blank: int,
         zero_infinity: bool, reduction: str) -> Any:
    logits = in_compute_dtype(logits)
    classes, frames, width = logits.shape[-1], logits.shape[1], labels.shape[1]
    wide = jax.dtypes.canonicalize_dtype(np.int64)  # (a sum's dtype: int32, int64 under x64)
    labels, input_lengths, label_lengths = (x.astype(wide) for x in (labels, input_lengths, label_lengths))
    within = jnp.arange(width, dtype=wide)[None] < label_lengths[:, None]
    valid = jnp.all(~within | ((labels >= 0) & (labels < classes) & (labels != blank)), axis=-1)
    valid &= (input_lengths >= 0) & (input_lengths <= frames) & (label_lengths >= 0) & (label_lengths <= width)
    safe = jnp.where(within & valid[:, None], labels, 0)
    frame_paddings = (jnp.arange(frames, dtype=wide)[None] >= input_lengths[:, None]).astype(logits.dtype)
    label_paddings = (~within).astype(logits.dtype)
    # optax mixes a float32 constant into float64 logits (under jax_enable_x64): standard
    # promotion for its call alone, which keeps float64 (a float32 input stays float32)
    with jax.numpy_dtype_promotion("standard"):
        losses = optax.ctc_loss(logits, frame_paddings, safe, label_paddings, blank_id=blank)
    # optax writes log 0 as -1e5: an impossible alignment is ~1e5, torch's is inf. It needs a
    # frame per label, and one more between each pair of equal neighbours (their blank).
    repeats = jnp.sum((safe[:, 1:] == safe[:, :-1]) & within[:, 1:], axis=-1)
    possible = input_lengths >= label_lengths + repeats
    losses = jnp.where(possible, losses, jnp.zeros((), losses.dtype) if zero_infinity else jnp.inf)
    losses = jnp.where(valid, losses, jnp.full((), jnp.nan, losses.dtype))
    if reduction in ("mean", "weighted"):
        return reduce("ctc", losses / jnp.maximum(label_lengths, 1).astype(losses.dtype), reduction)
    return reduce("ctc", losses, reduction)
