"""A fine-tuned :func:`ft.nn.from_hf` model as a directory Hugging Face's ``from_pretrained``
reads: :func:`save_hf`.

The directory is what ``save_pretrained`` writes: ``config.json`` (the model's carried
``hf_config`` with its ``architectures`` and ``dtype``), ``generation_config.json`` when the
model carried one, and the weights as safetensors: ``model.safetensors``, or past
``max_shard_size`` shards named ``model-00001-of-00002.safetensors`` with the index
``model.safetensors.index.json`` (HF's names and sharding: tensors in order, a new shard
when the next would pass the limit, a tensor larger than it alone in its shard).

It is written into a hidden directory beside the target and renamed into place, so the
target never holds a half-written checkpoint: an interrupted save leaves the old directory
(or none), never one ``from_pretrained`` would read as whole.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import uuid
from typing import Any

import jax
import numpy as np

from functree._files import local_path
from functree._tree import dotted_name
from functree.hf._dropout import without_dropout
from functree.hf._family import family_of
from functree.hf._files import read_config
from functree.hf._heads import tied_copies
from functree.hf._load import FAMILIES, _template, tied_head, to_hf_state_dict
from functree.interop._processes import on_primary
from functree.interop._safetensors import save_file
from functree.nn._lora import LoraDense

__all__ = ["save_hf"]


NOT_A_PORT = """\
ft.nn.save_hf takes a model built by ft.nn.from_hf ({covered}); got {given}. For other \
models write their state dict yourself: ft.nn.torch_state_dict(model, rename=..., layouts=...)."""

NO_CONFIG = """\
ft.nn.save_hf: this {given} carries no Hugging Face config (model.hf_config is None), so \
there is no config.json to write. Models from ft.nn.from_hf carry theirs; a hand-built one \
does not.

    wrong:  model = ft.nn.LlamaForCausalLM(...)  ;  ft.nn.save_hf(model, directory)
    right:  model = ft.nn.from_hf(config, key=jax.random.key(0))   # or from_hf(config, weights)
"""

HAS_LORA = """\
ft.nn.save_hf: the model has LoRA adapters ({where}); Hugging Face's {hf_class} has no place \
for them, and writing the base weights alone would drop the fine-tuning. Merge them into the \
weights first (or save the adapter alone with ft.nn.save_lora).

    wrong:  ft.nn.save_hf(model, directory)
    right:  ft.nn.save_hf(ft.nn.merge_lora(model), directory)
       or:  ft.nn.save_lora(model, adapter_directory)
"""

NOT_EMPTY = """\
ft.nn.save_hf: {directory!r} already holds {found}; save_hf would replace them. Pass \
overwrite=True to replace the directory (written beside it first, then swapped in), or \
choose a new one.

    wrong:  ft.nn.save_hf(model, {directory!r})
    right:  ft.nn.save_hf(model, {directory!r}, overwrite=True)
"""

NOT_A_DIRECTORY = """\
ft.nn.save_hf: {directory!r} is a file, not a directory; save_hf writes a directory \
(config.json and the weights).

    right:  ft.nn.save_hf(model, "path/to/new_directory")
"""

BAD_SHARD_SIZE = """\
ft.nn.save_hf: max_shard_size is a number of bytes or a size such as "5GB" (10^9 bytes, as \
Hugging Face's save_pretrained reads it) or "500MiB" (2^20, which transformers 5's \
save_pretrained refuses); got {given!r}.

    right:  ft.nn.save_hf(model, directory, max_shard_size="2GB")
"""

CONFIG_DIFFERS = """\
ft.nn.save_hf: the model's {path} is {given}, but the config it carries ({fields}) builds \
{expected} there. transformers builds the config's model and loads these weights into it \
(a missing layer left random, an extra one dropped: other logits, and only a load report \
says so). The model's structure changed after from_hf: save it with a config that \
describes it.

    wrong:  ft.nn.save_hf(model, directory)
    right:  config = {{**model.hf_config.to_dict(), {fix}}}
            ft.nn.save_hf(ft.nn.from_hf(config, ft.nn.to_hf_state_dict(model)), directory)
