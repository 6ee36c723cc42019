"""Hugging Face config options ``ft.nn.from_hf`` refused until the twenty-sixth session, each
against transformers' own model of a tiny config with random weights (no download):

* OPT-350m's layout: ``do_layer_norm_before: false`` (post-norm blocks, no final layer norm),
  ``word_embed_proj_dim`` other than ``hidden_size`` (``project_in`` / ``project_out``),
  ``_remove_final_layer_norm``, ``layer_norm_elementwise_affine: false``;
* GPT-2's ``scale_attn_weights: false`` and ``scale_attn_by_inverse_layer_idx: true`` (each
  layer's logit factor: its attention's ``logit_scale``), ``reorder_and_upcast_attn``;
* Qwen2's mixed sliding-window and full-attention layers (``max_window_layers``,
  ``layer_types``: each layer's window its attention's ``member_window``);
* OLMo's ``clip_qkv`` (the attention's ``clip``).

For each: HF's model is built (``AutoModelForCausalLM.from_config``, weights moved off its
initialization), saved with ``save_pretrained`` and read back with ``ft.nn.from_hf(directory)``.
The logits equal HF's at the real tokens of a left-padded batch, ``ft.nn.generate`` gives HF's
greedy tokens (a KV cache), one gradient step lowers the loss, and ``ft.nn.save_hf`` writes a
directory whose ``from_pretrained`` model computes the same logits.

Tolerance: ``atol = 1.6e-5 * max|HF|`` (float32): the largest difference measured over these
nine configs, HF models of seeds 0-4 and two batches each was 1.6e-6 of ``max|HF|`` (float32
sums in another order), times 10.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_hf_dropout import hf_call, same_masks  # noqa: E402, F401  (same_masks: a fixture)

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB, T = 40, 9
ATOL = 1.6e-5  # times max|HF| (module docstring)


def hf_of(config, seed=0):
    """HF's model of ``config`` (eager attention), every parameter moved by N(0, 0.2)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf.eval()


def ported(hf):
    """``ft.nn.from_hf`` of HF's ``save_pretrained`` directory (config.json and safetensors)."""
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        return ft.nn.from_hf(directory)


def batch(seed=0):
    """Token ids [2, T] and a left-padded mask (the second row starts 3 pads in)."""
    ids = np.random.default_rng(seed).integers(2, VOCAB, size=(2, T)).astype(np.int32)
    mask = np.ones((2, T), np.int32)
    mask[1, :3] = 0
    return ids, mask


def hf_logits(hf, ids, mask):
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)  # HF's generate's positions for left padding
    kwargs = {} if hf.config.model_type == "opt" else {"position_ids": torch.from_numpy(positions).long()}
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(), **kwargs).logits.numpy()


# One jitted forward for the file (a fresh lambda per call traced each model again).
forward = jax.jit(lambda m, i, a: m(i, attention_mask=a))


def assert_logits_equal(model, hf, seed=0):
    ids, mask = batch(seed)
    expected = hf_logits(hf, ids, mask)
    got = np.asarray(forward(model, ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], rtol=0, atol=ATOL * float(np.abs(expected[real]).max()))
    return float(np.abs(got[real] - expected[real]).max() / np.abs(expected[real]).max())


def assert_generates_as_hf(model, hf, new=4):
    ids, mask = batch()
    ours = np.asarray(ft.nn.generate(model, ids, new, attention_mask=mask, eos_token_id=0, pad_token_id=0))
    with torch.no_grad():
        theirs = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=0).numpy()
    np.testing.assert_array_equal(ours, theirs)


