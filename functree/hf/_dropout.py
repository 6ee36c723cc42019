"""Hugging Face's dropout in the ports of :func:`ft.nn.from_hf`, opt-in with ``dropout=True``.

``ft.nn.from_hf(source, dropout=True, key=key)`` builds the port with the dropout rates its
config names, applied where Hugging Face's modules apply them (read in transformers'
``modeling_<family>.py``); ``dropout=False`` (the default) builds today's port, with no new
leaf. Each rate drops at one of four positions, ``y = x * m / (1 - rate)``,
``m ~ Bernoulli(1 - rate)``, in training mode only (``ft.nn.training(model)``; the Trainer
trains in it), as ``ft.nn.Dropout``:

* the embedding (after the embeddings' sum; BERT: after its LayerNorm): GPT-2's
  ``embd_pdrop``, BERT's ``hidden_dropout_prob``, GPT-NeoX's ``hidden_dropout``;
* the attention weights (after the softmax, before the values): GPT-2's ``attn_pdrop``,
  BERT's ``attention_probs_dropout_prob``, ``attention_dropout`` elsewhere;
* the attention's output and the MLP's output (after their last projection, before the
  residual sum; BERT: before the LayerNorm): GPT-2's and Phi-3's ``resid_pdrop``, BERT's
  ``hidden_dropout_prob``, OPT's ``dropout``, GPT-NeoX's ``hidden_dropout``.

Llama, Mistral, Qwen2 and Gemma drop the attention weights only. Rates a config carries
that Hugging Face's module does not apply are not applied either (Phi-3's ``embd_pdrop``,
OPT's ``activation_dropout``); OPT's ``layerdrop`` (whole layers skipped) is refused.

The masks' keys: each block's attention is a :class:`DropoutAttention` (a
``MultiheadAttention`` with the block's rates and a ``dropout_key``, a ``no_derivative``
field: raw key data, one per Stack member). A call with ``key=`` splits it (embedding,
blocks; the Stack gives each member its own); a call without one draws each member's masks
from its ``dropout_key`` and advances it as layer state (``ft.nn.record_state``: the
Trainer, ``train_step`` and ``value_with_gradient_and_state`` write it back), so a loss
calling ``model(ids)`` gets fresh masks every step, and the embedding's from the first
member's key. Under ``accumulate=k`` and on a mesh each microbatch and each device folds its
index into the keys it draws (``functree.nn._salt.salted_keys``): masks of its own, as
torch draws, while the recorded next keys are the ones a single call records. The attention weights' dropout cannot run in the fused attention kernel
(``jax.nn.dot_product_attention`` has none): in training mode with an attention rate above
0, the attention is the explicit ``softmax(q k^T) v`` (``functree.nn._attention``);
inference keeps the kernel. A call with a cache (``ft.nn.generate``'s decoding) never
drops, whatever the mode. A torch state dict holds no dropout key: ``to_hf_state_dict``
and ``save_hf`` write the weights alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._module import field, from_fields
from functree._random import flat_key, one_key
from functree.hf._family import FAMILIES, HFModel
from functree.nn._attention import MultiheadAttention
from functree.nn._salt import salted
from functree.nn._stack import Stack, member_ranks
from functree.nn._state import record_state

__all__ = ["DropoutAttention", "with_dropout", "without_dropout", "check_dropout_call", "block_keys", "top_keys",
           "decoding", "drop", "rate", "rate_fields"]

DROPOUT_NEEDS_KEY = """\
ft.nn.from_hf(..., dropout=True) draws dropout masks and needs a PRNG key for them (the \
weights are not touched by it: a model with weights is the same model).

    wrong:  ft.nn.from_hf(source, dropout=True)
    right:  ft.nn.from_hf(source, dropout=True, key=jax.random.key(0))
