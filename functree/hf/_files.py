"""What ``ft.nn.from_hf`` reads from files: a ``save_pretrained`` directory's ``config.json``
and its weights (``.safetensors`` files, read by :mod:`functree.interop._safetensors`).

A ``config.json`` (a directory's, or one given as a dict) is read without ``transformers``
(whose import takes seconds): :class:`Config` holds its values with Hugging Face's defaults
filled in for the covered model types, as their config classes fill them (transformers v5:
each class's field defaults, then its ``__post_init__``: a ``head_dim`` or
``num_key_value_heads`` left None derived from the sizes, Qwen2's ``sliding_window`` and
``layer_types``, OPT's ``word_embed_proj_dim``, Gemma's legacy ``"gelu"``, GPT-2's
``hidden_size``-style aliases, and the rotary parameters gathered into ``rope_parameters``
from older files' ``rope_scaling``, ``rope_theta``, ``partial_rotary_factor``, GPT-NeoX's
``rotary_emb_base`` / ``rotary_pct`` and a top-level ``original_max_position_embeddings``:
Phi-3's field, or any file's); the
generation options older files kept in config.json are dropped, as HF drops them (without
a generation_config.json beside it they are the model's generation config, as HF's
``from_pretrained`` reads them: :func:`read_legacy_generation`).
``tests/test_hf_files.py`` checks every attribute the builders read against
``transformers.AutoConfig`` for each covered model type.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple, TypeGuard

from functree.hf._family import FAMILIES
from functree.hf._options import sliding_without_window
from functree.interop._safetensors import (
    SINGLE_NAME,
    index_of,
    index_omits,
    load_checkpoint,
    read_header,
)
from functree.nn._rotary import SMALLEST_BASE

BAD_CONFIG = """\
ft.nn.from_hf: the first argument is a Hugging Face model (torch) or config, a dict with \
"model_type" (a config.json), or a directory saved by save_pretrained; got {given}.

    right:  ft.nn.from_hf(hf_model)
       or:  ft.nn.from_hf("path/to/saved_model")                  # config.json + *.safetensors
       or:  ft.nn.from_hf(hf_model.config, "model.safetensors")
"""

NO_CONFIG_JSON = """\
ft.nn.from_hf({path!r}): the directory has no config.json (found: {found}). A directory \
from save_pretrained holds config.json and the weights.

    right:  ft.nn.from_hf(config, {path!r})     # the config given, the weights read from the directory
"""

BAD_CONFIG_JSON = """\
ft.nn.from_hf: {path!r} is not a config.json this reads ({why}). A save_pretrained \
directory's config.json is one JSON object {{"model_type": ..., "hidden_size": ..., ...}}; \
this one is damaged or was altered.

    right:  hf_config.save_pretrained(directory)     # writes config.json again
       or:  ft.nn.from_hf(hf_config, weights)         # the config given, not read from the file
"""

BAD_GENERATION_JSON = """\
ft.nn.from_hf: {path!r} is not a generation_config.json this reads ({why}). A \
save_pretrained directory's generation_config.json is one JSON object {{"eos_token_id": ..., \
...}}; this one is damaged or was altered.

    right:  hf_model.generation_config.save_pretrained(directory)    # writes it again
       or:  delete it (generation then reads eos and pad ids from config.json)
"""

SAMPLING_SWITCH = """\
ft.nn.from_hf: {path!r} sets "do_sample": {given} (a {kind}), not true or false. Any value \
but false, 0, null or an empty one switches sampling on (Hugging Face's generate samples with \
it too), though the file seems to mean {meant}; no model was built.

    wrong:  "do_sample": {given}
    right:  "do_sample": {right}        # JSON's boolean
"""

BAD_CONFIG_VALUE = """\
ft.nn.from_hf: the {model_type} config's {key!r} is {value!r} (a {kind}); Hugging Face's \
{model_type} config takes {expected} there (or null). Building from it would fail later, or \
build another model.

    wrong:  "{key}": {given}
    right:  "{key}": {right}        # {why}, in config.json's JSON
"""

NULL_VALUE = """\
ft.nn.from_hf: the {model_type} config's {key!r} is null; Hugging Face's {model_type} config \
takes {expected} there, never null (transformers refuses this config.json: "Field '{key}' \
expected ..."). Read as false, as 0 or as some default, the null would build another model.

    wrong:  "{key}": null
    right:  "{key}": {right}        # Hugging Face's default (or leave the key out: the same)
"""

NOT_FINITE = """\
ft.nn.from_hf: the {model_type} config's {key} is {value} (config.json's {literal}); no \
Hugging Face model is trained with a NaN or infinite setting, and the model built from it \
would compute NaNs or another model (transformers reads the file and computes them silently).

    wrong:  {wrong}
    right:  the value the checkpoint was trained with (the file as save_pretrained wrote it: download it again)
"""

PHI3_ROPE_TYPE = """\
ft.nn.from_hf: the phi3 config's rope type is {kind!r}; Hugging Face's Phi3Config takes \
"default" or "longrope" ("su" and "yarn" read as longrope) and refuses this config.json \
("`rope_parameters`'s type field must be one of ['longrope']"): no Phi-3 computes it, and \
functree's {kind} rotation would be a model nobody trained.

    wrong:  "rope_scaling": {{"type": {kind_json}, ...}}
    right:  "rope_scaling": {{"type": "longrope", "short_factor": [...], "long_factor": [...]}}   # the checkpoint's own
       or:  no rope_scaling (the default rotation)
