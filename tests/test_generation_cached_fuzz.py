"""``ft.nn.generate``'s key-value cache, drawn at random, against HF's cached ``generate`` and
functree's own uncached forward, for the fifteen causal families ``ft.nn.from_hf`` ports.

Each family is one tiny HF model (two layers, 48 tokens, weights moved off HF's
initialization and its head sharpened, ``torch.manual_seed(0)``; Mistral and Qwen2 with a
sliding window of 3, shorter than most prompts drawn; Qwen3 with it on its second layer
only, Gemma 2 on its first, its attention and final logits soft-capped, Gemma 3 on its first,
each layer type its own rope base; Granite with its four multipliers off 1; SmolLM3 sliding on
both layers, its second without rotary positions), ported by ``ft.nn.from_hf``. Hypothesis
draws a batch of left-padded prompts (1 to 3 rows of 1 to 6 real tokens; 11 in the bucket
test: a longer cache), ``max_new_tokens`` and whether rows end at EOS, and checks that greedy
tokens

- equal HF's ``generate(use_cache=True)`` (its DynamicCache; its sliding layers' cache),
- equal the argmax loop of functree's own uncached call (each step the whole sequence
  again, left-padded to one width: no cache at all),
- equal one call where a first call's output is continued by a second (``generate`` returns
  no cache to reuse: the continuation re-reads its prompt, so this checks that a cache
  filled by a prefill of the generated tokens equals one filled token by token),
- equal the loop compiled at the exact sizes (no bucket: the prompt is not padded after its
  last token and the loop's cache has ``P + N`` slots).

GPT-2 and OPT are also built with a position table of 16 and drawn left-padded prompts near
it (wider than it or not): their positions count each row's real tokens, so ``generate`` runs
(HF's tokens) wherever every row's real tokens plus ``max_new_tokens - 1`` fit, and refuses
by name where HF raises IndexError.

Near-ties: a step where HF's top-2 logits (or the uncached loop's) are closer than
:data:`TIE` ``* (1 + max|logits|)`` is where either choice is numerics; the row comparison ends
there (counted in :data:`DRAWS`). ``--hypothesis-profile=explore`` draws ten times as many.

Not drawn: a Llama config with a ``sliding_window`` key. HF 5's DynamicCache then keeps only
the window's keys while LlamaAttention attends the whole prefix, so HF's cached generate
differs from HF's own forward (functree follows the forward).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import jax
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functree as ft
from functree.generation import _generate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, EOS, PAD, WIDTH, NEW, WINDOW = 48, 2, 0, 6, 6, 3
# The ports' step logits and HF's differ by at most 1.6e-6 of 1 + max|logits| (measured: 8
# left-padded batches of each family, 6 steps each, OLMo's the largest); TIE is ten times it.
TIE = 1.6e-5

LLAMA_LIKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS = {
    "llama": LLAMA_LIKE,
    # every layer sliding (from_hf refuses a mix: its blocks are one Stack)
    "qwen2": {**LLAMA_LIKE, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0},
    "mistral": {**LLAMA_LIKE, "sliding_window": WINDOW},
    "gemma": {**LLAMA_LIKE, "head_dim": 8, "num_key_value_heads": 1},
    "phi3": {**LLAMA_LIKE, "num_key_value_heads": 4},
    "olmo": LLAMA_LIKE,
    # layer 0 full, layer 1 sliding (each member's window); head_dim other than hidden / heads
    "qwen3": {**LLAMA_LIKE, "head_dim": 16, "use_sliding_window": True, "sliding_window": WINDOW,
              "max_window_layers": 1},
    "olmo2": LLAMA_LIKE,
    # layer 0 sliding, layer 1 full (HF's default layer_types); both soft-caps bend the logits
    "gemma2": {**LLAMA_LIKE, "head_dim": 8, "sliding_window": WINDOW, "query_pre_attn_scalar": 6,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 10.0},
    # layer 0 sliding, layer 1 full (sliding_window_pattern 2), each its own rope (local base 100,
    # global 1000); q/k norms; the final logits soft-capped
    "gemma3_text": {**LLAMA_LIKE, "head_dim": 8, "sliding_window": WINDOW, "sliding_window_pattern": 2,
                    "query_pre_attn_scalar": 6, "final_logit_softcapping": 10.0, "rope_local_base_freq": 100.0,
                    "rope_theta": 1000.0},
    # its four multipliers off 1 (the attention's in place of 1/sqrt(head_dim))
    "granite": {**LLAMA_LIKE, "embedding_multiplier": 2.0, "attention_multiplier": 0.3, "residual_multiplier": 0.5,
                "logits_scaling": 2.0},
    # layer 0 rotary, layer 1 NoPE; every layer sliding
    "smollm3": {**LLAMA_LIKE, "no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": WINDOW},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "gpt_neox": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "rotary_pct": 0.5, "max_position_embeddings": 64},
    # one norm feeding the attention and the MLP; half of each head rotated; q/k LayerNorms; GQA
    "phi": {**LLAMA_LIKE, "qk_layernorm": True},
    # 4 experts, top-2 (the sparse MoE block), every layer sliding
    "mixtral": {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    # per-head q/k norms, 4 experts of 16, top-2 kept, every layer sliding
    "qwen3_moe": {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "use_sliding_window": True, "sliding_window": WINDOW},
    # q/k norms over the whole projections, clip_qkv, 4 experts, top-2 renormalized
    "olmoe": {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 1.5, "norm_topk_prob": True},
    # a shared expert gated per token, 4 experts of 16, top-2 kept; Qwen2-MoE's windows: layer 0 sliding, layer 1 full
    "qwen2_moe": {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 24, "use_sliding_window": True, "sliding_window": WINDOW},
    "opt": {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 64, "word_embed_proj_dim": 32},
}
FAMILIES = sorted(CONFIGS)
LONG = 2 * WIDTH - 1  # a prompt width in the next bucket (16): a longer cache
LONGEST = LONG + 2 * NEW  # the uncached loop's one width
WINDOWED = ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "smollm3", "mixtral", "qwen3_moe", "qwen2_moe")


@functools.cache
def lm(family, table=None):
    """The family's HF model (eager attention) and its port; ``table``: its learned position
    table's length instead (GPT-2's ``n_positions``, OPT's ``max_position_embeddings``)."""
    sizes = dict(CONFIGS[family])
    if table is not None:
        sizes["n_positions" if family == "gpt2" else "max_position_embeddings"] = table
    config = transformers.AutoConfig.for_model(family, vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS,
                                               bos_token_id=1, **sizes)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():  # off HF's initialization: biases and norms not zeros and ones
            p.add_(0.2 * torch.randn_like(p))
        if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
            hf.get_output_embeddings().weight.mul_(4.0)  # sharper logits: fewer near-ties
    return hf, ft.nn.from_hf(hf)


