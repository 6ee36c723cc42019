"""Hugging Face's own GPT-2, BERT and Llama ported to functree models in a few lines.

Each HF model is built from a tiny config with random weights (no download: HF_HUB_OFFLINE),
its weights moved off HF's small initial values so every tensor matters, and ported onto a
functree model written as a user would (its blocks in an ``ft.nn.Stack`` and in an
``ft.nn.Sequential``). The ``port_*`` functions are the user code of each port; the
classes above them are the models. Logits must equal HF's to float32 rounding: an atol of
1e-5 times the logits' magnitude (the same sums in two libraries' kernels; the spread
measured under every XLA CPU instruction set with isa-sweep is below 1e-6 of it).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, D, HEADS, LAYERS, T = 50, 32, 4, 2, 7


def close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))


def randomized(hf):
    """``hf`` in eval mode with every parameter moved by N(0, 0.2): LayerNorm scales off one."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf.eval()


def hf_logits(hf, tokens, **kwargs):
    with torch.no_grad():
        return hf(torch.from_numpy(tokens).long(), **kwargs).logits.numpy()


def tokens(batch=2):
    return np.random.default_rng(0).integers(0, VOCAB, size=(batch, T)).astype(np.int32)


def blocks(make, n, key, stacked):
    """``n`` blocks as an ``ft.nn.Stack`` (scanned) or an ``ft.nn.Sequential`` (unrolled)."""
    if stacked:
        return ft.nn.Stack(make, n, key=key)
    return ft.nn.Sequential(*(make(k) for k in jax.random.split(key, n)))


# ---- GPT-2: pre-norm blocks, Conv1D's [in, out] weights, fused c_attn, tied head ------------

class MLP(ft.Module):
    c_fc: ft.nn.Dense
    c_proj: ft.nn.Dense

    def __init__(self, d, hidden, activation, *, key):
        k1, k2 = jax.random.split(key)
        self.c_fc = ft.nn.Dense(d, hidden, activation, key=k1)
        self.c_proj = ft.nn.Dense(hidden, d, key=k2)

    def __call__(self, x):
        return self.c_proj(self.c_fc(x))


class GPT2Block(ft.Module):
    ln_1: ft.nn.LayerNorm
    attn: ft.nn.MultiheadAttention
    ln_2: ft.nn.LayerNorm
    mlp: MLP

    def __init__(self, d, heads, epsilon, *, key):
        k1, k2 = jax.random.split(key)
        self.ln_1, self.ln_2 = ft.nn.LayerNorm(d, epsilon=epsilon), ft.nn.LayerNorm(d, epsilon=epsilon)
        self.attn = ft.nn.MultiheadAttention(d, heads, causal=True, key=k1)
        self.mlp = MLP(d, 4 * d, ft.nn.gelu, key=k2)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(ft.Module):
    embed: ft.nn.Embedding
    position: ft.nn.Embedding
    blocks: ft.Module
    norm: ft.nn.LayerNorm
    head: ft.nn.Dense

    def __init__(self, vocab, positions, d, heads, layers, *, epsilon=1e-5, stacked=True, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed, self.position = ft.nn.Embedding(vocab, d, key=k1), ft.nn.Embedding(positions, d, key=k2)
        self.blocks = blocks(lambda k: GPT2Block(d, heads, epsilon, key=k), layers, k3, stacked)
        self.norm = ft.nn.LayerNorm(d, epsilon=epsilon)
        self.head = ft.nn.Dense(d, vocab, use_bias=False, key=k4)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + jax.lax.broadcast_to_rank(self.position(jnp.arange(tokens.shape[-1])), x.ndim)
        return self.head(self.norm(self.blocks(x)))


GPT2_NAMES = {"transformer.wte": "embed", "transformer.wpe": "position", "transformer.h": "blocks",
              "transformer.ln_f": "norm", "lm_head": "head"}


def port_gpt2(hf, stacked):
    c = hf.config
    model = GPT(c.vocab_size, c.n_positions, c.n_embd, c.n_head, c.n_layer, epsilon=c.layer_norm_epsilon,
                stacked=stacked, key=jax.random.key(0))
    model = ft.nn.Shared(model, {"head.weight": ("embed.embeddings", jnp.transpose)})
    return ft.nn.load_torch_state_dict(model, hf.state_dict(), rename=GPT2_NAMES, layouts={"blocks.*": "conv1d"})


@pytest.mark.parametrize("stacked", [True, False], ids=["Stack", "Sequential"])
def test_gpt2(stacked):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=0, eos_token_id=0)
    hf = randomized(transformers.GPT2LMHeadModel(config))
    model = port_gpt2(hf, stacked)
    x = tokens()
    close(jax.jit(lambda m, x: m(x))(model, x), hf_logits(hf, x))
    # and back: HF's strict load_state_dict takes the export, tied lm_head included
    sd = ft.nn.torch_state_dict(model, rename=GPT2_NAMES, layouts={"blocks.*": "conv1d"})
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd, strict=True)


