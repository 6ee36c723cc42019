"""Weight files as the internet writes them: each tampered ``save_pretrained`` directory reads
as transformers' ``from_pretrained`` reads it (the same logits), or is refused naming the
tensor, what was expected and what was given, and the fix.

Each directory is a tiny random model's ``save_pretrained`` output, its ``model.safetensors``
rewritten with the ``safetensors`` library or its header edited byte by byte."""

import json
import re
import struct
import warnings

import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = np.array([[1, 5, 9, 3, 7, 2]])
Q = "model.layers.0.self_attn.q_proj.weight"


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_embd=16, n_layer=2, n_head=4,
                                                                n_positions=32)).eval()


def _neox():
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=61, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32)).eval()


def _saved(model, path, change=None):
    """``model``'s save_pretrained directory, its tensors passed through ``change``."""
    model.save_pretrained(path)
    if change is not None:
        file = path / "model.safetensors"
        tensors = change(safetensors_torch.load_file(file))
        safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    return path


def _hf_logits(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def _close(ours, theirs, rtol):
    scale = max(float(np.abs(theirs).max()), 1e-3)
    np.testing.assert_allclose(np.asarray(ours, np.float32), theirs, atol=rtol * scale, rtol=0)


@pytest.mark.parametrize("dtype, config_dtype, rtol", [
    (torch.float16, "bfloat16", 2e-2),   # an fp16 file with a bf16 config: HF casts to bf16, functree to float32
    (torch.float32, "bfloat16", 2e-2),
    (torch.float64, "float32", 1e-5),
    (torch.float16, None, 2e-3),         # no dtype in config.json: HF keeps the file's float16
    (torch.float64, None, 1e-5),
])
def test_a_floating_file_of_another_dtype_than_its_config_reads_as_transformers_reads_it(tmp_path, dtype,
                                                                                         config_dtype, rtol):
    path = _saved(_llama(), tmp_path, lambda sd: {k: v.to(dtype) for k, v in sd.items()})
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if config_dtype is not None:
        config["dtype"] = config_dtype
    (path / "config.json").write_text(json.dumps(config))
    _close(ft.nn.from_hf(path)(IDS), _hf_logits(path), rtol)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_tensor_in_a_float32_file_reads_its_values_as_transformers_does(tmp_path, dtype):
    path = _saved(_llama(), tmp_path, lambda sd: {**sd, Q: sd[Q].to(dtype)})
    _close(ft.nn.from_hf(path)(IDS), _hf_logits(path), 1e-5)


def _integers(name, dtype):
    def change(sd):
        value = sd[name] * 100
        return {**sd, name: value > 0 if dtype is torch.bool else value.to(dtype)}
    return change


@pytest.mark.parametrize("name, dtype", [(Q, torch.int8), (Q, torch.uint8), (Q, torch.bool),
                                         ("model.norm.weight", torch.int64),
                                         ("model.layers.1.mlp.up_proj.weight", torch.int32)])
def test_an_integer_tensor_for_a_floating_weight_is_refused_naming_it(tmp_path, name, dtype):
    """transformers casts an integer or boolean tensor to the float weight silently (another
    model); functree refused it naming the tensor by functree's own name
    (``self_attn.query_projection``, not the file's ``q_proj``) with the fix of a config
    that is not the weights' own."""
    path = _saved(_llama(), tmp_path, _integers(name, dtype))
    _hf_logits(path)  # transformers loads it
    given = str(dtype).removeprefix("torch.")
    shape = tuple(safetensors_torch.load_file(path / "model.safetensors")[name].shape)
    with pytest.raises(ValueError, match=(
            rf"(?s)the weights' '{re.escape(name)}' is {given} \(shape {re.escape(str(shape))}\), where the "
            rf"LlamaForCausalLM the config builds has a floating weight \(.*dtype float32\).*casts the integers "
            rf"to floats.*wrong:  '{re.escape(name)}': {given}, shape .*right:  '{re.escape(name)}': float32, "
            rf"float16 or bfloat16.*safetensors.torch.load_file.*\.float\(\)")):
        ft.nn.from_hf(path)


def test_an_integer_tensor_in_a_state_dict_of_arrays_names_numpys_cast():
    model = _llama()
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    weights[Q] = (weights[Q] * 100).astype(np.int16)
    with pytest.raises(ValueError, match=rf"(?s)'{re.escape(Q)}' is int16 .*\.astype\(np.float32\)"):
        ft.nn.from_hf(model.config, weights)


def test_a_header_whose_dtype_was_rewritten_to_an_integer_is_refused_naming_the_tensor(tmp_path):
    """The same bytes read as int32: a header edit that keeps the file's layout valid."""
    path = _saved(_llama(), tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    header[Q]["dtype"] = "I32"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])
    with pytest.raises(ValueError, match=rf"'{re.escape(Q)}' is int32 \(shape \(16, 16\)\)"):
        ft.nn.from_hf(path)


