"""ft.nn.lora, LoraDense and merge_lora on Hugging Face's Llama, against PEFT's numbers.

A tiny ``LlamaForCausalLM`` built from a config with random weights (no download) is ported
with ``ft.nn.from_hf``, given adapters by Hugging Face's module names and by functree's key
paths, and trained a few steps (so ``lora_B`` is not zero); merged, its logits must equal
the adapted model's to float32 rounding: atol 2.5e-5 times the logits' magnitude
(test_hf_load's bound for the same model). The PEFT files (``save_lora``/``load_lora``)
are tested in test_hf_peft, on this module's model.
"""

import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import needs_float16_conversions

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

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
    return train_adapters(base)


def train_adapters(base):
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


def test_an_ensembles_lora_dense_called_outside_vmap_is_refused():
    # 3 adapted layers of 3 inputs on a batch of 3: x @ weight [3, 3, 3] broadcast over the
    # models and the biases over the rows, a [3, 3, 3] output with no error
    def adapted(k):
        layer = ft.nn.LoraDense(ft.nn.Dense(3, 3, key=k), rank=2, key=k)
        return layer.replace(lora_b=jax.random.normal(jax.random.fold_in(k, 1), (2, 3)))

    layers = jax.vmap(adapted)(jax.random.split(jax.random.key(0), 3))
    x = jax.random.normal(jax.random.key(1), (3, 3))
    with pytest.raises(ft.nn.LayerInputError, match=r"LoraDense holds weight f32\[3,3,3\], but one LoraDense's weight "
                                                    r"has 2 axes(.|\n)*jax.vmap\(lambda m: m\(x\)\)\(models\)"):
        layers(x)
    right = jax.vmap(lambda m: m(x))(layers)      # the fix
    assert_close(right[1], jax.tree.map(lambda a: a[1], layers)(x), 1e-6)


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


