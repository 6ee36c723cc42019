"""Dynamic loss scaling: overflow skips the step and halves the scale; growth."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _tolerance import needs_float16_conversions

import functree as ft
import functree.optim as fo


def _model():
    return ft.nn.Dense(3, 2, key=jax.random.key(0))


X = jnp.ones((8, 3))


def test_loss_scaling_overflow_skips_and_halves():
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.adam(0.1)), initial_scale=2.0**15, growth_interval=3)
    model = _model()
    state = opt.init(model)
    step = ft.jit(lambda m, s, x: opt.minimize(lambda m, x: jnp.mean(m(x)) * x[0, 0], m, s, x))
    model1, state1, _ = step(model, state, X)
    assert float(state1.scale) == 2.0**15
    big = jnp.full((8, 3), 1e36)
    model2, state2, _ = step(model1, state1, big)
    np.testing.assert_array_equal(model2.weight, model1.weight)
    np.testing.assert_array_equal(model2.bias, model1.bias)
    assert float(state2.scale) == 2.0**14 and int(state2.skipped) == 1
    assert int(fo.context(state2).step) == 1
    np.testing.assert_array_equal(fo.moments(state2)["mu"].weight, fo.moments(state1)["mu"].weight)
    m, s = model2, state2
    for _ in range(3):
        m, s, _ = step(m, s, X)
    assert float(s.scale) == 2.0**15 and int(s.good_steps) == 0


def test_loss_scaling_gives_unscaled_gradients():
    inner = fo.Optimizer(fo.sgd(1.0))
    opt = fo.LossScaleOptimizer(inner, initial_scale=1024.0)
    p = {"w": jnp.zeros(())}
    state = opt.init(p)
    loss, grads = opt.compute_gradients(lambda p: 3.0 * p["w"] + 1.0, p, state=state)
    assert float(grads["w"]) == 3.0 and float(loss) == 1.0
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\.compute_gradients needs the optimizer state") as info:
        opt.compute_gradients(lambda p: p["w"], p)  # named get_gradients, which the user did not call
    assert "opt.compute_gradients(loss_fn, model, x, state=state)" in str(info.value)
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\.get_gradients needs the optimizer state"):
        opt.get_gradients(lambda p: p["w"], p)
    with pytest.raises(ValueError, match="initial_scale must be a finite positive number"):
        fo.LossScaleOptimizer(inner, initial_scale=0.0)


def test_loss_scale_argument_and_state_errors():
    inner = fo.Optimizer(fo.sgd(1.0))
    with pytest.raises(ValueError, match="growth_interval must be positive, got 0"):
        fo.LossScaleOptimizer(inner, growth_interval=0)
    opt = fo.LossScaleOptimizer(inner)
    p = {"w": jnp.zeros(())}
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\.update needs the optimizer state"):
        opt.update(p, inner.init(p), p)


class _Complex(ft.Module):
    z: jax.Array


def test_loss_scaling_keeps_complex_gradients_complex():
    """The unscaling ran in float32, which dropped a complex gradient's imaginary part: the
    scaled step must equal the unscaled one (scale 2**10 is exact in binary)."""
    target = jnp.asarray([0.5 - 0.2j, -0.4j], jnp.complex64)

    def loss(m):
        return jnp.sum(jnp.abs(m.z - target) ** 2)

    model = _Complex(jnp.zeros(2, jnp.complex64))
    plain = fo.Optimizer(fo.sgd(0.1))
    scaled = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1)), initial_scale=2.0**10)
    m1, s1 = model, plain.init(model)
    m2, s2 = model, scaled.init(model)
    for _ in range(3):
        m1, s1, _ = plain.minimize(loss, m1, s1)
        m2, s2, _ = scaled.minimize(loss, m2, s2)
    assert m2.z.dtype == jnp.complex64
    np.testing.assert_array_equal(np.asarray(m2.z), np.asarray(m1.z))
    assert float(jnp.abs(m2.z - target).max()) < float(jnp.abs(target).max())


@pytest.mark.parametrize("scale", [8.0, 1024.0, 2.0**15])
def test_the_scale_comes_after_transform_loss_and_reaches_a_gradient_hook(scale):
    """The scale multiplied the loss before the inner optimizer's transform_loss, giving
    grad T(s L) / s (T = l**2: s times too large; w = -183.3 where 0.82 is right), and a
    get_gradients hook saw scaled gradients (per-example clipping at t / s). Now the loss
    scale is applied last: the same step as without it."""
    w = {"w": jnp.ones(())}
    loss = lambda p, x: 3.0 * p["w"] * jnp.mean(x)  # noqa: E731
    squared = fo.Optimizer(fo.sgd(0.01), transform_loss=lambda v: v**2)
    plain, _, _ = squared.minimize(loss, w, squared.init(w), jnp.ones(2))
    scaled_opt = fo.LossScaleOptimizer(squared, initial_scale=scale)
    scaled, _, reported = scaled_opt.minimize(loss, w, scaled_opt.init(w), jnp.ones(2))
    np.testing.assert_allclose(float(plain["w"]), 0.82, rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(scaled["w"]), float(plain["w"]), rtol=0, atol=1e-6)
    assert float(reported) == 3.0  # the loss as the loss function returned it

    clip = fo.Optimizer(fo.sgd(1.0), get_gradients=fo.per_example_clipping(1.0))
    scaled_clip = fo.LossScaleOptimizer(clip, initial_scale=scale)
    x = jnp.array([1.0, 100.0])  # example gradients -1 and -100: both clipped to 1
    by_example = lambda p, x: -(p["w"] * x).mean()  # noqa: E731
    zero = {"w": jnp.zeros(())}
    expected, _, _ = clip.minimize(by_example, zero, clip.init(zero), x)
    got, _, _ = scaled_clip.minimize(by_example, zero, scaled_clip.init(zero), x)
    assert float(expected["w"]) == 1.0 and float(got["w"]) == 1.0


def test_a_hook_without_scale_and_a_hook_beside_transform_loss_are_refused():
    w = {"w": jnp.ones(())}

    def hook(loss_fn, model, *batch, has_aux=False):
        return ft.value_with_gradient(lambda m: loss_fn(m, *batch), at=model, has_aux=has_aux)

    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1), get_gradients=hook))
    with pytest.raises(TypeError, match=r"The get_gradients hook .*hook takes no scale=") as info:
        opt.minimize(lambda p, x: p["w"] * x, w, opt.init(w), jnp.float32(2.0))
    assert "def hook(loss_fn, model, *batch, has_aux=False, scale=None)" in str(info.value)
    unscaled = fo.Optimizer(fo.sgd(0.1), get_gradients=hook)  # without loss scaling the hook is used as it is
    moved, _, _ = unscaled.minimize(lambda p, x: p["w"] * x, w, unscaled.init(w), jnp.float32(2.0))
    np.testing.assert_allclose(float(moved["w"]), 0.8, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"a get_gradients hook computes the gradients itself and would ignore"):
        fo.Optimizer(fo.sgd(0.1), transform_loss=lambda v: v**2, get_gradients=hook)



def _right_code(message):
    """The code of a message's ``right:`` block, dedented to run."""
    lines = message.split("right:", 1)[1].splitlines()
    return textwrap.dedent("\n".join([" " * 12 + lines[0].strip()] + lines[1:]))


