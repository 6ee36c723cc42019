"""What every model :func:`ft.nn.from_hf` builds shares: input checks, positions, masks and
the blocks' call (:func:`pre_norm`), and :class:`CausalLM`, the decoder language models'
``check_token_ids``, ``init_cache`` and ``__call__`` written once.

Each class mirrors its Hugging Face counterpart's module tree, so a parameter's key path
is HF's name (``model.layers.3.mlp.up_proj.weight``) except inside the layers ``ft.nn``
names itself: an attention's ``query_projection`` / ``key_projection`` /
``value_projection`` / ``output_projection`` (HF's ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``; GPT-2's fused ``c_attn`` / ``c_proj``; BERT's ``self.query`` ... ``output.dense``),
a norm's ``scale`` / ``offset`` (HF's ``weight`` / ``bias``), an embedding's
``embeddings`` (``weight``). The blocks are an ``ft.nn.Stack`` (one scanned block;
``model.layers.2`` is member 2).

Calls follow the cache protocol of ``ft.nn.generate``::

    logits = model(input_ids, attention_mask=None)             # no cache
    cache = model.init_cache(batch_size, max_length, dtype=None)
    logits, cache = model(input_ids, attention_mask=am, positions=pos, cache=cache)

``attention_mask`` is ``[batch, T]`` without a cache (1 = a real token, 0 = padding) and
``[batch, max_length]`` with one (1 = a filled slot, the current tokens included), bool or
0/1 and nothing else: a concrete mask holding another value (2, -1) raises naming the entry,
a traced integer one without a cache makes that row's outputs NaN (:func:`padding_mask`);
``positions`` is int32 ``[batch, T]`` (with a cache: the cache slots). Each block passes
``mask``, ``cache`` and ``positions`` to its attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import Module, field
from functree._repr import first_index, short_array
from functree.hf._dropout import block_keys, decoding, drop, top_keys
from functree.hf._family import HFModel
from functree.losses._linear_cross_entropy import linear_cross_entropy
from functree.nn._attention import KVCache, MultiheadAttention, check_cache_positions
from functree.nn._check import concrete
from functree.nn._embedding import Embedding, table_rows, without_padding_gradient
from functree.nn._linear import Dense, add_bias
from functree.nn._rotary import RopeScaling
from functree.nn._stack import Stack, member_ranks

__all__ = ["CausalLM", "Block", "TiedBias", "check_token_ids", "padding_index", "padding_row", "post_norm",
           "with_member_values"]

BAD_INPUT_IDS = """\
{model}: input_ids must be integer token ids [batch, T], got {given}.

    wrong:  model(jnp.asarray(tokens, jnp.float32))
    right:  model(jnp.asarray(tokens, jnp.int32))     # [batch, T]
"""

BAD_ATTENTION_MASK = """\
{model}: attention_mask must be [batch, {length}] of 0/1 (or bool): 1 marks a real token{slots}; \
got {given} for input_ids {ids}.

    wrong:  model(input_ids, attention_mask=mask[:, None, None, :])
    right:  model(input_ids, attention_mask=mask)      # mask [batch, {length}]
"""

MASK_NOT_ZERO_ONE = """\
{model}: attention_mask[{row}, {column}] is {value}; a mask holds 1 (or True) for a real \
token{slots} and 0 (or False) for padding, nothing else. Hugging Face reads any nonzero value \
as a real token (a -1 meant as padding is attended, silently) and counts positions with \
cumsum(mask) where it computes them (a 2 moves them).

    wrong:  model(input_ids, attention_mask=mask{cache})     # mask[{row}, {column}] == {value}
    right:  model(input_ids, attention_mask={fix}{cache})
       or:  model(input_ids, attention_mask=mask.astype(bool){cache})     # where every nonzero value marks a real token
"""

NEEDS_POSITIONS = """\
{model}: with a cache, pass the positions of the new tokens (int32 [batch, T]); the model \
cannot tell where in the cache they go.

    wrong:  model(input_ids, attention_mask=am, cache=cache)
    right:  model(input_ids, attention_mask=am, positions=pos, cache=cache)
       or:  ft.nn.generate(model, input_ids, max_new_tokens)   # does this for you
