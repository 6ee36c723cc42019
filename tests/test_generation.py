"""ft.nn.generate against Hugging Face's own generate, and its sampling, EOS and compile rules.

GPT-2 and Llama (grouped-query attention) are built by HF from tiny random configs (no
download), their weights moved off HF's small initial values (test_hf_ports.randomized), and
ported with ``ft.nn.from_hf`` (GPT-2 also by hand, onto a user model written against the
cache protocol: a Stack of blocks, each passing its attention's cache). Greedy tokens must
equal HF's ``generate(do_sample=False)`` token for token, left padding included; the test
checks that HF's top-1 margins are far
above float32 rounding (>= 1e-3 against logits of magnitude ~4: the two libraries' logits
differ by ~1e-6), so equal tokens are the right outcome and not luck.
"""

import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.generation import _controls, _decode, _generate
from functree.nn._eager_keys import model_reads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _backends import gpu_logprob_atol, logprob_atol  # noqa: E402
from test_hf_ports import GPT2_NAMES, MLP, randomized  # noqa: E402

VOCAB, D, HEADS, LAYERS, PROMPT, NEW = 50, 32, 4, 2, 6, 24


# ---- models written against the cache protocol ------------------------------------------

class GPT2Block(ft.Module):
    ln_1: ft.nn.LayerNorm
    attn: ft.nn.MultiheadAttention
    ln_2: ft.nn.LayerNorm
    mlp: MLP

    def __init__(self, c, *, key):
        k1, k2 = jax.random.split(key)
        self.ln_1, self.ln_2 = (ft.nn.LayerNorm(c.n_embd, epsilon=c.layer_norm_epsilon) for _ in range(2))
        self.attn = ft.nn.MultiheadAttention(c.n_embd, c.n_head, causal=True, key=k1)
        self.mlp = MLP(c.n_embd, 4 * c.n_embd, ft.nn.gelu, key=k2)

    def init_cache(self, batch_size, max_length, dtype=None):
        return self.attn.init_cache(batch_size, max_length, dtype)

    def __call__(self, x, *, mask, positions, cache):
        y, cache = self.attn(self.ln_1(x), mask=mask, positions=positions, cache=cache)
        x = x + y
        return x + self.mlp(self.ln_2(x)), cache


class GPT(ft.Module):
    embed: ft.nn.Embedding
    position: ft.nn.Embedding
    blocks: ft.nn.Stack
    norm: ft.nn.LayerNorm
    head: ft.nn.Dense
    max_positions: int = ft.field(static=True)

    def __init__(self, c, *, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed, self.position = ft.nn.Embedding(c.vocab_size, c.n_embd, key=k1), ft.nn.Embedding(c.n_positions, c.n_embd, key=k2)
        self.blocks = ft.nn.Stack(lambda k: GPT2Block(c, key=k), c.n_layer, key=k3)
        self.norm = ft.nn.LayerNorm(c.n_embd, epsilon=c.layer_norm_epsilon)
        self.head = ft.nn.Dense(c.n_embd, c.vocab_size, use_bias=False, key=k4)
        self.max_positions = c.n_positions

    def init_cache(self, batch_size, max_length, dtype=None):
        return self.blocks.init_cache(batch_size, max_length, dtype)

    def __call__(self, input_ids, *, attention_mask, positions, cache):
        # learned positions count the real tokens (HF: cumsum(mask) - 1); cache slots count all
        real = jnp.take_along_axis(jnp.cumsum(attention_mask, axis=1), positions, axis=1) - 1
        x = self.embed(input_ids) + self.position(jnp.maximum(real, 0))
        x, cache = self.blocks(x, mask=attention_mask, positions=positions, cache=cache)
        return self.head(self.norm(x)), cache


class TinyLM(ft.Module):
    """One attention layer: the cheap model of the option and error tests."""

    embed: ft.nn.Embedding
    attn: ft.nn.MultiheadAttention
    head: ft.nn.Dense
    max_positions: int = ft.field(static=True, default=32)

    def __init__(self, vocab=11, d=8, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = ft.nn.Embedding(vocab, d, key=k1)
        self.attn = ft.nn.MultiheadAttention(d, 2, rotary=True, causal=True, key=k2)
        self.head = ft.nn.Dense(d, vocab, key=k3)
        self.max_positions = 32

    def init_cache(self, batch_size, max_length, dtype=None):
        return self.attn.init_cache(batch_size, max_length, dtype)

    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None):
        x = self.embed(input_ids)
        y, cache = self.attn(x, mask=attention_mask, positions=positions, cache=cache)
        return self.head(x + y), cache


# ---- Hugging Face references ---------------------------------------------------------------

def left_padded_prompts():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (3, PROMPT)).astype(np.int32)
    mask = np.ones((3, PROMPT), np.int32)
    mask[1, :2] = mask[2, :4] = 0  # rows 1 and 2: 4 and 2 real tokens after their padding
    ids[mask == 0] = 0
    return ids, mask


def hf_generate(hf, ids, mask, **kwargs):
    with torch.no_grad():
        out = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                          max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True,
                          **kwargs)
    scores = torch.stack(out.scores, 1).numpy()
    top2 = np.sort(scores, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3  # clear top-1 margins: see the module
    return out.sequences.numpy()


@pytest.fixture(scope="module")
def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    hf = randomized(transformers.GPT2LMHeadModel(config))
    # the user model as a template (jax.eval_shape: its shapes, no values; each leaf is filled
    # from HF's state dict, strict) instead of initialised op by op (measured: 1.24 CPU-s of eager programs, 0.02 so)
    model = jax.eval_shape(lambda: ft.nn.Shared(GPT(config, key=jax.random.key(0)),
                                                {"head.weight": ("embed.embeddings", jnp.transpose)}))
    by_hand = ft.nn.load_torch_state_dict(model, hf.state_dict(), rename=GPT2_NAMES, layouts={"blocks.*": "conv1d"})
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(by_hand))  # filled whole
    return hf, by_hand, ft.nn.from_hf(hf)


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=2, intermediate_size=2 * D, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    hf = randomized(transformers.LlamaForCausalLM(config))
    return hf, ft.nn.from_hf(hf)  # the one-call port


# ---- compiled sizes: buckets -------------------------------------------------------------------

def exact(monkeypatch):
    """Run generate without buckets (the loop compiled for the exact prompt and new sizes)."""
    monkeypatch.setattr(_generate, "_buckets", lambda prompt, new, limit: (prompt, new))


def test_buckets_give_the_exact_tokens_and_reuse_one_program(llama, monkeypatch):
    """A prompt of 5 or 6 tokens and 20 or 24 new ones run in one program (prompt bucket 8, new
    32): the second call compiles nothing; greedy with EOS, sampling with controls and beam
    search give the tokens (and scores) of loops compiled for the exact sizes."""
    from _compiles import compiled

    _, model = llama
    ids, mask = left_padded_prompts()
    calls: list[dict[str, Any]] = [
        dict(eos_token_id=0, pad_token_id=2),
        dict(eos_token_id=[0, 5], pad_token_id=2, temperature=0.9, top_k=7, top_p=0.9, key=jax.random.key(4),
             repetition_penalty=1.3, min_new_tokens=3, no_repeat_ngram_size=2, return_scores=True,
             stop=[[7, 8]]),
        dict(eos_token_id=0, pad_token_id=2, num_beams=3, num_return_sequences=2, return_scores=True),
    ]
    bucketed = []
    # One block, every cache cleared once at its start (the first test of the module: the
    # programs compiled here are the later tests'): each call's programs are those the block
    # logged since the call before, and the kinds' programs differ (their static options), so
    # each kind's first call compiles its loop and nothing else, and its second nothing.
    with compiled() as names:
        for kw in calls:  # the tokens compared below are those of the calls whose compiles are counted
            start = len(names)
            bucketed.append([ft.nn.generate(model, ids[:, cut:], new, attention_mask=mask[:, cut:], **kw)
                             for cut, new in ((0, NEW), (1, NEW - 4))])
            assert names[start:] == ["jit(beam_search)" if "num_beams" in kw else "jit(generate_loop)"], (kw, names)
        start = len(names)
        ft.nn.generate(model, ids, NEW, attention_mask=mask, eos_token_id=[])  # plain greedy: one program
        assert names[start:] == ["jit(generate_loop)"]
    exact(monkeypatch)
    for kw, got in zip(calls, bucketed):
        # the exact-size loops for the shorter prompt and fewer new tokens (both padded up to
        # their buckets): each exact size is a compile of its own, so one size per control
        for (cut, new), out in zip(((1, NEW - 4),), got[1:]):
            want = ft.nn.generate(model, ids[:, cut:], new, attention_mask=mask[:, cut:], **kw)
            for a, b in zip(*((out, want) if kw.get("return_scores") else ((out,), (want,)))):
                assert a.shape == b.shape
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, float(np.abs(b).max())))
    assert (np.asarray(bucketed[0][0])[:, PROMPT:] == 0).any()  # EOS ends a row (the padding after it is cropped)


def test_greedy_gpt2_equals_hf_generate_with_left_padding(gpt2):
    """A user model written against the protocol, and ft.nn.from_hf's GPT-2 (its learned
    positions count the real tokens before each cache slot)."""
    hf, by_hand, ported = gpt2
    ids, mask = left_padded_prompts()
    expected = hf_generate(hf, ids, mask, pad_token_id=0, eos_token_id=None)
    np.testing.assert_array_equal(ft.nn.generate(by_hand, ids, NEW, attention_mask=mask), expected)
    np.testing.assert_array_equal(ft.nn.generate(ported, ids, NEW, attention_mask=mask, eos_token_id=[]), expected)
    # A prompt of max_positions (n_positions) tokens gets one new token, as from HF: the last new
    # token is never fed back (it was refused, "no position is left for a new token").
    full = np.random.default_rng(1).integers(1, VOCAB, (1, 64)).astype(np.int32)
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(full).long(), attention_mask=torch.ones(1, 64, dtype=torch.long),
                               max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    np.testing.assert_array_equal(ft.nn.generate(ported, full, 1, eos_token_id=[]), expected)
    with pytest.raises(ValueError, match=r"feeds the model 65 positions(.|\n)*max_positions = 64(.|\n)*"
                                         r"generate\(model, input_ids, 1\)"):  # from_hf's GPT-2: n_positions
        ft.nn.generate(ported, full, 2)


