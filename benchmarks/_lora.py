"""Family 14: a LoRA training step against the same step with the adapters merged out.

A Llama (``ft.nn.from_hf`` of a config: RMSNorm, rotary grouped-query attention, SwiGLU,
the blocks an ``ft.nn.Stack``) with rank-``RANK`` adapters on every block's q and v
projections (``ft.nn.lora(model, "model.layers.*.self_attn.[qv]_proj")``) takes an Adam step
on the adapters alone (``Optimizer(..., wrt="*.lora_*")``: next-token cross-entropy on a
``BATCH x SEQ`` batch), against the same step on the merged model (``ft.nn.merge_lora``:
plain ``Dense`` layers, no adapter) trained over every block's RMSNorm scales
(``wrt="*layernorm*"``), which costs the same forward and the same backward pass through
all blocks (activation gradients, no weight gradient of a frozen ``Dense``), the adapters'
own matmuls excepted. A full fine-tuning step (every parameter) is shown for scale. Each
variant carries its model and state from block to block (donated), ``STEPS`` steps per
timed block, blocks interleaved round by round. Target: the LoRA step ≤ 1.05× the merged one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _harness import Table, carried_updates, interleave, paired_rows

import functree as ft

VOCAB, D, HEADS, KV_HEADS, HIDDEN, LAYERS = 2000, 256, 8, 4, 768, 4
BATCH, SEQ, RANK, STEPS = 4, 128, 8, 3
MERGED, LORA, FULL = "merged model, wrt=\"*layernorm*\"", "LoRA r=8 on q, v, wrt=\"*.lora_*\"", "full fine-tuning"
CONFIG = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": D, "num_attention_heads": HEADS,
          "num_key_value_heads": KV_HEADS, "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS,
          "max_position_embeddings": 2 * SEQ, "bos_token_id": 0, "eos_token_id": 0}


def next_token_loss(model: ft.Module, ids: jax.Array) -> jax.Array:
    logits = model(ids[:, :-1])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


def _step(wrt: str | None) -> tuple[ft.optim.Optimizer, Callable[..., Any]]:
    opt = ft.optim.Optimizer(ft.optim.adam(1e-3), wrt=wrt)

    def update(m: ft.Module, s: Any, ids: jax.Array) -> tuple[ft.Module, Any]:
        m, s, _ = opt.minimize(next_token_loss, m, s, ids)
        return m, s

    return opt, ft.jit(update, donate=(0, 1))


def lora_step(quick: bool) -> list[Table]:
    """14. A LoRA step (adapters trained) against the merged model's step through the same blocks."""
    base = ft.nn.from_hf(CONFIG, key=jax.random.key(0))
    adapted = ft.nn.lora(base, "model.layers.*.self_attn.[qv]_proj", rank=RANK, alpha=2 * RANK,
                         key=jax.random.key(1))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32))
    variants = {}
    for name, model, wrt in ((MERGED, ft.nn.merge_lora(adapted), "*layernorm*"), (LORA, adapted, "*.lora_*"),
                             (FULL, base, None)):
        opt, update = _step(wrt)
        model = jax.tree.map(jnp.copy, model)  # each variant donates buffers of its own
        state = opt.init(model)
        model, state = jax.block_until_ready(update(model, state, ids))  # compiles
        variants[name] = (update, model, state)
    block = carried_updates(variants, ids, 2 if quick else STEPS)
    rounds = 3 if quick else 9
    values = interleave({name: block(name) for name in variants}, rounds)
    rows = paired_rows(values, MERGED, scale=1e3)
    tokens = BATCH * SEQ
    for row in rows:
        row.extra["tokens/s"] = f"{tokens / (row.median / 1e3):.0f}"
        if row.name == LORA:
            row.ok = row.ratio is not None and row.ratio <= 1.05
    trained = sum(int(np.prod(leaf.shape)) for name, leaf in ft.to_flat_dict(adapted).items() if ".lora_" in name)
    table = Table("lora", f"14. LoRA training step, Llama ({LAYERS} layers, d={D}, {HEADS}/{KV_HEADS} heads, "
                  f"MLP {HIDDEN}, vocab {VOCAB}), batch {BATCH} x {SEQ} tokens, Adam", "ms",
                  "LoRA step ≤ 1.05× the merged model's step", rows, columns=("tokens/s",))
    table.notes.append(f"median of {rounds} interleaved rounds of {2 if quick else STEPS} steps (ms per step); "
                       f"ratios per round to the merged model's step; LoRA trains {trained} parameters")
    return [table]
