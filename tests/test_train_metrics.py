"""Metrics: accuracy in its label forms, aux means, and their errors."""

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train import StepOutput
from functree.train._metrics import evaluate_metrics, resolve_metrics


@pytest.fixture(autouse=True)
def _own_compiled_steps():
    """Overrides conftest.py's: this module's Trainers share their compiled programs across
    tests (most run :func:`_token_loss` on the same data with sgd(0.0) and accuracy: the
    process-wide table of functree/train/_programs.py, as a user's process has it). No test
    here counts its compilations; the ones that expect a trace-time warning build a step of
    their own class or metrics, which no other test shares."""


LOGITS = jnp.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])


def out(aux, batch):
    return StepOutput(jnp.zeros(()), aux, batch, None)


def test_accuracy_label_forms():
    ints = jnp.array([0, 1, 1, 0])
    assert float(ft.train.accuracy(out(LOGITS, (None, ints)))) == 0.75
    onehot = jax.device_put(np.eye(3, dtype=np.float32)[np.asarray(ints)])  # numpy builds it: no program
    assert float(ft.train.accuracy(out({"logits": LOGITS}, {"label": onehot}))) == 0.75
    binary = jnp.array([1.0, 0.0, 1.0])
    assert float(ft.train.accuracy.of(jnp.array([[2.0], [-1.0], [-0.5]]), binary)) == pytest.approx(2 / 3)


def test_accuracy_errors_say_what_to_return():
    with pytest.raises(ValueError, match=r"return ft.losses.softmax_cross_entropy\(logits, y\), logits"):
        ft.train.accuracy(out(None, (None, jnp.zeros(4))))
    with pytest.raises(ValueError, match=r"could not find the labels"):
        ft.train.accuracy(out(LOGITS, {"image": jnp.zeros(4)}))
    with pytest.raises(ValueError, match=r"shape \(4, 3\) do not fit labels of shape \(5,\)"):
        ft.train.accuracy(out(LOGITS, (None, jnp.zeros(5, jnp.int32))))


def test_mean_and_resolution():
    fns = resolve_metrics(["mse", ft.train.accuracy])
    assert list(fns) == ["mse", "accuracy"]
    values = evaluate_metrics(fns, out({"mse": jnp.array([1.0, 2.0]), "logits": LOGITS},
                                       (None, jnp.array([0, 1, 2, 0]))))
    assert {k: float(v) for k, v in values.items()} == {"loss": 0.0, "mse": 1.5, "accuracy": 1.0}
    doubled = ft.train.mean(lambda o: 2 * o.loss)
    assert float(doubled(out(None, None))) == 0.0


def test_metric_errors():
    with pytest.raises(TypeError, match=r'right:  metrics=\{"accuracy": ft.train.accuracy'):
        resolve_metrics({"accuracy": 0.5})
    with pytest.raises(ValueError, match=r"reads aux\['mse'\]"):
        ft.train.mean("mse")(out(jnp.ones(2), None))
    with pytest.raises(ValueError, match=r"returned shape \(2,\)"):
        evaluate_metrics({"raw": lambda o: jnp.ones(2)}, out(None, None))


def test_binary_logits_of_the_labels_shape_are_scored_per_example():
    """Logits [N] with labels [N] (sigmoid_cross_entropy's layout) went to the one-hot branch:
    argmax over the batch axis, so each minibatch scored 0 or 1 (0.0 for 0.625)."""
    logits = jnp.array([2.0, -1.0, 0.5, -0.3, 1.5, -2.0, 0.2, 0.7])
    labels = jnp.array([1, 0, 0, 0, 1, 1, 1, 0])
    expected = float(np.mean((np.asarray(logits) > 0) == (np.asarray(labels) == 1)))  # numpy's
    assert expected == 0.625
    assert float(ft.train.accuracy(out(logits, (None, labels)))) == expected
    assert float(ft.train.accuracy.of(logits[:, None], labels)) == expected
    # Labels of the logits' shape [N, K]: one-hot for accuracy, elementwise for binary_accuracy.
    multi_logits, multi = jnp.array([[2.0, -1.0, 0.5], [-3.0, 1.0, -0.2]]), jnp.array([[1, 0, 0], [0, 1, 1]])
    assert float(ft.train.binary_accuracy(out(multi_logits, {"labels": multi}))) == pytest.approx(4 / 6)
    assert float(ft.train.binary_accuracy.of(logits, labels)) == expected
    with pytest.raises(ValueError, match=r"binary_accuracy: logits of shape \(2, 3\) do not fit 0/1 labels of shape \(2,\)"):
        ft.train.binary_accuracy.of(multi_logits, jnp.array([0, 1]))


def test_labels_of_minus_100_are_left_out():
    """HF pads token labels with -100, which the losses skip: accuracy counted them as wrong
    (0.0833 for 0.1667 on the audit's batch)."""
    logits = jnp.array([[[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]], [[0.0, 3.0], [2.0, 0.0], [0.0, 1.0]]])
    labels = jnp.array([[0, 0, -100], [1, -100, -100]])  # 3 counted: hit, miss, hit
    assert float(ft.train.accuracy(out({"logits": logits}, {"labels": labels}))) == pytest.approx(2 / 3)
    assert float(ft.train.accuracy.of(logits, jnp.full((2, 3), -100))) == 0.0  # nothing to count
    unsigned = jnp.array([[0, 0, 1], [1, 0, 1]], jnp.uint8)  # no -100 possible: every label counts
    assert float(ft.train.accuracy.of(logits, unsigned)) == pytest.approx(4 / 6)


def test_another_ignore_index_is_named_through_accuracy_of():
    """A segmentation mask's void label 255 (torch's ignore_index=255) is no class: scored, it is
    a miss (as Keras's and scikit-learn's accuracy); accuracy.of(ignore_index=255) leaves it out,
    in uint8 too, and a Trainer's means over minibatches of unequal size are then the whole
    data's Σ hits / Σ counted (numpy's)."""
    rng = np.random.default_rng(255)
    logits = rng.normal(size=(7, 3, 4)).astype(np.float32)
    labels = rng.integers(0, 4, (7, 3)).astype(np.uint8)
    labels[rng.random((7, 3)) < 0.4] = 255
    kept = labels != 255
    want = float(np.sum((logits.argmax(-1) == labels) & kept) / kept.sum())
    scored = float(np.sum((logits.argmax(-1) == labels) & kept) / labels.size)  # 255 a miss
    assert float(ft.train.accuracy.of(logits, labels)) == pytest.approx(scored, abs=1e-7)
    assert float(ft.train.accuracy.of(logits, labels, ignore_index=255)) == pytest.approx(want, abs=1e-7)
    signed = np.where(kept, labels.astype(np.int32), -1)
    assert float(ft.train.accuracy.of(logits, signed, ignore_index=-1)) == pytest.approx(want, abs=1e-7)
    assert float(ft.train.accuracy.of(logits, np.where(kept, labels.astype(np.int32), -100), ignore_index=None)) == pytest.approx(scored)
    t = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), _token_loss(logits, np.ones(7, np.float32)),
                         metrics={"acc": lambda o: ft.train.accuracy.of(o.aux, o.batch[-1], ignore_index=255)})
    idx = np.arange(7, dtype=np.int32)
    data = [(idx[a:b], labels[a:b]) for a, b in ((0, 3), (3, 6), (6, 7))]  # 3, 3, 1 examples
    t.fit(data, epochs=1, progress=False)
    atol = 2e-7  # float32 hit fractions times float32 sizes (test_accuracy_over_minibatches_...)
    np.testing.assert_allclose(t.history.epochs["acc"][0], want, rtol=0, atol=atol)
    np.testing.assert_allclose(t.evaluate(data)["acc"], want, rtol=0, atol=atol)
    for bad in ("255", 255.0, True):
        with pytest.raises(TypeError, match=r"(?s)ignore_index must be a Python int.*right:  ft\.train\.accuracy\.of"):
            ft.train.accuracy.of(logits, labels, ignore_index=bad)


def test_probabilities_are_scored_at_the_threshold_given_to_binary_accuracy_of():
    """A sigmoid-last model's probabilities (torch's BCELoss, Keras's BinaryAccuracy at 0.5) read
    as logits count every output above 0 as a 1; threshold=0.5 scores them, in a Trainer too."""
    rng = np.random.default_rng(5)
    probs = rng.uniform(size=(6, 1)).astype(np.float32)
    labels = (rng.uniform(size=(6, 1)) < 0.5).astype(np.int32)
    want = float(np.mean((probs > 0.5) == (labels > 0.5)))
    assert want != float(np.mean(labels == 1))  # the data tell the two readings apart
    assert float(ft.train.binary_accuracy.of(probs, labels)) == pytest.approx(float(np.mean(labels == 1)))
    assert float(ft.train.binary_accuracy.of(probs, labels, threshold=0.5)) == pytest.approx(want)
    t = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), _token_loss(probs, np.ones(6, np.float32)),
                         metrics={"acc": lambda o: ft.train.binary_accuracy.of(o.aux, o.batch[-1], threshold=0.5)})
    idx = np.arange(6, dtype=np.int32)
    t.fit([(idx[:4], labels[:4]), (idx[4:], labels[4:])], epochs=1, progress=False)
    np.testing.assert_allclose(t.history.epochs["acc"][0], want, rtol=0, atol=2e-7)
    for bad in ("0.5", None, True):
        with pytest.raises(TypeError, match=r"(?s)threshold must be a Python number.*right:  ft\.train\.binary_accuracy\.of"):
            ft.train.binary_accuracy.of(probs, labels, threshold=bad)