def test_merge_lora_gives_the_original_structure_and_logits(base, trained):
    model, _, _ = trained
    merged = ft.nn.merge_lora(model)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    ids = tokens()
    assert_close(logits(merged, ids), logits(model, ids))


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
    @jax.jit  # the model and the input in one compilation (eagerly, each operation compiled apart)
    def made(k):
        stack = ft.nn.Stack(lambda k: Block(key=k), 3, key=k)
        model = ft.nn.lora({"h": stack}, "h.*.up", rank=2, dropout=0.5, key=jax.random.key(1))
        return ft.set(model, "h.layers.up.lora_b", jnp.ones((3, 2, 8))), jax.random.normal(jax.random.key(2), (5, 4))

    model, x = made(jax.random.key(0))
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
    ({"rank": 2, "alpha": -1.0}, "alpha must be a positive finite number"),
    ({"rank": 2, "alpha": float("inf")}, "alpha must be a positive finite number"),
    ({"rank": 2, "alpha": True}, "alpha must be a positive finite number"),
    ({"rank": 2, "dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"rank": 2, "key": None}, "needs a PRNG key"),
])
def test_option_errors(options, message):
    dense = ft.nn.Dense(3, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        ft.nn.lora(dense, "*", **{"key": jax.random.key(1), **options})


def test_a_numpy_alpha_scales_as_its_float_does():
    # np.float32(16) (a config read with NumPy) was refused as no number
    dense, x = ft.nn.Dense(3, 3, key=jax.random.key(0)), jnp.ones((2, 3))
    by_numpy = ft.nn.lora(dense, "*", rank=2, alpha=np.float32(16), key=jax.random.key(1))
    by_float = ft.nn.lora(dense, "*", rank=2, alpha=16.0, key=jax.random.key(1))
    assert by_numpy.alpha == 16.0 and type(by_numpy.alpha) is float
    b = jnp.ones_like(by_float.lora_b)
    np.testing.assert_array_equal(by_numpy.replace(lora_b=b)(x), by_float.replace(lora_b=b)(x))


def test_lora_dense_needs_a_dense():
    with pytest.raises(TypeError, match=r"wraps an ft\.nn\.Dense, got Conv1D"):
        ft.nn.LoraDense(ft.nn.Conv1D(2, 2, 3, key=jax.random.key(0)), key=jax.random.key(0))  # pyright: ignore[reportArgumentType]


class ScaledOut(ft.nn.Dense):
    """A user's Dense subclass overriding ``__call__`` (audit t10)."""

    def __call__(self, x):
        return 3.0 * super().__call__(x)


class WithScale(ft.nn.Dense):
    """A user's Dense subclass with a trained field of its own (audit t08)."""

    scale: jax.Array

    def __init__(self, n_in, n_out, *, key):
        super().__init__(n_in, n_out, key=key)
        self.scale = jnp.full((n_out,), 2.0)

    def __call__(self, x):
        y = super().__call__(x)
        return y * jax.lax.broadcast_to_rank(self.scale, y.ndim)


def test_a_dense_subclass_is_refused_naming_it_and_the_plain_layers_selected():
    """A subclass became a plain LoraDense: its __call__ and fields were dropped and the
    adapted model (B = 0) differed from the original by 1.21. Refused; the fix runs."""
    keys = jax.random.split(jax.random.key(0), 4)
    net = jax.jit(lambda keys: ft.nn.Sequential(  # one program (eagerly, each initializer compiled apart)
        ft.nn.Dense(4, 4, key=keys[0]), WithScale(4, 4, key=keys[1]), ScaledOut(4, 2, key=keys[2])))(keys)
    for pattern in ("*", "all-linear", ["layers.0", "layers.1"]):
        with pytest.raises(ValueError, match=r"(?s)selects 'layers.1', a WithScale: a subclass of ft.nn.Dense.*"
                                             r"would drop what WithScale adds.*"
                                             r"right:  ft.nn.lora\(model, \['layers.0'\], \.\.\.\)"):
            ft.nn.lora(net, pattern, rank=2, key=keys[3])
    with pytest.raises(ValueError, match=r"(?s)selects 'layers.2', a ScaledOut.*right:  ft.nn.lora\(model, "
                                         r"'<a pattern without it>'"):
        ft.nn.lora(net, "layers.2", rank=2, key=keys[3])
    adapted = ft.nn.lora(net, ["layers.0"], rank=2, key=keys[3])  # the message's fix
    assert type(adapted.layers[1]) is WithScale and type(adapted.layers[2]) is ScaledOut
    x = jax.random.normal(keys[3], (3, 4))
    np.testing.assert_allclose(adapted(x), net(x), rtol=0, atol=0)  # B = 0: exactly the original
    with pytest.raises(TypeError, match=r"wraps a plain ft\.nn\.Dense, got a ScaledOut, a subclass"):
        ft.nn.LoraDense(net.layers[2], rank=2, key=keys[3])


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
    with pytest.raises(ValueError, match=rf"(?s){pattern} is an adapted layer \(LoraDense\).*"
                                         r"wrong:  ft\.nn\.torch_state_dict\(model\)\n"
                                         r"    right:  ft\.nn\.torch_state_dict\(ft\.nn\.merge_lora\(model\)\)"):
        ft.nn.torch_state_dict(adapted)
    with pytest.raises(ValueError, match=rf"(?s)load_torch_state_dict: {pattern} is an adapted layer.*"
                                         r"right:  ft\.nn\.load_torch_state_dict\(ft\.nn\.merge_lora\(model\), "
                                         r"state_dict\)"):
        ft.nn.load_torch_state_dict(adapted, ft.nn.torch_state_dict(base, numpy=True))
    merged = ft.nn.merge_lora(adapted)
    assert set(ft.nn.torch_state_dict(merged, numpy=True)) == set(ft.nn.torch_state_dict(base, numpy=True))


# ---- PEFT's config decides (issue 45 items 2, 3, 8, 11) ----------------------------------------


def test_a_lora_dense_pickled_before_saved_modules_existed_reads_at_the_default():
    # saved_modules came later (load_lora records PEFT's modules_to_save there): a pickle
    # without it unpickles as a LoraDense made today, and flattens (the field at its default).
    import pickle

    layer = ft.nn.LoraDense(ft.nn.Dense(3, 2, key=jax.random.key(0)), rank=2, key=jax.random.key(1))
    older = pickle.loads(pickle.dumps(layer))
    older.__dict__.pop("saved_modules")  # what an earlier functree's pickle holds
    back = pickle.loads(pickle.dumps(older))
    assert back.saved_modules == ()
    assert jax.tree.structure(back) == jax.tree.structure(layer)
    assert jnp.array_equal(back(jnp.ones((1, 3))), layer(jnp.ones((1, 3))))


def stacked_adapters(scales):
    """A Stack of two adapted Dense layers, lora_b trained away from zero, its members'
    scales ``scales`` (None: alpha / r for both). Built once per scales, in one program
    (eagerly, each initializer and draw compiled apart), and shared: arrays are immutable."""
    return _stacked_adapters(None if scales is None else tuple(scales))


@functools.cache
def _stacked_adapters(scales):
    return jax.jit(lambda: _stack_adapted(scales))()


def _stack_adapted(scales):
    stack = ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, key=k), 2, key=jax.random.key(0))
    adapted = ft.nn.lora(stack, "*", rank=2, alpha=4.0, key=jax.random.key(1))
    layer = adapted.layers.replace(lora_b=jax.random.normal(jax.random.key(2), (2, 2, 3)))
    return adapted.replace(layers=layer if scales is None else layer.replace(member_scale=jnp.asarray(scales)))


