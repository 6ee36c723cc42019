"""Hugging Face language models in one call: :func:`from_hf` and :func:`to_hf_state_dict`.

``from_hf`` reads an HF config (``model_type`` and sizes), builds the matching model of
:mod:`functree.nn._hf_models` as an abstract template (``jax.eval_shape``: no random
init) and fills it from the weights through :func:`ft.nn.load_torch_state_dict` with the
model class's ``rename=`` and ``layouts=``. ``transformers`` is imported only to read a
config given as a dict; torch only where the weights are torch tensors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree import _activations as act
from functree._state_dict import _to_numpy
from functree.nn._hf_models import BertModel, GPT2LMHeadModel, LlamaForCausalLM
from functree.nn._rotary import ROPE_TYPES, RopeScaling
from functree.nn._torch import _as_tensors, _load_file, load_torch_state_dict, torch_state_dict

__all__ = ["from_hf", "to_hf_state_dict"]

COVERED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertModel"}

UNCOVERED_ARCHITECTURE = """\
ft.nn.from_hf: {given} is not covered; covered: {covered}.
Port other models by hand from ft.nn layers and ft.nn.load_torch_state_dict (docs/guides/huggingface.md).

    wrong:  ft.nn.from_hf({wrong})
    right:  ft.nn.from_hf(transformers.LlamaForCausalLM(config))   # or (config, weights)
"""

UNCOVERED_CLASS = """\
ft.nn.from_hf: {given} is not covered; of its model type functree covers {covered} (all \
covered: {all}). A task model's body is covered where its class is (BertModel inside \
BertForMaskedLM as hf_model.bert); its other layers are yours to add.

    wrong:  ft.nn.from_hf({given}(config))
    right:  ft.nn.from_hf({covered}(config))
"""

UNCOVERED_OPTION = """\
ft.nn.from_hf: the {model_type} config sets {option}={value!r}; functree's {model_type} covers \
{covered}. Loading it anyway would give a different model.

    right:  a config with {option}={covered_value}
"""

UNKNOWN_ROPE_TYPE = """\
ft.nn.from_hf: rope_type {kind!r} (config.rope_parameters) is not covered; covered: {known}.

    right:  config.rope_parameters = {{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, ...}}
"""

UNKNOWN_ACTIVATION = """\
ft.nn.from_hf: the {model_type} config's activation {given!r} is not covered; covered: {known}."""

BAD_CONFIG = """\
ft.nn.from_hf: the first argument is a Hugging Face model (torch) or config, or a dict with \
"model_type" (a config.json); got {given}.

    right:  ft.nn.from_hf(hf_model)
       or:  ft.nn.from_hf(hf_model.config, "model.safetensors")
"""

BAD_WEIGHTS = """\
ft.nn.from_hf: weights are a state dict {{name: tensor or array}} or the path of a \
.safetensors file; got {given}.

    right:  ft.nn.from_hf(config, "path/to/model.safetensors")
       or:  ft.nn.from_hf(config, hf_model.state_dict())
"""

TIED_HEAD_DIFFERS = """\
ft.nn.from_hf: the config ties the output head to the embedding (tie_word_embeddings=True), \
but the weights' {head!r} differs from {embedding!r} by up to {difference:.3g}. Hugging Face \
would use the embedding for both; functree stores one tensor.

    right:  config.tie_word_embeddings = False   # an untied head: both tensors kept
       or:  del weights[{head!r}]                # the embedding for both
"""

NEEDS_WEIGHTS_OR_KEY = """\
ft.nn.from_hf: a {model_type} config without weights builds a freshly initialized model and \
needs a PRNG key for it.

    wrong:  ft.nn.from_hf(config)
    right:  ft.nn.from_hf(config, "model.safetensors")        # or a state dict
       or:  ft.nn.from_hf(config, key=jax.random.key(0))      # random init
"""

NOT_A_PORT = """\
ft.nn.to_hf_state_dict takes a model built by ft.nn.from_hf ({covered}); got {given}. \
For other models: ft.nn.torch_state_dict(model, rename=..., layouts=...)."""

