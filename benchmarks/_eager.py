"""Family ``eager``: the first eager call (no ``jax.jit``, as in a notebook cell) of
``ft.nn`` layers at a new input shape, against the same math written in raw ``jnp``.

Eager JAX runs each operation as a program of its own, compiled at each new input shape,
so a layer's first call at a new sequence length costs one compile per operation whose
inputs changed shape. Each probe runs in a fresh process: the layer (or raw function) is
called once at length 5 (what does not depend on the length compiles there), then at
length 6, where are counted the programs compiled (``jax_log_compiles``) and executed
(every program the call runs, JAX's C++ fast path turned off in the counting process), and
the call's seconds (in another fresh process, nothing patched). ft and raw alternate round
by round; the ratio is the median of the per-round ratios.

Run alone: ``python benchmarks/run.py --only eager``; ``python benchmarks/_eager.py probe
CASE ft|raw count|time`` is one probe.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

CASES = ("dense", "layernorm", "rmsnorm", "attention", "attention_rotary", "attention_cache", "decode_step", "lm")
D, H, B = 32, 4, 2


def _cases(which: str) -> dict[str, Any]:
    """``name -> (make(T) -> the call's arguments, call)`` for ``which`` (``ft`` or ``raw``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import functree as ft

    key = jax.random.key(0)
    rng = np.random.default_rng(0)

    def x_of(t: int) -> Any:
        return jnp.asarray(rng.normal(size=(B, t, D)).astype(np.float32))

    dense = ft.nn.Dense(D, D, key=key)
    ln, rms = ft.nn.LayerNorm(D), ft.nn.RMSNorm(D)
    attn = ft.nn.MultiheadAttention(D, H, causal=True, key=key)
    rot = attn.replace(rotary=10000.0)
    p = {n: (getattr(attn, n).weight, getattr(attn, n).bias)
         for n in ("query_projection", "key_projection", "value_projection", "output_projection")}
    cache = rot.init_cache(B, 16)

    def positions(t: int, start: int = 0) -> Any:
        return jnp.asarray(np.broadcast_to(np.arange(start, start + t, dtype=np.int32), (B, t)))

    if which == "ft":
        lm = _lm(ft, jax, jnp)
        return {
            "dense": (lambda t: (x_of(t),), dense),
            "layernorm": (lambda t: (x_of(t),), ln),
            "rmsnorm": (lambda t: (x_of(t),), rms),
            "attention": (lambda t: (x_of(t),), attn),
            "attention_rotary": (lambda t: (x_of(t),), rot),
            "attention_cache": (lambda t: (x_of(t), positions(t)),
                                lambda x, pos: rot(x, cache=cache, positions=pos)[0]),
            "decode_step": (lambda t: (x_of(1), positions(1, t)),
                            lambda x, pos: rot(x, cache=cache, positions=pos)[0]),
            "lm": (lambda t: (jnp.ones((B, t), jnp.int32),), lm),
        }

    def raw_dense(w: Any, b: Any, x: Any) -> Any:
        return x @ w + b

    def raw_heads(x: Any) -> Any:
        return x.reshape(*x.shape[:-1], H, D // H)

    def raw_rotate(x: Any, pos: Any) -> Any:
        half = x.shape[-1] // 2
        theta = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
        angle = pos[..., None, None].astype(jnp.float32) * theta
        c, s = jnp.cos(angle), jnp.sin(angle)
        a, b = x[..., :half], x[..., half:]
        return jnp.concatenate([a * c - b * s, b * c + a * s], -1)

    def raw_attention(x: Any, rotary: bool = False) -> Any:
        t = x.shape[1]
        q, k, v = (raw_heads(raw_dense(*p[n], x)) for n in ("query_projection", "key_projection", "value_projection"))
        if rotary:
            pos = jnp.arange(t)[None]
            q, k = raw_rotate(q, pos), raw_rotate(k, pos)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // H)
        a = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf), -1)
        return raw_dense(*p["output_projection"], jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape))

    def raw_cached(x: Any, pos: Any) -> Any:
        q, k, v = (raw_heads(raw_dense(*p[n], x)) for n in ("query_projection", "key_projection", "value_projection"))
        q, k = raw_rotate(q, pos), raw_rotate(k, pos)
        rows = jnp.arange(B)[:, None]
        ck, cv = cache.keys.at[rows, pos].set(k), cache.values.at[rows, pos].set(v)
        allowed = jnp.arange(16) <= pos[..., None]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, ck) / jnp.sqrt(D // H)
        a = jax.nn.softmax(jnp.where(allowed[:, None], s, -jnp.inf), -1)
        return raw_dense(*p["output_projection"], jnp.einsum("bhqk,bkhd->bqhd", a, cv).reshape(x.shape))

    def raw_ln(x: Any, eps: float = 1e-5) -> Any:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + eps) * ln.scale + ln.offset

    def raw_rms(x: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * rms.scale

    lm = _lm(ft, jax, jnp)
    flat = {k: jnp.asarray(v) for k, v in ft.to_flat_dict(lm).items()}

    def raw_lm(ids: Any) -> Any:
        t = ids.shape[1]
        x = flat["tok.embeddings"][ids] + flat["pos.embeddings"][jnp.arange(t)]
        causal = jnp.tril(jnp.ones((t, t), bool))
        for i in range(2):
            pre = f"blocks.layers.{i}."

            def lnp(name: str, x: Any) -> Any:
                mu = x.mean(-1, keepdims=True)
                var = ((x - mu) ** 2).mean(-1, keepdims=True)
                return (x - mu) / jnp.sqrt(var + 1e-5) * flat[name + ".scale"] + flat[name + ".offset"]

            def dn(name: str, x: Any) -> Any:
                return x @ flat[name + ".weight"] + flat[name + ".bias"]

            h = lnp(pre + "ln1", x)
            q, k, v = (raw_heads(dn(pre + f"attn.{n}_projection", h)) for n in ("query", "key", "value"))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // H)
            a = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), -1)
            x = x + dn(pre + "attn.output_projection", jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(h.shape))
            h = lnp(pre + "ln2", x)
            x = x + dn(pre + "mlp.layers.1", jax.nn.gelu(dn(pre + "mlp.layers.0", h)))
        return dn("head", lnp("ln_f", x))

    return {
        "dense": (lambda t: (x_of(t),), lambda x: raw_dense(dense.weight, dense.bias, x)),
        "layernorm": (lambda t: (x_of(t),), raw_ln),
        "rmsnorm": (lambda t: (x_of(t),), raw_rms),
        "attention": (lambda t: (x_of(t),), raw_attention),
        "attention_rotary": (lambda t: (x_of(t),), lambda x: raw_attention(x, True)),
        "attention_cache": (lambda t: (x_of(t), positions(t)), raw_cached),
        "decode_step": (lambda t: (x_of(1), positions(1, t)), raw_cached),
        "lm": (lambda t: (jnp.ones((B, t), jnp.int32),), raw_lm),
    }


