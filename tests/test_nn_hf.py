"""ft.nn.from_hf / to_hf_state_dict against Hugging Face's own GPT-2, Llama and BERT.

Each HF model is built from a tiny config with random weights (no download), its weights
moved off HF's small initial values so every tensor matters. Logits must equal HF's at
every real token of a left-padded batch (HF given ``position_ids = cumsum(mask) - 1``, as
its ``generate`` computes them) to float32 rounding: atol 2.5e-5 times the logits'
magnitude (the largest difference measured is 2.2e-6 of it, Llama 3 rope at 70 tokens,
times 10; all pass under every XLA CPU instruction set with isa-sweep). The user code of
each port is one line: ``ft.nn.from_hf(hf)``.
"""

import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn import _hf, _hf_models, _rotary

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_hf_ports import randomized  # noqa: E402

VOCAB, D, T = 40, 16, 9
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def batch(length=T):
    """Token ids [2, length] and a left-padded mask: the second row starts 3 pads in."""
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, length)).astype(np.int32)
    mask = np.ones((2, length), np.int32)
    mask[1, :3] = 0
    return ids, mask


def hf_output(hf, ids, mask, positions=True):
    kwargs = {"attention_mask": torch.from_numpy(mask).long()}
    if positions:
        kwargs["position_ids"] = torch.from_numpy(np.maximum(np.cumsum(mask, 1) - 1, 0)).long()
    with torch.no_grad():
        out = hf(torch.from_numpy(ids).long(), **kwargs)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


def assert_equal_at_tokens(model, hf, length=T, positions=True):
    ids, mask = batch(length)
    expected = hf_output(hf, ids, mask, positions)
    actual = np.asarray(jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids, mask))
    real = mask.astype(bool)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual[real], expected[real], rtol=0, atol=2.5e-5 * float(np.abs(expected).max()))


def assert_exports(model, hf):
    sd = ft.nn.to_hf_state_dict(model)
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd, strict=True)


def llama_config(**changes):
    options = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=2 * D, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(**{**options, **changes})


def gpt2_config(**changes):
    options = dict(vocab_size=VOCAB, n_positions=80, n_embd=D, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**options, **changes})


@pytest.fixture(scope="module")
def gpt2():
    return randomized(transformers.GPT2LMHeadModel(gpt2_config()))


@pytest.fixture(scope="module")
def llama():
    """4 layers (the fine-tune test trains the top two), untied, biases on, GQA."""
    config = llama_config(num_hidden_layers=4, attention_bias=True, mlp_bias=True)
    return randomized(transformers.LlamaForCausalLM(config))


# ---- logits equal HF's -------------------------------------------------------------------------

def test_gpt2(gpt2):
    model = ft.nn.from_hf(gpt2)
    assert isinstance(model.transformer.h, ft.nn.Stack) and model.lm_head is None  # tied to wte
    assert_equal_at_tokens(model, gpt2, length=70)
    assert_exports(model, gpt2)


def test_llama_grouped_query_untied_with_biases(llama):
    model = ft.nn.from_hf(llama)
    attention = model.model.layers[0].self_attn
    assert attention.num_kv_heads == 2 and attention.key_projection.bias is not None
    assert_equal_at_tokens(model, llama)
    assert_exports(model, llama)


@pytest.mark.parametrize("rope", [
    LLAMA3,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},  # max_position_embeddings 32 < 70 tokens: scaled
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
], ids=lambda r: r["rope_type"])
def test_llama_rope_scaling_at_70_tokens_tied(rope):
    hf = randomized(transformers.LlamaForCausalLM(llama_config(rope_scaling=rope, tie_word_embeddings=True,
                                                                num_hidden_layers=1, head_dim=8)))
    model = ft.nn.from_hf(hf)
    assert model.lm_head is None and model.model.layers[0].self_attn.rotary.kind == rope["rope_type"]
    assert_equal_at_tokens(model, hf, length=70)
    assert_exports(model, hf)