_ACTIVATIONS = {"gelu_new": act.gelu, "gelu_pytorch_tanh": act.gelu, "gelu": act.gelu_exact, "relu": act.relu,
                "silu": act.silu, "swish": act.silu, "tanh": act.tanh}


def _config(source: Any) -> Any:
    if isinstance(source, Mapping):
        if "model_type" not in source:
            raise ValueError(BAD_CONFIG.format(given=f"a dict without 'model_type' (keys {sorted(source)[:6]})"))
        import transformers

        options = {k: v for k, v in source.items() if k != "model_type"}
        return transformers.AutoConfig.for_model(source["model_type"], **options)
    if not hasattr(source, "model_type"):
        raise ValueError(BAD_CONFIG.format(given=type(source).__name__))
    return source


def _activation(config: Any, name: str) -> Any:
    given = getattr(config, name)
    if given not in _ACTIVATIONS:
        raise ValueError(UNKNOWN_ACTIVATION.format(model_type=config.model_type, given=given,
                                                   known=", ".join(_ACTIVATIONS)))
    return _ACTIVATIONS[given]


def _require(config: Any, option: str, covered: Any, default: Any) -> None:
    value = getattr(config, option, default)
    if value != covered:
        raise ValueError(UNCOVERED_OPTION.format(model_type=config.model_type, option=option, value=value,
                                                 covered=f"{option}={covered!r}", covered_value=repr(covered)))


def _rope(config: Any) -> RopeScaling:
    """Hugging Face's ``rope_parameters`` (``rope_scaling`` and ``rope_theta`` before v5) as a RopeScaling."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(UNKNOWN_ROPE_TYPE.format(kind=kind, known=", ".join(ROPE_TYPES)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _require(config, "partial_rotary_factor", 1.0, params["partial_rotary_factor"])
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    original = params.get("original_max_position_embeddings")
    if kind == "dynamic":  # HF's dynamic NTK scales past max_position_embeddings
        original = config.max_position_embeddings
    factor = params.get("factor")
    if kind == "yarn" and factor is None and original:
        factor = config.max_position_embeddings / original
    options = {k: params[k] for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                                      "attention_factor", "mscale", "mscale_all_dim", "truncate")
               if params.get(k) is not None}
    return RopeScaling(kind, base=base, factor=1.0 if factor is None else float(factor),
                       original_max_positions=None if original is None else int(original), **options)


def _gpt2(config: Any, names: set[str], dtype: Any, key: jax.Array) -> Any:
    _require(config, "scale_attn_weights", True, True)
    _require(config, "scale_attn_by_inverse_layer_idx", False, False)
    _require(config, "add_cross_attention", False, False)
    c = config
    return GPT2LMHeadModel(c.vocab_size, c.n_positions, c.n_embd, c.n_head, c.n_layer, hidden=c.n_inner,
                           activation=_activation(c, "activation_function"), epsilon=c.layer_norm_epsilon,
                           tied=bool(getattr(c, "tie_word_embeddings", True)), key=key, dtype=dtype)


def _llama(config: Any, names: set[str], dtype: Any, key: jax.Array) -> Any:
    c = config
    return LlamaForCausalLM(
        c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads,
        c.intermediate_size, c.num_hidden_layers, head_dim=getattr(c, "head_dim", None),
        activation=_activation(c, "hidden_act"), epsilon=c.rms_norm_eps, rotary=_rope(c),
        attention_bias=bool(getattr(c, "attention_bias", False)), mlp_bias=bool(getattr(c, "mlp_bias", False)),
        tied=bool(getattr(c, "tie_word_embeddings", False)), key=key, dtype=dtype)


def _bert(config: Any, names: set[str], dtype: Any, key: jax.Array) -> Any:
    c = config
    _require(c, "position_embedding_type", "absolute", "absolute")
    _require(c, "is_decoder", False, False)
    _require(c, "add_cross_attention", False, False)
    return BertModel(c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads,
                     c.intermediate_size, c.num_hidden_layers, types=c.type_vocab_size,
                     activation=_activation(c, "hidden_act"), epsilon=c.layer_norm_eps,
                     pooler="pooler.dense.weight" in names, key=key, dtype=dtype)


_BUILDERS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}
_HEADS = {"gpt2": ("lm_head.weight", "transformer.wte.weight"), "llama": ("lm_head.weight", "model.embed_tokens.weight")}


def _weights(weights: Any) -> Mapping[str, Any]:
    if isinstance(weights, (str, os.PathLike)):
        return _load_file(weights)
    if not isinstance(weights, Mapping):
        raise ValueError(BAD_WEIGHTS.format(given=type(weights).__name__))
    return weights


_GPT2_BUFFER = re.compile(r"(transformer\.)?h\.[0-9]+\.attn\.(bias|masked_bias)")


def _normalized(model_type: str, weights: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpoint names as the covered class's ``state_dict`` has them, as HF's loader reads
    older files: GPT-2's body saved without ``transformer.`` (the ``gpt2`` checkpoint) and its
    causal-mask buffers ``h.N.attn.bias``; BERT saved with ``bert.`` and LayerNorm's
    ``gamma``/``beta``."""
    out = dict(weights)
    if model_type == "gpt2":
        out = {k: v for k, v in out.items() if not _GPT2_BUFFER.fullmatch(k)}
        if "wte.weight" in out and "transformer.wte.weight" not in out:
            out = {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in out.items()}
    elif model_type == "bert":
        if any(k.startswith("bert.") for k in out) and not any(k.startswith("embeddings.") for k in out):
            out = {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in out.items()}
        out = {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)): v
               for k, v in out.items()}
    return out


