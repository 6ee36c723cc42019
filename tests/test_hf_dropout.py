"""``ft.nn.from_hf(..., dropout=True, key=key)``: Hugging Face's dropout, opt-in, against
transformers' own modules (tiny configs, random weights, no download).

Masks are random, so HF's training outputs are compared on the SAME masks: both sides'
mask draws are replaced by one deterministic pattern of the tensor's size
(``jax.random.bernoulli`` for functree, ``torch.nn.functional.dropout``, which every HF
``nn.Dropout`` calls, for HF), so an output equals HF's only if each position, its rate and
its ``1 / (1 - rate)`` scaling are HF's. Logits are compared at the real tokens with atol
2.5e-5 times their magnitude (as tests/test_hf_load.py; the largest difference measured is
1.2e-6 of it, Phi-3), gradients with 2.5e-5 times the largest gradient (measured: 2.9e-6 of
it, Llama).
"""

import functools
import hashlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _dropout
from functree.hf._family import HFModel
from functree.nn import _stack
from functree.nn._salt import salted_keys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_hf_ports import randomized  # noqa: E402

VOCAB, D, T = 40, 16, 12
DECODER = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=2 * D, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)


# The families of configs(), written out: collection reads no transformers config class (building
# them all imported each family's module at collection, ~3.4 s in every xdist worker).
FAMILIES = ["gpt2", "bert", "opt", "gpt_neox", "gpt_neox_sequential", "llama", "qwen2", "mistral", "gemma", "phi3",
            "qwen3", "olmo2", "gemma2", "ministral", "gemma3_text", "phi", "distilbert", "mixtral", "qwen3_moe", "olmoe",
            "qwen2_moe"]
ENCODERS = ("bert", "distilbert")


def configs(on=True):
    """Each family's tiny config, every dropout rate HF reads set (distinct where the fields
    differ) when ``on``, else 0."""
    r = (lambda x: x) if on else (lambda x: 0.0)
    built = {
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=D, n_layer=2, n_head=4,
                                        bos_token_id=0, eos_token_id=0, embd_pdrop=r(0.1), attn_pdrop=r(0.2),
                                        resid_pdrop=r(0.3)),
        "bert": transformers.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=2 * D, max_position_embeddings=32,
                                        hidden_dropout_prob=r(0.15), attention_probs_dropout_prob=r(0.25)),
        "opt": transformers.OPTConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                      ffn_dim=2 * D, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=1, dropout=r(0.2), attention_dropout=r(0.1)),
        "gpt_neox": transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=2 * D,
                                               max_position_embeddings=32, rotary_pct=0.5, bos_token_id=0,
                                               eos_token_id=0, hidden_dropout=r(0.2), attention_dropout=r(0.1)),
        "gpt_neox_sequential": transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * D,
            max_position_embeddings=32, rotary_pct=0.5, bos_token_id=0, eos_token_id=0, use_parallel_residual=False,
            hidden_dropout=r(0.2), attention_dropout=r(0.1)),
        "llama": transformers.LlamaConfig(**DECODER, attention_dropout=r(0.2)),
        "qwen2": transformers.Qwen2Config(**DECODER, attention_dropout=r(0.2)),
        "mistral": transformers.MistralConfig(**DECODER, attention_dropout=r(0.2)),
        "gemma": transformers.GemmaConfig(**DECODER, head_dim=8, attention_dropout=r(0.2)),
        "phi3": transformers.Phi3Config(**DECODER, attention_dropout=r(0.1), resid_pdrop=r(0.2),
                                        embd_pdrop=r(0.3)),  # HF's Phi-3 does not apply embd_pdrop
        "qwen3": transformers.Qwen3Config(**DECODER, head_dim=8, attention_dropout=r(0.2)),
        "olmo2": transformers.Olmo2Config(**DECODER, attention_dropout=r(0.2)),  # its norms after the sublayers
        "gemma2": transformers.Gemma2Config(**DECODER, head_dim=8, attention_dropout=r(0.2)),  # sandwich norms, caps
        "ministral": transformers.MinistralConfig(**DECODER, head_dim=4, attention_dropout=r(0.2)),  # layer_types
        # layers sliding and full, each its own rope (member_rope under dropout)
        "gemma3_text": transformers.Gemma3TextConfig(**DECODER, head_dim=8, sliding_window_pattern=2,
                                                     attention_dropout=r(0.2)),
        # the embedding's, the attention weights' and the parallel sublayers' outputs' (one norm)
        "phi": transformers.PhiConfig(**DECODER, qk_layernorm=True, attention_dropout=r(0.1), resid_pdrop=r(0.2),
                                      embd_pdrop=r(0.3)),
        # after the embeddings and lin2 (none after out_lin), the attention weights'
        "distilbert": transformers.DistilBertConfig(vocab_size=VOCAB, dim=D, n_layers=2, n_heads=4, hidden_dim=2 * D,
                                                    max_position_embeddings=32, dropout=r(0.15),
                                                    attention_dropout=r(0.25)),
        # the attention weights' alone (HF's MoE block has no dropout; its router jitter is 0 here)
        "mixtral": transformers.MixtralConfig(**DECODER, num_local_experts=4, attention_dropout=r(0.2)),
        "qwen3_moe": transformers.Qwen3MoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=D,
                                                 attention_dropout=r(0.2)),
        "olmoe": transformers.OlmoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2, attention_dropout=r(0.2)),
        # the attention weights' alone (HF's block, the shared expert too, has no dropout)
        "qwen2_moe": transformers.Qwen2MoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=D,
                                                 shared_expert_intermediate_size=D, attention_dropout=r(0.2)),
    }
    assert list(built) == FAMILIES, (list(built), FAMILIES)
    return built


