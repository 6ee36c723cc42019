"""Files written by Hugging Face, PEFT, torch or a stranger, fuzzed: each reader is run over
valid files from the writers (``safetensors.torch``, :func:`ft.nn.save_lora`, ``ft.train.save``,
a sharded index, a config.json dict) mutated at random (bytes flipped, cut or inserted;
header fields, index entries, config values and checkpoint descriptions replaced by other
JSON values). Each file either reads as the reference reads it (the ``safetensors`` library's
tensors, bit for bit; the tensors the index names, from the shards that hold them) or is
refused with a ValueError naming the file and what is wrong: never another exception from deep
inside Python, NumPy or JAX, never other numbers. Each defect the exploration found is kept as
a regression test below its property (the ``explore`` profile draws ten times as many).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import functree as ft
from functree.hf._files import DEFAULTS
from functree.interop import _safetensors

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
CALLER = "ft.nn.load_torch_state_dict"

# ---- .safetensors files: against the safetensors library ------------------------------------

TENSORS = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
           "e": torch.zeros(0, 4), "m": torch.tensor([True, False, True]), "i": torch.tensor([7, -9])}


@pytest.fixture(scope="module")
def library_file(tmp_path_factory):
    """The bytes safetensors.torch writes for TENSORS (every part of the format: an empty
    tensor, bfloat16, bool, int64, metadata), and its header as JSON."""
    path = tmp_path_factory.mktemp("library") / "model.safetensors"
    safetensors_torch.save_file(TENSORS, str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    return data, json.loads(data[8:8 + size]), data[8 + size:]


def _bytes(tensor):
    return tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


# The refusals where functree is stricter than the library, each for a reason of its own.
STRICTER = (r"names '.*' twice",                     # which of two entries? (the library keeps one)
            r"has dtype 'F8_E8M0'",                 # a dtype functree does not read
            r"NumPy makes no array of that shape")  # an empty [0, 2**62]: no NumPy array


def _read_both(path):
    """functree's tensors and the library's (either None where refused), asserting functree's
    refusal is a ValueError naming the file."""
    try:
        ours = _safetensors.load_file(path)
    except ValueError as e:
        ours, why = None, str(e)
        assert why.startswith(f"{CALLER}: {str(path)!r} is ") and "right:" in why, why
    try:
        theirs = safetensors_torch.load_file(str(path))
    except Exception:  # the library's own errors (SafetensorError, others)
        theirs = None
    if ours is None and theirs is not None:
        assert any(re.search(s, why) for s in STRICTER), why
    return ours, theirs


def _same_tensors(ours, theirs, metadata):
    """Every tensor the library reads, bit for bit; functree's others only the ties the
    file's metadata names (``{omitted name: held name}``)."""
    for name, tensor in theirs.items():
        assert list(ours[name].shape) == list(tensor.shape) and ours[name].tobytes() == _bytes(tensor), name
    for name in set(ours) - set(theirs):
        assert isinstance(metadata, dict) and metadata.get(name) in theirs, name


INTS = st.one_of(st.integers(-3, 40), st.sampled_from([2**62, 2**63 - 1, 2**63, 2**64, -2**63]))
VALUES = st.recursive(st.one_of(INTS, st.booleans(), st.none(), st.floats(), st.text(max_size=4)),
                      lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner,
                                                                                             max_size=2)),
                      max_leaves=4)
DTYPE_NAMES = st.one_of(st.sampled_from([*_safetensors.DTYPES, "F128", "f32", "F8_E8M0", "F4", "C128"]), VALUES)


@st.composite
def headers(draw, header):
    """A library file's header with 1-3 of its fields replaced, an entry added or removed,
    its __metadata__ replaced; the data cut or padded, the header size replaced."""
    header = copy.deepcopy(header)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(header)))
        entry, change = header[name], draw(st.sampled_from(["dtype", "shape", "size", "offsets", "offset", "entry",
                                                            "drop", "add", "metadata"]))
        if change == "metadata":
            names = st.sampled_from(["a", "b", "e", "z", "format", "pt"])
            header["__metadata__"] = draw(st.one_of(VALUES, st.dictionaries(names, names, max_size=3)))
        elif change in ("drop", "add", "entry"):
            header.pop(name) if change == "drop" else header.__setitem__(
                name if change == "entry" else draw(st.text(max_size=3)), draw(VALUES))
        elif isinstance(entry, dict) and change in ("dtype", "shape", "offsets"):
            entry[{"offsets": "data_offsets"}.get(change, change)] = draw(DTYPE_NAMES if change == "dtype" else VALUES)
        elif isinstance(entry, dict) and isinstance(entry.get("shape"), list) and entry["shape"] and change == "size":
            entry["shape"][draw(st.integers(0, len(entry["shape"]) - 1))] = draw(INTS)
        elif isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list) and entry["data_offsets"]:
            entry["data_offsets"][draw(st.integers(0, len(entry["data_offsets"]) - 1))] = draw(INTS)
    return header, draw(st.integers(-8, 8)), draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))


