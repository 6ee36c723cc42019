"""Qwen3-MoE (``ft.hf``'s ``Qwen3MoeForCausalLM``) against transformers' own: tiny configs
with random weights (no download), 2 layers, hidden 32, 4 heads of head_dim 16 (2 KV heads),
4 experts of moe_intermediate_size 24 (top-2 but where a case says), vocab 100, weights moved
by N(0, 0.3) so that every tensor (each expert's, the q/k norms') matters; ``norm_topk_prob``
both ways.

As test_hf_mixtral (whose helpers these tests call): in float64 HF's router softmax, rotary
and RMSNorm run in float32 (as HF computes: 1e-6 of the logits' magnitude); with those widened
to float64 in HF's model the port is HF's to float64 rounding: the logits, the loss with the
load-balancing term and every gradient. float32 from every source (the Hub's per-expert
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` too), HF's greedy tokens through the KV
cache, task heads and PEFT's LoRA both ways: 2.5e-5 of the magnitude.
"""

import json
import os
import re

import jax
import pytest

import functree as ft
from functree.hf import _mixtral, _qwen3_moe

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
from test_hf_phi import assert_logits  # noqa: E402  (its VOCAB and T: 100, 12)

VOCAB, T = 100, 12
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True,
         "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
AS_HF = 5e-6  # times max|HF|, float64 against HF's float32 router softmax, rotary and norms: measured 3.2e-7
WIDENED = 3e-14  # times max|HF|, against HF widened to float64: measured 1.6e-15 (gradients, test_hf_mixtral's
# tolerances: 2.3e-15 of the largest; with the aux loss 1.0e-8, HF's float32 sums)
FLOAT32 = 2.5e-5  # times max|HF| (test_hf_load.py's)
CASES = {"renormalized": {},
         "top1_kept_window": {"num_experts_per_tok": 1, "norm_topk_prob": False, "use_sliding_window": True,
                              "sliding_window": 5},
         "every_expert_tied_biased": {"num_experts_per_tok": 4, "norm_topk_prob": False, "tie_word_embeddings": True,
                                      "attention_bias": True}}


def hf_model(seed=0, dtype=torch.float32, cls="Qwen3MoeForCausalLM", **changes):
    torch.manual_seed(seed)
    if dtype == torch.float64:  # HF's CPU default, grouped_mm, takes float32 and narrower only
        changes = {**changes, "experts_implementation": "eager"}
    hf = getattr(transformers, cls)(transformers.Qwen3MoeConfig(**{**SIZES, **changes})).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


@pytest.mark.parametrize("case", CASES)
def test_float64_logits_are_hfs_with_and_without_a_mask(case):
    """As HF computes and against HF widened: top-2 renormalized, top-1 kept (norm_topk_prob
    false) with every layer's sliding window, every expert with a tied head and biases."""
    changes = CASES[case]
    model = assert_float64_logits_are_hfs(hf_model(1, torch.float64, **changes), changes, AS_HF, WIDENED)
    moe = model.model.layers.layers.mlp
    assert moe.renormalize == changes.get("norm_topk_prob", True) and moe.experts.down_proj.shape == (2, 4, 24, 32)


@pytest.mark.parametrize("with_aux", [False, True])
def test_float64_loss_with_the_aux_loss_and_gradients_are_hfs(with_aux):
    """test_hf_mixtral's check: HF's loss (plus ``router_aux_loss_coef * aux_loss`` with
    ``output_router_logits``), ``router_logits``, the one-pass loss and every gradient
    (norm_topk_prob false: the kept top-k probabilities)."""
    hf = hf_model(2, torch.float64, router_aux_loss_coef=0.25, norm_topk_prob=False)
    assert_loss_and_gradients_are_hfs(widened_moe(hf), with_aux)


def test_loads_from_every_source_exports_and_generates_as_hf(tmp_path):
    """float32 from the object, config + state dict, config.json's keys (``num_experts``:
    HF's attribute_map stores it as ``num_local_experts``), save_pretrained's directory, a
    directory in the Hub's per-expert layout written by hand (transformers reads it to the same
    model), the config with a per-expert state dict; the strict export, greedy generation,
    ``save_hf`` read back."""
    hf = hf_model(3, use_sliding_window=True, sliding_window=6)
    keys = ("model_type", *SIZES, "num_local_experts", "use_sliding_window", "sliding_window")  # (HF writes that)
    assert_loads_from_every_source(hf, tmp_path, keys, _mixtral.QWEN_EXPERTS)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in per_expert(hf.state_dict(), _mixtral.QWEN_EXPERTS)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    given = {**{k: v for k, v in written.items() if k in keys}, "num_experts": 4}
    given.pop("num_local_experts", None)
    model = ft.nn.from_hf(given, hf.state_dict())  # the Hub's key
    assert model.model.layers.layers.mlp.experts.gate_up_proj.shape[1] == 4
    assert_logits(model, hf, FLOAT32)


