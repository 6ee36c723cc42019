"""Hugging Face language models in one call: :func:`from_hf` and :func:`to_hf_state_dict`.

``from_hf`` reads an HF config (``model_type`` and sizes), picks the model type's
class in :data:`FAMILIES`, builds its model of :mod:`functree.hf._models` as an
abstract template (``jax.eval_shape``: no random init) and fills it from the weights through
:func:`ft.nn.load_torch_state_dict` with the model class's ``rename=`` and ``layouts=``.
A family is one class (:mod:`functree.hf._family`): its HF class, its builder reading the
config, its tied head's names and the older checkpoint names HF's loader renames are class
variables and class methods of the model class; :data:`FAMILIES` maps each model type to it. ``transformers``
is never imported (a ``config.json``, as a dict or a directory's, is read by
:mod:`functree.hf._files` with HF's defaults); torch only where the weights are torch tensors.
"""

from __future__ import annotations

import collections
import copy
import math
import os
import re
import threading
from collections.abc import Mapping
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from functree._files import local_if_path
from functree._jit import unchecked_jit
from functree._module import Module
from functree._naming import matches
from functree._random import normal_runs, one_key
from functree._state_dict import FlatDictReport, to_numpy
from functree._tree import dotted_name, join_names, written_dtype
from functree._warnings import warn
from functree.hf import _models  # noqa: F401  (defines every covered family: FAMILIES)
from functree.hf._causal import CausalLM, is_tied, padding_index
from functree.hf._config import HFConfig, hf_config_of
from functree.hf._dropout import check_dropout_call, with_dropout
from functree.hf._family import COVERED, FAMILIES, TASKS, HFModel, family_of, renamed
from functree.hf._files import (
    ALIASES,
    DEFAULTS,
    Config,
    check_metadata_copies,
    dtype_name,
    missing_tensors,
    not_floating,
    prefixed,
    read_config,
    read_weights,
    refuse_quantized,
)
from functree.hf._heads import (  # (defines TASKS)
    check_body_name,
    check_head_missing,
    check_head_tensors,
    check_tied_copies,
    tied_copies,
    with_head_dropout,
)
from functree.hf._options import causal
from functree.interop._ports import PORTS, Port
from functree.interop._safetensors import INDEX_NAME, SINGLE_NAME
from functree.interop._torch import ShortStack, as_tensors, load_by_rules, state_dict_by_rules
from functree.nn._abstract import shapes_only
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense

__all__ = ["from_hf", "to_hf_state_dict", "FAMILIES", "COVERED", "UnreadTensorsWarning", "UNREAD_TENSORS"]

UNCOVERED_ARCHITECTURE = """\
ft.nn.from_hf: {given} is not covered; covered: {covered}.
Port other models by hand from ft.nn layers and ft.nn.load_torch_state_dict (docs/guides/huggingface.md).

    right:  model = MyModel(...)      # ft.nn layers named as the HF model's modules
            model = ft.nn.load_torch_state_dict(model, hf_model.state_dict(), rename=..., layouts=...)
"""

GEMMA3_MULTIMODAL = """\
ft.nn.from_hf: {given} is Gemma 3's image-and-text model (Hugging Face's \
Gemma3ForConditionalGeneration: a SigLIP vision tower, a projector and Gemma 3's text model); \
functree ports the text model alone (model_type 'gemma3_text', Gemma3ForCausalLM). Its \
weights are the checkpoint's model.language_model.* (the head tied to their embedding), its \
config the config's text_config; the image-and-text model applies no final_logit_softcapping, \
so it is dropped to give its logits for text without images.

    wrong:  ft.nn.from_hf(hf_model)          # Gemma3ForConditionalGeneration, its directory or its config
    right:  text = {{k.replace("model.language_model.", "model.", 1): v
                    for k, v in hf_model.state_dict().items() if k.startswith("model.language_model.")}}
            config = {{**hf_model.config.text_config.to_dict(), "final_logit_softcapping": None}}
            model = ft.nn.from_hf(config, text)    # Gemma3ForCausalLM
"""

UNCOVERED_CLASS = """\
ft.nn.from_hf: {given} is not covered; of its model type functree covers {covered} (all \
covered: {all}). A task model's body is covered where its class is (BertModel inside \
BertForMaskedLM as hf_model.bert); its other layers are yours to add. {how}

    wrong:  ft.nn.from_hf(hf_model)          # a {given}
    right:  {right}
"""

# The right: line of UNCOVERED_CLASS for an instance: its own body (weights and all) where
# the body is the covered class; else the checkpoint read into the covered class (a fresh
# {covered}(config) would be a random model).
UNCOVERED_BODY = "hf_model.{prefix} is a {covered} with the model's own weights:"
PEFT_LAYERS = """\
ft.nn.from_hf: {given} holds PEFT LoRA layers ({names}, ...), not a plain {hf_class}'s \
weights. Merge the adapter into the weights with PEFT, or keep it apart (trainable) with \
ft.nn.load_lora, which reads a PEFT adapter directory onto the base model.

    wrong:  ft.nn.from_hf({wrong})
    right:  ft.nn.from_hf(peft_model.merge_and_unload())                        # the adapter merged
       or:  peft_model.save_pretrained("adapter")                                # first: unload() drops it
            model = ft.nn.load_lora(ft.nn.from_hf(peft_model.unload()), "adapter")   # a LoRA model
"""

UNCOVERED_OTHER = "Read its checkpoint into the covered class (the layers both have are the checkpoint's):"


BAD_ATTENTION = """\
ft.nn.from_hf: attention= is "auto", "xla" or "cudnn" (the implementation of every \
ft.nn.MultiheadAttention the model builds), got {given!r}.

    right:  ft.nn.from_hf(source, attention="auto")    # cuDNN flash attention where it applies, else XLA
"""

TIED_HEAD_DIFFERS = """\
ft.nn.from_hf: the config ties the output head to the embedding (tie_word_embeddings=True), \
but the weights' {head!r} differs from {embedding!r} by up to {difference:.3g}. Which one \
a tied model should use is ambiguous (transformers' versions differ: 5.x loads both and \
unties them, older ones tie the head to the embedding); functree stores one tensor and \
does not guess.

    right:  config.tie_word_embeddings = False   # an untied head: both tensors kept
       or:  del weights[{head!r}]                # the embedding for both
"""

BAD_DTYPE = """\
ft.nn.from_hf: dtype is the parameters' floating dtype (jnp.float32, jnp.bfloat16, \
jnp.float16), got {given}. Integer parameters cannot be trained or initialized; quantize \
after loading if that is the aim.

    wrong:  ft.nn.from_hf(source, dtype={given})
    right:  ft.nn.from_hf(source, dtype=jnp.bfloat16)
"""

