"""Qwen2-MoE (``ft.hf``'s ``Qwen2MoeForCausalLM``) against transformers' own: tiny configs with
random weights (no download), 2 layers, hidden 32, 4 heads (2 KV heads), 4 experts of
moe_intermediate_size 24 (top-2 but where a case says) and a shared expert of 40, vocab 100,
weights moved by N(0, 0.3) so that every tensor (each expert's, the shared expert's and its
gate, the q/k/v biases) matters; ``norm_topk_prob`` and ``qkv_bias`` both ways, Qwen2-MoE's
own sliding-window layers (the even ones below ``max_window_layers``).

test_hf_mixtral's checks (its helpers): float64 logits as HF computes (float32 router softmax,
rotary, RMSNorm: 1e-6 of their magnitude) and against HF widened (float64 rounding), the loss
with the load-balancing term and every gradient (the shared expert's too), float32 from every
source (the Hub's per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` too), HF's greedy
tokens through the KV cache, the task heads, PEFT's LoRA both ways: 2.5e-5 of the magnitude.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _mixtral, _qwen2_moe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_mixtral import (  # noqa: E402
    assert_float64_logits_are_hfs,
    assert_loads_from_every_source,
    assert_lora_both_ways,
    assert_loss_and_gradients_are_hfs,
    assert_task_head_is_hfs,
    per_expert,
    widened_moe,
)
from test_hf_phi import batch  # noqa: E402  (its VOCAB and T: 100, 12)
from test_hf_qwen3_moe import assert_a_dense_layer_is_refused  # noqa: E402

SIZES = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "max_position_embeddings": 32,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
AS_HF = 5e-6  # times max|HF|, float64 against HF's float32 router softmax, rotary and norms: measured 4.2e-7 (this
# seed; 2.0e-6 at most over 5 seeds x 3 cases)
WIDENED = 3e-14  # times max|HF|, against HF widened to float64: measured 3.2e-15 (3 seeds x 3 cases; gradients,
# test_hf_mixtral's tolerances: 5.4e-15 of the largest; with the aux loss 4.8e-9 (loss), HF's float32 sums)
CASES = {"kept": {},
         "top1_renormalized_window": {"num_experts_per_tok": 1, "norm_topk_prob": True, "use_sliding_window": True,
                                      "sliding_window": 5},
         "every_expert_tied_unbiased": {"num_experts_per_tok": 4, "tie_word_embeddings": True, "qkv_bias": False,
                                        "num_key_value_heads": 4}}


def hf_model(seed=0, dtype=torch.float32, cls="Qwen2MoeForCausalLM", **changes):
    torch.manual_seed(seed)
    if dtype == torch.float64:  # HF's CPU default, grouped_mm, takes float32 and narrower only
        changes = {**changes, "experts_implementation": "eager"}
    hf = getattr(transformers, cls)(transformers.Qwen2MoeConfig(**{**SIZES, **changes})).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


@pytest.mark.parametrize("case", CASES)
def test_float64_logits_are_hfs_with_and_without_a_mask(case):
    """Top-2 kept (Qwen1.5-MoE's norm_topk_prob false), top-1 renormalized with HF's window on
    layer 0 only (Qwen2MoeConfig's layer_types: even layers below max_window_layers), every
    expert with a tied head and no q/k/v biases; the shared expert in each."""
    changes = CASES[case]
    hf = hf_model(1, torch.float64, **changes)
    window = changes.get("sliding_window")
    model = assert_float64_logits_are_hfs(hf, {k: v for k, v in changes.items() if k != "sliding_window"}, AS_HF,
                                          WIDENED)
    moe, attention = model.model.layers.layers.mlp, model.model.layers.layers.self_attn
    assert isinstance(moe, _qwen2_moe.SharedExpertMoE) and moe.renormalize == changes.get("norm_topk_prob", False)
    assert moe.shared_expert.gate_proj.weight.shape == (2, 32, 40) and moe.experts.down_proj.shape == (2, 4, 24, 32)
    assert (attention.query_projection.bias is not None) == changes.get("qkv_bias", True)
    assert attention.output_projection.bias is None
    if window is not None:  # layer 0 slides, layer 1 attends to every token before it
        assert hf.config.layer_types == ["sliding_attention", "full_attention"]
        np.testing.assert_array_equal(np.asarray(attention.member_window), [window, 0])


@pytest.mark.parametrize("with_aux", [False, True])
def test_float64_loss_with_the_aux_loss_and_gradients_are_hfs(with_aux):
    """test_hf_mixtral's check: HF's loss (plus ``router_aux_loss_coef * aux_loss``),
    ``router_logits`` (the routed experts' router; the shared expert has none), the one-pass
    loss and every gradient, the shared expert's and its gate's among them."""
    assert_loss_and_gradients_are_hfs(widened_moe(hf_model(2, torch.float64, router_aux_loss_coef=0.25)), with_aux)


def test_loads_from_every_source_exports_and_generates_as_hf(tmp_path):
    """float32 from the object, config + state dict, config.json's keys (the DEFAULTS row:
    layer_types from use_sliding_window by Qwen2-MoE's rule), save_pretrained's directory, a
    hand-written per-expert directory (transformers reads it to the same model), the config
    with a per-expert state dict; the strict export, greedy generation, ``save_hf`` read back."""
    hf = hf_model(3, use_sliding_window=True, sliding_window=6, num_hidden_layers=3)
    assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    keys = ("model_type", *SIZES, "use_sliding_window", "sliding_window")  # (layer_types left out: derived)
    assert_loads_from_every_source(hf, tmp_path, keys, _qwen2_moe.QWEN2_MOE_EXPERTS)
    written = {k: v for k, v in json.loads((tmp_path / "hf" / "config.json").read_text()).items() if k in keys}
    model = ft.nn.from_hf(written, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(model.model.layers.layers.self_attn.member_window), [6, 0, 6])
    off = ft.nn.from_hf({**written, "use_sliding_window": False}, key=jax.random.key(0))  # HF's window 0: none
    assert off.model.layers.layers.self_attn.window is None and off.hf_config["sliding_window"] == 0


def test_router_logits_are_the_routed_experts_and_a_cache_is_refused():
    """``router_logits=True``: one router logits stack ``[layers, batch * T, experts]``, the
    SharedExpertMoE's own SparseMoE record (``sparse_moe()`` is the block: its top_k is the
    loss's; the loss test compares them with HF's); a cache is refused (ROUTER_LOGITS_CACHED)."""
    model = ft.nn.from_hf(transformers.Qwen2MoeConfig(**SIZES), key=jax.random.key(0))
    ids, mask = batch()
    _, routed = model(ids, mask, router_logits=True)
    assert routed.shape == (2, ids.size, 4) and model.sparse_moe() is model.model.layers.layers.mlp
    with pytest.raises(ValueError, match=r"router_logits=True\) was given a cache"):
        model(ids, mask, cache=model.init_cache(ids.shape[0], 16), router_logits=True)


def test_shared_expert_block_is_hfs_alone():
    """Layer 0's block by itself in float64: HF's Qwen2MoeSparseMoeBlock (eager experts) on
    random rows equals the port's SharedExpertMoE (HF's float32 router softmax: AS_HF);
    ``return_logits`` gives the router's logits (to float64 rounding)."""
    hf = hf_model(4, torch.float64)
    block = hf.model.layers[0].mlp
    x = np.random.default_rng(0).normal(size=(2, 5, 32))
    with torch.no_grad():
        expected = block(torch.from_numpy(x)).numpy()
        router = torch.nn.functional.linear(torch.from_numpy(x).reshape(-1, 32), block.gate.weight).numpy()
    with jax.enable_x64(True):
        moe = jax.tree.map(lambda a: a[0], ft.nn.from_hf(hf, dtype=jnp.float64).model.layers.layers.mlp)
        y, logits = moe(jnp.asarray(x), return_logits=True)
        np.testing.assert_array_equal(np.asarray(moe(jnp.asarray(x))), np.asarray(y))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=0, atol=AS_HF * np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(logits), router, rtol=0, atol=WIDENED * np.abs(router).max())


