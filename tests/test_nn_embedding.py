"""Embedding: lookup reference, scatter-add gradient, integer-only inputs."""

import jax
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


def test_an_ensembles_embedding_called_outside_vmap_is_refused(key):
    tables = jax.vmap(lambda k: ft.nn.Embedding(10, 4, key=k))(jax.random.split(key, 3))
    with pytest.raises(ft.nn.LayerInputError, match=r"Embedding holds embeddings f32\[3,10,4\], but one Embedding's "
                                                    r"embeddings has 2 axes(.|\n)*jax.vmap\(lambda m: m\(x\)\)\(models\)"):
        tables(jnp.zeros((2, 5), jnp.int32))    # was "too many values to unpack"


def test_an_ensembles_embedding_renormalized_outside_vmap_is_refused(key):
    tables = jax.vmap(lambda k: ft.nn.Embedding(10, 4, key=k))(jax.random.split(key, 3))
    tokens = jnp.array([1, 2])
    with pytest.raises(ft.nn.LayerInputError, match=r"Embedding holds embeddings f32\[3,10,4\]"):
        tables.renormalized(tokens, max_norm=1.0)   # was "too many values to unpack"
    right = jax.vmap(lambda m: m.renormalized(tokens, max_norm=1.0))(tables)     # the fix
    np.testing.assert_allclose(jnp.linalg.norm(right.embeddings[:, 1:3], axis=-1), 1.0, rtol=1e-5)


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


def test_an_index_outside_the_table_is_refused_naming_it_and_its_fix(key):
    """torch raises for an index outside the table; JAX's gather clamped it onto the last (or
    first) row: another token's embedding, silently. Concrete indices are checked."""
    layer = ft.nn.Embedding(5, 2, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=(
            r"(?s)Embedding expects inputs indices in \[0, 5\) \(int\), got 7 at indices\[1, 0\]\..*"
            r"JAX's gather would read row 4.*wrong:  ft\.nn\.Embedding\(5, 2, key=key\)\(indices\)\s+# indices up to 9\n"
            r"\s+right:  ft\.nn\.Embedding\(10, 2, key=key\)\(indices\)\s+# vocabulary_size > every index")):
        layer(jnp.array([[0, 4], [7, 9]]))
    with pytest.raises(ft.nn.LayerInputError, match=(
            r"(?s)got -1 at indices\[1\].*read row 0.*# indices down to -1\n"
            r"\s+right:  ft\.nn\.Embedding\(5, 2, key=key\)\(jnp\.where\(indices < 0, 0, indices\)\)")):
        layer(np.array([2, -1]))
    with pytest.raises(ft.nn.LayerInputError, match=r"got 5 at indices\[0\]"):
        layer.renormalized(jnp.array([5]), 1.0)
    model = ft.nn.Sequential([layer, ft.nn.Dense(2, 1, key=key)])
    with pytest.raises(ft.nn.LayerInputError, match=r"Embedding at \.layers\[0\] expects inputs indices in \[0, 5\)"):
        model(jnp.array([3, 5]))


@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_a_traced_index_outside_the_table_reads_a_nan_row_and_passes_no_gradient(key, scale_grad_by_freq):
    """Under jax.jit the values are not seen: an index outside [0, 5) (5, 7, -1) reads a NaN
    row, never another row; the rows inside are exact, and the gradient reaches only them
    (the padding row none; with scale_grad_by_freq, counted among the indices inside only)."""
    layer = ft.nn.Embedding(5, 2, key=key, padding_index=4, scale_grad_by_freq=scale_grad_by_freq)
    ids = jnp.array([5, 1, 7, 1, -1, 4, 2])
    rows = jax.jit(lambda e, i: e(i))(layer, ids)
    inside = np.array([False, True, False, True, False, True, True])
    assert np.isnan(np.asarray(rows)[~inside]).all()
    np.testing.assert_array_equal(np.asarray(rows)[inside], np.asarray(layer.embeddings)[np.array([1, 1, 4, 2])])
    weights = jnp.arange(1.0, 8.0)[:, None]  # a cotangent per lookup

    @jax.jit
    def grad(e, i):
        return ft.gradient(lambda e: jnp.where(inside[:, None], e(i) * weights, 0.0).sum(), at=e).embeddings

    expected = np.zeros((5, 2), np.float32)
    expected[1] = (2.0 + 4.0) / (2 if scale_grad_by_freq else 1)
    expected[2] = 7.0  # row 4 is the padding row: no gradient
    np.testing.assert_array_equal(grad(layer, ids), expected)


