"""functree.losses against numpy formulas; reductions; gradients; input errors."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import needs_float16_conversions
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
     lambda p, e: 100 * np.abs((e - p) / np.maximum(np.abs(e), 1e-7)), "mean"),
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


def test_mean_absolute_percentage_error_is_keras_at_the_floor_and_at_a_zero_error():
    """Keras 3.15's definition, 100 * mean(|t - p| / max(|t|, 1e-7)): its epsilon() 1e-7 in
    float64 too (ours floored at finfo's eps, 2.2e-16: 9.0e8 here; the formula 18.2, Keras's
    JAX backend 18.200001120567322, its terms rounded through float32: 6.2e-8 apart); the
    gradient at a zero error (entry 2) 0, as mean_absolute_error's (it was -10, jnp.abs's 1)."""
    t, p = np.array([1e-9, 0.0, 2.0, -3e-8, 5e-8]), np.array([0.0, 1e-8, 2.0, 0.0, 1e-7])
    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(ft.losses.mean_absolute_percentage_error)(p, t)
    np.testing.assert_allclose(value, 100 * np.mean(np.abs(t - p) / np.maximum(np.abs(t), 1e-7)), rtol=1e-15)
    np.testing.assert_allclose(value, 18.200001120567322, rtol=1e-7)  # keras.losses.mean_absolute_percentage_error
    np.testing.assert_allclose(grad, [-2e8, 2e8, 0.0, 2e8, 2e8], rtol=1e-15)  # Keras's but 0 at the zero error
    value32 = ft.losses.mean_absolute_percentage_error(p.astype(np.float32), t.astype(np.float32))
    np.testing.assert_allclose(value32, 18.199999, rtol=1e-6)  # Keras's in float32: the same floor


def test_hinge_gradients_at_the_kink_are_tfs():
    """Keras's hinge losses are tf.maximum(z, 0), whose gradient goes to z where z >= 0 (TF's
    _MaximumGrad, greater_equal): at a margin met exactly, d hinge/dp = -y / n (relu's 0 here
    before); squared_hinge's 0 there; categorical_hinge's -1 on the true class and +1 on the
    largest wrong one (split between tied ones)."""
    p, y = np.array([1.0, -1.0, 0.5, 2.0]), np.array([1.0, -1.0, 1.0, 1.0])  # entries 0, 1 at the kink
    with jax.enable_x64(True):
        grad = jax.grad(ft.losses.hinge)(p, y)
        squared = jax.grad(ft.losses.squared_hinge)(p, y)
        scores = np.array([[1.5, 0.5, -1.0], [2.0, 1.0, 1.0]])  # margins 1 + 0.5 - 1.5, 1 + 1 - 2: at the kink
        categorical = jax.grad(ft.losses.categorical_hinge)(scores, np.array([[1.0, 0.0, 0.0]] * 2))
    np.testing.assert_array_equal(grad, [-0.25, 0.25, -0.25, 0.0])
    np.testing.assert_array_equal(squared, [0.0, 0.0, -0.25, 0.0])  # 2 * 0.5 * -1 / 4 at entry 2
    np.testing.assert_array_equal(categorical, [[-0.5, 0.5, 0.0], [-0.5, 0.25, 0.25]])


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
        if callable(loss) and not isinstance(loss, type):  # WeightedMean: the record "weighted" returns
            assert inspect.signature(loss).parameters["reduction"].default == "mean", name


def _softmax(logits, dtype=np.float32):
    """jax.nn.softmax in NumPy (float64, then ``dtype``): a reference input that compiles nothing."""
    z = np.asarray(logits, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(dtype)


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
    assert float(np.asarray(none)[0, 1]) == 0.0
    smoothed = ft.losses.softmax_cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.2)
    expected = _smoothed_reference(logits[0, [0, 2]].astype(np.float64), np.array([1, 0]), 0.2).mean()
    np.testing.assert_allclose(smoothed, expected, rtol=1e-5, atol=1e-6)
    assert float(ft.losses.softmax_cross_entropy(logits, np.full((1, 3), 7, np.int32), ignore_index=7)) == 0.0
    grads = jax.jit(jax.grad(lambda z: ft.losses.softmax_cross_entropy(z, labels, ignore_index=-100)))(logits)
    assert not np.any(np.asarray(grads)[0, 1])  # an ignored position gets no gradient
    with pytest.raises(ValueError, match=r"(?s)ignore_index=0 needs integer class labels \[1, 3\], got probabilities f32\[1,3,3\]"):
        ft.losses.softmax_cross_entropy(logits, np.full((1, 3, 3), 1 / 3, np.float32), ignore_index=0)
    probabilities = np.full((1, 3, 3), 1 / 3, np.float32)  # the default ignore_index applies to class indices only
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
    x, y = np.ones((4, 3), np.float32), np.array([0, 1, 1, 0], np.int32)
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
    with pytest.raises(ValueError, match=r"reduction must be one of \['mean', 'sum', 'none', 'weighted'\], got 'avg'"):
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
        traced, none = jax.jit(lambda z, y, kw=kwargs: (ft.losses.softmax_cross_entropy(z, y, **kw),
                                                        ft.losses.softmax_cross_entropy(z, y, reduction="none", **kw)))(
            logits, given)
        assert np.isnan(float(traced))
        inside = (given >= 0) & (given < 50)
        assert np.isnan(np.asarray(none)[tuple(where)]) and np.isfinite(np.asarray(none)[inside]).all()


def test_kl_divergence_terms_where_expected_is_zero_are_zero_with_finite_gradients():
    """The issue: 0 * log(0) made KL NaN where expected == 0 and predicted == 0 (an underflowed
    float32 softmax), although the docstring said such terms are zero. torch's kl_div is NaN
    there too; its terms do not depend on predicted where expected == 0, so torch is the anchor
    with those predictions made positive."""
    torch = pytest.importorskip("torch")
    predicted = np.array([[1.0, 0.0, 0.0], [0.5, 0.0, 0.5], [0.2, 0.3, 0.5]], np.float32)
    expected = np.array([[1.0, 0.0, 0.0], [0.25, 0.0, 0.75], [0.0, 0.4, 0.6]], np.float32)
    positive = np.where(expected == 0, 1.0, predicted).astype(np.float32)  # same terms, torch-defined
    p = torch.tensor(positive, requires_grad=True)
    reference = torch.nn.functional.kl_div(torch.log(p), torch.from_numpy(expected), reduction="none").sum(-1)
    reference.mean().backward()
    atol = 1e-6
    np.testing.assert_allclose(ft.losses.kl_divergence(predicted, expected, reduction="none"),
                               reference.detach().numpy(), rtol=0, atol=atol)
    np.testing.assert_allclose(ft.losses.kl_divergence(predicted, expected), reference.mean().item(), rtol=0, atol=atol)
    grad = jax.jit(jax.grad(lambda q: ft.losses.kl_divergence(q, expected)))(predicted)
    # -e / p / rows where e > 0, and 0 where e == 0 (torch's own is NaN at p == 0 there)
    np.testing.assert_allclose(grad, p.grad.numpy(), rtol=0, atol=1e-6 * float(np.abs(p.grad.numpy()).max()))
    # a float32 softmax that underflowed to an exact 0, differentiated through its logits
    logits, one_hot = np.array([0.0, -200.0], np.float32), np.array([1.0, 0.0], np.float32)
    underflowed = jax.jit(jax.nn.softmax)(logits)  # one program
    assert float(np.asarray(underflowed)[1]) == 0.0
    kl = lambda z: ft.losses.kl_divergence(jax.nn.softmax(z), one_hot)  # noqa: E731
    assert float(ft.losses.kl_divergence(underflowed, one_hot)) == 0.0  # kl(logits), the softmax jitted
    assert np.isfinite(np.asarray(jax.jit(jax.grad(kl))(logits))).all()
    with np.errstate(divide="ignore"):  # expected > 0 where predicted == 0: infinite, as torch's
        assert float(ft.losses.kl_divergence(np.array([1.0, 0.0], np.float32), np.array([0.5, 0.5], np.float32))) == np.inf


def test_softmax_cross_entropy_refuses_integer_labels_of_the_logits_shape_and_one_class():
    """The issue: integer labels [N, 1] for a one-logit head were read as probabilities over one
    class: loss 0 and zero gradients, silently; class indices broadcast to [N, C] summed to 6
    "probabilities". torch refuses integer targets of the logits' shape."""
    torch = pytest.importorskip("torch")
    logits, indices = np.zeros((2, 3), np.float32), np.array([[2, 2, 2], [0, 0, 0]])
    with pytest.raises(RuntimeError, match="Expected floating point type for target with class probabilities"):
        torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(indices))
    for labels, given in [(indices, r"i64\[2,3\]"), (jnp.asarray(indices), r"i32\[2,3\]"), (indices == 1, r"bool\[2,3\]")]:
        with pytest.raises(TypeError, match=rf"(?s)labels {given} have the logits' shape \[2, 3\], so they would be read "
                                            r"as probabilities.*class indices need the shape logits.shape\[:-1\] = \[2\]"
                                            r".*labels.argmax\(-1\).*labels.astype\(logits.dtype\)"):
            ft.losses.softmax_cross_entropy(logits, labels)
    one_hot = np.eye(3, dtype=np.float32)[[2, 0]]  # the fix the message names, equal to torch's
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, one_hot),
                               torch.nn.functional.cross_entropy(torch.from_numpy(logits),
                                                                 torch.from_numpy(one_hot)).item(), rtol=0, atol=1e-6)
    head = jnp.array([[2.0], [-1.0], [0.5]])
    for labels in [jnp.array([[0], [1], [1]]), jnp.array([0, 0, 0]), jnp.array([[0.0], [1.0], [1.0]])]:
        with pytest.raises(ValueError, match=r"(?s)logits f32\[3,1\] have 1 class on their last axis; a softmax needs a "
                                             r"last axis of at least 2 classes.*ft.losses.sigmoid_cross_entropy\(logits"):
            ft.losses.softmax_cross_entropy(head, labels)
    with pytest.raises(ValueError, match=r"logits f32\[\] have no class axis"):
        ft.losses.softmax_cross_entropy(jnp.float32(1.0), jnp.int32(0))
    with pytest.raises(ValueError, match=r"logits f32\[2,0\] have 0 classes on their last axis"):
        ft.losses.softmax_cross_entropy(jnp.zeros((2, 0)), jnp.array([0, 0]))


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_softmax_cross_entropy_reads_numpy_labels_before_int32_wraps_them(dtype):
    """The issue: np.int64 label 2**32 + 1 became 1 in jnp.asarray (x64 off) and trained as class
    1, although labels outside the classes raise."""
    logits, labels = _collated(50)
    for bad in [2**32 + 1, 2**31]:
        given = labels.astype(np.int64)
        given[1, 4] = bad
        if dtype is np.uint64:
            given = np.where(given < 0, 7, given).astype(np.uint64)
        with pytest.raises(ValueError, match=rf"(?s)label {bad} at labels\[1, 4\] is not a class of logits "
                                             rf"f32\[2,6,50\].*np.where\(labels == {bad}, -100, labels\)"):
            ft.losses.softmax_cross_entropy(logits, given.astype(dtype))
    with pytest.raises(ValueError, match=r"label 4294967297 at labels\[1\]"):  # a Python list of them too
        ft.losses.softmax_cross_entropy(logits[0, :2], [1, 2**32 + 1])
    torch = pytest.importorskip("torch")  # in range, NumPy int64 labels are torch's loss
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(logits).reshape(-1, 50),
                                                 torch.from_numpy(labels.astype(np.int64)).reshape(-1))
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, labels.astype(np.int64)), expected.item(),
                               rtol=0, atol=1e-6 * float(np.abs(logits).max()))


