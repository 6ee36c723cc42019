"""ft.nn.AdaptiveLogSoftmaxWithLoss against torch's nn.AdaptiveLogSoftmaxWithLoss, its state dict
ported: the forward's output and loss, log_prob, predict and the gradients, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn._adaptive_softmax import BAD_CUTOFFS, BAD_TARGET, BAD_TARGET_SHAPE
from tests._errors import raises_named

torch = pytest.importorskip("torch")

CASES = [  # in_features, n_classes, cutoffs, div_value, head_bias
    (64, 30, [5, 12, 20], 4.0, False),   # the last tail 64 // 4^3 = 1 wide
    (8, 20, [4], 2.0, True),
    (12, 9, [2, 3, 8], 1.5, True),   # one-class clusters
]


def _pair(in_features, n_classes, cutoffs, div_value, head_bias, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.AdaptiveLogSoftmaxWithLoss(in_features, n_classes, cutoffs, div_value, head_bias).double()
    with jax.enable_x64(True):  # built abstractly (every leaf is torch's: eager initializers compiled apart)
        layer = jax.eval_shape(lambda: ft.nn.AdaptiveLogSoftmaxWithLoss(
            in_features, n_classes, cutoffs, div_value, head_bias, key=jax.random.key(0), dtype=jnp.float64))
        layer = ft.nn.load_torch_state_dict(layer, module.state_dict())
    return module, layer


@pytest.mark.parametrize("case", CASES)
def test_forward_log_prob_predict_and_gradients_match_torchs(case):
    in_features, n_classes = case[:2]
    module, layer = _pair(*case)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, in_features)) * 2.0
    target = rng.integers(0, n_classes, 40)
    target[:n_classes] = np.arange(n_classes)  # every class, every cluster
    xt = torch.from_numpy(x).requires_grad_()
    out_t, loss_t = module(xt, torch.from_numpy(target))
    loss_t.backward()
    with jax.enable_x64(True):
        out, loss = layer(jnp.asarray(x), jnp.asarray(target))  # eager
        # the gradients, log_prob and predict in one program (op by op: each operation compiled apart)
        g_layer, g_x, log_prob, predicted = jax.jit(lambda m, v, t: (
            *jax.grad(lambda m, v: m(v, t).loss, (0, 1))(m, v), m.log_prob(v), m.predict(v)))(
                layer, jnp.asarray(x), jnp.asarray(target))
    scale = np.abs(out_t.detach().numpy()).max()
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=0, atol=1e-13 * scale)
    np.testing.assert_allclose(loss, loss_t.item(), rtol=0, atol=1e-13 * scale)
    expected = module.log_prob(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(log_prob, expected, rtol=0, atol=1e-13 * np.abs(expected).max())
    np.testing.assert_array_equal(predicted, module.predict(torch.from_numpy(x)).numpy())
    np.testing.assert_allclose(g_x, xt.grad.numpy(), rtol=0, atol=1e-13 * np.abs(xt.grad.numpy()).max())
    grads = ft.nn.torch_state_dict(g_layer, numpy=True)
    named = dict(module.named_parameters())
    assert set(grads) == set(named)
    for name, p in named.items():
        assert p.grad is not None
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=0, atol=1e-13 * np.abs(p.grad.numpy()).max() + 1e-300,
                                   err_msg=name)


def test_parameters_are_torchs_shapes_and_names():
    torch.manual_seed(0)
    module = torch.nn.AdaptiveLogSoftmaxWithLoss(32, 30, [5, 12], 4.0, True)
    # built in one program (eagerly, each initializer compiled apart)
    layer = jax.jit(lambda: ft.nn.AdaptiveLogSoftmaxWithLoss(32, 30, [5, 12], 4.0, True, key=jax.random.key(0)))()
    mine = ft.nn.torch_state_dict(layer, numpy=True)
    assert {k: v.shape for k, v in mine.items()} == {k: tuple(v.shape) for k, v in module.state_dict().items()}
    # torch's Linear initialisation: U(+-1/sqrt(fan_in))
    assert np.abs(mine["head.weight"]).max() <= 1 / np.sqrt(32)


def test_unbatched_and_jit():
    module, layer = _pair(8, 20, [4], 2.0, True)
    x = np.random.default_rng(2).standard_normal(8)
    out_t, loss_t = module(torch.from_numpy(x), torch.tensor(13))
    with jax.enable_x64(True):
        out, loss = ft.jit(lambda m, v, t: m(v, t))(layer, jnp.asarray(x), jnp.asarray(13))
        assert out.shape == ()
        # a target outside the classes under jit: NaN, not another class's number
        bad, _ = ft.jit(lambda m, v, t: m(v, t))(layer, jnp.asarray(x), jnp.asarray(20))
    np.testing.assert_allclose(out, out_t.item(), rtol=0, atol=1e-13 * abs(out_t.item()))
    np.testing.assert_allclose(loss, loss_t.item(), rtol=0, atol=1e-13 * abs(out_t.item()))
    assert np.isnan(bad)


def test_errors_name_the_fix():
    key = jax.random.key(0)
    make = ft.nn.AdaptiveLogSoftmaxWithLoss
    raises_named(lambda: make(8, 10, [4, 4], key=key), ValueError, BAD_CUTOFFS, "cutoffs=[4]")
    raises_named(lambda: make(8, 10, [5, 3], key=key), ValueError, BAD_CUTOFFS, "cutoffs=[3, 5]")
    raises_named(lambda: make(8, 10, [4, 10], key=key), ValueError, BAD_CUTOFFS, "cutoffs=[4, 9]")
    raises_named(lambda: make(8, 10, [0], key=key), ValueError, BAD_CUTOFFS, "[1, 9]")
    asm = jax.jit(lambda: make(8, 10, [4], key=key))()  # one program (eagerly, each initializer compiled apart)
    x = jnp.ones((3, 8))
    raises_named(lambda: asm(x, jnp.array([0, 10, 2])), ValueError, BAD_TARGET, "in [0, 9]")
    raises_named(lambda: asm(x, jnp.array([0, -1, 2])), ValueError, BAD_TARGET, "[-1, 2]")
    raises_named(lambda: asm(x, jnp.array([0, 1])), ft.nn.LayerInputError, BAD_TARGET_SHAPE[:40], "int[3]")
    raises_named(lambda: asm(x, jnp.zeros(3)), ft.nn.LayerInputError, BAD_TARGET_SHAPE[:40], "int[3]")
    with pytest.raises(ft.nn.LayerInputError):
        asm(jnp.ones((3, 7)), jnp.array([0, 1, 2]))