"""

BAD_POSITIONS = """\
{model}: positions must be integers [batch, T] broadcastable to input_ids {ids}, got {given}.

    right:  model(input_ids, positions=jnp.cumsum(mask, axis=-1) - 1)
"""


OUT_OF_VOCABULARY = """\
{model}: token id {token} at input_ids{where} is outside the vocabulary (ids 0 to {last}: \
vocab_size {vocab}). Hugging Face raises here (IndexError); the usual cause is a tokenizer \
with added tokens and an embedding that was not resized.

    wrong:  model(tokenizer(text_with_added_tokens))            # ids >= {vocab}
    right:  ids below {vocab} (or resize the embedding before porting: hf_model.resize_token_embeddings(len(tokenizer)))
"""

TOO_MANY_POSITIONS = """\
{model}: {given} positions, but the learned position embedding has {limit} \
({name} = {limit}); Hugging Face raises here too.

    wrong:  model(input_ids)                    # input_ids [batch, {given}]
    right:  model(input_ids[:, -{limit}:])      # at most {limit} tokens
"""

POSITION_PAST_TABLE = """{model}: row {row} reaches position {high} ({why}), but the learned position embedding has \
{limit} ({name} = {limit}: positions 0 to {last}); Hugging Face raises here too (IndexError).

    right:  {right}
"""


LONGROPE_CROSSING = """\
{model}: longrope switches from its short to its long factors past original_max_positions \
({original}), and this cache of {length} slots would cross that point after a prompt of {prompt} \
tokens. Hugging Face's generate recomputes the whole cache with the long factors there (Phi-3's \
prepare_inputs_for_generation, at the step whose input holds {original} + 1 tokens); a KV cache \
keeps the keys it has, so the tokens would differ.

    right:  ft.nn.generate(model, input_ids, {fit})        # at most {original} + 1 positions in all
       or:  model(all_tokens)                               # no cache: the long factors throughout, as HF
"""


def longrope_crossing(model: Any, rotary: Any, prompt: int, length: int) -> None:
    """Raise :data:`LONGROPE_CROSSING` where a prompt of ``prompt`` tokens (its keys rotated
    with the short factors: ``prompt <= L0 = original_max_positions``) into a cache of
    ``length`` slots reaches the long factors, ``length >= L0 + 2``. Hugging Face's
    ``generate`` computes step ``k`` (``k >= 1``) from ``prompt + k`` tokens and recomputes its
    whole cache with the long factors at the step whose input has ``L0 + 1`` tokens, which
    exists iff ``prompt <= L0 < prompt + new - 1``; with ``length = prompt + new`` slots (the
    last token is never fed back) that is ``length >= L0 + 2``. A prompt past ``L0`` has its
    keys rotated with the long factors already, as HF's. Any rotary but longrope passes."""
    if not isinstance(rotary, RopeScaling) or rotary.kind != "longrope":
        return
    original = rotary.original_max_positions or 0
    if 1 <= prompt <= original and length >= original + 2:
        raise ValueError(LONGROPE_CROSSING.format(model=type(model).__name__, original=original, length=length,
                                                  prompt=prompt, fit=original + 1 - prompt))


def check_longrope(model: Any, attention: MultiheadAttention, ids: Any, cache: Any) -> None:
    """A prefill (``T > 1`` tokens) into a cache that crosses longrope's switch point raises
    (:func:`longrope_crossing`). A call of one token cannot tell a one-token prompt from a
    decoding step: ``ft.nn.generate`` checks its own sizes first (``check_generation``)."""
    prompt = np.shape(ids)[1] if np.ndim(ids) == 2 else 0
    if cache is not None and prompt > 1:
        longrope_crossing(model, attention.rotary, prompt, jax.tree.leaves(cache)[0].shape[2])


def check_token_ids(model: Any, input_ids: Any, vocab: int) -> None:
    """Raise :data:`OUT_OF_VOCABULARY` if concrete ``input_ids`` hold an id outside ``[0, vocab)``
    (traced ids are not checked here: the embedding lookup makes their rows NaN instead)."""
    ids = concrete(input_ids)
    if ids is None or ids.size == 0:
        return
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        where = first_index(bad)
        raise ValueError(OUT_OF_VOCABULARY.format(model=type(model).__name__, token=int(ids[where]),
                                                  where=list(where), last=vocab - 1, vocab=vocab))


