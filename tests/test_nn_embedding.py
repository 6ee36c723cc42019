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
