"""Files written by Hugging Face, PEFT, torch or a stranger: read right or refused by name.

Each case here was read before its fix (a silently different model, or a bare Python error),
and each file is built byte by byte or edited from a ``save_pretrained`` directory."""

import json
import re

import jax
import numpy as np
import pytest

import functree as ft
from functree.hf import _files as _hf_files
from functree.hf._files import DEFAULTS, NULL_ALLOWED, Derived

SIZES = {"gpt2": {"vocab_size": 61, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32},
         "opt": {"vocab_size": 61, "hidden_size": 16, "ffn_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "max_position_embeddings": 32, "word_embed_proj_dim": 16},
         "distilbert": {"vocab_size": 61, "dim": 16, "n_layers": 2, "n_heads": 4, "hidden_dim": 32,
                        "max_position_embeddings": 32}}  # (its own names: a standard one would win over a null)
LLAMA_LIKE = {"vocab_size": 61, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "pad_token_id": 0}


def _config(model_type, **changes):
    return {"model_type": model_type, **SIZES.get(model_type, LLAMA_LIKE), **changes}


def _non_null_fields():
    """Every field of every DEFAULTS row whose default is a value (not None, not a token id, not
    Derived: null derives it, as transformers v4 did for Mistral's num_key_value_heads too)."""
    return [(model_type, key) for model_type, row in DEFAULTS.items() for key, default in row.items()
            if not isinstance(default, Derived) and default is not None and not key.endswith("_token_id")]


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_null_is_refused_exactly_where_transformers_refuses_it(model_type):
    """A null where HF's config class takes no null (its strict validation refuses the file)
    was read as false, 0 or ft.nn.RMSNorm's epsilon=None (the dtype's machine epsilon):
    gpt_neox "use_parallel_residual": null built the sequential block, opt
    "do_layer_norm_before": null the post-norm one, llama "rms_norm_eps": null another
    epsilon, "hidden_size": null a bare TypeError; HF's nullable fields still read."""
    transformers = pytest.importorskip("transformers")
    for key in [k for t, k in _non_null_fields() if t == model_type]:
        given = _config(model_type, **{key: None})
        try:
            transformers.AutoConfig.for_model(**given)
            theirs = False
        except Exception as e:  # transformers' StrictDataclassFieldValidationError
            theirs = key in str(e)
        if (model_type, key) == ("qwen3_moe", "num_local_experts"):  # the attribute_map's target: HF validates
            with pytest.raises(Exception, match="num_experts"):      # its field num_experts alone (null: refused);
                transformers.AutoConfig.for_model(**_config(model_type, num_experts=None))  # null here is no model
            theirs = True
        try:
            _hf_files.Config.of(given)
            ours = False
        except ValueError as e:
            ours = re.search(rf"(?s)the {model_type} config's '{key}' is null; Hugging Face's {model_type} config "
                             rf"takes (an integer|a number|a boolean|a string|an object|a list) there.*wrong:  "
                             rf"\"{key}\": null\n    right:  \"{key}\": ", str(e)) is not None
        assert ours == theirs == (key not in NULL_ALLOWED.get(model_type, ())), (model_type, key, ours, theirs)


@pytest.mark.parametrize("model_type, key", [("gpt_neox", "use_parallel_residual"), ("opt", "do_layer_norm_before"),
                                             ("llama", "rms_norm_eps"), ("llama", "hidden_size")])
def test_a_null_that_built_another_model_is_refused_by_from_hf(model_type, key):
    with pytest.raises(ValueError, match=rf"config's '{key}' is null"):
        ft.nn.from_hf(_config(model_type, **{key: None}), key=jax.random.key(0))


@pytest.mark.parametrize("text, key, literal", [
    ('"rms_norm_eps": NaN', "rms_norm_eps", "NaN"),
    ('"rms_norm_eps": {"__float__": "Infinity"}', "rms_norm_eps", '{"__float__": "Infinity"}'),
    ('"rope_theta": -Infinity', r"rope_parameters\['rope_theta'\]", "-Infinity"),
    ('"rope_scaling": {"type": "linear", "factor": NaN}', r"rope_parameters\['factor'\]", "NaN"),
])
def test_a_nan_or_infinity_in_a_config_json_is_refused_naming_the_field(tmp_path, text, key, literal):
    """Python's JSON reader takes NaN and Infinity literals (and transformers its
    {"__float__": ...} tag): an RMSNorm epsilon of NaN made every logit NaN, silently."""
    config = json.dumps(_config("llama"))[:-1] + ", " + text + "}"
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=rf"(?s)the llama config's {key} is -?(nan|inf) \(config.json's "
                                         rf"{re.escape(literal)}\); no Hugging Face model.*wrong:  .*{re.escape(literal)}"):
        _hf_files.read_config(tmp_path)


