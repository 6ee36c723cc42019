"""ft.hf.save_lora / load_lora against PEFT: the adapters of ``ft.nn.lora`` as PEFT's files.

The reference is PEFT itself: tiny Hugging Face models built from configs with random
weights (no download) are ported with ``ft.nn.from_hf``, given adapters, saved with
``save_lora`` and loaded with ``peft.PeftModel.from_pretrained``; the logits must agree to
float32 rounding (atol 2.5e-5 times the logits' magnitude, as in test_nn_lora). The other
way, a ``PeftModel``'s own ``save_pretrained`` directory is read with ``load_lora``; fused
projections, ``all-linear``, ``modules_to_save``, rank and alpha patterns, damaged and
half-written files. The model and fixtures are test_nn_lora's.
"""

import copy
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from test_nn_lora import (
    QV,
    VOCAB,
    D,
    assert_close,
    hf_logits,
    llama,
    logits,
    tokens,
    train_adapters,
)

import functree as ft
from functree.hf import _names
from functree.nn import _lora

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# transformers' own deprecation, raised inside peft.PeftModel's constructor
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def hf():
    return llama()


@pytest.fixture(scope="module")
def base(hf):
    return ft.nn.from_hf(hf)


@pytest.fixture(scope="module")
def trained(base):
    return train_adapters(base)


def test_save_lora_loads_in_peft_with_equal_logits(hf, base, trained, tmp_path):
    model, _, _ = trained
    ft.nn.save_lora(model, tmp_path, base_model_name_or_path="tiny-llama")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == ("LORA", 4, 8.0, "CAUSAL_LM")
    assert config["target_modules"] == sorted(f"model.layers.{i}.{m}" for i in range(2)
                                              for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    peft_model = peft.PeftModel.from_pretrained(llama(), str(tmp_path)).eval()  # a fresh copy: peft edits it
    ids = tokens()
    expected = hf_logits(peft_model, ids)
    assert not np.allclose(expected, hf_logits(hf, ids), atol=1e-3)  # the adapters change the logits
    assert_close(logits(model, ids), expected)
    loaded = ft.nn.load_lora(base, tmp_path)  # and back
    assert jax.tree.structure(loaded) == jax.tree.structure(model)
    assert np.array_equal(logits(loaded, ids), logits(model, ids))


def test_load_lora_reads_peft_save_pretrained(tmp_path):
    hf = llama(seed=1)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "up_proj"], layers_to_transform=[1],
                             rank_pattern={"up_proj": 2}, alpha_pattern={"up_proj": 3})
    peft_model = peft.get_peft_model(llama(seed=1), config)
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B trained away from zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft_model.save_pretrained(str(tmp_path))
    model = ft.nn.load_lora(ft.nn.from_hf(hf), tmp_path)
    up = model.model.layers.layers.mlp.up_proj
    assert up.lora_a.shape == (2, D, 2) and up.scale == 1.5
    assert not np.any(np.asarray(up.lora_b[0])) and np.any(np.asarray(up.lora_b[1]))  # block 0: no adapter in the file
    ids = tokens()
    assert_close(logits(model, ids), hf_logits(peft_model.eval(), ids))


def test_save_and_load_errors(tmp_path, base):
    with pytest.raises(ValueError, match="holds no LoraDense layer"):
        ft.nn.save_lora(base, tmp_path)
    with pytest.raises(ValueError, match=r"not a PEFT LoRA adapter directory: no adapter_config\.json"):
        ft.nn.load_lora(base, tmp_path)
    other = ft.nn.Sequential(ft.nn.Dense(D, D, key=jax.random.key(0)))
    ft.nn.save_lora(ft.nn.lora(other, "*", rank=2, key=jax.random.key(0)), tmp_path)
    with pytest.raises(ValueError, match=r"holds tensors for \['0'\], which name no Dense layer"):
        ft.nn.load_lora(base, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="sets use_dora=True"):
        ft.nn.load_lora(other, tmp_path)
    for option, value in [("alora_invocation_tokens", [3, 4]), ("init_lora_weights", "mica"), ("bias", "all")]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, option: value}))
        with pytest.raises(ValueError, match=rf"sets {option}={value!r}".replace("[", r"\[")):
            ft.nn.load_lora(other, tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": "gaussian"}))
    adapted = ft.nn.load_lora(other, tmp_path)
    assert isinstance(adapted.layers[0], ft.nn.LoraDense)  # an initialization only
    with pytest.raises(ValueError, match=r"(?s)ft.nn.load_lora: the adapter in .*, which holds adapters\s+already.*load_lora\(base_model"):
        ft.nn.load_lora(adapted, tmp_path)  # it named ft.nn.lora's pattern error
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'base_model.model.0.lora_A.weight' has shape"):
        ft.nn.load_lora(ft.nn.Sequential(ft.nn.Dense(D + 1, D, key=jax.random.key(0))), tmp_path)


def normal(seed, shape):
    """Standard normal float32 values drawn in NumPy (a jax.random draw compiles a program per shape)."""
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def gpt2_hf():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def gpt2():
    return ft.nn.from_hf(gpt2_hf())


def test_gpt2_conv1d_layers_save_with_fan_in_fan_out(gpt2, tmp_path):
    model = ft.nn.lora(gpt2, ["*.mlp.c_fc", "*.attn.c_proj"], rank=2, alpha=4, key=jax.random.key(0))
    for name in ("transformer.h.layers.mlp.c_fc.lora_b", "transformer.h.layers.attn.output_projection.lora_b"):
        value = ft.get(model, name)
        model = ft.set(model, name, jnp.asarray(0.3 * normal(1, value.shape)))
    ft.nn.save_lora(model, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    peft_model = peft.PeftModel.from_pretrained(gpt2_hf(), str(tmp_path)).eval()
    ids = tokens()
    assert_close(logits(model, ids), hf_logits(peft_model, ids))


def test_torch_names_are_cached_per_tree_definition(base):
    _names._TORCH_NAMES.clear()
    first = _names.torch_names(base)
    assert _names.torch_names(jax.tree.map(lambda x: x, base)) is first


def _sequential(n_out):
    return ft.nn.Sequential(ft.nn.Dense(4, 4, key=jax.random.key(0)), ft.nn.Dense(4, n_out, key=jax.random.key(1)))


def _adapted(n_out):
    model = ft.nn.lora(_sequential(n_out), "*", rank=2, key=jax.random.key(2))
    return ft.set(model, "layers.1.lora_b", jnp.asarray(0.3 * normal(3, (2, n_out))))


def test_torch_names_follow_the_leaf_shapes_not_the_tree_definition_alone(tmp_path):
    """The names were cached per tree definition, which a Dense(4, 2) and a Dense(4, 3) head
    share: after the 2-output model (a notebook's first cell), ``save_lora`` of the 3-output
    one failed in numpy ("value array of shape (3,2) could not be broadcast ...") and
    ``load_lora`` refused its valid adapter as one for "(4 inputs, 2 outputs)". The
    reference: the fresh-cache save (equal tensors), and PEFT on the torch model."""
    _names._TORCH_NAMES.clear()
    ft.nn.save_lora(_adapted(3), tmp_path / "fresh")  # as a fresh process saves it
    _names._TORCH_NAMES.clear()
    ft.nn.save_lora(_adapted(2), tmp_path / "two")  # the cache holds the 2-output model's names
    ft.nn.save_lora(_adapted(3), tmp_path / "three")
    fresh, three = (safetensors.numpy.load_file(tmp_path / d / "adapter_model.safetensors") for d in ("fresh", "three"))
    assert fresh.keys() == three.keys() and all(np.array_equal(fresh[k], three[k]) for k in fresh)
    _names._TORCH_NAMES.clear()
    ft.nn.lora(_sequential(2), "*", rank=2, key=jax.random.key(2))  # the cache again holds the 2-output names
    loaded = ft.nn.load_lora(_sequential(3), tmp_path / "three")
    torch_model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    state = ft.interop.torch_state_dict(_sequential(3), numpy=True)
    torch_model.load_state_dict({k: torch.tensor(np.array(v)) for k, v in state.items()})
    peft_model = peft.PeftModel.from_pretrained(torch_model, str(tmp_path / "three")).eval()
    x = normal(4, (5, 4))
    with torch.no_grad():
        expected = peft_model(torch.tensor(x)).numpy()
    apply = jax.jit(lambda m, v: m(v))  # one program per model structure, not one per operation and shape
    assert not np.allclose(expected, np.asarray(apply(_sequential(3), x)), atol=1e-2)  # the adapter changes the outputs
    assert_close(apply(loaded, x), expected)
    assert_close(apply(_adapted(3), x), expected)


DECODER = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=2 * D, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)


@pytest.mark.parametrize(("config", "fused"), [
    (lambda: transformers.Qwen2Config(**DECODER), ()),
    (lambda: transformers.GemmaConfig(**DECODER, head_dim=8), ()),
    (lambda: transformers.Phi3Config(**DECODER), ("qkv_proj",)),
    (lambda: transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=2 * D, rotary_pct=0.5, bos_token_id=0, eos_token_id=0),
     ("query_key_value",)),
    (lambda: transformers.OPTConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                    ffn_dim=2 * D, bos_token_id=0, eos_token_id=0, pad_token_id=1), ()),
    (lambda: gemma3_config(), ()),
], ids=["qwen2", "gemma", "phi3", "gpt_neox", "opt", "gemma3_text"])
def test_every_dense_layer_finds_its_hf_module(config, fused):
    """Each Dense member of a from_hf model (abstract: no weights) names its own torch.nn.Linear
    of the Hugging Face model, or a fused one shared with its siblings (which save_lora refuses)."""
    config = config()
    model = jax.eval_shape(lambda: ft.nn.from_hf(config, key=jax.random.key(0)))
    is_hf, names, _, _ = _names.torch_names(model)
    linears = {n for n, m in transformers.AutoModelForCausalLM.from_config(config).named_modules()
               if isinstance(m, torch.nn.Linear)}
    layers = [m for layer in _lora.dense_layers(model) for m in _lora.member_layer_names(layer)]
    assert is_hf and set(names) == set(layers)
    for member, found in names.items():
        assert found.module in linears and found.transposed, (member, found)
        assert bool(found.shared_with) == found.module.endswith(fused), (member, found)


