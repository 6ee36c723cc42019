"""ft.nn.save_hf against Hugging Face's from_pretrained: weights bit for bit, equal logits,
HF's sharding and file names; the errors (LoRA, a non-empty directory) and
an interrupted write that leaves no directory from_pretrained would read.

Each HF model is built from a tiny config with random weights (no download); the functree
model is "fine-tuned" (every parameter moved) before it is saved, so the loaded model can
only equal it if the written directory holds the new weights.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _save as _hf_save

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from test_hf_load import (  # noqa: E402
    FAMILIES,
    batch,
    forward,
    gpt2_config,
    hf_model,
    hf_output,
    llama_config,
    llama_from_config,
    skip_without_xla_float16,
)

CONFIGS = {"gpt2": gpt2_config, "llama": llama_config,
           "llama_tied": lambda: llama_config(tie_word_embeddings=True), **FAMILIES}


def tuned(model):
    """Every parameter moved: a fine-tuned model (a loaded copy of the original would differ).
    The moves are NumPy's, put on the device (eager jax.random/add and jnp.asarray compile a
    program per leaf shape; device_put none)."""
    leaves = jax.tree_util.tree_leaves_with_path(model)
    moved = [x if "logit_scale" in jax.tree_util.keystr(path) else  # the config's (Gemma 2's), no weight
             jax.device_put(np.asarray(x) + (0.05 * np.random.default_rng(i).standard_normal(x.shape)).astype(x.dtype))
             for i, (path, x) in enumerate(leaves)]
    return jax.tree.unflatten(jax.tree.structure(model), moved)


def assert_reads_back(model, directory, auto=None, positions=True):
    loaded = (auto or transformers.AutoModelForCausalLM).from_pretrained(directory, attn_implementation="eager")
    expected = ft.nn.to_hf_state_dict(model, numpy=True)
    got = {k: v.numpy() for k, v in loaded.state_dict().items()}
    assert set(got) >= set(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)  # bit for bit
    ids, mask = batch(12)
    theirs = hf_output(loaded, ids, mask, positions)
    ours = np.asarray(forward(model, ids, mask))  # test_hf_load's jit: a model of a tree seen before reuses it
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], rtol=0, atol=2.5e-5 * float(np.abs(theirs).max()))
    return loaded


@pytest.mark.parametrize("family", CONFIGS)
def test_from_pretrained_reads_what_save_hf_wrote(family, tmp_path):
    model = tuned(ft.nn.from_hf(hf_model(CONFIGS[family]())))
    ft.nn.save_hf(model, tmp_path / "tuned")
    files = sorted(os.listdir(tmp_path / "tuned"))
    assert files in (["config.json", "generation_config.json", "model.safetensors"],
                     ["config.json", "model.safetensors"])
    assert sorted(os.listdir(tmp_path)) == ["tuned"]  # no staging directory left
    loaded = assert_reads_back(model, tmp_path / "tuned")
    assert type(loaded).__name__ == type(model).__name__
    again = ft.nn.from_hf(str(tmp_path / "tuned"))  # and functree reads it back, its config carried
    assert again.hf_config["architectures"] == (type(model).__name__,)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)


def test_bert_reads_back_with_automodel(tmp_path):
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=32, max_position_embeddings=32)
    model = tuned(ft.nn.from_hf(hf_model_bert(config)))
    ft.nn.save_hf(model, tmp_path / "bert")
    assert_reads_back(model, tmp_path / "bert", auto=transformers.AutoModel, positions=False)  # BERT: 0..T-1


def hf_model_bert(config):
    from test_hf_ports import randomized

    return randomized(transformers.BertModel(config))


def test_sharded_as_hf_names_and_splits_them(tmp_path):
    """Past max_shard_size: model-0000i-of-0000n.safetensors and the index, split as
    huggingface_hub's split_torch_state_dict_into_shards splits the same tensors."""
    from huggingface_hub import split_torch_state_dict_into_shards

    model = tuned(ft.nn.from_hf(hf_model(llama_config())))
    ft.nn.save_hf(model, tmp_path / "sharded", max_shard_size="6KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(os.listdir(tmp_path / "sharded")) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *shards])
    weights = ft.nn.to_hf_state_dict(model)
    split = split_torch_state_dict_into_shards(weights, max_shard_size="6KB")
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"]["total_size"] == split.metadata["total_size"]
    assert_reads_back(model, tmp_path / "sharded")
    assert _hf_save._shard_limit("5GB") == 5 * 10**9 and _hf_save._shard_limit("500MiB") == 500 * 2**20
    with pytest.raises(ValueError, match=r"max_shard_size is a number of bytes or a size such as \"5GB\".*got '5 parsecs'"):
        ft.nn.save_hf(model, tmp_path / "bad", max_shard_size="5 parsecs")


def test_bfloat16_and_float16_models_keep_their_dtype(tmp_path):
    skip_without_xla_float16()
    for dtype, name in [(jnp.bfloat16, "bfloat16"), (jnp.float16, "float16")]:
        model = ft.nn.from_hf(hf_model(gpt2_config()), dtype=dtype)
        ft.nn.save_hf(model, tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == name
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype="auto")
        assert loaded.dtype == getattr(torch, name)
        expected, got = ft.nn.to_hf_state_dict(model), loaded.state_dict()
        for key, tensor in expected.items():
            assert torch.equal(got[key], tensor), key


def test_a_directory_with_files_is_replaced_only_with_overwrite(tmp_path):
    model = ft.nn.from_hf(hf_model(gpt2_config()))
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"(?s)already holds notes.txt; save_hf would replace them.*overwrite=True"):
        ft.nn.save_hf(model, target)
    assert os.listdir(target) == ["notes.txt"]
    ft.nn.save_hf(model, target, overwrite=True)
    assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the old one removed, nothing staged left
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is a file, not a directory"):
        ft.nn.save_hf(model, tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    ft.nn.save_hf(model, empty)  # an empty directory is no one's work
    assert "config.json" in os.listdir(empty)


def test_an_interrupted_write_leaves_no_checkpoint(tmp_path, monkeypatch):
    """A failure in the middle (the second shard): no target directory from_pretrained would
    read; over an existing one, the old one as it was."""
    model = tuned(ft.nn.from_hf(hf_model(llama_config())))
    real, calls = _hf_save.save_file, []

    def failing(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, tensors, metadata)

    monkeypatch.setattr(_hf_save, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        ft.nn.save_hf(model, tmp_path / "new", max_shard_size="6KB")
    assert os.listdir(tmp_path) == []
    ft.nn.save_hf(model, tmp_path / "old")  # one file: the first call
    before = {p: (tmp_path / "old" / p).read_bytes() for p in os.listdir(tmp_path / "old")}
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        ft.nn.save_hf(tuned(model), tmp_path / "old", max_shard_size="6KB", overwrite=True)
    assert {p: (tmp_path / "old" / p).read_bytes() for p in os.listdir(tmp_path / "old")} == before
    assert os.listdir(tmp_path) == ["old"]


def test_a_lora_model_is_refused_and_saves_merged(tmp_path):
    base = ft.nn.from_hf(hf_model(llama_config()))
    adapted = jax.jit(lambda m, k: ft.nn.lora(m, "model.layers.*.self_attn.[qv]_proj", rank=2, key=k))(
        base, jax.random.key(0))  # one program (eagerly, ~10)
    adapted = jax.tree.map(lambda x: jax.device_put(np.asarray(x) + np.float32(0.1)) if x.ndim >= 2 else x,
                           adapted)  # lora_b trained off zero (in NumPy: no program per leaf shape)
    with pytest.raises(ValueError, match=r"(?s)the model has LoRA adapters \(model.layers.*ft.nn.merge_lora\(model\)"):
        ft.nn.save_hf(adapted, tmp_path / "adapted")
    assert not (tmp_path / "adapted").exists()
    merged = jax.jit(ft.nn.merge_lora)(adapted)
    ft.nn.save_hf(merged, tmp_path / "merged")
    assert_reads_back(merged, tmp_path / "merged")


def test_what_cannot_be_saved_says_why(tmp_path, monkeypatch):
    hand_built = _hf_models_llama()
    with pytest.raises(ValueError, match=r"(?s)carries no Hugging Face config \(model.hf_config is None\).*from_hf"):
        ft.nn.save_hf(hand_built, tmp_path / "a")
    with pytest.raises(ValueError, match=r"takes a model built by ft.nn.from_hf .*got Dense"):
        ft.nn.save_hf(jax.eval_shape(lambda: ft.nn.Dense(2, 2, key=jax.random.key(0))), tmp_path / "b")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layers", [1, 3])
def test_a_model_whose_layers_changed_is_refused_and_saves_with_its_config(tmp_path, layers):
    """A model cut or grown after from_hf carried its old config: save_hf wrote
    num_hidden_layers=2 beside one layer's weights, and transformers filled the missing
    layer with random weights (logits 0.28 off) or dropped the extra one, with only a load
    report. The config that describes it saves as the error says."""
    model = ft.nn.from_hf(hf_model(llama_config()))
    stack = model.model.layers
    restacked = jax.jit(lambda s: ft.nn.Stack.from_layers([s[min(i, 1)] for i in range(layers)]))(stack)  # one program
    changed = model.replace(model=model.model.replace(layers=restacked))
    with pytest.raises(ValueError, match=rf"(?s)model.layers.layers.* is \[{layers}, .*num_hidden_layers=2.* builds "
                                         r"\[2, .*right:  config = \{\*\*model.hf_config.to_dict\(\), "
                                         rf"'num_hidden_layers': {layers}\}}"):
        ft.nn.save_hf(changed, tmp_path / "a")
    assert os.listdir(tmp_path) == []
    config = {**changed.hf_config.to_dict(), "num_hidden_layers": layers}
    ft.nn.save_hf(ft.nn.from_hf(config, ft.nn.to_hf_state_dict(changed)), tmp_path / "b")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "b").num_hidden_layers == layers
    assert_reads_back(changed, tmp_path / "b")


def test_saving_needs_no_safetensors_package(tmp_path, monkeypatch):
    """save_hf writes the files itself (functree.interop._safetensors.save_file, the writer
    save_lora uses too); the safetensors package reads them back to the same arrays."""
    model = tuned(llama_from_config())  # ft.nn.from_hf(llama_config(), key=key(0)), built once per process
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    ft.nn.save_hf(model, tmp_path / "c")
    monkeypatch.undo()
    import safetensors.numpy

    stored = safetensors.numpy.load_file(str(tmp_path / "c" / "model.safetensors"))
    expected = ft.nn.to_hf_state_dict(model, numpy=True)
    assert stored.keys() == expected.keys()
    for name, array in expected.items():
        assert stored[name].dtype == array.dtype and stored[name].shape == array.shape, name
        np.testing.assert_array_equal(stored[name], array, err_msg=name)


def _hf_models_llama():
    from functree.hf._models import LlamaForCausalLM

    # its shapes alone (save_hf refuses it before reading a weight; eagerly, its initializers
    # compiled ~30 programs)
    return jax.eval_shape(lambda: LlamaForCausalLM(40, 16, 4, 2, 32, 1, key=jax.random.key(0)))


def test_a_model_read_from_other_paths_or_versions_compiles_once_and_saves_as_transformers_does(tmp_path):
    """Two copies of one model whose config.json differ only in where they came from
    (``_name_or_path``, ``transformers_version``: another machine's save) had other tree
    definitions: a jitted step compiled again for the second. save_hf writes the installed
    transformers' version, as save_pretrained does, and no ``_name_or_path``."""
    hf_model(llama_config()).save_pretrained(tmp_path / "a")
    hf_model(llama_config()).save_pretrained(tmp_path / "b")
    for name in ("config.json", "generation_config.json"):
        path = tmp_path / "b" / name
        if path.exists():
            values = json.loads(path.read_text())
            path.write_text(json.dumps({**values, "transformers_version": "4.40.0", "_name_or_path": "org/llama"}))
    a, b = ft.nn.from_hf(str(tmp_path / "a")), ft.nn.from_hf(str(tmp_path / "b"))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    traces = []

    @jax.jit
    def logits(model, ids):
        traces.append(1)
        return model(ids)

    ids = jnp.array([[1, 2, 3]])
    logits(a, ids), logits(b, ids)
    assert len(traces) == 1
    ft.nn.save_hf(b, tmp_path / "c")
    written = json.loads((tmp_path / "c" / "config.json").read_text())
    assert written["transformers_version"] == transformers.__version__ and "_name_or_path" not in written
    if (tmp_path / "c" / "generation_config.json").exists():
        generation = json.loads((tmp_path / "c" / "generation_config.json").read_text())
        assert generation["transformers_version"] == transformers.__version__
    # A checkpoint written before (its config kept the version) restores onto today's template.
    from functree.hf._config import HFConfig

    old = HFConfig({**b.hf_config.to_dict(), "transformers_version": "4.40.0"},
                   {**b.hf_config.generation.to_dict(), "transformers_version": "4.40.0"})
    assert old == b.hf_config and "transformers_version" not in old


def test_a_directory_under_home_is_written_and_read_there(tmp_path, monkeypatch, home_and_work):
    """``save_hf(model, "~/models/m")`` wrote ``./~/models/m`` (a folder named ``~``, often
    removed with ``rm -rf ~``), which ``from_hf("~/models/m")`` found only from that working
    directory. Now each reads ``~`` as the home (``with_head``'s directory too); a folder
    named ``~`` here (transformers' ``save_pretrained("~/m")`` writes one) is named, with
    ``"./~/m"`` to read it."""
    home, work = home_and_work
    model = ft.nn.from_hf(hf_model(gpt2_config()))
    ft.nn.save_hf(model, "~/models/m")
    assert os.listdir(work) == [] and "model.safetensors" in os.listdir(home / "models" / "m")
    monkeypatch.chdir(tmp_path)  # read from another working directory
    want = jax.tree.leaves(model)
    for again in (ft.nn.from_hf("~/models/m"), ft.nn.from_hf(gpt2_config().to_dict(), "~/models/m/model.safetensors")):
        for a, b in zip(jax.tree.leaves(again), want, strict=True):
            np.testing.assert_array_equal(a, b)
    ft.nn.save_hf(model, "./~/literal")  # "./~": the folder named "~" here, as a shell reads it
    assert (tmp_path / "~" / "literal" / "config.json").is_file() and not (home / "literal").exists()
    with pytest.raises(FileNotFoundError, match=r'(?s)~/literal.*does not exist.*a folder named "~" in the working '
                                                r"directory.*right:  ft.nn.from_hf\(\.\.\. '\./~/literal' \.\.\.\)"):
        ft.nn.from_hf("~/literal")
    with pytest.raises(FileNotFoundError, match=r"right:  ft.hf.with_head\(\.\.\. '\./~/literal' \.\.\.\)"):
        ft.hf.with_head("~/literal", "ForSequenceClassification", num_labels=2, key=jax.random.key(1))
    assert isinstance(ft.nn.from_hf("./~/literal"), type(model))
