"""functree.hf._peft_members: a PEFT adapter's tensors per ft layer member, against PEFT.

A Stack's members keep PEFT's own ``A``, ``B`` and scale when PEFT's ``alpha_pattern`` /
``rank_pattern`` give its layers different scales (``LoraDense.member_scale``): training
continued from ``load_lora`` is PEFT's training (losses and logits after SGD and Adam steps
equal PEFT's, run the same way in torch), and ``save_lora`` writes PEFT's tensors and
scale per module back. Low-precision and mixed-dtype files, and files holding tensors
under adapter names. Tolerances: float32 rounding, 2.5e-5 times the values' magnitude (as
test_nn_lora); the defects these tests guard against were 1e-3 to 5e-2 off.
"""

import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_nn_lora import assert_close, hf_logits, llama, logits, next_token_loss, tokens

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

V1 = "layers.1.self_attn.v_proj"
PATTERNS: dict[str, dict[str, Any]] = {"alpha_pattern": dict(r=2, lora_alpha=6, alpha_pattern={V1: 24}),  # scales 3 and 12
            "rank_pattern": dict(r=2, lora_alpha=6, rank_pattern={V1: 4})}  # ranks 2 and 4: scales 3 and 1.5


def peft_adapter(directory, seed=2, **options):
    """A PEFT LoRA on q and v of a fresh llama(), A and B random (not zero), saved by PEFT."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0, **options)
    peft_model = peft.get_peft_model(llama(), config).eval()
    peft_model.save_pretrained(str(directory))
    return peft_model


def lora_tensors(peft_model):
    """``{module: (A, B, scale)}`` of a PeftModel's default adapter."""
    out = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[name] = (module.lora_A["default"].weight.detach().numpy().copy(),
                         module.lora_B["default"].weight.detach().numpy().copy(), module.scaling["default"])
    return out


def torch_loss(peft_model, ids):
    logp = torch.log_softmax(peft_model(torch.from_numpy(ids[:, :-1]).long()).logits, -1)
    return -logp.gather(-1, torch.from_numpy(ids[:, 1:, None]).long()).mean()


# Each pattern once, each optimizer once (SGD's update is the gradient's own scale, Adam's is
# not): the pairs cover what the four-way product did, at half the suite's time.
@pytest.mark.parametrize(("kind", "optimizer"), [("alpha_pattern", "sgd"), ("rank_pattern", "adam")])
def test_training_continued_from_a_patterned_adapter_is_peft_training(kind, optimizer, tmp_path):
    peft_model = peft_adapter(tmp_path / "peft", **PATTERNS[kind])
    model = ft.nn.load_lora(ft.nn.from_hf(llama()), tmp_path / "peft")
    v = model.model.layers.layers.self_attn.value_projection
    b1 = peft_model.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(v.lora_b[1, : b1.shape[1]]), b1.T)  # PEFT's B itself (was 4x it)
    expected_scales = [3.0, 12.0] if kind == "alpha_pattern" else [3.0, 1.5]
    assert np.asarray(v.member_scale).tolist() == expected_scales
    assert model.model.layers.layers.self_attn.query_projection.member_scale is None  # one scale: as before
    ids = tokens(batch=3, length=10, seed=3)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        torch_opt, transform = torch.optim.SGD(trainable, lr=0.5), ft.optim.sgd(0.5)
    else:
        torch_opt, transform = torch.optim.Adam(trainable, lr=1e-2), ft.optim.adam(1e-2)
    opt = ft.optim.Optimizer(transform, wrt="*.lora_*")
    state = opt.init(model)
    # one compiled step (as a train step runs it): op by op it was most of the test's time
    step = ft.jit(lambda m, s, x: opt.minimize(next_token_loss, m, s, x))
    peft_model.train()
    for _ in range(3):
        torch_opt.zero_grad()
        expected = torch_loss(peft_model, ids)
        expected.backward()
        torch_opt.step()
        model, state, loss = step(model, state, jnp.asarray(ids))
        np.testing.assert_allclose(float(loss), expected.item(), rtol=0, atol=2e-5)  # was 5e-3 off
    peft_model.eval()
    assert_close(logits(model, tokens()), hf_logits(peft_model, tokens()))  # was 0.05 off (of 0.4)
    ft.nn.save_lora(model, tmp_path / "ft")  # and PEFT reads back the same A, B and scale per module
    again = peft.PeftModel.from_pretrained(llama(), str(tmp_path / "ft")).eval()
    trained, back = lora_tensors(peft_model), lora_tensors(again)
    assert sorted(back) == sorted(trained)
    for module, (a, b, scale) in trained.items():
        assert back[module][0].shape == a.shape and back[module][2] == scale, module
        for mine, theirs in zip(back[module][:2], (a, b), strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5 * float(np.abs(theirs).max()))


