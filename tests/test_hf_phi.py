"""Phi (``ft.hf``'s ``PhiForCausalLM``: phi-1, phi-1_5, phi-2) against transformers' own: tiny
configs with random weights (no download), 2 layers, hidden 32, vocab 100, weights moved by
N(0, 0.3) so that every tensor matters; the parallel block (one ``input_layernorm`` feeding
the attention and the MLP), biased q/k/v/dense, fc1/fc2 and head, partial rotary (0.5 and
0.4 of each head), ``qk_layernorm``, tied (the head's bias its own) and untied heads.

In float64 HF computes its rotary cos/sin in float32 whatever the dtype; as HF computes
them the logits agree to float32 rounding (measured 4.4e-8 of their magnitude at most over
three seeds of each case below, with and without the mask; tolerance 1e-6). With the rotary
widened to float64 in HF's model (:func:`test_hf_granite.widened`; Phi's LayerNorms are
torch's, float64 already) the port is HF's to float64 rounding: measured 1.3e-15 of the
logits' magnitude (tolerance 3e-14), the loss 2.7e-16 of itself and every gradient 1.5e-15
of the largest (tolerance 3e-14). float32 logits from every source, HF's greedy tokens
through the KV cache, exports, task heads and PEFT's LoRA both ways: 2.5e-5 of the magnitude
as the other families (measured 9.0e-7). Each the largest under the four XLA CPU
instruction sets (isa-sweep). Phi's dropout (``embd_pdrop``, ``attention_dropout``,
``resid_pdrop``) against HF's ``train()`` on the same masks: tests/test_hf_dropout.py.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _phi
from functree.hf._causal import TiedBias

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_granite import widened  # noqa: E402
from test_hf_load import assert_generates_as_hf, forward, hf_output  # noqa: E402

VOCAB, T = 100, 12
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0,
         "pad_token_id": 0}
AS_HF = 1e-6  # times max|HF|, float64 against HF's float32 rotary: measured 4.4e-8
WIDENED = 3e-14  # times max|HF|, against HF's rotary in float64: measured 1.3e-15
GRADIENTS = 3e-14  # times the largest gradient (the loss: of itself): measured 1.5e-15 (loss 2.7e-16)
FLOAT32 = 2.5e-5  # times max|HF| (test_hf_load.py's): measured 9.0e-7
# head 8, factor 0.5: 4 rotated; hidden 40 (head 10), factor 0.4: 4 rotated of 10
CASES = {"default": {}, "qk_layernorm": {"qk_layernorm": True},
         "partial_0.4": {"hidden_size": 40, "partial_rotary_factor": 0.4},
         "tied_gqa": {"tie_word_embeddings": True, "num_key_value_heads": 2, "qk_layernorm": True}}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"]  # PEFT's own for phi


def hf_model(seed=0, dtype=torch.float32, cls="PhiForCausalLM", **changes):
    torch.manual_seed(seed)
    hf = getattr(transformers, cls)(transformers.PhiConfig(**{**SIZES, **changes})).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


def batch(length=T):
    """Token ids [2, length] and a left-padded mask: the second row starts 3 pads in."""
    ids = np.random.default_rng(0).integers(1, VOCAB, size=(2, length)).astype(np.int32)
    mask = np.ones((2, length), np.int32)
    mask[1, :3] = 0
    return ids, mask


def assert_logits(model, hf, tolerance, masked=True):
    """Logits at the real tokens of the left-padded batch (HF's own positions from its mask),
    or of the batch without a mask."""
    ids, mask = batch()
    if not masked:
        mask = np.ones_like(mask)
    expected = hf_output(hf, ids, mask, positions=False)
    actual = np.asarray(forward(model, ids, mask) if masked else model(ids))
    real = mask.astype(bool)
    np.testing.assert_allclose(actual[real], expected[real], rtol=0,
                               atol=tolerance * float(np.abs(expected[real]).max()))


@pytest.mark.parametrize("case", CASES)
def test_float64_logits_are_hfs_with_and_without_a_mask(case):
    """As HF computes (its float32 rotary), and against HF widened: the parallel block, the
    partial rotary, the per-head q/k LayerNorms, the tied head's own bias."""
    changes = CASES[case]
    with jax.enable_x64(True):
        hf = hf_model(1, torch.float64, **changes)
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        attention = model.model.layers.layers.self_attn
        assert attention.rotary.partial == changes.get("partial_rotary_factor", 0.5)
        assert (attention.q_norm is not None) == bool(changes.get("qk_layernorm"))
        assert isinstance(model.lm_head, TiedBias if "tie_word_embeddings" in changes else ft.nn.Dense)
        assert attention.key_projection.bias is not None and attention.output_projection.bias is not None
        for masked in (True, False):
            assert_logits(model, hf, AS_HF, masked)
        widened(hf)
        for masked in (True, False):
            assert_logits(model, hf, WIDENED, masked)


def test_float64_loss_and_gradients_are_hfs():
    """The mean next-token cross-entropy of HF's float64 logits and every parameter's
    gradient of it (biases, q/k LayerNorms and the tied head's bias included), against HF
    widened."""
    hf = widened(hf_model(2, torch.float64, **CASES["tied_gqa"]))
    ids, _ = batch()
    tokens = torch.from_numpy(ids).long()
    logits = hf(tokens).logits[:, :-1]
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    theirs.backward()
    hf_grads = {name: p.grad.numpy() for name, p in hf.named_parameters()}

    def loss(m):
        picked = jnp.take_along_axis(jax.nn.log_softmax(m(ids)[:, :-1]), ids[:, 1:, None], -1)
        return -jnp.mean(picked)

    with jax.enable_x64(True):
        # one program (op by op, each operation compiled apart)
        value, grads = jax.jit(ft.value_with_gradient(loss))(ft.nn.from_hf(hf, dtype=jnp.float64))
        ours = ft.nn.to_hf_state_dict(grads, numpy=True)
    np.testing.assert_allclose(float(value), theirs.item(), rtol=GRADIENTS)
    scale = max(float(np.abs(g).max()) for g in hf_grads.values())
    assert "lm_head.bias" in hf_grads and "model.layers.1.self_attn.k_layernorm.bias" in hf_grads
    for name, expected in hf_grads.items():
        assert np.abs(expected).max() > 0, name
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=GRADIENTS * scale, err_msg=name)