def lookup_rows(embedding: Embedding, indices: jax.Array, padding: int | None = None) -> jax.Array:
    """Rows of the embedding table; NaN for an index outside it (traced ids the entry check
    could not read: the wrong row shows as NaN logits, never as another token's row).
    ``padding``: the row HF's embedding has as ``padding_idx`` (:func:`padding_row`): its
    lookups pass no gradient back, as torch's (a tied head still trains it)."""
    return without_padding_gradient(table_rows(embedding.embeddings, indices), indices, padding)


def padding_row(model: Any, vocab: int) -> int | None:
    """The token embedding's row HF builds with ``padding_idx = config.pad_token_id`` (the
    families whose ``hf_padded`` names it: Llama and those built like it, OPT, BERT), or
    None (no pad id, no config, or a family without one: GPT-2, GPT-NeoX). torch wraps a
    negative index."""
    config = getattr(model, "hf_config", None)
    if type(model).hf_padded is None or config is None:
        return None
    return padding_index(config.get("pad_token_id"), vocab)


def padding_index(pad: Any, vocab: int) -> int | None:
    """The row torch's ``nn.Embedding(vocab, d, padding_idx=pad)`` holds at zero: ``pad``
    wrapped as torch wraps a negative index (older Llama configs' ``pad_token_id: -1`` is
    the last row), or None (no pad id, or one outside the table, which torch refuses:
    ``from_hf`` refuses such a config for the padded families, PAD_OUTSIDE_VOCABULARY)."""
    if not isinstance(pad, int) or isinstance(pad, bool) or not -vocab <= pad < vocab:
        return None
    return pad % vocab


def check_ids(model: Any, input_ids: Any, vocab: int | None = None) -> jax.Array:
    ids = input_ids if isinstance(input_ids, jax.Array) else jnp.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(BAD_INPUT_IDS.format(model=type(model).__name__, given=short_array(ids)))
    if vocab is not None:
        check_token_ids(model, input_ids, vocab)
    return ids


def check_length(model: Any, length: int, limit: int, name: str) -> None:
    if length > limit:
        raise ValueError(TOO_MANY_POSITIONS.format(model=type(model).__name__, given=length, limit=limit, name=name))


def check_table(model: Any, width: int, real: jax.Array | None, cached: bool, given: bool, limit: int,
                name: str) -> None:
    """Refuse a position past a learned table of ``limit`` rows (HF: IndexError; the lookup
    would give NaN). The table is indexed by ``real`` (each row's real tokens, ``cumsum(mask)
    - 1``, or the ``given`` positions): checked where concrete (:data:`POSITION_PAST_TABLE`),
    so a left-padded batch wider than the table whose rows fit runs. Without a mask or
    positions (``real`` None), or traced, an uncached call counts its ``width`` (its positions
    are below it; a traced mask's real tokens are not known); a traced cached call is
    ``ft.nn.generate``'s, which checks its sizes before it runs."""
    if real is None or not (cached or given or width > limit):  # positions 0 .. width - 1 at most
        check_length(model, width, limit, name)
        return
    host = concrete(real)
    if host is None:
        if not cached:
            check_length(model, width, limit, name)
        return
    if host.size == 0 or host.max() < limit:
        return
    row = int(np.argmax(host.max(axis=1)))
    high = int(host[row].max())
    last = limit - 1
    if given and not cached:
        why, right = "the positions given", f"positions from 0 to {last}"
    elif cached:
        why = "its real tokens in the cache, the current ones included"
        right = (f"at most {limit} real tokens a row in the cache (ft.nn.generate checks its sizes before "
                 "it runs)")
    else:
        why = f"its {high + 1} real tokens; left padding takes no position"
        right = (f"model(input_ids[:, -{limit}:], attention_mask[:, -{limit}:])     # at most {limit} real "
                 "tokens a row")
    raise ValueError(POSITION_PAST_TABLE.format(model=type(model).__name__, row=row, high=high, why=why,
                                                limit=limit, name=name, last=last, right=right))


