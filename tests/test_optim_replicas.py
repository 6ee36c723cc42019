"""Aggregation over a bound axis: vmap, and shard_map with both check_vma settings."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _devices import env_with_devices
from _tolerance import assert_close_trained

import functree as ft
import functree.optim as fo

SHARD_MAP = textwrap.dedent("""
    import json, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, NamedSharding
    import functree as ft
    mesh = jax.make_mesh((4,), ("data",))
    w0 = {"w": jnp.zeros(3)}
    x = jnp.arange(24.0).reshape(8, 3) / 10
    V0 = {"v": jnp.asarray(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4))}
    LABELS = jnp.array([1, -100, -100, -100, 0, 3, 2, 1], jnp.int32)
    out = {}
    for check in (True, False):
        opt = ft.optim.Optimizer(ft.optim.sgd(0.1), axis_name="data")
        def step(w, s, xb):
            return opt.minimize(lambda p, xb: jnp.mean((xb @ p["w"] - 1.0) ** 2), w, s, xb)
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()),
                                  check_vma=check))
        w, s = w0, opt.init(w0)
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        losses = []
        for _ in range(3):
            w, s, loss = f(w, s, xs)
            losses.append(float(loss))
        out[str(check)] = {"w": np.asarray(w["w"]).tolist(), "samples": int(ft.optim.context(s).samples_seen),
                           "losses": losses}
        # A weighted loss (reduction="weighted"), one device keeping 1 of its 2 rows, another 0:
        # each device weighed by its count (see test_a_weighted_loss_weighs_each_replica_by_its_count).
        def weighted(p, xb, yb):
            return ft.losses.softmax_cross_entropy(xb @ p["v"], yb, reduction="weighted")
        opt = ft.optim.Optimizer(ft.optim.sgd(1.0), axis_name="data")
        g = jax.jit(jax.shard_map(lambda v, s, xb, yb: opt.minimize(weighted, v, s, xb, yb), mesh=mesh,
                                  in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P()),
                                  check_vma=check))
        v, s, loss = g(V0, opt.init(V0), xs, jax.device_put(LABELS, NamedSharding(mesh, P("data"))))
        out[str(check)].update(weighted_v=np.asarray(v["v"]).tolist(), weighted_loss=float(loss))
    print(json.dumps(out))