def _written(path, header, body, size=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if size is None else size) + text + body)
    return path


@settings(max_examples=examples(150), deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_a_mutated_header_reads_as_the_library_reads_it_or_is_refused_by_name(tmp_path, library_file, data):
    _, header, body = library_file
    changed, cut, size = data.draw(headers(header))
    body = body[:len(body) + cut] if cut < 0 else body + bytes(cut)
    path = _written(tmp_path / "model.safetensors", changed, body, size)
    ours, theirs = _read_both(path)
    if ours is not None:
        assert theirs is not None
        _same_tensors(ours, theirs, changed.get("__metadata__"))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=FIXTURES)
@given(edits=st.lists(st.tuples(st.sampled_from(["flip", "set", "cut", "insert", "delete"]), st.integers(0, 10**4),
                                st.integers(0, 255)), min_size=1, max_size=4))
def test_a_file_with_bytes_flipped_cut_or_inserted_reads_as_the_library_reads_it_or_is_refused(tmp_path, library_file,
                                                                                                edits):
    data = bytearray(library_file[0])
    for edit, at, byte in edits:
        at %= max(len(data), 1)
        if edit == "flip":
            data[at] ^= 1 << (byte % 8)
        elif edit == "set":
            data[at] = byte
        elif edit == "cut":
            del data[at:]
        elif edit == "insert":
            data[at:at] = bytes([byte])
        else:
            del data[at:at + 1 + byte % 4]
        if not data:
            break
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(data))
    ours, theirs = _read_both(path)
    if ours is not None:
        assert theirs is not None
        _same_tensors(ours, theirs, _safetensors.read_header(str(path), len(data))[1].get("__metadata__"))


@pytest.mark.parametrize("shape, dtype", [([0, 2**62], "F32"), ([2**31, 2**31, 0], "F64")])
def test_an_empty_tensor_whose_other_sizes_numpy_cannot_hold_is_refused_naming_it(tmp_path, shape, dtype):
    """An empty tensor of shape [0, 2**62] float32 (no bytes; the library reads it): NumPy's
    reshape refused it with a bare "array is too big" naming neither the file nor the tensor."""
    path = _written(tmp_path / "model.safetensors", {"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}},
                    b"")
    assert list(safetensors_torch.load_file(str(path))["w"].shape) == shape  # the library reads it
    with pytest.raises(ValueError, match=rf"(?s)^{CALLER}: '{re.escape(str(path))}' is not a \.safetensors file this "
                                         rf"reads: its entry for 'w' has shape {re.escape(str(shape))}: empty, but its "
                                         rf"other sizes times the \d-byte item pass 2\*\*63 - 1 bytes: NumPy makes no "
                                         r"array of that shape\..*right:"):
        _safetensors.load_file(path)
    small = _written(tmp_path / "small.safetensors", {"w": {"dtype": "U8", "shape": [0, 2**63 - 1],
                                                            "data_offsets": [0, 0]}}, b"")
    assert _safetensors.load_file(small)["w"].shape == (0, 2**63 - 1)  # within NumPy's bound: read


# ---- sharded checkpoints: an index's weight_map and metadata ------------------------------------

SHARDS = {"model-00001-of-00002.safetensors": {"a": np.arange(4, dtype=np.float32), "b": np.ones(2, np.float32)},
          "model-00002-of-00002.safetensors": {"c": np.full(3, 7, np.int32)}}
ORIGINAL = {name: array for tensors in SHARDS.values() for name, array in tensors.items()}
INDEX = {"metadata": {"total_size": 36}, "weight_map": {name: shard for shard, tensors in SHARDS.items()
                                                        for name in tensors}}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A sharded checkpoint's directory (two shards and their index), and a file outside it."""
    root = tmp_path_factory.mktemp("sharded")
    (root / "ckpt").mkdir()
    for shard, tensors in SHARDS.items():
        _safetensors.save_file(str(root / "ckpt" / shard), tensors, {"format": "pt"})
    _safetensors.save_file(str(root / "outside.safetensors"), {"a": np.zeros(4, np.float32)}, {})
    return root / "ckpt"


SHARD_NAMES = st.sampled_from([*SHARDS, "../outside.safetensors", str(os.sep) + "etc" + os.sep + "passwd", "", ".",
                               "sub/../model-00002-of-00002.safetensors", "model-00003-of-00002.safetensors",
                               "..\\outside.safetensors", "model.safetensors.index.json"])


@settings(max_examples=examples(60), deadline=None, suppress_health_check=FIXTURES)
@given(changes=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "z"]), st.one_of(SHARD_NAMES, VALUES)),
                        min_size=1, max_size=3),
       metadata=st.one_of(st.just(INDEX["metadata"]), VALUES, st.dictionaries(st.sampled_from(["a", "b", "c", "z"]),
                                                                              st.sampled_from(["a", "b", "c", "z"]))),
       drop=st.booleans())
