"""LayerNorm and BatchNorm: references, running statistics, gradients, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft


def _normal(seed, shape, dtype=np.float32):
    """Standard-normal input drawn by NumPy (a jax.random draw compiles programs per shape)."""
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def _x64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def test_layer_norm_matches_reference():
    ln = ft.nn.LayerNorm((3, 4), epsilon=1e-5)
    ln = ln.replace(scale=jnp.asarray(np.arange(12.0, dtype=np.float32).reshape(3, 4)),
                    offset=jnp.asarray(np.ones((3, 4), np.float32)))
    x = _normal(0, (2, 3, 4))
    mean = x.mean(axis=(1, 2), keepdims=True)
    var = x.var(axis=(1, 2), keepdims=True)
    expected = (x - mean) / np.sqrt(var + 1e-5) * np.arange(12.0).reshape(3, 4) + 1
    np.testing.assert_allclose(ln(x), expected, rtol=1e-5, atol=1e-5)


def test_layer_norm_without_scale_and_offset():
    ln = ft.nn.LayerNorm(4, use_scale=False, use_offset=False)
    assert ln.scale is None and ln.offset is None and ft.to_flat_dict(ln) == {}
    y = ln(_normal(0, (3, 4)))
    np.testing.assert_allclose(np.mean(np.asarray(y), -1), 0, atol=1e-6)


def test_layer_norm_gradient_and_error():
    with jax.enable_x64(True):
        ln = _x64(ft.nn.LayerNorm(3))
        ln = ln.replace(scale=jnp.array([1.0, 2.0, 3.0]))
        check_grads(jax.jit(lambda m, x: m(x)), (ln, _normal(0, (2, 3), np.float64)),
                    order=1, modes=["rev"])
    with pytest.raises(ft.nn.LayerInputError, match=r"LayerNorm expects inputs \[\.\.\., 3\] \(float\), got f32\[2,4\]"):
        ft.nn.LayerNorm(3)(np.ones((2, 4), np.float32))


def test_an_ensembles_norms_called_outside_vmap_are_refused():
    # scale [3, 4] on a batch of 3 rows: row i was scaled by model i's scale, silently
    layer_norms = jax.vmap(lambda s: ft.nn.LayerNorm(4).replace(scale=s))(jnp.arange(12.0).reshape(3, 4))
    rms_norms = jax.vmap(lambda s: ft.nn.RMSNorm(4).replace(scale=s))(jnp.arange(12.0).reshape(3, 4))
    for norms, name in ((layer_norms, "LayerNorm"), (rms_norms, "RMSNorm")):
        with pytest.raises(ft.nn.LayerInputError, match=rf"{name} holds scale f32\[3,4\], but one {name}'s scale has 1 axis"):
            norms(jnp.ones((3, 4)))


def test_an_ensembles_group_and_batch_norms_called_outside_vmap_are_refused():
    # GroupNorm's scale [3, 3] on x [2, 3, 3]: position i scaled by model i's, silently;
    # BatchNorm's [3, 3] statistics: JAX's "cannot reshape array of shape (3, 3)".
    scales = jnp.arange(1.0, 10.0).reshape(3, 3)
    group_norms = jax.vmap(lambda s: ft.nn.GroupNorm(1, 3).replace(scale=s))(scales)
    batch_norms = jax.vmap(lambda s: ft.nn.BatchNorm(3).replace(scale=s))(scales)
    x = _normal(0, (2, 3, 3))
    for norms, name in ((group_norms, "GroupNorm"), (batch_norms, "BatchNorm")):
        with pytest.raises(ft.nn.LayerInputError, match=rf"{name} holds scale f32\[3,3\], but one {name}'s scale "
                                                        r"has 1 axis(.|\n)*jax.vmap\(lambda m: m\(x\)\)\(models\)"):
            norms(x)
    with pytest.raises(ft.nn.LayerInputError, match=r"BatchNorm at <root> holds scale f32\[3,3\]"):
        ft.nn.collect_state(lambda m: m(x), ft.nn.training(batch_norms))
    right = jax.vmap(lambda m: m(x))(group_norms)     # the fix: model 1 on its own
    np.testing.assert_allclose(right[1], ft.nn.GroupNorm(1, 3).replace(scale=scales[1])(x), rtol=1e-6, atol=1e-6)


def test_batch_norm_training_matches_reference_and_records_statistics():
    bn = ft.nn.BatchNorm(3, momentum=0.9, epsilon=1e-3)
    bn = bn.replace(scale=jnp.array([1.0, 2.0, 3.0]), offset=jnp.array([0.0, 1.0, -1.0]))
    x = _normal(0, (4, 5, 3)) * 2 + 1
    y, updates = ft.nn.collect_state(lambda m: m(x), ft.nn.training(bn))
    mean, var = x.mean(axis=(0, 1)), x.var(axis=(0, 1))
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-3) * [1, 2, 3] + [0, 1, -1], rtol=1e-4, atol=1e-4)
    new = ft.nn.apply_state(bn, updates)
    np.testing.assert_allclose(new.running_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.running_variance, 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
    assert set(map(str, updates)) == {".running_mean", ".running_variance"}


def test_batch_norm_inference_uses_running_statistics():
    bn = ft.nn.BatchNorm(2, epsilon=0.0).replace(
        running_mean=jnp.array([1.0, -1.0]), running_variance=jnp.array([4.0, 0.25]))
    x = jnp.array([[3.0, 0.0]])
    np.testing.assert_allclose(bn(x), [[1.0, 2.0]], rtol=1e-5, atol=1e-6)
    _y, updates = ft.nn.collect_state(lambda m: m(x), bn)
    assert updates == {}


def test_batch_norm_other_axis():
    bn = ft.nn.training(ft.nn.BatchNorm(3, axis=1))
    x = _normal(0, (4, 3, 5))
    y, _ = ft.nn.collect_state(lambda m: m(x), bn)
    np.testing.assert_allclose(np.mean(np.asarray(y), axis=(0, 2)), 0, atol=1e-5)
    with pytest.raises(ft.nn.LayerInputError, match=r"BatchNorm expects inputs with 3 features at axis 1 \(float\), got f32\[4,2,5\]"):
        ft.nn.inference(bn)(np.ones((4, 2, 5), np.float32))


def test_running_statistics_are_not_parameters():
    bn = ft.nn.BatchNorm(2)
    view = ft.parameters(bn)
    assert view.running_mean is None and view.running_variance is None
    x = jnp.array([[1.0, 2.0], [3.0, 5.0]])
    grads = ft.gradient(lambda m: jnp.sum(ft.nn.collect_state(lambda t: t(x), ft.nn.training(m))[0] ** 3), at=bn)
    assert grads.running_mean is None and grads.scale.shape == (2,)


def test_batch_norm_training_gradient_finite_differences():
    with jax.enable_x64(True):
        bn = _x64(ft.nn.training(ft.nn.BatchNorm(2)))
        bn = bn.replace(scale=jnp.array([1.5, 0.5]), offset=jnp.array([0.1, 0.2]))
        x = _normal(0, (4, 2), np.float64)
        check_grads(jax.jit(lambda m, x: jnp.sum(jnp.sin(ft.nn.collect_state(lambda t: t(x), m)[0]))), (bn, x),
                    order=1, modes=["rev"])


def test_batch_norm_wrong_features_is_an_error():
    with pytest.raises(ft.nn.LayerInputError, match=r"BatchNorm expects inputs \[\.\.\., 3\] \(float\), got f32\[8,2\]"):
        ft.nn.BatchNorm(3)(np.ones((8, 2), np.float32))


@pytest.mark.parametrize("make", [lambda: ft.nn.LayerNorm(64), lambda: ft.nn.RMSNorm(64),
                                  lambda: ft.nn.GroupNorm(4, 64), lambda: ft.nn.training(ft.nn.BatchNorm(64))],
                         ids=["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"])
def test_bfloat16_statistics_are_computed_in_float32(make):
    """The issue: bfloat16 statistics at input mean 100 gave an error of 0.184 (Equinox, Flax: 0.008)."""
    layer = make()
    x = 100.0 + _normal(0, (8, 64))
    x16 = x.astype(jnp.bfloat16)
    y16, _ = ft.nn.collect_state(lambda m: m(x16), layer)
    reference, _ = ft.nn.collect_state(lambda m: m(x16.astype(jnp.float32)), layer)
    assert y16.dtype == jnp.bfloat16
    error = float(np.max(np.abs(np.asarray(y16, np.float32) - np.asarray(reference))))
    assert error < 0.02, error  # bfloat16 rounding of outputs of size ~2: <= 2**-7


def test_batch_norm_bfloat16_running_statistics_stay_float32():
    bn = ft.nn.training(ft.nn.BatchNorm(2, momentum=0.0))
    x = (100.0 + np.array([[0.0, 1.0], [1.0, 3.0]], np.float32)).astype(jnp.bfloat16)
    _, updates = ft.nn.collect_state(lambda m: m(x), bn)
    new = ft.nn.apply_state(bn, updates)
    assert new.running_mean.dtype == jnp.float32
    np.testing.assert_allclose(new.running_mean, [100.5, 102.0], rtol=1e-6)
    np.testing.assert_allclose(new.running_variance, [0.25, 1.0], rtol=1e-5)


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_float16_running_statistics_are_blended_in_float32_as_torchs(momentum):
    """A float16 BatchNorm's running statistics are stored in float16 (torch's buffers too),
    but each step's blend rounded at every operation in float16 (1/n, 1 - 1/n, each product,
    the sum): after 20 batches the statistics were 0.004-0.008 off torch's (values ~5, one or
    two float16 spacings), and over 300 batches 2.5-4x further from the true mean than torch's.
    Blended in float32 and rounded once, as torch does: torch's float16 statistics exactly,
    still stored in float16."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    fm = ft.nn.training(ft.nn.BatchNorm(3, momentum=momentum, epsilon=1e-5, unbiased_running_variance=True,
                                        dtype=jnp.float16))
    tm = torch.nn.BatchNorm1d(3, momentum=None if momentum is None else 1 - momentum).half()
    for _ in range(20):
        x = rng.normal(5.0, 2.0, size=(6, 3)).astype(np.float16)
        fm = _train_once(fm, jnp.asarray(x))
        tm(torch.tensor(x))
    assert fm.running_mean.dtype == fm.running_variance.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(fm.running_mean, np.float32), tm.running_mean.float().numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(fm.running_variance, np.float32), tm.running_var.float().numpy(), rtol=0, atol=0)


