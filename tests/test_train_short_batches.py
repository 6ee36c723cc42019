"""Errors of minibatches a Trainer cannot take: the data's short last minibatch on a mesh
(named as such whatever ``steps_per_call``), and a validation minibatch whose leaves do not
share their leading axis (named as validation, with a reason true for an evaluation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.parallel._placement import Placement
from functree.train._evaluation import MIXED_EVAL_LEAVES

# --- the short last minibatch on a mesh --------------------------------------------------
# Its 8-device scenario (the message at steps_per_call 1 and 2, checked against SGD in NumPy)
# runs in tests/test_parallel_step.py's subprocess: no process of its own (~16 s).


def test_stacked_batch_sets_earlier_from_its_minibatch_rows():
    # A stacked batch (steps, rows, ...): the rows of each step's minibatch are axis 1.
    where = Placement(None, "data", None, "ft.train.train_step")
    where.check_stacked((np.ones((2, 16, 3)), np.ones((2, 16))))
    assert where.earlier == 16
    where.check_stacked(np.ones((3, 8, 3)))  # the largest so far is kept
    assert where.earlier == 16


# --- a validation minibatch whose leaves disagree ----------------------------------------

_X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
_Y = np.random.default_rng(1).integers(0, 3, size=(16,)).astype(np.int32)


def _loss(m, b):
    logits = m(b["x"])
    return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), b["y"]] * b["w"])


def _trainer():
    return ft.train.Trainer(ft.nn.Dense(3, 3, key=jax.random.key(0)), ft.optim.Optimizer(ft.optim.sgd(0.05)), _loss)


def _data(w_rows):
    return [{"x": _X[i:i + 8], "y": _Y[i:i + 8], "w": np.ones(w_rows, np.float32)} for i in (0, 8)]


def test_bad_validation_minibatch_is_named_as_validation():
    # Was "evaluate: minibatch 0 ... failed", with a reason about leaves cut over devices or
    # microbatches: one device, no accumulate, nothing is cut.
    with pytest.raises(ValueError) as info:
        _trainer().fit(_data(8), 1, progress=False, validation_data=_data(3))
    text = str(info.value)
    assert text.startswith("validation (fit's validation_data=): minibatch 0 (counted from 0) failed.")
    assert MIXED_EVAL_LEAVES.format(first="['x']", rows=8, other="['w']", given=3) in text
    assert "is cut along" not in text and "would be sliced" not in text


def test_bad_evaluate_minibatch_is_named_as_evaluate():
    with pytest.raises(ValueError) as info:
        _trainer().evaluate(_data(8)[:1] + _data(3)[1:])
    text = str(info.value)
    assert text.startswith("evaluate: minibatch 1 (counted from 0) failed.")
    assert MIXED_EVAL_LEAVES.format(first="['x']", rows=8, other="['w']", given=3) in text
