"""NumPy inputs copied before JAX reads them (functree/_host_buffers.py): a batch buffer the
caller refills after a step's call returns does not change that step.

JAX takes an aligned NumPy buffer as the device buffer on the CPU and reads a call's inputs
when its program runs, after the call returned. Each test makes that moment late on
purpose: the model comes out of a slow program, so the step waits for it while the caller
has already refilled the buffer (without the copies, the step trained on the next batch)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree._host_buffers import ALIGNED_FROM, ALIGNMENT, empty, private_arrays, private_copy

ROWS, FEATURES, STEPS = 64, 8, 6
RNG = np.random.default_rng(0)
X = RNG.normal(size=(STEPS, ROWS, FEATURES)).astype(np.float32)
Y = RNG.normal(size=(STEPS, ROWS, 1)).astype(np.float32)


def loss_fn(model, batch):
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    return jnp.mean((x @ model["w"] - y) ** 2)


@jax.jit
def slowly(model):
    """``model`` unchanged, ready only after ~10^9 flops: a step given it starts late."""
    a = jnp.full((256, 256), 1.0 / 256, jnp.float32)
    work = jax.lax.fori_loop(0, 30, lambda i, m: m @ a, a)
    return jax.tree.map(lambda w: w + 0.0 * work[0, 0], model)


def buffers():
    """An aligned batch buffer (JAX aliases it on the CPU, every time)."""
    x, y = empty((ROWS, FEATURES), np.float32), empty((ROWS, 1), np.float32)
    assert x.ctypes.data % ALIGNMENT == 0 and y.ctypes.data % ALIGNMENT == 0
    return x, y


def train(step, opt, refill, kind=tuple):
    """``kind``: the batch's container, a tuple or a dict (both looked at inline by a step's call)."""
    model = {"w": jnp.zeros((FEATURES, 1))}
    state = opt.init(model)
    bx, by = buffers()
    for i in range(STEPS):
        if refill:
            bx[...], by[...] = X[i], Y[i]
            batch = (bx, by)
        else:
            batch = (X[i].copy(), Y[i].copy())
        if kind is dict:
            batch = {"x": batch[0], "y": batch[1]}
        model, state, _ = step(slowly(model), state, batch)
        if refill:  # the next batch's values written while this step waits for its model
            bx[...], by[...] = 100.0, -100.0
    return np.asarray(model["w"])


@pytest.mark.parametrize("kind", [tuple, dict], ids=["tuple", "dict"])
@pytest.mark.parametrize("on_nan", ["stop", "ignore"])
def test_a_refilled_batch_buffer_trains_as_fresh_batches(on_nan, kind):
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(loss_fn, opt, on_nan=on_nan)
    fresh = train(step, opt, refill=False, kind=kind)
    np.testing.assert_array_equal(train(step, opt, refill=True, kind=kind), fresh)


def test_an_eval_step_reads_the_batch_it_was_given():
    step = ft.train.eval_step(loss_fn)
    model = {"w": jnp.ones((FEATURES, 1))}
    expected = float(step(model, (X[0].copy(), Y[0].copy()))["loss"])
    bx, by = buffers()
    bx[...], by[...] = X[0], Y[0]
    metrics = step(slowly(model), (bx, by))
    bx[...], by[...] = 100.0, -100.0
    assert float(metrics["loss"]) == expected


def test_a_batch_placed_on_a_mesh_keeps_its_values():
    mesh = jax.make_mesh((1,), ("data",))
    bx, _ = buffers()
    bx[...] = X[0]
    placed = ft.parallel.shard_batch(bx, mesh)
    bx[...] = 100.0
    np.testing.assert_array_equal(np.asarray(placed), X[0])


def test_private_copies_are_aligned_and_leave_device_arrays_alone():
    large = np.arange(ALIGNED_FROM // 2 + 1, dtype=np.int16)[1:]  # an unaligned view of ALIGNED_FROM bytes
    small = large[:6]
    for x in (large, small):
        copy = private_copy(x)
        assert copy.dtype == x.dtype and copy.shape == x.shape and not np.shares_memory(copy, x)
        np.testing.assert_array_equal(copy, x)
    assert private_copy(large).ctypes.data % ALIGNMENT == 0  # XLA takes it as it is: one copy in all
    x = small
    device = jnp.ones(2)
    tree = {"a": device, "n": 3}
    assert private_arrays(tree) is tree  # nothing to copy: the same tree
    out = private_arrays({"a": device, "b": x, "s": np.float32(2)})
    assert out["a"] is device and out["s"] == 2 and not np.shares_memory(out["b"], x)
    assert private_copy(out["b"]) is out["b"] and private_arrays(out) is out  # a copy is not copied again
    assert not out["b"].flags.writeable  # and no one writes into it
    names = np.array(["a", "b"], object)  # no buffer to align: copied as it is
    assert private_copy(names).tolist() == ["a", "b"]