@pytest.mark.parametrize("has_aux", [False, True])
def test_the_scale_hook_in_the_message_runs_and_a_hook_returning_grads_only_is_refused(has_aux):
    """HOOK_WITHOUT_SCALE's fix read "grads of scale * loss": a hook returning the scaled loss
    reported -65536 for -2.0, one returning the gradients alone failed with a bare "not enough
    values to unpack" inside the optimizer."""
    loss_fn = lambda p, x: -(p["w"] * x).mean()  # noqa: E731
    fn = (lambda p, x: (loss_fn(p, x), {"x": x})) if has_aux else loss_fn

    def hook(loss_fn, model, *batch, has_aux=False):
        return jax.value_and_grad(loss_fn, has_aux=has_aux)(model, *batch)

    without = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(1.0), get_gradients=hook))
    w = {"w": jnp.ones(())}
    with pytest.raises(TypeError, match="takes no scale=") as info:
        without.minimize(fn, w, without.init(w), jnp.array([1.0, 3.0]), has_aux=has_aux)
    assert "(unscaled loss, grads of scale * loss)" in str(info.value)
    space = {"jax": jax}
    exec(_right_code(str(info.value)), space)
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(1.0), get_gradients=space["hook"]))
    moved, _, reported = opt.minimize(fn, w, opt.init(w), jnp.array([1.0, 3.0]), has_aux=has_aux)
    np.testing.assert_allclose(float(moved["w"]), 3.0, rtol=0, atol=1e-6)  # gradient -2, by hand
    np.testing.assert_allclose(float(reported[0] if has_aux else reported), -2.0, rtol=0, atol=1e-6)

    def grads_only(loss_fn, model, *batch, has_aux=False, scale=None):
        return jax.grad(lambda m, *b: scale * (loss_fn(m, *b)[0] if has_aux else loss_fn(m, *b)))(model, *batch)

    for model in (w, {"w": jnp.ones(()), "v": jnp.ones(())}):  # a dict of two would unpack
        bad = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(1.0), get_gradients=grads_only))
        with pytest.raises(TypeError, match=r"grads_only returned a dict; it must return the pair "
                                            r"\(unscaled loss, grads of scale \* loss\)") as info:
            bad.minimize(fn, model, bad.init(model), jnp.array([1.0, 3.0]), has_aux=has_aux)
    exec(_right_code(str(info.value)), space)  # this message's fix runs too
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(1.0), get_gradients=space["hook"]))
    moved, _, reported = opt.minimize(fn, w, opt.init(w), jnp.array([1.0, 3.0]), has_aux=has_aux)
    np.testing.assert_allclose(float(moved["w"]), 3.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(reported[0] if has_aux else reported), -2.0, rtol=0, atol=1e-6)