def test_bert_with_token_types_and_its_pooler():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=2 * D, max_position_embeddings=16)
    hf = randomized(transformers.BertModel(config))
    model = ft.nn.from_hf(hf)
    ids, mask = batch()
    types = (np.arange(T) >= 5).astype(np.int32)[None].repeat(2, 0)
    with torch.no_grad():  # BERT's positions are 0..T-1 with any mask
        out = hf(*(torch.from_numpy(a).long() for a in (ids, mask, types)))
    hidden = jax.jit(lambda m, *a: m(*a))(model, ids, mask, types)
    real, expected = mask.astype(bool), out.last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(hidden)[real], expected[real], rtol=0,
                               atol=2.5e-5 * float(np.abs(expected).max()))
    np.testing.assert_allclose(model.pooler(hidden[:, 0]), out.pooler_output.numpy(), rtol=0, atol=1e-5)
    assert_exports(model, hf)


def test_from_config_and_a_safetensors_file_without_torch(gpt2, tmp_path, monkeypatch):
    gpt2.save_pretrained(tmp_path)  # writes the tied head once
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails: this path never imports it
    model = ft.nn.from_hf(gpt2.config, tmp_path / "model.safetensors")
    exported = ft.nn.to_hf_state_dict(model, numpy=True)
    monkeypatch.undo()
    assert_equal_at_tokens(model, gpt2, length=70)
    np.testing.assert_array_equal(exported["lm_head.weight"], gpt2.state_dict()["transformer.wte.weight"].numpy())


def test_older_checkpoint_names_load_as_hf_reads_them(gpt2):
    """The hub's gpt2 file: the body's names without ``transformer.``, causal-mask buffers."""
    n = 80
    old = {k.removeprefix("transformer."): v for k, v in gpt2.state_dict().items() if k != "lm_head.weight"}
    old.update({f"h.{i}.attn.bias": torch.ones(1, 1, n, n) for i in range(2)}, **{"h.0.attn.masked_bias": torch.ones(())})
    expected = ft.to_flat_dict(ft.nn.from_hf(gpt2))
    for name, value in ft.to_flat_dict(ft.nn.from_hf(gpt2.config, old)).items():
        np.testing.assert_array_equal(value, expected[name])
    bert = {"bert.embeddings.LayerNorm.gamma": np.ones(4, np.float32), "bert.embeddings.LayerNorm.beta": np.zeros(4)}
    assert set(_hf._normalized("bert", bert)) == {"embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"}


def test_fine_tune_the_top_two_layers_leaves_the_rest_bit_identical(llama):
    model = ft.nn.from_hf(llama)
    ids, mask = batch()

    def loss_fn(m, b):
        logits = m(b[0], attention_mask=b[1])
        return ft.losses.softmax_cross_entropy(logits[:, :-1], b[0][:, 1:])

    optimizer = ft.optim.Optimizer(ft.optim.adamw(1e-2), wrt="model.layers.[2-3].*")
    step = ft.train.train_step(loss_fn, optimizer, donate=False)
    tuned, state = model, optimizer.init(model)
    for _ in range(2):
        tuned, state, _ = step(tuned, state, (ids, mask))
    before, after = ft.to_flat_dict(model, unstack=True), ft.to_flat_dict(tuned, unstack=True)
    for name in before:
        same = np.array_equal(before[name], after[name])
        assert same != name.startswith(("model.layers.2.", "model.layers.3.")), name


# ---- rope frequencies ---------------------------------------------------------------------------