def test_rms_norm_matches_reference_and_gradients():
    norm = ft.nn.RMSNorm((2, 3), epsilon=1e-6)
    norm = norm.replace(scale=jnp.asarray(np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3)))
    x = _normal(0, (4, 2, 3), np.float64)
    expected = x / np.sqrt(np.mean(x**2, axis=(1, 2), keepdims=True) + 1e-6) * np.arange(1.0, 7.0).reshape(2, 3)
    np.testing.assert_allclose(norm(x.astype(np.float32)), expected, rtol=1e-5, atol=1e-6)
    assert ft.nn.RMSNorm(3, use_scale=False).scale is None
    with jax.enable_x64(True):
        check_grads(jax.jit(lambda m, x: m(x)), (_x64(norm), jnp.asarray(x)), order=1, modes=["rev"])
    with pytest.raises(ft.nn.LayerInputError, match=r"RMSNorm expects inputs \[\.\.\., 2, 3\] \(float\), got f32\[4,3,2\]"):
        norm(np.ones((4, 3, 2), np.float32))


def _group_norm_reference(x, groups, scale, offset, epsilon):
    n, channels = x.shape[0], x.shape[-1]
    g = x.reshape(n, -1, groups, channels // groups)
    mean = g.mean(axis=(1, 3), keepdims=True)
    var = g.var(axis=(1, 3), keepdims=True)
    return ((g - mean) / np.sqrt(var + epsilon)).reshape(x.shape) * scale + offset


def test_group_norm_matches_reference_and_gradients():
    scale, offset = np.linspace(0.5, 2.0, 6), np.linspace(-1.0, 1.0, 6)
    norm = ft.nn.GroupNorm(3, 6, epsilon=1e-5).replace(scale=jnp.asarray(scale, jnp.float32),
                                                        offset=jnp.asarray(offset, jnp.float32))
    x = _normal(0, (2, 4, 5, 6), np.float64) * 3 + 1
    expected = _group_norm_reference(x, 3, scale, offset, 1e-5)
    np.testing.assert_allclose(norm(x.astype(np.float32)), expected, rtol=1e-5, atol=1e-5)
    # groups=1 over [batch, channels] is LayerNorm; groups=channels normalizes each channel alone
    x2 = _normal(1, (3, 6))
    np.testing.assert_allclose(ft.nn.GroupNorm(1, 6)(x2), ft.nn.LayerNorm(6)(x2), rtol=1e-5, atol=1e-6)
    with jax.enable_x64(True):
        check_grads(jax.jit(lambda m, x: m(x)), (_x64(norm), jnp.asarray(x[:, :2, :2])), order=1, modes=["rev"])


def test_group_norm_errors():
    with pytest.raises(ValueError, match=r"(?s)channels \(6\) must be divisible by groups \(4\).*ft.nn.GroupNorm\(3, 6\)"):
        ft.nn.GroupNorm(4, 6)
    with pytest.raises(ft.nn.LayerInputError, match=r"GroupNorm expects inputs \[batch, \.\.\., 6\] \(float\), got f32\[6\]"):
        ft.nn.GroupNorm(3, 6)(np.ones(6, np.float32))
    with pytest.raises(ft.nn.LayerInputError, match=r"GroupNorm expects inputs \[batch, \.\.\., 6\] \(float\), got f32\[2,4\]"):
        ft.nn.GroupNorm(3, 6)(np.ones((2, 4), np.float32))


def test_batch_norm_in_torchs_argument_order_is_refused_at_construction():
    # torch's BatchNorm1d(8, 1e-5, 0.1) put a float in axis: the call failed with
    # "tuple indices must be integers or slices, not float".
    with pytest.raises(TypeError, match=r"(?s)axis must be an int, got 1e-05.*epsilon=1e-5, momentum=0.9"):
        ft.nn.BatchNorm(8, 1e-5, 0.1)
    assert ft.nn.BatchNorm(3, np.int64(0)).axis == 0  # an integer scalar is an int


def test_batch_norm_unbiased_running_variance_trains_as_torchs():
    # torch's running_var takes the unbiased batch variance: with the biased one (ft's default)
    # and 4 rows a batch it ended 25% above ft's, eval outputs 15% apart; no flag reached it
    torch = pytest.importorskip("torch")
    bn = torch.nn.BatchNorm1d(3)
    f = ft.nn.training(ft.nn.BatchNorm(3, momentum=0.9, epsilon=1e-5, unbiased_running_variance=True))
    for x in np.random.default_rng(0).normal(size=(2, 4, 3)).astype(np.float32) * 2:
        expected = bn(torch.tensor(x)).detach().numpy()
        y, updates = ft.nn.collect_state(lambda m, x=x: m(jnp.asarray(x)), f)
        f = ft.nn.apply_state(f, updates)
        # float32 rounding of values up to 3: 4.8e-7 measured over 5 seeds and 3 steps
        np.testing.assert_allclose(y, expected, rtol=0, atol=4e-6)
    np.testing.assert_allclose(f.running_variance, bn.running_var.numpy(), rtol=0, atol=4e-6)
    np.testing.assert_allclose(f.running_mean, bn.running_mean.numpy(), rtol=0, atol=4e-6)
    with pytest.raises(ValueError, match=r"(?s)needs more than one value per feature: f32\[1,3\] gives 1 at axis -1"):
        ft.nn.collect_state(lambda m: m(np.ones((1, 3), np.float32)), f)


def test_a_channels_first_batch_gets_the_move_for_batch_and_group_norm():
    """torch's NCHW / NCL batches: the fix said "build the layer for the size you have (last
    axis 5)", which normalizes the width as channels. It names the move now (and BatchNorm's
    axis=1), and following either gives torch's numbers."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=(2, 3, 5, 5)).astype(np.float32)
    bn = ft.nn.BatchNorm(3, epsilon=1e-5)
    with pytest.raises(ft.nn.LayerInputError, match=r"\(torch's NCHW\)\. ft\.nn\.BatchNorm takes channels last: "
                       r"jnp\.moveaxis\(x, -3, -1\), or normalize that axis: ft\.nn\.BatchNorm\(3, axis=1\)"):
        bn(jnp.asarray(x))
    expected = torch.nn.BatchNorm2d(3)(torch.tensor(x)).detach().numpy()  # training: batch statistics
    moved = ft.nn.collect_state(lambda m: m(jnp.asarray(np.moveaxis(x, -3, -1))), ft.nn.training(bn))[0]
    in_place = ft.nn.collect_state(lambda m: m(jnp.asarray(x)), ft.nn.training(bn.replace(axis=1)))[0]
    np.testing.assert_allclose(np.moveaxis(np.asarray(moved), -1, -3), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(in_place, expected, rtol=0, atol=1e-5)

    y = np.random.default_rng(1).normal(size=(2, 4, 7)).astype(np.float32)
    gn = ft.nn.GroupNorm(2, 4)
    with pytest.raises(ft.nn.LayerInputError, match=r"\(torch's NCL\)\. ft\.nn\.GroupNorm takes channels last: "
                       r"jnp\.moveaxis\(x, -2, -1\)\.$"):
        gn(jnp.asarray(y))
    expected = torch.nn.GroupNorm(2, 4)(torch.tensor(y)).detach().numpy()
    np.testing.assert_allclose(np.moveaxis(np.asarray(gn(jnp.asarray(np.moveaxis(y, -2, -1)))), -1, -2), expected,
                               rtol=0, atol=1e-5)
    with pytest.raises(ft.nn.LayerInputError, match=r"build the layer for the size you have \(last axis 5\)"):
        gn(np.ones((2, 7, 5), np.float32))  # channels last, just another count: the old fix stands


@pytest.mark.parametrize("axis", [-5, 4])
def test_a_batch_norm_axis_outside_the_input_is_refused_not_wrapped(axis):
    """axis=-5 on a 4-axis input was read as axis 3 (``-5 % 4``), silently normalizing the
    last axis when its size matched; now refused as the positive axis 4 already was, naming
    the axes there are."""
    x = np.ones((2, 3, 5, 4), np.float32)
    with pytest.raises(ft.nn.LayerInputError, match=rf"Its axis {axis} is outside an input of 4 axes \(axes -4 \.\. 3"
                       r"(.|\n)*right:  ft.nn.BatchNorm\(4, axis=3\)"):
        ft.nn.training(ft.nn.BatchNorm(4, axis=axis))(x)
    assert ft.nn.BatchNorm(2, axis=-4)(np.ones((2, 3, 5, 4), np.float32)).shape == (2, 3, 5, 4)


@pytest.mark.parametrize("make", [ft.nn.LayerNorm, ft.nn.RMSNorm])
def test_a_numpy_int_normalized_shape_is_taken_as_torchs_is(make):
    """``LayerNorm(np.int64(4))`` raised "'numpy.int64' object is not iterable" (torch takes it)."""
    assert make(np.int64(4)).shape == (4,) and make([np.int64(2), 4]).shape == (2, 4)
    assert type(make(np.int64(4)).shape[0]) is int


def test_rms_norm_epsilon_none_is_torchs_eps_none():
    """torch's RMSNorm(eps=None), its default, adds the input dtype's machine epsilon;
    ``epsilon=None`` raised "float() argument must be ... not 'NoneType'". On inputs of rms
    1e-4 (mean square 1e-8, under float32's 1.19e-7) the epsilon decides the output."""
    torch = pytest.importorskip("torch")
    x = (_normal(0, (3, 4)) * 1e-4).astype(np.float32)
    expected = torch.nn.RMSNorm(4, elementwise_affine=False)(torch.tensor(x)).numpy()
    actual = np.asarray(ft.nn.RMSNorm(4, epsilon=None, use_scale=False)(x))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6 * float(np.abs(expected).max()))
    assert np.abs(np.asarray(ft.nn.RMSNorm(4, use_scale=False)(x)) - expected).max() > 0.1  # 1e-6 is another layer


@pytest.mark.parametrize("training", [False, True])
def test_parameter_view_called_as_a_model_names_the_fix(training):
    # audit 27: ft.parameters(net)(x) (what optax.apply_updates(ft.parameters(net), u) kept as
    # the model gives) failed inside BatchNorm with "'NoneType' object has no attribute 'astype'"
    from functree._parameters import VIEW_CALLED

    net = ft.nn.Sequential(ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.BatchNorm(3, training=training))
    x = jnp.asarray(_normal(0, (4, 2)))
    with pytest.raises(TypeError) as e:
        ft.parameters(net)(x)
    assert str(e.value) == VIEW_CALLED.format(layer="BatchNorm", field="running_mean")
    # the right lines run and give the model's own output
    import optax
    updates = jax.tree.map(jnp.zeros_like, ft.parameters(net))
    model = ft.with_parameters(net, optax.apply_updates(ft.parameters(net), updates))
    moved = ft.move(net, along=updates)
    if not training:
        np.testing.assert_array_equal(model(x), net(x))
        np.testing.assert_array_equal(moved(x), net(x))


@pytest.mark.parametrize("unbiased", [False, True])
def test_batch_norm_training_on_one_value_per_feature_is_refused_as_torchs(unbiased):
    """torch refuses ("Expected more than 1 value per channel when training"); ours gave the
    offset for every input and a zero input gradient (the batch variance 0), and recorded
    that batch as the running statistics. A per-example vmap keeps collect_state's error (its fix)."""
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        torch.nn.BatchNorm1d(3).train()(torch.ones(1, 3))
    bn = ft.nn.training(ft.nn.BatchNorm(3, unbiased_running_variance=unbiased))
    why = "divides by count - 1" if unbiased else "every output would be the offset"
    for x in (np.ones((1, 3), np.float32), np.ones((1, 1, 1, 3), np.float32)):
        with pytest.raises(ValueError, match=rf"(?s)needs more than one value per feature: f32\[[1,]+3\] gives 1 .*{why}"
                                             r".*right:  ft\.nn\.training\(bn\)\(x_batch\)"):
            ft.nn.collect_state(lambda m, x=x: m(x), bn)
    y, _ = ft.nn.collect_state(lambda m: m(np.ones((2, 1, 3), np.float32)), bn)  # two values per feature: fine
    assert y.shape == (2, 1, 3)
    assert ft.nn.inference(bn)(np.ones((1, 3), np.float32)).shape == (1, 3)  # the running statistics: fine


def test_instance_norms_torch_momentum_none_is_refused_by_name():
    """torch's InstanceNorm momentum=None (F.instance_norm's 0.0: the running statistics never
    updated) raised float()'s bare TypeError here; the fix names ft's momentum=1.0."""
    with pytest.raises(TypeError, match=r"(?s)momentum=None is torch's .*right:  ft\.nn\.\w+\(3, momentum=1\.0\)"):
        ft.nn.InstanceNorm2D(3, momentum=None)


def _trained_on(model, x):
    """``model`` after one training forward on ``x``: its recorded state written back."""
    return ft.nn.apply_state(model, ft.nn.collect_state(lambda m: m(x), model)[1])


_train_once = jax.jit(_trained_on)


def test_momentum_none_is_torchs_cumulative_average_trained_loaded_and_saved():
    """torch's BatchNorm2d(momentum=None) keeps the plain mean of every training batch's
    statistics (batch n weighed 1/n, n its num_batches_tracked); it was refused by name here.
    Now ft.nn.BatchNorm(c, momentum=None) counts its batches in batches_tracked: torch's
    running statistics in float64 after every batch (measured 4e-15 at values ~1) and its
    eval outputs; the count is read from torch's state dict (dropped, a loaded model's next
    batch weighed 1 instead of 1/4: running mean 0.4 away) and written back."""
    torch = pytest.importorskip("torch")
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        tm = torch.nn.BatchNorm2d(3, momentum=None).double()
        fm = ft.nn.training(ft.nn.BatchNorm(3, momentum=None, epsilon=1e-5, unbiased_running_variance=True,
                                            dtype=jnp.float64))
        assert fm.batches_tracked.dtype == jnp.int32 and int(fm.batches_tracked) == 0
        batches = [rng.normal(loc=i, scale=i + 1, size=(4, 3, 5, 5)) for i in range(4)]
        for x in batches[:3]:
            tm(torch.tensor(x))
            fm = _train_once(fm, jnp.asarray(x.transpose(0, 2, 3, 1)))
            for ours, theirs in ((fm.running_mean, tm.running_mean), (fm.running_variance, tm.running_var)):
                np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-13)
            assert int(fm.batches_tracked) == int(tm.num_batches_tracked)
        tm.eval()
        np.testing.assert_allclose(ft.nn.inference(fm)(jnp.asarray(batches[0].transpose(0, 2, 3, 1))),
                                   tm(torch.tensor(batches[0])).detach().numpy().transpose(0, 2, 3, 1), rtol=0, atol=1e-12)
        tm.train()
        fresh = ft.nn.BatchNorm(3, momentum=None, epsilon=1e-5, unbiased_running_variance=True, dtype=jnp.float64)
        loaded = ft.nn.training(ft.nn.load_torch_state_dict(fresh, tm.state_dict()))
        assert int(loaded.batches_tracked) == 3
        tm(torch.tensor(batches[3]))
        loaded = _train_once(loaded, jnp.asarray(batches[3].transpose(0, 2, 3, 1)))
        np.testing.assert_allclose(loaded.running_mean, tm.running_mean.numpy(), rtol=0, atol=1e-13)
        written = ft.nn.torch_state_dict(loaded, numpy=True)
        assert int(written["num_batches_tracked"]) == 4
        back = torch.nn.BatchNorm2d(3, momentum=None).double()
        back.load_state_dict(ft.nn.torch_state_dict(loaded))
        assert int(back.num_batches_tracked) == 4
        # a float momentum reads no count (torch writes one for every BatchNorm): dropped, as before
        plain = ft.nn.load_torch_state_dict(ft.nn.BatchNorm(3, momentum=0.9, epsilon=1e-5, dtype=jnp.float64),
                                            tm.state_dict())
        assert plain.batches_tracked is None and "num_batches_tracked" not in ft.nn.torch_state_dict(plain, numpy=True)
        # given the module, its momentum=None is an option compared (an InstanceNorm's is ft's momentum=1.0)
        with pytest.raises(ValueError, match=r"(?s)torch's momentum=None, the model's momentum=0\.9.*"
                                             r"right:  ft\.nn\.BatchNorm\(\.\.\., momentum=None\)"):
            ft.nn.load_torch_state_dict(ft.nn.BatchNorm(3, momentum=0.9, epsilon=1e-5, unbiased_running_variance=True,
                                                        dtype=jnp.float64), tm)
        with pytest.raises(ValueError, match=r"right:  ft\.nn\.InstanceNorm2D\(\.\.\., momentum=1\.0\)"):
            ft.nn.load_torch_state_dict(ft.nn.InstanceNorm2D(3, momentum=0.9, track_running_stats=True, epsilon=1e-5),
                                        torch.nn.InstanceNorm2d(3, momentum=None, track_running_stats=True))