@pytest.mark.parametrize("case", ["qk_layernorm", "tied_gqa"])
def test_loads_from_every_source_exports_and_generates_as_hf(case, tmp_path):
    """float32: from the HF object, its config and state dict, its config.json's keys alone
    (the DEFAULTS row: the factor 0.5, gelu_new, eps 1e-5) and its save_pretrained directory
    (a tied head saved without lm_head.weight); the strict export; HF's greedy tokens through
    the KV cache on the left-padded batch; ``save_hf`` read by ``from_pretrained``, equal."""
    hf = hf_model(3, **CASES[case])
    hf.save_pretrained(tmp_path / "hf")
    config_json = {k: v for k, v in json.loads((tmp_path / "hf" / "config.json").read_text()).items()
                   if k in ("model_type", *SIZES, *CASES[case])}
    for given in ((hf,), (hf.config, hf.state_dict()), (config_json, hf.state_dict()), (tmp_path / "hf",)):
        model = ft.nn.from_hf(*given)
        assert type(model).__name__ == "PhiForCausalLM" and model.model.layers.layers.self_attn.rotary.partial == 0.5
        assert_logits(model, hf, FLOAT32)
    hf.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)
    assert_generates_as_hf(model, hf, length=T, new=6)
    ft.nn.save_hf(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == "PhiForCausalLM" and back.config.qk_layernorm
    theirs = hf.state_dict()
    assert set(back.state_dict()) == set(theirs)
    for name, tensor in back.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("cls", ["PhiForSequenceClassification", "PhiForTokenClassification"])
def test_task_heads_are_hfs(cls):
    """HEADS' row (transformers 5.25 has these two for phi): the sequence classifier at the
    rightmost non-pad token, the token classifier at every real token; the export is strict."""
    hf = hf_model(4, cls=cls, num_labels=3)
    model = ft.nn.from_hf(hf)
    assert type(model).__name__ == cls
    ids, mask = batch()
    expected = hf_output(hf, ids, mask, positions=False)
    ours = np.asarray(model(ids, mask))
    if cls.endswith("TokenClassification"):
        real = mask.astype(bool)
        ours, expected = ours[real], expected[real]
    np.testing.assert_allclose(ours, expected, rtol=0, atol=FLOAT32 * float(np.abs(expected).max()))
    hf.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)


