"""Hugging Face language models in one call: :func:`from_hf` and :func:`to_hf_state_dict`.

``from_hf`` reads an HF config (``model_type`` and sizes), picks the model type's
:class:`Family` in :data:`FAMILIES`, builds its model of :mod:`functree.nn._hf_models` as an
abstract template (``jax.eval_shape``: no random init) and fills it from the weights through
:func:`ft.nn.load_torch_state_dict` with the model class's ``rename=`` and ``layouts=``.
A family is one table row: its HF class, its functree class, a builder reading the config,
its tied head's names and the older checkpoint names HF's loader renames. ``transformers``
is never imported (a ``config.json``, as a dict or a directory's, is read by
:mod:`functree.nn._hf_files` with HF's defaults); torch only where the weights are torch tensors.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree import _activations as act
from functree._jit import unchecked_jit
from functree._naming import matches
from functree._state_dict import _to_numpy
from functree._tree import dotted_name
from functree.nn import _hf_models as models
from functree.nn._embedding import Embedding
from functree.nn._hf_config import hf_config_of
from functree.nn._hf_files import _config, _weights
from functree.nn._linear import Dense
from functree.nn._rotary import ROPE_TYPES, RopeScaling
from functree.nn._torch import _as_tensors, load_torch_state_dict, torch_state_dict

__all__ = ["from_hf", "to_hf_state_dict"]

UNCOVERED_ARCHITECTURE = """\
ft.nn.from_hf: {given} is not covered; covered: {covered}.
Port other models by hand from ft.nn layers and ft.nn.load_torch_state_dict (docs/guides/huggingface.md).

    right:  model = MyModel(...)      # ft.nn layers named as the HF model's modules
            model = ft.nn.load_torch_state_dict(model, hf_model.state_dict(), rename=..., layouts=...)
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

MIXED_WINDOWS = """\
ft.nn.from_hf: the {model_type} config mixes sliding-window and full-attention layers \
(layer_types {types}); functree's {model_type} takes one kind for every layer (its blocks are \
one ft.nn.Stack).

    right:  a config with use_sliding_window=False, or sliding windows on every layer
"""

UNKNOWN_ROPE_TYPE = """\
ft.nn.from_hf: rope_type {kind!r} (config.rope_parameters) is not covered; covered: {known}.

    right:  config.rope_parameters = {{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, ...}}
"""

PARTIAL_ROTARY_CRASHES = """\
ft.nn.from_hf: the {model_type} config sets partial_rotary_factor={partial} with rope_type \
{kind!r}. Hugging Face's {hf_class} applies partial_rotary_factor only to that rope type's \
frequencies, not to the rotation ({rotated} frequencies against a head of {head_dim}: its \
forward fails with a size mismatch), so no model computes this config.

    right:  config.rope_parameters = {{..., "rope_type": {kind!r}}}        # no partial_rotary_factor: the whole head
       or:  rope_type "default" (Hugging Face's {hf_class} then rotates the whole head, whatever the factor)
"""

UNKNOWN_ACTIVATION = """\
ft.nn.from_hf: the {model_type} config's activation {given!r} is not covered; covered: {known}."""

BAD_ATTENTION = """\
ft.nn.from_hf: attention= is "auto", "xla" or "cudnn" (the implementation of every \
ft.nn.MultiheadAttention the model builds), got {given!r}.

    right:  ft.nn.from_hf(source, attention="auto")    # cuDNN flash attention where it applies, else XLA
"""

TIED_HEAD_DIFFERS = """\
ft.nn.from_hf: the config ties the output head to the embedding (tie_word_embeddings=True), \
but the weights' {head!r} differs from {embedding!r} by up to {difference:.3g}. Hugging Face \
would use the embedding for both; functree stores one tensor.

    right:  config.tie_word_embeddings = False   # an untied head: both tensors kept
       or:  del weights[{head!r}]                # the embedding for both
"""

