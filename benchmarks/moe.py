"""ft.nn.SparseMoE's forms on this machine's default backend, interleaved: ``"dense"``
(every expert for every token, masked: ``E / top_k`` times the selected work) against
``"sorted"`` (the selected (token, expert) pairs only, ``jax.lax.ragged_dot``) and, for
fewer tokens times ``top_k`` than experts (a decoding step), ``"gathered"`` (each token's
experts' weights gathered); forward and gradient, and which one ``"auto"`` takes here. The
sorted/dense ratio says whether this backend's ``ragged_dot`` is a grouped matmul (sorted
faster) or lowered densely (sorted slower).

    python benchmarks/moe.py [--tokens 4096] [--d 1024] [--hidden 2816] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import functree as ft


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    moe = ft.nn.SparseMoE(a.d, a.hidden, num_experts=a.experts, top_k=a.top_k, key=jax.random.key(0), dtype=dtype)
    x = jax.random.normal(jax.random.key(1), (a.tokens, a.d), dtype)
    few = a.tokens * a.top_k < a.experts
    forms = {i: moe.replace(implementation=i) for i in ("dense", "sorted", *(("gathered",) if few else ()))}
    steps = {}
    for name, m in forms.items():
        steps[name, "forward"] = jax.jit(lambda m, x: m(x))
        steps[name, "gradient"] = jax.jit(jax.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)))
    times: dict[tuple[str, str], list[float]] = {k: [] for k in steps}
    for k, f in steps.items():  # compiled, warm
        jax.block_until_ready(f(forms[k[0]], x))
    for _ in range(a.rounds):  # interleaved: each round runs every program once
        for k, f in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(f(forms[k[0]], x))
            times[k].append(time.perf_counter() - start)
    print(f"{jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}: {a.tokens} tokens, "
          f"d {a.d}, hidden {a.hidden}, {a.experts} experts, top-{a.top_k}, {jnp.dtype(dtype).name}")
    print("| pass | " + " | ".join(f"{i} ms" for i in forms) + " | " + " | ".join(f"{i} / dense" for i in forms
                                                                                 if i != "dense") + " |")
    print("|---" * (2 * len(forms)) + "|")
    for pass_ in ("forward", "gradient"):
        ms = {i: statistics.median(times[i, pass_]) * 1e3 for i in forms}
        print(f"| {pass_} | " + " | ".join(f"{v:.2f}" for v in ms.values()) + " | "
              + " | ".join(f"{ms[i] / ms['dense']:.2f}" for i in forms if i != "dense") + " |")
    auto = "gathered" if few else "sorted" if jax.default_backend() == "tpu" else "dense"
    print(f'"auto" takes {auto!r} here')


if __name__ == "__main__":
    main()
