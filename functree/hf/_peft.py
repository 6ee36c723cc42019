"""PEFT's LoRA adapter files: :func:`save_lora` writes them, :func:`load_lora` reads them.

A PEFT adapter directory is ``adapter_config.json`` (``LoraConfig``'s fields) and
``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]`` per adapted torch module, and the full tensors
``base_model.model.<module>.<param>`` of the modules in ``modules_to_save``. The layer
computes ``y = base(x) + (alpha / r) x Aᵀ Bᵀ`` (``use_rslora``: ``alpha / sqrt(r)``), ``r``
and ``alpha`` from ``rank_pattern`` / ``alpha_pattern`` (regexes matched against the end of
the module's name) or ``r`` / ``lora_alpha``; a Stack's members keep their own
(:mod:`functree.hf._peft_members`).

The config decides what an adapter is, as in PEFT: the modules ``target_modules`` selects
(with ``layers_to_transform``, ``layers_pattern``, ``exclude_modules``; ``modules_to_save``
are never targets) get adapters; a file's tensors must be exactly theirs, of the config's
ranks, in a float dtype (PEFT ignores extra tensors and casts integer ones: errors here).

Fused projections (GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``, Phi-3's ``qkv_proj``)
are one torch module but several ft ``Dense`` layers: PEFT's ``lora_A`` is shared and
``lora_B``'s rows are the members' outputs, laid out as the converter lays the weight out
(``_names.torch_names`` finds where each output goes). Loaded, each member gets ``A`` and
its rows of ``B``; saved, members with equal ``A`` write it once, members with their own
``A`` (trained apart) write the exact block form: ``A`` stacked ``[Σr, in]`` and ``B``
block-diagonal, rank ``Σr`` in ``rank_pattern``, each member's columns recorded in the
metadata (:data:`BLOCKS`); loaded back, each member gets its own columns of ``A`` and ``B``
again (its rank ``r_i``, not ``Σr``), so training resumed from the file is the training saved.

Saving is atomic per file (temporary files renamed into place), and a crash between the
two renames cannot pass unnoticed: the weights file records, in its safetensors metadata
(which PEFT ignores), the config fields that decide the numbers, and ``load_lora`` refuses a
config that differs from that record.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._files import local_path, read_path
from functree._random import one_key
from functree._tree import dotted_name, join_names
from functree._where import placed_like
from functree.hf._causal import CausalLM
from functree.hf._family import family_of
from functree.hf._heads import tied_copies
from functree.hf._load import tied_head, to_hf_state_dict
from functree.hf._names import (
    TASK_TYPES,
    TorchNames,
    classifier_of,
    router_modules,
    saved_under,
    torch_names,
    unwrapped,
)
from functree.hf._peft_blocks import BLOCKS, member_columns, read_blocks
from functree.hf._peft_members import (
    chosen_adapter,
    loaded_layer,
    member_adapters,
    member_arrays,
    written_alpha,
)
from functree.hf._peft_params import (
    EXPERTS_DROPOUT_SAVED,
    check_params,
    expert_tensors,
    loaded_experts,
)
from functree.interop._safetensors import load_file, read_header, save_file
from functree.interop._torch import torch_state_dict
from functree.nn._lora import (
    ALL_LINEAR,
    DenseLayer,
    LoraDense,
    dense_layers,
    is_dense,
    member_layer_names,
)
from functree.nn._lora_experts import LoraParameter, expert_weights, is_experts

__all__ = ["save_lora", "load_lora"]

NO_ADAPTERS = """\
{what}: the model holds no LoraDense layer (no adapters to {verb}).
    right:  model = ft.nn.lora(model, "model.layers.*.self_attn.[qv]_proj", rank=8, alpha=16, key=key)"""

NO_NAME = """\
ft.nn.save_lora: the adapted layer {layer!r} has no {torch} weight name (its weight is not \
written as a Linear's "<module>.weight"), so PEFT has no module to put its adapter on."""

MHA_OUTPUT = """\
ft.nn.{what}: {subject} {module!r}, the output projection of a MultiheadAttention held as \
torch's nn.MultiheadAttention ({layer!r}: in_proj_weight and out_proj). torch's \
MultiheadAttention.forward reads out_proj.weight directly and never calls out_proj, so PEFT's \
PeftModel ignores an adapter there without a word (its merge_and_unload folds it in: two \
models from one file); PEFT's own docs say not to target it. {consequence}
    wrong:  {wrong}
    right:  {right}"""


NOT_PEFT = """\
ft.nn.load_lora: {directory!r} is not a PEFT LoRA adapter directory: {problem}.
    right:  ft.nn.load_lora(model, "path/to/adapter")   # adapter_config.json (peft_type "LORA") and
                                                        # adapter_model.safetensors, as PeftModel.save_pretrained writes"""

UNSUPPORTED_PEFT = """\
ft.nn.load_lora: the adapter sets {option}={value!r}; ft.nn.load_lora reads plain LoRA \
({covered}). Loading it anyway would give a different model.{right}"""

# The fix for adapters PEFT merges exactly (DoRA, biases, trainable tokens, an embedding's
# adapter, modules_to_save of other layers): fold the adapter in, then port the merged model
# (measured: the PeftModel's logits to 2e-6).
MERGED_ROUTE = """
    right:  merged = peft.PeftModel.from_pretrained(hf_model, directory).merge_and_unload()
            model = ft.nn.from_hf(merged)   # the adapter folded into the weights: PEFT's logits"""
# The options of COVERED whose other values PEFT's merge_and_unload folds in exactly.
MERGEABLE = ("use_dora", "lora_bias", "bias", "trainable_token_indices")

PICKLED_WEIGHTS = """\
ft.nn.load_lora: {directory!r} holds its weights as adapter_model.bin, a pickle \
(PeftModel.save_pretrained(..., safe_serialization=False)); unpickling a file can run code, \
so ft.nn.load_lora reads adapter_model.safetensors only. Write that file from it (in torch, \
where you trust the file):

    wrong:  ft.nn.load_lora(model, {directory!r})   # adapter_model.bin beside adapter_config.json
    right:  peft.PeftModel.from_pretrained(hf_model, {directory!r}).save_pretrained(new_directory)
       or:  safetensors.torch.save_file(torch.load(bin_path, weights_only=True), safetensors_path)"""

UNPREFIXED = """\
ft.nn.load_lora: {name!r} in {directory!r} names its module without the prefix \
"base_model.model." that every tensor PeftModel.save_pretrained writes has. PEFT finds no \
adapter in such a file (it warns of missing keys and leaves the modules at their \
initialization); another tool wrote it. Add the prefix:

    right:  tensors = safetensors.numpy.load_file(path)
            safetensors.numpy.save_file({{"base_model.model." + k: v for k, v in tensors.items()}}, path)"""

BAD_CONFIG = """\
ft.nn.load_lora: adapter_config.json in {directory!r} sets {option}={value!r}: {why}. PEFT \
refuses it too (or computes nothing sensible with it).
    right:  {right}"""

BAD_CONFIG_TYPE = """\
ft.nn.load_lora: adapter_config.json in {directory!r} sets {option}={value!r} (a {kind}); PEFT's \
LoraConfig takes {accepted} there. The file was written by hand or altered; read as it is, \
the adapter would fail deep inside the loader or select other layers.

    wrong:  "{option}": {given}
    right:  "{option}": {right}"""

BAD_PATTERN = """\
ft.nn.load_lora: adapter_config.json in {directory!r} sets {option}={value!r}, and {pattern!r} \
is not a regular expression ({error}). PEFT matches module names against it (as {form}) and \
fails there too (re.error); the file was written by hand or altered.

    wrong:  "{option}": {given}
    right:  "{option}": {right}        # module names, or a regular expression that compiles"""

NESTED_JSON = "nested deeper than Python's JSON reader follows"


def _strs(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _ints(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, list) and all(_is_int(x) for x in value))


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


def _str(value: Any) -> bool:
    return isinstance(value, str)


# The JSON type of each adapter_config.json field load_lora reads besides r, lora_alpha and
# lora_dropout (checked as numbers in _check_config): (test, what PEFT takes, a right value).
FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "target_modules": (_strs, "a regular expression (str) or a list of module names (list of str)",
                       '["q_proj", "v_proj"]'),
    "exclude_modules": (_strs, "a regular expression (str) or a list of module names (list of str)", '["lm_head"]'),
    "layers_to_transform": (_ints, "a layer number (int) or a list of them (list of int)", "[0, 1]"),
    "layers_pattern": (_strs, "a module name (str) or a list of them (list of str)", '"layers"'),
    # A bare string is not a one-item list there: PEFT's matching iterates over it, so
    # "lm_head" saves every module whose name ends in l, m, _, h, e, a or d (the whole model).
    "modules_to_save": (_str_list, "a list of module names (list of str; PEFT reads a bare string one "
                        "character at a time, saving every module whose name ends in one of them)", '["lm_head"]'),
    "rank_pattern": (_object, "an object {module regex: rank (int)}", '{"q_proj": 16}'),
    "alpha_pattern": (_object, "an object {module regex: alpha (number)}", '{"q_proj": 32}'),
    "use_rslora": (_bool, "true or false", "false"),
    "fan_in_fan_out": (_bool, "true or false", "false"),
    "use_dora": (_bool, "true or false", "false"),
    "lora_bias": (_bool, "true or false", "false"),
    "bias": (_str, '"none", "all" or "lora_only" (str)', '"none"'),
    "target_parameters": (_str_list, "a list of parameter names (list of str)", '["experts.gate_up_proj"]'),
}


# How PEFT reads each option's strings as regular expressions (the module name matched
# against the pattern each string makes): the check below and the matching use the same forms.
REGEX_FORMS: dict[str, str] = {
    "target_modules": "{}",  # a str (a list names modules, matched by their ends)
    "exclude_modules": "{}",
    "rank_pattern": r"(.*\.)?({})$",  # each key
    "alpha_pattern": r"(.*\.)?({})$",
    "layers_pattern": r"(?:^|.*?\.){}\.(?P<idx>\d+)\.",  # a str or each of a list
    "modules_to_save": r"(^|.*\.){}($|\..*)",  # each of the list
}


