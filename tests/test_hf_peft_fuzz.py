"""PEFT adapters over LoraConfig's option space, read by ft.nn.load_lora: PEFT's logits or a refusal.

Each example draws a tiny Hugging Face model with random weights (Llama with an untied or
tied head, GPT-2 with its Conv1D layers and fused ``c_attn``, GPT-NeoX with its per-head
interleaved ``query_key_value``, Phi, DistilBERT's masked LM with its ``q_lin`` ... ``lin2``
and a tied or untied ``vocab_projector``), saved with ``save_pretrained``,
and a ``peft.LoraConfig`` over the options adapter_config.json files set: ``r``,
``lora_alpha``, ``use_rslora``, ``target_modules`` (a list of name ends, full names, a regex,
``"all-linear"``), ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern``,
``rank_pattern`` / ``alpha_pattern``, ``lora_dropout``, ``bias``, ``modules_to_save``,
``fan_in_fan_out``, ``init_lora_weights``, ``use_dora``, ``lora_bias``,
``trainable_token_indices``, ``layer_replication``, ``task_type``, ``inference_mode``,
``ensure_weight_tying``. PEFT builds the adapter (a config PEFT itself refuses is not drawn
again), every trainable tensor is moved off its initialization (PEFT's ``lora_B = 0`` would
hide every defect), and ``save_pretrained`` writes it. The base is read as the guide says
users do, ``ft.nn.from_hf(directory)``, then ``ft.nn.load_lora(base, adapter_directory)``
must either give PEFT's logits (and, merged, ``merge_and_unload``'s; saved again with
``save_lora``, a file PEFT loads to the same logits) or raise a ValueError naming one of the
options the draw set away from its default. Anything else (other logits, another error)
fails. Exploring (``--hypothesis-profile=explore``) draws ten times as many.

Tolerance: over 790 explored draws of this generator (275 matched, 3 comparisons each) the
largest difference was 2.34e-6 of the logits' magnitude (float32 rounding, in PEFT's order
and in functree's); atol is 10x that, rounded up to test_nn_lora's 2.5e-5. Each matched
draw's adapter moves PEFT's logits by more than 100x the atol, so a skipped option shows.
(Adapters moved by 0.3 randn with alpha 16, r = 1 made models so sensitive that PEFT's own
float32 logits were 4e-5 off its float64 ones: the draws move them by 0.1 randn.)
"""

from __future__ import annotations

import json
import os
import re
import warnings

import jax
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar, once per draw
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

VOCAB, D, T = 48, 16, 6
SCALE = 2.5e-5  # 10x the measured spread (2.2e-6), times the logits' magnitude

