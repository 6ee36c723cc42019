"""MultiheadAttention against jax.nn.dot_product_attention and a numpy reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.test_util import check_grads

import functree as ft
from functree.nn import _attention as attention
from functree.nn import _attention_kernel as kernel


def _normal(seed, shape, dtype=np.float32):
    """Standard normal values drawn by NumPy: no sampler compiled per shape."""
    return jax.device_put(np.random.default_rng(seed).normal(size=shape).astype(dtype))


def _mask(seed, p, shape):
    """A NumPy-drawn boolean mask (True with probability ``p``) where every query sees key 0."""
    mask = np.random.default_rng(seed).random(shape) < p
    mask[..., 0] = True
    return jax.device_put(mask)


def _x64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _heads(mha, q, k, v):
    def project(dense, x):
        y = np.asarray(x, np.float64) @ np.asarray(dense.weight, np.float64) + np.asarray(dense.bias, np.float64)
        return y.reshape(*y.shape[:-1], mha.num_heads, -1)

    return project(mha.query_projection, q), project(mha.key_projection, k), project(mha.value_projection, v)


def _output(mha, out):
    dense = mha.output_projection
    out = out.reshape(*out.shape[:-2], -1)
    return out @ np.asarray(dense.weight, np.float64) + np.asarray(dense.bias, np.float64)


_jax_attention = jax.jit(lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask))  # eagerly ~10 programs


def _reference(mha, q, k, v, mask=None):
    Q, K, V = (jax.device_put(np.asarray(a, np.float32)) for a in _heads(mha, q, k, v))
    out = _jax_attention(Q, K, V, mask)
    return _output(mha, np.asarray(out, np.float64))


def _numpy_reference(mha, q, k, v, mask):
    Q, K, V = _heads(mha, q, k, v)
    logits = np.einsum("bqhd,bkhd->bhqk", Q, K) / np.sqrt(Q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights, V)
    return _output(mha, out)


def test_self_attention_matches_jax(key):
    mha = ft.nn.MultiheadAttention(8, 2, key=key)
    x = _normal(1, (3, 5, 8))
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(mha, x), _reference(mha, x, x, x), rtol=1e-5, atol=1e-5)


def test_an_ensembles_attention_called_outside_vmap_is_refused(key):
    layers = jax.vmap(lambda k: ft.nn.MultiheadAttention(8, 2, key=k))(jax.random.split(key, 3))
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense holds weight f32\[3,8,8\], but one Dense's weight"):
        layers(jnp.ones((2, 5, 8)))             # was "expects inputs [..., queries, 3]", the models' count


def test_an_ensembles_attention_called_with_a_cache_outside_vmap_is_refused(key):
    # the cached (decoding) call said "expects inputs [batch, T, 3]", the models' count
    layers = jax.vmap(lambda k: ft.nn.MultiheadAttention(8, 2, batch_first=True, key=k))(jax.random.split(key, 3))
    cache = ft.nn.MultiheadAttention(8, 2, batch_first=True, key=key).init_cache(2, 4)
    positions = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense holds weight f32\[3,8,8\], but one Dense's weight"):
        layers(jnp.ones((2, 1, 8)), cache=cache, positions=positions)
    x = jnp.ones((2, 1, 8))
    right, _ = jax.vmap(lambda m: m(x, cache=cache, positions=positions))(layers)   # the fix
    alone, _ = jax.tree.map(lambda a: a[1], layers)(x, cache=cache, positions=positions)
    np.testing.assert_allclose(right[1], alone, rtol=1e-5, atol=1e-6)


def test_cross_attention_with_mask_and_sizes(key):
    mha = ft.nn.MultiheadAttention(6, 3, key_size=4, value_size=5, output_size=7, qk_size=2, vo_size=3, key=key)
    q = _normal(1, (2, 4, 6))
    k = _normal(2, (2, 3, 4))
    v = _normal(3, (2, 3, 5))
    mask = _mask(4, 0.7, (2, 1, 4, 3))
    y = jax.jit(lambda m, *a, mask: m(*a, mask=mask))(mha, q, k, v, mask=mask)
    assert y.shape == (2, 4, 7)
    np.testing.assert_allclose(y, _numpy_reference(mha, q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_causal_mask_ignores_the_future(key):
    mha = ft.nn.MultiheadAttention(4, 2, key=key)
    x = _normal(1, (5, 4))
    causal = np.tril(np.ones((5, 5), bool))
    f = jax.jit(lambda m, x: m(x, mask=causal))
    y, y2 = f(mha, x), f(mha, x.at[3:].set(100.0))
    np.testing.assert_allclose(y[:3], y2[:3], rtol=1e-5, atol=1e-5)


def test_gradient_finite_differences(key):
    # Every weight and the input in one float64 vector, cut apart inside the jitted function:
    # check_grads perturbs its arguments eagerly, a program per leaf shape.
    tree = jax.tree.map(lambda a: np.asarray(a, np.float64), (ft.nn.MultiheadAttention(4, 2, key=key), _normal(1, (3, 4))))
    with jax.enable_x64(True):
        flat, unravel = ravel_pytree(tree)
        check_grads(jax.jit(lambda v: (lambda m, x: m(x))(*unravel(v))), (flat,), order=1, modes=["rev"])


def test_errors(key):
    with pytest.raises(ValueError, match=r"query_size \(6\) must be divisible by num_heads \(4\)"):
        ft.nn.MultiheadAttention(6, 4, key=key)
    mha = ft.nn.MultiheadAttention(4, 2, key=key)
    with pytest.raises(ft.nn.LayerInputError, match=r"MultiheadAttention expects inputs \[\.\.\., queries, 4\] \(float\), got f32\[3,5\]"):
        mha(jax.device_put(np.ones((3, 5), np.float32)))  # (inputs by device_put: jnp.ones compiles a program a shape)
    with pytest.raises(ft.nn.LayerInputError, match=r"mask broadcastable to \[2, 3, 3\] \(bool\), got f32\[3,3\]"):
        mha(jax.device_put(np.ones((3, 4), np.float32)), mask=jax.device_put(np.ones((3, 3), np.float32)))


def _explicit(mha, x, mask=None, causal=False, dropout=0.0, key=None):
    """functree's hand-written attention (the path used for dropout and float64)."""
    from functree.nn._attention import attention_weights_times_values

    q, k, v = (mha._heads(p(x)) for p in (mha.query_projection, mha.key_projection, mha.value_projection))
    out = attention_weights_times_values(q, k, v, mask, causal, dropout, key)
    return mha.output_projection(out.reshape((*out.shape[:-2], -1)))


