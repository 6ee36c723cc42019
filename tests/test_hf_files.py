"""config.json read without transformers: for every covered model type, the config built from a
config.json equals transformers' AutoConfig on every attribute the builders read; a directory
and a dict load without importing transformers; building compiles only what it needs."""

import functools
import json
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _files as _hf_files
from functree.hf import _load as _hf

transformers = pytest.importorskip("transformers")

# config.json files: each model type's minimal one (HF's defaults throughout), and the older
# or unusual spellings HF's config classes convert (rope_scaling and rope_theta at the top
# level, GPT-NeoX's rotary_pct, GPT-2's standard names, nulls for derived sizes ...).
CONFIGS = {
    "gpt2": [{}, {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "n_inner": 96,
                  "activation_function": "gelu", "tie_word_embeddings": False, "pad_token_id": 5},
             {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True}],
    "llama": [{}, {"hidden_size": 64, "num_attention_heads": 4, "head_dim": None, "num_key_value_heads": None,
                   "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
              {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}, "rope_theta": 500000.0,
               "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "pad_token_id": 0},
              {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
               "max_position_embeddings": 4096, "head_dim": 64},
              # a top-level original_max_position_embeddings wins over rope_scaling's (HF reads the
              # attribute; was: the rope dict's, or max_position_embeddings: logits 0.74 of their scale off)
              {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
               "original_max_position_embeddings": 2048, "max_position_embeddings": 16384}],
    "qwen2": [{}, {"use_sliding_window": True, "max_window_layers": 0, "sliding_window": 64},
              {"use_sliding_window": True, "num_hidden_layers": 4, "max_window_layers": 2, "rope_theta": 1e6},  # mixed
              {"num_key_value_heads": None, "head_dim": 32, "tie_word_embeddings": True},
              {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
               "original_max_position_embeddings": 4096}],  # the top-level value (was: max_position_embeddings)
    "mistral": [{}, {"sliding_window": None, "head_dim": None, "hidden_size": 256, "num_attention_heads": 8}],
    # MinistralConfig: layer_types from sliding_window when absent; head_dim stays null (not derived)
    "ministral": [{}, {"sliding_window": None, "head_dim": None, "hidden_size": 256, "num_attention_heads": 8},
                  {"num_hidden_layers": 3, "sliding_window": 64, "head_dim": 32,
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}],
    "gemma": [{}, {"hidden_act": "gelu", "num_key_value_heads": 1, "head_dim": 32}],
    "phi3": [{}, {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
                  "original_max_position_embeddings": 2048, "max_position_embeddings": 8192, "sliding_window": 64},
             {"partial_rotary_factor": 0.5, "num_key_value_heads": 8}],
    "gpt_neox": [{}, {"rotary_pct": 0.5, "rotary_emb_base": 20000.0, "use_parallel_residual": False,
                      "attention_bias": False, "hidden_act": "gelu_fast"},
                 {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_theta": 1234.0}],
    # phi-2's sizes and factor (0.4 of a head of 80), q/k LayerNorms, a tied head; an older file's rope_scaling
    "phi": [{}, {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32, "partial_rotary_factor": 0.4,
                 "qk_layernorm": True, "tie_word_embeddings": True, "num_key_value_heads": 8},
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1234.0, "hidden_act": "gelu_fast"}],
    # Mixtral-8x7B's sizes (8 experts, top-2, kv 8, theta 1e6 by default); a window, top-1, an older rope_scaling
    "mixtral": [{}, {"num_local_experts": 4, "num_experts_per_tok": 1, "sliding_window": 4096, "router_aux_loss_coef": 0.02},
                {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1234.0, "head_dim": 64}],
    # Qwen3-30B-A3B's keys (num_experts: stored as num_local_experts); a window, renormalized top-1, head_dim
    "qwen3_moe": [{}, {"num_experts": 4, "num_experts_per_tok": 1, "norm_topk_prob": True, "use_sliding_window": True,
                       "sliding_window": 4096, "moe_intermediate_size": 64, "head_dim": 64, "router_aux_loss_coef": 0.02},
                  {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1234.0, "mlp_only_layers": [99]}],
    # OLMoE-1B-7B's defaults (64 experts, top-8 kept); clip_qkv, renormalized top-1, grouped kv; an older rope_scaling
    "olmoe": [{}, {"num_experts": 4, "num_experts_per_tok": 1, "norm_topk_prob": True, "clip_qkv": 8.0,
                   "num_key_value_heads": 4, "router_aux_loss_coef": 0.02},
              {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1234.0}],
    # Qwen1.5-MoE-A2.7B's defaults (60 experts, top-4 kept, a shared expert); its windows (the even layers below
    # max_window_layers), renormalized top-1, no qkv bias, head_dim; an older rope_scaling, a dense layer past the last
    "qwen2_moe": [{}, {"num_experts": 4, "num_experts_per_tok": 1, "norm_topk_prob": True, "use_sliding_window": True,
                       "sliding_window": 4096, "max_window_layers": 5, "moe_intermediate_size": 64,
                       "shared_expert_intermediate_size": 96, "qkv_bias": False, "head_dim": 64,
                       "router_aux_loss_coef": 0.02},
                  {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1234.0, "mlp_only_layers": [99]}],
    "opt": [{}, {"word_embed_proj_dim": None, "hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 128, "enable_bias": False},
            {"do_layer_norm_before": False, "word_embed_proj_dim": 32, "hidden_size": 64, "num_attention_heads": 4},  # OPT-350m's
            {"_remove_final_layer_norm": True, "word_embed_proj_dim": 64, "layer_norm_elementwise_affine": False}],
    "bert": [{}, {"hidden_act": "relu", "type_vocab_size": 1}],
    "roberta": [{}, {"type_vocab_size": 1, "max_position_embeddings": 514, "layer_norm_eps": 1e-5}],  # roberta-base's
    "xlm-roberta": [{}, {"vocab_size": 250002, "type_vocab_size": 1, "max_position_embeddings": 514,
                         "layer_norm_eps": 1e-5}],
    # DistilBERT's own names and HF's standard ones (its attribute_map), relu, sinusoidal positions
    "distilbert": [{}, {"dim": 64, "n_heads": 4, "n_layers": 3, "hidden_dim": 96, "activation": "relu",
                        "sinusoidal_pos_embds": True, "tie_word_embeddings": False},
                   {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "dropout": 0}],
    "olmo": [{}, {"num_key_value_heads": None, "hidden_size": 64, "num_attention_heads": 4, "attention_bias": True,
                  "tie_word_embeddings": True, "rope_theta": 5e5},
             {"clip_qkv": 8.0}],
    "qwen3": [{}, {"use_sliding_window": True, "num_hidden_layers": 4, "max_window_layers": 2, "sliding_window": 64},
              # no use_sliding_window: no window (sliding layer types then: refused, tests/test_files_hostile.py)
              {"sliding_window": 64, "layer_types": ["full_attention"] * 32},
              {"num_key_value_heads": 8, "head_dim": 32, "attention_bias": True, "rope_theta": 1e6}],
    "olmo2": [{}, {"num_key_value_heads": None, "hidden_size": 64, "num_attention_heads": 4, "attention_bias": True,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True}],
    "gemma2": [{}, {"num_hidden_layers": 3, "sliding_window": 64, "query_pre_attn_scalar": 144,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 128},
               {"layer_types": ["full_attention"] * 26, "hidden_activation": "gelu", "tie_word_embeddings": False}],
    # Gemma 3: an older file's rope keys (the 4B's linear factor 8 on the full layers, its
    # local base and pattern), the nested rope_parameters of transformers 5, a scaled type
    "gemma3_text": [{}, {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6,
                         "rope_local_base_freq": 1e4, "sliding_window_pattern": 6, "num_hidden_layers": 34,
                         "query_pre_attn_scalar": 168, "sliding_window": 1024, "final_logit_softcapping": 30.0},
                    {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "full_attention"],
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
                     "attention_bias": True, "attn_logit_softcapping": 50.0, "sliding_window_pattern": 2}],
    # granite-3.0-8b-base's multipliers; integer multipliers (GraniteConfig's float | int), a tied head
    "granite": [{}, {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                     "logits_scaling": 16.0, "num_key_value_heads": 8, "rope_theta": 1e7},
                {"embedding_multiplier": 2, "logits_scaling": 3, "tie_word_embeddings": True, "attention_bias": True,
                 "mlp_bias": True}],
    # SmolLM3: the default theta (2e6) and NoPE layers; sliding NoPE layers; a list of its own, longer than the layers
    "smollm3": [{}, {"num_hidden_layers": 8, "use_sliding_window": True, "sliding_window": 64, "rope_theta": 5e6},
                {"num_hidden_layers": 3, "no_rope_layers": [0, 1, 1, 0], "no_rope_layer_interval": 2,
                 "num_key_value_heads": None, "tie_word_embeddings": False}],
}
CASES = [(model_type, i) for model_type, configs in CONFIGS.items() for i in range(len(configs))]


class Recorded:
    """A config whose attribute reads are recorded (the names the builders read)."""

    def __init__(self, config, read):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_read", read)

    def __getattr__(self, name):
        self._read.add(name)
        return getattr(self._config, name)


def read_by_builders(config):
    """The attributes the family's builder and HF's initialization read from ``config``, and
    the builder's error where it refuses the config (then both configs must be refused alike)."""
    read = set()
    recorded = Recorded(config, read)
    family = _hf.FAMILIES[config.model_type]

    def build():
        model = family.from_config(recorded, {"pooler.dense.weight"}, jnp.float32, jax.random.key(0), "xla")
        return _hf._hf_initialized(family, model, recorded, jax.random.key(1))

    try:
        jax.eval_shape(build)
    except ValueError as e:
        return read, str(e)
    return read, None


def attribute(config, name):
    try:
        return getattr(config, name)
    except AttributeError:
        return AttributeError


@pytest.mark.parametrize("model_type, i", CASES)
def test_a_config_json_reads_as_transformers_reads_it(model_type, i):
    given = {"model_type": model_type, **CONFIGS[model_type][i]}
    ours = _hf_files.Config.of(json.loads(json.dumps(given)))
    theirs = transformers.AutoConfig.for_model(**json.loads(json.dumps(given)))
    if getattr(theirs, "rope_parameters", None):  # again, as HF's rope init does when its model is built:
        theirs.standardize_rope_params()          # a top-level original_max_position_embeddings then wins
    (names, error), (their_names, their_error) = read_by_builders(ours), read_by_builders(theirs)
    assert error == their_error
    names |= their_names
    assert error is not None or {"vocab_size", "num_hidden_layers"} <= names
    for name in sorted(names):
        assert attribute(ours, name) == attribute(theirs, name), (name, attribute(ours, name), attribute(theirs, name))


def test_every_covered_model_type_has_its_defaults_and_its_configs_here():
    assert set(_hf_files.DEFAULTS) == set(_hf.FAMILIES) == set(CONFIGS)


def test_generation_options_in_a_config_json_are_dropped_as_transformers_drops_them():
    given = {"model_type": "llama", "max_length": 7, "temperature": 0.5, "use_cache": False, "eos_token_id": 5}
    ours = _hf_files.Config.of(dict(given)).to_dict()
    theirs = transformers.AutoConfig.for_model(**given).to_dict()
    for key in given:
        assert (key in ours) == (key in theirs) and ours.get(key) == theirs.get(key), key


def test_the_config_is_read_only_and_gives_its_values_back():
    config = _hf_files.Config.of({"model_type": "gpt2", "hidden_size": 64})
    assert config.n_embd == config.hidden_size == 64 and config.to_dict()["n_embd"] == 64
    assert config == _hf_files.Config.of({"model_type": "gpt2", "n_embd": 64}) and hash(config) == hash(config)
    with pytest.raises(AttributeError, match=r"the gpt2 config has no 'rope_parameters'"):
        _ = config.rope_parameters
    with pytest.raises(AttributeError, match=r"read-only"):
        config.n_embd = 3
    config.to_dict()["n_embd"] = 3
    assert config.n_embd == 64
    assert _hf_files.Config.of({"model_type": "t5", "d_model": 8}).to_dict() == {"model_type": "t5", "d_model": 8}
    with pytest.raises(ValueError, match=r"model_type 't5' is not covered"):
        ft.nn.from_hf({"model_type": "t5"}, {})


@pytest.mark.parametrize("key, value, expected", [("hidden_size", "64", "an integer"), ("rms_norm_eps", True, "a number"),
                                                 ("tie_word_embeddings", 1, "a boolean"), ("hidden_act", 3, "a string")])
def test_a_config_value_of_the_wrong_type_is_refused_naming_it(key, value, expected):
    with pytest.raises(ValueError, match=rf"(?s)the llama config's '{key}' is {value!r} \(a {type(value).__name__}\); "
                                         rf"Hugging Face's llama config takes {expected} there.*right:  \"{key}\": "):
        ft.nn.from_hf({"model_type": "llama", key: value}, {})
    with pytest.raises(ValueError, match=rf"the llama config's '{key}' is null"):  # transformers refuses it too
        _hf_files.Config.of({"model_type": "llama", key: None})
    config = _hf_files.Config.of({"model_type": "llama", "rms_norm_eps": 1, "eos_token_id": [0, 1]})
    assert config.rms_norm_eps == 1 and config.eos_token_id == [0, 1]


@functools.cache
def _gpt2_weights():
    """A 1-layer GPT-2's config and its random weights (NumPy, only read: saved by each test).
    Built once for the module: every ``from_hf(config, key=)`` compiles its build again (~2 CPU-s)."""
    config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}
    return config, ft.nn.to_hf_state_dict(ft.nn.from_hf(config, key=jax.random.key(0)), numpy=True)


@pytest.mark.parametrize("text, words", [(b"{\"eos_token_id\": 2", r"not JSON: Expecting"),
                                         (b"[2]", r"a JSON list, not an object")])
def test_a_damaged_generation_config_json_is_refused_naming_it(tmp_path, text, words):
    config, weights = _gpt2_weights()
    from safetensors.numpy import save_file

    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_bytes(text)
    with pytest.raises(ValueError, match=rf"(?s)'.*generation_config.json' is not a generation_config.json this "
                                         rf"reads \({words}.*right:  hf_model.generation_config.save_pretrained"):
        ft.nn.from_hf(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert ft.nn.from_hf(tmp_path).hf_config.generation["eos_token_id"] == 3


def _gpt2_directory(tmp_path):
    config, weights = _gpt2_weights()
    from safetensors.numpy import save_file

    save_file(weights, tmp_path / "model.safetensors")
    return config


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("levels", [500, 5000])
def test_a_deeply_nested_json_file_is_refused_naming_it(tmp_path, name, levels):
    # before: a RecursionError (copy.deepcopy, HFConfig's freeze, or json at 5000 levels), no file named
    config = _gpt2_directory(tmp_path)
    files = {"config.json": dict(config), "generation_config.json": {"eos_token_id": 3}}
    for file, values in files.items():
        text = json.dumps(values)
        if file == name:
            text = text[:-1] + ', "zzz": ' + "[" * levels + "]" * levels + "}"
        (tmp_path / file).write_text(text)
    why = "values nested 501 levels deep, past 100" if levels == 500 else "nested deeper than Python's JSON reader"
    with pytest.raises(ValueError, match=rf"'.*{name}' is not a {name} this reads \({why}"):
        ft.nn.from_hf(tmp_path)


def test_hf_config_refuses_values_nested_past_the_recursion_limit_naming_the_key():
    # before: a RecursionError from _frozen; a config object given in memory has no file to name
    from functree.hf._config import HFConfig

    lists, objects = [], 1
    for _ in range(2000):
        lists, objects = [lists], {"inner": objects}
    for key, value in (("zzz", lists), ("inner", objects)):
        with pytest.raises(ValueError, match=rf"the config's '{key}' holds lists or objects nested deeper than"):
            HFConfig({"model_type": "gpt2", "zzz": value})
    assert HFConfig({"zzz": [[[1]]]})["zzz"] == (((1,),),)


LOAD = """
import json, os, sys, jax
jax.config.update("jax_log_compiles", True)
import functree as ft
model = ft.nn.from_hf(sys.argv[1])
with open(os.path.join(sys.argv[1], "config.json")) as f:
    same = ft.nn.from_hf(json.load(f), sys.argv[1])     # a config.json dict: read by functree too
print("transformers imported:", "transformers" in sys.modules, "torch imported:", "torch" in sys.modules)
"""


def test_a_directory_loads_without_transformers_and_compiles_nothing_it_does_not_need(tmp_path):
    """The config read by functree (from the directory, and as a dict), the weights
    memory-mapped: neither transformers nor torch imported, and (logged compiles counted) no
    program compiled: the parameters are transfers (jnp.asarray compiled one per shape)."""
    import os

    # A vocabulary past _host.BLOCK: the head's transpose is XLA's host transpose (a transfer).
    config = transformers.LlamaConfig(vocab_size=160, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    hf = transformers.LlamaForCausalLM(config)
    hf.save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path)], capture_output=True, text=True,
                         env=dict(os.environ), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "transformers imported: False torch imported: False" in out.stdout
    compiles = [line for line in out.stderr.splitlines() if "Compiling " in line or "Finished XLA compilation" in line]
    assert len([c for c in compiles if "Finished XLA compilation" in c]) <= COMPILES, "\n".join(compiles)
    loaded = ft.nn.from_hf(tmp_path)
    expected = ft.nn.from_hf(hf)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


COMPILES = 0


def test_a_family_without_its_defaults_row_reads_a_complete_config_and_names_a_missing_field(monkeypatch):
    """The family class alone: from_hf builds it from a complete config.json (every field
    given); a field a config.json leaves out is an error naming the field and the DEFAULTS
    row, not the builder's AttributeError (and getattr's defaults still read)."""
    complete = transformers.OlmoConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2).to_dict()
    monkeypatch.delitem(_hf_files.DEFAULTS, "olmo")
    model = ft.nn.from_hf(complete, key=jax.random.key(0))
    assert type(model).__name__ == "OlmoForCausalLM" and model.model.embed_tokens.embeddings.shape == (11, 8)
    partial = {k: v for k, v in complete.items() if k != "num_key_value_heads"}
    with pytest.raises(ValueError, match=r"(?s)the olmo config has no 'num_key_value_heads', and "
                                         r"functree/hf/_files.py's DEFAULTS has no 'olmo' row.*OlmoForCausalLM is "
                                         r"covered.*right:  ft.nn.from_hf\(transformers.AutoConfig"):
        ft.nn.from_hf(partial, key=jax.random.key(0))
    config = _hf_files.Config.of(partial)
    assert getattr(config, "num_key_value_heads", 3) == 3
    with pytest.raises(AttributeError, match=r"the t5 config has no 'd_ff'"):
        _ = _hf_files.Config.of({"model_type": "t5"}).d_ff