"""

NULL_ROPE = """\
ft.nn.from_hf: the {model_type} config's {key} (at its top level or in rope_parameters / \
rope_scaling, GPT-NeoX's rotary_emb_base / rotary_pct) is null; a rotary embedding needs a \
number there (Hugging Face's model fails on it: "unsupported operand type(s)"), and a number \
made up here would build another model.

    wrong:  "{key}": null
    right:  "{key}": {right}        # the checkpoint's own (Hugging Face's default: leave the key out)
"""

BAD_SIZE = """\
ft.nn.from_hf: the {model_type} config's {key!r} is {value}{times}; a size of the model's \
weights is a positive integer, below 2**60 (its weights' dimensions, a few sizes' products, \
fit an array's shape). Built from it, the model would fail deep inside JAX (a negative or \
unrepresentable dimension) or divide by zero, and no checkpoint has such weights.

    wrong:  "{key}": {value}
    right:  "{key}": {right}        # the checkpoint's own ({why}: leave the key out)
"""

HEADS_DO_NOT_DIVIDE = """\
ft.nn.from_hf: the {model_type} config's {hidden!r} ({size}) is not a multiple of its {heads!r} \
({count}): Hugging Face's {model_type} attention splits the hidden size into equal heads and \
refuses this config ("embed_dim must be divisible by num_heads"), so no checkpoint has its weights.

    wrong:  "{hidden}": {size}, "{heads}": {count}
    right:  "{heads}": {right}        # the checkpoint's own: a divisor of {size}
"""

# The families whose HF attention splits the hidden size into equal heads (no head_dim of its own).
EQUAL_HEADS = ("gpt2", "opt", "bert", "gpt_neox", "roberta", "xlm-roberta", "distilbert")

ROPE_VALUE = """\
ft.nn.from_hf: the {model_type} config's {key} (at its top level or in rope_parameters / \
rope_scaling{where}) is {value!r} (a {kind}); a rotary embedding reads {expected} there. Read \
as it is, it would fail deep inside the build, or be read as another value (true as 1, 4096.5 \
as 4096), so no model was built.

    wrong:  "{name}": {given}
    right:  "{name}": {right}        # {why}
"""

ROPE_THETA = """\
ft.nn.from_hf: the {model_type} config's {key} (at its top level or in rope_parameters / \
rope_scaling{where}) is {value!r}; the rotary base is a positive number, at least \
{smallest:.3g} (its frequencies theta_i = rope_theta ** (-2i / d) are float32 numbers, at most \
1 / rope_theta). From {value!r} they are infinite or NaN: the model built from it computes \
NaNs (transformers reads the file and computes them silently), and no checkpoint was trained \
with it.

    wrong:  "rope_theta": {given}
    right:  "rope_theta": 10000.0        # the checkpoint's own (Hugging Face's default: leave the key out)
"""

NO_DEFAULTS = """\
ft.nn.from_hf: the {model_type} config has no {name!r}, and functree/hf/_files.py's \
DEFAULTS has no {model_type!r} row (Hugging Face's defaults of the fields a config.json \
leaves out): {cls} is covered from a transformers model or config, or from a config.json \
that gives every field.

    right:  ft.nn.from_hf(transformers.AutoConfig.from_pretrained(path), path)   # transformers fills the defaults
       or:  ft.nn.from_hf(hf_model)
       or:  DEFAULTS[{model_type!r}] = {{"vocab_size": ..., "num_key_value_heads": KV_HEADS, ...}}   # functree/hf/_files.py
"""


class MissingField(AttributeError, ValueError):
    """A field a config.json of a family without its :data:`DEFAULTS` row lacks: an
    AttributeError (``getattr(config, name, default)`` reads the default) whose message
    says what to give; a ValueError as from_hf's other errors of a config."""


BAD_WEIGHTS = """\
ft.nn.from_hf: weights are a state dict {{name: tensor or array}}, the path of a .safetensors \
file or of a sharded checkpoint's index (model.safetensors.index.json), or a directory holding \
them; got {given}.

    right:  ft.nn.from_hf(config, "path/to/model.safetensors")
       or:  ft.nn.from_hf(config, "path/to/saved_model")
       or:  ft.nn.from_hf(config, hf_model.state_dict())
"""


def read_config(source: Any) -> Any:
    """The HF config of ``from_hf``'s first argument: a config object (its rope parameters
    as its model reads them: :func:`_as_its_model_reads_it`), or a :class:`Config` of a
    ``config.json`` dict or of a ``save_pretrained`` directory's."""
    if isinstance(source, Mapping):
        if "model_type" not in source:
            raise ValueError(BAD_CONFIG.format(given=f"a dict without 'model_type' (keys {sorted(source)[:6]})"))
        return _buildable(Config.of(source))
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        return _buildable(Config.of(_read_json(source)))
    if not hasattr(source, "model_type"):
        raise ValueError(BAD_CONFIG.format(given=type(source).__name__ if not isinstance(source, (str, os.PathLike))
                                           else f"{os.fspath(source)!r}, not a directory"))
    return _as_its_model_reads_it(source)


def _as_its_model_reads_it(config: Any) -> Any:
    """A transformers config as its model reads it: HF's rope init standardizes the config's
    rope parameters again when the model is built, and a top-level
    ``original_max_position_embeddings`` (an attribute by then) replaces the rope dict's
    (yarn, llama3, longrope). The config object alone keeps the dict's (or
    ``max_position_embeddings``), so it is standardized again here, on a copy."""
    if not (hasattr(config, "standardize_rope_params") and getattr(config, "rope_parameters", None)):
        return config
    config = copy.deepcopy(config)
    config.standardize_rope_params()
    return config


def _read_json(directory: Any) -> dict[str, Any]:
    """A directory's ``config.json`` as a dict with a ``model_type``, else an error naming the file."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ValueError(NO_CONFIG_JSON.format(path=os.fspath(directory), found=sorted(os.listdir(directory))[:8]))
    values = _json_object(path, BAD_CONFIG_JSON)
    if not isinstance(values.get("model_type"), str):
        raise ValueError(BAD_CONFIG_JSON.format(path=path, why=f"model_type is {values.get('model_type')!r}, "
                                                                 "not a model type's name"))
    return values


def read_generation(directory: Any) -> dict[str, Any] | None:
    """A directory's ``generation_config.json`` as a dict (None when it has none), else an
    error naming the file."""
    path = os.path.join(os.fspath(directory), "generation_config.json")
    if not os.path.isfile(path):
        return None
    return _sampling_switch(_json_object(path, BAD_GENERATION_JSON), path)


def _sampling_switch(values: dict[str, Any], path: str) -> dict[str, Any]:
    """``values`` (a generation config's), refused where ``do_sample`` is not a boolean
    (:data:`SAMPLING_SWITCH`): a string ``"false"`` is truthy, so Hugging Face's generate and
    this one would sample where the file seems to say greedy."""
    given = values.get("do_sample")
    if given is not None and not isinstance(given, bool):
        off = str(given).strip().lower() in ("false", "0", "no", "off", "")
        raise ValueError(SAMPLING_SWITCH.format(path=path, given=json.dumps(given), kind=type(given).__name__,
                                                meant="greedy decoding" if off else "sampling",
                                                right="false" if off else "true"))
    return values


# The token ids HF's generation config also reads from a config.json (GenerationConfig fields).
GENERATION_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def read_legacy_generation(directory: Any) -> dict[str, Any] | None:
    """The generation options an older ``config.json`` holds (``no_repeat_ngram_size``,
    ``repetition_penalty`` ...), with its token ids; None when it holds none. For a directory
    without generation_config.json, where HF's ``from_pretrained`` reads config.json as the
    generation config (``GenerationConfig.from_pretrained(directory,
    config_file_name="config.json")``), though its config class drops those keys."""
    values = _read_json(directory)
    if not any(values.get(k) is not None for k in GENERATION_OPTIONS):
        return None
    _sampling_switch(values, os.path.join(os.fspath(directory), "config.json"))
    return {k: copy.deepcopy(v) for k, v in values.items()
            if (k in GENERATION_OPTIONS or k in GENERATION_TOKEN_IDS) and v is not None}


def _json_object(path: str, error: str) -> dict[str, Any]:
    """The JSON object in file ``path``, else ``error`` (formatted with ``path`` and why)."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(error.format(path=path, why=f"not JSON: {e}")) from None
    except RecursionError:  # json.load recurses per nesting level: a damaged file, named
        raise ValueError(error.format(path=path, why="nested deeper than Python's JSON reader allows")) from None
    if not isinstance(values, dict):
        raise ValueError(error.format(path=path, why=f"a JSON {type(values).__name__}, not an object"))
    depth = _depth(values)
    if depth > MAX_JSON_DEPTH:  # copied and frozen recursively later: refused here, the file named
        raise ValueError(error.format(path=path, why=f"values nested {depth} levels deep, past {MAX_JSON_DEPTH}"))
    return values


# Far past any Hugging Face config's nesting (a few levels), far below Python's recursion limit.
MAX_JSON_DEPTH = 100


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in a JSON value, measured without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level + 1)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


HEAD_MISSING = """\
ft.nn.from_hf: the weights hold no {head!r}: the {hf_class} the config builds has an output \
head of its own (tie_word_embeddings is false), and these are a base model's weights \
({base}'s save_pretrained writes none) or lack it. transformers' AutoModelForCausalLM loads \
them with a head drawn at random (a warning), whose logits mean nothing; no model was built.

    right:  the causal LM's own checkpoint: {hf_class}.from_pretrained(...).save_pretrained(directory)
       or:  ft.nn.from_hf({{**config, "tie_word_embeddings": True}}, weights)   # if the head is the embedding (a tied model)
"""


NOT_FLOATING = """\
ft.nn.from_hf: the weights' {tensor!r} is {given} (shape {shape}), where the {hf_class} the config \
builds has a floating weight ({expected}){more}. transformers' from_pretrained casts the \
integers to floats without a word: another model (a quantized checkpoint's integers read \
without their scales, or a file whose header was altered); nothing was built.

    wrong:  {tensor!r}: {given}, shape {shape}
    right:  {tensor!r}: float32, float16 or bfloat16, shape {shape}   # the checkpoint's floating file: download or save it again
       or:  {load}weights[{tensor!r}] = weights[{tensor!r}]{cast}   # only where these integers are the values meant
            model = ft.nn.from_hf(config, weights)
"""

PREFIXED_WEIGHTS = """\
ft.nn.from_hf: {which}the weights' names start with {prefix!r} (e.g. {example!r}), where the {hf_class} \
the config builds names its weights without it ({expected!r}): a checkpoint saved from a model \
wrapped in another (PEFT's base_model.model., DistributedDataParallel's module.) or its names \
edited. transformers' from_pretrained does not read them as the model's either: it \
initializes each weight it does not find under its own name at random (its load report lists \
them as missing), a model whose logits mean nothing; nothing was built.

    wrong:  {example!r}
    right:  {expected!r}
            {load}weights = {{k.removeprefix({prefix!r}): v for k, v in weights.items()}}
            model = ft.nn.from_hf(config, weights)
"""


def dtype_name(value: Any) -> str:
    """A tensor's or array's dtype name, torch's or NumPy's ("int8", "bfloat16", "float8_e4m3fn")."""
    return str(getattr(value, "dtype", "")).removeprefix("torch.")


def not_floating(hf_class: str, weights: Mapping[str, Any], unexpected: Collection[str],
                 mismatched: Collection[tuple[str, str, str]], load: str) -> ValueError | None:
    """:data:`NOT_FLOATING` where a tensor the model reads as a floating weight is an integer,
    boolean or complex one (``mismatched``: the load report's, which refused it), else None.
    A quantized checkpoint's tensors left over (``unexpected``: scales beside integer weights)
    are named by the caller's own error."""
    refused = " ".join(given for _, _, given in mismatched)
    wrong = [name for name, value in weights.items() if name not in unexpected
             and not dtype_name(value).startswith(("float", "bfloat"))
             and f"dtype {dtype_name(value)}" in refused]
    if not wrong:
        return None
    first = weights[wrong[0]]
    expected = next((want for _, want, given in mismatched if f"dtype {dtype_name(first)}" in given), "floating")
    more = f"; so are {wrong[1:4] + (['...'] if len(wrong) > 4 else [])}" if len(wrong) > 1 else ""
    torch = bool(load) or type(first).__module__.startswith("torch")  # (a file's: safetensors.torch's reader)
    return ValueError(NOT_FLOATING.format(tensor=wrong[0], given=dtype_name(first), shape=tuple(first.shape),
                                          hf_class=hf_class, expected=expected, more=more, load=load,
                                          cast=".float()" if torch else ".astype(np.float32)"))


def prefixed(hf_class: str, weights: Mapping[str, Any], stack: str, load: str) -> ValueError | None:
    """:data:`PREFIXED_WEIGHTS` where no tensor's name starts with ``stack`` (the torch name of
    the model's layers, ``model.layers``) but some name holds it after a prefix
    (``base_model.model.model.layers.0...``; every name's, or only some: a wrapper's
    layers saved beside the bare embedding), else None."""
    marker = f".{stack}."
    example = next((name for name in weights if marker in name and not name.startswith(f"{stack}.")), None)
    if example is None or any(name.startswith(f"{stack}.") for name in weights):
        return None
    prefix = example[:example.index(marker) + 1]
    held = sum(name.startswith(prefix) for name in weights)  # (all, or the layers only: module.model.layers.*)
    which = "" if held == len(weights) else f"{held} of {len(weights)} of "
    return ValueError(PREFIXED_WEIGHTS.format(prefix=prefix, example=example, expected=example.removeprefix(prefix),
                                              hf_class=hf_class, load=load, which=which))


METADATA_COPY = """\
ft.nn.from_hf: the checkpoint holds no {alias!r}; the metadata of {record} names it a copy of \
{held!r} (shape {shape}, {dtype}: safetensors' save_model and huggingface_hub's \
save_torch_state_dict record so a tensor they stored once for two names), and the {hf_class} \
the config builds reads {alias!r} as a weight of its own. transformers' from_pretrained does \
not read that record: it draws {alias!r} at random (its load report lists it as missing), so \
the checkpoint reads as two different models; nothing was built.

    wrong:  {alias!r} from the record {{{alias!r}: {held!r}}}
    right:  {tie}{load}weights[{alias!r}] = weights[{held!r}]   # the copy, said in code
            model = ft.nn.from_hf(config, weights)
"""


def metadata_copies(path: Any) -> tuple[str, dict[str, str]]:
    """The file recording the copies a checkpoint's metadata names (one ``.safetensors``
    file's ``__metadata__``, a sharded checkpoint's index ``metadata``) and those copies,
    ``{name: held name}``: each a name no file holds, read as the held tensor by
    :func:`~functree.interop._safetensors.load_checkpoint`. Read after the checkpoint loaded
    (its headers checked)."""
    where = os.fspath(path)
    index = index_of(where)
    if index is not None:
        with open(index, encoding="utf-8") as f:
            content = json.load(f)
        names = set(content["weight_map"])
        held = set(names)
        for shard in set(content["weight_map"].values()):
            file = os.path.join(os.path.dirname(index), shard)
            held |= set(read_header(file, os.path.getsize(file))[1])
        record, metadata = index, content.get("metadata")
    else:
        record = os.path.join(where, SINGLE_NAME) if os.path.isdir(where) else where
        header = read_header(record, os.path.getsize(record))[1]
        metadata = header.pop("__metadata__", None)
        names = held = set(header)
    if not isinstance(metadata, dict):
        return record, {}
    return record, {alias: name for alias, name in metadata.items()
                    if isinstance(name, str) and alias not in held and name in names}


def check_metadata_copies(given: Any, weights: Mapping[str, Any], tied: Collection[tuple[str, str]],
                          hf_class: str, head: str | None, load: str) -> None:
    """Raise :data:`METADATA_COPY` where the checkpoint at ``given`` (a path; a state dict is
    the caller's own) supplies a tensor the model reads by a metadata record alone, which
    transformers does not read. ``tied``: the (copy, tensor) pairs the model ties (its head to
    its embedding), either way round one tensor: a record of them reads as transformers ties them."""
    if not isinstance(given, (str, os.PathLike)):
        return
    record, copies = metadata_copies(given)
    pairs = {frozenset(pair) for pair in tied}
    for alias, held in copies.items():
        if alias not in weights or frozenset((alias, held)) in pairs:
            continue
        value = weights[alias]
        tie = ('ft.nn.from_hf({**config, "tie_word_embeddings": True}, path)   # where the head is the embedding '
               '(a tied model)\n       or:  ') if alias == head else ""
        raise ValueError(METADATA_COPY.format(alias=alias, record=record, held=held, shape=tuple(value.shape),
                                              dtype=str(value.dtype), hf_class=hf_class, tie=tie, load=load))


QUANTIZED = """\
ft.nn.from_hf: the config's {field!r} is {shown}: the checkpoint's weights are stored \
quantized ({method}: packed integers, or narrow floats whose scales are tensors of their own), \
and functree reads every weight as a floating array of the model's shape. Read so they would \
compute another model (an int4 word or a float8 weight without its scale is not the weight), \
so nothing was built.

    wrong:  ft.nn.from_hf(path)    # config.json: "{field}": {shown}
    right:  ft.nn.from_hf("path/to/the/unquantized/checkpoint")   # the float16/bfloat16/float32 original
       or:  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path)
            hf_model.dequantize()                    # where its quantizer can; drops config.{field}
            model = ft.nn.from_hf(hf_model)
"""


def _quantization(field: str, value: Any) -> str:
    """The quantization method a config's ``field`` names: transformers' ``quant_method``, MLX's bits."""
    if field == "quantization":  # mlx_lm's {"group_size": 64, "bits": 4}
        return f"MLX, {value.get('bits', '?')} bits" if isinstance(value, Mapping) else "MLX"
    method = value.get("quant_method") if isinstance(value, Mapping) else None
    return str(getattr(method, "value", method)) if method is not None else "an unnamed method"  # (an enum's value)


def refuse_quantized(config: Any) -> None:
    """Raise :data:`QUANTIZED` where ``config`` (an HF config object or a :class:`Config`)
    describes quantized weights: a ``quantization_config`` (transformers' quantizers: GPTQ,
    AWQ, bitsandbytes, fp8, compressed-tensors, ...) or MLX's ``quantization``, not null."""
    for field in ("quantization_config", "quantization"):
        value = getattr(config, field, None)
        if value is None:
            continue
        if hasattr(value, "to_dict"):  # transformers' QuantizationConfig objects
            value = value.to_dict()
        shown = json.dumps(value, default=str)
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        raise ValueError(QUANTIZED.format(field=field, shown=shown, method=_quantization(field, value)))


LAYER_LACKS = """\
ft.nn.from_hf: missing from the weights: {missing!r}, which the other layers hold ({sibling!r}: \
shape {shape}, {dtype}){more}: the checkpoint lost it (a partial download or copy, an edited \
file), the config is its own. transformers' from_pretrained draws it at random (its load \
report lists it as missing), a model nobody trained; nothing was built.

    wrong:  no {missing!r}
    right:  {missing!r}: shape {shape}   # the checkpoint whole: download or save it again
"""


def _layer_lacks(missing: list[str], unexpected: list[str], weights: Mapping[str, Any]) -> ValueError | None:
    """:data:`LAYER_LACKS` where every tensor missing is one layer's, held by another layer
    (``model.layers.0.self_attn.q_proj.weight`` where layer 1 has its own) and nothing is left
    over: no config builds layers of different tensors here, so the file is to blame."""
    if unexpected or not missing:
        return None
    siblings = []
    for name in missing:
        match = re.search(r"\.(\d+)\.", name)
        pattern = re.compile(re.escape(name[:match.start()]) + r"\.\d+\." + re.escape(name[match.end():])) \
            if match else None
        sibling = next((k for k in weights if pattern is not None and pattern.fullmatch(k)), None)
        if sibling is None:
            return None
        siblings.append(sibling)
    value = weights[siblings[0]]
    more = f"; so are {missing[1:4] + (['...'] if len(missing) > 4 else [])}" if len(missing) > 1 else ""
    return ValueError(LAYER_LACKS.format(missing=missing[0], sibling=siblings[0], shape=tuple(value.shape),
                                         dtype=dtype_name(value), more=more))


def missing_tensors(family: Any, model: Any, missing: list[str], unexpected: list[str], given: Any,
                    weights: Mapping[str, Any] | None = None) -> ValueError | None:
    """Why the weights ``given`` to from_hf lack the tensors ``missing`` where the config is
    not to blame: the checkpoint's index omits them though a shard holds them
    (:data:`~functree.interop._safetensors.INDEX_OMITS`), or only the untied output head of
    ``model`` is missing (:data:`HEAD_MISSING`: a base model's checkpoint); else None."""
    omitted = index_omits(given, missing, family.hf_names) if missing else None
    if omitted is not None:
        return omitted
    head = family.hf_head[0] if family.hf_head is not None else None
    if missing == [head] and not unexpected and getattr(model, "lm_head", None) is not None:
        name = family.hf_class
        base = next((name[: -len(s)] + "Model" for s in ("ForCausalLM", "LMHeadModel") if name.endswith(s)), name)
        return ValueError(HEAD_MISSING.format(head=head, hf_class=family.hf_class, base=base))
    return _layer_lacks(missing, unexpected, weights) if weights is not None else None


def read_weights(weights: Any) -> Mapping[str, Any]:
    """``from_hf``'s weights: a state dict as given, or the tensors of a checkpoint's files."""
    if isinstance(weights, (str, os.PathLike)):
        return load_checkpoint(weights, "ft.nn.from_hf")
    if not isinstance(weights, Mapping):
        raise ValueError(BAD_WEIGHTS.format(given=type(weights).__name__))
    return weights


# ---- config.json with Hugging Face's defaults ---------------------------------------------------


class Derived(NamedTuple):
    """A field whose default is ``default`` and which HF's config class derives from the
    others in ``__post_init__`` when it is None (given as null, or None by default):
    ``rule(values)``, None where the values it reads are not there."""

    default: Any
    rule: Callable[[Mapping[str, Any]], Any]


def _heads(values: Mapping[str, Any]) -> Any:
    return values.get("num_attention_heads")


def _head_size(values: Mapping[str, Any]) -> Any:
    heads, hidden = values.get("num_attention_heads"), values.get("hidden_size")
    if isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
        return hidden // heads
    return None


# num_key_value_heads = num_attention_heads; head_dim = hidden_size // num_attention_heads.
KV_HEADS, HEAD_DIM = Derived(None, _heads), Derived(None, _head_size)

_LLAMA = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "hidden_act": "silu",
          "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
          "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1,
          "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
          "mlp_bias": False, "head_dim": HEAD_DIM}