def test_softmax_cross_entropy_takes_numpy_smoothing_and_names_the_labels_dtype():
    """The issue: label_smoothing=np.float32(0.1) was refused as "not a number in [0, 1)" while
    np.float64 passed; bool labels were said to have "a floating dtype"."""
    torch = pytest.importorskip("torch")
    logits, labels = _collated(50)
    kept = labels.reshape(-1) != -100
    flat_logits, flat_labels = logits.reshape(-1, 50)[kept], labels.reshape(-1)[kept]
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(flat_logits), torch.from_numpy(flat_labels),
                                                 label_smoothing=0.1).item()
    atol = 1e-6 * float(np.abs(logits).max())
    for smoothing in [np.float32(0.1), np.float64(0.1), 0.1]:
        np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=smoothing), expected,
                                   rtol=0, atol=atol)
    plain = ft.losses.softmax_cross_entropy(logits, labels)
    assert float(ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=np.int64(0))) == float(plain)
    for smoothing, given in [(jnp.float32(0.1), r"f32\[\]"), (np.array(0.1), r"f64\[\]"), ("0.1", "'0.1'"),
                             (True, "True"), (np.bool_(False), "np.False_")]:
        with pytest.raises(TypeError, match=rf"(?s)label_smoothing must be a Python or NumPy number in \[0, 1\), got "
                                            rf"{given}\. An array.*label_smoothing=float\(smoothing\)"):
            ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=smoothing)
    with pytest.raises(TypeError, match=r"label_smoothing must be a Python or NumPy number in \[0, 1\), got f32\[\]"):
        jax.jit(lambda s: ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=s))(0.1)
    for smoothing in [np.float32(1.0), np.float64(np.nan), -0.1]:
        with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\)"):
            ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=smoothing)
    with pytest.raises(TypeError, match=r"labels bool\[3\] have the shape of class indices \[3\] but dtype bool, not an "
                                        r"integer dtype"):
        ft.losses.softmax_cross_entropy(jnp.zeros((3, 4)), jnp.array([True, False, True]))