def assert_trains(model):
    """One gradient step (SGD, lr 0.05) on next-token cross-entropy lowers the loss."""
    ids, mask = batch()
    weight = mask[:, 1:].astype(np.float32)

    def loss(m):
        logits = m(ids, attention_mask=mask)[:, :-1]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
        return -jnp.sum(picked * weight) / weight.sum()

    def step(m):  # the loss, its gradient and the loss after the step: one compiled program (the
        # step's eager moves compiled one program per leaf shape, the loss after it one more)
        before, grad = ft.value_with_gradient(loss, m)
        return before, grad, loss(ft.move(m, along=ft.tangent_scale(grad, -0.05)))

    before, grad, after = jax.jit(step)(model)
    leaves = [np.asarray(g) for g in jax.tree.leaves(grad)]
    assert all(np.isfinite(g).all() for g in leaves) and all(np.abs(g).max() > 0 for g in leaves)
    assert float(after) < float(before)


def assert_saves_back(model, hf):
    """``ft.nn.save_hf``'s directory read by HF's ``from_pretrained`` computes HF's logits."""
    ids, mask = batch()
    with tempfile.TemporaryDirectory() as directory:
        ft.nn.save_hf(model, os.path.join(directory, "saved"))
        again = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(directory, "saved"),
                                                                  attn_implementation="eager").eval()
    assert sorted(again.state_dict()) == sorted(hf.state_dict())
    np.testing.assert_array_equal(hf_logits(again, ids, mask), hf_logits(hf, ids, mask))


def check_all(config):
    hf = hf_of(config)
    model = ported(hf)
    assert_logits_equal(model, hf)
    assert_generates_as_hf(model, hf)
    assert_trains(model)
    assert_saves_back(model, hf)
    return model, hf


# ---- OPT-350m: post-norm blocks, projected embeddings, no final layer norm ----------------------

def opt_config(**changes):
    options = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, ffn_dim=32,
                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    return transformers.OPTConfig(**{**options, **changes})


def test_opt_350m_layout_matches_hf():
    """OPT-350m's config (``do_layer_norm_before: false``, ``word_embed_proj_dim`` 512 beside
    ``hidden_size`` 1024) at a tiny size: refused by name before, now HF's logits, tokens,
    training and save-back; the layers HF builds and no other (no final layer norm)."""
    model, _ = check_all(opt_config(do_layer_norm_before=False, word_embed_proj_dim=8))
    decoder = model.model.decoder
    assert decoder.final_layer_norm is None and decoder.project_in.weight.shape == (8, 16)
    assert decoder.project_out.weight.shape == (16, 8) and decoder.embed_tokens.embeddings.shape == (VOCAB, 8)
    assert not decoder.layers.layers.do_layer_norm_before


@pytest.mark.parametrize("changes", [{"word_embed_proj_dim": 8, "tie_word_embeddings": False},
                                     {"_remove_final_layer_norm": True},
                                     {"layer_norm_elementwise_affine": False, "do_layer_norm_before": False}],
                         ids=["projected", "no_final_norm", "not_affine"])
def test_opt_projection_and_final_norm_options_match_hf(changes):
    """The options apart: an untied head of the projected width on pre-norm blocks, a
    pre-norm OPT without its final layer norm (checkpoints fine-tuned before transformers 4.20),
    layer norms without weight or bias (``layer_norm_elementwise_affine: false``: none exported)."""
    hf = hf_of(opt_config(**changes))
    model = ported(hf)
    assert_logits_equal(model, hf)
    assert_saves_back(model, hf)


