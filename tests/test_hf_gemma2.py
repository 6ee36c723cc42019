"""Gemma 2 (``ft.hf``'s ``Gemma2ForCausalLM``, a subclass of Gemma's) against transformers'
own: built from tiny configs with random weights (no download), loaded from the HF object,
its config and state dict, its config.json as a dict and its ``save_pretrained`` directory;
sandwich norms, attention logits scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped
(``attn_logit_softcapping``), the final logits soft-capped (``final_logit_softcapping``),
sliding (window 3, shorter than the 12 tokens) and full layers alternating; greedy cached
tokens equal HF's ``generate`` (its sliding-window cache layers); a training step's
gradients equal torch's; PEFT's LoRA adapters load with PEFT's logits.

Logits at the real tokens of a left-padded batch within 1.1e-5 of their magnitude: over the
three seeds below the largest difference measured was 6.8e-7 of it, 1.1e-6 with caps 1.5 and
2.0 over three layers (spread times 10).
``save_hf`` -> ``from_pretrained``, HF's initialization and the float16 run with the other
families (``test_hf_load.py``'s and ``test_hf_save.py``'s ``FAMILIES``); drawn configs in
``test_hf_config_fuzz.py``, ``test_generation_cached_fuzz.py`` and ``test_hf_bf16_fuzz.py``."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _llama
from functree.nn import _attention_kernel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_load import DECODER, batch, forward, hf_model, hf_output  # noqa: E402

ATOL = 1.1e-5  # times max|HF|: measured 1.1e-6 (module docstring)


def config(**changes):
    """Layer 0 slides (window 3), layer 1 attends every key; the scalar 6 is not head_dim 8;
    the caps are near the logits' size (max|logits| about 1.8), so both bend them."""
    return transformers.Gemma2Config(**{**DECODER, "head_dim": 8, "sliding_window": 3, "query_pre_attn_scalar": 6,
                                        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0, **changes})


def assert_logits_equal(model, hf, length=12):
    ids, mask = batch(length)
    expected = hf_output(hf, ids, mask)
    actual = np.asarray(forward(model, ids, mask))
    real = mask.astype(bool)
    atol = ATOL * float(np.abs(expected).max())
    np.testing.assert_allclose(actual[real], expected[real], rtol=0, atol=atol)
    return actual[real], atol


def test_loads_from_every_source_with_hf_logits(tmp_path):
    """Three seeds from the HF object (one compiled forward), the last also from its config
    and state dict, its config.json dict (read with the family's defaults row) and its
    save_pretrained directory. Each of the soft-caps, the query scalar and the windows moves
    the logits by more than 100 times the tolerance (none of them is idle here)."""
    for seed in range(3):
        torch.manual_seed(seed)
        hf = hf_model(config())
        assert_logits_equal(ft.nn.from_hf(hf), hf)
    hf.save_pretrained(tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    for given in ((hf.config, hf.state_dict()), (config_json, hf.state_dict()), (tmp_path,)):
        model = ft.nn.from_hf(*given)
        assert type(model).__name__ == "Gemma2ForCausalLM"
        ours, atol = assert_logits_equal(model, hf)
    attention = model.model.layers.layers.self_attn
    assert attention.member_window.tolist() == [3, 0] and attention.logit_softcap == 1.5
    np.testing.assert_allclose(attention.logit_scale, [6 ** -0.5] * 2, rtol=0, atol=1e-7)
    with jax.enable_x64(True):  # a float64 port's factor is HF's Python float, not rounded to float32
        wide = ft.nn.from_hf(hf.double(), dtype=jnp.float64).model.layers.layers.self_attn.logit_scale
        assert wide.dtype == jnp.float64 and wide.tolist() == [6 ** -0.5] * 2, wide
    hf.float()
    assert model.final_logit_softcapping == 3.0 and model.lm_head is None  # tied, as Gemma's
    real = batch(12)[1].astype(bool)
    layers = model.model.layers
    idle = {"attention cap": model.replace(model=model.model.replace(layers=layers.replace(
                layers=layers.layers.replace(self_attn=attention.replace(logit_softcap=None))))),
            "final cap": model.replace(final_logit_softcapping=None),
            "scalar": model.replace(model=model.model.replace(layers=layers.replace(
                layers=layers.layers.replace(self_attn=attention.replace(logit_scale=None))))),
            "window": model.replace(model=model.model.replace(layers=layers.replace(
                layers=layers.layers.replace(self_attn=attention.replace(member_window=jnp.zeros(2, jnp.int32))))))}
    for name, other in idle.items():
        moved = np.abs(np.asarray(forward(other, *batch(12)))[real] - ours).max()
        assert moved > 100 * atol, (name, moved, atol)


def test_generates_hf_s_greedy_tokens_past_the_window():
    """Prompts of 12 and 9 real tokens (left-padded) and 6 new tokens, the cache attending
    the last 3 slots on the sliding layer: HF's greedy ``generate`` (its sliding-window cache)."""
    hf = hf_model(config())
    model = ft.nn.from_hf(hf)
    ids, mask = batch(12)
    ours = np.asarray(ft.nn.generate(model, ids, 6, attention_mask=mask, eos_token_id=None, pad_token_id=0))
    with torch.no_grad():
        theirs = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                             max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_a_training_step_s_gradients_equal_torch_s():
    """The gradient of the mean next-token cross-entropy of a left-padded batch (predictions
    at real tokens), tensor by tensor against torch's ``.grad``, the four norms of each block
    included (finite, nonzero), within 1.1e-5 of each tensor's largest gradient (measured:
    1.1e-6, times 10)."""
    hf = hf_model(config())
    model = ft.nn.from_hf(hf)
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
    assert set(theirs) <= set(grads) and any(".pre_feedforward_layernorm." in n for n in theirs)
    for name, expected in theirs.items():
        assert np.isfinite(grads[name]).all() and np.abs(expected).max() > 0, name
        np.testing.assert_allclose(grads[name], expected, rtol=0, atol=1.1e-5 * float(np.abs(expected).max()),
                                   err_msg=name)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_lora_adapters_load_with_peft_s_logits(tmp_path):
    """PEFT's adapters on q_proj, v_proj and the MLP's three projections, saved by PEFT,
    loaded by ``ft.nn.load_lora``: PEFT's logits (the adapter matters: the base's differ)."""
    base = hf_model(config())
    ours_base = ft.nn.from_hf(base)
    torch.manual_seed(2)
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=2, lora_alpha=4,
                                                           target_modules=targets)).eval()
    peft_model.save_pretrained(str(tmp_path))
    ids, mask = batch(12)
    expected = hf_output(peft_model, ids, mask)
    model = ft.nn.load_lora(ours_base, tmp_path)
    real = mask.astype(bool)
    atol = ATOL * float(np.abs(expected).max())
    assert np.abs(np.asarray(forward(ours_base, ids, mask))[real] - expected[real]).max() > 100 * atol
    np.testing.assert_allclose(np.asarray(forward(model, ids, mask))[real], expected[real], rtol=0, atol=atol)


