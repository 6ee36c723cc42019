"""ft.nn's torch Transformer layers against torch's: outputs with torch's weights ported, the
state dict both ways, masks (bool and float, key padding, causal), gradients, dropout's
statistics, and the refusals. Tiny sizes (d_model 8, 2 heads, 1-2 layers), one compile a case."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.test_util import check_grads

import functree as ft
from functree.nn import _transformer

torch = pytest.importorskip("torch")
# torch's TransformerEncoder notes that its nested-tensor fast path is off (batch_first=False)
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")

E, HEADS, FF, N, S, L = 8, 2, 12, 3, 6, 5


def _inputs(rng, batch_first, dtype):
    src, tgt = rng.standard_normal((N, S, E)), rng.standard_normal((N, L, E))
    if not batch_first:
        src, tgt = src.swapaxes(0, 1), tgt.swapaxes(0, 1)
    return src.astype(dtype), tgt.astype(dtype)


def _masks(rng, float_masks, dtype):
    """torch's masks: src_mask with key 0 allowed, key padding leaving each row a key,
    tgt_mask causal; bool (True: masked) or float (-inf and finite biases)."""
    src_mask = rng.random((S, S)) < 0.3
    src_mask[:, 0] = False  # key 0 (never padding) open to every query: no row wholly masked (torch: NaN)
    lengths = np.array([S, S - 2, 2])
    src_pad = np.arange(S)[None] >= lengths[:, None]
    tgt_pad = np.arange(L)[None] >= np.array([L, L - 1, 3])[:, None]
    tgt_mask = np.triu(np.ones((L, L), bool), 1)
    masks = dict(src_mask=src_mask, tgt_mask=tgt_mask, src_key_padding_mask=src_pad,
                 tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    if float_masks:  # -inf where masked, plus finite biases (torch adds them to the logits)
        masks = {k: np.where(m, -np.inf, 0.0).astype(dtype) for k, m in masks.items()}
        masks["src_mask"] = masks["src_mask"] + rng.standard_normal((S, S)).astype(dtype)
    return masks


def _torch_out(module, args, masks, **flags):
    """torch's output in eval mode (no dropout), gradients on: its reference path (the
    inference fast path, taken without them, gives zeros at padded positions)."""
    tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in masks.items()}
    module.train(False)
    return module(*(torch.from_numpy(a) for a in args), **tensors, **flags).detach().numpy()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_matches_torchs_in_float64(norm_first, activation, batch_first):
    """nn.Transformer (1 encoder layer, 2 decoder layers, final norms) with every mask, bool
    masks where batch_first, float ones (-inf and finite biases) otherwise: torch's weights
    loaded, outputs within 1e-12 of max|out| (measured: 1.5e-15 over the eight cases; float32 3.0e-7)."""
    rng = np.random.default_rng([norm_first, activation == "gelu", batch_first])
    torch.manual_seed(0)
    module = torch.nn.Transformer(E, HEADS, 1, 2, FF, dropout=0.1, activation=activation, batch_first=batch_first,
                                  norm_first=norm_first, dtype=torch.float64)
    with jax.enable_x64(True):
        # built abstract (no eager draws: ~45 programs), every leaf then loaded from torch's
        model = jax.eval_shape(lambda: ft.nn.Transformer(E, HEADS, 1, 2, FF, activation=activation,
                                                         batch_first=batch_first, norm_first=norm_first,
                                                         key=jax.random.key(0), dtype=jnp.float64))
        model = ft.nn.load_torch_state_dict(model, module.state_dict())
        args = _inputs(rng, batch_first, np.float64)
        masks = _masks(rng, not batch_first, np.float64)
        ours = np.asarray(jax.jit(lambda m, a, k: m(*a, **k))(model, args, masks))
    expected = _torch_out(module, args, masks)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12 * np.abs(expected).max())


def test_state_dict_written_loads_into_torch_strictly_and_computes_the_same():
    """ft's own draws written with torch_state_dict: torch loads them strictly (no name
    missing or extra), and its outputs equal ours in float32 (bias=False: no biases, no
    LayerNorm offsets, as torch's; gelu; encoder causal via is_causal)."""
    model = ft.nn.Transformer(E, HEADS, 2, 1, FF, activation="gelu", bias=False, norm_first=True,
                              key=jax.random.key(1))
    module = torch.nn.Transformer(E, HEADS, 2, 1, FF, activation="gelu", bias=False, norm_first=True)
    module.load_state_dict(ft.nn.torch_state_dict(model), strict=True)
    rng = np.random.default_rng(1)
    src, tgt = _inputs(rng, False, np.float32)
    causal = np.triu(np.ones((S, S), bool), 1)
    ours = np.asarray(jax.jit(lambda m, src, tgt: m(src, tgt, src_mask=causal, src_is_causal=True, tgt_is_causal=True,
                                                   tgt_mask=np.triu(np.ones((L, L), bool), 1)))(model, src, tgt))
    expected = _torch_out(module, (src, tgt), dict(src_mask=causal, tgt_mask=np.triu(np.ones((L, L), bool), 1)),
                          src_is_causal=True, tgt_is_causal=True)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-6 * np.abs(expected).max())