def test_opt_post_norm_dropout_equals_hf_train_on_the_same_masks(same_masks):  # noqa: F811  (the fixture)
    """``from_hf(..., dropout=True)`` on a post-norm OPT in training mode: the attention
    weights, the attention output and the MLP output dropped where HF's post-norm layer drops
    them (before each residual sum, then the norm), on the same masks (tests/test_hf_dropout.py)."""
    hf = hf_of(opt_config(do_layer_norm_before=False, word_embed_proj_dim=8, dropout=0.2, attention_dropout=0.1))
    model = ft.nn.training(ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0)))
    ids, mask = batch()
    hf.train()
    with torch.no_grad():
        expected = hf_call(hf, ids, mask).numpy()
    assert {p: same_masks.count(p) for p in set(same_masks)} == {0.1: 2, 0.2: 4}  # every HF position ran
    # one program (eager, one per operation); the masks drawn as it is traced, the patterns
    got = np.asarray(jax.jit(lambda m, k: m(ids, mask, key=k))(model, jax.random.key(1)))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], rtol=0, atol=ATOL * float(np.abs(expected[real]).max()))
    assert not np.allclose(got[real], hf_logits(hf.eval(), ids, mask)[real], atol=1e-3)  # the masks matter


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's
def test_opt_350m_lora_loads_and_saves_as_peft(tmp_path):
    """A PEFT LoRA on OPT-350m's layout, ``project_in`` / ``project_out`` among its targets:
    ``ft.nn.load_lora`` computes PEFT's logits, ``ft.nn.save_lora`` writes PEFT's tensors back
    bit for bit, and the merged model saves as a directory HF reads."""
    peft = pytest.importorskip("peft")
    import safetensors.numpy

    config = opt_config(do_layer_norm_before=False, word_embed_proj_dim=8)
    torch.manual_seed(2)
    peft_model = peft.get_peft_model(hf_of(config), peft.LoraConfig(
        init_lora_weights=False, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "project_in", "project_out"]))
    peft_model.eval().save_pretrained(str(tmp_path / "peft"))
    ids, mask = batch()
    expected = hf_logits(peft_model, ids, mask)
    model = ft.nn.load_lora(ported(hf_of(config)), tmp_path / "peft")
    real = mask.astype(bool)
    got = np.asarray(forward(model, ids, mask))  # (one program: eager, one per operation)
    np.testing.assert_allclose(got[real], expected[real], rtol=0, atol=ATOL * float(np.abs(expected[real]).max()))
    ft.nn.save_lora(model, tmp_path / "ft")
    ours, theirs = (safetensors.numpy.load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("ft", "peft"))
    assert set(ours) == set(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in theirs)
    merged = ft.nn.merge_lora(model)
    ft.nn.save_hf(merged, tmp_path / "merged")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(again, ids, mask)[real], expected[real], rtol=0,
                               atol=ATOL * float(np.abs(expected[real]).max()))


# ---- GPT-2's attention scalings ------------------------------------------------------------------

def gpt2_config(**changes):
    options = dict(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**options, **changes})


def test_gpt2_unscaled_attention_by_inverse_layer_index_matches_hf():
    """``scale_attn_weights: false`` (logits ``q k^T``, no ``1 / sqrt(d)``) with
    ``scale_attn_by_inverse_layer_idx: true`` (layer ``i``'s logits over ``i + 1``) and
    ``reorder_and_upcast_attn`` (float32 logits, as functree's attention computes them
    anyway): refused by name before, now HF's logits, tokens (a KV cache), training and
    save-back. Each layer's factor is its attention's ``logit_scale`` (no weight)."""
    model, _ = check_all(gpt2_config(scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True,
                                     reorder_and_upcast_attn=True))
    np.testing.assert_allclose(np.asarray(model.transformer.h.layers.attn.logit_scale), [1.0, 1 / 2, 1 / 3], rtol=1e-7)
    assert "transformer.h.0.attn.logit_scale" not in ft.nn.to_hf_state_dict(model, numpy=True)


@pytest.mark.parametrize("changes", [{"scale_attn_weights": False}, {"scale_attn_by_inverse_layer_idx": True}],
                         ids=["unscaled", "by_layer"])
def test_gpt2_each_attention_scaling_matches_hf(changes):
    hf = hf_of(gpt2_config(**changes))
    model = ported(hf)
    assert_logits_equal(model, hf)
    assert_generates_as_hf(model, hf)


@pytest.mark.parametrize("changes", [{"scale_attn_weights": False}, {"scale_attn_by_inverse_layer_idx": True}],
                         ids=["unscaled", "by_layer"])