def test_greedy_llama_gqa_equals_hf_generate_with_left_padding_and_eos(llama):
    """EOS 0 ends row 0 at new token 8 and row 1 at 15 (HF then emits the pad id 2); row 2 runs on."""
    hf, model = llama
    ids, mask = left_padded_prompts()
    expected = hf_generate(hf, ids, mask, pad_token_id=2, eos_token_id=0)
    new = expected[:, PROMPT:]
    assert (new[0, 9:] == 2).all() and (new[1, 16:] == 2).all() and (new[2] != 0).all()  # EOS is exercised
    out = ft.nn.generate(model, ids, NEW, attention_mask=mask, eos_token_id=0, pad_token_id=2)
    np.testing.assert_array_equal(out, expected)


def test_a_pad_id_outside_the_vocabulary_fills_finished_rows_only(llama):
    """HF takes pad_token_id = vocab_size as the fill of finished rows. The bucket's columns
    after a 5-token prompt (bucket 8) were filled with it too, and the prefill embedded
    them: NaN keys reached every row through the mask (0 * NaN), and every token came back
    0 with NaN scores. They hold id 0 now, masked."""
    hf, model = llama
    ids = np.arange(3, 13, dtype=np.int32).reshape(2, 5)
    expected = hf_generate(hf, ids, np.ones_like(ids), pad_token_id=2, eos_token_id=None)
    for pad in (VOCAB, VOCAB + 1000):
        tokens, scores = ft.nn.generate(model, ids, 6, eos_token_id=[], pad_token_id=pad, return_scores=True)
        np.testing.assert_array_equal(tokens, expected[:, :11])
        assert np.isfinite(np.asarray(scores)).all()


def test_a_batch_that_finishes_inside_the_prompts_bucket_is_padded_as_hf_pads_it(llama):
    """Both rows end at their second new token, before the loop fills the 3-token prompts'
    bucket (8 columns): the bucket's slots came back as id 0, not the pad id (greedy,
    `stop=` and beams alike)."""
    hf, model = llama
    ids = np.arange(5, 11, dtype=np.int32).reshape(2, 3)
    # (with its scores: the program of the test above, 2 rows in buckets of 8 and 8; greedy
    # tokens do not depend on it)
    free = np.asarray(ft.nn.generate(model, ids, 6, eos_token_id=[], return_scores=True)[0])
    eos = [int(free[0, 4]), int(free[1, 4])]
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.ones(2, 3, dtype=torch.long),
                               max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=2).numpy()
    assert expected.shape[1] < 9 or (expected[:, 5:] == 2).all()  # both rows ended early: pad after
    expected = np.pad(expected, ((0, 0), (0, 9 - expected.shape[1])), constant_values=2)
    np.testing.assert_array_equal(ft.nn.generate(model, ids, 6, eos_token_id=eos, pad_token_id=2), expected)
    stopped = ft.nn.generate(model, ids, 6, eos_token_id=[], pad_token_id=2, stop=[[eos[0]], [eos[1]]])
    np.testing.assert_array_equal(stopped, expected)
    with torch.no_grad():
        hf_beams = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.ones(2, 3, dtype=torch.long),
                               max_new_tokens=6, do_sample=False, num_beams=2, eos_token_id=[free[1, 3]],
                               pad_token_id=2).numpy()
    hf_beams = np.pad(hf_beams, ((0, 0), (0, 9 - hf_beams.shape[1])), constant_values=2)
    assert (hf_beams[1, 4:] == 2).all()  # row 1's best beam ends at its first token
    np.testing.assert_array_equal(
        ft.nn.generate(model, ids, 6, num_beams=2, eos_token_id=[int(free[1, 3])], pad_token_id=2), hf_beams)


# ---- sampling, EOS, compilation --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    prompt = jnp.array([[3, 4, 5], [0, 6, 7]], jnp.int32)
    return TinyLM(key=jax.random.key(0)), prompt, jnp.array([[1, 1, 1], [0, 1, 1]], jnp.int32)


@jax.jit
def all_logits(model, tokens, mask):
    """Logits at every position of ``tokens`` (one prefill call of the protocol)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    am = jnp.concatenate([mask, jnp.ones((b, t - mask.shape[1]), jnp.int32)], axis=1)
    return model(tokens, attention_mask=am, positions=positions, cache=model.init_cache(b, t))[0]


_SHIFT_CELL = """
import jax, jax.numpy as jnp, functree as ft
SHIFT = 1
class Counting(ft.Module):
    # the next token is the last one plus SHIFT (a notebook's global), modulo the vocabulary
    table: jax.Array
    def init_cache(self, batch_size, max_length, dtype=None):
        return jnp.zeros((batch_size, max_length), jnp.float32)
    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None):
        following = (input_ids + SHIFT) % self.table.shape[0]
        return jax.nn.one_hot(following, self.table.shape[0]) * 10.0 + jax.lax.broadcast_to_rank(self.table[0], following.ndim + 1), cache