@st.composite
def prompts(draw, widths=(WIDTH,)):
    """``(ids, mask)`` ``[rows, width]`` (a width of ``widths``), left-padded with PAD; the
    last row unpadded."""
    rows, width = draw(st.integers(1, 3)), draw(st.sampled_from(widths))
    lengths = [draw(st.integers(1, width)) for _ in range(rows - 1)] + [width]
    ids = np.full((rows, width), PAD, np.int64)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n))
    mask = (np.arange(width)[None] >= width - np.array(lengths)[:, None]).astype(np.int64)
    return ids, mask


def hf_generate(hf, ids, mask, new, eos):
    """HF's cached greedy tokens ``[rows, new]`` (PAD after a row's EOS and after HF stopped)
    and its logits ``[rows, steps, vocab]``."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                          do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
                          eos_token_id=eos, pad_token_id=PAD)
    tokens = np.full((len(ids), new), PAD, np.int64)
    got = out.sequences.numpy()[:, ids.shape[1]:]
    tokens[:, :got.shape[1]] = got
    return tokens, torch.stack(out.logits, 1).float().numpy()


def ours(model, ids, mask, new, eos):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ft.nn.generate(model, ids.astype(np.int32), new, attention_mask=mask, eos_token_id=eos,
                             pad_token_id=PAD)
    return np.asarray(out)[:, ids.shape[1]:]


@functools.cache
def _forward(family):
    return jax.jit(lambda model, ids, mask: model(ids, mask))


def uncached(family, ids, mask, new, eos):
    """Greedy tokens from functree's call without a cache: each step the prompt and the tokens
    so far, left-padded to ``LONGEST`` columns (one compiled shape), argmax of the last
    column; and each step's logits ``[rows, new, vocab]``."""
    model = lm(family)[1]
    rows, width = len(ids), LONGEST
    seqs = [list(ids[r, mask[r] == 1]) for r in range(rows)]
    done = np.zeros(rows, bool)
    tokens, logits = np.full((rows, new), PAD, np.int64), []
    for t in range(new):
        full, full_mask = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
        for r, s in enumerate(seqs):
            full[r, width - len(s):], full_mask[r, width - len(s):] = s, 1
        last = np.asarray(_forward(family)(model, full, full_mask))[:, -1]
        logits.append(last)
        for r in range(rows):
            token = PAD if done[r] else int(last[r].argmax())
            tokens[r, t] = token
            seqs[r].append(token)
            done[r] |= token in eos
    return tokens, np.stack(logits, 1)