def randomized(build):
    """``build()``'s model (the same weights each call) moved away from HF's small
    initialization (logits of order 1)."""
    torch.manual_seed(0)
    hf = build()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf.eval()


def neox_hf():
    return randomized(lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * D,
        rotary_pct=0.5, bos_token_id=0, eos_token_id=0)))


def gemma3_config():
    """Gemma 3's text config: layers sliding (window 3), full; local rope base 100, global 1000."""
    return transformers.Gemma3TextConfig(**DECODER, head_dim=8, sliding_window=3, sliding_window_pattern=2,
                                         query_pre_attn_scalar=6, rope_local_base_freq=100.0, rope_theta=1000.0)


def gemma3_hf():
    return randomized(lambda: transformers.Gemma3ForCausalLM(gemma3_config()))


def phi3_hf():
    return randomized(lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**DECODER)))


def peft_adapter(make_hf, directory, **options):
    """A PEFT LoRA on a fresh ``make_hf()`` with random non-zero A and B, saved by PEFT."""
    torch.manual_seed(2)
    peft_model = peft.get_peft_model(make_hf(), peft.LoraConfig(init_lora_weights=False, **options)).eval()
    peft_model.save_pretrained(str(directory))
    return peft_model


def edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(("make_hf", "fused"), [(gpt2_hf, "c_attn"), (neox_hf, "query_key_value"),
                                                (phi3_hf, "qkv_proj")], ids=["gpt2", "gpt_neox", "phi3"])
def test_fused_projection_adapters_load_and_save_as_peft_does(make_hf, fused, tmp_path):
    """PEFT's one adapter on a fused q|k|v projection (one A, B's rows the members' outputs in
    the fused layout: GPT-NeoX interleaves them per head) is each member's A and rows of B;
    saved back it is PEFT's tensors again, and once the members' A differ, the exact block form."""
    peft_model = peft_adapter(make_hf, tmp_path / "peft", r=4, lora_alpha=8, target_modules=[fused],
                              fan_in_fan_out=fused == "c_attn")  # GPT-2's Conv1D
    ids = tokens()
    expected = hf_logits(peft_model, ids)
    base = ft.nn.from_hf(make_hf())
    assert not np.allclose(expected, hf_logits(make_hf(), ids), atol=1e-2)  # the adapter changes the logits
    model = ft.nn.load_lora(base, tmp_path / "peft")
    assert_close(logits(model, ids), expected)
    ft.nn.save_lora(model, tmp_path / "ft")
    ours = safetensors.numpy.load_file(str(tmp_path / "ft" / "adapter_model.safetensors"))
    theirs = safetensors.numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert set(ours) == set(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in theirs)  # bit for bit
    # the members trained apart: q's A moved, k has no adapter of its own any more
    attention = next(n for n in ft.to_flat_dict(model) if n.endswith("query_projection.lora_a")).rpartition(".")[0]
    attention = attention.rpartition(".")[0]
    moved = ft.set(model, f"{attention}.query_projection.lora_a",
                   ft.get(model, f"{attention}.query_projection.lora_a") * 1.5)
    moved = ft.set(moved, f"{attention}.key_projection.lora_b", jnp.zeros_like(ft.get(moved, f"{attention}.key_projection.lora_b")))
    ft.nn.save_lora(moved, tmp_path / "apart")
    config = json.loads((tmp_path / "apart" / "adapter_config.json").read_text())
    assert set(config["rank_pattern"].values()) == {12} or config["r"] == 12  # A stacked: rank 3 r
    again = peft.PeftModel.from_pretrained(make_hf(), str(tmp_path / "apart")).eval()
    assert_close(logits(moved, ids), hf_logits(again, ids))


@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
def test_fused_members_trained_apart_load_back_with_their_own_rank(trained, tmp_path):
    """GPT-2's q, k, v adapters (each its own A) save as the block form, rank 3r; loaded,
    each member took all of A (rank 3r, growing 2 -> 6 -> 18 at every save and load), so
    training resumed from the file was not the training saved (losses 4.1719 for 4.1733 two
    steps later). Each member now gets its own columns back: equal leaves, equal files."""
    model = ft.nn.lora(ft.nn.from_hf(gpt2_hf()), "*.attn.*_projection", rank=2, alpha=4, key=jax.random.key(1))
    if trained:
        leaves = {n: v for n, v in ft.to_flat_dict(model).items() if n.endswith("lora_b")}
        model = ft.from_flat_dict(model, {**ft.to_flat_dict(model), **{
            n: jnp.asarray(normal(i, v.shape)) for i, (n, v) in enumerate(leaves.items())}})
    ft.nn.save_lora(model, tmp_path / "one")
    config = json.loads((tmp_path / "one" / "adapter_config.json").read_text())
    assert config["r"] == 6  # the block form: A stacked
    loaded = ft.nn.load_lora(ft.nn.from_hf(gpt2_hf()), tmp_path / "one")
    ours, theirs = ft.to_flat_dict(model), ft.to_flat_dict(loaded)
    for name, value in ours.items():
        if "lora_" in name:
            np.testing.assert_array_equal(theirs[name], value, err_msg=name)  # rank 2, bit for bit
    ft.nn.save_lora(loaded, tmp_path / "two")
    first, second = (safetensors.numpy.load_file(str(tmp_path / d / "adapter_model.safetensors"))
                     for d in ("one", "two"))
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)
    ids = tokens()
    again = peft.PeftModel.from_pretrained(gpt2_hf(), str(tmp_path / "two")).eval()
    assert_close(logits(loaded, ids), hf_logits(again, ids))


def test_a_block_form_without_the_record_splits_where_b_shows_the_blocks(tmp_path):
    """Files written before the record (or by hand): each member's rows of B nonzero in its
    own columns alone is the block form too; a shared A stays shared."""
    model = ft.nn.lora(ft.nn.from_hf(gpt2_hf()), "*.attn.*_projection", rank=2, alpha=4, key=jax.random.key(1))
    flat = ft.to_flat_dict(model)
    model = ft.from_flat_dict(model, {**flat, **{n: jnp.ones_like(v) for n, v in flat.items() if n.endswith("lora_b")}})
    ft.nn.save_lora(model, tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    tensors = safetensors.numpy.load_file(str(weights))
    safetensors.numpy.save_file(tensors, str(weights), metadata={"format": "pt"})  # no record of any kind
    loaded = ft.nn.load_lora(ft.nn.from_hf(gpt2_hf()), tmp_path)
    name = next(n for n in ft.to_flat_dict(loaded) if n.endswith("query_projection.lora_a"))
    assert ft.get(loaded, name).shape[-1] == 2
    np.testing.assert_array_equal(ft.get(loaded, name), ft.get(model, name))


@pytest.mark.parametrize("make_hf", [llama, gpt2_hf, gemma3_hf], ids=["llama", "gpt2", "gemma3_text"])
def test_all_linear_adapts_what_peft_adapts(make_hf, tmp_path):
    """PEFT's "all-linear": every Linear / Conv1D but the output head (GPT-2's fused c_attn
    included); saved, the config lists the same modules PEFT's would."""
    peft_model = peft.get_peft_model(make_hf(), peft.LoraConfig(target_modules="all-linear",
                                                                fan_in_fan_out=make_hf is gpt2_hf))
    wanted = set(peft_model.peft_config["default"].target_modules)
    port = ft.nn.from_hf(make_hf())  # read by both (modules are immutable)
    model = ft.nn.lora(port, "all-linear", rank=2, key=jax.random.key(0))
    ft.nn.save_lora(model, tmp_path)
    assert set(json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]) == wanted
    assert "lm_head" not in wanted and len(wanted) > 4
    # a PEFT adapter whose config says "all-linear" (PEFT's own saves list the modules it found)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft_model.eval().save_pretrained(str(tmp_path / "peft"))
    edit_config(tmp_path / "peft", target_modules="all-linear")
    ids = tokens()
    loaded = ft.nn.load_lora(port, tmp_path / "peft")
    assert_close(logits(loaded, ids), hf_logits(peft_model, ids))


