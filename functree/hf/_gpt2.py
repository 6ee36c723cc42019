"""GPT-2 as a functree model: Hugging Face's ``GPT2LMHeadModel`` (:func:`ft.nn.from_hf`'s ``gpt2``)."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import Module, field
from functree._random import one_key
from functree.hf._causal import Block, CausalLM, lookup_rows, with_member_values
from functree.hf._config import HFConfig
from functree.hf._dropout import rate
from functree.hf._options import activation, require
from functree.nn._attention import MultiheadAttention
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import LayerNorm
from functree.nn._precision import statistics_dtype
from functree.nn._stack import Stack

__all__ = ["GPT2LMHeadModel", "GPT2Model", "GPT2Block", "GPT2MLP", "attention_scales"]

_GPT2_BUFFER = re.compile(r"(transformer\.)?h\.[0-9]+\.attn\.(bias|masked_bias)")


class GPT2MLP(Module):
    """``c_proj(activation(c_fc(x)))`` (HF's ``Conv1D`` layers as ``Dense``)."""

    c_fc: Dense
    c_proj: Dense

    def __init__(self, d: int, hidden: int, activation: Any, *, key: jax.Array, dtype: Any = jnp.float32):
        k1, k2 = jax.random.split(one_key(key))
        self.c_fc = Dense(d, hidden, activation, key=k1, dtype=dtype)
        self.c_proj = Dense(hidden, d, key=k2, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(self.c_fc(x))


class GPT2Block(Block):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    ln_1: LayerNorm
    attn: MultiheadAttention
    ln_2: LayerNorm
    mlp: GPT2MLP

    def __init__(self, d: int, heads: int, hidden: int, activation: Any, epsilon: float, *, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto"):
        k1, k2 = jax.random.split(one_key(key))
        self.ln_1 = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.attn = MultiheadAttention(d, heads, causal=True, implementation=attention, key=k1, dtype=dtype)
        self.ln_2 = LayerNorm(d, epsilon=epsilon, dtype=dtype)
        self.mlp = GPT2MLP(d, hidden, activation, key=k2, dtype=dtype)

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        return self.ln_1, self.attn, self.ln_2, self.mlp


class GPT2Model(Module):
    """GPT-2's body: token and position embeddings, the blocks ``h``, the final norm ``ln_f``
    (``scales``: each block's attention logit factor, its ``attn.logit_scale``; None: ``1 /
    sqrt(head size)``)."""

    wte: Embedding
    wpe: Embedding
    h: Stack
    ln_f: LayerNorm

    def __init__(self, vocab: int, positions: int, d: int, heads: int, layers: int, hidden: int, activation: Any,
                 epsilon: float, *, key: jax.Array, dtype: Any = jnp.float32, attention: Any = "auto",
                 scales: tuple[float, ...] | None = None):
        k1, k2, k3 = jax.random.split(one_key(key), 3)
        self.wte = Embedding(vocab, d, key=k1, dtype=dtype)
        self.wpe = Embedding(positions, d, key=k2, dtype=dtype)
        h = Stack(lambda k: GPT2Block(d, heads, hidden, activation, epsilon, key=k, dtype=dtype,
                                      attention=attention), layers, key=k3)
        if scales is not None:  # each member its own factor (a no_derivative leaf: no weight)
            h = with_member_values(h, "attn", logit_scale=jnp.asarray(scales, statistics_dtype(self.wte.embeddings.dtype)))
        self.h = h
        self.ln_f = LayerNorm(d, epsilon=epsilon, dtype=dtype)


def attention_scales(config: Any) -> tuple[float, ...] | None:
    """Each layer's attention logit factor as HF's ``GPT2Attention.scaling``: ``1 /
    sqrt(head size)`` (1 with ``scale_attn_weights: false``), divided by ``layer_idx + 1``
    with ``scale_attn_by_inverse_layer_idx: true``; None where both are HF's defaults (the
    attention's own ``1 / sqrt(head size)``: no leaf, today's program). ``reorder_and_upcast_attn``
    computes the same logits in float32, as functree's attention always does."""
    weights = bool(getattr(config, "scale_attn_weights", True))
    by_layer = bool(getattr(config, "scale_attn_by_inverse_layer_idx", False))
    if weights and not by_layer:
        return None
    base = (config.n_embd // config.n_head) ** -0.5 if weights else 1.0
    return tuple(base / (i + 1) if by_layer else base for i in range(config.n_layer))


class GPT2LMHeadModel(CausalLM):
    """Hugging Face's ``GPT2LMHeadModel`` as a functree model (built by :func:`ft.nn.from_hf`).

    ``logits = lm_head(ln_f(h(wte(ids) + wpe(positions))))``, the head tied to ``wte``
    (``lm_head`` is None: ``x wte^T``). Positions are ``cumsum(attention_mask) - 1`` with a
    mask (left padding as HF's ``generate``), else ``0..T-1``; more than ``n_positions``
    tokens raise (a position past the table under a cache reads NaN). Parameters keep HF's
    names under ``transformer`` (:mod:`functree.hf._causal` for the layers' own).
    ``attention_scales``: one logit factor per layer (None: ``1 / sqrt(head size)``), from
    the config's ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx``
    (:func:`attention_scales`).
    """

    transformer: GPT2Model
    lm_head: Dense | None
    hf_config: HFConfig | None = field(static=True, default=None)  # from_hf's: config.json (and generation's)
    model_type = "gpt2"
    hf_head = ("lm_head.weight", "transformer.wte.weight")
    hf_residual = ("*.attn.output_projection", "*.mlp.c_proj")
    hf_layouts: ClassVar[dict[str, Any]] = {"transformer.h.*": "conv1d"}
    rotates = False

    def __init__(self, vocab: int, positions: int, d: int, heads: int, layers: int, *, hidden: int | None = None,
                 activation: Any = None, epsilon: float = 1e-5, tied: bool = True, key: jax.Array,
                 dtype: Any = jnp.float32, attention: Any = "auto",
                 attention_scales: tuple[float, ...] | None = None):
        from functree._activations import gelu

        k1, k2 = jax.random.split(one_key(key))
        self.transformer = GPT2Model(vocab, positions, d, heads, layers, 4 * d if hidden is None else hidden,
                                     gelu if activation is None else activation, epsilon, key=k1, dtype=dtype,
                                     attention=attention, scales=attention_scales)
        self.lm_head = None if tied else Dense(d, vocab, use_bias=False, key=k2, dtype=dtype)

    @property
    def max_positions(self) -> int:
        """The longest sequence the learned position embedding covers (``n_positions``):
        ``ft.nn.generate`` refuses a prompt whose longest row's real tokens plus
        ``max_new_tokens`` pass it (left padding takes no position: HF's ``cumsum(mask) - 1``)."""
        return int(self.transformer.wpe.embeddings.shape[0])

    def _tokens(self) -> Embedding:
        return self.transformer.wte

    def _blocks(self) -> Stack:
        return self.transformer.h

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return self.transformer.ln_f(x)

    def _embed(self, ids: jax.Array, real: jax.Array) -> jax.Array:
        return lookup_rows(self.transformer.wte, ids) + lookup_rows(self.transformer.wpe, real)

    def _limit(self) -> tuple[int, str] | None:
        return self.max_positions, "n_positions"

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: jax.Array, attention: str) -> Any:
        c = config
        require(c, "add_cross_attention", False, False)
        return cls(c.vocab_size, c.n_positions, c.n_embd, c.n_head, c.n_layer, hidden=c.n_inner,
                   activation=activation(c, "activation_function"), epsilon=c.layer_norm_epsilon,
                   tied=bool(getattr(c, "tie_word_embeddings", True)), key=key, dtype=dtype, attention=attention,
                   attention_scales=attention_scales(c))

    @classmethod
    def hf_values(cls, model: Any, config: Any) -> Any:
        """Each layer's attention logit factor (:func:`attention_scales`), where the config
        sets one."""
        scales = attention_scales(config)
        if scales is None:
            return model
        wide = statistics_dtype(model.transformer.wte.embeddings.dtype)  # HF's Python float for float64 weights
        h = with_member_values(model.transformer.h, "attn", logit_scale=jnp.asarray(scales, wide))
        return model.replace(transformer=model.transformer.replace(h=h))

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``embd_pdrop`` on ``wte + wpe``, ``attn_pdrop`` on the attention weights,
        ``resid_pdrop`` after ``attn.c_proj`` and ``mlp.c_proj`` (``modeling_gpt2.py``)."""
        resid = rate(config, "resid_pdrop")
        return {"embedding": rate(config, "embd_pdrop"), "attention": rate(config, "attn_pdrop"),
                "attention_output": resid, "mlp_output": resid}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """GPT-2's body saved without ``transformer.`` (the ``gpt2`` checkpoint), its causal-mask buffers."""
        out = {k: v for k, v in weights.items() if not _GPT2_BUFFER.fullmatch(k)}
        if "wte.weight" in out and "transformer.wte.weight" not in out:
            out = {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in out.items()}
        return out

