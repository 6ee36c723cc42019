"""functree.losses against numpy formulas; reductions; gradients; input errors."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft

P = np.array([[0.5, -1.0, 2.0], [3.0, 0.0, -0.2]], np.float32)
E = np.array([[0.0, 1.0, 2.5], [1.0, 0.5, 0.3]], np.float32)


def _huber(d, delta):
    a = np.abs(d)
    return np.where(a <= delta, 0.5 * a**2, delta * (a - 0.5 * delta))


REGRESSION = [
    (ft.losses.mean_squared_error, lambda p, e: (p - e) ** 2, "mean"),
    (ft.losses.mean_absolute_error, lambda p, e: np.abs(p - e), "mean"),
    (ft.losses.l1, lambda p, e: np.abs(p - e), "mean"),
    (ft.losses.l2, lambda p, e: (p - e) ** 2, "mean"),
    (ft.losses.huber, lambda p, e: _huber(p - e, 1.0), "mean"),
    (ft.losses.mean_squared_logarithmic_error,
     lambda p, e: (np.log1p(np.maximum(p, 0)) - np.log1p(np.maximum(e, 0))) ** 2, "mean"),
    (ft.losses.mean_absolute_percentage_error,
     lambda p, e: 100 * np.abs((e - p) / np.maximum(np.abs(e), np.finfo(np.float32).eps)), "mean"),
    (ft.losses.log_cosh, lambda p, e: np.log(np.cosh(p - e)), "mean"),
    (ft.losses.hinge, lambda p, e: np.maximum(0, 1 - e * p), "mean"),
    (ft.losses.squared_hinge, lambda p, e: np.maximum(0, 1 - e * p) ** 2, "mean"),
]


@pytest.mark.parametrize("loss,elementwise,default", REGRESSION)
def test_regression_losses_and_reductions(loss, elementwise, default):
    values = elementwise(P.astype(np.float64), E.astype(np.float64))
    np.testing.assert_allclose(loss(P, E, reduction="none"), values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss(P, E, reduction="sum"), values.sum(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss(P, E, reduction="mean"), values.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss(P, E), getattr(values, default)(), rtol=1e-5, atol=1e-6)


def test_poisson():
    rates, counts = np.abs(P) + 0.1, np.round(np.abs(E) * 3)
    values = rates - counts * np.log(rates)
    np.testing.assert_allclose(ft.losses.poisson(rates, counts, reduction="none"), values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ft.losses.poisson(rates, counts), values.mean(), rtol=1e-5, atol=1e-6)


def test_categorical_hinge():
    logits = np.array([[2.0, 1.5, -1.0], [0.0, 3.0, 1.0]], np.float32)
    one_hot = np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], np.float32)
    per_example = np.maximum(0, 1 + ((1 - one_hot) * logits).max(-1) - (one_hot * logits).sum(-1))
    np.testing.assert_allclose(ft.losses.categorical_hinge(logits, one_hot, reduction="none"), per_example)
    np.testing.assert_allclose(ft.losses.categorical_hinge(logits, one_hot), per_example.mean())


def test_huber_delta():
    np.testing.assert_allclose(ft.losses.huber(P, E, delta=0.3, reduction="none"), _huber(P - E, 0.3), rtol=1e-5, atol=1e-6)


def test_softmax_cross_entropy_integer_labels_and_probabilities():
    logits = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], np.float32)
    labels = np.array([1, 2])
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    per_example = -log_p[np.arange(2), labels]
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, labels, reduction="none"), per_example, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, labels), per_example.mean(), rtol=1e-5, atol=1e-6)
    probs = np.array([[0.2, 0.8, 0.0], [0.5, 0.0, 0.5]], np.float32)
    np.testing.assert_allclose(
        ft.losses.softmax_cross_entropy(logits, probs, reduction="sum"), -(probs * log_p).sum(), rtol=1e-5, atol=1e-6)


def test_every_loss_defaults_to_the_mean():
    """The issue: mse meant, huber/l1/l2 summed (0.25 vs 8.0 vs 16.0 on one batch)."""
    for name in ft.losses.__all__:
        loss = getattr(ft.losses, name)
        if callable(loss):
            assert inspect.signature(loss).parameters["reduction"].default == "mean", name


def _smoothed_reference(logits, labels, smoothing):
    classes = logits.shape[-1]
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = (1 - smoothing) * np.eye(classes)[labels] + smoothing / classes
    return -(target * log_p).sum(-1)


def test_softmax_cross_entropy_label_smoothing():
    logits = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], np.float64)
    labels = np.array([1, 2])
    expected = _smoothed_reference(logits, labels, 0.1)
    got = ft.losses.softmax_cross_entropy(logits.astype(np.float32), labels, label_smoothing=0.1, reduction="none")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    one_hot = np.eye(3, dtype=np.float32)[labels]
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits.astype(np.float32), one_hot, label_smoothing=0.1),
                               expected.mean(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\), got 1.5"):
        ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=1.5)


def test_softmax_cross_entropy_ignore_index_means_over_kept_positions():
    logits = np.array([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [2.0, 2.0, 2.0]]], np.float32)  # [1, 3 tokens, 3]
    labels = np.array([[1, -100, 0]])
    per_token = _smoothed_reference(logits.astype(np.float64), np.where(labels < 0, 0, labels), 0.0)
    kept = per_token[labels != -100]
    loss = ft.losses.softmax_cross_entropy(logits, labels, ignore_index=-100)
    np.testing.assert_allclose(loss, kept.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, labels, ignore_index=-100, reduction="sum"),
                               kept.sum(), rtol=1e-5, atol=1e-6)
    none = ft.losses.softmax_cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    assert float(none[0, 1]) == 0.0
    smoothed = ft.losses.softmax_cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.2)
    expected = _smoothed_reference(logits[0, [0, 2]].astype(np.float64), np.array([1, 0]), 0.2).mean()
    np.testing.assert_allclose(smoothed, expected, rtol=1e-5, atol=1e-6)
    assert float(ft.losses.softmax_cross_entropy(logits, jnp.full((1, 3), 7), ignore_index=7)) == 0.0
    grads = jax.grad(lambda z: ft.losses.softmax_cross_entropy(z, labels, ignore_index=-100))(jnp.asarray(logits))
    assert not np.any(grads[0, 1])  # an ignored position gets no gradient
    with pytest.raises(ValueError, match=r"(?s)ignore_index=0 needs integer class labels \[1, 3\], got probabilities f32\[1,3,3\]"):
        ft.losses.softmax_cross_entropy(logits, jnp.ones((1, 3, 3)) / 3, ignore_index=0)
    probabilities = jnp.ones((1, 3, 3)) / 3  # the default ignore_index applies to class indices only
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, probabilities),
                               -np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).mean(-1).mean(),
                               rtol=0, atol=1e-6)


def test_sigmoid_cross_entropy():
    logits = np.array([[-2.0, 0.5], [3.0, 0.0]], np.float32)
    labels = np.array([[0.0, 1.0], [1.0, 0.3]], np.float32)
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    values = -(labels * np.log(s) + (1 - labels) * np.log(1 - s))
    np.testing.assert_allclose(ft.losses.sigmoid_cross_entropy(logits, labels), values.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ft.losses.sigmoid_cross_entropy(logits, labels.astype(bool), reduction="none"),
                               -(np.round(labels) * np.log(s) + (1 - np.round(labels)) * np.log(1 - s)), rtol=1e-5, atol=1e-6)


def test_kl_divergence():
    predicted = np.array([[0.25, 0.25, 0.5], [0.1, 0.6, 0.3]], np.float32)
    expected = np.array([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]], np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(expected > 0, expected * np.log(expected / predicted), 0.0)
    np.testing.assert_allclose(ft.losses.kl_divergence(predicted, expected, reduction="none"), terms.sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ft.losses.kl_divergence(predicted, expected), terms.sum(-1).mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ft.losses.kl_divergence(predicted, expected, reduction="sum"), terms.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", [ft.losses.mean_squared_error, ft.losses.huber, ft.losses.kl_divergence,
                                  ft.losses.sigmoid_cross_entropy, ft.losses.log_cosh, ft.losses.poisson,
                                  ft.losses.mean_squared_logarithmic_error])
def test_gradients_finite_differences(loss):
    with jax.enable_x64(True):
        p = jnp.asarray([[0.2, 0.3, 0.5], [0.1, 0.6, 0.3]], jnp.float64)
        e = jnp.asarray([[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]], jnp.float64)
        check_grads(jax.jit(lambda p: loss(p, e)), (p,), order=1, modes=["rev"])


def test_softmax_cross_entropy_gradient_finite_differences():
    with jax.enable_x64(True):
        logits = jnp.asarray([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], jnp.float64)
        check_grads(jax.jit(lambda z: ft.losses.softmax_cross_entropy(z, jnp.array([1, 2]))), (logits,), order=1, modes=["rev"])
        check_grads(jax.jit(lambda z: ft.losses.softmax_cross_entropy(z, jnp.array([1, -1]), label_smoothing=0.1,
                                                                      ignore_index=-1)), (logits,), order=1, modes=["rev"])


def test_losses_are_jittable_and_differentiable_through_a_model(key):
    model = ft.nn.Dense(3, 2, key=key)
    x, y = jnp.ones((4, 3)), jnp.array([0, 1, 1, 0])
    grads = jax.jit(ft.gradient(lambda m: ft.losses.softmax_cross_entropy(m(x), y)))(model)
    assert grads.weight.shape == (3, 2)


def test_shape_mismatch_is_an_error_naming_both_shapes():
    with pytest.raises(ValueError, match=r"(?s)mean_squared_error: predicted and expected must have the same shape; expected f32\[4\] \(\[4\]\), got predicted f32\[4,1\].*reshape\(y.shape\)"):
        ft.losses.mean_squared_error(jnp.ones((4, 1)), jnp.ones(4))


def test_float_labels_where_ints_needed_is_an_error():
    with pytest.raises(TypeError, match=r"(?s)labels f32\[2\] have the shape of class indices \[2\].*astype\(jnp.int32\)"):
        ft.losses.softmax_cross_entropy(jnp.ones((2, 3)), jnp.array([0.0, 1.0]))


def test_wrong_label_shape_is_an_error():
    with pytest.raises(ValueError, match=r"for logits f32\[2,3\], expected integer labels of shape \[2\] or probabilities of shape \[2, 3\], got i32\[3\]"):
        ft.losses.softmax_cross_entropy(jnp.ones((2, 3)), jnp.array([0, 1, 2]))


def test_integer_predictions_and_bad_reduction_are_errors():
    with pytest.raises(TypeError, match=r"l1: predicted must be a floating array, got i32\[2\]"):
        ft.losses.l1(jnp.array([1, 2]), jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"reduction must be one of \['mean', 'sum', 'none'\], got 'avg'"):
        ft.losses.l2(P, E, reduction="avg")


def _collated(vocab, seed=0):
    """Logits [2, 6, vocab] and a Hugging Face collator's labels: -100 on the prompt and padding."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (2, 6, vocab)).astype(np.float32)
    labels = rng.integers(0, vocab, (2, 6))
    labels[0, :2] = labels[1, :3] = labels[1, 5] = -100
    return logits, labels


