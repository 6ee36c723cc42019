"""ft.nn.cosine_similarity and pairwise_distance against torch's functions in float64,
broadcasting, zero vectors (eps) and p norms included, gradients too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_cosine_similarity_and_pairwise_distance_match_torchs_in_float64():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 3, 5)), rng.standard_normal((3, 5))
    a[0, 0] = 0.0  # a zero vector: eps keeps it finite
    ta, tb = (torch.from_numpy(x).requires_grad_() for x in (a, b))
    with jax.enable_x64(True):
        cos, pull = jax.vjp(ft.nn.cosine_similarity, jnp.asarray(a), jnp.asarray(b))
        ga, gb = pull(jnp.ones_like(cos))
        np.testing.assert_allclose(ft.nn.cosine_similarity(a, b, axis=0, eps=1e-3),
                                   F.cosine_similarity(torch.from_numpy(a), torch.from_numpy(b), dim=0,
                                                       eps=1e-3).numpy(), rtol=0, atol=1e-15)
        distances = {p: np.asarray(ft.nn.pairwise_distance(a, b, p=p)) for p in (1.0, 2.0, 3.0, np.inf)}
        kept = ft.nn.pairwise_distance(a, b, keepdims=True)
    expected = F.cosine_similarity(ta, tb, dim=-1)
    expected.sum().backward()
    np.testing.assert_allclose(cos, expected.detach().numpy(), rtol=0, atol=1e-15)
    np.testing.assert_allclose(ga, ta.grad.numpy(), rtol=1e-14, atol=1e-14)  # the zero vector: 1e8 / eps scale
    np.testing.assert_allclose(gb, tb.grad.numpy(), rtol=0, atol=1e-14)
    for p, ours in distances.items():
        theirs = F.pairwise_distance(torch.from_numpy(a), torch.from_numpy(b), p=p).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-14, atol=0)
    assert kept.shape == (4, 3, 1)


@pytest.mark.parametrize("name, function", [("CosineSimilarity", "cosine_similarity"),
                                            ("PairwiseDistance", "pairwise_distance")])
def test_torchs_class_names_point_to_the_functions(name, function):
    with pytest.raises(AttributeError, match=rf"torch's nn.{name} is the function ft.nn.{function} here"):
        getattr(ft.nn, name)


def test_pairwise_distance_gradients_are_torchs_where_the_distance_or_a_component_is_zero():
    """One implementation with the triplet losses: jnp.linalg.norm's gradient was NaN at
    x1 == x2 (eps=0), and p=1's was 1 at a zero component where torch's is 0."""
    x = np.array([[1.0, 2.0, 3.0]])
    for other, p in ((x, 2.0), (np.array([[1.0, 2.5, 3.0]]), 1.0), (np.array([[1.0, 2.5, 3.5]]), 3.0)):
        with jax.enable_x64(True):
            ours = np.asarray(jax.grad(lambda a, b=other, q=p: ft.nn.pairwise_distance(a, b, p=q, eps=0.0).sum())(x))
        t = torch.from_numpy(x.copy()).requires_grad_(True)
        F.pairwise_distance(t, torch.from_numpy(other), p=p, eps=0.0).sum().backward()
        assert t.grad is not None
        np.testing.assert_allclose(ours, t.grad.numpy(), rtol=0, atol=1e-12)


def test_pairwise_distance_p0_counts_the_differing_components_as_torchs():
    """p=0 was a bare ZeroDivisionError (the root 1 / p); torch counts the nonzero components
    of x1 - x2 + eps, with a zero gradient. A negative p is refused by name."""
    x1, x2 = np.array([[1.0, 0.0, 2.0], [1.0, 1.0, 1.0]]), np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    for eps in (0.0, 1e-6):
        expected = F.pairwise_distance(torch.from_numpy(x1), torch.from_numpy(x2), p=0, eps=eps).numpy()
        np.testing.assert_array_equal(np.asarray(ft.nn.pairwise_distance(x1, x2, p=0, eps=eps)), expected)
    np.testing.assert_array_equal(jax.grad(lambda a: ft.nn.pairwise_distance(a, x2, p=0).sum())(x1), 0.0)
    for bad in (-1, float("nan"), "l2"):
        with pytest.raises(ValueError, match=r"(?s)pairwise_distance: p must be a number >= 0 .*p=2.0"):
            ft.nn.pairwise_distance(x1, x2, p=bad)  # pyright: ignore[reportArgumentType]  (the wrong types are the test)


def test_pairwise_distance_gradient_below_p1_is_torchs_at_a_zero_component():
    """p < 1: d**p's derivative is infinite at a zero component, times sign's 0 it was NaN;
    torch's is 0 there (the other components' as torch's)."""
    x1, x2 = np.array([[1.0, 0.0, 2.0]]), np.array([[1.0, 1.0, 0.0]])
    with jax.enable_x64(True):
        ours = np.asarray(jax.grad(lambda a: ft.nn.pairwise_distance(a, x2, p=0.5, eps=0.0).sum())(x1))
    t = torch.from_numpy(x1.copy()).requires_grad_(True)
    F.pairwise_distance(t, torch.from_numpy(x2), p=0.5, eps=0.0).sum().backward()
    assert t.grad is not None
    np.testing.assert_allclose(ours, t.grad.numpy(), rtol=0, atol=1e-13 * np.abs(t.grad.numpy()).max())