def test_a_traced_int64_index_past_2_32_or_a_narrow_negative_one_reads_a_nan_row(key):
    """XLA:CPU bounds-checks an int64 index in its low 32 bits: under x64 a traced
    ``2**32 + 1`` read row 1 (and renormalized() rescaled it); an int8 ``-1`` on a table of
    300 rows read row 44 (300 wrapped in int8). Both read a NaN row, as any index outside."""
    lookup = jax.jit(lambda e, i: e(i))
    with jax.enable_x64(True):
        emb = ft.nn.Embedding(5, 2, key=key)
        rows = np.asarray(lookup(emb, np.array([1, 2**32 + 1, 2**33 + 3], np.int64)))
        np.testing.assert_array_equal(rows[0], np.asarray(emb.embeddings[1]))
        assert np.isnan(rows[1:]).all(), rows
        big = emb.replace(embeddings=emb.embeddings * 10)
        kept = jax.jit(lambda e, i: e.renormalized(i, 1.0))(big, np.array([2**32 + 1], np.int64))
        np.testing.assert_array_equal(np.asarray(kept.embeddings), np.asarray(big.embeddings))
    wide = ft.nn.Embedding(300, 2, key=key)
    assert np.isnan(np.asarray(lookup(wide, jnp.array([-1], jnp.int8)))).all()


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_renormalized_before_each_step_is_torchs_max_norm_training(key, norm_type):
    """torch's Embedding(max_norm=m) rescales the rows it looks up inside its weight at every
    forward (no_grad), and SGD steps from them. emb.renormalized(tokens, m) before each step is
    that step for step: 5 SGD steps 1.8e-15 apart in float64 (outputs, gradients, tables;
    norm_type 2, 1, inf). A forward that only scaled its output (gradient passed through, as
    torch's) gave torch's first output and gradient exactly, then drifted: 1.64 of its outputs
    and 3.05 of its table off after 5 steps (norm_type 2): refused (MAX_NORM). float32 here,
    3 steps: 1.2e-7 of the values apart measured (norm_type 2, 1, inf), atol 10 times it, rounded up."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Embedding(10, 4, max_norm=1.0, norm_type=norm_type)
    sgd = torch.optim.SGD(module.parameters(), lr=0.5)
    emb = ft.nn.load_torch_state_dict(ft.nn.Embedding(10, 4, key=key), module.state_dict())

    @jax.jit  # one program: the renorm, the forward and the gradient
    def step(emb, ids, target):
        emb = emb.renormalized(ids, 1.0, norm_type)
        return emb, emb(ids), ft.gradient(lambda e: ((e(ids) - target) ** 2).sum(), at=emb)

    rng = np.random.default_rng(0)
    for _ in range(3):
        ids, target = rng.integers(0, 10, size=(3, 4)), rng.normal(size=(3, 4, 4)).astype(np.float32)
        y = module(torch.tensor(ids))
        sgd.zero_grad()
        ((y - torch.tensor(target)) ** 2).sum().backward()
        emb, out, grad = step(emb, jnp.asarray(ids), target)
        for ours, theirs in ((out, y.detach().numpy()), (grad.embeddings, module.weight.grad.numpy())):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6 * max(1.0, float(np.abs(theirs).max())))
        sgd.step()
        emb = emb.replace(embeddings=emb.embeddings - 0.5 * grad.embeddings)
        table = module.weight.detach().numpy()
        np.testing.assert_allclose(emb.embeddings, table, rtol=0, atol=2e-6 * max(1.0, float(np.abs(table).max())))


def test_renormalized_rescales_the_rows_looked_up_once(key):
    emb = ft.nn.Embedding(5, 2, key=key, initializer=lambda k, shape, dtype: jnp.full(shape, 3.0, dtype))
    out = emb.renormalized(jnp.array([[1, 1], [4, 1]]), 2.0)  # row 1 twice: rescaled once
    norms = np.linalg.norm(np.asarray(out.embeddings), axis=-1)
    np.testing.assert_allclose(norms, [np.hypot(3, 3), 2.0, np.hypot(3, 3), np.hypot(3, 3), 2.0], rtol=0, atol=1e-6)
    # traced, an index outside the table (7, -1: never seen) rescales no row (clamped, 7 rescaled row 4)
    out = jax.jit(lambda e, i: e.renormalized(i, 2.0))(emb, jnp.array([[1, 1], [7, -1]]))
    norms = np.linalg.norm(np.asarray(out.embeddings), axis=-1)
    np.testing.assert_allclose(norms, [np.hypot(3, 3), 2.0, np.hypot(3, 3), np.hypot(3, 3), np.hypot(3, 3)],
                               rtol=0, atol=1e-6)


def test_max_norm_is_refused_with_the_functional_step(key):
    with pytest.raises(ValueError, match=r"(?s)max_norm=1.0 is torch's in-place side effect.*drift from it after the "
                       r"first step.*right:  emb = ft.nn.Embedding\(n, d, key=key\)\n\s+emb = emb.renormalized\(tokens, "
                       r"1.0\)"):
        ft.nn.Embedding(10, 4, key=key, max_norm=1.0)


@pytest.mark.parametrize("padding", [None, 2])
def test_scale_grad_by_freq_is_torchs_gradient_and_forward_mode_works(padding):
    """Each row's gradient is the mean of its lookups' cotangents (torch's scale_grad_by_freq,
    float64; measured 1.4e-17); the output is unchanged, and a JVP is the lookups' tangent
    scaled the same way (a custom JVP: jvp and vjp agree)."""
    torch = pytest.importorskip("torch")
    indices = np.array([[1, 2, 1, 0], [3, 1, 2, 2]])
    cotangent = np.random.default_rng(0).normal(size=(2, 4, 3))
    module = torch.nn.Embedding(6, 3, padding_idx=padding, scale_grad_by_freq=True, dtype=torch.float64)
    module(torch.tensor(indices)).backward(torch.tensor(cotangent))
    with jax.enable_x64(True):
        emb = ft.nn.Embedding(6, 3, padding_index=padding, scale_grad_by_freq=True, key=jax.random.key(0),
                              dtype=jnp.float64)
        emb = ft.nn.load_torch_state_dict(emb, module)
        tangent = jnp.asarray(np.random.default_rng(1).normal(size=(6, 3)))
        y, grad, forward, plain = _frequency_scaled(emb, jnp.asarray(indices), jnp.asarray(cotangent), tangent)
        np.testing.assert_array_equal(y, module.weight.detach().numpy()[indices])
        np.testing.assert_allclose(grad, module.weight.grad.numpy(), rtol=0, atol=1e-15)
        # not the derivative (check_grads' finite differences disagree by design): forward and
        # reverse mode agree, <J t, c> = <t, J^T c>
        np.testing.assert_allclose(jnp.vdot(forward, cotangent), jnp.vdot(tangent, grad), rtol=0, atol=1e-13)
        assert np.abs(np.asarray(plain) - module.weight.grad.numpy()).max() > 0.1  # rows looked up 3 times


@jax.jit
def _frequency_scaled(emb, indices, cotangent, tangent):  # one program (op by op: 0.9 s)
    def lookup(table, scaled=True):
        return emb.replace(embeddings=table, scale_grad_by_freq=scaled)(indices)

    y, vjp = jax.vjp(lookup, emb.embeddings)
    _, forward = jax.jvp(lookup, (emb.embeddings,), (tangent,))
    _, plain = jax.vjp(lambda table: lookup(table, False), emb.embeddings)
    return y, vjp(cotangent)[0], forward, plain(cotangent)[0]


def test_narrow_ids_renormalize_and_scale_by_frequency_as_int32_ones():
    """int8 ids with a vocabulary of 300: renormalized() and scale_grad_by_freq=True raised
    an OverflowError inside JAX (its scatter normalizes indices in their own type)."""
    emb = ft.nn.Embedding(300, 4, key=jax.random.key(0))
    freq = ft.nn.Embedding(300, 4, key=jax.random.key(0), scale_grad_by_freq=True)
    ids = jnp.array([1, 2, 2, 5], jnp.int8)
    wide = ids.astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(freq(ids)), np.asarray(freq(wide)))
    for a, b in zip(jax.tree.leaves(emb.renormalized(ids, 1.0)), jax.tree.leaves(emb.renormalized(wide, 1.0)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grad = ft.gradient(lambda e: e(ids).sum(), at=freq)
    np.testing.assert_array_equal(np.asarray(grad.embeddings), np.asarray(ft.gradient(lambda e: e(wide).sum(),
                                                                                      at=freq).embeddings))