model = Counting(jnp.zeros((7, 7)))
"""


def test_a_global_the_model_reads_set_in_a_later_cell_generates_with_the_new_value():
    """A notebook: ``SHIFT = 2`` set after a first ``generate``, read by the model's
    ``__call__``: the second call ran the loop compiled with ``SHIFT = 1`` ([1 2 3 4 5] where
    the model now counts [1 2 4 6 1]), silently, while an eager call saw 2. The loops are keyed
    by what the model's Python reads (beam search's loop too); unchanged code compiles nothing."""
    ns: dict = {}
    exec(compile(_SHIFT_CELL, "<cell>", "exec"), ns)
    ids, model = jnp.array([[1, 2]], jnp.int32), ns["model"]
    np.testing.assert_array_equal(ft.nn.generate(model, ids, 3), [[1, 2, 3, 4, 5]])
    compiled = _decode.generate_loop._cache_size()  # pyright: ignore[reportAttributeAccessIssue]
    reads = model_reads(model)
    np.testing.assert_array_equal(ft.nn.generate(model, ids, 3), [[1, 2, 3, 4, 5]])
    assert _decode.generate_loop._cache_size() == compiled  # pyright: ignore[reportAttributeAccessIssue]
    ns["SHIFT"] = 2
    np.testing.assert_array_equal(ft.nn.generate(model, ids, 3), [[1, 2, 4, 6, 1]])
    assert model_reads(model) != reads  # the key of beam search's loop too


def test_a_model_reading_a_global_too_large_to_key_generates_with_its_values_now():
    """A model whose Python reads a NumPy global over the key's size limit: each call traces its
    own loop (a new ``jax.jit`` of the same function found JAX's old trace), never the one
    traced with an older value of what it reads."""
    ns: dict = {"np": np}
    exec(compile(_SHIFT_CELL.replace("(input_ids + SHIFT)", "(input_ids + SHIFT + OFFSETS[0])")
                 + "OFFSETS = np.zeros(5000, np.int32)\n", "<cell>", "exec"), ns)
    ids, model = jnp.array([[1, 2]], jnp.int32), ns["model"]
    assert model_reads(model) is None
    np.testing.assert_array_equal(ft.nn.generate(model, ids, 3), [[1, 2, 3, 4, 5]])
    ns["SHIFT"] = 2
    np.testing.assert_array_equal(ft.nn.generate(model, ids, 3), [[1, 2, 4, 6, 1]])


def test_sampling_is_reproducible_by_key_and_stays_in_top_k(tiny):
    model, prompt, mask = tiny
    sample = lambda key, **kw: ft.nn.generate(model, prompt, 12, attention_mask=mask, key=key, **kw)  # noqa: E731
    before = _decode.generate_loop._cache_size()  # pyright: ignore[reportAttributeAccessIssue]
    a = sample(jax.random.key(1), temperature=2.0, top_k=3)
    np.testing.assert_array_equal(a, sample(jax.random.key(1), temperature=2.0, top_k=3))
    b = sample(jax.random.key(2), temperature=1.5, top_k=3)  # another key and temperature: no recompile
    assert (a != b).any()
    after = _decode.generate_loop._cache_size()  # pyright: ignore[reportAttributeAccessIssue]
    assert after == before + 1  # one compile per shape and options
    as_arrays = sample(jax.random.key(2), temperature=jnp.float32(1.5), top_k=jnp.int32(3), top_p=np.array(1.0))
    np.testing.assert_array_equal(as_arrays, b)  # 0-d arrays are the numbers they hold (were refused)
    np.testing.assert_array_equal(ft.nn.generate(model, prompt, jnp.int32(12), attention_mask=mask,
                                                 key=jax.random.key(2), temperature=1.5, top_k=3), b)
    for out in (a, b):
        logits = all_logits(model, out, mask)[:, 2:-1]  # the logits each new token was drawn from
        top3 = jax.lax.top_k(logits, 3)[1]
        assert (top3 == out[:, 3:, None]).any(-1).all()


def test_a_seed_or_several_keys_is_refused_at_the_call_and_a_raw_key_samples_as_a_typed_one(tiny):
    model, prompt, mask = tiny
    sample = lambda key: ft.nn.generate(model, prompt, 4, attention_mask=mask, temperature=1.5, key=key)  # noqa: E731
    np.testing.assert_array_equal(sample(jax.random.PRNGKey(1)), sample(jax.random.key(1)))
    with pytest.raises(TypeError, match=re.escape("got 3 (int)")) as seed:  # torch's manual_seed habit
        sample(3)
    assert "key=jax.random.key(3)" in str(seed.value)
    for several in (jax.random.split(jax.random.key(1), 2), jax.random.split(jax.random.PRNGKey(1), 2)):
        with pytest.raises(ValueError, match=re.escape("got 2 keys")) as error:  # was fold_in's, inside JAX
            sample(several)
        assert "key=jax.random.split(key, 2)[0]" in str(error.value)


# filtered as one program a case (op by op, eagerly: 45 programs compiled for the cases below)
_filtered = jax.jit(_controls.filtered, static_argnames=("temperature", "top_k", "top_p", "min_p"))


def test_filters_equal_hf_logits_warpers():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32) * 3
    no_ids = torch.zeros((6, 1), dtype=torch.long)  # the warpers do not read the ids
    for temperature, top_k, top_p, min_p in [(0.7, 5, None, None), (1.0, None, 0.8, None), (1.3, 20, 0.6, None),
                                             (0.5, None, 0.999, None), (1.0, None, None, 0.1),
                                             (1.5, 30, 0.9, 0.05), (0.8, None, None, 0.5)]:
        expected = TemperatureLogitsWarper(temperature)(no_ids, torch.from_numpy(logits))
        if top_k is not None:
            expected = TopKLogitsWarper(top_k)(no_ids, expected)
        if top_p is not None:
            expected = TopPLogitsWarper(top_p)(no_ids, expected)
        if min_p is not None:
            before = np.isfinite(expected.numpy()).sum()
            expected = MinPLogitsWarper(min_p)(no_ids, expected)
            assert np.isfinite(expected.numpy()).sum() < before  # min_p removed some tokens
        ours = np.asarray(_filtered(jnp.asarray(logits), temperature, top_k=top_k, top_p=top_p, min_p=min_p))
        expected = expected.numpy()
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(expected))
        kept = np.isfinite(expected)
        np.testing.assert_allclose(ours[kept], expected[kept], rtol=0, atol=1e-6 * np.abs(expected[kept]).max())


def test_rows_past_eos_keep_emitting_eos_or_the_pad_id(tiny):
    model, prompt, mask = tiny
    free = np.asarray(ft.nn.generate(model, prompt, 12, attention_mask=mask))[:, 3:]
    eos = int(free[0, 2])  # row 0's third new token
    ends = [int(np.argmax(row == eos)) if (row == eos).any() else None for row in free]
    for pad, fill in ((None, eos), (10, 10)):  # one compile: the EOS and pad ids are traced
        out = np.asarray(ft.nn.generate(model, prompt, 12, attention_mask=mask, eos_token_id=[eos], pad_token_id=pad))
        for row, end, tokens in zip(free, ends, out[:, 3:]):
            stop = len(row) if end is None else end + 1
            np.testing.assert_array_equal(tokens[:stop], row[:stop])  # the same tokens up to EOS
            assert (tokens[stop:] == fill).all()


# ---- controls: repetition penalty, min_new_tokens, scores, stop sequences, beams ------------------

def hf_outputs(hf, ids, mask, **kwargs):
    with torch.no_grad():
        return hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                           max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True,
                           **kwargs)


def hf_expected(hf, out, beams=False, pad=2):
    """HF's sequences padded to PROMPT + NEW with ``pad`` (HF crops at the longest row), and
    compute_transition_scores (HF's per-token log-probabilities, 0 past a beam's end)."""
    sequences = np.full((out.sequences.shape[0], PROMPT + NEW), pad, np.int64)
    sequences[:, :out.sequences.shape[1]] = out.sequences.numpy()
    if beams:
        scores = hf.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    else:
        scores = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    padded = np.zeros((len(sequences), NEW), np.float32)
    padded[:, :scores.shape[1]] = scores.numpy()
    return sequences, padded


def char_tokenizer():
    """A tokenizer whose tokens are single characters ('a', 'b', ...): HF's stop_strings then
    are token sequences (built offline)."""
    import tokenizers

    chars = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(VOCAB - 26)]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="a"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer), chars


def test_repetition_penalty_min_new_tokens_stop_and_scores_equal_hf_generate(llama):
    """Greedy with HF's processors and stopping rules, left padding (the penalty counts real
    prompt tokens only; a stop pair may start in the prompt): the tokens equal HF's (its
    stop_strings over a one-character-per-token tokenizer), the scores its
    compute_transition_scores(normalize_logits=True) until each row's end (0 afterwards, where
    HF scores the pad tokens)."""
    hf, model = llama
    ids, mask = left_padded_prompts()
    options: dict[str, Any] = dict(eos_token_id=0, pad_token_id=2, repetition_penalty=1.5, min_new_tokens=12)
    free = hf_outputs(hf, ids, mask, **options).sequences.numpy()  # without stop sequences
    stop = [free[1, PROMPT + 5:PROMPT + 7].tolist(), [int(ids[2, -1]), int(free[2, PROMPT])]]
    tokenizer, chars = char_tokenizer()
    out = hf_outputs(hf, ids, mask, stop_strings=["".join(chars[i] for i in s) for s in stop], tokenizer=tokenizer,
                     **options)
    top2 = np.sort(torch.stack(out.scores, 1).numpy(), axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3  # clear margins after the penalty
    expected, expected_scores = hf_expected(hf, out)
    # every control is exercised: the penalty changes tokens, EOS is held back, the stops end rows 1 and 2
    plain = hf_generate(hf, ids, mask, pad_token_id=2, eos_token_id=0)
    assert (free[:, PROMPT:PROMPT + 8] != plain[:, PROMPT:PROMPT + 8]).any()
    unheld = hf_outputs(hf, ids, mask, **{**options, "min_new_tokens": 0}).sequences.numpy()
    assert (unheld[0, PROMPT:PROMPT + 12] == 0).any() and (expected[0, PROMPT:PROMPT + 12] != 0).all()
    assert (expected[0, PROMPT + 12:] == 0).any() and (expected[1, PROMPT + 7:] == 2).all()
    assert (expected[2, PROMPT + 1:] == 2).all()
    tokens, scores = ft.nn.generate(model, ids, NEW, attention_mask=mask, stop=stop, return_scores=True, **options)
    np.testing.assert_array_equal(tokens, expected)
    lengths = [np.argmax(row[PROMPT:] == 0) + 1 if (row[PROMPT:] == 0).any() else NEW for row in expected]
    lengths[1:] = [7, 1]
    ended = np.arange(NEW) >= np.array(lengths)[:, None]
    expected_scores[ended] = 0.0
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=logprob_atol(expected_scores, 2e-5))


def _unused_pad(ids, mask, *outputs):
    """``ids`` with its padding set to a token id that no real prompt token and no output
    uses: Hugging Face's no_repeat_ngram_size counts padding as tokens and ours does not, so
    the two agree exactly when no n-gram of padding can match."""
    used = set(ids[mask != 0].tolist()).union(*(set(o.ravel().tolist()) for o in outputs))
    free = next(i for i in range(VOCAB) if i not in used)
    return np.where(mask != 0, ids, free), free


def test_no_repeat_ngram_bad_words_and_suppress_tokens_equal_hf_generate(llama):
    """Greedy and beam search with HF's no_repeat_ngram_size, bad_words_ids and
    suppress_tokens (and the penalty before them), left-padded prompts: tokens and scores
    equal HF's, and the controls change what plain decoding gives. (n = 1 bans every token of the row, which for
    HF includes the padding token itself: that case runs unpadded.)"""
    hf, model = llama
    ids, mask = left_padded_prompts()
    plain = hf_outputs(hf, ids, mask, eos_token_id=0, pad_token_id=2).sequences.numpy()
    suppress = sorted({int(plain[0, PROMPT + 1]), int(plain[1, PROMPT])})
    bad = [[int(plain[0, PROMPT + 3])], plain[1, PROMPT + 2:PROMPT + 4].tolist(), [0]]  # [0]: EOS, ignored (HF)
    assert not set(bad[0]) & set(suppress)
    for n, more in [(2, {"repetition_penalty": 1.2, "bad_words_ids": bad}),
                    (3, {"num_beams": 3, "num_return_sequences": 2, "bad_words_ids": bad}), (1, {"unpadded": True})]:
        if more.pop("unpadded", False):
            ids, mask = ids[:1], mask[:1]
            plain = plain[:1]
        options: dict[str, Any] = dict(eos_token_id=0, pad_token_id=2, no_repeat_ngram_size=n,
                                       suppress_tokens=suppress, **more)
        first = hf_outputs(hf, ids, mask, **options).sequences.numpy()
        padded, free = _unused_pad(ids, mask, plain, first)
        out = hf_outputs(hf, padded, mask, **options)
        expected, expected_scores = hf_expected(hf, out, beams="num_beams" in more)
        assert free not in expected[:, PROMPT:]
        tokens, scores = ft.nn.generate(model, padded, NEW, attention_mask=mask, return_scores=True, **options)
        np.testing.assert_array_equal(tokens, expected, err_msg=f"n={n} {more}")
        generated = expected[:, PROMPT:]
        lengths = np.where((generated == 0).any(1), np.argmax(generated == 0, 1) + 1, NEW)
        alive = np.arange(NEW) < lengths[:, None]  # (HF scores the pad tokens after a row's end; ours are 0)
        assert np.isfinite(expected_scores[alive]).all() and (np.asarray(scores)[~alive] == 0).all()
        np.testing.assert_allclose(np.asarray(scores)[alive], expected_scores[alive], rtol=0,
                                   atol=logprob_atol(expected_scores[alive], 2e-5))
        generated = np.asarray(tokens)[:, PROMPT:]
        assert not np.isin(generated, suppress).any()
        if "bad_words_ids" in more:
            assert not np.isin(generated, bad[0]).any() and (generated == 0).any()  # EOS still emitted
            pairs = {tuple(row[i:i + 2]) for row in np.asarray(tokens) for i in range(PROMPT - 1, PROMPT + NEW - 1)}
            assert tuple(bad[1]) not in pairs
        for row, real in zip(np.asarray(tokens), mask.astype(bool)):
            text = row[np.concatenate([real, np.ones(NEW, bool)])].tolist()
            grams = [tuple(text[i:i + n]) for i in range(len(text) - n + 1)]
            ended = [g for g in grams if 0 not in g and 2 not in g]  # before the row's end (EOS 0, pad 2)
            assert len(set(ended)) == len(ended), f"a repeated {n}-gram in {text}"
        if "num_beams" not in more:
            assert (np.asarray(tokens)[:, PROMPT:] != plain[:, PROMPT:]).any()


class Recorder:
    """A streamer (HF's protocol) that keeps what it is given."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(np.asarray(value).tolist())

    def end(self):
        self.ends += 1


def test_a_streamer_gets_what_hf_generate_gives_it(llama, capsys):
    """The prompt, each step's tokens (a finished row's pad ids too) until every row ends,
    then end(): equal to what HF's generate puts into the same streamer; a new streamer
    runs the same compiled loop; HF's TextStreamer prints the new text."""
    hf, model = llama
    ids, mask = left_padded_prompts()
    options: dict[str, Any] = dict(eos_token_id=[0, 18], pad_token_id=2, min_new_tokens=3)

    class HFRecorder(Recorder, transformers.generation.streamers.BaseStreamer):
        pass

    theirs = HFRecorder()
    Recorder.__init__(theirs)
    expected = hf_outputs(hf, ids, mask, streamer=theirs, **options).sequences.numpy()
    assert len(theirs.puts) < NEW + 1  # every row ended before NEW tokens
    ours = Recorder()
    tokens = ft.nn.generate(model, ids, NEW, attention_mask=mask, streamer=ours, **options)
    assert ours.puts == theirs.puts and ours.ends == theirs.ends == 1
    np.testing.assert_array_equal(np.asarray(tokens)[:, :expected.shape[1]], expected)
    compiled = _decode.generate_loop._cache_size()
    again = Recorder()
    ft.nn.generate(model, ids, NEW, attention_mask=mask, streamer=again, **options)
    assert again.puts == ours.puts and _decode.generate_loop._cache_size() == compiled
    tokenizer, chars = char_tokenizer()
    printed = transformers.TextStreamer(tokenizer, skip_prompt=True)
    one = ft.nn.generate(model, ids[:1], 8, streamer=printed)
    assert capsys.readouterr().out == "".join(chars[i] for i in np.asarray(one)[0, PROMPT:]) + "\n"


def test_sampling_scores_are_hf_processed_log_probabilities(tiny):
    """Sampled tokens' scores: log_softmax of the logits after HF's repetition penalty (left
    padding not counted), temperature and top-k, each step's processors run by HF on the
    sampled row so far."""
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    model, prompt, mask = tiny
    tokens, scores = ft.nn.generate(model, prompt, 10, attention_mask=mask, key=jax.random.key(3), temperature=1.5,
                                    top_k=4, repetition_penalty=1.4, return_scores=True)
    logits = torch.from_numpy(np.asarray(all_logits(model, tokens, mask))[:, 2:-1].copy())
    rows = torch.from_numpy(np.array(tokens)).long()
    padding = torch.from_numpy(np.array(mask == 0).sum(1))
    expected = []
    for t in range(10):
        x = RepetitionPenaltyLogitsProcessor(1.4, prompt_ignore_length=padding)(rows[:, :3 + t], logits[:, t].clone())
        x = TopKLogitsWarper(4)(rows, TemperatureLogitsWarper(1.5)(rows, x))
        expected.append(torch.log_softmax(x, -1).gather(1, rows[:, 3 + t:4 + t])[:, 0].numpy())
    expected = np.stack(expected, 1)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(scores, expected, rtol=0, atol=logprob_atol(expected, 3e-5))


BEAMS = [  # num_beams, num_return_sequences, EOS ids, length_penalty, early_stopping, more options
    (3, 2, 0, None, None, {}),  # HF's defaults
    # one compile for these two (length_penalty and early_stopping are traced)
    (4, 2, [0, 5], 0.5, True, {"min_new_tokens": 4, "repetition_penalty": 1.3, "stop": True}),
    (4, 2, [0, 5], 0.7, "never", {"min_new_tokens": 4, "repetition_penalty": 1.3, "stop": True}),
]


@pytest.mark.parametrize(("beams", "returns", "eos", "length_penalty", "early", "more"), BEAMS)
def test_beam_search_equals_hf_generate(llama, beams, returns, eos, length_penalty, early, more):
    """HF's beam search, left-padded prompts: the returned sequences (best first, some ended by
    EOS or a stop sequence), and the scores its compute_transition_scores(beam_indices) gives,
    whose sums over new_tokens ** length_penalty are HF's sequences_scores."""
    hf, model = llama
    ids, mask = left_padded_prompts()
    options: dict[str, Any] = dict(num_beams=beams, num_return_sequences=returns, eos_token_id=eos, pad_token_id=2,
                                   **more)
    if length_penalty is not None:
        options["length_penalty"] = length_penalty
    if early is not None:
        options["early_stopping"] = early
    stop = options.pop("stop", False)
    hf_options: dict[str, Any] = dict(options)
    if stop:  # a pair from the middle of HF's best beams without it
        free = hf_outputs(hf, ids, mask, **hf_options).sequences.numpy()
        options["stop"] = [free[0, PROMPT + 9:PROMPT + 11].tolist(), free[4, PROMPT + 6:PROMPT + 8].tolist()]
        tokenizer, chars = char_tokenizer()
        hf_options.update(stop_strings=["".join(chars[i] for i in s) for s in options["stop"]], tokenizer=tokenizer)
    out = hf_outputs(hf, ids, mask, **hf_options)
    expected, expected_scores = hf_expected(hf, out, beams=True)
    assert (expected_scores == 0).any(), "some returned beams end before NEW tokens"
    tokens, scores = ft.nn.generate(model, ids, NEW, attention_mask=mask, return_scores=True, **options)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=logprob_atol(expected_scores, 2e-5))
    lengths = (np.asarray(scores) != 0).sum(1)
    np.testing.assert_allclose(np.asarray(scores).sum(1) / lengths ** (length_penalty or 1.0),
                               out.sequences_scores.numpy(), rtol=1e-5, atol=gpu_logprob_atol(tokens=NEW))
    if stop:
        assert any(row[PROMPT + n - 2:PROMPT + n].tolist() in options["stop"] for row, n in zip(expected, lengths))