def test_one_member_of_a_fused_projection_saves_as_peft_reads_it(tmp_path):
    """An adapter on GPT-2's query projection alone is PEFT's c_attn adapter with zero k, v rows."""
    model = ft.nn.lora(ft.nn.from_hf(gpt2_hf()), "*.attn.query_projection", rank=2, alpha=4, key=jax.random.key(1))
    name = "transformer.h.layers.attn.query_projection.lora_b"
    model = ft.set(model, name, jnp.asarray(normal(2, ft.get(model, name).shape)))
    ft.nn.save_lora(model, tmp_path)
    b = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))[
        "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert b.shape == (3 * D, 2) and np.any(b[:D]) and not np.any(b[D:])
    peft_model = peft.PeftModel.from_pretrained(gpt2_hf(), str(tmp_path)).eval()
    ids = tokens()
    assert_close(logits(model, ids), hf_logits(peft_model, ids))


def test_alpha_zero_with_an_alpha_pattern_and_rslora_load_as_peft(tmp_path, base):
    ids = tokens()
    for name, options in [("zero", dict(lora_alpha=0, alpha_pattern={"v_proj": 16})),
                          ("rslora", dict(lora_alpha=6, use_rslora=True))]:
        peft_model = peft_adapter(llama, tmp_path / name, r=4, target_modules=["q_proj", "v_proj"], **options)
        model = ft.nn.load_lora(base, tmp_path / name)  # was: ZeroDivisionError
        assert_close(logits(model, ids), hf_logits(peft_model, ids))
        ft.nn.save_lora(model, tmp_path / f"{name}_back")
        again = peft.PeftModel.from_pretrained(llama(), str(tmp_path / f"{name}_back")).eval()
        assert_close(hf_logits(again, ids), hf_logits(peft_model, ids))


def test_load_lora_follows_the_config_not_the_file(tmp_path, base):
    """The file holds q and v; configs that select other modules or ranks than the file's are
    refused (PEFT: loads a subset silently, or its size-mismatch error, or ZeroDivisionError)."""
    peft_adapter(llama, tmp_path, r=4, target_modules=["q_proj", "v_proj"])
    edit_config(tmp_path, target_modules=["q_proj"])  # was: v applied too (logits 0.25 from PEFT's)
    with pytest.raises(ValueError, match=r"(?s)holds tensors for \['model.layers.0.self_attn.v_proj'.*"
                                         r"does not select.*\"target_modules\": \["):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, target_modules=["o_prj"])
    with pytest.raises(ValueError, match=r"target_modules=\['o_prj'\] selects no module of this model"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, target_modules=["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"selects \['model.layers.0.self_attn.k_proj'.*holds no lora_A / lora_B"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, target_modules=["q_proj", "v_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"selects \['model.embed_tokens'\], which is not a Dense layer"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, target_modules=["q_proj", "v_proj"], r=8)  # was: the rank taken from the tensors
    with pytest.raises(ValueError, match=r"lora_A.weight' has shape \(\(4, 16\), \(16, 4\)\).*r = 8 \(the config's r\)"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, r=4, rank_pattern={"v_proj": 2})
    with pytest.raises(ValueError, match=r"v_proj.lora_A.weight' has shape.*r = 2 \(rank_pattern\['v_proj'\]\)"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, r=0, rank_pattern={})  # was: ZeroDivisionError
    with pytest.raises(ValueError, match=r"sets r=0: a rank is a positive int"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, r=4, target_modules="model\\.layers\\.1\\.self_attn\\.[qv]_proj")  # a regex: layer 1 only
    with pytest.raises(ValueError, match=r"holds tensors for \['model.layers.0.self_attn.q_proj'"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    with pytest.raises(ValueError, match=r"does not select"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, layers_to_transform=None, exclude_modules=["model.layers.1.self_attn.v_proj"])
    with pytest.raises(ValueError, match=r"holds tensors for \['model.layers.1.self_attn.v_proj'\]"):
        ft.nn.load_lora(base, tmp_path)
    edit_config(tmp_path, exclude_modules=None)
    assert isinstance(ft.nn.load_lora(base, tmp_path).model.layers.layers.self_attn.value_projection, ft.nn.LoraDense)


@pytest.mark.parametrize(("option", "value"), [("layers_to_transform", [1]), ("layers_pattern", "layers")])
def test_a_layer_selection_beside_a_regex_target_is_refused_as_peft_refuses_it(base, tmp_path, option, value):
    """target_modules a regex with layers_to_transform / layers_pattern: PEFT's LoraConfig
    refuses it; load_lora put the adapters on every layer the regex matched (both, here)."""
    regex = r".*\.(q|v)_proj"
    peft_adapter(llama, tmp_path, r=4, lora_alpha=8, target_modules=regex)
    edit_config(tmp_path, **{option: value})
    with pytest.raises(ValueError, match=rf"`{option}` cannot be used when `target_modules` is a str"):
        peft.LoraConfig.from_pretrained(str(tmp_path))  # the reference
    with pytest.raises(ValueError, match=rf"(?s)adapter_config.json in .* sets {option}={re.escape(repr(value))}: .*regular "
                                         rf"expression {re.escape(repr(regex))}.*PEFT refuses it too.*"
                                         r"right:  \"target_modules\": \[\"q_proj\", \"v_proj\"\]"):
        ft.nn.load_lora(base, tmp_path)


def test_layers_pattern_without_layers_to_transform_is_refused_as_peft_refuses_it(base, tmp_path):
    """layers_pattern alone selects no layer numbers: PEFT's LoraConfig refuses it; load_lora
    read past it and put the adapters on every layer."""
    peft_adapter(llama, tmp_path, r=2, target_modules=["q_proj"])
    edit_config(tmp_path, layers_pattern="layers")
    with pytest.raises(ValueError, match="`layers_to_transform` must also be specified"):
        peft.LoraConfig.from_pretrained(str(tmp_path))  # the reference
    with pytest.raises(ValueError, match=r"(?s)sets layers_pattern='layers': .*layers_to_transform is null.*"
                                         r"right:  \"layers_to_transform\": \[0, 1\]"):
        ft.nn.load_lora(base, tmp_path)


def test_a_field_of_a_newer_peft_is_refused_by_name_unless_it_is_off(base, tmp_path):
    """A field PEFT 0.21's LoraConfig lacks (a newer PEFT's LoRA variant, an old one's
    enable_lora) set: UNKNOWN_OPTION naming it and its value; load_lora read past it, as PEFT
    0.21 does with a warning, and gave plain LoRA's logits for what may be another model.
    Null, false or empty, it is off and loads."""
    peft_adapter(llama, tmp_path, r=2, target_modules=["q_proj"])
    plain = ft.nn.load_lora(base, tmp_path)
    for value in (None, False, [], {}):
        edit_config(tmp_path, use_newer_variant=value)
        assert jax.tree.structure(ft.nn.load_lora(base, tmp_path)) == jax.tree.structure(plain)
    for option, value in (("use_newer_variant", True), ("enable_lora", [True, False, True]), ("newer_config", {"k": 2})):
        edit_config(tmp_path, **{"use_newer_variant": None, option: value})
        with pytest.raises(ValueError, match=rf"(?s)sets {option}={re.escape(repr(value))}, a field PEFT 0.21's "
                                             rf"LoraConfig does not have.*wrong:  \"{option}\": "
                                             rf"{re.escape(json.dumps(value))}\n    right:  \"{option}\": null.*"
                                             r"merge_and_unload"):
            ft.nn.load_lora(base, tmp_path)
        edit_config(tmp_path, **{option: None})


def test_integer_and_damaged_adapter_files_are_refused(tmp_path, base):
    peft_adapter(llama, tmp_path, r=2, target_modules=["q_proj"])
    path = tmp_path / "adapter_model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    safetensors.numpy.save_file({**tensors, name: (tensors[name] * 10).astype(np.int32)}, str(path))
    with pytest.raises(ValueError, match=rf"'{name}' holds int32 numbers; an adapter's tensors are floating"):
        ft.nn.load_lora(base, tmp_path)  # was: lora_B cast to int32, the update truncated
    safetensors.numpy.save_file(tensors, str(path))
    path.write_bytes(path.read_bytes()[:-8])  # truncated
    with pytest.raises(ValueError, match=r"load_lora: '.*adapter_model.safetensors' is not a .safetensors file"):
        ft.nn.load_lora(base, tmp_path)


def test_modules_to_save_lm_head_loads_and_saves_as_peft(tmp_path, base):
    """PEFT's modules_to_save=["lm_head"]: the trained head's full weight beside the adapters
    (base_model.model.lm_head.weight) replaces the head; saved back the same way."""
    torch.manual_seed(3)
    peft_model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                                              init_lora_weights=False)).eval()
    with torch.no_grad():  # the head trained
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    ids = tokens()
    expected = hf_logits(peft_model, ids)
    model = ft.nn.load_lora(base, tmp_path / "peft")
    assert_close(logits(model, ids), expected)
    ft.nn.save_lora(model, tmp_path / "ft", modules_to_save="lm_head")  # a str: one module's name, written as a one-item list
    assert json.loads((tmp_path / "ft" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    again = peft.PeftModel.from_pretrained(llama(), str(tmp_path / "ft")).eval()
    assert_close(hf_logits(again, ids), expected)
    gpt2 = ft.nn.lora(ft.nn.from_hf(gpt2_hf()), "*.c_fc", rank=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"names 'lm_head', which is not a Dense layer of its own here \(a tied head"):
        ft.nn.save_lora(gpt2, tmp_path / "tied", modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"names 'classifier', which is no module of this model"):
        ft.nn.save_lora(model, tmp_path / "none", modules_to_save=["classifier"])


def test_modules_to_save_naming_no_module_is_skipped_as_peft_skips_it(tmp_path, base):
    """PEFT's SEQ_CLS adapters always list ["classifier", "score"], one of which the model
    lacks; PEFT skips such an entry (_set_trainable), and so does load_lora (it refused the
    file). save_lora writes the entries found; its own argument naming nothing is an error."""
    peft_model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                              modules_to_save=["lm_head", "score"],
                                                              init_lora_weights=False)).eval()
    with torch.no_grad():
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.1)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head", "score"]
    ids = tokens()
    expected = hf_logits(peft.PeftModel.from_pretrained(llama(), str(tmp_path / "peft")).eval(), ids)
    assert_close(expected, hf_logits(peft_model, ids))
    model = ft.nn.load_lora(base, tmp_path / "peft")
    assert_close(logits(model, ids), expected)
    ft.nn.save_lora(model, tmp_path / "ft")
    assert json.loads((tmp_path / "ft" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    assert_close(hf_logits(peft.PeftModel.from_pretrained(llama(), str(tmp_path / "ft")).eval(), ids), expected)
    with pytest.raises(ValueError, match=r"save_lora: modules_to_save names 'score', which is no module of this model"):
        ft.nn.save_lora(model, tmp_path / "none", modules_to_save=["lm_head", "score"])


def test_a_loaded_head_is_saved_again_without_being_named(tmp_path, base):
    """An adapter loaded with modules_to_save (a head trained in full) and trained further
    goes back out with its head: save_lora's modules_to_save defaults to the loaded
    adapter's (the adapters record it), so PEFT does not get the base's head back. [] drops
    it, said explicitly; a checkpoint of the loaded model keeps the record."""
    torch.manual_seed(4)
    peft_model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                                              init_lora_weights=False)).eval()
    with torch.no_grad():
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    model = ft.nn.load_lora(base, tmp_path / "peft")
    assert model.model.layers.layers.self_attn.query_projection.saved_modules == ("lm_head",)
    model = ft.set(model, "lm_head.weight", model.lm_head.weight * 1.5)  # the head trained on
    ids = tokens()
    ft.nn.save_lora(model, tmp_path / "again")  # modules_to_save not named
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    again = peft.PeftModel.from_pretrained(llama(), str(tmp_path / "again")).eval()
    assert_close(hf_logits(again, ids), logits(model, ids))
    ft.nn.save_lora(model, tmp_path / "adapters", modules_to_save=[])  # said explicitly: adapters alone
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["modules_to_save"] is None
    assert not any("lm_head" in k for k in safetensors.numpy.load_file(str(tmp_path / "adapters" / "adapter_model.safetensors")))
    ft.train.save(tmp_path / "ckpt", model)
    restored = ft.train.load(tmp_path / "ckpt")
    assert restored.model.layers.layers.self_attn.query_projection.saved_modules == ("lm_head",)