def test_a_mistral_config_with_layer_types_is_read_as_the_ministral_transformers_reads(tmp_path):
    """transformers' AutoConfig reads a mistral config.json with layer_types as Ministral's
    (each layer its type's mask); functree built Mistral, every layer sliding: logits 0.13 of
    their scale off for a window of 3 (a differential sweep against transformers), then refused
    them (MISTRAL_LAYER_TYPES). Now each layer takes its type's window, "full_attention" none
    even where sliding_window is set (HF's logits: tests/test_hf_ministral.py)."""
    transformers = pytest.importorskip("transformers")
    given = _config("mistral", sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(given))
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == "ministral"
    attention = ft.nn.from_hf(given, key=jax.random.key(0)).model.layers.layers.self_attn
    assert attention.window is None and np.asarray(attention.member_window).tolist() == [3, 0]
    full = _config("mistral", sliding_window=3, layer_types=["full_attention"] * 2)
    assert ft.nn.from_hf(full, key=jax.random.key(0)).model.layers.layers.self_attn.window is None
    model = ft.nn.from_hf(_config("mistral", sliding_window=3, layer_types=["sliding_attention"] * 2),
                          key=jax.random.key(0))
    assert model.model.layers.layers.self_attn.window == 3
    with pytest.raises(ValueError, match=r"the mistral config's 'layer_types' is \['sliding_attention'\]"):
        ft.nn.from_hf(_config("mistral", sliding_window=3, layer_types=["sliding_attention"]), key=jax.random.key(0))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("changes, words", [
    ({"sliding_window": 3}, r"null \(use_sliding_window is false, which makes Hugging Face's sliding_window 3 null\)"),
    ({"sliding_window": None, "use_sliding_window": True}, r"null: a sliding layer"),
])
def test_a_sliding_layer_without_a_window_is_refused_naming_the_layer(model_type, changes, words):
    """Qwen2 / Qwen3 layer types naming a sliding layer while the window is null: HF's forward
    fails on it (a bare TypeError); functree read every layer as full attention (Qwen3's until
    2026-12-03: its config.json kept the window use_sliding_window false drops)."""
    given = _config(model_type, layer_types=["full_attention", "sliding_attention"], **changes)
    with pytest.raises(ValueError, match=rf"(?s)the {model_type} config's layer_types make layer 1 "
                                         rf"\"sliding_attention\", but its sliding window is {words}.*wrong:  .*right:  "):
        ft.nn.from_hf(given, key=jax.random.key(0))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_transformers_config_with_a_sliding_layer_and_no_window_is_refused(model_type):
    """The same config as transformers' object (its window already null): refused, not built
    as full attention (HF's model fails on it)."""
    transformers = pytest.importorskip("transformers")
    given = _config(model_type, layer_types=["full_attention", "sliding_attention"], sliding_window=3)
    config = transformers.AutoConfig.for_model(**given)
    assert config.sliding_window is None
    with pytest.raises(ValueError, match=rf"the {model_type} config's layer_types make layer 1 \"sliding_attention\", "
                                         r"but its sliding window is null"):
        ft.nn.from_hf(config, key=jax.random.key(0))


