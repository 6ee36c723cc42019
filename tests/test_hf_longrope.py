"""Phi-3's longrope rope against Hugging Face's ``Phi3ForCausalLM``, across its switch point.

HF rotates with ``short_factor`` while a call's longest position ``max(position_ids) + 1`` is
at most ``original_max_position_embeddings`` (``L0``), with ``long_factor`` past it, cos/sin
scaled by ``attention_factor`` (``modeling_rope_utils.dynamic_rope_update``). Its ``generate``
recomputes the whole cache with the long factors at the step whose input holds ``L0 + 1``
tokens (``Phi3ForCausalLM.prepare_inputs_for_generation``); functree's KV cache keeps its keys,
so a generation that would cross there is refused and every other one gives HF's tokens.

The model is a tiny random Phi-3 (``L0 = 12``, no power of two: a prompt of 9 to 12 tokens is
compiled in a bucket of 16 columns, past ``L0``), saved by HF and read with ``ft.nn.from_hf``
of the directory. Logits and gradients at float32 rounding: atol 2.5e-5 times the largest
value (measured: 1.1e-6 of it), scores 1e-5 (measured 1e-6 on log-probabilities of order 3).
"""

import json
import os

import jax
import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, L0 = 40, 12
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5], "long_factor": [3.0, 7.0]}


def phi3_config(**changes):
    return transformers.Phi3Config(**{
        "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 32, "max_position_embeddings": 48,
        "original_max_position_embeddings": L0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "rope_parameters": dict(LONGROPE), **changes})


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """HF's Phi-3 (weights moved off HF's small initialization), its directory and its port."""
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM._from_config(phi3_config(), attn_implementation="eager")
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    hf.eval()
    directory = tmp_path_factory.mktemp("phi3") / "hf"
    hf.save_pretrained(directory)
    return hf, directory, ft.nn.from_hf(directory)


def tokens(rows, length, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, size=(rows, length)).astype(np.int32)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long()).logits.numpy()


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=2.5e-5 * float(np.abs(expected).max()))


def test_logits_equal_hf_at_and_past_the_switch_point(phi3):
    hf, _, model = phi3
    ids = tokens(2, L0 + 1)
    forward = jax.jit(lambda m, i: m(i))
    for length in (L0, L0 + 1):  # at the switch point: the short factors; one past it: the long ones
        assert_close(np.asarray(forward(model, ids[:, :length])), hf_logits(hf, ids[:, :length]))
    # the switch is exercised: one token more turns every position's rotation to the long factors
    assert np.abs(hf_logits(hf, ids)[:, :L0] - hf_logits(hf, ids[:, :L0])).max() > 0.05


def test_gradients_equal_hf_past_the_switch_point(phi3):
    hf, _, model = phi3
    ids = tokens(2, L0 + 3, seed=1)
    loss = lambda m: ft.losses.softmax_cross_entropy(m(ids)[:, :-1], ids[:, 1:])  # noqa: E731
    grads = ft.hf.to_hf_state_dict(jax.jit(ft.gradient(loss))(model), numpy=True)
    hf.zero_grad()
    hf(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long()).loss.backward()
    expected = {name: p.grad.numpy() for name, p in hf.named_parameters()}
    hf.zero_grad()
    assert set(grads) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(grads[name], value, rtol=0, atol=2.5e-5 * float(np.abs(value).max()), err_msg=name)


def hf_generate(hf, ids, new, mask=None):
    kwargs = {} if mask is None else {"attention_mask": torch.from_numpy(mask).long()}
    with torch.no_grad():
        out = hf.generate(torch.from_numpy(ids).long(), max_new_tokens=new, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_scores=True, return_dict_in_generate=True, **kwargs)
        scores = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    return out.sequences.numpy(), scores.numpy()


@pytest.mark.parametrize("prompt, new", [(L0 + 1, 4), (L0 - 3, 4), (1, L0), (L0, 1), (4, L0 - 3)],
                         ids=["past-the-switch", "bucket-past-L0", "one-token-prompt", "prompt-of-L0", "L0+1-slots"])