# ---- against torch.amp.GradScaler ------------------------------------------------------------

def _torch_scaler(init_scale, growth_interval=2000):
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)


def _clip(grads):  # ft.optim.Optimizer's docstring's hook: torch's clip_grad_value_(1.0)
    return ft.tree_map(lambda g: jnp.clip(g, -1.0, 1.0), grads)


def test_a_clip_hook_does_not_hide_an_overflow():
    """The finiteness was checked after transform_gradients: jnp.clip turned the overflowed
    inf into 1 and the step was applied (w 1 -> 0.9, scale kept at 32768, 0 skipped). torch's
    unscale_ checks before clip_grad_value_: the step is skipped and the scale halved."""
    w = torch.ones((), requires_grad=True)
    sgd = torch.optim.SGD([w], lr=0.1)
    scaler = _torch_scaler(2.0**15)
    scaler.scale(w * 1e35).backward()
    scaler.unscale_(sgd)
    torch.nn.utils.clip_grad_value_([w], 1.0)
    scaler.step(sgd)
    scaler.update()
    expected = (float(w.detach()), scaler.get_scale())
    assert expected == (1.0, 2.0**14)

    loss = lambda p, *batch: p["w"] * 1e35  # noqa: E731  (scale * loss overflows float32)
    for hook in (_clip, [_clip], ()):
        opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1), transform_gradients=hook))
        p = {"w": jnp.ones(())}
        got, state, _ = ft.jit(lambda p, s, opt=opt: opt.minimize(loss, p, s))(p, opt.init(p))
        assert (float(got["w"]), float(state.scale), int(state.skipped)) == (*expected, 1)
        assert int(fo.context(state).step) == 0
        step = ft.train.train_step(loss, opt, donate=False)
        got, state, _ = step(p, opt.init(p), (jnp.zeros(1),))
        assert (float(got["w"]), float(state.scale), int(state.skipped)) == (*expected, 1)
    # An unaggregated hook too, and RFC 234's own loop: compute_gradients then apply_gradients.
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1), transform_unaggregated_gradients=_clip))
    p = {"w": jnp.ones(())}
    state = opt.init(p)
    _, grads = opt.compute_gradients(loss, p, state=state)
    assert np.isnan(float(grads["w"]))
    got, state = opt.apply_gradients(grads, p, state)
    assert (float(got["w"]), float(state.scale), int(state.skipped)) == (*expected, 1)


