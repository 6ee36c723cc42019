"""functree.optim._skip: the step's gate."""

import jax.numpy as jnp

from functree.optim._skip import gate


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
