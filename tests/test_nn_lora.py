"""ft.nn.lora, LoraDense, merge_lora, save_lora / load_lora against PEFT on Hugging Face's Llama.

The reference is PEFT itself: a tiny ``LlamaForCausalLM`` built from a config with random
weights (no download) is ported with ``ft.nn.from_hf``, given adapters by Hugging Face's
module names, trained a few steps (so ``lora_B`` is not zero), saved with ``save_lora`` and
loaded with ``peft.PeftModel.from_pretrained``; the logits must agree to float32 rounding:
atol 2.5e-5 times the logits' magnitude (test_hf_load's bound for the same model; measured
here: 2e-7 of it). The other way, a ``PeftModel``'s own ``save_pretrained`` directory is read
with ``load_lora``.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import functree as ft
from functree.hf import _names
from functree.nn import _lora

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# transformers' own deprecation, raised inside peft.PeftModel's constructor
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

VOCAB, D, T = 50, 16, 7
QV = "model.layers.*.self_attn.[qv]_proj"


def tokens(batch=2, length=T, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length)).astype(np.int32)


def llama(seed=0, **changes):
    options = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**options, **changes}))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf.eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long()).logits.numpy()


def assert_close(actual, expected, scale=2.5e-5):
    expected = np.asarray(expected, np.float32)
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=0,
                               atol=scale * float(np.abs(expected).max()))


logits = jax.jit(lambda model, ids: model(ids))  # one compilation per model structure


def next_token_loss(model, ids):
    logits = model(ids[:, :-1])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


@pytest.fixture(scope="module")
def hf():
    return llama()


@pytest.fixture(scope="module")
def base(hf):
    return ft.nn.from_hf(hf)


@pytest.fixture(scope="module")
def trained(base):
    """The port with adapters on q, v (HF names) and down_proj (ft names), 4 Adam steps on
    the adapters alone; also the step's inputs, to check what stayed frozen."""
    model = ft.nn.lora(base, [QV, "*.mlp.down_proj"], rank=4, alpha=8, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adam(3e-2), wrt="*.lora_*")
    state = opt.init(model)
    step = ft.jit(lambda m, s, x: opt.minimize(next_token_loss, m, s, x))
    ids = tokens(4, 9, seed=1)
    losses = []
    for _ in range(4):
        model, state, loss = step(model, state, ids)  # the loss before the step's update
        losses.append(float(loss))
    return model, losses[0], losses[-1]


def test_lora_dense_computes_the_low_rank_update():
    dense = ft.nn.Dense(5, 3, jax.nn.tanh, key=jax.random.key(0))
    layer = ft.nn.LoraDense(dense, rank=2, alpha=6.0, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (4, 5))
    assert bool(jnp.all(layer(x) == dense(x)))  # lora_b = 0 at init: the same numbers
    b = jax.random.normal(jax.random.key(3), (2, 3))
    layer = layer.replace(lora_b=b)
    w, bias, a = (np.asarray(v, np.float64) for v in (dense.weight, dense.bias, layer.lora_a))
    xs = np.asarray(x, np.float64)
    expected = np.tanh(xs @ w + bias + 3.0 * (xs @ a) @ np.asarray(b, np.float64))
    assert_close(layer(x), expected, 1e-6)
    bound = 1 / np.sqrt(5)
    assert layer.lora_a.shape == (5, 2) and float(jnp.abs(layer.lora_a).max()) <= bound


def test_hf_names_select_the_same_layers_as_ft_names(base):
    by_hf = ft.nn.lora(base, [QV, "*.mlp.down_proj"], rank=4, key=jax.random.key(0))  # the trained model's shapes
    by_ft = ft.nn.lora(base, ["*.self_attn.[qv]*_projection", "model.layers.*.mlp.down_proj"], rank=4,
                       key=jax.random.key(0))
    assert jax.tree.structure(by_hf) == jax.tree.structure(by_ft)
    attn = by_hf.model.layers.layers.self_attn
    assert isinstance(attn.query_projection, ft.nn.LoraDense) and isinstance(attn.value_projection, ft.nn.LoraDense)
    assert type(attn.key_projection) is ft.nn.Dense and type(attn.output_projection) is ft.nn.Dense
    assert attn.query_projection.lora_a.shape == (2, D, 4)  # stacked with the two members
    assert attn.value_projection.lora_b.shape == (2, 4, 8)  # two kv heads of size 4
    ids = tokens()
    assert bool(jnp.all(logits(by_hf, ids) == logits(base, ids)))  # B = 0: the logits are unchanged


