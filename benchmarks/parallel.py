"""Data parallelism on simulated CPU devices: step time and per-device memory.

For 1, 2, 4 and 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, one
child process each) this trains an MLP 512-1024-1024-10 with Adam on a global batch of
256 through ``ft.parallel.DataParallelStep`` and reports

* the median time of one step (``block_until_ready``, after compilation), replicated;
* the bytes per device of parameters + optimizer state, replicated vs ``"fsdp"``: the
  compiled step's ``memory_analysis()`` (arguments per device, which also counts the
  batch's share) and the sum of each array's shard on device 0.

Simulated devices share the host's cores, so step times show the overhead of the
partitioned program, not a speed-up; memory per device is what a real mesh would hold.

    python benchmarks/parallel.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SIZES = (512, 1024, 1024, 10)
BATCH = 256


def child(devices: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import functree as ft
    from functree.parallel import DataParallelStep

    assert jax.device_count() == devices
    mesh = jax.make_mesh((devices,), ("data",))
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)

    def mlp():  # fresh arrays for each run: the step donates its inputs
        return ft.nn.Sequential(*[
            ft.nn.Dense(i, o, jax.nn.relu if n < len(SIZES) - 2 else ft.nn.identity, key=k)
            for n, (i, o, k) in enumerate(zip(SIZES[:-1], SIZES[1:], keys))])

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(BATCH, SIZES[0])).astype(np.float32),
             rng.integers(0, SIZES[-1], BATCH).astype(np.int32))
    out = {"devices": devices}
    for sharding in (None, "fsdp"):
        opt = ft.optim.Optimizer(ft.optim.adam(1e-3))
        step = DataParallelStep(loss_fn, opt, mesh=mesh, sharding=sharding)
        model = mlp()
        model, state = step.place(model, opt.init(model))
        global_batch = ft.parallel.shard_batch(batch, mesh)
        compiled = jax.jit(step.step).lower(model, state, global_batch, None).compile()
        memory = compiled.memory_analysis()
        shard_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((model, state)))
        name = "replicated" if sharding is None else sharding
        out[name] = {"argument_bytes": int(memory.argument_size_in_bytes),
                     "temp_bytes": int(memory.temp_size_in_bytes),
                     "params_state_bytes_per_device": int(shard_bytes)}
        model, state, metrics = step(model, state, global_batch)  # compile the called step
        jax.block_until_ready(metrics)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            model, state, metrics = step(model, state, global_batch)
            jax.block_until_ready((model, state, metrics))
            times.append(time.perf_counter() - t)
        out[name]["step_ms"] = 1e3 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", type=int, default=0)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    rows = []
    for n in (1, 2, 4, 8):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, __file__, "--child", str(n), "--steps", str(args.steps)],
                              env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    import jax

    print(f"MLP {'-'.join(map(str, SIZES))}, Adam, global batch {BATCH}; {platform.machine()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}, {args.steps} steps\n")
    print("| devices | step ms (replicated) | step ms (fsdp) | params+state MB/device replicated | "
          "fsdp | compiled argument MB/device replicated | fsdp |")
    print("|---|---|---|---|---|---|---|")
    mb = 1 / 2**20
    for r in rows:
        rep, fsdp = r["replicated"], r["fsdp"]
        print(f"| {r['devices']} | {rep['step_ms']:.1f} | {fsdp['step_ms']:.1f} | "
              f"{rep['params_state_bytes_per_device'] * mb:.1f} | {fsdp['params_state_bytes_per_device'] * mb:.1f} | "
              f"{rep['argument_bytes'] * mb:.1f} | {fsdp['argument_bytes'] * mb:.1f} |")


if __name__ == "__main__":
    main()
