"""OLMoE (``ft.hf``'s ``OlmoeForCausalLM``) against transformers' own: tiny configs with random
weights (no download), 2 layers, hidden 32, 4 heads (2 KV heads), 4 experts of intermediate 24
(top-2 but where a case says), vocab 100, weights moved by N(0, 0.3) so that every tensor (each
expert's, the q/k norms over the whole projections) matters; ``clip_qkv`` and
``norm_topk_prob`` both ways.

test_hf_mixtral's checks (its helpers): float64 logits as HF computes (float32 router softmax,
rotary, RMSNorm: 1e-6 of their magnitude) and against HF widened (float64 rounding), the loss
with the load-balancing term and every gradient, float32 from every source (the Hub's
per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` too), HF's greedy tokens through the
KV cache, PEFT's LoRA both ways. transformers 5.25 has no OLMoE task heads.
"""

import os

import jax
import pytest

import functree as ft
from functree.hf import _mixtral, _olmoe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_hf_mixtral import (  # noqa: E402
    assert_float64_logits_are_hfs,
    assert_loads_from_every_source,
    assert_lora_both_ways,
    assert_loss_and_gradients_are_hfs,
    per_expert,
    widened_moe,
)

SIZES = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
         "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
AS_HF = 5e-6  # times max|HF|, float64 against HF's float32 router softmax, rotary and norms: measured 2.1e-7
WIDENED = 3e-14  # times max|HF|, against HF widened to float64: measured 1.3e-15 (gradients, test_hf_mixtral's
# tolerances: 1.5e-15 of the largest; with the aux loss 7.7e-9, HF's float32 sums)
CASES = {"kept": {},
         "top1_renormalized_clipped": {"num_experts_per_tok": 1, "norm_topk_prob": True, "clip_qkv": 0.5},
         "every_expert_tied_biased": {"num_experts_per_tok": 4, "tie_word_embeddings": True, "attention_bias": True,
                                      "num_key_value_heads": 4}}


def hf_model(seed=0, dtype=torch.float32, **changes):
    torch.manual_seed(seed)
    if dtype == torch.float64:  # HF's CPU default, grouped_mm, takes float32 and narrower only
        changes = {**changes, "experts_implementation": "eager"}
    hf = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**{**SIZES, **changes})).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


@pytest.mark.parametrize("case", CASES)
def test_float64_logits_are_hfs_with_and_without_a_mask(case):
    """Top-2 kept (OLMoE-1B-7B's norm_topk_prob false), top-1 renormalized with clip_qkv
    (clamped after the q/k norms, as HF), every expert with a tied head and biases."""
    changes = CASES[case]
    model = assert_float64_logits_are_hfs(hf_model(1, torch.float64, **changes), changes, AS_HF, WIDENED)
    attention = model.model.layers.layers.self_attn
    assert model.model.layers.layers.mlp.renormalize == changes.get("norm_topk_prob", False)
    assert attention.clip == changes.get("clip_qkv") and not attention.qk_norm_per_head
    assert attention.q_norm.scale.shape == (2, 32)  # over the whole projection (hidden_size)


@pytest.mark.parametrize("with_aux", [False, True])
def test_float64_loss_with_the_aux_loss_and_gradients_are_hfs(with_aux):
    """test_hf_mixtral's check: HF's loss (plus ``router_aux_loss_coef * aux_loss``),
    ``router_logits``, the one-pass loss and every gradient."""
    assert_loss_and_gradients_are_hfs(widened_moe(hf_model(2, torch.float64, router_aux_loss_coef=0.25)), with_aux)


def test_loads_from_every_source_exports_and_generates_as_hf(tmp_path):
    """float32 from the object, config + state dict, config.json's keys (``num_experts``),
    save_pretrained's directory, a hand-written per-expert directory (transformers reads it
    to the same model), the config with a per-expert state dict; the strict export, greedy
    generation, ``save_hf`` read back."""
    hf = hf_model(3, clip_qkv=2.0)
    assert_loads_from_every_source(hf, tmp_path, ("model_type", *SIZES, "clip_qkv"), _mixtral.OLMOE_EXPERTS)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_lora_on_the_attention_saved_is_read_by_peft_and_peft_s_is_read_back(tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    written = assert_lora_both_ways(hf_model, tmp_path, targets, targets)
    assert {name.rpartition(".")[2] for name in written} == set(targets) and len(written) == 8


def test_a_head_dim_hf_s_norms_do_not_fit_and_a_missing_expert_are_refused_naming_the_keys():
    """``head_dim`` other than hidden / heads: HF's q_norm (hidden_size) does not fit its
    projection (its forward fails: checked); refused naming head_dim (OLMOE_HEAD_DIM). An
    expert's ``down_proj`` missing in the per-expert layout: MISSING_EXPERT in OLMoE's names."""
    config = transformers.OlmoeConfig(**SIZES, head_dim=16)
    with pytest.raises(RuntimeError):
        transformers.OlmoeForCausalLM(config)(torch.zeros((1, 3), dtype=torch.long))
    with pytest.raises(ValueError, match="the olmoe config has head_dim=16") as error:
        ft.nn.from_hf(config, key=jax.random.key(0))
    assert str(error.value).startswith(_olmoe.OLMOE_HEAD_DIM.split("{")[0]) and '"head_dim": 8' in str(error.value)
    hf = hf_model(7)
    old = per_expert(hf.state_dict(), _mixtral.OLMOE_EXPERTS)
    missing = {k: v for k, v in old.items() if k != "model.layers.0.mlp.experts.3.down_proj.weight"}
    with pytest.raises(ValueError, match=r"OLMoE's per-expert tensors for layer 0 .* but not "
                                         r"'model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight'"):
        ft.nn.from_hf(hf.config, missing)