"""

BAD_DROPOUT_FLAG = """\
ft.nn.from_hf: dropout must be True (Hugging Face's rates, read from the config) or False \
(no dropout: the default), got {given!r}. A rate of your own goes into the config, in the \
fields {whose} reads (another family's field is not read: no dropout at all).

    wrong:  ft.nn.from_hf(source, dropout={given!r}, key=key)
    right:  ft.nn.from_hf(source, dropout=True, key=key)
{fixes}"""

# BAD_DROPOUT_FLAG's config lines: the family's rate fields (every field it reads), or each
# family's when the source's family is not known.
RATE_FIX = "       or:  {fields} = {value}; ft.nn.from_hf(config, weights, dropout=True, key=key)\n"
RATE_FIXES = "       or:  {lines}\n            ft.nn.from_hf(config, weights, dropout=True, key=key)\n"

BAD_RATE = """\
ft.nn.from_hf(..., dropout=True): the {model_type} config's {name} is {value!r}; a dropout \
rate is a number in [0, 1) (the probability of zeroing an element).

    wrong:  config.{name} = {value!r}
    right:  config.{name} = 0.1
"""

DROPOUT_NOT_PORTED = """\
ft.nn.from_hf(..., dropout=True): {cls} does not declare Hugging Face's dropout positions \
(its hf_dropout); families with dropout: {covered}.

    right:  ft.nn.from_hf(source)        # no dropout
"""

LAYERDROP = """\
ft.nn.from_hf(..., dropout=True): the OPT config sets layerdrop={value!r} (Hugging Face skips \
whole layers at random in training); functree's OPT does not skip layers, so its training \
would differ.

    right:  config.layerdrop = 0.0
"""

NO_DROPOUT_KEY = """\
{cls} (a port built with dropout=True) is in training mode without a key for its dropout \
masks: its dropout_key is None and the call passed no key=.

    wrong:  model(input_ids)                                   # dropout_key removed
    right:  model(input_ids, key=jax.random.key(step))        # a fresh key every step
       or:  ft.nn.from_hf(source, dropout=True, key=jax.random.key(0))   # keys of its own
       or:  ft.nn.inference(model)                             # no dropout
"""

POSITIONS = ("embedding", "attention", "attention_output", "mlp_output")
_STREAM = 0x44524F50  # folded into from_hf's key: the masks' keys, apart from the weights' draws
_EMBEDDING = 1  # folded into the first member's key: the embedding's mask without a call key


class DropoutAttention(MultiheadAttention):
    """A port's attention with its block's Hugging Face dropout: ``dropout`` (the parent's
    field) drops the attention weights; ``rates`` are ``(embedding, attention output, MLP
    output)`` (the embedding's is read from the first block by the model's call);
    ``dropout_key`` is raw key data, advanced as layer state when called without ``key=``
    (module docstring). Built by :func:`with_dropout`, never by hand.
    """

    dropout_key: jax.Array | None = field(no_derivative=True, default=None)
    rates: tuple[float, float, float] = field(static=True, default=(0.0, 0.0, 0.0))
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("dropout", "implementation", "rates")
    records_no_state: ClassVar[bool] = False  # its dropout_key is recorded in training mode

    @property
    def drops(self) -> bool:
        """Whether a call in training mode drops anything in this block."""
        return self.dropout > 0.0 or any(r > 0.0 for r in self.rates)  # the embedding's too (GPT-2's embd_pdrop)


class _RateNames:
    """A stand-in config that records the rate fields a family's ``hf_dropout`` reads
    (through :func:`rate`); any other attribute reads 0.0."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __getattr__(self, name: str) -> float:
        if name.startswith("__"):
            raise AttributeError(name)
        return 0.0


def rate_fields(family: type[HFModel]) -> list[str]:
    """The config fields holding ``family``'s dropout rates, in the order ``hf_dropout``
    reads them (``[]``: no dropout ported)."""
    names = _RateNames()
    family.hf_dropout(names)
    return list(dict.fromkeys(names.names))


def rate(config: Any, name: str) -> float:
    """The config's dropout rate ``name``, checked to be in [0, 1)."""
    if isinstance(config, _RateNames):
        config.names.append(name)
        return 0.0
    value = getattr(config, name, 0.0)
    value = 0.0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(BAD_RATE.format(model_type=getattr(config, "model_type", "?"), name=name, value=value))
    return float(value)


def check_layerdrop(config: Any) -> None:
    """OPT's ``layerdrop`` above 0 is refused (:data:`LAYERDROP`)."""
    value = getattr(config, "layerdrop", 0.0) or 0.0
    if value != 0.0:
        raise ValueError(LAYERDROP.format(value=value))