# ---- bad input ---------------------------------------------------------------------------------

def test_a_prompt_longer_than_max_positions_is_refused_with_a_call_that_runs(tiny):
    """The issue: a 40-token prompt with max_positions 32 was told ``wrong: generate(model,
    input_ids, 1)`` and ``right:`` the same call. The last new token is never fed back, so a
    prompt of max_positions tokens gets one (test_greedy_gpt2_...: HF's tokens)."""
    model, _, _ = tiny
    ids = np.arange(40, dtype=np.int32)[None] % 11
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\) alone is longer than the model's "
                                         r"max_positions = 32") as info:
        ft.nn.generate(model, ids, 1)
    right = re.search(r"right:  (.*?)    #", str(info.value)).group(1)
    assert right == "ft.nn.generate(model, input_ids[:, -32:], 1)"
    out = eval(right, {"ft": ft, "model": model, "input_ids": ids})
    assert out.shape == (1, 33) and np.array_equal(out[:, :32], ids[:, -32:])
    with pytest.raises(ValueError, match=r"generate\(model, input_ids\[:, -25:\], 8\)"):
        ft.nn.generate(model, ids[:, :33], 8)


def wider_than_the_table():
    """A left-padded batch ``[2, 66]`` (GPT-2's n_positions is 64) of 64 and 63 real tokens."""
    ids = np.random.default_rng(2).integers(1, VOCAB, (2, 66)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :2] = mask[1, :3] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_left_padding_takes_no_learned_position_where_the_model_counts_real_tokens(gpt2):
    """The issue (audit26 bf16gen D2): max_positions was checked against the prompt's width,
    left padding included, but from_hf's GPT-2 (``positions_count_real_tokens``) indexes its
    table by each row's real tokens (HF's ``cumsum(mask) - 1``): rows of 64 and 63 real tokens
    in 66 columns (n_positions = 64) were refused while HF runs them. Now: HF's token, with the
    mask given or inferred from the pad id; a row that does overrun is refused by name (HF:
    IndexError). A model that does not declare its rule (by_hand: its positions could be
    cache slots), or a traced mask, still counts the width."""
    hf, by_hand, ported = gpt2
    ids, mask = wider_than_the_table()
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                               max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    np.testing.assert_array_equal(ft.nn.generate(ported, ids, 1, attention_mask=mask, eos_token_id=[]), expected)
    np.testing.assert_array_equal(ft.nn.generate(ported, ids, 1, pad_token_id=0, eos_token_id=[]), expected)
    real = r"64 real tokens in row 0, its longest; left padding takes no position"
    with pytest.raises(ValueError, match=rf"prompt \({real}\) plus max_new_tokens \(2\) feeds the model 65 "
                                         r"positions(.|\n)*max_positions = 64(.|\n)*generate\(model, input_ids, 1\)"):
        ft.nn.generate(ported, ids, 2, attention_mask=mask)
    over = mask.copy()
    over[1, 1:] = 1  # row 1: 65 real tokens
    with pytest.raises(ValueError, match=r"prompt \(65 real tokens in row 1, its longest(.|\n)*alone is longer than "
                                         r"(.|\n)*input_ids \[batch, 66\](.|\n)*input_ids\[:, -64:\], 1\)"):
        ft.nn.generate(ported, ids, 1, attention_mask=over)
    with pytest.raises(ValueError, match=r"prompt \(66 tokens\) alone is longer than the model's max_positions = 64"):
        ft.nn.generate(by_hand, ids, 1, attention_mask=mask)
    with pytest.raises(ValueError, match=r"prompt \(66 tokens, left padding included: a traced attention_mask's "
                                         r"real tokens are not counted\) alone"):
        jax.jit(lambda m: ft.nn.generate(ported, ids, 1, attention_mask=m))(mask)


def test_from_hf_learned_positions_are_checked_where_the_table_is_indexed(gpt2):
    """from_hf's GPT-2 call checks the positions its table is indexed by. The issue: a
    left-padded batch of 66 columns whose rows hold 64 and 63 real tokens (n_positions = 64)
    was refused by its width, though its positions (cumsum(mask) - 1) fit: its logits now
    equal HF's given those positions (measured spread 6.6e-7 of max|logits|). A row past the
    table, positions given past it, and a cached call past it (its lookup gave NaN logits,
    no error) are refused naming the row (HF: IndexError); a traced mask counts the width."""
    hf, _, ported = gpt2
    ids, mask = wider_than_the_table()
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                  position_ids=torch.from_numpy(positions).long()).logits.numpy()
    got = np.asarray(ported(ids, mask))
    np.testing.assert_allclose(got[mask == 1], want[mask == 1], rtol=0, atol=7e-6 * max(1.0, np.abs(want).max()))
    over = mask.copy()
    over[1, 1:] = 1
    past = r"but the learned position embedding has 64 \(n_positions = 64: positions 0 to 63\)"
    with pytest.raises(ValueError, match=rf"row 1 reaches position 64 \(its 65 real tokens; left padding takes no "
                                         rf"position\), {past}(.|\n)*attention_mask\[:, -64:\]"):
        ported(ids, over)
    with pytest.raises(ValueError, match=rf"row 0 reaches position 65 \(the positions given\), {past}"):
        ported(ids[:, -4:], positions=np.arange(62, 66)[None])  # 4 tokens: NaN logits, no error
    with pytest.raises(ValueError, match=rf"row 0 reaches position 64 \(its real tokens in the cache(.|\n)*{past}"):
        ported(ids[:1, :65], np.ones((1, 66), np.int32), positions=np.arange(65)[None], cache=ported.init_cache(1, 66))
    with pytest.raises(ValueError, match=r"66 positions, but the learned position embedding has 64"):
        jax.jit(lambda m: ported(ids, m))(mask)