def test_training_moves_only_the_adapters(base, trained):
    model, first, last = trained
    assert last < first
    flat, before = ft.to_flat_dict(model), ft.to_flat_dict(base)
    for name, value in flat.items():
        if ".lora_" not in name:
            assert np.array_equal(np.asarray(value), np.asarray(before[name])), name
    assert float(jnp.abs(model.model.layers.layers.self_attn.query_projection.lora_b).max()) > 1e-3
    assert float(jnp.abs(model.model.layers.layers.mlp.down_proj.lora_b).max()) > 1e-3


def test_save_lora_loads_in_peft_with_equal_logits(hf, trained, tmp_path):
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
    loaded = ft.nn.load_lora(ft.nn.from_hf(hf), tmp_path)  # and back
    assert jax.tree.structure(loaded) == jax.tree.structure(model)
    assert bool(jnp.all(logits(loaded, ids) == logits(model, ids)))


def test_merge_lora_gives_the_original_structure_and_logits(base, trained):
    model, _, _ = trained
    merged = ft.nn.merge_lora(model)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    ids = tokens()
    assert_close(logits(merged, ids), logits(model, ids))


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


def test_bfloat16_compute_and_generate(trained):
    model, _, _ = trained
    ids = tokens()
    half = ft.cast(model, jnp.bfloat16)
    assert half.model.layers.layers.self_attn.query_projection.lora_b.dtype == jnp.bfloat16
    assert_close(logits(half, ids), logits(model, ids), 3e-2)  # bfloat16: 8 bits of mantissa
    out = np.asarray(ft.nn.generate(model, ids[:, :3], T - 3))  # greedy: each token the argmax given the rest
    assert np.array_equal(np.asarray(logits(model, out)).argmax(-1)[:, 2:-1], out[:, 3:])


class Block(ft.Module):
    up: ft.nn.Dense
    down: ft.nn.Dense

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.up, self.down = ft.nn.Dense(4, 8, jax.nn.relu, key=k1), ft.nn.Dense(8, 4, key=k2)

    def __call__(self, x):
        return x + self.down(self.up(x))


def test_dropout_draws_a_fresh_mask_each_step():
    stack = jax.jit(lambda k: ft.nn.Stack(lambda k: Block(key=k), 3, key=k))(jax.random.key(0))  # one compilation
    model = ft.nn.lora({"h": stack}, "h.*.up", rank=2, dropout=0.5, key=jax.random.key(1))
    model = ft.set(model, "h.layers.up.lora_b", jnp.ones((3, 2, 8)))
    x = jax.random.normal(jax.random.key(2), (5, 4))
    run = lambda m: m["h"](x)  # noqa: E731
    train = ft.nn.training(model)
    collect = jax.jit(lambda m: ft.nn.collect_state(run, m))
    y1, s1 = collect(train)
    assert [str(k) for k in s1] == ["['h'].layers.up.dropout_key"]
    advanced = ft.nn.apply_state(train, s1)
    y2, _ = collect(advanced)
    assert not np.allclose(np.asarray(y1), np.asarray(y2))  # another mask
    forward = jax.jit(run)
    assert bool(jnp.all(forward(model) == forward(ft.nn.inference(advanced))))  # no dropout in inference
    keys = np.asarray(ft.get(model, "h.layers.up.dropout_key"))
    assert keys.shape == (3, 2) and len({tuple(k) for k in keys}) == 3  # a key per member
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="*.lora_*")
    new, _, _ = ft.jit(lambda m, s: opt.minimize(lambda m: jnp.sum(run(m) ** 2), m, s))(train, opt.init(train))
    assert not np.array_equal(np.asarray(ft.get(new, "h.layers.up.dropout_key")), keys)  # the step advanced it
    layer = ft.nn.LoraDense(ft.nn.Dense(4, 8, key=jax.random.key(3)), rank=2, dropout=0.5, key=jax.random.key(4))
    layer = ft.nn.training(layer.replace(dropout_key=None))  # as load_lora without key= makes it
    with pytest.raises(ValueError, match="needs a PRNG key for its dropout mask"):
        layer(x)
    assert layer(x, key=jax.random.key(3)).shape == (5, 8)