# Per family: each linear module's name end and its full name in block {i} (the head: its own),
# the numbered block list's name, the embedding.
LINEAR = {"llama": {**{n: f"model.layers.{{i}}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                    **{n: f"model.layers.{{i}}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")},
                    "lm_head": "lm_head"},
          "gpt2": {"c_attn": "transformer.h.{i}.attn.c_attn", "c_proj": "transformer.h.{i}.attn.c_proj",
                   "c_fc": "transformer.h.{i}.mlp.c_fc", "lm_head": "lm_head"},
          "gpt_neox": {"query_key_value": "gpt_neox.layers.{i}.attention.query_key_value",
                       "dense": "gpt_neox.layers.{i}.attention.dense",
                       "dense_h_to_4h": "gpt_neox.layers.{i}.mlp.dense_h_to_4h",
                       "dense_4h_to_h": "gpt_neox.layers.{i}.mlp.dense_4h_to_h", "embed_out": "embed_out"},
          "phi": {**{n: f"model.layers.{{i}}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "dense")},
                  **{n: f"model.layers.{{i}}.mlp.{n}" for n in ("fc1", "fc2")}, "lm_head": "lm_head"},
          # the router (mlp.gate) and the stacked experts are no Linear: PEFT targets the attention alone
          "mixtral": {**{n: f"model.layers.{{i}}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                      "lm_head": "lm_head"},
          "qwen3_moe": {**{n: f"model.layers.{{i}}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                        "lm_head": "lm_head"},
          "olmoe": {**{n: f"model.layers.{{i}}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                    "lm_head": "lm_head"},
          # the shared expert and its per-token gate are Linears (the router and the stacked experts are not)
          "qwen2_moe": {**{n: f"model.layers.{{i}}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                        **{n: f"model.layers.{{i}}.mlp.shared_expert.{n}" for n in ("gate_proj", "up_proj", "down_proj")},
                        "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate", "lm_head": "lm_head"},
          "distilbert": {**{n: f"distilbert.transformer.layer.{{i}}.attention.{n}"
                            for n in ("q_lin", "k_lin", "v_lin", "out_lin")},
                         **{n: f"distilbert.transformer.layer.{{i}}.ffn.{n}" for n in ("lin1", "lin2")},
                         "vocab_transform": "vocab_transform", "vocab_projector": "vocab_projector"}}
BLOCKS = {"llama": "layers", "gpt2": "h", "gpt_neox": "layers", "phi": "layers", "distilbert": "layer",
          "mixtral": "layers", "qwen3_moe": "layers", "olmoe": "layers", "qwen2_moe": "layers"}
EMBEDDING = {"llama": "embed_tokens", "gpt2": "wte", "gpt_neox": "embed_in", "phi": "embed_tokens", "mixtral": "embed_tokens",
             "qwen3_moe": "embed_tokens", "olmoe": "embed_tokens", "qwen2_moe": "embed_tokens",
             "distilbert": "word_embeddings"}


def build(family: str, tied: bool, seed: int):
    """A tiny HF causal LM with weights moved away from HF's small initialization."""
    torch.manual_seed(seed)
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=tied))
    elif family == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    elif family == "distilbert":  # an encoder's masked LM: the projector's weight tied (its bias its own) or not
        hf = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=D, hidden_dim=2 * D, n_layers=2, n_heads=4, max_position_embeddings=16,
            tie_word_embeddings=tied))
    elif family == "phi":  # every linear layer biased, the head too (tied: its weight alone)
        hf = transformers.PhiForCausalLM(transformers.PhiConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, qk_layernorm=True,
            tie_word_embeddings=tied))
    elif family == "mixtral":  # 4 experts, top-2
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=tied))
    elif family == "qwen3_moe":  # per-head q/k norms, 4 experts of 16, top-2 renormalized
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied))
    elif family == "olmoe":  # q/k norms over the whole projections, clip_qkv, 4 experts, top-2 kept
        hf = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, clip_qkv=2.0, max_position_embeddings=16,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied))
    elif family == "qwen2_moe":  # biased q/k/v, 4 experts of 16, top-2 kept, a shared expert of 24 gated per token
        hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied))
    else:
        hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * D,
            rotary_pct=0.5, max_position_embeddings=16, bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf.eval()