def test_momentum_none_counts_each_microbatch_and_restores_its_count(tmp_path):
    """Under accumulate=k a step runs k forwards, as torch's k calls: the count is threaded
    through the microbatches with the statistics (2 after one step of 2 microbatches, each
    weighed 1/n), and a checkpoint keeps it; a layer given momentum=None after it was built
    with a float one has no count, and training it names the fix (NO_COUNT)."""
    from functree.nn._normalization import NO_COUNT
    from tests._errors import raises_named

    model = ft.nn.training(ft.nn.Sequential(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2, momentum=None)))
    x = jnp.asarray(_normal(1, (8, 3)))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.01), accumulate=2)
    step = ft.train.train_step(lambda m, b: jnp.mean(m(b) ** 2), opt, donate=False)
    out, _, _ = step(model, opt.init(model), x)
    bn = out.layers[1]
    assert int(bn.batches_tracked) == 2
    h = np.asarray(model.layers[0](x))
    expected = (h[:4].mean(0) + h[4:].mean(0)) / 2  # batch 1 weighed 1, batch 2 weighed 1/2
    np.testing.assert_allclose(bn.running_mean, expected, rtol=0, atol=1e-6 * np.abs(h).max())
    ft.train.save(tmp_path / "bn", out)
    restored = ft.train.load(tmp_path / "bn", model)
    assert int(restored.layers[1].batches_tracked) == 2
    late = ft.nn.training(ft.nn.BatchNorm(2)).replace(momentum=None)
    raises_named(lambda: ft.nn.collect_state(lambda m: m(x[:, :2]), late), TypeError,
                 NO_COUNT, "bn.replace(momentum=None, batches_tracked=jnp.asarray(n, jnp.int32))")


