"""``ft.nn.generate`` against Hugging Face's ``generate`` where the earlier audits did not look:
rope scaling during cached generation past ``max_position_embeddings``, a whole bfloat16
generation loop, and models that cannot generate.

Dynamic NTK rope recomputes its frequencies from each call's longest position
(``modeling_rope_utils.dynamic_rope_update``): a prefill of ``P`` tokens rotates with the base
of ``max(P, L0)``, each decoding step with that of its own position, and the keys already in
the cache keep the base they were rotated with (HF's ``DynamicCache`` as functree's KV cache).
HF's cached generation therefore differs from its own forward of the whole sequence (checked
here: the effect is exercised), and functree's must equal the cached one. Tiny random Llama and
Gemma 3 (its full-attention layers dynamic, the sliding ones default: one rope per layer type),
``L0 = max_position_embeddings = 16``, a prompt of 6 (one row left-padded) and 14 new tokens.

Tolerance: scores (log-probabilities, magnitude up to ~6) ``atol = 4e-5``: over 61 draws of 13
families x 5 rope types (linear, dynamic, yarn, llama3, longrope; Phi-3 longrope only; prompt 6
+ 20 new, float32) the largest difference was 4.05e-6, times 10. bfloat16: the bound is 2.5 times
HF's own bfloat16 error (its model as ``from_pretrained(dtype=torch.bfloat16)`` makes it), as
for the bfloat16 forwards.
"""

import copy
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, MAX_POS, PROMPT, NEW = 100, 16, 6, 14
SCORE_ATOL = 4e-5  # measured 4.05e-6 (module docstring), times 10
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=MAX_POS, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)


def built(cls, config):
    torch.manual_seed(0)
    hf = cls._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf.eval()


def llama():
    return built(transformers.LlamaForCausalLM, transformers.LlamaConfig(**COMMON, rope_parameters=dict(DYNAMIC)))


def gemma3():
    ropes = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": dict(DYNAMIC)}
    config = transformers.Gemma3TextConfig(**COMMON, head_dim=8, rope_parameters=ropes, sliding_window=64,
                                           layer_types=["sliding_attention", "full_attention"])
    return built(transformers.Gemma3ForCausalLM, config)


def prompt_batch():
    ids = np.random.default_rng(5).integers(3, VOCAB, size=(2, PROMPT))
    mask = np.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # row 1 left-padded
    return ids, mask


@pytest.mark.parametrize("make", [llama, gemma3], ids=["llama", "gemma3"])
def test_dynamic_rope_generation_past_max_positions_equals_hf(make):
    """Greedy tokens and scores equal HF's across the point where dynamic NTK starts scaling
    (positions 0..19 against max_position_embeddings 16), the cached keys keeping their base."""
    hf = make()
    ids, mask = prompt_batch()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=NEW,
                          min_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None, output_scores=True,
                          output_logits=True, return_dict_in_generate=True)
        expected = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).numpy()
        sequence = out.sequences
        whole = torch.from_numpy(np.concatenate([mask, np.ones((2, NEW), mask.dtype)], 1))
        full = hf(sequence, attention_mask=whole).logits[:, PROMPT - 1:-1]
    # HF's cached generation is not its forward of the whole sequence: the rescaling is exercised
    assert float((full - torch.stack(out.logits, 1)).abs().max()) > 1e-3
    model = ft.nn.from_hf(hf)
    tokens, scores = ft.nn.generate(model, ids.astype(np.int32), NEW, attention_mask=mask.astype(np.int32),
                                    temperature=0.0, eos_token_id=[], pad_token_id=0, return_scores=True)
    np.testing.assert_array_equal(np.asarray(tokens), sequence.numpy())
    np.testing.assert_allclose(np.asarray(scores), expected, rtol=0, atol=SCORE_ATOL)


# ---- bfloat16: the whole generation loop within HF's own bfloat16 error ---------------------------

def hf_bfloat16(hf):
    """HF's bfloat16 model as ``from_pretrained(dtype=torch.bfloat16)`` makes it: its rotary
    ``inv_freq`` stays float32 (``model.to(torch.bfloat16)`` would round it too)."""
    model = type(hf)._from_config(copy.deepcopy(hf.config), dtype=torch.bfloat16, attn_implementation="eager")
    model.load_state_dict(hf.state_dict())
    return model.eval()


def hf_steps(hf, sequence, mask):
    """HF's logits at each generation step, teacher-forced on ``sequence`` with its cache and
    ``generate``'s positions (``cumsum(mask) - 1``, 1 at padding)."""
    am = torch.from_numpy(np.concatenate([mask, np.ones((2, NEW), mask.dtype)], 1))
    positions = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    ids, out = torch.from_numpy(sequence), []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (past_key_values= is deprecated from transformers 5.x: cache=)
        step = hf(input_ids=ids[:, :PROMPT], attention_mask=am[:, :PROMPT], position_ids=positions[:, :PROMPT])
        for s in range(PROMPT, PROMPT + NEW):
            out.append(step.logits[:, -1].float().numpy())
            if s < PROMPT + NEW - 1:
                step = hf(input_ids=ids[:, s:s + 1], attention_mask=am[:, :s + 1], position_ids=positions[:, s:s + 1],
                          past_key_values=step.past_key_values)
    return np.stack(out, 1)


