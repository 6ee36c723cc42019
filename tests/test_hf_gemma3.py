"""Gemma 3's text model (``ft.hf``'s ``Gemma3ForCausalLM``, model type ``gemma3_text``, a
subclass of Gemma 2's) against transformers' own: built from a tiny config with random
weights (no download), loaded from the HF object, its config and state dict, its config.json
as a dict and its ``save_pretrained`` directory. Three layers, sliding (window 3, shorter than
the 12 tokens), full, sliding (``sliding_window_pattern`` 2); each layer type its own rope
(the sliding layers base 100, the full ones base 1000 with a linear factor 8: an older
file's ``rope_local_base_freq``, ``rope_theta`` and ``rope_scaling``); per-head q/k norms,
``query_pre_attn_scalar`` 6 (not ``head_dim`` 8), final logits soft-capped;
``attn_logit_softcapping`` set, which HF's Gemma 3 does not apply (nor does this). Greedy
cached tokens equal HF's ``generate``; each layer type's cos/sin equal HF's
``Gemma3RotaryEmbedding`` for every rope type; what is not ported is refused by name.

Logits at the real tokens of a left-padded batch within 2.1e-5 of their magnitude: over three
seeds the largest difference measured was 2.0e-6 of it (1.2e-6, 8.0e-7, 2.0e-6; times 10).
``save_hf`` -> ``from_pretrained``, HF's initialization, export and generation run with the
other families too (``test_hf_load.py``'s and ``test_hf_save.py``'s ``FAMILIES``)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _load, _options
from functree.nn import _rotary

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_hf_load import DECODER, batch, forward, hf_model, hf_output  # noqa: E402

ATOL = 2.1e-5  # times max|HF|: measured 2.0e-6 (module docstring)
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


def config(**changes):
    """Layers sliding, full, sliding (window 3); local base 100, global base 1000 scaled
    linearly by 8; the scalar 6 is not head_dim 8; the final cap near the logits' size."""
    return transformers.Gemma3TextConfig(**{
        **DECODER, "num_hidden_layers": 3, "head_dim": 8, "sliding_window": 3, "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 6, "final_logit_softcapping": 3.0, "attn_logit_softcapping": 1.0,
        "rope_local_base_freq": 100.0, "rope_theta": 1000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        **changes})


@pytest.fixture(scope="module")
def hf():
    return hf_model(config())


@pytest.fixture(scope="module")
def model(hf):
    return ft.nn.from_hf(hf)


def assert_logits_equal(model, hf, length=12):
    ids, mask = batch(length)
    expected = hf_output(hf, ids, mask)
    actual = np.asarray(forward(model, ids, mask))
    real = mask.astype(bool)
    atol = ATOL * float(np.abs(expected).max())
    np.testing.assert_allclose(actual[real], expected[real], rtol=0, atol=atol)
    return actual[real], atol


def with_attention(model, **changes):
    layers = model.model.layers
    attention = layers.layers.self_attn.replace(**changes)
    return model.replace(model=model.model.replace(layers=layers.replace(layers=layers.layers.replace(
        self_attn=attention))))