HALF = [jnp.bfloat16, pytest.param(jnp.float16, marks=needs_float16_conversions)]


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_inputs_give_a_float32_loss_as_torch_autocast(dtype):
    """A float16 loss times a loss scale of 65536 is inf: every scaled step overflowed. torch's
    autocast runs cross_entropy (and the other losses) in float32, Hugging Face's losses take
    logits.float(): the loss is float32, the value that of the float32 inputs, and the
    gradient flows back in the inputs' dtype."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 5)) * 4, dtype)
    labels = np.array([0, 4, 2, -100, 1, 3], np.int32)
    wide = np.asarray(logits).astype(np.float32)  # a writable copy for torch
    got = ft.losses.softmax_cross_entropy(logits, labels)
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(wide), torch.from_numpy(labels).long())
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), expected.item(), rtol=0, atol=1e-6 * abs(expected.item()))
    grad = jax.jit(jax.grad(lambda z: ft.losses.softmax_cross_entropy(z, labels) * 2.0**17))(logits)
    assert grad.dtype == dtype and np.isfinite(np.asarray(grad).astype(np.float32)).all()  # scaled by 2**17: finite
    half_p, half_e = jnp.asarray(P, dtype), jnp.asarray(E, dtype)
    rounded = [np.asarray(a).astype(dtype).astype(np.float32) for a in (P, E)]  # the rounded inputs, in NumPy
    for loss, _, _ in REGRESSION:
        value = loss(half_p, half_e)
        assert value.dtype == jnp.float32
        exact = loss(*rounded)
        np.testing.assert_allclose(float(value), float(exact), rtol=0, atol=1e-6 * max(1.0, abs(float(exact))))
    for loss, args in [(ft.losses.sigmoid_cross_entropy, (P, (E > 0.5).astype(np.float32))),
                       (ft.losses.kl_divergence, (np.full((2, 3), 1 / 3, np.float32), np.eye(3, dtype=np.float32)[:2])),
                       (ft.losses.categorical_hinge, (P, np.eye(3, dtype=np.float32)[:2])),
                       (ft.losses.poisson, (np.abs(P) + 0.5, E))]:
        assert loss(*(jnp.asarray(a, dtype) for a in args)).dtype == jnp.float32


def test_another_librarys_loss_name_names_its_equivalent():
    """`ft.losses.cross_entropy` (torch's name) was a bare AttributeError."""
    with pytest.raises(AttributeError, match=r"(?s)no attribute 'cross_entropy': its equivalent here is "
                                             r"ft.losses.softmax_cross_entropy.*right:  ft.losses.softmax_cross_entropy"):
        ft.losses.cross_entropy  # noqa: B018
    with pytest.raises(AttributeError, match=r"'sparse_categorical_crossentropy'.*ft.losses.softmax_cross_entropy"):
        ft.losses.sparse_categorical_crossentropy  # noqa: B018
    with pytest.raises(AttributeError, match=r"did you mean ft.losses.mean_squared_error\?"):
        ft.losses.mean_squared_eror  # noqa: B018
    with pytest.raises(AttributeError, match=r"no attribute 'nothing_like_it'$"):
        ft.losses.nothing_like_it  # noqa: B018
    assert not hasattr(ft.losses, "cross_entropy") and hasattr(ft.losses, "huber")
    for name, ours in ft.losses.OTHER_NAMES.items():  # every equivalent named exists
        assert ours in ft.losses.__all__, (name, ours)
    assert set(ft.losses.OTHER_CALLS) <= set(ft.losses.OTHER_NAMES)


def test_other_names_right_calls_compute_torchs_numbers():
    """Each `right:` line the other-name error shows, run as written, gives torch's number
    (before: `ft.losses.poisson(log_rate, y)` for torch's poisson_nll_loss, 0.95366 for
    0.35884; kl_divergence of log q was NaN)."""
    import jax.scipy.special  # (the binary line names jax.scipy.special.logit)
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    log_probs = np.log(rng.dirichlet(np.ones(5), size=4)).astype(np.float32)
    probs = np.exp(log_probs)
    labels = np.array([0, 3, 1, 4])
    onehot = np.eye(5, dtype=np.float32)[labels]
    log_rate, target = rng.normal(size=6).astype(np.float32), rng.poisson(2.0, size=6).astype(np.float32)
    p01, y01 = rng.uniform(0.05, 0.95, size=6).astype(np.float32), rng.integers(0, 2, 6).astype(np.float32)
    predicted, expected, beta = rng.normal(size=8).astype(np.float32) * 2, np.zeros(8, np.float32), 0.5
    ctc_log_probs = np.log(rng.dirichlet(np.ones(4), size=(6, 2))).astype(np.float32)  # torch's [T, B, C]
    ctc_labels, ctc_lengths = np.array([[1, 2, 3], [3, 3, 1]]), np.array([6, 5])
    cases = {
        "nll_loss": (dict(log_probs=log_probs, labels=labels), F.nll_loss(torch.tensor(log_probs), torch.tensor(labels))),
        "categorical_crossentropy": (dict(probs=probs, labels=onehot),
                                     -(torch.tensor(onehot) * torch.log(torch.tensor(probs))).sum(-1).mean()),
        "sparse_categorical_crossentropy": (dict(probs=probs, labels=labels),
                                            F.nll_loss(torch.log(torch.tensor(probs)), torch.tensor(labels))),
        "binary_crossentropy": (dict(probs=p01, labels=y01), F.binary_cross_entropy(torch.tensor(p01), torch.tensor(y01))),
        "kl_div": (dict(log_q=log_probs, p=probs[::-1].copy()),
                   F.kl_div(torch.tensor(log_probs), torch.tensor(probs[::-1].copy()), reduction="batchmean")),
        "poisson_nll_loss": (dict(log_rate=log_rate, target=target),
                             F.poisson_nll_loss(torch.tensor(log_rate), torch.tensor(target))),
        "smooth_l1_loss": (dict(predicted=predicted, expected=expected, beta=beta),
                           F.smooth_l1_loss(torch.tensor(predicted), torch.tensor(expected), beta=beta)),
        "ctc_loss": (dict(log_probs=ctc_log_probs, labels=ctc_labels, input_lengths=ctc_lengths, label_lengths=ctc_lengths // 2),
                     F.ctc_loss(torch.tensor(ctc_log_probs), torch.tensor(ctc_labels), torch.tensor(ctc_lengths),
                                torch.tensor(ctc_lengths // 2))),
    }
    assert set(cases) == set(ft.losses.OTHER_CALLS)
    for name, (values, reference) in cases.items():
        call = ft.losses.OTHER_CALLS[name].split("  #")[0]
        with pytest.raises(AttributeError, match=re.escape(call)):
            getattr(ft.losses, name)
        # jax.Arrays by device_put (jnp.asarray compiled a program per shape and dtype)
        names = {"ft": ft, "jnp": jnp, "jax": jax, **{k: jax.device_put(v) if isinstance(v, np.ndarray) else v
                                                       for k, v in values.items()}}
        ours = float(eval(call, names))  # the library's own message, run as a user pastes it
        np.testing.assert_allclose(ours, float(reference), rtol=0, atol=1e-6 * max(1.0, abs(float(reference))),
                                   err_msg=name)


def test_binary_cross_entropy_is_torchs_and_bce_loss_names_it():
    """`ft.losses.binary_cross_entropy` hinted `did you mean ft.losses.softmax_cross_entropy?`
    (0.805 for torch's 0.415 on probabilities [0.9, 0.2, 0.6], labels [1, 0, 0]); then it named
    sigmoid_cross_entropy of the logits. It is torch's own loss now (tests/test_losses_torch.py
    checks its numbers), and torch's class name BCELoss names it."""
    torch = pytest.importorskip("torch")
    probs, labels = np.array([0.9, 0.2, 0.6], np.float32), np.array([1.0, 0.0, 0.0], np.float32)
    want = torch.nn.functional.binary_cross_entropy(torch.tensor(probs), torch.tensor(labels)).item()
    np.testing.assert_allclose(float(ft.losses.binary_cross_entropy(probs, labels)), want, rtol=1e-6)
    with pytest.raises(AttributeError, match=r"(?s)'BCELoss': its equivalent here is ft.losses.binary_cross_entropy "
                                             r".*right:  ft.losses.binary_cross_entropy\(predicted, expected\)"):
        ft.losses.BCELoss  # noqa: B018


@pytest.mark.parametrize("name,alike,optax_name", [("sigmoid_focal_loss", "sigmoid_cross_entropy", "sigmoid_focal_loss"),
                                                   ("binary_focal_crossentropy", "binary_cross_entropy",
                                                    "sigmoid_focal_loss"),
                                                   ("dice_loss", None, "dice_loss"),
                                                   ("ntxent", None, "ntxent"),
                                                   ("triplet_semihard_loss", "triplet_margin", None)])
def test_a_loss_with_no_equivalent_says_so_instead_of_guessing_another(name, alike, optax_name):
    """`ft.losses.sigmoid_focal_loss` hinted `did you mean ft.losses.sigmoid_cross_entropy?`:
    another loss. Names with no equivalent say there is none (and name the look-alike as
    another loss); optax's loss of that kind is named where it has one, and exists."""
    import optax

    with pytest.raises(AttributeError) as e:
        getattr(ft.losses, name)
    message = str(e.value)
    assert "no loss here computes it" in message and "did you mean" not in message
    assert (f"ft.losses.{alike}, whose name looks alike, is another loss" in message) == (alike is not None)
    assert (f"optax.losses.{optax_name} (" in message) if optax_name else "optax" not in message
    assert f"right:  def {name}(predicted, expected): ..." in message
    for other in ft.losses.NO_EQUIVALENT.values():
        assert other is None or hasattr(optax.losses, other.rpartition(".")[2]), other
    assert not set(ft.losses.NO_EQUIVALENT) & (set(ft.losses.OTHER_NAMES) | set(ft.losses.__all__))


def test_hinge_losses_refuse_zero_one_labels():
    """hinge([2, -2, .3, -.4], [1, 0, 1, 0]) was 0.675 (each 0 label a constant 1), where
    Keras maps 0/1 labels to -1/1 and gives 0.325. Concrete 0/1 labels now raise, naming
    `2 * labels - 1`, which gives the -1/1 numbers (NumPy's formula); -1/1 labels, all-1
    labels and traced labels pass."""
    p, y01 = np.array([2.0, -2.0, 0.3, -0.4], np.float32), np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    signed = 2 * y01 - 1
    for loss, power in ((ft.losses.hinge, 1), (ft.losses.squared_hinge, 2)):
        name = loss.__name__
        with pytest.raises(ValueError, match=rf"(?s){name}: labels must be in {{-1, 1}}.*expected\[1\] is 0.*"
                                             rf"wrong: +ft.losses.{name}\(predicted, labels\).*"
                                             rf"right: +ft.losses.{name}\(predicted, 2 \* labels - 1\)"):
            loss(p, y01)
        with pytest.raises(ValueError, match=r"expected\[0\]\[1\] is 0"):
            loss(p.reshape(2, 2), jnp.asarray(y01).reshape(2, 2))
        reference = np.mean(np.maximum(0, 1 - signed * p) ** power)  # 0.325 for hinge: Keras's number
        np.testing.assert_allclose(loss(p, 2 * y01 - 1), reference, rtol=0, atol=1e-6)
        np.testing.assert_allclose(loss(p, np.ones(4, np.float32)), np.mean(np.maximum(0, 1 - p) ** power),
                                   rtol=0, atol=1e-6)
        traced = jax.jit(loss)(p, y01)  # not readable under jit: taken as given (documented)
        np.testing.assert_allclose(traced, np.mean(np.maximum(0, 1 - y01 * p) ** power), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ft.losses.hinge(p, signed), 0.325, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype,classes,label", [(np.uint8, 200, 156), (np.uint16, 65500, 65436)])
def test_softmax_cross_entropy_unsigned_labels_equal_to_the_wrapped_ignore_index_are_classes(dtype, classes, label):
    """The issue: in uint8 the default ignore_index=-100 wrapped to 156 (65436 in uint16), so
    real labels 156 were ignored: per example [5.632, 0., 4.984, 0.] for torch's
    [5.632, 6.143, 4.984, 5.190]."""
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(0).normal(size=(4, classes)).astype(np.float32)
    labels = np.array([3, label, 17, label], dtype)
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels.astype(np.int64)),
                                                 reduction="none").numpy()
    atol = 1e-6 * float(np.abs(expected).max())
    for given in (labels, jnp.asarray(labels)):
        np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, given, reduction="none"), expected,
                                   rtol=0, atol=atol)
    jitted = jax.jit(ft.losses.softmax_cross_entropy)(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_allclose(jitted, expected.mean(), rtol=0, atol=atol)


@pytest.mark.parametrize("dtype,classes", [(np.int8, 130), (np.uint8, 256), (np.uint16, 65536)])
def test_softmax_cross_entropy_more_classes_than_the_labels_dtype_holds(dtype, classes):
    """The issue: `labels < classes` cast the class count into the labels' dtype (130 -> -126 in
    int8, 256 -> 0 in uint8), every label was "outside": NaN for torch's 4.87."""
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(1).normal(size=(2, classes)).astype(np.float32)
    labels = np.array([1, 2], dtype)
    expected = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels.astype(np.int64))).item()
    for loss in (ft.losses.softmax_cross_entropy, jax.jit(ft.losses.softmax_cross_entropy)):
        np.testing.assert_allclose(loss(jnp.asarray(logits), jnp.asarray(labels)), expected, rtol=0, atol=1e-5)


def test_softmax_cross_entropy_ignore_index_beyond_the_labels_dtype_is_a_named_error():
    """The issue: ignore_index=2**40 with NumPy int64 labels raised JAX's raw OverflowError."""
    with pytest.raises(ValueError, match=r"(?s)ignore_index=1099511627776 does not fit JAX's labels dtype int32.*"
                                         r"np.where\(labels == 1099511627776, -100, labels\)"):
        ft.losses.softmax_cross_entropy(jnp.ones((2, 3)), np.array([1, 2**40]), ignore_index=2**40)


def test_an_ignore_index_that_is_no_python_int_is_a_named_error():
    """The issue: ignore_index=jnp.asarray(-100) (or an ignore_index traced by a jax.jit of your
    own) failed deep inside jax.jit ("Non-hashable static arguments are not supported"), and a
    string one in a comparison; each of the three cross entropies names the int to give. A
    NumPy int is read as the int it is."""
    logits, labels = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 3.0]], np.float32), np.array([0, -100, 1])
    calls = [("softmax_cross_entropy", lambda ig: ft.losses.softmax_cross_entropy(logits, labels, ignore_index=ig)),
             ("nll", lambda ig: ft.losses.nll(jax.nn.log_softmax(logits), labels, ignore_index=ig)),
             ("linear_cross_entropy", lambda ig: ft.losses.linear_cross_entropy(logits, np.eye(2, dtype=np.float32),
                                                                               labels, ignore_index=ig))]
    kept = -jax.nn.log_softmax(logits)[[0, 2], [0, 1]]
    for name, loss in calls:
        np.testing.assert_allclose(float(loss(np.int64(-100))), float(jnp.mean(kept)), rtol=0, atol=1e-6)
        for bad, fix in [(jnp.asarray(-100), r"int\(pad\)"), (np.array(-100), r"int\(pad\)"),
                         (-100.0, "-100"), (True, "None"), ("-100", "-100")]:
            with pytest.raises(TypeError, match=rf"(?s)^{name}: ignore_index must be a Python int.*"
                                                rf"right:  ft.losses.{name}\(.*ignore_index={fix}"):
                loss(bad)
        with pytest.raises(TypeError, match=rf"^{name}: ignore_index must be a Python int.*traced by jax.jit"):
            jax.jit(loss)(-100)


