"""Checkpoint files read as data: ``.safetensors`` files, sharded checkpoints' indexes, and
``save_pretrained`` directories, each tensor a read-only view of a memory map.

A ``.safetensors`` file is an 8-byte little-endian header size ``n``, ``n`` bytes of UTF-8
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(offsets into the data after the header), then the data. Every rule the ``safetensors``
library checks is checked here, before any tensor is made, and a file breaking one is an
error naming the file, the tensor and the rule:

* ``8 <= 8 + n <= file size``, ``n <= 100_000_000``; the header is UTF-8 JSON, an object
  without duplicate names (which the library does not check: a reader keeping the first of
  two would read other bytes than one keeping the last); ``__metadata__`` (optional) maps str to str;
* each entry has ``dtype`` (known), ``shape`` (sizes ``>= 0``, their product
  within int64) and ``data_offsets`` (two ints, ``begin <= end``), and holds
  ``prod(shape) * itemsize`` bytes;
* the entries sorted by offsets tile the data exactly: the first begins at 0, each begins
  where the one before it ends (no overlap, no gap), the last ends at the end of the file.

A name the file omits that its ``__metadata__`` maps to a tensor it holds reads as that
tensor: ``safetensors.torch.save_model`` writes one copy of tied weights (a head sharing its
embedding) and records ``{"head.weight": "emb.weight"}`` there; a sharded checkpoint of
``huggingface_hub.save_torch_state_dict`` records them in its index's ``metadata``.

Read here rather than by ``safetensors.numpy``, which refuses bfloat16, and which would copy
every tensor: a view of the memory map is read from disk only when it is used.
"""

from __future__ import annotations

import json
import math
import os
import time
import zipfile
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz, "C64": np.complex64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
MAX_HEADER = 100_000_000  # the safetensors library's bound on the header size
_INT64 = 2**63 - 1

BAD_SAFETENSORS = """\
{caller}: {path!r} is not a .safetensors file this reads: {why}. The file is damaged \
(a truncated download, a disk error) or was altered; nothing of it was loaded.

    right:  download or save it again (hf_model.save_pretrained(path), safetensors' save_file)
       or:  pass a state dict: ft.nn.load_torch_state_dict(model, torch.load(path, weights_only=True))"""

PICKLED_FILE = """\
{caller}: {path!r} is a torch pickle ({kind}), not a .safetensors file. functree never \
unpickles a file: unpickling runs whatever code the file names. Load it with torch's \
restricted loader and pass the state dict.

    wrong:  {caller}(..., "pytorch_model.bin")
    right:  {caller}(..., torch.load("pytorch_model.bin", weights_only=True))"""

NUMPY_FILE = """\
{caller}: {path!r} is {kind}, not a .safetensors file (nor a torch pickle: torch.load does \
not read it). NumPy reads it as data (np.load refuses pickled objects unless given \
allow_pickle=True); pass its arrays as the state dict, named as torch names them:

    wrong:  {caller}(..., {path!r})
    right:  {caller}(..., {right})"""

# NUMPY_FILE's {kind} and {right}: np.savez's archive of named arrays, np.save's one array.
NPZ_KIND, NPZ_RIGHT = "a NumPy .npz archive (np.savez's format)", "dict(np.load({path!r}))"
NPY_KIND, NPY_RIGHT = "a NumPy .npy array (np.save's format: one array, no names)", \
    '{{"0.weight": np.load({path!r})}}'

LFS_POINTER = """\
{caller}: {path!r} is a Git LFS pointer ({size}), not the .safetensors file it \
stands for: the repository was cloned or copied without its large files (git lfs not \
installed, or GIT_LFS_SKIP_SMUDGE set). Nothing of it was loaded.

    right:  git lfs install && git lfs pull                  # in the clone
       or:  huggingface_hub.snapshot_download(repo_id, local_dir=...)   # the files themselves"""