def test_a_mutated_index_reads_the_tensors_its_shards_hold_or_is_refused_naming_it(sharded, changes, metadata, drop):
    """weight_map entries moved to another shard, outside the directory (``../``, absolute,
    a backslash), to a missing or non-shard file, or replaced by other JSON values; a name
    added or dropped; the metadata replaced: the index reads only tensors the shards hold
    under that name (a tie its metadata names: the tensor it names), else a ValueError naming
    the index."""
    index = copy.deepcopy(INDEX)
    for name, shard in changes:
        index["weight_map"][name] = shard
    if drop:
        index["weight_map"].pop("b")
    index["metadata"] = metadata
    path = sharded / "model.safetensors.index.json"
    path.write_text(json.dumps(index))
    try:
        tensors = _safetensors.load_checkpoint(path, "ft.nn.from_hf")
    except ValueError as e:
        assert str(e).startswith("ft.nn.from_hf: ") and str(path) in str(e) and "right:" in str(e), str(e)
        return
    for name, array in tensors.items():
        held = name if name in index["weight_map"] else metadata[name]  # a tie the metadata names
        np.testing.assert_array_equal(array, ORIGINAL[held])
        assert array.dtype == ORIGINAL[held].dtype


# ---- PEFT adapters: adapter_config.json and the weights' metadata ------------------------------

LLAMA = {"model_type": "llama", "vocab_size": 61, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "pad_token_id": 0}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A Llama port, and save_lora's directory of its q/v adapters (B moved off zero), with
    and without the record of its config that save_lora writes in the weights' metadata
    (PEFT writes none)."""
    from functree.hf._peft import RECORD

    base = ft.nn.from_hf(LLAMA, key=jax.random.key(0))
    adapted = ft.nn.lora(base, "model.layers.*.self_attn.[qv]_proj", rank=2, alpha=4, key=jax.random.key(1))
    adapted = jax.tree.map(lambda x: x + 0.1 if isinstance(x, jax.Array) and x.ndim == 3 else x, adapted)
    root = tmp_path_factory.mktemp("adapter")
    ft.nn.save_lora(adapted, root / "recorded")
    shutil.copytree(root / "recorded", root / "plain")
    weights = str(root / "plain" / "adapter_model.safetensors")
    metadata = dict(_safetensors.read_header(weights, os.path.getsize(weights))[1]["__metadata__"])
    tensors = {k: np.array(v) for k, v in _safetensors.load_file(weights).items()}
    _safetensors.save_file(weights, tensors, {k: v for k, v in metadata.items() if k != RECORD})
    return base, root, json.loads((root / "plain" / "adapter_config.json").read_text())


def _adapter_copy(adapter, tmp_path, which, config=None, text=None, metadata=None):
    """A copy of the fixture's adapter directory, its config or its weights' metadata replaced."""
    _, root, _ = adapter
    directory = tmp_path / "adapter"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(root / which, directory)
    if config is not None or text is not None:
        (directory / "adapter_config.json").write_text(json.dumps(config) if text is None else text)
    if metadata is not None:
        weights = str(directory / "adapter_model.safetensors")
        held = dict(_safetensors.read_header(weights, os.path.getsize(weights))[1]["__metadata__"])
        tensors = {k: np.array(v) for k, v in _safetensors.load_file(weights).items()}
        _safetensors.save_file(weights, tensors, {**held, **metadata})
    return directory


OPTIONS = ("r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "layers_to_transform",
           "layers_pattern", "rank_pattern", "alpha_pattern", "modules_to_save", "use_rslora", "fan_in_fan_out",
           "bias", "init_lora_weights", "use_dora", "peft_type", "inference_mode", "megatron_config", "newer_option")
PATTERNS = st.sampled_from(["q_proj", "v_proj", ".*q_proj", "(q|v)_proj", "layers", "q_proj([", "*", "a{2,1}", "(?P<",
                            "all-linear", "lm_head", "\\", ")"])
CONFIG_VALUES = st.one_of(VALUES, PATTERNS, st.lists(PATTERNS, max_size=2), st.dictionaries(PATTERNS, VALUES, max_size=2),
                          st.sampled_from([10**400, 2, 8.0, -1, 0.5, 1.0]))


@settings(max_examples=examples(20), deadline=None, suppress_health_check=FIXTURES)
@given(changes=st.lists(st.tuples(st.sampled_from(OPTIONS), CONFIG_VALUES), min_size=1, max_size=2),
       which=st.sampled_from(["plain", "recorded"]))
@example(changes=[("lora_alpha", 6.805647135594673e+38)], which="plain")  # finite, but its scale alpha / r is no float32
def test_a_mutated_adapter_config_loads_or_is_refused_naming_it(adapter, tmp_path, changes, which):
    """adapter_config.json's options replaced by other JSON values (regular expressions that
    do not compile among them): load_lora loads the adapter or raises a ValueError of its
    own; with save_lora's record, never with a number-deciding option other than saved."""
    from functree.hf._peft import RECORDED, _same_setting

    base, _, original = adapter
    config = {**original, **dict(changes)}
    directory = _adapter_copy(adapter, tmp_path, which, config)
    try:
        loaded = ft.nn.load_lora(base, directory)
    except ValueError as e:
        assert str(e).startswith("ft.nn.load_lora: "), str(e)
        return
    assert loaded(np.zeros((1, 3), np.int32)).shape == (1, 3, 61)
    if which == "recorded":
        assert all(_same_setting(o, original.get(o), config.get(o)) for o in RECORDED), changes