BAD_DTYPE = """\
ft.nn.from_hf: dtype is the parameters' floating dtype (jnp.float32, jnp.bfloat16, \
jnp.float16), got {given!r}. Integer parameters cannot be trained or initialized; quantize \
after loading if that is the aim.

    wrong:  ft.nn.from_hf(source, dtype={given!r})
    right:  ft.nn.from_hf(source, dtype=jnp.bfloat16)
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

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")

_ACTIVATIONS = {"gelu_new": act.gelu, "gelu_pytorch_tanh": act.gelu, "gelu": act.gelu_exact, "relu": act.relu,
                "silu": act.silu, "swish": act.silu, "tanh": act.tanh}


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


def _rope(config: Any, head_dim: int | None = None) -> RopeScaling:
    """Hugging Face's ``rope_parameters`` (``rope_scaling`` and ``rope_theta`` before v5) as a RopeScaling.

    ``head_dim``: the family rotates the whole head whatever ``partial_rotary_factor`` says
    (Llama, Qwen2, Mistral, Gemma: HF's ``apply_rotary_pos_emb`` has no pass-through part,
    and their default rope ignores the factor), so a factor under 1 is dropped for the default
    rope and refused for the others (HF's forward fails there); None where HF rotates the
    first ``partial_rotary_factor`` of each head (GPT-NeoX, Phi-3)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(UNKNOWN_ROPE_TYPE.format(kind=kind, known=", ".join(ROPE_TYPES)))
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    if head_dim is not None and int(head_dim * partial) != head_dim:
        if kind != "default":
            raise ValueError(PARTIAL_ROTARY_CRASHES.format(
                model_type=config.model_type, partial=partial, kind=kind, hf_class=FAMILIES[config.model_type].hf_class,
                rotated=int(head_dim * partial) // 2, head_dim=head_dim))
        partial = 1.0  # as HF's default rope: the factor is not read
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    original = params.get("original_max_position_embeddings")
    if kind == "dynamic":  # HF's dynamic NTK scales past max_position_embeddings
        original = config.max_position_embeddings
    factor = params.get("factor")
    if kind == "longrope":  # Phi-3: the factor from the two lengths when not given
        original = original or getattr(config, "original_max_position_embeddings", None)
        params = {**params, "short_factor": tuple(map(float, params.get("short_factor") or ())),
                  "long_factor": tuple(map(float, params.get("long_factor") or ()))}
    if kind in ("yarn", "longrope") and factor is None and original:
        factor = config.max_position_embeddings / original
    options = {k: params[k] for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                                      "attention_factor", "mscale", "mscale_all_dim", "truncate", "short_factor",
                                      "long_factor")
               if params.get(k) is not None}
    return RopeScaling(kind, base=base, factor=1.0 if factor is None else float(factor),
                       original_max_positions=None if original is None else int(original), partial=partial, **options)


def _window(config: Any) -> int | None:
    """The sliding window of every layer (None: full attention), from ``layer_types`` where
    the config has them (Qwen2), else ``sliding_window`` (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and config.model_type == "qwen2":
        kinds = set(types)
        if len(kinds) > 1:
            raise ValueError(MIXED_WINDOWS.format(model_type=config.model_type, types=list(types)))
        return window if kinds == {"sliding_attention"} else None
    return None if window is None else int(window)


# ---- the families -------------------------------------------------------------------------------

def _gpt2(c: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
    _require(c, "scale_attn_weights", True, True)
    _require(c, "scale_attn_by_inverse_layer_idx", False, False)
    _require(c, "add_cross_attention", False, False)
    return models.GPT2LMHeadModel(c.vocab_size, c.n_positions, c.n_embd, c.n_head, c.n_layer, hidden=c.n_inner,
                                  activation=_activation(c, "activation_function"), epsilon=c.layer_norm_epsilon,
                                  tied=bool(getattr(c, "tie_word_embeddings", True)), key=key, dtype=dtype,
                                  attention=attention)


def _llama(c: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
    """Llama and the families built like it (their differences: :data:`_LLAMA_LIKE`)."""
    family = FAMILIES[c.model_type]
    options = dict(_LLAMA_LIKE.get(c.model_type, {}))
    if options.pop("gemma", False):
        options.update(norm=models.GemmaRMSNorm, embed_scale=float(c.hidden_size) ** 0.5)
    if options.pop("windowed", False):
        options["window"] = _window(c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    partial = options.pop("partial", False)  # HF rotates the first partial_rotary_factor of each head (Phi-3)
    attention_bias = options.pop("attention_bias", bool(getattr(c, "attention_bias", False)))  # Qwen2's: always
    return family.model(
        c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads,
        c.intermediate_size, c.num_hidden_layers, head_dim=head_dim, activation=_activation(c, "hidden_act"),
        epsilon=c.rms_norm_eps, rotary=_rope(c, None if partial else head_dim), attention_bias=attention_bias,
        mlp_bias=bool(getattr(c, "mlp_bias", False)), tied=bool(getattr(c, "tie_word_embeddings", False)), key=key,
        dtype=dtype, attention=attention, **options)


# How each family built like Llama differs from it (keyword arguments of LlamaForCausalLM).
_LLAMA_LIKE: dict[str, dict[str, Any]] = {
    "qwen2": {"attention_bias": True, "output_bias": False, "windowed": True},
    "mistral": {"windowed": True},
    "gemma": {"gemma": True},
    "phi3": {"mlp": models.Phi3MLP, "windowed": True, "partial": True},
}


def _gpt_neox(c: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
    return models.GPTNeoXForCausalLM(
        c.vocab_size, c.hidden_size, c.num_attention_heads, c.intermediate_size, c.num_hidden_layers,
        activation=_activation(c, "hidden_act"), epsilon=c.layer_norm_eps, rotary=_rope(c),
        use_bias=bool(getattr(c, "attention_bias", True)), parallel=bool(c.use_parallel_residual),
        tied=bool(getattr(c, "tie_word_embeddings", False)), key=key, dtype=dtype, attention=attention)


def _opt(c: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
    _require(c, "do_layer_norm_before", True, True)
    _require(c, "word_embed_proj_dim", c.hidden_size, c.hidden_size)
    _require(c, "layer_norm_elementwise_affine", True, True)
    _require(c, "_remove_final_layer_norm", False, False)
    return models.OPTForCausalLM(
        c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads, c.ffn_dim,
        c.num_hidden_layers, activation=_activation(c, "activation_function"),
        use_bias=bool(getattr(c, "enable_bias", True)), tied=bool(getattr(c, "tie_word_embeddings", True)), key=key,
        dtype=dtype, attention=attention)


def _bert(c: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
    _require(c, "position_embedding_type", "absolute", "absolute")
    _require(c, "is_decoder", False, False)
    _require(c, "add_cross_attention", False, False)
    return models.BertModel(c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_attention_heads,
                            c.intermediate_size, c.num_hidden_layers, types=c.type_vocab_size,
                            activation=_activation(c, "hidden_act"), epsilon=c.layer_norm_eps,
                            pooler="pooler.dense.weight" in names, key=key, dtype=dtype, attention=attention)


_GPT2_BUFFER = re.compile(r"(transformer\.)?h\.[0-9]+\.attn\.(bias|masked_bias)")
_ROTARY_BUFFER = re.compile(r".*\.rotary_emb\.inv_freq|.*\.attention\.(bias|masked_bias)")


def _gpt2_names(weights: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's body saved without ``transformer.`` (the ``gpt2`` checkpoint), its causal-mask buffers."""
    out = {k: v for k, v in weights.items() if not _GPT2_BUFFER.fullmatch(k)}
    if "wte.weight" in out and "transformer.wte.weight" not in out:
        out = {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in out.items()}
    return out


def _bert_names(weights: dict[str, Any]) -> dict[str, Any]:
    """BERT saved with ``bert.`` and LayerNorm's ``gamma``/``beta``."""
    out = weights
    if any(k.startswith("bert.") for k in out) and not any(k.startswith("embeddings.") for k in out):
        out = {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in out.items()}
    return {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)): v
            for k, v in out.items()}