def hf_model(config):
    torch.manual_seed(0)  # HF's initialization draws from torch's global generator: one draw in any test order
    cls = transformers.AutoModel if config.model_type in ENCODERS else transformers.AutoModelForCausalLM
    return randomized(cls.from_config(config, attn_implementation="eager"))


def batch():
    """Token ids [2, T] and a left-padded mask: the second row starts 3 pads in."""
    ids = np.random.default_rng(0).integers(2, VOCAB, size=(2, T)).astype(np.int32)
    mask = np.ones((2, T), np.int32)
    mask[1, :3] = 0
    return ids, mask


def hf_call(hf, ids, mask):
    kwargs = {"attention_mask": torch.from_numpy(mask).long()}
    if hf.config.model_type not in ENCODERS:
        kwargs["position_ids"] = torch.from_numpy(np.maximum(np.cumsum(mask, 1) - 1, 0)).long()
    out = hf(torch.from_numpy(ids).long(), **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_close_at_tokens(actual, expected, mask, scale=2.5e-5):
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(actual)[real], expected[real], rtol=0,
                               atol=scale * float(np.abs(expected[real]).max()))


# ---- 1. inference with dropout=True: HF's eval() ------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_inference_mode_equals_hf_eval(family):
    hf = hf_model(configs()[family])
    model = ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0))
    assert isinstance(_dropout.dropout_attention(_blocks(model).layers), _dropout.DropoutAttention)
    ids, mask = batch()
    with torch.no_grad():
        expected = hf_call(hf, ids, mask).numpy()
    assert_close_at_tokens(model(ids, mask), expected, mask)


def _blocks(model):
    return model.encoder.layer if hasattr(model, "encoder") else model._blocks()


# ---- 2. training mode with every rate 0: today's port, bit for bit --------------------------------

@pytest.mark.parametrize("family", ["gpt2", "bert", "opt", "gpt_neox", "llama", "phi3"])
def test_training_with_zero_rates_is_todays_port(family):
    hf = hf_model(configs(on=False)[family])
    today = ft.nn.from_hf(hf)
    ported = ft.nn.training(ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0)))
    ids, mask = batch()
    np.testing.assert_array_equal(np.asarray(ported(ids, mask)), np.asarray(today(ids, mask)))
    np.testing.assert_array_equal(np.asarray(ported(ids, mask, key=jax.random.key(3))), np.asarray(today(ids, mask)))


# ---- 3. training mode on the same masks: HF's train() ---------------------------------------------

def pattern(shape):
    """The one mask of a tensor's size (keep 3 in 4), the same for [B*T, D] (OPT's MLP) and [B, T, D]."""
    size = int(np.prod(shape))
    return np.random.default_rng(size * 1009 + shape[-1]).random(size).reshape(shape) >= 0.25


@pytest.fixture
def same_masks(monkeypatch):
    """Both sides' masks replaced by :func:`pattern`; each HF dropout call's rate recorded."""
    rates = []

    def bernoulli(key, p=0.5, shape=None, **kwargs):
        return jnp.asarray(pattern(tuple(shape) if shape is not None else np.shape(p)))

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        rates.append(p)
        keep = torch.from_numpy(pattern(tuple(x.shape)))
        return torch.where(keep, x / (1.0 - p), torch.zeros((), dtype=x.dtype))

    _stack._SCANS.clear()  # the eager scans compiled with the real draws
    monkeypatch.setattr(jax.random, "bernoulli", bernoulli)
    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    yield rates
    _stack._SCANS.clear()


