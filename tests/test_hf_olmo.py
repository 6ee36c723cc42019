"""OLMo (``ft.hf``'s ``OlmoForCausalLM``, one subclass of Llama's) against transformers'
``OlmoForCausalLM``: built from a tiny config with random weights (no download), loaded from
the HF object, from its config and state dict, from a config.json dict and from a
``save_pretrained`` directory; its parameter-free LayerNorm exports nothing (strict load);
PEFT's LoRA adapters load and save bit for bit. Logits at the real tokens of a left-padded
batch within 2.5e-5 of their magnitude (measured: 1.4e-6 at 2.8). Greedy tokens, the strict export and
``save_hf`` -> ``from_pretrained`` run with the other families (``test_hf_load.py``'s and
``test_hf_save.py``'s ``FAMILIES``)."""

import json
import os
import re

import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from test_hf_load import DECODER, assert_equal_at_tokens, hf_model  # noqa: E402


def olmo_config(**changes):
    return transformers.OlmoConfig(**{**DECODER, "attention_bias": True, **changes})


@pytest.fixture(scope="module")
def hf():
    return hf_model(olmo_config())


def test_olmo_loads_from_every_source_with_hf_logits(hf, tmp_path):
    """The HF object, its config and state dict, its config.json as a dict (read by functree
    with OLMo's defaults row), and the directory save_pretrained wrote: the same model."""
    hf.save_pretrained(tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    sources = {"object": (hf,), "config": (hf.config, hf.state_dict()), "json": (config_json, hf.state_dict()),
               "directory": (tmp_path,)}
    models = {name: ft.nn.from_hf(*given) for name, given in sources.items()}
    for name, model in models.items():
        assert type(model).__name__ == "OlmoForCausalLM", name
        assert_equal_at_tokens(model, hf, length=12)
    norm = models["directory"].model.norm
    assert norm.scale is None and norm.offset is None and norm.epsilon == 1e-5  # HF's OlmoLayerNorm
    sd = ft.nn.to_hf_state_dict(models["json"])
    assert set(sd) == set(hf.state_dict()) and not any("norm" in k for k in sd)
    transformers.OlmoForCausalLM(olmo_config()).load_state_dict(sd, strict=True)


def test_olmo_clip_qkv_clamps_as_hf():
    """``clip_qkv`` (refused by name before): HF clamps the q, k, v projections' outputs;
    the port's attention clamps them too (its static ``clip``), HF's logits at a bound that
    clamps (the model without the clamp is far from them). Greedy tokens, training and
    save-back: tests/test_hf_options.py."""
    hf = hf_model(olmo_config(clip_qkv=0.5))
    model = ft.nn.from_hf(hf)
    assert model.model.layers.layers.self_attn.clip == 0.5
    assert_equal_at_tokens(model, hf, length=12)
    unclamped = model.replace(model=model.model.replace(layers=model.model.layers.replace(
        layers=model.model.layers.layers.replace(self_attn=model.model.layers.layers.self_attn.replace(clip=None)))))
    ids = np.random.default_rng(0).integers(0, 40, size=(1, 12)).astype(np.int32)
    assert not np.allclose(np.asarray(unclamped(ids)), np.asarray(model(ids)), atol=1e-2)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_olmo_lora_loads_and_saves_as_peft_does(tmp_path):
    """PEFT's adapters on q, v and the MLP's down projection: loaded, the logits PEFT's model
    computes; saved back, PEFT's tensors bit for bit."""
    base = hf_model(olmo_config())
    ours_base = ft.nn.from_hf(base)  # before PEFT puts its layers into it
    torch.manual_seed(2)
    peft_model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=2, lora_alpha=4,
                                                           target_modules=["q_proj", "v_proj", "down_proj"])).eval()
    peft_model.save_pretrained(str(tmp_path / "peft"))
    ids = np.random.default_rng(0).integers(0, DECODER["vocab_size"], size=(2, 7))
    with torch.no_grad():
        expected = peft_model(torch.from_numpy(ids).long()).logits.numpy()
    model = ft.nn.load_lora(ours_base, tmp_path / "peft")
    assert not np.allclose(np.asarray(ours_base(ids.astype(np.int32))), expected, atol=1e-2)  # the adapter matters
    ours = np.asarray(model(ids.astype(np.int32)))
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2.5e-5 * float(np.abs(expected).max()))
    ft.nn.save_lora(model, tmp_path / "ft")
    saved, theirs = (safetensors_numpy.load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("ft", "peft"))
    assert set(saved) == set(theirs) and all(np.array_equal(saved[k], theirs[k]) for k in theirs)


def test_the_guide_lists_every_family_in_the_registry_s_order():
    """docs/guides/huggingface.md's table of covered families is FAMILIES: each model type
    with its HF class, in the order defined (a family added is a row there, or this fails)."""
    from pathlib import Path

    from functree.hf._family import FAMILIES

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "huggingface.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)` \| `(\w+)`", guide, flags=re.MULTILINE)  # (xlm-roberta: a hyphen)
    assert rows == [(model_type, family.hf_class) for model_type, family in FAMILIES.items()]