def test_save_lora_writes_each_layer_s_rank_and_alpha(tmp_path):
    peft_adapter(tmp_path / "peft", r=2, lora_alpha=10, alpha_pattern={V1: 7}, rank_pattern={V1: 3})
    model = ft.nn.load_lora(ft.nn.from_hf(llama()), tmp_path / "peft")
    assert model.model.layers.layers.self_attn.value_projection.lora_a.shape[-1] == 3  # padded in the Stack
    ft.nn.save_lora(model, tmp_path / "ft")
    config = json.loads((tmp_path / "ft" / "adapter_config.json").read_text())
    key = r"model\.layers\.1\.self_attn\.v_proj"
    assert (config["r"], config["lora_alpha"], config["rank_pattern"], config["alpha_pattern"]) == (2, 10.0, {key: 3},
                                                                                                  {key: 7.0})
    again = ft.nn.load_lora(ft.nn.from_hf(llama()), tmp_path / "ft")
    assert jax.tree.structure(again) == jax.tree.structure(model)
    assert bool(jnp.all(logits(again, tokens()) == logits(model, tokens())))


def test_merge_lora_and_casts_use_each_member_s_scale(tmp_path):
    peft_model = peft_adapter(tmp_path, **PATTERNS["alpha_pattern"])
    model = ft.nn.load_lora(ft.nn.from_hf(llama()), tmp_path)
    expected = hf_logits(peft_model, tokens())
    assert_close(logits(ft.nn.merge_lora(model), tokens()), expected)
    cast = ft.cast(model, jnp.bfloat16)  # a no_derivative field: the scales stay float32
    assert cast.model.layers.layers.self_attn.value_projection.member_scale.dtype == jnp.float32