def _array(x: Any) -> np.ndarray:
    converted = _to_numpy(x)
    return np.asarray(x) if converted is None else converted


def _untie(model_type: str, model: Any, weights: Mapping[str, Any]) -> dict[str, Any]:
    """The weights without a tied head's copy of the embedding (checked equal to it)."""
    weights = dict(weights)
    if model_type not in _HEADS or getattr(model, "lm_head", True) is not None:
        return weights
    head, embedding = _HEADS[model_type]
    if head in weights and embedding in weights:
        given, stored = _array(weights.pop(head)), _array(weights[embedding])
        if given.shape != stored.shape or not np.array_equal(given, stored):
            difference = float(np.abs(given.astype(np.float64) - stored.astype(np.float64)).max()) \
                if given.shape == stored.shape else float("inf")
            raise ValueError(TIED_HEAD_DIFFERS.format(head=head, embedding=embedding, difference=difference))
    elif head in weights:  # only the head given (a file that stored the tie under the head's name)
        weights[embedding] = weights.pop(head)
    return weights


def from_hf(source: Any, weights: Any = None, *, dtype: Any = jnp.float32, key: jax.Array | None = None) -> Any:
    """A Hugging Face language model as a functree model, its weights loaded.

    ``from_hf(hf_model)`` takes an HF torch model: ``GPT2LMHeadModel``,
    ``LlamaForCausalLM`` (grouped-query attention, tied or untied head, attention/MLP
    biases, ``head_dim``, rope types ``default``, ``linear``, ``dynamic``, ``yarn``,
    ``llama3``: :class:`ft.nn.RopeScaling`) or ``BertModel``. ``from_hf(config, weights)``
    takes its config (an HF config, or a ``config.json`` dict) and a state dict (torch
    tensors or NumPy arrays) or the path of a ``.safetensors`` file (read without torch).
    Parameters are cast to ``dtype``. Older checkpoint names read as HF's loader reads them
    (GPT-2's body without ``transformer.`` and its mask buffers ``h.N.attn.bias``; BERT's
    ``bert.`` prefix and LayerNorm ``gamma``/``beta``); a task head's tensors (BERT's
    ``cls.*``) are unexpected: drop them first. ``from_hf(config, key=key)`` without weights builds
    the model with ``ft.nn``'s random initialization (to train from scratch).

    The model (:class:`GPT2LMHeadModel`, :class:`LlamaForCausalLM`, :class:`BertModel` of
    ``functree.nn._hf_models``) is made of ordinary ``ft.nn`` layers, its blocks an
    ``ft.nn.Stack``, HF's parameter names kept (``model.layers.3.mlp.up_proj.weight``;
    inside ``ft.nn`` layers their own names: ``self_attn.query_projection`` for
    ``self_attn.q_proj``, a norm's ``scale`` for ``weight``). ``model(input_ids,
    attention_mask=None)`` gives the logits ``[batch, T, vocab]`` (BERT: the last
    hidden state). A config functree does not cover (a model type, a rope type, an
    option) and weights that do not fit the config raise, naming what was given.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2,
      ...           "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
      >>> fresh = ft.nn.from_hf(config, key=jax.random.key(0))     # no weights: ft's random init
      >>> weights = ft.nn.to_hf_state_dict(fresh, numpy=True)        # as HF's GPT2LMHeadModel names them
      >>> model = ft.nn.from_hf(config, weights)
      >>> model(np.zeros((1, 5), np.int32)).shape
      (1, 5, 11)
      >>> len(model.transformer.h), sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(weights)
      (2, True)
    """
    if weights is None and hasattr(source, "config") and hasattr(source, "state_dict"):
        config, weights = source.config, source.state_dict()
        model_type = getattr(config, "model_type", None)
        if model_type in COVERED and type(source).__name__ != COVERED[model_type]:
            raise ValueError(UNCOVERED_CLASS.format(given=type(source).__name__, covered=COVERED[model_type],
                                                    all=", ".join(COVERED.values())))
    else:
        config = _config(source)
    model_type = getattr(config, "model_type", None)
    if model_type not in _BUILDERS:
        raise ValueError(UNCOVERED_ARCHITECTURE.format(given=f"model_type {model_type!r}",
                                                       covered=", ".join(f"{k} ({v})" for k, v in COVERED.items()),
                                                       wrong=f"{model_type}_model"))
    build = _BUILDERS[model_type]
    if weights is None:
        if key is None:
            raise ValueError(NEEDS_WEIGHTS_OR_KEY.format(model_type=model_type))
        return build(config, {"pooler.dense.weight"}, dtype, key)
    weights = _normalized(model_type, _weights(weights))
    template = jax.eval_shape(lambda: build(config, set(weights), dtype, jax.random.key(0)))
    weights = _untie(model_type, template, weights)
    cls = type(template)
    return load_torch_state_dict(template, weights, rename=cls.hf_rename, layouts=cls.hf_layouts)


