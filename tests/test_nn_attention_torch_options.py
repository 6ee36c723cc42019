"""MultiheadAttention's batch_first=False and add_zero_attn=True against torch's nn.MultiheadAttention
in float64 (outputs and gradients; measured at most 1.5e-15 of their magnitude, tolerance 1e-13 of it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn._attention import CACHE_OPTION

torch = pytest.importorskip("torch")

K = jax.random.key(0)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _close(got, expected):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-13 * max(1.0, float(np.abs(expected).max())))


@jax.jit
def _value_and_vjp(layer, mask, cotangent, *xs):  # one program (op by op: a second a case)
    y, vjp = jax.vjp(lambda m, *xs: m(*xs, mask=mask), layer, *xs)
    return y, vjp(cotangent)


@jax.jit
def _banded(layer, x, bias, band):
    return layer(x, bias=bias), layer.replace(causal=False, window=None)(x, mask=band, bias=bias)


@pytest.mark.parametrize(("batch_first", "zero", "unbatched"), [(False, False, False), (False, True, False),
                                                                 (True, True, False), (False, True, True)])
def test_sequence_first_and_a_zero_key_give_torchs_outputs_and_gradients(batch_first, zero, unbatched):
    rng = np.random.default_rng(0)
    E, H, L, S, N, KD = 8, 2, 4, 5, 3, 6  # cross attention, keys and values of another size
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, batch_first=batch_first, add_zero_attn=zero, kdim=KD, vdim=KD,
                                         dtype=torch.float64)
    layer = ft.nn.MultiheadAttention(E, H, batch_first=batch_first, add_zero_attn=zero, key_size=KD, key=K,
                                     dtype=jnp.float64)
    layer = ft.nn.load_torch_state_dict(layer, module)  # the options compared: they agree

    def shape(length, size):
        return (length, size) if unbatched else (N, length, size) if batch_first else (length, N, size)

    q, k, v = rng.normal(size=shape(L, E)), rng.normal(size=shape(S, KD)), rng.normal(size=shape(S, KD))
    attn_mask = rng.random((L, S)) < 0.4  # torch's: True = not attended
    padding = rng.random(() if unbatched else (N,))[..., None] < rng.random(S)
    attn_mask[:, 0] = padding[..., 0] = False  # every query sees key 0 (torch's fully masked row: the bias)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out, _ = module(tq, tk, tv, attn_mask=torch.tensor(attn_mask), key_padding_mask=torch.tensor(padding),
                    need_weights=False)
    cotangent = rng.normal(size=tuple(out.shape))
    out.backward(torch.tensor(cotangent))

    allowed = ~attn_mask & ~padding[..., None, :] if unbatched else ~attn_mask & ~padding[:, None, None, :]
    y, grads = _value_and_vjp(layer, jnp.asarray(allowed), jnp.asarray(cotangent), q, k, v)
    assert y.shape == tuple(out.shape)
    _close(y, out.detach().numpy())
    for got, expected in zip(grads[1:], (tq, tk, tv)):
        _close(got, expected.grad.numpy())
    _close(grads[0].key_projection.weight, module.k_proj_weight.grad.numpy().T)
    _close(grads[0].output_projection.bias, module.out_proj.bias.grad.numpy())


def test_a_zero_key_is_attended_past_the_causal_band_the_window_and_the_bias():
    """With add_zero_attn the causal band is an explicit mask, the zero key outside it; a bias
    gets a 0 column: equal to the same layer given the band as a mask (torch's is_causal takes one)."""
    rng = np.random.default_rng(1)
    layer = ft.nn.MultiheadAttention(8, 2, add_zero_attn=True, causal=True, window=2, key=K, dtype=jnp.float64)
    x, bias = jnp.asarray(rng.normal(size=(2, 5, 8))), jnp.asarray(rng.normal(size=(5, 5)))
    band = np.tril(np.ones((5, 5), bool)) & ~np.tril(np.ones((5, 5), bool), -2)
    got, expected = _banded(layer, x, bias, jnp.asarray(band))
    _close(got, expected)
    # the zero key counts: without it the outputs differ
    _, without = _banded(layer.replace(add_zero_attn=False), x, bias, jnp.asarray(band))
    assert np.abs(np.asarray(without - expected)).max() > 1e-3


@pytest.mark.parametrize(("option", "right"), [("batch_first=False", "batch_first=True"),
                                               ("add_zero_attn=True", "add_zero_attn=False")])
def test_a_cache_is_refused_with_sequence_first_inputs_or_a_zero_key(option, right):
    name, value = option.split("=")
    layer = ft.nn.MultiheadAttention(8, 2, key=K, **{name: value == "True"})
    cache = layer.init_cache(1, 4)
    with pytest.raises(ValueError) as e:
        layer(jnp.ones((1, 2, 8)), cache=cache, positions=jnp.array([[0, 1]]))
    assert str(e.value) == CACHE_OPTION.format(option=option, right=right)