def test_batch_norm_without_running_statistics_is_torchs_track_running_stats_false():
    """torch's BatchNorm2d(track_running_stats=False) normalizes with the batch's statistics in
    eval too and its state dict holds no running statistics: the load was refused with
    strict=False as its fix, which kept 0 and 1 and gave other numbers in inference. Now the
    layer is ft.nn.BatchNorm(c, track_running_stats=False), torch's in float64 (values ~1:
    measured 4e-16), trained or not, recording nothing; the load error names it."""
    torch = pytest.importorskip("torch")
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        tm = torch.nn.BatchNorm2d(4, track_running_stats=False).double()
        with torch.no_grad():
            tm.weight.copy_(torch.tensor(rng.uniform(0.5, 2, 4)))
            tm.bias.copy_(torch.tensor(rng.uniform(-1, 1, 4)))
        x = rng.normal(size=(3, 4, 5, 5))
        assert sorted(tm.state_dict()) == ["bias", "weight"]
        with pytest.raises(ValueError, match=r"(?s)no running statistics.*right:  ft\.nn\.BatchNorm\(features, track_running_stats=False\)"):
            ft.nn.load_torch_state_dict(ft.nn.BatchNorm(4, axis=1, dtype=jnp.float64), tm.state_dict())
        bn = ft.nn.load_torch_state_dict(
            ft.nn.BatchNorm(4, axis=1, epsilon=1e-5, dtype=jnp.float64, track_running_stats=False), tm.state_dict())
        assert bn.running_mean is None and bn.running_variance is None
        forward = jax.jit(lambda m, x: m(x))
        for mode, torch_mode in ((ft.nn.inference, tm.eval), (ft.nn.training, tm.train)):
            torch_mode()
            want = tm(torch.tensor(x)).detach().numpy()
            np.testing.assert_allclose(forward(mode(bn), x), want, rtol=0, atol=1e-13)
        _, updates = ft.nn.collect_state(lambda m: m(x), ft.nn.training(bn))
        assert updates == {}
        with pytest.raises(ValueError, match="needs more than one value per feature"):  # torch refuses it in eval too
            bn(x[:1, :, :1, :1])