# HF's dropout calls per forward of the 2-layer configs above: (rate, count)
HF_CALLS = {"gpt2": {0.1: 1, 0.2: 2, 0.3: 4}, "bert": {0.15: 5, 0.25: 2}, "opt": {0.1: 2, 0.2: 4},
            "gpt_neox": {0.2: 5, 0.1: 2}, "gpt_neox_sequential": {0.2: 5, 0.1: 2}, "llama": {0.2: 2},
            "phi3": {0.1: 2, 0.2: 4}, "olmo2": {0.2: 2}, "gemma2": {0.2: 2}, "gemma3_text": {0.2: 2},
            "phi": {0.3: 1, 0.1: 2, 0.2: 4}, "distilbert": {0.15: 3, 0.25: 2}, "mixtral": {0.2: 2},
            "qwen3_moe": {0.2: 2}, "olmoe": {0.2: 2}, "qwen2_moe": {0.2: 2}}


@pytest.mark.parametrize("family", list(HF_CALLS))
def test_training_equals_hf_train_on_the_same_masks(family, same_masks):
    hf = hf_model(configs()[family])
    model = ft.nn.training(ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0)))
    ids, mask = batch()
    hf.train()
    with torch.no_grad():
        expected = hf_call(hf, ids, mask).numpy()
    assert {p: same_masks.count(p) for p in set(same_masks)} == HF_CALLS[family]  # every HF position ran
    actual = model(ids, mask, key=jax.random.key(1))
    assert_close_at_tokens(actual, expected, mask)
    with torch.no_grad():  # and the masks matter: HF's eval differs
        assert not np.allclose(hf.eval()(torch.from_numpy(ids).long()).__getitem__(0).numpy()[0], expected[0],
                               atol=1e-3)


# ---- 5. gradients on the same masks: HF's backward ------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "bert", "opt", "gpt_neox", "llama", "phi3", "phi", "distilbert",
                                    "mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_gradients_equal_hf_backward_on_the_same_masks(family, same_masks):
    hf = hf_model(configs()[family])
    model = ft.nn.training(ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0)))
    ids, mask = batch()
    weights = np.random.default_rng(1).normal(size=(*ids.shape, 1)).astype(np.float32) * mask[..., None]
    hf.train()
    (hf_call(hf, ids, mask) * torch.from_numpy(weights)).sum().backward()
    wrt = ("embeddings", "encoder") if family == "bert" else 0  # not BERT's pooler: the loss is on the hidden state
    # one compiled program (eager, the backward's operations were each compiled apart)
    grads = jax.jit(ft.gradient(lambda m: jnp.sum(m(ids, mask, key=jax.random.key(1)) * weights), wrt=wrt))(model)
    ours = ft.nn.to_hf_state_dict(grads, numpy=True)
    theirs = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
    assert set(theirs) <= set(ours)
    # scaled to the largest gradient: some tensors' are 0 up to rounding (a key bias: softmax ignores it)
    scale = max(float(np.abs(g).max()) for g in theirs.values())
    for name, expected in theirs.items():
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=2.5e-5 * scale, err_msg=name)


# ---- 4. statistics: the rate, fresh masks every step, one mask per layer --------------------------

@pytest.fixture
def recorded(monkeypatch):
    """Every mask drawn (by shape), through the real ``jax.random.bernoulli``."""
    masks = []
    real = jax.random.bernoulli

    def bernoulli(key, p=0.5, shape=None, **kwargs):
        keep = real(key, p, shape, **kwargs)
        jax.debug.callback(lambda k: masks.append(np.asarray(k)), keep, ordered=False)
        return keep

    _stack._SCANS.clear()
    monkeypatch.setattr(jax.random, "bernoulli", bernoulli)
    yield masks
    _stack._SCANS.clear()


def gpt2_config(embd=0.0, attn=0.0, resid=0.0):
    return {"model_type": "gpt2", "vocab_size": VOCAB, "n_positions": 64, "n_embd": 32, "n_layer": 3, "n_head": 4,
            "embd_pdrop": embd, "attn_pdrop": attn, "resid_pdrop": resid}


def test_the_fraction_dropped_is_the_rate_and_each_layer_draws_its_own(recorded):
    model = ft.nn.training(ft.nn.from_hf(gpt2_config(embd=0.1, attn=0.3, resid=0.2), dropout=True,
                                         key=jax.random.key(0)))
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(4, 64)).astype(np.int32)
    jax.block_until_ready(model(ids, key=jax.random.key(1)))
    jax.effects_barrier()
    by_shape = {}
    for m in recorded:
        by_shape.setdefault(m.shape, []).append(m)
    weights, hidden = by_shape[(4, 4, 64, 64)], by_shape[(4, 64, 32)]
    assert len(weights) == 3 and len(hidden) == 1 + 2 * 3  # the embedding's, two per layer
    for masks, rate in ((weights, 0.3), (hidden[:1], 0.1)):
        for m in masks:
            sigma = np.sqrt(rate * (1 - rate) / m.size)
            assert abs((1 - m.mean()) - rate) < 5 * sigma
    dropped = 1 - np.mean([m.mean() for m in hidden[1:]])
    assert abs(dropped - 0.2) < 5 * np.sqrt(0.2 * 0.8 / (6 * hidden[1].size))
    assert len({m.tobytes() for m in weights}) == 3 and len({m.tobytes() for m in hidden}) == 7  # all different