def test_the_scale_stops_at_float32s_largest_power_of_two_as_torchs():
    """The scale doubled from 2**127 to inf, after which every step overflowed, was skipped,
    and inf / 2 stayed inf: training stopped for good, silently. And from 2**127 on, the
    unscaling's reciprocal (2**-127) was subnormal, flushed to zero by XLA: every gradient 0.
    torch grows only to a finite scale and unscales exactly."""
    loss = lambda p: 0.01 * jnp.sum((p["w"] - 1.0) ** 2)  # noqa: E731
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1)), initial_scale=2.0**126, growth_interval=1)
    p = {"w": jnp.zeros(2)}
    state = opt.init(p)
    step = ft.jit(lambda p, s: opt.minimize(loss, p, s))
    scales, eager = [], (p, state)
    for _ in range(6):
        p, state, _ = step(p, state)
        scales.append(float(state.scale))
    for _ in range(6):  # eagerly: XLA's division by a scalar is a product with its reciprocal there too
        eager = opt.minimize(loss, *eager)[:2]

    w = torch.zeros(2, requires_grad=True)
    sgd = torch.optim.SGD([w], lr=0.1)
    scaler = _torch_scaler(2.0**126, growth_interval=1)
    torch_scales = []
    for _ in range(6):
        sgd.zero_grad()
        scaler.scale(0.01 * ((w - 1.0) ** 2).sum()).backward()
        scaler.step(sgd)
        scaler.update()
        torch_scales.append(scaler.get_scale())
    assert scales == torch_scales == [2.0**127] * 6
    assert int(state.skipped) == 0
    # w about 0.012: the float32 steps of the same SGD differ in their last bits
    np.testing.assert_allclose(np.asarray(p["w"]), w.detach().numpy(), rtol=0, atol=1e-8)
    np.testing.assert_allclose(np.asarray(eager[0]["w"]), w.detach().numpy(), rtol=0, atol=1e-8)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e39, -1.0, 0, True, "65536", jnp.ones(2), 1j])
def test_an_initial_scale_float32_cannot_hold_is_refused(value):
    with pytest.raises(ValueError, match=r"initial_scale must be a finite positive number .* float32") as info:
        fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1)), initial_scale=value)
    assert "right:  ft.optim.LossScaleOptimizer(opt, initial_scale=2.0**16)" in str(info.value)


@pytest.mark.parametrize("value", [2.0**127, 1024, np.float32(8.0), jnp.float32(8.0)])
def test_a_finite_positive_initial_scale_is_taken(value):
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1)), initial_scale=value)
    assert float(opt.init({"w": jnp.zeros(())}).scale) == float(value)


def _torch_linear(x, y):
    torch.manual_seed(0)
    t = torch.nn.Linear(4, 3)
    model = ft.nn.load_torch_state_dict(ft.nn.Dense(4, 3, key=jax.random.key(0)),
                                        {k: v.detach().numpy() for k, v in t.state_dict().items()})
    return t, model