def _regex(option: str, text: str) -> str:
    """The regular expression PEFT makes of ``text``, one of ``option``'s strings."""
    return REGEX_FORMS[option].replace("{}", text)


def _check_patterns(config: dict[str, Any], directory: str) -> None:
    """Each string read as a regular expression compiles (:data:`BAD_PATTERN`): an unbalanced
    ``"q_proj(["`` was a bare ``re.error`` from deep inside the matching."""
    for option in REGEX_FORMS:
        value = config.get(option)
        if option in ("target_modules", "exclude_modules"):
            texts = [value] if isinstance(value, str) else []
        else:
            texts = [value] if isinstance(value, str) else list(value or ())  # a dict: its keys
        for text in texts:
            try:
                re.compile(_regex(option, text))
            except re.error as e:
                raise ValueError(BAD_PATTERN.format(directory=directory, option=option, value=value, pattern=text,
                                                    error=e, form=repr(_regex(option, "...")),
                                                    given=json.dumps(value), right=FIELD_TYPES[option][2])) from None


def _check_types(config: dict[str, Any], directory: str) -> None:
    """Each field of :data:`FIELD_TYPES` null or of the JSON type PEFT's LoraConfig takes
    (:data:`BAD_CONFIG_TYPE`): ``target_modules=5`` was a TypeError deep in the matching,
    ``use_rslora="false"`` a truthy string (alpha / sqrt(r): another scale)."""
    for option, (ok, accepted, right) in FIELD_TYPES.items():
        value = config.get(option)
        if value is not None and not ok(value):
            raise ValueError(BAD_CONFIG_TYPE.format(directory=directory, option=option, value=value,
                                                    kind=type(value).__name__, accepted=accepted,
                                                    given=json.dumps(value, default=str), right=right))


UNKNOWN_MODULE = """\
ft.nn.load_lora: the adapter holds tensors for {modules}, which name no Dense layer of \
this model (its {torch} names: {known} ...). Load it into the model it was trained on."""

NOT_TARGETED = """\
ft.nn.load_lora: the adapter file holds tensors for {modules}, which adapter_config.json's \
target_modules={targets!r} does not select (PEFT would silently ignore them, and load \
another model than the one trained). The file and the config disagree: save the adapter \
again, or correct target_modules.
    right:  "target_modules": {right!r}"""

NOTHING_TARGETED = """\
ft.nn.load_lora: adapter_config.json's target_modules={targets!r} selects no module of this \
model (PEFT refuses it: "Target modules ... not found in the base model"). Its {torch} \
modules are named like {known} ...
    wrong:  ft.nn.load_lora(other_model, directory)
    right:  ft.nn.load_lora(ft.nn.from_hf(base_model_it_was_trained_on), directory)"""

NO_TARGETS = """\
ft.nn.load_lora: adapter_config.json has no target_modules (null or absent). PEFT then adapts \
its default modules for the model type (peft.utils.constants.\
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: Llama's q_proj and v_proj), a table of \
PEFT's version that functree does not keep. The file's tensors adapt {modules}: name them.
    wrong:  "target_modules": null
    right:  "target_modules": {right}"""

NOT_IN_FILE = """\
ft.nn.load_lora: adapter_config.json's target_modules selects {modules}, but \
adapter_model.safetensors holds no lora_A / lora_B for {them} (PEFT would leave them at \
their initialization: random or zero, silently). The file is incomplete or from another \
save.
    right:  peft_model.save_pretrained(directory)   # or ft.nn.save_lora(model, directory): both files again"""

NOT_DENSE_TARGET = """\
ft.nn.load_lora: adapter_config.json's {option} selects {modules}, which {are} not a Dense \
layer of this model (ft.nn.load_lora puts adapters on Dense layers; an embedding, a norm or \
a whole block is another kind of adapter). Loading the rest would be a different model.
    right:  "target_modules": ["q_proj", "v_proj"]   # train on Linear (and Conv1D) modules only{merged}"""

# NOT_DENSE_TARGET's second fix, where PEFT's merge is exact: not for an adapter on a tied
# embedding (merged into the weight the head shares, it moves the logits too: 60x off, measured).
MERGED_TARGET = """
       or:  model = ft.nn.from_hf(peft.PeftModel.from_pretrained(hf_model, directory).merge_and_unload())"""

TIED_HEAD_TARGET = """\
ft.nn.load_lora: adapter_config.json's {option} selects {modules}: the tied output head of \
a Hugging Face port here ({are} the embedding's transpose, logits = x @ embedding^T, not a \
Dense layer), which PEFT adapts as a Linear on the torch model ("all-linear" leaves out only \
the head of a PreTrainedModel at the root, not one held inside a model of your own). \
ft.nn.lora cannot put an adapter on a tied head, and loading the rest would be a different \
model. Train the adapter without the tied heads, or build the port with an untied head (a \
Dense layer holding a copy of the embedding, which the adapter loads onto: the same logits):

    wrong:  peft.LoraConfig(target_modules="all-linear")
    right:  peft.LoraConfig(target_modules="all-linear", exclude_modules={heads!r})
       or:  ft.nn.from_hf({{**config, "tie_word_embeddings": False}}, key=key)   # then
            ft.nn.load_torch_state_dict(model, torch_model.state_dict()); ft.nn.load_lora(model, directory)"""

ADAPTER_SHAPE = """\
ft.nn.load_lora: {name!r} has shape {given}; the layer {layer!r} ({inputs} inputs, {outputs} \
outputs) takes lora_A [r, {inputs}] and lora_B [{outputs}, r] with r = {rank} ({source}): PEFT \
refuses it too (a size mismatch). The config and the file are from different saves, or the \
model is not the one the adapter was trained on.
    right:  ft.nn.load_lora(ft.nn.from_hf(base_model_it_was_trained_on), directory)   # with the config saved beside the file"""

ADAPTER_DTYPE = """\
ft.nn.load_lora: {name!r} holds {dtype} numbers; an adapter's tensors are floating point \
(PEFT casts lora_B to lora_A's dtype: an integer lora_A truncates the update to 0). The \
file is damaged or was not written as an adapter.
    right:  peft_model.save_pretrained(directory)   # or ft.nn.save_lora(model, directory)"""

STALE_CONFIG = """\
ft.nn.load_lora: adapter_config.json in {directory!r} is not the config its \
adapter_model.safetensors was saved with: {option} is {given!r} in the config, but the \
weights were written for {recorded!r}. A save_lora was interrupted between its two files, \
or the config was edited after; loading them together would give a different model.
    right:  ft.nn.save_lora(model, {directory!r})   # save the adapter again"""

MUTATED_BASE = """\
ft.nn.load_lora: the adapter sets init_lora_weights={value!r}: with it PEFT changes the base \
model's own weights when it loads the adapter ({how}), so its lora_A / lora_B are not an \
update of the base model given here, and loading them onto it would give a different model. \
{right}"""

CONVERT_MUTATED = """Save it as plain LoRA (PEFT converts it; the base stays as it is):
    wrong:  peft_model.save_pretrained(directory)
    right:  peft_model.save_pretrained(directory, path_initial_model_for_weight_conversion=initial_adapter_dir)"""

BASE_LAYER = """\
ft.nn.load_lora: {name!r} is the base weight of {module!r} that PEFT saved beside its adapter \
(save_embedding_layers), and it differs from this model's (shape {given} against {expected}{values}). \
PEFT would load it over the model's own; the adapter was trained on another base (a resized \
vocabulary, or trained embeddings).
    right:  ft.nn.load_lora(ft.nn.from_hf(base_model_it_was_trained_on), directory)"""

BASE_TENSOR = """\
ft.nn.load_lora: {name!r} is a weight of the base model that PEFT saved whole beside the \
adapter (save_pretrained(..., save_embedding_layers=True), or "auto" after the vocabulary was \
resized), and it differs from this model's ({how}). PEFT loads it over the model's own: the \
adapter belongs to that base (its new tokens' rows), and loading it onto this one would give \
a different model.
    right:  {resize}model = ft.nn.from_hf(peft.PeftModel.from_pretrained(hf_model, directory).merge_and_unload())"""

SAVED_MODULE = """\
ft.nn.{what}: modules_to_save names {module!r}, {problem}. A module to save is a Dense \
layer of its own, written (and read) whole, as PEFT's modules_to_save does.
    right:  {right}"""

SAVED_SHAPE = """\
ft.nn.load_lora: modules_to_save's {module!r} is saved as {got} (torch layout), but this \
model's {module!r} takes {expected}: the adapter was trained on another base model{why}. \
PEFT refuses it too (a size mismatch).
    right:  ft.nn.load_lora(ft.nn.from_hf(base_model_it_was_trained_on), directory){resize}"""

# SAVED_SHAPE's second fix where only the output size differs: the vocabulary the training resized.
SAVED_VOCAB = """
       or:  hf_model.resize_token_embeddings({given})   # as the training did, then
            ft.nn.load_lora(ft.nn.from_hf(hf_model), directory)"""

HEAD_ADAPTED = """\
ft.nn.save_lora: the classifier {head!r} of this {hf_class} holds LoRA adapters, and the \
adapter is saved with task_type={task_type!r}, under which PEFT keeps the classifier whole \
(modules_to_save) and never adapts it: PEFT's from_pretrained fails on such a file \
(KeyError 'base_model.model.{weight}.weight'). Fold the head's adapters into its weight (PEFT \
then loads the head whole, the same logits), or adapt the layers without the head:

    wrong:  ft.hf.save_lora(model, directory)                # {head}: a LoraDense
    right:  ft.hf.save_lora(model.replace({field}=ft.nn.merge_lora(model.{field})), directory)
       or:  model = ft.nn.lora(base, "all-linear", ...)       # all but {head}; train it whole: wrt=["*.lora_*", "{field}.*"]
       or:  ft.hf.save_lora(model, directory, task_type=None)   # PEFT's plain LoRA on {head}; its own
                                                                 # weight is not written: the base model's"""