def test_train_step_draws_fresh_masks_every_step(recorded):
    """A loss calling ``model(ids)`` without a key: each member's dropout_key advances as
    layer state, so the next step's masks differ; the weights still train."""
    model = ft.nn.training(ft.nn.from_hf(gpt2_config(attn=0.2, resid=0.1), dropout=True, key=jax.random.key(0)))
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, 8)).astype(np.int32)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.0))  # no move: the masks alone change the loss

    def loss(m, batch):
        return jnp.mean(m(batch) ** 2)

    step = ft.train.train_step(loss, opt, donate=False)
    state = opt.init(model)
    keys, losses = [], []
    for _ in range(3):
        keys.append(np.asarray(model.transformer.h.layers.attn.dropout_key))
        model, state, metrics = step(model, state, ids)
        losses.append(float(metrics["loss"]))
    jax.effects_barrier()
    assert len({k.tobytes() for k in keys}) == 3 and len(set(losses)) == 3
    assert not np.array_equal(keys[0][0], keys[0][1])  # each member its own key
    weights = [m for m in recorded if m.shape == (2, 4, 8, 8)]
    assert len({m.tobytes() for m in weights}) == len(weights) >= 9  # 3 layers x 3 steps, all different


@functools.cache
def _resid_port():
    """The port with a residual rate alone, in training mode: built once (a compile), read by
    the tests below (modules are immutable: none changes it)."""
    return ft.nn.training(ft.nn.from_hf(gpt2_config(resid=0.1), dropout=True, key=jax.random.key(0)))


def test_value_with_gradient_and_state_advances_the_keys():
    model = _resid_port()
    ids = np.zeros((1, 4), np.int32)
    # one compiled program (as a train step runs it): op by op it was most of the test's time
    _, _, state = jax.jit(lambda m: ft.nn.value_with_gradient_and_state(lambda m: jnp.sum(m(ids)), m))(model)
    after = ft.nn.apply_state(model, state)
    old, new = (np.asarray(m.transformer.h.layers.attn.dropout_key) for m in (model, after))
    assert old.shape == new.shape == (3, 2) and not np.array_equal(old, new)


def test_a_call_key_overrides_the_stored_keys():
    model = ft.nn.training(ft.nn.from_hf(gpt2_config(embd=0.2, attn=0.2, resid=0.2), dropout=True,
                                         key=jax.random.key(0)))
    ids = np.zeros((2, 6), np.int32)
    a, b, c = (np.asarray(model(ids, key=jax.random.key(k))) for k in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    inference = np.asarray(ft.nn.inference(model)(ids, key=jax.random.key(1)))
    np.testing.assert_array_equal(inference, np.asarray(ft.nn.from_hf(gpt2_config(), key=jax.random.key(0))(ids)))


# ---- the attention kernel: off in training with an attention rate only --------------------------

def test_the_kernel_runs_except_for_attention_dropout_in_training(monkeypatch):
    from functree.nn import _attention

    fused = []
    real = _attention._fused_attention
    monkeypatch.setattr(_attention, "_fused_attention", lambda *a: fused.append(1) or real(*a))
    ids = np.zeros((1, 4), np.int32)
    _stack._SCANS.clear()
    attention = ft.nn.from_hf(gpt2_config(attn=0.1), dropout=True, key=jax.random.key(0))  # built once, both modes
    for model, uses_kernel in ((attention, True), (ft.nn.training(attention), False), (_resid_port(), True)):
        fused.clear()
        model(ids, key=jax.random.key(1))
        assert bool(fused) == uses_kernel
    _stack._SCANS.clear()


# ---- 6. the default: today's structure, leaves and files ------------------------------------------

# sha256 (16 hex digits) of the tree definition (function addresses removed) and of the leaves'
# dtypes and shapes of ft.nn.from_hf(config, key=key(0)) with hf_config=None, written by the tree
# before dropout existed (9887404): the default port is the same tree. Since the twenty-sixth
# session the tree definitions hold MultiheadAttention's logit_scale, member_window and clip and
# OPT's do_layer_norm_before, project_out and project_in (None or their default in these ports:
# the leaves, their dtypes and shapes, are the ones before, each family's leaves hash unchanged).
# Since the twenty-seventh they hold its q_norm and k_norm (None) and qk_norm_per_head (Qwen3's
# and OLMo2's q/k norms; the leaves' hashes unchanged again, checked against the tree before).
# Then its logit_softcap (None; Gemma 2's attention soft-cap): the leaves' hashes unchanged again.
# The twenty-eighth added its member_rope (None; Gemma 3's rope per layer type): the leaves' hashes
# unchanged again (checked against the tree before, each family). The thirty-first added its
# member_rotates (None; SmolLM3's NoPE layers): the leaves' hashes unchanged again (each family's
# leaves hashed at 8c96ec5^ and after, equal; the fingerprints before it were the ones here then).
# The forty-first added its batch_first (True) and add_zero_attn (False; torch's options): the
# leaves' hashes unchanged again (each family's leaves hashed at c83c456 and after, equal).
TODAY = {"gpt2": "465a12cc49ebd4ad", "bert": "3af7773582f41ef0", "opt": "118bab561ab77297",
         "gpt_neox": "e38d7404f9e1fd64", "llama": "371dc283fcd0fec1", "qwen2": "21f83d9c9b20c624",
         "mistral": "9e71520b877be330", "gemma": "faa10359573ab48e", "phi3": "455c0d238a25af0a"}
SMALL = {
    "gpt2": {"n_positions": 32, "n_embd": 16, "n_layer": 2, "n_head": 4},
    "bert": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32,
             "max_position_embeddings": 32},
    "opt": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 32,
            "max_position_embeddings": 32},
    "gpt_neox": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
                 "max_position_embeddings": 32},
    **{f: {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 32} for f in ("llama", "qwen2", "mistral")},
    # Phi-3's default pad_token_id, 32000, is outside this vocabulary: HF refuses it (and from_hf)
    "phi3": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 32, "pad_token_id": 0},
    "gemma": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 32, "head_dim": 8},
}