def test_dot_product_attention_path_matches_the_hand_written_one(key):
    mha = ft.nn.MultiheadAttention(8, 2, key=key)
    x = _normal(1, (2, 3, 6, 8))  # two leading batch axes
    mask = _mask(2, 0.6, (2, 3, 2, 6, 6))

    @jax.jit
    def both(mha, x, mask):
        causal = mha.replace(causal=True)
        fused = (mha(x, mask=mask), causal(x), causal(x, mask=mask))
        return fused, (_explicit(mha, x, mask), _explicit(mha, x, causal=True), _explicit(mha, x, mask, causal=True))

    for a, b in zip(*both(mha, x, mask)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_causal_flag_equals_a_lower_triangular_mask(key):
    mha = ft.nn.MultiheadAttention(4, 2, causal=True, key=key)
    x = _normal(1, (3, 5, 4))
    tril = np.tril(np.ones((5, 5), bool))
    y, masked, y2 = jax.jit(lambda m, x: (m(x), m.replace(causal=False)(x, mask=tril), m(x.at[:, 3:].set(100.0))))(mha, x)
    np.testing.assert_allclose(y, masked, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[:, :3], y2[:, :3], rtol=1e-5, atol=1e-5)


def test_attention_dropout(key):
    mha = ft.nn.MultiheadAttention(4, 2, dropout=0.5, key=key)
    x = _normal(1, (3, 5, 4))
    train = ft.nn.training(mha)
    drop_key = jax.random.key(7)
    # one jitted program (eagerly every operation compiled apart)
    y_eval, y_no_dropout, y, y_explicit = jax.jit(lambda m, t, x, k: (
        m(x), m.replace(dropout=0.0)(x), t(x, key=k), _explicit(m, x, dropout=0.5, key=k)))(mha, train, x, drop_key)
    np.testing.assert_array_equal(y_eval, y_no_dropout)  # inference: no dropout
    np.testing.assert_allclose(y, y_explicit, rtol=1e-5, atol=1e-6)
    assert not np.allclose(y, y_eval, atol=1e-3)
    # Sequential passes keys (traced: a missing key is refused while tracing, as eagerly)
    assert jax.eval_shape(lambda: ft.nn.training(ft.nn.Sequential(mha))(x, key=drop_key)).shape == (3, 5, 4)
    with pytest.raises(ValueError, match=r"(?s)dropout=0.5\) is in training mode and needs a PRNG key.*key=jax.random.key\(step\)"):
        train(x)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        ft.nn.MultiheadAttention(4, 2, dropout=1.0, key=key)


def test_bfloat16_attention_under_strict_promotion(key):
    mha = ft.nn.MultiheadAttention(8, 2, key=key, dtype=jnp.bfloat16)
    x = _normal(1, (2, 4, 8), jnp.bfloat16)
    y, reference = jax.jit(lambda m, x: (m(x), _explicit(_x32(m), x.astype(jnp.float32))))(mha, x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), reference, rtol=0.05, atol=0.05)