@st.composite
def adapters(draw):
    """``(family, tied, seed, LoraConfig options, rewrite)``: ``rewrite`` a change PEFT's saved
    config gets afterwards, as a hand-written file sets it (``"all-linear"`` kept as it is)."""
    family = draw(st.sampled_from(["llama", "gpt2", "gpt_neox", "phi", "distilbert", "mixtral", "qwen3_moe",
                                      "olmoe", "qwen2_moe"]))
    tied = family == "gpt2" or (family in ("llama", "phi", "distilbert", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
                                and draw(st.booleans()))
    names = list(LINEAR[family])
    blocks = BLOCKS[family]
    options: dict = {"r": draw(st.integers(1, 4)),
                     "lora_alpha": draw(st.sampled_from([1, 4, 8, 16, 0.5, 3])),
                     "use_rslora": draw(st.booleans())}
    rewrite = None
    kind = draw(st.sampled_from(["list", "list", "full", "regex", "all-linear"]))
    chosen = draw(st.lists(st.sampled_from([*names, *names, EMBEDDING[family]]), min_size=1, max_size=3, unique=True))
    if kind == "list":
        options["target_modules"] = chosen
    elif kind == "full":
        options["target_modules"] = [LINEAR[family][n].format(i=i) for n in chosen if n in LINEAR[family]
                                     for i in (0, 1)]
    elif kind == "regex":
        layer = draw(st.sampled_from([r"\d+", "0", "1"]))
        options["target_modules"] = rf".*\.{blocks}\.{layer}\..*\.({'|'.join(chosen)})"
    else:
        options["target_modules"] = "all-linear"
        rewrite = draw(st.sampled_from([None, "all-linear"]))
    if draw(st.integers(0, 3)) == 0:
        excluded = draw(st.sampled_from(names))
        options["exclude_modules"] = draw(st.sampled_from([[excluded], rf".*\.1\..*{excluded}"]))
    if isinstance(options["target_modules"], list) and draw(st.integers(0, 2)) == 0:
        options["layers_to_transform"] = draw(st.sampled_from([0, 1, [0], [1], [0, 1]]))
        options["layers_pattern"] = draw(st.sampled_from([None, blocks, [blocks], "blocks"]))
    if draw(st.integers(0, 2)) == 0:
        key = draw(st.sampled_from([*names, rf"{blocks}\.1\..*", rf"{blocks}\.0\.\w+\.{names[0]}"]))
        options["rank_pattern"] = {key: draw(st.integers(1, 5))}
    if draw(st.integers(0, 2)) == 0:
        key = draw(st.sampled_from([*names, rf"{blocks}\.1\..*"]))
        options["alpha_pattern"] = {key: draw(st.sampled_from([2, 32, 0.25]))}
    options["lora_dropout"] = draw(st.sampled_from([0.0, 0.1]))
    options["bias"] = draw(st.sampled_from(["none"] * 6 + ["all", "lora_only"]))
    if draw(st.integers(0, 3)) == 0:
        options["modules_to_save"] = draw(st.sampled_from([[names[-1]], ["classifier", "score"], [names[-2]]]))
    options["fan_in_fan_out"] = draw(st.booleans())
    options["init_lora_weights"] = draw(st.sampled_from([True, False, "gaussian", True, False, "olora"]))
    rare = draw(st.sampled_from([None] * 12 + ["use_dora", "lora_bias", "trainable_token_indices",
                                               "layer_replication", "ensure_weight_tying", "target_parameters",
                                               "alora_invocation_tokens", "use_qalora"]))
    if rare in ("trainable_token_indices", "alora_invocation_tokens"):
        options[rare] = [1, 2]
    elif rare == "target_parameters":
        options[rare] = [f"{names[-2]}.weight"]
    elif rare == "layer_replication":
        options[rare] = [[0, 2], [1, 2]]
    elif rare is not None:
        options[rare] = True
    options["task_type"] = draw(st.sampled_from([None] if family == "distilbert" else [None, "CAUSAL_LM"]))
    options["inference_mode"] = draw(st.booleans())
    return family, tied, draw(st.integers(0, 2**16)), options, rewrite


DEFAULTS = {f.name: f.default for f in __import__("dataclasses").fields(peft.LoraConfig)}
logits = jax.jit(lambda model, ids: model(ids))


def set_options(options: dict) -> list[str]:
    """The options drawn away from LoraConfig's defaults: those a refusal may name."""
    return [k for k, v in options.items() if k not in DEFAULTS or DEFAULTS[k] != v]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


def assert_close(actual, expected):
    expected = np.asarray(expected, np.float32)
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=0,
                               atol=SCALE * float(np.abs(expected).max()))


