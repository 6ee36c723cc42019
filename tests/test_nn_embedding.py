"""Embedding: lookup reference, scatter-add gradient, integer-only inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def test_lookup_matches_indexing(key):
    emb = ft.nn.Embedding(7, 3, key=key)
    idx = jnp.array([[0, 6, 2], [2, 2, 5]])
    np.testing.assert_array_equal(emb(idx), np.asarray(emb.embeddings)[np.asarray(idx)])
    assert emb.embeddings.shape == (7, 3)
    assert float(jnp.std(ft.nn.Embedding(1000, 64, key=key).embeddings)) == pytest.approx(1.0, rel=0.03)


def test_gradient_scatter_adds_into_rows(key):
    emb = ft.nn.Embedding(5, 2, key=key)
    idx = jnp.array([1, 3, 1])
    grads = ft.gradient(lambda m: jnp.sum(m(idx)), at=emb)
    np.testing.assert_array_equal(grads.embeddings, [[0, 0], [2, 2], [0, 0], [1, 1], [0, 0]])


def test_float_indices_are_an_error(key):
    emb = ft.nn.Embedding(5, 2, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)Embedding expects inputs \[\.\.\.\] \(int\), got f32\[3\].*astype\(jnp.int32\)"):
        emb(jnp.array([1.0, 2.0, 3.0]))


def test_padding_index_is_torchs_padding_idx(key):
    """Row p starts at zeros and takes no gradient; torch's state dict does not carry
    padding_idx (the padding row trained after a port)."""
    torch = pytest.importorskip("torch")
    module = torch.nn.Embedding(7, 3, padding_idx=2)
    assert not module.weight[2].any()
    layer = ft.nn.load_torch_state_dict(ft.nn.Embedding(7, 3, key=key, padding_index=2), module.state_dict())
    assert not np.asarray(ft.nn.Embedding(7, 3, key=key, padding_index=-5).embeddings[2]).any()
    ids = np.array([[2, 0, 2], [5, 2, 6]])
    upstream = np.random.default_rng(0).normal(size=(2, 3, 3)).astype(np.float32)
    (module(torch.tensor(ids)) * torch.tensor(upstream)).sum().backward()
    grad = ft.gradient(lambda e: (e(jnp.asarray(ids)) * upstream).sum(), at=layer)
    np.testing.assert_allclose(grad.embeddings, module.weight.grad.numpy(), rtol=0, atol=1e-6)
    assert not np.asarray(grad.embeddings[2]).any()
    np.testing.assert_array_equal(layer(jnp.asarray(ids)), module(torch.tensor(ids)).detach().numpy())
    with pytest.raises(ValueError, match=r"padding_index=7 is outside the vocabulary of 7 rows"):
        ft.nn.Embedding(7, 3, key=key, padding_index=7)


def test_indices_clipped_onto_the_padding_row_pass_it_no_gradient(key):
    """Out-of-range indices read the clipped row (jnp.take's "clip"); where that is the
    padding row it got their gradient ([2, 2] from indices 5 and 7 onto row 4), though the
    padding row gets none."""
    for padding, indices in ((4, [5, 7, 1]), (0, [-1, 2])):
        layer = ft.nn.Embedding(5, 2, key=key, padding_index=padding)
        ids = jnp.array(indices)
        grad = ft.gradient(lambda e, ids=ids: e(ids).sum(), at=layer).embeddings
        np.testing.assert_array_equal(grad[padding], [0.0, 0.0])
        expected = np.zeros((5, 2), np.float32)
        for i in indices:
            row = min(max(i, 0), 4)
            if row != padding:
                expected[row] += 1.0
        np.testing.assert_array_equal(grad, expected)
