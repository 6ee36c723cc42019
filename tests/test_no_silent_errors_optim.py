"""Issue 22, optimization and jit edges: each item gives the right number or an error in
functree's style (naming the argument or key path and the fix). One test per item; the
docstring quotes what the issue measured before the fix. Items 1-3 and 10 (differentiation
edges) are in tests/test_no_silent_errors.py; items 4-6 in the optimizer tests (below)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import functree as ft

# Items 4-6 are tested where the same behaviour has its fuller test (each was a copy of a
# part of it; one test per behaviour keeps the suite's compile time down):
# - item 4 (complex parameters descend; SGD on |z − a|² diverged 6.25 → 2.3e32, Adam's loss
#   rose): tests/test_optim_optimizer.py::test_complex_parameters_descend_through_minimize_update_and_train_step
#   (the same 100 steps of sgd(0.1) and adam(0.1), and optax.adam, update and train_step too);
# - item 5 (adamw(exclude=()) left a declared bias at 1 where torch's went 1 → 0.95):
#   tests/test_optim_aliases.py::test_adamw_exclude_nothing_decays_declared_fields_as_torch
#   (the same zero-gradient step against torch, then 20 steps against torch);
# - item 6 (Optimizer(optax.lbfgs()).minimize raised optax's "missing ... 'value', 'grad',
#   and 'value_fn'"): tests/test_optim_optimizer.py::test_lbfgs_through_minimize_and_update_equals_optax_loop
#   (minimize and update against optax's documented loop).


def test_item07_optax_lookahead_model_is_refused():
    """optax.lookahead as optax documents it (a LookaheadParams(fast, slow) model, the loss
    on .fast) through the Optimizer: the slow weights never moved."""
    params = {"w": jnp.ones(2)}
    model = optax.LookaheadParams(params, jax.tree.map(jnp.copy, params))
    with pytest.raises(ValueError, match=r"ft\.optim\.lookahead"):
        ft.optim.Optimizer(optax.lookahead(optax.sgd(0.1), 2, 0.5)).init(model)
    with pytest.raises(TypeError, match=r"ft\.optim\.lookahead in its place"):
        ft.optim.Optimizer(optax.chain(optax.clip(1.0), optax.lookahead(optax.sgd(0.1), 2, 0.5)))


def test_item08_rewrapped_jit_compiles_once():
    """ft.jit(f)(x) re-wrapped per call traced and compiled every time (22.8 ms against
    0.06 ms for jax.jit(f)(x))."""
    traces = []

    def f(x):
        traces.append(1)
        return 2 * x

    for _ in range(3):
        ft.jit(f)(jnp.ones(2))
    assert len(traces) == 1


def test_item09_reusing_a_donated_model_names_it():
    """Reusing a donated model after a train step gave XLA's "INVALID_ARGUMENT ... Buffer
    has been deleted or donated"."""
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(lambda m, b: jnp.mean(m(b) ** 2), opt)
    _, state, _ = step(model, opt.init(model), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="'model' holds a deleted array at weight") as e:
        step(model, state, jnp.ones((4, 2)))
    assert "previous call of the train step" in str(e.value) and "donate=False" in str(e.value)