@pytest.mark.parametrize("delta", [0.0, -1.0, float("nan"), np.float32(0.0)])
def test_huber_refuses_a_delta_that_is_not_positive_as_torch(delta):
    """The issue: delta=0.0 silently gave a loss of 0.0, delta=-1.0 a negative loss (-2.0 for
    errors [1, 2]); torch's huber_loss refuses both."""
    torch = pytest.importorskip("torch")
    if not np.isnan(delta):
        with pytest.raises(RuntimeError, match="non-positive values for delta"):
            torch.nn.functional.huber_loss(torch.ones(2), torch.zeros(2), delta=float(delta))
    with pytest.raises(ValueError, match=r"(?s)huber: delta must be a positive number.*"
                                         r"right:  ft.losses.huber\(predicted, expected, delta=1.0\).*"
                                         r"or:  ft.losses.l1\(predicted, expected\)"):
        ft.losses.huber(jnp.array([1.0, 2.0]), jnp.zeros(2), delta=delta)


def test_smooth_l1_message_names_the_l1_loss_for_beta_zero():
    """The `right:` line huber(delta=beta) / beta divided by zero at torch's valid beta=0; the
    message named the L1 loss for it. It names ft.losses.smooth_l1 now, whose beta=0 is the L1
    loss and torch's number."""
    torch = pytest.importorskip("torch")
    with pytest.raises(AttributeError, match=r"right:  ft.losses.smooth_l1\(predicted, expected, beta=beta\)  "
                                             r"# torch's beta \(0: the L1 loss\)"):
        ft.losses.smooth_l1_loss  # noqa: B018
    predicted = np.random.default_rng(2).normal(size=8).astype(np.float32) * 2
    expected = torch.nn.functional.smooth_l1_loss(torch.from_numpy(predicted), torch.zeros(8), beta=0.0).item()
    np.testing.assert_allclose(ft.losses.smooth_l1(predicted, np.zeros(8, np.float32), beta=0.0), expected, rtol=0,
                               atol=1e-6)
    np.testing.assert_allclose(ft.losses.l1(predicted, np.zeros(8, np.float32)), expected, rtol=0, atol=1e-6)