def test_loads_from_every_source_with_hf_logits(hf, model, tmp_path):
    """The HF object, its config and state dict, its config.json dict (read with the family's
    defaults row: an older file's rope keys) and its save_pretrained directory. Each of the
    layer types' ropes, the windows, the q/k norms, the query scalar and the final cap moves
    the logits by more than 100 times the tolerance (none of them is idle here); the
    attention cap HF does not apply would move them too."""
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.lm_head is None  # tied, as Gemma's
    ours, atol = assert_logits_equal(model, hf)
    hf.save_pretrained(tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    older = {k: v for k, v in config_json.items() if k not in ("rope_parameters", "layer_types")}
    older.update(rope_local_base_freq=100.0, rope_theta=1000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    for given in ((hf.config, hf.state_dict()), (config_json, hf.state_dict()), (older, hf.state_dict()),
                  (tmp_path,)):
        loaded = ft.nn.from_hf(*given)
        assert type(loaded) is type(model)
        np.testing.assert_array_equal(np.asarray(forward(loaded, *batch(12)))[batch(12)[1].astype(bool)], ours)
    attention = model.model.layers.layers.self_attn
    local, scaled = attention.rotary
    assert (local.kind, local.base, scaled.kind, scaled.base, scaled.factor) == ("default", 100.0, "linear", 1000.0, 8.0)
    assert attention.member_rope.tolist() == [0, 1, 0] and attention.member_window.tolist() == [3, 0, 3]
    assert attention.logit_softcap is None and model.final_logit_softcapping == 3.0
    np.testing.assert_allclose(attention.logit_scale, [6 ** -0.5] * 3, rtol=0, atol=1e-7)
    real = batch(12)[1].astype(bool)
    idle = {"ropes": with_attention(model, member_rope=jnp.zeros(3, jnp.int32)),
            "window": with_attention(model, member_window=jnp.zeros(3, jnp.int32)),
            "q/k norms": with_attention(model, q_norm=None, k_norm=None),
            "scalar": with_attention(model, logit_scale=None),
            "final cap": model.replace(final_logit_softcapping=None),
            "attention cap (HF's Gemma 3 has none)": with_attention(model, logit_softcap=1.0)}
    for name, other in idle.items():
        moved = np.abs(np.asarray(forward(other, *batch(12)))[real] - ours).max()
        assert moved > 100 * atol, (name, moved, atol)


def test_generates_hf_s_greedy_tokens_past_the_window(hf, model):
    """Prompts of 12 and 9 real tokens (left-padded) and 6 new tokens, the cache attending
    the last 3 slots on the sliding layers: HF's greedy ``generate`` (its hybrid cache)."""
    ids, mask = batch(12)
    ours = np.asarray(ft.nn.generate(model, ids, 6, attention_mask=mask, eos_token_id=None, pad_token_id=0))
    with torch.no_grad():
        theirs = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                             max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_a_training_step_s_gradients_equal_torch_s(hf, model):
    """The gradient of the mean next-token cross-entropy of a left-padded batch, tensor by
    tensor against torch's ``.grad`` (the q/k norms and the four norms of each block
    included: finite, nonzero), within 4.8e-5 of each tensor's largest gradient (measured over
    three seeds: 4.7e-6 at most, times 10)."""
    ids, mask = batch(12)
    labels = np.where((mask[:, 1:] == 1) & (mask[:, :-1] == 1), ids[:, 1:], -100)

    def loss(m):
        logits = m(ids, mask)[:, :-1]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), np.maximum(labels, 0)[..., None], -1)[..., 0]
        return -jnp.sum(jnp.where(labels >= 0, picked, 0.0)) / float(np.sum(labels >= 0))

    grads = ft.nn.to_hf_state_dict(jax.jit(ft.gradient(loss))(model), numpy=True)
    hf.zero_grad()
    logits = hf(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                position_ids=torch.from_numpy(np.maximum(np.cumsum(mask, 1) - 1, 0)).long()).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                      torch.from_numpy(labels).reshape(-1).long(), ignore_index=-100).backward()
    theirs = {name: p.grad.numpy() for name, p in hf.named_parameters()}
    hf.zero_grad()
    assert set(theirs) <= set(grads) and any(".self_attn.q_norm." in n for n in theirs)
    for name, expected in theirs.items():
        assert np.isfinite(grads[name]).all() and np.abs(expected).max() > 0, name
        np.testing.assert_allclose(grads[name], expected, rtol=0, atol=4.8e-5 * float(np.abs(expected).max()),
                                   err_msg=name)


def test_weight_decay_skips_what_transformers_trainer_skips(hf, model):
    """ft.optim's default decay set is the names ``transformers.Trainer`` decays (its
    ``get_decay_parameter_names``): the projections and the embedding; no norm (the q/k
    norms' ``weight`` included: GemmaRMSNorm declares it ``decay=False``)."""
    params = ft.parameters(model)
    mask = ft.optim.decay_mask(params)
    ones = jax.tree.map(lambda m, p: np.broadcast_to(np.reshape(np.asarray(m, np.float32),
                                                                np.shape(m) + (1,) * (np.ndim(p) - np.ndim(m))),
                                                     np.shape(p)), mask, params)
    ours = {name for name, value in ft.nn.to_hf_state_dict(ones, numpy=True).items() if np.all(value == 1)}
    theirs = set(transformers.Trainer.get_decay_parameter_names(None, hf))
    assert ours == theirs and any(".q_proj." in n for n in ours) and not any("norm" in n for n in ours)


# Each rope type on the full layers (the sliding ones keep the default at base 100), HF's keys.
ROPES = {"linear": {"factor": 8.0}, "yarn": {"factor": 4.0}, "dynamic": {"factor": 2.0},
         "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
         "longrope": {"factor": 4.0, "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 9.0],
                      "original_max_position_embeddings": 16}}


@pytest.mark.parametrize("kind", ROPES)
def test_each_layer_type_rotates_as_hf_s_gemma3_rotary_embedding(kind):
    """cos and sin of positions 0..39 (past max_position_embeddings 32: dynamic NTK grows its
    base; past longrope's 16: its long factors) for each layer type, from the attention's
    tuple ``rotary`` and the layer type's index, equal HF's within 1e-5 (float32 angles up
    to 39 radians)."""
    c = config(rope_scaling={"rope_type": kind, **ROPES[kind]})
    head_dim, half, positions = 8, 4, np.arange(40)
    rotary, index = _options.layer_type_ropes(c, head_dim, "Gemma3ForCausalLM")
    assert isinstance(rotary, tuple) and index is not None and index == (0, 1, 0) and rotary[1].kind == kind
    hf_rope = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(c)
    unit = jnp.broadcast_to(jnp.eye(head_dim)[:half], (40, half, head_dim))  # e_i: rotated to (cos, sin) at i, i + half
    for layer, kind_of_layer in enumerate(c.layer_types[:2]):
        with torch.no_grad():
            cos, sin = hf_rope(torch.zeros(1, 40, head_dim), torch.from_numpy(positions)[None], kind_of_layer)
        y = np.asarray(ft.nn.apply_rotary(unit, positions[:, None], base=rotary, choice=jnp.int32(index[layer])))
        ours_cos, ours_sin = y[:, np.arange(half), np.arange(half)], y[:, np.arange(half), half + np.arange(half)]
        np.testing.assert_allclose(ours_cos, cos[0, :, :half].numpy(), rtol=0, atol=1e-5, err_msg=kind_of_layer)
        np.testing.assert_allclose(ours_sin, sin[0, :, :half].numpy(), rtol=0, atol=1e-5, err_msg=kind_of_layer)
    hf_rope_local = np.asarray(ft.nn.apply_rotary(unit, positions[:, None], base=rotary, choice=0))
    assert np.abs(hf_rope_local - y).max() > 0.1  # the two layer types' rotations differ