SHARD_MISSING = """\
{caller}: the sharded checkpoint's index {index} puts {tensor!r}{more} in the shard {shard!r}, \
which is not there ({found}). A sharded checkpoint is the index and every shard it names, in \
one directory.

    right:  copy {shard!r} next to the index (or save the model again with save_pretrained)
"""

SHARD_LACKS = """\
{caller}: the sharded checkpoint's index {index} puts {tensor!r} in the shard {shard}, whose \
header does not hold it (it holds {count} tensors{example}). The index and its shards come from \
different saves, or the shard was altered.

    right:  the index and the shards of one save_pretrained call
"""

SHARD_OUTSIDE = """\
{caller}: the sharded checkpoint's index {index} puts {tensor!r} in the shard {shard!r}, a path \
outside the index's directory; an index names its shards by file name, next to it. The index \
was altered: nothing was read from {shard!r}.

    wrong:  "weight_map": {{{tensor!r}: {shard!r}}}
    right:  "weight_map": {{{tensor!r}: "model-00001-of-00002.safetensors"}}
"""

SHARD_DUPLICATE = """\
{caller}: the sharded checkpoint's index {index} puts {tensor!r} in the shard {listed!r}, and \
the shard {other!r} holds a tensor of that name too{values}. transformers reads every tensor of \
every shard and keeps the copy of the shard it reads last ({last!r}); the index names the other: \
which one is the model's is not in the files, so neither was read.

    right:  the index and the shards of one save_pretrained call (save the model again)
       or:  remove {tensor!r} from the shard that should not hold it (rewrite it with safetensors' save_file)
"""

INDEX_OMITS = """\
{caller}: the sharded checkpoint's index {index} does not list {tensors}, which the shard \
{shard!r} holds{more}. A reader follows the index (transformers initializes such a tensor at \
random, silently), so the index, not the config, is what lacks it: the index was altered or \
comes from another save.

    right:  the index of the same save_pretrained call as its shards (save the model again)
       or:  add it to the index: "weight_map": {{..., {first!r}: {shard!r}}}
"""

BAD_INDEX = """\
{caller}: {index} is not a sharded checkpoint's index ({why}): a JSON object with \
"weight_map" {{tensor name: shard file}}, as save_pretrained writes model.safetensors.index.json. \
The index is damaged or was altered; no shard was read.

    right:  the index of the same save_pretrained call as its shards (download or save it again)"""

NO_CHECKPOINT = """\
{caller}: the directory {path!r} holds no model.safetensors or model.safetensors.index.json \
(found: {found}). Files other than safetensors are not read here.

    right:  hf_model.save_pretrained({path!r})             # writes model.safetensors (safe_serialization)
       or:  pass a state dict: torch.load("pytorch_model.bin", weights_only=True)
"""

BOTH_CHECKPOINTS = """\
{caller}: the directory {path!r} holds two checkpoints: model.safetensors (written {single}) \
and the sharded model.safetensors.index.json (written {index}). save_pretrained leaves the \
other kind's files of an earlier save in place, so one of them is stale, and which one \
transformers reads depends on its version and on which files are complete: no weights were \
read rather than perhaps the stale ones.

    right:  remove the stale one (model.safetensors, or the index and its shards), or
            ft.nn.from_hf(hf_config, {path!r} + "/model.safetensors")   # or name the file meant
"""

PICKLED_DIRECTORY = """\
{caller}: the directory {path!r} holds its weights as torch pickles ({files}), not as \
model.safetensors: a checkpoint saved by transformers before safetensors was its default \
(save_pretrained(..., safe_serialization=False)). functree never unpickles a file: unpickling \
runs whatever code the file names. Read {them} with torch's restricted loader and pass the state \
dict, or convert the directory once.

    wrong:  {wrong}
    right:  {load}
            {right}
       or:  transformers.AutoModelForCausalLM.from_pretrained({path!r}).save_pretrained(new_path)   # writes model.safetensors"""