def fingerprint(model):
    model = model.replace(hf_config=None)
    structure = re.sub(r" at 0x[0-9a-f]+", "", str(jax.tree.structure(model)))
    leaves = [(str(leaf.dtype), tuple(leaf.shape)) for leaf in jax.tree.leaves(model)]
    return hashlib.sha256((structure + repr(leaves)).encode()).hexdigest()[:16]


@pytest.mark.parametrize("family", list(TODAY))
def test_the_default_port_is_todays_tree(family):
    """Two builds (each a compile): the default port, read for its tree and its weights, and
    the dropout port; ``dropout=False``'s tree is traced (``jax.eval_shape``: the same tree
    definition, shapes and dtypes as its build, without compiling it)."""
    config = {"model_type": family, "vocab_size": VOCAB, **SMALL[family]}
    default = ft.nn.from_hf(config, key=jax.random.key(0))
    assert fingerprint(default) == TODAY[family]
    assert fingerprint(jax.eval_shape(lambda: ft.nn.from_hf(config, key=jax.random.key(0), dropout=False))) == \
        TODAY[family]
    with_dropout = ft.nn.from_hf(config, key=jax.random.key(0), dropout=True)
    assert fingerprint(with_dropout) != TODAY[family]
    # the same weights: dropout's keys come from their own stream of the key
    plain = ft.nn.to_hf_state_dict(default, numpy=True)
    dropped = ft.nn.to_hf_state_dict(with_dropout, numpy=True)
    assert plain.keys() == dropped.keys()
    for name, value in plain.items():
        np.testing.assert_array_equal(value, dropped[name])


def test_a_dropout_port_exports_saves_and_restores(tmp_path):
    hf = hf_model(configs()["gpt2"])
    model = ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0))
    sd = ft.nn.to_hf_state_dict(model)  # the weights alone: no dropout key in torch's names
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd, strict=True)
    ft.train.save(tmp_path / "ckpt", model)
    restored = ft.train.load(tmp_path / "ckpt", model)
    assert jax.tree.structure(restored) == jax.tree.structure(model)
    np.testing.assert_array_equal(np.asarray(restored.transformer.h.layers.attn.dropout_key),
                                  np.asarray(model.transformer.h.layers.attn.dropout_key))
    ids = np.zeros((1, 5), np.int32)
    expected = np.asarray(ft.nn.generate(ft.nn.from_hf(hf), ids, 3))
    np.testing.assert_array_equal(np.asarray(ft.nn.generate(model, ids, 3)), expected)
    # decoding never drops, in training mode too (a Trainer's model): no mask, no state recorded
    np.testing.assert_array_equal(np.asarray(ft.nn.generate(ft.nn.training(model), ids, 3)), expected)
    ft.nn.save_hf(model, tmp_path / "hf")  # the weights and the config alone
    assert type(ft.nn.from_hf(tmp_path / "hf").transformer.h.layers.attn) is ft.nn.MultiheadAttention


# ---- errors ---------------------------------------------------------------------------------------