SAVED_MODULE_NOT_HERE = """\
ft.nn.load_lora: the adapter in {directory!r} holds {module!r} whole (its modules_to_save \
{saved!r}, task_type={task_type!r}), which this {cls} has not: the adapter was trained on \
{trained}, its head saved with it. PEFT's from_pretrained leaves that tensor unread without a \
word (PEFT 0.21: the adapters on this model, the trained head dropped), which is not the model trained.

    wrong:  ft.nn.load_lora(ft.nn.from_hf(base_directory), {directory!r})
    right:  ft.nn.load_lora(ft.hf.with_head(ft.nn.from_hf(base_directory), {suffix!r}, num_labels=N, key=key),
                            {directory!r})     # the head's weights are the adapter's"""

HEAD_NOT_SAVED = """\
ft.nn.load_lora: the adapter in {directory!r} has task_type={task_type!r}, under which PEFT \
keeps the classifier {head!r} of a {hf_class} whole in modules_to_save, but the file holds no \
{head!r} (its modules_to_save does not name it): PEFT's from_pretrained fails on it \
(KeyError 'base_model.model.{head}.weight'), and the head it was trained with is not in the \
file (ft.hf.save_lora before 2026-12-02 left it out). Loading it would pair the adapters with \
another head. Save it again from the trained model (the head goes in modules_to_save), or, \
where the head was not trained, say so in the config:

    right:  ft.hf.save_lora(trained_model, {directory!r})
       or:  "task_type": null     # in adapter_config.json: the adapters alone, on the model's own head"""

# SAVED_MODULE's fix for a port's tied head: the port built untied (its head a Dense holding a
# copy of the embedding: the same logits), which the saved head's full weight then replaces.
UNTIED_HEAD = """model = ft.nn.from_hf({{**config, "tie_word_embeddings": False}}, hf_model.state_dict())   # an untied \
Dense head (a copy of the embedding), then
            {then}"""

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PICKLED = "adapter_model.bin"  # PEFT's pickled weights (safe_serialization=False): never unpickled here
# The config's fields that decide the adapted model's numbers: recorded in the weights file's
# metadata (under RECORD) by save_lora and checked against the config by load_lora.
RECORD = "functree.adapter_config"
RECORDED = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "target_modules", "exclude_modules",
            "layers_to_transform", "layers_pattern", "modules_to_save", "fan_in_fan_out", "bias", "use_dora",
            "lora_bias", "target_parameters")
# Options whose other values are other kinds of adapter, and the values read here.
# (PEFT's LoRA variants: the LoraConfig fields marked is_lora_variant; init_lora_weights below.)
COVERED = (("use_dora", False), ("lora_bias", False), ("bias", "none"), ("layer_replication", None),
           ("trainable_token_indices", None), ("alora_invocation_tokens", None),
           ("use_bdlora", None), ("use_qalora", False), ("velora_config", None), ("monteclora_config", None),
           ("arrow_config", None), ("kasa_config", None))
# init_lora_weights: the values that only draw lora_A / lora_B (the file's tensors replace them),
# and those with which PEFT also rewrites the base layer's weight (peft/tuners/lora/layer.py,
# LoraLayer.update_layer), with what it does there.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")  # (PEFT reads "gaussian" in any case)
MUTATING_INITS = {"pissa": "W - scale * B0 A0 of W's principal singular vectors",
                  "corda": "W - scale * B0 A0 of a context-oriented decomposition",
                  "olora": "W - scale * B0 A0 of W's QR decomposition",
                  "loftq": "W quantized, B0 A0 its quantization error",
                  "lora_ga": "W - scale * B0 A0 of gradient-aligned vectors"}
# (Any other value is refused as another kind of adapter: "mica", say, freezes lora_B to W's
# minor singular vectors, computed again at load.)
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha default
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the largest alpha whose scale (alpha / r) float32 holds
# Every field PEFT 0.21's LoraConfig writes to adapter_config.json (dataclasses.fields): a file
# setting another one comes from a newer PEFT (or was edited), and is refused (UNKNOWN_OPTION).
KNOWN_FIELDS = frozenset((
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out",
    "bias", "use_rslora", "modules_to_save", "init_lora_weights", "layers_to_transform", "layers_pattern",
    "rank_pattern", "alpha_pattern", "megatron_config", "megatron_core", "trainable_token_indices",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "use_dora", "velora_config",
    "alora_invocation_tokens", "use_qalora", "qalora_group_size", "monteclora_config", "layer_replication",
    "runtime_config", "lora_bias", "target_parameters", "use_bdlora", "arrow_config", "kasa_config",
    "ensure_weight_tying"))

UNKNOWN_OPTION = """\
ft.nn.load_lora: adapter_config.json in {directory!r} sets {option}={value!r}, a field PEFT 0.21's \
LoraConfig does not have: a newer PEFT wrote it (PEFT 0.21 drops it with a warning), or the file \
was edited. ft.nn.load_lora cannot tell what it changes, and skipping it could load a different \
model than the one trained.
    wrong:  "{option}": {given}
    right:  "{option}": null     # only where it is off in the PEFT that wrote the file; else merge it there:
            model = ft.nn.from_hf(peft.PeftModel.from_pretrained(hf_model, directory).merge_and_unload())"""


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> tuple[Any, str | None]:
    """PEFT's rank_pattern / alpha_pattern lookup (``get_pattern_key``): the value of the first
    key matching the end of the module's name, and that key (None: the default)."""
    for key, value in patterns.items():
        if re.match(_regex("rank_pattern", key), module):  # (alpha_pattern's form is the same)
            return value, key
    return default, None


# ---- writing ----------------------------------------------------------------------------------