def test_an_interrupted_save_is_refused_not_loaded(tmp_path, base, monkeypatch):
    """save_lora replaces the weights, then the config; a crash between leaves new weights
    beside the old config, which load_lora refuses (the weights record their config)."""
    small = ft.nn.lora(base, QV, rank=2, key=jax.random.key(0))
    small = ft.set(small, "model.layers.layers.self_attn.query_projection.lora_b",
                   jnp.ones_like(small.model.layers.layers.self_attn.query_projection.lora_b))
    ft.nn.save_lora(small, tmp_path)
    larger = ft.nn.lora(base, QV, rank=4, alpha=4, key=jax.random.key(1))
    replace, calls = os.replace, []

    def crash_on_config(source, target):
        calls.append(target)
        if str(target).endswith("adapter_config.json"):
            raise OSError("disk full")
        replace(source, target)

    monkeypatch.setattr(os, "replace", crash_on_config)
    with pytest.raises(OSError, match="disk full"):
        ft.nn.save_lora(larger, tmp_path)
    monkeypatch.undo()
    assert [os.path.basename(c) for c in calls] == ["adapter_model.safetensors", "adapter_config.json"]
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]  # no temporaries
    with pytest.raises(ValueError, match=r"(?s)not the config its adapter_model.safetensors was saved with: "
                                         r"r is 2 in the config, but the weights were written for 4"):
        ft.nn.load_lora(base, tmp_path)  # was: the new weights under the old scale (logits off by ~0.02)
    ft.nn.save_lora(small, tmp_path)
    edit_config(tmp_path, r=3)  # edited by hand
    with pytest.raises(ValueError, match=r"r is 3 in the config, but the weights were written for 2"):
        ft.nn.load_lora(base, tmp_path)


def test_a_config_peft_saved_again_in_its_own_order_loads(tmp_path, base):
    """PEFT holds target_modules as a set, so its LoraConfig.from_pretrained(d).save_pretrained(d)
    (a user changing base_model_name_or_path) writes them back in hash order: load_lora refused
    such a directory as an interrupted save ("target_modules is [...] in the config, but the
    weights were written for [...]"), though the modules are the same."""
    model = ft.nn.lora(base, QV, rank=2, key=jax.random.key(0))
    ft.nn.save_lora(model, tmp_path)
    listed = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    edit_config(tmp_path, target_modules=listed[::-1], base_model_name_or_path="my/base")
    loaded = ft.nn.load_lora(base, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True))
    edit_config(tmp_path, target_modules=listed[1:])  # another selection is still refused
    with pytest.raises(ValueError, match=r"target_modules is \[.*\] in the config, but the weights were written for"):
        ft.nn.load_lora(base, tmp_path)