def padding_mask(model: Any, ids: jax.Array, attention_mask: Any, cached: bool) -> tuple[jax.Array | None, jax.Array]:
    """The mask as bool ``[batch, T]`` (``[batch, max_length]`` with a cache), checked, and
    the ids to embed. A concrete mask holding a value other than 0 or 1 raises
    :data:`MASK_NOT_ZERO_ONE` (naming the first entry); a traced integer one (under
    ``jax.jit``, not read on the host) gives such a row the ids -1, which the embedding's
    lookup reads as NaN rows (:func:`lookup_rows`): that row's outputs are NaN, never those of
    a guessed mask. One select on the ids, for a traced integer mask without a cache only (a
    cache's mask is ``ft.nn.generate``'s, 0/1: traced there, it must be 0/1)."""
    if attention_mask is None:
        return None, ids
    mask = jnp.asarray(attention_mask)
    kind_ok = mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)
    shape_ok = mask.ndim == 2 and mask.shape[0] == ids.shape[0] and (cached or mask.shape[1] == ids.shape[1])
    if not (kind_ok and shape_ok):
        length = "max_length" if cached else ids.shape[1]
        slots = " at that cache slot" if cached else ""
        raise ValueError(BAD_ATTENTION_MASK.format(model=type(model).__name__, length=length, slots=slots,
                                                   given=short_array(mask), ids=short_array(ids)))
    if mask.dtype == jnp.bool_:
        return mask, ids
    if not check_mask_values(model, attention_mask, cached) and not cached:  # traced: such rows embed as NaN
        bad = jnp.any((mask != 0) & (mask != 1), axis=1)
        ids = jnp.where(bad[:, None], jnp.asarray(-1, ids.dtype), ids)
    return mask != 0, ids


def check_mask_values(model: Any, attention_mask: Any, cached: bool = False) -> bool:
    """Raise :data:`MASK_NOT_ZERO_ONE` if a concrete integer ``[batch, T]`` mask holds a value
    other than 0 or 1, naming the first entry; True where the mask was read (concrete, or
    None), False where it is traced (under ``jax.jit``: not read on the host)."""
    if attention_mask is None:
        return True
    host = concrete(attention_mask)
    if host is None:
        return False
    if host.ndim != 2 or host.dtype == np.bool_:  # (another shape: BAD_ATTENTION_MASK names it)
        return True
    wrong = (host != 0) & (host != 1)
    if wrong.any():
        row, column = first_index(wrong)
        raise ValueError(MASK_NOT_ZERO_ONE.format(model=type(model).__name__, row=row, column=column,
                                                  value=host[row, column].item(),
                                                  slots=" (with a cache: a filled slot)" if cached else "",
                                                  fix="mask == 1" if cached else "input_ids != pad_id",
                                                  cache=", positions=pos, cache=cache" if cached else ""))
    return True


def _positions(model: Any, ids: jax.Array, mask: jax.Array | None, positions: Any, cached: bool) -> jax.Array:
    """Given positions (checked), else ``cumsum(mask) - 1`` (Hugging Face's for left padding;
    a padding token at the family's ``padding_position``, else its row's count), else ``0..T-1``."""
    if positions is not None:
        pos = jnp.asarray(positions)
        try:
            ok = jnp.issubdtype(pos.dtype, jnp.integer) and jnp.broadcast_shapes(pos.shape, ids.shape) == ids.shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(BAD_POSITIONS.format(model=type(model).__name__, ids=short_array(ids),
                                                  given=short_array(pos)))
        return jnp.broadcast_to(pos, ids.shape)
    if cached:
        raise ValueError(NEEDS_POSITIONS.format(model=type(model).__name__))
    if mask is None:
        return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    counted = jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1
    padding = getattr(model, "padding_position", None)
    return jnp.maximum(counted, 0) if padding is None else jnp.where(mask, counted, padding)


def _real_positions(pos: jax.Array, mask: jax.Array | None, cached: bool) -> jax.Array:
    """Each token's position among its row's real tokens (HF's ``cumsum(mask) - 1``): with a
    cache, ``pos`` are slots and the real tokens before each slot are counted."""
    if not cached or mask is None:
        return pos
    counts = jnp.cumsum(mask.astype(jnp.int32), axis=1)
    return jnp.maximum(jnp.take_along_axis(counts, pos, axis=1) - 1, 0)