def test_encoder_layer_per_head_masks_unbatched_and_decoder_memory_mask():
    """The per-head mask [N * nhead, S, S] (float), an unbatched [S, E] input with a [S]
    key padding mask, and a decoder layer's memory_mask: against torch's layers in float64."""
    rng = np.random.default_rng(2)
    torch.manual_seed(2)
    enc = torch.nn.TransformerEncoderLayer(E, HEADS, FF, batch_first=True, dtype=torch.float64)
    dec = torch.nn.TransformerDecoderLayer(E, HEADS, FF, norm_first=True, dtype=torch.float64)
    with jax.enable_x64(True):
        ours_enc = ft.nn.load_torch_state_dict(jax.eval_shape(lambda: ft.nn.TransformerEncoderLayer(
            E, HEADS, FF, batch_first=True, key=jax.random.key(0), dtype=jnp.float64)), enc.state_dict())
        ours_dec = ft.nn.load_torch_state_dict(jax.eval_shape(lambda: ft.nn.TransformerDecoderLayer(
            E, HEADS, FF, norm_first=True, key=jax.random.key(0), dtype=jnp.float64)), dec.state_dict())
        x = rng.standard_normal((N, S, E))
        per_head = rng.standard_normal((N * HEADS, S, S))
        memory_mask = rng.random((L, S)) < 0.4

        @jax.jit  # one compile for the three calls
        def run(enc, dec, x, per_head, memory_mask):
            return [enc(x, src_mask=per_head),
                    enc(x[0], src_key_padding_mask=jnp.arange(S) >= 4),
                    dec(x[:, :L].swapaxes(0, 1), x.swapaxes(0, 1), memory_mask=memory_mask,
                        memory_key_padding_mask=jnp.arange(S)[None] >= jnp.array([[S], [S], [3]]))]

        got = run(ours_enc, ours_dec, x, per_head, memory_mask)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N, S, E))
    per_head = rng.standard_normal((N * HEADS, S, S))
    expected = [_torch_out(enc, (x,), dict(src_mask=per_head)),
                _torch_out(enc, (x[0],), dict(src_key_padding_mask=np.arange(S) >= 4)),
                _torch_out(dec, (np.ascontiguousarray(x[:, :L].swapaxes(0, 1)), np.ascontiguousarray(x.swapaxes(0, 1))),
                           dict(memory_mask=rng.random((L, S)) < 0.4,
                                memory_key_padding_mask=np.arange(S)[None] >= np.array([[S], [S], [3]])))]
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-12 * np.abs(b).max())


def test_float_masks_of_two_dtypes_are_summed_in_the_wider():
    """A half-precision src_mask and a float32 key padding mask: torch adds them in float32.
    They were summed in the first's dtype, rounding the float32 mask to half precision
    (float16 with torch's layer: 5.3e-5 off its output, measured; now 3.6e-7, float32's).
    bfloat16 here (float16 casts need F16C, absent under SSE4_2); both in float32 is the
    reference."""
    rng = np.random.default_rng(5)
    layer = ft.nn.TransformerEncoderLayer(E, HEADS, FF, batch_first=True, key=jax.random.key(5))
    x = rng.standard_normal((N, S, E)).astype(np.float32)
    src_mask = jnp.asarray(rng.standard_normal((S, S)), jnp.bfloat16)
    padding = (rng.standard_normal((N, S)) * 3).astype(np.float32)
    run = jax.jit(lambda m, x, a, b: m(x, src_mask=a, src_key_padding_mask=b))
    got = run(layer, x, src_mask, padding)
    reference = run(layer, x, src_mask.astype(jnp.float32), padding)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=0, atol=1e-6)


