"""SmolLM3 (``ft.hf``'s ``SmolLM3ForCausalLM``, a subclass of Llama's) against transformers' own:
tiny 4-layer configs with random weights (no download). HF's default makes layer 3 a NoPE
layer (``no_rope_layer_interval`` 4: its queries and keys unrotated); a config's own
``no_rope_layers`` ([0, 1, 0, 1] below) and the sliding window on the NoPE layers
(``use_sliding_window``) are each checked too.

As in tests/test_hf_granite.py: in float64 HF computes its rotary cos/sin and RMSNorm in
float32, so the logits agree to float32 rounding as HF computes (measured 8.8e-7 of their
magnitude at most over three seeds of each case, tolerance 1e-5); with those two widened to
float64 in HF's model (:func:`test_hf_granite.widened`), 7.5e-15 (tolerance 1e-13), the loss
1.9e-16 of itself and every gradient 3.3e-15 of the largest (tolerance 5e-14), at rope base 1e4 (at SmolLM3's default base 2e6 HF's float32
frequencies differ from functree's correctly rounded ones by an ulp: 4e-10 there). float32
logits, greedy cached tokens, exports and PEFT's LoRA as the other families (2.5e-5 of the
magnitude; measured 1.7e-6).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_granite import assert_logits, widened  # noqa: E402
from test_hf_load import DECODER, assert_generates_as_hf, batch, forward, hf_output  # noqa: E402

LAYERS = {**DECODER, "num_hidden_layers": 4}
AS_HF = 1e-5  # times max|HF|, float64 against HF's float32 rope and norms: measured 8.8e-7
WIDENED = 1e-13  # times max|HF|, against HF with those in float64: measured 7.5e-15
GRADIENTS = 5e-14  # times the largest gradient (the loss: of itself): measured 3.3e-15 (loss 1.9e-16)
FLOAT32 = 2.5e-5  # times max|HF| (test_hf_load.py's): measured 1.7e-6
CASES = {"default": {}, "own_list": {"no_rope_layers": [0, 1, 0, 1]},
         "sliding": {"use_sliding_window": True, "sliding_window": 3}}


def hf_model(seed=0, dtype=torch.float32, cls="SmolLM3ForCausalLM", **changes):
    torch.manual_seed(seed)
    hf = getattr(transformers, cls)(transformers.SmolLM3Config(**{**LAYERS, **changes})).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


@pytest.mark.parametrize("case", CASES)
def test_float64_logits_are_hfs_each_nope_layer_unrotated(case):
    """Two seeds as HF computes; at base 1e4, against HF widened (module docstring). The NoPE
    layers are each attention's ``member_rotates`` 0; the window on the sliding ones only."""
    changes = CASES[case]
    with jax.enable_x64(True):
        for seed in range(2):
            hf = hf_model(seed, torch.float64, **changes)
            model = ft.nn.from_hf(hf, dtype=jnp.float64)
            assert_logits(model, hf, AS_HF)
        attention = model.model.layers.layers.self_attn
        assert attention.member_rotates.tolist() == ([0, 1, 0, 1] if case == "own_list" else [1, 1, 1, 0])
        assert (attention.member_window is None) == (case != "sliding")
        if case == "sliding":
            assert attention.member_window.tolist() == [0, 0, 0, 3]
        hf = widened(hf_model(2, torch.float64, rope_theta=1e4, **changes))
        assert_logits(ft.nn.from_hf(hf, dtype=jnp.float64), hf, WIDENED)


def test_float64_gradients_are_hfs():
    """The mean next-token cross-entropy of HF's float64 logits (torch's ``cross_entropy``)
    and every parameter's gradient of it, against HF widened, NoPE layers [0, 1, 0, 1]."""
    hf = widened(hf_model(3, torch.float64, rope_theta=1e4, **CASES["own_list"]))
    ids, _ = batch(12)
    tokens = torch.from_numpy(ids).long()
    logits = hf(tokens).logits[:, :-1]
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    theirs.backward()
    hf_grads = {name: p.grad.numpy() for name, p in hf.named_parameters()}

    def loss(m):
        picked = jnp.take_along_axis(jax.nn.log_softmax(m(ids)[:, :-1]), ids[:, 1:, None], -1)
        return -jnp.mean(picked)

    with jax.enable_x64(True):
        # (int32 per-layer leaves); one program (op by op, each operation compiled apart)
        value, grads = jax.jit(ft.value_with_gradient(loss))(ft.nn.from_hf(hf, dtype=jnp.float64))
        ours = ft.nn.to_hf_state_dict(grads, numpy=True)
    np.testing.assert_allclose(float(value), theirs.item(), rtol=GRADIENTS)
    scale = max(float(np.abs(g).max()) for g in hf_grads.values())
    for name, expected in hf_grads.items():
        assert np.abs(expected).max() > 0, name
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=GRADIENTS * scale, err_msg=name)


