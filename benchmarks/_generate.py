"""Family 12: greedy generation with a key-value cache, tokens per second.

A Llama-style decoder (RMSNorm, rotary, grouped-query attention, SwiGLU; the blocks in an
``ft.nn.Stack``) generates ``NEW`` tokens after a ``PROMPT``-token prompt for a batch of
``BATCH``: ``ft.nn.generate`` against a hand-written raw-JAX loop on the same weights (the
same prefill, a ``lax.scan`` over the steps and over the layers, the caches updated with
``lax.dynamic_update_slice``, ``jax.nn.dot_product_attention``), and, when torch and
transformers are installed, Hugging Face's ``LlamaForCausalLM.generate(do_sample=False)``
with the same weights (exported with ``ft.nn.torch_state_dict``). The three must produce the
same tokens. Target: functree ≥ raw (a ratio ≤ 1.0 of time per token; each round compiles
nothing).

A second table times beam search (``num_beams=BEAMS``, HF's defaults otherwise) and the greedy
loop with Hugging Face's controls on (``repetition_penalty``, ``return_scores``) against plain
greedy ``ft.nn.generate``, and HF's beam search on the same weights: informative, no target
(the raw loop has no beams); the beams must equal HF's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _harness import Row, Table, interleave, paired_rows, timed

import functree as ft

VOCAB, D, HEADS, KV_HEADS, HIDDEN, LAYERS = 2000, 256, 8, 4, 512, 4
BATCH, PROMPT, NEW = 4, 32, 128
BEAMS = 4
THETA, EPS = 10000.0, 1e-6
RAW, FUNCTREE, HF = "raw JAX loop", "ft.nn.generate", "HF generate (torch)"


class SwiGLU(ft.Module):
    gate_proj: ft.nn.Dense
    up_proj: ft.nn.Dense
    down_proj: ft.nn.Dense

    def __init__(self, *, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate_proj = ft.nn.Dense(D, HIDDEN, jax.nn.silu, use_bias=False, key=k1)
        self.up_proj = ft.nn.Dense(D, HIDDEN, use_bias=False, key=k2)
        self.down_proj = ft.nn.Dense(HIDDEN, D, use_bias=False, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class Block(ft.Module):
    input_layernorm: ft.nn.RMSNorm
    self_attn: ft.nn.MultiheadAttention
    post_attention_layernorm: ft.nn.RMSNorm
    mlp: SwiGLU

    def __init__(self, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.input_layernorm, self.post_attention_layernorm = ft.nn.RMSNorm(D, epsilon=EPS), ft.nn.RMSNorm(D, epsilon=EPS)
        self.self_attn = ft.nn.MultiheadAttention(D, HEADS, num_kv_heads=KV_HEADS, rotary=THETA, causal=True,
                                                  use_bias=False, key=k1)
        self.mlp = SwiGLU(key=k2)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        return self.self_attn.init_cache(batch_size, max_length, dtype)

    def __call__(self, x: jax.Array, *, mask: Any, positions: Any, cache: Any) -> tuple[jax.Array, Any]:
        y, cache = self.self_attn(self.input_layernorm(x), mask=mask, positions=positions, cache=cache)
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Llama(ft.Module):
    embed: ft.nn.Embedding
    blocks: ft.nn.Stack
    norm: ft.nn.RMSNorm
    head: ft.nn.Dense

    def __init__(self, *, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = ft.nn.Embedding(VOCAB, D, key=k1)
        self.blocks = ft.nn.Stack(lambda k: Block(key=k), LAYERS, key=k2)
        self.norm = ft.nn.RMSNorm(D, epsilon=EPS)
        self.head = ft.nn.Dense(D, VOCAB, use_bias=False, key=k3)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        return self.blocks.init_cache(batch_size, max_length, dtype)

    def __call__(self, input_ids: jax.Array, *, attention_mask: Any, positions: Any, cache: Any) -> Any:
        x, cache = self.blocks(self.embed(input_ids), mask=attention_mask, positions=positions, cache=cache)
        return self.head(self.norm(x)), cache


NAMES = {"model.embed_tokens": "embed", "model.layers": "blocks", "model.norm": "norm", "lm_head": "head"}
LAYOUTS = {"*.self_attn": ("q_proj", "k_proj", "v_proj", "o_proj")}


# ---- the raw-JAX loop: the same function written by hand ---------------------------------

def raw_params(model: Llama) -> dict[str, Any]:
    b = model.blocks.layers
    a = b.self_attn
    return {"embed": model.embed.embeddings, "norm": model.norm.scale, "head": model.head.weight, "layers": {
        "ln1": b.input_layernorm.scale, "ln2": b.post_attention_layernorm.scale,
        "wq": a.query_projection.weight, "wk": a.key_projection.weight, "wv": a.value_projection.weight,
        "wo": a.output_projection.weight, "wg": b.mlp.gate_proj.weight, "wu": b.mlp.up_proj.weight,
        "wd": b.mlp.down_proj.weight}}


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * scale


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:  # x [B, T, heads, H], positions [T]
    half = x.shape[-1] // 2
    angle = positions[:, None, None].astype(jnp.float32) * THETA ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def _forward(p: dict[str, Any], tokens: jax.Array, start: jax.Array, ck: jax.Array, cv: jax.Array) -> Any:
    b, t = tokens.shape
    h = D // HEADS
    positions = start + jnp.arange(t)
    allowed = (jnp.arange(ck.shape[2]) <= positions[:, None])[None, None]  # [1, 1, T, slots]

    def layer(x: jax.Array, xs: Any) -> Any:
        lp, k_cache, v_cache = xs
        y = _rms(x, lp["ln1"])
        q = _rope((y @ lp["wq"]).reshape(b, t, HEADS, h), positions)
        k = _rope((y @ lp["wk"]).reshape(b, t, KV_HEADS, h), positions)
        v = (y @ lp["wv"]).reshape(b, t, KV_HEADS, h)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, start, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, start, 0, 0))
        out = jax.nn.dot_product_attention(q, k_cache, v_cache, mask=allowed)
        x = x + out.reshape(b, t, D) @ lp["wo"]
        y = _rms(x, lp["ln2"])
        return x + (jax.nn.silu(y @ lp["wg"]) * (y @ lp["wu"])) @ lp["wd"], (k_cache, v_cache)

    x, (ck, cv) = jax.lax.scan(layer, p["embed"][tokens], (p["layers"], ck, cv))
    return _rms(x, p["norm"]) @ p["head"], ck, cv


@jax.jit
def raw_generate(p: dict[str, Any], ids: jax.Array) -> jax.Array:
    b, prompt = ids.shape
    ck = cv = jnp.zeros((LAYERS, b, prompt + NEW, KV_HEADS, D // HEADS), jnp.float32)
    logits, ck, cv = _forward(p, ids, jnp.int32(0), ck, cv)
    first = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)

    def step(carry: Any, t: jax.Array) -> Any:
        token, ck, cv = carry
        logits, ck, cv = _forward(p, token[:, None], prompt + t, ck, cv)
        return (jnp.argmax(logits[:, -1], -1).astype(jnp.int32), ck, cv), token

    (last, _, _), tokens = jax.lax.scan(step, (first, ck, cv), jnp.arange(NEW - 1, dtype=jnp.int32))
    return jnp.concatenate([ids, tokens.T, last[:, None]], axis=1)


def _hf(model: Llama) -> Any:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      intermediate_size=HIDDEN, rms_norm_eps=EPS, max_position_embeddings=PROMPT + NEW,
                                      rope_theta=THETA, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(config).eval()
    state = ft.nn.torch_state_dict(model, rename=NAMES, layouts=LAYOUTS)
    hf.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True)

    def run(ids: np.ndarray, **kwargs: Any) -> np.ndarray:
        with torch.no_grad():
            return hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                               max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs).numpy()

    return run


def generation(quick: bool) -> list[Table]:
    """12. Greedy generation: ft.nn.generate vs a raw-JAX KV-cache loop vs HF generate."""
    model = Llama(key=jax.random.key(0))
    # scale the weights so that the logits have clear top-1 margins (tokens comparable across libraries)
    model = jax.tree.map(lambda a: a * 2.0 if a.ndim >= 2 else a, model)
    ids = np.random.default_rng(0).integers(1, VOCAB, (BATCH, PROMPT)).astype(np.int32)
    params = raw_params(model)
    ours = np.asarray(ft.nn.generate(model, ids, NEW))  # compiles
    raw = np.asarray(raw_generate(params, jnp.asarray(ids)))
    hf = _hf(model)
    same = {"raw": bool((ours == raw).all())}
    blocks = {RAW: lambda: timed(lambda: raw_generate(params, ids)),
              FUNCTREE: lambda: timed(lambda: ft.nn.generate(model, ids, NEW))}
    rounds = 5 if quick else 15
    values = interleave(blocks, rounds)
    if hf is not None:
        # timed apart, after the JAX pair, so that torch's threads never overlap a JAX round
        same["hf"] = bool((hf(ids) == ours).all())
        hf_times = [timed(lambda: hf(ids)) for _ in range(2 if quick else 3)]
    tokens = BATCH * NEW
    rows = paired_rows(values, RAW)
    if hf is not None:
        raw_median = next(r.median for r in rows if r.name == RAW)
        hf_row = Row(HF, hf_times)
        hf_row.ratio = hf_row.median / raw_median  # not paired: timed apart
        rows.append(hf_row)
    for row in rows:
        row.extra["tokens/s"] = f"{tokens / row.median:.0f}"
        if row.name == FUNCTREE:
            row.ok = row.ratio is not None and row.ratio <= 1.0
    table = Table("generate", f"12. Greedy generation, Llama-style ({LAYERS} layers, d={D}, {HEADS} heads / "
                  f"{KV_HEADS} KV heads, vocab {VOCAB}): batch {BATCH}, prompt {PROMPT}, {NEW} new tokens", "s",
                  "ft.nn.generate ≤ 1.0× the raw-JAX loop's time", rows, columns=("tokens/s",))
    table.notes.append(f"JAX variants: median of {rounds} interleaved rounds; the same tokens as raw: {same['raw']}"
                       + (f", as HF: {same['hf']}; HF timed apart afterwards ({len(hf_times)} runs, its ratio "
                          "to raw's median, unpaired)" if "hf" in same else "; HF not installed"))
    table.checks = {"same_tokens": same}
    return [table, _controls(model, ids, hf, quick)]


def _controls(model: Llama, ids: np.ndarray, hf: Any, quick: bool) -> Table:
    """Beam search and the greedy loop with controls on, against plain greedy (informative)."""
    greedy, beams, controls = "ft.nn.generate, greedy", f"ft.nn.generate, {BEAMS} beams", \
        "ft.nn.generate, greedy + repetition_penalty + return_scores"
    calls = {greedy: lambda: ft.nn.generate(model, ids, NEW),
             beams: lambda: ft.nn.generate(model, ids, NEW, num_beams=BEAMS),
             controls: lambda: ft.nn.generate(model, ids, NEW, repetition_penalty=1.2, return_scores=True)[0]}
    ours = np.asarray(calls[beams]())  # compiles
    calls[controls]()
    rounds = 3 if quick else 7
    values = interleave({name: (lambda f=f: timed(f)) for name, f in calls.items()}, rounds)
    rows = paired_rows(values, greedy)
    same = {}
    if hf is not None:
        same["hf_beams"] = bool((hf(ids, num_beams=BEAMS) == ours).all())
        hf_row = Row(f"HF generate (torch), {BEAMS} beams", [timed(lambda: hf(ids, num_beams=BEAMS))
                                                               for _ in range(1 if quick else 2)])
        hf_row.ratio = hf_row.median / next(r.median for r in rows if r.name == greedy)
        rows.append(hf_row)
    for row in rows:
        row.extra["tokens/s"] = f"{BATCH * NEW / row.median:.0f}"  # new tokens of the returned sequences
    table = Table("generate_controls", f"12b. Beam search ({BEAMS} beams: {BEAMS * BATCH} rows) and HF's controls, "
                  f"the same model and prompts", "s", "informative (no raw-JAX counterpart)", rows,
                  columns=("tokens/s",), ratio_label="time / greedy")
    table.notes.append(f"median of {rounds} interleaved rounds, ratios to greedy paired by round"
                       + (f"; beams equal HF's: {same['hf_beams']} (HF timed apart afterwards, unpaired)"
                          if same else "; HF not installed"))
    table.checks = {"same_tokens": same}
    return table