""")


def test_shard_map_gives_the_mean_gradient_and_counts_the_global_batch_with_either_check_vma():
    env = env_with_devices(4)
    proc = subprocess.run([sys.executable, "-c", SHARD_MAP], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the reference: one device, the whole batch
    opt = fo.Optimizer(fo.sgd(0.1))
    w = {"w": jnp.zeros(3)}
    s = opt.init(w)
    x = jnp.arange(24.0).reshape(8, 3) / 10
    losses = []
    for _ in range(3):
        w, s, loss = opt.minimize(lambda p, xb: jnp.mean((xb @ p["w"] - 1.0) ** 2), w, s, x)
        losses.append(float(loss))
    for check in ("True", "False"):
        assert_close_trained(np.float32(result[check]["w"]), w["w"], spread=2e-7)  # 4 shards vs 1 batch: measured max 1.9e-7
        assert_close_trained(np.float32(result[check]["losses"]), np.float32(losses), spread=2e-7)
        assert result[check]["samples"] == 24
    # The weighted loss: the one-device step on all 8 rows (5 kept), to rounding.
    v0 = {"v": jnp.asarray(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4))}
    labels = np.array([1, -100, -100, -100, 0, 3, 2, 1], np.int32)
    ref = fo.Optimizer(fo.sgd(1.0))
    v, _, loss = ref.minimize(_weighted, v0, ref.init(v0), x, labels)
    for check in ("True", "False"):
        np.testing.assert_allclose(result[check]["weighted_v"], v["v"], rtol=0, atol=1e-6)  # measured 6e-8
        np.testing.assert_allclose(result[check]["weighted_loss"], float(loss), rtol=0, atol=1e-6)


def test_vmap_replicas_report_the_mean_loss_and_the_global_samples():
    opt = fo.Optimizer(fo.sgd(1.0), axis_name="r")
    w = {"w": jnp.zeros(())}
    state = opt.init(w)
    xs = jnp.array([[1.0, 3.0], [5.0, 7.0]])  # two replicas of two examples
    new, states, losses = jax.vmap(lambda x: opt.minimize(lambda p, x: jnp.mean(p["w"] * x), w, state, x),
                                   axis_name="r")(xs)
    np.testing.assert_allclose(new["w"], [-4.0, -4.0])
    np.testing.assert_allclose(losses, [0.0, 0.0])
    assert [int(n) for n in states.context.counters[:, 2]] == [4, 4]  # samples_seen of each replica


def _weighted(p, xb, yb):
    return ft.losses.softmax_cross_entropy(xb @ p["v"], yb, reduction="weighted")


def test_a_weighted_loss_weighs_each_replica_by_its_count():
    # reduction="weighted" asks for the global batch's token mean; Optimizer(axis_name=)
    # averaged the replicas' means equally: replica 0 keeping 1 of its 6 tokens weighed as
    # much as replica 1 keeping 6, 0.15 off the global step (loss 1.97 for 1.79). Weighed by
    # count: the one-replica step on all 12 tokens, to rounding, with either aggregation input.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 3)).astype(np.float32)
    y = rng.integers(0, 4, size=(2, 6)).astype(np.int32)
    y[0, 1:] = -100
    v0 = {"v": jnp.asarray(rng.normal(size=(3, 4)).astype(np.float32))}
    opt = fo.Optimizer(fo.sgd(1.0), axis_name="r")
    step = jax.jit(jax.vmap(lambda v, s, xb, yb: opt.minimize(_weighted, v, s, xb, yb),
                            in_axes=(None, None, 0, 0), axis_name="r"))
    v, _, loss = step(v0, opt.init(v0), x, y)
    ref = fo.Optimizer(fo.sgd(1.0))
    rv, _, rloss = ref.minimize(_weighted, v0, ref.init(v0), x.reshape(12, 3), y.reshape(12))
    scale = float(np.abs(rv["v"]).max())
    np.testing.assert_allclose(v["v"], np.stack([rv["v"]] * 2), rtol=0, atol=1e-6 * scale)  # measured 6e-8
    np.testing.assert_allclose(loss, [float(rloss)] * 2, rtol=0, atol=1e-6)
    # A replica keeping no token: its share is 0, the mean is the other's.
    y[0, :] = -100
    v, _, loss = step(v0, opt.init(v0), x, y)
    rv, _, rloss = ref.minimize(_weighted, v0, ref.init(v0), x[1], y[1])
    np.testing.assert_allclose(v["v"][0], rv["v"], rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(loss[0], float(rloss), rtol=0, atol=1e-6)
    # An override reaching the default through super() is weighed too (it was the equal mean:
    # 0.15 off, and its loss the mean of the replicas' means).
    class Logged(fo.Optimizer):
        def aggregate_gradients(self, grads):
            return super().aggregate_gradients(grads)
    logged = Logged(fo.sgd(1.0), axis_name="r")
    y[0, :] = y[1, :]
    y[0, 1:] = -100
    v, _, loss = jax.vmap(lambda xb, yb: logged.minimize(_weighted, v0, logged.init(v0), xb, yb), axis_name="r")(x, y)
    rv, _, rloss = ref.minimize(_weighted, v0, ref.init(v0), x.reshape(12, 3), y.reshape(12))
    np.testing.assert_allclose(v["v"], np.stack([rv["v"]] * 2), rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(loss, [float(rloss)] * 2, rtol=0, atol=1e-6)
    # A custom aggregation is the user's: the replicas' gradients reach it unweighed.
    seen = []
    custom = fo.Optimizer(fo.sgd(1.0), axis_name="r", aggregate_gradients=lambda g: seen.append(g) or jax.lax.pmean(g, "r"))
    jax.vmap(lambda xb, yb: custom.minimize(_weighted, v0, custom.init(v0), xb, yb), axis_name="r")(x, y)
    assert len(seen) == 1


def test_an_axis_name_outside_any_binding_names_the_axis_and_the_fix():
    opt = fo.Optimizer(fo.adam(), axis_name="devices")
    w = {"w": jnp.zeros(2)}
    with pytest.raises(ValueError, match=r"axis_name='devices', but no axis of that name is bound") as info:
        jax.jit(lambda w, s: opt.minimize(lambda p: jnp.sum(p["w"] ** 2), w, s))(w, opt.init(w))
    assert "mesh=mesh" in str(info.value)
    assert isinstance(ft.optim.context(opt.init(w)), fo.LearningContext)