@pytest.mark.parametrize("track", [True, False])
def test_batch_norm_without_scale_and_offset_is_torchs_affine_false(track):
    """torch's BatchNorm2d(c, affine=False): its state dict (no weight or bias) loads into
    use_scale=False, use_offset=False; training and eval outputs, the input's gradient and the
    running statistics are torch's in float64 (measured 4.4e-16 of their magnitude)."""
    torch = pytest.importorskip("torch")
    module = torch.nn.BatchNorm2d(3, affine=False, track_running_stats=track, momentum=0.3, dtype=torch.float64)
    if track:
        module.running_mean.uniform_(-1, 1)
        module.running_var.uniform_(0.5, 2)
    x = np.random.default_rng(0).normal(size=(4, 3, 2, 5)) * 3 + 1
    with jax.enable_x64(True):
        bn = ft.nn.BatchNorm(3, axis=1, momentum=0.7, epsilon=1e-5, unbiased_running_variance=True, use_scale=False,
                             use_offset=False, track_running_stats=track, dtype=jnp.float64)
        bn = ft.nn.load_torch_state_dict(bn, module)
        assert bn.scale is None and bn.offset is None
        assert set(ft.nn.torch_state_dict(bn)) == ({"running_mean", "running_var"} if track else set())
        cotangent = np.random.default_rng(1).normal(size=x.shape)
        y, updates, grad, inferred = _trained_and_inferred(bn, jnp.asarray(x), jnp.asarray(cotangent))
        tx = torch.tensor(x, requires_grad=True)
        expected = module.train()(tx)
        expected.backward(torch.tensor(cotangent))
        for got, want in ((y, expected.detach()), (grad, tx.grad)):
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-13 * np.abs(want.numpy()).max())
        if track:
            trained = ft.nn.apply_state(bn, updates)
            for got, want in ((trained.running_mean, module.running_mean), (trained.running_variance, module.running_var)):
                np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-14)
            want = module.eval()(torch.tensor(x)).detach().numpy()
            np.testing.assert_allclose(inferred, want, rtol=0, atol=1e-13 * np.abs(want).max())