def test_eos_and_stop_ids_outside_the_vocabulary_are_refused(tiny):
    """The issue: eos_token_id=200 with a vocabulary of 11 ran and never stopped. The pad id
    stays unchecked (HF fills with pad_token_id=vocab_size on purpose). A caller's list with
    some id inside the vocabulary runs (HF's rule: test_eos_outside_the_vocabulary_...)."""
    model, prompt, _ = tiny
    vocab = model.head.weight.shape[-1]
    with pytest.raises(ValueError, match=rf"eos_token_id \[{vocab + 189}\] are not ids of this model's vocabulary "
                                         rf"\({vocab} tokens: 0 to {vocab - 1}\)(.|\n)*eos_token_id=\[{vocab - 1}\]"):
        ft.nn.generate(model, prompt, 4, eos_token_id=vocab + 189)
    with pytest.raises(ValueError, match=rf"eos_token_id \[{vocab}, {vocab + 1}\] are not ids(.|\n)*eos_token_id=\[\]"):
        ft.nn.generate(model, prompt, 4, eos_token_id=[vocab + 1, vocab])
    with pytest.raises(ValueError, match=rf"stop \[{vocab}\] are not ids(.|\n)*stop=\[\[{vocab - 1}\]\]"):
        ft.nn.generate(model, prompt, 4, stop=[[1, vocab]], pad_token_id=0)


def test_attention_mask_values_other_than_0_and_1_are_refused_or_give_no_tokens(tiny):
    """The issue: a mask holding 2 or -1 ran as if it held 1 (``mask != 0``): -1 for padding
    attended the padding (the all-ones mask's tokens) and 2 gave the 0/1 mask's tokens where
    HF's positions ``cumsum(mask) - 1`` move (its GPT-2 gave other tokens, or IndexError for
    -1). Now a concrete one is refused naming the first such entry; a traced one makes its
    prompt's output rows -1 (no token id) with NaN scores, the other rows unchanged."""
    model, prompt, mask = tiny
    for bad, value in ((np.array([[1, 1, 1], [-1, 1, 1]]), -1), (np.array([[2, 2, 2], [0, 2, 2]], np.uint8), 2)):
        with pytest.raises(ValueError, match=rf"attention_mask\[{0 if value == 2 else 1}, 0\] is {value}; a mask holds "
                                             r"1 \(or True\) for a real token and 0 \(or False\) for left padding") as info:
            ft.nn.generate(model, prompt, 4, attention_mask=bad)
    right = re.search(r"right:  (.*)", str(info.value)).group(1)
    fixed = eval(right, {"ft": ft, "model": model, "input_ids": prompt, "pad_id": 0})
    np.testing.assert_array_equal(fixed, ft.nn.generate(model, prompt, 8, attention_mask=mask))
    good, good_scores = ft.nn.generate(model, prompt, 4, attention_mask=mask, return_scores=True)
    bad = mask.at[1, 0].set(-1)
    run = jax.jit(lambda m: ft.nn.generate(model, prompt, 4, attention_mask=m, return_scores=True))
    tokens, scores = run(mask)  # a good mask traced: the eager tokens (scores to an ulp: another program)
    np.testing.assert_array_equal(tokens, good)
    np.testing.assert_allclose(scores, good_scores, rtol=1e-6)
    tokens, scores = run(bad)
    np.testing.assert_array_equal(tokens[0], good[0])
    np.testing.assert_allclose(scores[0], good_scores[0], rtol=1e-6)
    assert (np.asarray(tokens[1]) == -1).all() and np.isnan(scores[1]).all()
    sampled = jax.jit(lambda m: ft.nn.generate(model, prompt, 4, attention_mask=m, temperature=1.0, key=jax.random.key(0),
                                               num_return_sequences=2))(mask.at[0, 1].set(2))
    assert (np.asarray(sampled[:2]) == -1).all() and (np.asarray(sampled[2:]) >= 0).all()


def test_a_traced_mask_ending_in_padding_gives_no_tokens(tiny):
    """The issue: inside a ``jax.jit`` of the caller's a right-padded mask was not seen (the
    concrete one is refused, RIGHT_PADDED: test_errors) and the row ran on after its padding:
    the prompt [4, 5] padded on the right gave [8, 9, 3, 1], where left-padded it gives
    [1, 10, 3, 1], with finite scores. Now a traced row whose mask ends in padding (a row of
    padding only too), bool or integer, gives -1 (no token id) with NaN scores; other rows unchanged."""
    model, _, _ = tiny
    prompt = jnp.array([[3, 4, 5], [4, 5, 0]], jnp.int32)
    run = jax.jit(lambda m: ft.nn.generate(model, prompt, 4, attention_mask=m, return_scores=True))
    good, good_scores = run(jnp.ones((2, 3), jnp.int32))
    for mask in (jnp.array([[1, 1, 1], [1, 1, 0]]), jnp.array([[1, 1, 1], [0, 0, 0]]),
                 jnp.array([[True, True, True], [True, True, False]])):
        tokens, scores = run(mask)
        np.testing.assert_array_equal(tokens[0], good[0])
        np.testing.assert_allclose(scores[0], good_scores[0], rtol=1e-6)
        assert (np.asarray(tokens[1]) == -1).all() and np.isnan(scores[1]).all()
    left = ft.nn.generate(model, jnp.array([[0, 4, 5]], jnp.int32), 4, attention_mask=jnp.array([[0, 1, 1]]))
    np.testing.assert_array_equal(left[0, 3:], [1, 10, 3, 1])  # the left-padded row's tokens, the docstring's