@pytest.mark.parametrize("model_type, field, derived", [("llama", "head_dim", 16), ("mistral", "head_dim", 16),
                                                        ("phi3", "num_key_value_heads", 4),
                                                        ("qwen2", "num_key_value_heads", 4),
                                                        ("olmo", "num_key_value_heads", 4)])
def test_a_null_derived_field_is_derived_as_its_config_class_does(model_type, field, derived):
    """A Derived default of the model type's DEFAULTS row: null (or absent where the
    default is None) becomes the rule's value, as HF's __post_init__ does."""
    given = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, field: None}
    theirs = getattr(transformers.AutoConfig.for_model(**given), field)
    assert getattr(_hf_files.Config.of(given), field) == theirs == derived


# A field whose default is None (or derived from None) has its type too: each value here was
# read before (a false "num_kv_heads (2) must divide num_heads (4)", JAX's "Shapes must be 1D
# sequences of concrete values of integer type", "dictionary update sequence element #0",
# Phi-3's window int()-ed, a Qwen2 layer_types of 1 entry for 2 layers loaded).
WRONG_TYPES = [("llama", "num_key_value_heads", "2", "an integer", "2"), ("llama", "num_key_value_heads", 2.0,
                                                                         "an integer", "2"),
               ("llama", "head_dim", 8.0, "an integer", "8"), ("gpt2", "n_inner", "128", "an integer", "128"),
               ("llama", "rope_parameters", "default", "an object", "null"),
               ("phi3", "sliding_window", "4", "an integer", "4"), ("phi3", "sliding_window", 4.5, "an integer", "null"),
               ("qwen2", "layer_types", ["full_attention"], r"a list of num_hidden_layers \(2\) layer types", "null")]