@jax.jit
def _trained_and_inferred(bn, x, cotangent):  # one program (op by op in float64: 1.7 s)
    (y, updates), vjp = jax.vjp(lambda x: ft.nn.collect_state(lambda m: m(x), ft.nn.training(bn)), x)
    (grad,) = vjp((cotangent, jax.tree.map(jnp.zeros_like, updates)))
    inferred = ft.nn.apply_state(bn, updates)(x) if bn.track_running_stats else None
    return y, updates, grad, inferred


def test_a_batch_norm_holding_no_array_normalizes_any_feature_count_as_torchs():
    """No scale, offset or running statistics: nothing holds the feature count, and torch's
    BatchNorm1d(4, affine=False, track_running_stats=False) takes 6 features too."""
    bn = ft.nn.BatchNorm(4, use_scale=False, use_offset=False, track_running_stats=False)
    x = jnp.arange(12.0).reshape(2, 6)
    np.testing.assert_allclose(bn(x), jnp.broadcast_to(jnp.array([-1.0, 1.0])[:, None], (2, 6)), atol=1e-3)
    with pytest.raises(ft.nn.LayerInputError):  # an array held: its count checked
        ft.nn.BatchNorm(4, use_scale=False)(x)


def test_update_bn_is_torchs_swa_update_bn_and_keeps_the_rest_of_the_model():
    """torch.optim.swa_utils.update_bn (an averaged model's statistics recomputed over the
    data) had no counterpart. ft.nn.update_bn: torch's running statistics in float64 (measured
    3e-16 at values ~1) for a BatchNorm2d of momentum 0.1 and a BatchNorm1d of momentum None,
    over a loader of (x, y) pairs with a short last batch (each batch weighs the same); every
    BatchNorm's momentum and mode as before, the None one counting its batches. Members of a
    Stack are recomputed each as its unstacked layer; a model without BatchNorm and an empty
    pass are refused by name."""
    torch = pytest.importorskip("torch")
    from functree.nn._update_bn import NO_BATCH_NORM, NO_BATCHES
    from tests._errors import raises_named

    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        tm = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(12, 4), torch.nn.BatchNorm1d(4, momentum=None)).double()
        k = jax.random.split(jax.random.key(0), 2)
        f64 = {"dtype": jnp.float64}
        fm = ft.nn.Sequential(ft.nn.Conv2D(2, 3, 3, padding="VALID", key=k[0], **f64),
                              ft.nn.BatchNorm(3, momentum=0.9, epsilon=1e-5, unbiased_running_variance=True, **f64),
                              ft.nn.relu, lambda h: jnp.transpose(h, (0, 3, 1, 2)).reshape(h.shape[0], -1),
                              ft.nn.Dense(12, 4, key=k[1], **f64),
                              ft.nn.BatchNorm(4, momentum=None, epsilon=1e-5, unbiased_running_variance=True, **f64))
        fm = ft.nn.load_torch_state_dict(fm, tm.state_dict())
        data = [(rng.normal(size=(n, 2, 4, 4)), rng.integers(0, 4, n)) for n in (4, 4, 3)]
        torch.optim.swa_utils.update_bn([(torch.tensor(x), torch.tensor(y)) for x, y in data], tm)
        fresh = ft.nn.update_bn(fm, [(x.transpose(0, 2, 3, 1), y) for x, y in data])
        for ours, theirs in ((fresh.layers[1], tm[1]), (fresh.layers[5], tm[5])):
            np.testing.assert_allclose(ours.running_mean, theirs.running_mean.numpy(), rtol=0, atol=1e-13)
            np.testing.assert_allclose(ours.running_variance, theirs.running_var.numpy(), rtol=0, atol=1e-13)
        assert (fresh.layers[1].momentum, fresh.layers[1].batches_tracked, fresh.layers[1].training) == (0.9, None, False)
        assert fresh.layers[5].momentum is None and int(fresh.layers[5].batches_tracked) == 3
        assert all(a is b for a, b in zip(jax.tree.leaves(fresh.layers[4]), jax.tree.leaves(fm.layers[4])))  # the rest: as it was

    block = lambda key: ft.nn.Sequential(ft.nn.Dense(3, 3, key=key), ft.nn.BatchNorm(3))  # noqa: E731
    stack = ft.nn.Stack(block, 2, key=jax.random.key(1))
    xs = [_normal(i, (5, 3)) for i in range(2)]
    stacked, unstacked = ft.nn.update_bn(stack, xs), ft.nn.update_bn(stack.unstack(), xs)
    for i in range(2):
        np.testing.assert_allclose(stacked.unstack().layers[i].layers[1].running_mean,
                                   unstacked.layers[i].layers[1].running_mean, rtol=0, atol=1e-6)
    raises_named(lambda: ft.nn.update_bn(ft.nn.Dense(3, 3, key=jax.random.key(0)), xs), ValueError, NO_BATCH_NORM,
                 "model = ft.nn.update_bn(model, batches)")
    raises_named(lambda: ft.nn.update_bn(stack, iter([])), ValueError, NO_BATCHES,
                 "ft.nn.update_bn(model, ft.train.batches((x, y), 64))")