def test_bfloat16_adapters_save_and_load(base, trained, tmp_path):
    """bfloat16 adapters are written as BF16 tensors (safetensors.numpy refuses them) and read back bit for bit."""
    model, _, _ = trained

    def bf16(a):  # cast in NumPy (ml_dtypes, round to nearest even as XLA): no program per shape
        return jnp.asarray(np.asarray(a).astype(jnp.bfloat16))

    half = jax.tree.map(lambda x: x.replace(lora_a=bf16(x.lora_a), lora_b=bf16(x.lora_b))
                        if isinstance(x, ft.nn.LoraDense) else x, model, is_leaf=lambda x: isinstance(x, ft.nn.LoraDense))
    ft.nn.save_lora(half, tmp_path)
    loaded = ft.nn.load_lora(base, tmp_path)
    layer = loaded.model.layers.layers.self_attn.query_projection
    assert layer.lora_b.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(layer.lora_b), np.asarray(half.model.layers.layers.self_attn.query_projection.lora_b))
    peft_model = peft.PeftModel.from_pretrained(llama(), str(tmp_path)).eval()
    ids = tokens()
    assert_close(logits(loaded, ids), hf_logits(peft_model, ids))


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`:UserWarning")  # PEFT's, saving
def test_an_adapter_on_lm_head_with_the_base_weight_peft_saves_beside_it(tmp_path, base):
    """PEFT's save_embedding_layers="auto" writes lm_head's base weight beside its adapter
    (``lm_head.base_layer.weight``): read when it is the model's own, refused when it is
    another (PEFT would load it over the model's); an adapted embedding is another kind."""
    peft_model = peft_adapter(llama, tmp_path / "head", r=2, target_modules=["q_proj", "lm_head"])
    file = tmp_path / "head" / "adapter_model.safetensors"
    tensors = safetensors.numpy.load_file(str(file))
    assert "base_model.model.lm_head.base_layer.weight" in tensors
    ids = tokens()
    model = ft.nn.load_lora(base, tmp_path / "head")
    assert_close(logits(model, ids), hf_logits(peft_model, ids))
    assert isinstance(model.lm_head, _lora.LoraDense)
    name = "base_model.model.lm_head.base_layer.weight"
    for changed, shown in ((tensors[name] + np.float32(0.5), f"shape ({VOCAB}, {D}) against ({VOCAB}, {D}), other values"),
                           (tensors[name][:40], f"shape (40, {D}) against ({VOCAB}, {D}))")):
        safetensors.numpy.save_file({**tensors, name: changed}, str(file))
        with pytest.raises(ValueError, match=re.escape(f"{name!r} is the base weight of 'lm_head'")) as info:
            ft.nn.load_lora(base, tmp_path / "head")
        assert shown in str(info.value) and "base_model_it_was_trained_on" in str(info.value)
    peft_adapter(llama, tmp_path / "embed", r=2, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"selects \['model.embed_tokens'\], which is not a Dense layer"):
        ft.nn.load_lora(base, tmp_path / "embed")


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga", "mica", "bogus"])
def test_initializations_that_change_the_base_weights_are_refused(tmp_path, init, base):
    """With PiSSA, CorDA, OLoRA, LoftQ and LoRA-GA PEFT rewrites the base layer's weight
    when it loads the adapter (W - scale B0 A0): the file's A and B do not apply to the
    base given, so loading them would be another model (measured: logits 0.04-0.07 off)."""
    peft_adapter(llama, tmp_path, r=2, target_modules=["q_proj"])
    edit_config(tmp_path, init_lora_weights=init)
    if init in ("mica", "bogus"):
        match = rf"sets init_lora_weights='{init}'; ft.nn.load_lora reads plain LoRA \(init_lora_weights=True"
    else:
        match = rf"sets init_lora_weights='{init}': with it PEFT changes the base model's own weights"
    with pytest.raises(ValueError, match=match) as info:
        ft.nn.load_lora(base, tmp_path)
    assert ("path_initial_model_for_weight_conversion" in str(info.value)) == (init.split("_")[0] in ("pissa", "olora",
                                                                                                       "corda"))
    for plain in (True, False, "Gaussian", "eva", "orthogonal"):
        edit_config(tmp_path, init_lora_weights=plain)
        ft.nn.load_lora(base, tmp_path)


@pytest.mark.filterwarnings("ignore:PiSSA changes the base weights:UserWarning")  # PEFT's, converting
def test_a_pissa_adapter_converted_by_peft_loads_as_peft_loads_it(tmp_path, base):
    """The fix the refusal names: PEFT's save with path_initial_model_for_weight_conversion
    writes plain LoRA (rank 2r) that applies to the unchanged base."""
    torch.manual_seed(4)
    peft_model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                              init_lora_weights="pissa"))
    peft_model.peft_config["default"].init_lora_weights = True  # PEFT's documented recipe for the initial save
    peft_model.save_pretrained(str(tmp_path / "initial"))
    peft_model.peft_config["default"].init_lora_weights = "pissa"
    with torch.no_grad():  # trained
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.add_(0.1 * torch.randn_like(p))
    peft_model.save_pretrained(str(tmp_path / "plain"), path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    peft_model.save_pretrained(str(tmp_path / "pissa"))
    ids = tokens()
    expected = hf_logits(peft.PeftModel.from_pretrained(llama(), str(tmp_path / "plain")).eval(), ids)
    assert_close(hf_logits(peft_model.eval(), ids), expected)  # the conversion keeps the model
    assert_close(logits(ft.nn.load_lora(base, tmp_path / "plain"), ids), expected)
    with pytest.raises(ValueError, match="init_lora_weights='pissa'"):
        ft.nn.load_lora(base, tmp_path / "pissa")


def _gpt2_config(tied=True):
    return transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=1, n_head=4, bos_token_id=0,
                                   eos_token_id=0, tie_word_embeddings=tied)


class _TorchTagger(torch.nn.Module):
    """A user's torch model holding a GPT-2 with its tied lm_head, and a Linear head."""

    def __init__(self):
        super().__init__()
        self.gpt = transformers.GPT2LMHeadModel(_gpt2_config())
        self.head = torch.nn.Linear(30, 3)

    def forward(self, ids):
        return self.head(self.gpt(ids).logits)


class _Tagger(ft.Module):
    gpt: object  # a port (a Callable annotation would mark it non-differentiable)
    head: ft.nn.Dense

    def __call__(self, ids):
        return self.head(self.gpt(ids))  # pyright: ignore[reportCallIssue]


@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning")  # PEFT's: Linear and Conv1D both
@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`:UserWarning")  # PEFT's, saving
@pytest.mark.filterwarnings("ignore:Could not identify embedding layer:UserWarning")
def test_all_linear_of_peft_on_a_tied_head_inside_a_model_names_the_heads_and_both_fixes(tmp_path):
    """PEFT's "all-linear" leaves out only a PreTrainedModel root's output head: on a user's
    model holding GPT-2 it adapts gpt.lm_head, the tied head (x @ wte^T), which no Dense
    layer holds here. Before, load_lora refused it with the fix for embeddings and norms
    ('"target_modules": ["q_proj", "v_proj"]'); now it names the tied heads and the two fixes,
    and both give PEFT's logits."""
    torch.manual_seed(0)
    reference = _TorchTagger().eval()
    ids = np.random.default_rng(0).integers(1, 30, (2, 7)).astype(np.int32)

    def peft_adapter(directory, **options):
        model = peft.get_peft_model(copy.deepcopy(reference), peft.LoraConfig(r=2, lora_alpha=4, **options))
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5)
        model.save_pretrained(directory)
        with torch.no_grad():
            return model.eval()(torch.from_numpy(ids).long()).numpy()

    built = {}  # each port built once: the tied one serves both of its loads (modules are immutable)

    def tagger(tied):
        if tied not in built:  # the port read from the GPT-2's weights (no build compiled), then the user's load
            port = ft.nn.from_hf(_gpt2_config(tied), reference.gpt.state_dict())
            tagged = _Tagger(port, ft.nn.Dense(30, 3, key=jax.random.key(1)))  # pyright: ignore[reportCallIssue]
            built[tied] = ft.nn.load_torch_state_dict(tagged, reference.state_dict())
        return built[tied]

    expected = peft_adapter(tmp_path / "all", target_modules="all-linear")
    with pytest.raises(ValueError, match=r"(?s)selects \['gpt.lm_head'\]: the tied output head of a Hugging Face port"
                                         r".*exclude_modules=\['gpt.lm_head'\].*\"tie_word_embeddings\": False"):
        ft.nn.load_lora(tagger(tied=True), tmp_path / "all")
    untied = ft.nn.load_lora(tagger(tied=False), tmp_path / "all")  # the second fix: the same logits as PEFT's
    np.testing.assert_allclose(np.asarray(logits(untied, ids)), expected, rtol=0, atol=2e-5 * float(np.abs(expected).max()))
    with torch.no_grad():  # the adapters move the outputs: a base without them would not pass
        base = reference(torch.from_numpy(ids).long()).numpy()
    assert np.abs(expected - base).max() > 0.1
    excluded = peft_adapter(tmp_path / "excluded", target_modules="all-linear", exclude_modules=["gpt.lm_head"])
    loaded = ft.nn.load_lora(tagger(tied=True), tmp_path / "excluded")  # the first fix
    np.testing.assert_allclose(np.asarray(logits(loaded, ids)), excluded, rtol=0, atol=2e-5 * float(np.abs(excluded).max()))


