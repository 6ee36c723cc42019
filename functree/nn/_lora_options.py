"""The options every LoRA layer takes, checked in one place: ``rank``, ``alpha``, ``dropout``,
``key`` and the adapters' ``dtype`` (``ft.nn.lora``, ``ft.nn.LoraDense``, ``ft.nn.LoraExperts``,
``ft.nn.LoraParameter``)."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from functree._random import one_key
from functree._tree import written_dtype
from functree.nn._window import is_int, is_real

__all__ = ["BAD_LORA_DTYPE", "BAD_RANK", "BAD_ALPHA", "BAD_DROPOUT", "NO_KEY", "check_dtype", "check_options"]

BAD_LORA_DTYPE = """\
{call}: dtype is the adapters' floating dtype (jnp.float32, jnp.bfloat16, jnp.float16; \
None: the weight's), got {given}. lora_a is drawn at random and both adapters are trained: \
they need a floating JAX dtype (a torch dtype or a name like "bf16" is not one).

    wrong:  {call}(..., dtype={given})
    right:  {call}(..., dtype=jnp.bfloat16)
"""


BAD_RANK = """\
ft.nn.lora: rank must be a positive int (the adapters' inner size), got {rank!r}.
    right:  ft.nn.lora(model, pattern, rank=8, alpha=16, key=key)"""

BAD_ALPHA = """\
ft.nn.lora: alpha must be a positive finite number (the adapters' output is scaled by alpha / rank), \
got {alpha!r}.
    right:  ft.nn.lora(model, pattern, rank=8, alpha=16, key=key)"""

BAD_DROPOUT = """\
ft.nn.lora: dropout must be in [0, 1) (the probability of zeroing an adapter input), got \
{dropout!r}.
    right:  ft.nn.lora(model, pattern, rank=8, alpha=16, dropout=0.05, key=key)"""

NO_KEY = """\
ft.nn.lora needs a PRNG key (lora_a is drawn at random; lora_b starts at zero).
    wrong:  ft.nn.lora(model, {pattern!r}, rank={rank})
    right:  ft.nn.lora(model, {pattern!r}, rank={rank}, key=jax.random.key(0))"""


def check_dtype(dtype: Any, call: str) -> Any:
    """``dtype`` as a JAX dtype (None stays None), or :data:`BAD_LORA_DTYPE` at the call,
    not inside ``jax.random.uniform`` or NumPy."""
    if dtype is None:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(BAD_LORA_DTYPE.format(call=call, given=written_dtype(dtype)))
    return dt


def check_options(rank: Any, alpha: Any, dropout: Any, key: Any, pattern: Any) -> None:
    """Raise the named error of the first bad option: ``rank`` a positive int, ``alpha`` a
    positive finite number, ``dropout`` in ``[0, 1)``, ``key`` given and one PRNG key (``pattern``: the one shown;
    an integer seed or a whole ``jax.random.split``: :func:`functree._random.one_key`'s error
    here, not inside JAX's ``fold_in`` of the first adapter)."""
    if not is_int(rank) or rank < 1:  # a NumPy int is a rank
        raise ValueError(BAD_RANK.format(rank=rank))
    # an infinite alpha made alpha / rank * (x @ a @ b) = inf * 0, NaN from every adapted layer
    if not is_real(alpha) or not math.isfinite(alpha) or not alpha > 0:
        raise ValueError(BAD_ALPHA.format(alpha=alpha))
    if not is_real(dropout) or not 0.0 <= dropout < 1.0:
        raise ValueError(BAD_DROPOUT.format(dropout=dropout))
    if key is None:
        raise ValueError(NO_KEY.format(pattern=pattern, rank=rank))
    one_key(key)
