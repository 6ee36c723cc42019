"""IBM's Granite (``model_type: "granite"``): Llama with four multipliers, each a Python float
of the config applied where Hugging Face's ``modeling_granite.py`` applies it.

* ``embedding_multiplier`` ``m_e``: the blocks' input is ``m_e * embed_tokens(ids)`` (the
  tied head reads the embedding table itself, unscaled);
* ``residual_multiplier`` ``m_r``: each sublayer's output scaled before its residual sum,
  ``x = x + m_r * self_attn(input_layernorm(x))``, then ``x = x + m_r *
  mlp(post_attention_layernorm(x))`` (:class:`GraniteDecoderLayer`);
* ``attention_multiplier`` ``m_a``: the attention logits ``m_a q k^T`` in place of
  ``q k^T / sqrt(head_dim)`` (each attention's ``logit_scale``, in the model's float32 or
  float64: HF's scale is a Python float);
* ``logits_scaling`` ``s``: ``logits = lm_head(norm(x)) / s`` (with a tied head too).

A multiplier meets a bfloat16 or float16 tensor in float32, rounded back once, as torch's
CPU and CUDA kernels compute a half tensor times a Python number (the number is not rounded
to the tensor's dtype first); float32 and float64 compute in their own dtype.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp

from functree._module import field
from functree.hf._causal import with_member_values
from functree.hf._llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, sandwich_outputs
from functree.nn._normalization import statistics_dtype

__all__ = ["GraniteForCausalLM", "GraniteDecoderLayer", "MULTIPLIER", "times"]

MULTIPLIER = """\
ft.nn.from_hf: the granite config sets {option}={value!r}; {why} Hugging Face's \
GraniteForCausalLM would compute {outcome} with this value.

    wrong:  "{option}": {value_json}
    right:  "{option}": {example}     # the checkpoint's own ({default}: Llama's)
"""

# Each multiplier of the config, its default (GraniteConfig's) and a checkpoint's value
# (granite-3.0-8b-base's config.json) for the error's fix.
_MULTIPLIERS = {"embedding_multiplier": (1.0, 12.0), "residual_multiplier": (1.0, 0.22),
                "attention_multiplier": (1.0, 0.0078125), "logits_scaling": (1.0, 16.0)}


def times(x: jax.Array, factor: float) -> jax.Array:
    """``factor * x`` in float32 or wider (:func:`statistics_dtype`), in ``x``'s dtype: torch's
    half tensor times a Python number (module docstring); a factor of 1 adds no operation.

    Example:
      >>> import jax.numpy as jnp
      >>> times(jnp.ones(2, jnp.bfloat16), 0.22).tolist() == [jnp.bfloat16(0.22)] * 2   # one rounding
      True
    """
    if factor == 1.0:
        return x
    wide = statistics_dtype(x.dtype)
    return (x.astype(wide) * jnp.asarray(factor, wide)).astype(x.dtype)


def _over(x: jax.Array, divisor: float) -> jax.Array:
    """``x / divisor`` as :func:`times` computes (HF divides, ``logits / logits_scaling``)."""
    if divisor == 1.0:
        return x
    wide = statistics_dtype(x.dtype)
    return (x.astype(wide) / jnp.asarray(divisor, wide)).astype(x.dtype)


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Granite's block: Llama's, each sublayer's output times ``residual_multiplier`` before
    its residual sum (HF's ``GraniteDecoderLayer``): ``x + m_r * self_attn(input_layernorm(x))``,
    then ``x + m_r * mlp(post_attention_layernorm(x))``."""

    residual_multiplier: float = field(static=True, default=1.0)

    def __init__(self, *args: Any, residual_multiplier: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.residual_multiplier = float(residual_multiplier)

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None,
                 rotary_positions: Any = None, key: jax.Array | None = None) -> Any:
        scaled = functools.partial(times, factor=self.residual_multiplier)  # the outputs, not the inputs
        norms = (self.input_layernorm, scaled, self.post_attention_layernorm, scaled)
        return sandwich_outputs(x, norms, self.self_attn, self.mlp, mask, cache, positions, rotary_positions, key)