def _attention_mask(mask: jax.Array | None, cached: bool) -> jax.Array | None:
    """The attention's mask: ``[batch, 1, 1, T]`` without a cache, the slots' ``[batch, max_length]`` with one."""
    if mask is None or cached:
        return mask
    return mask[:, None, None, :]


def _run(model: Any, input_ids: Any, attention_mask: Any, positions: Any, cache: Any, *, vocab: int,
         blocks: Stack, embed: Callable[[jax.Array, jax.Array], jax.Array], head: Callable[[jax.Array], jax.Array],
         rotary: bool, limit: tuple[int, str] | None = None, key: jax.Array | None = None) -> Any:
    """A decoder language model's call under the cache protocol (module docstring): inputs
    checked, positions made, ``embed(ids, real positions)``, the blocks, ``head``.

    ``rotary``: the blocks' attention rotates queries and keys, by the real positions (HF's)
    with or without a cache; otherwise (learned positions) the blocks get the slots only.
    A port built with ``dropout=True`` in training mode drops the embedding's output and
    gives the blocks their keys (:mod:`functree.hf._dropout`)."""
    ids = check_ids(model, input_ids, vocab)
    cached = cache is not None
    mask, ids = padding_mask(model, ids, attention_mask, cached)
    if not cached and mask is None and positions is None:
        pos = real = None  # 0..T-1: the attention's own
    else:
        pos = _positions(model, ids, mask, positions, cached)
        length = cache_length(cache) if cached else None
        if length is not None:
            check_cache_positions(type(model).__name__, pos, length)
        real = _real_positions(pos, mask, cached)
    if limit is not None:  # a learned table, indexed by the real positions
        check_table(model, ids.shape[1], real, cached, positions is not None, *limit)
    x = embed(ids, jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape) if real is None else real)
    kwargs: dict[str, Any] = {"mask": _attention_mask(mask, cached)}
    dropping = None if cached else top_keys(blocks, key)
    if dropping is not None:  # HF's dropout (opt-in): the embedding's mask; the blocks' key, if given
        rate, embedding, rest = dropping
        x = drop(x, rate, embedding)
        if rest is not None:
            kwargs["key"] = rest
    if cached:
        kwargs["positions"] = pos
        if rotary:
            kwargs["rotary_positions"] = real
    elif rotary and real is not None:
        kwargs["positions"] = real
    out = blocks(x, cache=cache, **kwargs)
    x, cache = (out, None) if cache is None else out
    logits = head(x)
    return logits if cache is None else (logits, cache)


def _pre_norm(x: jax.Array, norm1: Any, attention: MultiheadAttention, norm2: Any, mlp: Any, mask: Any,
              cache: Any, positions: Any, rotary_positions: Any = None, parallel: bool = False,
              key: jax.Array | None = None) -> Any:
    """One pre-norm block: ``x + attention(norm1(x))``, then ``x + mlp(norm2(x))`` (``parallel``:
    GPT-NeoX's ``x + attention(norm1(x)) + mlp(norm2(x))``); with a cache, ``(x, cache)``.
    With HF's dropout (a port built with ``dropout=True``, in training mode) the attention
    weights, the attention's output and the MLP's output are dropped, as HF's blocks do:
    ``x + drop(attention(norm1(x)))``, then ``x + drop(mlp(norm2(x)))``."""
    extra = {} if rotary_positions is None else {"rotary_positions": rotary_positions}
    keys = block_keys(attention, key) if cache is None else None  # decoding with a cache never drops
    if keys is None:  # no dropout: today's computation, op for op
        attention = decoding(attention) if cache is not None else attention
        out = attention(norm1(x), mask=mask, cache=cache, positions=positions, **extra)
        h, cache = (out, None) if cache is None else out
        x = x + h + mlp(norm2(x)) if parallel else x + h + mlp(norm2(x + h))
        return x if cache is None else (x, cache)
    rates = attention.rates  # type: ignore[attr-defined]  # a DropoutAttention (block_keys checked)
    out = attention(norm1(x), mask=mask, cache=cache, positions=positions, key=keys[0], **extra)
    h, cache = (out, None) if cache is None else out
    h = drop(h, rates[1], keys[1])
    if parallel:
        x = x + h + drop(mlp(norm2(x)), rates[2], keys[2])
    else:
        x = x + h
        x = x + drop(mlp(norm2(x)), rates[2], keys[2])
    return x if cache is None else (x, cache)