"""

# The config fields that size a model's tensors (each family's names), shown in CONFIG_DIFFERS.
_SIZES = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "n_inner", "ffn_dim",
          "vocab_size", "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "max_position_embeddings",
          "n_positions", "type_vocab_size")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def _shard_limit(given: Any) -> int:
    """``max_shard_size`` in bytes (HF's units: KB = 10^3, KiB = 2^10)."""
    if isinstance(given, (int, np.integer)) and not isinstance(given, bool) and given > 0:
        return int(given)
    match = _SIZE.fullmatch(given) if isinstance(given, str) else None
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(BAD_SHARD_SIZE.format(given=given))
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _shards(weights: dict[str, np.ndarray], limit: int) -> list[dict[str, np.ndarray]]:
    """HF's split (``huggingface_hub``'s): in order, a new shard when the next tensor would
    pass ``limit``; a tensor over ``limit`` alone in a shard of its own."""
    shards: list[dict[str, np.ndarray]] = []
    current: dict[str, np.ndarray] = {}
    size = 0
    for name, array in weights.items():
        if array.nbytes > limit:
            shards.append({name: array})
            continue
        if current and size + array.nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _family(model: Any) -> Any:
    family = family_of(model)
    if family is None:
        raise ValueError(NOT_A_PORT.format(covered=", ".join(f.__name__ for f in FAMILIES.values()),
                                           given=type(model).__name__))
    return family


def _check_no_lora(model: Any, hf_class: str) -> None:
    found = [dotted_name(path) for path, node in
             jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, LoraDense))[0]
             if isinstance(node, LoraDense)]
    if found:
        where = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(HAS_LORA.format(where=where, hf_class=hf_class))


def _dtype_name(weights: dict[str, np.ndarray]) -> str:
    dtypes = {np.dtype(a.dtype).name for a in weights.values()}
    return dtypes.pop() if len(dtypes) == 1 else "float32"