def test_loads_from_every_source_exports_and_generates_as_hf(tmp_path):
    """float32, the sliding NoPE layer: from the HF object, its config and state dict, its
    config.json (the DEFAULTS row derives no_rope_layers and layer_types, base 2e6) and its
    save_pretrained directory; the strict export; HF's greedy tokens through the KV cache
    (a NoPE layer's cached keys unrotated); ``save_hf`` read by ``from_pretrained``."""
    hf = hf_model(4, **CASES["sliding"])
    hf.save_pretrained(tmp_path / "hf")
    config_json = {k: v for k, v in json.loads((tmp_path / "hf" / "config.json").read_text()).items()
                   if k in ("model_type", *LAYERS, "use_sliding_window", "sliding_window")}
    for given in ((hf,), (hf.config, hf.state_dict()), (config_json, hf.state_dict()), (tmp_path / "hf",)):
        model = ft.nn.from_hf(*given)
        assert type(model).__name__ == "SmolLM3ForCausalLM" and model.lm_head is None  # tied by default
        assert_logits(model, hf, FLOAT32)
    hf.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)
    assert_generates_as_hf(model, hf, length=12, new=6)
    ft.nn.save_hf(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert back.config.no_rope_layers == [1, 1, 1, 0] and back.config.layer_types[3] == "sliding_attention"
    theirs = hf.state_dict()
    for name, tensor in back.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("cls", ["SmolLM3ForSequenceClassification", "SmolLM3ForQuestionAnswering"])
def test_task_heads_are_hfs(cls):
    """HEADS' row: HF's sequence classifier (the rightmost non-pad token) and question
    answering (its body under ``transformer``, HF's base_model_prefix there)."""
    hf = hf_model(5, cls=cls)
    model = ft.nn.from_hf(hf)
    assert type(model).__name__ == cls
    ids, mask = batch(12)
    with torch.no_grad():
        out = hf(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
    ours = model(ids, mask)
    pairs = [(ours, out.logits)] if cls.endswith("Classification") else [
        (ours.start_logits, out.start_logits), (ours.end_logits, out.end_logits)]
    real = mask.astype(bool)
    for mine, theirs in pairs:
        theirs = theirs.numpy()
        mine, theirs = (np.asarray(mine), theirs) if mine.ndim == 2 and theirs.shape[1] != 12 else (
            np.asarray(mine)[real], theirs[real])
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=FLOAT32 * float(np.abs(theirs).max()))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_all_linear_lora_saved_is_read_by_peft_with_its_logits(tmp_path):
    """``ft.nn.lora(model, "all-linear")`` with nonzero B, ``save_lora``, PEFT's
    ``PeftModel.from_pretrained``: PEFT's logits (the adapter matters)."""
    model = ft.nn.lora(ft.nn.from_hf(hf_model(6)), "all-linear", rank=2, alpha=4, key=jax.random.key(1))
    flat = ft.to_flat_dict(model)
    b = {n: 0.3 * jax.random.normal(jax.random.key(i), v.shape, v.dtype)
         for i, (n, v) in enumerate(flat.items()) if n.endswith("lora_b")}
    model = ft.from_flat_dict(model, {**flat, **b})
    ft.nn.save_lora(model, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(hf_model(6), str(tmp_path)).eval()
    ids, mask = batch(12)
    expected = hf_output(peft_model, ids, mask, positions=False)
    real = mask.astype(bool)
    atol = FLOAT32 * float(np.abs(expected[real]).max())
    assert np.abs(hf_output(hf_model(6), ids, mask, positions=False)[real] - expected[real]).max() > 100 * atol
    np.testing.assert_allclose(np.asarray(forward(model, ids, mask))[real], expected[real], rtol=0, atol=atol)


@pytest.mark.parametrize(("changes", "says"), [
    ({"no_rope_layers": [1, 0]}, "IndexError"),
    ({"no_rope_layers": [1, "x", 0, 1]}, "refuses"),
    ({"no_rope_layer_interval": 0}, "ZeroDivisionError"),
])
def test_a_no_rope_list_hf_fails_on_is_refused_by_name(changes, says):
    """A list shorter than the layers (HF's attention: IndexError), not of integers, or none
    with an interval of 0 (HF's config: ZeroDivisionError)."""
    with pytest.raises(ValueError, match="no_rope_layers") as error:
        ft.nn.from_hf({"model_type": "smollm3", **LAYERS, **changes}, key=jax.random.key(0))
    assert says in str(error.value) and '"no_rope_layers": [1, 1, 1, 0]' in str(error.value)


def test_a_member_that_does_not_rotate_is_the_attention_without_rotary_exactly():
    """``MultiheadAttention``'s ``member_rotates``: 0 gives the unrotated attention bit for
    bit (a select), 1 the rotated one; with a cache too."""
    attn = ft.nn.MultiheadAttention(8, 2, rotary=True, causal=True, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    plain = attn.replace(rotary=None)
    np.testing.assert_array_equal(attn.replace(member_rotates=jnp.int32(0))(x), plain(x))
    np.testing.assert_array_equal(attn.replace(member_rotates=jnp.int32(1))(x), attn(x))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    cached = attn.replace(member_rotates=jnp.int32(0))(x, cache=attn.init_cache(2, 8), positions=positions)
    expected = plain(x, cache=plain.init_cache(2, 8), positions=positions)
    np.testing.assert_array_equal(cached[0], expected[0])
