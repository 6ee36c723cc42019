"""Rotary position embeddings: the direct formula, the relative-position property, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft
from functree.nn import _rotary


def _direct(x, positions, base=10000.0):
    """Loops over the formula: pair (i, i + d/2) rotated by p * base^(-2i/d)."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    out = np.empty_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        p = float(np.broadcast_to(positions, x.shape[:-1])[index])
        for i in range(d // 2):
            a = p * base ** (-2 * i / d)
            u, v = x[index][i], x[index][i + d // 2]
            out[index + (i,)] = u * np.cos(a) - v * np.sin(a)
            out[index + (i + d // 2,)] = v * np.cos(a) + u * np.sin(a)
    return out


def test_matches_the_direct_formula():
    x = jax.random.normal(jax.random.key(0), (2, 5, 6))
    positions = np.arange(5) * 3
    np.testing.assert_allclose(ft.nn.apply_rotary(x, positions), _direct(x, positions), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ft.nn.apply_rotary(x, positions, base=100.0), _direct(x, positions, 100.0),
                               rtol=1e-5, atol=1e-5)


def test_layer_over_heads_matches_the_function():
    q = jax.random.normal(jax.random.key(0), (2, 5, 3, 4))  # [batch, T, heads, size]
    rope = ft.nn.RotaryEmbedding(4, seq_axis=-3)
    np.testing.assert_allclose(rope(q), _direct(q, np.arange(5)[:, None]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rope(q, positions=np.arange(7, 12)[:, None]), _direct(q, np.arange(7, 12)[:, None]),
                               rtol=1e-5, atol=1e-5)


def test_scores_depend_only_on_relative_position():
    q, k = jax.random.normal(jax.random.key(1), (2, 8))

    def score(m, n):
        return jnp.dot(ft.nn.apply_rotary(q, m), ft.nn.apply_rotary(k, n))

    for m, n, shift in [(3, 1, 5), (0, 4, 11), (7, 7, 2)]:
        np.testing.assert_allclose(score(m, n), score(m + shift, n + shift), rtol=1e-4, atol=1e-4)
    assert not np.isclose(score(3, 1), score(1, 3), atol=1e-3)
    np.testing.assert_allclose(jnp.linalg.norm(ft.nn.apply_rotary(q, 5)), jnp.linalg.norm(q), rtol=1e-5)


def test_bfloat16_keeps_dtype_and_gradient_finite_differences():
    x = jax.random.normal(jax.random.key(0), (4, 6))
    y = ft.nn.apply_rotary(x.astype(jnp.bfloat16), jnp.arange(4) * 1000)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), _direct(x.astype(jnp.bfloat16).astype(jnp.float32),
                                                              np.arange(4) * 1000), rtol=0.02, atol=0.02)
    with jax.enable_x64(True):
        x64 = jax.random.normal(jax.random.key(0), (3, 4), jnp.float64)
        check_grads(lambda x: ft.nn.apply_rotary(x, jnp.arange(3)), (x64,), order=1, modes=["rev"])


def test_errors():
    with pytest.raises(ValueError, match=r"(?s)even size.*got f32\[3,5\]"):
        ft.nn.apply_rotary(jnp.ones((3, 5)), jnp.arange(3))
    with pytest.raises(ValueError, match=r"(?s)positions i32\[4\] must broadcast against x's leading axes \[2, 3, 5\].*arange\(T\)\[:, None\]"):
        ft.nn.apply_rotary(jnp.ones((2, 3, 5, 4)), jnp.arange(4))
    with pytest.raises(ValueError, match=r"RotaryEmbedding: size must be an even int >= 2"):
        ft.nn.RotaryEmbedding(5)
    with pytest.raises(ValueError, match=r"seq_axis must count from the end"):
        ft.nn.RotaryEmbedding(4, seq_axis=1)
    with pytest.raises(ft.nn.LayerInputError, match=r"RotaryEmbedding expects inputs \[\.\.\., T, 4\] \(float\), got f32\[5,6\]"):
        ft.nn.RotaryEmbedding(4)(jnp.ones((5, 6)))
    with pytest.raises(ft.nn.LayerInputError, match=r"RotaryEmbedding expects inputs \[\.\.\., T, _, 4\] \(float\), got f32\[5,4\]"):
        ft.nn.RotaryEmbedding(4, seq_axis=-3)(jnp.ones((5, 4)))


def test_a_rotary_base_of_zero_or_below_is_refused_where_it_is_given():
    """base 0 made infinite frequencies (1 / 0 ** (2i / d)), a negative base NaN powers, 1e-300
    frequencies past float32: every rotated feature NaN, silently (found with from_hf's check)."""
    x = jax.device_put(np.ones((3, 4), np.float32))
    assert bool(jnp.isnan(ft.nn.apply_rotary(x, np.arange(3), base=1.0)).any()) is False  # 1: no rotation, fine
    for base in (0.0, -10000.0, 1e-300, 0):
        with pytest.raises(ValueError, match=rf"(?s)^apply_rotary: base={base!r}; the rotary base is a positive "
                                             r"number, at least 2.94e-39.*right:  ft.nn.apply_rotary\(x, positions, base=10000.0\)"):
            ft.nn.apply_rotary(x, np.arange(3), base=base)
    for make, where in ((lambda: ft.nn.RopeScaling("linear", base=0.0, factor=2.0), "ft.nn.RopeScaling"),
                        (lambda: ft.nn.RotaryEmbedding(4, base=-1.0), "ft.nn.RotaryEmbedding"),
                        (lambda: ft.nn.MultiheadAttention(8, 2, rotary=0.0, key=jax.random.key(0)), "ft.nn.MultiheadAttention")):
        with pytest.raises(ValueError, match=rf"^{where}: base=-?[0-9.]+; the rotary base is a positive number"):
            make()
    assert "theta_i = base^(-2i/d)" in _rotary.ROPE_BASE


def test_partial_rotary_turns_the_first_fraction_only():
    """RopeScaling(partial=f) (GPT-NeoX's rotary_pct, Phi-3's partial_rotary_factor)."""
    x = jax.random.normal(jax.random.key(0), (5, 8))
    y = ft.nn.apply_rotary(x, jnp.arange(5), base=ft.nn.RopeScaling(partial=0.25))
    np.testing.assert_array_equal(y[:, 2:], x[:, 2:])
    np.testing.assert_allclose(y[:, :2], _direct(x[:, :2], np.arange(5)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"needs 0 < partial <= 1; given partial=1.5"):
        ft.nn.RopeScaling(partial=1.5)
    with pytest.raises(ValueError, match=r"even size.*partial=0.375: 3 rotated"):
        ft.nn.apply_rotary(x, jnp.arange(5), base=ft.nn.RopeScaling(partial=0.375))


def test_longrope_needs_one_short_and_one_long_factor_per_pair():
    rope = ft.nn.RopeScaling("longrope", short_factor=(1.0, 2.0), long_factor=(4.0, 8.0), original_max_positions=4)
    theta = 1.0 / 10000.0 ** (np.arange(0, 4, 2) / 4)
    np.testing.assert_allclose(rope.inverse_frequencies(4, jnp.arange(4)), theta / [1.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(rope.inverse_frequencies(4, jnp.arange(5)), theta / [4.0, 8.0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"has 2 and 2 short and long factors for a rotated size of 8"):
        rope.inverse_frequencies(8)
    with pytest.raises(ValueError, match=r"RopeScaling\('longrope'\) needs short_factor and long_factor"):
        ft.nn.RopeScaling("longrope", original_max_positions=4)


def test_longrope_factors_given_as_lists_are_held_as_tuples():
    """Lists (as config.json holds them) made the scaling unhashable: a static field refused
    it, and an eager apply_rotary (one compiled program per base) raised JAX's bare
    "unhashable type: 'list'"; held as tuples, the scaling equals the tuple-built one."""
    given = ft.nn.RopeScaling("longrope", short_factor=[1.0, 2.0], long_factor=[4.0, 8.0], original_max_positions=4)
    assert given == ft.nn.RopeScaling("longrope", short_factor=(1.0, 2.0), long_factor=(4.0, 8.0),
                                      original_max_positions=4)
    assert given.short_factor == (1.0, 2.0) and hash(given) is not None
    x, at = jnp.ones((1, 3, 1, 4)), jnp.arange(3)[:, None]
    np.testing.assert_array_equal(ft.nn.apply_rotary(x, at, base=given),
                                  jax.jit(lambda x: ft.nn.apply_rotary(x, at, base=given))(x))
    attn = ft.nn.MultiheadAttention(8, 2, causal=True, rotary=given, key=jax.random.key(0))
    assert attn(jnp.ones((1, 3, 8))).shape == (1, 3, 8)


@pytest.mark.parametrize("size,even", [(5, 4), (1, 2), (0, 2)])
def test_an_odd_rotary_layer_size_gets_a_fix_for_the_constructor(size, even):
    """RotaryEmbedding(5) raised apply_rotary's message, whose right: line was
    apply_rotary(x[..., :4], positions), not a fix for the constructor; size 0 was accepted."""
    with pytest.raises(ValueError) as info:
        ft.nn.RotaryEmbedding(size)
    message = str(info.value)
    assert message.startswith(f"RotaryEmbedding: size must be an even int >= 2 (features are rotated in pairs), got {size}.")
    assert f"wrong:  rope = ft.nn.RotaryEmbedding({size})" in message and "apply_rotary" not in message
    right = message.split("right:  ")[1].split("   #")[0]
    assert right == f"rope = ft.nn.RotaryEmbedding({even}); rope(x[..., :{even}])"
    x = jax.random.normal(jax.random.key(0), (2, 3, max(size, even)))
    rope = ft.nn.RotaryEmbedding(even)  # the fix, run: the first pairs rotated by positions 0 .. T-1
    np.testing.assert_allclose(rope(x[..., :even]), _direct(x[..., :even], np.arange(3)), rtol=0, atol=1e-5)


def test_a_rope_choice_outside_the_tuple_is_refused_or_nan_never_another_entry():
    """Indexing a tuple ``base`` by ``choice`` clamped 2 onto the last entry and counted -1
    from the end: another layer type's rotation, silently. Concrete: refused, naming the
    entries; traced: NaN. An entry inside is exactly that entry's rotation."""
    x, at = jnp.ones((3, 8)), jnp.arange(3)
    ropes = (ft.nn.RopeScaling(base=100.0), ft.nn.RopeScaling("linear", factor=2.0))
    for choice in (2, -1, jnp.int32(5)):
        with pytest.raises(ValueError, match=r"choice -?\d+ is no entry of it: 0 to 1") as info:
            ft.nn.apply_rotary(x, at, base=ropes, choice=choice)
        assert "right:" in str(info.value)
    rotate = jax.jit(lambda c: ft.nn.apply_rotary(x, at, base=ropes, choice=c))
    assert np.isnan(np.asarray(rotate(jnp.int32(2)))).all() and np.isnan(np.asarray(rotate(jnp.int32(-1)))).all()
    np.testing.assert_array_equal(rotate(jnp.int32(1)), ft.nn.apply_rotary(x, at, base=ropes[1]))
