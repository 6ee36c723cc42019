"""ft.nn.Bilinear against torch's nn.Bilinear: outputs and gradients in float64 with torch's
weights ported, written back (strict), bias=False, torch's init range, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("bias", [True, False])
def test_bilinear_matches_torchs_in_float64(bias):
    torch.manual_seed(0)
    module = torch.nn.Bilinear(3, 4, 5, bias=bias, dtype=torch.float64)
    rng = np.random.default_rng(0)
    x1, x2 = rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 4))
    t1, t2 = (torch.from_numpy(a).requires_grad_() for a in (x1, x2))
    yt = module(t1, t2)
    yt.backward(torch.from_numpy(np.sin(yt.detach().numpy())))
    with jax.enable_x64(True):
        layer = ft.nn.load_torch_state_dict(ft.nn.Bilinear(3, 4, 5, bias=bias, key=jax.random.key(0),
                                                           dtype=jnp.float64), module.state_dict())
        y, pull = jax.vjp(lambda m, a, b: m(a, b), layer, jnp.asarray(x1), jnp.asarray(x2))
        grads = pull(jnp.sin(y))
        written = ft.nn.torch_state_dict(layer)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=0, atol=1e-14)
    np.testing.assert_allclose(grads[1], t1.grad.numpy(), rtol=0, atol=1e-13)
    np.testing.assert_allclose(grads[2], t2.grad.numpy(), rtol=0, atol=1e-13)
    torch_grads = ft.nn.torch_state_dict(grads[0], numpy=True, gradient=True)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(torch_grads[name], p.grad.numpy(), rtol=0, atol=1e-13)
    module.load_state_dict(written, strict=True)  # torch's names and layout back


def test_bilinear_draws_in_torchs_range_and_refuses_unpaired_inputs():
    layer = ft.nn.Bilinear(4, 2, 3, key=jax.random.key(0))
    assert layer.weight.shape == (4, 2, 3)
    assert layer.bias is not None and float(jnp.abs(layer.weight).max()) <= 0.5 >= float(jnp.abs(layer.bias).max())  # 1 / sqrt(4)
    assert float(jnp.abs(layer.weight).max()) > 0.3
    with pytest.raises(ft.nn.LayerInputError, match=r"x1 \[\.\.\., 4\] and x2 \[\.\.\., 2\] with one batch shape"):
        layer(jnp.ones((5, 4)), jnp.ones((3, 2)))
    with pytest.raises(ft.nn.LayerInputError, match=r"\[\.\.\., 2\] \(float\), got f32\[5,3\]"):
        layer(jnp.ones((5, 4)), jnp.ones((5, 3)))



@pytest.mark.parametrize("in1, in2", [(4, 5), (3, 3)])
def test_an_ensembles_bilinear_called_outside_vmap_is_refused(in1, in2):
    # 3 layers of (4, 5) inputs: "expects inputs [..., 3]", the models' count; 3 of (3, 3):
    # einsum's "subscript 'ijo' does not contain the correct number of indices"
    layers = jax.vmap(lambda k: ft.nn.Bilinear(in1, in2, 2, key=k))(jax.random.split(jax.random.key(0), 3))
    x1, x2 = jnp.ones((2, in1)), jnp.ones((2, in2))
    with pytest.raises(ft.nn.LayerInputError, match=rf"Bilinear holds weight f32\[3,{in1},{in2},2\], but one "
                                                    r"Bilinear's weight has 3 axes"):
        layers(x1, x2)
    right = jax.vmap(lambda m: m(x1, x2))(layers)     # the fix
    np.testing.assert_allclose(right[1], jax.tree.map(lambda a: a[1], layers)(x1, x2), rtol=1e-6)