def test_a_peft_wrapped_model_is_refused_with_the_two_routes_that_load_it(tmp_path):
    """The issue: from_hf(peft_model) said ``right: ft.nn.from_hf(hf_model.model)``, which still
    holds the LoRA layers and then failed suggesting to drop the base_layer/lora_ tensors (the
    base q_proj weights and the adapter with them). Both right lines give PEFT's logits."""
    peft_model = peft.get_peft_model(llama(seed=2), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                      init_lora_weights=False)).eval()
    ids = tokens()
    expected = hf_logits(peft_model, ids)
    assert np.abs(expected - hf_logits(llama(seed=2), ids)).max() > 0.1  # the adapter moves the logits
    for given, name in ((peft_model, "PeftModel"), (peft_model.model, "LlamaForCausalLM")):
        with pytest.raises(ValueError, match=rf"(?s)the {name} given holds PEFT LoRA layers .*q_proj.base_layer.weight"
                                             r".*merge_and_unload\(\).*ft.nn.load_lora\("):
            ft.nn.from_hf(given)
    with pytest.raises(ValueError, match=r"the state dict given holds PEFT LoRA layers"):
        ft.nn.from_hf(peft_model.config, peft_model.model.state_dict())
    merged = ft.nn.from_hf(copy.deepcopy(peft_model).merge_and_unload())  # the first right line
    assert_close(logits(merged, ids), expected)
    peft_model.save_pretrained(str(tmp_path / "adapter"))  # the second
    model = ft.nn.load_lora(ft.nn.from_hf(peft_model.unload()), str(tmp_path / "adapter"))
    assert_close(logits(model, ids), expected)


def _peft_saved(base, directory, **options):
    """PEFT's adapter on ``base`` (a copy) with its LoRA and saved modules moved off their
    initial values, saved to ``directory``; the PeftModel (eval mode)."""
    peft_model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, lora_alpha=4, **options))
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(0.3 * torch.randn_like(p))
    peft_model.save_pretrained(str(directory))
    return peft_model.eval()


@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning")
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # PEFT's, on the tied head
def test_modules_to_save_lm_head_on_a_tied_gpt2_names_the_untied_port_that_loads_it(tmp_path):
    """The issue: the right line was 'an untied Dense head, e.g. modules_to_save=["lm_head"]',
    the value given. Now it is the untied port, which gives PEFT's logits; a Llama adapter
    on GPT-2 is said to be another model's, not blamed on modules_to_save."""
    torch.manual_seed(0)
    gpt2 = randomized(lambda: transformers.GPT2LMHeadModel(_gpt2_config(tied=True)).eval())
    ids = np.random.default_rng(0).integers(1, 30, (2, 7)).astype(np.int32)
    peft_model = _peft_saved(gpt2, tmp_path / "gpt2", target_modules=["c_attn"], fan_in_fan_out=True,
                             modules_to_save=["lm_head"])
    expected = hf_logits(peft_model, ids)
    with pytest.raises(ValueError, match=r"modules_to_save names 'lm_head', which is not a Dense layer") as info:
        ft.nn.load_lora(ft.nn.from_hf(gpt2), tmp_path / "gpt2")
    right = str(info.value).split("right:  ")[1].split("   #")[0]
    assert right == 'model = ft.nn.from_hf({**config, "tie_word_embeddings": False}, hf_model.state_dict())'
    scope = {"ft": ft, "config": gpt2.config.to_dict(), "hf_model": gpt2}
    exec(right, scope)
    assert_close(logits(ft.nn.load_lora(scope["model"], tmp_path / "gpt2"), ids), expected)
    _peft_saved(llama(), tmp_path / "llama", target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"tensors for \['model.layers.0.self_attn.q_proj'.*which name no Dense layer"
                                         r"(.|\n)*Load it into the model it was trained on"):
        ft.nn.load_lora(ft.nn.from_hf(gpt2), tmp_path / "llama")


def test_modules_to_save_of_another_vocabulary_is_a_shape_error_with_the_resize_that_loads_it(tmp_path, base):
    """The issue: a saved lm_head [VOCAB + 5, D] on a base of VOCAB tokens was called 'not a
    PEFT LoRA adapter directory'. PEFT refuses it as a size mismatch; resizing the base's
    vocabulary first, the right line, loads it as PEFT does."""
    _peft_saved(llama(vocab_size=VOCAB + 5), tmp_path, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(RuntimeError, match="size mismatch"):  # the reference: PEFT refuses it too
        peft.PeftModel.from_pretrained(llama(), str(tmp_path))
    with pytest.raises(ValueError, match=rf"(?s)modules_to_save's 'lm_head' is saved as \{{'weight': \({VOCAB + 5}, {D}\)\}}"
                                         rf".*takes \{{'weight': \({VOCAB}, {D}\)\}}: the adapter was trained on another "
                                         rf"base model \(a vocabulary of {VOCAB + 5} tokens, not {VOCAB}\)"
                                         rf".*resize_token_embeddings\({VOCAB + 5}\)"):
        ft.nn.load_lora(base, tmp_path)
    resized = llama()
    resized.resize_token_embeddings(VOCAB + 5)
    ids = tokens()
    expected = hf_logits(peft.PeftModel.from_pretrained(copy.deepcopy(resized), str(tmp_path)).eval(), ids)
    assert_close(logits(ft.nn.load_lora(ft.nn.from_hf(resized), tmp_path), ids), expected)


def test_adapter_config_fields_of_another_json_type_are_named(base, tmp_path):
    """A field of another JSON type than PEFT's LoraConfig takes is BAD_CONFIG_TYPE naming
    the field, the value and its type: target_modules=5 and layers_to_transform="x" were a
    bare TypeError inside the matching (PEFT's own loader fails there too), use_rslora="false"
    a truthy string (alpha / sqrt(r), another scale), modules_to_save="lm_head" a one-item
    list where PEFT wraps every module whose name ends in one of its characters."""
    peft_adapter(llama, tmp_path, r=2, target_modules=["q_proj"])
    original = json.loads((tmp_path / "adapter_config.json").read_text())
    edit_config(tmp_path, target_modules=5)
    with pytest.raises(TypeError):  # the reference: PEFT fails deep inside, naming nothing
        peft.PeftModel.from_pretrained(llama(), str(tmp_path))
    cases = [("target_modules", 5, r"a regular expression \(str\) or a list of module names \(list of str\)"),
             ("target_modules", ["q_proj", 3], r"list of str"),
             ("layers_to_transform", "x", r"a layer number \(int\) or a list of them \(list of int\)"),
             ("layers_to_transform", [0, True], r"list of int"),
             ("layers_pattern", 1, r"list of str"), ("exclude_modules", {"a": 1}, r"list of str"),
             ("modules_to_save", 7, r"list of str"),
             # PEFT's own matching iterates over a string: every module ending in l, m, _, h, e, a or d
             ("modules_to_save", "lm_head", r"list of str; PEFT reads a bare string one character at a time"),
             ("rank_pattern", ["q_proj"], r"an object"),
             ("alpha_pattern", 2, r"an object"), ("use_rslora", "false", r"true or false"),
             ("fan_in_fan_out", 0, r"true or false"), ("bias", 0, r"\"none\"")]
    for option, value, accepted in cases:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**original, option: value}))
        with pytest.raises(ValueError, match=rf"(?s)sets {option}={re.escape(repr(value))} \(a {type(value).__name__}\); "
                                             rf"PEFT's LoraConfig takes .*{accepted}.*wrong:  \"{option}\": "
                                             rf"{re.escape(json.dumps(value))}\n    right:  \"{option}\": "):
            ft.nn.load_lora(base, tmp_path)


def without_record(directory):
    """The adapter's weights written again without save_lora's record of its config (as PEFT writes them)."""
    path = str(directory / "adapter_model.safetensors")
    safetensors.numpy.save_file(safetensors.numpy.load_file(path), path)