def test_gpt2_attention_factors_of_a_float64_port_are_hf_python_floats(changes):
    """HF's factor is a Python float (a double): a float64 port holds it in float64, not
    rounded to float32 (measured: 1.0e-11 of max|logits| with float32 factors, 1.4e-16 now;
    float64's own rounding over these sums: 1e-14 is ~100 times it)."""
    hf = hf_of(gpt2_config(**changes)).double()
    ids, mask = batch()
    expected = hf_logits(hf, ids, mask)
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert model.transformer.h.layers.attn.logit_scale.dtype == jnp.float64
        got = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], rtol=0, atol=1e-14 * float(np.abs(expected[real]).max()))


def test_gpt2_default_scaling_holds_no_leaf_and_a_fresh_port_has_the_scales():
    """HF's default scaling is the attention's own (no leaf: today's tree and program); a port
    built from the config alone (no weights) has the factors too."""
    plain = jax.eval_shape(lambda: ft.nn.from_hf(gpt2_config(), key=jax.random.key(0)))  # the structure alone
    assert plain.transformer.h.layers.attn.logit_scale is None
    fresh = ft.nn.from_hf(gpt2_config(scale_attn_by_inverse_layer_idx=True), key=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(fresh.transformer.h.layers.attn.logit_scale), 0.5 / np.arange(1, 4), rtol=1e-7)


# ---- Qwen2's mixed sliding-window and full-attention layers --------------------------------------

QWEN2 = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=32, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def without_windows(model):
    """``model`` with its layers' windows removed (every layer full attention)."""
    layers = model.model.layers
    attention = layers.layers.self_attn.replace(member_window=None)
    return model.replace(model=model.model.replace(layers=layers.replace(layers=layers.layers.replace(self_attn=attention))))


def test_qwen2_max_window_layers_mixes_full_and_sliding_layers_as_hf():
    """``use_sliding_window`` with ``max_window_layers: 1``: layer 0 full attention, layers 1
    and 2 a window of 2 (refused before: MIXED_WINDOWS). Each layer's window is its member's
    ``member_window`` (0: full), the Stack one block; HF's logits, tokens (a KV cache: the
    window over the cache's slots), training and save-back; without the windows the logits differ."""
    model, hf = check_all(transformers.Qwen2Config(**QWEN2, use_sliding_window=True, sliding_window=2,
                                                   max_window_layers=1))
    attention = model.model.layers.layers.self_attn
    assert attention.window is None and np.asarray(attention.member_window).tolist() == [0, 2, 2]
    ids, mask = batch()
    real = mask.astype(bool)
    full = np.asarray(forward(without_windows(model), ids, mask))  # (one program: eager, one per operation)
    assert not np.allclose(full[real], hf_logits(hf, ids, mask)[real], atol=1e-2)  # the windows matter


def test_qwen2_layer_types_in_any_order_match_hf():
    """``layer_types`` (transformers 5) with a full layer between sliding ones."""
    hf = hf_of(transformers.Qwen2Config(**QWEN2, use_sliding_window=True, sliding_window=2,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    model = ported(hf)
    assert np.asarray(model.model.layers.layers.self_attn.member_window).tolist() == [2, 0, 2]
    assert_logits_equal(model, hf)
    assert_generates_as_hf(model, hf)


def test_qwen2_windows_on_every_layer_or_none_keep_the_static_window():
    """Every layer sliding (or none): the attention's static ``window`` as before, no leaf."""
    config = transformers.Qwen2Config(**QWEN2, use_sliding_window=True, sliding_window=2, max_window_layers=0)
    every = jax.eval_shape(lambda: ft.nn.from_hf(config, key=jax.random.key(0)))  # the structure alone
    attention = every.model.layers.layers.self_attn
    assert attention.window == 2 and attention.member_window is None


# ---- OLMo's clip_qkv -----------------------------------------------------------------------------

def test_olmo_clip_qkv_generates_trains_and_saves_as_hf():
    """``clip_qkv`` at a bound that clamps (0.5): HF's logits, tokens, training and save-back
    (tests/test_hf_olmo.py: the clamp matters)."""
    model, _ = check_all(transformers.OlmoConfig(**{**QWEN2, "num_hidden_layers": 2}, clip_qkv=0.5))
    assert model.model.layers.layers.self_attn.clip == 0.5