# ---- errors -----------------------------------------------------------------------------------

def test_pattern_errors(base):
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"selects no Dense layer(.|\n)*right:  ft.nn.lora\(model, '\*.self_attn.q_proj'"):
        ft.nn.lora(base, "*.self_attn.q_prj", rank=2, key=key)
    with pytest.raises(ValueError, match=r"also selects 'model.layers.layers.input_layernorm.scale', a leaf of RMSNorm"):
        ft.nn.lora(base, "model.layers.*", rank=2, key=key)
    with pytest.raises(ValueError, match=r"members \[0\] of the 2 members of the Stack layer "
                                         r"'model.layers.layers.self_attn.query_projection'(.|\n)*"
                                         r"'model.layers.\*.self_attn.query_projection'"):
        ft.nn.lora(base, "model.layers.0.self_attn.q_proj", rank=2, key=key)
    with pytest.raises(ValueError, match="holds 2 members"):
        ft.nn.lora(base, "model.layers.5.self_attn.q_proj", rank=2, key=key)
    adapted = ft.nn.lora(base, QV, rank=2, key=key)
    with pytest.raises(ValueError, match="a LoraDense already"):
        ft.nn.lora(adapted, "*.query_projection", rank=2, key=key)
    with pytest.raises(ValueError, match="bias of a Dense layer"):
        ft.nn.lora(ft.nn.Dense(2, 2, key=key), "bias", rank=1, key=key)