@pytest.mark.parametrize("option, value, pattern", [
    ("target_modules", "model.*q_proj([", "model.*q_proj(["), ("exclude_modules", "lm_head(", "lm_head("),
    ("rank_pattern", {"q_proj[": 2}, "q_proj["), ("alpha_pattern", {"*": 8}, "*"),
    ("layers_pattern", ["layers", "h)"], "h)"), ("modules_to_save", ["lm_head", "(?P<"], "(?P<"),
])
def test_a_pattern_that_is_no_regular_expression_is_refused_naming_the_option(adapter, tmp_path, option, value, pattern):
    """Each string PEFT matches module names with as a regular expression: one that does not
    compile was a bare re.error from deep inside the matching (PEFT fails the same way)."""
    base, _, original = adapter
    extra = {"layers_to_transform": [0], "target_modules": ["q_proj", "v_proj"]} if option == "layers_pattern" else {}
    directory = _adapter_copy(adapter, tmp_path, "plain", {**original, **extra, option: value})
    with pytest.raises(ValueError, match=rf"(?s)^ft.nn.load_lora: adapter_config.json in '{re.escape(str(directory))}' "
                                         rf"sets {option}=.*, and {re.escape(repr(pattern))} is not a regular expression "
                                         rf"\(.*\). PEFT matches module names against it.*wrong:  \"{option}\": "
                                         rf"{re.escape(json.dumps(value))}\n    right:  \"{option}\": "):
        ft.nn.load_lora(base, directory)


@pytest.mark.parametrize("option", ["lora_alpha", "alpha_pattern"])
def test_an_alpha_too_large_for_a_float_is_refused_naming_it(adapter, tmp_path, option):
    """A 400-digit integer alpha (JSON's 1e400 written out): math.isfinite raised a bare
    OverflowError ("int too large to convert to float")."""
    base, _, original = adapter
    huge = "1" + "0" * 400
    text = json.dumps({**original, option: 0 if option == "lora_alpha" else {"q_proj": 0}})
    text = text.replace('"lora_alpha": 0', f'"lora_alpha": {huge}').replace('{"q_proj": 0}', f'{{"q_proj": {huge}}}')
    directory = _adapter_copy(adapter, tmp_path, "plain", text=text)
    key = "lora_alpha" if option == "lora_alpha" else r"alpha_pattern\['q_proj'\]"
    with pytest.raises(ValueError, match=rf"^ft.nn.load_lora: adapter_config.json in .* sets {key}={huge}: the "
                                         r"adapters' scale is alpha / r, a finite number"):
        ft.nn.load_lora(base, directory)


NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("record, why", [('["r"]', "a JSON list, not an object"), ("5", "a JSON int, not an object"),
                                         (NESTED, "nested deeper than Python's JSON reader follows")])
def test_a_record_of_the_config_that_is_no_object_is_refused_naming_it(adapter, tmp_path, record, why):
    """save_lora's record in the weights' metadata, altered into a list, a number or JSON
    nested past the reader's recursion: a bare TypeError ("list indices must be integers")
    or RecursionError."""
    from functree.hf._peft import RECORD

    base = adapter[0]
    directory = _adapter_copy(adapter, tmp_path, "recorded", metadata={RECORD: record})
    with pytest.raises(ValueError, match=rf"^ft.nn.load_lora: '{re.escape(str(directory))}' is not a PEFT LoRA "
                                         rf"adapter directory: adapter_model.safetensors's record of its config "
                                         rf"\('{RECORD}' in its metadata\) is {why}"):
        ft.nn.load_lora(base, directory)