def test_each_stack_member_computes_with_its_own_scale_and_merges_with_it():
    """LoraDense.member_scale (ft.nn.load_lora of PEFT's alpha_pattern / rank_pattern): member
    i computes x W_i + b_i + s_i (x A_i) B_i; merge_lora folds each member's own scale in."""
    adapted = stacked_adapters([0.5, 3.0])
    x = jax.random.normal(jax.random.key(3), (4, 3))
    node = adapted.layers
    assert node.scale.shape == (2,) and stacked_adapters(None).layers.member_scale is None
    expected = x
    for i, s in enumerate((0.5, 3.0)):
        expected = expected @ node.weight[i] + node.bias[i][None, :] + s * (expected @ node.lora_a[i]) @ node.lora_b[i]
    np.testing.assert_allclose(adapted(x), expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))
    merged = ft.nn.merge_lora(adapted)
    np.testing.assert_allclose(merged(x), expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))
    trained = ft.parameters(adapted)  # no derivative: not a parameter an optimizer moves
    assert "layers.member_scale" not in ft.to_flat_dict(trained) and "layers.lora_b" in ft.to_flat_dict(trained)


def test_files_written_before_member_scale_existed_read_it_as_none():
    # member_scale came later: a pickle or a checkpoint's tree description without it reads
    # as a LoraDense made today (the field None, every member at alpha / r); one with it
    # keeps it.
    import pickle

    from functree.train.checkpoint._treespec import decode, encode

    layer = stacked_adapters(None).layers
    older = pickle.loads(pickle.dumps(layer))
    older.__dict__.pop("member_scale")  # what an earlier functree's pickle holds
    back = pickle.loads(pickle.dumps(older))
    assert back.member_scale is None and jax.tree.structure(back) == jax.tree.structure(layer)
    arrays, spec = encode(layer)
    spec = json.loads(json.dumps(spec))
    del spec["fields"]["member_scale"]
    assert decode(spec, arrays).member_scale is None
    scaled = stacked_adapters([0.5, 3.0]).layers
    arrays, spec = encode(scaled)
    again = decode(json.loads(json.dumps(spec)), arrays)
    assert jnp.array_equal(again.member_scale, scaled.member_scale)
    assert jax.tree.structure(again) == jax.tree.structure(scaled)


# ---- dropout under accumulation and on a mesh: each microbatch / device its own masks --------

class Adapted(ft.Module):
    a: ft.nn.Dense

    def __call__(self, x):
        return self.a(x)


@functools.cache  # shared: arrays are immutable; built in one program (eagerly, each initializer apart)
@jax.jit
def adapted_with_dropout():
    model = ft.nn.lora(Adapted(ft.nn.Dense(6, 6, key=jax.random.key(0))), "a", rank=2, dropout=0.5,
                       key=jax.random.key(1))
    return ft.nn.training(ft.set(model, "a.lora_b", jnp.ones((2, 6))))  # B nonzero: the adapter shows


@jax.jit  # one program (eagerly, each operation compiled apart)
def by_hand(layer, x, key):
    """The LoRA layer's output with its input mask drawn from ``key`` (the layer's formula)."""
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    h = jnp.where(keep, x / 0.5, 0.0)
    return x @ layer.weight + jax.lax.broadcast_to_rank(layer.bias, x.ndim) + ((h @ layer.lora_a) * layer.scale) @ layer.lora_b