def _nonzero_b(model):
    flat = ft.to_flat_dict(model)
    b = {n: 0.3 * jax.random.normal(jax.random.key(i), v.shape, v.dtype)
         for i, (n, v) in enumerate(flat.items()) if n.endswith("lora_b")}
    return ft.from_flat_dict(model, {**flat, **b})


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_lora_saved_is_read_by_peft_and_peft_s_is_read_back(tmp_path):
    """``ft.nn.lora`` on PEFT's phi targets (q_proj, k_proj, v_proj, dense, fc1, fc2) with
    nonzero B, ``save_lora``, PEFT's ``PeftModel.from_pretrained``: PEFT's logits (the adapter
    matters). PEFT's own adapter (``get_peft_model`` on the same targets, its B moved off 0,
    ``save_pretrained``) read by ``load_lora``: PEFT's logits again."""
    patterns = [f"*.{t}" for t in LORA_TARGETS]
    model = _nonzero_b(ft.nn.lora(ft.nn.from_hf(hf_model(5)), patterns, rank=2, alpha=4, key=jax.random.key(1)))
    ft.nn.save_lora(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_modules"]
    assert {name.rpartition(".")[2] for name in written} == set(LORA_TARGETS) and len(written) == 12
    ids, mask = batch()
    real = mask.astype(bool)
    peft_model = peft.PeftModel.from_pretrained(hf_model(5), str(tmp_path / "ours")).eval()
    expected = hf_output(peft_model, ids, mask, positions=False)
    atol = FLOAT32 * float(np.abs(expected[real]).max())
    assert np.abs(hf_output(hf_model(5), ids, mask, positions=False)[real] - expected[real]).max() > 100 * atol
    np.testing.assert_allclose(np.asarray(forward(model, ids, mask))[real], expected[real], rtol=0, atol=atol)

    theirs = peft.get_peft_model(hf_model(6), peft.LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    theirs.save_pretrained(tmp_path / "peft")
    loaded = ft.nn.load_lora(ft.nn.from_hf(hf_model(6)), tmp_path / "peft")
    expected = hf_output(theirs.eval(), ids, mask, positions=False)
    np.testing.assert_allclose(np.asarray(forward(loaded, ids, mask))[real], expected[real], rtol=0,
                               atol=FLOAT32 * float(np.abs(expected[real]).max()))


@pytest.mark.parametrize(("changes", "key", "fix"), [
    ({"partial_rotary_factor": 0.4}, "partial_rotary_factor", '"partial_rotary_factor": 0.25'),  # int(8 * 0.4) = 3
    ({"qk_layernorm": True, "head_dim": 16}, "qk_layernorm", '"qk_layernorm": true                 # no head_dim'),
    ({"num_key_value_heads": 3}, "num_key_value_heads", '"num_key_value_heads": 4'),
])
def test_a_config_hf_fails_on_is_refused_naming_the_key_and_the_fix(changes, key, fix):
    """An odd rotated count (HF's rotary: a size mismatch in its forward), q/k LayerNorms over
    another size than the heads (HF builds them over hidden / heads), key/value heads that
    do not divide the heads: each refused naming the key and a config that works."""
    config = transformers.PhiConfig(**{**SIZES, **changes})
    if key != "num_key_value_heads":  # (HF's model refuses at build or forward: the claim checked)
        with pytest.raises(RuntimeError):
            transformers.PhiForCausalLM(config)(torch.zeros((1, 3), dtype=torch.long))
    with pytest.raises(ValueError, match=key) as error:
        ft.nn.from_hf(config, key=jax.random.key(0))
    assert fix in str(error.value) and "wrong:" in str(error.value)
    if key == "qk_layernorm":
        assert str(error.value).startswith(_phi.QK_LAYERNORM_HEAD_DIM.split("{")[0])