def _gemma2_layer_types(values: Mapping[str, Any]) -> list[str] | None:
    """Gemma2Config's ``layer_types`` when none is given: the even layers slide, the odd are full."""
    layers = values.get("num_hidden_layers")
    if not isinstance(layers, int):
        return None
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]


def _qwen3_layer_types(values: Mapping[str, Any]) -> list[str] | None:
    """Qwen3Config's ``layer_types`` when none is given: sliding from layer
    ``max_window_layers`` on where ``use_sliding_window`` keeps a ``sliding_window``."""
    layers, first = values.get("num_hidden_layers"), values.get("max_window_layers")
    size = values.get("sliding_window") if values.get("use_sliding_window") else None
    if not isinstance(layers, int) or not isinstance(first, int):
        return None
    return ["sliding_attention" if size is not None and i >= first else "full_attention" for i in range(layers)]


def _qwen2_moe_layer_types(values: Mapping[str, Any]) -> list[str] | None:
    """Qwen2MoeConfig's ``layer_types`` when none is given: where ``use_sliding_window``, the
    even layers below ``max_window_layers`` sliding (``(i + 1) % 2``: its own rule, not
    Qwen2's), every other layer full."""
    layers, last = values.get("num_hidden_layers"), values.get("max_window_layers")
    if not isinstance(layers, int) or not isinstance(last, int):
        return None
    on = bool(values.get("use_sliding_window"))
    return ["sliding_attention" if on and (i + 1) % 2 and i < last else "full_attention" for i in range(layers)]