def post_norm(x: jax.Array, norm1: Any, attention: MultiheadAttention, norm2: Any, mlp: Any, mask: Any,
              cache: Any, positions: Any, key: jax.Array | None = None) -> Any:
    """One post-norm block (OPT-350m's ``do_layer_norm_before: false``): ``x = norm1(x +
    attention(x))``, then ``norm2(x + mlp(x))``; with a cache, ``(x, cache)``. With HF's
    dropout (training mode) the attention weights, its output and the MLP's output are
    dropped before their residual sums, as :func:`_pre_norm`."""
    keys = block_keys(attention, key) if cache is None else None  # decoding with a cache never drops
    if keys is None:
        attention = decoding(attention) if cache is not None else attention
        out = attention(x, mask=mask, cache=cache, positions=positions)
        h, cache = (out, None) if cache is None else out
        x = norm1(x + h)
        x = norm2(x + mlp(x))
        return x if cache is None else (x, cache)
    rates = attention.rates  # type: ignore[attr-defined]  # a DropoutAttention (block_keys checked)
    h = attention(x, mask=mask, cache=None, positions=positions, key=keys[0])
    x = norm1(x + drop(h, rates[1], keys[1]))
    return norm2(x + drop(mlp(x), rates[2], keys[2]))


def with_member_values(stack: Stack, attention: str, **values: Any) -> Stack:
    """``stack`` with its blocks' attention (field ``attention``) given per-member values:
    each of ``values`` (a ``MultiheadAttention`` data field: ``logit_scale``,
    ``member_window``) one entry per member, e.g. GPT-2's scale by layer index (the Stack
    builds its members alike)."""
    block = stack.layers
    attn = getattr(block, attention).replace(**values)
    block = block.replace(**{attention: attn})
    return stack.replace(layers=block, ranks=None if stack.ranks is None else member_ranks(block))


def _ties(x: jax.Array, embeddings: jax.Array) -> jax.Array:
    """Logits from a head tied to the input embedding: ``x E^T``."""
    return x @ embeddings.T.astype(x.dtype)


class TiedBias(Module):
    """A head tied to the token embedding that keeps a bias of its own: ``x E^T + bias``.
    Phi's ``lm_head`` with ``tie_word_embeddings``: HF ties ``lm_head.weight`` to the
    embedding alone, ``lm_head.bias`` stays the head's (its state dict name here too)."""

    bias: jax.Array = field(decay=False)

    def __init__(self, vocab: int, *, dtype: Any = jnp.float32):
        self.bias = jnp.zeros((vocab,), dtype)


def is_tied(lm_head: Any) -> bool:
    """Whether a causal LM's ``lm_head`` field is a head tied to its embedding (None, or a
    :class:`TiedBias`: no weight of its own)."""
    return lm_head is None or isinstance(lm_head, TiedBias)


LM_LABELS = """\
lm_loss: labels must be [batch, T] as input_ids are ({ids}), one label per token (the loss \
shifts them: each position predicts the next label), got {labels}.

    wrong:  model.lm_loss(ids, ids[:, 1:])
    right:  model.lm_loss(ids, ids)                                   # or a collator's labels, -100 where ignored"""


def _head(x: jax.Array, lm_head: Dense | TiedBias | None, embedding: Embedding) -> jax.Array:
    if lm_head is None:
        return _ties(x, embedding.embeddings)
    if isinstance(lm_head, TiedBias):
        return add_bias(_ties(x, embedding.embeddings), lm_head.bias)
    return lm_head(x)


def cache_length(cache: Any) -> int | None:
    """The slots of a model's cache (its first ``KVCache``'s keys ``[..., batch, slots,
    heads, size]``), or None for no cache of that form (its own checks name it)."""
    found = [c for c in jax.tree.leaves(cache, is_leaf=lambda c: isinstance(c, KVCache)) if isinstance(c, KVCache)]
    keys = getattr(found[0], "keys", None) if found else None
    shape = getattr(keys, "shape", ())
    return shape[-3] if len(shape) >= 3 else None