NEEDS_WEIGHTS_OR_KEY = """\
ft.nn.from_hf: a {model_type} config without weights builds a freshly initialized model and \
needs a PRNG key for it.

    wrong:  ft.nn.from_hf(config)
    right:  ft.nn.from_hf(config, "model.safetensors")        # or a state dict
       or:  ft.nn.from_hf(config, key=jax.random.key(0))      # random init
"""

KEY_OR_WEIGHTS = """\
ft.nn.from_hf({source!r}, key=key): the directory holds weights, and a key without \
dropout=True would build a freshly initialized model from its config alone, leaving the \
weights unread. Say which one you mean:

    wrong:  ft.nn.from_hf({source!r}, key=key)
    right:  ft.nn.from_hf({source!r})                                  # its weights
       or:  ft.nn.from_hf({source!r}, dropout=True, key=key)           # its weights, HF's dropout
       or:  ft.nn.from_hf(ft.nn.from_hf({source!r}).hf_config.to_dict(), key=key)   # a fresh model
"""

PAD_OUTSIDE_VOCABULARY = """\
ft.nn.from_hf: the config's pad_token_id is {pad}{default}, outside its vocabulary (vocab_size {vocab}: \
ids 0 to {last}, or -{vocab} to -1 counted from the end). {hf_class} builds its token \
embedding with padding_idx=pad_token_id, and Hugging Face refuses this config too (its \
from_config and from_pretrained: torch's "Padding_idx must be within num_embeddings").

    wrong:  "vocab_size": {vocab}, "pad_token_id": {pad}
    right:  "vocab_size": {vocab}, "pad_token_id": null    # no padding row (pass generate a pad_token_id)
       or:  "vocab_size": {vocab}, "pad_token_id": {inside}    # an id in the table (the eos token's, or 0)
       or:  "vocab_size": {grown}, "pad_token_id": {pad}    # a row for it (a fresh model; weights need it too)
"""

OUT_OF_RANGE = """\
ft.nn.from_hf: the weights' {tensor!r} ({given}, shape {shape}) holds {value!r}, beyond {dtype}'s \
largest finite value ({largest!r}): read as dtype={dtype} it would be inf, and every logit it \
reaches inf or nan, where the file holds a finite number (transformers computes in the \
file's {given} where config.json names no dtype); nothing was built.

    wrong:  ft.nn.from_hf(source, dtype=jnp.{dtype})   # {tensor!r} overflows
    right:  jax.config.update("jax_enable_x64", True); ft.nn.from_hf(source, dtype=jnp.float64)
       or:  rescale or clip {tensor!r} in the checkpoint (its values are meant to fit {dtype})
"""

_WIDER = {"float64": ("float32", "bfloat16", "float16"), "float32": ("float16",), "bfloat16": ("float16",)}


def _check_range(weights: Mapping[str, Any], dtype: Any) -> None:
    """:data:`OUT_OF_RANGE` where a finite floating value in ``weights`` overflows ``dtype``
    (a float64 file read as float32, a float32 or bfloat16 one as float16). Only tensors whose
    dtype has a wider range than ``dtype`` are scanned: none for the usual files."""
    target = np.dtype(dtype).name
    largest = float(jnp.finfo(dtype).max)
    for name, value in weights.items():
        given = dtype_name(value)
        if target not in _WIDER.get(given, ()):
            continue
        array = _array(value).astype(np.float64)
        finite = array[np.isfinite(array)]
        if finite.size and float(np.abs(finite).max()) > largest:
            raise ValueError(OUT_OF_RANGE.format(tensor=name, given=given, shape=tuple(array.shape),
                                                 value=float(finite[np.argmax(np.abs(finite))]),
                                                 dtype=target, largest=largest))


# The files a save_pretrained directory holds its weights in (read_weights reads them).
_WEIGHT_FILES = (SINGLE_NAME, INDEX_NAME, "pytorch_model.bin", "pytorch_model.bin.index.json")  # a .bin: read_weights names torch.load


def _holds_weights(source: Any, key: Any, dropout: bool) -> bool:
    """Whether ``from_hf(source, key=key)`` reads ``source``'s weights: a directory does
    when it holds them; with a key and a config alone it builds a fresh model (dropout or
    not). A key without dropout beside weights is :data:`KEY_OR_WEIGHTS`."""
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        return False
    if key is None:
        return True
    held = any(os.path.exists(os.path.join(source, name)) for name in _WEIGHT_FILES)
    if held and not dropout:
        raise ValueError(KEY_OR_WEIGHTS.format(source=os.fspath(source)))
    return held


NOT_A_PORT = """\
ft.nn.to_hf_state_dict takes a model built by ft.nn.from_hf ({covered}); got {given}. \
For other models: ft.nn.torch_state_dict(model, rename=..., layouts=...) (a from_hf model \
inside one is written in Hugging Face's names under its attribute, as torch's state_dict())."""

TIED_HEAD_DIFFERS_LOADED = """\
ft.nn.load_torch_state_dict: {port} ties its output head to the embedding (built from a \
config with tie_word_embeddings=True: one tensor), but the state dict's {head!r} differs from \
{embedding!r} by up to {difference:.3g}. Loading one of them would silently drop the other \
(ft.nn.from_hf refuses the same weights).

    right:  del state_dict[{head!r}]                  # the embedding for both
       or:  model = ft.nn.from_hf(config, state_dict)  # with config.tie_word_embeddings = False: an untied head"""

WEIGHTS_DO_NOT_FIT = """\
ft.nn.from_hf: the weights do not fit the {hf_class} its config builds (names as the weights \
spell them).
{report}
{fix}"""

# WEIGHTS_DO_NOT_FIT's fix where tensors are left over: another model's (a task head the
# family's hf_unread does not name). transformers' {hf_class}.from_pretrained skips them with a
# warning; from_hf reads every other tensor it is given (one left over may as well be a layer the
# config lacks), so they are dropped by the caller.
EXTRA_TENSORS_FIX = """The weights hold tensors the {hf_class} has not: {extra}. If they are another model's (a task \
head), leave them out; if they are this model's, the config is not the weights' own.

    wrong:  ft.nn.from_hf({call})
    right:  {load}weights = {{k: v for k, v in weights.items() if {test}}}
            model = ft.nn.from_hf({config}, weights)
       or:  model = ft.nn.from_hf(transformers.{hf_class}.from_pretrained({path}))   # transformers drops them, warning"""