def test_errors(tiny):
    model, prompt, _ = tiny
    generate = ft.nn.generate
    with pytest.raises(TypeError, match=r"a Dense has no init_cache(.|\n)*docs/guides/generation.md"):
        generate(ft.nn.Dense(2, 2, key=jax.random.key(0)), prompt, 4)
    with pytest.raises(ValueError, match=r"integer token ids \[batch, prompt_length\], got i32\[3\]"):
        generate(model, prompt[0], 4)
    with pytest.raises(ValueError, match=r"integer token ids(.|\n)*got f32\[2,3\]"):
        generate(model, prompt.astype(jnp.float32), 4)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1, got 0"):
        generate(model, prompt, 0)
    with pytest.raises(ValueError, match=r"prompt \(3 tokens\) plus max_new_tokens \(31\) feeds the model 33 "
                                         r"positions (.|\n)*max_positions = 32(.|\n)*generate\(model, input_ids, 30\)"):
        generate(model, prompt, 31)
    with pytest.raises(ValueError, match=r"attention_mask must be bool or 0/1 integers with input_ids' shape "
                                         r"\[2, 3\](.|\n)*got i32\[2,4\]"):
        generate(model, prompt, 4, attention_mask=jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"got f32\[2,3\]"):
        generate(model, prompt, 4, attention_mask=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"row 1 of attention_mask ends in padding; pad prompts on the left"):
        generate(model, prompt, 4, attention_mask=np.array([[1, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match=r"temperature must be a number >= 0 \(0: greedy\), got -1"):
        generate(model, prompt, 4, temperature=-1.0)
    with pytest.raises(ValueError, match=r"sampling \(temperature=0.5\) needs key="):
        generate(model, prompt, 4, temperature=0.5)
    with pytest.raises(ValueError, match=r"top_k= filters(.|\n)*temperature=0.0 is greedy"):
        generate(model, prompt, 4, top_k=5)
    key = jax.random.key(0)
    for min_p in (-0.1, 1.5, "0.1"):
        with pytest.raises(ValueError, match=r"min_p must be a number in \[0, 1\]"):
            generate(model, prompt, 4, temperature=1.0, min_p=min_p, key=key)
    with pytest.raises(ValueError, match=r"min_p= filters(.|\n)*temperature=0.0 is greedy"):
        generate(model, prompt, 4, min_p=0.1)
    for size in (-1, 2.0, "3"):
        with pytest.raises(ValueError, match=r"no_repeat_ngram_size must be an int >= 0"):
            generate(model, prompt, 4, no_repeat_ngram_size=size)
    vocab = model.head.weight.shape[-1]
    with pytest.raises(ValueError, match=r"bad_words_ids must be a list of token-id sequences"):
        generate(model, prompt, 4, bad_words_ids=[3, 4])
    with pytest.raises(ValueError, match=rf"bad_words_ids \[{vocab}\] are not ids of this model's vocabulary"):
        generate(model, prompt, 4, bad_words_ids=[[1, vocab]])
    with pytest.raises(ValueError, match=r"suppress_tokens must be a token id"):
        generate(model, prompt, 4, suppress_tokens=[-1])
    with pytest.raises(ValueError, match=rf"suppress_tokens \[{vocab}, {vocab + 5}\] are not ids of this model's "
                                         rf"vocabulary \({vocab} tokens: 0 to {vocab - 1}\)"):
        generate(model, prompt, 4, suppress_tokens=[1, vocab + 5, vocab])
    with pytest.raises(TypeError, match=r"streamer must have put\(token_ids\) and end\(\)(.|\n)*got a list"):
        generate(model, prompt, 4, streamer=[])
    with pytest.raises(ValueError, match=r"beam search only knows its best sequences at the end"):
        generate(model, prompt, 4, num_beams=2, streamer=Recorder())
    with pytest.raises(ValueError, match=r"inside a jax.jit of your own"):
        jax.jit(lambda p: generate(model, p, 4, streamer=Recorder()))(prompt)
    for top_p in (1.5, -0.1):
        with pytest.raises(ValueError, match=rf"top_p must be a number in \[0, 1\](.|\n)*got {top_p}"):
            generate(model, prompt, 4, temperature=1.0, top_p=top_p, key=key)
    for top_k in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"top_k must be an int >= 0 (.|\n)*got {top_k}"):
            generate(model, prompt, 4, temperature=1.0, top_k=top_k, key=key)
    token = r"must be a token id \(an int from 0 to 2\*\*31 - 1: the tokens are int32\)"
    with pytest.raises(ValueError, match=rf"eos_token_id {token} or a list of them, got -1"):
        generate(model, prompt, 4, eos_token_id=-1)
    with pytest.raises(ValueError, match=rf"pad_token_id {token}, got \[1\]"):
        generate(model, prompt, 4, eos_token_id=2, pad_token_id=[1])  # pyright: ignore[reportArgumentType]
    # An id past int32 (a generation_config.json's pad id): was a bare OverflowError at the loop's set-up.
    with pytest.raises(ValueError, match=rf"pad_token_id {token}, got 2147483648"):
        generate(model, prompt, 4, pad_token_id=2**31)
    with pytest.raises(ValueError, match=rf"eos_token_id {token} or a list of them, got \[2, 4294967296\]"):
        generate(model, prompt, 4, eos_token_id=[2, 2**32])

    with pytest.raises(ValueError, match=r"repetition_penalty must be a number > 0 \(1.0: none(.|\n)*got 0"):
        generate(model, prompt, 4, repetition_penalty=0)
    with pytest.raises(ValueError, match=r"min_new_tokens must be an int from 0 to max_new_tokens \(4\), got 5"):
        generate(model, prompt, 4, eos_token_id=1, min_new_tokens=5)
    with pytest.raises(ValueError, match=r"min_new_tokens=2 keeps eos_token_id(.|\n)*but no eos_token_id is given"):
        generate(model, prompt, 4, min_new_tokens=2)
    bad_stops: list[Any] = [[13, 198], [[]], [[1, -1]], "ab", [[2**31]]]
    for stop in bad_stops:
        with pytest.raises(ValueError, match=r"stop must be a list of token-id sequences(.|\n)*stop=\[\[13, 198\]\]"):
            generate(model, prompt, 4, stop=stop, pad_token_id=0)
    with pytest.raises(ValueError, match=r"neither pad_token_id nor eos_token_id(.|\n)*stop=\[\[1\]\], pad_token_id=0"):
        generate(model, prompt, 4, stop=[[1]])
    with pytest.raises(ValueError, match=r"num_beams must be an int >= 1 \(1: no beam search\), got 0"):
        generate(model, prompt, 4, num_beams=0)
    with pytest.raises(ValueError, match=r"beam search \(num_beams=2\)(.|\n)*does not sample \(temperature=0.5, top_k=3\)"):
        generate(model, prompt, 4, num_beams=2, temperature=0.5, top_k=3, key=key)
    beam_only: list[tuple[str, Any]] = [("length_penalty", 2.0), ("early_stopping", True),
                                        ("early_stopping", "never")]
    for name, value in beam_only:
        with pytest.raises(ValueError, match=rf"{name}={value!r} is an option of beam search, but num_beams=1"):
            generate(model, prompt, 4, **{name: value})
    with pytest.raises(ValueError, match=r"num_return_sequences must be an int from 1 to num_beams \(2\)(.|\n)*got 3"):
        generate(model, prompt, 4, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match=r"length_penalty must be a finite number(.|\n)*got nan"):
        generate(model, prompt, 4, num_beams=2, length_penalty=float("nan"))
    with pytest.raises(ValueError, match=r"early_stopping must be False(.|\n)*or \"never\"(.|\n)*got 'yes'"):
        generate(model, prompt, 4, num_beams=2, early_stopping="yes")

    class SquareCache(TinyLM):  # a cache leaf [batch, batch]: no one batch axis to reorder
        def init_cache(self, batch_size, max_length, dtype=None):
            return super().init_cache(batch_size, max_length, dtype), jnp.zeros((batch_size, batch_size))

        def __call__(self, input_ids, *, cache, **kwargs):
            logits, inner = super().__call__(input_ids, cache=cache[0], **kwargs)
            return logits, (inner, cache[1])

    with pytest.raises(ValueError, match=r"reorders the cache along its batch axis, but the cache leaf at \[1\] "
                                         r"is \(2, 2\) and \(4, 4\)"):
        generate(SquareCache(key=jax.random.key(0)), prompt, 4, num_beams=2)

    class NoPair(TinyLM):
        def __call__(self, input_ids, **kwargs):
            return super().__call__(input_ids, **kwargs)[0]

    with pytest.raises(TypeError, match=r"must return \(logits \[batch, T, vocab\] float, cache of the same "
                                        r"structure\), got an array f32\[2,8,11\] for input_ids i32\[2,8\]"):
        generate(NoPair(key=jax.random.key(0)), prompt, 4)


# ---- a checkpoint's generation config -----------------------------------------------------------

class Config(dict):
    """A config mapping with its generation config (model.hf_config's interface), hashable."""

    def __init__(self, config, generation):
        super().__init__(config)
        self.generation = dict(generation)

    def __hash__(self):
        return id(self)


class WithConfig(ft.Module):
    """A model and the hf_config HF's generate would read its defaults from."""

    model: Any
    hf_config: Any = ft.field(static=True)

    def init_cache(self, batch_size, max_length, dtype=None):
        return self.model.init_cache(batch_size, max_length, dtype)

    def __call__(self, input_ids, **kwargs):
        return self.model(input_ids, **kwargs)


def configured(model, hf):
    """``model`` with ``hf``'s config and generation config: from_hf's own ``hf_config`` where
    it has one (and the same generation values), else given by hand."""
    generation = {k: v for k, v in hf.generation_config.to_dict().items() if v is not None}
    if getattr(model, "hf_config", None) is not None and dict(model.hf_config.generation) == generation:
        return model
    return WithConfig(model, Config(hf.config.to_dict(), generation))


def test_a_checkpoints_generation_defaults_are_hf_generates(llama, tmp_path):
    """With nothing but the prompt, generate on ft.nn.from_hf(directory) takes what HF's
    generate takes from the directory's generation_config.json (EOS list, pad, repetition
    penalty, n-grams): the same tokens; an explicit argument wins; a do_sample=True config
    samples with a key (the config's temperature and top_k) and asks for one without; a bad
    value names the config; an option HF applies and generate does not is named."""
    hf, model = llama
    ids, mask = left_padded_prompts()
    saved = hf.generation_config
    try:
        hf.generation_config = transformers.GenerationConfig(eos_token_id=[0, 18], pad_token_id=2,
                                                             repetition_penalty=1.4, no_repeat_ngram_size=3)
        with torch.no_grad():
            expected = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                                   max_new_tokens=NEW).numpy()
            explicit = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                                   max_new_tokens=NEW, repetition_penalty=1.0).numpy()
        plain = hf_generate(hf, ids, mask, pad_token_id=2, eos_token_id=None, repetition_penalty=1.0,
                            no_repeat_ngram_size=0)
        assert np.isin(expected[:, PROMPT:], [0, 18]).any() and (expected != plain[:, :expected.shape[1]]).any()
        hf.save_pretrained(tmp_path)
        ours = ft.nn.from_hf(str(tmp_path))
        assert (tmp_path / "generation_config.json").exists() and not isinstance(ours, WithConfig)
        out = np.asarray(ft.nn.generate(ours, ids, NEW, attention_mask=mask))
        np.testing.assert_array_equal(out[:, :expected.shape[1]], expected)
        assert (out[:, expected.shape[1]:] == 2).all()
        out = np.asarray(ft.nn.generate(ours, ids, NEW, attention_mask=mask, repetition_penalty=1.0))
        np.testing.assert_array_equal(out[:, :explicit.shape[1]], explicit)
        padded = np.where(mask != 0, ids, 2)  # the config's pad id where the mask is 0: HF infers the mask
        with torch.no_grad():
            inferred = hf.generate(torch.from_numpy(padded).long(), max_new_tokens=NEW).numpy()
        out = np.asarray(ft.nn.generate(ours, padded, NEW))
        np.testing.assert_array_equal(out[:, :inferred.shape[1]], inferred)
        np.testing.assert_array_equal(out, ft.nn.generate(ours, padded, NEW, attention_mask=mask))
        with pytest.raises(ValueError, match=r"row 0 of input_ids ends in pad_token_id 2(.|\n)*pad on the left"):
            ft.nn.generate(ours, np.concatenate([ids[:1, 1:], [[2]]], axis=1), 4)

        hf.generation_config = transformers.GenerationConfig(do_sample=True, temperature=0.7, top_k=3, eos_token_id=0)
        ours = configured(model, hf)
        with pytest.raises(ValueError, match=r"sets do_sample=True \(temperature=0.7, top_k=3\)(.|\n)*needs key="):
            ft.nn.generate(ours, ids, NEW, attention_mask=mask)
        sampled = ft.nn.generate(ours, ids, 8, attention_mask=mask, key=jax.random.key(0), eos_token_id=[])
        same = ft.nn.generate(model, ids, 8, attention_mask=mask, key=jax.random.key(0), temperature=0.7, top_k=3,
                              top_p=1.0, eos_token_id=[])
        np.testing.assert_array_equal(sampled, same)
        greedy = ft.nn.generate(ours, ids, NEW, attention_mask=mask, temperature=0.0)
        np.testing.assert_array_equal(greedy, ft.nn.generate(model, ids, NEW, attention_mask=mask, eos_token_id=0))

        bad = WithConfig(model, Config({"eos_token_id": -3}, {}))
        with pytest.raises(ValueError, match=r"hf_config \(config.json / generation_config.json\) gives "
                                             r"eos_token_id=-3(.|\n)*an explicit argument wins"):
            ft.nn.generate(bad, ids, 4, attention_mask=mask)
        forced = WithConfig(model, Config({}, {"encoder_repetition_penalty": 2.0, "eos_token_id": 0}))
        with pytest.warns(UserWarning, match=r"sets encoder_repetition_penalty=2.0, which Hugging Face's generate "
                                             r"applies"):
            ft.nn.generate(forced, ids, 4, attention_mask=mask)
    finally:
        hf.generation_config = saved



