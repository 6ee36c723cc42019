"""Family 15 (``lm``): training a Llama-style language model, functree against raw JAX.

A Llama decoder (RMSNorm, rotary, grouped-query attention, SwiGLU; the blocks in an
``ft.nn.Stack``) trained with AdamW in bf16 compute: ``ft.train.train_step`` (the NaN gate
on, as users run it) against a hand-written raw-JAX step on the same weights (``lax.scan``
over the stacked layers, ``jax.nn.dot_product_attention`` with the same implementation,
``optax.adamw``, parameters cast to bf16 inside the loss). Reported: step time, tokens/s, MFU
(model FLOPs: ``6 N T`` for the weights plus the attention's ``12 L T² d``, per sequence,
over the GPU's dense bf16 peak), peak device memory, and the time to the first step, measured
in fresh processes in both orders (each step the first compile of its process, and second).
The two losses at step 0 must agree (same weights, same data).

Sizes: on an accelerator the 220M model of issue 35 (d 1024, 12 layers, 16 heads, vocab
32000, sequence 1024, batch 8); on a CPU a tiny one (d 256, 4 layers, sequence 128, batch 4)
that shows the split of the first step (tracing, lowering, compiles and their count).
Targets: step time ≤ 1.02× raw with the same kernel; MFU ≥ 34% at batch 8 on an H200 with
``attention="auto"``; time to first step ≤ 1.5× raw.

Run alone: ``python benchmarks/run.py --only lm``. ``python benchmarks/_lm.py first ft|raw
[auto|xla|cudnn]`` is the fresh-process probe the family starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import functree as ft

FUNCTREE, RAW = "functree train_step", "raw JAX step"
THETA, EPS = 10000.0, 1e-6
# Dense bf16 peaks (NVIDIA's datasheets, SXM parts): MFU's denominator.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


@dataclasses.dataclass(frozen=True)
class Size:
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    seq: int
    batch: int


FULL = Size(vocab=32000, d=1024, layers=12, heads=16, kv_heads=16, hidden=2816, seq=1024, batch=8)
TINY = Size(vocab=1024, d=256, layers=4, heads=4, kv_heads=2, hidden=688, seq=128, batch=4)


def size() -> Size:
    return TINY if jax.default_backend() == "cpu" else FULL


# ----------------------------------------------------------------------------- the functree model


class MLP(ft.Module):
    gate_proj: ft.nn.Dense
    up_proj: ft.nn.Dense
    down_proj: ft.nn.Dense

    def __init__(self, s: Size, *, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate_proj = ft.nn.Dense(s.d, s.hidden, jax.nn.silu, use_bias=False, key=k1)
        self.up_proj = ft.nn.Dense(s.d, s.hidden, use_bias=False, key=k2)
        self.down_proj = ft.nn.Dense(s.hidden, s.d, use_bias=False, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class Block(ft.Module):
    input_layernorm: ft.nn.RMSNorm
    self_attn: ft.nn.MultiheadAttention
    post_attention_layernorm: ft.nn.RMSNorm
    mlp: MLP

    def __init__(self, s: Size, attention: str, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.input_layernorm = ft.nn.RMSNorm(s.d, epsilon=EPS)
        self.post_attention_layernorm = ft.nn.RMSNorm(s.d, epsilon=EPS)
        self.self_attn = ft.nn.MultiheadAttention(s.d, s.heads, num_kv_heads=s.kv_heads, rotary=THETA,
                                                  causal=True, use_bias=False, implementation=attention,
                                                  key=k1)
        self.mlp = MLP(s, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(ft.Module):
    embed_tokens: ft.nn.Embedding
    layers: ft.nn.Stack
    norm: ft.nn.RMSNorm
    lm_head: ft.nn.Dense

    def __init__(self, s: Size, attention: str = "auto", *, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed_tokens = ft.nn.Embedding(s.vocab, s.d, key=k1)
        self.layers = ft.nn.Stack(lambda k: Block(s, attention, key=k), s.layers, key=k2)
        self.norm = ft.nn.RMSNorm(s.d, epsilon=EPS)
        self.lm_head = ft.nn.Dense(s.d, s.vocab, use_bias=False, key=k3)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.lm_head(self.norm(self.layers(self.embed_tokens(ids))))


def lm_loss(model: Any, batch: jax.Array) -> jax.Array:
    logits = model(batch[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def functree_step(attention: str) -> tuple[Any, Any, Any]:
    """``(step, model, opt_state)`` for functree (the train step the Trainer runs)."""
    s = size()
    model = Llama(s, attention, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adamw(3e-4, weight_decay=0.1))
    step = ft.train.train_step(lm_loss, opt, compute_dtype=jnp.bfloat16)
    return step, model, opt.init(model)


# ----------------------------------------------------------------------------- raw JAX


def raw_params(model: Llama) -> dict[str, Any]:
    """The functree model's weights as a raw dict (the layers stacked, as ``Stack`` keeps them)."""
    members = model.layers.layers  # one Block whose leaves have the layer axis first
    a = members.self_attn
    return {
        "embed": model.embed_tokens.embeddings, "norm": model.norm.scale, "head": model.lm_head.weight,
        "layers": {
            "ln1": members.input_layernorm.scale, "ln2": members.post_attention_layernorm.scale,
            "q": a.query_projection.weight, "k": a.key_projection.weight, "v": a.value_projection.weight,
            "o": a.output_projection.weight, "gate": members.mlp.gate_proj.weight,
            "up": members.mlp.up_proj.weight, "down": members.mlp.down_proj.weight,
        },
    }


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array) -> jax.Array:
    t, h = x.shape[-3], x.shape[-1]
    inv = 1.0 / THETA ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