def test_kl_div_message_computes_torchs_batchmean_for_sequences():
    """The issue: the kl_div message called kl_divergence(jnp.exp(log_q), p) torch's
    reduction='batchmean'; for [B, T, C] torch divides the sum by B alone (12.03 vs 0.752).
    The `right:` line, run as written, is torch's batchmean for [B, C] and [B, T, C]."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    for shape in [(4, 10), (4, 16, 10)]:
        log_q = np.log(rng.dirichlet(np.ones(10), size=shape[:-1])).astype(np.float32)
        p = rng.dirichlet(np.ones(10), size=shape[:-1]).astype(np.float32)
        reference = torch.nn.functional.kl_div(torch.from_numpy(log_q), torch.from_numpy(p), reduction="batchmean").item()
        call = ft.losses.OTHER_CALLS["kl_div"].split("  #")[0]
        with pytest.raises(AttributeError, match=re.escape(call)):
            ft.losses.kl_div  # noqa: B018
        ours = float(eval(call, {"ft": ft, "jnp": jnp, "log_q": jnp.asarray(log_q), "p": jnp.asarray(p)}))
        np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5 * abs(reference))


KERAS_EPSILON = np.float32(1e-7)  # keras.config.epsilon(), applied in the inputs' float32


def _keras_categorical(probs, onehot, eps=KERAS_EPSILON):
    """Keras 3's categorical_crossentropy(from_logits=False) in NumPy: renormalize, clip to
    [eps, 1 - eps] (in the inputs' float32, as Keras), then -sum(target * log) per example."""
    probs = np.clip(probs / probs.sum(-1, keepdims=True), eps, np.float32(1) - eps).astype(np.float64)
    return float(np.mean(-np.sum(onehot * np.log(probs), -1)))


def _keras_binary(probs, labels, eps=KERAS_EPSILON):
    """Keras 3's binary_crossentropy(from_logits=False) in NumPy: clip, then the mean of
    -(y log p + (1 - y) log(1 - p))."""
    probs = np.clip(probs, eps, np.float32(1) - eps)
    one_minus = (np.float32(1) - probs).astype(np.float64)  # float32's 1 - p, as Keras computes it
    return float(np.mean(-(labels * np.log(probs.astype(np.float64)) + (1 - labels) * np.log(one_minus))))


def test_keras_messages_clip_saturated_probabilities_as_keras():
    """The issue: the categorical_crossentropy message's softmax_cross_entropy(jnp.log(probs),
    labels) was NaN for probabilities [1, 0, 9e-14] (log 0), and binary_crossentropy's
    sigmoid_cross_entropy(logit(probs), labels) NaN at probabilities 1.0 and 0.0. Each `right:`
    line, run as written, is Keras's clipped number."""
    import jax.scipy.special  # (the binary line names jax.scipy.special.logit)
    probs = _softmax(np.array([[30.0, -80.0, 0.0], [0.2, 0.3, -1.0], [-90.0, 40.0, 0.0]]))
    labels = np.array([1, 0, 1])  # a class of probability 0 (16.1: -log 1e-7), one of probability 1
    onehot = np.eye(3, dtype=np.float32)[labels]
    p01 = np.array([1.0, 0.0, 0.3, 1.0, 0.0, 0.7], np.float32)
    y01 = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], np.float32)
    cases = {
        "categorical_crossentropy": (dict(probs=probs, labels=onehot), _keras_categorical(probs, onehot)),
        "sparse_categorical_crossentropy": (dict(probs=probs, labels=labels), _keras_categorical(probs, onehot)),
        "binary_crossentropy": (dict(probs=p01, labels=y01), _keras_binary(p01, y01)),
    }
    for name, (values, reference) in cases.items():
        call = ft.losses.OTHER_CALLS[name].split("  #")[0]
        names = {"ft": ft, "jnp": jnp, "jax": jax, **{k: jnp.asarray(v) for k, v in values.items()}}
        ours = float(eval(call, names))
        # float32 logs of 1e-7 (16.1) and the softmax's renormalization of the clip: 5.3e-7 measured
        np.testing.assert_allclose(ours, reference, rtol=0, atol=5e-6, err_msg=name)