def _lm(ft: Any, jax: Any, jnp: Any) -> Any:
    """The decoder LM of the user's report (2 blocks, d 32, 4 heads, vocab 16)."""

    class Block(ft.Module):
        ln1: Any
        attn: Any
        ln2: Any
        mlp: Any

        def __init__(self, *, key: Any):
            k1, k2 = jax.random.split(key)
            self.ln1, self.ln2 = ft.nn.LayerNorm(D), ft.nn.LayerNorm(D)
            self.attn = ft.nn.MultiheadAttention(D, H, causal=True, key=k1)
            self.mlp = ft.nn.MLP(D, D, width_size=4 * D, depth=1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x: Any) -> Any:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class LM(ft.Module):
        tok: Any
        pos: Any
        blocks: Any
        ln_f: Any
        head: Any

        def __init__(self, *, key: Any):
            ks = jax.random.split(key, 5)
            self.tok, self.pos = ft.nn.Embedding(16, D, key=ks[0]), ft.nn.Embedding(12, D, key=ks[1])
            self.blocks = ft.nn.Sequential(*[Block(key=k) for k in ks[3:]])
            self.ln_f, self.head = ft.nn.LayerNorm(D), ft.nn.Dense(D, 16, key=ks[2])

        def __call__(self, ids: Any) -> Any:
            x = self.tok(ids) + self.pos(jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape))
            return self.head(self.ln_f(self.blocks(x)))

    return LM(key=jax.random.key(0))


class _Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split()[1])


def probe(case: str, which: str, mode: str) -> dict[str, Any]:
    """One fresh process's measurement (see the module)."""
    import jax

    executed: list[str] = []
    if mode == "count":  # every program through Python: no C++ fast path, count each execution
        from jax._src import pjit
        from jax._src.interpreters import pxla

        pjit._get_fastpath_data = lambda *a, **k: None
        run = pxla.ExecuteReplicated.__call__

        def counted(self: Any, *args: Any) -> Any:
            executed.append(self.name)
            return run(self, *args)

        pxla.ExecuteReplicated.__call__ = counted
    make, call = _cases(which)[case]
    jax.block_until_ready(call(*make(5)))
    args = jax.block_until_ready(make(6))
    handler, logger = _Compiles(), logging.getLogger("jax")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    executed.clear()
    with jax.log_compiles(True):
        start = time.perf_counter()
        jax.block_until_ready(call(*args))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "compiles": len(handler.names), "executed": len(executed),
            "compiled": sorted(set(handler.names))}


def _probe(case: str, which: str, mode: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "probe", case, which, mode],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def eager(quick: bool = False) -> Any:
    from _harness import Table, interleave, paired_rows

    table = Table("eager", "18. First eager call of ft.nn layers at a new length (fresh processes): functree vs raw "
                  "jnp", "ms", "≤ 1.2× raw", columns=("compiles", "programs run"))
    rounds = 3 if quick else 7
    for case in CASES:
        counts = {w: _probe(case, w, "count") for w in ("ft", "raw")}
        values = interleave({f"{case}: functree": lambda case=case: _probe(case, "ft", "time")["seconds"],
                             f"{case}: raw jnp": lambda case=case: _probe(case, "raw", "time")["seconds"]}, rounds)
        rows = paired_rows(values, f"{case}: raw jnp", scale=1e3)
        for row, which in zip(rows, ("ft", "raw")):
            row.extra = {"compiles": counts[which]["compiles"], "programs run": counts[which]["executed"]}
        rows[0].ok = rows[0].ratio is not None and rows[0].ratio <= 1.2
        table.rows += rows
    table.notes.append("compiles and programs run: at length 6 after a call at length 5, fresh processes")
    return [table]


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        print(json.dumps(probe(*sys.argv[2:5])))