def test_binary_labels_of_minus_100_are_left_out():
    """HF pads per-token binary tags with -100, which precision leaves out: binary_accuracy
    (and accuracy of one logit per label) read -100 as a negative (0.6 for 2/3 here: the
    padded token of logit -2 a hit, of logit 3 a miss), in a Trainer's jitted step too."""
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    labels = np.array([1, 0, 0, -100, -100], np.int32)
    want = float(np.mean((logits[:3] > 0) == (labels[:3] == 1)))
    assert want == pytest.approx(2 / 3)
    assert float(ft.train.binary_accuracy.of(logits, labels)) == pytest.approx(want)
    assert float(ft.train.binary_accuracy(out(logits, (None, labels)))) == pytest.approx(want)
    assert float(ft.train.accuracy.of(logits[:, None], labels)) == pytest.approx(want)
    assert float(jax.jit(lambda z, y: ft.train.binary_accuracy.of(z, y))(logits, labels)) == pytest.approx(want)
    marked = np.where(labels == -100, 255, labels).astype(np.uint8)  # another ignore label, named
    assert float(ft.train.binary_accuracy.of(logits, marked, ignore_index=255)) == pytest.approx(want)
    assert float(ft.train.accuracy.of(logits[:, None], marked, ignore_index=255)) == pytest.approx(want)
    assert float(ft.train.binary_accuracy.of(logits, jnp.full(5, -100))) == 0.0  # nothing counted
    t = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), _token_loss(logits, np.ones(5, np.float32)),
                         metrics=[ft.train.binary_accuracy])
    idx = np.arange(5, dtype=np.int32)
    data = [(idx[:2], labels[:2]), (idx[2:], labels[2:])]
    t.fit(data, epochs=1, progress=False)
    np.testing.assert_allclose(t.history.epochs["binary_accuracy"][0], want, rtol=0, atol=2e-7)
    for bad in ("255", 255.0, True):
        with pytest.raises(TypeError, match=r"(?s)ignore_index must be a Python int.*right:  ft\.train\.binary_accuracy\.of"):
            ft.train.binary_accuracy.of(logits, labels, ignore_index=bad)


def test_binary_accuracy_refuses_labels_that_are_no_binary_labels_and_is_nan_under_jit():
    """binary_accuracy (and accuracy of one logit per label) read labels as ``label > 0.5``:
    3-class labels [2, 0, 1, 2, 0] and soft labels [0.7, 0.2, 0.6, 0.9, 0.4] both scored 1.0,
    a 0/255 mask 0.8. 0/1 (int, bool, float) and -1/1 labels are binary; another raises naming
    the first and the fix, and a Trainer's jitted step shows NaN (not a plausible number)."""
    from functree.train._metrics import BINARY_LABEL_SIGNS, BINARY_LABEL_VALUE
    from tests._errors import raises_named

    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    binary = np.array([1, 0, 0, 1, 0], np.int32)
    want = float(np.mean((logits > 0) == (binary == 1)))
    traced = jax.jit(lambda z, y: ft.train.binary_accuracy.of(z, y))
    for labels in (binary, binary.astype(bool), binary.astype(np.float32), binary.astype(np.uint8), 2 * binary - 1):
        assert float(ft.train.binary_accuracy.of(logits, labels)) == pytest.approx(want)
        assert float(ft.train.accuracy.of(logits[:, None], labels)) == pytest.approx(want)
        assert float(traced(logits, labels)) == pytest.approx(want)
    three = np.array([2, 0, 1, 2, 0], np.int32)
    soft = np.array([0.7, 0.2, 0.6, 0.9, 0.4], np.float32)
    mask = np.array([255, 0, 0, 255, 0], np.uint8)
    signs = np.array([1, 0, -1, 1, 0], np.int32)
    raises_named(lambda: ft.train.binary_accuracy.of(logits, three), ValueError, BINARY_LABEL_VALUE,
                 "ft.train.binary_accuracy.of(logits, labels == 2)")
    raises_named(lambda: ft.train.binary_accuracy.of(logits, soft), ValueError, BINARY_LABEL_VALUE,
                 "ft.train.binary_accuracy.of(logits, labels > 0.5)")
    raises_named(lambda: ft.train.binary_accuracy.of(logits, mask), ValueError, BINARY_LABEL_VALUE,
                 "label 255 at labels[0]")
    raises_named(lambda: ft.train.binary_accuracy.of(logits, signs), ValueError, BINARY_LABEL_SIGNS,
                 "ft.train.binary_accuracy.of(logits, labels, ignore_index=0)")
    raises_named(lambda: ft.train.accuracy.of(logits[:, None], three), ValueError, BINARY_LABEL_VALUE,
                 "ft.train.accuracy.of(logits, labels == 2)")
    raises_named(lambda: ft.train.binary_accuracy(out(logits, (None, soft))), ValueError, BINARY_LABEL_VALUE,
                 'metrics={"binary_accuracy": lambda out: ft.train.binary_accuracy.of(out.aux, out.batch[1] > 0.5)}')
    raises_named(lambda: ft.train.accuracy(out(logits, (None, three))), ValueError, BINARY_LABEL_VALUE,
                 'metrics={"accuracy": lambda out: ft.train.accuracy.of(out.aux, out.batch[1] == 2)}')
    for labels in (three, soft, mask, signs):
        assert np.isnan(float(traced(logits, labels)))
        assert np.isnan(float(jax.jit(lambda z, y: ft.train.accuracy.of(z[:, None], y))(logits, labels)))
    assert float(ft.train.binary_accuracy.of(logits, signs, ignore_index=0)) == pytest.approx(2 / 3)  # the fix
    assert float(ft.train.binary_accuracy.of(logits, soft > 0.5)) == 1.0
    # a Trainer: the labels inside the jitted step are traced
    metrics = [ft.train.binary_accuracy, ft.train.accuracy]
    idx = np.arange(5, dtype=np.int32)
    for labels, expected in ((2 * binary - 1, want), (three, None), (soft, None)):
        t = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), _token_loss(logits, np.ones(5, np.float32)),
                             metrics=metrics)
        data = [(idx[:3], labels[:3]), (idx[3:], labels[3:])]
        t.fit(data, epochs=1, progress=False)
        for name in ("binary_accuracy", "accuracy"):
            got = t.history.epochs[name][0]
            assert (np.isnan(got) if expected is None else got == pytest.approx(expected, abs=2e-7)), (name, labels)


def test_accuracy_refuses_one_hot_rows_that_hold_no_class():
    """accuracy read labels of the logits' shape by argmax alone: jax.nn.one_hot of a -100 (a
    row of 0s) was class 0 (0.75 for 1.0), int class ids broadcast to the logits' shape [0, 0,
    0] and [2, 2, 2] class 0 (0.5 for 0.75). Such a row raises naming it and the fix where
    concrete, and is NaN under jit (a Trainer); so does a negative entry (log-probabilities,
    which softmax_cross_entropy refuses as labels too: jax.nn.softmax of them is the fix)."""
    from functree.train._metrics import ONE_HOT_ROW
    from tests._errors import raises_named

    logits = jnp.array([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [2.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    padded = jax.nn.one_hot(jnp.array([0, 1, -100, -100]), 3)
    broadcast = np.broadcast_to(np.array([0, 1, 2, 2])[:, None], (4, 3)).astype(np.int32)
    log_probs = np.log(np.asarray(jax.nn.one_hot(jnp.array([0, 1, 0, 2]), 3)) * 0.9 + 0.05)
    raises_named(lambda: ft.train.accuracy.of(logits, padded), ValueError, ONE_HOT_ROW,
                 "right:  ft.train.accuracy.of(logits, jnp.where(labels.max(-1) > 0, labels.argmax(-1), -100))")
    raises_named(lambda: ft.train.accuracy.of(logits, broadcast + 1), ValueError, ONE_HOT_ROW,
                 "ft.train.accuracy.of(logits, labels[..., 0])")
    raises_named(lambda: ft.train.accuracy(out(logits, (None, log_probs))), ValueError, ONE_HOT_ROW,
                 'metrics={"accuracy": lambda out: ft.train.accuracy.of(out.aux, jax.nn.softmax(out.batch[1]))}')
    assert float(ft.train.accuracy.of(logits, jnp.where(padded.max(-1) > 0, padded.argmax(-1), -100))) == 1.0
    assert float(ft.train.accuracy.of(logits, broadcast[..., 0])) == 0.75
    assert float(ft.train.accuracy.of(logits, jax.nn.softmax(jnp.asarray(log_probs)))) == 1.0
    traced = jax.jit(lambda z, y: ft.train.accuracy.of(z, y))
    for labels in (padded, broadcast, log_probs, np.where(np.arange(3) == 1, np.nan, padded)):
        assert np.isnan(float(traced(logits, labels)))
    for labels in (np.asarray(padded)[:2], np.eye(3, dtype=np.int32)[:2], np.eye(3, dtype=bool)[:2],
                   np.array([[0.2, 0.7, 0.1], [0.0, 1.0, 1.0]], np.float32)):  # one-hot, probabilities, multi-label
        assert float(traced(logits[:2], labels)) == float(ft.train.accuracy.of(logits[:2], labels))
    t = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), _token_loss(np.asarray(logits), np.ones(4, np.float32)),
                         metrics=[ft.train.accuracy])
    idx = np.arange(4, dtype=np.int32)
    t.fit([(idx[:2], np.asarray(padded)[:2]), (idx[2:], np.asarray(padded)[2:])], epochs=1, progress=False)
    assert t.history.steps["accuracy"][0] == 1.0 and np.isnan(t.history.steps["accuracy"][1])
    assert np.isnan(t.history.epochs["accuracy"][0])


def test_labels_that_are_not_an_array_and_duplicate_metric_names():
    with pytest.raises(ValueError, match=r'could not find the labels.*\["target"\]'):
        ft.train.accuracy(out(LOGITS, {"target": {"class": jnp.zeros(4, jnp.int32)}}))
    with pytest.raises(ValueError, match=r"Two metrics are named '<lambda>'"):
        resolve_metrics([lambda o: o.loss, lambda o: 2 * o.loss])
    with pytest.raises(ValueError, match=r"Two metrics are named 'loss'"):
        resolve_metrics({"loss": ft.train.accuracy})


def _float64_regression():
    """A float64 least-squares problem whose loss float32 would round (x64 only)."""
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(64, 2))
    y = x @ jnp.array([[1.0], [2.0]]) + 1e-9
    model = {"w": jnp.zeros((2, 1)), "b": jnp.full((1,), 0.1)}

    def loss(m, batch):
        x, y = batch
        return jnp.mean((x @ m["w"] + m["b"][None, :] - y) ** 2)

    return model, loss, (x, y)