def test_one_rope_for_every_layer_is_the_attention_s_own():
    """Where both layer types' ropes are equal (or every layer one type), the attention holds
    that one RopeScaling and no member_rope (the rotation of every other family)."""
    same = config(rope_local_base_freq=1000.0, rope_scaling=None)
    assert _options.layer_type_ropes(same, 8, "") == (ft.nn.RopeScaling(base=1000.0), None)
    sliding = config(layer_types=["sliding_attention"] * 3)
    assert _options.layer_type_ropes(sliding, 8, "") == (ft.nn.RopeScaling(base=100.0), None)


def test_a_rope_choice_missing_or_unusable_is_refused_by_name():
    """A tuple ``base`` needs an integer ``choice``, RopeScalings of one ``partial``: each
    refused naming why, with the fix (no rope picked silently)."""
    x, at = jnp.ones((3, 8)), jnp.arange(3)
    ropes = (ft.nn.RopeScaling(base=100.0), ft.nn.RopeScaling("linear", factor=2.0))
    cases = {"none was given": {}, "is not an integer": {"choice": 0.5}}
    for why, extra in cases.items():
        with pytest.raises(ValueError, match=why) as info:
            ft.nn.apply_rotary(x, at, base=ropes, **extra)
        assert str(info.value).startswith(_rotary.ROPE_CHOICE.split("{")[0]) and "right:" in str(info.value)
    with pytest.raises(ValueError, match=r"partials \[1.0, 0.5\] differ"):
        ft.nn.apply_rotary(x, at, base=(ropes[0], ft.nn.RopeScaling(partial=0.5)), choice=0)
    attention = ft.nn.MultiheadAttention(8, 2, rotary=ropes, key=jax.random.key(0))
    with pytest.raises(ValueError, match="none was given"):
        attention(jnp.ones((3, 8)))
    picked = attention.replace(member_rope=jnp.int32(1))(jnp.ones((3, 8)))
    np.testing.assert_array_equal(picked, attention.replace(rotary=ropes[1])(jnp.ones((3, 8))))


def test_the_image_and_text_model_is_refused_naming_its_text_model_s_way():
    """Gemma 3's multimodal ``gemma3`` (Gemma3ForConditionalGeneration: a vision tower) is
    refused by name, from its HF object and its config.json dict; the fix the message gives
    builds the text model, whose logits for text equal the multimodal model's."""
    text = {**DECODER, "num_hidden_layers": 2, "head_dim": 8, "sliding_window": 3, "sliding_window_pattern": 2,
            "final_logit_softcapping": 3.0}
    vision = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 8, "patch_size": 4}
    multimodal = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                           image_token_index=39, boi_token_index=37, eoi_token_index=38)
    hf_model = transformers.Gemma3ForConditionalGeneration(multimodal).eval()
    for given in (hf_model, multimodal.to_dict()):
        with pytest.raises(ValueError) as info:
            ft.nn.from_hf(given)
        assert str(info.value).startswith(_load.GEMMA3_MULTIMODAL.split("{")[0]) and "right:" in str(info.value)
    text_weights = {k.replace("model.language_model.", "model.", 1): v
                    for k, v in hf_model.state_dict().items() if k.startswith("model.language_model.")}
    ours = ft.nn.from_hf({**hf_model.config.text_config.to_dict(), "final_logit_softcapping": None}, text_weights)
    ids, mask = batch(12)
    expected = hf_output(hf_model, np.minimum(ids, 36), mask)  # no image tokens
    actual = np.asarray(forward(ours, np.minimum(ids, 36), mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(actual[real], expected[real], rtol=0, atol=ATOL * float(np.abs(expected).max()))


def test_what_is_not_ported_is_refused_by_name():
    """Bidirectional attention (HF's sdpa then attends both ways, its window halved) and a
    layer type without its rope (HF builds no frequencies for it) are refused, naming the key."""
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True.*\n\n.*right:"):
        ft.nn.from_hf(config(use_bidirectional_attention=True), key=jax.random.key(0))
    broken = config()
    broken.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1000.0}}  # set after HF's checks
    with pytest.raises(ValueError) as info:
        ft.nn.from_hf(broken, key=jax.random.key(0))
    text = str(info.value)
    assert text.startswith(_options.NO_LAYER_ROPE.split("{")[0]) and "'sliding_attention'" in text and "right:" in text