def _rotary_names(weights: dict[str, Any]) -> dict[str, Any]:
    """Older files' rotary ``inv_freq`` and GPT-NeoX's mask buffers dropped (HF's loader ignores them)."""
    return {k: v for k, v in weights.items() if not _ROTARY_BUFFER.fullmatch(k)}


def _neox_names(weights: dict[str, Any]) -> dict[str, Any]:
    """GPT-NeoX's head saved as ``embed_out`` (HF renames it ``lm_head``)."""
    return {("lm_head." + k[len("embed_out."):] if k.startswith("embed_out.") else k): v
            for k, v in _rotary_names(weights).items()}


def _opt_names(weights: dict[str, Any]) -> dict[str, Any]:
    """OPT saved without ``model.`` (``decoder.layers...``, as the hub's files)."""
    if any(k.startswith("decoder.") for k in weights) and not any(k.startswith("model.") for k in weights):
        return {("model." + k if k.startswith("decoder.") else k): v for k, v in weights.items()}
    return weights


@dataclasses.dataclass(frozen=True)
class Family:
    """One model type ``from_hf`` covers: the HF class it equals, the functree class, the
    builder reading the config ``(config, weight names, dtype, key, attention) -> model``, a
    tied head's ``(head, embedding)`` weight names, and the older checkpoint names HF's
    loader reads (a function of the weights dict)."""

    hf_class: str
    model: type
    build: Callable[..., Any]
    head: tuple[str, str] | None = None
    names: Callable[[dict[str, Any]], dict[str, Any]] = _rotary_names
    padded: str | None = None  # the embedding HF builds with padding_idx=pad_token_id (its row zeroed at init)
    residual: tuple[str, ...] = ()  # the layers HF initializes at std / sqrt(2 * n_layer) (key-path patterns)