@pytest.mark.parametrize("cls", ["Qwen3MoeForSequenceClassification", "Qwen3MoeForTokenClassification",
                                 "Qwen3MoeForQuestionAnswering"])
def test_task_heads_are_hfs(cls):
    """HEADS' row (transformers 5.25 has all three; the QA body is named ``transformer``)."""
    assert_task_head_is_hfs(hf_model(4, cls=cls, num_labels=3), cls)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_lora_on_the_attention_saved_is_read_by_peft_and_peft_s_is_read_back(tmp_path):
    """``ft.nn.lora`` on q/k/v/o with nonzero B, ``save_lora``, PEFT's logits; PEFT's own
    adapter on them read by ``load_lora``: PEFT's logits again."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    written = assert_lora_both_ways(hf_model, tmp_path, targets, targets)
    assert {name.rpartition(".")[2] for name in written} == set(targets) and len(written) == 8


@pytest.mark.parametrize(("changes", "key", "dense", "fix"), [
    ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]", "[1]", '"mlp_only_layers": []'),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2", "[0]", '"decoder_sparse_step": 1'),
    ({"num_experts": 0, "num_experts_per_tok": 0}, "num_experts=0", "[0, 1]", '"num_experts": 128'),
])
def test_a_dense_layer_is_refused_naming_the_key(changes, key, dense, fix):
    """HF's Qwen3MoeDecoderLayer makes these layers a dense Qwen3MoeMLP (checked on HF's
    model); the port's one stack of sparse blocks refuses naming the key (DENSE_LAYERS).
    A mlp_only_layers entry past the layers leaves every layer sparse: built."""
    assert_a_dense_layer_is_refused("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig(**{**SIZES, **changes}), key,
                                    dense, fix)
    past = transformers.Qwen3MoeConfig(**{**SIZES, "mlp_only_layers": [2]})
    assert isinstance(ft.nn.from_hf(past, key=jax.random.key(0)).model.layers.layers.mlp, ft.nn.SparseMoE)


def assert_a_dense_layer_is_refused(lm_class, config, key, dense, fix):
    """HF's ``lm_class`` of ``config`` makes layers ``dense`` (JSON) its dense MLP (checked);
    ``from_hf`` refuses naming ``key``, the family's dense MLP class and ``fix`` (DENSE_LAYERS;
    Qwen2-MoE's test calls it too)."""
    mlp = lm_class.replace("ForCausalLM", "MLP")
    layers = getattr(transformers, lm_class)(config).model.layers
    assert [i for i, layer in enumerate(layers) if type(layer.mlp).__name__ == mlp] == json.loads(dense)
    with pytest.raises(ValueError, match=re.escape(f"the {config.model_type} config has {key}, which makes "
                                                   f"layer(s) {dense} of 2")) as error:
        ft.nn.from_hf(config, key=jax.random.key(0))
    message = str(error.value)
    assert message.startswith(_qwen3_moe.DENSE_LAYERS.split("{")[0]) and f"right:  {fix}" in message
    assert f"(Hugging Face's {mlp}: a layer is sparse" in message


def test_experts_per_token_past_the_experts_and_a_missing_expert_are_refused_naming_the_keys():
    """``num_experts_per_tok`` above ``num_experts`` (HF's torch.topk fails): EXPERTS_PER_TOKEN
    naming the Hub's key ``num_experts``; an expert's ``up_proj`` missing in the per-expert
    layout: MISSING_EXPERT naming it with Qwen3-MoE's names."""
    config = transformers.Qwen3MoeConfig(**{**SIZES, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="the qwen3_moe config has num_experts_per_tok=5 and num_experts=4") as error:
        ft.nn.from_hf(config, key=jax.random.key(0))
    assert '"num_experts_per_tok": 2, "num_experts": 4' in str(error.value)
    hf = hf_model(7)
    old = per_expert(hf.state_dict(), _mixtral.QWEN_EXPERTS)
    missing = {k: v for k, v in old.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
    with pytest.raises(ValueError, match=r"Qwen3-MoE's per-expert tensors for layer 1 \(mlp\.experts\.\{e\}\."
                                         r"gate_proj/up_proj/down_proj\.weight\) but not "
                                         r"'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'"):
        ft.nn.from_hf(hf.config, missing)
