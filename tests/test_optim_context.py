"""Learning context, hyperparameters in the state, rate units and schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree.optim as fo


def _params():
    return {"w": jnp.zeros(())}


ONE = {"w": jnp.ones(())}


def test_context_advances_with_minibatch_size_and_loss():
    tx = fo.sgd(0.1)
    state = tx.init(_params())
    ctx = fo.context(state)
    assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size)) == (0, 0, 1)
    assert np.isnan(float(ctx.loss))
    for size, loss in [(4, 3.0), (6, 2.0), (5, 1.0)]:
        _, state = tx.update(ONE, state, minibatch_size=size, loss=loss)
    ctx = fo.context(state)
    assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size), float(ctx.loss)) == (3, 15, 5, 1.0)
    _, state = tx.update(ONE, state)  # minibatch size kept
    assert int(fo.context(state).samples_seen) == 20


def test_next_sweep_advances_every_context():
    tx = optax.chain(fo.clip(1.0), fo.adam())
    state = fo.next_sweep(fo.next_sweep(tx.init(_params())))
    from functree.optim._context import contexts

    assert [int(c.sweep) for c in contexts(state)] == [2, 2]


def test_context_of_a_state_without_one():
    with pytest.raises(ValueError, match=r"holds no ft\.optim\.LearningContext") as info:
        fo.context(optax.adam(1e-3).init(_params()))
    assert "right:" in str(info.value)
    with pytest.raises(ValueError, match=r"holds no ft\.optim\.LearningContext"):
        fo.next_sweep(optax.sgd(1e-3).init(_params()))


def test_optimizer_adds_a_context_to_plain_optax():
    opt = fo.Optimizer(optax.sgd(0.5))
    state = opt.init(_params())
    assert isinstance(state, fo.ContextState)
    updates, state = opt.update(ONE, state, _params(), minibatch_size=4)
    assert float(updates["w"]) == -0.5
    assert int(fo.context(state).samples_seen) == 4


def test_context_replace_and_repr():
    ctx = fo.initial_context().replace(step=3, loss=0.25)
    assert repr(ctx) == "LearningContext(step=3, sweep=0, samples_seen=0, minibatch_size=1, loss=0.25)"
    assert int(jax.jit(lambda c: c.replace(sweep=c.step + 1))(ctx).sweep) == 4
    with pytest.raises(TypeError, match=r"no field\(s\) \['epoch'\]"):
        ctx.replace(epoch=1)