@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning")  # PEFT's: Linear and Conv1D both
def test_refused_adapters_name_the_route_that_loads_them(tmp_path, base, gpt2):
    """The errors for adapters load_lora does not read had no fix, or one for another case:
    DoRA and adapter biases ("reads plain LoRA (...)", nothing more), a modules_to_save
    naming a fused projection ('right: an untied Dense head, e.g. modules_to_save=["lm_head"]'),
    an adapter on an embedding (only "train on Linear modules"). Each now shows PEFT's
    merge_and_unload ported with from_hf (its logits: checked for DoRA), except where the merge
    is not PEFT's model: an adapter on a tied embedding changes the head it shares."""
    hf = llama()
    peft_model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True,
                                                              init_lora_weights=False)).eval()
    peft_model.save_pretrained(str(tmp_path / "dora"))
    with pytest.raises(ValueError, match=r"(?s)sets use_dora=True.*right:  merged = peft.PeftModel.from_pretrained"
                                         r"\(hf_model, directory\).merge_and_unload\(\)\n +model = ft.nn.from_hf\(merged\)"):
        ft.nn.load_lora(base, tmp_path / "dora")
    merged = peft.PeftModel.from_pretrained(hf, str(tmp_path / "dora")).merge_and_unload()  # the route
    ids = tokens()
    expected = hf_logits(peft_model, ids)
    assert_close(logits(ft.nn.from_hf(merged), ids), expected)
    assert np.abs(expected - hf_logits(llama(), ids)).max() > 0.1  # the adapter moves the logits

    ft.nn.save_lora(ft.nn.lora(base, QV, rank=2, key=jax.random.key(0)), tmp_path / "qv")
    edit_config(tmp_path / "qv", alora_invocation_tokens=[3])  # no merge route: PEFT applies it after those tokens
    with pytest.raises(ValueError, match=r"sets alora_invocation_tokens=\[3\].*different model\.$"):
        ft.nn.load_lora(base, tmp_path / "qv")
    ft.nn.save_lora(ft.nn.lora(base, QV, rank=2, key=jax.random.key(0)), tmp_path / "qv")
    without_record(tmp_path / "qv")  # as PEFT writes it: the config alone decides
    edit_config(tmp_path / "qv", target_modules=["q_proj", "v_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"(?s)selects \['model.embed_tokens'\], which is not a Dense layer.*"
                                         r"or:  model = ft.nn.from_hf\(peft.PeftModel.from_pretrained"):
        ft.nn.load_lora(base, tmp_path / "qv")

    adapted = ft.nn.lora(gpt2, "*.mlp.c_fc", rank=2, key=jax.random.key(0))
    ft.nn.save_lora(adapted, tmp_path / "gpt2")
    without_record(tmp_path / "gpt2")
    edit_config(tmp_path / "gpt2", target_modules=["c_fc", "wte"])  # GPT-2's embedding is its head's weight
    with pytest.raises(ValueError, match=r"selects \['transformer.wte'\], which is not a Dense layer") as info:
        ft.nn.load_lora(gpt2, tmp_path / "gpt2")
    assert "merge_and_unload" not in str(info.value)
    edit_config(tmp_path / "gpt2", target_modules=["c_fc"], modules_to_save=["c_attn"])
    with pytest.raises(ValueError, match=r"(?s)names 'transformer.h.0.attn.c_attn', a fused projection .*"
                                         r"right:  merged = peft.PeftModel.from_pretrained"):
        ft.nn.load_lora(gpt2, tmp_path / "gpt2")


def test_a_pickled_or_unprefixed_adapter_file_is_named_with_its_conversion(tmp_path, base):
    """PEFT's adapter_model.bin (a pickle: never unpickled here) was "not a PEFT LoRA adapter
    directory: no adapter_model.safetensors"; tensors without PEFT's "base_model.model."
    prefix (which PEFT does not load either) were "an unexpected tensor". Each now names
    what the file is and the conversion; the prefixed file loads."""
    ft.nn.save_lora(ft.nn.lora(base, QV, rank=2, key=jax.random.key(0)), tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    tensors = safetensors.numpy.load_file(str(weights))
    weights.rename(tmp_path / "adapter_model.bin")  # its bytes are never read
    with pytest.raises(ValueError, match=r"(?s)holds its weights as adapter_model.bin, a pickle.*"
                                         r"torch.load\(bin_path, weights_only=True\)"):
        ft.nn.load_lora(base, tmp_path)
    (tmp_path / "adapter_model.bin").unlink()
    safetensors.numpy.save_file({k.removeprefix("base_model.model."): v for k, v in tensors.items()}, str(weights))
    with pytest.raises(ValueError, match=r"(?s)'model.layers.0.self_attn.q_proj.lora_A.weight' in .* names its module "
                                         r"without the prefix \"base_model.model.\".*\"base_model.model.\" \+ k"):
        ft.nn.load_lora(base, tmp_path)
    unprefixed = safetensors.numpy.load_file(str(weights))
    safetensors.numpy.save_file({"base_model.model." + k: v for k, v in unprefixed.items()}, str(weights))  # the fix
    assert isinstance(ft.nn.load_lora(base, tmp_path).model.layers.layers.self_attn.query_projection, ft.nn.LoraDense)


@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to:UserWarning")  # PEFT's: Linear and Conv1D both
def test_embedding_layers_peft_saves_whole_load_where_they_are_the_model_s(tmp_path, base, gpt2):
    """``save_pretrained(..., save_embedding_layers=True)`` (PEFT's "auto" sets it after a
    vocabulary resize) writes the embedding and the head whole beside the adapter, and PEFT
    loads them over the model's: load_lora refused every such file ("an unexpected tensor
    'base_model.model.lm_head.weight'"). Now tensors equal to the model's own load (the tied
    GPT-2 too), and other ones (a resized vocabulary) are named with the route that loads them."""
    ids = tokens()
    peft_model = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                              init_lora_weights=False)).eval()
    peft_model.save_pretrained(str(tmp_path / "llama"), save_embedding_layers=True)
    assert_close(logits(ft.nn.load_lora(base, tmp_path / "llama"), ids), hf_logits(peft_model, ids))
    tied = peft.get_peft_model(gpt2_hf(), peft.LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False))
    tied.eval().save_pretrained(str(tmp_path / "gpt2"), save_embedding_layers=True)
    assert_close(logits(ft.nn.load_lora(gpt2, tmp_path / "gpt2"), ids), hf_logits(tied, ids))

    resized = llama()
    resized.resize_token_embeddings(VOCAB + 6, mean_resizing=False)  # the new rows drawn at random
    peft_model = peft.get_peft_model(resized, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                              init_lora_weights=False)).eval()
    peft_model.save_pretrained(str(tmp_path / "resized"), save_embedding_layers=True)
    with pytest.raises(ValueError, match=r"(?s)'base_model.model.lm_head.weight' is a weight of the base model .*"
                                         rf"{VOCAB + 6} rows for the model's {VOCAB}: a resized vocabulary.*"
                                         rf"resize_token_embeddings\({VOCAB + 6}\)"):
        ft.nn.load_lora(base, tmp_path / "resized")  # (the route: PEFT's logits to 4e-7, measured)


def test_member_scales_of_a_float64_model_are_peft_python_floats(tmp_path):
    """PEFT's per-layer scales (``alpha_pattern``) are Python floats: a float64 model holds its
    members' scales in float64 (``member_scale``), not rounded to float32 (16/3 and 7/3 are not
    float32 numbers). GPT-2: no rotary, whose float32 cos/sin would hide the difference.
    Measured: 5.8e-8 of max|logits| with float32 scales, 5.4e-16 now."""
    double = lambda: gpt2_hf().double()  # noqa: E731
    peft_model = peft_adapter(double, tmp_path, r=3, lora_alpha=16, target_modules=["c_fc"], fan_in_fan_out=True,
                              alpha_pattern={"transformer.h.1.mlp.c_fc": 7})
    ids = tokens()
    expected = hf_logits(peft_model, ids)
    with jax.enable_x64(True):
        model = ft.nn.load_lora(ft.nn.from_hf(double(), dtype=jnp.float64), tmp_path)
        scales = model.transformer.h.layers.mlp.c_fc.member_scale
        assert scales.dtype == jnp.float64 and scales.tolist() == [16 / 3, 7 / 3], scales
        got = np.asarray(model(ids))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-14 * float(np.abs(expected).max()))


