"""Hugging Face model directories as the Hub has them, read by ``ft.nn.from_hf(directory)``:
each a tiny random model's ``save_pretrained`` output, edited as older or third-party writers
left it. Either it reads as ``transformers.AutoModelForCausalLM.from_pretrained`` reads the same
directory (the same logits, float64), or it is refused naming the file and the fix.

Found by the session-46 audit (docs in the report, /work/notes/audit46/hubfiles/REPORT.md):

* a directory of torch pickles (``pytorch_model.bin``, or its shards beside
  ``pytorch_model.bin.index.json``: transformers' format before safetensors) was refused as
  holding "no model.safetensors", its fix a ``torch.load`` of one file only; it is now named a
  pickle checkpoint (never opened), with the restricted loader for each shard and the call that
  reads the directory's config with those weights;
* a ``config.json`` whose ``architectures`` names another covered family's class (a llama file
  naming ``MistralForCausalLM``, edited or converted by hand) was refused as "not covered", the
  message listing that class among the covered ones; ``AutoModelForCausalLM`` builds the model
  type's class (architectures unread), and so does from_hf now.
"""

import json
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.interop._safetensors import PICKLED_DIRECTORY
from tests._errors import raises_named

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = np.array([[3, 5, 7, 11, 13, 17], [29, 31, 37, 41, 43, 47]])

# HF's Llama computes its rotary angles in float32 (inv_freq and cos/sin, then cast): float64
# logits differ by 4.73e-8 of 1 + max|HF| (measured on this model); times 10.
ROPE_SPREAD = 4.8e-7


def _llama_dir(directory, architectures=None):
    """A tiny random LlamaForCausalLM saved to ``directory``, its biases and norms moved off
    their initial values; ``architectures`` written over config.json's where given."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(directory)
    if architectures is not None:
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            written = json.load(f)
        with open(path, "w") as f:
            json.dump({**written, "architectures": architectures}, f)
    return hf


def _marked(directory):
    """A pickle whose unpickling writes the file ``unpickled`` into ``directory``."""
    class Marks:
        def __reduce__(self):
            return (open, (os.path.join(directory, "unpickled"), "w"))

    return pickle.dumps({"model.embed_tokens.weight": Marks()}, protocol=2)


@pytest.mark.parametrize("sharded", [False, True], ids=["pytorch_model.bin", "shards and index"])
def test_a_directory_of_torch_pickles_is_named_a_pickle_checkpoint_never_opened(tmp_path, sharded):
    """Was NO_CHECKPOINT ("holds no model.safetensors"), its fix one file's torch.load; now
    PICKLED_DIRECTORY: the pickles named (never unpickled: a pickle that would leave a mark
    leaves none), each shard read with the restricted loader, the directory's config.json
    read with those weights (the fix checked: it loads the weights saved)."""
    hf = _llama_dir(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    if sharded:
        names = sorted(state)
        torch.save({k: state[k] for k in names[:5]}, tmp_path / "pytorch_model-00001-of-00002.bin")
        (tmp_path / "pytorch_model-00002-of-00002.bin").write_bytes(_marked(tmp_path))
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f"pytorch_model-0000{1 + (i >= 5)}-of-00002.bin"
                                            for i, k in enumerate(names)}}))
        fix = "for k, v in torch.load(shard, weights_only=True).items()}"
    else:
        (tmp_path / "pytorch_model.bin").write_bytes(_marked(tmp_path))
        fix = "torch.load(os.path.join("
    raises_named(lambda: ft.nn.from_hf(tmp_path), ValueError, PICKLED_DIRECTORY, fix)
    raises_named(lambda: ft.nn.from_hf(tmp_path), ValueError, PICKLED_DIRECTORY,
                 f"model = ft.nn.from_hf({str(tmp_path)!r}, weights)")
    assert not (tmp_path / "unpickled").exists()
    model = ft.nn.from_hf(tmp_path, state)  # the fix's call: the directory's config.json, these weights
    loaded = ft.nn.to_hf_state_dict(model, numpy=True)
    for name, value in state.items():
        np.testing.assert_array_equal(loaded[name], value.numpy(), err_msg=name)


@pytest.mark.parametrize("named", ["MistralForCausalLM", "Qwen2ForCausalLM"])
def test_architectures_naming_another_covered_family_read_as_auto_model_reads_them(tmp_path, named):
    """A llama config.json naming another covered family's class: AutoModelForCausalLM builds
    LlamaForCausalLM (architectures unread), from_hf the same model. Was refused as 'not
    covered' (naming a covered class)."""
    _llama_dir(tmp_path, [named])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        expected = hf(torch.tensor(IDS)).logits.numpy()
    with jax.enable_x64(True):
        model = ft.nn.from_hf(tmp_path, dtype=jnp.float64)
        actual = np.asarray(jax.jit(lambda m, x: m(x))(model, IDS))
    assert type(model).__name__ == "LlamaForCausalLM"
    np.testing.assert_allclose(actual, expected, rtol=0, atol=ROPE_SPREAD * (1 + np.abs(expected).max()))