# WEIGHTS_DO_NOT_FIT's fix where tensors are missing or mis-shaped: the config and the weights
# describe different models.
OTHER_MODEL_FIX = """The {hf_class} the config describes differs from the weights' (missing or mis-shaped tensors \
above): give the config saved with these weights.

    right:  ft.nn.from_hf(config, weights)   # config.json of the same save_pretrained directory"""

LAYERS_NOT_IN_WEIGHTS = """\
ft.nn.from_hf: the config builds {length} layers ({torch}.0 to {torch}.{last}, the model's {ft}), but \
the weights hold {held}. The config does not describe these weights: a config.json \
edited, or another model's. Nothing was built.

    wrong:  "{key}": {length}
    right:  "{key}": {count}     # or the config.json saved with these weights"""

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


def _loading(given: Any) -> str:
    """EXTRA_TENSORS_FIX's line reading ``weights`` where from_hf was given a file's path: one
    ``.safetensors`` file (a directory's) with safetensors' own reader (bfloat16 too)."""
    if not isinstance(given, (str, os.PathLike)):
        return ""  # the state dict given
    single = os.path.join(given, SINGLE_NAME) if os.path.isdir(given) else os.fspath(given)
    if not (single.endswith(".safetensors") and os.path.isfile(single)):
        return "weights = ...   # the checkpoint's state dict (every shard's tensors)\n            "
    return f"weights = safetensors.torch.load_file({single!r})\n            "


# WEIGHTS_DO_NOT_FIT's fix where the tensors left over are a quantized checkpoint's (its
# config's quantization_config dropped or not given): dropping them, EXTRA_TENSORS_FIX's fix,
# would read float8 weights without their scales as the weights (another model, silently).
QUANTIZED_TENSORS_FIX = """The weights hold a quantized checkpoint's tensors ({extra}: scales, zero points or packed \
words beside the weights). Read without them the weights are not the model's, so do not leave them out: \
the checkpoint's config.json names its quantization_config, which ft.nn.from_hf refuses.

    right:  ft.nn.from_hf("path/to/the/unquantized/checkpoint")   # the float16/bfloat16/float32 original
       or:  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path)
            hf_model.dequantize()                    # where its quantizer can
            model = ft.nn.from_hf(hf_model)"""

# The names quantizers give the tensors beside (or instead of) a weight: transformers' fp8,
# fbgemm and compressed-tensors scales, GPTQ/AWQ's packed words, bitsandbytes' statistics, MLX's.
_QUANTIZER_TENSOR = re.compile(r".*\.(weight_scale|weight_scale_inv|input_scale|output_scale|weight_zero_point|"
                               r"weight_packed|weight_shape|qweight|qzeros|scales|biases|g_idx|SCB|weight_format|"
                               r"absmax|quant_map|nested_absmax|nested_quant_map|quant_state\..*)")


def _weights_do_not_fit(hf_class: str, report: FlatDictReport, weights: Mapping[str, Any], source: Any,
                        given: Any) -> ValueError:
    """:data:`WEIGHTS_DO_NOT_FIT` with the fix from_hf's caller has: drop the tensors left
    over (by their first name part where no tensor the model reads shares it, else by name),
    or give the weights' own config; a quantized checkpoint's tensors left over are not to be
    dropped (:data:`QUANTIZED_TENSORS_FIX`)."""
    fixes = []
    quantizer = sorted(n for n in report.unexpected if _QUANTIZER_TENSOR.fullmatch(n))
    if quantizer:
        fixes.append(QUANTIZED_TENSORS_FIX.format(extra=quantizer[:3] + (["..."] if len(quantizer) > 3 else [])))
    elif report.unexpected:
        extra = set(report.unexpected)
        kept = [k for k in weights if k not in extra]
        heads = sorted({n.split(".")[0] + "." for n in extra})
        if all("." in n for n in extra) and not any(k.startswith(tuple(heads)) for k in kept):
            test = f"not k.startswith({tuple(heads)!r})"
        else:
            test = f"k not in {sorted(extra)!r}"
        path = repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "path"
        fixes.append(EXTRA_TENSORS_FIX.format(
            hf_class=hf_class, extra=sorted(extra)[:4] + (["..."] if len(extra) > 4 else []), test=test,
            call=path if given is source else "config, weights", config=path if given is source else "config",
            load=_loading(given), path=path))
    if report.missing or report.mismatched:
        fixes.append(OTHER_MODEL_FIX.format(hf_class=hf_class))
    return ValueError(WEIGHTS_DO_NOT_FIT.format(hf_class=hf_class, report=report, fix="\n".join(fixes)))


def _refuse_peft_layers(weights: Mapping[str, Any], given: str, wrong: str, hf_class: str) -> None:
    """Raise :data:`PEFT_LAYERS` where ``weights`` are a PEFT-wrapped model's (``q_proj.base_layer``,
    ``q_proj.lora_A.default``): no tensor of them should be dropped or renamed by hand."""
    names = [k for k in weights if ".base_layer." in k or ".lora_" in k]
    if names:
        raise ValueError(PEFT_LAYERS.format(given=given, names=", ".join(names[:2]), hf_class=hf_class, wrong=wrong))


def _hf_class_of(source: Any, model_type: str) -> str:
    """The HF class of a model given to from_hf (a PeftModel's or a LoraModel's: the model
    inside it), where it is a task class (``LlamaForSequenceClassification``); else the
    family's covered class."""
    inner = [source, getattr(source, "model", None)]
    if callable(getattr(source, "get_base_model", None)):  # a PeftModel
        inner.append(source.get_base_model())
    return next((type(x).__name__ for x in inner if type(x).__name__ in TASKS), COVERED[model_type])


def _task_of(config: Any, named: str | None, family: type[HFModel]) -> type[HFModel]:
    """The class from_hf builds: the HF model's own where it is a task class of the family
    (``named``: its class name), else a task class the config's ``architectures`` name
    where they do not name the family's own class (a ``save_pretrained`` directory's), else
    the family (:mod:`functree.hf._heads`)."""
    listed = getattr(config, "architectures", None)
    if named is not None:
        names = [named]
    elif isinstance(listed, (list, tuple)) and family.hf_class not in listed:
        names = list(listed)
    else:
        names = []
    for name in names:
        task = TASKS.get(name) if isinstance(name, str) else None
        if task is not None and task.model_type == family.model_type:
            return task
    return family