def test_metrics_keep_a_float64_loss_under_x64():
    """Under x64 the step's metrics, the Trainer's history and evaluate were float32: a
    float64 model's loss 0.5648236194... was logged as 0.5648236274719238."""
    with jax.enable_x64(True):
        model, loss, batch = _float64_regression()
        # the reference: the loss before and after one SGD step, in one compiled program
        # (eagerly, ~40 programs of one operation each; the same float64 sums to ~1e-16)
        reference = jax.jit(lambda m: (loss(m, batch), loss(jax.tree.map(lambda w, g: w - 0.1 * g, m,
                                                                         jax.grad(loss)(m, batch)), batch)))
        exact, after = (float(v) for v in reference(model))
        step = ft.train.train_step(loss, ft.optim.sgd(0.1), donate=False)
        _, _, out = step(model, step.optimizer.init(model), batch)
        close = functools.partial(np.testing.assert_allclose, rtol=0, atol=1e-14)  # float32 was ~1e-8 off
        assert out["loss"].dtype == jnp.float64
        close(float(out["loss"]), exact)
        close(float(ft.train.eval_step(loss)(model, batch)["loss"]), exact)
        trainer = ft.train.Trainer(model, ft.optim.sgd(0.1), loss)
        close(trainer.evaluate([batch])["loss"], exact)
        history = trainer.fit([batch], epochs=2, progress=False)
        close(history.steps["loss"], [exact, after])
        assert history.steps["learning_rate"] == [0.1, 0.1]  # was 0.10000000149011612
    _, loss32, _ = _float64_regression()  # without x64: float32 columns, as before
    step = ft.train.train_step(loss32, ft.optim.sgd(0.1), donate=False)
    model32 = {"w": jnp.zeros((2, 1)), "b": jnp.full((1,), 0.1)}
    batch32 = (jnp.ones((4, 2)), jnp.ones((4, 1)))
    assert step(model32, step.optimizer.init(model32), batch32)[2]["loss"].dtype == jnp.float32


def test_a_floating_last_item_of_a_three_item_batch_is_not_read_as_labels():
    # Keras-style (x, y, sample_weight) batches: accuracy read the weights as labels (cast
    # to int32) and gave 0.4318 for a true 0.6705, with no error.
    logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [0.0, 2.0]])
    labels = jnp.array([0, 1, 1, 1])
    weights = jnp.array([0.5, 1.0, 0.25, 1.0])
    batch = (jnp.zeros((4, 3)), labels, weights)
    out = ft.train.StepOutput(jnp.zeros(()), logits, batch, None)
    with pytest.raises(ValueError, match=r"(?s)cannot tell which item of this batch of 3 items.*\(x, y, sample_weight\)"):
        ft.train.accuracy(out)
    with pytest.raises(ValueError, match=r"ft.train.binary_accuracy.of\(out.aux, out.batch\[1\]\)"):
        ft.train.binary_accuracy(out._replace(aux=logits[:, 0]))
    named = {"accuracy": lambda out: ft.train.accuracy.of(out.aux, out.batch[1])}  # the fix it names
    np.testing.assert_allclose(named["accuracy"](out), 0.75, rtol=0, atol=1e-7)
    assert float(ft.train.accuracy(out._replace(batch=(batch[0], weights, labels)))) == 0.75  # labels last
    # (x, y) with float class ids: refused (float labels are never class indices), naming the cast
    with pytest.raises(ValueError, match=r"out.batch\[1\].astype\(jnp.int32\)"):
        ft.train.accuracy(out._replace(batch=(batch[0], labels.astype(jnp.float32))))
    # Float labels of two axes (one-hot rows; multi-label targets) cannot be per-example
    # weights: read, as before the refusal (which once refused them too).
    one_hot = jax.nn.one_hot(labels, 2)
    assert float(ft.train.accuracy(out._replace(batch=(batch[0], weights, one_hot)))) == 0.75
    multi = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]])
    expected = float(np.mean((np.asarray(logits) > 0) == (np.asarray(multi) > 0.5)))  # numpy's
    assert float(ft.train.binary_accuracy(out._replace(batch=(batch[0], weights, multi)))) == expected


def _bce_and_keras_batches():
    """A (x, mask, y) BCE batch (float 0/1 targets last, torch's BCEWithLogitsLoss layout)
    and a Keras (x, y, sample_weight) batch, with one-logit models' outputs on each."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    mask = (rng.random((64, 3)) > 0.2).astype(np.float32)
    y = (rng.random(64) > 0.5).astype(np.float32)
    weights = rng.uniform(0.1, 2.0, size=64).astype(np.float32)
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    return model, x, mask, y, weights


def test_float_targets_after_a_float_mask_are_the_labels():
    """The (x, mask, y) batch of BCEWithLogitsLoss was refused as Keras's (x, y, sample_weight)
    (0.3333 before that refusal, numpy's value): a [N, D] mask has no labels' shape, so the
    float targets last are read."""
    model, x, mask, y, _ = _bce_and_keras_batches()
    expected = np.mean((np.asarray(model(jnp.asarray(x * mask)))[:, 0] > 0) == (y > 0.5))

    def loss_fn(m, batch):
        logits = m(batch[0] * batch[1])[:, 0]
        return jnp.mean(jnp.logaddexp(0.0, logits) - batch[2] * logits), logits

    for metric in (ft.train.binary_accuracy, ft.train.accuracy):
        trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics=[metric])
        got = trainer.evaluate([(x, mask, y)])[metric.__name__]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)  # 64 examples: a hit is 1/64


def test_keras_weights_after_labels_are_refused_naming_both_readings():
    """Keras's (x, y, sample_weight) stays refused (the weights scored as labels gave 0.4318
    for 0.6705); the fix the error names scores it as numpy does."""
    model, x, _, y, weights = _bce_and_keras_batches()
    logits = np.asarray(model(jnp.asarray(x)))[:, 0]
    expected = np.mean((logits > 0) == (y > 0.5))

    def loss_fn(m, batch):
        logits = m(batch[0])[:, 0]
        labels = batch[1].astype(jnp.float32)
        return jnp.mean(batch[2] * (jnp.logaddexp(0.0, logits) - labels * logits)), logits

    for labels in (y, y.astype(np.int32), y.astype(bool)):
        trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics=[ft.train.binary_accuracy])
        with pytest.raises(ValueError, match=r"(?s)batch\[-2\] \((float32|int32|bool)\[64\]\) has the shape.*"
                           r"\(x, y, sample_weight\).*\(x, mask, y\).*out.batch\[1\]\)\}.*out.batch\[2\]\)\}"):
            trainer.evaluate([(x, labels, weights)])
        named = {"binary_accuracy": lambda out: ft.train.binary_accuracy.of(out.aux, out.batch[1])}
        trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics=named)
        np.testing.assert_allclose(trainer.evaluate([(x, labels, weights)])["binary_accuracy"], expected,
                                   rtol=0, atol=1e-6)
    # A (x, y) batch, or a [N, 1] logit against [N] labels: no second reading, no error.
    out2 = ft.train.StepOutput(jnp.zeros(()), logits[:, None], (x, y), None)
    np.testing.assert_allclose(ft.train.binary_accuracy(out2), expected, rtol=0, atol=1e-6)


# --- float items of the class-index shape: weights or a mask, never class ids ---------------------

_B, _TT, _V = 4, 5, 7


def _tokens():
    """Token logits [B, T, V], int class ids [B, T], float 0/1 per-token weights [B, T]."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(_B, _TT, _V)).astype(np.float32)
    labels = rng.integers(0, _V, size=(_B, _TT)).astype(np.int32)
    weights = (rng.random((_B, _TT)) > 0.5).astype(np.float32)
    return logits, labels, weights


def _run(metric, logits, batch):
    return float(metric(out(jnp.asarray(logits), tuple(jnp.asarray(b) for b in batch))))


def _right_line(message, i):
    """The metric the error's ``right:`` (i=0) or ``or:`` (i=1) line names, evaluated."""
    lines = [ln for ln in message.splitlines() if ln.strip().startswith(("right:", "or:"))]
    code = lines[i].split(":", 1)[1].split("#")[0].strip()
    scope: dict[str, Any] = {"ft": ft, "jnp": jnp}
    exec(code, scope)  # metrics={"accuracy": lambda out: ...}
    return scope["metrics"]["accuracy"]


@pytest.mark.parametrize("layout", ["keras-temporal", "loss-mask", "float-labels"])
def test_per_token_float_weights_are_not_scored_as_class_ids(layout):
    """(x, y int[B, T], w float[B, T]): the 0/1 weights were cast and compared with the argmax
    as class ids (0.2 for numpy's 0.25, weighted 0.40), with no error. Now an error names
    both readings; each right line scores as numpy does."""
    logits, labels, weights = _tokens()
    first = {"keras-temporal": np.zeros((_B, _TT, 3), np.float32), "loss-mask": labels,
             "float-labels": labels}[layout]
    y = labels.astype(np.float32) if layout == "float-labels" else labels
    batch = (first, y, weights)
    want = np.mean(np.argmax(logits, -1) == labels)
    assert want == 0.25  # and the scored weights: np.mean(argmax == weights) == 0.2
    with pytest.raises(ValueError, match=r"(?s)cannot tell which item of this batch of 3 items.*"
                       r"class-index shape.*\(x, y, sample_weight\).*\(input_ids, labels, loss_mask\).*"
                       r"out.batch\[2\].astype\(jnp.int32\)\)\}") as e:
        _run(ft.train.accuracy, logits, batch)
    o = out(jnp.asarray(logits), tuple(jnp.asarray(b) for b in batch))
    np.testing.assert_allclose(float(_right_line(str(e.value), 0)(o)), want, rtol=0, atol=1e-7)  # 20 tokens
    np.testing.assert_allclose(float(_right_line(str(e.value), 1)(o)),
                               np.mean(np.argmax(logits, -1) == weights.astype(np.int32)), rtol=0, atol=1e-7)
    trainer = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), lambda m, b: (m["w"], jnp.asarray(logits)),
                               metrics=[ft.train.accuracy])
    with pytest.raises(ValueError, match=r"cannot tell which item"):
        trainer.evaluate([batch])