def raw_forward(p: dict[str, Any], ids: jax.Array, s: Size, implementation: str | None) -> jax.Array:
    x = p["embed"][ids]
    hd = s.d // s.heads

    def layer(x: jax.Array, w: dict[str, Any]) -> tuple[jax.Array, None]:
        h = _rms(x, w["ln1"])
        b, t = h.shape[:2]
        q = _rope((h @ w["q"]).reshape(b, t, s.heads, hd))
        k = _rope((h @ w["k"]).reshape(b, t, s.kv_heads, hd))
        v = (h @ w["v"]).reshape(b, t, s.kv_heads, hd)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        x = x + a.reshape(b, t, s.d) @ w["o"]
        h = _rms(x, w["ln2"])
        return x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"], None

    x, _ = jax.lax.scan(layer, x, p["layers"])
    return _rms(x, p["norm"]) @ p["head"]


def raw_step(attention: str) -> tuple[Any, Any, Any]:
    """``(step, params, opt_state)``: the same model, loss and AdamW written in raw JAX."""
    s = size()
    params = raw_params(Llama(s, attention, key=jax.random.key(0)))
    q = jnp.zeros((s.batch, s.seq, s.heads, s.d // s.heads), jnp.bfloat16)
    implementation = ft.nn._attention_kernel.choose(attention, q, q, q, None)
    tx = optax.adamw(3e-4, weight_decay=0.1)

    def loss(p: Any, batch: jax.Array) -> jax.Array:
        p16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
        logits = raw_forward(p16, batch[:, :-1], s, implementation).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def step(p: Any, state: Any, batch: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    return step, params, tx.init(params)


# ----------------------------------------------------------------------------- measurements


def batch_of(s: Size, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (s.batch, s.seq + 1), 0, s.vocab)


def model_flops(s: Size) -> float:
    """FLOPs of one training step (forward + backward): ``6 N T`` + attention ``12 L T² d``."""
    n = s.layers * (2 * s.d * s.d + 2 * s.d * (s.d // s.heads) * s.kv_heads + 3 * s.d * s.hidden) + s.d * s.vocab
    tokens = s.batch * s.seq
    return 6.0 * n * tokens + 12.0 * s.layers * s.batch * s.seq * s.seq * s.d


def peak() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def first_step(which: str, attention: str) -> dict[str, Any]:
    """Time from a built model to the first step's result, split by JAX's own events."""
    events: dict[str, list[float]] = {}
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: events.setdefault(name, []).append(secs))
    step, params, state = (functree_step if which == "ft" else raw_step)(attention)
    batch = batch_of(size())
    jax.block_until_ready((params, state, batch))
    events.clear()
    start = time.perf_counter()
    out = step(params, state, batch)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    loss = out[2]["loss"] if which == "ft" else out[2]

    def total(suffix: str) -> tuple[int, float]:
        found = [v for k, vs in events.items() if k.endswith(suffix) for v in vs]
        return len(found), round(sum(found), 3)

    compiles, compile_s = total("backend_compile_duration")
    return {"which": which, "seconds": round(seconds, 3), "loss": float(loss), "compiles": compiles,
            "compile_s": compile_s, "trace_s": total("jaxpr_trace_duration")[1],
            "lower_s": total("jaxpr_to_mlir_module_duration")[1]}


def _probe(order: list[str], attention: str) -> list[dict[str, Any]]:
    """The first steps of ``order`` in one fresh process (the first is its first compile)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import _lm; "
            f"print(json.dumps([_lm.first_step(w, {attention!r}) for w in {order!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def language_model(quick: bool = False) -> Any:
    from _harness import Row, Table, interleave, paired_rows, timed

    s = size()
    attention = "auto"
    table = Table("lm", f"15. Llama training step ({'tiny, CPU' if s is TINY else '220M'}): "
                  f"d {s.d}, {s.layers} layers, seq {s.seq}, batch {s.batch}, bf16 compute, AdamW",
                  "ms", "≤ 1.02× raw (same kernel); MFU ≥ 34% (H200, batch 8); first step ≤ 1.5× raw")
    variants = {FUNCTREE: functree_step(attention), RAW: raw_step(attention)}
    batch = batch_of(s)
    carry = {name: [p, st] for name, (_, p, st) in variants.items()}
    losses = {}
    for name, (step, _, _) in variants.items():  # compile, and the losses at step 0
        p, st, out = step(*carry[name], batch)
        losses[name] = float(out["loss"] if name == FUNCTREE else out)
        carry[name] = [p, st]
    table.checks["loss at step 0"] = losses
    table.checks["losses agree"] = abs(losses[FUNCTREE] - losses[RAW]) <= 2e-2 * abs(losses[RAW])
    calls = 3 if quick else 10

    def block(name: str) -> Any:
        step = variants[name][0]

        def run() -> float:
            def many() -> Any:
                out = None
                for _ in range(calls):
                    p, st, out = step(*carry[name], batch)
                    carry[name] = [p, st]
                return out
            return timed(many) / calls * 1e3
        return run

    values = interleave({name: block(name) for name in variants}, 3 if quick else 7)
    table.rows = paired_rows(values, RAW)
    flops, top = model_flops(s), peak()
    for row in table.rows:
        ms = row.median
        row.extra["tokens/s"] = f"{s.batch * s.seq / (ms / 1e3):,.0f}"
        row.extra["MFU"] = f"{100 * flops / (ms / 1e3) / top:.1f}%" if top else "n/a (CPU)"
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        table.checks["peak device memory GiB"] = round(stats["peak_bytes_in_use"] / 2**30, 2)
    table.columns = ("tokens/s", "MFU")
    # Time to the first step: fresh processes, each order (first compile of the process, and second).
    firsts: dict[str, list[float]] = {"ft": [], "raw": []}
    split: dict[str, Any] = {}
    for order in (["ft", "raw"], ["raw", "ft"]) * (1 if quick else 2):
        for position, result in enumerate(_probe(order, attention)):
            firsts[result["which"]].append(result["seconds"])
            split[f"{result['which']} ({'first' if position == 0 else 'second'} in its process)"] = result
    for which, label in (("ft", FUNCTREE), ("raw", RAW)):
        table.rows.append(Row(f"first step: {label}", [v * 1e3 for v in firsts[which]]))
    ratio = float(np.median(firsts["ft"]) / np.median(firsts["raw"]))
    table.rows[-2].ratio = ratio
    table.rows[-2].ok = ratio <= 1.5
    table.checks["first step split"] = split
    table.notes.append(f"attention: {attention} -> {ft.nn._attention_kernel.choose(attention, *(jnp.zeros((s.batch, s.seq, s.heads, s.d // s.heads), jnp.bfloat16),) * 3, None)}; "
                       f"model FLOPs per step {flops / 1e12:.2f} T; peak {top / 1e12 if top else 'n/a'} TFLOP/s")
    return [table]


if __name__ == "__main__":
    if sys.argv[1:2] == ["first"]:
        print(json.dumps(first_step(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "auto")))
    else:
        print(language_model(quick="--quick" in sys.argv)[0].markdown())