def test_an_adapter_config_nested_past_the_json_readers_recursion_is_refused_naming_it(adapter, tmp_path):
    base = adapter[0]
    directory = _adapter_copy(adapter, tmp_path, "plain", text='{"peft_type": "LORA", "x": ' + NESTED + "}")
    with pytest.raises(ValueError, match=r"^ft.nn.load_lora: .* is not a PEFT LoRA adapter directory: "
                                         r"adapter_config.json is nested deeper than Python's JSON reader follows"):
        ft.nn.load_lora(base, directory)


@pytest.mark.parametrize("blocks", [NESTED, '{"model.layers.0.self_attn.q_proj": [["q", 0, Infinity]]}'])
def test_a_damaged_record_of_fused_blocks_is_a_hint_not_read(adapter, tmp_path, blocks):
    """The record of a fused projection's member columns (a hint, used where the tensors
    agree): nested past the reader's recursion, or an Infinity (int() of it overflows), was
    a bare RecursionError or OverflowError; it is read past, the adapter loaded as without it."""
    from functree.hf._peft_blocks import BLOCKS

    base = adapter[0]
    directory = _adapter_copy(adapter, tmp_path, "plain", metadata={BLOCKS: blocks})
    loaded = ft.nn.load_lora(base, directory)
    plain = ft.nn.load_lora(base, adapter[1] / "plain")
    tokens = np.arange(4, dtype=np.int32)[None]
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(plain(tokens)))


# ---- config.json values ------------------------------------------------------------------------

SMALL = {"gpt2": {"vocab_size": 61, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32},
         "opt": {"vocab_size": 61, "hidden_size": 16, "ffn_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "max_position_embeddings": 32, "word_embed_proj_dim": 16},
         "bert": {"vocab_size": 61, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 32, "max_position_embeddings": 32},
         "gpt_neox": {"vocab_size": 61, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "intermediate_size": 32, "max_position_embeddings": 32}}


def _small(model_type):
    """A tiny config.json of ``model_type`` (Llama's sizes for the Llama-like families)."""
    return {**SMALL.get(model_type, {k: v for k, v in LLAMA.items() if k != "model_type"}), "model_type": model_type}


ROPE_KEYS = ("rope_scaling", "rope_theta", "partial_rotary_factor", "rotary_pct", "rotary_emb_base",
             "original_max_position_embeddings", "head_dim", "n_embd", "num_attention_heads", "layer_types")
ROPE_DICTS = st.dictionaries(st.sampled_from(["type", "rope_type", "factor", "rope_theta", "low_freq_factor",
                                              "high_freq_factor", "original_max_position_embeddings", "short_factor",
                                              "__float__"]),
                             st.one_of(VALUES, st.sampled_from(["linear", "llama3", "yarn", "default", "NaN"])),
                             max_size=3)
CONFIG_JSON = st.one_of(VALUES, ROPE_DICTS, st.sampled_from([10**30, 0, -1, 1e400, "16", "silu", "sliding_attention"]))


@st.composite
def configs(draw, model_types):
    """A tiny config.json with one or two of its model type's fields (or the older rope keys,
    sizes under other names) replaced by other JSON values, or dropped."""
    model_type = draw(st.sampled_from(model_types))
    config = _small(model_type)
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(sorted(set(DEFAULTS[model_type]) | set(ROPE_KEYS))))
        if draw(st.integers(0, 9)) == 0:
            config.pop(key, None)
        else:
            config[key] = draw(CONFIG_JSON)
    return config


def _refused_by_name(error):
    assert str(error).startswith("ft.nn.") and "right:" in str(error), str(error)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=FIXTURES)
@given(config=configs(sorted(DEFAULTS)))
@example(config={**_small("mistral"), "layer_types": 0})  # a bare TypeError: object of type 'int' has no len()
def test_a_mutated_config_json_reads_or_is_refused_naming_the_key(config):
    from functree.hf._files import Config

    try:
        Config.of(config)
    except ValueError as e:
        _refused_by_name(e)


class _Weights(dict):
    """A fixture's dict of weights, printed short: hypothesis prints a failing draw's arguments,
    and the weights' 232 kB repr was a HypothesisWarning (an error) in place of the failure."""

    def __repr__(self) -> str:
        return f"<weights of {sorted(self)}>"