def test_a_quantized_checkpoints_integer_weight_with_its_scale_is_named_a_quantized_checkpoint(tmp_path):
    """An int8 weight beside its scale (bitsandbytes' SCB) is a quantized checkpoint: its own error."""
    def change(sd):
        return {**sd, Q: (sd[Q] * 100).to(torch.int8), Q.replace(".weight", ".SCB"): torch.ones(16)}
    path = _saved(_llama(), tmp_path, change)
    with pytest.raises(ValueError, match="quantized checkpoint's tensors"):
        ft.nn.from_hf(path)


@pytest.mark.parametrize("make, prefix", [(_llama, "base_model.model."), (_llama, "module."), (_llama, "transformer."),
                                          (_gpt2, "module."), (_gpt2, "model."),
                                          (_neox, "gpt_neox.")])  # (transformers strips it, but not from embed_out)
def test_weights_under_a_wrappers_prefix_are_refused_naming_the_prefix(tmp_path, make, prefix):
    """transformers initializes the weights it does not find under their names at random;
    functree refused them as a config with too many layers: ``"num_hidden_layers": 0`` its fix."""
    model = make()
    path = _saved(model, tmp_path, lambda sd: {prefix + k: v for k, v in sd.items()})
    with torch.no_grad():
        own = model(torch.tensor(IDS)).logits.numpy()
    assert not np.allclose(_hf_logits(path), own, atol=1e-3)  # transformers' model is not the checkpoint's
    layer = {_llama: "model.layers.0.", _gpt2: "transformer.h.0.", _neox: "gpt_neox.layers.0."}[make]
    with pytest.raises(ValueError, match=(
            rf"(?s)the weights' names start with '{re.escape(prefix)}' \(e.g. '{re.escape(prefix + layer)}.*"
            rf"wrong:  '{re.escape(prefix + layer)}.*right:  '{re.escape(layer)}.*"
            rf"weights = \{{k.removeprefix\('{re.escape(prefix)}'\): v")) as e:
        ft.nn.from_hf(path)
    assert "num_hidden_layers" not in str(e.value)
    stripped = {k.removeprefix(prefix): v.numpy() for k, v in safetensors_torch.load_file(path / "model.safetensors")
                .items()}
    _close(ft.nn.from_hf(model.config, stripped)(IDS), own, 1e-5)  # the fix reads the checkpoint's model



def _opt():
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=61, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=16, max_position_embeddings=32)).eval()


@pytest.mark.parametrize("make, base, bare", [(_llama, "model.", "model.layers."), (_llama, "model.", "model.layers.1."),
                                              (_llama, "model.", "model.norm."), (_gpt2, "transformer.", "transformer.h."),
                                              (_opt, "model.", "model.decoder.layers.")])
def test_a_base_model_prefix_missing_on_some_names_reads_as_transformers_reads_them(tmp_path, make, base, bare):
    """``layers.0...`` beside ``model.embed_tokens.weight``: transformers adds the base model's
    prefix name by name (the same logits); functree refused them as a config with fewer layers
    ("num_hidden_layers": 0 its fix)."""
    model = make()
    path = _saved(model, tmp_path, lambda sd: {k.removeprefix(base) if k.startswith(bare) else k: v
                                               for k, v in sd.items()})
    with torch.no_grad():
        own = model(torch.tensor(IDS)).logits.numpy()
    theirs = _hf_logits(path)
    _close(theirs, own, 1e-6)
    _close(ft.nn.from_hf(path)(IDS), theirs, 1e-5)


def test_a_bare_name_beside_its_prefixed_name_with_other_values_is_refused_naming_both(tmp_path):
    """Which of the two is the model's weight cannot be told: neither is read silently."""
    weights = {k: v.numpy() for k, v in _llama().state_dict().items()}
    bare = Q.removeprefix("model.")
    weights[bare] = weights[Q] + 1
    with pytest.raises(ValueError, match=rf"{re.escape(bare)}.*{re.escape(Q)}"):
        ft.nn.from_hf(_llama().config, weights)
    weights[bare] = weights[Q].copy()  # an equal copy is the same tensor: read once
    _close(ft.nn.from_hf(_llama().config, weights)(IDS), _hf_logits(_saved(_llama(), tmp_path)), 1e-5)