@pytest.mark.parametrize(("model_type", "changes", "where"), [
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, "layer 1"),
    ("qwen3", {"use_sliding_window": True, "max_window_layers": 1}, "layer 1"),
    ("ministral", {"head_dim": 8, "layer_types": ["full_attention", "sliding_attention"]}, "layer 1"),
    ("qwen2_moe", {"use_sliding_window": True, "num_experts": 2, "num_experts_per_tok": 1}, "layer 0"),
    ("mistral", {}, "every layer"),
])
def test_a_sliding_window_of_0_is_refused_as_transformers_fails_on_it(model_type, changes, where):
    """``sliding_window`` 0 on a sliding layer: HF's sliding mask fails (checked); functree read
    it as full attention where the layer types mix (0 in the per-layer windows), or refused it
    by the attention's own message naming no config key; now SLIDING_WINDOW_NOT_POSITIVE."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    given = _config(model_type, sliding_window=0, **changes)
    config = transformers.AutoConfig.for_model(**given)
    with pytest.raises(RuntimeError, match="must match"):
        transformers.AutoModelForCausalLM.from_config(config)(torch.zeros((1, 3), dtype=torch.long))
    for source in (given, config):
        with pytest.raises(ValueError, match=rf'(?s)the {model_type} config has sliding_window=0 and {where}.* slides.*'
                                             r'right:  "sliding_window": 4096'):
            ft.nn.from_hf(source, key=jax.random.key(0))


@pytest.mark.parametrize("rope", [{"type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_a_phi3_rope_type_transformers_refuses_is_refused_by_name(rope):
    """Phi3Config takes default or longrope rotations only; functree built a linearly scaled Phi-3."""
    transformers = pytest.importorskip("transformers")
    given = _config("phi3", rope_scaling=rope)
    with pytest.raises(Exception, match=r"type field must be one of \['longrope'\]"):
        transformers.AutoConfig.for_model(**given)
    kind = rope.get("type", rope.get("rope_type"))
    with pytest.raises(ValueError, match=rf"(?s)the phi3 config's rope type is '{kind}'; Hugging Face's Phi3Config "
                                         rf"takes \"default\" or \"longrope\".*wrong:  \"rope_scaling\": \{{\"type\": "
                                         rf"\"{kind}\""):
        ft.nn.from_hf(given, key=jax.random.key(0))


@pytest.mark.parametrize("standard, own", [("num_attention_heads", "n_head"), ("num_hidden_layers", "n_layer"),
                                           ("hidden_size", "n_embd"), ("max_position_embeddings", "n_positions")])
@pytest.mark.parametrize("standard_first", [True, False])
def test_gpt2s_standard_name_beside_its_own_reads_as_transformers_reads_it(standard, own, standard_first):
    """GPT2Config sets a standard name (num_attention_heads) after its own (n_head), whatever
    the file's order; functree kept the file's last: {"num_attention_heads": 2, "n_head": 4}
    built 4 heads of the same weights' shapes, HF 2."""
    transformers = pytest.importorskip("transformers")
    values = {standard: 8, own: 4} if standard_first else {own: 4, standard: 8}
    given = {"model_type": "gpt2", **values}
    theirs = getattr(transformers.AutoConfig.for_model(**given), own)
    assert getattr(_hf_files.Config.of(given), own) == getattr(_hf_files.Config.of(given), standard) == theirs == 8