def test_greedy_tokens_and_scores_equal_hf(phi3, prompt, new):
    """A prompt past the switch (long factors throughout, a left-padded row too), and
    generations of ``L0 + 1`` positions (the last token is never fed back: short factors
    throughout, as in HF, whose reset step never comes), the fixes the refusals below give.
    A cache of ``L0 + 1`` slots after a prompt of 2 to ``L0 - 1`` tokens was refused (HF computes it)."""
    hf, _, model = phi3
    ids = tokens(2, prompt, seed=prompt)
    mask = np.ones_like(ids)
    mask[1, : prompt // 3] = 0
    tokens_, scores = ft.nn.generate(model, ids, new, attention_mask=mask, temperature=0.0, eos_token_id=[],
                                     pad_token_id=0, return_scores=True)
    expected_tokens, expected_scores = hf_generate(hf, ids, new, mask)
    np.testing.assert_array_equal(np.asarray(tokens_), expected_tokens)
    np.testing.assert_allclose(np.asarray(scores), expected_scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("prompt, new", [(1, L0 + 1), (L0 - 3, 5), (L0, 2)],
                         ids=["one-token-prompt", "bucket-past-L0", "prompt-of-L0"])
def test_a_generation_that_would_cross_the_switch_point_is_refused(phi3, prompt, new):
    """HF recomputes its cache at the crossing, so the tokens differ from a KV cache's: a
    one-token prompt (its prefill, one token, looks like a decoding step to the model) and a
    prompt of 9 to 12 tokens (compiled in 16 columns, past L0: the model's own check missed
    it) gave other tokens than HF's, silently (measured: scores 0.013, 0.018 and 0.39 off HF's,
    the last token another). The message's fix, ``L0 + 1 - prompt`` new tokens, is a case of
    the test above."""
    model = phi3[2]
    with pytest.raises(ValueError, match=rf"(?s)original_max_positions \({L0}\), and this cache of {prompt + new} "
                                         rf"slots would cross.*ft\.nn\.generate\(model, input_ids, {L0 + 1 - prompt}\)"):
        ft.nn.generate(model, tokens(1, prompt), new, temperature=0.0)


def test_a_llama_with_longrope_generates_across_the_switch_as_hf(tmp_path):
    """Only Phi-3's generate recomputes its cache at the switch point; HF's Llama with a
    longrope rope keeps its cache (short-factor keys, then long-factor queries and keys), as a
    KV cache does. Its generations across the switch were refused (the check lived on every
    Llama-family class): a one-token prompt and a prompt of 6 into 15 slots give HF's tokens."""
    rope = {**LONGROPE, "partial_rotary_factor": 1.0, "short_factor": [1.0, 1.5, 1.2, 1.1],
            "long_factor": [3.0, 7.0, 2.0, 5.0], "original_max_position_embeddings": L0}
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=48,
                                      original_max_position_embeddings=L0, rope_parameters=rope)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model = ft.nn.from_hf(tmp_path)
    assert model.model.layers.layers.self_attn.rotary.kind == "longrope"
    for prompt, new in ((1, L0 + 1), (6, L0 - 3)):
        ids = tokens(1, prompt, seed=prompt)
        tokens_, scores = ft.nn.generate(model, ids, new, temperature=0.0, eos_token_id=[], pad_token_id=0,
                                         return_scores=True)
        expected_tokens, expected_scores = hf_generate(hf, ids, new, np.ones_like(ids))
        np.testing.assert_array_equal(np.asarray(tokens_), expected_tokens)
        np.testing.assert_allclose(np.asarray(scores), expected_scores, rtol=0, atol=1e-5)


def test_save_hf_writes_hf_s_longrope_config(phi3, tmp_path):
    """config.json's rope_parameters (an old-style rope_scaling with factor and attention
    factor too) and original_max_position_embeddings exactly as HF's save_pretrained writes them."""
    _, directory, model = phi3
    ft.nn.save_hf(model, tmp_path / "ft")
    assert json.loads((tmp_path / "ft" / "config.json").read_text()) == json.loads((directory / "config.json").read_text())
    scaled = transformers.Phi3ForCausalLM(phi3_config(rope_parameters=None, rope_scaling={
        "type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [3.0, 7.0], "partial_rotary_factor": 0.5,
        "factor": 3.0, "attention_factor": 1.1}))
    scaled.save_pretrained(tmp_path / "hf")
    port = ft.nn.from_hf(tmp_path / "hf")
    assert port.model.layers[0].self_attn.rotary.scale == scaled.model.rotary_emb.attention_scaling == 1.1
    ft.nn.save_hf(port, tmp_path / "ft2")
    assert json.loads((tmp_path / "ft2" / "config.json").read_text()) == json.loads((tmp_path / "hf" / "config.json").read_text())