def _with_attention_multiplier(model: LlamaModel, multiplier: float, dtype: Any) -> LlamaModel:
    """``model`` with each attention's ``logit_scale`` the ``attention_multiplier``, in the
    parameters' float32 (float64 for float64: HF's Python float, not rounded to float32)."""
    layers = model.layers
    scale = jnp.full((layers.n,), multiplier, statistics_dtype(dtype))
    return model.replace(layers=with_member_values(layers, "self_attn", logit_scale=scale))


class GraniteForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``GraniteForCausalLM`` (IBM Granite 3.x): Llama with the embedding, the
    sublayers' outputs, the attention logits and the final logits scaled by the config's
    multipliers (module docstring). Held as static fields ``embedding_multiplier`` and
    ``logits_scaling``, the blocks' static ``residual_multiplier`` and each attention's
    ``logit_scale`` (a ``no_derivative`` leaf per Stack member); no weight of its own, so
    its state dict, ``save_hf`` and PEFT's module names are Llama's.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "granite", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
      ...           "num_hidden_layers": 2, "num_attention_heads": 2, "embedding_multiplier": 12.0,
      ...           "residual_multiplier": 0.22, "attention_multiplier": 0.25, "logits_scaling": 8.0}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> model.logits_scaling, model.model.layers.layers.residual_multiplier
      (8.0, 0.22)
      >>> model(np.zeros((1, 3), np.int32)).shape
      (1, 3, 11)
    """

    embedding_multiplier: float = field(static=True, default=1.0)
    logits_scaling: float = field(static=True, default=1.0)
    model_type = "granite"

    def __init__(self, *args: Any, embedding_multiplier: float = 1.0, residual_multiplier: float = 1.0,
                 attention_multiplier: float | None = None, logits_scaling: float = 1.0, **kwargs: Any):
        layer = functools.partial(GraniteDecoderLayer, residual_multiplier=residual_multiplier)
        super().__init__(*args, layer=layer, **kwargs)
        if attention_multiplier is not None:  # None: the attention's own 1 / sqrt(head_dim)
            self.model = _with_attention_multiplier(self.model, attention_multiplier,
                                                    self.model.embed_tokens.embeddings.dtype)
        self.embedding_multiplier, self.logits_scaling = float(embedding_multiplier), float(logits_scaling)

    def _embed(self, ids: jax.Array, real: jax.Array) -> jax.Array:
        return times(self.model.embed(ids, self._padding()), self.embedding_multiplier)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        return _over(super().lm_logits(hidden), self.logits_scaling)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        """The four multipliers (each checked: :data:`MULTIPLIER`); HF's attention always
        scales by ``attention_multiplier`` (1 by default, not ``1 / sqrt(head_dim)``)."""
        return {option: _multiplier(config, option) for option in _MULTIPLIERS}

    @classmethod
    def hf_values(cls, model: Any, config: Any) -> Any:
        """Each attention's ``logit_scale``, the ``attention_multiplier`` (no weight: a state
        dict has none), in the loaded parameters' float32 or float64."""
        dtype = model.model.embed_tokens.embeddings.dtype
        body = _with_attention_multiplier(model.model, _multiplier(config, "attention_multiplier"), dtype)
        return model.replace(model=body)


def _multiplier(config: Any, option: str) -> float:
    """The config's ``option`` (its default where absent): a finite number; ``logits_scaling``
    also nonzero (else :data:`MULTIPLIER`)."""
    default, example = _MULTIPLIERS[option]
    value = getattr(config, option, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and not (option == "logits_scaling" and value == 0):
        return float(value)
    if number and option == "logits_scaling" and value == 0:
        why, outcome = "the logits are divided by it, so it must not be 0.", "infinite or NaN logits (x / 0)"
    else:  # (a config.json's string or null is refused by its reader first, as HF's config class does)
        why, outcome = "it must be a finite number.", "infinite or NaN logits" if number else "no model"
    raise ValueError(MULTIPLIER.format(option=option, value=value, why=why, outcome=outcome, example=example,
                                       value_json=json.dumps(value, default=str), default=default))