@pytest.mark.parametrize(("options", "message"), [
    ({"rank": 0}, "rank must be a positive int"),
    ({"rank": 2, "alpha": -1.0}, "alpha must be a positive number"),
    ({"rank": 2, "dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"rank": 2, "key": None}, "needs a PRNG key"),
])
def test_option_errors(options, message):
    dense = ft.nn.Dense(3, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        ft.nn.lora(dense, "*", **{"key": jax.random.key(1), **options})


def test_lora_dense_needs_a_dense():
    with pytest.raises(TypeError, match=r"wraps an ft\.nn\.Dense, got Conv1D"):
        ft.nn.LoraDense(ft.nn.Conv1D(2, 2, 3, key=jax.random.key(0)), key=jax.random.key(0))  # pyright: ignore[reportArgumentType]


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
    assert isinstance(ft.nn.load_lora(other, tmp_path).layers[0], ft.nn.LoraDense)  # an initialization only
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'base_model.model.0.lora_A.weight' has shape"):
        ft.nn.load_lora(ft.nn.Sequential(ft.nn.Dense(D + 1, D, key=jax.random.key(0))), tmp_path)


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
        model = ft.set(model, name, 0.3 * jax.random.normal(jax.random.key(1), value.shape))
    ft.nn.save_lora(model, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    peft_model = peft.PeftModel.from_pretrained(gpt2_hf(), str(tmp_path)).eval()
    ids = tokens()
    assert_close(logits(model, ids), hf_logits(peft_model, ids))


def test_torch_names_are_cached_per_tree_definition(base):
    _names._TORCH_NAMES.clear()
    first = _names.torch_names(base)
    assert _names.torch_names(jax.tree.map(lambda x: x, base)) is first


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
], ids=["qwen2", "gemma", "phi3", "gpt_neox", "opt"])
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


def matmuls(jaxpr):
    """dot_general equations of ``jaxpr`` and of the jaxprs inside it (the Stack's scan body)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "dot_general"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += matmuls(inner)
    return total


def test_the_lora_step_computes_no_frozen_weight_gradient(base):
    """The step's cost: the merged model's step through the same blocks (wrt the norms: every
    activation gradient, no Dense weight gradient) plus six matmuls per adapted Dense (x A,
    h B forward; dB, dh, dA and dx backward); a full step adds one per Dense instead."""
    ids = tokens(2, 9)

    def count(model, wrt):
        opt = ft.optim.Optimizer(ft.optim.sgd(0.1), wrt=wrt)
        step = lambda m, s: opt.minimize(next_token_loss, m, s, ids)  # noqa: E731
        return matmuls(jax.make_jaxpr(step)(model, opt.init(model)).jaxpr)

    adapted = ft.nn.lora(base, QV, rank=2, key=jax.random.key(0))
    merged = count(ft.nn.merge_lora(adapted), "*layernorm*")
    assert count(adapted, "*.lora_*") == merged + 6 * 2  # q and v in the scanned block
    assert count(base, None) == merged + 8  # 7 Dense per block and the head: a weight gradient each


class _Tiny(ft.Module):
    attn: ft.nn.MultiheadAttention
    fc: ft.nn.Dense

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.attn = ft.nn.MultiheadAttention(8, 2, key=k1)
        self.fc = ft.nn.Dense(8, 4, key=k2)

    def __call__(self, x):
        return self.fc(self.attn(x))


@pytest.mark.parametrize("pattern", ["fc", "attn.query_projection"])
def test_state_dict_converters_refuse_unmerged_adapters_naming_the_layer(pattern):
    # A plain state dict cannot hold adapters: writing the base weight alone (or dropping the
    # adapters inside an attention) would be a silently different model.
    base = _Tiny(key=jax.random.key(0))
    adapted = ft.nn.lora(base, pattern, rank=2, key=jax.random.key(1))
    with pytest.raises(ValueError, match=rf"(?s){pattern} is an adapted layer \(LoraDense\).*merge_lora"):
        ft.nn.torch_state_dict(adapted)
    with pytest.raises(ValueError, match=rf"load_torch_state_dict: {pattern} is an adapted layer"):
        ft.nn.load_torch_state_dict(adapted, ft.nn.torch_state_dict(base, numpy=True))
    merged = ft.nn.merge_lora(adapted)
    assert set(ft.nn.torch_state_dict(merged, numpy=True)) == set(ft.nn.torch_state_dict(base, numpy=True))


# ---- PEFT's config decides (issue 45 items 2, 3, 8, 11) ----------------------------------------

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


@pytest.mark.parametrize("make_hf", [llama, gpt2_hf], ids=["llama", "gpt2"])
def test_all_linear_adapts_what_peft_adapts(make_hf, tmp_path):
    """PEFT's "all-linear": every Linear / Conv1D but the output head (GPT-2's fused c_attn
    included); saved, the config lists the same modules PEFT's would."""
    peft_model = peft.get_peft_model(make_hf(), peft.LoraConfig(target_modules="all-linear",
                                                                fan_in_fan_out=make_hf is gpt2_hf))
    wanted = set(peft_model.peft_config["default"].target_modules)
    model = ft.nn.lora(ft.nn.from_hf(make_hf()), "all-linear", rank=2, key=jax.random.key(0))
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
    loaded = ft.nn.load_lora(ft.nn.from_hf(make_hf()), tmp_path / "peft")
    assert_close(logits(loaded, ids), hf_logits(peft_model, ids))


def test_one_member_of_a_fused_projection_saves_as_peft_reads_it(tmp_path):
    """An adapter on GPT-2's query projection alone is PEFT's c_attn adapter with zero k, v rows."""
    model = ft.nn.lora(ft.nn.from_hf(gpt2_hf()), "*.attn.query_projection", rank=2, alpha=4, key=jax.random.key(1))
    name = "transformer.h.layers.attn.query_projection.lora_b"
    model = ft.set(model, name, jax.random.normal(jax.random.key(2), ft.get(model, name).shape))
    ft.nn.save_lora(model, tmp_path)
    b = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))[
        "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert b.shape == (3 * D, 2) and np.any(b[:D]) and not np.any(b[D:])
    peft_model = peft.PeftModel.from_pretrained(gpt2_hf(), str(tmp_path)).eval()
    ids = tokens()
    assert_close(logits(model, ids), hf_logits(peft_model, ids))


def test_alpha_zero_with_an_alpha_pattern_and_rslora_load_as_peft(tmp_path):
    ids = tokens()
    for name, options in [("zero", dict(lora_alpha=0, alpha_pattern={"v_proj": 16})),
                          ("rslora", dict(lora_alpha=6, use_rslora=True))]:
        peft_model = peft_adapter(llama, tmp_path / name, r=4, target_modules=["q_proj", "v_proj"], **options)
        model = ft.nn.load_lora(ft.nn.from_hf(llama()), tmp_path / name)  # was: ZeroDivisionError
        assert_close(logits(model, ids), hf_logits(peft_model, ids))
        ft.nn.save_lora(model, tmp_path / f"{name}_back")
        again = peft.PeftModel.from_pretrained(llama(), str(tmp_path / f"{name}_back")).eval()
        assert_close(hf_logits(again, ids), hf_logits(peft_model, ids))


def test_load_lora_follows_the_config_not_the_file(tmp_path):
    """The file holds q and v; configs that select other modules or ranks than the file's are
    refused (PEFT: loads a subset silently, or its size-mismatch error, or ZeroDivisionError)."""
    peft_adapter(llama, tmp_path, r=4, target_modules=["q_proj", "v_proj"])
    base = ft.nn.from_hf(llama())
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


def test_integer_and_damaged_adapter_files_are_refused(tmp_path):
    peft_adapter(llama, tmp_path, r=2, target_modules=["q_proj"])
    base = ft.nn.from_hf(llama())
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


def test_modules_to_save_lm_head_loads_and_saves_as_peft(tmp_path):
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
    model = ft.nn.load_lora(ft.nn.from_hf(llama()), tmp_path / "peft")
    assert_close(logits(model, ids), expected)
    ft.nn.save_lora(model, tmp_path / "ft", modules_to_save="lm_head")  # a str, as PEFT takes it
    assert json.loads((tmp_path / "ft" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    again = peft.PeftModel.from_pretrained(llama(), str(tmp_path / "ft")).eval()
    assert_close(hf_logits(again, ids), expected)
    gpt2 = ft.nn.lora(ft.nn.from_hf(gpt2_hf()), "*.c_fc", rank=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"names 'lm_head', which is not a Dense layer of its own here \(a tied head"):
        ft.nn.save_lora(gpt2, tmp_path / "tied", modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"names 'classifier', which is no module of this model"):
        ft.nn.save_lora(model, tmp_path / "none", modules_to_save=["classifier"])


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


def test_bfloat16_adapters_save_and_load(hf, trained, tmp_path):
    """bfloat16 adapters are written as BF16 tensors (safetensors.numpy refuses them) and read back bit for bit."""
    model, _, _ = trained
    half = jax.tree.map(lambda x: x.replace(lora_a=x.lora_a.astype(jnp.bfloat16), lora_b=x.lora_b.astype(jnp.bfloat16))
                        if isinstance(x, ft.nn.LoraDense) else x, model, is_leaf=lambda x: isinstance(x, ft.nn.LoraDense))
    ft.nn.save_lora(half, tmp_path)
    loaded = ft.nn.load_lora(ft.nn.from_hf(hf), tmp_path)
    layer = loaded.model.layers.layers.self_attn.query_projection
    assert layer.lora_b.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(layer.lora_b), np.asarray(half.model.layers.layers.self_attn.query_projection.lora_b))
    peft_model = peft.PeftModel.from_pretrained(llama(), str(tmp_path)).eval()
    ids = tokens()
    assert_close(logits(loaded, ids), hf_logits(peft_model, ids))