def trusted(logits, tokens, eos):
    """Per row, how many leading tokens are not numerics: up to (not including) the first step
    whose top-2 gap is under the tie floor, or the whole row; rows ended at EOS stop counting."""
    top2 = np.sort(logits, -1)[..., -2:]
    gap = top2[..., 1] - top2[..., 0]
    floor = TIE * (1 + np.abs(logits).max(-1))
    steps = logits.shape[1]
    out = np.full(len(tokens), tokens.shape[1])
    for r in range(len(tokens)):
        for t in range(steps):
            if gap[r, t] < floor[r, t]:
                out[r] = t
                DRAWS["near-ties"] += 1
                break
            if tokens[r, t] in eos:
                break
    return out


def assert_equal_up_to(got, expected, upto, what):
    for r, n in enumerate(upto):
        np.testing.assert_array_equal(got[r, :n], expected[r, :n], err_msg=f"{what}: row {r}")
        DRAWS["tokens"] += int(n)


DRAWS = {"draws": 0, "tokens": 0, "near-ties": 0, "continued": 0, "exact": 0, "near the table": 0,
         "refused there": 0}


def fuzz(n):
    return settings(max_examples=examples(n), deadline=None, suppress_health_check=list(HealthCheck))


@fuzz(4)
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), new=st.integers(1, NEW),
       eos=st.sampled_from([[], [EOS]]))
def test_cached_greedy_equals_hf_cached_and_our_uncached(family, prompt, new, eos):
    ids, mask = prompt
    hf, model = lm(family)
    tokens = ours(model, ids, mask, new, eos)
    expected, logits = hf_generate(hf, ids, mask, new, eos)
    DRAWS["draws"] += 1
    assert_equal_up_to(tokens, expected, trusted(logits, expected, eos), f"{family}: HF's cached generate")
    plain, own = uncached(family, ids, mask, new, eos)
    assert_equal_up_to(tokens, plain, trusted(own, plain, eos), f"{family}: the uncached loop")


@pytest.fixture(scope="module", autouse=True)
def _counts():
    yield
    print(f"\ncached generation fuzz: {DRAWS}", file=sys.__stderr__)


@fuzz(2)
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), first=st.integers(1, NEW - 1), second=st.integers(1, NEW))
def test_a_continued_generation_equals_one_call(family, prompt, first, second):
    """``generate(generate(p, a), b)`` (its mask: the prompt's, then ones) equals
    ``generate(p, a + b)`` (no EOS, so no row ends in between), up to HF's near-ties."""
    ids, mask = prompt
    hf, model = lm(family)
    once = ours(model, ids, mask, first + second, [])
    half = np.concatenate([ids, ours(model, ids, mask, first, [])], axis=1)
    again = ours(model, half, np.concatenate([mask, np.ones((len(ids), first), np.int64)], axis=1), second, [])
    expected, logits = hf_generate(hf, ids, mask, first + second, [])
    upto = trusted(logits, expected, [])
    assert_equal_up_to(once, expected, upto, f"{family}: one call against HF")
    DRAWS["continued"] += 1
    assert_equal_up_to(np.concatenate([half[:, ids.shape[1]:], again], axis=1), once, upto, f"{family}: continued")


@fuzz(2)
@given(family=st.sampled_from(FAMILIES), prompt=prompts((WIDTH, LONG)), new=st.integers(1, 2 * NEW),
       eos=st.sampled_from([[], [EOS]]))