_LLAMA_HEAD = ("lm_head.weight", "model.embed_tokens.weight")
FAMILIES: dict[str, Family] = {
    "gpt2": Family("GPT2LMHeadModel", models.GPT2LMHeadModel, _gpt2, ("lm_head.weight", "transformer.wte.weight"),
                   _gpt2_names, residual=("*.attn.output_projection", "*.mlp.c_proj")),
    "llama": Family("LlamaForCausalLM", models.LlamaForCausalLM, _llama, _LLAMA_HEAD, padded=_LLAMA_HEAD[1]),
    "qwen2": Family("Qwen2ForCausalLM", models.Qwen2ForCausalLM, _llama, _LLAMA_HEAD, padded=_LLAMA_HEAD[1]),
    "mistral": Family("MistralForCausalLM", models.MistralForCausalLM, _llama, _LLAMA_HEAD, padded=_LLAMA_HEAD[1]),
    "gemma": Family("GemmaForCausalLM", models.GemmaForCausalLM, _llama, _LLAMA_HEAD, padded=_LLAMA_HEAD[1]),
    "phi3": Family("Phi3ForCausalLM", models.Phi3ForCausalLM, _llama, _LLAMA_HEAD, padded=_LLAMA_HEAD[1]),
    "gpt_neox": Family("GPTNeoXForCausalLM", models.GPTNeoXForCausalLM, _gpt_neox,
                       ("lm_head.weight", "gpt_neox.embed_in.weight"), _neox_names),
    "opt": Family("OPTForCausalLM", models.OPTForCausalLM, _opt, ("lm_head.weight", "model.decoder.embed_tokens.weight"),
                  _opt_names, padded="model.decoder.embed_tokens.weight"),
    "bert": Family("BertModel", models.BertModel, _bert, None, _bert_names, padded="embeddings.word_embeddings.weight"),
}
COVERED = {k: f.hf_class for k, f in FAMILIES.items()}