def to_hf_state_dict(model: Any, *, numpy: bool = False) -> dict[str, Any]:
    """A :func:`from_hf` model's parameters as its Hugging Face model's ``state_dict``.

    ``hf_model.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)`` takes it
    (HF's names and layouts; a tied head written under both names, as HF's own
    ``state_dict()``). Torch tensors, or NumPy arrays with ``numpy=True`` (no torch).

    Example:
      >>> import functree as ft, jax
      >>> config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2,
      ...           "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
      >>> sd = ft.nn.to_hf_state_dict(ft.nn.from_hf(config, key=jax.random.key(0)), numpy=True)
      >>> sd["transformer.h.1.attn.c_attn.weight"].shape, sd["lm_head.weight"] is sd["transformer.wte.weight"]
      ((8, 24), True)
    """
    ports = (GPT2LMHeadModel, LlamaForCausalLM, BertModel)
    if not isinstance(model, ports):
        raise ValueError(NOT_A_PORT.format(covered=", ".join(c.__name__ for c in ports), given=type(model).__name__))
    out = torch_state_dict(model, rename=model.hf_rename, layouts=model.hf_layouts, numpy=True)
    model_type = {GPT2LMHeadModel: "gpt2", LlamaForCausalLM: "llama", BertModel: "bert"}[type(model)]
    if model_type in _HEADS and getattr(model, "lm_head", True) is None:
        head, embedding = _HEADS[model_type]
        out[head] = out[embedding]
    if numpy:
        return out
    return _as_tensors(out)