def _cache(blocks: Stack, batch_size: int, max_length: int, dtype: Any) -> Any:
    return blocks.init_cache(batch_size, max_length, dtype=dtype)  # type: ignore[attr-defined]


class Block(Module):
    """A pre-norm block's call and cache, shared by the families' blocks (their fields: HF's names)."""

    def _parts(self) -> tuple[Any, MultiheadAttention, Any, Any]:
        raise NotImplementedError

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """This block's attention cache (``MultiheadAttention.init_cache``)."""
        return self._parts()[1].init_cache(batch_size, max_length, dtype)

    def __call__(self, x: jax.Array, *, mask: Any = None, cache: Any = None, positions: Any = None,
                 rotary_positions: Any = None, key: jax.Array | None = None) -> Any:
        return _pre_norm(x, *self._parts(), mask, cache, positions, rotary_positions,
                         bool(getattr(self, "parallel", False)), key)


class CausalLM(HFModel):
    """A decoder language model's calls, written once for every family (module docstring):
    ``check_token_ids``, ``init_cache`` and ``model(input_ids, attention_mask=None, *,
    positions=None, cache=None, key=None)``. A family names its parts (:meth:`_tokens`,
    :meth:`_blocks`, :meth:`_final_norm`) and its difference (:meth:`_embed`: learned
    positions; ``rotates``: rotary attention; :meth:`_limit`: a position table's length).
    The head is the class's ``lm_head`` field (None: tied to :meth:`_tokens`; a
    :class:`TiedBias`: tied, with a bias of its own). ``key=``
    gives the dropout masks of a port built with ``dropout=True`` in training mode
    (without it, the blocks' own ``dropout_key``: :mod:`functree.hf._dropout`); else unused.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
      ...           "num_hidden_layers": 2, "num_attention_heads": 2}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> cache = model.init_cache(1, 8)
      >>> logits, cache = model(np.zeros((1, 3), np.int32), np.array([[1, 1, 1, 0, 0, 0, 0, 0]]),
      ...                       positions=np.arange(3)[None], cache=cache)
      >>> logits.shape
      (1, 3, 11)
    """

    rotates: ClassVar[bool] = True  # the blocks rotate queries and keys by the real positions
    # generate's protocol: the positions (learned ones: max_positions) count each row's real
    # tokens, so a left-padded prompt's padding takes none of the table (HF's cumsum(mask) - 1)
    positions_count_real_tokens: ClassVar[bool] = True
    # an uncached call's padding token's position (a mask, no positions): None, its row's real
    # tokens before it; OPT's forward puts it at -1 (HF's cumsum(mask) * mask - 1: its own table row)
    padding_position: ClassVar[int | None] = None

    def _tokens(self) -> Embedding:
        """The token embedding (the vocabulary; a tied head's weight)."""
        raise NotImplementedError

    def _blocks(self) -> Stack:
        raise NotImplementedError

    def _final_norm(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def _embed(self, ids: jax.Array, real: jax.Array) -> jax.Array:
        """The blocks' input for token ids at their real positions (``cumsum(mask) - 1``)."""
        return lookup_rows(self._tokens(), ids, self._padding())

    def _padding(self) -> int | None:
        """The token embedding's padding row (:func:`padding_row`)."""
        return padding_row(self, self._tokens().embeddings.shape[0])

    def _limit(self) -> tuple[int, str] | None:
        """A learned position table's length and its config name (longer inputs raise)."""
        return None

    def _check_call(self, input_ids: Any, cache: Any) -> None:
        """A family's own check of a call's inputs (Phi-3's longrope with a cache)."""

    def check_generation(self, prompt_length: int, new_tokens: int) -> None:
        """Raise where ``ft.nn.generate`` of ``new_tokens`` after a prompt of ``prompt_length``
        tokens (left padding included) would compute other tokens than Hugging Face's
        ``generate`` (Phi-3's longrope switch point: :func:`longrope_crossing`); ``generate``
        calls it with the exact sizes, before any bucket. Nothing to check here."""

    def check_token_ids(self, input_ids: Any) -> None:
        """Raise if concrete ``input_ids`` hold an id outside the vocabulary (``ft.nn.generate`` calls it)."""
        check_token_ids(self, input_ids, self._tokens().embeddings.shape[0])

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """One cache per block (``ft.nn.Stack.init_cache``)."""
        return _cache(self._blocks(), batch_size, max_length, dtype)

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None,
                 key: jax.Array | None = None) -> Any:
        self._check_call(input_ids, cache)
        return _run(self, input_ids, attention_mask, positions, cache, vocab=self._tokens().embeddings.shape[0],
                    blocks=self._blocks(), embed=self._embed, head=lambda x: self.lm_logits(self._final_norm(x)),
                    rotary=self.rotates, limit=self._limit(), key=key)

    def last_hidden_state(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None,
                          key: jax.Array | None = None) -> jax.Array:
        """The final norm's output ``[batch, T, hidden_size]``, Hugging Face's base model's
        ``last_hidden_state`` (``LlamaModel``'s, ``GPT2Model``'s; OPT's after
        ``project_out``): the call's logits are :meth:`lm_logits` of it. The arguments are
        the call's (no cache)."""
        self._check_call(input_ids, None)
        return _run(self, input_ids, attention_mask, positions, None, vocab=self._tokens().embeddings.shape[0],
                    blocks=self._blocks(), embed=self._embed, head=self._final_norm, rotary=self.rotates,
                    limit=self._limit(), key=key)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """The logits of :meth:`last_hidden_state`'s rows: the head (``lm_head``, or tied to
        the token embedding) and the family's own last step (Granite's ``logits_scaling``,
        Gemma 2's ``final_logit_softcapping``). Any leading axes."""
        return _head(hidden, getattr(self, "lm_head", None), self._tokens())

    def lm_loss(self, input_ids: Any, labels: Any, attention_mask: Any = None, *, positions: Any = None,
                key: jax.Array | None = None, chunk_size: int | str = "auto", label_smoothing: float = 0.0,
                ignore_index: int | None = -100, reduction: str = "mean") -> Any:
        """Hugging Face's causal LM loss, ``model(input_ids, labels=labels).loss``, without
        the logits ``[batch, T, vocab]`` in memory: the next-token cross entropy
        ``softmax_cross_entropy(logits[:, :-1], labels[:, 1:])`` (each position predicts the
        next label; labels of ``ignore_index``, -100 as HF's collators write on the prompt
        and padding, are left out; the mean is over the kept labels), computed by
        :func:`ft.losses.linear_cross_entropy` from :meth:`last_hidden_state` and
        :meth:`lm_logits`, a chunk of positions at a time (``chunk_size``; ``"auto"``: 2**25
        logits a chunk), the gradient making each chunk's logits again. ``labels``
        ``[batch, T]``, as ``input_ids`` (often the ids themselves); ``reduction="weighted"``
        gives the parts ``Optimizer(accumulate=k)`` combines (HF's ``num_items_in_batch``).
        A mixture of experts' load-balancing loss is not in it (:meth:`aux_loss`).

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp, numpy as np
          >>> config = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
          ...           "num_hidden_layers": 2, "num_attention_heads": 2}
          >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
          >>> ids = np.array([[1, 4, 2, 7, 3]])
          >>> loss = model.lm_loss(ids, ids, chunk_size=2)
          >>> whole = ft.losses.softmax_cross_entropy(model(ids)[:, :-1], ids[:, 1:])
          >>> bool(jnp.abs(loss - whole) < 1e-6)
          True
        """
        shape = np.shape(input_ids)
        if np.shape(labels) != shape or len(shape) != 2:
            raise ValueError(LM_LABELS.format(ids=list(shape), labels=list(np.shape(labels))))
        hidden = self.last_hidden_state(input_ids, attention_mask, positions=positions, key=key)
        return linear_cross_entropy(hidden[:, :-1], self.lm_logits, labels[:, 1:], chunk_size=chunk_size,
                                    label_smoothing=label_smoothing, ignore_index=ignore_index, reduction=reduction)
