"""Qwen3 and OLMo2 (``ft.hf``'s ``Qwen3ForCausalLM`` and ``Olmo2ForCausalLM``, subclasses of
Llama's) against transformers' own: built from tiny configs with random weights (no
download), loaded from the HF object, its config and state dict, its config.json as a dict
and its ``save_pretrained`` directory; their q/k norms (``self_attn.q_norm`` / ``k_norm``:
per head for Qwen3, over the whole projection for OLMo2) export under HF's names; a training
step's gradients equal torch's; PEFT's LoRA adapters load with PEFT's logits.

Logits at the real tokens of a left-padded batch within 8e-6 of their magnitude: over the
three seeds of each family below the largest difference measured was 7.7e-7 of it (spread
times 10). Greedy cached tokens, the strict export, ``save_hf`` -> ``from_pretrained``, HF's
initialization and float16 run with the other families (``test_hf_load.py``'s and
``test_hf_save.py``'s ``FAMILIES``); drawn configs in ``test_hf_config_fuzz.py``,
``test_generation_cached_fuzz.py`` and ``test_hf_bf16_fuzz.py``."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_load import DECODER, batch, forward, hf_model, hf_output  # noqa: E402

ATOL = 8e-6  # times max|HF|: measured 7.7e-7 (module docstring)
CONFIGS = {
    # head_dim 8, not hidden / heads = 4: the norms' size is the head's
    "qwen3": lambda **c: transformers.Qwen3Config(**{**DECODER, "head_dim": 8, **c}),
    "olmo2": lambda **c: transformers.Olmo2Config(**{**DECODER, "attention_bias": True, **c}),
}


def assert_logits_equal(model, hf, length=12):
    ids, mask = batch(length)
    expected = hf_output(hf, ids, mask)
    actual = np.asarray(forward(model, ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(actual[real], expected[real], rtol=0, atol=ATOL * float(np.abs(expected).max()))


@pytest.mark.parametrize("family", CONFIGS)
def test_loads_from_every_source_with_hf_logits(family, tmp_path):
    """Three seeds from the HF object (one compiled forward: the same shapes); the last one
    also from its config and state dict, its config.json dict (read with the family's
    defaults row) and its save_pretrained directory. The norms sit where HF's do: Qwen3's
    over each head (size head_dim), OLMo2's over the whole q and k projections."""
    for seed in range(3):
        torch.manual_seed(seed)
        hf = hf_model(CONFIGS[family]())
        assert_logits_equal(ft.nn.from_hf(hf), hf)
    hf.save_pretrained(tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    for given in ((hf.config, hf.state_dict()), (config_json, hf.state_dict()), (tmp_path,)):
        model = ft.nn.from_hf(*given)
        assert type(model).__name__ == type(hf).__name__
        assert_logits_equal(model, hf)
    attention = model.model.layers.layers.self_attn  # the Stack's stacked member: [layers, ...]
    sizes = {"qwen3": (8, 8), "olmo2": (4 * 4, 2 * 4)}[family]
    assert (attention.q_norm.scale.shape[1:], attention.k_norm.scale.shape[1:]) == tuple((s,) for s in sizes)
    assert attention.qk_norm_per_head == (family == "qwen3")
    if family == "olmo2":  # no input norm: the norms follow the sublayers
        assert not hasattr(model.model.layers.layers, "input_layernorm")


def test_qwen3_attention_bias_biases_every_projection_and_sliding_needs_its_switch():
    """Qwen3's ``attention_bias`` biases o_proj too (Qwen2's never); its ``sliding_window``
    applies only with ``use_sliding_window`` (HF's config drops it otherwise), and then on
    the layers from ``max_window_layers`` on (one window per member)."""
    hf = hf_model(CONFIGS["qwen3"](attention_bias=True, sliding_window=3))
    model = ft.nn.from_hf(hf)
    attention = model.model.layers.layers.self_attn
    assert attention.output_projection.bias is not None
    assert attention.window is None and attention.member_window is None  # use_sliding_window false: full
    assert_logits_equal(model, hf)
    hf = hf_model(CONFIGS["qwen3"](use_sliding_window=True, sliding_window=3, max_window_layers=1))
    model = ft.nn.from_hf(hf)
    assert model.model.layers.layers.self_attn.member_window.tolist() == [0, 3]
    assert_logits_equal(model, hf)


@pytest.mark.parametrize("family", CONFIGS)
def test_a_training_step_s_gradients_equal_torch_s(family):
    """The gradient of the mean next-token cross-entropy of a left-padded batch (the
    predictions made at real tokens: a padding position's output is no model's), tensor by
    tensor against torch's ``.grad`` (the q/k norms' included, nonzero), within 3e-5 of each
    tensor's largest gradient (measured: 2.6e-6, times 10)."""
    hf = hf_model(CONFIGS[family]())
    model = ft.nn.from_hf(hf)
    ids, mask = batch(12)
    labels = np.where((mask[:, 1:] == 1) & (mask[:, :-1] == 1), ids[:, 1:], -100)  # predicted from real tokens

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
    assert set(theirs) <= set(grads) and any(".q_norm." in n for n in theirs) and any(".k_norm." in n for n in theirs)
    for name, expected in theirs.items():
        assert np.isfinite(grads[name]).all() and np.abs(expected).max() > 0, name
        np.testing.assert_allclose(grads[name], expected, rtol=0, atol=3e-5 * float(np.abs(expected).max()),
                                   err_msg=name)


@pytest.mark.parametrize("per_head", [True, False])
def test_the_qk_norm_attention_s_derivatives_are_its_finite_differences(per_head):
    """``jax.test_util.check_grads`` in float64 (reverse mode, first order: training's) of a
    2-head, 1-key-head attention with rotary and q/k RMSNorms (scales off one), through the
    query, the norms' scales and a projection."""
    with jax.enable_x64(True):
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        attn = ft.nn.MultiheadAttention(8, 2, num_kv_heads=1, rotary=True, causal=True, key=k1, dtype=jnp.float64)
        q_size, k_size = (4, 4) if per_head else (8, 4)
        scale = lambda k, n: 1.0 + 0.3 * jax.random.normal(k, (n,), jnp.float64)  # noqa: E731
        attn = attn.replace(q_norm=ft.nn.RMSNorm(q_size, dtype=jnp.float64).replace(scale=scale(k2, q_size)),
                            k_norm=ft.nn.RMSNorm(k_size, dtype=jnp.float64).replace(scale=scale(k3, k_size)),
                            qk_norm_per_head=per_head)
        x = jax.random.normal(k1, (3, 8), jnp.float64)

        def f(x, q_scale, k_scale, w):
            a = attn.replace(q_norm=attn.q_norm.replace(scale=q_scale), k_norm=attn.k_norm.replace(scale=k_scale),
                             key_projection=attn.key_projection.replace(weight=w))
            return a(x)

        check_grads(jax.jit(f), (x, attn.q_norm.scale, attn.k_norm.scale, attn.key_projection.weight), order=1,
                    modes=("rev",))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
@pytest.mark.parametrize("family", CONFIGS)
def test_lora_adapters_load_with_peft_s_logits(family, tmp_path):
    """PEFT's adapters on q_proj, v_proj and the MLP's three projections, saved by PEFT,
    loaded by ``ft.nn.load_lora``: PEFT's logits (the adapter matters: the base's differ)."""
    base = hf_model(CONFIGS[family]())
    ours_base = ft.nn.from_hf(base)  # before PEFT puts its layers into it
    torch.manual_seed(2)
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=2, lora_alpha=4,
                                                           target_modules=targets)).eval()
    peft_model.save_pretrained(str(tmp_path))
    ids, mask = batch(12)
    with torch.no_grad():
        expected = peft_model(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                              position_ids=torch.from_numpy(np.maximum(np.cumsum(mask, 1) - 1, 0)).long()).logits
    expected = expected.numpy()
    model = ft.nn.load_lora(ours_base, tmp_path)
    real = mask.astype(bool)
    atol = ATOL * float(np.abs(expected).max())
    assert np.abs(np.asarray(forward(ours_base, ids, mask))[real] - expected[real]).max() > 100 * atol
    np.testing.assert_allclose(np.asarray(forward(model, ids, mask))[real], expected[real], rtol=0, atol=atol)