@pytest.mark.parametrize(("heads", "kv_heads", "keys", "size"), [(1, 1, 1, 3), (1, 1, 4, 1), (1, 1, 1, 8), (4, 1, 1, 1)])
def test_bfloat16_attention_of_one_query_row_compiles_and_equals_the_batched_rows(key, heads, kv_heads, keys, size):
    """One query row per key/value head (batch 1, one token, one key/value head: GQA's 4
    query heads too) in bfloat16 failed to compile on the CPU
    (XLA: "Algorithm not supported by the ElementalIrEmitter: ALG_DOT_BF16_BF16_F32", raw
    jax.nn.dot_product_attention too), eagerly and under jit, its gradient too; it equals the
    same row computed in a batch of two within a bfloat16 rounding, and float32's."""
    mha = ft.nn.MultiheadAttention(size * heads, heads, num_kv_heads=kv_heads, key=key, dtype=jnp.bfloat16)
    x = np.asarray(_normal(1, (2, keys, size * heads), jnp.bfloat16))  # sliced in NumPy (eagerly, a program a slice)
    q, kv = jax.device_put(x[:1, -1:]), jax.device_put(x[:1])  # (jnp.asarray compiles a program per shape)
    alone = np.asarray(mha(q, kv, kv), np.float32)  # the last key's row: one query, eagerly

    @jax.jit  # one program: the two rows (XLA's fused program), float32's row, the row's gradient
    def jitted(m, q2, x, q, kv):
        reference = _x32(m)(q.astype(jnp.float32), kv.astype(jnp.float32), kv.astype(jnp.float32))
        grad = jax.grad(lambda m: m(q, kv, kv).astype(jnp.float32).sum())(m)
        return m(q2, x, x), reference, [jnp.isfinite(g.astype(jnp.float32)).all() for g in jax.tree.leaves(grad)]

    batched, reference, finite = jitted(mha, jax.device_put(x[:, -1:]), jax.device_put(x), q, kv)
    batched = np.asarray(batched, np.float32)
    np.testing.assert_allclose(alone, batched[:1], rtol=0, atol=2 * 2.0 ** -8 * float(np.abs(batched).max()))  # 2 bf16 ulps
    np.testing.assert_allclose(alone, reference, rtol=0, atol=0.05)
    assert all(map(bool, finite))