def _normalized(model_type: str, weights: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpoint names as the covered class's ``state_dict`` has them, as HF's loader reads
    older files (each family's ``names``)."""
    return FAMILIES[model_type].names(dict(weights))


def _array(x: Any) -> np.ndarray:
    converted = _to_numpy(x)
    return np.asarray(x) if converted is None else converted


def _untie(family: Family, model: Any, weights: Mapping[str, Any]) -> dict[str, Any]:
    """The weights without a tied head's copy of the embedding (checked equal to it)."""
    weights = dict(weights)
    if family.head is None or getattr(model, "lm_head", True) is not None:
        return weights
    head, embedding = family.head
    if head in weights and embedding in weights:
        given, stored = _array(weights.pop(head)), _array(weights[embedding])
        if given.shape != stored.shape or not np.array_equal(given, stored):
            difference = float(np.abs(given.astype(np.float64) - stored.astype(np.float64)).max()) \
                if given.shape == stored.shape else math.inf
            raise ValueError(TIED_HEAD_DIFFERS.format(head=head, embedding=embedding, difference=difference))
    elif head in weights:  # only the head given (a file that stored the tie under the head's name)
        weights[embedding] = weights.pop(head)
    return weights


def _hf_initialized(family: Family, model: Any, config: Any, key: jax.Array) -> Any:
    """``model`` with Hugging Face's initialization (its ``_init_weights``), as
    ``family.hf_class(config)`` starts training from scratch: every weight matrix (linear,
    Conv1D, embedding) ``normal(0, initializer_range)`` (OPT: ``init_std``), the family's
    residual projections (GPT-2's ``c_proj``) ``/ sqrt(2 * n_layer)``, biases zero, the
    padding id's embedding row zero, norms as built (scale 1, Gemma's offset 0). Independent
    normal draws are the same whatever the layout, so each ``Dense`` and ``Embedding`` is
    drawn as it is (fused or split projections, stacked layers); it traces (``jax.jit`` of a
    build)."""
    std = next((float(v) for v in (getattr(config, "initializer_range", None), getattr(config, "init_std", None))
                if v is not None), 0.02)
    pad = getattr(config, "pad_token_id", None)
    padded = None if family.padded is None else family.padded.removesuffix(".weight")  # HF's names are kept

    def normal(i: int, like: jax.Array, scale: float) -> jax.Array:
        return (scale * jax.random.normal(jax.random.fold_in(key, i), like.shape, jnp.float32)).astype(like.dtype)

    def fresh(i: int, path: Any, node: Any) -> Any:
        name = dotted_name(path)
        if isinstance(node, Embedding):
            table = normal(i, node.embeddings, std)
            if name == padded and isinstance(pad, int) and 0 <= pad < table.shape[0]:
                table = table.at[pad].set(0)
            return node.replace(embeddings=table)
        if isinstance(node, Dense):
            residual = any(matches(name, pattern) for pattern in family.residual)
            scale = std / math.sqrt(2 * config.num_hidden_layers) if residual else std
            bias = None if node.bias is None else jnp.zeros_like(node.bias)
            return node.replace(weight=normal(i, node.weight, scale), bias=bias)
        return node  # a norm's leaf: as built

    nodes, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, (Dense, Embedding)))
    return treedef.unflatten([fresh(i, path, node) for i, (path, node) in enumerate(nodes)])


def _from_config(family: Family, config: Any, dtype: Any, key: jax.Array, attention: str) -> Any:
    """The model built and initialized as HF does (:func:`_hf_initialized`), as one
    compiled program: run op by op, each operation compiled on its own (47 programs for a
    2-layer Llama, each a GPU compile) and every layer's default initialization drawn
    only to be replaced (12 layers at d=256, vocabulary 32000: 32 s on a 2-core CPU, 17 s
    as one program). Leaves that are not arrays stay Python values (``static_leaves``)."""

    def build(key: jax.Array) -> Any:
        built = family.build(config, {"pooler.dense.weight"}, dtype, jax.random.fold_in(key, 1), attention)
        return _hf_initialized(family, built, config, key)

    return unchecked_jit(build, static_leaves=True)(key)