def test_update_bn_refuses_a_call_that_cannot_take_the_model_and_the_batch():
    """ft.nn.update_bn(model, batches, call=lambda m: m(x)) (or a call of three arguments)
    failed inside the jitted pass with Python's bare "takes 1 positional argument but 2 were
    given". CALL_ARGUMENTS names the call, its signature and call(model, batch); the fix it
    shows recomputes the statistics, and a call taking *args is never refused."""
    from functree.nn._update_bn import CALL_ARGUMENTS
    from tests._errors import raises_named

    model = ft.nn.Sequential(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2))
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    for call in (lambda m: m(x), lambda m, batch, extra: m(batch)):
        raises_named(lambda call=call: ft.nn.update_bn(model, [(x, 0)], call=call), TypeError, CALL_ARGUMENTS,
                     "call=lambda m, batch: m(batch[0])")
    want = ft.nn.update_bn(model, [x]).layers[1].running_mean
    for call in (lambda m, batch: m(batch[0]), lambda *a: a[0](a[1][0])):
        got = ft.nn.update_bn(model, [(x, 0)], call=call).layers[1].running_mean
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


_SCALED_BN_CELL = """
import jax, jax.numpy as jnp, functree as ft
GAIN = 1.0
class Scaled(ft.Module):
    norm: ft.nn.BatchNorm
    def __call__(self, x):
        return self.norm(GAIN * x)
model = Scaled(ft.nn.BatchNorm(2))
"""