def check_dropout_call(source: Any, weights: Any, dropout: Any, key: Any) -> None:
    """``from_hf``'s ``dropout=`` checked before anything is read."""
    if dropout is False:
        return
    if dropout is not True:
        raise ValueError(_bad_flag(source, dropout))
    if key is None:
        raise ValueError(DROPOUT_NEEDS_KEY)


def _model_type(source: Any) -> Any:
    """The model type of ``from_hf``'s source where it is at hand (a config, an HF model, a
    config dict); a directory's is not read here (None)."""
    if isinstance(source, Mapping):
        return source.get("model_type")
    return getattr(source, "model_type", None) or getattr(getattr(source, "config", None), "model_type", None)


def _bad_flag(source: Any, given: Any) -> str:
    """BAD_DROPOUT_FLAG, its config line naming the fields the source's family reads (the
    audit's ``config.attn_pdrop`` was read by GPT-2 only: on Llama no dropout), or one line
    per family when the family is not known."""
    value = given if isinstance(given, float) and 0.0 < given < 1.0 else 0.1
    family = FAMILIES.get(_model_type(source) or "")
    if family is not None and rate_fields(family):
        fields = " = ".join(f"config.{n}" for n in rate_fields(family))
        return BAD_DROPOUT_FLAG.format(given=given, whose=f"the {family.model_type} family",
                                       fixes=RATE_FIX.format(fields=fields, value=value))
    by_fields: dict[str, list[str]] = {}  # families reading the same fields share a line
    for f in FAMILIES.values():
        if rate_fields(f):
            by_fields.setdefault(" = ".join(f"config.{n}" for n in rate_fields(f)), []).append(str(f.model_type))
    width = max(len(k) for k in by_fields) + len(f" = {value}")
    lines = "\n            ".join(f"{k + f' = {value}':<{width}}   # {', '.join(types)}"
                                  for k, types in by_fields.items())
    return BAD_DROPOUT_FLAG.format(given=given, whose="the model's family",
                                   fixes=RATE_FIXES.format(lines=lines))


def _declared(cls: type) -> set[str]:
    """The names ``cls`` or a base below :class:`HFModel` defines (its family's own methods)."""
    return {n for c in cls.__mro__ if issubclass(c, HFModel) and c is not HFModel for n in vars(c)}


def _key_data(keys: jax.Array) -> jax.Array:
    typed = keys if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(keys)
    return jax.random.key_data(typed)


def with_dropout(model: Any, config: Any, dropout: bool, key: Any) -> Any:
    """``model`` (a port) with its family's dropout rates (:data:`POSITIONS`, from
    ``type(model).hf_dropout(config)``) when ``dropout``, else ``model`` itself. Each block's
    attention becomes a :class:`DropoutAttention`, its ``dropout_key`` one key per member
    split from ``fold_in(key, _STREAM)`` (apart from the weights' draws of the same key).

    Example:
      >>> import functree as ft, jax
      >>> config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 3, "n_head": 2}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0), dropout=True)
      >>> attn = model.transformer.h.layers.attn
      >>> type(attn).__name__, attn.dropout, attn.rates, attn.dropout_key.shape   # HF's defaults: 0.1
      ('DropoutAttention', 0.1, (0.1, 0.1, 0.1), (3, 2))
    """
    if not dropout:
        return model
    rates: Mapping[str, float] | None = type(model).hf_dropout(config)
    if rates is None:
        covered = ", ".join(c.__name__ for c in FAMILIES.values() if "hf_dropout" in _declared(c))
        raise ValueError(DROPOUT_NOT_PORTED.format(cls=type(model).__name__, covered=covered))
    typed = key if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
    stream = jax.random.fold_in(typed, _STREAM)

    def convert(node: Any) -> Any:
        return _stack_with_dropout(node, rates, stream) if isinstance(node, Stack) else node

    return jax.tree.map(convert, model, is_leaf=lambda n: isinstance(n, Stack))