@pytest.mark.parametrize("option, value, message", [
    ("attn_logit_softcapping", 0.0, _llama.SOFTCAP), ("final_logit_softcapping", -30.0, _llama.SOFTCAP),
    ("query_pre_attn_scalar", -4, _llama.QUERY_SCALAR), ("query_pre_attn_scalar", 0, _llama.QUERY_SCALAR)])
def test_a_cap_or_scalar_no_model_computes_is_refused_by_name(option, value, message):
    """A cap of 0 (0/0: NaN), a negative cap, a scalar of 0 or below: refused, the key named
    with its value and the fix (none built: HF's model computes NaN or sign-flipped logits)."""
    values = {"model_type": "gemma2", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, option: value}
    with pytest.raises(ValueError) as info:
        ft.nn.from_hf(values, key=jax.random.key(0))
    text = str(info.value)
    assert text.startswith(message.split("{")[0]) and f"{option}={value!r}" in text and "right:" in text


def test_a_capped_attention_never_runs_a_kernel_without_its_cap():
    """``implementation="cudnn"`` with a soft-cap is refused, the cap named (no kernel has it);
    ``"auto"`` computes the cap: the explicit softmax of capped logits, by hand."""
    k = jax.random.key(0)
    attn = ft.nn.MultiheadAttention(8, 2, causal=True, key=k).replace(logit_softcap=0.5)
    x = 3.0 * jax.random.normal(k, (5, 8))
    with pytest.raises(ValueError, match=r"cuDNN's flash attention does not apply here: a logit soft-cap"):
        attn.replace(implementation="cudnn")(x)
    assert _attention_kernel.CUDNN_DOES_NOT_APPLY.split(":")[0] == "MultiheadAttention"
    q, kk, v = (p(x).reshape(5, 2, 4) for p in (attn.query_projection, attn.key_projection, attn.value_projection))
    logits = 0.5 * jnp.tanh(jnp.einsum("qhd,khd->hqk", q, kk) / 2.0 / 0.5)
    logits = jnp.where(jnp.tril(jnp.ones((5, 5), bool)), logits, -jnp.inf)
    by_hand = attn.output_projection(jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits), v).reshape(5, 8))
    np.testing.assert_allclose(attn(x), by_hand, rtol=0, atol=1e-6 * float(np.abs(by_hand).max()))
    assert np.abs(np.asarray(attn(x) - attn.replace(logit_softcap=None)(x))).max() > 1e-2
