"""A checkpoint's generation defaults read as Hugging Face reads them: generation_config.json
alone when the directory has one (config.json's eos and pad ids are not mixed in), config.json
only without it. Reference: transformers' ``generate`` on the same saved files."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

LLAMA = dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1)
PROMPT = np.array([[5, 9, 11, 3, 7], [0, 0, 4, 8, 20]])  # row 1 starts with config.json's pad id 0
NEW = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random-weight tiny Llama saved by save_pretrained (config.json pad 0, eos set below),
    and the tokens HF's greedy generate gives it without any EOS."""
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**LLAMA, pad_token_id=0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf_model.save_pretrained(directory)
    os.remove(directory / "generation_config.json")
    return directory, _hf_generate(transformers.AutoModelForCausalLM.from_pretrained(directory).eval())


def _hf_generate(hf_model, **options):
    mask = torch.tensor((PROMPT != 0).astype(np.int64))
    with torch.no_grad():
        return hf_model.generate(torch.tensor(PROMPT), attention_mask=mask, max_new_tokens=NEW, **options).numpy()


def _checkpoint(saved, tmp_path, config, generation):
    """``saved``'s weights with ``config`` patched into its config.json and ``generation``
    written as generation_config.json."""
    directory, _ = saved
    shutil.copy(directory / "model.safetensors", tmp_path)
    values = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, **config}))
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def _same_tokens(ours, hf, pad):
    """HF stops when every row has ended; ft.nn.generate runs to max_new_tokens, padding."""
    ours = np.asarray(ours)
    np.testing.assert_array_equal(ours[:, :hf.shape[1]], hf)
    assert (ours[:, hf.shape[1]:] == pad).all()


def test_generation_config_json_alone_sets_eos_config_jsons_eos_is_not_read(saved, tmp_path):
    # config.json's eos is a token greedy decoding emits: read per key, it would end row 0 there
    eos = int(saved[1][0, PROMPT.shape[1] + 1])
    directory = _checkpoint(saved, tmp_path, {"eos_token_id": eos}, {"bos_token_id": 1, "do_sample": False})
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    hf = _hf_generate(hf_model)
    assert hf.shape[1] == PROMPT.shape[1] + NEW and (hf[0, PROMPT.shape[1]:] == eos).any()  # HF does not stop
    mask = jnp.asarray(PROMPT != 0, jnp.int32)
    np.testing.assert_array_equal(ft.nn.generate(ft.nn.from_hf(directory), PROMPT, NEW, attention_mask=mask), hf)
    # the HF model object: its generation_config (from the file) is carried, read alone too
    np.testing.assert_array_equal(ft.nn.generate(ft.nn.from_hf(hf_model), PROMPT, NEW, attention_mask=mask), hf)


def test_generation_config_json_without_pad_infers_no_mask_from_config_jsons_pad(saved, tmp_path):
    # config.json's pad 0 would mark row 1's leading 0s as padding; HF's pad is eos[0] (unset in the file)
    ends = [int(saved[1][0, -1]), 12]
    directory = _checkpoint(saved, tmp_path, {}, {"eos_token_id": ends})
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor(PROMPT), max_new_tokens=NEW).numpy()
    _same_tokens(ft.nn.generate(ft.nn.from_hf(directory), PROMPT, NEW), hf, pad=ends[0])


def test_without_generation_config_json_config_jsons_eos_and_pad_apply(saved, tmp_path):
    eos = int(saved[1][0, PROMPT.shape[1] + 1])
    directory = _checkpoint(saved, tmp_path, {"eos_token_id": eos}, {})
    os.remove(directory / "generation_config.json")
    hf = _hf_generate(transformers.AutoModelForCausalLM.from_pretrained(directory).eval())
    model = ft.nn.from_hf(directory)
    _same_tokens(ft.nn.generate(model, PROMPT, NEW, attention_mask=jnp.asarray(PROMPT != 0, jnp.int32)), hf, pad=0)


def test_without_generation_config_json_config_jsons_generation_options_apply(saved, tmp_path):
    """An older config.json's no_repeat_ngram_size and repetition_penalty (no
    generation_config.json beside it) were dropped with HF's config class's other generation
    keys, where HF's from_pretrained reads config.json as the generation config: other tokens,
    no warning."""
    directory = _checkpoint(saved, tmp_path, {"no_repeat_ngram_size": 1, "repetition_penalty": 1.5,
                                              "num_beam_groups": 1}, {})
    os.remove(directory / "generation_config.json")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert hf_model.generation_config.no_repeat_ngram_size == 1
    hf = _hf_generate(hf_model)
    assert (hf != saved[1]).any()  # the options change HF's tokens
    model = ft.nn.from_hf(directory)
    assert model.hf_config.generation["no_repeat_ngram_size"] == 1 and model.hf_config.generation["pad_token_id"] == 0
    _same_tokens(ft.nn.generate(model, PROMPT, NEW, attention_mask=jnp.asarray(PROMPT != 0, jnp.int32)), hf, pad=0)


@pytest.mark.parametrize("generation", [{}, {"transformers_version": "4.51.0"}], ids=["empty", "provenance only"])
def test_an_empty_generation_config_json_is_read_alone_too(saved, tmp_path, generation):
    """A file of ``{}`` (or of provenance keys only, which functree does not keep) counted as
    no file: config.json's eos ended row 0 and its pad 0 was filled in, where HF reads the
    empty file alone (eos and pad unset)."""
    eos = int(saved[1][0, PROMPT.shape[1] + 1])
    directory = _checkpoint(saved, tmp_path, {"eos_token_id": eos}, generation)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert hf_model.generation_config.eos_token_id is None and hf_model.generation_config.pad_token_id is None
    hf = _hf_generate(hf_model)
    model = ft.nn.from_hf(directory)
    assert model.hf_config.has_generation and len(model.hf_config.generation) == 0
    mask = jnp.asarray(PROMPT != 0, jnp.int32)
    np.testing.assert_array_equal(ft.nn.generate(model, PROMPT, NEW, attention_mask=mask), hf)
    ft.nn.save_hf(model, tmp_path / "saved")  # written back, read back: still read alone, by HF too
    again = ft.nn.from_hf(tmp_path / "saved")
    assert again.hf_config.has_generation and again.hf_config == model.hf_config
    np.testing.assert_array_equal(ft.nn.generate(again, PROMPT, NEW, attention_mask=mask), hf)
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    np.testing.assert_array_equal(_hf_generate(reread), hf)