@pytest.mark.parametrize("model_type, key, value, expected, right", WRONG_TYPES)
def test_a_nullable_field_of_the_wrong_type_is_refused_naming_it_as_transformers_does(model_type, key, value, expected,
                                                                                     right):
    sizes = {"gpt2": {"n_embd": 32, "n_head": 4, "n_layer": 2}}.get(
        model_type, {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2})
    given = {"model_type": model_type, **sizes, key: value}
    with pytest.raises(Exception, match=rf"{key}"):  # transformers' strict dataclass refuses it too
        transformers.AutoConfig.for_model(**given)
    with pytest.raises(ValueError, match=rf"(?s)the {model_type} config's '{key}' is {re.escape(repr(value))} "
                                         rf"\(a {type(value).__name__}\); Hugging Face's {model_type} config takes "
                                         rf"{expected}.*wrong:  \"{key}\": .*right:  \"{key}\": {right} "):
        _hf_files.Config.of(given)
    fixed = {**given, key: json.loads(right)}
    assert getattr(transformers.AutoConfig.for_model(**fixed), key) == _hf_files.Config.of(fixed).to_dict()[key]


torch = pytest.importorskip("torch")
TINY = dict(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32)
IDS = np.random.default_rng(1).integers(0, 61, (1, 7))


def _hf_logits(hf_model):
    with torch.no_grad():
        return hf_model(torch.from_numpy(IDS)).logits.float().numpy()


