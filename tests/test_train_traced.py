"""functree/train/_traced.py: a train step called inside the user's jax.jit / jax.vmap / lax.scan
takes the path of its configuration (a mesh, several steps per call, any on_nan) and equals
plain calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _problem():
    kx, km = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (8, 3))
    return ft.nn.Dense(3, 1, key=km), (x, x @ jnp.array([[1.0], [-2.0], [0.5]]))


def _close(a, b, atol=1e-6):  # weights, Adam moments and losses of order 1 to 10
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol * max(1.0, float(np.abs(y).max())))


@pytest.mark.parametrize("on_nan", ["stop", "skip", "ignore"])
@pytest.mark.parametrize("options", [
    {"mesh": "one device", "sharding": "fsdp"},  # placing arrays failed on tracers (also with "ignore")
    {"steps_per_call": 2},
    {},
])
def test_a_step_inside_jit_then_a_plain_call_equal_two_plain_calls(options, on_nan):
    model, batch = _problem()
    if "mesh" in options:
        options = {**options, "mesh": jax.make_mesh((1,), ("data",))}
    if options.get("steps_per_call") == 2:
        batch = ft.train.stack_batches([batch, jax.tree.map(lambda a: 2 * a, batch)])
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))

    def new():
        return ft.train.TrainStep(mse, opt, donate=False, on_nan=on_nan, **options)

    step, ref = new(), new()
    m1, s1, met1 = jax.jit(lambda a, b: step(a, b, batch))(model, opt.init(model))
    m2, s2, met2 = step(m1, s1, batch)
    step.check()
    r1, q1, ref1 = ref(model, opt.init(model), batch)
    r2, q2, ref2 = ref(r1, q1, batch)
    _close((m1, s1, met1["loss"], m2, s2, met2["loss"]), (r1, q1, ref1["loss"], r2, q2, ref2["loss"]))