def peft_adapter(family, tied, seed, options, directory, ids):
    """PEFT's model of the draw, its trainable tensors moved off their start, saved under
    ``directory/adapter``, the base under ``directory/base``, and its logits of ``ids`` and
    the base's; Nones where PEFT refuses the config."""
    hf = build(family, tied, seed)
    hf.save_pretrained(str(directory / "base"))
    plain = hf_logits(hf, ids)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # trainable (inference_mode written to the file after): its tensors are moved below
            peft_model = peft.get_peft_model(hf, peft.LoraConfig(**{**options, "inference_mode": False}))
        torch.manual_seed(seed + 1)
        with torch.no_grad():
            for p in peft_model.parameters():
                if p.requires_grad:  # lora_A / lora_B, biases, saved modules, DoRA magnitudes, tokens
                    p.add_(0.1 * torch.randn_like(p))
        peft_model.eval()
        expected = hf_logits(peft_model, ids)
    except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError, RuntimeError, IndexError):
        # PEFT refuses it (no target found), or its model fails (OLoRA on a Conv1D; Qwen2-MoE: aLoRA's mask on the
        # shared expert's flattened rows, layer_replication past the config's layer_types: IndexError)
        return None, None, None
    peft_model.save_pretrained(str(directory / "adapter"))
    edit(directory / "adapter", inference_mode=options.get("inference_mode", False))
    return peft_model, expected, plain


def edit(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


DRAWN: dict[str, int] = {"examples": 0, "refused_by_peft": 0, "refused": 0, "matched": 0}  # for exploring


def check(family, tied, seed, options, rewrite, directory):
    """The property: load_lora gives PEFT's logits, merged and saved again too, or refuses
    naming an option the draw set; what it does is counted in :data:`DRAWN`."""
    DRAWN["examples"] += 1
    ids = np.random.default_rng(seed).integers(0, VOCAB, (2, T)).astype(np.int32)
    peft_model, expected, plain = peft_adapter(family, tied, seed, options, directory, ids)
    if peft_model is None:
        DRAWN["refused_by_peft"] += 1
        return "refused_by_peft"
    adapter = directory / "adapter"
    if rewrite is not None:
        edit(adapter, target_modules=rewrite)
    base = ft.nn.from_hf(str(directory / "base"))
    try:
        loaded = ft.nn.load_lora(base, adapter)
    except ValueError as e:
        # PEFT sets target_parameters itself on an MoE's "all-linear" (the router, the stacked experts)
        written = json.loads((adapter / "adapter_config.json").read_text())
        added = ["target_parameters"] if written.get("target_parameters") else []
        named = [k for k in set_options(options) + added if re.search(rf"\b{k}\b", str(e))]
        assert named, f"load_lora refused {options} without naming an option it set:\n{e}"
        DRAWN["refused"] += 1
        return "refused"
    # the adapter moves the logits far beyond the tolerance: a wrong or skipped option shows
    assert float(np.abs(expected - plain).max()) > 100 * SCALE * float(np.abs(expected).max())
    assert_close(logits(loaded, ids), expected)
    saved = directory / "again"
    ft.nn.save_lora(loaded, saved)
    again = peft.PeftModel.from_pretrained(build(family, tied, seed), str(saved)).eval()
    assert_close(hf_logits(again, ids), expected)
    merged = peft_model.merge_and_unload()
    assert_close(logits(ft.nn.merge_lora(loaded), ids), hf_logits(merged, ids))
    DRAWN["matched"] += 1
    return "matched"


# PEFT checks rank_pattern / alpha_pattern keys against modules only, and warns of a parameter's
# key it uses (its own "all-linear" on an MoE: ".*\.gate_up_proj"; save_lora's per-layer ones)
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
@given(adapters())
def test_peft_adapters_load_with_peft_logits_or_are_refused_by_option(tmp_path_factory, draw):
    family, tied, seed, options, rewrite = draw
    outcome = check(family, tied, seed, options, rewrite, tmp_path_factory.mktemp("peft"))
    assume(outcome != "refused_by_peft")