def test_sigmoid_cross_entropy_refuses_labels_outside_zero_one():
    """The issue: labels -1/1 (the hinge losses') or 0/255 (an image mask) gave a number, as
    torch's binary_cross_entropy_with_logits does: logits [2, -2, 0.3, -0.4] on [1, 0, 1, 0]
    are 0.3303, on their -1/1 form -0.2697, on 0/255 -145.7. Concrete labels outside [0, 1]
    now raise; soft labels in [0, 1], bool and integer 0/1 labels are read as before."""
    logits = np.array([2.0, -2.0, 0.3, -0.4], np.float32)
    labels = np.array([1, 0, 1, 0], np.float32)
    for given, value, where in [(2 * labels - 1, "-1", r"\[1\]"), ((255 * labels).astype(np.uint8), "255", r"\[0\]")]:
        with pytest.raises(ValueError, match=rf"(?s)sigmoid_cross_entropy: labels must be probabilities in \[0, 1\].*"
                                             rf"but labels{where} is {value}\..*right: .*\(labels \+ 1\) / 2"):
            ft.losses.sigmoid_cross_entropy(logits, given)
    torch = pytest.importorskip("torch")
    expected = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(logits), torch.tensor(labels)).item()
    for given in [labels, labels.astype(bool), labels.astype(np.int64), np.array([0.9, 0.0, 1.0, 0.25], np.float32)]:
        reference = torch.nn.functional.binary_cross_entropy_with_logits(
            torch.tensor(logits), torch.tensor(given.astype(np.float32))).item()
        np.testing.assert_allclose(ft.losses.sigmoid_cross_entropy(logits, given), reference, rtol=0, atol=1e-6)
    assert abs(expected - 0.3303) < 1e-4
    # traced labels (a jit of your own, ft.train's step) cannot be read: NaN, never a number
    traced = jax.jit(lambda z, y: ft.losses.sigmoid_cross_entropy(z, y, reduction="none"))(logits, 2 * labels - 1)
    np.testing.assert_array_equal(np.isnan(traced), labels == 0)
    assert np.isnan(float(jax.jit(ft.losses.sigmoid_cross_entropy)(logits, 255 * labels)))