def test_float_class_ids_are_refused_naming_the_cast():
    """Float labels of logits.shape[:-1] and no second reading: (x, y), a dict, accuracy.of.
    They were cast and scored; the -100 of float token labels counted as misses."""
    logits, labels, _ = _tokens()
    labels[0, :2] = -100
    counted = labels != -100
    want = np.sum((np.argmax(logits, -1) == labels) & counted) / np.sum(counted)
    y = labels.astype(np.float32)
    for batch in ((np.zeros((_B, 3)), y), (np.zeros((_B, _TT, 2)), np.zeros((_B, 3)), y)):
        with pytest.raises(ValueError, match=r"(?s)the labels out.batch\[\d\] \(float32\[4, 5\]\) are floating-point"
                                             r".*wrong:  metrics=\[ft.train.accuracy\]") as e:
            _run(ft.train.accuracy, logits, batch)
        o = out(jnp.asarray(logits), tuple(jnp.asarray(b) for b in batch))
        np.testing.assert_allclose(float(_right_line(str(e.value), 0)(o)), want, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r'out.batch\["labels"\].astype\(jnp.int32\)'):
        ft.train.accuracy(out(jnp.asarray(logits), {"labels": jnp.asarray(y)}))
    with pytest.raises(ValueError, match=r"right:  ft.train.accuracy.of\(logits, labels.astype\(jnp.int32\)\)"):
        ft.train.accuracy.of(logits, y)
    np.testing.assert_allclose(float(ft.train.accuracy.of(logits, y.astype(np.int32))), want, rtol=0, atol=1e-7)


def test_float_labels_of_the_logits_shape_are_still_read():
    """Soft labels (probabilities [B, T, V]) after int token labels, and binary_accuracy's
    float 0/1 targets of its logits' shape after an int attention mask: read, as numpy."""
    logits, labels, weights = _tokens()
    z = np.random.default_rng(1).normal(size=logits.shape).astype(np.float32)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)  # numpy's softmax: rows of probabilities, no program
    want = np.mean(np.argmax(logits, -1) == np.argmax(probs, -1))
    np.testing.assert_allclose(_run(ft.train.accuracy, logits, (labels, labels, probs)), want, rtol=0, atol=1e-7)
    tag_logits = logits[..., 0]  # one binary logit per token: (input_ids, attention_mask, float targets)
    want = np.mean((tag_logits > 0) == (weights > 0.5))
    got = _run(ft.train.binary_accuracy, tag_logits, (labels, np.ones_like(labels), weights))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


# --- accuracy over minibatches: Σ hits / Σ counted, not a mean weighted by minibatch size ------

_N, _T, _C = 11, 4, 5
_SIZES = (4, 1, 6)  # uneven minibatches


def _token_data(ignore: bool):
    """Per-example token logits (a fixed table read by example index: the accuracy does not
    depend on training), token labels with -100 (``ignore``: more in the small minibatch),
    and per-example loss values."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(_N, _T, _C)).astype(np.float32)
    labels = rng.integers(0, _C, size=(_N, _T)).astype(np.int32)
    if ignore:
        labels[rng.random((_N, _T)) < 0.4] = -100
        labels[4] = [np.argmax(logits[4, 0]), -100, -100, -100]  # the 1-example minibatch: 1 hit of 1
    values = rng.normal(size=(_N,)).astype(np.float32)
    cuts = np.cumsum((0, *_SIZES))
    idx = np.arange(_N, dtype=np.int32)
    data = [(idx[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]
    return logits, labels, values, data


def _per_token(logits, labels):
    """numpy: torch's / HF compute_metrics' token accuracy, labels of -100 left out."""
    counted = labels != -100
    return float(np.sum((np.argmax(logits, -1) == labels) & counted) / np.sum(counted))


def _trainer(logits, values):
    # (a learning rate of 0: the loss stays each minibatch's mean of the values)
    return ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), _token_loss(logits, values),
                            metrics=[ft.train.accuracy])


@pytest.mark.parametrize("ignore", [True, False], ids=["ignored-labels", "every-label"])
def test_accuracy_over_minibatches_is_the_per_token_accuracy(ignore):
    # Before: Σ n_b · acc_b / Σ n_b; the reproducer's 3 of 6 and 1 of 1 gave 0.75 for 4/7.
    logits, labels, values, data = _token_data(ignore)
    want = _per_token(logits, labels)
    t = _trainer(logits, values)
    logged = []
    t.fit(data, epochs=1, progress=False, log_every=2, callbacks=[lambda c: logged.append(c)])
    cuts = np.cumsum((0, *_SIZES))
    atol = 2e-7  # measured: at most 1.3e-8 (float32 hit fractions times float32 sizes), x10 and up
    np.testing.assert_allclose(t.history.epochs["accuracy"][0], want, rtol=0, atol=atol)
    np.testing.assert_allclose(t.evaluate(data)["accuracy"], want, rtol=0, atol=atol)
    window = [c.metrics["accuracy"] for c in logged if c.event == "log"]
    np.testing.assert_allclose(window, [_per_token(logits[: cuts[2]], labels[: cuts[2]])], rtol=0, atol=atol)
    steps = [_per_token(logits[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]
    np.testing.assert_allclose(t.history.steps["accuracy"], steps, rtol=0, atol=atol)  # each minibatch's own
    assert set(t.history.steps) == {"step", "loss", "accuracy", "learning_rate"}  # the parts stay inside
    assert set(t.evaluate(data)) == {"loss", "accuracy"}
    # The loss stays the minibatch-size-weighted mean (per example here), as Keras's.
    np.testing.assert_allclose(t.history.epochs["loss"][0], np.mean(values, dtype=np.float64), rtol=0, atol=atol)
    np.testing.assert_allclose(t.evaluate(data)["loss"], np.mean(values, dtype=np.float64), rtol=0, atol=atol)


def test_accuracy_means_resume_mid_epoch_exactly(tmp_path):
    logits, labels, values, data = _token_data(True)
    whole = _trainer(logits, values)
    whole.fit(data, epochs=1, progress=False)
    first = _trainer(logits, values)
    first.fit(data, steps=2, progress=False)
    first.save(tmp_path / "ck")
    resumed = _trainer(logits, values).restore(tmp_path / "ck")
    resumed.fit(data, epochs=1, progress=False)
    np.testing.assert_allclose(resumed.history.epochs["accuracy"], whole.history.epochs["accuracy"], rtol=0, atol=0)
    np.testing.assert_allclose(resumed.history.epochs["accuracy"][0], _per_token(logits, labels), rtol=0, atol=2e-7)


def test_a_mid_epoch_checkpoint_with_accuracy_means_of_an_older_functree_is_refused(tmp_path):
    """Its sums hold accuracy weighted by minibatch size and no parts: no sum makes that
    exact, so the restore refuses it (naming it) rather than mixing the two means."""
    import json

    from functree.train.checkpoint._checkpoint import metadata_digest

    logits, _labels, values, data = _token_data(True)
    t = _trainer(logits, values)
    t.fit(data, steps=2, progress=False)
    t.save(tmp_path / "ck")
    path = tmp_path / "ck" / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    for means in meta["config"]["trainer"]["means"].values():  # as the older functree wrote them
        means["sums"] = {k: v for k, v in means["sums"].items() if "#" not in k}
    meta["digest"] = metadata_digest(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(ft.train.CheckpointError,
                       match=r"(?s)at step 2 \(.*ck/2\) holds the epoch's running mean of 'accuracy' without the "
                             r"counted labels.*override that does not call super\(\).*right:  trainer\.restore\(path, step="):
        _trainer(logits, values).restore(tmp_path / "ck")


def test_with_parts_and_combine_parts():
    from functree.train._metrics import combine_parts, with_parts

    parts = with_parts(resolve_metrics([ft.train.accuracy, ft.train.binary_accuracy, ft.train.mean("mse")]))
    assert sorted(parts) == ["accuracy", "accuracy#count", "accuracy#sum", "binary_accuracy",
                             "binary_accuracy#count", "binary_accuracy#sum", "mse"]
    # every label -100: 0, as the minibatch's own accuracy; a NaN part: NaN
    assert combine_parts({"accuracy": 0.0, "accuracy#sum": 0.0, "accuracy#count": 0.0}) == {"accuracy": 0.0}
    assert np.isnan(combine_parts({"accuracy#sum": np.nan, "accuracy#count": 2.0})["accuracy"])


def test_the_label_errors_fix_lines_read_the_logits_where_the_metric_found_them():
    """With aux a dict ({"logits": ...}), the fix lines said accuracy.of(out.aux, ...), which
    fails ("entry not a 2- or 3- tuple"); they name out.aux["logits"], and run."""
    logits = jnp.asarray(np.random.RandomState(0).randn(8, 3), jnp.float32)
    y = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    expected = np.mean(np.argmax(np.asarray(logits), -1) == y)
    cases = [(None, jnp.asarray(y, jnp.float32)),  # float class ids: the cast
             (None, jnp.asarray(y, jnp.int32), jnp.ones(8))]  # Keras (x, y, w): both readings
    for batch in cases:
        out = StepOutput(jnp.zeros(()), {"logits": logits, "hidden": jnp.zeros((8, 4))}, batch, None)
        with pytest.raises(ValueError) as info:
            ft.train.accuracy(out)
        line = next(x for x in str(info.value).splitlines() if "right:" in x)
        assert 'out.aux["logits"]' in line, line
        body = line.split("right:", 1)[1].split("   #")[0].strip().split("lambda out: ", 1)[1].rsplit("}", 1)[0]
        metric = eval("lambda out: " + body)  # the fix line's metric, as a user pastes it
        np.testing.assert_allclose(float(metric(out)), expected, rtol=0, atol=1e-7)


# --- the counting metrics' parts are the steps' own: a Trainer given a ready-made step ----------
# Before, only the Trainer's own step (built from metrics=) recorded the parts; a step given
# ready-made (train_step=ft.train.train_step(..., metrics=...)) had none, and its epoch means,
# validation and evaluate fell back to the minibatch-size-weighted mean of the accuracies.

_EVEN = (3, 3, 3, 3, 2)  # steps_per_call=2: two stacked calls, then a single step of 2 examples
_ATOL = 2e-7  # measured: at most 2.0e-8 under SSE4_2, AVX and the default ISA (float32 hit fractions), x10


def _even_data(nan_at: int | None = None):
    """As :func:`_token_data`, in minibatches of :data:`_EVEN` with -100 densities that differ
    between minibatches (their size-weighted mean is not the per-token accuracy); a NaN
    per-example loss value at ``nan_at``."""
    rng = np.random.default_rng(11)
    n = sum(_EVEN)
    logits = rng.normal(size=(n, _T, _C)).astype(np.float32)
    labels = rng.integers(0, _C, size=(n, _T)).astype(np.int32)
    labels[:6] = np.where(rng.random((6, _T)) < 0.7, -100, labels[:6])  # the first two minibatches: sparse
    for i, j in ((0, 0), (3, 1), (4, 2)):  # hits among the few counted labels there
        labels[i, j] = np.argmax(logits[i, j])
    values = rng.normal(size=(n,)).astype(np.float32)
    if nan_at is not None:
        values[nan_at] = np.nan
    cuts = np.cumsum((0, *_EVEN))
    idx = np.arange(n, dtype=np.int32)
    return logits, labels, values, [(idx[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]


_LOSSES: dict[bytes, Any] = {}


def _token_loss(logits, values):
    """The loss of per-example ``values`` (times 1 + w) with the ``logits`` table as aux, read
    by example index; one function per data (the program table compares a test's function
    by identity, so the Trainers of several tests on the same data share their programs)."""
    key = repr((logits.shape, values.shape)).encode() + logits.tobytes() + values.tobytes()
    if key not in _LOSSES:
        table, per_example = jnp.asarray(logits), jnp.asarray(values)

        def loss_fn(model, batch):
            return jnp.mean(per_example[batch[0]] * (1.0 + model["w"])), table[batch[0]]

        _LOSSES[key] = loss_fn
    return _LOSSES[key]


class _Step(ft.train.TrainStep):
    """A subclass whose compute_metrics adds one (its super's parts come along)."""

    def compute_metrics(self, out):
        return {**super().compute_metrics(out), "zero": jnp.zeros((), jnp.float32)}


def _given(logits, values, how: str, **options):
    """A Trainer of the step ``how`` names: built from ``metrics=``, or given ready-made."""
    loss_fn, opt, metrics = _token_loss(logits, values), ft.optim.sgd(0.0), {"acc": ft.train.accuracy}
    if how == "metrics":
        return ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, metrics=metrics, **options)
    make = {"factory": ft.train.train_step, "instance": ft.train.TrainStep, "subclass": _Step}[how]
    step = make(loss_fn, opt, metrics=metrics, **options)
    return ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, train_step=step)