def _config_json(model: Any, family: Any, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """config.json: the carried config, its ``architectures`` and ``dtype`` those of this model."""
    config = model.hf_config.to_dict()
    config["architectures"] = [family.hf_class]
    config["dtype"] = _dtype_name(weights)  # transformers 5's name; 4.x reads torch_dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return _versioned(config)


def _versioned(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the installed transformers' version, as ``save_pretrained`` writes it
    (the carried config keeps no version: :data:`functree.hf._config.PROVENANCE`); none
    without transformers (read from its metadata: nothing is imported)."""
    try:
        return {**values, "transformers_version": importlib.metadata.version("transformers")}
    except importlib.metadata.PackageNotFoundError:
        return values


def _check_target(directory: str, overwrite: bool) -> None:
    if os.path.isfile(directory):
        raise ValueError(NOT_A_DIRECTORY.format(directory=directory))
    if os.path.isdir(directory) and not overwrite:
        found = sorted(os.listdir(directory))
        if found:
            names = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            raise ValueError(NOT_EMPTY.format(directory=directory, found=names))


def _check_config_fits(family: Any, model: Any, names: set[str]) -> None:
    """Raise :data:`CONFIG_DIFFERS` unless the model's leaves have the shapes its carried
    config builds (a model cut or grown after ``from_hf``: its config.json would describe
    another model). One trace of the build, no initialization."""
    config = read_config(model.hf_config.to_dict())
    built = jax.tree_util.tree_flatten_with_path(_template(family, config, names, np.float32, "xla"))[0]
    ours = jax.tree_util.tree_flatten_with_path(without_dropout(model))[0]  # dropout's keys: not weights
    expected = {dotted_name(path): leaf for path, leaf in built}
    for path, leaf in ours:
        name = dotted_name(path)
        want = expected.pop(name, None)
        if want is None or np.shape(leaf) != want.shape:
            _config_differs(model, name, np.shape(leaf), None if want is None else want.shape)
    for name, want in expected.items():
        _config_differs(model, name, None, want.shape)


def _config_differs(model: Any, name: str, given: Any, expected: Any) -> None:
    values = model.hf_config
    fields = ", ".join(f"{k}={values[k]}" for k in _SIZES if k in values)
    layers = next((k for k in ("num_hidden_layers", "n_layer") if k in values), "num_hidden_layers")
    # A stacked leaf that differs in its layer axis alone tells the count to write.
    count = "..."
    if given is not None and expected is not None and len(given) == len(expected) > 0 \
            and given[1:] == expected[1:] and expected[0] == values.get(layers):
        count = given[0]
    raise ValueError(CONFIG_DIFFERS.format(
        path=name, given="absent" if given is None else list(given), fields=fields,
        expected="nothing" if expected is None else list(expected), fix=f"{layers!r}: {count}"))


def _write_files(staging: str, model: Any, family: Any, weights: dict[str, np.ndarray], limit: int) -> None:
    """Everything into ``staging``, config.json last."""
    shards = _shards(weights, limit)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(os.path.join(staging, name), shard, {"format": "pt"})  # HF's loader reads "pt" files
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(a.nbytes for a in weights.values()))},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        _write_json(os.path.join(staging, INDEX_FILE), index)
    generation = model.hf_config.generation
    if model.hf_config.has_generation:  # an empty one too: Hugging Face reads it alone
        _write_json(os.path.join(staging, "generation_config.json"), _versioned(generation.to_dict()))
    _write_json(os.path.join(staging, "config.json"), _config_json(model, family, weights))


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def _swap_in(staging: str, directory: str) -> None:
    """``staging`` renamed to ``directory``; an existing ``directory`` moved aside first and
    removed after (put back if the rename fails)."""
    if not os.path.isdir(directory):
        os.rename(staging, directory)
        return
    parent, name = os.path.split(os.path.abspath(directory))
    aside = os.path.join(parent, f".{name}.replaced-{uuid.uuid4().hex[:8]}")
    os.rename(directory, aside)
    try:
        os.rename(staging, directory)
    except BaseException:
        os.rename(aside, directory)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def save_hf(model: Any, directory: str | os.PathLike[str], *, max_shard_size: int | str = "50GB",
            overwrite: bool = False) -> None:
    """Write a :func:`from_hf` model as a directory ``from_pretrained`` reads.

    ``AutoModelForCausalLM.from_pretrained(directory)`` (BERT: ``AutoModel``) then gives
    the same logits: ``config.json`` is the config the model carries (``model.hf_config``,
    with ``architectures`` and ``dtype`` this model's), ``generation_config.json`` its
    generation config when it has one, and the weights (HF's names and layouts, a tied head
    stored once, as ``save_pretrained`` does) go to ``model.safetensors``, or past
    ``max_shard_size`` (bytes, or ``"5GB"`` = 5·10^9 as HF's; also ``"500MiB"`` =
    500·2^20, which transformers 5's ``save_pretrained`` refuses; HF's default ``"50GB"``) to shards ``model-00001-of-0000N.safetensors`` with the index
    ``model.safetensors.index.json``.

    The directory is written beside the target and renamed into place: an interrupted save
    never leaves a directory that reads as a whole checkpoint. A directory that already
    holds files is replaced only with ``overwrite=True``. A model with LoRA adapters is
    refused: merge them first (``ft.nn.merge_lora(model)``), and so is a model whose
    tensors no longer have the shapes its carried config builds (layers cut or added after
    ``from_hf``: transformers would build the config's model around them). Needs no other package
    (the files are written by :func:`functree.interop._safetensors.save_file`).

    In a multi-process job (a model sharded over several hosts) every process calls it:
    the sharded tensors are gathered (a collective), process 0 writes the directory, and
    every process returns once it is written (or raises its error).

    Example:
      >>> import functree as ft, jax, json, os, pathlib, tempfile
      >>> config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2,
      ...           "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> directory = os.path.join(tempfile.mkdtemp(), "tuned")
      >>> ft.nn.save_hf(model, directory)
      >>> sorted(os.listdir(directory))
      ['config.json', 'model.safetensors']
      >>> json.loads(pathlib.Path(directory, "config.json").read_text())["architectures"]
      ['GPT2LMHeadModel']
      >>> again = ft.nn.from_hf(directory)
      >>> bool((again.transformer.wte.embeddings == model.transformer.wte.embeddings).all())
      True
    """
    family = _family(model)
    if model.hf_config is None:
        raise ValueError(NO_CONFIG.format(given=type(model).__name__))
    _check_no_lora(model, family.hf_class)
    limit = _shard_limit(max_shard_size)
    directory = os.fspath(local_path(directory))  # "~/models/m": the home's, not ./~
    on_primary(lambda: _check_target(directory, overwrite), "ft.nn.save_hf")  # before gathering the model
    weights = to_hf_state_dict(model, numpy=True)  # every process: sharded leaves gathered
    _check_config_fits(family, model, set(weights))
    tied = tied_head(family, model)
    if tied is not None:
        del weights[tied[0]]  # tied: stored once, under the embedding's name (HF's save_pretrained)
    for copy, _ in tied_copies(family, model):  # (BERT's masked LM: its decoder's weight and bias, stored once too)
        weights.pop(copy, None)
    on_primary(lambda: _write_directory(directory, model, family, weights, limit), "ft.nn.save_hf")


def _write_directory(directory: str, model: Any, family: Any, weights: dict[str, np.ndarray], limit: int) -> None:
    """The files into a hidden directory beside ``directory``, then renamed into place."""
    parent, name = os.path.split(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
    try:
        _write_files(staging, model, family, weights, limit)
        _swap_in(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