def ft_steps(model, sequence, mask):
    """The port's logits at each step, teacher-forced on ``sequence`` under generate's cache
    protocol (a prefill, then one token a call)."""
    call = jax.jit(lambda m, t, a, p, c: m(t, attention_mask=a, positions=p, cache=c))
    am = np.concatenate([mask, np.zeros((2, NEW), mask.dtype)], 1).astype(np.int32)
    ids, cache = sequence.astype(np.int32), model.init_cache(2, PROMPT + NEW)
    logits, cache = call(model, ids[:, :PROMPT], am, np.broadcast_to(np.arange(PROMPT, dtype=np.int32), (2, PROMPT)),
                         cache)
    out = [logits[:, -1]]
    for slot in range(PROMPT, PROMPT + NEW - 1):
        am[:, slot] = 1
        logits, cache = call(model, ids[:, slot:slot + 1], am, np.full((2, 1), slot, np.int32), cache)
        out.append(logits[:, -1])
    return np.asarray(jnp.stack(out, 1).astype(jnp.float32))


def test_bfloat16_generation_loop_is_within_hf_s_own_bfloat16_error():
    """The port in bfloat16 (weights, activations, key-value cache) through a whole cached loop
    past the dynamic rescaling: its per-step logits are as far from HF's float32 as HF's own
    bfloat16 model's are (bound 2.5x; measured over 50 draws of 13 families, default and dynamic
    rope: ratio 0.58 to 1.47; here 0.82),
    and each greedy choice on HF's context equals HF float32's where its top-2 margin exceeds 3x
    that error (near-ties may flip)."""
    hf = llama()
    ids, mask = prompt_batch()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=NEW,
                          min_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                          return_dict_in_generate=True)
    sequence, reference = out.sequences.numpy(), torch.stack(out.logits, 1).numpy()
    hf_error = float(np.abs(hf_steps(hf_bfloat16(hf), sequence, mask) - reference).max())
    ours = ft_steps(ft.nn.from_hf(hf, dtype=jnp.bfloat16), sequence, mask)
    assert float(np.abs(ours - reference).max()) <= 2.5 * hf_error
    top2 = np.sort(reference, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 3 * hf_error
    assert clear.sum() >= 4  # the token check below compares something
    np.testing.assert_array_equal(ours.argmax(-1)[clear], reference.argmax(-1)[clear])


# ---- a model that cannot generate names what it is and the fix ---------------------------------

def tiny_bert():
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32)


@pytest.mark.parametrize("cls, pattern", [
    ("BertForMaskedLM", r"a BertForMaskedLM \(ft.nn.from_hf's port of Hugging Face's BertForMaskedLM\) does not "
                        r"generate text: it is an encoder(.|\n)*logits = model\(input_ids, attention_mask=mask\)"
                        r"(.|\n)*\[MASK\](.|\n)*ft.nn.from_hf\(causal_lm\)"),
    ("BertForSequenceClassification", r"BertForSequenceClassification(.|\n)*it is an encoder(.|\n)*"
                                      r"out = model\(input_ids"),
    ("LlamaForSequenceClassification", r"it is a task head on LlamaForCausalLM's body(.|\n)*"
                                       r"lm = ft.nn.from_hf\(causal_lm\)   # a LlamaForCausalLM checkpoint"),
])
def test_generate_on_a_model_that_cannot_generate_names_the_fix(cls, pattern):
    """An encoder or a task head from ft.nn.from_hf (HF's classes have no generate) was told to
    write a class with init_cache (the cache protocol): the fix for a model of one's own, not
    for a loaded BERT or classifier. The message says what the model is and what to do."""
    if cls.startswith("Bert"):
        config = tiny_bert()
    else:
        config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    torch.manual_seed(0)
    model = ft.nn.from_hf(getattr(transformers, cls)(config).eval())
    with pytest.raises(TypeError, match=pattern):
        ft.nn.generate(model, np.array([[5, 6, 7]], np.int32), 2)
    flat = ft.to_flat_dict(model)
    shapes = [np.shape(v) for v in flat.values()]
    shape = next(s for s in shapes if shapes.count(s) > 1)
    target, source = [k for k, v in flat.items() if np.shape(v) == shape][:2]  # two leaves of one shape
    with pytest.raises(TypeError, match=pattern):  # tied in an ft.nn.Shared: the same message
        ft.nn.generate(ft.nn.Shared(model, {target: source}), np.array([[5, 6, 7]], np.int32), 2)