def test_beams_with_the_callers_temperature_blame_the_temperature_not_the_checkpoint(gpt2):
    """num_beams=3, temperature=0.7 on a from_hf model blamed the checkpoint's top_k=50 (HF's
    sampling default, named beside it); passing top_k moved the blame to top_p."""
    _, _, model = gpt2
    ids, key = jnp.array([[5, 7, 9]], jnp.int32), jax.random.key(0)
    for extra in ({}, {"top_k": 0}):
        with pytest.raises(ValueError, match=r"^generate: beam search \(num_beams=3\) keeps the most likely "
                                             r"continuations; it does not sample \(temperature=0.7") as info:
            ft.nn.generate(model, ids, 8, num_beams=3, temperature=0.7, key=key, **extra)
        assert "hf_config" not in str(info.value)
    fixes = [line.split("right:")[1].split("#")[0].strip() for line in str(info.value).splitlines() if "right:" in line]
    space = {"ft": ft, "model": model, "input_ids": ids, "key": key}
    beams, sampled = (eval(fix, space) for fix in fixes)
    assert beams.shape == sampled.shape == (1, 11)
    np.testing.assert_array_equal(beams, ft.nn.generate(model, ids, 8, num_beams=3))

# ---- several samples per prompt, a donated model, a cache larger than memory ------------------------

def test_sampling_returns_several_sequences_per_prompt_in_hf_order(tiny):
    """num_return_sequences=n with sampling: each prompt n times in a row (HF's
    repeat_interleave), the samples of one key; greedy refuses it, as HF does."""
    model, prompt, mask = tiny
    key = jax.random.key(5)
    out = ft.nn.generate(model, prompt, 10, attention_mask=mask, temperature=1.5, key=key, num_return_sequences=3)
    assert out.shape == (6, 13)
    repeated = ft.nn.generate(model, jnp.repeat(prompt, 3, 0), 10, attention_mask=jnp.repeat(mask, 3, 0),
                              temperature=1.5, key=key)
    np.testing.assert_array_equal(out, repeated)
    np.testing.assert_array_equal(np.asarray(out)[:, :3], np.repeat(np.asarray(prompt), 3, 0))
    assert len({tuple(r) for r in np.asarray(out)[:3, 3:].tolist()}) > 1  # the samples differ
    with pytest.raises(ValueError, match=r"num_return_sequences=2 asks for 2 sequences per prompt, but greedy"
                                         r"(.|\n)*Hugging Face's generate raises too"):
        ft.nn.generate(model, prompt, 4, num_return_sequences=2)
    # the number from a sampling checkpoint, greedy decoding asked for by the caller: the error
    # names the checkpoint's value (the caller never wrote num_return_sequences), and its fixes run
    sampling = WithConfig(model, Config({}, {"do_sample": True, "num_return_sequences": 2}))
    with pytest.raises(ValueError, match=r"^generate: the model's generation config \(hf_config.generation: "
                                         r"generation_config.json\) sets num_return_sequences=2, but this call "
                                         r"decodes greedily(.|\n)*wrong:  ft.nn.generate\(model, input_ids, 8, "
                                         r"temperature=0.0\)\n") as info:
        ft.nn.generate(sampling, prompt, 8, temperature=0.0)
    fixes = [line.split("right:")[1].split("#")[0].strip() for line in str(info.value).splitlines() if "right:" in line]
    space = {"ft": ft, "model": sampling, "input_ids": prompt, "key": key}
    assert [eval(fix, space).shape for fix in fixes] == [(2, 11), (4, 11), (4, 11)]


def test_a_donated_model_is_named_by_key_path(tiny):
    """A model whose arrays a donating step deleted: the key path and the step, not JAX's bare
    "Array has been deleted"."""
    model, prompt, _ = tiny
    copy = jax.tree.map(jnp.copy, model)
    step = ft.jit(lambda m: jax.tree.map(lambda x: x * 0.5, m), donate=0)
    step(copy)  # donates copy's arrays
    with pytest.raises(ValueError, match=r"holds a deleted array at model.embed.embeddings: call 1 of (.|\n)*donated "
                                         r"it(.|\n)*right:  best = jax.tree.map\(jnp.copy, model\)"):
        ft.nn.generate(copy, prompt, 4)


class Untraced(TinyLM):
    """TinyLM under a type of its own: no loop that another test compiled for a TinyLM is in
    the jit cache for it, so each of its calls below is traced (where the memory check runs).
    With tiny's model the test passed only while an earlier test cleared every cache."""


def test_a_cache_larger_than_memory_raises_before_it_is_made(tiny, monkeypatch):
    """The cache's bytes, from its shapes while the loop is traced, against the memory there
    is: a clear error naming both (nothing is allocated), with a max_new_tokens that fits; a
    bucket too large whose exact sizes fit runs at its exact sizes."""
    model, prompt = Untraced(key=jax.random.key(0)), tiny[1]
    unbounded = model.replace(max_positions=None)
    rows = jnp.zeros((64, 3), jnp.int32)  # 64 rows of 2 ** 30 positions: 4 TiB of keys and values
    with pytest.raises(ValueError, match=r"cache for 64 sequences of 1073741803 positions \(the prompt's 3 tokens "
                                         r"and max_new_tokens = 1073741800\)(.|\n)*needs 4398046425088 bytes "
                                         r"\(4.0 TiB\), but the (.|\n)*allocates the whole cache up front"):
        ft.nn.generate(unbounded, rows, 2 ** 30 - 24)
    from functree.generation import _memory

    monkeypatch.setattr(_memory, "available_bytes", lambda device: (1000, "test's memory"))
    needs = 2 * 2 * (3 + 12) * 2 * 4 * 4  # keys and values [2, 3 + 12 slots, 2 heads, 4] float32 (exact: the bucket
    # of 8 + 16 slots does not fit either)
    with pytest.raises(ValueError, match=rf"needs {needs} bytes(.|\n)*test's memory has 1000 bytes(.|\n)*"
                                         r"generate\(model, input_ids\[:1\], 8\)    # fewer rows"):  # 7 slots fit
        ft.nn.generate(model, prompt, 12)
    with pytest.raises(ValueError, match=r"test's memory has 1000 bytes"):
        ft.nn.generate(model, prompt, 12, num_beams=2)
    monkeypatch.setattr(_memory, "available_bytes", lambda device: (128 * 30, "test's memory"))  # 30 slots
    with pytest.raises(ValueError, match=r"generate\(model, input_ids, 16\)"):  # 8 + 16 fit, 8 + 32 do not
        ft.nn.generate(unbounded, prompt, 30)
    out = ft.nn.generate(unbounded, prompt, 20)  # its bucket (8 + 32 slots) does not fit, its exact 23 do
    np.testing.assert_array_equal(out[:, :15], ft.nn.generate(model, prompt, 12))


class Picky(TinyLM):
    """A model that refuses caches longer than 16 slots while traced (as longrope refuses a
    cache that crosses its switch point)."""

    def init_cache(self, batch_size, max_length, dtype=None):
        if max_length > 16:
            raise ValueError(f"Picky: a cache of {max_length} slots is longer than 16")
        return super().init_cache(batch_size, max_length, dtype)


def test_sizes_whose_bucket_the_model_refuses_run_exact(tiny):
    """A bucket the model refuses while traced (3 + 12 tokens: 8 + 16 slots) runs at its exact
    sizes (15 slots), with the same tokens; sizes it refuses exactly raise its error."""
    model, prompt, mask = tiny
    picky = Picky(key=jax.random.key(0))
    expected = ft.nn.generate(model, prompt, 12, attention_mask=mask)
    np.testing.assert_array_equal(ft.nn.generate(picky, prompt, 12, attention_mask=mask), expected)
    assert (Picky, 3, 12) in _generate._EXACT
    np.testing.assert_array_equal(ft.nn.generate(picky, prompt, 12, attention_mask=mask), expected)
    with pytest.raises(ValueError, match=r"Picky: a cache of 17 slots is longer than 16"):
        ft.nn.generate(picky, prompt, 14, attention_mask=mask)


def test_a_streamer_gets_the_prompt_once_when_a_bucket_is_refused(tiny):
    """The refused bucket's plan gave the streamer the prompt; the exact sizes' run does not
    give it again: the same puts as a model that never refused."""
    model, prompt, mask = tiny
    _generate._EXACT.discard((Picky, 3, 11))
    picky, plain = Recorder(), Recorder()
    ft.nn.generate(Picky(key=jax.random.key(0)), prompt, 11, attention_mask=mask, streamer=picky)
    ft.nn.generate(model, prompt, 11, attention_mask=mask, streamer=plain)
    assert (Picky, 3, 11) in _generate._EXACT
    assert picky.puts == plain.puts and picky.ends == plain.ends == 1
    assert picky.puts[0] == np.asarray(prompt).tolist()


# ---- the controls are records the loops fold over ---------------------------------------------

def recorded_loops(monkeypatch):
    """Every call of the compiled loops made by generate: (loop, args, kwargs)."""
    calls = []
    for name in ("generate_loop", "beam_search"):
        loop = getattr(_generate, name)

        def recorded(*args, _loop=loop, **kwargs):
            calls.append((_loop, args, kwargs))
            return _loop(*args, **kwargs)

        monkeypatch.setattr(_generate, name, recorded)
    return calls


def test_plain_greedy_has_no_control_and_a_controls_values_are_traced(tiny, monkeypatch):
    model, prompt, mask = tiny
    calls = recorded_loops(monkeypatch)
    ft.nn.generate(model, prompt, 4, attention_mask=mask)
    before = _decode.generate_loop._cache_size()  # pyright: ignore[reportAttributeAccessIssue]
    for penalty in (1.3, 1.7):  # one program: the penalty is an array field of its record
        ft.nn.generate(model, prompt, 4, attention_mask=mask, repetition_penalty=penalty, no_repeat_ngram_size=2)
    assert _decode.generate_loop._cache_size() == before + 1  # pyright: ignore[reportAttributeAccessIssue]
    (loop, plain, options), (_, controlled, _) = calls[0], calls[1]
    assert plain[-1] == ()  # plain greedy: no control at all
    assert [type(c) for c in controlled[-1]] == [_controls.RepetitionPenalty, _controls.NoRepeatNGram]
    text = loop.lower(*plain, **options).as_text()
    controlled_text = loop.lower(*controlled, **calls[1][2]).as_text()
    per_token = f"tensor<2x{model.head.weight.shape[-1]}xi1>"  # bool [rows, vocab]: a control's state or mask
    assert per_token not in text and per_token in controlled_text
    assert "stablehlo.sort" not in text and "stablehlo.log" not in text  # no warper's, no score's op
    assert text.count("stablehlo.scatter") < controlled_text.count("stablehlo.scatter")  # (the cache's only)