def _normalized(model_type: str, weights: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpoint names as the covered class's ``state_dict`` has them, as HF's loader reads
    older files (each family's ``names``)."""
    return FAMILIES[model_type].hf_names(dict(weights))


def _array(x: Any) -> np.ndarray:
    converted = to_numpy(x)
    return np.asarray(x) if converted is None else converted


def tied_head(family: type[HFModel], model: Any) -> tuple[str, str] | None:
    """A tied model's ``(head, embedding)`` weight names (it has no ``lm_head`` weight of its
    own: None, or Phi's :class:`~functree.hf._causal.TiedBias`), else None."""
    return family.hf_head if is_tied(getattr(model, "lm_head", True)) else None


def _untie(family: type[HFModel], model: Any, weights: Mapping[str, Any], prefix: str | None = None
           ) -> dict[str, Any]:
    """The weights without a tied head's copy of the embedding (checked equal to it; else
    :data:`TIED_HEAD_DIFFERS`, or with ``prefix``, the port's place in a model given to
    ``load_torch_state_dict``, :data:`TIED_HEAD_DIFFERS_LOADED`), and without the other tied
    copies ``model`` has (BERT's masked LM: :func:`~functree.hf._heads.check_tied_copies`)."""
    weights = check_tied_copies(family, model, dict(weights))  # (BERT's masked LM: its decoder's copies)
    tied = tied_head(family, model)
    if tied is None:
        return weights
    head, embedding = tied
    if head in weights and embedding in weights:
        given, stored = _array(weights.pop(head)), _array(weights[embedding])
        if given.shape != stored.shape or not np.array_equal(given, stored):
            difference = float(np.abs(given.astype(np.float64) - stored.astype(np.float64)).max()) \
                if given.shape == stored.shape else math.inf
            if prefix is None:
                raise ValueError(TIED_HEAD_DIFFERS.format(head=head, embedding=embedding, difference=difference))
            port = f"{prefix!r} ({family.__name__})" if prefix else f"the model ({family.__name__})"
            raise ValueError(TIED_HEAD_DIFFERS_LOADED.format(port=port, head=join_names(prefix, head),
                                                             embedding=join_names(prefix, embedding),
                                                             difference=difference))
    elif head in weights:  # only the head given (a file that stored the tie under the head's name)
        weights[embedding] = weights.pop(head)
    return weights


def _hf_initialized(family: type[HFModel], model: Any, config: Any, key: jax.Array) -> Any:
    """``model`` with Hugging Face's initialization (its ``_init_weights``), as
    ``family.hf_class(config)`` starts training from scratch: every weight matrix (linear,
    Conv1D, embedding) ``normal(0, initializer_range)`` (OPT: ``init_std``), the family's
    residual projections (GPT-2's ``c_proj``) ``/ sqrt(2 * n_layer)``, biases zero, the
    padding id's embedding row zero (a negative id wrapped, as torch's ``padding_idx``: -1 is
    the last row), norms as built (scale 1, Gemma's offset 0). Independent normal draws are
    the same whatever the layout, so each ``Dense`` and ``Embedding`` is drawn as it is
    (fused or split projections, stacked layers), sliced from a few flat runs of draws
    (:func:`~functree._random.normal_runs`: one hash to compile, not one an array); it
    traces (``jax.jit`` of a build)."""
    std = next((float(v) for v in (getattr(config, "initializer_range", None), getattr(config, "init_std", None))
                if v is not None), 0.02)
    pad = getattr(config, "pad_token_id", None)
    padded = {p.removesuffix(".weight") for p in (family.hf_padded, *family.hf_padded_also) if p}  # HF's names kept

    nodes, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, (Dense, Embedding)))
    drawn = [node.embeddings if isinstance(node, Embedding) else node.weight for _, node in nodes
             if isinstance(node, (Dense, Embedding))]
    wide = jnp.float64 if any(like.dtype == jnp.float64 for like in drawn) else jnp.float32  # (x64: float64's digits)
    draws = iter(normal_runs(key, [like.shape for like in drawn], wide))  # functree/_random.py: one hash, few compiles

    def normal(like: jax.Array, scale: float) -> jax.Array:
        return (scale * next(draws)).astype(like.dtype)

    def fresh(path: Any, node: Any) -> Any:
        name = dotted_name(path)
        if isinstance(node, Embedding):
            table = normal(node.embeddings, std)
            row = padding_index(pad, table.shape[0]) if name in padded else None
            if row is not None:
                table = table.at[row].set(0)
            return node.replace(embeddings=table)
        if isinstance(node, Dense):
            residual = any(matches(name, pattern) for pattern in family.hf_residual)
            scale = std / math.sqrt(2 * config.num_hidden_layers) if residual else std
            bias = None if node.bias is None else jnp.zeros_like(node.bias)
            return node.replace(weight=normal(node.weight, scale), bias=bias)
        return node  # a norm's leaf: as built

    return treedef.unflatten([fresh(path, node) for path, node in nodes])


def _from_config(family: type[HFModel], config: Any, values: HFConfig, dtype: Any, key: jax.Array,
                 attention: str) -> Any:
    """The model built and initialized as HF does (:func:`_hf_initialized`), as one
    compiled program: run op by op, each operation compiled on its own (47 programs for a
    2-layer Llama, each a GPU compile) and every layer's default initialization drawn
    only to be replaced (12 layers at d=256, vocabulary 32000: 32 s on a 2-core CPU, 17 s
    as one program). Leaves that are not arrays stay Python values (``static_leaves``).

    The program is kept per configuration (:data:`_BUILDS`, keyed by ``values``, the
    config's :class:`HFConfig`): building the same config again
    (another key, a notebook cell run again, a teacher and a student) runs it without a
    trace or a compile (a 2-layer Llama: 2.4 CPU-s a build before, on a 2-core CPU)."""
    signature = (family, values, repr(dtype), attention)  # what the build reads
    with _BUILDS_LOCK:  # (models built in threads)
        program = _BUILDS.get(signature)
        if program is None:
            # (a later trace must not read the caller's HF config changed since; config.json's is read-only)
            kept = config if isinstance(config, Config) else copy.deepcopy(config)

            def build(key: jax.Array) -> Any:
                built = family.from_config(kept, {"pooler.dense.weight"}, dtype, jax.random.fold_in(key, 1), attention)
                return family.hf_initial(_hf_initialized(family, built, kept, key), kept)

            program = _BUILDS[signature] = unchecked_jit(build, static_leaves=True)
            while len(_BUILDS) > _KEPT_BUILDS:  # the least recently built goes (its program with it)
                del _BUILDS[next(iter(_BUILDS))]
        else:
            _BUILDS.move_to_end(signature)
    return program(key)