def _x32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def test_dot_product_attention_gradients_match_the_hand_written_ones(key):
    mha = ft.nn.MultiheadAttention(4, 2, causal=True, key=key)
    x = _normal(1, (2, 5, 4))
    # one jitted program for both (eagerly every operation of both gradients compiled apart)
    fused, explicit = jax.jit(lambda m: (jax.grad(lambda m: jnp.sum(jnp.sin(m(x))))(m),
                                         jax.grad(lambda m: jnp.sum(jnp.sin(_explicit(m, x, causal=True))))(m)))(mha)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(explicit)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _gqa_reference(mha, x, causal, rotary=None):
    """Grouped-query attention written out in float64 NumPy: key/value head j serves query
    heads j*g .. j*g+g-1 (g = num_heads // num_kv_heads), rotary in the half layout."""
    def project(dense, heads):
        y = np.asarray(x, np.float64) @ np.asarray(dense.weight, np.float64) + np.asarray(dense.bias, np.float64)
        return y.reshape(*y.shape[:-1], heads, -1)

    q = project(mha.query_projection, mha.num_heads)
    k, v = (project(p, mha.num_kv_heads) for p in (mha.key_projection, mha.value_projection))
    if rotary is not None:
        def rotate(a):
            half = a.shape[-1] // 2
            angle = np.arange(a.shape[-3])[:, None, None] * rotary ** (-np.arange(half) * 2 / a.shape[-1])
            first, second = a[..., :half], a[..., half:]
            return np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                                   second * np.cos(angle) + first * np.sin(angle)], -1)
        q, k = rotate(q), rotate(k)
    group = mha.num_heads // mha.num_kv_heads
    k, v = (np.stack([a[..., h // group, :] for h in range(mha.num_heads)], -2) for a in (k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return _output(mha, np.einsum("bhqk,bkhd->bqhd", weights, v))


@pytest.mark.parametrize("kv_heads,causal,rotary", [(2, True, None), (1, False, None), (2, True, 10000.0)])
def test_grouped_and_multi_query_attention_match_a_hand_written_reference(key, kv_heads, causal, rotary):
    mha = ft.nn.MultiheadAttention(16, 4, num_kv_heads=kv_heads, causal=causal, rotary=rotary, key=key)
    assert mha.key_projection.weight.shape == (16, 4 * kv_heads)
    mha = mha.replace(**{n: getattr(mha, n).replace(bias=_normal(5, (16 if n[0] in "qo" else 4 * kv_heads,)))
                         for n in ("query_projection", "key_projection", "value_projection", "output_projection")})
    x = _normal(1, (2, 6, 16))
    expected = _gqa_reference(mha, x, causal, rotary)
    fused = jax.jit(lambda m, x: m(x))(mha, x)  # jax.nn.dot_product_attention
    np.testing.assert_allclose(fused, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    with jax.enable_x64(True):
        explicit = jax.jit(lambda m, x: m(x))(_x64(mha), x.astype(jnp.float64))  # the hand-written path (float64 takes it)
        np.testing.assert_allclose(explicit, expected, rtol=0, atol=1e-12 * np.abs(expected).max())


def test_default_kv_heads_are_the_heads_and_a_bad_count_names_the_fix(key):
    assert ft.nn.MultiheadAttention(8, 4, key=key).num_kv_heads == 4
    with pytest.raises(ValueError, match=r"(?s)num_kv_heads \(3\) must divide num_heads \(4\).*right: .*num_kv_heads=2"):
        ft.nn.MultiheadAttention(8, 4, num_kv_heads=3, key=key)


# ------------------------------------------------------------------ the key-value cache
_step = jax.jit(lambda m, x, c, p, mask: m(x, cache=c, positions=p, mask=mask))


def _decode(mha, x, splits, mask=None, length=None):
    """``x`` through ``mha``'s cache in chunks of ``splits`` tokens (a prefill, then steps)."""
    x = np.asarray(x)  # sliced and joined in NumPy (eagerly, a program per slice; device_put compiles none)
    b, t, _ = x.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    cache, outs, start = mha.init_cache(b, length or t), [], 0
    for n in splits:
        out, cache = _step(mha, jax.device_put(x[:, start:start + n]), cache,
                           jax.device_put(positions[:, start:start + n]), mask)
        outs.append(np.asarray(out))
        start += n
    return np.concatenate(outs, axis=1), cache


def test_cache_decoding_equals_causal_attention_with_left_padding(key):
    """Prefill 3 tokens, then 1 at a time, through grouped-query rotary attention: row 0
    equals the float64 NumPy reference of the causal layer; row 1 holds 2 padding slots,
    then row 0's first 4 tokens: masked out and rotated by their slots (2..5), its outputs
    equal row 0's (rotary attention depends on offsets only)."""
    mha = ft.nn.MultiheadAttention(16, 4, num_kv_heads=2, rotary=10000.0, causal=True, key=key)
    x0 = np.asarray(_normal(1, (6, 16)))  # the rows built in NumPy (eagerly ~5 programs)
    x = np.stack([x0, np.concatenate([np.full((2, 16), 9.0, np.float32), x0[:4]])])
    mask = jnp.array([[True] * 8, [False, False] + [True] * 6])  # over the 8 slots
    out, cache = _decode(mha, x, [3, 1, 1, 1], mask=mask, length=8)
    expected = _gqa_reference(mha, x0[None], True, 10000.0)[0]
    atol = 1e-5 * np.abs(expected).max()
    np.testing.assert_allclose(out[0], expected, rtol=0, atol=atol)
    np.testing.assert_allclose(out[1, 2:], out[0, :4], rtol=0, atol=atol)
    assert isinstance(cache, ft.nn.KVCache) and cache.keys.shape == (2, 8, 2, 4)
    np.testing.assert_array_equal(cache.keys[:, 6:], 0)  # slots past the tokens stay empty


def test_positions_without_a_cache_rotate_queries_and_keys(key):
    mha = ft.nn.MultiheadAttention(8, 2, rotary=True, causal=True, key=key)
    x = _normal(1, (2, 5, 8))
    at = jax.jit(lambda m, x, p: m(x, positions=p))
    shifted, plain = at(mha, x, jnp.arange(5) + 7), at(mha, x, jnp.arange(5))  # the same offsets: the same attention
    np.testing.assert_allclose(shifted, plain, rtol=0, atol=1e-5 * np.abs(shifted).max())
    assert not np.allclose(at(mha, x, jnp.array([0, 1, 2, 0, 1])), plain, atol=1e-3)


def test_cache_errors(key):
    mha = ft.nn.MultiheadAttention(8, 2, num_kv_heads=1, key=key)
    # the inputs built in NumPy and put on the device (eagerly, each jnp operation here compiled a program)
    dev, xn, posn = jax.device_put, np.ones((2, 3, 8), np.float32), np.zeros((2, 3), np.int32)
    x, cache, pos = dev(xn), mha.init_cache(2, 8), dev(posn)
    with pytest.raises(ValueError, match=r"keys= and values= cannot be passed with cache="):
        mha(x, x, cache=cache, positions=pos)
    with pytest.raises(ValueError, match=r"cache= needs positions= \(int32 \[batch, T\]"):
        mha(x, cache=cache)
    with pytest.raises(ft.nn.LayerInputError, match=r"expects inputs positions \[2, 3\] \(int\), got f32\[2,3\]"):
        mha(x, cache=cache, positions=dev(posn.astype(np.float32)))
    with pytest.raises(ft.nn.LayerInputError, match=r"positions \[2, 3\] \(int\), got i32\[4\]"):
        mha(x, cache=cache, positions=dev(np.arange(4, dtype=np.int32)))
    with pytest.raises(ft.nn.LayerInputError, match=r"expects inputs \[batch, T, 8\] \(float\), got f32\[3,8\]"):
        mha(dev(xn[0]), cache=cache, positions=dev(posn[0]))
    with pytest.raises(ft.nn.LayerInputError, match=r"\[batch, T, 8\] \(float\), got f32\[1,2,3,8\](.|\n)*one batch axis"):
        mha(dev(xn[None]), cache=cache, positions=pos)
    with pytest.raises(ft.nn.LayerInputError, match=r"cache KVCache\(keys \[1, max_length, 1, 4\], values "
                                                    r"\[1, max_length, 1, 4\]\), got KVCache\(keys=f32\[2,8,1,4\]"):
        mha(dev(xn[:1]), cache=cache, positions=dev(posn[:1]))
    with pytest.raises(ft.nn.LayerInputError, match=r"got a dict"):
        mha(x, cache={"keys": cache.keys}, positions=pos)
    with pytest.raises(ft.nn.LayerInputError, match=r"mask \[2, 8\] \(bool\), got f32\[2,8\](.|\n)*over the cache's slots"):
        mha(x, cache=cache, positions=pos, mask=dev(np.ones((2, 8), np.float32)))
    with pytest.raises(ft.nn.LayerInputError, match=r"mask \[2, 8\] \(bool\), got bool\[2,3,8\]"):
        mha(x, cache=cache, positions=pos, mask=dev(np.ones((2, 3, 8), bool)))
    with pytest.raises(ValueError, match=r"init_cache\(batch_size, max_length\) takes positive ints, got "
                                         r"batch_size=0, max_length=8"):
        mha.init_cache(0, 8)
    with pytest.raises(ValueError, match=r"positions= \(without a cache\) rotates self-attention's"):
        mha(x, x, positions=pos)
    with pytest.raises(ft.nn.LayerInputError, match=r"positions \[2, 3\] \(int\), got f32\[3\]"):
        mha(x, positions=dev(np.ones(3, np.float32)))
    # slots outside the cache: its scatter dropped the write (a negative slot wrapped), silently
    with pytest.raises(ValueError, match=r"(?s)run from 6 to 8, but the cache has 8 slots \(0 to 7\).*"
                                         r"right:  cache = model.init_cache\(2, 9\)"):
        mha(x, cache=cache, positions=dev(posn + 6 + np.arange(3, dtype=np.int32)))
    with pytest.raises(ValueError, match=r"(?s)run from -1 to 1, but the cache has 8 slots.*counted from 0"):
        mha(x, cache=cache, positions=dev(np.broadcast_to(np.arange(3, dtype=np.int32) - 1, (2, 3))))
    out, _ = jax.jit(lambda p: mha(x, cache=cache, positions=p))(dev(posn + 6 + np.arange(3, dtype=np.int32)))  # traced: NaN past the end
    assert out.shape == (2, 3, 8) and np.isnan(np.asarray(out[:, 2])).all() and not np.isnan(np.asarray(out[:, :2])).any()


# ----------------------------------------------------------------------------- the kernel choice

_H200 = ("nvidia", (9, 0))
_A100 = ("nvidia", (8, 0))


def _qkv(t=16, size=64, dtype=jnp.bfloat16, s=None):
    q = jax.device_put(np.zeros((2, t, 4, size), dtype))  # (jnp.zeros: a program per shape, at collection)
    k = jax.device_put(np.zeros((2, t if s is None else s, 4, size), dtype))
    return q, k, k


@pytest.mark.parametrize(
    ("inputs", "mask", "device", "expected"),
    [
        (_qkv(), None, _H200, "cudnn"),
        (_qkv(dtype=jnp.float16), None, _A100, "cudnn"),
        (_qkv(dtype=jnp.float32), None, _H200, "xla"),  # no float32 flash attention
        (_qkv(size=12), None, _H200, "xla"),  # head size not a multiple of 8
        (_qkv(size=256), None, _A100, "xla"),  # 256 only from Hopper on
        (_qkv(size=256), None, _H200, "cudnn"),
        (_qkv(t=1, s=32), None, _H200, "xla"),  # one-token decoding stays on XLA
        (_qkv(t=15), jax.device_put(np.ones((1, 1, 15, 15), bool)), _H200, "xla"),  # odd lengths with a mask
        (_qkv(t=16), jax.device_put(np.ones((1, 1, 16, 16), bool)), _H200, "cudnn"),
        (_qkv(), None, ("nvidia", (7, 5)), "xla"),  # before Ampere
        (_qkv(), None, ("gpu", None), "xla"),  # a ROCm GPU
        (_qkv(), None, ("tpu", None), "xla"),
        (_qkv(), None, ("cpu", None), "xla"),
    ],
)
def test_auto_picks_cudnn_exactly_where_it_applies(inputs, mask, device, expected):
    assert kernel.choose("auto", *inputs, mask, device=device) == expected
    assert kernel.choose("xla", *inputs, mask, device=device) == "xla"


def test_cudnn_where_it_cannot_run_names_the_constraint(monkeypatch):
    with pytest.raises(ValueError, match="float32, not float16 or bfloat16"):
        kernel.choose("cudnn", *_qkv(dtype=jnp.float32), None, device=_H200)
    with pytest.raises(ValueError, match=r"below 8\.0"):
        kernel.choose("cudnn", *_qkv(), None, device=("nvidia", (7, 5)))
    # The layer asks the default device: a CPU here on every backend (faked on a GPU).
    monkeypatch.setattr(kernel, "_device", lambda: ("cpu", None))
    attention = ft.nn.MultiheadAttention(8, 2, implementation="cudnn", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"cuDNN's flash attention does not apply here: the device is a CPU"):
        attention(jnp.ones((1, 4, 8)))
    dropping = ft.nn.MultiheadAttention(8, 2, implementation="cudnn", dropout=0.5, training=True,
                                        key=jax.random.key(0))
    with pytest.raises(ValueError, match="attention dropout in training"):
        dropping(jnp.ones((1, 4, 8)), key=jax.random.key(1))


@pytest.mark.parametrize("device", [_H200, ("cpu", None)], ids=["faked-h200", "faked-cpu"])
def test_the_layer_names_the_default_device_it_runs_on(monkeypatch, device):
    """A float32 layer asked for cuDNN names the obstacle the device it runs on has: the
    dtype on an NVIDIA GPU, the device elsewhere (the real device, then each faked)."""
    attention = ft.nn.MultiheadAttention(8, 2, implementation="cudnn", key=jax.random.key(0))
    for _ in range(2):
        reason = kernel.cudnn_obstacle(*_qkv(dtype=jnp.float32), None)
        with pytest.raises(ValueError, match=re.escape(reason)):
            attention(jnp.ones((1, 4, 8)))
        monkeypatch.setattr(kernel, "_device", lambda: device)


def test_the_device_is_read_from_the_default_backend():
    kind, capability = kernel._device()
    assert kind == ("nvidia" if capability is not None else jax.default_backend())
    assert jax.default_backend() == ("gpu" if kind == "nvidia" else kind)


def test_an_unknown_implementation_is_refused_at_construction():
    with pytest.raises(ValueError, match=r'implementation=\'flash\' is not one of "auto", "xla", "cudnn"'):
        ft.nn.MultiheadAttention(8, 2, implementation="flash", key=jax.random.key(0))


def test_auto_is_the_default_and_equals_xla_here():
    attention = ft.nn.MultiheadAttention(8, 2, causal=True, key=jax.random.key(0))
    assert attention.implementation == "auto"
    x = _normal(1, (2, 6, 8))
    np.testing.assert_array_equal(attention(x), attention.replace(implementation="xla")(x))


def _cudnn_runs_here() -> bool:
    """Whether cuDNN's flash attention runs on the default device (an NVIDIA GPU of compute
    capability 8.0 or newer): then JAX does not refuse it, and a refusal is faked."""
    return kernel._device()[0] == "nvidia" and kernel._device()[1] >= (8, 0)


def _refusing_cudnn(monkeypatch):
    """``jax.nn.dot_product_attention`` refusing cuDNN while tracing, as JAX does where cuDNN
    cannot run this input (a cuDNN version, a GPU rule functree does not check)."""
    original = jax.nn.dot_product_attention

    def refusing(*args, implementation=None, **kwargs):
        if implementation == "cudnn":
            raise RuntimeError("cuDNN refused this input (faked)")
        return original(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", refusing)


@pytest.mark.parametrize("refusal", ["jax", "faked"])
def test_auto_falls_back_to_xla_when_cudnn_refuses_while_tracing(monkeypatch, refusal):
    """As if on an NVIDIA GPU whose cuDNN refuses this input: JAX's own refusal where cuDNN
    cannot run (no cuDNN at all: a CPU), a faked one on every backend."""
    if refusal == "jax" and _cudnn_runs_here():
        pytest.skip("cuDNN runs on this device: JAX does not refuse it (the faked refusal is tested)")
    if refusal == "faked":
        _refusing_cudnn(monkeypatch)
    monkeypatch.setattr(kernel, "_device", lambda: _H200)
    attention = ft.nn.MultiheadAttention(16, 2, causal=True, key=jax.random.key(0), dtype=jnp.bfloat16)
    x = _normal(1, (2, 8, 16), jnp.bfloat16)
    np.testing.assert_array_equal(attention(x), attention.replace(implementation="xla")(x))
    with pytest.raises(RuntimeError, match="cuDNN"):  # asked for by name: JAX's own error
        attention.replace(implementation="cudnn")(x)


def test_auto_runs_the_kernel_chosen_for_the_default_device():
    """bf16 attention: cuDNN's flash kernel on an NVIDIA GPU (its outputs differ from XLA's by
    bf16 rounding), XLA's on every other device (the same outputs)."""
    attention = ft.nn.MultiheadAttention(16, 2, causal=True, key=jax.random.key(0), dtype=jnp.bfloat16)
    x = _normal(1, (2, 8, 16), jnp.bfloat16)
    q = jnp.zeros((2, 8, 2, 8), jnp.bfloat16)  # the layer's heads: [batch, T, 2 heads, 8]
    chosen = kernel.choose("auto", q, q, q, None)
    assert chosen == ("cudnn" if _cudnn_runs_here() else "xla")
    np.testing.assert_array_equal(attention(x), attention.replace(implementation=chosen)(x))
    xla = np.asarray(attention.replace(implementation="xla")(x), np.float32)
    # Another kernel sums in another order: a few bf16 roundings (2**-8 relative) of the
    # outputs' size; no GPU measurement of this spread exists yet (then: 10 times it).
    atol = 4 * 2.0**-8 * float(np.abs(xla).max())
    np.testing.assert_allclose(np.asarray(attention(x), np.float32), xla, rtol=0, atol=atol)


def test_sliding_window_equals_a_band_mask_with_and_without_a_cache(key):
    """window=W (Mistral's): query i sees keys i - W < j <= i, in the forward and in the cache."""
    mha = ft.nn.MultiheadAttention(16, 4, num_kv_heads=2, rotary=10000.0, causal=True, window=3, key=key)
    x = _normal(1, (2, 7, 16))
    i, j = np.arange(7)[:, None], np.arange(7)[None]
    band = jnp.asarray((j <= i) & (j > i - 3))
    windowed, expected, causal = jax.jit(lambda m, x: (m(x), m.replace(window=None, causal=False)(x, mask=band),
                                                       m.replace(window=None)(x)))(mha, x)
    atol = 1e-5 * float(np.abs(expected).max())
    np.testing.assert_allclose(windowed, expected, rtol=0, atol=atol)
    assert not np.allclose(causal, expected, atol=atol)  # the window matters here
    np.testing.assert_allclose(_decode(mha, x, [3, 1, 1, 1, 1])[0], expected, rtol=0, atol=atol)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=r"window must be an int >= 1 .* got"):
            ft.nn.MultiheadAttention(16, 4, window=bad, key=key)


def _softmax_attention_float64(q, k, v):
    """Causal softmax(q k^T / sqrt(d)) v in float64 numpy, on [batch, T, heads, size]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)


def test_bfloat16_explicit_attention_is_as_accurate_as_the_fused_path():
    """The explicit path (attention dropout in training) computed bf16 logits and a bf16
    softmax: 0.038 from float32's output on bf16-rounded inputs where the fused path
    (float32 logits and softmax) is 0.013 and torch's bf16 sdpa 0.0088. It does what the
    fused path does now: the same 0.013."""
    @jax.jit  # the inputs drawn in one program (eagerly ~8)
    def draw(key):
        q, k, v = (jax.random.normal(kk, (2, 64, 4, 64)).astype(jnp.bfloat16) for kk in jax.random.split(key, 3))
        return (q.astype(jnp.float32) * 3.0).astype(jnp.bfloat16), k, v  # logits' std ~ 24: softmax rounding shows

    q, k, v = draw(jax.random.key(0))
    expected = _softmax_attention_float64(*(np.asarray(a, np.float32) for a in (q, k, v)))
    explicit = attention.attention_weights_times_values(q, k, v, None, True)
    fused = attention._fused_attention(q, k, v, None, True, "xla")
    assert explicit.dtype == fused.dtype == jnp.bfloat16
    fused_error = float(np.abs(np.asarray(fused, np.float64) - expected).max())
    assert 0.005 < fused_error < 0.02  # ~2 bf16 roundings of values up to ~3
    np.testing.assert_allclose(np.asarray(explicit, np.float64), expected, rtol=0, atol=1.25 * fused_error)
    dropped = attention.attention_weights_times_values(q, k, v, None, True, 0.1, jax.random.key(1))
    assert dropped.dtype == jnp.bfloat16  # under the tests' strict promotion


def test_a_query_with_every_key_masked_is_what_the_docstring_says(key):
    """The docstring said masked entries get -inf (which would make the row NaN); they get a
    large finite negative, so the row is W_o(mean of all values), as Hugging Face's eager
    attention (the ports keep it). The documented recipe zeroes the row, or gives torch's."""
    torch = pytest.importorskip("torch")
    assert "-inf``)" not in ft.nn.MultiheadAttention.__doc__ and "mean of *all* its" in ft.nn.MultiheadAttention.__doc__
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    torch.nn.init.normal_(module.out_proj.bias)
    mha = ft.nn.load_torch_state_dict(jax.eval_shape(lambda: ft.nn.MultiheadAttention(8, 2, key=key)),  # torch's leaves
                                      module.state_dict())
    q, kv = np.random.default_rng(0).normal(size=(2, 2, 5, 8)).astype(np.float32)
    mask = np.ones((2, 1, 5, 5), bool)
    mask[1, :, 0] = False  # query 0 of example 1 sees no key
    y = jax.jit(lambda m, q, kv, mask: m(q, kv, mask=mask))(mha, *map(jax.device_put, (q, kv, mask)))
    values = np.asarray(kv[1], np.float64) @ np.asarray(mha.value_projection.weight) + np.asarray(mha.value_projection.bias)
    expected = values.mean(0) @ np.asarray(mha.output_projection.weight) + np.asarray(mha.output_projection.bias)
    np.testing.assert_allclose(y[1, 0], expected, rtol=0, atol=1e-5)
    zeroed = jnp.where(jnp.asarray(mask).any(-1).swapaxes(-1, -2), y, 0.0)
    assert not np.any(zeroed[1, 0]) and np.array_equal(zeroed[0], y[0]) and np.array_equal(zeroed[1, 1:], y[1, 1:])
    as_torch = jnp.where(jnp.asarray(mask).any(-1).swapaxes(-1, -2), y, mha.output_projection.bias)
    expected, _ = module(*(torch.tensor(a) for a in (q, kv, kv)), need_weights=False,
                         attn_mask=torch.tensor(~mask).repeat_interleave(2, 0).reshape(4, 5, 5))
    np.testing.assert_allclose(as_torch, expected.detach().numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("heads", [0, -2])
def test_num_heads_that_are_not_a_positive_int_are_refused_when_built(heads):
    """num_heads=0 raised ZeroDivisionError (``query_size % num_heads``); torch and now
    functree refuse it naming the setting."""
    with pytest.raises(ValueError, match=rf"num_heads must be an int >= 1, got {heads}(.|\n)*right:  ft.nn.Multihead"):
        ft.nn.MultiheadAttention(8, heads, key=jax.random.key(0))


def test_an_eager_attention_call_compiles_its_core_and_rotation_as_one_program_each():
    """Called eagerly (a notebook cell), the fused attention's and the rotation's ~30
    operations were as many programs, each compiled again at every new length (40 programs
    for this causal rotary call, every cache cleared; 8 now: the projections and the two
    compiled cores). Under jit nothing changes (the same HLO: the cores are traced in place),
    the eager numbers are the jitted ones, and under jax.disable_jit the cores run as Python."""
    from _compiles import compiled

    attn = ft.nn.MultiheadAttention(16, 2, causal=True, rotary=True, key=jax.random.key(0))
    x = jax.device_put(np.random.default_rng(0).normal(size=(2, 7, 16)).astype(np.float32))  # |y| ~ 2
    with compiled() as names:
        y = attn(x)
    assert len(names) <= 8, names  # main: 40
    assert names.count("jit(_fused_compiled)") == 1 and names.count("jit(_rotated_compiled)") == 1
    assert "_fused_compiled" not in jax.jit(attn).lower(x).as_text()
    np.testing.assert_allclose(y, jax.jit(attn)(x), rtol=0, atol=3e-6)  # main: 2.7e-7 apart
    with jax.disable_jit():
        np.testing.assert_allclose(attn(x), y, rtol=0, atol=3e-6)  # measured 2.4e-7


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_an_empty_batch_is_attended_as_torchs(kv_heads):
    """A batch of 0 sequences (torch's MultiheadAttention returns [0, T, E]): the heads were
    split with a reshape to -1, which JAX refuses on an empty array (ZeroDivisionError)."""
    import torch

    mha = ft.nn.MultiheadAttention(6, 2, num_kv_heads=kv_heads, key=jax.random.key(0))
    x = jnp.zeros((0, 3, 6))
    y = mha(x, mask=jnp.ones((3, 3), bool))
    grads = jax.jit(jax.grad(lambda m, x: m(x).sum(), argnums=(0, 1)))(mha, x)
    expected = torch.nn.MultiheadAttention(6, 2, batch_first=True)(*(torch.zeros(0, 3, 6),) * 3)[0]
    assert y.shape == tuple(expected.shape) == (0, 3, 6)
    assert grads[1].shape == x.shape and not np.asarray(grads[0].query_projection.weight).any()


def test_narrow_cache_positions_attend_as_int32_ones():
    """Positions of 8 bits were kept in their type: a cache of 300 slots compared slots
    jnp.arange(300, uint8) (slot 256 was slot 0: empty slots attended, 1.89 off) and a
    window's positions - window wrapped (1 - 2 = 255: the query's own window masked out,
    2.30 off); int8 positions with 300 slots overflowed inside JAX."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4, 8)), jnp.float32)
    for window, slots in ((None, 300), (2, 8)):
        attn = ft.nn.MultiheadAttention(8, 2, key=jax.random.key(0), causal=True, window=window)
        uncached = np.asarray(attn(x))
        for dtype in (jnp.int32, jnp.uint8, jnp.int8):
            cached = attn(x, cache=attn.init_cache(1, slots), positions=jnp.arange(4, dtype=dtype)[None])[0]
            np.testing.assert_allclose(np.asarray(cached), uncached, rtol=0, atol=1e-6, err_msg=f"{window} {dtype}")


def test_traced_positions_outside_the_cache_give_nan_and_write_nothing():
    """Under jax.jit (positions unseen) a slot past the cache's end was dropped by the scatter
    and the query attended the cache without its own token: a finite output (a jitted decode
    step one token past max_length read the same values as the step before); a negative slot
    wrapped onto the last slot and overwrote it. Now such a query's output is NaN and its key
    and value are written nowhere; the tokens inside the cache are unchanged."""
    attn = ft.nn.MultiheadAttention(8, 2, key=jax.random.key(0))
    x = _normal(0, (1, 2, 8))
    step = jax.jit(lambda c, p: attn(x, cache=c, positions=p))
    filled = step(attn.init_cache(1, 4), jnp.array([[0, 1]]))[1]
    expected = np.asarray(step(filled, jnp.array([[2, 3]]))[0])
    for bad in ([[2, 4]], [[2, -1]]):  # the second token past the end, or counted from it
        out, cache = step(filled, jnp.array(bad))
        out = np.asarray(out)
        assert np.isnan(out[0, 1]).all(), bad
        np.testing.assert_allclose(out[0, 0], expected[0, 0], rtol=0, atol=1e-6 * np.abs(expected).max())
        assert not np.asarray(cache.keys[0, 3]).any() and not np.asarray(cache.values[0, 3]).any(), bad


def test_bfloat16_attention_differentiates_under_strict_promotion():
    """The fused call's backward pass (lowered outside its "standard" promotion block) has a
    float32-by-bfloat16 dot: jax.grad of a bfloat16 MultiheadAttention raised a
    TypePromotionError inside JAX under strict promotion (this suite's setting)."""
    attn = ft.nn.MultiheadAttention(8, 2, key=jax.random.key(0), dtype=jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 8)), jnp.bfloat16)
    grads = ft.gradient(lambda a: a(x).astype(jnp.float32).sum(), at=attn)
    assert grads.query_projection.weight.dtype == jnp.bfloat16
    with jax.numpy_dtype_promotion("standard"):
        expected = ft.gradient(lambda a: a(x).astype(jnp.float32).sum(), at=attn)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0,
                                   atol=0.05 * float(np.abs(np.asarray(b, np.float32)).max()))  # bfloat16's paths