def test_a_wrappers_prefix_on_the_layers_alone_is_refused_naming_the_prefix(tmp_path):
    """``module.model.layers.*`` beside ``model.embed_tokens.weight``: transformers draws the
    layers at random; functree's fix was ``"num_hidden_layers": 0``."""
    model = _llama()
    path = _saved(model, tmp_path, lambda sd: {"module." + k if k.startswith("model.layers.") else k: v
                                               for k, v in sd.items()})
    with torch.no_grad():
        own = model(torch.tensor(IDS)).logits.numpy()
    assert not np.allclose(_hf_logits(path), own, atol=1e-3)
    with pytest.raises(ValueError, match=(r"(?s)18 of 21 of the weights' names start with 'module.' "
                                          r"\(e.g. 'module.model.layers.0.*weights = \{k.removeprefix\('module.'\)")):
        ft.nn.from_hf(path)
    fixed = {k.removeprefix("module."): v for k, v in safetensors_torch.load_file(path / "model.safetensors").items()}
    _close(ft.nn.from_hf(model.config, fixed)(IDS), own, 1e-5)


def test_load_torch_state_dict_names_a_stack_members_refused_dtype_by_its_torch_name(tmp_path):
    """The report says "names as torch spells them"; a Stack member's dtype was reported under
    functree's key path (``self_attn.key_projection``)."""
    model = ft.nn.from_hf(_saved(_llama(), tmp_path))
    sd = _llama().state_dict()
    k = "model.layers.1.self_attn.k_proj.weight"
    sd[k] = sd[k].to(torch.int8)
    with pytest.raises(ValueError, match=rf"\n  {re.escape(k)}: expected dtype float32, given dtype int8") as e:
        ft.nn.load_torch_state_dict(model, sd)
    assert "key_projection" not in str(e.value)

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_or_infinite_weight_reads_as_the_file_holds_it(tmp_path, value):
    """HF loads such a weight too (its CPU attention kernel then gives finite logits from NaN
    queries, functree NaN: the file's numbers, not another model's)."""
    path = _saved(_llama(), tmp_path, lambda sd: {**sd, "model.norm.weight": torch.full((16,), value)})
    model = ft.nn.from_hf(path)
    np.testing.assert_array_equal(np.asarray(model.model.norm.scale), np.full(16, value, np.float32))  # (NaN too)


@pytest.mark.parametrize("make, prefix, tie", [(_llama, "model.", False), (_llama, "model.", True),
                                               (_gpt2, "transformer.", True)])
def test_weights_under_a_second_base_model_prefix_read_as_transformers_reads_them(tmp_path, make, prefix, tie):
    """``model.model.layers.0...`` and ``model.lm_head.weight`` (a causal LM saved as a wrapper's
    ``model``): transformers strips the base model's prefix where the rest is the model's
    name; functree refused them as a config with too many layers."""
    model = make()
    if tie:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    path = _saved(model, tmp_path, lambda sd: {prefix + k: v for k, v in sd.items()})
    with torch.no_grad():
        own = model(torch.tensor(IDS)).logits.numpy()
    theirs = _hf_logits(path)
    _close(theirs, own, 1e-6)
    _close(ft.nn.from_hf(path)(IDS), theirs, 1e-5)


def _recorded_copy(path, name, held):
    """``path``'s model.safetensors without ``name``, its ``__metadata__`` naming it a copy of
    ``held`` (safetensors.torch.save_model's record of a tensor stored once for two names)."""
    file = path / "model.safetensors"
    tensors = safetensors_torch.load_file(file)
    tensors.pop(name, None)  # (a tied head: save_pretrained wrote none)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt", name: held})
    return path


@pytest.mark.parametrize("name, held", [("lm_head.weight", "model.embed_tokens.weight"),
                                        ("model.norm.weight", "model.layers.1.post_attention_layernorm.weight")])
def test_a_weight_only_a_metadata_record_supplies_is_refused_naming_it(tmp_path, name, held):
    """transformers' from_pretrained reads no ``__metadata__`` copy: the untied head (or norm)
    is drawn at random (missing); functree read the embedding as the head, silently another
    model."""
    path = _recorded_copy(_saved(_llama(), tmp_path), name, held)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert name in info["missing_keys"]
    with pytest.raises(ValueError, match=(
            rf"(?s)the checkpoint holds no '{re.escape(name)}'; the metadata of .*model.safetensors names it a copy "
            rf"of '{re.escape(held)}' \(shape \(\d+(, 16)?,?\), float32.*transformers' from_pretrained does not "
            rf"read that record: it draws '{re.escape(name)}' at random.*wrong:  '{re.escape(name)}' from the record.*"
            rf"weights\['{re.escape(name)}'\] = weights\['{re.escape(held)}'\]")) as e:
        ft.nn.from_hf(path)
    assert ("tie_word_embeddings" in str(e.value)) == (name == "lm_head.weight")