# (family, the config's values, dtype, attention) -> its jitted build: equal configs build
# the same model (the builders read nothing but the config's values), so they share it.
_BUILDS: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
_BUILDS_LOCK = threading.Lock()
_KEPT_BUILDS = 16


def _template(family: type[HFModel], config: Any, names: set[str], dtype: Any, attention: str) -> Any:
    """The model ``family`` builds from ``config``, its leaves ``jax.ShapeDtypeStruct``s: its
    construction traced (``jax.eval_shape``), the initializers' draws skipped
    (:func:`functree.nn._abstract.shapes_only`: a quarter of the tracing), nothing compiled."""
    with shapes_only():
        return jax.eval_shape(lambda: family.from_config(config, names, dtype, jax.random.key(0), attention))


def _check_dtype(dtype: Any) -> None:
    """A floating dtype, or :data:`BAD_DTYPE` at the call (not deep inside the initialization)."""
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(BAD_DTYPE.format(given=written_dtype(dtype)))


def _covered() -> str:
    return ", ".join(f"{k} ({v})" for k, v in COVERED.items())


def from_hf(source: Any, weights: Any = None, *, dtype: Any = jnp.float32, key: jax.Array | None = None,
            attention: str = "auto", dropout: bool = False) -> Any:
    """A Hugging Face language model as a functree model, its weights loaded.

    ``from_hf(hf_model)`` takes an HF torch model of a covered family (:data:`FAMILIES`):
    ``GPT2LMHeadModel``; ``LlamaForCausalLM`` (grouped-query attention, tied or untied head,
    attention/MLP biases, ``head_dim``, rope types ``default``, ``linear``, ``dynamic``,
    ``yarn``, ``llama3``: :class:`ft.nn.RopeScaling`) and the families built like it,
    ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5), ``MistralForCausalLM`` (sliding-window attention),
    ``GemmaForCausalLM``, ``Phi3ForCausalLM`` (fused ``qkv_proj`` / ``gate_up_proj``) and
    ``OlmoForCausalLM`` (LayerNorm without weight or bias), ``Qwen3ForCausalLM`` (RMSNorm over
    each head's queries and keys), ``Olmo2ForCausalLM`` (norms after the sublayers, RMSNorm
    over the whole query and key projections), ``Gemma2ForCausalLM`` (attention and final
    logit soft-caps, alternating sliding and full layers, norms around each sublayer) and
    ``Gemma3ForCausalLM`` (Gemma 3's text model: Gemma 2's blocks, per-head q/k norms, each
    layer type its own rope);
    ``GPTNeoXForCausalLM`` (Pythia: parallel residual, partial rotary); ``OPTForCausalLM``;
    ``BertModel``. ``from_hf(directory)`` reads a ``save_pretrained`` directory
    (``config.json`` and ``model.safetensors`` or a sharded ``model.safetensors.index.json``);
    ``from_hf(config, weights)`` takes its config (an HF config, or a ``config.json`` dict)
    and a state dict (torch tensors or NumPy arrays), a ``.safetensors`` file, an index or a
    directory (read without torch, one tensor at a time from memory-mapped files: bfloat16
    files too). Parameters are cast to ``dtype``, a floating dtype (float32, bfloat16,
    float16: float16 runs on a CPU too; an integer dtype is refused at the call).
    ``partial_rotary_factor`` is read as each HF class reads it: GPT-NeoX and Phi-3 rotate
    that part of each head; Llama, Qwen2, Mistral and Gemma the whole head with the default
    rope (a config with another rope type and a factor is refused: HF's forward fails on it).
    Older checkpoint names read as HF's
    loader reads them (GPT-2's body without ``transformer.`` and its mask buffers; BERT's
    ``bert.`` prefix and LayerNorm ``gamma``/``beta``; GPT-NeoX's ``embed_out``; OPT's
    ``decoder.`` without ``model.``). The heads a family's checkpoints carry beside the class
    loaded (bert-base-uncased's pooler and next-sentence head in its masked LM's file,
    roberta-base's pooler: the family's ``hf_unread``) are left unread, as transformers'
    loader leaves them, with :class:`UnreadTensorsWarning` naming them; any other tensor
    the model has not is refused (it may be a layer the config lacks). A directory whose ``config.json`` names only uncovered task classes in
    ``architectures`` (``Qwen2ForSequenceClassification``) is refused naming its body, the
    part functree ports; another covered family's class there (a llama file naming
    ``MistralForCausalLM``) builds the model type's class, as ``AutoModelForCausalLM`` does.
    ``from_hf(config, key=key)`` without weights builds the model with
    Hugging Face's initialization, as ``AutoModelForCausalLM.from_config(config)`` does (to
    train from scratch): weight matrices and embeddings ``normal(0, initializer_range)``,
    GPT-2's residual projections scaled by ``1 / sqrt(2 * n_layer)``, biases zero, the
    padding id's embedding row zero, norms the identity (a ``pad_token_id`` outside the
    vocabulary is refused where HF refuses it: the families whose embedding has a padding
    row, all but GPT-2 and GPT-NeoX). ``attention`` ("auto",
    "xla" or "cudnn") is the ``implementation`` of every ``ft.nn.MultiheadAttention`` built.
    ``dropout=True`` (with ``key=``, the masks' keys) applies Hugging Face's dropout at the
    config's rates where HF's modules do, in training mode only (``functree.hf._dropout``);
    the default builds no dropout.

    The model (the classes of ``functree.hf._models``) is made of ordinary ``ft.nn``
    layers, its blocks an ``ft.nn.Stack``, HF's parameter names kept
    (``model.layers.3.mlp.up_proj.weight``; inside ``ft.nn`` layers their own names:
    ``self_attn.query_projection`` for ``self_attn.q_proj``, a norm's ``scale`` for
    ``weight``). ``model(input_ids, attention_mask=None)`` gives the logits ``[batch, T,
    vocab]`` (BERT: the last hidden state). A token id outside the vocabulary and more tokens
    than a learned position table holds raise (under a jit of your own, where ids are traced,
    such a token's logits are NaN instead). A config functree does not cover (a model type, a
    rope type, an option) and weights that do not fit the config raise, naming what was given.
    The model carries its config: ``model.hf_config`` (``config.json``'s values, immutable
    and hashable, the generation config as ``model.hf_config.generation``), which
    :func:`ft.nn.save_hf` writes back.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2,
      ...           "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
      >>> fresh = ft.nn.from_hf(config, key=jax.random.key(0))     # no weights: HF's initialization
      >>> weights = ft.nn.to_hf_state_dict(fresh, numpy=True)        # as HF's GPT2LMHeadModel names them
      >>> model = ft.nn.from_hf(config, weights)
      >>> model(np.zeros((1, 5), np.int32)).shape
      (1, 5, 11)
      >>> len(model.transformer.h), sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(weights)
      (2, True)
      >>> model.hf_config["n_head"], model.hf_config["model_type"]
      (2, 'gpt2')
    """
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(BAD_ATTENTION.format(given=attention))
    _check_dtype(dtype)
    same = weights is source  # (from_hf(path, path): one object stays one)
    source = local_if_path(source, "ft.nn.from_hf")  # "~/models/m": the home's, not ./~
    weights = source if same else local_if_path(weights, "ft.nn.from_hf")
    check_dropout_call(source, weights, dropout, key)
    if key is not None:  # an integer seed, a whole split: named here, not inside the build's fold_in
        one_key(key)
    named = None  # the HF model's class, where from_hf is given one
    if weights is None and hasattr(source, "config") and hasattr(source, "state_dict"):
        config, weights = source.config, source.state_dict()
        model_type = getattr(config, "model_type", None)
        if isinstance(model_type, str) and model_type in COVERED:  # a PeftModel, or the model inside it: PEFT's layers, not a covered class's
            _refuse_peft_layers(weights, f"the {type(source).__name__} given", "hf_model", _hf_class_of(source, model_type))
        if isinstance(model_type, str) and model_type in COVERED and type(source).__name__ != COVERED[model_type] \
                and type(source).__name__ not in TASKS:  # a task class of its own (LlamaForSequenceClassification)
            raise _uncovered_class(source, COVERED[model_type])
        named = type(source).__name__
    else:
        if weights is None and _holds_weights(source, key, dropout):
            weights = source  # a save_pretrained directory: its config and its weights
        config = read_config(source)
        if weights is source:  # the directory's own weights: its config.json names their class
            _check_architectures(config, source)
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":  # the text model inside it is covered: named, with the way to it
        raise ValueError(GEMMA3_MULTIMODAL.format(given="model_type 'gemma3'"))
    if model_type not in FAMILIES:
        raise ValueError(UNCOVERED_ARCHITECTURE.format(given=f"model_type {model_type!r}", covered=_covered()))
    family = _task_of(config, named, FAMILIES[model_type])
    refuse_quantized(config)  # quantized weights read as floats would be another model
    if issubclass(getattr(family, "body_class", family), CausalLM):  # a config that makes HF's masks bidirectional
        causal(config, family.hf_class)
    _check_pad_token(family, config)
    carried = hf_config_of(config, source)
    if weights is None:
        if key is None:
            raise ValueError(NEEDS_WEIGHTS_OR_KEY.format(model_type=model_type))
        built = _from_config(family, config, carried, dtype, key, attention).replace(hf_config=carried)
        return with_head_dropout(with_dropout(built, config, dropout, key), config, dropout)
    given = weights
    weights = family.hf_names(_base_stripped(family, dict(read_weights(weights))))  # older names as the class's state_dict has them
    check_body_name(family, weights)  # (Llama's QA body is transformer.*: a causal LM's model.* is not it)
    template = _template(family, config, set(weights), dtype, attention)
    added = _base_added(family, template, weights)  # (layers.0... beside model.embed_tokens: per name, as HF)
    if added is not weights:
        weights = added
        template = _template(family, config, set(weights), dtype, attention)
    tied = tied_head(family, template)
    check_metadata_copies(given, weights, (*([tied] if tied else []), *tied_copies(family, template)), family.hf_class,
                          family.hf_head[0] if family.hf_head else None, _loading(given))
    _check_range(weights, dtype)  # (a float64 file's value past float32: inf, where transformers' is finite)
    weights = _untie(family, template, weights)
    cls = type(template)
    try:
        model, report = load_by_rules(template, weights, rename=cls.hf_rename, layouts=cls.hf_layouts, strict=False,
                                      given_names=True, complete=True)
    except ShortStack as e:  # found in the weights' names alone: no layer walked, no array built
        _refuse_peft_layers(weights, "the state dict given", "config, weights", family.hf_class)  # (under base_model.model.)
        wrapped = prefixed(family.hf_class, weights, e.torch, _loading(given))  # (base_model.model.model.layers.0 ...)
        if wrapped is not None:
            raise wrapped from None
        # (a task model's body under a name of its own, Llama's QA transformer.*: its class, not a layer count)
        check_head_tensors(family, config, _foreign(cls, weights),
                           fits=lambda task: _fits(task, config, given, dtype, attention))
        raise _layers_not_in_weights(e, config) from None
    if not report.ok:  # the fixes from_hf's caller has (load_torch_state_dict's rename= and strict= it has not)
        _refuse_peft_layers(weights, "the state dict given", "config, weights", family.hf_class)
        if not any(_QUANTIZER_TENSOR.fullmatch(n) for n in report.unexpected):  # (else a quantized checkpoint's)
            integers = not_floating(family.hf_class, weights, report.unexpected, report.mismatched, _loading(given))
            if integers is not None:
                raise integers
        check_head_tensors(family, config, report.unexpected,  # a task model's weights, its class not named
                           fits=lambda task: _fits(task, config, given, dtype, attention))
        check_head_missing(family, config, report.missing, report.unexpected)  # a body's checkpoint: with_head
        if not _unread_heads(family, report):
            explained = missing_tensors(family, template, list(report.missing), list(report.unexpected), given,
                                         None if report.mismatched else weights)  # (a layer's tensor lost)
            raise explained or _weights_do_not_fit(family.hf_class, report, weights, source, given)
    model = family.hf_values(model, config)  # the template's non-weight leaves (abstract) set from the config
    return with_head_dropout(with_dropout(model.replace(hf_config=carried), config, dropout, key), config, dropout)