@pytest.mark.parametrize("vocab", [256, 50])
def test_softmax_cross_entropy_reads_hf_labels_as_torch_does(vocab):
    """The issue: the default ignore_index=None read -100 as class V - 100 (6.4654 vs torch's
    6.5028 at V=256; NaN at V=50). Now -100 is ignored by default, as torch's cross_entropy."""
    torch = pytest.importorskip("torch")
    logits, labels = _collated(vocab)
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(logits).reshape(-1, vocab),
                                                 torch.from_numpy(labels).reshape(-1))
    atol = 1e-6 * float(np.abs(logits).max())
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, labels), expected.item(), rtol=0, atol=atol)
    np.testing.assert_allclose(jax.jit(ft.losses.softmax_cross_entropy)(logits, labels), expected.item(), rtol=0,
                               atol=atol)
    smoothed = torch.nn.functional.cross_entropy(torch.from_numpy(logits).reshape(-1, vocab),
                                                 torch.from_numpy(labels).reshape(-1), label_smoothing=0.1)
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=0.1), smoothed.item(),
                               rtol=0, atol=atol)


def test_softmax_cross_entropy_through_train_step_equals_torch():
    """Loss and gradient of one SGD step on a Dense head, HF labels, against torch's."""
    torch = pytest.importorskip("torch")
    vocab, lr = 256, 0.5
    x, labels = _collated(vocab)
    x = x[..., :8]
    model = ft.nn.Dense(8, vocab, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.sgd(lr))
    step = ft.train.train_step(lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1]), opt, donate=False)
    new, _, metrics = step(model, opt.init(model), (jnp.asarray(x), jnp.asarray(labels)))
    w = torch.tensor(np.asarray(model.weight), requires_grad=True)
    b = torch.tensor(np.asarray(model.bias), requires_grad=True)
    loss = torch.nn.functional.cross_entropy((torch.from_numpy(x) @ w + b).reshape(-1, vocab),
                                             torch.from_numpy(labels).reshape(-1))
    loss.backward()
    np.testing.assert_allclose(float(metrics["loss"]), loss.item(), rtol=0, atol=1e-5 * abs(loss.item()))
    expected = np.asarray(model.weight) - lr * w.grad.numpy()
    np.testing.assert_allclose(np.asarray(new.weight), expected, rtol=0, atol=1e-6 * float(np.abs(expected).max()))


def test_softmax_cross_entropy_labels_outside_the_classes():
    logits, labels = _collated(50)
    for bad, where, kwargs in [(50, [1, 4], {}), (-1, [1, 4], {}), (-100, [0, 0], {"ignore_index": None}),
                               (-100, [0, 0], {"ignore_index": 0})]:
        given = labels.copy()
        given[tuple(where)] = bad
        with pytest.raises(ValueError, match=rf"(?s)label {bad} at labels\[{where[0]}, {where[1]}\] is not a class of "
                                             rf"logits f32\[2,6,50\] \(classes 0 to 49\).*ignore_index="):
            ft.losses.softmax_cross_entropy(logits, given, **kwargs)
        # traced labels (a jit of your own) cannot be read: NaN, never a plausible number
        traced = jax.jit(lambda z, y, kw=kwargs: ft.losses.softmax_cross_entropy(z, y, **kw))(logits, given)
        assert np.isnan(float(traced))
        none = jax.jit(lambda z, y, kw=kwargs: ft.losses.softmax_cross_entropy(z, y, reduction="none", **kw))(logits, given)
        inside = (given >= 0) & (given < 50)
        assert np.isnan(none[tuple(where)]) and np.isfinite(np.asarray(none)[inside]).all()