def rewritten(source, directory, convert):
    """``source``'s adapter with each tensor ``convert(name, tensor)``, the config beside it."""
    directory.mkdir()
    (directory / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    tensors = safetensors_torch.load_file(str(source / "adapter_model.safetensors"))
    safetensors_torch.save_file({k: convert(k, v) for k, v in tensors.items()},
                                str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize(("name", "convert", "dtype"), [
    ("bf16", lambda k, v: v.bfloat16(), jnp.bfloat16),
    ("A_bf16_B_f32", lambda k, v: v.bfloat16() if "lora_A" in k else v, jnp.float32),
    ("A_f16_B_bf16", lambda k, v: v.half() if "lora_A" in k else v.bfloat16(), jnp.float32)])
def test_low_precision_and_mixed_dtype_files_load_as_peft(name, convert, dtype, tmp_path):
    """PEFT computes in float32 whatever the file's dtype; a bfloat16 file's values fit a
    bfloat16 adapter exactly (with alpha 20 against 6 they were rescaled and rounded: 6e-4
    off), and lora_B float32 beside a bfloat16 lora_A is not rounded to it (7e-4 off)."""
    peft_adapter(tmp_path / "peft", r=2, lora_alpha=6, alpha_pattern={V1: 20})
    directory = rewritten(tmp_path / "peft", tmp_path / name, convert)
    expected = hf_logits(peft.PeftModel.from_pretrained(llama(), str(directory)).eval(), tokens())
    model = ft.nn.load_lora(ft.nn.from_hf(llama()), directory)
    assert {v.dtype for k, v in ft.to_flat_dict(model).items() if ".lora_" in k} == {jnp.dtype(dtype)}
    assert_close(logits(model, tokens()), expected)


def test_tensors_under_adapter_names_load_the_one_peft_loads(tmp_path):
    peft_model = peft_adapter(tmp_path / "one", r=2, lora_alpha=6)
    peft_model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    state = {k: v.detach().contiguous() for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert any(".lora_A.other." in k for k in state) and any(".lora_A.default." in k for k in state)

    def written(name, tensors):  # PEFT's config, these tensors
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text((tmp_path / "one" / "adapter_config.json").read_text())
        safetensors_torch.save_file(tensors, str(tmp_path / name / "adapter_model.safetensors"))
        return tmp_path / name

    both = written("both", state)
    with warnings.catch_warnings():  # PEFT 0.22 says so too: "Found unexpected adapter keys" (other's)
        warnings.filterwarnings("ignore", "Found unexpected adapter keys", UserWarning)
        expected = hf_logits(peft.PeftModel.from_pretrained(llama(), str(both)).eval(), tokens())
    peft_model.set_adapter("default")
    assert_close(expected, hf_logits(peft_model.eval(), tokens()))  # PEFT reads 'default'
    with pytest.raises(ValueError, match=r"(?s)both/adapter_model\.safetensors holds the tensors of several adapters: "
                                         r"'default' \(the one PeftModel.from_pretrained reads\) and 'other' \(on "
                                         r"\['model\.layers\.0\.self_attn\.q_proj'.*selected_adapters=\[\"default\"\]"):
        ft.nn.load_lora(ft.nn.from_hf(llama()), both)
    peft_model.save_pretrained(str(tmp_path / "selected"), selected_adapters=["default"])  # the message's fix
    assert_close(logits(ft.nn.load_lora(ft.nn.from_hf(llama()), tmp_path / "selected"), tokens()), expected)
    # default's q_proj beside other's v_proj: each module's only name loaded a mix (q of one
    # adapter, v of the other, no adapter PEFT loads: 1.2x the logits off); one name per file.
    mix = written("mix", {k: v for k, v in state.items() if (".q_proj." in k) == (".default." in k)})
    with pytest.raises(ValueError, match=r"(?s)several adapters: 'default' .* and 'other' \(on "
                                         r"\['model\.layers\.0\.self_attn\.v_proj', 'model\.layers\.1\.self_attn\.v_proj'\]\)"):
        ft.nn.load_lora(ft.nn.from_hf(llama()), mix)
    only_other = written("other", {k: v for k, v in state.items() if ".other." in k})  # one name: that adapter
    peft_model.set_adapter("other")
    assert_close(logits(ft.nn.load_lora(ft.nn.from_hf(llama()), only_other), tokens()), hf_logits(peft_model, tokens()))
    peft_model.set_adapter("default")
    two_others = written("two", {**{k: v for k, v in state.items() if ".other." in k},
                                 **{k.replace(".default.", ".third."): v for k, v in state.items() if ".default." in k}})
    with pytest.raises(ValueError, match=r"(?s)two/adapter_model\.safetensors holds the adapter of "
                                         r"'model\.layers\.0\.self_attn\.q_proj' under the adapter names "
                                         r"\['other', 'third'\].*selected_adapters"):
        ft.nn.load_lora(ft.nn.from_hf(llama()), two_others)
    unnamed = {k.replace(".other.", "."): v for k, v in state.items() if ".other." in k}
    clash = written("clash", {**unnamed, **{k: v for k, v in state.items() if ".default." in k}})
    with pytest.raises(ValueError, match=r"under the adapter names \[None, 'default'\] \(both PeftModel's names"):
        ft.nn.load_lora(ft.nn.from_hf(llama()), clash)