def save_lora(model: Any, directory: str | os.PathLike[str], *, base_model_name_or_path: str | None = None,
              task_type: str | None = "auto", modules_to_save: Sequence[str] | None = None) -> None:
    """Write ``model``'s adapters as a PEFT LoRA adapter: ``directory/adapter_model.safetensors``
    and ``directory/adapter_config.json``, which ``peft.PeftModel.from_pretrained(hf_model,
    directory)`` loads onto the Hugging Face model.

    Tensors are named as PEFT names them, ``base_model.model.<module>.lora_A.weight``
    (``[r, in]``) and ``lora_B.weight`` (``[out, r]``), ``<module>`` the layer's Hugging Face
    module (:func:`ft.nn.from_hf` models; other models: :func:`ft.nn.torch_state_dict`'s
    names), one per Stack member, in the adapters' dtype. The config lists the adapted
    modules by full name in ``target_modules``, with ``r``, ``lora_alpha`` and
    ``lora_dropout`` (the most common rank and alpha; others in ``rank_pattern`` /
    ``alpha_pattern``: each Stack member's own rank, zero padding trimmed, and scale; the
    first adapter's dropout),
    ``bias="none"``; ``task_type`` ``"auto"`` is ``"CAUSAL_LM"`` for a causal LM (GPT-2,
    Llama), none for a masked LM (BERT's, RoBERTa's: PEFT has no task type for them), ``"SEQ_CLS"`` / ``"TOKEN_CLS"`` / ``"QUESTION_ANS"`` for a task model of
    :mod:`functree.hf._heads`, else none. Under these a task model's
    head (``score``, ``classifier``, ``qa_outputs``) is written whole in ``modules_to_save``, whatever
    ``modules_to_save`` says, as PEFT's ``PeftModelForSequenceClassification`` saves it
    (``base_model.model.score.weight``; PEFT fails to load such a file without it, and the
    head's training would be lost); a classifier holding adapters is refused
    (:data:`HEAD_ADAPTED`: PEFT never adapts it there).

    Adapters on the members of a fused projection (GPT-2's ``c_attn`` holds q, k and v) are
    written as PEFT's one adapter on it: ``lora_B``'s rows in the weight's layout; the
    members' shared ``A`` once (as :func:`load_lora` makes them), or, once they differ, the
    exact block form (``A`` stacked, ``B`` block-diagonal: rank ``Σr``); a member without
    an adapter has zero rows. ``modules_to_save`` (PEFT's, e.g. ``["lm_head"]``) writes those
    ``Dense`` layers whole (a head trained in full beside the adapters). Left at None, it is
    the ``modules_to_save`` of the adapter :func:`load_lora` loaded (the adapters record it:
    ``LoraDense.saved_modules``), so a loaded head goes back out with its adapters; ``[]``
    writes the adapters alone. A multiple-choice model's ``classifier`` (PEFT has no task type
    for it, and its users list the new head in ``modules_to_save``) is written whole where
    None is given and the classifier holds no adapters.

    Adapters on a sparse MoE's expert weights (``ft.nn.lora(model, "*.experts.gate_up_proj",
    ...)``) are written as PEFT's ``target_parameters`` (:mod:`functree.hf._peft_params`:
    ``lora_A [E r, in]``, ``lora_B [out, r E]``, the parameters' full names listed, their
    ranks and alphas by those names in ``rank_pattern`` / ``alpha_pattern``).

    The adapters alone are written, not the weights under them: train them alone
    (``ft.optim.Optimizer(tx, wrt="*.lora_*")``; an optimizer without ``wrt=`` warns,
    :class:`~functree.nn.LoraBaseWarning`), or merge and write the whole model
    (``ft.nn.save_hf(ft.nn.merge_lora(model), directory)``) when the base trained too.

    The write is atomic per file, and a crash between the two files leaves a directory that
    :func:`load_lora` refuses (the weights record the config they were saved with).

    Example:
      >>> import functree as ft, jax, json, os, pathlib, tempfile
      >>> model = ft.nn.Sequential(ft.nn.Dense(4, 4, key=jax.random.key(0)), ft.nn.Dense(4, 2, key=jax.random.key(1)))
      >>> adapted = ft.nn.lora(model, "layers.1", rank=2, alpha=4, key=jax.random.key(2))
      >>> directory = tempfile.mkdtemp()
      >>> ft.nn.save_lora(adapted, directory)
      >>> sorted(os.listdir(directory))
      ['adapter_config.json', 'adapter_model.safetensors']
      >>> config = json.loads(pathlib.Path(directory, "adapter_config.json").read_text())
      >>> config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]
      ('LORA', 2, 4.0, ['1'])
    """
    if isinstance(modules_to_save, str):
        modules_to_save = [modules_to_save]
    layers = [layer for layer in dense_layers(model) if isinstance(layer.node, LoraDense)]
    experts = [w for w in expert_weights(model) if isinstance(getattr(w.node, w.field), LoraParameter)]
    if not layers and not experts:
        raise ValueError(NO_ADAPTERS.format(what="ft.nn.save_lora", verb="save"))
    if modules_to_save is None:  # those the loaded adapter saved (load_lora records them)
        modules_to_save = list(dict.fromkeys(m for layer in layers for m in layer.node.saved_modules)) or None
    names = torch_names(model)
    kind = "Hugging Face" if names.is_hf else "torch"
    by_module: dict[str, list[tuple[str, np.ndarray, np.ndarray, float]]] = {}
    dropouts: list[float] = []
    for layer in layers:  # each member at its own rank and scale (a loaded Stack's: PEFT's per layer)
        for name, a, b, scale in member_adapters(layer):
            found = names.members.get(name)
            if found is None or not found.weight_param:
                raise ValueError(NO_NAME.format(layer=name, torch=kind))
            if _mha_output(name, names) is not None:
                raise ValueError(MHA_OUTPUT.format(
                    what="save_lora", subject="the adapted layer is", module=name, layer=found.module[:-9] or "",
                    consequence="The saved adapter would give PEFT other logits than this model's.",
                    wrong=f'ft.nn.lora(model, "{name}", ...); ft.nn.save_lora(model, directory)',
                    right="torch_model.load_state_dict(ft.nn.torch_state_dict(ft.nn.merge_lora(model)))"
                          "   # the adapter folded in, or adapt other layers"))
            by_module.setdefault(found.module, []).append((name, a, b, scale))
        dropouts.append(layer.node.dropout)
    routers = router_modules(model, names) & set(by_module)  # written as PEFT's target_parameters (their .weight)
    dropping = [layer for layer in layers if layer.node.dropout > 0]
    if (experts or routers) and dropping:  # PEFT's ParamWrapper refuses any lora_dropout
        param = experts[0].info.name if experts else f"{min(routers)}.weight"
        raise ValueError(EXPERTS_DROPOUT_SAVED.format(param=param, dropout=dropping[0].node.dropout,
                                                      layer=dropping[0].name))
    tensors, param_ranks, param_alphas = expert_tensors(model) if experts else ({}, {}, {})
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    blocks: dict[str, list[list[Any]]] = {}
    for module, given in by_module.items():
        a, b, scale, fused = _module_adapter(given, names)
        if fused is not None:
            blocks[module] = fused
        tensors[f"{PREFIX}{module}.lora_A.weight"], tensors[f"{PREFIX}{module}.lora_B.weight"] = a, b
        if module in routers:  # (PEFT's own names for a ParamWrapper on a 2-d weight: a Linear's)
            param_ranks[f"{module}.weight"] = a.shape[0]
            param_alphas[f"{module}.weight"] = written_alpha(scale, a.shape[0], a.dtype)
        else:
            ranks[module], alphas[module] = a.shape[0], written_alpha(scale, a.shape[0], a.dtype)
    if task_type == "auto":
        # (a causal LM's, not every lm_head's: RoBERTa's masked LM names its head lm_head too)
        task_type = "CAUSAL_LM" if isinstance(model, CausalLM) and names.is_hf else \
            TASK_TYPES.get(getattr(family_of(model), "suffix", ""))  # a task model's: SEQ_CLS, TOKEN_CLS, QUESTION_ANS
    head = classifier_of(model) if task_type in TASK_TYPES.values() else None
    if head is not None:  # PEFT keeps it whole under SEQ_CLS / TOKEN_CLS / QUESTION_ANS, and fails to load a file without it
        adapted = [m for m in by_module if m == head or m.startswith(head + ".")]  # (RoBERTa's: classifier.dense)
        if adapted:
            field = _field_of(head, adapted[0], names)
            raise ValueError(HEAD_ADAPTED.format(head=head, weight=adapted[0], field=field, hf_class=type(model).__name__,
                                                 task_type=task_type))
        modules_to_save = list(dict.fromkeys([*(modules_to_save or ()), head]))
    family = family_of(model)
    if modules_to_save is None and getattr(family, "suffix", "") == "ForMultipleChoice" and "classifier" not in by_module:
        # PEFT has no multiple-choice task type (its users list the new head themselves): the
        # model's own classifier, written whole, so that PEFT's model scores as this one
        modules_to_save = ["classifier"]
    saved = _saved_modules(model, names, modules_to_save, "save_lora") if modules_to_save else {}
    for module, (layer, i) in saved.items():
        if module in by_module or isinstance(layer.node, LoraDense):
            raise ValueError(SAVED_MODULE.format(what="save_lora", module=module, problem="which holds adapters",
                                                 right="ft.nn.save_lora(ft.nn.merge_lora(...)) or adapt other layers"))
        tensors.update(_full_tensors(module, layer, i, names))
    modules = list(ranks)
    ranks, alphas = {**ranks, **param_ranks}, {**alphas, **param_alphas}  # expert weights: by parameter name
    r, alpha = _most_common(ranks), _most_common(alphas)  # the others in rank_pattern / alpha_pattern
    config = {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model_name_or_path,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropouts[0] if dropouts else 0.0,
        "target_modules": sorted(modules), "target_parameters": sorted(param_ranks) or None,
        "rank_pattern": {re.escape(m): v for m, v in ranks.items() if v != r},
        "alpha_pattern": {re.escape(m): v for m, v in alphas.items() if v != alpha},
        "bias": "none", "fan_in_fan_out": any(not names.members[g[0][0]].transposed for g in by_module.values()),
        "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": list(modules_to_save) if modules_to_save else None, "layers_to_transform": None,
        "layers_pattern": None, "use_rslora": False, "use_dora": False, "lora_bias": False, "revision": None,
        "exclude_modules": None,
    }
    _write(os.fspath(local_path(directory)), tensors, config, blocks)  # "~/adapter": the home's, not ./~


def _mha_output(name: str, names: TorchNames) -> str | None:
    """The torch module of ft member ``name`` where it is a MultiheadAttention's output
    projection written as torch's ``nn.MultiheadAttention.out_proj`` (its query projection in
    ``in_proj_weight`` or ``q_proj_weight``, no Linear of its own): PEFT ignores an adapter
    there (:data:`MHA_OUTPUT`). None for any other layer (Hugging Face's ``o_proj``, OPT's
    ``out_proj``: Linear modules their attention calls)."""
    found = names.members.get(name)
    if found is None or not name.endswith("output_projection") or not found.weight_param:
        return None
    query = names.members.get(name[: -len("output_projection")] + "query_projection")
    if query is None or query.weight_param or found.module != join_names(query.module, "out_proj"):
        return None
    return found.module


def _most_common(values: dict[str, Any]) -> Any:
    return Counter(values.values()).most_common(1)[0][0]  # the first seen among equally common ones


def _module_adapter(given: list[tuple[str, np.ndarray, np.ndarray, float]], names: TorchNames
                    ) -> tuple[np.ndarray, np.ndarray, float, list[list[Any]] | None]:
    """PEFT's ``(lora_A [r, in], lora_B [size, r], scale, blocks)`` of one torch module from
    its ft members' ``(name, a [in, r_i], b [r_i, out_i], scale_i)``: each member's ``B`` rows
    at its outputs' positions, times ``scale_i / scale`` (``scale`` the first nonzero one), so
    that ``scale · x Aᵀ Bᵀ`` is every member's ``scale_i · x a_i b_i`` in the module's layout.
    ``blocks``: in the block form (members with their own ``A``), each member's columns
    ``[name, start, stop]``; None for a shared ``A``."""
    found = names.members[given[0][0]]
    scale = next((s for *_, s in given if s != 0.0), 0.0)
    shared = all(a.shape == given[0][1].shape and np.array_equal(a, given[0][1]) for _, a, _, _ in given)
    a_rows = [given[0][1].T] if shared else [a.T for _, a, _, _ in given]
    a_all = np.concatenate(a_rows, axis=0)
    b_all = np.zeros((found.size, a_all.shape[0]), np.result_type(*(b.dtype for _, _, b, _ in given)))
    offset, blocks = 0, []
    if any(s != scale for *_, s in given) and b_all.dtype.itemsize < 4:  # a rescaled B not rounded to 16 bits
        b_all = b_all.astype(np.float32)
    for name, a, b, s in given:
        rows = b.T if s == scale else (b.T.astype(np.float64) * (s / scale if scale else 0.0)).astype(b_all.dtype)
        b_all[names.members[name].positions, offset: offset + a.shape[1]] = rows
        blocks.append([name, offset, offset + a.shape[1]])
        offset += 0 if shared else a.shape[1]
    return np.ascontiguousarray(a_all), b_all, float(scale), None if shared or len(given) < 2 else blocks


def _saved_modules(model: Any, names: TorchNames, modules_to_save: Sequence[str], what: str
                   ) -> dict[str, tuple[DenseLayer, int]]:
    """``{torch module: (its Dense layer, member index)}`` of the modules PEFT's
    ``modules_to_save`` names (``_set_trainable``: a module whose name ends with one). An
    entry naming no module is an error for save_lora's argument; in a file's config PEFT
    skips it (its SEQ_CLS adapters list both "classifier" and "score"), and so does load_lora."""
    if isinstance(modules_to_save, str):  # save_lora's argument: one module's name
        modules_to_save = [modules_to_save]
    layers = {m: (layer, i) for layer in dense_layers(model) for i, m in enumerate(member_layer_names(layer))}
    out: dict[str, tuple[DenseLayer, int]] = {}
    for entry in modules_to_save:
        matched = sorted(m for m in names.modules if saved_under(m, entry))
        if not matched and what == "load_lora":
            continue
        if not matched:
            raise ValueError(SAVED_MODULE.format(what=what, module=entry, problem="which is no module of this model",
                                                 right='modules_to_save=["lm_head"]'))
        held = {n.module for n in names.members.values() if n.weight_param}
        for module in matched:
            if module not in held and any(m.startswith(module + ".") and m in held for m in matched):
                continue  # a module enclosing the Dense layers saved (RoBERTa's classifier): they are its tensors
            member = next((m for m, n in names.members.items() if n.module == module and n.weight_param), None)
            if member is None or names.members[member].shared_with:
                problem = ("a fused projection (held here as Dense layers of its parts: q, k and v)"
                           if member is not None else
                           "which is not a Dense layer of its own here (a tied head is the embedding; "
                           "a norm or an embedding is another kind of layer)")
                untied = member is None and module in _tied_heads(model)
                then = "ft.nn.load_lora(model, directory)" if what == "load_lora" else "ft.nn.lora(model, ...)  # train, save"
                right = (UNTIED_HEAD.format(then=then) if untied else
                         MERGED_ROUTE.strip().removeprefix("right:").strip() if what == "load_lora" else
                         "an untied Dense head, e.g. modules_to_save=[\"lm_head\"]")
                raise ValueError(SAVED_MODULE.format(what=what, module=module, problem=problem, right=right))
            out[module] = layers[member]
    return out