def test_dropout_errors(tmp_path):
    config = gpt2_config(attn=0.1)
    saved = ft.nn.from_hf(config, key=jax.random.key(0))  # built once: its config, weights and directory below
    with pytest.raises(ValueError, match=r"dropout=True\) draws dropout masks and needs a PRNG key"):
        ft.nn.from_hf(saved.hf_config.to_dict(), ft.nn.to_hf_state_dict(saved, numpy=True), dropout=True)
    with pytest.raises(ValueError, match=r"dropout must be True .* got 0.1"):
        ft.nn.from_hf(config, key=jax.random.key(0), dropout=0.1)  # pyright: ignore[reportArgumentType]  # refused
    with pytest.raises(ValueError, match=r"the gpt2 config's attn_pdrop is 1.0; a dropout rate is a number in \[0, 1\)"):
        ft.nn.from_hf(gpt2_config(attn=1.0), key=jax.random.key(0), dropout=True)
    ft.nn.save_hf(saved, tmp_path / "saved")
    # A directory with weights: they are read, and the key seeds the masks (was refused, and
    # without dropout a key silently built a fresh model in place of the directory's weights).
    loaded = ft.nn.from_hf(tmp_path / "saved", dropout=True, key=jax.random.key(5))
    assert loaded.transformer.h.layers.attn.dropout == 0.1
    np.testing.assert_array_equal(loaded.transformer.wte.embeddings, saved.transformer.wte.embeddings)
    with pytest.raises(ValueError, match=r"(?s)the directory holds weights, and a key without dropout=True.*"
                                         r"right:  ft.nn.from_hf\('.*saved'\)  "):
        ft.nn.from_hf(tmp_path / "saved", key=jax.random.key(0))
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    fresh = ft.nn.from_hf(tmp_path / "config_only", key=jax.random.key(1))  # a config alone: HF's initialization
    assert not np.array_equal(fresh.transformer.wte.embeddings, saved.transformer.wte.embeddings)
    dropping = ft.nn.from_hf(tmp_path / "config_only", dropout=True, key=jax.random.key(1))  # was refused
    np.testing.assert_array_equal(dropping.transformer.wte.embeddings, fresh.transformer.wte.embeddings)
    assert dropping.transformer.h.layers.attn.dropout == 0.1
    opt = configs()["opt"]
    opt.layerdrop = 0.1
    with pytest.raises(ValueError, match=r"OPT config sets layerdrop=0.1"):
        ft.nn.from_hf(opt, key=jax.random.key(0), dropout=True)


def test_a_family_without_dropout_positions_is_refused():
    class Bare(HFModel):
        pass

    with pytest.raises(ValueError, match=r"Bare does not declare Hugging Face's dropout positions .*GPT2LMHeadModel"):
        _dropout.with_dropout(Bare(), None, True, jax.random.key(0))


def test_training_without_a_collector_or_key_warns_as_lora_does():
    model = _resid_port()
    with pytest.warns(ft.nn.UncollectedStateWarning):
        model(np.zeros((1, 4), np.int32))


def test_training_without_any_key_is_refused():
    model = _resid_port()
    blocks = model.transformer.h
    keyless = blocks.replace(layers=blocks.layers.replace(attn=blocks.layers.attn.replace(dropout_key=None)))
    model = model.replace(transformer=model.transformer.replace(h=keyless))
    with pytest.raises(ValueError, match=r"DropoutAttention \(a port built with dropout=True\) is in training mode without a key"):
        model(np.zeros((1, 4), np.int32))
    assert model(np.zeros((1, 4), np.int32), key=jax.random.key(0)).shape == (1, 4, VOCAB)


def _or_lines(error):
    """The code of a message's ``or:`` block (it runs to the end of the message)."""
    text = str(error).split("or:", 1)[1]
    return "\n".join(line.split("#")[0].strip() for line in text.splitlines() if line.strip())


def _attention_rates(model):
    found = [m for m in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, _dropout.DropoutAttention))
             if isinstance(m, _dropout.DropoutAttention)]
    return {(m.dropout, *m.rates) for m in found}


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "opt"])
def test_a_rate_given_as_dropout_is_pointed_at_the_family_s_own_fields(family):
    """BAD_DROPOUT_FLAG's fix was config.attn_pdrop = 0.05 for every family: GPT-2's field,
    which Llama does not read (its dropout silently 0)."""
    config = configs(on=False)[family]
    weights, key = hf_model(config).state_dict(), jax.random.key(0)
    with pytest.raises(ValueError, match=rf"dropout must be True .* got 0.05.*the {family} family reads") as info:
        ft.nn.from_hf(config, weights, dropout=0.05, key=key)  # pyright: ignore[reportArgumentType]  # refused
    fields = _dropout.rate_fields(_dropout.FAMILIES[config.model_type])
    assert _or_lines(info.value).startswith(" = ".join(f"config.{n}" for n in fields) + " = 0.05;")
    exec(_or_lines(info.value), {"ft": ft, "config": config, "weights": weights, "key": key})
    rates = _dropout.FAMILIES[config.model_type].hf_dropout(config)
    assert rates is not None and set(rates.values()) == {0.05}  # every field it reads
    model = ft.nn.from_hf(config, weights, dropout=True, key=key)
    assert 0.05 in {r for rates in _attention_rates(model) for r in rates}
    if family == "llama":  # the attention weights' rate, the only one: was 0 after config.attn_pdrop = 0.05
        assert _attention_rates(model) == {(0.05, 0.0, 0.0, 0.0)}