@pytest.mark.parametrize("accumulate", [1, 2])
def test_dropout_under_accumulation_draws_each_microbatch_its_own_mask(accumulate):
    # The audit: with accumulate=2 both microbatches drew the stored key's mask (two equal
    # rows gave equal outputs). Microbatch i now draws fold_in(drawn, i); with one
    # microbatch the draw is the stored key's, as before; the recorded next key is the same
    # for any k (a job's keys do not depend on it).
    model = adapted_with_dropout()
    x = np.tile(np.arange(6, dtype=np.float32)[None], (2, 1))  # two identical rows
    opt = ft.optim.Optimizer(ft.optim.sgd(0.0), accumulate=accumulate, wrt="*.lora_*")

    def loss_fn(m, x):
        out = m(x)
        return jnp.mean(out ** 2), out

    new, _, (_, out) = opt.minimize(loss_fn, model, opt.init(model), x, has_aux=True)
    out = np.asarray(out).reshape(2, 6)
    drawn, following = jax.random.split(jax.random.wrap_key_data(model.a.dropout_key))
    keys = [drawn] if accumulate == 1 else [jax.random.fold_in(drawn, i) for i in range(2)]
    rows = [x] if accumulate == 1 else [x[:1], x[1:]]
    expected = np.concatenate([np.asarray(by_hand(model.a, r, k)) for r, k in zip(rows, keys, strict=True)])
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6 * float(np.abs(expected).max()))
    assert float(np.max(np.abs(out[0] - out[1]))) > 1.0  # the rows' masks differ, as with one microbatch
    np.testing.assert_array_equal(np.asarray(new.a.dropout_key), np.asarray(jax.random.key_data(following)))


@needs_float16_conversions  # float16 adapters drawn: XLA:CPU's SSE4_2 JIT links no float16 conversions
@pytest.mark.parametrize("given, written", [(jnp.int8, "jnp.int8"), ("bf16", "'bf16'"), (None.__class__, "NoneType"),
                                            ("torch", "torch.bfloat16")])
def test_lora_names_a_dtype_that_is_not_floating(given, written):
    # jnp.int8 failed inside jax.random.uniform, torch.bfloat16 inside NumPy.
    if given == "torch":
        given = pytest.importorskip("torch").bfloat16
    model = {"l": ft.nn.Dense(2, 2, key=jax.random.key(0))}
    with pytest.raises(TypeError, match=rf"(?s)ft.nn.lora: dtype is the adapters' floating dtype.*got {written}"
                                        rf".*right:  ft.nn.lora\(\.\.\., dtype=jnp.bfloat16\)"):
        ft.nn.lora(model, "l", rank=1, key=jax.random.key(0), dtype=given)
    with pytest.raises(TypeError, match=rf"ft.nn.LoraDense: dtype .*got {written}"):
        ft.nn.LoraDense(model["l"], 1, key=jax.random.key(0), dtype=given)
    for fine in ("bfloat16", np.float16, jnp.float32):
        adapted = ft.nn.lora(model, "l", rank=1, key=jax.random.key(0), dtype=fine)
        assert adapted["l"].lora_a.dtype == adapted["l"].lora_b.dtype == jnp.dtype(fine)


def test_a_bfloat16_lora_dense_adds_its_bias_as_dense_does():
    """The bias's gradient sums dL/dy over every row: added in bfloat16 (LoraDense; Dense adds
    it in float32, add_bias), XLA:CPU summed 16x256 rows in bfloat16 and the gradient came back
    2048 off (0.5 of its 4096; 0.75 over 32x512 rows); now 7 off, Dense's. The reference: d bias_j = rows * cos(j)
    exactly, for L = sum_j cos(j) y_j. The outputs are Dense's bit for bit (lora_b = 0)."""
    x = jax.random.normal(jax.random.key(1), (16, 256, 16)).astype(jnp.bfloat16)
    dense = ft.nn.Dense(16, 8, key=jax.random.key(0), dtype=jnp.bfloat16)
    adapted = ft.nn.lora({"d": dense}, "d", rank=2, key=jax.random.key(2))["d"]
    w = np.cos(np.arange(8.0))
    grad = jax.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) * w[None, None, :]))(adapted, x).bias
    expected = 16 * 256 * w
    np.testing.assert_allclose(np.asarray(grad, np.float64), expected, rtol=0, atol=0.017 * np.max(np.abs(expected)))
    assert np.array_equal(np.asarray(adapted(x), np.float32), np.asarray(dense(x), np.float32))


