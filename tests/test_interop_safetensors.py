"""Checkpoint files are data: every tampered ``.safetensors`` file, index and config.json is
refused before a tensor is made, naming the file, the tensor and the rule — each file written
here byte by byte, and each refused by the ``safetensors`` library too where it checks the rule."""

import json
import os
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.interop import _safetensors

W = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
B = {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}
VALUES = np.arange(6, dtype=np.float32)
BODY = VALUES.tobytes()


def written(path, header=None, body=BODY, text=None, size=None):
    """A file of the format's three parts, any of them tampered with."""
    text = json.dumps({"w": W, "b": B} if header is None else header).encode() if text is None else text
    path.write_bytes(struct.pack("<Q", len(text) if size is None else size) + text + body)
    return path


def model():
    return ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)))


# (file parts, the error's words, whether the safetensors library refuses the file too)
CASES = {
    "short": (dict(text=b"", body=b"", size=0), r"fewer than the 8 of the header size|header is not JSON", True),
    "huge header": (dict(size=200_000_000), r"header size is 200000000 bytes, over the format's bound", True),
    "header past the end": (dict(size=10_000), r"header size is 10000 bytes, past the end of the \d+-byte file", True),
    "not utf-8": (dict(text=b'{"w\xff": 1}'), r"header is not JSON: 'utf-8' codec", True),
    "not json": (dict(text=b'{"w": [1, 2'), r"header is not JSON: Expecting", True),
    "not an object": (dict(text=b"[1, 2]"), r"header is not JSON: not an object", True),
    "duplicate": (dict(text=b'{"w": %s, "w": %s}' % (json.dumps(W).encode(), json.dumps(B).encode())),
                  r"header names 'w' twice", True),
    "metadata": (dict(header={"__metadata__": {"format": 1}, "w": W, "b": B}),
                 r"__metadata__ is \{'format': 1\}, not a mapping of strings to strings", True),
    "fields": (dict(header={"w": W, "b": {"dtype": "F32"}}), r"entry for 'b' has \['dtype'\]; it lacks", True),
    "dtype": (dict(header={"w": W, "b": {**B, "dtype": "F128"}}), r"entry for 'b' has dtype 'F128'; one of F64", True),
    "negative size": (dict(header={"w": W, "b": {**B, "shape": [-2]}}), r"'b' has shape \[-2\], not a list of sizes", True),
    "float size": (dict(header={"w": W, "b": {**B, "shape": [2.0]}}), r"'b' has shape \[2.0\], not a list of sizes", True),
    "overflow": (dict(header={"w": {**W, "shape": [2**32, 2**32]}, "b": B}),
                 r"entry for 'w' has shape \[4294967296, 4294967296\], whose element count overflows int64", True),
    "overflow, empty": (dict(header={"w": {**W, "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}}, body=b""),
                        r"'w' has shape \[4294967296, 4294967296, 0\], whose element count overflows", True),
    "offsets": (dict(header={"w": W, "b": {**B, "data_offsets": [24, 16]}}),
                r"'b' has data_offsets \[24, 16\], not \[begin, end\] with 0 <= begin <= end", True),
    "byte count": (dict(header={"w": {**W, "shape": [2, 3]}, "b": B}),
                   r"'w' holds 16 bytes; its shape \[2, 3\] and dtype F32 take 24", True),
    "overlap": (dict(header={"w": W, "b": {**B, "data_offsets": [8, 16]}}, body=VALUES[:4].tobytes()),
                r"entry for 'b' \(bytes 8..16\) overlaps 'w' \(ending at byte 16\)", True),
    "gap": (dict(header={"w": W, "b": {**B, "data_offsets": [20, 28]}}, body=bytes(28)),
            r"bytes 16..20 of its data \(after 'w', before 'b'\) belong to no tensor", True),
    "late start": (dict(header={"w": {**W, "data_offsets": [4, 20]}, "b": {**B, "data_offsets": [20, 28]}},
                        body=bytes(28)), r"bytes 0..4 of its data \(at the start of the data, before 'w'\)", True),
    "trailing bytes": (dict(body=VALUES.tobytes() + bytes(8)), r"bytes 24..32 of its data \(after 'b'\) belong to no", True),
    "truncated": (dict(body=VALUES.tobytes()[:20]), r"entry for 'b' has data_offsets ending at byte 24, past the 20 bytes", True),
    # a RecursionError from json before (the library's parser stops at 128 levels)
    "nested": (dict(text=b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), r"header is not JSON this reads: values "
               r"nested deeper than a JSON parser follows", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tampered_file_is_refused_naming_the_file_the_tensor_and_the_rule(tmp_path, case):
    from safetensors.numpy import load_file

    parts, words, library_refuses = CASES[case]
    path = written(tmp_path / f"{case.replace(' ', '_')}.safetensors", **parts)
    with pytest.raises(ValueError, match=rf"(?s)ft.nn.load_torch_state_dict: '{re.escape(str(path))}' is not a "
                                         rf"\.safetensors file this reads: [^.]*({words}).*damaged.*save_pretrained.*torch.load"):
        ft.nn.load_torch_state_dict(model(), path)
    if library_refuses:
        with pytest.raises(Exception):  # noqa: B017 - the library's own error type
            load_file(path)


def test_the_untampered_file_and_the_formats_freedoms_read_as_the_library_reads_them(tmp_path):
    """Whitespace around the header, an extra field in an entry, a null ``__metadata__``, a
    zero-size tensor between two others and entries listed out of byte order are valid."""
    from safetensors.numpy import load_file

    empty = {"dtype": "F32", "shape": [0, 3], "data_offsets": [16, 16]}
    files = {
        "plain": written(tmp_path / "plain.safetensors"),
        "spaces": written(tmp_path / "spaces.safetensors", text=b"  " + json.dumps({"w": W, "b": B}).encode() + b"  "),
        "free": written(tmp_path / "free.safetensors",
                        header={"b": {**B, "note": 1}, "__metadata__": None, "e": empty, "w": W}),
        "empty": written(tmp_path / "empty.safetensors", header={}, body=b""),
    }
    for name, path in files.items():
        ours, theirs = _safetensors.load_file(path), load_file(path)
        assert sorted(ours) == sorted(theirs), name
        for key in theirs:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{name}: {key}")
            assert ours[key].dtype == theirs[key].dtype and not ours[key].flags.writeable
    np.testing.assert_array_equal(_safetensors.load_file(files["plain"])["w"], VALUES[:4].reshape(2, 2))


def test_every_dtype_reads_its_bytes(tmp_path):
    """Each dtype the format names and NumPy holds: the bytes back as written (bfloat16 and
    float8 through ml_dtypes, which the library's NumPy reader refuses)."""
    header, body = {}, b""
    for name, dtype in _safetensors.DTYPES.items():
        values = np.arange(3).astype(dtype)
        header[name] = {"dtype": name, "shape": [3], "data_offsets": [len(body), len(body) + values.nbytes]}
        body += values.tobytes()
    loaded = _safetensors.load_file(written(tmp_path / "all.safetensors", header=header, body=body))
    for name, dtype in _safetensors.DTYPES.items():
        assert loaded[name].dtype == np.dtype(dtype), name
        np.testing.assert_array_equal(loaded[name], np.arange(3).astype(dtype), err_msg=name)  # BOOL: [0, 1, 1]


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz", "complex64"])
def test_the_librarys_other_dtypes_read_bit_for_bit_and_load(tmp_path, dtype):
    # safetensors writes these (AMD's float8, torch's complex64); functree refused the files
    # ("has dtype 'F8_E4M3FNUZ'; one of F64, ... is read")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    values = torch.linspace(-3, 3, 8).reshape(2, 4)
    values = torch.complex(values, -values) if dtype == "complex64" else values.to(getattr(torch, dtype))
    path = tmp_path / "x.safetensors"
    save_file({"w": values, "b": values[0].clone()}, path)
    ours, theirs = _safetensors.load_file(path)["w"], load_file(path)["w"]
    assert ours.dtype.name == dtype
    np.testing.assert_array_equal(ours.view(np.uint8), theirs.view(torch.uint8).numpy())
    leaf = jnp.complex64 if dtype == "complex64" else jnp.float32  # float8 cast exactly as loaded
    loaded = ft.nn.load_torch_state_dict({"w": jnp.zeros((2, 4), leaf), "b": jnp.zeros(4, leaf)}, path)
    np.testing.assert_array_equal(loaded["w"], values.numpy() if dtype == "complex64" else values.float().numpy())


def sharded(tmp_path, weight_map):
    written(tmp_path / "model-1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path / "model.safetensors.index.json"


@pytest.mark.parametrize("shard", ["../model-1.safetensors", "/etc/passwd", "sub/../../model-1.safetensors", "",
                                   "..\\model-1.safetensors"])
def test_an_index_naming_a_shard_outside_its_directory_is_refused(tmp_path, shard):
    inner = tmp_path / "checkpoint"
    inner.mkdir()
    written(tmp_path / "model-1.safetensors")  # a file the escaping name would reach
    index = sharded(inner, {"w": "model-1.safetensors", "b": shard})
    with pytest.raises(ValueError, match=r"(?s)puts 'b' in the shard .*, a path outside the index's directory.*"
                                         r"nothing was read.*right:  \"weight_map\""):
        ft.nn.load_torch_state_dict(model(), index)


def test_an_index_in_a_subdirectory_and_symbolic_links_still_read(tmp_path):
    """Confinement is by name: Hugging Face's cache links each file to a blob elsewhere."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    (snapshot / "parts").mkdir()
    written(blobs / "abc")
    os.symlink(blobs / "abc", snapshot / "parts" / "model-1.safetensors")
    (snapshot / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "parts/model-1.safetensors", "b": "./parts/model-1.safetensors"}}))
    tensors = _safetensors.load_checkpoint(snapshot)
    np.testing.assert_array_equal(tensors["b"], VALUES[4:])


@pytest.mark.parametrize("text, words", [("{not json", r"not JSON: Expecting"), ("[1]", r"not a JSON object"),
                                         ('{"weight_map": {"w": 3}}', r"no weight_map of file names"),
                                         ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", r"not JSON this reads: "
                                          r"values nested deeper")])  # was a RecursionError
def test_a_damaged_index_is_refused_naming_it(tmp_path, text, words):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=rf"(?s)model.safetensors.index.json is not a sharded checkpoint's index \({words}"
                                         r".*no shard was read.*right:  the index of the same save_pretrained call"):
        ft.nn.from_hf({"model_type": "gpt2"}, tmp_path)


@pytest.mark.parametrize("shards", [True, False], ids=["with its shards", "stale index, shards deleted"])
def test_a_directory_with_a_single_file_and_an_index_is_refused_naming_both(tmp_path, shards):
    """save_pretrained leaves the other kind's files of an earlier save in place: a
    directory saved unsharded then sharded holds a stale model.safetensors beside the index
    (transformers reads the stale file), saved the other way round a stale index whose
    shards are gone. The index won before, or its missing shard was reported."""
    index = sharded(tmp_path, {"w": "model-1.safetensors", "b": "model-1.safetensors"})
    if not shards:
        (tmp_path / "model-1.safetensors").unlink()
    written(tmp_path / "model.safetensors", body=(VALUES + 1).tobytes())
    with pytest.raises(ValueError, match=r"(?s)holds two checkpoints: model.safetensors \(written 2\d{3}-.*UTC\) and "
                                         r"the sharded model.safetensors.index.json .*remove the stale one"):
        _safetensors.load_checkpoint(tmp_path)
    assert index.exists()
    np.testing.assert_array_equal(_safetensors.load_checkpoint(tmp_path / "model.safetensors")["b"], VALUES[4:] + 1)


def test_a_tampered_shard_is_refused_naming_the_shard(tmp_path):
    index = sharded(tmp_path, {"w": "model-1.safetensors", "b": "model-1.safetensors"})
    written(tmp_path / "model-1.safetensors", body=VALUES.tobytes() + b"\0")
    with pytest.raises(ValueError, match=r"ft.nn.from_hf: '.*model-1.safetensors' is not a .safetensors file this "
                                         r"reads: bytes 24..25 of its data \(after 'b'\)"):
        ft.nn.from_hf({"model_type": "gpt2"}, index)


@pytest.mark.parametrize("text, words", [(b"{\"model_type\": \"llama\",", r"not JSON: Expecting"),
                                         (b"[\"llama\"]", r"a JSON list, not an object"),
                                         (b"{\"hidden_size\": 8}", r"model_type is None, not a model type's name"),
                                         (b"{\"model_type\": \"ll\xffama\"}", r"not JSON: 'utf-8' codec")])
def test_a_damaged_config_json_is_refused_naming_it(tmp_path, text, words):
    (tmp_path / "config.json").write_bytes(text)
    written(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"(?s)ft.nn.from_hf: '.*config.json' is not a config.json this reads "
                                         rf"\({words}.*right:  hf_config.save_pretrained"):
        ft.nn.from_hf(tmp_path)


def test_a_bfloat16_file_reads_into_a_bfloat16_model(tmp_path):
    values = np.arange(6).astype(jnp.bfloat16)
    header = {"0.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
              "0.bias": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}}
    path = written(tmp_path / "model.safetensors", header=header, body=values.tobytes())
    template = ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0), dtype=jnp.bfloat16))
    loaded = ft.nn.load_torch_state_dict(template, path)
    assert loaded.layers[0].weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded.layers[0].weight, np.float32), [[0, 2], [1, 3]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_loaded_model_holds_copies_never_the_files_memory_map(tmp_path, dtype):
    """The file rewritten in place after loading changes nothing loaded (a view of the memory
    map would): leaves of a model, of an abstract template, of a Stack."""
    stacked = ft.nn.Stack(lambda k: ft.nn.Dense(16, 16, key=k, dtype=dtype), 2, key=jax.random.key(1))
    model = ft.nn.Sequential(ft.nn.Dense(16, 16, key=jax.random.key(0), dtype=dtype), stacked)
    sd = ft.nn.torch_state_dict(model, numpy=True)
    names = sorted(sd)
    body, header = b"", {}
    for name in names:
        data = np.ascontiguousarray(sd[name]).astype(np.float32)
        header[name] = {"dtype": "F32", "shape": list(data.shape), "data_offsets": [len(body), len(body) + data.nbytes]}
        body += data.tobytes()
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)  # every tensor 64-byte aligned, as a device could alias it
    path = written(tmp_path / "model.safetensors", text=text, body=body)
    loads = [ft.nn.load_torch_state_dict(model, path), ft.nn.load_torch_state_dict(jax.eval_shape(lambda: model), path)]
    before = [np.asarray(x, np.float32).copy() for load in loads for x in jax.tree.leaves(load)]
    with open(path, "r+b") as f:  # the same bytes count, other values
        f.seek(8 + len(text))
        f.write(np.full(len(body) // 4, 7.0, np.float32).tobytes())
    after = [np.asarray(x, np.float32) for load in loads for x in jax.tree.leaves(load)]
    for old, new in zip(before, after):
        np.testing.assert_array_equal(new, old)
    assert not any((x == 7.0).all() for x in after)


class Counted(ft.Module):
    """A layer with an integer array leaf (matched by its name, as it is)."""

    dense: ft.nn.Dense
    counts: jax.Array

    def __init__(self):
        self.dense = ft.nn.Dense(2, 2, key=jax.random.key(0))
        self.counts = jnp.zeros(16, jnp.int32)


def test_an_integer_leaf_is_a_device_copy_too(tmp_path):
    values = np.arange(16, dtype=np.int32)
    body = values.tobytes() + VALUES[:4].tobytes() + VALUES[4:].tobytes()
    header = {"counts": {"dtype": "I32", "shape": [16], "data_offsets": [0, 64]},
              "dense.weight": {**W, "data_offsets": [64, 80]}, "dense.bias": {**B, "data_offsets": [80, 88]}}
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    path = written(tmp_path / "model.safetensors", text=text, body=body)
    loaded = [ft.nn.load_torch_state_dict(Counted(), path), ft.nn.load_torch_state_dict(jax.eval_shape(Counted), path)]
    with open(path, "r+b") as f:
        f.seek(8 + len(text))
        f.write(np.full(16, 7, np.int32).tobytes())
    for model in loaded:
        assert isinstance(model.counts, jax.Array) and model.counts.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(model.counts), values)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy pickle"])
def test_a_torch_pickle_is_named_as_one_and_never_unpickled(tmp_path, legacy):
    """``pytorch_model.bin`` was reported as a damaged .safetensors file. It is now named as
    a torch pickle with the restricted loader as the fix; a pickle whose unpickling would
    leave a mark (a file) leaves none."""
    torch = pytest.importorskip("torch")
    import pickle

    class Marks:
        def __reduce__(self):
            return (open, (str(tmp_path / "unpickled"), "w"))

    path = tmp_path / "pytorch_model.bin"
    if legacy:
        path.write_bytes(pickle.dumps({"w": Marks()}, protocol=2))
    else:
        torch.save({"w": torch.zeros(2, 2)}, path)
    with pytest.raises(ValueError, match=r"(?s)is a torch pickle \((a zip archive|a pickle stream).*never unpickles.*"
                                         r"torch.load\(\"pytorch_model.bin\", weights_only=True\)"):
        ft.nn.load_torch_state_dict(model(), path)
    assert not (tmp_path / "unpickled").exists()


def test_numpy_files_are_named_as_numpy_not_as_torch_pickles_or_damage(tmp_path):
    """An .npz (np.savez: a zip archive, as torch.save's) was called a torch pickle, its fix
    torch.load (which refuses it: "file in archive is not in a subdirectory"), and an .npy a
    damaged download; each is named as NumPy's, with np.load as the fix, which loads."""
    arrays = {"0.weight": np.arange(4, dtype=np.float32).reshape(2, 2), "0.bias": np.ones(2, np.float32)}
    np.savez(tmp_path / "w.npz", **arrays)
    np.save(tmp_path / "w.npy", arrays["0.weight"])
    with pytest.raises(ValueError, match=r"(?s)is a NumPy \.npz archive.*right: .*dict\(np\.load\("):
        ft.nn.load_torch_state_dict(model(), tmp_path / "w.npz")
    with pytest.raises(ValueError, match=r"(?s)is a NumPy \.npy array.*right: .*np\.load\("):
        ft.nn.load_torch_state_dict(model(), tmp_path / "w.npy")
    loaded = ft.nn.load_torch_state_dict(model(), dict(np.load(tmp_path / "w.npz")))
    np.testing.assert_array_equal(loaded.layers[0].weight, arrays["0.weight"].T)


def test_a_header_that_starts_like_a_pickle_is_still_safetensors(tmp_path):
    """A header of 640 bytes starts the file with 80 02 (a protocol-2 pickle's first bytes):
    the file reads, and damaged it is reported as damage, not as a pickle."""
    header = {"w": W, "b": B, "__metadata__": {"pad": ""}}
    header["__metadata__"]["pad"] = "x" * (640 - len(json.dumps(header).encode()))
    path = written(tmp_path / "m.safetensors", header=header)
    assert path.read_bytes()[:3] == b"\x80\x02\x00"
    np.testing.assert_array_equal(_safetensors.load_file(path)["b"], VALUES[4:])
    written(path, header=header, body=BODY[:20])
    with pytest.raises(ValueError, match=r"is not a .safetensors file this reads: .*past the 20 bytes"):
        _safetensors.load_file(path)


@pytest.mark.parametrize("order", [">", "<", "="])
def test_save_file_writes_any_byte_order_little_endian_as_the_library_reads_it(tmp_path, order):
    """A big-endian array (a NumPy ``>f4`` from another format) is written as the format
    demands, little-endian, and the safetensors library reads its values back (was a bare
    ``KeyError: dtype('>f4')``)."""
    from safetensors.numpy import load_file

    values = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    arrays = {"w": values.astype(np.dtype("f4").newbyteorder(order)), "i": np.arange(3).astype(f"{order}i8")}
    path = str(tmp_path / "m.safetensors")
    _safetensors.save_file(path, arrays, {})
    theirs = load_file(path)
    np.testing.assert_array_equal(theirs["w"], values.astype(np.float32))
    np.testing.assert_array_equal(theirs["i"], np.arange(3))
    assert theirs["w"].dtype == np.float32 and theirs["i"].dtype == np.int64


def test_a_tensor_in_two_shards_is_refused_naming_both_unless_the_copies_are_equal(tmp_path):
    """The index puts 'w' in model-1, model-2 holds another 'w': transformers reads every
    tensor of every shard the index names, in sorted order, and keeps model-2's (the last);
    the index's copy was read before, silently (the audit's Llama: logits 1.04 apart)."""
    from safetensors.numpy import load_file, save_file

    written(tmp_path / "model-1.safetensors")
    save_file({"w": -3 * VALUES[:4].reshape(2, 2), "c": VALUES[:2]}, str(tmp_path / "model-2.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model-1.safetensors", "b": "model-1.safetensors",
                                                "c": "model-2.safetensors"}}))
    # the library's reading of the two copies: other values
    assert not np.array_equal(load_file(str(tmp_path / "model-1.safetensors"))["w"],
                              load_file(str(tmp_path / "model-2.safetensors"))["w"])
    with pytest.raises(ValueError, match=r"(?s)index .*model.safetensors.index.json puts 'w' in the shard "
                                         r"'model-1.safetensors', and the shard 'model-2.safetensors' holds a tensor of "
                                         r"that name too \(other values\).*keeps the copy of the shard it reads last "
                                         r"\('model-2.safetensors'\).*neither was read.*remove 'w' from the shard"):
        _safetensors.load_checkpoint(tmp_path)
    save_file({"w": VALUES[:4].reshape(2, 2), "c": VALUES[:2]}, str(tmp_path / "model-2.safetensors"))
    tensors = _safetensors.load_checkpoint(tmp_path)  # an equal copy: either reads the same
    np.testing.assert_array_equal(tensors["w"], load_file(str(tmp_path / "model-2.safetensors"))["w"])
    assert sorted(tensors) == ["b", "c", "w"]


@pytest.mark.parametrize("writer", ["save_model", "save_torch_state_dict"])
def test_a_tie_save_model_dropped_reads_from_its_metadata(tmp_path, writer):
    """safetensors.torch.save_model writes a tied head once and records {"head.weight":
    "emb.weight"} in __metadata__; the head read from the file is the embedding (it was
    'missing keys: head.weight', and strict=False left the head at its initial values).
    huggingface_hub's sharded save_torch_state_dict records it in the index's metadata
    (which was not read: 'missing keys: head.weight')."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    class Untied(ft.Module):
        emb: ft.nn.Embedding
        head: ft.nn.Dense

        def __call__(self, ids):
            return self.head(self.emb(ids))

    tied = Tied()
    if writer == "save_model":
        path = tmp_path / "m.safetensors"
        safetensors_torch.save_model(tied, str(path), metadata={"format": "pt"})
        assert set(_safetensors.read_header(str(path), path.stat().st_size)[1]) == {"emb.weight", "head.bias",
                                                                                   "__metadata__"}
    else:
        hub = pytest.importorskip("huggingface_hub")
        path = tmp_path / "sharded"
        path.mkdir()
        hub.save_torch_state_dict(tied.state_dict(), path, max_shard_size=100)  # emb, head.bias: 2 shards
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == {"emb.weight", "head.bias"} and index["metadata"]["head.weight"] == "emb.weight"
    model = Untied(ft.nn.Embedding(11, 6, key=jax.random.key(0)), ft.nn.Dense(6, 11, key=jax.random.key(1)))
    loaded = ft.nn.load_torch_state_dict(model, path)
    ids = np.array([[1, 5, 10, 0]])
    expected = tied(torch.tensor(ids)).detach().numpy()
    np.testing.assert_allclose(np.asarray(loaded(jnp.asarray(ids))), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