def _close(actual, expected):
    """float32 rounding: measured 4e-7 of the logits' scale, asserted at 4e-6 of it."""
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=4e-6 * float(np.abs(expected).max()))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_a_base_models_directory_loads_with_its_tied_head_as_transformers_loads_it(tmp_path, family):
    """LlamaModel / GPTNeoXModel save their body without model. / gpt_neox.: transformers'
    AutoModelForCausalLM adds the prefix (and ties the head), which from_hf refused before,
    its fix dropping every tensor; an untied head the file lacks is named."""
    config_class, body = {"llama": (transformers.LlamaConfig, transformers.LlamaModel),
                          "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXModel)}[family]
    sizes = {**TINY, "rotary_pct": 0.5} if family == "gpt_neox" else TINY  # 2 of each 4 features rotated
    torch.manual_seed(0)
    body(config_class(**sizes, tie_word_embeddings=True)).save_pretrained(tmp_path / "tied")
    expected = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tied").eval())
    _close(jax.jit(lambda m, ids: m(ids))(ft.nn.from_hf(tmp_path / "tied"), IDS), expected)
    body(config_class(**sizes, tie_word_embeddings=False)).save_pretrained(tmp_path / "untied")
    hf_class = {"llama": "LlamaForCausalLM", "gpt_neox": "GPTNeoXForCausalLM"}[family]
    with pytest.raises(ValueError, match=rf"(?s)the weights hold no 'lm_head.weight': the {hf_class} the config "
                                         rf"builds has an output head of its own.*a base model's weights "
                                         rf"\({hf_class[:-len('ForCausalLM')]}Model's save_pretrained writes none\).*"
                                         r"drawn at random.*\"tie_word_embeddings\": True"):
        ft.nn.from_hf(tmp_path / "untied")


def _neox_weights():
    config = {"model_type": "gpt_neox", **TINY, "rotary_pct": 0.5}
    weights = ft.nn.to_hf_state_dict(ft.nn.from_hf(config, key=jax.random.key(0)), numpy=True)
    return config, weights


@pytest.mark.parametrize("case", ["neox", "bert"])
def test_an_older_name_beside_its_new_name_is_refused_naming_both(case):
    """GPT-NeoX's embed_out beside lm_head, BERT's LayerNorm.gamma beside LayerNorm.weight:
    the rename overwrote one silently (functree read lm_head and weight, transformers
    embed_out and gamma: logits 1.0 and 0.22 apart). Equal copies are one tensor, read."""
    if case == "neox":
        config, weights = _neox_weights()
        old, new = "embed_out.weight", "lm_head.weight"
    else:
        config = {"model_type": "bert", **TINY}
        weights = ft.nn.to_hf_state_dict(ft.nn.from_hf(config, key=jax.random.key(0)), numpy=True)
        old, new = "encoder.layer.0.output.LayerNorm.gamma", "encoder.layer.0.output.LayerNorm.weight"
    twice = {**weights, old: weights[new] * 2}
    with pytest.raises(ValueError, match=rf"(?s)the weights hold both '{re.escape(old)}' and '{re.escape(new)}' "
                                         rf"\(other values\).*reads '{re.escape(old)}' \(an older file's name\).*"
                                         rf"right:  weights.pop\('{re.escape(new)}'\)"):
        ft.nn.from_hf(config, twice)
    loaded = ft.nn.from_hf(config, {**weights, old: weights[new]})
    for name, value in ft.nn.to_hf_state_dict(loaded, numpy=True).items():
        np.testing.assert_array_equal(value, weights[name])


def test_an_index_that_omits_a_tensor_its_shard_holds_is_named_not_the_config(tmp_path):
    """lm_head.weight left out of the index, still in its shard: the missing key was blamed
    on the config ("give the config saved with these weights"); transformers loads the
    model with a random head, silently (logits 1.05 off). The loaded index's fix reads."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, num_key_value_heads=2)).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    full = json.loads(index.read_text())
    shard = full["weight_map"].pop("lm_head.weight")
    index.write_text(json.dumps(full))
    with pytest.raises(ValueError, match=rf"(?s)index .*model.safetensors.index.json does not list \['lm_head.weight'\], "
                                         rf"which the shard '{shard}' holds.*not the config.*"
                                         rf"\"weight_map\": {{..., 'lm_head.weight': '{shard}'}}"):
        ft.nn.from_hf(tmp_path)
    alone = {k: v for k, v in full["weight_map"].items() if v != shard}  # the shard named by no entry
    index.write_text(json.dumps({**full, "weight_map": alone}))
    with pytest.raises(ValueError, match=rf"(?s)does not list \['model\.layers\..*'\.\.\.'\], which the shard '{shard}' holds"):
        ft.nn.from_hf(tmp_path)
    full["weight_map"]["lm_head.weight"] = shard  # the message's fix
    index.write_text(json.dumps(full))
    _close(jax.jit(lambda m, ids: m(ids))(ft.nn.from_hf(tmp_path), IDS), _hf_logits(hf))


@pytest.mark.parametrize(("task", "config_class", "covered", "body"), [
    ("GPT2DoubleHeadsModel", "GPT2Config", "GPT2LMHeadModel", "transformer"),
    ("BertForNextSentencePrediction", "BertConfig", "BertModel", "bert")])
def test_a_task_class_directory_is_refused_naming_its_body_as_the_portable_part(tmp_path, task, config_class,
                                                                              covered, body):
    """A task checkpoint's directory of a head functree does not cover (classification and
    question-answering and multiple-choice heads are covered: tests/test_hf_heads.py, tests/test_hf_qa.py,
    tests/test_hf_multiple_choice.py): from_hf's fix dropped its head tensors, which
    built a causal LM (the head tied to the embedding) or a BERT named as the checkpoint.
    config.json's architectures names the uncovered class now; the fix's body is the
    checkpoint's, hidden states equal to transformers' body of the task model."""
    torch.manual_seed(0)
    heads = {"num_key_value_heads": 2} if config_class == "MistralConfig" else {}  # Mistral's default: 8
    hf_model = getattr(transformers, task)(getattr(transformers, config_class)(**TINY, **heads, num_labels=3)).eval()
    hf_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"(?s)^ft.nn.from_hf: {task} is not covered; of its model type functree "
                                         rf"covers {covered} .*architectures \['{task}'\]. Its body \({body}\.\*.*"
                                         rf"right:  (body|ported) = ft.nn.from_hf\(transformers\.") as info:
        ft.nn.from_hf(tmp_path)
    right = str(info.value).split("right:  ")[1].split("    #")[0]
    scope = {"ft": ft, "transformers": transformers}
    with warnings.catch_warnings():  # transformers names the head it does not load
        warnings.simplefilter("ignore")
        exec(right, scope)  # the fix as the message writes it
    if "body" in scope:  # BERT: the body is the covered class, its hidden states transformers'
        with torch.no_grad():
            expected = getattr(hf_model, body)(torch.from_numpy(IDS)).last_hidden_state.numpy()
        _close(scope["body"](IDS), expected)
        return
    ours = {k: v for k, v in ft.nn.to_hf_state_dict(scope["ported"], numpy=True).items() if k.startswith(body + ".")}
    theirs = {k: v.numpy() for k, v in hf_model.state_dict().items() if k.startswith(body + ".")}
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():  # the body's tensors, copied exactly
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


@pytest.fixture(scope="module")
def small_gpt2(tmp_path_factory):
    """A 1-layer GPT-2 directory (n_embd 8), written once."""
    from safetensors.numpy import save_file

    directory = tmp_path_factory.mktemp("gpt2")
    config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}
    shapes = {"wte.weight": (11, 8), "wpe.weight": (8, 8), "h.0.attn.c_attn.weight": (8, 24), "h.0.attn.c_attn.bias": (24,),
              "h.0.attn.c_proj.weight": (8, 8), "h.0.mlp.c_fc.weight": (8, 32), "h.0.mlp.c_fc.bias": (32,),
              "h.0.mlp.c_proj.weight": (32, 8), **{f"{n}.{p}": (8,) for n in ("h.0.ln_1", "h.0.ln_2", "ln_f")
                                                    for p in ("weight", "bias")},
              "h.0.attn.c_proj.bias": (8,), "h.0.mlp.c_proj.bias": (8,)}  # GPT2LMHeadModel's, tied head
    rng = np.random.default_rng(0)  # (a fresh from_hf build compiles: seconds)
    save_file({f"transformer.{k}": rng.normal(size=v).astype(np.float32) for k, v in shapes.items()},
              str(directory / "model.safetensors"))
    ft.nn.from_hf(config, str(directory / "model.safetensors"))  # the file is the config's own: it loads
    return directory, config


def _small_gpt2_directory(small_gpt2, tmp_path, **sizes):
    """A copy of ``small_gpt2`` whose config.json claims ``sizes``."""
    directory, config = small_gpt2
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, **sizes}))


@pytest.mark.parametrize("n_embd", [4096, 65536, 10**12])
def test_config_sizes_larger_than_the_weights_are_compared_before_any_array_is_built(small_gpt2, tmp_path, n_embd):
    """A config.json claiming n_embd far above its 8-wide weights: the torch shapes it implies
    are traced (jax.eval_shape) and compared with the files' headers, nothing built at its
    size. Was: the fused c_attn's placeholder concatenated (4096: 200 MB; 65536: NumPy's
    MemoryError for 48 GiB), 10**12: NumPy's "iterator is too large"."""
    import tracemalloc

    from safetensors import safe_open

    _small_gpt2_directory(small_gpt2, tmp_path, n_embd=n_embd)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:  # the reference: the file's own header
        given = tuple(f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape())
    if n_embd == 4096:  # NumPy's allocations, traced (slow: this size alone)
        tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"(?s)weights do not fit the GPT2LMHeadModel.*"
                                             rf"  transformer.h.0.attn.c_attn.weight: expected shape "
                                             rf"\({n_embd}, {3 * n_embd}\) \(for Stack member transformer.h.0.attn."
                                             rf"query_projection.weight ...\), given shape {re.escape(str(given))}.*"
                                             r"give the config saved with these weights"):
            ft.nn.from_hf(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert given == (8, 24) and peak < 16 * 2**20, peak  # was 200 MB at 4096 (the fused placeholder built)


def test_a_config_with_more_layers_than_the_weights_fails_fast_naming_both_counts(small_gpt2, tmp_path):
    """n_layer 3000 (or 10**7) beside a 1-layer file: the weights' names hold layer 0 alone,
    found before any layer is walked (was: 3000 layers planned, 36000 names listed missing;
    10**7 never answered)."""
    _small_gpt2_directory(small_gpt2, tmp_path, n_layer=10**7)
    message = r"(?s)^ft.nn.from_hf: the config builds {n} layers \(transformer.h.0 to transformer.h.{last}, the " \
              r"model's transformer.h\), but the weights hold layers 0 to 0\..*wrong:  \"n_layer\": {n}\n" \
              r"    right:  \"n_layer\": 1 "
    with pytest.raises(ValueError, match=message.format(n=10**7, last=10**7 - 1)):
        ft.nn.from_hf(tmp_path)
    _small_gpt2_directory(small_gpt2, tmp_path, n_layer=3000)
    with pytest.raises(ValueError, match=message.format(n=3000, last=2999)):
        ft.nn.from_hf(tmp_path)


@pytest.mark.parametrize("field, value, method", [
    ("quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
    ("quantization_config", {"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ("quantization", {"group_size": 64, "bits": 4}, "MLX, 4 bits")])  # mlx_lm's
def test_a_quantized_checkpoints_config_is_refused_naming_the_field(small_gpt2, tmp_path, field, value, method):
    """A config.json with a quantization_config (or MLX's quantization): the weights are
    packed integers or float8 with scales beside them. Was: the field ignored, float weights
    beside it loaded as if unquantized, and where the scales were extra tensors the fix
    offered was to drop them (a float8 weight read without its scale)."""
    _small_gpt2_directory(small_gpt2, tmp_path, **{field: value})
    message = rf"(?s)the config's '{field}' is {re.escape(json.dumps(value))}: .*stored quantized \({method}:.*" \
              rf"nothing was built.*\"{field}\": {re.escape(json.dumps(value))}.*dequantize\(\)"
    with pytest.raises(ValueError, match=message):
        ft.nn.from_hf(tmp_path)
    config = transformers.GPT2Config(**{k: v for k, v in small_gpt2[1].items() if k != "model_type"})
    setattr(config, field, value)  # a transformers config in memory: refused alike
    with pytest.raises(ValueError, match=message):
        ft.nn.from_hf(config, str(tmp_path / "model.safetensors"))
    _small_gpt2_directory(small_gpt2, tmp_path, **{field: None})  # null: not quantized, loads
    ft.nn.from_hf(tmp_path)


@pytest.mark.parametrize("extra", ["weight_scale_inv", "weight_scale", "qzeros", "SCB"])
def test_a_quantized_checkpoints_scales_are_not_offered_to_be_dropped(small_gpt2, extra):
    """float8 weights and their scales given without the quantization_config: the error named
    the scales as leftovers to leave out, and the weights loaded without them (the float8
    values as the weights: another model). Now it says what they are and not to drop them."""
    import ml_dtypes
    from safetensors.numpy import load_file

    directory, config = small_gpt2
    weights = load_file(str(directory / "model.safetensors"))
    name = "transformer.h.0.attn.c_attn.weight"
    weights[name] = (weights[name] / 2).astype(ml_dtypes.float8_e4m3fn)
    weights[name.replace("weight", extra)] = np.full((1,), 2.0, np.float32)
    with pytest.raises(ValueError, match=rf"(?s)unexpected keys: \['{name.replace('weight', extra)}'\].*"
                                         r"a quantized checkpoint's tensors .*do not leave them out") as refused:
        ft.nn.from_hf(config, weights)
    assert "leave them out;" not in str(refused.value) and "weights = {k: v" not in str(refused.value)


def test_a_transformers_config_with_a_top_level_pretraining_length_reads_as_its_model():
    """transformers keeps rope_scaling's length (or max_position_embeddings) in the config
    object, but its model's rope init standardizes the config again and a top-level
    original_max_position_embeddings wins: from_hf(config, weights) read the object's
    (logits 0.74 of their scale from HF's model); now the model's, the caller's config untouched."""
    from functree.hf import _options

    config = transformers.LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=64,
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0}, original_max_position_embeddings=16)
    assert config.rope_parameters["original_max_position_embeddings"] == 64  # the object's own
    assert _options.rope(_hf_files.read_config(config), 4).original_max_positions == 16
    assert config.rope_parameters["original_max_position_embeddings"] == 64  # the caller's, untouched
    hf_model = transformers.LlamaForCausalLM(config)  # (standardizes the config it is given again, in place)
    assert hf_model.config.rope_parameters["original_max_position_embeddings"] == 16  # the model's
    assert _options.rope(_hf_files.read_config(hf_model.config), 4).original_max_positions == 16
