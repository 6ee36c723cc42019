"""Unfold and Fold against torch's F.unfold / F.fold over kernel, dilation, padding and
stride settings; Fold is Unfold's adjoint; gradients, jit and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.test_util import check_grads

import functree as ft

SETTINGS = [((2, 3), 1, 0, 1), ((3, 2), (2, 1), 1, (2, 1)), (2, 1, (1, 0), 2)]


def test_unfold_and_fold_match_torch():
    rng = np.random.default_rng(0)
    for k, d, p, s in SETTINGS:
        x = rng.standard_normal((2, 7, 6, 3)).astype(np.float32)
        blocks = ft.nn.Unfold(k, d, p, s)(jnp.asarray(x))
        expected = torch.nn.functional.unfold(torch.from_numpy(np.moveaxis(x, -1, 1).copy()), k, d, p, s).numpy()
        np.testing.assert_array_equal(blocks, expected.swapaxes(-1, -2))  # torch's [N, C kh kw, L], transposed
        y = ft.nn.Fold((7, 6), k, d, p, s)(blocks)
        folded = torch.nn.functional.fold(torch.from_numpy(expected), (7, 6), k, d, p, s).numpy()
        # measured 1.9e-6 (overlapping blocks summed in another order, |y| ~ 10): 4x
        np.testing.assert_allclose(y, np.moveaxis(folded, 1, -1), rtol=0, atol=8e-6)


def test_fold_is_the_adjoint_of_unfold_and_differentiable():
    unfold, fold = ft.nn.Unfold(2, padding=1, strides=2), ft.nn.Fold((3, 4), 2, padding=1, strides=2)
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, 2))  # leading axes kept
    b = jax.random.normal(jax.random.key(1), unfold(x).shape)
    np.testing.assert_allclose(jnp.vdot(unfold(x), b), jnp.vdot(x, fold(b)), rtol=1e-5)
    check_grads(fold, (b,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(jax.jit(unfold)(x), unfold(x), rtol=0, atol=0)


def test_fold_refuses_blocks_that_do_not_fit():
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)Its 5 blocks of 8 features do not fit output_size=\(3, 3\)"
                                                    r".*give 4 blocks"):
        ft.nn.Fold(3, 2)(jnp.ones((1, 5, 8)))
    with pytest.raises(ft.nn.LayerInputError, match=r"6 is not a multiple of 4"):
        ft.nn.Fold(3, 2)(jnp.ones((1, 4, 6)))


def test_fold_refuses_an_output_no_block_fits():
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)output_size=\(2, 2\) holds no block.*spans \(3, 3\).*"
                                                    r"padding=1"):
        ft.nn.Fold(2, 3)(jnp.ones((1, 1, 9)))


def test_unfold_refuses_a_window_larger_than_the_image():
    with pytest.raises(ft.nn.LayerInputError, match=r"height >= 3"):
        ft.nn.Unfold(3)(jnp.ones((1, 2, 5, 1)))


# Settings on which XLA aborted the process compiling Fold (Unfold's transpose) or Unfold's
# gradient in float64 (functree/nn/_xla_conv.py): a filter of 2 with strides 2 and padding 1.
ABORTED = [  # output size, kernel, dilation, padding, strides
    ((4, 4), (3, 2), (2, 1), (1, 1), (2, 2)),
    ((3, 4), (3, 2), 1, 1, (3, 2)),
    ((5, 4), (3, 2), 1, ((0, 0), (1, 1)), 2),
    ((1, 6), 2, 1, 1, 2),
]


@pytest.mark.parametrize(("size", "k", "d", "p", "s"), ABORTED, ids=[str(c) for c in ABORTED])
def test_settings_xla_aborted_on_fold_and_unfold_as_torch(size, k, d, p, s):
    """Fold and Unfold's gradient at these settings aborted the process inside XLA's compiler
    (float64); both equal torch's fold and unfold's gradient now."""
    rng = np.random.default_rng(0)
    torch_p = p if isinstance(p, int) else tuple(q if isinstance(q, int) else q[0] for q in p)  # (lo, lo) pairs
    with jax.enable_x64(True):
        x = rng.standard_normal((2, *size, 3))
        xt = torch.tensor(np.moveaxis(x, -1, 1).copy(), requires_grad=True)
        blocks = torch.nn.functional.unfold(xt, k, d, torch_p, s)
        t = rng.standard_normal(blocks.shape)
        (blocks * torch.from_numpy(t)).sum().backward()
        assert xt.grad is not None
        unfold, fold = ft.nn.Unfold(k, d, p, s), ft.nn.Fold(size, k, d, p, s)
        ours, pullback = jax.vjp(unfold, jnp.asarray(x))
        np.testing.assert_array_equal(ours, blocks.detach().numpy().swapaxes(-1, -2))
        (grad,) = pullback(jnp.asarray(t.swapaxes(-1, -2)))
        expected = np.moveaxis(xt.grad.numpy(), 1, -1)
        np.testing.assert_allclose(grad, expected, rtol=0, atol=1e-12 * np.abs(expected).max())
        folded = torch.nn.functional.fold(torch.from_numpy(t), size, k, d, torch_p, s).numpy()
        np.testing.assert_allclose(fold(jnp.asarray(t.swapaxes(-1, -2))), np.moveaxis(folded, 1, -1), rtol=0,
                                   atol=1e-12 * np.abs(folded).max())