def test_a_rate_for_a_source_of_unknown_family_lists_each_family_s_fields(tmp_path):
    with pytest.raises(ValueError, match=r"got 0\.05\. A rate of your own goes into the config, in the fields the "
                                         r"model's family reads") as info:
        ft.nn.from_hf(tmp_path, dropout=0.05, key=jax.random.key(0))  # pyright: ignore[reportArgumentType]  # refused
    message = str(info.value)
    assert re.search(r"config\.attention_dropout = 0\.05 +# llama, qwen2, mistral, ministral, gemma, olmo, qwen3, olmo2, gemma2, gemma3_text, "
                     r"granite, smollm3, mixtral, qwen3_moe, olmoe, qwen2_moe\n", message)
    assert re.search(r"config\.hidden_dropout_prob = config\.attention_probs_dropout_prob = 0\.05 +# bert", message)
    config = configs(on=False)["llama"]  # the llama line and the call, as written
    code = [line for line in _or_lines(info.value).splitlines() if line in ("config.attention_dropout = 0.05",)
            or line.startswith("ft.nn.from_hf")]
    space = {"ft": ft, "config": config, "weights": hf_model(config).state_dict(), "key": jax.random.key(0)}
    exec("\n".join(code), space)
    assert _attention_rates(ft.nn.from_hf(config, space["weights"], dropout=True, key=space["key"])) == {
        (0.05, 0.0, 0.0, 0.0)}



# ---- 6. the embedding's rate alone; microbatches and devices draw masks of their own ---------------

def test_the_embedding_rate_alone_drops_as_hf_train(same_masks):
    # The audit: GPT-2 with only embd_pdrop > 0 dropped nothing (the blocks' `drops` ignored
    # the embedding's rate, so the model call drew no key).
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=D, n_layer=2, n_head=4, bos_token_id=0,
                                     eos_token_id=0, embd_pdrop=0.1, attn_pdrop=0.0, resid_pdrop=0.0)
    hf = hf_model(config)
    model = ft.nn.training(ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0)))
    ids, mask = batch()
    hf.train()
    with torch.no_grad():
        expected = hf_call(hf, ids, mask).numpy()
    assert same_masks == [0.1]  # HF dropped the embedding, nothing else
    assert_close_at_tokens(model(ids, mask, key=jax.random.key(1)), expected, mask)
    stored, state = ft.nn.collect_state(lambda m: m(ids, mask), model)  # the stored keys' path too
    assert_close_at_tokens(stored, expected, mask)
    assert [str(p) for p in state] == [".transformer.h.layers.attn.dropout_key"]  # advanced: fresh masks next step
    with torch.no_grad():
        assert not np.allclose(hf.eval()(torch.from_numpy(ids).long()).logits.numpy(), expected, atol=1e-3)


def mean_square(m, ids):
    out = m(ids)
    return jnp.mean(out ** 2), out


@pytest.mark.parametrize("rates", [dict(resid=0.5), dict(embd=0.5)])
def test_accumulated_microbatches_draw_masks_of_their_own(rates):
    # The audit: with accumulate=2 the two microbatches drew the stored keys' masks, so two
    # identical rows gave identical outputs (with accumulate=1 they differ). Microbatch i now
    # folds i into every key drawn from a stored key; the keys recorded for the next step are
    # the unsalted ones, the same for any k, and with k=1 the step is the plain call's.
    # The four calls below (the plain call, the steps with k = 1 and 2, microbatch 1's call)
    # run as ONE jitted program, as a train step runs them: eagerly, each of their operations
    # compiled apart (141 programs); as four programs, 4 compiles of ~1.5 CPU-s.
    model = ft.nn.training(ft.nn.from_hf(gpt2_config(**rates), dropout=True, key=jax.random.key(0)))
    ids = np.tile(np.arange(1, 9, dtype=np.int32)[None], (2, 1))
    opts = {k: ft.optim.Optimizer(ft.optim.sgd(0.0), accumulate=k) for k in (1, 2)}

    @jax.jit
    def calls(m):
        plain = ft.nn.collect_state(lambda m: m(ids), m)
        steps = {k: opt.minimize(mean_square, m, opt.init(m), ids, has_aux=True) for k, opt in opts.items()}
        with salted_keys(1):  # microbatch 1's masks: the row's call with salt 1 (traced here)
            second, _ = ft.nn.collect_state(lambda m: m(ids[1:]), m)
        return plain, steps, second

    (plain, plain_state), steps, second = calls(model)
    results = {}
    for k, (new, _, (_, out)) in steps.items():
        out = np.asarray(out).reshape(plain.shape)
        results[k] = out, np.asarray(new.transformer.h.layers.attn.dropout_key)
        assert float(np.max(np.abs(out[0] - out[1]))) > 1e-3 * float(np.abs(out).max())  # the rows' masks differ
    np.testing.assert_allclose(results[1][0], np.asarray(plain), rtol=0, atol=1e-6 * float(np.abs(plain).max()))
    (recorded,) = plain_state.values()
    np.testing.assert_array_equal(results[1][1], np.asarray(recorded))
    np.testing.assert_array_equal(results[2][1], np.asarray(recorded))
    np.testing.assert_allclose(results[2][0][1], np.asarray(second)[0], rtol=0,
                               atol=1e-6 * float(np.abs(second).max()))