class UnreadTensorsWarning(UserWarning):
    """``ft.nn.from_hf`` left tensors of the checkpoint unread: heads of the family's other
    classes (:data:`UNREAD_TENSORS`), as transformers' loader leaves them."""


UNREAD_TENSORS = """\
ft.nn.from_hf: left unread {count} tensor(s) of heads the {hf_class} has not: {names}, as \
transformers' {hf_class}.from_pretrained leaves them (its load report lists them as \
unexpected); every tensor of the model was read. Checkpoints saved for pre-training carry \
them (bert-base-uncased's next-sentence head and pooler beside its masked-LM head).

    silence it:  warnings.filterwarnings("ignore", category=ft.hf.UnreadTensorsWarning)
"""

POOLER_UNREAD = """The pooler is a classifier's input: ft.hf.with_head reads it from the directory, as HF's \
AutoModelForSequenceClassification.from_pretrained(directory) does (given this model, it \
can only draw a fresh one).

    right:  ft.hf.with_head(directory, "ForSequenceClassification", num_labels=n, key=key)
"""


def _unread_heads(family: type[HFModel], report: FlatDictReport) -> bool:
    """Whether the only tensors ``report`` has left over are heads of the family's other
    classes (its ``hf_unread`` name prefixes) and nothing is missing or mismatched: then
    they are left unread, saying so (:class:`UnreadTensorsWarning`). Any other tensor left
    over may be a layer the config lacks: the caller refuses the weights."""
    prefixes = getattr(family, "body_class", family).hf_unread
    extra = report.unexpected
    if report.missing or report.mismatched or not extra or not all(n.startswith(prefixes) for n in extra):
        return False
    names = sorted(extra)
    message = UNREAD_TENSORS.format(count=len(names), hf_class=family.hf_class,
                                    names=names[:4] + (["..."] if len(names) > 4 else []))
    if any(".pooler." in f".{n}" for n in names) and getattr(family, "pooled", True) is False:
        message += "\n" + POOLER_UNREAD  # (a masked LM's file: the next step is often a classifier)
    warn(message, UnreadTensorsWarning)
    return True