def test_gradients_check_in_float64():
    """check_grads (reverse, order 1) of a pre-norm encoder layer through its parameters and
    input, with a float mask and a bool key padding mask."""
    with jax.enable_x64(True):
        # drawn in one program (eagerly, float64's initializers compiled ~15)
        layer, x = jax.jit(lambda k, kx: (
            ft.nn.TransformerEncoderLayer(4, 2, 6, activation="gelu", norm_first=True, batch_first=True, key=k,
                                          dtype=jnp.float64),
            jax.random.normal(kx, (2, 3, 4), jnp.float64)))(jax.random.key(3), jax.random.key(4))
        bias = jnp.array([[0.0, -1.0, -jnp.inf], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
        pad = jnp.array([[False, False, True], [False, False, False]])
        # Every parameter and the input in one float64 vector, cut apart inside the jitted
        # function: check_grads perturbs its arguments eagerly, a program per leaf shape.
        flat, unravel = ravel_pytree((layer, x))

        def run(v):
            m, x = unravel(v)
            return m(x, src_mask=bias, src_key_padding_mask=pad)

        # eps 1e-6: the central difference's error (eps**2: 5.8e-6 at 1e-4, 5.8e-8 at 1e-5) well below 1e-7
        check_grads(jax.jit(run), (flat,), order=1, modes=["rev"], atol=1e-7, rtol=1e-7, eps=1e-6)


def test_dropout_in_training_is_unbiased_and_drops_at_its_rate():
    """Training mode, rate 0.25, 4000 keys: with the feed-forward branch zero (linear2 zero),
    the pre-norm layer's output is linear in the attention-dropout and dropout1 masks, so its
    mean over keys is the inference output (within 5 standard errors); with linear2's bias
    one, dropout2 zeroes a fraction 0.25 of the branch. Inference ignores the key."""
    layer = ft.nn.TransformerEncoderLayer(E, HEADS, FF, dropout=0.25, norm_first=True, batch_first=True,
                                          key=jax.random.key(5))
    layer = ft.set(layer, "linear2.weight", jnp.zeros((FF, E)))
    x = jax.random.normal(jax.random.key(6), (2, S, E))
    keys = jax.random.split(jax.random.key(7), 4000)
    trained = ft.nn.training(layer)

    @jax.jit
    def draws(model):
        return jax.vmap(lambda k: model(x, key=k))(keys)

    # inference with and without a key in one program; the statistics in NumPy (eagerly, a
    # program per jnp operation)
    inferred, inferred_keyed = jax.jit(lambda m, k: (m(x), m(x, key=k)))(layer, keys[0])
    outs = np.asarray(draws(trained))
    spread = outs.std(0) / np.sqrt(len(keys))
    np.testing.assert_array_less(np.abs(outs.mean(0) - np.asarray(inferred)), 5 * spread + 1e-6)
    assert float(spread.max()) > 1e-3  # the masks do vary the output
    branch = np.asarray(draws(ft.set(trained, "linear2.bias", np.ones(E, np.float32)))) - outs  # dropout2(ones)
    kept = branch[branch != 0]
    np.testing.assert_allclose(kept, 1 / 0.75, rtol=1e-5)  # the kept ones scaled by 1 / (1 - rate)
    assert abs(1 - kept.size / branch.size - 0.25) < 0.01   # 4000 * 2 * 6 * 8 draws: std 0.002
    np.testing.assert_array_equal(inferred_keyed, inferred)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        trained(x)


def test_a_transformer_in_training_drops_with_one_key_per_member():
    """ft.nn.training(Transformer): the stacks split the key per member; the same key gives
    the same output, another key another; a custom encoder is used."""
    model = ft.nn.Transformer(E, HEADS, 2, 1, FF, dropout=0.3, batch_first=True, key=jax.random.key(0))
    src, tgt = jnp.ones((2, S, E)), jnp.ones((2, L, E))
    run = jax.jit(lambda m, k: m(src, tgt, key=k))
    trained = ft.nn.training(model)
    a, b, c = (run(trained, jax.random.key(k)) for k in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(a - c).max()) > 1e-2  # (inference ignores keys: test_dropout_in_training...)

    class PassThrough(ft.Module):
        def __call__(self, src, **masks):
            return src

    custom = ft.nn.Transformer(E, HEADS, 1, 1, FF, batch_first=True, custom_encoder=PassThrough(),
                               key=jax.random.key(0))
    ours, theirs = jax.jit(lambda m: (m(src, tgt), m.decoder(tgt, src)))(custom)
    np.testing.assert_array_equal(ours, theirs)


def test_an_ensembles_transformer_layers_called_outside_vmap_are_refused():
    # 3 models of d_model 8: "expects inputs [N, L, 3] or [L, 3]", the models' count
    keys = jax.random.split(jax.random.key(0), 3)
    encoders = jax.vmap(lambda k: ft.nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True, key=k))(keys)
    decoders = jax.vmap(lambda k: ft.nn.TransformerDecoderLayer(8, 2, 16, 0.0, batch_first=True, key=k))(keys)
    x, memory = jnp.ones((2, 5, 8)), jnp.ones((2, 4, 8))
    match = r"Dense holds weight f32\[3,8,16\], but one Dense's weight has 2 axes(.|\n)*jax.vmap\(lambda m: m\(x\)\)"
    with pytest.raises(ft.nn.LayerInputError, match=match):
        encoders(x)
    with pytest.raises(ft.nn.LayerInputError, match=match):
        decoders(x, memory)
    right = jax.vmap(lambda m: m(x, memory))(decoders)     # the fix
    np.testing.assert_allclose(right[1], jax.tree.map(lambda a: a[1], decoders)(x, memory), rtol=1e-5, atol=1e-6)


def test_generate_square_subsequent_mask_is_torchs():
    np.testing.assert_array_equal(ft.nn.Transformer.generate_square_subsequent_mask(4),
                                  torch.nn.Transformer.generate_square_subsequent_mask(4).numpy())


def test_encoder_of_a_layer_clones_it_and_a_function_needs_a_key():
    layer = ft.nn.TransformerEncoderLayer(E, HEADS, FF, key=jax.random.key(0))
    encoder = ft.nn.TransformerEncoder(layer, 3)
    assert encoder.num_layers == 3
    np.testing.assert_array_equal(encoder.layers[2].linear1.weight, layer.linear1.weight)  # torch's clones
    with pytest.raises(ValueError, match="needs key="):
        ft.nn.TransformerEncoder(lambda k: ft.nn.TransformerEncoderLayer(E, HEADS, key=k), 2)
    drawn = ft.nn.TransformerDecoder(lambda k: ft.nn.TransformerDecoderLayer(E, HEADS, FF, key=k), 2,
                                     key=jax.random.key(0))
    assert not np.array_equal(drawn.layers[0].linear1.weight, drawn.layers[1].linear1.weight)


def test_refusals_name_the_argument():
    layer = ft.nn.TransformerEncoderLayer(E, HEADS, FF, batch_first=True, key=jax.random.key(0))
    x = jnp.ones((N, S, E))
    with pytest.raises(ValueError, match=r"d_model \(8\) must be divisible by nhead \(3\)[\s\S]*nhead=2"):
        ft.nn.Transformer(E, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"activation must be \"relu\", \"gelu\""):
        ft.nn.TransformerDecoderLayer(E, HEADS, activation="swish", key=jax.random.key(0))
    with pytest.raises(ft.nn.LayerInputError, match=r"src_mask \[6, 6\] or \[6, 6, 6\] \(bool or float\), got bool\[5,5\]"):
        layer(x, src_mask=jnp.zeros((5, 5), bool))
    with pytest.raises(ft.nn.LayerInputError, match=r"src_mask .*got i32\[6,6\]"):
        layer(x, src_mask=jnp.zeros((S, S), jnp.int32))
    with pytest.raises(ft.nn.LayerInputError, match=r"src_key_padding_mask \[3, 6\] \(bool or float\), got bool\[6,3\]"):
        layer(x, src_key_padding_mask=jnp.zeros((S, N), bool))
    with pytest.raises(ft.nn.LayerInputError, match=r"expects inputs \[N, L, 8\] or \[L, 8\] \(float\), got f32\[3,6,4\]"):
        layer(jnp.ones((N, S, 4)))
    model = ft.nn.Transformer(E, HEADS, 1, 1, FF, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch of src \(3\) differs from that of tgt \(2\)"):
        model(jnp.ones((S, 3, E)), jnp.ones((L, 2, E)))
    dec = ft.nn.TransformerDecoderLayer(E, HEADS, FF, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch of tgt \(3\) differs from that of memory \(2\)"):
        dec(jnp.ones((L, 3, E)), jnp.ones((S, 2, E)))


def _causal_cases(ours: bool):
    """(module, args, flag, mask argument) for every is_causal flag of every port; ours or torch's."""
    tiny: dict[str, Any] = dict(dim_feedforward=FF, dropout=0.0)
    if ours:
        enc = ft.nn.TransformerEncoderLayer(E, HEADS, key=jax.random.key(0), **tiny)
        dec = ft.nn.TransformerDecoderLayer(E, HEADS, key=jax.random.key(0), **tiny)
        model = ft.nn.Transformer(E, HEADS, 1, 1, key=jax.random.key(0), **tiny)
        encoder, decoder = ft.nn.TransformerEncoder(enc, 1), ft.nn.TransformerDecoder(dec, 1)
        src, tgt = jnp.ones((S, N, E)), jnp.ones((L, N, E))
    else:
        enc = torch.nn.TransformerEncoderLayer(E, HEADS, **tiny)
        dec = torch.nn.TransformerDecoderLayer(E, HEADS, **tiny)
        model = torch.nn.Transformer(E, HEADS, 1, 1, **tiny)
        encoder = torch.nn.TransformerEncoder(enc, 1, enable_nested_tensor=False)
        decoder = torch.nn.TransformerDecoder(dec, 1)
        src, tgt = torch.ones((S, N, E)), torch.ones((L, N, E))
    return [(enc, (src,), "is_causal", "src_mask"), (encoder, (src,), "is_causal", "mask"),
            (dec, (tgt, src), "tgt_is_causal", "tgt_mask"), (dec, (tgt, src), "memory_is_causal", "memory_mask"),
            (decoder, (tgt, src), "tgt_is_causal", "tgt_mask"), (decoder, (tgt, src), "memory_is_causal", "memory_mask"),
            (model, (src, tgt), "src_is_causal", "src_mask"), (model, (src, tgt), "tgt_is_causal", "tgt_mask"),
            (model, (src, tgt), "memory_is_causal", "memory_mask")]


def test_is_causal_without_its_mask_is_refused_as_torch_refuses_it():
    """torch 2.13 raises on every is_causal=True (tgt_/memory_/src_) given without its mask,
    with or without a key padding mask ("Need attn_mask if specifying the is_causal hint");
    ours applied a causal band silently. Each refused by name, the mask in the fix; with the
    mask given the hint is taken, as torch's (test_state_dict_written_loads_...)."""
    for (theirs, t_args, flag, _), (ours, o_args, _, name) in zip(_causal_cases(False), _causal_cases(True)):
        with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
            theirs(*t_args, **{flag: True})
        with pytest.raises(ValueError, match=rf"{type(ours).__name__}: {flag}=True is torch's hint that {name} "
                                             rf"[\s\S]*right: .*{name}=ft.nn.Transformer.generate_square"):
            ours(*o_args, **{flag: True})
        jax.eval_shape(functools.partial(ours, *o_args, **{flag: False}))  # False (or None) needs no mask (traced)


def test_attention_bias_refusals():
    """MultiheadAttention's bias= (what the float masks use): a non-float bias and one with a
    cache are refused by name."""
    attn = ft.nn.MultiheadAttention(E, HEADS, key=jax.random.key(0))
    x = jnp.ones((1, S, E))
    with pytest.raises(ft.nn.LayerInputError, match=r"bias broadcastable to \[1, 2, 6, 6\] \(float\), got bool"):
        attn(x, bias=jnp.zeros((S, S), bool))
    with pytest.raises(ValueError, match=r"bias= .* is not taken with cache="):
        attn(x, bias=jnp.zeros((S, S)), cache=attn.init_cache(1, 8), positions=jnp.arange(S)[None])
    biased, plain = jax.jit(lambda m: (m(x, bias=jnp.zeros((S, S))), m(x)))(attn)  # one program (eagerly ~15)
    np.testing.assert_allclose(biased, plain, atol=1e-6)


def test_module_names_its_public_layers():
    assert set(_transformer.__all__) - {"generate_square_subsequent_mask"} <= set(ft.nn.__all__)
