"""A mistral ``config.json`` with ``layer_types``, read as transformers reads it: its
``AutoConfig`` switches such a file to Ministral ("treating as ministral"), whose layers each
take their type's mask (the window on "sliding_attention" layers only). functree's
``MistralForCausalLM`` then holds one window per layer (``member_window``); HF's own
``MistralConfig`` object keeps the key but its ``MistralForCausalLM`` ignores it (every
layer slides), and so does ``from_hf`` of that model. ``model_type: "ministral"`` (HF's
``MinistralForCausalLM``, its config, a saved directory) is a family of its own:
``MinistralForCausalLM``, whose layers always take their types' masks.

Tiny config, random weights (no download), window 3 shorter than the 12 tokens. Logits at the
real tokens of a left-padded batch within 5e-6 of max|HF|: over three seeds of weights drawn
N(0, 0.5) the largest difference measured was 4.9e-7 of it (times 10)."""

import json
import os

import jax
import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_hf_load import DECODER, assert_generates_as_hf, batch, forward, hf_model, hf_output  # noqa: E402

ATOL = 5e-6  # times max|HF|: measured 4.9e-7 (module docstring)

# head_dim given: HF's MinistralAttention fails without it (it reads config.head_dim, None)
CONFIG = {"model_type": "mistral", **DECODER, "head_dim": 4, "sliding_window": 3,
          "layer_types": ["sliding_attention", "full_attention"]}


def assert_logits_equal(model, hf):
    ids, mask = batch(12)
    expected, real = hf_output(hf, ids, mask), mask.astype(bool)
    np.testing.assert_allclose(np.asarray(forward(model, ids, mask))[real], expected[real], rtol=0,
                               atol=ATOL * float(np.abs(expected).max()))


def ministral(tmp_path):
    """HF's model of CONFIG's config.json (AutoConfig: a MinistralConfig) with random weights."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == "MinistralConfig"
    return hf_model(config)


def test_a_mistral_config_json_with_layer_types_is_hf_s_ministral(tmp_path):
    """config.json's dict and weights: HF's Ministral logits and greedy cached tokens; the
    windows matter (every layer sliding, as before, is another model)."""
    hf = ministral(tmp_path)
    assert type(hf).__name__ == "MinistralForCausalLM"
    weights = {k: v.numpy() for k, v in hf.state_dict().items()}
    model = ft.nn.from_hf(CONFIG, weights)
    attention = model.model.layers.layers.self_attn
    assert attention.window is None and np.asarray(attention.member_window).tolist() == [3, 0]
    assert_logits_equal(model, hf)
    assert_generates_as_hf(model, hf, length=12)
    ids, mask = batch(12)
    sliding = model.replace(model=model.model.replace(layers=model.model.layers.replace(
        layers=model.model.layers.layers.replace(self_attn=attention.replace(member_window=None, window=3)))))
    real = mask.astype(bool)
    assert np.abs(np.asarray(forward(sliding, ids, mask))[real] - np.asarray(forward(model, ids, mask))[real]).max() > 1e-3


def test_save_hf_writes_a_file_transformers_reads_back_as_the_same_model(tmp_path):
    """save_hf keeps model_type "mistral" and the layer types: from_pretrained gives
    Ministral again with the same logits, and from_hf of the directory the same model."""
    hf = ministral(tmp_path)
    model = ft.nn.from_hf(CONFIG, {k: v.numpy() for k, v in hf.state_dict().items()})
    ft.nn.save_hf(model, tmp_path / "saved")
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert written["model_type"] == "mistral" and written["layer_types"] == CONFIG["layer_types"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
    assert type(back).__name__ == "MinistralForCausalLM"
    assert_logits_equal(model, back)
    assert_logits_equal(ft.nn.from_hf(tmp_path / "saved"), hf)


def test_hf_s_mistral_model_with_layer_types_still_slides_on_every_layer():
    """HF's MistralConfig object with layer_types: its MistralForCausalLM ignores them."""
    config = transformers.MistralConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    hf = hf_model(config)
    assert type(hf).__name__ == "MistralForCausalLM"
    model = ft.nn.from_hf(hf)
    assert model.model.layers.layers.self_attn.window == 3
    assert_logits_equal(model, hf)
    assert ft.nn.from_hf(config, key=jax.random.key(0)).model.layers.layers.self_attn.window == 3


def test_save_hf_of_hf_s_mistral_model_with_layer_types_writes_the_mistral_it_ran(tmp_path):
    """HF's MistralConfig object keeps layer_types that its model ignores; saved with them, the
    file was Ministral to AutoConfig (0.04 off at scale 0.24), refused since as a changed
    structure. save_hf writes the Mistral that ran: from_pretrained gives its logits."""
    config = transformers.MistralConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    hf = hf_model(config)
    ft.nn.save_hf(ft.nn.from_hf(hf), tmp_path / "saved")
    assert "layer_types" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
    assert type(back).__name__ == "MistralForCausalLM"
    assert_logits_equal(ft.nn.from_hf(tmp_path / "saved"), hf)


def test_model_type_ministral_is_hf_s_ministral_from_its_model_directory_and_dict(tmp_path):
    """``model_type: "ministral"`` (was refused: "not covered"): HF's MinistralForCausalLM, its
    save_pretrained directory, and that config.json's dict with the weights each give HF's
    logits and greedy cached tokens; save_hf writes "ministral" back, which from_pretrained
    reads as the same model (the same tensors)."""
    hf = hf_model(transformers.MinistralConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"}))
    assert type(hf).__name__ == "MinistralForCausalLM"
    hf.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "ministral"
    weights = {k: v.numpy() for k, v in hf.state_dict().items()}
    for model in (ft.nn.from_hf(hf), ft.nn.from_hf(tmp_path / "hf"), ft.nn.from_hf(written, weights)):
        attention = model.model.layers.layers.self_attn
        assert type(model).__name__ == "MinistralForCausalLM"
        assert attention.window is None and np.asarray(attention.member_window).tolist() == [3, 0]
        assert_logits_equal(model, hf)
    assert_generates_as_hf(model, hf, length=12)
    ft.nn.save_hf(model, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "ministral"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
    assert type(back).__name__ == "MinistralForCausalLM" and back.config.layer_types == CONFIG["layer_types"]
    assert back.state_dict().keys() == hf.state_dict().keys()
    for name, tensor in back.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), weights[name], err_msg=name)


@pytest.mark.parametrize("window, expected", [(3, 3), (None, None)])
def test_a_ministral_config_without_layer_types_gets_ministral_s_default(window, expected):
    """MinistralConfig's default layer types: every layer sliding, or every layer full where
    the window is null (one static window, or none)."""
    given = {**{k: v for k, v in CONFIG.items() if k != "layer_types"}, "model_type": "ministral",
             "sliding_window": window}
    assert transformers.AutoConfig.for_model(**given).layer_types == [
        "sliding_attention" if window else "full_attention"] * 2
    attention = jax.eval_shape(lambda: ft.nn.from_hf(given, key=jax.random.key(0))).model.layers.layers.self_attn
    assert attention.window == expected and attention.member_window is None