def _weighted(logits, labels, sizes):
    """What the old fallback gave: Σ n_b · acc_b / Σ n_b."""
    cuts = np.cumsum((0, *sizes))
    accs = [_per_token(logits[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]
    return float(np.dot(sizes, accs) / np.sum(sizes))


@pytest.mark.parametrize("how", ["metrics", "factory", "instance", "subclass"])
@pytest.mark.parametrize("k", [1, 2], ids=["one-step-calls", "steps_per_call=2"])
def test_a_given_step_averages_accuracy_per_token(how, k, tmp_path):
    logits, labels, values, data = _even_data()
    want = _per_token(logits, labels)
    assert abs(_weighted(logits, labels, _EVEN) - want) > 0.05  # the data tells the two means apart
    t = _given(logits, values, how, steps_per_call=k)
    logged: list[Any] = []
    t.fit(data, epochs=1, progress=False, log_every=2, validation_data=data,
          callbacks=[logged.append, ft.train.CSVLogger(tmp_path / "log.csv", every="log")])
    np.testing.assert_allclose(t.history.epochs["acc"][0], want, rtol=0, atol=_ATOL)
    np.testing.assert_allclose(t.history.epochs["val_acc"][0], want, rtol=0, atol=_ATOL)
    np.testing.assert_allclose(t.evaluate(data)["acc"], want, rtol=0, atol=_ATOL)
    whole = (np.arange(sum(_EVEN), dtype=np.int32), labels)  # the same examples, cut into minibatches of 5
    np.testing.assert_allclose(t.evaluate(whole, batch_size=5)["acc"], want, rtol=0, atol=_ATOL)
    cuts = np.cumsum((0, *_EVEN))
    windows = [c.metrics["acc"] for c in logged if c.event == "log"]  # steps 1-2 and 3-4 (k=2: per call)
    np.testing.assert_allclose(windows[:2], [_per_token(logits[: cuts[2]], labels[: cuts[2]]),
                                             _per_token(logits[cuts[2]: cuts[4]], labels[cuts[2]: cuts[4]])],
                               rtol=0, atol=_ATOL)
    steps = [_per_token(logits[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]
    np.testing.assert_allclose(t.history.steps["acc"], steps, rtol=0, atol=_ATOL)  # each minibatch's own
    # The parts are the means' bookkeeping: no metric, column, logged value or returned entry.
    extra = {"zero"} if how == "subclass" else set()
    assert list(t.train_step.metrics) == list(t.eval_step.metrics) == ["acc"]
    assert set(t.history.steps) == {"step", "loss", "acc", "learning_rate"} | extra
    assert set(t.history.epochs) == {"epoch", "loss", "acc", "val_loss", "val_acc", "last_step"} | extra
    shown = {"loss", "acc"} | extra
    assert {frozenset(c.metrics) for c in logged} == {frozenset(shown), frozenset(shown | {"val_loss", "val_acc"})}
    assert set(t.evaluate(data)) == {"loss", "acc"}
    assert set(t.eval_step(t.inference_model, data[0])) == {"loss", "acc"}
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert header == ["epoch", "step", "learning_rate", "loss", "acc", *extra]
    np.testing.assert_allclose(t.history.epochs["loss"][0], np.mean(values, dtype=np.float64), rtol=0, atol=_ATOL)
    cut = [np.mean(values[a:b], dtype=np.float64) for a, b in itertools.pairwise(cuts)]
    np.testing.assert_allclose(t.history.steps["loss"], cut, rtol=0, atol=_ATOL)
    if how == "subclass":  # its columns in its dict's order (the row's), not sorted by name
        assert t.history.steps["zero"] == [0.0] * len(_EVEN)


@pytest.mark.parametrize("k", [1, 2], ids=["one-step-calls", "steps_per_call=2"])
def test_a_nan_step_under_on_nan_ignore_keeps_accuracy_per_token(k):
    """Under on_nan="ignore" the NaN step is applied and counted: the loss's mean is NaN, and
    accuracy (its logits finite) stays Σ hits / Σ counted over every step."""
    logits, labels, values, data = _even_data(nan_at=7)  # the third minibatch's loss is NaN
    want = _per_token(logits, labels)
    t = _given(logits, values, "factory", steps_per_call=k, on_nan="ignore")
    t.fit(data, epochs=1, progress=False, log_every=2)
    assert np.isnan(t.history.steps["loss"][2]) and np.isnan(t.history.epochs["loss"][0])
    np.testing.assert_allclose(t.history.epochs["acc"][0], want, rtol=0, atol=_ATOL)
    np.testing.assert_allclose(t.evaluate(data)["acc"], want, rtol=0, atol=_ATOL)


def test_a_step_called_by_hand_returns_no_parts():
    logits, _labels, values, data = _even_data()
    loss_fn, opt = _token_loss(logits, values), ft.optim.sgd(0.0)
    model = {"w": jnp.zeros(())}
    step = ft.train.train_step(loss_fn, opt, metrics={"acc": ft.train.accuracy}, donate=False)
    assert set(step(model, step.optimizer.init(model), data[0])[2]) == {"loss", "acc", "nonfinite"}
    step2 = ft.train.train_step(loss_fn, opt, metrics={"acc": ft.train.accuracy}, steps_per_call=2, donate=False)
    metrics = step2(model, step2.optimizer.init(model), ft.train.stack_batches(data[:2]))[2]
    assert set(metrics) == {"loss", "acc", "nonfinite"} and metrics["acc"].shape == (2,)
    evaluate = ft.train.eval_step(loss_fn, metrics={"acc": ft.train.accuracy})
    assert set(evaluate(model, data[0])) == {"loss", "acc"}


def test_a_metric_named_as_a_part_is_refused():
    from functree.train._metrics import PART_NAME

    with pytest.raises(ValueError) as info:
        ft.train.train_step(lambda m, b: 0.0, ft.optim.sgd(0.1), metrics={"tokens#count": ft.train.mean("n")})
    assert str(info.value) == PART_NAME.format(name="tokens#count", suffix="#count", right="tokens_count")
    assert "right:  metrics={'tokens_count': ...}" in str(info.value)


def test_a_user_metric_with_its_own_counts_method_is_averaged_as_a_mean():
    """Counting metrics were found by a ``counts`` attribute, so a user's precision object
    with a ``counts(out) -> (tp, fp)`` helper was averaged as Σ tp / Σ fp: 1.75 for numpy's
    0.636. Only functree's own counting metrics are marked (``__ft_counts__``)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype(np.float32)
    y = (rng.random(32) < 0.5).astype(np.float32)
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))

    def loss_fn(m, b):
        z = m(b[0])[:, 0]
        return jnp.mean(jax.nn.softplus(z) - b[1] * z), z

    class Precision:
        def counts(self, out):
            p, t = out.aux > 0, out.batch[1] > 0.5
            return jnp.sum(p & t, dtype=jnp.float32), jnp.sum(p & ~t, dtype=jnp.float32)

        def __call__(self, out):
            tp, fp = self.counts(out)
            return tp / jnp.maximum(tp + fp, 1.0)

    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics={"precision": Precision()})
    trainer.fit(ft.train.batches((x, y), 32, shuffle=False), epochs=1, progress=False)
    z = np.asarray(model(jnp.asarray(x)))[:, 0]
    expected = ((z > 0) & (y > 0.5)).sum() / (z > 0).sum()
    np.testing.assert_allclose(trainer.history.epochs["precision"], [expected], rtol=0, atol=1e-6)
    np.testing.assert_allclose(trainer.evaluate(ft.train.batches((x, y), 32, shuffle=False))["precision"],
                               expected, rtol=0, atol=1e-6)


class _Override(ft.train.TrainStep):
    """compute_metrics overridden without super(): the metric reported as is, or replaced."""

    scale = 1.0

    def compute_metrics(self, out):
        acc = ft.train.accuracy(out)  # reported as is: the very value accuracy returned
        return {"loss": out.loss, "acc": acc if self.scale == 1.0 else acc * self.scale, "ten": jnp.float32(10.0)}


class _Replaced(_Override):
    scale = 0.5  # the counting value rescaled: its parts rescaled


@pytest.mark.parametrize("k", [1, 2], ids=["one-step-calls", "steps_per_call=2"])
def test_an_override_without_super_keeps_accuracy_per_token(k):
    """Before: the parts came from TrainStep.compute_metrics only, so an override returning
    ``{"loss": ..., "acc": ft.train.accuracy(out)}`` got the size-weighted epoch accuracy
    (the audit's 0.428571 for numpy's 0.473684). The step adds them: Σ hits / Σ counted; a
    rescaled one (0.5 * acc) had its size-weighted mean (0.223214 for numpy's 0.5 · 0.378378
    = 0.189189): its parts are rescaled, 0.5 · Σ hits / Σ counted."""
    logits, labels, values, data = _even_data()
    want, weighted = _per_token(logits, labels), _weighted(logits, labels, _EVEN)
    assert abs(weighted - want) > 0.05  # the data tells the two means apart
    cuts = np.cumsum((0, *_EVEN))
    steps = [_per_token(logits[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]
    for cls, epoch, scale in ((_Override, want, 1.0), (_Replaced, 0.5 * want, 0.5)):
        opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
        step = cls(loss_fn, opt, metrics={"acc": ft.train.accuracy}, steps_per_call=k)
        t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, train_step=step)
        t.fit(data, epochs=1, progress=False, log_every=2, validation_data=data)
        np.testing.assert_allclose(t.history.epochs["acc"][0], epoch, rtol=0, atol=_ATOL)
        np.testing.assert_allclose(t.history.steps["acc"], np.multiply(steps, scale), rtol=0, atol=_ATOL)
        np.testing.assert_allclose(t.history.epochs["val_acc"][0], want, rtol=0, atol=_ATOL)
        np.testing.assert_allclose(t.evaluate(data)["acc"], want, rtol=0, atol=_ATOL)
        assert set(t.history.steps) == {"step", "loss", "acc", "ten", "learning_rate"}  # no part shown
        assert t.history.epochs["ten"] == [10.0]


class _PadsAsMisses(ft.train.TrainStep):
    """An own accuracy under the counting metric's name: pads (-100) counted as misses."""

    def compute_metrics(self, out):
        return {"loss": out.loss, "accuracy": jnp.mean(jnp.argmax(out.aux, -1) == out.batch[1])}


def test_an_own_value_under_a_counting_name_is_decided_once_not_per_minibatch():
    """Before: the step compared the reported number with accuracy's own, per minibatch
    (within 8 ulp): on a minibatch without pads the two coincide and it added hits /
    counted, on the other (v, 1); epoch accuracy 0.275 where the override's values
    [0.25, 0.375] weigh to 0.3125. Whether a value is the counting metric's own is now its
    identity at trace time: this one is the override's, size-weighted on every minibatch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 4, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=(4, 4)).astype(np.int32)
    y[2:, 2:] = -100  # the second minibatch has pads, the first none
    model = ft.nn.Dense(3, 3, key=jax.random.key(0))

    def loss_fn(m, batch):
        logits = m(batch[0])
        return jnp.mean(logits ** 2), logits

    opt = ft.optim.sgd(0.0)  # the model stays put: numpy scores the same logits
    step = _PadsAsMisses(loss_fn, opt, metrics=[ft.train.accuracy])
    t = ft.train.Trainer(model, opt, loss_fn, train_step=step)
    t.fit(ft.train.batches((x, y), 2, shuffle=False), epochs=1, progress=False)
    pred = np.asarray(model(jnp.asarray(x))).argmax(-1)
    per_batch = [np.mean(pred[i:i + 2] == y[i:i + 2]) for i in (0, 2)]
    own = [(pred[i:i + 2] == y[i:i + 2])[y[i:i + 2] != -100].mean() for i in (0, 2)]
    assert per_batch[0] == own[0] and per_batch[1] != own[1]  # the case that mixed the two
    np.testing.assert_allclose(t.history.steps["accuracy"], per_batch, rtol=0, atol=1e-6)
    np.testing.assert_allclose(t.history.epochs["accuracy"], [np.mean(per_batch)], rtol=0, atol=1e-6)


class _HandStep(ft.train.TrainStep):
    """step() overridden, its metrics built by hand: accuracy without its parts."""

    def step(self, model, opt_state, batch, key=None, enabled=None):
        new, state, loss, aux, nonfinite = self.apply(model, opt_state, batch, key, enabled)
        acc = ft.train.accuracy(StepOutput(loss, aux, batch, model))
        return new, state, {"loss": loss, "acc": acc, "nonfinite": nonfinite}


class _HandStepAndMetrics(_HandStep):
    """The same with compute_metrics overridden (the Trainer then reads the names step()
    returns): it trained, and its epoch accuracy was Σ n_b·acc_b / Σ n_b."""

    def compute_metrics(self, out):
        return {"loss": out.loss, "acc": ft.train.accuracy(out)}


class _SuperStep(ft.train.TrainStep):
    """step() overridden through super(): the parts come along."""

    def step(self, model, opt_state, batch, key=None, enabled=None):
        new, state, metrics = super().step(model, opt_state, batch, key, enabled)
        return new, state, {**metrics, "loss": 2.0 * metrics["loss"]}


@pytest.mark.parametrize("cls", [_HandStep, _HandStepAndMetrics])
@pytest.mark.parametrize("k", [1, 2], ids=["one-step-calls", "steps_per_call=2"])
def test_a_step_override_building_accuracy_itself_is_refused(cls, k):
    """Before: _HandStepAndMetrics's epoch accuracy was 0.446429 (size-weighted) for numpy's
    per-token 0.378378; _HandStep failed with a bare broadcasting error. Its parts cannot be
    recovered from what step() returns: the Trainer refuses it by name; a call by hand
    (which reports each minibatch's own accuracy, no mean) still runs."""
    from functree.train._step import STEP_WITHOUT_PARTS

    logits, labels, values, data = _even_data()
    assert abs(_weighted(logits, labels, _EVEN) - _per_token(logits, labels)) > 0.05
    opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
    step = cls(loss_fn, opt, metrics={"acc": ft.train.accuracy}, steps_per_call=k)
    t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, train_step=step)
    with pytest.raises(ValueError) as info:
        t.fit(data, epochs=1, progress=False, log_every=2)
    message = STEP_WITHOUT_PARTS.format(cls=cls.__name__, name="acc")
    assert message in str(info.value)
    assert "right:  def compute_metrics(self, out):" in message and "super().step(" in message
    by_hand = cls(loss_fn, opt, metrics={"acc": ft.train.accuracy}, donate=False)
    model = {"w": jnp.zeros(())}
    got = by_hand(model, by_hand.optimizer.init(model), data[0])[2]["acc"]
    np.testing.assert_allclose(got, _per_token(logits[:3], labels[:3]), rtol=0, atol=_ATOL)


@pytest.mark.parametrize("k", [1, 2], ids=["one-step-calls", "steps_per_call=2"])
def test_a_step_override_through_super_keeps_accuracy_per_token(k):
    logits, labels, values, data = _even_data()
    want = _per_token(logits, labels)
    opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
    step = _SuperStep(loss_fn, opt, metrics={"acc": ft.train.accuracy}, steps_per_call=k)
    t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, train_step=step)
    logged: list[Any] = []
    t.fit(data, epochs=1, progress=False, log_every=2, callbacks=[logged.append])
    cuts = np.cumsum((0, *_EVEN))
    np.testing.assert_allclose(t.history.epochs["acc"][0], want, rtol=0, atol=_ATOL)
    window = next(c.metrics["acc"] for c in logged if c.event == "log")
    np.testing.assert_allclose(window, _per_token(logits[: cuts[2]], labels[: cuts[2]]), rtol=0, atol=_ATOL)
    np.testing.assert_allclose(t.history.epochs["loss"][0], 2 * np.mean(values, dtype=np.float64), rtol=0, atol=_ATOL)
    np.testing.assert_allclose(t.evaluate(data)["acc"], want, rtol=0, atol=_ATOL)


# --- every counting value carries its parts: .of, lambdas, wrappers, rescaling (regress15 3-5) ---
# Before, a value was the counting metric's only if it was the very array accuracy(out)
# returned: .of, 1.0 * acc, stop_gradient(acc) or a lambda in metrics= got the size-weighted
# epoch accuracy (the audit's 0.252308 for numpy's 0.253333; here 0.446429 for 0.378378).

_VARIANTS = {  # compute_metrics' value under "acc", and what the epoch mean must be of numpy's
    "of": (lambda out: ft.train.accuracy.of(out.aux, out.batch[1]), lambda a: a),
    "times1": (lambda out: 1.0 * ft.train.accuracy(out), lambda a: a),
    "stop_gradient": (lambda out: jax.lax.stop_gradient(ft.train.accuracy(out)), lambda a: a),
    "float32": (lambda out: jnp.float32(ft.train.accuracy(out)), lambda a: a),
    "percent": (lambda out: 100 * ft.train.accuracy(out), lambda a: 100 * a),
    "error_rate": (lambda out: 1.0 - ft.train.accuracy.of(out.aux, out.batch[1]), lambda a: 1 - a),
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_a_counting_value_through_any_function_in_compute_metrics_keeps_its_parts(variant):
    fn, expect = _VARIANTS[variant]
    logits, labels, values, data = _even_data()
    want = _per_token(logits, labels)
    assert abs(_weighted(logits, labels, _EVEN) - want) > 0.05
    cls = type("Own", (ft.train.TrainStep,), {"compute_metrics": lambda self, out: {"loss": out.loss, "acc": fn(out)}})
    opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
    t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, train_step=cls(loss_fn, opt, metrics={"acc": ft.train.accuracy}))
    t.fit(data, epochs=1, progress=False, log_every=2)
    cuts = np.cumsum((0, *_EVEN))
    steps = [expect(_per_token(logits[a:b], labels[a:b])) for a, b in itertools.pairwise(cuts)]
    np.testing.assert_allclose(t.history.steps["acc"], steps, rtol=0, atol=100 * _ATOL)
    np.testing.assert_allclose(t.history.epochs["acc"][0], expect(want), rtol=0, atol=100 * _ATOL)


@pytest.mark.parametrize("variant", ["of", "times1", "percent", "partial", "super_percent"])
def test_a_counting_value_through_a_metric_function_keeps_its_parts_in_fit_and_evaluate(variant):
    """metrics={name: lambda out: ft.train.accuracy.of(...)} (the label errors' own fix) was a
    plain metric: fit, validation and evaluate gave the size-weighted mean."""
    logits, labels, values, data = _even_data()
    want = _per_token(logits, labels)
    opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
    scale, step = 1.0, None
    if variant == "partial":
        metric = functools.partial(ft.train.accuracy)
    elif variant == "super_percent":  # super()'s value rescaled in an override
        metric, scale = ft.train.accuracy, 100.0

        class Percent(ft.train.TrainStep):
            def compute_metrics(self, out):
                metrics = super().compute_metrics(out)
                return {**metrics, "acc": 100 * metrics["acc"]}

        step = Percent(loss_fn, opt, metrics={"acc": metric})
    else:
        metric, scale = _VARIANTS[variant][0], 100.0 if variant == "percent" else 1.0
    t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, metrics={"acc": metric}, train_step=step)
    t.fit(data, epochs=1, progress=False, log_every=2, validation_data=data)
    np.testing.assert_allclose(t.history.epochs["acc"][0], scale * want, rtol=0, atol=100 * _ATOL)
    if step is None:  # (an EvalStep has no compute_metrics to override)
        np.testing.assert_allclose(t.history.epochs["val_acc"][0], scale * want, rtol=0, atol=100 * _ATOL)
        np.testing.assert_allclose(t.evaluate(data)["acc"], scale * want, rtol=0, atol=100 * _ATOL)
    assert set(t.history.steps) >= {"loss", "acc"} and not any("#" in k for k in t.history.steps)


def test_counting_values_combined_warn_and_keep_their_size_weighted_mean():
    """A value of two counting metrics (or squared) has no parts: its size-weighted mean, as
    a plain metric's, with an InexactMeanWarning naming it and the fix (never stale parts)."""
    from functree.train._metrics import InexactMeanWarning

    logits, labels, values, data = _even_data()
    opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
    metrics = {"sq": lambda out: ft.train.accuracy(out) ** 2,
               "acc": lambda out: (ft.train.accuracy(out) + ft.train.accuracy.of(out.aux, out.batch[1])) / 2}
    t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, metrics=metrics)
    with pytest.warns(InexactMeanWarning) as caught:
        t.fit(data, epochs=1, progress=False)
    said = {str(w.message).split("'")[1] for w in caught}
    assert said == {"sq", "acc"}, said
    assert "right:  {\"accuracy\": ft.train.accuracy(out)" in str(caught[0].message)
    cuts = np.cumsum((0, *_EVEN))
    accs = np.array([_per_token(logits[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)])
    np.testing.assert_allclose(t.history.epochs["sq"][0], np.dot(_EVEN, accs ** 2) / sum(_EVEN), rtol=0, atol=_ATOL)
    np.testing.assert_allclose(t.history.epochs["acc"][0], np.dot(_EVEN, accs) / sum(_EVEN), rtol=0, atol=_ATOL)


def _recipe(error: Exception, which: str, key: str | None = None) -> dict[str, Any]:
    """The ``metrics=`` of an error's fix line ``which``, as a user pastes it (``key``: the
    batch's own name for its labels in place of the example's ``"target"``)."""
    line = next(x for x in str(error).splitlines() if x.strip().startswith(which))
    code = line.split("metrics=", 1)[1].split("   #")[0].strip()
    return eval(code if key is None else code.replace('"target"', f'"{key}"'), {"ft": ft, "jnp": jnp})


@pytest.mark.parametrize("layout", ["NO_LABELS", "LABELS_OR_WEIGHTS", "FLOAT_CLASS_IDS_OR_WEIGHTS"])
def test_the_label_errors_recipes_give_the_per_token_accuracy(layout):
    """The three errors recommended a lambda of accuracy.of, which fit, validation and
    evaluate averaged size-weighted (the audit's 0.252308 for numpy's 0.253333; here
    0.446429 for 0.378378). Their recipes, run as written, give numpy's per-token accuracy."""
    logits, labels, values, data = _even_data()
    want = _per_token(logits, labels)
    assert abs(_weighted(logits, labels, _EVEN) - want) > 0.05
    table, per_example = jnp.asarray(logits), jnp.asarray(values)

    def loss_fn(model, batch):
        i = batch["x"] if isinstance(batch, dict) else batch[0]
        return jnp.mean(per_example[i] * (1.0 + model["w"])), table[i]

    key = None
    if layout == "NO_LABELS":  # labels under a name accuracy does not know
        batches, key = [{"x": i, "tags": y} for i, y in data], "tags"
    elif layout == "LABELS_OR_WEIGHTS":  # Keras's (x, y, sample_weight): a weight per example
        batches = [(i, y, np.linspace(0.5, 1.5, len(i)).astype(np.float32)) for i, y in data]
    else:  # (input_ids, labels, loss_mask)
        batches = [(i, y, (y != -100).astype(np.float32)) for i, y in data]
    with pytest.raises(ValueError) as info:
        ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), loss_fn,
                         metrics=[ft.train.accuracy]).fit(batches, epochs=1, progress=False)
    said = {"NO_LABELS": "could not find the labels", "LABELS_OR_WEIGHTS": "floating-point, one number per example",
            "FLOAT_CLASS_IDS_OR_WEIGHTS": "floating-point of the class-index shape"}[layout]
    assert said in str(info.value)
    recipe = _recipe(info.value, "metrics=" if layout == "NO_LABELS" else "right:", key)
    t = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0), loss_fn, metrics=recipe)
    t.fit(batches, epochs=1, progress=False, validation_data=batches)
    for got in (t.history.epochs["accuracy"][0], t.history.epochs["val_accuracy"][0],
                t.evaluate(batches)["accuracy"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=_ATOL)


class _MixedWithLoss(ft.train.TrainStep):
    """accuracy mixed with another traced value under its own name: no parts can be known."""

    def compute_metrics(self, out):
        metrics = super().compute_metrics(out)
        return {**metrics, "acc": metrics["acc"] * (1.0 + 0.0 * out.loss)}


def test_a_counting_value_mixed_with_traced_values_warns_and_keeps_its_size_weighted_mean():
    """No stale parts: the value the steps report, size-weighted (numpy: Σ n_b·acc_b / Σ n_b),
    with an InexactMeanWarning naming the metric."""
    from functree.train._metrics import InexactMeanWarning

    logits, labels, values, data = _even_data()
    opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
    t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, metrics={"acc": ft.train.accuracy},
                         train_step=_MixedWithLoss)
    with pytest.warns(InexactMeanWarning, match=r"'acc' reports a value computed from a counting metric's value and "
                                                r"other traced values"):
        t.fit(data, epochs=1, progress=False)
    np.testing.assert_allclose(t.history.epochs["acc"][0], _weighted(logits, labels, _EVEN), rtol=0, atol=_ATOL)