@pytest.mark.parametrize("cls", ["Qwen2MoeForSequenceClassification", "Qwen2MoeForTokenClassification",
                                 "Qwen2MoeForQuestionAnswering"])
def test_task_heads_are_hfs(cls):
    """HEADS' row (transformers 5.25 has all three; the QA body is named ``model``)."""
    assert_task_head_is_hfs(hf_model(5, cls=cls, num_labels=3), cls)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_lora_on_the_attention_saved_is_read_by_peft_and_peft_s_is_read_back(tmp_path):
    """``ft.nn.lora`` on q/k/v/o (biased q/k/v) with nonzero B, ``save_lora``, PEFT's logits;
    PEFT's own adapter on them read by ``load_lora``: PEFT's logits again."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    written = assert_lora_both_ways(hf_model, tmp_path, targets, targets)
    assert {name.rpartition(".")[2] for name in written} == set(targets) and len(written) == 8


@pytest.mark.parametrize(("changes", "key", "dense", "fix"), [
    ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]", "[1]", '"mlp_only_layers": []'),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2", "[0]", '"decoder_sparse_step": 1'),
    ({"num_experts": 0, "num_experts_per_tok": 0}, "num_experts=0", "[0, 1]", '"num_experts": 60'),
])
def test_a_dense_layer_is_refused_naming_the_key(changes, key, dense, fix):
    """HF's Qwen2MoeDecoderLayer makes these layers a dense Qwen2MoeMLP (checked on HF's
    model); refused naming the key (Qwen3-MoE's DENSE_LAYERS in Qwen2-MoE's words; test_hf_qwen3_moe's check)."""
    config = transformers.Qwen2MoeConfig(**{**SIZES, **changes})
    assert_a_dense_layer_is_refused("Qwen2MoeForCausalLM", config, key, dense, fix)
    with pytest.raises(ValueError, match=re.escape("(Qwen1.5-MoE-A2.7B's)")):
        ft.nn.from_hf(config, key=jax.random.key(0))


def test_experts_per_token_a_missing_expert_and_a_window_hf_s_config_drops_are_refused_naming_the_keys():
    """``num_experts_per_tok`` above ``num_experts`` (HF's torch.topk fails): EXPERTS_PER_TOKEN
    naming ``num_experts``; an expert's ``gate_proj`` missing in the per-expert layout:
    MISSING_EXPERT in Qwen2-MoE's names; a sliding layer where ``use_sliding_window`` is false
    (HF's config then sets the window 0): SLIDING_WITHOUT_WINDOW; a window of 0 where
    ``use_sliding_window`` (HF's mask fails: checked): SLIDING_WINDOW_NOT_POSITIVE."""
    config = transformers.Qwen2MoeConfig(**{**SIZES, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="the qwen2_moe config has num_experts_per_tok=5 and num_experts=4") as error:
        ft.nn.from_hf(config, key=jax.random.key(0))
    assert '"num_experts_per_tok": 2, "num_experts": 4' in str(error.value)
    hf = hf_model(7)
    old = per_expert(hf.state_dict(), _qwen2_moe.QWEN2_MOE_EXPERTS)
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in old
    missing = {k: v for k, v in old.items() if k != "model.layers.1.mlp.experts.0.gate_proj.weight"}
    with pytest.raises(ValueError, match=r"Qwen2-MoE's per-expert tensors for layer 1 .* but not "
                                         r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight'"):
        ft.nn.from_hf(hf.config, missing)
    dropped = transformers.Qwen2MoeConfig(**SIZES, layer_types=["sliding_attention", "full_attention"])
    assert dropped.sliding_window == 0
    with pytest.raises(ValueError, match="sliding_attention"):
        ft.nn.from_hf(dropped, key=jax.random.key(0))
    zero = transformers.Qwen2MoeConfig(**SIZES, use_sliding_window=True, sliding_window=0)
    with pytest.raises(RuntimeError, match="must match"):  # HF's sliding mask
        transformers.Qwen2MoeForCausalLM(zero)(torch.zeros((1, 3), dtype=torch.long))
    for config in (zero, {"model_type": "qwen2_moe", **SIZES, "use_sliding_window": True, "sliding_window": 0}):
        with pytest.raises(ValueError, match=r'sliding_window=0 and layer 0 \("sliding_attention" in layer_types\) slides'):
            ft.nn.from_hf(config, key=jax.random.key(0))
    assert _mixtral.QWEN_EXPERTS.module == _qwen2_moe.QWEN2_MOE_EXPERTS.module == "mlp"