def test_softmax_cross_entropy_refuses_negative_probabilities():
    """The issue: a teacher's logits given as probability targets (distillation) gave a
    number, here -1.4115 where the softmax of them gives 1.7742 (torch's cross_entropy takes
    them too). Concrete negative probabilities now raise, naming jax.nn.softmax."""
    student = np.random.default_rng(1).normal(size=(4, 5)).astype(np.float32)
    teacher = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    with pytest.raises(ValueError, match=r"(?s)labels f32\[4,5\] have the logits' shape, so they are read as "
                                         r"probabilities over the 5 classes, but labels\[0, 1\] is -0\.1\d+: a "
                                         r"probability is never negative.*right: .*jax\.nn\.softmax\(teacher_logits\)"):
        ft.losses.softmax_cross_entropy(student, teacher)
    target = _softmax(teacher)
    mixed = np.where(np.arange(4)[:, None] == 2, target, teacher)  # row 2 fine
    traced = jax.jit(lambda z, y: ft.losses.softmax_cross_entropy(z, y, reduction="none"))(student, mixed)
    np.testing.assert_array_equal(np.isnan(traced), [True, True, False, True])  # traced: NaN, never a number
    torch = pytest.importorskip("torch")
    reference = torch.nn.functional.cross_entropy(torch.tensor(student), torch.tensor(target)).item()
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(student, target), reference, rtol=0, atol=1e-6)


def test_softmax_cross_entropy_names_torchs_class_axis():
    """The issue: logits in torch's layout [N, C, T] with labels [N, T] got `right:
    labels.reshape([N, C])`, wrong advice. It now names jnp.moveaxis(logits, 1, -1), whose
    loss is torch's cross_entropy of the [N, C, T] logits."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (2, 3, 5)).astype(np.float32)
    labels = rng.integers(0, 3, (2, 5))
    labels[1, 3] = -100
    with pytest.raises(ValueError, match=r"(?s)logits f32\[2,3,5\] and labels i64\[2,5\] are in torch's layout.*"
                                         r"right: +ft.losses.softmax_cross_entropy\(jnp.moveaxis\(logits, 1, -1\), labels\)"):
        ft.losses.softmax_cross_entropy(logits, labels)
    reference = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(labels)).item()
    np.testing.assert_allclose(ft.losses.softmax_cross_entropy(jnp.moveaxis(logits, 1, -1), labels), reference,
                               rtol=0, atol=1e-6)


def test_kl_divergence_refuses_log_probabilities():
    """The issue: log-probabilities (torch's kl_div input, or its log_target=True target)
    gave NaN. Concrete negative inputs now raise, naming jnp.exp(log_q)."""
    q = np.full((2, 3), 1 / 3, np.float32)
    for what, args in [("predicted", (np.log(q), q)), ("expected", (q, np.log(q)))]:
        with pytest.raises(ValueError, match=rf"(?s)kl_divergence: {what} must be probabilities.*but {what}\[0, 0\] "
                                             rf"is -1\.09861.*right: +ft.losses.kl_divergence\(jnp.exp\(log_q\), p\)"):
            ft.losses.kl_divergence(*args)


def test_poisson_refuses_log_rates():
    """The issue: torch's poisson_nll_loss takes log-rates by default; given here they were NaN
    (log-rates [-0.5, 0.3, 1.2]: torch 0.7255). Concrete negative rates now raise, naming
    jnp.exp(log_rate), which gives torch's number."""
    log_rate, target = np.array([-0.5, 0.3, 1.2], np.float32), np.array([1.0, 0.0, 3.0], np.float32)
    with pytest.raises(ValueError, match=r"(?s)poisson: predicted must be rates \(non-negative\), but predicted\[0\] "
                                         r"is -0\.5: log-rates.*right: +ft.losses.poisson\(jnp.exp\(log_rate\), target\)"):
        ft.losses.poisson(log_rate, target)
    np.testing.assert_allclose(ft.losses.poisson(jnp.exp(log_rate), target), 0.725502, rtol=0, atol=1e-6)


def _weighted_case():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 5, 7)).astype(np.float32)
    labels = rng.integers(0, 7, (3, 5))
    labels[0, :2] = labels[2, 4] = -100
    return logits, labels, rng.uniform(0.1, 3, 7).astype(np.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("ignore_index", [-100, None])
def test_softmax_cross_entropy_class_weights_equal_torchs(reduction, smoothing, ignore_index):
    """weight= is torch's CrossEntropyLoss(weight=): a position counts w[label], and the mean
    divides by the kept positions' summed w[label] (4.665166 here with -100 ignored), with
    label smoothing too (the smoothing term weighted by w[c]); loss and gradient."""
    torch = pytest.importorskip("torch")
    logits, labels, weight = _weighted_case()
    if ignore_index is None:
        labels = np.abs(labels) % 7
    kwargs = dict(weight=weight, label_smoothing=smoothing, reduction=reduction, ignore_index=ignore_index)
    z = torch.tensor(logits, requires_grad=True)
    reference = torch.nn.functional.cross_entropy(z.reshape(-1, 7), torch.tensor(labels).reshape(-1),
                                                  weight=torch.tensor(weight), label_smoothing=smoothing,
                                                  reduction=reduction)
    reference.sum().backward()
    ours = ft.losses.softmax_cross_entropy(logits, labels, **kwargs)
    # float32 sums of up to 15 terms of at most ~25: 7.6e-6 measured for "sum"
    np.testing.assert_allclose(np.asarray(ours).reshape(-1), reference.detach().numpy().reshape(-1), rtol=0,
                               atol=5e-5 if reduction == "sum" else 5e-6)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(ft.losses.softmax_cross_entropy(q, labels, **kwargs))))(logits)
    np.testing.assert_allclose(grad, z.grad.numpy(), rtol=0, atol=2e-6)  # 2.4e-7 measured


def test_softmax_cross_entropy_class_weights_with_probabilities_and_errors():
    """weight= with probability targets weighs each class term; the mean is over positions, as
    torch's. A weight that is not one float per class raises BAD_WEIGHT; every label ignored
    is a loss of 0 (torch: NaN), as without weights."""
    torch = pytest.importorskip("torch")
    logits, labels, weight = _weighted_case()
    probs = _softmax(logits[::-1])
    for smoothing in [0.0, 0.2]:
        reference = torch.nn.functional.cross_entropy(torch.tensor(logits).reshape(-1, 7), torch.tensor(probs).reshape(-1, 7),
                                                      weight=torch.tensor(weight), label_smoothing=smoothing).item()
        np.testing.assert_allclose(ft.losses.softmax_cross_entropy(logits, probs, weight=weight, label_smoothing=smoothing),
                                   reference, rtol=0, atol=5e-6)
    assert float(ft.losses.softmax_cross_entropy(logits, np.full((3, 5), -100), weight=weight)) == 0.0
    for bad in [weight[:6], weight.astype(np.int32)]:
        with pytest.raises(ValueError, match=r"(?s)weight must be one floating weight per class, f32\[7\] for logits "
                                             r"f32\[3,5,7\].*got i?\w?\d+\[\d\].*right: .*weight=jnp.asarray\(w, jnp.float32\)"):
            ft.losses.softmax_cross_entropy(logits, labels, weight=bad)