def _full_tensors(module: str, layer: DenseLayer, i: int, names: TorchNames) -> dict[str, np.ndarray]:
    """A Dense member's weight (and bias) as its torch module holds them."""
    found = names.members[member_layer_names(layer)[i]]
    weight = member_arrays(layer.node.weight, layer.info.sizes)[i]  # [in, out]
    torch_weight = np.empty((found.size, weight.shape[0]), weight.dtype)
    torch_weight[found.positions] = weight.T
    out = {f"{PREFIX}{module}.weight": torch_weight if found.transposed else np.ascontiguousarray(torch_weight.T)}
    if layer.node.bias is not None:
        bias = member_arrays(layer.node.bias, layer.info.sizes)[i]
        torch_bias = np.empty((found.size,), bias.dtype)
        torch_bias[found.positions] = bias
        out[f"{PREFIX}{module}.bias"] = torch_bias
    return out


def _write(directory: str, tensors: dict[str, np.ndarray], config: dict[str, Any],
           blocks: dict[str, list[list[Any]]] | None = None) -> None:
    """Both files through temporary files renamed into place, the weights first; the weights'
    metadata records the config's numeric fields (a crash between the renames leaves new
    weights beside an old config, which :func:`load_lora` then refuses)."""
    os.makedirs(directory, exist_ok=True)
    record = json.dumps({k: config.get(k) for k in RECORDED}, sort_keys=True)
    temporaries: list[str] = []
    try:
        weights = _temporary(directory, WEIGHTS_FILE, temporaries)
        metadata = {"format": "pt", RECORD: record}
        if blocks:
            metadata[BLOCKS] = json.dumps(blocks, sort_keys=True)
        save_file(weights, tensors, metadata)
        settings = _temporary(directory, CONFIG_FILE, temporaries)
        with open(settings, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _synced(weights)
        os.replace(weights, os.path.join(directory, WEIGHTS_FILE))
        os.replace(settings, os.path.join(directory, CONFIG_FILE))
    finally:
        for path in temporaries:
            if os.path.exists(path):
                os.remove(path)


def _temporary(directory: str, name: str, made: list[str]) -> str:
    handle, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(handle)
    made.append(path)
    return path


def _synced(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# ---- reading ----------------------------------------------------------------------------------

def _read_adapter(directory: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """The config and tensors of an adapter directory, the config checked against the record
    the weights carry (when save_lora wrote them)."""
    config_path, weights_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
    for path in (config_path, weights_path):
        if path == weights_path and not os.path.isfile(path) and os.path.isfile(os.path.join(directory, PICKLED)):
            raise ValueError(PICKLED_WEIGHTS.format(directory=directory))
        if not os.path.isfile(path):
            problem = f"no {os.path.basename(path)}"
            named = sorted(d for d in os.listdir(directory) if os.path.isfile(os.path.join(directory, d, CONFIG_FILE))) \
                if path == config_path and os.path.isdir(directory) else []
            if named:  # PEFT's save_pretrained of a named adapter (not "default") writes it in a folder of its name
                problem += (f"; its subfolders {named} hold adapters (PEFT writes a named adapter in a folder of its "
                            f"name): ft.nn.load_lora(model, {os.path.join(directory, named[0])!r})")
            raise ValueError(NOT_PEFT.format(directory=directory, problem=problem))
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(NOT_PEFT.format(directory=directory, problem=f"{CONFIG_FILE} is not JSON ({e})")) from e
    except RecursionError:  # json recurses per level: a damaged file, named
        raise ValueError(NOT_PEFT.format(directory=directory, problem=f"{CONFIG_FILE} is {NESTED_JSON}")) from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        given = config.get("peft_type") if isinstance(config, dict) else config
        raise ValueError(NOT_PEFT.format(directory=directory, problem=f"peft_type is {given!r}, not 'LORA'"))
    _check_types(config, directory)
    _check_patterns(config, directory)
    for option, covered in COVERED:
        value = config.get(option)
        if value is None or value == covered or (covered in (None, False) and not value):
            continue
        raise ValueError(UNSUPPORTED_PEFT.format(option=option, value=value,
                                                 covered=", ".join(f"{o}={c!r}" for o, c in COVERED),
                                                 right=MERGED_ROUTE if option in MERGEABLE else ""))
    _check_init(config.get("init_lora_weights", True))
    _check_known(config, directory)
    tensors = load_file(weights_path, caller="ft.nn.load_lora")  # every rule of the format checked
    metadata = read_header(weights_path, os.path.getsize(weights_path))[1].get("__metadata__") or {}
    if RECORD in metadata:
        _check_record(directory, config, metadata[RECORD])
    return config, tensors, read_blocks(metadata.get(BLOCKS))


def _check_known(config: dict[str, Any], directory: str) -> None:
    """Refuse a field PEFT 0.21's LoraConfig does not have, set (:data:`UNKNOWN_OPTION`): a
    newer PEFT's option (a LoRA variant) that this reader would skip, as PEFT 0.21 skips it
    with a warning. Left at null, false or empty, such a field is off and is read past."""
    for option, value in config.items():
        if option not in KNOWN_FIELDS and value not in (None, False, "", [], {}):
            raise ValueError(UNKNOWN_OPTION.format(directory=directory, option=option, value=value,
                                                   given=json.dumps(value, default=str)))


def _check_init(value: Any) -> None:
    """Refuse an ``init_lora_weights`` with which PEFT changes the base weights on load (the
    file's tensors then belong to that changed base), or one PEFT does not know."""
    name = value.lower() if isinstance(value, str) else None
    if value is True or value is False or name == "gaussian" or value in ("eva", "orthogonal"):  # as PEFT compares
        return
    kind = next((k for k in MUTATING_INITS if name is not None and (name == k or name.startswith(f"{k}_"))), None)
    if kind is None:
        raise ValueError(UNSUPPORTED_PEFT.format(option="init_lora_weights", value=value, covered=", ".join(
            f"init_lora_weights={v!r}" for v in PLAIN_INITS), right=""))
    right = CONVERT_MUTATED if kind in ("pissa", "corda", "olora") else "PEFT cannot convert it to plain LoRA."
    raise ValueError(MUTATED_BASE.format(value=value, how=MUTATING_INITS[kind], right=right))


def _check_record(directory: str, config: dict[str, Any], text: str) -> None:
    try:
        recorded = json.loads(text)
        why = None if isinstance(recorded, dict) else f"a JSON {type(recorded).__name__}, not an object"
    except ValueError as e:
        why = f"not JSON ({e})"
    except RecursionError:
        why = NESTED_JSON
    if why is not None:  # save_lora writes an object {option: value}: the file was altered
        raise ValueError(NOT_PEFT.format(directory=directory, problem=f"{WEIGHTS_FILE}'s record of its config "
                                                                      f"({RECORD!r} in its metadata) is {why}"))
    for option in RECORDED:
        if option in recorded and not _same_setting(option, recorded[option], config.get(option)):
            raise ValueError(STALE_CONFIG.format(directory=directory, option=option, given=config.get(option),
                                                 recorded=recorded[option]))


# Module lists PEFT holds as sets (LoraConfig.__post_init__): a config PEFT saved again lists them in
# another order (PeftConfig.from_pretrained(d).save_pretrained(d)), which selects the same modules.
UNORDERED = ("target_modules", "exclude_modules")


def _same_setting(option: str, recorded: Any, given: Any) -> bool:
    """Whether the config's ``given`` value of ``option`` is the ``recorded`` one (the lists of
    :data:`UNORDERED` in any order: PEFT writes its sets back in hash order)."""
    if option in UNORDERED and isinstance(recorded, list) and isinstance(given, list):
        return set(recorded) == set(given)
    return bool(recorded == given)


def _split_tensors(tensors: dict[str, np.ndarray], saved: set[str], directory: str
                   ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]],
                              dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """``({module: {"lora_A": ..., "lora_B": ...}}, {saved module: {param: full tensor}},
    {module: {param: its base layer's tensor}}, {torch name: tensor})``: the adapters (an
    embedding's ``lora_embedding_A`` / ``_B`` among them, refused later as not a Dense
    target), the modules_to_save, the base weights PEFT's ``save_embedding_layers`` writes
    beside an adapted ``lm_head`` or ``embed_tokens``, and any other tensor under PEFT's prefix
    (the embedding and head ``save_embedding_layers`` writes whole when they are not adapted:
    :func:`_check_base_tensors`). Tensors named with an adapter (``lora_A.default.weight``):
    the one PEFT reads (:func:`chosen_adapter`)."""
    named: dict[str, dict[str | None, dict[str, np.ndarray]]] = {}
    full: dict[str, dict[str, np.ndarray]] = {}
    bases: dict[str, dict[str, np.ndarray]] = {}
    others: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        match = re.fullmatch(rf"{re.escape(PREFIX)}(.*)\.(lora_A|lora_B)(?:\.([^.]+))?\.weight", name) or re.fullmatch(
            rf"{re.escape(PREFIX)}(.*)\.lora_embedding_(A|B)(?:\.([^.]+))?", name)
        base = re.fullmatch(rf"{re.escape(PREFIX)}(.*)\.base_layer\.(weight|bias)", name)
        module, _, param = name[len(PREFIX):].rpartition(".")
        if match is not None:
            which = match[2] if match[2].startswith("lora") else f"lora_{match[2]}"
            named.setdefault(match[1], {}).setdefault(match[3], {})[which] = value
        elif base is not None:
            bases.setdefault(base[1], {})[base[2]] = value
        elif name.startswith(PREFIX) and module in saved:
            full.setdefault(module, {})[param] = value
        elif not name.startswith(PREFIX) and re.fullmatch(r".+\.lora_(A|B|embedding_A|embedding_B)\b.*", name):
            raise ValueError(UNPREFIXED.format(name=name, directory=directory))
        elif name.startswith(PREFIX) and "lora_" not in name and not name.endswith(".base_layer"):
            others[name[len(PREFIX):]] = value
        else:
            raise ValueError(NOT_PEFT.format(directory=directory, problem=f"an unexpected tensor {name!r}"))
        if not (np.issubdtype(value.dtype, np.floating) or value.dtype == jnp.bfloat16):
            raise ValueError(ADAPTER_DTYPE.format(name=name, dtype=value.dtype))
    pairs = chosen_adapter(named, os.path.join(directory, WEIGHTS_FILE))
    for module, pair in pairs.items():
        for which in ("lora_A", "lora_B"):
            if which not in pair:
                raise ValueError(NOT_PEFT.format(directory=directory, problem=f"{module!r} has no {which}"))
    return pairs, full, bases, others


def _check_base_tensors(model: Any, given: dict[str, np.ndarray], directory: str,
                        config: dict[str, Any] | None = None) -> None:
    """The base model's tensors PEFT's ``save_embedding_layers`` wrote whole beside the adapter
    (an embedding, a head not adapted: ``model.embed_tokens.weight``): PEFT loads them over the
    model's own, so they are read where they equal the model's (in its dtype) and refused where
    they differ (:data:`BASE_TENSOR`: the adapter was trained on that other base); a name the
    model's state dict does not hold is :data:`NOT_PEFT`, or :data:`SAVED_MODULE_NOT_HERE` where
    ``config``'s ``modules_to_save`` names it (a task adapter's head, loaded into the causal LM)."""
    if not given:
        return
    plain = unwrapped(model)
    own = to_hf_state_dict(plain, numpy=True) if family_of(plain) is not None else torch_state_dict(plain, numpy=True)
    for name, value in given.items():
        mine = own.get(name)
        if mine is None:
            module = name.rpartition(".")[0]
            saved = (config or {}).get("modules_to_save") or []
            if any(saved_under(module, entry) for entry in saved):  # (not "not a PEFT adapter": another model's)
                task_type = (config or {}).get("task_type")
                suffixes: dict[Any, str] = {v: k for k, v in TASK_TYPES.items()}
                suffix = suffixes.get(task_type, "ForSequenceClassification")
                trained = f"a {suffix[3:]} model ({suffix})" if task_type in TASK_TYPES.values() else \
                    f"a model with a module {module!r}"
                raise ValueError(SAVED_MODULE_NOT_HERE.format(directory=directory, module=module, saved=saved,
                                                              task_type=task_type, cls=type(model).__name__,
                                                              trained=trained, suffix=suffix))
            raise ValueError(NOT_PEFT.format(directory=directory, problem=f"an unexpected tensor {PREFIX + name!r}"))
        mine = np.asarray(mine)
        if value.shape == mine.shape and np.array_equal(value.astype(mine.dtype), mine):
            continue
        resized = value.ndim == mine.ndim and value.shape[1:] == mine.shape[1:] and value.shape[0] != mine.shape[0]
        how = (f"{value.shape[0]} rows for the model's {mine.shape[0]}: a resized vocabulary" if resized else
               f"shape {value.shape} for {mine.shape}" if value.shape != mine.shape else "other values")
        resize = f"hf_model.resize_token_embeddings({value.shape[0]})   # as the training did, then\n            " \
            if resized else ""
        raise ValueError(BASE_TENSOR.format(name=PREFIX + name, how=how, resize=resize))


def _check_base_layers(model: Any, names: TorchNames, bases: dict[str, dict[str, np.ndarray]], modules: list[str],
                       directory: str) -> None:
    """The base weights PEFT saved beside adapted modules (``save_embedding_layers``; its
    ``"auto"`` writes them whenever ``target_modules`` names ``lm_head`` or
    ``embed_tokens``): read when they equal the model's own (in its dtype), refused
    otherwise, as PEFT would load them over the model's (:data:`BASE_LAYER`)."""
    layers = {m: (layer, i) for layer in dense_layers(model) for i, m in enumerate(member_layer_names(layer))}
    for module, given in bases.items():
        members = [m for m, n in names.members.items() if n.module == module and n.weight_param]
        if module not in modules or len(members) != 1:  # not an adapted Dense of its own
            name = f"{PREFIX}{module}.base_layer.{next(iter(given))}"
            raise ValueError(NOT_PEFT.format(directory=directory, problem=(
                f"an unexpected tensor {name!r} (a base layer's weight, for no adapted Dense layer)")))
        layer, i = layers[members[0]]
        own = _full_tensors(module, layer, i, names)
        for param, value in given.items():
            mine = own.get(f"{PREFIX}{module}.{param}")
            expected = None if mine is None else tuple(mine.shape)
            same = mine is not None and value.shape == mine.shape and np.array_equal(value.astype(mine.dtype), mine)
            if not same:
                values = "" if mine is None or value.shape != mine.shape else ", other values"
                raise ValueError(BASE_LAYER.format(name=f"{PREFIX}{module}.base_layer.{param}", module=module,
                                                   given=tuple(value.shape), expected=expected, values=values))


def _layer_index(config: dict[str, Any], module: str) -> int | None:
    """The layer number PEFT's ``layers_to_transform`` reads from a module's name (the first
    numbered segment, or the one after ``layers_pattern``)."""
    patterns = config.get("layers_pattern")
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(_regex("layers_pattern", pattern), module)
            if match is not None:
                break
    return int(match["idx"]) if match else None


def _targets(config: dict[str, Any], module: str) -> bool:
    """PEFT's ``check_target_module_exists``: whether the config puts an adapter on ``module``."""
    exclude = config.get("exclude_modules")
    if exclude and (re.fullmatch(exclude, module) if isinstance(exclude, str)
                    else module in exclude or any(module.endswith(f".{e}") for e in exclude)):
        return False
    saved = config.get("modules_to_save") or ()
    if any(re.match(_regex("modules_to_save", m), module) for m in saved):
        return False
    targets = config.get("target_modules")
    if targets is None:
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    if module in targets:
        return True
    if not any(module.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    index = _layer_index(config, module)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def _targeted(config: dict[str, Any], names: TorchNames, model: Any = None) -> set[str]:
    """The torch modules the config adapts; ``"all-linear"``: every Dense module but the
    output head (PEFT's shorthand), a task model's classifier under ``SEQ_CLS`` (PEFT's
    ``_maybe_include_all_linear_layers``; without a task type PEFT adapts it) and a sparse
    MoE's router (no torch Linear in transformers 5: :func:`_as_peft_reads_it` adds its
    weight where PEFT's MoE conversion does)."""
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        dense = {n.module for n in names.members.values() if n.weight_param}
        classifier = classifier_of(model) if model is not None else None
        left_out = {names.head, classifier if config.get("task_type") == "SEQ_CLS" else None,
                    *(router_modules(model, names) if model is not None else ())}
        return {m for m in dense if m not in left_out and _targets({**config, "target_modules": [m]}, m)}
    return {m for m in names.modules if _targets(config, m)}


def _as_peft_reads_it(config: dict[str, Any], model: Any) -> dict[str, Any]:
    """A config whose ``target_modules`` is ``"all-linear"`` as PEFT 0.21 reads it onto this
    model: where the family lists them (``hf_all_linear``, PEFT's MoE conversion: Mixtral's,
    Qwen3-MoE's, OLMoE's) the router's weight and the stacked expert weights join
    ``target_parameters``, a fused one at its multiple of ``r`` and ``lora_alpha``
    (``rank_pattern`` / ``alpha_pattern`` ``".*\\.gate_up_proj"``, as PEFT sets them). A config
    PEFT saved lists what it resolved instead; a hand-written one keeps the shorthand."""
    targets = config.get("target_modules")
    extra = getattr(family_of(model), "hf_all_linear", {})
    if not (isinstance(targets, str) and targets.lower() == ALL_LINEAR) or not extra:
        return config
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    ranks, alphas = dict(config.get("rank_pattern") or {}), dict(config.get("alpha_pattern") or {})
    for entry, multiple in extra.items():
        if multiple != 1:
            pattern = rf".*\.{re.escape(entry.rpartition('.')[2])}"
            ranks[pattern], alphas[pattern] = r * multiple, alpha * multiple
    parameters = list(dict.fromkeys([*(config.get("target_parameters") or []), *extra]))
    return {**config, "target_parameters": parameters, "rank_pattern": ranks, "alpha_pattern": alphas}


LOAD_ONTO_ADAPTED = """\
ft.nn.load_lora: the adapter in {directory} has tensors for {name!r}, which holds adapters
already (a LoraDense): an adapter loads onto the base model it was trained on.
    wrong:  ft.nn.load_lora(adapted, {directory!r})
    right:  ft.nn.load_lora(base_model, {directory!r})      # or ft.nn.merge_lora(adapted) to stack them"""


def load_lora(model: Any, directory: str | os.PathLike[str], *, key: jax.Array | None = None) -> Any:
    """``model`` with the LoRA adapter a PEFT directory holds (``save_pretrained``'s, or
    :func:`save_lora`'s) put on its ``Dense`` layers: the inverse of :func:`save_lora`.

    The config decides, as in PEFT: the modules ``target_modules`` selects (with
    ``layers_to_transform``, ``layers_pattern``, ``exclude_modules``; ``"all-linear"``: every
    Dense but the output head and a sparse MoE's router, with the router's weight and the
    expert weights where PEFT's MoE conversion adds them) get the file's ``lora_A`` / ``lora_B``, as a
    :class:`LoraDense` with rank ``r`` (or ``rank_pattern``'s, which the tensors must have)
    and scale ``lora_alpha / r`` (``alpha_pattern``; ``use_rslora``: ``alpha / sqrt(r)``),
    ``dropout`` from ``lora_dropout``; a Stack's members of other ranks or scales keep PEFT's
    own ``A``, ``B`` (zero-padded to the largest rank) and scale (``LoraDense.member_scale``),
    so training continues as PEFT's would. Tensors named with an adapter
    (``lora_A.default.weight``): the one PEFT reads (none, else ``default``); several other
    names are refused. A fused projection's adapter (GPT-2's ``c_attn``) goes to its members,
    each with the shared ``A`` and its rows of ``B``. ``modules_to_save``'s full tensors (a
    trained ``lm_head``) replace those Dense layers' weight and bias, and the adapters record
    the list (``LoraDense.saved_modules``) for :func:`save_lora`; an entry naming no module
    of the model is skipped, as PEFT skips it. A Stack member the config does not target
    gets zero adapters. ``key`` seeds the adapters' dropout masks (needed only to train with
    dropout). ``target_parameters`` (PEFT's ``lora.ParamWrapper``): a sparse MoE's expert
    weights get PEFT's per-expert adapters (:mod:`functree.hf._peft_params`), a Linear's weight
    (the router's ``mlp.gate.weight``) that Dense layer's; any other parameter is refused.

    Refused, naming the tensor or option: a config and a file that disagree (tensors of
    modules not targeted, targeted modules without tensors, ranks other than the config's,
    integer tensors, a config other than the one the weights were saved with), targets that
    are not Dense layers, DoRA and adapter biases, an ``init_lora_weights`` with which PEFT
    rewrites the base weights at load (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA: PEFT's converted
    save, ``path_initial_model_for_weight_conversion=``, loads), and a base weight saved
    beside an adapted head (``save_embedding_layers``), or an embedding or head it saved whole,
    that is not the model's own (one equal to it is read: PEFT loads it over the model's).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, tempfile
      >>> model = ft.nn.Sequential(ft.nn.Dense(4, 4, key=jax.random.key(0)), ft.nn.Dense(4, 2, key=jax.random.key(1)))
      >>> adapted = ft.nn.lora(model, "*", rank=2, key=jax.random.key(2))
      >>> adapted = ft.set(adapted, "layers.1.lora_b", jnp.ones((2, 2)))
      >>> directory = tempfile.mkdtemp()
      >>> ft.nn.save_lora(adapted, directory)
      >>> loaded = ft.nn.load_lora(model, directory)
      >>> bool(jnp.all(loaded(jnp.ones((1, 4))) == adapted(jnp.ones((1, 4)))))
      True
    """
    directory = os.fspath(read_path(directory, "ft.nn.load_lora"))  # "~/adapter": the home's
    config, tensors, blocks = _read_adapter(directory)
    _check_config(config, directory)
    names = torch_names(model)
    config = _as_peft_reads_it(config, model)
    kind = "Hugging Face" if names.is_hf else "torch"
    if config.get("modules_to_save"):  # another base's adapter: say so before its modules_to_save miss here
        _check_known_modules(tensors, names, kind)
    saved = _saved_modules(model, names, config["modules_to_save"], "load_lora") if config.get("modules_to_save") \
        else {}
    head = classifier_of(model)
    if config.get("task_type") in TASK_TYPES.values() and head is not None \
            and not any(saved_under(m, head) for m in saved):
        # PEFT keeps the classifier whole there: its from_pretrained fails on such a file too
        raise ValueError(HEAD_NOT_SAVED.format(directory=directory, task_type=config["task_type"], head=head,
                                               hf_class=type(model).__name__))
    pairs, full, bases, others = _split_tensors(tensors, set(saved), directory)
    _check_base_tensors(model, others, directory, config)
    by_param: set[str] = set()
    experts: dict[Any, Any] = {}
    if config.get("target_parameters"):  # PEFT's ParamWrapper: the expert weights, a Linear's weight
        # (a Linear's weight [out, in] only: PEFT reads a 2-D parameter so, and a Conv1D's [in, out] otherwise)
        dense = {n.module for n in names.members.values() if n.weight_param and n.transposed}
        by_param = check_params(config, model, dense, _targeted(config, names, model) & dense)
        adapted = next((w for w in expert_weights(model) if isinstance(getattr(w.node, w.field), LoraParameter)), None)
        if adapted is not None:
            raise ValueError(LOAD_ONTO_ADAPTED.format(name=adapted.info.name, directory=directory))
        experts, used = loaded_experts(model, config, pairs, _pattern_value)
        pairs = {m: p for m, p in pairs.items() if m not in used}
    modules = _checked_modules(config, names, pairs, kind, model, by_param)
    outputs = [m for m in names.members if _mha_output(m, names) in modules]
    if outputs:  # PEFT's PeftModel computes without that adapter, its merge with it
        module = names.members[outputs[0]].module
        raise ValueError(MHA_OUTPUT.format(
            what="load_lora", subject="the adapter's target_modules select", module=module,
            layer=module[:-9] or "", consequence="Which of the two models the file means is ambiguous.",
            wrong=f'peft.LoraConfig(target_modules=[..., "{module}"])',
            right=f'peft.LoraConfig(target_modules=[...], exclude_modules=["{module}"])   # train it again'
                  "\n       or:  ft.nn.load_torch_state_dict(model, peft_model.merge_and_unload().state_dict())"
                  "   # the merged model"))
    _check_base_layers(model, names, bases, modules, directory)
    layers = dense_layers(model)
    inputs = {m: int(layer.node.weight.shape[-2]) for layer in layers for m in member_layer_names(layer)}
    members: dict[str, tuple[str, np.ndarray, np.ndarray, float]] = {}
    for module in modules:
        members.update(_member_adapters(module, pairs[module], config, names, inputs, blocks.get(module),
                                        f"{module}.weight" if module in by_param else None))
    wrapped: dict[Any, Any] = {}
    for j, layer in enumerate(layers):
        layer_names = member_layer_names(layer)
        given = [(i, members[n]) for i, n in enumerate(layer_names) if n in members]
        if given and isinstance(layer.node, LoraDense):
            raise ValueError(LOAD_ONTO_ADAPTED.format(name=layer.name, directory=directory))
        if given:
            wrapped[layer.path] = loaded_layer(layer, given, float(config.get("lora_dropout") or 0.0),
                                               None if key is None else jax.random.fold_in(one_key(key), j))
    for module, (layer, i) in saved.items():
        wrapped[layer.path] = _with_full(wrapped.get(layer.path, layer.node), layer, i, module,
                                         full.get(module, {}), names, directory)
    if saved:  # the adapters remember them (those found here): save_lora writes the trained modules again
        listed = config["modules_to_save"]
        entries = tuple(e for e in ((listed,) if isinstance(listed, str) else listed)
                        if any(saved_under(m, e) for m in saved))
        wrapped = {path: node.replace(saved_modules=entries) if isinstance(node, LoraDense) else node
                   for path, node in wrapped.items()}

    # The loaded arrays where each layer's weight lives (a model put on device 3 or on a mesh).
    base = {layer.path: layer.node for layer in layers}
    wrapped = {path: placed_like(node, base[path]) if path in base else node for path, node in wrapped.items()}
    nodes = {w.path: w.node for w in expert_weights(model)}
    wrapped.update({path: placed_like(node, nodes[path]) for path, node in experts.items()})

    def one(path: Any, x: Any) -> Any:
        return wrapped.get(tuple(path), x)

    return jax.tree_util.tree_map_with_path(one, model, is_leaf=lambda x: x is None or is_dense(x) or is_experts(x))


def _check_known_modules(tensors: dict[str, np.ndarray], names: TorchNames, kind: str) -> None:
    """Raise :data:`UNKNOWN_MODULE` where the file's adapters name modules this model has not
    (a Llama adapter's q_proj on a GPT-2)."""
    adapted = {re.sub(r"(\.base_layer)+$", "", m[1])  # (PEFT's nested ParamWrappers: the module's own)
               for name in tensors if (m := re.fullmatch(rf"{re.escape(PREFIX)}(.*)\.lora_[AB]\b.*", name))}
    unknown = sorted(m for m in adapted if m not in names.modules)
    if unknown:
        dense = sorted({n.module for n in names.members.values() if n.weight_param})
        raise ValueError(UNKNOWN_MODULE.format(modules=unknown[:4], torch=kind, known=dense[:4]))


def _check_config(config: dict[str, Any], directory: str) -> None:
    """The config's numbers: PEFT's ``r > 0`` (a ZeroDivisionError deep inside otherwise); and
    no layer selection beside a regex ``target_modules`` (PEFT refuses it; the regex alone would
    otherwise put adapters on every layer)."""
    def bad(option: str, value: Any, why: str, right: str) -> ValueError:
        return ValueError(BAD_CONFIG.format(directory=directory, option=option, value=value, why=why, right=right))

    ranks = {"r": config.get("r", 8), **{f"rank_pattern[{k!r}]": v for k, v in (config.get("rank_pattern") or {}).items()}}
    for option, r in ranks.items():
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise bad(option, r, "a rank is a positive int", '"r": 8')
    alphas = {"lora_alpha": config.get("lora_alpha", PEFT_DEFAULT_ALPHA),
              **{f"alpha_pattern[{k!r}]": v for k, v in (config.get("alpha_pattern") or {}).items()}}
    for option, alpha in alphas.items():
        # the scale alpha / r (r >= 1) multiplies float32 activations: an alpha past float32's
        # largest number (6.8e38, finite in Python) made an infinite scale, NaNs from every layer
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not _finite(alpha) \
                or abs(alpha) > FLOAT32_MAX:
            raise bad(option, alpha, "the adapters' scale is alpha / r, a finite number (a float32: "
                      f"at most {FLOAT32_MAX:.7g})", '"lora_alpha": 16')
    dropout = config.get("lora_dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise bad("lora_dropout", dropout, "a dropout probability is in [0, 1)", '"lora_dropout": 0.05')
    targets = config.get("target_modules")
    for option in ("layers_to_transform", "layers_pattern"):  # LoraConfig.__post_init__ refuses both
        if isinstance(targets, str) and config.get(option) is not None:
            raise bad(option, config[option], f"it selects layers of a list of target_modules, and target_modules "
                      f"is the regular expression {targets!r} (PEFT: `{option}` cannot be used when "
                      "`target_modules` is a str)",
                      '"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]    # or a regex '
                      'naming the layers: ".*\\.1\\.self_attn\\.(q|v)_proj"')
    if config.get("layers_pattern") and config.get("layers_to_transform") is None:  # LoraConfig refuses it next
        raise bad("layers_pattern", config["layers_pattern"], "it names the blocks whose numbers "
                  "layers_to_transform selects, and layers_to_transform is null (PEFT: `layers_to_transform` must "
                  "also be specified)", '"layers_to_transform": [0, 1], "layers_pattern": "layers"    # or '
                  '"layers_pattern": null: every layer')


def _finite(number: float) -> bool:
    """A finite float: an int too large for one (JSON's 1e400 written out) is not."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def _field_of(module: str, inner: str, names: TorchNames) -> str:
    """The key path here of torch module ``module``, from that of ``inner``, a Dense layer in
    it or itself (``classifier`` from ``classifier.dense``'s)."""
    path = next(m for m, n in names.members.items() if n.module == inner)
    tail = inner[len(module):]
    return path[:-len(tail)] if tail and path.endswith(tail) else path


def _not_dense(targets: Any, modules: list[str], model: Any) -> ValueError:
    """:data:`TIED_HEAD_TARGET` where ``modules`` include a port's tied head, else :data:`NOT_DENSE_TARGET`."""
    option = f"target_modules={targets!r}"
    heads = _tied_heads(model)
    tied = [m for m in modules if m in heads]
    if tied:
        return ValueError(TIED_HEAD_TARGET.format(option=option, modules=tied[:4], heads=heads,
                                                  are="it is" if len(tied) == 1 else "each is"))
    tied_embeddings = {embedding for _, embedding in _tied_pairs(model)}
    merged = "" if any(m in tied_embeddings for m in modules) else MERGED_TARGET
    return ValueError(NOT_DENSE_TARGET.format(option=option, modules=modules[:4],
                                              are="is" if len(modules) == 1 else "are", merged=merged))


def _tied_heads(model: Any) -> list[str]:
    """The torch module names of the tied output heads of ``model``'s from_hf ports, at its
    root (``lm_head``) or inside it (``decoders.0.lm_head``): no Dense layer holds them."""
    return [head for head, _ in _tied_pairs(model)]


def _tied_pairs(model: Any) -> list[tuple[str, str]]:
    """``(head, embedding)`` torch module names of each tied from_hf port in ``model``: a
    decoder's ``lm_head``, and a masked LM's decoder tied to the word embeddings (BERT's
    ``cls.predictions.decoder``, RoBERTa's ``lm_head.decoder``: their ``hf_ties``)."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: family_of(x) is not None)
    out = []
    for path, node in pairs:
        family = family_of(node)
        if family is None:
            continue
        tied = tied_head(family, node)  # type: ignore[arg-type]
        ties = ([tied] if tied is not None else []) + [
            (copy, source) for copy, source in tied_copies(family, node) if copy.endswith(".weight")]
        out.extend(tuple(join_names(dotted_name(path), name.rpartition(".")[0]) for name in pair) for pair in ties)
    return out  # type: ignore[return-value]


def _checked_modules(config: dict[str, Any], names: TorchNames, pairs: dict[str, Any], kind: str,
                     model: Any = None, by_param: set[str] | None = None) -> list[str]:
    """The targeted modules, checked against the file's tensors and the model's Dense layers
    (``by_param``: Dense modules whose weight ``target_parameters`` selects)."""
    dense = {n.module for n in names.members.values() if n.weight_param}
    targets = config.get("target_modules")
    if config.get("target_parameters"):  # (checked by check_params: it selects something)
        targeted = _targeted(config, names, model) | (by_param or set())
        if not pairs and not targeted:
            return []
        if targets is None:
            targets = []
    if targets is None:
        ends = sorted({m.rpartition(".")[2] for m in pairs})
        raise ValueError(NO_TARGETS.format(modules=sorted(pairs)[:4] + (["..."] if len(pairs) > 4 else []),
                                           right=json.dumps(ends)))
    unknown = sorted(m for m in pairs if m not in dense)
    if unknown and all(m in names.modules for m in unknown):  # an embedding, a tied head: adapters of another kind
        raise _not_dense(targets, unknown, model)
    if unknown:
        raise ValueError(UNKNOWN_MODULE.format(modules=unknown[:4], torch=kind, known=sorted(dense)[:4]))
    targeted = _targeted(config, names, model) | (by_param or set())
    if not targeted:
        raise ValueError(NOTHING_TARGETED.format(targets=targets, torch=kind, known=sorted(dense)[:4]))
    stray = sorted(m for m in pairs if m not in targeted)
    if stray:
        raise ValueError(NOT_TARGETED.format(modules=stray[:4], targets=targets, right=sorted(pairs)))
    other = sorted(m for m in targeted if m not in dense)
    if other:
        raise _not_dense(targets, other, model)
    missing = sorted(m for m in targeted if m not in pairs)
    if missing:
        raise ValueError(NOT_IN_FILE.format(modules=missing[:4], them="it" if len(missing) == 1 else "them"))
    return sorted(targeted)


def _member_adapters(module: str, pair: dict[str, np.ndarray], config: dict[str, Any], names: TorchNames,
                     inputs: dict[str, int], recorded: Any = None, param: str | None = None
                     ) -> dict[str, tuple[str, np.ndarray, np.ndarray, float]]:
    """``{ft member: (module, a [in, r], b [r, out], scale)}`` of one torch module's adapter:
    a fused module's members share ``A`` and take their rows of ``B``, except in the block
    form :func:`save_lora` writes for members trained apart (``recorded``: its columns per
    member, or found from ``B``: :func:`functree.hf._peft_blocks.member_columns`), where
    each takes its own columns."""
    a, b = pair["lora_A"], pair["lora_B"]
    members = sorted(m for m, n in names.members.items() if n.module == module and n.weight_param)
    found = names.members[members[0]]
    matched = param or module  # PEFT matches a target_parameters' Linear weight by its parameter's name
    r, rank_key = _pattern_value(config.get("rank_pattern") or {}, matched, config.get("r", 8))
    alpha, _ = _pattern_value(config.get("alpha_pattern") or {}, matched, config.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    n_in = inputs[members[0]]
    if a.ndim != 2 or b.ndim != 2 or a.shape != (r, n_in) or b.shape != (found.size, r):
        wrong = "lora_A" if a.ndim != 2 or a.shape != (r, n_in) else "lora_B"
        source = f"rank_pattern[{rank_key!r}]" if rank_key is not None else "the config's r"
        raise ValueError(ADAPTER_SHAPE.format(name=f"{PREFIX}{module}.{wrong}.weight", given=(a.shape, b.shape),
                                              layer=module, inputs=n_in, outputs=found.size, rank=r, source=source))
    scale = float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)
    rows = {m: b[names.members[m].positions] for m in members}
    blocks = member_columns(recorded, rows)
    if blocks is not None:  # the block form save_lora writes: each member its own A and B
        return {m: (module, a[blocks[m]].T, rows[m][:, blocks[m]].T, scale) for m in members}
    return {m: (module, a.T, rows[m].T, scale) for m in members}


def _saved_shape(module: str, got: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                 transposed: bool) -> ValueError:
    """:data:`SAVED_SHAPE`, with :data:`SAVED_VOCAB` where only the outputs differ (a resized
    vocabulary; ``transposed``: torch's Linear layout ``[outputs, inputs]``, else Conv1D's)."""
    out = 0 if transposed else 1
    given, own = got["weight"], expected["weight"]
    head = module.rpartition(".")[2] in ("lm_head", "embed_out")  # the vocabulary's rows (GPT-NeoX: embed_out)
    resized = head and given[1 - out] == own[1 - out] and given[out] != own[out]
    why = f" (a vocabulary of {given[out]} tokens, not {own[out]})" if resized else ""
    return ValueError(SAVED_SHAPE.format(module=module, got=got, expected=expected, why=why,
                                         resize=SAVED_VOCAB.format(given=given[out]) if resized else ""))


def _with_full(node: Any, layer: DenseLayer, i: int, module: str, given: dict[str, np.ndarray], names: TorchNames,
               directory: str) -> Any:
    """``node`` with member ``i``'s weight and bias replaced by a saved module's full tensors."""
    found = names.members[member_layer_names(layer)[i]]
    weight, bias = node.weight, node.bias
    n_in = weight.shape[-2]
    expected: dict[str, tuple[int, ...]] = {"weight": (found.size, n_in) if found.transposed else (n_in, found.size)}
    if bias is not None:
        expected["bias"] = (found.size,)
    got = {p: tuple(v.shape) for p, v in given.items()}
    if set(given) == set(expected) and any(given[p].shape != s for p, s in expected.items()):
        raise _saved_shape(module, got, expected, found.transposed)
    if set(given) != set(expected):
        raise ValueError(NOT_PEFT.format(directory=directory, problem=(
            f"modules_to_save's {module!r} is saved as {got}, but the model's layer takes "
            f"{ {p: s for p, s in expected.items()} } (torch layout)")))
    torch_weight = given["weight"] if found.transposed else given["weight"].T
    new_weight = np.array(weight)
    flat = new_weight.reshape((-1, *new_weight.shape[-2:]))
    flat[i] = torch_weight[found.positions].T.astype(new_weight.dtype)
    out = {"weight": jnp.asarray(new_weight)}
    if bias is not None:
        new_bias = np.array(bias)
        new_bias.reshape((-1, new_bias.shape[-1]))[i] = given["bias"][found.positions].astype(new_bias.dtype)
        out["bias"] = jnp.asarray(new_bias)
    return node.replace(**out)