def test_a_float64_rslora_adapter_saved_again_keeps_its_scale_to_the_last_bit(tmp_path):
    """An rslora adapter's scale alpha / sqrt(r) is no short decimal: save_lora wrote the
    shortest lora_alpha giving the float32 scale (12.124356 for 7 / sqrt(3) at rank 3), and a
    float64 model read back (by PEFT or functree) was 3.3e-8 of max|logits| off. A float64
    adapter's alpha now gives its float64 scale exactly; PEFT reads the file as the original."""
    double = lambda: gpt2_hf().double()  # noqa: E731
    peft_model = peft_adapter(double, tmp_path / "peft", r=3, lora_alpha=7, use_rslora=True, target_modules=["c_fc"],
                              fan_in_fan_out=True)
    ids = tokens()
    expected = hf_logits(peft_model, ids)
    with jax.enable_x64(True):
        model = ft.nn.load_lora(ft.nn.from_hf(double(), dtype=jnp.float64), tmp_path / "peft")
        ft.nn.save_lora(model, tmp_path / "again")
    with open(tmp_path / "again" / "adapter_config.json") as f:
        written = json.load(f)
    assert written["lora_alpha"] / written["r"] == 7 / np.sqrt(3), written["lora_alpha"]
    again = peft.PeftModel.from_pretrained(double(), str(tmp_path / "again")).eval()
    np.testing.assert_allclose(hf_logits(again, ids), expected, rtol=0, atol=1e-14 * float(np.abs(expected).max()))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_an_adapter_on_a_masked_lms_tied_decoder_is_refused_as_a_tied_head(family, tmp_path):
    """PEFT adapts BERT's cls.predictions.decoder (RoBERTa's lm_head.decoder), tied to the word
    embeddings. load_lora refused it as "not a Dense layer" and offered merge_and_unload, whose
    merge moves the embeddings the decoder shares: logits 1.04 (RoBERTa 0.73) of scale off
    PEFT's. Now it is refused as a tied head, with the untied port, which loads PEFT's logits."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                 max_position_embeddings=16, pad_token_id=1)
    kind = {"bert": transformers.BertForMaskedLM, "roberta": transformers.RobertaForMaskedLM}[family]
    hf_model = kind(transformers.AutoConfig.for_model(family, **sizes)).eval()
    weights = {k: v.clone() for k, v in hf_model.state_dict().items()}
    config = {**hf_model.config.to_dict(), "architectures": [kind.__name__]}
    decoder = "cls.predictions.decoder" if family == "bert" else "lm_head.decoder"
    adapted = peft.get_peft_model(hf_model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "decoder"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    adapted.save_pretrained(str(tmp_path))
    ids = np.random.default_rng(0).integers(2, 40, (2, 7)).astype(np.int32)
    expected = hf_logits(adapted.eval(), ids)
    with pytest.raises(ValueError, match=rf"(?s)selects \['{decoder}'\]: the tied output head.*exclude_modules="
                                         rf"\['{decoder}'\].*\"tie_word_embeddings\": False") as refused:
        ft.nn.load_lora(ft.nn.from_hf(config, weights), str(tmp_path))
    assert "merge_and_unload" not in str(refused.value)
    untied = ft.nn.from_hf({**config, "tie_word_embeddings": False}, key=jax.random.key(0))  # the fix it names
    untied = ft.nn.load_torch_state_dict(untied, weights)
    assert_close(logits(ft.nn.load_lora(untied, str(tmp_path)), ids), expected)


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta"])
def test_save_lora_of_a_roberta_masked_lm_writes_no_causal_task_type(family, tmp_path):
    """RoBERTa's masked LM names its head lm_head, and save_lora's "auto" wrote task_type
    CAUSAL_LM for it: PEFT then failed to load the file ('RobertaForMaskedLM' object has no
    attribute 'prepare_inputs_for_generation'). A masked LM gets none, and PEFT's logits."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                 max_position_embeddings=16, pad_token_id=1)
    kind = {"roberta": transformers.RobertaForMaskedLM, "xlm-roberta": transformers.XLMRobertaForMaskedLM}[family]
    hf_model = kind(transformers.AutoConfig.for_model(family, **sizes)).eval()
    model = ft.nn.lora(ft.nn.from_hf(hf_model), ["*.query", "*.value"], rank=2, alpha=4, key=jax.random.key(1))
    model = jax.tree_util.tree_map_with_path(  # the adapters moved off their zero start
        lambda p, x: x + 0.3 * jax.random.normal(jax.random.key(len(jax.tree_util.keystr(p))), x.shape, x.dtype)
        if "lora_b" in jax.tree_util.keystr(p) else x, model)
    ft.nn.save_lora(model, str(tmp_path))
    with open(tmp_path / "adapter_config.json") as f:
        assert json.load(f)["task_type"] is None
    ids = np.random.default_rng(0).integers(2, 40, (2, 7)).astype(np.int32)
    read = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(tmp_path)).eval()  # the same base weights
    expected = hf_logits(read, ids)
    assert np.abs(expected - hf_logits(hf_model, ids)).max() > 1e-3  # the adapters move the logits
    assert_close(logits(model, ids), expected)


def test_no_target_modules_and_a_named_adapters_folder_are_refused_with_their_fixes(tmp_path):
    """target_modules null: PEFT adapts its table's default modules for the model type (the
    refusal said PEFT refused it); the fix names the modules the file's tensors adapt. A
    directory whose adapter PEFT wrote in a folder of its name (save_pretrained of an adapter
    not called "default"): the refusal names the folder."""
    peft_adapter(llama, tmp_path / "adapter", r=2, target_modules=["q_proj", "v_proj"])
    edit_config(tmp_path / "adapter", target_modules=None)
    base = ft.nn.from_hf(llama())
    with pytest.raises(ValueError, match=r'(?s)has no target_modules \(null or absent\). PEFT then adapts its default '
                                         r'.*right:  "target_modules": \["q_proj", "v_proj"\]'):
        ft.nn.load_lora(base, tmp_path / "adapter")
    os.makedirs(tmp_path / "outer")
    os.rename(tmp_path / "adapter", tmp_path / "outer" / "second")
    with pytest.raises(ValueError, match=r"no adapter_config.json; its subfolders \['second'\] hold adapters .*"
                                         r"ft.nn.load_lora\(model, '.*outer/second'\)"):
        ft.nn.load_lora(base, tmp_path / "outer")


class _Attending(ft.Module):
    """ft's twin of a torch module holding ``self.attn = nn.MultiheadAttention(16, 4,
    batch_first=True)`` and ``self.head = nn.Linear(16, 3)``."""

    attn: ft.nn.MultiheadAttention
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.attn(x))


class _TorchAttending(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def test_an_adapter_on_torch_multihead_attentions_out_proj_is_refused_both_ways(tmp_path):
    """torch's MultiheadAttention.forward reads out_proj.weight and never calls out_proj, so
    PEFT's PeftModel ignored an adapter there: save_lora wrote the output projection's
    adapter as "attn.out_proj", and PEFT's logits were 1.64 off functree's (of 1.32, no
    error); a PEFT file adapting it loaded as PEFT's merged model, 2.27 off its PeftModel.
    Both refused (MHA_OUTPUT); the head beside it loads and saves as before."""
    net = _Attending(ft.nn.MultiheadAttention(16, 4, key=jax.random.key(0)), ft.nn.Dense(16, 3, key=jax.random.key(1)))
    adapted = ft.nn.lora(net, ["attn.output_projection", "head"], rank=2, key=jax.random.key(2))
    with pytest.raises(ValueError, match=r"(?s)save_lora: the adapted layer is 'attn.output_projection', the output "
                                         r"projection of a MultiheadAttention .*never calls out_proj.*"
                                         r"right:  torch_model.load_state_dict\(ft.nn.torch_state_dict\(ft.nn.merge_lora"):
        ft.nn.save_lora(adapted, tmp_path / "ours")
    torch_net = _TorchAttending()
    torch_net.load_state_dict(ft.nn.torch_state_dict(net))
    theirs = peft.get_peft_model(torch_net, peft.LoraConfig(r=2, target_modules=["out_proj", "head"]))
    theirs.save_pretrained(tmp_path / "peft")
    with pytest.raises(ValueError, match=r"(?s)load_lora: the adapter's target_modules select 'attn.out_proj'.*"
                                         r'exclude_modules=\["attn.out_proj"\]'):
        ft.nn.load_lora(net, tmp_path / "peft")
    ft.nn.save_lora(ft.nn.lora(net, "head", rank=2, key=jax.random.key(2)), tmp_path / "head")  # no refusal


def test_an_adapter_under_home_is_written_and_read_there(tmp_path, monkeypatch, home_and_work):
    """``save_lora(model, "~/adapter")`` wrote ``./~/adapter`` (a folder named ``~``, often
    removed with ``rm -rf ~``), which ``load_lora(model, "~/adapter")`` found only from that
    working directory; a folder named ``~`` here is named, with ``"./~/..."`` to read it."""
    home, work = home_and_work
    model = ft.nn.Sequential(ft.nn.Dense(4, 4, key=jax.random.key(0)), ft.nn.Dense(4, 2, key=jax.random.key(1)))
    adapted = ft.set(ft.nn.lora(model, "*", rank=2, key=jax.random.key(2)), "layers.1.lora_b", jnp.ones((2, 2)))
    ft.nn.save_lora(adapted, "~/adapter")
    assert os.listdir(work) == [] and sorted(os.listdir(home / "adapter")) == ["adapter_config.json",
                                                                              "adapter_model.safetensors"]
    monkeypatch.chdir(tmp_path)  # read from another working directory
    x = jnp.ones((1, 4))
    np.testing.assert_array_equal(ft.nn.load_lora(model, "~/adapter")(x), adapted(x))
    ft.nn.save_lora(adapted, "./~/literal")  # "./~": the folder named "~" here, as a shell reads it
    with pytest.raises(FileNotFoundError, match=r"""(?s)a folder named "~".*ft.nn.load_lora\(\.\.\. '\./~/literal'"""):
        ft.nn.load_lora(model, "~/literal")
    np.testing.assert_array_equal(ft.nn.load_lora(model, "./~/literal")(x), adapted(x))