def test_sigmoid_cross_entropy_pos_weight_equals_torchs():
    """pos_weight= is torch's BCEWithLogitsLoss(pos_weight=) (one weight per class, or any
    shape that broadcasts to the labels'), saturated logits of +-80 included; loss and
    gradient. One that does not broadcast, or integer, raises BAD_POS_WEIGHT."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, (6, 5)).astype(np.float32)
    logits[0, :2] = 80.0, -80.0
    labels = (rng.random((6, 5)) > 0.5).astype(np.float32)
    labels[1] = rng.random(5)
    for pos_weight in [rng.uniform(0.2, 5, 5).astype(np.float32), np.array(2.5, np.float32)]:
        for reduction in ["mean", "none"]:
            z = torch.tensor(logits, requires_grad=True)
            reference = torch.nn.functional.binary_cross_entropy_with_logits(
                z, torch.tensor(labels), pos_weight=torch.tensor(pos_weight), reduction=reduction)
            reference.sum().backward()
            ours = ft.losses.sigmoid_cross_entropy(logits, labels, pos_weight=pos_weight, reduction=reduction)
            np.testing.assert_allclose(ours, reference.detach().numpy(), rtol=0, atol=5e-6)  # 4.8e-7 measured
            grad = jax.jit(jax.grad(lambda q, p=pos_weight, r=reduction: jnp.sum(
                ft.losses.sigmoid_cross_entropy(q, labels, pos_weight=p, reduction=r))))(logits)
            np.testing.assert_allclose(grad, z.grad.numpy(), rtol=0, atol=1e-6)
    for bad in [np.ones(4, np.float32), np.ones(5, np.int32)]:
        with pytest.raises(ValueError, match=r"(?s)pos_weight must be a floating array that broadcasts to the labels' "
                                             r"shape f32\[6,5\].*right: .*pos_weight=jnp.asarray\(w, jnp.float32\)"):
            ft.losses.sigmoid_cross_entropy(logits, labels, pos_weight=bad)


def test_causal_lm_recipe_equals_hugging_faces_labels_loss():
    """The guide's recipe, softmax_cross_entropy(logits[:, :-1], labels[:, 1:]) on a collator's
    labels (-100 on a prompt and the right padding), against the HF model's own labels= loss
    and transformers' ForCausalLMLoss: the mean, the sum over num_items_in_batch (gradient
    accumulation: reduction="sum" / n), bfloat16 logits (a float32 loss, HF's
    logits.float()) and the gradient of the logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, pad_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = ft.nn.from_hf(hf)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (3, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = mask[2, 4:] = 0
    labels = np.where(mask == 1, ids, -100)
    labels[0, :3] = -100
    with torch.no_grad():
        expected = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss.item()
    logits = jax.jit(lambda m: m(jnp.asarray(ids, jnp.int32), jnp.asarray(mask)))(model)  # one program
    recipe = lambda z, **kw: ft.losses.softmax_cross_entropy(z[:, :-1], labels[:, 1:], **kw)  # noqa: E731
    np.testing.assert_allclose(recipe(logits), expected, rtol=0, atol=5e-6)  # 0 measured; 4.8e-7 on GPT-2
    z = torch.tensor(np.asarray(logits), requires_grad=True)
    items = int((labels[:, 1:] != -100).sum()) + 5  # a batch's share of the accumulated steps' tokens
    accumulated = ForCausalLMLoss(z, torch.tensor(labels), vocab_size=64, num_items_in_batch=torch.tensor(items))
    np.testing.assert_allclose(recipe(logits, reduction="sum") / items, accumulated.item(), rtol=0, atol=5e-6)
    accumulated.backward()
    grad = jax.jit(jax.grad(lambda q: recipe(q, reduction="sum") / items))(logits)
    np.testing.assert_allclose(grad, z.grad.numpy(), rtol=0, atol=1e-7)  # 7e-10 measured, gradients ~0.07
    half = logits.astype(jnp.bfloat16)
    reference = ForCausalLMLoss(torch.tensor(np.asarray(half).astype(np.float32)).to(torch.bfloat16),
                                torch.tensor(labels), vocab_size=64).item()
    assert recipe(half).dtype == jnp.float32
    np.testing.assert_allclose(recipe(half), reference, rtol=0, atol=5e-6)


def test_weighted_losses_gradients_finite_differences():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        # jax.Arrays by device_put (jnp.asarray compiled a program per shape)
        logits = jax.device_put(rng.normal(size=(3, 4, 5)))
        labels = rng.integers(0, 5, (3, 4))
        labels[0, 0] = -100
        weight = jax.device_put(rng.uniform(0.5, 2, 5))
        probs = jax.device_put(_softmax(rng.normal(size=(3, 4, 5)), np.float64))
        for loss in [lambda z: ft.losses.softmax_cross_entropy(z, labels, label_smoothing=0.1, weight=weight),
                     lambda z: ft.losses.softmax_cross_entropy(z, probs, label_smoothing=0.1, weight=weight),
                     lambda z: ft.losses.sigmoid_cross_entropy(z, probs, pos_weight=weight)]:
            check_grads(jax.jit(loss), (logits,), order=1, modes=["rev"])


def test_an_eager_loss_is_one_compiled_program():
    # Called eagerly (a notebook's cell, an evaluation loop), a loss was one program per
    # operation, each compiled again at a new shape: 28 programs and 1.2 CPU-s for a first
    # softmax_cross_entropy of [8, 5] logits, 4.6 ms a call after. One program now (0.23 CPU-s,
    # 0.27 ms), its checks on the host; inside a jit of the caller's it is inlined.
    from _compiles import compiled

    logits = np.linspace(-2, 2, 56, dtype=np.float32).reshape(8, 7)
    labels = np.arange(8, dtype=np.int32) % 7
    with compiled() as names:
        ft.losses.softmax_cross_entropy(logits, labels, label_smoothing=0.1)
        ft.losses.mean_squared_error(logits, logits[::-1])
        ft.losses.sigmoid_cross_entropy(logits, (logits > 0).astype(np.float32), pos_weight=np.ones(7, np.float32))
    assert names == ["jit(_softmax_cross_entropy)", "jit(_reduced)", "jit(_reduced)"], names
    with compiled() as names:
        jax.jit(lambda x: ft.losses.softmax_cross_entropy(x, labels) + ft.losses.huber(x, x[::-1]))(logits)
    assert names == ["jit(<lambda>)"], names
