"""Errors of minibatches a Trainer cannot take: the data's short last minibatch on a mesh
(named as such whatever ``steps_per_call``), and a validation minibatch whose leaves do not
share their leading axis (named as validation, with a reason true for an evaluation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.parallel._placement import SHORT_LAST_BATCH, Placement
from functree.train._evaluation import MIXED_EVAL_LEAVES

# --- the short last minibatch on a mesh --------------------------------------------------

_SHORT_LAST = """
import functree as ft, jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
x = rng.normal(size=(44, 3)).astype(np.float32)
y = rng.normal(size=(44, 1)).astype(np.float32)
mesh = jax.make_mesh((8,), ("data",))
loss_fn = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
out = {"x": x.tolist(), "y": y.tolist()}
for k in (1, 2):
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    out["start"] = [np.asarray(model.weight).tolist(), np.asarray(model.bias).tolist()]
    t = ft.train.Trainer(model, ft.optim.Optimizer(ft.optim.sgd(0.1)), loss_fn, mesh=mesh, steps_per_call=k)
    try:
        t.fit([(x[i:i + 16], y[i:i + 16]) for i in range(0, 44, 16)], 1, progress=False)
        out[k] = None
    except ValueError as e:
        out[k] = [str(e), t.steps_run, np.asarray(t.model.weight).tolist(), np.asarray(t.model.bias).tolist()]
report(out)
"""


@pytest.fixture(scope="module")
def short_last():
    from _devices import run

    return run(_SHORT_LAST)


def _sgd_reference(x, y, w, b, steps, rate=0.1, size=16):
    """``steps`` SGD steps on mean((x w + b - y)^2) over minibatches of ``size``:
    dL/dw = 2/n x^T r, dL/db = 2/n Σ r, r = x w + b - y (n the minibatch's rows)."""
    for i in range(steps):
        xb, yb = x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]
        r = xb @ w + b - yb
        w, b = w - rate * 2 / len(xb) * xb.T @ r, b - rate * 2 / len(xb) * r.sum(0)
    return w, b


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_short_last_minibatch_named_at_any_steps_per_call(short_last, steps_per_call):
    # 44 examples in minibatches of 16: the third has 12, which 8 devices cannot share. With
    # steps_per_call=2 the first two ran stacked, which once left `earlier` at 0: the message
    # then told the user to use batch_size=8 instead of dropping the short last minibatch.
    text, steps, weight, bias = short_last[str(steps_per_call)]
    right = SHORT_LAST_BATCH.format(size=12, path="[0]", n=8, axis="data", earlier=16, right=8)
    assert right in text
    assert "batch_size=16, drop_last=True" in text and "batch_size=12" not in text
    # The two full minibatches ran (before the short one stopped the epoch), as plain SGD.
    x, y = np.asarray(short_last["x"], np.float64), np.asarray(short_last["y"], np.float64)
    w, b = _sgd_reference(x, y, np.asarray(short_last["start"][0]), np.asarray(short_last["start"][1]), 2)
    assert steps == 2
    np.testing.assert_allclose(np.asarray(weight), w, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(bias), b, rtol=0, atol=1e-5)


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