def _sharded(tmp_path, shards, weight_map, metadata=None):
    """A sharded checkpoint written byte by byte: {shard: {name: array}} and its index."""
    from functree.interop._safetensors import save_file

    for shard, tensors in shards.items():
        save_file(str(tmp_path / shard), tensors, {"format": "pt"})
    index = {"metadata": metadata or {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


A, B, C = (np.full((2, 2), v, np.float32) for v in (1.0, 2.0, 3.0))


def test_an_index_moving_a_tensor_to_a_shard_without_it_is_refused_naming_both(tmp_path):
    """The shard read first held the tensor the index puts in a later shard: the duplicate
    check looked it up there, a bare KeyError."""
    from functree.interop import _safetensors

    path = _sharded(tmp_path, {"s1.safetensors": {"a": A, "b": B}, "s2.safetensors": {"c": C}},
                    {"b": "s1.safetensors", "a": "s2.safetensors", "c": "s2.safetensors"})
    with pytest.raises(ValueError, match=r"(?s)index .*model.safetensors.index.json puts 'a' in the shard "
                                         r".*s2.safetensors, whose header does not hold it \(it holds 1 tensors, "
                                         r"e.g. 'c'\)"):
        _safetensors.load_checkpoint(path, "ft.nn.from_hf")


def test_the_index_metadata_never_replaces_a_tensor_a_shard_holds(tmp_path):
    """huggingface_hub's index metadata names the ties it dropped ({"b": "a"}); a name a
    shard holds is its own tensor (transformers reads it), which the metadata replaced
    silently with another's values when the index left it out."""
    from functree.interop import _safetensors

    (tmp_path / "held").mkdir(), (tmp_path / "tied").mkdir()
    path = _sharded(tmp_path / "held", {"s1.safetensors": {"a": A, "b": B}},
                    {"a": "s1.safetensors"}, {"b": "a"})
    assert sorted(_safetensors.load_checkpoint(path, "ft.nn.from_hf")) == ["a"]  # b: missing, then named
    assert _safetensors.unlisted(str(path / "model.safetensors.index.json")) == {"b": "s1.safetensors"}
    tied = _sharded(tmp_path / "tied", {"s1.safetensors": {"a": A}}, {"a": "s1.safetensors"}, {"b": "a"})
    np.testing.assert_array_equal(_safetensors.load_checkpoint(tied, "ft.nn.from_hf")["b"], A)  # a tie still reads


def test_a_torch_tensor_with_a_lazy_negation_reads_its_values():
    """``c.conj().imag`` is a real tensor with torch's negative bit (a lazy negation):
    ``.numpy()`` refuses it, a bare RuntimeError from load_torch_state_dict."""
    torch = pytest.importorskip("torch")
    c = torch.tensor([[1 + 1j, 2 + 2j, 3 - 3j], [4 + 4j, 5 - 5j, 6 + 6j]], dtype=torch.complex64)
    weight = c.conj().imag
    assert weight.is_neg()
    model = ft.nn.Sequential(ft.nn.Dense(3, 2, key=jax.random.key(0)))
    loaded = ft.nn.load_torch_state_dict(model, {"0.weight": weight, "0.bias": torch.zeros(2)})
    np.testing.assert_array_equal(np.asarray(loaded.layers[0].weight).T, [[-1, -2, 3], [-4, 5, -6]])


@pytest.mark.parametrize("file", ["generation_config.json", "config.json"])
@pytest.mark.parametrize("given, meant", [("false", "greedy decoding"), (1, "sampling")])
def test_a_do_sample_that_is_no_boolean_is_refused_naming_the_file(tmp_path, file, given, meant):
    """A "do_sample": "false" is truthy: generate sampled where the file seems to say greedy
    (transformers' does too). An older config.json's generation options are read when the
    directory has no generation_config.json."""
    from functree.interop._safetensors import save_file

    model = ft.nn.from_hf(_config("llama"), key=jax.random.key(0))
    save_file(str(tmp_path / "model.safetensors"), ft.nn.to_hf_state_dict(model, numpy=True), {"format": "pt"})
    config = _config("llama") if file == "generation_config.json" else _config("llama", do_sample=given)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if file == "generation_config.json":
        (tmp_path / file).write_text(json.dumps({"do_sample": given}))
    with pytest.raises(ValueError, match=rf"(?s){re.escape(str(tmp_path / file))}' sets \"do_sample\": "
                                         rf"{re.escape(json.dumps(given))} \(a {type(given).__name__}\), not true or "
                                         rf"false.*seems to mean {meant}.*right:  \"do_sample\": "):
        ft.nn.from_hf(tmp_path)


def test_a_git_lfs_pointer_is_named_as_one(tmp_path):
    """A clone without git lfs holds ~130-byte pointers where the weights should be: it read
    as a damaged file ("header size is 2336927755350992246 bytes, over the format's bound")."""
    path = tmp_path / "model.safetensors"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 26843545600\n")
    with pytest.raises(ValueError, match=rf"(?s)ft.nn.load_torch_state_dict: '{re.escape(str(path))}' is a Git LFS "
                                         r"pointer \(the pointer of a 26.8 GB file\), not the .safetensors file.*"
                                         r"git lfs pull"):
        ft.nn.load_torch_state_dict(ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0))), path)


@pytest.mark.parametrize("model_type, changes, key", [
    ("llama", {"rope_theta": None}, "rope_theta"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": None}}, "rope_theta"),
    ("gpt_neox", {"rotary_pct": None}, "partial_rotary_factor"),
    ("phi3", {"partial_rotary_factor": None}, "partial_rotary_factor"),
])
def test_a_null_rope_number_is_refused_naming_it(model_type, changes, key):
    """Read into the rotation, a null rope_theta or factor was a bare TypeError ("float()
    argument must be ... not 'NoneType'"); Hugging Face's model fails on it too (llama:
    "unsupported operand type(s) for ** or pow()" building the rotary embedding)."""
    given = _config(model_type, **changes)
    with pytest.raises(ValueError, match=rf"(?s)the {model_type} config's {key} \(at its top level.*is null; a rotary "
                                         rf"embedding needs a number there.*wrong:  \"{key}\": null\n    right:  "
                                         rf"\"{key}\": "):
        _hf_files.Config.of(given)


def test_a_null_partial_rotary_factor_is_no_factor_as_transformers_reads_it():
    """HF's standardize_rope_params skips a null partial_rotary_factor (the whole head
    rotates); it was a bare TypeError."""
    transformers = pytest.importorskip("transformers")
    given = _config("llama", partial_rotary_factor=None)
    assert "partial_rotary_factor" not in transformers.AutoConfig.for_model(**given).rope_parameters
    assert _hf_files.Config.of(given).rope_parameters == _hf_files.Config.of(_config("llama")).rope_parameters