def test_bucketed_sizes_give_the_exact_sizes_tokens(family, prompt, new, eos):
    """The loop compiled for the prompt's and ``max_new_tokens``' buckets (the prompt padded
    after its last token, a longer cache) gives the tokens of the loop compiled at the exact
    sizes (``P + N`` cache slots), up to the uncached loop's near-ties."""
    ids, mask = prompt
    model = lm(family)[1]
    bucketed = ours(model, ids, mask, new, eos)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_generate, "_buckets", lambda prompt, new, limit: (prompt, new))
        exact = ours(model, ids, mask, new, eos)
    plain, own = uncached(family, ids, mask, new, eos)
    DRAWS["exact"] += 1
    upto = trusted(own, plain, eos)
    assert_equal_up_to(exact, plain, upto, f"{family}: exact sizes against the uncached loop")
    assert_equal_up_to(bucketed, exact, upto, f"{family}: bucketed against exact")


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_window_prompts_longer_than_the_window(family):
    """Mistral, Qwen2, SmolLM3, Mixtral and Qwen3-MoE (every layer), Qwen3 (its second layer), Gemma 2, Gemma 3
    and Qwen2-MoE (their first) attend the last 3 positions: prompts
    of 6 and 4 real tokens (one left-padded) and 6 new tokens, cached, equal HF's cached
    generate (its sliding-window cache layers) and functree's uncached loop."""
    hf, model = lm(family)
    ids = np.array([[0, 0, 17, 5, 30, 9], [11, 40, 23, 8, 14, 33]])
    mask = (np.arange(WIDTH) >= [[2], [0]]).astype(np.int64)
    tokens = ours(model, ids, mask, NEW, [])
    expected, logits = hf_generate(hf, ids, mask, NEW, [])
    assert (trusted(logits, expected, []) == NEW).all()  # no near-tie: every token compared
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(tokens, uncached(family, ids, mask, NEW, [])[0])


TABLE = 16  # the near-limit models' learned position table
LEARNED = ("gpt2", "opt")  # positions from a table, counted over each row's real tokens


@st.composite
def near_the_table(draw):
    """``(ids, mask, new)``: 1 to 3 left-padded rows in ``TABLE - 11`` to ``TABLE + 3`` columns
    (wider than the table or not; the widest in a bucket past it), each row's real tokens up
    to ``TABLE + 1``, and ``new`` such that the longest row's real tokens plus ``new - 1``
    land one short of, on, or one past ``TABLE`` (at least one new token)."""
    rows, width = draw(st.integers(1, 3)), draw(st.sampled_from((TABLE - 11, TABLE - 8, TABLE - 1, TABLE + 1,
                                                                  TABLE + 3)))
    lengths = [draw(st.integers(1, min(width, TABLE + 1))) for _ in range(rows)]
    ids = np.full((rows, width), PAD, np.int64)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n))
    mask = (np.arange(width)[None] >= width - np.array(lengths)[:, None]).astype(np.int64)
    new = max(1, TABLE + 1 - max(lengths) + draw(st.integers(-1, 1)))
    return ids, mask, new


@fuzz(3)
@given(family=st.sampled_from(LEARNED), drawn=near_the_table(), eos=st.sampled_from([[], [EOS]]))
def test_learned_positions_near_the_table_count_real_tokens(family, drawn, eos):
    """GPT-2 and OPT with a table of 16 positions, left-padded prompts near it (wider than it
    or not): where every row's real tokens plus ``new - 1`` fit, HF's cached generate runs and
    functree's tokens equal it; where a row overruns, HF raises IndexError and functree refuses
    naming the row's real tokens. (Near the table the loop runs at its exact sizes: a bucket is
    taken only where the rounded width plus new tokens fit the table, and its padding, after
    the prompt and masked, takes no real position.)"""
    ids, mask, new = drawn
    hf, model = lm(family, TABLE)
    DRAWS["near the table"] += 1
    if mask.sum(1).max() + new - 1 > TABLE:
        with pytest.raises(IndexError):
            hf_generate(hf, ids, mask, new, eos)
        with pytest.raises(ValueError, match=rf"{mask.sum(1).max()} real tokens in row \d+, its longest(.|\n)*"
                                             rf"max_positions = {TABLE}"):
            ours(model, ids, mask, new, eos)
        DRAWS["refused there"] += 1
        return
    expected, logits = hf_generate(hf, ids, mask, new, eos)
    assert_equal_up_to(ours(model, ids, mask, new, eos), expected, trusted(logits, expected, eos),
                       f"{family}: HF's cached generate near the table")