def _ministral_layer_types(values: Mapping[str, Any]) -> list[str] | None:
    """MinistralConfig's ``layer_types`` when none is given: every layer sliding where
    ``sliding_window`` is set, every layer full where it is null."""
    layers = values.get("num_hidden_layers")
    if not isinstance(layers, int):
        return None
    return ["sliding_attention" if values.get("sliding_window") is not None else "full_attention"] * layers


def _gemma3_layer_types(values: Mapping[str, Any]) -> list[str] | None:
    """Gemma3TextConfig's ``layer_types`` when none is given: every ``sliding_window_pattern``-th
    layer full (an older file's key, 6 where it is absent), the others sliding."""
    layers, pattern = values.get("num_hidden_layers"), values.get("sliding_window_pattern", 6)
    if not isinstance(layers, int) or not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        return None
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _smollm3_no_rope(values: Mapping[str, Any]) -> list[int] | None:
    """SmolLM3Config's ``no_rope_layers`` when none is given: every ``no_rope_layer_interval``-th layer 0 (NoPE)."""
    layers, interval = values.get("num_hidden_layers"), values.get("no_rope_layer_interval")
    if not isinstance(layers, int) or not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        return None
    return [int((i + 1) % interval != 0) for i in range(layers)]


def _smollm3_layer_types(values: Mapping[str, Any]) -> list[str] | None:
    """SmolLM3Config's ``layer_types`` when none is given: the NoPE layers slide where
    ``use_sliding_window`` and a ``sliding_window`` are set, every other layer is full."""
    layers, rope = values.get("num_hidden_layers"), values.get("no_rope_layers")
    if not isinstance(layers, int) or not isinstance(rope, list) or len(rope) < layers:
        return None
    sliding = bool(values.get("use_sliding_window")) and values.get("sliding_window") is not None
    return ["sliding_attention" if sliding and not rope[i] else "full_attention" for i in range(layers)]