def test_update_bn_after_a_cell_set_a_global_the_model_reads_uses_the_new_value():
    """A notebook: ``GAIN = 3.0`` read by the model's ``__call__``, set after a first
    ``ft.nn.update_bn``: the second ran the program traced with ``GAIN = 1.0`` (running mean
    2.5 where the model now feeds 7.5), silently. The program is keyed by what the model's
    Python reads; one too large to key traces for the call alone."""
    ns: dict = {}
    exec(compile(_SCALED_BN_CELL, "<cell>", "exec"), ns)
    x = np.full((4, 2), 2.5, np.float32)
    for gain in (1.0, 3.0):
        ns["GAIN"] = gain
        np.testing.assert_allclose(ft.nn.update_bn(ns["model"], [x]).norm.running_mean, [2.5 * gain] * 2,
                                   rtol=0, atol=1e-6)
    ns["LARGE"] = np.zeros(5000, np.float32)  # over the key's 16 KiB: read, it cannot be keyed
    exec(compile(_SCALED_BN_CELL.replace("GAIN * x", "(GAIN + LARGE[0]) * x").replace("GAIN = 1.0\n", ""),
                 "<cell>", "exec"), ns)
    for gain in (1.0, 2.0):
        ns["GAIN"] = gain
        np.testing.assert_allclose(ft.nn.update_bn(ns["model"], [x]).norm.running_mean, [2.5 * gain] * 2,
                                   rtol=0, atol=1e-6)


def test_update_bn_sums_a_bfloat16_models_statistics_in_float32():
    """ft.nn.update_bn on a bfloat16 model (SWA's averaged model) took each batch's 1/n share
    into bfloat16 running statistics, where a share below half bfloat16's spacing rounds away:
    over 40 batches of values ~5 the mean ended 0.037 off the float32 pass's (an error of 0.006
    is its rounding to bfloat16), the variance 0.027 (0.005). They are summed
    in float32 and rounded once into the model's bfloat16 (its dtype kept: no recompile, the
    checkpoint's dtypes), the float32 pass's statistics rounded to bfloat16 exactly."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(5.0, 2.0, size=(4, 2)).astype(jnp.bfloat16) for _ in range(40)]
    got = ft.nn.update_bn(ft.nn.BatchNorm(2, dtype=jnp.bfloat16), xs)
    want = ft.nn.update_bn(ft.nn.BatchNorm(2), [x.astype(np.float32) for x in xs])
    assert got.running_mean.dtype == got.running_variance.dtype == jnp.bfloat16
    for ours, exact in ((got.running_mean, want.running_mean), (got.running_variance, want.running_variance)):
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(exact.astype(jnp.bfloat16), np.float32),
                                   rtol=0, atol=0)


def test_batch_and_instance_norm_statistics_export_over_a_symbolic_size():
    """ft.export of a training step with a symbolic batch ("b") crashed inside JAX at
    BatchNorm's check of one value per feature ("Symbolic dimension comparison 'b' < '2' is
    inconclusive"), as did an InstanceNorm over a symbolic length. A size that may be 1 is
    refused by name with the constraint that declares it (SYMBOLIC_COUNT); declared, the
    exported program records what jax.jit records (measured equal: atol 1e-6, values about 1)."""
    b, = jax.export.symbolic_shape("b", constraints=("b >= 2",))
    t, = jax.export.symbolic_shape("t", constraints=("t >= 2",))

    def step(m, x):
        y, updates = ft.nn.collect_state(lambda m: m(x), m)
        return y, ft.nn.apply_state(m, updates)

    bn = ft.nn.training(ft.nn.BatchNorm(3, momentum=None, unbiased_running_variance=True))
    norm = ft.nn.training(ft.nn.InstanceNorm1D(3, track_running_stats=True))
    x = np.random.default_rng(0).normal(size=(2, 5, 3)).astype(np.float32)
    for model, shape, given in ((bn, (b, 3), x[0]), (norm, (2, t, 3), x)):
        exported = ft.export(step)(model, jax.ShapeDtypeStruct(shape, jnp.float32))
        for a, want in zip(jax.tree.leaves(exported(model, given)), jax.tree.leaves(jax.jit(step)(model, given))):
            np.testing.assert_allclose(a, want, rtol=0, atol=1e-6)
    plain = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 3"), jnp.float32)
    with pytest.raises(ValueError, match=r"(?s)ft\.nn\.BatchNorm takes its statistics over the b values per feature"
                       r".*right:  jax\.export\.symbolic_shape\(\"b\", constraints=\(\"b >= 2\",\)\)"):
        ft.export(step)(bn, plain)