def test_rope_frequencies_equal_hf():
    """Each rope type's inverse frequencies against HF's own functions (torch float32)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in (LLAMA3, {"rope_type": "linear", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0},
                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0}):
        config = llama_config(rope_scaling=dict(rope), head_dim=8)
        expected, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None, seq_len=70)
        ours = _hf._rope(config)
        actual = ours.inverse_frequencies(8, jnp.arange(70))
        np.testing.assert_allclose(actual, expected.numpy(), rtol=0, atol=6e-7)  # measured 6e-8 (llama3)
        assert ours.scale == pytest.approx(scale, abs=1e-7)


# ---- errors -------------------------------------------------------------------------------------

def test_uncovered_architectures_list_the_covered_ones(gpt2):
    with pytest.raises(ValueError, match=r"model_type 't5' is not covered; covered: gpt2 \(GPT2LMHeadModel\), llama"):
        ft.nn.from_hf(types.SimpleNamespace(model_type="t5"), {})
    with pytest.raises(ValueError, match=r"GPT2Model is not covered; of its model type functree covers GPT2LMHeadModel"):
        ft.nn.from_hf(gpt2.transformer)


def test_uncovered_config_options():
    with pytest.raises(ValueError, match=r"rope_type 'longrope' .* covered: default, linear, dynamic, yarn, llama3"):
        _hf._rope(types.SimpleNamespace(rope_parameters={"rope_type": "longrope"}, max_position_embeddings=8))
    with pytest.raises(ValueError, match=r"sets scale_attn_by_inverse_layer_idx=True"):
        ft.nn.from_hf(gpt2_config(scale_attn_by_inverse_layer_idx=True), {})
    with pytest.raises(ValueError, match=r"activation 'gelu_fast' is not covered; covered: gelu_new"):
        ft.nn.from_hf(gpt2_config(activation_function="gelu_fast"), {})
    with pytest.raises(ValueError, match=r"rope type 'ntk' is not covered"):
        ft.nn.RopeScaling("ntk")
    with pytest.raises(ValueError, match=r"RopeScaling\('llama3'\) needs original_max_positions"):
        ft.nn.RopeScaling("llama3", factor=8.0)
    with pytest.raises(ValueError, match=r"needs factor >= 1; given factor=0.5"):
        ft.nn.RopeScaling("linear", factor=0.5)


def test_weights_that_do_not_fit_the_config_name_the_tensor(gpt2):
    weights = dict(gpt2.state_dict())
    weights["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"transformer.h.1.mlp.c_fc.weight.*shape \(16, 64\).*shape \(3, 3\)"):
        ft.nn.from_hf(gpt2.config, weights)
    del weights["transformer.h.1.mlp.c_fc.weight"]
    with pytest.raises(ValueError, match=r"missing.*transformer.h.1.mlp.c_fc.weight"):
        ft.nn.from_hf(gpt2.config, weights)


def test_a_tied_head_that_differs_from_the_embedding(gpt2):
    weights = {**gpt2.state_dict(), "lm_head.weight": torch.zeros(VOCAB, D)}
    with pytest.raises(ValueError, match=r"'lm_head.weight' differs from 'transformer.wte.weight'"):
        ft.nn.from_hf(gpt2.config, weights)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"a dict without 'model_type'"):
        ft.nn.from_hf({"vocab_size": 3}, {})
    with pytest.raises(ValueError, match=r"Hugging Face model \(torch\) or config.*got int"):
        ft.nn.from_hf(3, {})
    with pytest.raises(ValueError, match=r"weights are a state dict .*got list"):
        ft.nn.from_hf(gpt2_config(), [])
    with pytest.raises(ValueError, match=r"a gpt2 config without weights .* needs a PRNG key"):
        ft.nn.from_hf(gpt2_config())
    with pytest.raises(ValueError, match=r"takes a model built by ft.nn.from_hf .*got Dense"):
        ft.nn.to_hf_state_dict(ft.nn.Dense(2, 2, key=jax.random.key(0)))


def test_bad_model_inputs():
    model = jax.eval_shape(lambda: ft.nn.from_hf(gpt2_config(n_layer=1), key=jax.random.key(0)))  # checks come first
    ids = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"input_ids must be integer token ids \[batch, T\], got f32\[2,5\]"):
        model(ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, 5\] of 0/1 .*got bool\[2,1,1,5\]"):
        model(ids, attention_mask=jnp.ones((2, 1, 1, 5), bool))
    with pytest.raises(ValueError, match=r"with a cache, pass the positions of the new tokens"):
        model(ids, attention_mask=jnp.ones((2, 8), bool), cache=object())
    with pytest.raises(ValueError, match=r"positions must be integers \[batch, T\] .*got f32\[2,5\]"):
        model(ids, positions=jnp.zeros((2, 5)))


def test_model_classes_are_plain_modules_of_ft_layers():
    assert issubclass(_hf_models.LlamaForCausalLM, ft.Module)
    assert set(_rotary.ROPE_TYPES) == {"default", "linear", "dynamic", "yarn", "llama3"}