def without_dropout(model: Any) -> Any:
    """``model`` with each :class:`DropoutAttention` back to the plain attention ``from_hf``
    builds without dropout (no key, no rate): the tree a port's config describes (``save_hf``'s check)."""

    def plain(node: Any) -> Any:
        if not isinstance(node, DropoutAttention):
            return node
        values = {n: getattr(node, n) for n in MultiheadAttention.__ft_fields__}
        return from_fields(MultiheadAttention, {**values, "dropout": 0.0})

    return jax.tree.map(plain, model, is_leaf=lambda n: isinstance(n, DropoutAttention))


def _stack_with_dropout(stack: Stack, rates: Mapping[str, float], key: jax.Array) -> Stack:
    block = stack.layers
    name = next(n for n in type(block).__ft_fields__ if isinstance(getattr(block, n), MultiheadAttention))
    attention = getattr(block, name)
    values = {n: getattr(attention, n) for n in type(attention).__ft_fields__}
    values.update(dropout=rates.get("attention", 0.0), dropout_key=_key_data(jax.random.split(one_key(key), stack.n)),
                  rates=(rates.get("embedding", 0.0), rates.get("attention_output", 0.0), rates.get("mlp_output", 0.0)))
    block = block.replace(**{name: from_fields(DropoutAttention, values)})
    return stack.replace(layers=block, ranks=None if stack.ranks is None else member_ranks(block))


def dropout_attention(block: Any) -> DropoutAttention | None:
    """The block's :class:`DropoutAttention`, if it is one (a port built with ``dropout=True``)."""
    for name in type(block).__ft_fields__:
        value = getattr(block, name)
        if isinstance(value, DropoutAttention):
            return value
    return None


def _dropping(attention: Any) -> bool:
    return isinstance(attention, DropoutAttention) and attention.training and attention.drops


def block_keys(attention: Any, key: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """One block call's keys ``(attention weights, attention output, MLP output)``, or None
    where nothing drops (inference, no rate, a port without dropout: today's computation).
    Without ``key``, the attention's ``dropout_key`` is split: one half drawn from, the other
    recorded as its next value."""
    if not _dropping(attention):
        return None
    first, second, third = jax.random.split(_drawn(attention) if key is None else key, 3)
    return first, second, third


def _drawn(attention: DropoutAttention) -> jax.Array:
    """A key from the attention's ``dropout_key``, whose next value is recorded as layer state."""
    if attention.dropout_key is None:
        raise ValueError(NO_DROPOUT_KEY.format(cls=type(attention).__name__))
    drawn, following = jax.random.split(jax.random.wrap_key_data(attention.dropout_key))
    record_state(attention, dropout_key=jax.random.key_data(following))
    return salted(drawn)  # a microbatch's / device's own masks (nn._salt.salted_keys); the next key unsalted


def top_keys(blocks: Stack, key: jax.Array | None) -> tuple[float, jax.Array | None, jax.Array | None] | None:
    """A model call's ``(embedding rate, embedding key, the blocks' key)``, or None where
    nothing drops. With ``key``: split in two (the Stack splits its half among the members);
    without: the embedding's from the first member's ``dropout_key`` (folded: apart from
    that member's own masks), the members drawing from their own keys."""
    attention = dropout_attention(blocks.layers)
    if attention is None or not _dropping(attention):
        return None
    if key is not None:
        embedding, rest = jax.random.split(one_key(key))
        return attention.rates[0], embedding, rest
    if attention.dropout_key is None:
        raise ValueError(NO_DROPOUT_KEY.format(cls=type(attention).__name__))
    first = jax.random.wrap_key_data(attention.dropout_key[0])
    return attention.rates[0], salted(jax.random.fold_in(first, _EMBEDDING)), None


def decoding(attention: Any) -> Any:
    """The attention for a call with a cache (``ft.nn.generate``'s decoding): a
    :class:`DropoutAttention` in training mode switched to inference (decoding never drops);
    any other attention as it is."""
    if isinstance(attention, DropoutAttention) and attention.training:
        return attention.replace(training=False)
    return attention


def drop(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """``x * m / (1 - rate)``, ``m ~ Bernoulli(1 - rate)`` (``ft.nn.Dropout``'s); ``x`` at rate 0.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> sorted(set(drop(jnp.ones(1000), 0.5, jax.random.key(0)).tolist()))
      [0.0, 2.0]
    """
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(flat_key(key), 1.0 - rate, jnp.shape(x))  # the key's mask (functree/_random.py)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