# Each covered model type's config class fields and their defaults (transformers v5); a
# Derived value: the field HF's __post_init__ derives when it is None (its rule).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": Derived(32, _heads), "hidden_act": "silu",
              "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
              "tie_word_embeddings": False, "rope_parameters": None, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28, "layer_types": None, "attention_dropout": 0.0,
              "pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": Derived(8, _heads), "head_dim": HEAD_DIM,
                "hidden_act": "silu",
                "max_position_embeddings": 4096 * 32, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                "use_cache": True, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
                "tie_word_embeddings": False, "rope_parameters": None, "sliding_window": 4096,
                "attention_dropout": 0.0},
    # MinistralConfig: Mistral's fields and layer_types; its head_dim stays null (HF's model then fails)
    "ministral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,  # (HF refuses null kv)
                  "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "initializer_range": 0.02,
                  "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
                  "eos_token_id": 2, "tie_word_embeddings": False, "rope_parameters": None, "sliding_window": 4096,
                  "attention_dropout": 0.0, "layer_types": Derived(None, _ministral_layer_types)},
    "gemma": {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
              "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "initializer_range": 0.02,
              "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
              "tie_word_embeddings": True, "rope_parameters": None, "attention_bias": False,
              "attention_dropout": 0.0, "use_bidirectional_attention": None},
    "phi3": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
             "use_cache": True, "tie_word_embeddings": False, "rope_parameters": None, "bos_token_id": 1,
             "eos_token_id": 32000, "pad_token_id": 32000, "sliding_window": None},
    "olmo": {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "hidden_act": "silu",
             "max_position_embeddings": 2048, "initializer_range": 0.02, "use_cache": True, "pad_token_id": 1,
             "bos_token_id": None, "eos_token_id": 50279, "tie_word_embeddings": False, "rope_parameters": None,
             "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None},
    "gpt_neox": {"vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
                 "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
                 "classifier_dropout": 0.1, "max_position_embeddings": 2048, "initializer_range": 0.02,
                 "layer_norm_eps": 1e-5, "use_cache": True, "bos_token_id": 0, "eos_token_id": 2,
                 "pad_token_id": None, "tie_word_embeddings": False, "use_parallel_residual": True,
                 "rope_parameters": None, "attention_bias": True, "is_decoder": False},
    # PhiConfig: no head_dim field (its attention reads hidden / heads), the factor 0.5 by default
    "phi": {"vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
            "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attention_dropout": 0.0, "hidden_act": "gelu_new", "max_position_embeddings": 2048,
            "initializer_range": 0.02, "layer_norm_eps": 1e-5, "use_cache": True, "tie_word_embeddings": False,
            "rope_parameters": None, "qk_layernorm": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": None},
    # MixtralConfig: Mistral's fields (no sliding window by default; head_dim stays null: hidden / heads), the experts'
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,  # (HF refuses null kv)
                "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "initializer_range": 0.02,
                "rms_norm_eps": 1e-5, "use_cache": True, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
                "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
                "num_experts_per_tok": 2, "num_local_experts": 8, "output_router_logits": False,
                "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "rope_parameters": None},
    # Qwen3MoeConfig: no head_dim field (its attention reads config.json's, else hidden / heads); num_experts is
    # stored as num_local_experts (its attribute_map: ALIASES); mlp_only_layers null is []
    "qwen3_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
        "attention_dropout": 0.0, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_local_experts": 128, "norm_topk_prob": False, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "mlp_only_layers": Derived(None, lambda values: []), "pad_token_id": None,
        "bos_token_id": None, "eos_token_id": None},
    # Qwen2MoeConfig: no head_dim field (its attention reads config.json's, else hidden / heads), num_experts
    # (no attribute_map), qkv_bias; its sliding_window is 0 unless use_sliding_window (read as no window)
    "qwen2_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": Derived(16, _heads), "hidden_act": "silu",
        "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "attention_dropout": 0.0, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
        "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "mlp_only_layers": Derived(None, lambda values: []), "qkv_bias": True,
        "layer_types": Derived(None, _qwen2_moe_layer_types), "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None},
    # OlmoeConfig: num_local_experts read as num_experts (its attribute_map: ALIASES), no head_dim field
    "olmoe": {
        "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": KV_HEADS, "hidden_act": "silu", "max_position_embeddings": 4096,
        "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True, "pad_token_id": 1, "bos_token_id": None,
        "eos_token_id": 50279, "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "num_experts_per_tok": 8, "num_experts": 64,
        "output_router_logits": False, "router_aux_loss_coef": 0.01, "norm_topk_prob": False},
    "opt": {"vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
            "max_position_embeddings": 2048, "do_layer_norm_before": True, "_remove_final_layer_norm": False,
            "word_embed_proj_dim": None, "dropout": 0.1, "attention_dropout": 0.0, "num_attention_heads": 12,
            "activation_function": "relu", "layerdrop": 0.0, "init_std": 0.02, "use_cache": True,
            "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "enable_bias": True,
            "layer_norm_elementwise_affine": True, "tie_word_embeddings": True},
    "bert": {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
             "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
             "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0, "use_cache": True,
             "classifier_dropout": None, "is_decoder": False, "add_cross_attention": False, "bos_token_id": None,
             "eos_token_id": None, "tie_word_embeddings": True},
    "roberta": {"vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
                "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 1, "bos_token_id": 0,
                "eos_token_id": 2, "use_cache": True, "classifier_dropout": None, "is_decoder": False,
                "add_cross_attention": False, "tie_word_embeddings": True},
    "xlm-roberta": {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                    "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
                    "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 1, "bos_token_id": 0,
                    "eos_token_id": 2, "use_cache": True, "classifier_dropout": None, "is_decoder": False,
                    "add_cross_attention": False, "tie_word_embeddings": True},
    # DistilBertConfig: its own names (dim, n_heads, n_layers: ALIASES); LayerNorm's eps fixed (1e-12), no field
    "distilbert": {"vocab_size": 30522, "max_position_embeddings": 512, "sinusoidal_pos_embds": False, "n_layers": 6,
                   "n_heads": 12, "dim": 768, "hidden_dim": 3072, "dropout": 0.1, "attention_dropout": 0.1,
                   "activation": "gelu", "initializer_range": 0.02, "qa_dropout": 0.1, "seq_classif_dropout": 0.2,
                   "pad_token_id": 0, "eos_token_id": None, "bos_token_id": None, "tie_word_embeddings": True},
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
             "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "summary_type": "cls_index",
             "summary_use_proj": True, "summary_activation": None, "summary_proj_to_labels": True,
             "summary_first_dropout": 0.1, "scale_attn_weights": True, "use_cache": True, "bos_token_id": 50256,
             "eos_token_id": 50256, "pad_token_id": None, "scale_attn_by_inverse_layer_idx": False,
             "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True},
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": Derived(32, _heads),
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": 0.02,
        "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False, "rope_parameters": None,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": Derived(None, _qwen3_layer_types), "attention_dropout": 0.0, "pad_token_id": None,
        "bos_token_id": None, "eos_token_id": None},
    "olmo2": {
        "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "hidden_act": "silu", "max_position_embeddings": 2048,
        "initializer_range": 0.02, "use_cache": True, "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 50279,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
        "rms_norm_eps": 1e-5},
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": Derived(None, _gemma2_layer_types), "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None},
    "gemma3_text": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": Derived(None, _gemma3_layer_types), "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "use_bidirectional_attention": False},
    # GraniteConfig: Llama's fields but pretraining_tp and head_dim (its attention reads hidden / heads), four multipliers
    "granite": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "hidden_act": "silu", "max_position_embeddings": 2048,
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "embedding_multiplier": 1.0, "logits_scaling": 1.0,
        "residual_multiplier": 1.0, "attention_multiplier": 1.0},
    # SmolLM3Config: no_rope_layers from no_rope_layer_interval, layer_types from them (sliding: the NoPE layers)
    "smollm3": {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
        "num_attention_heads": 16, "num_key_value_heads": Derived(4, _heads), "hidden_act": "silu",
        "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": 128004, "bos_token_id": 128000, "eos_token_id": 128001, "rope_parameters": None,
        "use_sliding_window": False, "sliding_window": None, "no_rope_layers": Derived(None, _smollm3_no_rope),
        "no_rope_layer_interval": 4, "layer_types": Derived(None, _smollm3_layer_types), "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True},
}
# GPT-2's and DistilBERT's standard names for their own fields (their config classes' attribute_map).
ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
             "num_hidden_layers": "n_layer"},
    "distilbert": {"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "olmoe": {"num_local_experts": "num_experts"},
}
# The generation options HF's config classes drop from config.json (older files kept them
# there; generation_config.json holds them now): transformers v5's GenerationConfig defaults.
GENERATION_OPTIONS = frozenset((
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size",
    "encoder_repetition_penalty", "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "max_length", "min_length",
    "no_repeat_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "suppress_tokens", "target_lookbehind", "temperature", "top_k", "top_p", "typical_p",
    "use_cache"))
_DEFAULT_THETA = 10_000.0
# each rope key's value where the file gives none (the model type's, else every model type's)
_ROPE_DEFAULTS: dict[Any, float] = {"rope_theta": _DEFAULT_THETA, "partial_rotary_factor": 1.0,
                                    ("gpt_neox", "partial_rotary_factor"): 0.25, ("phi", "partial_rotary_factor"): 0.5,
                                    ("smollm3", "rope_theta"): 2e6, ("mixtral", "rope_theta"): 1e6}