def test_gpt2_from_a_safetensors_file(tmp_path):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=0, eos_token_id=0)
    hf = randomized(transformers.GPT2LMHeadModel(config))
    hf.save_pretrained(tmp_path)  # writes the tied lm_head.weight once (under transformer.wte)
    model = GPT(VOCAB, 16, D, HEADS, LAYERS, key=jax.random.key(1))
    model = ft.nn.Shared(model, {"head.weight": ("embed.embeddings", jnp.transpose)})
    model = ft.nn.load_torch_state_dict(model, tmp_path / "model.safetensors", rename=GPT2_NAMES,
                                        layouts={"blocks.*": "conv1d"})
    x = tokens()
    close(jax.jit(lambda m, x: m(x))(model, x), hf_logits(hf, x))


# ---- BERT: post-norm blocks, a padding mask, a tied decoder (weight and bias) ---------------

class BertLayer(ft.Module):
    attention: ft.nn.MultiheadAttention
    attention_norm: ft.nn.LayerNorm
    intermediate: ft.nn.Dense
    output: ft.nn.Dense
    output_norm: ft.nn.LayerNorm

    def __init__(self, d, heads, hidden, epsilon, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = ft.nn.MultiheadAttention(d, heads, key=k1)
        self.intermediate = ft.nn.Dense(d, hidden, ft.nn.gelu_exact, key=k2)
        self.output = ft.nn.Dense(hidden, d, key=k3)
        self.attention_norm, self.output_norm = ft.nn.LayerNorm(d, epsilon=epsilon), ft.nn.LayerNorm(d, epsilon=epsilon)

    def __call__(self, x, mask):
        x = self.attention_norm(x + self.attention(x, mask=mask))
        return self.output_norm(x + self.output(self.intermediate(x)))


class Bert(ft.Module):
    """BertForMaskedLM's function: embeddings, post-norm encoder layers, the MLM head."""

    embed: ft.nn.Embedding
    position: ft.nn.Embedding
    token_type: ft.nn.Embedding
    embed_norm: ft.nn.LayerNorm
    layers: ft.Module
    transform: ft.nn.Dense
    transform_norm: ft.nn.LayerNorm
    decoder: ft.nn.Dense
    bias: jax.Array  # HF's cls.predictions.bias: the decoder's bias under a second name

    def __init__(self, vocab, positions, d, heads, hidden, n, *, epsilon=1e-12, stacked=True, key):
        k = jax.random.split(key, 6)
        self.embed, self.position = ft.nn.Embedding(vocab, d, key=k[0]), ft.nn.Embedding(positions, d, key=k[1])
        self.token_type = ft.nn.Embedding(2, d, key=k[2])
        self.embed_norm, self.transform_norm = ft.nn.LayerNorm(d, epsilon=epsilon), ft.nn.LayerNorm(d, epsilon=epsilon)
        self.layers = blocks(lambda key: BertLayer(d, heads, hidden, epsilon, key=key), n, k[3], stacked)
        self.transform = ft.nn.Dense(d, d, ft.nn.gelu_exact, key=k[4])
        self.decoder = ft.nn.Dense(d, vocab, key=k[5])
        self.bias = jnp.zeros(vocab)

    def __call__(self, tokens, padding):
        position = self.position(jnp.arange(tokens.shape[-1]))
        x = self.embed(tokens) + jax.lax.broadcast_to_rank(position, tokens.ndim + 1) + self.token_type(jnp.zeros_like(tokens))
        x, mask = self.embed_norm(x), padding[:, None, None, :]  # mask [batch, heads, queries, keys]
        for layer in [self.layers] if isinstance(self.layers, ft.nn.Stack) else self.layers:
            x = layer(x, mask)  # a Stack passes the mask to each member
        return self.decoder(self.transform_norm(self.transform(x)))


BERT_NAMES = {
    "bert.embeddings.word_embeddings": "embed", "bert.embeddings.position_embeddings": "position",
    "bert.embeddings.token_type_embeddings": "token_type", "bert.embeddings.LayerNorm": "embed_norm",
    "bert.encoder.layer.*.attention.output.LayerNorm": "layers.*.attention_norm",
    "bert.encoder.layer.*.intermediate.dense": "layers.*.intermediate",
    "bert.encoder.layer.*.output.dense": "layers.*.output", "bert.encoder.layer.*.output.LayerNorm": "layers.*.output_norm",
    "bert.encoder.layer": "layers", "cls.predictions.transform.dense": "transform",
    "cls.predictions.transform.LayerNorm": "transform_norm", "cls.predictions.decoder": "decoder",
    "cls.predictions.bias": "bias",
}


def port_bert(hf, stacked):
    c = hf.config
    model = Bert(c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads, c.intermediate_size,
                 c.num_hidden_layers, epsilon=c.layer_norm_eps, stacked=stacked, key=jax.random.key(0))
    model = ft.nn.Shared(model, {"decoder.weight": ("embed.embeddings", jnp.transpose), "decoder.bias": "bias"})
    attention = ("self.query", "self.key", "self.value", "output.dense")
    return ft.nn.load_torch_state_dict(model, hf.state_dict(), rename=BERT_NAMES, layouts={"*.attention": attention})


@pytest.mark.parametrize("stacked", [True, False], ids=["Stack", "Sequential"])
def test_bert(stacked):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     intermediate_size=2 * D, max_position_embeddings=16)
    hf = randomized(transformers.BertForMaskedLM(config))
    model = port_bert(hf, stacked)
    x, padding = tokens(), np.ones((2, T), bool)
    padding[1, 4:] = False  # the second sequence is 4 tokens long
    expected = hf_logits(hf, x, attention_mask=torch.from_numpy(padding).long())
    close(jax.jit(lambda m, x, p: m(x, p))(model, x, padding), expected)
    sd = ft.nn.torch_state_dict(model, rename=BERT_NAMES, layouts={"*.attention": ("self.query", "self.key",
                                                                                    "self.value", "output.dense")})
    hf.load_state_dict(sd, strict=True)  # both tied names written, as HF's own state_dict