class _Logged(ft.train.TrainStep):
    """compute_metrics with host callbacks: one logs the loss and accuracy, one (a
    pure_callback) reports the accuracy as the host computed it."""

    logged: list[tuple[float, float]]
    seen: list[float]

    def compute_metrics(self, out):
        metrics = super().compute_metrics(out)
        jax.debug.callback(lambda loss, acc: self.logged.append((float(loss), float(acc))), metrics["loss"],
                           metrics["acc"])
        host = jax.pure_callback(lambda v: (self.seen.append(float(v)), np.asarray(v, np.float32))[1],
                                 jax.ShapeDtypeStruct((), jnp.float32), metrics["acc"])
        return {**metrics, "acc100": 100 * metrics["acc"], "host": host}


def test_callbacks_in_compute_metrics_run_once_a_step_on_the_steps_values():
    """Before: the exactness probe re-ran compute_metrics inside the step's trace, so a
    jax.debug.callback logged each step 4 times, and callbacks fed the accuracy got the
    probe's made-up 0.25, 0.5, 0.75 at trace time. The probe traces into a throwaway jaxpr
    and evaluates no callback: once a step, the step's own values; 100 * acc stays exact
    (Σ hits / Σ counted), the host's value is size-weighted with an InexactMeanWarning."""
    from functree.train._metrics import InexactMeanWarning

    logits, labels, values, data = _even_data()
    opt, loss_fn = ft.optim.sgd(0.0), _token_loss(logits, values)
    step = _Logged(loss_fn, opt, metrics={"acc": ft.train.accuracy})
    step.logged, step.seen = [], []
    t = ft.train.Trainer({"w": jnp.zeros(())}, opt, loss_fn, train_step=step)
    with pytest.warns(InexactMeanWarning) as caught:
        t.fit(data, epochs=1, progress=False)
    assert {str(w.message).split("'")[1] for w in caught} == {"host"}
    cuts = np.cumsum((0, *_EVEN))
    accs = [_per_token(logits[a:b], labels[a:b]) for a, b in itertools.pairwise(cuts)]
    losses = [float(np.mean(values[a:b], dtype=np.float32)) for a, b in itertools.pairwise(cuts)]
    assert len(step.logged) == len(step.seen) == len(_EVEN)  # once a step (callbacks may run unordered)
    # measured: at most 6e-8 (float32 losses, hit fractions), x10 and up
    np.testing.assert_allclose(np.array(sorted(step.logged)), np.array(sorted(zip(losses, accs))), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sorted(step.seen), sorted(accs), rtol=0, atol=_ATOL)
    np.testing.assert_allclose(t.history.epochs["acc100"][0], 100 * _per_token(logits, labels), rtol=0, atol=100 * _ATOL)
    np.testing.assert_allclose(t.history.epochs["host"][0], _weighted(logits, labels, _EVEN), rtol=0, atol=_ATOL)