@_controls.record("bonus")
@dataclass(frozen=True)
class BoostOnce(_controls.Control):
    """A control written outside the library: ``bonus`` is added to ``token``'s score until the
    row has chosen it (state: bool [rows], whether it has)."""

    token: int
    bonus: Any

    @classmethod
    def build(cls, o):
        return cls(3, np.float32(100.0))

    def init(self, loop):
        return jnp.zeros((loop.ids.shape[0],), bool)

    def apply(self, scores, state, now):
        return scores.at[:, self.token].add(jnp.where(state, jnp.float32(0.0), self.bonus))

    def update(self, state, token, now):
        return state | (token == self.token)


def test_a_new_control_is_one_record_in_the_controls_tuple(tiny, monkeypatch):
    model, prompt, mask = tiny
    longer = jnp.concatenate([prompt, jnp.full((2, 1), 3, jnp.int32)], axis=1)
    after_3 = np.asarray(ft.nn.generate(model, longer, 5, attention_mask=jnp.pad(mask, ((0, 0), (0, 1)),
                                                                                  constant_values=1)))
    monkeypatch.setattr(_controls, "CONTROLS", (*_controls.CONTROLS, BoostOnce))
    out = np.asarray(ft.nn.generate(model, prompt, 6, attention_mask=mask))
    np.testing.assert_array_equal(out[:, 3], [3, 3])  # boosted first
    np.testing.assert_array_equal(out, after_3)  # then never again: greedy after the prompt and a 3
    beams = np.asarray(ft.nn.generate(model, prompt, 6, attention_mask=mask, num_beams=2, num_return_sequences=2))
    assert all(3 in row for row in beams[:, 3:])  # each kept beam's state followed it (reordered)


def test_every_control_reads_generate_keywords_named_as_the_checkpoints():
    from functree.generation._defaults import SUPPORTED

    keywords = inspect.signature(ft.nn.generate).parameters
    for control in _controls.CONTROLS:
        assert control.keywords and all(k in keywords and k in SUPPORTED for k in control.keywords)


def test_top_k_past_the_vocabulary_keeps_every_token_as_hf_does(tiny):
    """Hugging Face keeps min(top_k, vocab) tokens and reads top_k=0 as no top-k; its
    default top_k=50 on a from_hf model of a smaller vocabulary raised here. Now a k past the
    vocabulary, 0 and None all sample the same tokens from the same key."""
    model, prompt, mask = tiny  # a vocabulary of 11
    key = jax.random.key(3)
    # k = vocab, and past it (HF's default 50; any k > vocab is TopK's one min(k, vocab) path)
    runs = [ft.nn.generate(model, prompt, 6, attention_mask=mask, temperature=0.8, top_k=k, key=key)
            for k in (None, 0, 11, 50)]
    for run in runs[1:]:
        np.testing.assert_array_equal(run, runs[0])
    fewer = ft.nn.generate(model, prompt, 6, attention_mask=mask, temperature=0.8, top_k=1, key=key)
    np.testing.assert_array_equal(fewer, ft.nn.generate(model, prompt, 6, attention_mask=mask))  # k = 1: greedy


def test_sampling_a_small_vocabulary_from_hf_model_with_hf_defaults():
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = ft.nn.from_hf(randomized(transformers.LlamaForCausalLM(config)))
    ids = np.array([[3, 4, 5]], np.int32)
    out = ft.nn.generate(model, ids, 4, temperature=0.7, key=jax.random.key(0))  # HF's top_k=50 > 40: all kept
    np.testing.assert_array_equal(out, ft.nn.generate(model, ids, 4, temperature=0.7, top_k=40, key=jax.random.key(0)))


# The 2-process generate (a model sharded over both processes returns tokens each process
# reads) runs in tests/test_train_processes.py's two worker processes: no start-up of its own.


def test_hugging_faces_spellings_and_typos_name_the_keyword_to_write(tiny):
    """`output_scores=True` (HF's name) was Python's bare "unexpected keyword argument"."""
    model, ids = tiny[0], np.array([[1, 2, 3], [4, 5, 6]], np.int32)  # tiny's rows: its greedy program
    cases = {"output_scores": r"\(Hugging Face's name\).*right:  ft.nn.generate\(model, input_ids, max_new_tokens, "
                              r"return_scores=True\)",
             "do_sample": r"right:  ft.nn.generate\(model, input_ids, max_new_tokens, temperature=1.0, "
                          r"key=jax.random.key\(0\)\)",
             "max_length": r"right:  ft.nn.generate\(model, input_ids, max_length - input_ids.shape\[1\]\)",
             "top_kk": r"\(did you mean 'top_k'\?\).*right:  ft.nn.generate\(model, input_ids, max_new_tokens, top_k=",
             "encoder_repetition_penalty": r"Hugging Face's generate applies it; ft.nn.generate does not have it"}
    for name, pattern in cases.items():
        with pytest.raises(TypeError, match=rf"(?s)^ft.nn.generate\(\) got an unexpected keyword argument "
                                            rf"'{name}'.*{pattern}"):
            ft.nn.generate(model, ids, 2, **{name: 1})
    tokens, scores = ft.nn.generate(model, ids, 2, return_scores=True)  # the fixes run
    assert tokens.shape == (2, 5) and scores.shape == (2, 2)
    assert ft.nn.generate(model, ids, 5 - ids.shape[1]).shape == (2, 5)


def test_the_do_sample_fixes_sample_and_decode_greedily(tiny):
    """do_sample=True's fix was ``key=jax.random.key(0)`` alone, which decodes greedily (a key
    samples only where the checkpoint sets do_sample=True): the call it names samples now, and
    do_sample=False's is greedy."""
    model, prompt, _ = tiny
    space = {"ft": ft, "jax": jax, "model": model, "input_ids": prompt, "max_new_tokens": 8}
    runs = {}
    for value in (True, False):
        with pytest.raises(TypeError, match=r"'do_sample' \(Hugging Face's name\)") as info:
            ft.nn.generate(model, prompt, 8, do_sample=value)
        right = re.search(r"right:  (.*?)   #", str(info.value)).group(1)
        runs[value] = np.asarray(eval(right, space))
    greedy = np.asarray(ft.nn.generate(model, prompt, 8))
    np.testing.assert_array_equal(runs[False], greedy)
    np.testing.assert_array_equal(runs[True], ft.nn.generate(model, prompt, 8, temperature=1.0,
                                                             key=jax.random.key(0)))
    assert (runs[True] != greedy).any()  # it samples


def test_scores_under_x64_equal_float32s(llama):
    """generate(..., return_scores=True) with jax_enable_x64 on: greedy and sampled (before: a
    TypeError from dynamic_update_slice, int32 slot indices beside a weak int64 step 0)."""
    _, model = llama
    ids, mask = left_padded_prompts()
    ids, mask = ids[1:], mask[1:]  # the left-padded rows: float32 greedy is test_a_pad_id_...'s program
    runs = {}
    for x64 in (False, True):
        with jax.enable_x64(x64):
            runs[x64] = [ft.nn.generate(model, ids, 4, attention_mask=mask, eos_token_id=[], return_scores=True,
                                        **options) for options in ({}, {"temperature": 0.9, "key": jax.random.key(1)})]
    for (tokens, scores), (tokens64, scores64) in zip(runs[False], runs[True], strict=True):
        np.testing.assert_array_equal(np.asarray(tokens64), np.asarray(tokens))
        np.testing.assert_allclose(np.asarray(scores64), np.asarray(scores), rtol=0,
                                   atol=1e-6 * np.abs(np.asarray(scores)).max())


# ---- a checkpoint's EOS outside the vocabulary (regression audit 16, finding 2) --------------

def test_a_default_eos_outside_the_vocabulary_warns_and_gives_hf_tokens():
    """GPT2Config's default eos_token_id 50256 on a 50-token vocabulary: generate refused the
    model ("not a valid eos_token_id"); HF's generate runs (no row can end) and so does ours
    now, with a CheckpointEosWarning naming the id, the vocabulary and eos_token_id=[]."""
    from functree.generation._defaults import CheckpointEosWarning

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=D, n_layer=LAYERS, n_head=HEADS)
    assert config.eos_token_id == 50256  # the default the issue is about
    torch.manual_seed(1)
    hf = randomized(transformers.GPT2LMHeadModel(config))
    model = ft.nn.from_hf(hf)
    ids, mask = left_padded_prompts()
    expected = hf_generate(hf, ids, mask)  # the checkpoint's defaults: eos 50256, pad = eos
    with pytest.warns(CheckpointEosWarning, match=rf"eos_token_id \[50256\](.|\n)*\({VOCAB} tokens(.|\n)*"
                                                  rf"eos_token_id=\[\](.|\n)*eos_token_id=\[{VOCAB - 1}\]"):
        out = ft.nn.generate(model, ids, NEW, attention_mask=mask)
    np.testing.assert_array_equal(out, expected)


def test_a_callers_eos_list_with_an_id_outside_the_vocabulary_ends_rows_as_hf(llama):
    """eos_token_id=[0, VOCAB + 7]: HF's generate ends rows on 0 and never on the other id; the
    list was refused. Only a caller's list with no id inside the vocabulary is (the test above:
    test_eos_and_stop_ids_outside_the_vocabulary_are_refused)."""
    hf, model = llama
    ids, mask = left_padded_prompts()
    expected = hf_generate(hf, ids, mask, pad_token_id=2, eos_token_id=[0, VOCAB + 7])
    assert (expected[0, PROMPT + 9:] == 2).all()  # a row ended on 0
    out = ft.nn.generate(model, ids, NEW, attention_mask=mask, eos_token_id=[0, VOCAB + 7], pad_token_id=2)
    np.testing.assert_array_equal(out, expected)