INDEX_NAME, SINGLE_NAME = "model.safetensors.index.json", "model.safetensors"
# transformers' names of a torch-pickle checkpoint (one file, or shards and their index)
PICKLE_NAME, PICKLE_INDEX_NAME = "pytorch_model.bin", "pytorch_model.bin.index.json"


def _pickled_directory(where: str, caller: str) -> ValueError | None:
    """:data:`PICKLED_DIRECTORY` where the directory ``where`` (holding no safetensors
    checkpoint) holds transformers' torch-pickle checkpoint: ``pytorch_model.bin``, or the
    shards ``pytorch_model-00001-of-00002.bin`` ... beside their index; else None. The files
    are named, never opened."""
    names = sorted(os.listdir(where))
    pickles = [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
    if not pickles:
        return None
    if PICKLE_INDEX_NAME in names or len(pickles) > 1:  # shards: every one of them read
        load = (f"weights = {{k: v for shard in sorted(glob.glob(os.path.join({where!r}, 'pytorch_model*.bin')))\n"
                "                       for k, v in torch.load(shard, weights_only=True).items()}")
        them = "each shard"
    else:
        load = f"weights = torch.load(os.path.join({where!r}, {pickles[0]!r}), weights_only=True)"
        them = "it"
    shown = ", ".join(pickles[:3]) + (f", ... ({len(pickles)} files)" if len(pickles) > 3 else "")
    if caller == "ft.nn.from_hf":  # the directory still gives the config (its config.json)
        wrong, right = f"ft.nn.from_hf({where!r})", f"model = ft.nn.from_hf({where!r}, weights)   # its config.json, these weights"
    else:
        wrong, right = f"{caller}(model, {where!r})", f"model = {caller}(model, weights)"
    return ValueError(PICKLED_DIRECTORY.format(caller=caller, path=where, files=shown, them=them, load=load,
                                               wrong=wrong, right=right))


# An empty tensor's other sizes: the library reads [0, 2**62] (no bytes), NumPy makes no such
# array (its sizes other than 0, times the item size, must fit in int64).
EMPTY_TOO_BIG = ("its entry for {name!r} has shape {shape}: empty, but its other sizes times the {itemsize}-byte "
                 "item pass 2**63 - 1 bytes: NumPy makes no array of that shape")


NESTED = "values nested deeper than a JSON parser follows (its entries nest {depth} deep)"


class _Invalid(ValueError):
    """Why a header breaks the format (worded to follow "the file's ...")."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a name given twice (JSON parsers keep one
    of the two silently, so two readers could read two different tensors)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise _Invalid(f"its header names {name!r} twice")
        out[name] = value
    return out


def read_header(path: str, total: int) -> tuple[int, dict[str, Any]]:
    """The header's size and its JSON object, checked against the file's size."""
    if total < 8:
        raise _Invalid(f"it has {total} bytes, fewer than the 8 of the header size")
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER:
            raise _Invalid(f"its header size is {size} bytes, over the format's bound of {MAX_HEADER}")
        if 8 + size > total:
            raise _Invalid(f"its header size is {size} bytes, past the end of the {total}-byte file (a truncated file?)")
        raw = f.read(size)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except _Invalid:
        raise
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _Invalid(f"its header is not JSON: {e}") from None
    except RecursionError:  # arrays in arrays past Python's recursion limit (the library's parser stops at 128)
        raise _Invalid(f"its header is not JSON this reads: {NESTED.format(depth=3)}") from None
    if not isinstance(header, dict):
        raise _Invalid("its header is not JSON: not an object")
    return size, header


def _metadata(value: Any) -> None:
    if value is not None and not (isinstance(value, dict)
                                  and all(isinstance(v, str) for v in value.values())):
        raise _Invalid(f"its __metadata__ is {value!r}, not a mapping of strings to strings")


def _entry(name: str, info: Any) -> tuple[Any, tuple[int, ...], int, int]:
    """One header entry's dtype, shape and byte range, each checked."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        fields = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise _Invalid(f"its entry for {name!r} has {fields}; it lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _Invalid(f"its entry for {name!r} has dtype {dtype!r}; one of {', '.join(DTYPES)} is read")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _Invalid(f"its entry for {name!r} has shape {shape!r}, not a list of sizes >= 0")
    elements = 1
    for d in shape:  # each partial product within int64, as the library's checked products
        elements *= d
        if elements > _INT64 or d > _INT64:
            raise _Invalid(f"its entry for {name!r} has shape {shape}, whose element count overflows int64")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]):
        raise _Invalid(f"its entry for {name!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    if 0 in shape and math.prod(d for d in shape if d) * itemsize > _INT64:  # NumPy's bound counts a 0's neighbours
        raise _Invalid(EMPTY_TOO_BIG.format(name=name, shape=shape, itemsize=itemsize))
    begin, end = offsets
    expected = elements * itemsize
    if end - begin != expected:
        raise _Invalid(f"its entry for {name!r} holds {end - begin} bytes; its shape {shape} and dtype {dtype} "
                       f"take {expected}")
    return DTYPES[dtype], tuple(shape), begin, end


def _tiled(entries: dict[str, tuple[Any, tuple[int, ...], int, int]], available: int) -> None:
    """The entries' byte ranges cover the data exactly: no overlap, no gap, nothing past the end."""
    at, before = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin < at:
            raise _Invalid(f"its entry for {name!r} (bytes {begin}..{end}) overlaps {before!r} (ending at byte {at})")
        if begin > at:
            after = f"after {before!r}" if before is not None else "at the start of the data"
            raise _Invalid(f"bytes {at}..{begin} of its data ({after}, before {name!r}) belong to no tensor")
        at, before = end, name
    if at < available:
        raise _Invalid(f"bytes {at}..{available} of its data (after {before!r}) belong to no tensor")
    if at > available:
        raise _Invalid(f"its entry for {before!r} has data_offsets ending at byte {at}, past the {available} "
                       "bytes of data (a truncated file?)")


def _torch_file(path: str) -> str | None:
    """What torch file ``path`` is (its first bytes), or None. Asked only of a file that is
    not safetensors, whose JSON header would start at byte 8 with ``{``: torch.save's zip
    archive (``PK\\x03\\x04``) or a bare pickle (``\\x80``, protocol 2-5, then an opcode:
    never byte 0, which a small header size's third byte is)."""
    with open(path, "rb") as f:
        start = f.read(9)
    if len(start) < 9 or start[8:9] == b"{":
        return None
    if start.startswith(b"PK\x03\x04"):
        return "a zip archive: torch.save's format"
    if start[0] == 0x80 and 2 <= start[1] <= 5 and start[2] != 0:
        return "a pickle stream"
    return None


def _numpy_file(path: str) -> tuple[str, str] | None:
    """NUMPY_FILE's ``(kind, right)`` for NumPy's own formats, else None: ``.npy``
    (``\\x93NUMPY``) or an ``.npz`` (a zip archive, as torch.save's, whose every entry is
    an ``.npy``: its directory read, nothing extracted). Asked only of a file that is not
    safetensors."""
    with open(path, "rb") as f:
        start = f.read(6)
    if start == b"\x93NUMPY":
        return NPY_KIND, NPY_RIGHT.format(path=path)
    if not start.startswith(b"PK\x03\x04"):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    if names and all(name.endswith(".npy") for name in names):
        return NPZ_KIND, NPZ_RIGHT.format(path=path)
    return None


def _lfs_pointer(path: str) -> str | None:
    """The size a Git LFS pointer file records ("the pointer of a 25.0 GB file"), or None
    for any other file: its text starts ``version https://git-lfs.github.com/spec/``."""
    with open(path, "rb") as f:
        start = f.read(1024)
    if not start.startswith(b"version https://git-lfs.github.com/spec/"):
        return None
    size = next((line.split()[1] for line in start.split(b"\n") if line.startswith(b"size ")
                 and len(line.split()) == 2 and line.split()[1].isdigit()), None)
    return f"the pointer of a {int(size) / 1e9:.1f} GB file" if size is not None else "a pointer"


def load_file(path: Any, caller: str = "ft.nn.load_torch_state_dict") -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file as read-only NumPy views of a memory map, the
    whole header checked first (module docstring)."""
    where = os.fspath(path)
    total = os.path.getsize(where)
    try:
        size, header = read_header(where, total)
        metadata = header.pop("__metadata__", None)
        _metadata(metadata)
        entries = {name: _entry(name, info) for name, info in header.items()}
        _tiled(entries, total - 8 - size)
    except _Invalid as e:
        pointer = _lfs_pointer(where)
        if pointer is not None:
            raise ValueError(LFS_POINTER.format(caller=caller, path=where, size=pointer)) from None
        numpy_file = _numpy_file(where)  # not safetensors: NumPy's and torch's files are named, not as damage
        if numpy_file is not None:
            raise ValueError(NUMPY_FILE.format(caller=caller, path=where, kind=numpy_file[0],
                                               right=numpy_file[1])) from None
        kind = _torch_file(where)
        if kind is not None:
            raise ValueError(PICKLED_FILE.format(caller=caller, path=where, kind=kind)) from None
        raise ValueError(BAD_SAFETENSORS.format(caller=caller, path=where, why=e)) from None
    if total == 8 + size:  # no data (every tensor empty): nothing to map
        raw = np.zeros(0, np.uint8)
    else:
        raw = np.memmap(where, np.uint8, mode="r", offset=8 + size)
    tensors = {name: raw[begin:end].view(dtype).reshape(shape) for name, (dtype, shape, begin, end) in entries.items()}
    return tensors | _aliases(metadata or {}, tensors)


def _aliases(metadata: dict[str, str], tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tied names ``save_model`` dropped: metadata ``{omitted name: held name}``."""
    return {alias: tensors[held] for alias, held in metadata.items() if alias not in tensors and held in tensors}


def load_checkpoint(path: Any, caller: str = "ft.nn.load_torch_state_dict") -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file, of a sharded checkpoint (its index
    ``*.safetensors.index.json``) or of a directory holding either, as read-only views of
    memory maps: nothing is read until a tensor is used, one tensor at a time."""
    where = os.fspath(path)
    if os.path.isdir(where):
        index, single = os.path.join(where, INDEX_NAME), os.path.join(where, SINGLE_NAME)
        if os.path.isfile(index) and os.path.isfile(single):
            raise ValueError(BOTH_CHECKPOINTS.format(caller=caller, path=where, single=_written(single),
                                                     index=_written(index)))
        if os.path.isfile(index):
            return load_index(index, caller)
        if os.path.isfile(single):
            return load_file(single, caller)
        pickled = _pickled_directory(where, caller)  # (named, never opened)
        if pickled is not None:
            raise pickled
        raise ValueError(NO_CHECKPOINT.format(caller=caller, path=where, found=sorted(os.listdir(where))[:8]))
    if where.endswith(".json"):
        return load_index(where, caller)
    return load_file(where, caller)


def _written(path: str) -> str:
    """A file's modification time, UTC to the second (which save came last)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(os.path.getmtime(path)))


def _weight_map(index: str, caller: str) -> dict[str, str]:
    return _read_index(index, caller)[0]


def _read_index(index: str, caller: str) -> tuple[dict[str, str], dict[str, str]]:
    """An index's ``weight_map`` (checked) and the string entries of its ``metadata``
    (``huggingface_hub.save_torch_state_dict`` records there the tied names it dropped,
    ``{"head.weight": "emb.weight"}``, as ``save_model`` does in a file's ``__metadata__``)."""
    try:
        with open(index, encoding="utf-8") as f:
            content = json.load(f)
        weight_map = content.get("weight_map")
        metadata = content.get("metadata")
        ok = isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
        why = "no weight_map of file names"
    except (ValueError, AttributeError) as e:
        ok, why = False, f"not JSON: {e}" if isinstance(e, ValueError) else "not a JSON object"
    except RecursionError:
        ok, why = False, f"not JSON this reads: {NESTED.format(depth=2)}"
    if not ok:
        raise ValueError(BAD_INDEX.format(caller=caller, index=index, why=why))
    strings = {k: v for k, v in metadata.items() if isinstance(v, str)} if isinstance(metadata, dict) else {}
    return weight_map, strings


def _confined(shard: str) -> bool:
    """A shard named by a relative path that stays in the index's directory (lexically: a
    directory of symbolic links, as Hugging Face's cache, still reads)."""
    normal = os.path.normpath(shard)
    return bool(shard) and not os.path.isabs(shard) and not os.path.splitdrive(shard)[0] \
        and normal != os.pardir and not normal.startswith(os.pardir + os.sep) and "\\" not in shard


def load_index(index: str, caller: str) -> dict[str, np.ndarray]:
    """A sharded checkpoint: each shard its index names (confined to the index's
    directory), read lazily; every tensor checked to be in the shard the index puts it in
    (:data:`SHARD_LACKS`, every shard's header first), then in no other shard the index names
    (:data:`SHARD_DUPLICATE`); the index's metadata names a tie only for a name no shard holds."""
    weight_map, metadata = _read_index(index, caller)
    folder = os.path.dirname(index)
    tensors: dict[str, np.ndarray] = {}
    shards: dict[str, dict[str, np.ndarray]] = {}
    for shard, names in _by_shard(index, weight_map, caller).items():
        held = shards[shard] = load_file(_shard_path(index, folder, shard, names, caller), caller)
        for name in names:
            if name not in held:
                example = f", e.g. {next(iter(held))!r}" if held else ""
                raise ValueError(SHARD_LACKS.format(caller=caller, index=index, tensor=name,
                                                    shard=os.path.join(folder, shard), count=len(held),
                                                    example=example))
            tensors[name] = held[name]
    for shard, held in shards.items():
        _no_second_copy(index, weight_map, shard, held, shards, caller)
    # a name a shard holds is that tensor (transformers reads it), never a tie the metadata names
    unheld = {alias: name for alias, name in metadata.items() if not any(alias in held for held in shards.values())}
    return tensors | _aliases(unheld, tensors)


def _by_shard(index: str, weight_map: dict[str, str], caller: str) -> dict[str, list[str]]:
    """The index's tensor names per shard, each shard's name checked to stay in its directory."""
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not _confined(shard):
            raise ValueError(SHARD_OUTSIDE.format(caller=caller, index=index, tensor=name, shard=shard))
        by_shard.setdefault(shard, []).append(name)
    return by_shard


def _shard_path(index: str, folder: str, shard: str, names: list[str], caller: str) -> str:
    """A shard's path, refused (:data:`SHARD_MISSING`) when the file is not there."""
    path = os.path.join(folder, shard)
    if not os.path.isfile(path):
        more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
        found = ", ".join(sorted(n for n in os.listdir(folder or ".") if n.endswith(".safetensors"))) or "no shards"
        raise ValueError(SHARD_MISSING.format(caller=caller, index=index, tensor=names[0], more=more, shard=shard,
                                              found=f"the directory holds {found}"))
    return path


def _no_second_copy(index: str, weight_map: dict[str, str], shard: str, held: dict[str, np.ndarray],
                    shards: dict[str, dict[str, np.ndarray]], caller: str) -> None:
    """Refuse a tensor of ``shard`` that the index puts in another shard, with other values:
    transformers loads every tensor of every shard the index names, in sorted order, the
    last copy kept; this reads the index's, so the two would read different weights (an
    equal copy reads the same). ``shards``: every shard's tensors, each holding what the
    index puts in it (checked before)."""
    for name, value in held.items():
        listed = weight_map.get(name, shard)
        if listed == shard:
            continue
        other = shards[listed][name]
        if value.shape == other.shape and value.dtype == other.dtype and value.tobytes() == other.tobytes():
            continue  # the same bytes (NaNs too): either copy reads the same
        values = " (other values)" if value.shape == other.shape else \
            f" (shape {list(value.shape)} against {list(other.shape)})"
        raise ValueError(SHARD_DUPLICATE.format(caller=caller, index=index, tensor=name, listed=listed, other=shard,
                                                values=values, last=max(listed, shard)))


def unlisted(index: str) -> dict[str, str]:
    """The tensors the shards beside an index hold (those it names, and any other
    ``.safetensors`` file of its directory: a shard whose every tensor the index omits) but
    the index does not list, with their shard (``{name: shard}``; headers read only), for an
    error naming the index, not the config, when one of them is missing (:data:`INDEX_OMITS`)."""
    weight_map = _weight_map(index, "ft.nn.from_hf")
    folder = os.path.dirname(index)
    beside = {n for n in os.listdir(folder or ".") if n.endswith(".safetensors")}
    out: dict[str, str] = {}
    for shard in sorted(set(weight_map.values()) | beside):
        path = os.path.join(folder, shard)
        if not (_confined(shard) and os.path.isfile(path)):
            continue
        try:
            _, header = read_header(path, os.path.getsize(path))
        except _Invalid:
            continue
        out.update((name, shard) for name in header if name != "__metadata__" and name not in weight_map)
    return out


def index_of(path: Any) -> str | None:
    """The sharded checkpoint's index that ``path`` (a directory or a file) reads, or None."""
    where = os.fspath(path)
    if os.path.isdir(where):
        index = os.path.join(where, INDEX_NAME)
        return index if os.path.isfile(index) and not os.path.isfile(os.path.join(where, SINGLE_NAME)) else None
    return where if where.endswith(".json") and os.path.isfile(where) else None


def index_omits(path: Any, missing: list[str], rename: Any = None) -> ValueError | None:
    """:data:`INDEX_OMITS` where a tensor the model lacks (``missing``) is in a shard
    header of the checkpoint ``path`` reads but not in its index, else None. ``rename``:
    the loader's renames of older names (a function of ``{name: value}``), applied before
    comparing; the error names the tensors as the files spell them."""
    index = index_of(path) if isinstance(path, (str, os.PathLike)) else None
    if index is None:
        return None
    held = {name: (name, shard) for name, shard in unlisted(index).items()}
    named = rename(held) if rename is not None and held else held
    omitted = [named[name] for name in missing if name in named]
    if not omitted:
        return None
    shard = omitted[0][1]
    same = [name for name, where in omitted if where == shard]
    more = f" (and {len(omitted) - len(same)} more in other shards)" if len(omitted) > len(same) else ""
    listed = same[:4] + (["..."] if len(same) > 4 else [])
    return ValueError(INDEX_OMITS.format(caller="ft.nn.from_hf", index=index, tensors=listed, shard=shard,
                                         more=more, first=same[0]))


def save_file(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (and string ``metadata``) as a ``.safetensors`` file, in the format
    this module reads, as the safetensors library lays it out (a header padded to 8 bytes,
    then each tensor's little-endian bytes in order): ``save_hf`` and ``save_lora`` need no
    ``safetensors`` package. Each array is written from its own memory (no second copy; a
    big-endian array's bytes swapped first)."""
    names = {np.dtype(dtype): name for name, dtype in DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, array in tensors.items():
        end = offset + array.nbytes
        # the file's dtype names no byte order: a big-endian array is written little-endian (below)
        header[name] = {"dtype": names[array.dtype.newbyteorder("<")], "shape": list(array.shape),
                        "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as the safetensors library writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for array in tensors.values():
            little = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)
            f.write(little.reshape(-1).view(np.uint8).data)  # bytes: bfloat16 has no buffer format