def test_keras_metric_names_name_functrees_metric():
    # audit 27: metrics=["accuracy"] (Keras's) reads aux["accuracy"] here, and its error only
    # suggested returning {'accuracy': value} from the loss function, not ft.train.accuracy
    from functree.train._metrics import KERAS_METRICS

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(16, 7)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, 7, 16).astype(np.int32))
    one_hot = jax.nn.one_hot(ids, 7)
    targets = jnp.asarray(rng.normal(size=(16, 7)).astype(np.float32))
    binary = (targets > 0).astype(jnp.float32)
    n_logits, n_ids, n_targets = np.asarray(logits), np.asarray(ids), np.asarray(targets)
    top5 = np.argsort(-n_logits, axis=-1)[:, :5]
    tp = (n_logits > 0) & (n_targets > 0)
    expected = {  # name -> (aux, labels, value by NumPy)
        "accuracy": (logits, ids, np.mean(n_logits.argmax(-1) == n_ids)),
        "categorical_accuracy": (logits, one_hot, np.mean(n_logits.argmax(-1) == n_ids)),
        "binary_accuracy": (logits, binary, np.mean((n_logits > 0) == (n_targets > 0))),
        "mae": (logits, targets, np.mean(np.abs(n_logits - n_targets))),
        "mse": (logits, targets, np.mean(np.square(n_logits - n_targets))),
        "top_k_accuracy": (logits, ids, np.mean((top5 == n_ids[:, None]).any(-1))),
        "top_k_categorical_accuracy": (logits, one_hot, np.mean((top5 == n_ids[:, None]).any(-1))),
        # ft.train.precision / recall / f1 of multi-label 0/1 targets: every element counts (micro, as Keras's Precision)
        "precision": (logits, binary, np.sum(tp) / np.sum(n_logits > 0)),
        "recall": (logits, binary, np.sum(tp) / np.sum(n_targets > 0)),
        "f1_score": (logits, binary, 2 * np.sum(tp) / (np.sum(n_logits > 0) + np.sum(n_targets > 0))),
    }
    same = {"acc": "accuracy", "sparse_categorical_accuracy": "accuracy", "mean_absolute_error": "mae",
            "mean_squared_error": "mse", "sparse_top_k_categorical_accuracy": "top_k_accuracy"}
    assert set(KERAS_METRICS) == set(expected) | set(same)
    for name, (right, _, _) in KERAS_METRICS.items():
        with pytest.raises(ValueError) as e:
            resolve_metrics([name])[name](out(None, (None, ids)))
        assert f"wrong:  metrics=[{name!r}]\n    right:  metrics={right}   # " in str(e.value)
        # the right line runs and gives Keras's number (class ids or one-hot labels as Keras's)
        aux, labels, value = expected[same.get(name, name)]
        (fn,) = resolve_metrics(eval(right, {"ft": ft, "jax": jax, "jnp": jnp})).values()
        np.testing.assert_allclose(fn(out(aux, (None, labels))), value, rtol=0, atol=1e-6)
        # a loss function returning the name as its aux key keeps it (the name is a key here)
        assert float(resolve_metrics([name])[name](out({name: jnp.arange(4.0)}, None))) == 1.5
    with pytest.raises(ValueError) as e:  # a name Keras does not use: the aux key's message alone
        resolve_metrics(["f1"])["f1"](out(None, None))
    assert "Keras" not in str(e.value)