def test_a_sharded_index_whose_metadata_alone_supplies_a_weight_is_refused_naming_it(tmp_path):
    path = tmp_path / "sharded"
    _llama().save_pretrained(path, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"].pop("lm_head.weight")
    tensors = safetensors_torch.load_file(shard)
    del tensors["lm_head.weight"]
    safetensors_torch.save_file(tensors, shard, metadata={"format": "pt"})
    index["metadata"]["lm_head.weight"] = "model.embed_tokens.weight"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"the checkpoint holds no 'lm_head.weight'; the metadata of .*"
                                         r"model.safetensors.index.json names it a copy of 'model.embed_tokens.weight'"):
        ft.nn.from_hf(path)


def test_a_tied_heads_metadata_record_reads_as_transformers_ties_it(tmp_path):
    model = _llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    path = _recorded_copy(_saved(model, tmp_path), "lm_head.weight", "model.embed_tokens.weight")
    _close(ft.nn.from_hf(path)(IDS), _hf_logits(path), 1e-5)


@pytest.mark.parametrize("names", [[Q], [Q, "model.layers.1.mlp.down_proj.weight"]])
def test_a_tensor_one_layer_lacks_is_refused_naming_the_layer_that_holds_it(tmp_path, names):
    """transformers draws a layer's lost tensor at random; functree refused the weights
    asking for the config saved with them, which is the directory's own."""
    path = _saved(_llama(), tmp_path, lambda sd: {k: v for k, v in sd.items() if k not in names})
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set(names)
    other = names[0].replace(".0.", ".1.") if ".0." in names[0] else names[0].replace(".1.", ".0.")
    with pytest.raises(ValueError, match=(
            rf"(?s)missing from the weights: '{re.escape(names[0])}', which the other layers hold \('{re.escape(other)}': "
            rf"shape \(16, 16\), float32\){'; so are ' if len(names) > 1 else ''}.*the config is its own.*"
            rf"draws it at random.*wrong:  no '{re.escape(names[0])}'\n    right:  '{re.escape(names[0])}': "
            rf"shape \(16, 16\)")) as e:
        ft.nn.from_hf(path)
    assert "config saved with these weights" not in str(e.value)


def test_a_tensor_every_layer_lacks_still_names_the_config(tmp_path):
    """Every layer without its biases is a config's switch (attention_bias), not a lost tensor."""
    path = _saved(_llama(), tmp_path, lambda sd: {k: v for k, v in sd.items() if "q_proj" not in k})
    with pytest.raises(ValueError, match="give the config saved with these weights"):
        ft.nn.from_hf(path)


def test_a_peft_models_state_dict_under_its_prefix_is_named_a_peft_model():
    """A PeftModel's state_dict (base_model.model.*, LoRA's lora_A beside base_layer): named
    a PEFT model, not a prefix to strip (nor a config with too many layers)."""
    peft = pytest.importorskip("peft")
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (peft's deprecation warnings of transformers' names)
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"(?s)holds PEFT LoRA layers .*merge_and_unload"):
        ft.nn.from_hf(model.config, wrapped.state_dict())


@pytest.mark.parametrize("file_dtype, dtype, value", [
    (torch.float64, "float32", 1e39),   # transformers keeps a float64 model where config.json names no dtype
    (torch.float32, "float16", 1e5),    # a float32 file read as float16
])
def test_a_value_the_dtype_read_cannot_hold_is_refused_naming_the_tensor(tmp_path, file_dtype, dtype, value):
    def change(tensors):
        tensors = {k: v.to(file_dtype) for k, v in tensors.items()}
        tensors["model.norm.weight"][0] = value
        return tensors
    path = _saved(_llama(), tmp_path, change)
    with pytest.raises(ValueError) as e:
        ft.nn.from_hf(path, dtype=np.dtype(dtype))
    for words in ("'model.norm.weight'", f"{str(file_dtype).removeprefix('torch.')}, shape (16,)", repr(value),
                  f"beyond {dtype}'s largest finite value", "wrong:", "right:"):
        assert words in str(e.value)