_SCALED_ROPES = ("llama3", "yarn", "longrope")  # the rope types that keep the pretraining length


class Config:
    """A ``config.json``'s values as attributes, Hugging Face's defaults filled in for the
    covered model types (module docstring); ``to_dict()`` gives them all back.

    Example:
      >>> from functree.hf._files import Config
      >>> c = Config.of({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
      >>> c.head_dim, c.num_key_value_heads, c.rope_parameters, c.vocab_size
      (16, 4, {'rope_theta': 10000.0, 'rope_type': 'default'}, 32000)
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Config:
        """The config of a ``config.json`` dict, as its model type's HF config class builds it."""
        model_type = given["model_type"]
        if model_type not in DEFAULTS:  # not covered: from_hf says so, naming the model type
            return cls(copy.deepcopy(dict(given)))
        aliases, fields = ALIASES.get(model_type, {}), DEFAULTS[model_type]
        kept = [(k, v) for k, v in given.items() if k in fields or k not in GENERATION_OPTIONS]
        # a standard name (hidden_size) over its model's own (n_embd) given beside it, in either
        # order: HF's config sets it last, through the class's attribute_map
        extra = {k: copy.deepcopy(v) for k, v in kept if k not in aliases}
        extra.update((aliases[k], copy.deepcopy(v)) for k, v in kept if k in aliases)
        defaults = {k: v.default if isinstance(v, Derived) else copy.deepcopy(v) for k, v in fields.items()}
        values = {**defaults, **extra}
        _check_types(model_type, values)
        _check_rope_scaling(model_type, values)
        _post_init(model_type, values, extra)
        _check_finite(model_type, "rope_parameters", values.get("rope_parameters"))  # older files' keys gathered
        _check_rope_types(model_type, values.get("rope_parameters"))
        _check_windows(model_type, values, extra)
        return cls(values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        key = ALIASES.get(values.get("model_type"), {}).get(name, name)
        if key not in values:
            model_type = values.get("model_type")
            family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
            if family is not None and model_type not in DEFAULTS:  # a family given no defaults row
                raise MissingField(NO_DEFAULTS.format(model_type=model_type, name=name, cls=family.__name__))
            raise AttributeError(f"the {model_type} config has no {name!r}")
        return values[key]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a config read from config.json is read-only")

    def __repr__(self) -> str:
        return f"Config({self._values!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._values == other._values

    def __hash__(self) -> int:
        return hash(json.dumps(self._values, sort_keys=True, default=str))

    def to_dict(self) -> dict[str, Any]:
        """Every value, as ``transformers``' ``config.to_dict()`` holds them (a copy)."""
        return copy.deepcopy(self._values)


_TYPES = ((bool, "a boolean", (bool,)), (int, "an integer", (int,)), (float, "a number", (int, float)),
          (str, "a string", (str,)), (dict, "an object", (dict,)), (list, "a list", (list,)))

# The type of each field whose default is None (or Derived from None), which its default
# cannot tell: HF's config classes type them (``int | None``, ``dict | None``) and refuse
# another type when the config is built (transformers' strict dataclass validation).
NULLABLE: dict[str, type] = {"num_key_value_heads": int, "head_dim": int, "n_inner": int, "sliding_window": int,
                             "word_embed_proj_dim": int, "rope_parameters": dict,
                             "layer_types": list, "clip_qkv": float, "classifier_dropout": float,
                             "use_bidirectional_attention": bool, "summary_activation": str,
                             "no_rope_layers": list, "mlp_only_layers": list}
# The layer types a covered family computes (HF's layer_type_validation takes more, for other
# families): one per hidden layer.
LAYER_TYPES = ("full_attention", "sliding_attention")


# The fields HF's config classes type ``X | None`` though their default is not None (every
# other field with a default refuses null: transformers' strict dataclass validation). A new
# family's row goes here too: tests/test_files_hostile.py compares each field with transformers.
NULL_ALLOWED: dict[str, frozenset[str]] = {"llama": frozenset({"pretraining_tp", "attention_dropout"}),
                                           "qwen2": frozenset({"sliding_window"}),
                                           "mistral": frozenset({"sliding_window"}),
                                           "ministral": frozenset({"sliding_window"}),
                                           "qwen3": frozenset({"sliding_window"}),
                                           "qwen3_moe": frozenset({"sliding_window"}),
                                           "qwen2_moe": frozenset({"sliding_window"}),
                                           "phi": frozenset({"attention_dropout"}),
                                           "gemma2": frozenset({"attention_dropout", "sliding_window",
                                                                "final_logit_softcapping", "attn_logit_softcapping"}),
                                           "gemma3_text": frozenset({"attention_dropout", "sliding_window",
                                                                     "use_bidirectional_attention"})}


def _check_types(model_type: str, values: Mapping[str, Any]) -> None:
    """Each field's value of its default's JSON type (:data:`NULLABLE`'s where the default is
    None), or null where HF's config class takes null (a None default, a Derived field,
    :data:`NULL_ALLOWED`), and finite (:data:`NOT_FINITE`); token ids integers (``eos_token_id``
    a list of them too) or null; sizes positive (:data:`SIZES`); ``layer_types`` one known type
    per layer."""
    for key, default in DEFAULTS[model_type].items():
        value, derived = values[key], isinstance(default, Derived)
        default = default.default if derived else default
        _check_finite(model_type, key, value)
        if key.endswith("_token_id") and not _token_id(key, value):  # HF's int | None (eos: | list[int])
            raise _bad_value(model_type, key, value, "an integer" + " or a list of integers" * (key == "eos_token_id"),
                             default)
        if value is None and default is not None and not derived and not key.endswith("_token_id") \
                and key not in NULL_ALLOWED.get(model_type, ()):
            expected = next(e for t, e, _ in _TYPES if isinstance(default, t))
            raise ValueError(NULL_VALUE.format(model_type=model_type, key=key, expected=expected,
                                               right=json.dumps(default)))
        if value is None or key.endswith("_token_id") or (default is None and key not in NULLABLE):
            continue
        typed = NULLABLE[key] if default is None else type(default)
        kind, expected, accepted = next((t, e, a) for t, e, a in _TYPES if issubclass(typed, t))
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            raise _bad_value(model_type, key, value, expected, default)
    _check_sizes(model_type, values)
    _check_layer_types(model_type, values)


def _an_integer(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id(key: str, value: Any) -> bool:
    """A token id as HF's config classes type it: an int or null; ``eos_token_id`` a list of ints too."""
    return value is None or _an_integer(value) or (key == "eos_token_id" and isinstance(value, list)
                                                   and all(_an_integer(v) for v in value))


# The sizes of the weights' shapes (and of the learned position tables): positive where given.
# ``head_dim`` 0 is no size: HF's attention derives it (``config.head_dim or hidden // heads``).
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "n_embd", "n_layer", "n_head", "n_inner", "ffn_dim", "word_embed_proj_dim",
         "n_positions", "max_position_embeddings", "type_vocab_size", "head_dim", "dim", "n_heads", "n_layers",
         "hidden_dim")


def _check_sizes(model_type: str, values: Mapping[str, Any]) -> None:
    """Each of :data:`SIZES` the config gives: an integer (``head_dim`` of any rotary family:
    HF's attention reads it where its config class has no such field) and positive
    (:data:`BAD_SIZE`): a negative one was a bare TypeError deep inside JAX, no heads a
    ZeroDivisionError."""
    for key in SIZES:
        value = values.get(key)
        head = key == "head_dim"  # read by the rotary families' HF attention, ignored by the others'
        if value is None or (head and ((value == 0 and _an_integer(value)) or "rope_parameters" not in DEFAULTS[model_type])):
            continue
        if not _an_integer(value):
            raise _bad_value(model_type, key, value, "an integer", None)
        if not 1 <= value < _LARGEST:
            raise _bad_size(model_type, key, value)
    head = values.get("head_dim")
    for key in ("num_attention_heads", "num_key_value_heads"):  # the projections' widths
        count = values.get(key)
        if _an_integer(count) and _an_integer(head) and count * head >= _LARGEST:
            raise _bad_size(model_type, "head_dim", head, f" (times {key} {count}: {count * head} features)")


def _buildable(config: Config) -> Config:
    """``config``, refused (:data:`HEADS_DO_NOT_DIVIDE`) where it is a family of :data:`EQUAL_HEADS`
    whose heads do not divide its hidden size: HF's config class takes it, its attention
    refuses it (was ft.nn.MultiheadAttention's error, naming neither key, its fix not the config's)."""
    values = config.to_dict()
    model_type = values.get("model_type")
    if model_type not in EQUAL_HEADS:
        return config
    names = ALIASES.get(model_type, {})
    hidden, heads = names.get("hidden_size", "hidden_size"), names.get("num_attention_heads", "num_attention_heads")
    size, count = values.get(hidden), values.get(heads)
    if _an_integer(size) and _an_integer(count) and count > 0 and size % count:
        right = next((k for k in range(min(count, size), 0, -1) if size % k == 0), 1) if count <= 4096 else 1
        raise ValueError(HEADS_DO_NOT_DIVIDE.format(model_type=model_type, hidden=hidden, heads=heads, size=size,
                                                    count=count, right=right))
    return config


_LARGEST = 2**60  # a size's bound: a weight's dimension is at most a few sizes' product (GPT-2's 4 * n_embd)


def _bad_size(model_type: str, key: str, value: int, times: str = "") -> ValueError:
    default = DEFAULTS[model_type].get(key)
    right = json.dumps(default) if _an_integer(default) else "null"
    return ValueError(BAD_SIZE.format(model_type=model_type, key=key, value=value, times=times, right=right,
                                      why="Hugging Face's default" if right != "null" else
                                      "derived from the other sizes, as Hugging Face derives it"))


# transformers writes a NaN or an infinity into config.json as {"__float__": "NaN"} and reads it back
_FLOAT_TAGS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _check_finite(model_type: str, key: str, value: Any) -> None:
    """Raise :data:`NOT_FINITE` where ``value`` (a field the builders read: a number, or numbers
    nested in lists and objects, as ``rope_parameters``) holds a NaN or an infinity, as a JSON
    literal (``NaN``, ``Infinity``) or as transformers' tag ``{"__float__": "NaN"}``."""
    stack: list[tuple[str, Any]] = [(key, value)]
    while stack:
        where, item = stack.pop()
        tagged = isinstance(item, dict) and set(item) == {"__float__"} and isinstance(item["__float__"], str) \
            and item["__float__"] in _FLOAT_TAGS  # (a list there was a bare "unhashable type")
        number = _FLOAT_TAGS[item["__float__"]] if tagged else item
        if isinstance(number, float) and not math.isfinite(number):
            literal = json.dumps(item) if tagged else json.dumps(number)
            raise ValueError(NOT_FINITE.format(model_type=model_type, key=where, value=number, literal=literal,
                                               wrong=f'"{key}": {json.dumps(value)}' if len(json.dumps(value)) < 80
                                               else f'"{key}": ... {literal} ...'))
        if isinstance(item, dict) and not tagged:
            stack.extend((f"{where}[{k!r}]", v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))


# The JSON type of each rope_parameters key the rotary embedding reads (functree.hf._options.rope):
# numbers (an int or a float, not a boolean), the pretraining length (an int, or a float with an
# integer's value), longrope's factor lists, YaRN's truncate switch, the type's name.
ROPE_TYPES_OF = {**dict.fromkeys(("rope_theta", "factor", "partial_rotary_factor", "low_freq_factor",
                                  "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                                  "mscale_all_dim"), "a number"),
                 "original_max_position_embeddings": "an integer", "short_factor": "a list of numbers",
                 "long_factor": "a list of numbers", "truncate": "a boolean", "rope_type": "a string",
                 "type": "a string"}


def _check_rope_scaling(model_type: str, values: Mapping[str, Any]) -> None:
    """An older file's ``rope_scaling``: an object or null, as ``rope_parameters`` (a list was a
    bare TypeError, a string a bare ValueError, gathering it into the rope parameters)."""
    value = values.get("rope_scaling")
    if value is not None and not isinstance(value, dict):
        raise _bad_value(model_type, "rope_scaling", value, "an object", None)


def _rope_typed(value: Any, expected: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "a number":
        return number
    if expected == "an integer":  # 4096.0 reads as 4096; 4096.5 would be cut to it
        return number and (isinstance(value, int) or float(value).is_integer())
    if expected == "a list of numbers":
        return isinstance(value, list) and all(_rope_typed(v, "a number") for v in value)
    return isinstance(value, bool if expected == "a boolean" else str)


def _check_rope_types(model_type: str, params: Any) -> None:
    """Each key of ``rope_parameters`` (standardized: a file's older keys gathered) the rotary
    embedding reads of its JSON type (:data:`ROPE_TYPES_OF`), null left to the rope's own checks:
    ``"rope_theta": []`` was a bare TypeError, ``"factor": true`` a factor of 1; a
    ``rope_theta`` of 0 or below, or too small for float32's frequencies (:data:`ROPE_THETA`),
    NaNs from every layer. Gemma 3's
    dicts per layer type are each checked."""
    if not isinstance(params, Mapping):
        return
    nested = [(f"[{k!r}]", v) for k, v in params.items() if k in LAYER_TYPES and isinstance(v, Mapping)]
    for where, entry in nested or [("", params)]:
        for key, expected in ROPE_TYPES_OF.items():
            value = entry.get(key)
            if key == "rope_theta" and value is not None and _rope_typed(value, expected) and not value >= SMALLEST_BASE:
                # 0 ** (-2i / d) is infinite, a negative base's power NaN, 1e-300's past float32:
                # NaNs from every layer
                raise ValueError(ROPE_THETA.format(
                    model_type=model_type, key=f"rope_parameters{where}[{key!r}]", value=value,
                    smallest=SMALLEST_BASE,
                    where=", GPT-NeoX's rotary_emb_base / rotary_pct" if model_type == "gpt_neox" else "",
                    given=json.dumps(value)))
            if value is None or _rope_typed(value, expected):
                continue
            meant = _meant(value, expected)
            right, why = (meant, "the value meant, typed") if meant is not None else \
                (_ROPE_EXAMPLES.get(key, 1.0), "the checkpoint's own value, e.g.")
            raise ValueError(ROPE_VALUE.format(
                model_type=model_type, key=f"rope_parameters{where}[{key!r}]", value=value, kind=type(value).__name__,
                where=", GPT-NeoX's rotary_emb_base / rotary_pct" if model_type == "gpt_neox" else "",
                expected=expected, name=key, given=json.dumps(value, default=str), right=json.dumps(right), why=why))


_ROPE_EXAMPLES = {"rope_theta": 10000.0, "original_max_position_embeddings": 4096, "short_factor": [1.0, 1.0],
                  "long_factor": [1.0, 1.0], "truncate": True, "rope_type": "default", "type": "default"}


def _check_windows(model_type: str, values: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """The layer types agree with the sliding window the model reads: a "sliding_attention"
    layer needs a window (:data:`SLIDING_WITHOUT_WINDOW`: Qwen2's ``use_sliding_window`` false
    makes it null). A mistral config's layer types are HF's Ministral's, each layer its type's
    mask (``MistralForCausalLM.hf_options``); any value of the key switches HF to Ministral."""
    types, size = values.get("layer_types"), values.get("sliding_window")
    if not isinstance(types, list):
        if model_type == "mistral" and types is not None:  # HF's AutoConfig switches on the key alone
            raise _bad_value(model_type, "layer_types", types, "a list of layer types", None)
        return
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and size is None:
        off = "use_sliding_window" in values and not values["use_sliding_window"] and given.get("sliding_window")
        raise sliding_without_window(model_type, sliding[0], given["sliding_window"] if off else None)


def _check_layer_types(model_type: str, values: Mapping[str, Any]) -> None:
    """``layer_types``, where given: one of :data:`LAYER_TYPES` for each of the
    ``num_hidden_layers`` layers (HF refuses another length: the layers would read other
    layers' types)."""
    given, layers = values.get("layer_types"), values.get("num_hidden_layers")
    ministral = model_type == "mistral"  # a mistral config's layer_types: HF's Ministral's (MinistralConfig's field)
    if given is None or ("layer_types" not in DEFAULTS[model_type] and not ministral) or not isinstance(layers, int):
        return
    if not isinstance(given, list) or len(given) != layers or not all(isinstance(t, str) and t in LAYER_TYPES
                                                                      for t in given):  # (a mistral's 0: len() failed)
        raise _bad_value(model_type, "layer_types", given, f"a list of num_hidden_layers ({layers}) layer types, "
                         f"each {' or '.join(map(repr, LAYER_TYPES))},", None)


def _bad_value(model_type: str, key: str, value: Any, expected: str, default: Any) -> ValueError:
    meant = _meant(value, expected)
    right, why = (meant, "the value meant, typed") if meant is not None else (default, "Hugging Face's default")
    return ValueError(BAD_CONFIG_VALUE.format(model_type=model_type, key=key, value=value, kind=type(value).__name__,
                                              expected=expected, given=json.dumps(value, default=str), right=json.dumps(right),
                                              why=why))


def _meant(value: Any, expected: str) -> Any:
    """The value of the expected type a wrongly typed one spells (``"2"``, ``2.0`` for an
    integer; ``"1e-6"`` for a number; ``"false"`` for a boolean), else None."""
    text = value.strip().lower() if isinstance(value, str) else None
    if expected == "an integer":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return int(text) if text is not None and text.lstrip("-").isdigit() else None
    if expected == "a number" and text is not None:
        try:
            return float(text)
        except ValueError:
            return None
    if expected == "a boolean" and text in ("true", "false"):
        return text == "true"
    return None


def _post_init(model_type: str, values: dict[str, Any], given: dict[str, Any]) -> None:
    """What the model type's HF config class does after setting its fields: derived sizes,
    then the rotary parameters (``given``: config.json's keys, some consumed as HF's are)."""
    hidden = values.get("hidden_size")
    for key, default in DEFAULTS[model_type].items():  # the row's Derived fields
        if isinstance(default, Derived) and values.get(key) is None:
            values[key] = default.rule(values)
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):  # (their configs null the window unless use_sliding_window)
        values["sliding_window"] = values["sliding_window"] if values["use_sliding_window"] else \
            (0 if model_type == "qwen2_moe" else None)  # (Qwen2MoeConfig's 0: no window read, window()'s enabled)
        if model_type == "qwen2" and values.get("layer_types") is None:
            values["layer_types"] = [
                "sliding_attention" if values["sliding_window"] is not None and i >= values["max_window_layers"]
                else "full_attention" for i in range(int(values["num_hidden_layers"]))]
    if model_type == "gemma" and values.get("hidden_act") == "gelu":  # a legacy name of the tanh approximation
        values["hidden_act"] = "gelu_pytorch_tanh"
    if model_type == "opt" and values.get("word_embed_proj_dim") is None:
        values["word_embed_proj_dim"] = hidden
    if "rope_parameters" in values:
        _rope_parameters(model_type, values, given)


def _rope_parameters(model_type: str, values: dict[str, Any], given: dict[str, Any]) -> None:
    """``rope_parameters`` as HF's config classes standardize them: ``rope_scaling`` (older
    files) first, then ``rope_parameters``; ``rope_theta`` and ``partial_rotary_factor`` from
    the file's top level (GPT-NeoX: ``rotary_emb_base``, ``rotary_pct``; Phi-3, Phi and GPT-NeoX
    default the factor); ``rope_type`` from ``type``; the pretraining length kept for scaled
    types: a top-level ``original_max_position_embeddings`` over the rope dict's own, then
    ``max_position_embeddings`` (as HF's model: its rope init standardizes the config again,
    the file's top-level key then an attribute, which wins; HF's config object alone keeps the
    rope dict's). The keys HF consumes are not attributes afterwards."""
    if model_type == "gemma3_text":
        values["rope_parameters"] = _gemma3_rope_parameters(values)
        return
    params = dict(values.pop("rope_scaling", None) or values.get("rope_parameters") or {})
    if model_type == "gpt_neox":
        params.setdefault("rope_theta", values.pop("rotary_emb_base", _DEFAULT_THETA))
        params.setdefault("partial_rotary_factor", values.pop("rotary_pct", 0.25))
    elif model_type == "phi3":
        params.setdefault("rope_theta", values.pop("rope_theta", _DEFAULT_THETA))
        params.setdefault("partial_rotary_factor", given.get("partial_rotary_factor", 1.0))
    elif model_type == "phi":  # PhiConfig's default factor, 0.5; the top-level key consumed (no attribute after)
        params.setdefault("rope_theta", values.pop("rope_theta", _DEFAULT_THETA))
        params.setdefault("partial_rotary_factor", values.pop("partial_rotary_factor",
                                                             _ROPE_DEFAULTS["phi", "partial_rotary_factor"]))
    else:  # the config class's default_theta (SmolLM3's 2e6)
        params.setdefault("rope_theta", values.pop("rope_theta", _ROPE_DEFAULTS.get((model_type, "rope_theta"),
                                                                                   _DEFAULT_THETA)))
        if "partial_rotary_factor" in given:  # a null one is no factor, as HF's standardize_rope_params reads it
            factor = values.pop("partial_rotary_factor")
            if factor is not None:
                params.setdefault("partial_rotary_factor", factor)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _SCALED_ROPES:
        # a top-level value wins over the rope dict's own: Phi-3's field, and any config.json
        # that gives one (HF's standardize_rope_params reads the attribute wherever it is set)
        if values.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = values["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    if model_type == "phi3" and params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"
    if model_type == "phi3" and params["rope_type"] not in ("default", "longrope"):
        raise ValueError(PHI3_ROPE_TYPE.format(kind=params["rope_type"], kind_json=json.dumps(params["rope_type"])))
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in params and params[key] is None:
            raise ValueError(NULL_ROPE.format(model_type=model_type, key=key, right=_ROPE_DEFAULTS[model_type, key]
                                              if (model_type, key) in _ROPE_DEFAULTS else _ROPE_DEFAULTS[key]))
    values["rope_parameters"] = params


# Gemma3TextConfig's rope per layer type where the file gives none, and the older files' key of each.
_GEMMA3_THETA = {"full_attention": ("rope_theta", 1_000_000.0), "sliding_attention": ("rope_local_base_freq", 10_000.0)}


def _gemma3_rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's ``rope_parameters``, one dict per layer type, as ``Gemma3TextConfig`` builds
    them: the file's (or ``{"rope_type": "default"}`` each), an older file's ``rope_scaling``
    merged into the full layers' (Gemma 3 4B's linear factor 8), ``rope_theta`` (1e6) the
    full layers' base and ``rope_local_base_freq`` (1e4) the sliding layers', where the dict
    gives none (both keys consumed); then standardized as HF's ``standardize_rope_params``
    does for the types ``layer_types`` use (``rope_type`` from an older ``type``, a top-level
    ``partial_rotary_factor``, the pretraining length of the scaled types)."""
    given = values.get("rope_parameters")
    params: dict[str, Any] = copy.deepcopy(dict(given)) if isinstance(given, Mapping) else {
        "sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
    scaling = values.pop("rope_scaling", None)
    if isinstance(scaling, Mapping):
        params.setdefault("full_attention", {"rope_type": "default"})
        params["full_attention"] = {**(params["full_attention"] or {"rope_type": "default"}), **scaling}
    thetas = {kind: values.pop(key, default) for kind, (key, default) in _GEMMA3_THETA.items()}
    for kind, theta in thetas.items():
        if not isinstance(params.get(kind), Mapping):
            params[kind] = {"rope_type": "default"}
        params[kind].setdefault("rope_theta", theta)
    partial = values.get("partial_rotary_factor")
    for kind in (k for k in params if k in (values.get("layer_types") or ())):
        entry = params[kind]
        entry.setdefault("rope_type", entry.get("type", "default"))
        if partial is not None:
            entry.setdefault("partial_rotary_factor", partial)
        if entry["rope_type"] in _SCALED_ROPES:
            entry.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
        if entry.get("rope_theta") is None:
            raise ValueError(NULL_ROPE.format(model_type="gemma3_text", key=f"rope_parameters[{kind!r}]['rope_theta']",
                                              right=json.dumps(_GEMMA3_THETA[kind][1]) if kind in _GEMMA3_THETA
                                              else _DEFAULT_THETA))
    return params