def test_keras_accuracy_name_through_the_trainer():
    model = ft.nn.Dense(3, 4, key=jax.random.key(0))
    x, y = np.ones((4, 3), np.float32), np.arange(4)
    loss_fn = lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1])  # noqa: E731
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics=["acc"])
    with pytest.raises(ValueError, match=r"right:  metrics=\[ft\.train\.accuracy\]   # the loss function returns"):
        trainer.fit(ft.train.batches((x, y), 4), epochs=1, progress=False)


def test_aux_scalars_no_metric_records_are_named_with_the_metrics_that_record_them():
    """Flax's and Equinox's way of returning metrics, (loss, {"accuracy": acc}), reached no
    history: a step records the metrics= it is given, and without any the aux went nowhere,
    silently."""
    import warnings

    import functree.optim as fo

    def loss_fn(w, batch):
        x, y = batch
        logits = x @ w["w"]
        acc = jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))
        return ft.losses.softmax_cross_entropy(logits, y), {"accuracy": acc, "logits": logits}

    w = {"w": jnp.ones((3, 2))}
    batch = (jnp.ones((4, 3)), jnp.array([0, 1, 0, 1]))
    opt = fo.Optimizer(fo.sgd(0.1))
    with pytest.warns(ft.train.UnrecordedAuxWarning, match=r"returns 'accuracy' in its aux, and the step records no "
                                                            r"metric: it reaches no history") as caught:
        ft.train.train_step(loss_fn, opt, donate=False)(w, opt.init(w), batch)
    assert "metrics=[ft.train.mean('accuracy')])" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, metrics = ft.train.train_step(loss_fn, opt, donate=False, metrics=[ft.train.mean("accuracy")])(
            w, opt.init(w), batch)
        assert float(metrics["accuracy"]) == 0.5

        class Own(ft.train.TrainStep):  # an override records what it likes
            def compute_metrics(self, out):
                return {"loss": out.loss, "acc": out.aux["accuracy"]}

        Own(loss_fn, opt, donate=False)(w, opt.init(w), batch)
        ft.train.train_step(lambda w, b: (loss_fn(w, b)[0], {"logits": jnp.zeros((4, 2))}), opt, donate=False)(
            w, opt.init(w), batch)


def test_a_metric_not_taking_the_step_output_is_refused_with_the_call_that_takes_it():
    # session 60: metrics={"mae": lambda model, batch: ...} (a loss function's arguments) or
    # Keras's mae(y_true, y_pred) failed inside the first step with Python's "missing 1
    # required positional argument: 'batch'", which named neither the metric nor what it gets
    from functree.train._metrics import METRIC_ARGUMENTS

    assert "fn(out)" in METRIC_ARGUMENTS
    x, y = np.arange(8.0, dtype=np.float32).reshape(4, 2), np.ones((4, 1), np.float32)
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))

    def loss_fn(m, b):
        return ft.losses.mean_squared_error(m(b[0]), b[1]), m(b[0])

    def keras_mae(y_true, y_pred):
        return jnp.mean(jnp.abs(y_true - y_pred))

    mae = float(np.mean(np.abs(np.asarray(model(x)) - y)))
    evaluate = ft.train.eval_step(loss_fn, metrics={"mae": keras_mae})
    with pytest.raises(TypeError) as e:
        evaluate(model, (x, y))
    right = "metrics={'mae': lambda out: keras_mae(out.batch[-1], out.aux)}"
    assert f"wrong:  metrics={{'mae': keras_mae}}   # keras_mae(y_true, y_pred)\n    right:  {right}" in str(e.value)
    fixed = ft.train.eval_step(loss_fn, **eval(f"dict({right})", {"keras_mae": keras_mae}))  # the right line runs
    np.testing.assert_allclose(float(fixed(model, (x, y))["mae"]), mae, rtol=0, atol=1e-6)
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics={"mae": lambda model, batch: 0.0})
    with pytest.raises(TypeError, match=r"right:  metrics=\{'mae': lambda out: \.\.\.\}   # model, batch read as "
                                        r"out\.model, out\.batch"):
        trainer.fit(ft.train.batches((x, y), 4), epochs=1, progress=False)
    with pytest.raises(TypeError) as located:  # the metric's own refusal, not blamed on minibatch 0
        ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics={"mae": keras_mae}).fit([(x, y)], epochs=1,
                                                                                            progress=False)
    assert str(located.value).startswith("The metric 'mae' is keras_mae(y_true, y_pred)")
    with pytest.raises(TypeError, match=r"wrong:  ft\.train\.mean\(<lambda>\)"):
        ft.train.mean(lambda model, batch: 0.0)


def test_a_metric_returning_none_is_refused_with_its_return_not_blamed_on_the_minibatch():
    # session 60: a metric def that forgot its return (or lambda out: out.aux beside a loss
    # without aux) failed in fit with "step 1: minibatch 0 ... Its shapes: ... None is not a
    # valid value for jnp.array": the data blamed, no metric named, no fix
    from functree.train._metrics import METRIC_NOT_A_NUMBER

    assert "returned {given}, not a number" in METRIC_NOT_A_NUMBER
    x, y = np.arange(8.0, dtype=np.float32).reshape(4, 2), np.ones((4, 1), np.float32)
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    loss_fn = lambda m, b: ft.losses.mean_squared_error(m(b[0]), b[1])  # noqa: E731

    def mae(out):
        jnp.mean(jnp.abs(out.model(out.batch[0]) - out.batch[1]))  # no return

    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics={"mae": mae})
    with pytest.raises(TypeError) as e:
        trainer.fit([(x, y)], epochs=1, progress=False)
    assert str(e.value).startswith("The metric 'mae' returned None, not a number")
    assert "wrong:  def mae(out): jnp.mean(...)\n    right:  def mae(out): return jnp.mean(...)" in str(e.value)
    evaluate = ft.train.eval_step(loss_fn, metrics={"aux": lambda out: out.aux})  # the loss has no aux
    with pytest.raises(TypeError, match=r"'aux' returned None.*out\.aux is None when the loss function returns"):
        evaluate(model, (x, y))
    with pytest.raises(TypeError, match=r"'name' returned a str, not a number"):
        ft.train.eval_step(loss_fn, metrics={"name": lambda out: "mae"})(model, (x, y))
    fixed = ft.train.eval_step(loss_fn, metrics={"mae": lambda out: jnp.mean(jnp.abs(out.model(out.batch[0]) - out.batch[1]))})
    np.testing.assert_allclose(float(fixed(model, (x, y))["mae"]), np.mean(np.abs(np.asarray(model(x)) - y)), atol=1e-6)