# ---- Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU ----------------------

class SwiGLU(ft.Module):
    gate_proj: ft.nn.Dense
    up_proj: ft.nn.Dense
    down_proj: ft.nn.Dense

    def __init__(self, d, hidden, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate_proj = ft.nn.Dense(d, hidden, jax.nn.silu, use_bias=False, key=k1)
        self.up_proj = ft.nn.Dense(d, hidden, use_bias=False, key=k2)
        self.down_proj = ft.nn.Dense(hidden, d, use_bias=False, key=k3)

    def __call__(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class LlamaBlock(ft.Module):
    input_layernorm: ft.nn.RMSNorm
    self_attn: ft.nn.MultiheadAttention
    post_attention_layernorm: ft.nn.RMSNorm
    mlp: SwiGLU

    def __init__(self, d, heads, kv_heads, hidden, epsilon, rope_theta, *, key):
        k1, k2 = jax.random.split(key)
        self.input_layernorm = ft.nn.RMSNorm(d, epsilon=epsilon)
        self.self_attn = ft.nn.MultiheadAttention(d, heads, num_kv_heads=kv_heads, rotary=rope_theta, causal=True,
                                                  use_bias=False, key=k1)
        self.post_attention_layernorm = ft.nn.RMSNorm(d, epsilon=epsilon)
        self.mlp = SwiGLU(d, hidden, key=k2)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(ft.Module):
    embed: ft.nn.Embedding
    blocks: ft.Module
    norm: ft.nn.RMSNorm
    head: ft.nn.Dense

    def __init__(self, vocab, d, heads, kv_heads, hidden, layers, *, epsilon, rope_theta, stacked=True, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = ft.nn.Embedding(vocab, d, key=k1)
        self.blocks = blocks(lambda k: LlamaBlock(d, heads, kv_heads, hidden, epsilon, rope_theta, key=k), layers, k2,
                             stacked)
        self.norm = ft.nn.RMSNorm(d, epsilon=epsilon)
        self.head = ft.nn.Dense(d, vocab, use_bias=False, key=k3)

    def __call__(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


LLAMA_NAMES = {"model.embed_tokens": "embed", "model.layers": "blocks", "model.norm": "norm", "lm_head": "head"}


def port_llama(hf, stacked):
    c = hf.config
    model = Llama(c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
                  c.num_hidden_layers, epsilon=c.rms_norm_eps, rope_theta=c.rope_parameters["rope_theta"],
                  stacked=stacked, key=jax.random.key(0))
    layouts = {"*.self_attn": ("q_proj", "k_proj", "v_proj", "o_proj")}
    return ft.nn.load_torch_state_dict(model, hf.state_dict(), rename=LLAMA_NAMES, layouts=layouts)


@pytest.mark.parametrize("stacked", [True, False], ids=["Stack", "Sequential"])
def test_llama_with_grouped_query_attention(stacked):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=2, intermediate_size=2 * D, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0)
    hf = randomized(transformers.LlamaForCausalLM(config))
    model = port_llama(hf, stacked)
    assert model.blocks[0].self_attn.key_projection.weight.shape == (D, 2 * D // HEADS)
    x = tokens()
    close(jax.jit(lambda m, x: m(x))(model, x), hf_logits(hf, x))


def test_docs_gpt2_port_runs_as_written():
    """The docs' "Loading torch weights" GPT-2 block, with the download replaced by a tiny model."""
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "guides" / "torch-weights.md").read_text()
    after = text.split("Hugging Face models port the same way")[1]
    block = after.split("```python", 1)[1].split("\n", 1)[1].split("```")[0]  # the fence may carry a title
    download = 'transformers.GPT2LMHeadModel.from_pretrained("gpt2")'
    assert download in block
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=0, eos_token_id=0)
    tiny = randomized(transformers.GPT2LMHeadModel(config))
    namespace = {"ft": ft, "jax": jax, "jnp": jnp, "GPT": GPT, "tiny": tiny}
    exec(block.replace(download, "tiny"), namespace)
    x = tokens()
    close(jax.jit(lambda m, x: m(x))(namespace["model"], x), hf_logits(tiny, x))