def _base_stripped(family: type[HFModel], weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` without a second base-model prefix where every name has one
    (``model.model.layers.0...``, ``model.lm_head.weight``: a causal LM saved under a wrapper's
    ``model`` attribute), as transformers' loader reads them: it strips the base model's prefix
    (``model``; GPT-2's ``transformer``) from a name when what is left is one of the model's.
    Here every name's rest must start with a module of the class (else the names are kept, and
    refused by name where they do not fit: GPT-NeoX's ``gpt_neox.embed_out.weight``, whose
    rest transformers does not rename to its ``lm_head``, drawing that at random). The covered
    classes only (a task class's body has a prefix of its own)."""
    base = _BODY_PREFIX.get(str(family.model_type), "model") + "."
    known = set(getattr(family, "__ft_fields__", ())) | {k.split(".")[0] for k in (*family.hf_rename,
                                                                                 *(family.hf_head or ()))}
    if FAMILIES.get(str(family.model_type)) is not family or not weights \
            or not all(k.startswith(base) and k[len(base):].split(".")[0] in known for k in weights):
        return weights
    return {k[len(base):]: v for k, v in weights.items()}


def _base_added(family: type[HFModel], template: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with each name of the base model saved without its prefix
    (``layers.0.mlp.up_proj.weight`` beside ``model.embed_tokens.weight``) under it, as
    transformers' loader adds the base model's prefix name by name (a name whose first part
    is a module of the body ``template`` holds, and not one of the class's own). A rename onto
    a name the weights hold already, with other values, is refused
    (:data:`~functree.hf._family.RENAME_COLLIDES`). ``weights`` itself where none is bare."""
    base = _BODY_PREFIX.get(str(family.model_type), "model")
    body = getattr(template, base, None)
    if FAMILIES.get(str(family.model_type)) is not family or not isinstance(body, Module):
        return weights
    own = set(getattr(family, "__ft_fields__", ())) | {k.split(".")[0] for k in (*family.hf_rename,
                                                                               *(family.hf_head or ()))}
    bare = {k for k in weights if k.split(".")[0] in set(body.__ft_fields__) - own}
    if not bare:
        return weights
    return renamed(weights, lambda k: f"{base}.{k}" if k in bare else k, family.hf_class)


def _foreign(cls: type[HFModel], weights: Mapping[str, Any]) -> list[str]:
    """The names of ``weights`` under no module of ``cls`` (neither a field nor a renamed name's
    first part): another class's tensors."""
    known = set(getattr(cls, "__ft_fields__", ())) | {k.split(".")[0] for k in cls.hf_rename}
    return [k for k in weights if k.split(".")[0] not in known]


def _fits(task: type[HFModel], config: Any, given: Any, dtype: Any, attention: str) -> bool:
    """Whether the weights ``given`` load whole into ``task``'s model: the error path's check
    that the tensors a body left over are that task model's head, not a stray tensor (a
    BertModel file with BertForPreTraining's ``cls.predictions.bias`` alone is no masked LM)."""
    try:
        weights = task.hf_names(dict(read_weights(given)))
        template = _template(task, config, set(weights), dtype, attention)
        weights = _untie(task, template, weights)
        _, report = load_by_rules(template, weights, rename=task.hf_rename, layouts=task.hf_layouts, strict=False,
                                  given_names=True, complete=True)
    except (ValueError, TypeError, KeyError, ShortStack):  # does not fit: the body's own message follows
        return False
    return report.ok


def _an_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (a config's token id or size as JSON gives it)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_pad_token(family: type[HFModel], config: Any) -> None:
    """Raise :data:`PAD_OUTSIDE_VOCABULARY` where ``family`` builds its token embedding with
    ``padding_idx = pad_token_id`` (``hf_padded``) and the id is outside ``-vocab <= pad <
    vocab``, as torch's ``nn.Embedding`` refuses it (HF's ``from_config`` and
    ``from_pretrained`` fail on it; GPT-2 and GPT-NeoX build no padding row and accept any id)."""
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if family.hf_padded is None or not _an_int(pad) or not _an_int(vocab):
        return
    if padding_index(pad, vocab) is None:  # an int outside the table
        eos = getattr(config, "eos_token_id", None)
        inside = eos if _an_int(eos) and 0 <= eos < vocab else 0
        default = DEFAULTS.get(str(family.model_type), {}).get("pad_token_id") == pad  # (Phi-3's 32000)
        raise ValueError(PAD_OUTSIDE_VOCABULARY.format(
            pad=pad, vocab=vocab, last=vocab - 1, hf_class=family.hf_class, inside=inside,
            grown=pad + 1 if pad >= 0 else -pad,
            default=f" ({family.model_type}'s default: a config without the key takes it)" if default else ""))


def _layers_not_in_weights(short: ShortStack, config: Any) -> ValueError:
    """:data:`LAYERS_NOT_IN_WEIGHTS` of a config whose layer count exceeds the weights'."""
    model_type = getattr(config, "model_type", None)
    key = ALIASES.get(model_type, {}).get("num_hidden_layers", "num_hidden_layers") if isinstance(model_type, str) \
        else "num_hidden_layers"
    held = short.held
    shown = (f"layers {held[0]} to {held[-1]}" if held == list(range(held[0], held[-1] + 1)) else f"layers {held}") \
        if held else f"no {short.torch}.* layer"
    return ValueError(LAYERS_NOT_IN_WEIGHTS.format(length=short.length, torch=short.torch, last=short.length - 1,
                                                   ft=short.ft, held=shown, key=key, count=max(held, default=-1) + 1))


def to_hf_state_dict(model: Any, *, numpy: bool = False) -> dict[str, Any]:
    """A :func:`from_hf` model's parameters as its Hugging Face model's ``state_dict``.

    ``hf_model.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)`` takes it
    (HF's names and layouts; a tied head written under both names, as HF's own
    ``state_dict()``). Torch tensors, or NumPy arrays with ``numpy=True`` (no torch). A
    partial tree (a gradient taken with ``wrt=``: ``None`` elsewhere) gives the tensors it
    holds whole, and no others. In a multi-process job every process calls it: tensors
    sharded over other processes' devices are gathered, each process gets them all.

    Example:
      >>> import functree as ft, jax
      >>> config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2,
      ...           "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
      >>> sd = ft.nn.to_hf_state_dict(ft.nn.from_hf(config, key=jax.random.key(0)), numpy=True)
      >>> sd["transformer.h.1.attn.c_attn.weight"].shape, sd["lm_head.weight"] is sd["transformer.wte.weight"]
      ((8, 24), True)
    """
    family = family_of(model)
    if family is None:
        raise ValueError(NOT_A_PORT.format(covered=", ".join(f.__name__ for f in FAMILIES.values()),
                                           given=type(model).__name__))
    out = state_dict_by_rules(model, rename=model.hf_rename, layouts=model.hf_layouts, where="ft.nn.to_hf_state_dict")
    tied = tied_head(family, model)
    if tied is not None and tied[1] in out:  # (a partial gradient without the embedding: neither)
        out[tied[0]] = out[tied[1]]
    for tie, source in tied_copies(family, model):  # (BERT's masked LM decoder: the word embedding and the bias)
        if source in out:
            out[tie] = out[source]
    if numpy:
        return out
    return as_tensors(out)


def _load_port(model: Any, weights: dict[str, Any], prefix: str) -> tuple[Any, FlatDictReport]:
    """``model`` (a from_hf model, at ``prefix`` in the model given to
    ``ft.nn.load_torch_state_dict``) with Hugging Face's ``weights`` in it, read as
    :func:`from_hf` reads them: older checkpoint names, a tied head's copy of the embedding
    (taken when equal to it, refused when not), the family's renames and layouts."""
    family = family_of(model)
    assert family is not None
    weights = _untie(family, model, family.hf_names(dict(weights)), prefix)
    return load_by_rules(model, weights, rename=family.hf_rename, layouts=family.hf_layouts, strict=False,
                         given_names=True)


def _port(node: Any) -> Port | None:
    """A from_hf model's :class:`~functree.interop._ports.Port`: its torch names are Hugging Face's."""
    family = family_of(node)
    if family is None:
        return None
    return Port(f"Hugging Face {family.hf_class}", lambda model: to_hf_state_dict(model, numpy=True), _load_port)


PORTS.append(_port)


# The body of a task class: the attribute HF's class keeps it under (its base_model_prefix).
_BODY_PREFIX = {"gpt2": "transformer", "gpt_neox": "gpt_neox", "bert": "bert"}  # others: "model"
UNCOVERED_CHECKPOINT = ("config.json in {path!r} gives architectures {listed}. Its body ({prefix}.*, "
                        "the checkpoint's weights) is the portable part; its task head is yours to add:")


def _check_architectures(config: Any, directory: Any) -> None:
    """UNCOVERED_CLASS where a directory's config.json names only task classes functree does
    not cover (``Qwen2ForSequenceClassification``, ``BertForTokenClassification``): its
    weights are a body and a head, and the covered class of its model type would build
    another model (a causal LM head tied to the embedding, or missing)."""
    model_type = getattr(config, "model_type", None)
    listed = getattr(config, "architectures", None)
    if not isinstance(model_type, str) or model_type not in COVERED or not isinstance(listed, (list, tuple)) \
            or not listed:
        return
    covered = COVERED[model_type]
    # Another covered family's class (MistralForCausalLM in a llama config.json: a file edited or
    # converted by hand) is no task head: AutoModelForCausalLM builds the model type's class from it
    # (architectures unread), and so does from_hf. Was refused as an uncovered class, the message
    # naming it among the covered ones.
    task = [a for a in listed if isinstance(a, str) and a != covered and a not in TASKS
            and a not in COVERED.values() and ("For" in a or a.endswith("HeadModel") or a.endswith("HeadsModel"))]
    if len(task) < len(listed):  # the covered class, or a base model (its directory loads)
        return
    prefix = _BODY_PREFIX.get(model_type, "model")
    path = os.fspath(directory)
    if covered.endswith("ForCausalLM") or covered.endswith("LMHeadModel"):  # the body inside the covered port
        right = (f"ported = ft.nn.from_hf(transformers.{covered}.from_pretrained({path!r}))"
                 f"    # ported.{prefix}: the checkpoint's body; its head is not the {task[0]}'s")
    else:  # the covered class is the body itself (BertModel)
        right = f"body = ft.nn.from_hf(transformers.{task[0]}.from_pretrained({path!r}).{prefix})    # a {covered}"
    how = UNCOVERED_CHECKPOINT.format(path=path, listed=list(listed), prefix=prefix)
    raise ValueError(UNCOVERED_CLASS.format(given=task[0], covered=covered, all=", ".join(COVERED.values()),
                                            how=how, right=right))


def _uncovered_class(source: Any, covered: str) -> ValueError:
    """UNCOVERED_CLASS for the HF model ``source``, a class of a covered model type that is
    not ``covered``: its fix loads the user's weights (``hf_model.bert`` for a
    BertForMaskedLM), never a freshly initialized model."""
    prefix = getattr(source, "base_model_prefix", None)
    body = getattr(source, prefix, None) if isinstance(prefix, str) and prefix else None
    if type(body).__name__ == covered:
        how, right = UNCOVERED_BODY.format(prefix=prefix, covered=covered), f"ft.nn.from_hf(hf_model.{prefix})"
    else:
        how = UNCOVERED_OTHER
        right = f"ft.nn.from_hf(transformers.{covered}.from_pretrained(path))    # path: hf_model's checkpoint"
    return ValueError(UNCOVERED_CLASS.format(given=type(source).__name__, covered=covered,
                                             all=", ".join(COVERED.values()), how=how, right=right))
