"""functree.optim._skip: the step's gate."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.optim._skip import apply_or_keep, gate


def test_a_handled_optimizers_gate_closes_on_the_loss_and_reports_the_loss():
    # Loss scaling handles non-finite gradients itself; only a non-finite loss closes the
    # gate then, and it is reported as the loss (-2), not as the first gradient, which a
    # float16 forward overflow also makes non-finite.
    grads = {"a": jnp.ones(2), "w": jnp.array([jnp.nan])}
    closed = gate(jnp.float32(jnp.inf), grads, on_nan="stop", handled=True)
    assert not bool(closed.apply) and not bool(closed.finite) and int(closed.nonfinite) == -2
    open_ = gate(jnp.float32(1), grads, on_nan="stop", handled=True)
    assert bool(open_.apply) and not bool(open_.finite) and int(open_.nonfinite) == -1
    plain = gate(jnp.float32(jnp.inf), grads, on_nan="stop")  # not handled: the first gradient
    assert not bool(plain.apply) and int(plain.nonfinite) == 1


RATES = [(1, 1.0), (1, 2.0), (1, 3.0)]
HEAD, BODY = {"head": True, "body": False}, {"head": False, "body": True}


@pytest.mark.parametrize("nested, whole, names", [
    (lambda s, tx: ft.optim.groups({"head": s(tx)}, default=tx),
     lambda s, tx: s(ft.optim.groups({"head": tx}, default=tx)), ("ft.optim.groups", "inner_states['head']")),
    (lambda s, tx: ft.optim.lookahead(s(tx), sync_period=2, slow_step_size=0.5),
     lambda s, tx: s(ft.optim.lookahead(tx, sync_period=3, slow_step_size=0.5)), ("lookahead's fast", "fast_state")),
    (lambda s, tx: optax.chain(optax.masked(s(tx), HEAD), optax.masked(tx, BODY)),
     lambda s, tx: s(optax.chain(optax.masked(tx, HEAD), optax.masked(tx, BODY))), ("optax.masked", "inner[0].inner_state")),
], ids=["groups", "lookahead", "masked"])
def test_a_skip_inside_a_group_or_lookahead_is_refused_and_the_whole_step_skips_outside(nested, whole, names):
    # Inside one group, skip_non_finite skipped that group alone while the one learning context
    # stopped: the other group took its scheduled rate again (1, 2, 2 for 1, 2, 3). Inside
    # lookahead the skipped step counted towards sync_period (fast 2.5 / slow 1.5 after 5 steps
    # for 2.0 / 2.0). Inside optax.masked, as inside a group. Outside, the whole step skips: no update, the context stays.
    tx = ft.optim.sgd(ft.optim.piecewise(RATES))
    params = {"head": jnp.zeros(()), "body": jnp.zeros(())}
    with pytest.raises(ValueError, match="skip_non_finite sits inside") as e:
        ft.optim.Optimizer(nested(ft.optim.skip_non_finite, tx)).init(params)
    assert all(n in str(e.value) for n in names)
    opt = ft.optim.Optimizer(whole(ft.optim.skip_non_finite, tx))
    state = opt.init(params)
    rates = []
    for head in (-1.0, jnp.nan, -1.0):
        updates, state = opt.update({"head": jnp.asarray(head), "body": jnp.asarray(-1.0)}, state, params)
        rates.append(float(updates["body"]))
    assert rates == [1.0, 0.0, 2.0] and int(ft.optim.context(state).step) == 2


def test_the_gated_update_leaks_no_tracer_out_of_its_cond():
    # jax.checking_leaks() around a step's first trace (a user hunting their own leak): the
    # gate's applied branch kept its traced leaves after the cond's trace, and JAX refused
    # every gated step (on_nan="stop"/"skip" of an optimizer without the leafwise update).
    add = lambda m, s: ({"w": m["w"] + 1, "act": m["act"]}, s + 1)  # noqa: E731

    def gated(ok, w, s):
        model, state = apply_or_keep(ok, add, {"w": w, "act": jnp.tanh}, s)
        assert model["act"] is jnp.tanh  # a leaf that is no array comes from the branch as it is
        return model["w"], state

    with jax.checking_leaks():
        w, s = jax.jit(gated)(jnp.array(True), jnp.zeros(2), jnp.int32(0))
        kept = jax.jit(gated)(jnp.array(False), jnp.zeros(2), jnp.int32(0))
    np.testing.assert_array_equal(w, [1.0, 1.0])
    assert int(s) == 1 and int(kept[1]) == 0
