"""The fortieth session's audit of ft.nn's layers against torch in float64, where earlier
fuzzing drew no ties: inputs on a grid of -1, 0 and 1 make equal maxima in most windows and
whole windows of zeros. torch sends a max pool's gradient to one element, the first of equal
maxima in the window's row-major order (the index ``return_indices`` gives); ft's dilated
MaxPool and its AdaptiveMaxPool split it evenly between them (``jnp.maximum``, ``jnp.max``),
``LPPool(norm_type=inf)`` gave a window of zeros the gradient 1 (``jnp.abs``'s at 0; torch's
``abs`` has 0), and EmbeddingBag's ``"max"`` split a bag's equal maxima (``segment_max``).
Values and gradients against torch's autograd.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")
F = torch.nn.functional

# Max pools pick and copy elements (exact); the one sum is the cotangent's scatter: a few
# adds of values < 4. 1e-13 is far above float64's spread and far below a gradient split (0.5).
ATOL = 1e-13

_CASES = {  # name: (ours, torch's, input [N, *spatial, C])
    "MaxPool1D dilated": (ft.nn.MaxPool1D(2, 1, dilation=2), lambda x: F.max_pool1d(x, 2, 1, dilation=2), (2, 7, 3)),
    "MaxPool2D dilated, padded, ceil_mode": (
        ft.nn.MaxPool2D(3, 2, 1, ceil_mode=True, dilation=(2, 1)),
        lambda x: F.max_pool2d(x, 3, 2, 1, dilation=(2, 1), ceil_mode=True), (2, 6, 5, 2)),
    "AdaptiveMaxPool1D": (ft.nn.AdaptiveMaxPool1D(3), lambda x: F.adaptive_max_pool1d(x, 3), (2, 7, 3)),
    "AdaptiveMaxPool2D": (ft.nn.AdaptiveMaxPool2D((3, 2)), lambda x: F.adaptive_max_pool2d(x, (3, 2)), (2, 5, 7, 2)),
    "AdaptiveMaxPool3D": (ft.nn.AdaptiveMaxPool3D((2, None, 1)), lambda x: F.adaptive_max_pool3d(x, (2, 3, 1)),
                          (1, 3, 3, 4, 2)),
    "LPPool2D inf": (ft.nn.LPPool2D(float("inf"), 2), lambda x: F.lp_pool2d(x, float("inf"), 2), (2, 4, 6, 2)),
    "LPPool1D -inf": (ft.nn.LPPool1D(-float("inf"), 3, 2), lambda x: F.lp_pool1d(x, -float("inf"), 3, 2), (2, 7, 3)),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_max_pools_send_the_gradient_of_equal_maxima_where_torch_does(name):
    layer, torch_pool, shape = _CASES[name]
    rng = np.random.default_rng(0)
    x = rng.integers(-1, 2, size=shape).astype(np.float64)  # ties in most windows
    x[(0, *(slice(0, 3),) * (len(shape) - 2))] = 0.0  # and a window of zeros
    move, back = (lambda a: np.moveaxis(a, -1, 1)), (lambda a: np.moveaxis(a, 1, -1))
    xt = torch.tensor(move(x), requires_grad=True)
    yt = torch_pool(xt)
    g = rng.normal(size=back(yt.detach().numpy()).shape)
    yt.backward(torch.tensor(move(g)))
    with jax.enable_x64(True):
        y, grad = jax.jit(lambda x, g: (lambda y, vjp: (y, vjp(g)[0]))(*jax.vjp(layer, x)))(jnp.asarray(x),
                                                                                             jnp.asarray(g))
    np.testing.assert_array_equal(np.asarray(y), back(yt.detach().numpy()))
    np.testing.assert_allclose(np.asarray(grad), back(xt.grad.numpy()), rtol=0, atol=ATOL)


@pytest.mark.parametrize("padding_index", [None, 2])
def test_embedding_bag_max_sends_the_gradient_of_equal_maxima_where_torch_does(padding_index):
    """Rows on the grid tie within bags (and a bag holds row 0 twice): torch's max_indices take
    the first; ft's segment_max split the gradient between them. Values, the table's gradient."""
    rng = np.random.default_rng(0)
    module = torch.nn.EmbeddingBag(5, 3, mode="max", padding_idx=padding_index).double()
    with torch.no_grad():
        module.weight.copy_(torch.tensor(rng.integers(-1, 2, size=(5, 3)).astype(np.float64)))
    indices, offsets = np.array([0, 1, 2, 3, 4, 0, 0, 3, 2]), np.array([0, 3, 5, 8, 8])  # an empty bag too
    g = rng.normal(size=(len(offsets), 3))
    out = module(torch.tensor(indices), torch.tensor(offsets))
    (out * torch.tensor(g)).sum().backward()
    with jax.enable_x64(True):
        bag = ft.nn.load_torch_state_dict(
            jax.eval_shape(lambda: ft.nn.EmbeddingBag(5, 3, "max", padding_index=padding_index, key=jax.random.key(0),
                                                      dtype=jnp.float64)), module.state_dict())
        y, grad = jax.jit(lambda b, g: (lambda y, vjp: (y, vjp(g)[0]))(*jax.vjp(
            lambda b: b(jnp.asarray(indices), jnp.asarray(offsets)), b)))(bag, jnp.asarray(g))
    np.testing.assert_array_equal(np.asarray(y), out.detach().numpy())
    np.testing.assert_allclose(np.asarray(grad.embeddings), module.weight.grad.numpy(), rtol=0, atol=ATOL)