@pytest.fixture(scope="module")
def small_weights():
    """Each tiny config's weights (HF's initialization), per model type."""
    return _Weights({t: ft.nn.to_hf_state_dict(ft.nn.from_hf(_small(t), key=jax.random.key(0)), numpy=True)
                     for t in ("llama", "gpt2")})


@settings(max_examples=examples(8), deadline=None, suppress_health_check=FIXTURES)
@given(config=configs(["llama", "gpt2"]))
@example(config={k: v for k, v in _small("gpt2").items() if k != "n_head"})  # HF's 12 heads do not divide 16
def test_a_mutated_config_json_builds_from_its_weights_or_is_refused_by_name(small_weights, config):
    """Beyond reading: the config read and the model built from the tiny model's weights
    (``"rope_theta": []`` read, then a bare TypeError in the build; a negative size one from
    deep inside JAX)."""
    try:
        model = ft.nn.from_hf(config, small_weights[config["model_type"]])
    except ValueError as e:
        _refused_by_name(e)
    else:
        assert model(np.zeros((1, 3), np.int32)).shape == (1, 3, config.get("vocab_size", 61))


@pytest.mark.parametrize("changes, key, expected, right", [
    ({"rope_theta": []}, "rope_theta", "a number", "10000.0"),
    ({"rope_theta": "500000"}, "rope_theta", "a number", "500000.0"),
    ({"rope_scaling": {"type": "linear", "factor": True}}, "factor", "a number", "1.0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096.5}},
     "original_max_position_embeddings", "an integer", "4096"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1, "2"], "long_factor": [1, 2]}}, "short_factor",
     "a list of numbers", r"\[1.0, 1.0\]"),
    ({"rope_parameters": {"rope_type": 3}}, "rope_type", "a string", '"default"'),
])
def test_a_rope_value_of_the_wrong_type_is_refused_naming_it(changes, key, expected, right):
    """The rope parameters' values were not type-checked: a list rope_theta was a bare
    TypeError deep inside the build, a string one read as its number, a factor true read as
    1, a pretraining length 4096.5 cut to 4096."""
    from functree.hf._files import Config

    with pytest.raises(ValueError, match=rf"(?s)^ft.nn.from_hf: the llama config's rope_parameters\['{key}'\] \(at its "
                                         rf"top level or in rope_parameters / rope_scaling\) is .*; a rotary embedding "
                                         rf"reads {expected} there.*right:  \"{key}\": {right} "):
        Config.of({**_small("llama"), **changes})
    assert Config.of({**_small("llama"), "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                             "original_max_position_embeddings": 4096.0}})


@pytest.mark.parametrize("model_type, changes", [("llama", {"rope_theta": 0}), ("llama", {"rope_theta": -10000.0}),
                                                  ("gpt_neox", {"rotary_emb_base": 0.0}), ("llama", {"rope_theta": 1e-300}),
                                                  ("llama", {"rope_theta": 5e-324})])
def test_a_rope_theta_of_zero_or_below_is_refused_naming_it(model_type, changes):
    """A rotary base of 0 made infinite frequencies (1 / 0 ** (2i / d)), a negative one NaN
    powers, 1e-300 frequencies past float32 (an overflow in the cast): the model built computed
    NaNs from every layer (found by the explore profile in the build-from-weights property:
    refused here before any build, so its draws 0 and 5e-324 are these cases)."""
    from functree.hf._files import Config

    value = next(iter(changes.values()))
    with pytest.raises(ValueError, match=rf"(?s)^ft.nn.from_hf: the {model_type} config's rope_parameters\['rope_theta'\] "
                                         rf".* is {value}; the rotary base is a positive number.*right:  \"rope_theta\": "):
        Config.of({**_small(model_type), **changes})


@pytest.mark.parametrize("value", [[1], "linear"])
def test_a_rope_scaling_that_is_no_object_is_refused_naming_it(value):
    """An older file's rope_scaling as a list or a string: a bare TypeError or ValueError
    ("dictionary update sequence element") gathering it into rope_parameters."""
    from functree.hf._files import Config

    with pytest.raises(ValueError, match=r"(?s)the llama config's 'rope_scaling' is .*; Hugging Face's llama config "
                                         r"takes an object there"):
        Config.of({**_small("llama"), "rope_scaling": value})


@pytest.mark.parametrize("model_type, key, value", [
    ("llama", "intermediate_size", -5), ("llama", "num_attention_heads", 0), ("llama", "num_hidden_layers", 0),
    ("llama", "head_dim", -4), ("llama", "num_key_value_heads", 0), ("gpt2", "n_embd", -16), ("opt", "ffn_dim", -1),
    ("bert", "type_vocab_size", 0), ("llama", "num_hidden_layers", 2**63), ("llama", "hidden_size", 10**30),
])
def test_a_size_that_is_not_positive_or_past_any_shape_is_refused_naming_it(model_type, key, value):
    """A negative size built weights of a negative dimension (a bare TypeError from JAX's
    broadcast_in_dim), no heads divided by zero, no layers failed inside ft.nn.Stack; a size
    past int64 was a TypeError (2**63 layers) or an OverflowError (10**30) from JAX."""
    from functree.hf._files import Config

    with pytest.raises(ValueError, match=rf"(?s)^ft.nn.from_hf: the {model_type} config's '{key}' is {value}; a size "
                                         rf"of the model's weights is a positive integer.*wrong:  \"{key}\": {value}\n"):
        Config.of({**_small(model_type), key: value})
    assert Config.of({**_small("llama"), "head_dim": 0}).head_dim == 0  # (HF derives a head_dim of 0)
    with pytest.raises(ValueError, match=r"the llama config's 'head_dim' is 288230376151711744 \(times "
                                         r"num_attention_heads 4: 1152921504606846976 features\); a size"):
        Config.of({**_small("llama"), "head_dim": 2**58})  # each size below the bound, their product past it


@pytest.mark.parametrize("model_type", sorted(SMALL))
def test_heads_that_do_not_divide_the_hidden_size_are_refused_naming_both(model_type):
    """GPT-2, OPT, BERT and GPT-NeoX split the hidden size into equal heads (HF refuses
    another count): 12 heads (GPT-2's default, the key left out) of 16 features was
    ft.nn.MultiheadAttention's error, naming neither key and offering its own fix."""
    from functree.hf._files import ALIASES, Config, read_config

    heads = ALIASES.get(model_type, {}).get("num_attention_heads", "num_attention_heads")
    hidden = ALIASES.get(model_type, {}).get("hidden_size", "hidden_size")
    with pytest.raises(ValueError, match=rf"(?s)^ft.nn.from_hf: the {model_type} config's '{hidden}' \(16\) is not a "
                                         rf"multiple of its '{heads}' \(12\).*wrong:  \"{hidden}\": 16, \"{heads}\": 12\n"
                                         rf"    right:  \"{heads}\": 8 "):
        read_config({**_small(model_type), heads: 12})
    assert Config.of({**_small(model_type), heads: 12})  # HF's config class takes it; its attention does not


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3", "gpt_neox", "phi"])
def test_a_head_dim_of_a_rotary_family_that_is_no_integer_is_refused(model_type):
    """qwen2, olmo, phi3, gpt_neox and phi configs have no head_dim field, yet HF's attention and
    rope read one a config.json gives (a list there: HF fails in validate_rope)."""
    from functree.hf._files import Config

    with pytest.raises(ValueError, match=rf"the {model_type} config's 'head_dim' is \[4\] \(a list\); Hugging Face's "
                                         rf"{model_type} config takes an integer there"):
        Config.of({**_small(model_type), "head_dim": [4]})
    assert Config.of({**_small("gpt2"), "head_dim": [4]})  # GPT-2 reads none (nor does HF's)


def test_token_ids_of_the_wrong_type_are_refused_where_transformers_refuses_them():
    """pad/bos/eos token ids: HF's config classes take an int or null (eos a list of ints
    too); a float, string or boolean id, or a pad or bos list, was read as it was (a float
    pad id skipped the vocabulary check; generation compared tokens with it)."""
    transformers = pytest.importorskip("transformers")
    from functree.hf._files import Config

    compared = ("llama", "gpt2", "opt", "bert")  # transformers' answer is each config class's; four of them asked
    for model_type in sorted(DEFAULTS):
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            for value in (2.0, "2", True, [0, 1]):
                config = {**_small(model_type), key: value}
                hf_refuses = key != "eos_token_id" or value != [0, 1]  # HF's types: int | None (eos: | list[int])
                if model_type in compared and value != "2":
                    try:
                        transformers.AutoConfig.for_model(**config)
                        refused = False
                    except Exception:  # transformers' StrictDataclassFieldValidationError
                        refused = True
                    assert refused == hf_refuses, (model_type, key, value)
                try:
                    Config.of(config)
                    ours = False
                except ValueError as e:
                    ours = f"config's '{key}' is {value!r}" in str(e)
                assert ours == hf_refuses, (model_type, key, value, ours, hf_refuses)


def test_a_float_tag_holding_no_string_is_refused_as_the_wrong_type():
    """transformers' {"__float__": "NaN"} tag holding a list: a bare "unhashable type"."""
    from functree.hf._files import Config

    with pytest.raises(ValueError, match=r"the gemma config's 'initializer_range' is \{'__float__': \[\]\} \(a dict\)"):
        Config.of({**_small("gemma"), "initializer_range": {"__float__": []}})


# ---- ft.train checkpoints: the type description, resealed -----------------------------------

TREE = {"model": ft.nn.Sequential(ft.nn.Dense(2, 3, jax.nn.relu, key=jax.random.key(0)), ft.nn.Lambda(jnp.tanh)),
        "n": 3, "f": 0.5, "t": (1, None), "k": jax.random.key(1), "w": np.arange(4, dtype=np.int32)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """ft.train.save's directory of TREE (a Module with static functions, Python scalars, a
    tuple, a PRNG key, an integer array) and its metadata."""
    path = tmp_path_factory.mktemp("checkpoint") / "ckpt"
    ft.train.save(path, TREE)
    return path, json.loads((path / "meta" / "metadata").read_text())


def _places(node, at=()):
    """Every place in a JSON value: its key path and the value there."""
    yield at, node
    for key, child in (node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()):
        yield from _places(child, (*at, key))


SPEC_VALUES = st.one_of(VALUES, st.sampled_from(["module", "leaf", "tuple", "none", "dict", "float32", "O", "int",
                                                 "float", "complex", "model.layers.0.weight", "threefry2x32",
                                                 "functree.nn.Dense", "builtins.print", "jax.nn.relu"]),
                        st.dictionaries(st.sampled_from(["kind", "class", "fields", "static", "items", "keys", "key",
                                                         "python", "prng", "function", "json", "repr"]), VALUES,
                                        max_size=3))


def _resealed(directory, meta):
    """``directory``'s metadata replaced by ``meta``, its CRC-32 fixed as a forger would."""
    from functree.train.checkpoint._checkpoint import metadata_digest

    meta = {**meta, "digest": None}
    meta["digest"] = metadata_digest(meta)
    (directory / "meta" / "metadata").write_text(json.dumps(meta))


def _same_leaves(a, b):
    def data(x):
        return jax.random.key_data(x) if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key) else x
    return all(np.array_equal(np.asarray(data(x)), np.asarray(data(y))) for x, y in zip(jax.tree.leaves(a),
                                                                                       jax.tree.leaves(b), strict=True))


@settings(max_examples=examples(25), deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data(), template=st.booleans())
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's cleanup of a refused read
def test_a_resealed_type_description_loads_the_saved_tree_or_is_refused(checkpoint, tmp_path, data, template):
    """The metadata's type description, checksums and fields replaced by other JSON values
    (the digest fixed: a forger's file), loaded with and without a template: a
    CheckpointError, or a tree (with a template: TREE's structure and values)."""
    path, meta = checkpoint
    meta = copy.deepcopy(meta)
    for _ in range(data.draw(st.integers(1, 2))):
        places = [at for at, _ in _places(meta) if at and at[0] != "digest"]
        at = data.draw(st.sampled_from(places))
        parent = meta
        for key in at[:-1]:
            parent = parent[key]
        if data.draw(st.integers(0, 4)) == 0:
            del parent[at[-1]]
        else:
            parent[at[-1]] = data.draw(SPEC_VALUES)
    directory = tmp_path / "ckpt"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(path, directory)
    _resealed(directory, meta)
    try:
        loaded = ft.train.load(directory, template=TREE if template else None)
    except ft.train.CheckpointError:
        return
    if template:
        assert jax.tree.structure(loaded) == jax.tree.structure(TREE) and _same_leaves(loaded, TREE)


def _dense(meta):
    return meta["spec"]["items"][0]["fields"]["layers"]["items"][0]


@pytest.mark.parametrize("change, words", [
    (lambda m: _dense(m)["static"].__setitem__("activation", 1), r"model.layers.0.activation.*static value 1 is not "
                                                                 r"encoded"),
    (lambda m: _dense(m)["static"].__setitem__("activation", 0.5), r"static value 0.5 is not encoded"),
    (lambda m: m["spec"]["items"][2].__setitem__("python", []), r"a Python \[\] scalar"),
])
@pytest.mark.parametrize("template", [True, False])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_resealed_description_with_a_value_of_another_type_is_refused_naming_it(checkpoint, tmp_path, change, words,
                                                                                   template):
    """With a template, a static value that is no encoded object (``"activation": 1``) was a
    bare TypeError ("argument of type 'int' is not iterable"), a leaf's Python tag that is a
    list or an object a bare "unhashable type"."""
    path, meta = checkpoint
    meta = copy.deepcopy(meta)
    change(meta)
    shutil.copytree(path, tmp_path / "ckpt")
    _resealed(tmp_path / "ckpt", meta)
    with pytest.raises(ft.train.CheckpointError, match=rf"(?s)damaged.*{words}"):
        ft.train.load(tmp_path / "ckpt", template=TREE if template else None)