def test_an_optimizer_without_wrt_warns_that_the_adapted_weights_train_too(tmp_path):
    """The silent mistake: ``Optimizer(tx)`` over a LoRA model trains the base weights too,
    ``save_lora`` writes the adapters alone, and PEFT's model (the untrained base plus them)
    is not the trained one. ``init`` warns, naming the base weights and both fixes; any
    ``wrt`` given (``"*"`` too: everything, deliberately) and a model without adapters do not."""
    @jax.jit  # one program (eagerly, each initializer compiled apart)
    def built():
        model = ft.nn.Sequential(ft.nn.Dense(4, 4, jax.nn.relu, key=jax.random.key(0)),
                                 ft.nn.Dense(4, 2, key=jax.random.key(1)))
        return model, ft.nn.lora(model, "layers.*", rank=2, alpha=4, key=jax.random.key(2))

    model, adapted = built()
    with pytest.warns(ft.nn.LoraBaseWarning) as caught:
        state = ft.optim.Optimizer(ft.optim.sgd(0.1)).init(adapted)
    message = str(caught[0].message)
    assert "layers.0.weight, layers.1.weight" in message and "layers.0.lora_a" in message, message
    assert 'wrt="*.lora_*"' in message and 'wrt="*"' in message and "merge_lora" in message, message
    # what the warning is about: the step moves the base weights, which save_lora leaves out
    x, y = jnp.ones((3, 4)), jnp.zeros((3, 2))
    loss_fn = lambda m, x, y: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    everything = ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="*")
    trained, _, _ = jax.jit(lambda a, s: everything.minimize(loss_fn, a, s, x, y))(adapted, state)  # one program
    assert not np.array_equal(np.asarray(trained.layers[1].weight), np.asarray(adapted.layers[1].weight))
    batch_loss = lambda m, batch: loss_fn(m, *batch)  # noqa: E731
    with pytest.warns(ft.nn.LoraBaseWarning):  # the Trainer's optimizer too
        ft.train.Trainer(adapted, ft.optim.sgd(0.1), batch_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for wrt in ("*.lora_*", "*", ["*.lora_*", "layers.1.bias"]):
            ft.optim.Optimizer(ft.optim.sgd(0.1), wrt=wrt).init(adapted)
        ft.optim.Optimizer(ft.optim.sgd(0.1)).init(model)
        ft.train.Trainer(adapted, ft.optim.sgd(0.1), batch_loss, wrt="*.lora_*")


def test_lora_refuses_the_dense_a_wrapper_computes_the_weight_of():
    """ft.nn.lora on a WeightNorm's inner Dense (its weight None) crashed: AttributeError
    'NoneType' object has no attribute 'shape'. Now a named error (COMPUTED_WEIGHT)."""
    from functree.nn._lora import COMPUTED_WEIGHT

    model = ft.nn.Sequential(ft.nn.WeightNorm(ft.nn.Dense(3, 4, key=jax.random.key(0))), ft.nn.Dense(4, 2, key=jax.random.key(0)))
    with pytest.raises(ValueError, match=r"'layers.0.layer' is the Dense inside a WeightNorm or SpectralNorm") as info:
        ft.nn.lora(model, "layers.0.layer", rank=2, key=jax.random.key(0))
    assert 'wrt="layers.0.*"' in str(info.value) and "there is no stored weight" in COMPUTED_WEIGHT
    adapted = ft.nn.lora(model, "layers.1", rank=2, key=jax.random.key(0))  # the others adapt
    assert type(adapted.layers[1]).__name__ == "LoraDense"


def test_the_base_weights_warning_reads_what_the_optimizer_trains_not_wrt_alone():
    """LoraBaseWarning read wrt= alone: an optimizer freezing the base weights another way
    (ft.optim.groups with freeze() or optax.set_to_zero() beside the adapters' group, an
    optax.partition whose base label is set_to_zero()) was told they train. It reads the
    parameters the optimizer moves: those say nothing; one that trains a base weight (the
    adapters frozen, the rest trained) still warns, naming it."""
    @jax.jit  # one program (eagerly, each initializer compiled apart)
    def built():
        model = {"enc": ft.nn.Dense(2, 2, key=jax.random.key(0)), "head": ft.nn.Dense(2, 2, key=jax.random.key(1))}
        return ft.nn.lora(model, "enc", rank=1, key=jax.random.key(2))

    adapted = built()

    def labels(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: "lora" if "lora_" in jax.tree_util.keystr(p) else "base",
                                                params)

    sgd = ft.optim.sgd(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ft.nn.LoraBaseWarning)
        for tx in (ft.optim.groups({"*.lora_*": sgd}, default=ft.optim.freeze()),
                   ft.optim.groups({"*.lora_*": sgd, "head.*": sgd}, default=optax.set_to_zero()),
                   optax.partition({"lora": optax.sgd(0.1), "base": optax.set_to_zero()}, labels)):
            ft.optim.Optimizer(tx).init(adapted)
    for tx in (sgd, ft.optim.groups({"*.lora_*": ft.optim.freeze()}, default=sgd)):
        with pytest.warns(ft.nn.LoraBaseWarning, match=r"the adapted layers' own weights too \(enc\.weight\)"):
            ft.optim.Optimizer(tx).init(adapted)