@needs_float16_conversions
def test_float16_compute_follows_torch_autocast_scales():
    """compute_dtype=float16: the loss came back float16 and the scale was cast to it, so any
    scale from 65536 on overflowed every step (65536, 32768, 65536, ...: 3 or 4 of 6 steps
    skipped). torch's autocast computes cross_entropy in float32: 262144, 131072, ... The
    ft.losses now compute in float32 and the scaled loss is float32: the same scales."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 8).astype(np.int32)
    t, model = _torch_linear(x, y)
    sgd = torch.optim.SGD(t.parameters(), lr=0.1)
    scaler = _torch_scaler(2.0**17, growth_interval=1)
    torch_scales = []
    for _ in range(6):
        sgd.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(t(torch.tensor(x)), torch.tensor(y).long())
        scaler.scale(loss).backward()
        scaler.step(sgd)
        scaler.update()
        torch_scales.append(scaler.get_scale())
    assert loss.dtype == torch.float32

    loss_fn = lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1])  # noqa: E731
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1)), initial_scale=2.0**17, growth_interval=1)
    step = ft.train.train_step(loss_fn, opt, donate=False, compute_dtype=jnp.float16)
    state, scales = opt.init(model), []
    for _ in range(6):
        model, state, _ = step(model, state, (x, y))
        scales.append(float(state.scale))
    assert scales == torch_scales
    assert int(state.skipped) == sum(b < a for a, b in zip([2.0**17, *scales], scales))
    # float16 forward and backward in both: rounding of 2**-11 on values of about 1
    params = {"weight": t.weight.detach().numpy().T, "bias": t.bias.detach().numpy()}
    for name, expected in params.items():
        np.testing.assert_allclose(np.asarray(getattr(model, name)), expected, rtol=0, atol=4e-3)


def test_accumulated_microbatches_overflow_at_torchs_scale():
    """accumulate=k scaled each microbatch's mean loss by the whole scale, where torch's
    recipe scales loss / k: functree overflowed at a k times smaller scale. Each microbatch
    is now scaled by scale / k: the same scales, steps and skips as torch's."""
    rng = np.random.default_rng(3)
    k, micro, steps = 2, 4, 6
    x = (rng.normal(size=(steps * k * micro, 4)) * 30).astype(np.float32)
    y = rng.integers(0, 3, steps * k * micro).astype(np.int32)
    t, model = _torch_linear(x, y)
    sgd = torch.optim.SGD(t.parameters(), lr=0.01)
    scaler = _torch_scaler(2.0**126, growth_interval=3)
    torch_scales = []
    for s in range(steps):
        sgd.zero_grad()
        for i in range(k):
            rows = slice((s * k + i) * micro, (s * k + i + 1) * micro)
            loss = torch.nn.functional.cross_entropy(t(torch.tensor(x[rows])), torch.tensor(y[rows]).long())
            scaler.scale(loss / k).backward()
        scaler.step(sgd)
        scaler.update()
        torch_scales.append(scaler.get_scale())

    loss_fn = lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1])  # noqa: E731
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.01), accumulate=k), initial_scale=2.0**126, growth_interval=3)
    step = ft.train.train_step(loss_fn, opt, donate=False)
    state, scales = opt.init(model), []
    for s in range(steps):
        rows = slice(s * k * micro, (s + 1) * k * micro)
        model, state, _ = step(model, state, (x[rows], y[rows]))
        scales.append(float(state.scale))
    assert scales == torch_scales
    assert 0 < int(state.skipped) < steps  # some overflowed, some trained
    # float32 SGD on weights of about 0.5 and gradients of about 30: a few float32 roundings
    np.testing.assert_allclose(np.asarray(model.weight), t.weight.detach().numpy().T, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model.bias), t.bias.detach().numpy(), rtol=0, atol=1e-5)


def test_a_loss_scale_optimizer_takes_an_optax_transformation_as_the_trainer_does():
    plain = ft.optim.LossScaleOptimizer(ft.optim.sgd(0.1), initial_scale=4.0)
    wrapped = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1)), initial_scale=4.0)
    w = {"w": jnp.ones(())}
    a, _, _ = plain.minimize(lambda p: p["w"] * 3.0, w, plain.init(w))
    b, _, _ = wrapped.minimize(lambda p: p["w"] * 3.0, w, wrapped.init(w))
    assert float(a["w"]) == float(b["w"]) == pytest.approx(0.7, abs=1e-6)
    with pytest.raises(TypeError, match="needs an optax GradientTransformation"):
        ft.optim.LossScaleOptimizer(0.1)


def test_float16_parameters_are_refused_as_torchs_gradscaler_does():
    # Their gradients were unscaled in float16: 2e-8 (3.3e-4 once scaled) came out 0, silently.
    opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1)))
    with pytest.raises(ValueError, match=r"(?s)parameter at head\.w is float16.*compute_dtype=jnp\.float16"):
        opt.init({"head": {"w": jnp.ones(2, jnp.float16)}, "b": jnp.ones(2)})
    # bfloat16 (float32's range) and the float32 master parameters of compute_dtype= are taken.
    for dtype in (jnp.bfloat16, jnp.float32):
        p = {"w": jnp.ones(2, dtype)}
        _, grads = opt.compute_gradients(lambda q: jnp.sum(q["w"].astype(jnp.float32) * 2e-8), p, state=opt.init(p))
        np.testing.assert_allclose(np.asarray(grads["w"], np.float32), 2e-8, atol=2e-10)  # bfloat16: 8e-11