def _check_dtype(dtype: Any) -> None:
    """A floating dtype, or :data:`BAD_DTYPE` at the call (not deep inside the initialization)."""
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(BAD_DTYPE.format(given=dtype))


def _covered() -> str:
    return ", ".join(f"{k} ({v})" for k, v in COVERED.items())


def from_hf(source: Any, weights: Any = None, *, dtype: Any = jnp.float32, key: jax.Array | None = None,
            attention: str = "auto") -> Any:
    """A Hugging Face language model as a functree model, its weights loaded.

    ``from_hf(hf_model)`` takes an HF torch model of a covered family (:data:`FAMILIES`):
    ``GPT2LMHeadModel``; ``LlamaForCausalLM`` (grouped-query attention, tied or untied head,
    attention/MLP biases, ``head_dim``, rope types ``default``, ``linear``, ``dynamic``,
    ``yarn``, ``llama3``: :class:`ft.nn.RopeScaling`) and the families built like it,
    ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5), ``MistralForCausalLM`` (sliding-window attention),
    ``GemmaForCausalLM`` and ``Phi3ForCausalLM`` (fused ``qkv_proj`` / ``gate_up_proj``);
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
    ``decoder.`` without ``model.``); a task head's tensors (BERT's ``cls.*``) are unexpected:
    drop them first. ``from_hf(config, key=key)`` without weights builds the model with
    Hugging Face's initialization, as ``AutoModelForCausalLM.from_config(config)`` does (to
    train from scratch): weight matrices and embeddings ``normal(0, initializer_range)``,
    GPT-2's residual projections scaled by ``1 / sqrt(2 * n_layer)``, biases zero, the
    padding id's embedding row zero, norms the identity. ``attention`` ("auto",
    "xla" or "cudnn") is the ``implementation`` of every ``ft.nn.MultiheadAttention`` built.

    The model (the classes of ``functree.nn._hf_models``) is made of ordinary ``ft.nn``
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
    if weights is None and hasattr(source, "config") and hasattr(source, "state_dict"):
        config, weights = source.config, source.state_dict()
        model_type = getattr(config, "model_type", None)
        if model_type in COVERED and type(source).__name__ != COVERED[model_type]:
            raise ValueError(UNCOVERED_CLASS.format(given=type(source).__name__, covered=COVERED[model_type],
                                                    all=", ".join(COVERED.values())))
    else:
        if weights is None and key is None and isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
            weights = source  # a save_pretrained directory: its config and its weights
        config = _config(source)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(UNCOVERED_ARCHITECTURE.format(given=f"model_type {model_type!r}", covered=_covered()))
    family = FAMILIES[model_type]
    carried = hf_config_of(config, source)
    if weights is None:
        if key is None:
            raise ValueError(NEEDS_WEIGHTS_OR_KEY.format(model_type=model_type))
        return _from_config(family, config, dtype, key, attention).replace(hf_config=carried)
    weights = _normalized(model_type, _weights(weights))
    template = jax.eval_shape(lambda: family.build(config, set(weights), dtype, jax.random.key(0), attention))
    weights = _untie(family, template, weights)
    cls = type(template)
    model = load_torch_state_dict(template, weights, rename=cls.hf_rename, layouts=cls.hf_layouts)
    return model.replace(hf_config=carried)


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
    family = next((f for f in FAMILIES.values() if type(model) is f.model), None)
    if family is None:
        raise ValueError(NOT_A_PORT.format(covered=", ".join(f.model.__name__ for f in FAMILIES.values()),
                                           given=type(model).__name__))
    out = torch_state_dict(model, rename=model.hf_rename, layouts=model.hf_layouts, numpy=True)
    if family.head is not None and getattr(model, "lm_head", True) is None:
        head, embedding = family.head
        out[head] = out[embedding]
    if numpy:
        return out
    return _as_tensors(out)
