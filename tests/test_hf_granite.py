"""IBM Granite (``ft.hf``'s ``GraniteForCausalLM``, a subclass of Llama's) against transformers'
own: tiny configs with random weights (no download), every multiplier away from 1 and none a
power of two (``embedding_multiplier`` 3, ``residual_multiplier`` 0.3, ``attention_multiplier``
0.3, ``logits_scaling`` 2.5: a multiplier rounded to float32 or applied in the wrong place shows).

In float64, HF's model computes two things in float32 whatever its dtype: the rotary cos/sin
and RMSNorm (``hidden_states.to(torch.float32)``). As HF computes them, the logits agree to
float32 rounding: measured 1.6e-7 of their magnitude at most over three seeds, tied and
untied (tolerance 3e-6, as tests/test_hf_qa.py's rotary families). With those two widened to
float64 in HF's model (:func:`widened`: the same formulas in float64) the port is HF's to
float64 rounding: 6.3e-16 of the logits' magnitude measured (tolerance 1e-14), the loss
1.1e-16 of itself and every gradient 7.6e-16 of the largest (tolerance 1e-14): the multipliers
sit where HF's do, unrounded (the attention's in float32 fails here at 3.3e-5). float32
logits, greedy tokens, exports and PEFT's LoRA: as the other families (2.5e-5 of the
magnitude; measured 3.5e-7).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _granite

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_load import DECODER, assert_generates_as_hf, batch, forward, hf_output  # noqa: E402

MULTIPLIERS = {"embedding_multiplier": 3.0, "residual_multiplier": 0.3, "attention_multiplier": 0.3,
               "logits_scaling": 2.5}
AS_HF = 3e-6  # times max|HF|, float64 against HF's float32 rope and norms: measured 1.6e-7
WIDENED = 1e-14  # times max|HF|, against HF with those in float64: measured 6.3e-16
GRADIENTS = 1e-14  # times the largest gradient (the loss: of itself): measured 7.6e-16 (loss 1.1e-16)
FLOAT32 = 2.5e-5  # times max|HF|, float32 (test_hf_load.py's): measured 3.5e-7


def config(**changes):
    return transformers.GraniteConfig(**{**DECODER, **MULTIPLIERS, **changes})


def hf_model(seed=0, dtype=torch.float32, **changes):
    """HF's GraniteForCausalLM (sdpa: its float64 eager softmax over a padding row is NaN),
    weights moved by N(0, 0.3) so that every tensor matters."""
    torch.manual_seed(seed)
    hf = transformers.GraniteForCausalLM(config(**changes)).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


def widened(hf):
    """``hf`` with its rotary cos/sin and its RMSNorms computed in the model's dtype (HF's
    formulas, float32 there whatever the dtype): the reference the multipliers are checked
    against at float64 rounding."""
    rotary = hf.model.rotary_emb

    def rope(x, position_ids):
        angles = position_ids[..., None].to(x.dtype) * rotary.inv_freq.to(torch.float32).to(x.dtype)
        both = torch.cat((angles, angles), dim=-1)
        return both.cos(), both.sin()

    rotary.forward = rope
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):  # GraniteRMSNorm, SmolLM3RMSNorm (Llama's formula)
            module.forward = lambda x, m=module: m.weight * (
                x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))
    return hf


def assert_logits(model, hf, tolerance, length=12):
    ids, mask = batch(length)
    expected = hf_output(hf, ids, mask, positions=False)  # HF's own positions: cumsum(mask) - 1 from its mask
    actual = np.asarray(forward(model, ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(actual[real], expected[real], rtol=0, atol=tolerance * float(np.abs(expected[real]).max()))


@pytest.mark.parametrize("tied", [False, True])
def test_float64_logits_are_hfs_left_padded(tied):
    """Three seeds as HF computes (its float32 rope and norms), the last also against HF with
    them widened: the multipliers unrounded, where HF applies them (the tied head reads the
    embedding table unscaled; the logits divided by ``logits_scaling`` after it)."""
    with jax.enable_x64(True):
        for seed in range(3):
            hf = hf_model(seed, torch.float64, tie_word_embeddings=tied)
            model = ft.nn.from_hf(hf, dtype=jnp.float64)
            assert (model.lm_head is None) == tied and model.logits_scaling == 2.5
            assert_logits(model, hf, AS_HF)
        assert_logits(model, widened(hf), WIDENED)
        assert model.model.layers.layers.self_attn.logit_scale.dtype == jnp.float64  # 0.3, not float32's 0.30000001


def test_float64_loss_and_gradients_are_hfs():
    """The mean next-token cross-entropy (torch's ``cross_entropy`` of HF's float64 logits)
    and every parameter's gradient of it, against HF widened (module docstring), in float64;
    HF's own ``labels=`` loss casts the logits to float32 first (``ForCausalLMLoss``): equal
    to float32 rounding (measured 5.5e-8 of itself, tolerance 1e-6)."""
    hf = widened(hf_model(1, torch.float64))
    ids, _ = batch(12)
    tokens = torch.from_numpy(ids).long()
    hf.zero_grad()
    logits = hf(tokens).logits[:, :-1]
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    theirs.backward()
    hf_grads = {name: p.grad.numpy() for name, p in hf.named_parameters()}
    with torch.no_grad():
        hf_loss = hf(tokens, labels=tokens).loss.item()

    def loss(m):
        logits = m(ids)[:, :-1]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)
        return -jnp.mean(picked)

    with jax.enable_x64(True):
        # one program (op by op, each operation compiled apart)
        value, grads = jax.jit(jax.value_and_grad(loss))(ft.nn.from_hf(hf, dtype=jnp.float64))
        ours = ft.nn.to_hf_state_dict(grads, numpy=True)
    np.testing.assert_allclose(float(value), theirs.item(), rtol=GRADIENTS)
    np.testing.assert_allclose(float(value), hf_loss, rtol=1e-6)
    scale = max(float(np.abs(g).max()) for g in hf_grads.values())
    for name, expected in hf_grads.items():
        assert np.abs(expected).max() > 0, name
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=GRADIENTS * scale, err_msg=name)


def test_loads_from_every_source_exports_and_generates_as_hf(tmp_path):
    """float32: from the HF object, its config and state dict, its config.json as a dict (the
    DEFAULTS row fills the rest) and its save_pretrained directory, each with HF's logits;
    the strict export, HF's greedy tokens; ``save_hf`` read by ``from_pretrained`` with the
    same tensors and the multipliers in its config."""
    hf = hf_model(2)
    hf.save_pretrained(tmp_path / "hf")
    config_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    config_json = {k: v for k, v in config_json.items() if k in ("model_type", *DECODER, *MULTIPLIERS)}
    for given in ((hf,), (hf.config, hf.state_dict()), (config_json, hf.state_dict()), (tmp_path / "hf",)):
        model = ft.nn.from_hf(*given)
        assert type(model).__name__ == "GraniteForCausalLM"
        assert_logits(model, hf, FLOAT32)
    hf.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)
    assert_generates_as_hf(model, hf, length=12)
    ft.nn.save_hf(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == "GraniteForCausalLM"
    assert {k: getattr(back.config, k) for k in MULTIPLIERS} == MULTIPLIERS
    theirs = hf.state_dict()
    for name, tensor in back.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_all_linear_lora_saved_is_read_by_peft_with_its_logits(tmp_path):
    """``ft.nn.lora(model, "all-linear")`` with nonzero B, ``save_lora``, PEFT's
    ``PeftModel.from_pretrained`` on HF's model: PEFT's logits (the adapter matters)."""
    model = ft.nn.lora(ft.nn.from_hf(hf_model(3)), "all-linear", rank=2, alpha=4, key=jax.random.key(1))
    flat = ft.to_flat_dict(model)
    b = {n: 0.3 * jax.random.normal(jax.random.key(i), v.shape, v.dtype)
         for i, (n, v) in enumerate(flat.items()) if n.endswith("lora_b")}
    model = ft.from_flat_dict(model, {**flat, **b})
    ft.nn.save_lora(model, tmp_path)
    targets = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    assert len(targets) == 14 and {t.rsplit(".", 1)[1] for t in targets} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # no lm_head, as PEFT's
    peft_model = peft.PeftModel.from_pretrained(hf_model(3), str(tmp_path)).eval()
    ids, mask = batch(12)
    expected = hf_output(peft_model, ids, mask, positions=False)
    real = mask.astype(bool)
    atol = FLOAT32 * float(np.abs(expected[real]).max())
    assert np.abs(hf_output(hf_model(3), ids, mask, positions=False)[real] - expected[real]).max() > 100 * atol
    np.testing.assert_allclose(np.asarray(forward(model, ids, mask))[real], expected[real], rtol=0, atol=atol)


@pytest.mark.parametrize(("option", "value", "says"), [
    ("logits_scaling", 0, "must not be 0"),
    ("embedding_multiplier", float("nan"), "finite number"),
    ("attention_multiplier", float("inf"), "finite number"),
    ("residual_multiplier", -float("inf"), "finite number"),
])
def test_a_multiplier_functree_cannot_reproduce_is_refused_by_name(option, value, says):
    """HF's GraniteConfig takes these (its model's logits are then inf or NaN): MULTIPLIER
    names the option, the value and a checkpoint's value. (A config.json's string or null
    is refused by the file reader, by name, as HF's config class refuses it.)"""
    with pytest.raises(ValueError, match=option) as error:
        ft.nn.from_hf(config(**{option: value}), key=jax.random.key(0))
    assert says in str(error.value) and "right:" in str(error.value)
    with pytest.raises(ValueError, match="residual_multiplier"):
        ft.nn.from_hf({"model_type": "granite", **DECODER, "residual_multiplier": "0.22"}, key=jax.random.key(0))


def test_times_rounds_a_half_tensor_once_as_torch():
    """A bfloat16 tensor times 0.22: torch computes in float32 and rounds once (0.22 is not
    rounded to bfloat16 first); float32 computes in float32; a factor of 1 adds nothing."""
    x = torch.linspace(-3, 3, 97, dtype=torch.bfloat16)
    ours = _granite.times(jnp.asarray(x.float().numpy(), jnp.bfloat16), 0.22)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), (x * 0.22).float().numpy())
    y = jnp.ones(3)
    assert _granite.times(y, 1.0) is y