MESH_MASKS = """
import numpy as np, jax, jax.numpy as jnp
import functree as ft
from functree.nn._salt import salted_keys

mesh = jax.make_mesh((8,), ("data",))
config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2, "n_head": 2,
          "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.5}
gpt2 = ft.nn.training(ft.nn.from_hf(config, key=jax.random.key(0), dropout=True))

class Adapted(ft.Module):
    a: ft.nn.Dense
    def __call__(self, x):
        return self.a(x)

def adapt():  # built as one program (eagerly, its initializers compiled 16; the same leaves bit for bit)
    adapted = ft.nn.lora(Adapted(ft.nn.Dense(32, 6, key=jax.random.key(0))), "a", rank=2, dropout=0.5,
                         key=jax.random.key(1))  # masks of 32 inputs: 8 devices' or 16 microbatches' all differ
    return ft.set(adapted, "a.lora_b", jnp.ones((2, 6)))

adapted = ft.nn.training(jax.jit(adapt)())

def loss_fn(m, b):
    out = m(b[0])
    return jnp.mean(out ** 2), out

out = {}
for name, model, row, key_path in (("gpt2", gpt2, np.arange(1, 7, dtype=np.int32), "transformer.h.layers.attn.dropout_key"),
                                   ("lora", adapted, np.arange(32, dtype=np.float32), "a.dropout_key")):
    # one device's call (one row), the same for k = 1 and 2, and device 3's (one microbatch:
    # the row's call with salt 3), made once per model as ONE program (op by op they were 3.7
    # of the subprocess's 21 CPU-s; as two programs, a compile more per model)
    def calls(m):
        plain = ft.nn.collect_state(lambda m: m(row[None]), m)  # noqa: B023
        with salted_keys(3):
            third, _ = ft.nn.collect_state(lambda m: m(row[None]), m)  # noqa: B023
        return plain, third

    (one, plain), third = jax.jit(calls)(model)
    # each output row read as one number (numpy's draw: no program to compile for it)
    w = np.random.default_rng(5).standard_normal(one.shape[1:]).astype(np.float32)
    for k in (1, 2):
        batch = (np.tile(row[None], (8 * k, 1)),)  # identical rows: k per device
        opt = ft.optim.Optimizer(ft.optim.sgd(0.0), accumulate=k, wrt="*")  # (LoRA: every parameter, deliberately)
        metrics = {f"row{i}": (lambda o, i=i: jnp.sum(o.aux[i] * w)) for i in range(8 * k)}
        new, _, values = ft.train.train_step(loss_fn, opt, mesh=mesh, donate=False, metrics=metrics)(
            model, opt.init(model), batch)
        rows = np.array([float(values[f"row{i}"]) for i in range(8 * k)])
        scale = float(np.abs(rows).max())
        out[f"{name}_{k}"] = {
            "distinct": len(set(rows.round(5).tolist())),
            "least_gap": min(abs(rows[i] - rows[j]) / scale for i in range(len(rows)) for j in range(i)),
            "device_3": abs(rows[3] - float(jnp.sum(third[0] * w))) / scale if k == 1 else 0.0,
            "keys_as_one_device": bool(np.array_equal(np.asarray(ft.get(new, key_path)),
                                                      np.asarray(next(iter(plain.values()))))),
        }
report(out)
"""


@pytest.mark.slow
def test_devices_of_a_mesh_draw_masks_of_their_own():
    # The audit: on an 8-device mesh every device drew the stored keys' masks (the step's
    # loss was one row's). Device d folds d into every key drawn from a stored key (HF ports'
    # and LoRA's), microbatches theirs within it; the keys recorded stay one device's.
    from _devices import run

    out = run(MESH_MASKS)
    for name in ("gpt2_1", "gpt2_2", "lora_1", "lora_2"):
        got = out[name]
        rows = 8 * int(name[-1])
        assert got["distinct"] == rows and got["least_gap"] > 1e-5, (name, got)  # equal masks: 0
        assert got["device_3"] < 1e-6 and got["keys_as_one_device"], (name, got)