def test_float64_gradients_are_unscaled_in_float64_under_x64():
    # They were unscaled in float32: 1 + 2**-40 came back 1, and 1e300 inf (a skipped step).
    with jax.enable_x64(True):
        opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(1.0)))
        p = {"w": jnp.ones(2, jnp.float64)}
        c = jnp.asarray([1 + 2.0**-40, 1e300], jnp.float64)
        _, grads = opt.compute_gradients(lambda q: jnp.sum(q["w"] * c), p, state=opt.init(p))
        assert grads["w"].dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(grads["w"]), np.asarray(c))  # exact: the scale is 2**15


def test_a_non_finite_loss_with_finite_gradients_is_a_step_under_ignore_as_torchs():
    """torch's GradScaler checks the gradients alone: an inf loss whose gradients are finite
    (a constant term overflowing in a float16 forward) steps, and the scale stays. Under
    on_nan="ignore" it was taken as an overflow: skipped, the scale halved."""
    opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(1.0)), initial_scale=1024.0)
    p = {"w": jnp.zeros(())}

    def loss(p):
        return 3.0 * p["w"] + ft.without_derivative(at=jnp.float32(jnp.inf))

    new, state, value = jax.jit(lambda p, s: opt.minimize(loss, p, s))(p, opt.init(p))
    assert float(value) == np.inf and float(new["w"]) == -3.0
    assert float(state.scale) == 1024.0 and int(state.skipped) == 0
    w = torch.zeros((), requires_grad=True)
    sgd = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(3.0 * w + torch.tensor(float("inf"))).backward()
    scaler.step(sgd)
    scaler.update()
    assert float(w.detach()) == -3.0 and scaler.get_scale() == 1024.0


def test_accumulated_float64_gradients_are_unscaled_in_float64():
    """accumulate=k with k no power of two: the gradients were unscaled by a float32
    reciprocal of scale / k, float32's rounding (6e-8 relative) put into every float64
    gradient; the step without loss scaling agreed to 3e-17."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        w0 = {"w": jnp.asarray(rng.normal(size=3))}
        x, y = rng.normal(size=(12, 3)), rng.normal(size=12)

        def loss(p, x, y):
            return jnp.mean((x @ p["w"] - y) ** 2)

        expected = w0["w"] - 0.1 * jax.grad(loss)(w0, x, y)["w"]  # the whole batch's step
        for k in (3, 4):
            opt = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1), accumulate=k), initial_scale=2.0**10)
            stepped = opt.minimize(loss, w0, opt.init(w0), x, y)[0]["w"]
            np.testing.assert_allclose(np.asarray(stepped), np.asarray(expected), rtol=0, atol=1e-14, err_msg=str(k))


def test_a_float16_step_without_a_loss_scale_warns():
    """compute_dtype=float16 with an optimizer that scales no loss trained silently with
    its small gradients flushed to 0 (measured: a Dense's weight gradients, 1.2e-10 in
    float32 and under a loss scale, were 0); it warns at construction, naming the LossScaleOptimizer that fixes it.
    A loss-scaled step (wrapped or not) and a bfloat16 one do not warn."""
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    loss = lambda m, b: jnp.mean(m(b) ** 2)  # noqa: E731
    with pytest.warns(fo.UnscaledFloat16Warning, match=r"(?s)compute_dtype=float16 with Optimizer, which scales no "
                      r"loss.*right:  ft\.train\.Trainer\(model, ft\.optim\.LossScaleOptimizer\(opt\)"):
        ft.train.Trainer(model, fo.Optimizer(fo.sgd(0.1)), loss, compute_dtype=jnp.float16)
    with pytest.warns(fo.UnscaledFloat16Warning):
        ft.train.train_step(loss, fo.sgd(0.1), compute_dtype="float16")
    scaled = fo.LossScaleOptimizer(fo.Optimizer(fo.sgd(0.1)))
    for opt, dtype in [(scaled, jnp.float16), (fo.OptimizerWrapper(scaled), jnp.float16),
                       (fo.Optimizer(fo.sgd(0.1)), jnp.bfloat16), (fo.Optimizer(fo.sgd(0.1)), None)]:
        ft.train.train_step(loss, opt, compute_dtype=dtype)  # no warning (the suite's warnings are errors)