def test_max_norm_over_an_empty_axis_is_refused_as_torch_does():
    """p = inf over an empty last axis is a max of nothing: torch refuses it; the function
    failed inside jnp.max ("zero-size array to reduction operation max")."""
    p = float("inf")
    with pytest.raises(RuntimeError, match="inf norm"):
        F.pairwise_distance(torch.zeros(3, 0), torch.zeros(1, 0), p=p)
    with pytest.raises(ValueError, match=r"empty(.|\n)*right:  ft.nn.pairwise_distance\(x1, x2, p=2.0\)"):
        ft.nn.pairwise_distance(jnp.zeros((3, 0)), jnp.zeros((1, 0)), p=p)
    np.testing.assert_array_equal(ft.nn.pairwise_distance(jnp.zeros((3, 0)), jnp.zeros((1, 0))),
                                  F.pairwise_distance(torch.zeros(3, 0), torch.zeros(1, 0)).numpy())


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, float("inf")])
def test_normalize_matches_torchs_values_and_gradients_in_float64(p):
    """torch's F.normalize (contrastive heads, cosine classifiers) had no counterpart. Values and
    gradients in float64, a zero vector and one below eps included (torch's gradient there:
    1 / eps through the clamp, not NaN); scale-relative tolerance, measured 2.2e-16 of values
    of about 1 (gradients up to 1/eps = 1e12 on the zero vector: rtol there)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 5))
    x[0, 0] = 0.0
    x[0, 1] = 1e-14  # a norm under eps
    weights = rng.standard_normal(x.shape)
    with jax.enable_x64(True):
        grad = jax.grad(lambda v: jnp.sum(ft.nn.normalize(v, p=p, eps=1e-12) * weights))(jnp.asarray(x))
        values = ft.nn.normalize(jnp.asarray(x), p=p, eps=1e-12)
        on_axis = ft.nn.normalize(jnp.asarray(x), p=p, axis=1)
    t = torch.from_numpy(x).requires_grad_()
    expected = F.normalize(t, p=p, dim=-1, eps=1e-12)
    (expected * torch.from_numpy(weights)).sum().backward()
    np.testing.assert_allclose(values, expected.detach().numpy(), rtol=0, atol=1e-15)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(on_axis, F.normalize(torch.from_numpy(x), p=p, dim=1).numpy(), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"p must be a number > 0"):
        ft.nn.normalize(x, p=0)
