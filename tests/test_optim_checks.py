"""The optimizer's input checks (functree/optim/_checks.py): a state that does not fit the
gradients (a changed layer, a state made with or without ``wrt=``) is refused by name."""

import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import functree as ft
import functree.optim as fo
from functree.optim._checks import check_state_fits
from functree.optim._rate import check_rate_applied


class Net(ft.Module):
    encoder: ft.nn.Dense
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(jnp.tanh(self.encoder(x)))


def _net(out=1, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return Net(ft.nn.Dense(3, 4, key=k1), ft.nn.Dense(4, out, key=k2))


X = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)


def _loss(m):
    return jnp.mean(m(X) ** 2)


_grad = jax.jit(ft.gradient(_loss))  # one program per model shape, shared by the tests (eager: one per op)


def _torch_net(net):
    t = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, net.head.weight.shape[1]))
    with torch.no_grad():
        for layer, ours in ((t[0], net.encoder), (t[2], net.head)):
            layer.weight.copy_(torch.tensor(np.asarray(ours.weight).T.copy()))
            layer.bias.copy_(torch.tensor(np.asarray(ours.bias)))
    return t


@pytest.mark.parametrize("tx", [fo.adagrad(0.1), fo.adadelta(1.0), optax.rmsprop(0.1), optax.adafactor(0.1)],
                         ids=["adagrad", "adadelta", "optax.rmsprop", "optax.adafactor"])
def test_a_second_moment_of_a_changed_layer_is_refused(tx):
    # Before: the old (4, 1) accumulators broadcast silently into the (4, 3) head.
    opt = fo.Optimizer(tx)
    old = _net(out=1)
    state = opt.init(old)
    _, state = jax.jit(opt.apply_gradients)(_grad(old), old, state)  # the setup step compiled: one program
    new = old.replace(head=ft.nn.Dense(4, 3, key=jax.random.key(5)))
    with pytest.raises(ValueError, match=r"another structure: its moment \w+ differs from the gradients at "
                                         r"head\.(weight|bias): the gradient has shape \((4, )?3,?\)"):
        opt.apply_gradients(_grad(new), new, state)


@pytest.mark.parametrize("make", [lambda: fo.Optimizer(fo.asgd(0.1)),
                                  lambda: fo.Optimizer(optax.sgd(0.1), average=fo.ema(0.9))], ids=["asgd", "ema"])
def test_averaged_parameters_of_a_changed_layer_are_refused(make):
    # Before: the (4, 1) head's average broadcast silently into the (4, 3) head's
    # (ASGD's ax and average='s EMA of the new model were of the old one's shapes).
    opt = make()
    old = _net(out=1)
    state = opt.init(old)
    _, state = jax.jit(opt.apply_gradients)(_grad(old), old, state)
    new = old.replace(head=ft.nn.Dense(4, 3, key=jax.random.key(5)))
    with pytest.raises(ValueError, match=r"another structure: its moment average differs from the gradients at "
                                         r"head\.weight: the gradient has shape \(4, 3\), the moment \(4, 1\)"):
        opt.apply_gradients(_grad(new), new, state)
    fresh = opt.init(new)  # the advised fix: a new state
    opt.apply_gradients(_grad(new), new, fresh)


@pytest.mark.parametrize("tx", [optax.novograd(0.1), optax.adafactor(0.1, min_dim_size_to_factor=1), fo.adagrad(0.1)],
                         ids=["novograd-scalar-nu", "adafactor-factored", "adagrad"])
def test_reduced_and_factored_second_moments_of_the_same_model_fit(tx):
    net = _net(out=3)
    check_state_fits(tx.init(ft.parameters(net)), ft.parameters(net))  # no error


def test_unfreezing_with_a_wrt_state_is_refused_and_the_advised_code_keeps_the_head_moments():
    # Before: TypeError "unsupported operand type(s) for *: 'ArrayImpl' and 'NoneType'" in optax.
    net = _net()
    head_opt = fo.Optimizer(fo.adam(1e-2), wrt="head.*")
    state = head_opt.init(net)
    net, state = jax.jit(lambda n, s: head_opt.apply_gradients(ft.gradient(_loss, at=n, wrt="head.*"), n, s))(net, state)
    opt = fo.Optimizer(fo.adam(1e-2))
    grads = _grad(net)
    with pytest.raises(ValueError, match=r"no moment mu for encoder\.weight, which has a gradient now.*wrt="):
        opt.apply_gradients(grads, net, state)
    # the message's recipe: the head's moments and the step count kept, the encoder's from zero
    kept = jax.tree.map(lambda old, new: new if old is None else old, state, opt.init(net), is_leaf=lambda x: x is None)
    _, after = jax.jit(opt.apply_gradients)(grads, net, kept)
    mu_before, mu_after = fo.moments(state)["mu"], fo.moments(after)["mu"]
    np.testing.assert_allclose(mu_after.head.weight, 0.9 * mu_before.head.weight + 0.1 * grads.head.weight,
                               rtol=0, atol=1e-8)
    np.testing.assert_allclose(mu_after.encoder.weight, 0.1 * grads.encoder.weight, rtol=0, atol=1e-8)
    assert int(fo.context(after).step) == 2


def test_freezing_mid_run_names_wrt_and_the_advised_partial_gradients_match_torch():
    # Before: "made for a model of another structure ... moments start again from zero".
    net = _net()
    tnet = _torch_net(net)
    topt = torch.optim.Adam(tnet.parameters(), lr=1e-2)
    opt = fo.Optimizer(fo.adam(1e-2))
    state = opt.init(net)

    def torch_step():
        topt.zero_grad()
        (tnet(torch.tensor(X)) ** 2).mean().backward()
        topt.step()

    full = jax.jit(lambda n, s: opt.apply_gradients(_grad(n), n, s))  # one program per loop, not one per op
    for _ in range(2):
        net, state = full(net, state)
        torch_step()
    with pytest.raises(ValueError, match=r"(?s)moments for encoder\.weight, which this optimizer does not train.*"
                                         r"made for all parameters.*ft\.gradient\(loss_fn, at=model, wrt=\"head\.\*\"\)"):
        fo.Optimizer(fo.adam(1e-2), wrt="head.*").apply_gradients(ft.gradient(_loss, at=net, wrt="head.*"), net, state)
    # the advised way: the same optimizer, partial gradients (torch: requires_grad_(False))
    encoder = net.encoder
    tnet[0].requires_grad_(False)
    partial = jax.jit(lambda n, s: opt.apply_gradients(ft.gradient(_loss, at=n, wrt="head.*"), n, s))
    for _ in range(2):
        net, state = partial(net, state)
        torch_step()
    assert np.array_equal(net.encoder.weight, encoder.weight)
    np.testing.assert_allclose(net.head.weight, tnet[2].weight.detach().numpy().T, rtol=0, atol=1e-6)
    np.testing.assert_allclose(fo.moments(state)["mu"].head.weight, topt.state[tnet[2].weight]["exp_avg"].numpy().T,
                               rtol=0, atol=1e-7)


def test_adafactor_factored_moments_are_read_by_name():
    # Before: ft.optim.moments(adafactor's state) == {}.
    tx = optax.adafactor(0.1, min_dim_size_to_factor=1)
    net = _net(out=3)
    params = ft.parameters(net)
    state = fo.Optimizer(tx).init(net)
    grads = jax.tree.map(np.ones_like, params)
    _, state = jax.jit(fo.Optimizer(tx).update)(grads, state, net)  # one program, not one per optax op
    m = fo.moments(state)
    assert {"v_row", "v_col", "v"} <= set(m)
    raw = jax.jit(tx.update)(grads, tx.init(params), params)[1]
    factored = next(s for s in jax.tree.leaves(raw, is_leaf=lambda x: hasattr(x, "v_row")) if hasattr(s, "v_row"))
    np.testing.assert_allclose(ft.get(m["v_row"], "head.weight"), factored.v_row.head.weight, rtol=0, atol=1e-7)
    np.testing.assert_allclose(ft.get(m["v_col"], "head.weight"), factored.v_col.head.weight, rtol=0, atol=1e-7)
    assert ft.get(m["v"], "head.bias").shape == (3,)  # a vector: its full second moment


def test_a_static_value_changed_after_init_is_named_and_the_moments_carry_over():
    """A Stack's remat toggled (or a Dense's activation swapped) after init: the message named
    no field ('a Stack node (other fields or static values)') and only said to start the
    moments again. It names the field and both values; its carry-over keeps the moments."""
    stack = ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, jax.nn.tanh, key=k), 3, key=jax.random.key(0))
    opt = ft.optim.Optimizer(optax.adam(1e-2))
    loss = lambda m: jnp.sum(m(jnp.linspace(-1.0, 1.0, 3)) ** 2)  # noqa: E731
    step = jax.jit(lambda m, s: opt.minimize(loss, m, s))  # the steps around the refused one compiled
    model, opt_state, _ = step(stack, opt.init(stack))
    changed = model.replace(remat=True)
    with pytest.raises(ValueError, match=r"(?s)before a static value changed: its moment mu .*"
                                         r"the field 'remat' is True in the model, None in the state's.*"
                                         r"right:  opt_state = jax.tree.unflatten"):
        opt.minimize(loss, changed, opt_state)
    carried = jax.tree.unflatten(jax.tree.structure(opt.init(changed)), jax.tree.leaves(opt_state))
    after, _, _ = step(changed, carried)
    expected, _, _ = step(model, opt_state)  # the same step without the change
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    dense = ft.nn.Dense(3, 3, jax.nn.relu, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"the field 'activation' is tanh in the model, relu in the state's"):
        opt.minimize(loss, dense.replace(activation=jax.nn.tanh), opt.init(dense))
    grown = ft.nn.Dense(3, 4, jax.nn.relu, key=jax.random.key(1))  # a shape changed: no carry-over offered
    with pytest.raises(ValueError, match=r"made for a model of another structure"):
        opt.minimize(loss, grown, opt.init(dense))


def test_a_field_named_v_outside_adafactor_is_not_a_moment():
    """optax.contrib.mechanize's MechanicState.v (one array of its betas) was read as
    adafactor's per-parameter `v` once `v` became a moment field: every step was refused."""
    params = {"w": jnp.array([1.0, -2.0, 0.5])}
    loss = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731
    tx = optax.contrib.mechanize(optax.sgd(0.1))
    opt = ft.optim.Optimizer(tx)
    state = opt.init(params)
    new, _, _ = jax.jit(lambda p, s: opt.minimize(loss, p, s))(params, state)  # one program, not one per op
    raw_state = tx.init(params)
    updates, _ = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))(params, raw_state)
    np.testing.assert_allclose(new["w"], optax.apply_updates(params, updates)["w"], rtol=0, atol=1e-7)
    assert "v" not in ft.optim.moments(state)
    factored = ft.optim.Optimizer(optax.adafactor(0.1, min_dim_size_to_factor=1)).init({"w": jnp.ones((3, 2))})
    assert {"v_row", "v_col", "v"} <= set(ft.optim.moments(factored))  # adafactor's still read


# --- moments not shaped like the parameters; states of another optimizer ---------------------
_W = {"w": jax.random.normal(jax.random.key(0), (4, 3)), "b": jnp.zeros(3)}
_XS, _YS = jax.random.normal(jax.random.key(1), (8, 4)), jax.random.normal(jax.random.key(2), (8, 3))


def _mse(m):
    return jnp.mean((_XS @ m["w"] + m["b"][None, :] - _YS) ** 2)


@pytest.mark.parametrize("make", [lambda: optax.flatten(optax.adam(1e-2)),
                                  lambda: optax.flatten(optax.sgd(1e-2, momentum=0.9)),
                                  lambda: optax.contrib.galore(1e-2)],
                         ids=["flatten-adam", "flatten-sgd-momentum", "galore"])
def test_moments_not_shaped_like_the_parameters_run_as_plain_optax(make):
    """flatten's mu/trace is one (15,) vector, GaLore's mu a (3, 3) low-rank projection of the
    (4, 3) gradient: the check refused each at the first step of a fresh state ("made for a
    model of another structure ... the state a leaf of shape (15,)")."""
    tx = make()
    ref, ref_state = dict(_W), tx.init(_W)
    opt = ft.optim.Optimizer(tx)
    ours, state = dict(_W), opt.init(_W)

    @jax.jit  # both steps in one program (eager: one per op)
    def steps(ref, ref_state, ours, state):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float literals and int counts
            updates, ref_state = tx.update(jax.grad(_mse)(ref), ref_state, ref)
        return optax.apply_updates(ref, updates), ref_state, *opt.minimize(_mse, ours, state)[:2]

    for _ in range(3):
        ref, ref_state, ours, state = steps(ref, ref_state, ours, state)
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):  # measured: bit for bit
        np.testing.assert_allclose(a, b, rtol=0, atol=0)


def test_a_flattened_moment_of_another_model_is_refused_with_both_shapes():
    opt = ft.optim.Optimizer(optax.flatten(optax.adam(1e-2)))
    state = opt.init(_W)
    grown = {"w": jnp.ones((5, 3)), "b": jnp.zeros(3)}
    with pytest.raises(ValueError, match=r"(?s)another structure: its moment mu .* a state made for this model has a "
                                         r"moment of shape \(18,\) there, the given \(15,\).*opt_state = optimizer.init"):
        opt.minimize(lambda m: jnp.sum(m["w"] ** 2) + jnp.sum(m["b"]), grown, state)


_M = {"a": {"w": jnp.ones((3, 2))}, "b": {"w": jnp.ones((2,))}, "c": jnp.ones(())}


def _mloss(m):
    return jnp.sum(m["a"]["w"] ** 2) + jnp.sum(jnp.sin(m["b"]["w"])) + m["c"] ** 2


_REBUILT = {  # (the optimizer that made the state, the rebuilt one, what the rebuilt one's state holds at the path)
    "average": (fo.adam(1e-2), dict(transform=fo.adam(1e-2), average=fo.ema(0.9)), r"<root>.*a tuple of length 2"),
    "multisteps": (optax.adam(1e-2), dict(transform=optax.MultiSteps(optax.adam(1e-2), 2)), r"<root>.*a MultiStepsState"),
    "chain-clip": (fo.adam(1e-2), dict(transform=optax.chain(optax.clip_by_global_norm(1.0), fo.adam(1e-2))),
                   r"<root>.*a tuple of length 2"),
    "masked": (fo.adam(1e-2), dict(transform=optax.masked(fo.adam(1e-2), {"a": {"w": True}, "b": {"w": True}, "c": True})),
               r"<root>.*a MaskedState"),
    "optax-adamw": (optax.adam(1e-2), dict(transform=optax.adamw(1e-2)), r"<root>.*a tuple of length 3"),
    "inject-schedule": (optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
                        dict(transform=optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(1e-2, 0, 10))),
                        r"hyperparams_states.*keys \['learning_rate'\]"),
    "number-to-schedule": (optax.adam(1e-2), dict(transform=optax.adam(optax.linear_schedule(1e-2, 0.0, 10))),
                           r"1 the state holds an EmptyState.*this optimizer's state holds a ScaleByScheduleState"),
}


@pytest.mark.parametrize("case", list(_REBUILT))
def test_a_state_of_another_optimizer_is_refused_by_name(case):
    """A plain optimizer's state given to a rebuilt one crashed inside optax ("'HyperState'
    object is not subscriptable", "no attribute 'gradient_step'", "has no len()",
    "'inner_state'", chain's "number of updates and states", KeyError 'learning_rate')."""
    made_by, rebuilt, where = _REBUILT[case]
    old = ft.optim.Optimizer(made_by)
    model, state, _ = jax.jit(lambda m, s: old.minimize(_mloss, m, s))(_M, old.init(_M))  # one program
    new = ft.optim.Optimizer(**rebuilt)
    with pytest.raises(ValueError, match=r"(?s)made by another optimizer than this one: at " + where +
                                         r".*make a new state.*state = opt.init\(model\)") as e:
        new.minimize(_mloss, model, state)
    settable = "ft.optim.set_hyperparameters(state" in str(e.value)
    assert settable == (case not in ("optax-adamw", "multisteps", "number-to-schedule"))  # offered where the old state holds settable hyperparameters
    after, _, _ = jax.jit(lambda m, s: new.minimize(_mloss, m, s))(model, new.init(model))  # the fix
    assert jax.tree.structure(after) == jax.tree.structure(_M)


@pytest.mark.parametrize("schedule", [optax.adam, optax.sgd])
def test_a_schedule_replaced_by_a_number_keeps_the_state(schedule):
    """A state made with a scheduled learning rate, continued with a constant one: the
    rebuilt chain's scale is stateless (EmptyState where the state holds the schedule's
    count), its update drops the count and keeps the moments, as optax's own update of the
    same state does. It was refused as another optimizer's state, offering only a new state."""
    old = ft.optim.Optimizer(schedule(lambda count: 1e-2 / (1.0 + count.astype(jnp.float32))))
    model, state = _M, old.init(_M)
    step = jax.jit(lambda m, s: old.minimize(_mloss, m, s))  # the steps before the change: one program
    for _ in range(3):
        model, state, _ = step(model, state)
    grads = ft.gradient(_mloss)(model)
    new = ft.optim.Optimizer(schedule(1e-3))
    reference, ref_state = schedule(1e-3), (state.inner[0], optax.EmptyState())
    for _ in range(2):  # optax's scale returns the state it is given: the next step holds the count too
        updates, state = new.update(grads, state, model)
        with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic (a Python float with int32)
            expected, ref_state = reference.update(grads, ref_state, model)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)


def test_a_state_of_another_optimizer_is_refused_in_a_compiled_step():
    step = ft.train.train_step(lambda m, x: _mloss(m) * x, ft.optim.Optimizer(fo.adam(1e-2), average=fo.ema(0.9)))
    state = ft.optim.Optimizer(fo.adam(1e-2)).init(_M)
    with pytest.raises(ValueError, match=r"made by another optimizer than this one: at <root> the state holds a "
                                         r"HyperState \(hyperparameters learning_rate, beta1, beta2, epsilon"):
        step(_M, state, jnp.ones(()))


def test_check_state_fits_without_init_reads_the_moments_only():
    inner = optax.flatten(optax.adam(0.1)).init(_W)
    with pytest.raises(ValueError, match=r"its moment mu differs from the gradients at <root>"):
        check_state_fits(inner, _W)  # no fresh state to compare with: the moments are read as per-parameter
    check_state_fits(inner, _W, optax.flatten(optax.adam(0.1)).init, _W)


# --- a model class defined again (a notebook cell re-run) -------------------------------

def _linear_class() -> Any:
    """A fresh class each call, of one module and qualified name: a cell defining it re-run."""
    class Linear(ft.Module):
        w: jax.Array
        b: jax.Array

        def __call__(self, x):
            return x @ self.w + jax.lax.broadcast_to_rank(self.b, x.ndim)

    Linear.__qualname__ = "Linear"
    return Linear


_Y = (X @ np.array([[1.0], [2.0], [-1.0]], np.float32)).astype(np.float32)


@jax.jit  # the gradient is the refused call's input, not its subject: one program per class
def _linear_grads(model):
    return jax.grad(lambda m: jnp.mean((m(X) - _Y) ** 2))(model)


def _dict_loss(p):
    return jnp.mean((X @ p["w"] + p["b"][None, :] - _Y) ** 2)


@pytest.mark.parametrize("through", ["Optimizer", "standalone"])
def test_a_redefined_model_class_is_named_and_its_moments_carry_over(through):
    old_cls, new_cls = _linear_class(), _linear_class()
    tx = fo.adam(0.1)
    opt: Any = fo.Optimizer(tx) if through == "Optimizer" else tx
    model = old_cls(jnp.zeros((3, 1)), jnp.zeros(1))
    state = opt.init(model)
    update = jax.jit(lambda m, s: opt.update(_linear_grads(m), s, m))  # the steps not refused: one program each
    updates, state = update(model, state)
    model = ft.move(model, along=updates)
    # the uninterrupted run's second step
    expected, _ = update(model, state)
    # the cell re-run: the same fields and values, in the new class
    model = new_cls(model.w, model.b)
    with pytest.raises(ValueError, match="a model class was defined again") as e:
        opt.update(_linear_grads(model), state, model)  # was optax's "different types ... Net ... Net"
    assert "at <root>" in str(e.value) and f"{__name__}.Linear" in str(e.value)
    # the carry-over the message gives: the same moments and step count, the new class
    state = jax.tree.unflatten(jax.tree.structure(opt.init(model)), jax.tree.leaves(state))
    updates, _ = update(model, state)
    np.testing.assert_allclose(updates.w, expected.w, rtol=0, atol=0)
    np.testing.assert_allclose(updates.b, expected.b, rtol=0, atol=0)
    # and optax's second Adam step on a plain dict
    ref = optax.adam(0.1)
    p: Any = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}
    s: Any = ref.init(p)
    u: Any = None

    @jax.jit  # optax's step compiled: one program, not one per op
    def ref_step(p, s):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int
            u, s = ref.update(jax.grad(_dict_loss)(p), s, p)
        return optax.apply_updates(p, u), s, u

    for _ in range(2):
        p, s, u = ref_step(p, s)
    # measured: 6.8e-7 apart (updates of 0.1; functree's Adam rounds in another order)
    np.testing.assert_allclose(updates.w, u["w"], rtol=0, atol=7e-6)
    np.testing.assert_allclose(updates.b, u["b"], rtol=0, atol=7e-6)


def test_a_redefined_class_held_outside_the_moments_is_named():
    """SAM's cache holds the model's parameters (plain SGD: no moments): the state-of-another-
    optimizer check meets the old class first, and names it."""
    old_cls, new_cls = _linear_class(), _linear_class()
    sam = optax.contrib.sam(optax.sgd(0.1), optax.chain(optax.contrib.normalize(), optax.sgd(0.05)))
    opt = fo.Optimizer(sam)
    state = opt.init(old_cls(jnp.zeros((3, 1)), jnp.zeros(1)))
    model = new_cls(jnp.zeros((3, 1)), jnp.zeros(1))
    with pytest.raises(ValueError, match="a model class was defined again"):
        opt.update(_linear_grads(model), state, model)


# --- optax.contrib.sam: an ExtraArgs transformation whose update takes no **extra_args ----

def _sam(outer):
    return optax.contrib.sam(outer, optax.chain(optax.contrib.normalize(), optax.sgd(0.05)), sync_period=2)


def test_sam_through_the_optimizer_takes_optax_s_steps():
    """Was: TypeError "transparent_update_fn() got an unexpected keyword argument 'context'"."""
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = fo.Optimizer(_sam(optax.adam(0.1)))
    state = opt.init(model)
    step = ft.jit(lambda m, s: opt.minimize(lambda m: jnp.mean((m(X) - _Y) ** 2), m, s))
    # optax's own loop, as its docs drive sam: update, apply_updates, every call
    ref = _sam(optax.adam(0.1))
    p: Any = {"w": model.weight, "b": model.bias}
    s: Any = ref.init(p)

    @jax.jit  # optax's step compiled: one program, not one per op
    def ref_step(p, s):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int
            u, s = ref.update(jax.grad(_dict_loss)(p), s, p)
        return optax.apply_updates(p, u), s

    for _ in range(5):  # adversarial, outer, adversarial, outer, adversarial
        model, state, _ = step(model, state)
        p, s = ref_step(p, s)
        # measured: equal bit for bit (weights near 1.3: 10 float32 ulps would be 1.2e-6)
        np.testing.assert_allclose(model.weight, p["w"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(model.bias, p["b"], rtol=0, atol=1e-6)
    assert int(state.inner.steps_since_sync) == int(s.steps_since_sync) == 1


def test_sam_inside_a_chain_is_refused_by_name():
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    opt = fo.Optimizer(optax.chain(optax.clip_by_global_norm(1.0), _sam(optax.sgd(0.1))))
    state = opt.init(model)
    with pytest.raises(TypeError, match="refuses optax's extra arguments") as e:
        opt.update(_linear_grads(model), state, model)
    assert "optax.contrib.sam(optax.chain(optax.clip_by_global_norm(1.0), opt), adv_opt)" in str(e.value)


def test_sam_around_a_functree_transform_is_refused_by_name():
    """sam passes no extra arguments on: an ft.optim transform inside would get no context."""
    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"cannot pass the\s+learning context"):
        fo.Optimizer(_sam(fo.sgd(0.1))).init(model)


def test_a_layer_rebuilt_with_other_static_values_names_them():
    # Before: "the gradients have a AdaptiveLogSoftmaxWithLoss node (other fields or static
    # values), the state a AdaptiveLogSoftmaxWithLoss node (...)": nothing said which.
    key = jax.random.key(0)
    old = {"head": ft.nn.AdaptiveLogSoftmaxWithLoss(4, 10, [3, 6], key=key)}
    new = {"head": ft.nn.AdaptiveLogSoftmaxWithLoss(4, 12, [3, 6], key=key)}
    opt = fo.Optimizer(optax.adam(0.1))
    state = opt.init(old)
    grads = jax.tree.map(jnp.ones_like, new)
    with pytest.raises(ValueError, match=r"at head: the gradients have an AdaptiveLogSoftmaxWithLoss with "
                                         r"n_classes=12, cutoffs=\(3, 6, 12\), the state one with n_classes=10, "
                                         r"cutoffs=\(3, 6, 10\)\."):
        opt.update(grads, state, new)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: fo.lookahead(optax.sgd(0.1), 2, 0.5), "slow"),
    (lambda: optax.MultiSteps(optax.sgd(0.1), 2), "acc_grads"),
    (lambda: optax.contrib.schedule_free_sgd(0.1), "z"),
    (lambda: optax.chain(optax.ema(0.9), optax.sgd(0.1)), "0.ema"),
    (lambda: optax.adan(0.1), "0.m"),
    (lambda: optax.contrib.prodigy(0.1), "exp_avg"),
], ids=["lookahead", "MultiSteps", "schedule_free", "ema", "adan", "prodigy"])
def test_per_parameter_state_under_any_name_of_a_changed_layer_is_refused(make, field):
    # Before: no error for any of these but MultiSteps (a lax.cond TypeError deep in JAX):
    # the (4, 1) head's slow weights, z, EMA, Adan moments ... broadcast into the (4, 3) head's.
    opt = fo.Optimizer(make())
    old = _net(out=1)
    state = opt.init(old)
    new = old.replace(head=ft.nn.Dense(4, 3, key=jax.random.key(5)))
    with pytest.raises(ValueError, match=rf"another structure: its moment {re.escape(field)} differs from the "
                                         r"gradients at head\.(weight|bias): the state holds shape \((4, )?1,?\) "
                                         r"where a state made for this model holds \((4, )?3,?\)"):
        opt.apply_gradients(_grad(new), new, state)
    opt.apply_gradients(_grad(new), new, opt.init(new))  # the advised fix: a new state


def test_a_transform_that_hands_the_gradient_back_as_the_update_is_refused():
    """optax.masked (ft.optim.masked) as the whole optimizer passes the parameters its mask
    leaves out through as the gradient itself, which apply_updates added: p + g, a step up
    the loss with rate 1 (a user's masked(adam, "head.*"), to train the head: the body moved
    0.129 in 3 steps, the loss of the body's gradient ascent, with no error). Refused naming
    the parameters and the fixes, which train the head alone; masked inside a chain (a decay
    on some parameters) is what it is for, and trains."""
    model = {"body": ft.nn.Dense(2, 2, key=jax.random.key(0)), "head": ft.nn.Dense(2, 1, key=jax.random.key(1))}
    x, y = jnp.ones((4, 2)), jnp.full((4, 1), 2.0)

    def loss(m):
        return jnp.mean((m["head"](m["body"](x)) - y) ** 2)

    for tx in (ft.optim.masked(optax.adam(0.1), "head.*"),
               optax.masked(optax.adam(0.1), lambda p: {"body": jax.tree.map(lambda _: False, p["body"]),
                                                       "head": jax.tree.map(lambda _: True, p["head"])}),
               ft.optim.groups({"head.*": optax.adam(0.1)}, default=optax.identity())):
        opt = ft.optim.Optimizer(tx)
        with pytest.raises(ValueError, match=r"(?s)the gradient itself as the update of body\.weight, body\.bias "
                                             r"\(2 of 4 parameters\).*p \+ g.*wrt=\"head\.\*\""):
            jax.jit(lambda m, s: opt.minimize(loss, m, s))(model, opt.init(model))  # noqa: B023
    for opt in (ft.optim.Optimizer(optax.sgd(0.1), wrt="head.*"),
                ft.optim.Optimizer(ft.optim.groups({"head.*": optax.sgd(0.1)}, default=ft.optim.freeze())),
                ft.optim.Optimizer(optax.chain(ft.optim.masked(optax.add_decayed_weights(0.1), "head.*"),
                                               optax.sgd(0.1)))):
        moved, _, _ = opt.minimize(loss, model, opt.init(model))
        assert float(loss(moved)) < float(loss(model))


def _body_and_head():
    model = {"body": ft.nn.Dense(2, 2, key=jax.random.key(0)), "head": ft.nn.Dense(2, 1, key=jax.random.key(1))}
    x, y = jnp.ones((4, 2)), jnp.full((4, 1), 2.0)
    return model, lambda m, x=x, y=y: jnp.mean((m["head"](m["body"](x)) - y) ** 2), (x, y)


def test_a_mask_around_the_learning_rate_last_in_a_chain_is_refused():
    """optax.masked around the learning rate, last in a chain (scale_by_adam, then the rate on
    the head only), passes the body its mask leaves out through as scale_by_adam's direction,
    which apply_updates added: p + direction (no update is the gradient object, so the
    gradient-as-update check missed it). Through ft.optim.Optimizer and the Trainer, the body
    moved 3.0 in 3 steps and the loss went 4.1 -> 19.3 with no error. Refused while the step
    traces, naming the body's parameters (ft.optim.masked's mask too)."""
    model, loss, batch = _body_and_head()
    head = ft.mask(model, "head.*")
    wrong = r"(?s)applies no learning rate to body\.weight, body\.bias \(2 of 4 parameters\).*p \+ direction"
    for tx in (optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(-1e-3), head)),
               optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(),
                           ft.optim.masked(optax.scale_by_learning_rate(1e-3), "head.*"))):
        opt = ft.optim.Optimizer(tx)
        with pytest.raises(ValueError, match=wrong):  # while the step traces: no compilation needed
            jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))  # noqa: B023
    trainer = ft.train.Trainer(model, ft.optim.Optimizer(optax.chain(optax.scale_by_adam(),
                                                                     optax.masked(optax.scale(-1e-3), head))),
                               lambda m, b: loss(m, *b))
    with pytest.raises(ValueError, match=wrong):
        trainer.fit([batch], epochs=1, progress=False)


def test_a_mask_around_a_smaller_rate_or_a_rate_applied_elsewhere_trains():
    """The refusal of a parameter without a learning rate reads the transform's structure and
    refuses only what surely has none: a mask around a smaller rate before the rate, a mask
    after a whole optimizer, adamw's decay mask and a rate in the user's apply_updates train."""
    model, loss, _ = _body_and_head()
    head = ft.mask(model, "head.*")
    descend = lambda m, u: ft.move(m, along=jax.tree.map(lambda v: -0.1 * v, u))  # noqa: E731
    for opt in (ft.optim.Optimizer(optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(0.1), head),
                                               optax.scale(-0.1))),
                ft.optim.Optimizer(optax.chain(optax.adamw(0.1, mask=head), optax.masked(optax.scale(0.1), head))),
                ft.optim.Optimizer(optax.scale_by_adam(), apply_updates=descend)):
        moved, _, _ = opt.minimize(loss, model, opt.init(model))
        assert float(loss(moved)) < float(loss(model))


def _ascends(learning_rate=1e-3, mask=None):
    """The mistake: the rate masked to the head, last in a chain (the body gets p + direction)."""
    mask = ft.mask(_body_and_head()[0], "head.*") if mask is None else mask
    return optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(-learning_rate), mask))


# Wrappers that give their inner transform the updates over the same parameters: the check
# reads through them (optax's, ft.optim's, and a transform rebuilt from its hyperparameters).
WRAPPERS = {
    "optax.MultiSteps": lambda tx: optax.MultiSteps(tx, every_k_schedule=4),
    "optax.MultiSteps.gradient_transformation": lambda tx: optax.MultiSteps(tx, 4).gradient_transformation(),
    "optax.lookahead": lambda tx: optax.lookahead(tx, sync_period=2, slow_step_size=0.5),
    "optax.apply_if_finite": lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=3),
    "optax.conditionally_mask": lambda tx: optax.conditionally_mask(tx, lambda step: step > 2),
    "optax.inject_hyperparams": lambda tx: optax.inject_hyperparams(
        lambda weight_decay: optax.chain(optax.add_decayed_weights(weight_decay), tx))(weight_decay=0.0),
    "ft.optim.inject": lambda tx: fo.inject(
        "mine", lambda weight_decay: optax.chain(optax.add_decayed_weights(weight_decay), tx), {"weight_decay": 0.0}),
    "ft.optim.lookahead": lambda tx: fo.lookahead(tx, sync_period=2, slow_step_size=0.5),
    "ft.optim.skip_non_finite": fo.skip_non_finite,
    "ft.optim.per_member": fo.per_member,
    "ft.optim.whole_stack": fo.whole_stack,
    "optax.MultiSteps(every_k_schedule=fn)": lambda tx: optax.MultiSteps(tx, every_k_schedule=lambda step: 2 + step % 2),
    "optax.contrib.schedule_free": lambda tx: optax.contrib.schedule_free(tx, 1e-3),
    "optax.contrib.sam": lambda tx: optax.contrib.sam(tx, optax.sgd(0.01), sync_period=2),
    "optax.contrib.mechanize": optax.contrib.mechanize,
    "optax.contrib.reduce_on_plateau": lambda tx: optax.chain(tx, optax.contrib.reduce_on_plateau()),
    "ft.optim.reduce_on_plateau": lambda tx: optax.chain(tx, fo.reduce_on_plateau()),
}


@pytest.mark.parametrize("wrap", list(WRAPPERS.values()), ids=list(WRAPPERS))
def test_a_mask_around_the_learning_rate_inside_a_wrapper_is_refused(wrap):
    """The refusal of a parameter without a learning rate read optax.chain, masked and
    partition, and took every other transform for one applying a rate: the same ascending
    chain inside optax.MultiSteps, lookahead, apply_if_finite, inject_hyperparams or
    ft.optim's lookahead, skip_non_finite, per_member, inject trained the body up the loss
    with no error; so did optax.contrib's schedule_free, sam and mechanize around it, and a
    reduce_on_plateau after it (the loss 4.06 -> 17, 12, 4.05798 and 27 in 4 steps). Each is
    read through (its inner transform's verdict; reduce_on_plateau scales by a factor in
    (0, 1], no rate)."""
    model, loss, _ = _body_and_head()
    opt = ft.optim.Optimizer(wrap(_ascends()))
    with pytest.raises(ValueError, match=r"applies no learning rate to body\.weight, body\.bias \(2 of 4 parameters\)"):
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))


def test_a_transform_built_from_its_hyperparameters_is_read_as_the_step_builds_it():
    """optax.inject_hyperparams and ft.optim.inject rebuild their transform at each step from
    the hyperparameters (a schedule's value included): the factory is called as the jitted
    step calls it (abstract values), and the chain it builds is read (a LossScaleOptimizer
    around it too)."""
    model, loss, _ = _body_and_head()
    head = ft.mask(model, "head.*")
    wrong = r"applies no learning rate to body\.weight, body\.bias \(2 of 4 parameters\)"
    injected = optax.inject_hyperparams(lambda learning_rate: _ascends(learning_rate, head))
    for opt in (fo.Optimizer(injected(learning_rate=1e-3)),
                fo.Optimizer(injected(learning_rate=optax.linear_schedule(1e-3, 0.0, 10))),
                fo.Optimizer(fo.inject("mine", lambda learning_rate: _ascends(learning_rate, head),
                                       {"learning_rate": fo.linear_warmup(1e-3, 4)})),
                fo.LossScaleOptimizer(fo.Optimizer(injected(learning_rate=1e-3)))):
        with pytest.raises(ValueError, match=wrong):
            jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))  # noqa: B023


def test_optax_flatten_is_read_on_its_one_vector():
    """optax.flatten hands its inner transform one vector: a mask inside it (a rate on the
    matrices, ndim > 1) selects nothing there, and the step added every parameter's adam
    direction (the loss 4.06 -> 2124 in 4 steps), with no error: the walk took flatten for a
    transform applying a rate. Its inner transform is read on that vector (all rated or
    none); flatten inside a mask is read for the parameters it gets."""
    model, loss, _ = _body_and_head()
    matrices = lambda u: jax.tree.map(lambda x: x.ndim > 1, u)  # noqa: E731
    everything = r"applies no learning rate to body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4"
    for tx, wrong in ((optax.flatten(optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(-1e-3), matrices))),
                       everything),
                      (optax.flatten(optax.scale_by_adam()), everything),
                      (optax.chain(optax.scale_by_adam(), optax.masked(optax.flatten(optax.scale(-1e-3)),
                                                                       ft.mask(model, "head.*"))),
                       r"applies no learning rate to body\.weight, body\.bias \(2 of 4")):
        opt = ft.optim.Optimizer(tx)
        with pytest.raises(ValueError, match=wrong):
            jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))  # noqa: B023
    for tx in (optax.flatten(optax.adam(1e-3)),
               optax.flatten(optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(0.1), matrices),
                                         optax.scale(-1e-3)))):
        opt = ft.optim.Optimizer(tx)
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))  # noqa: B023  (no error)


def _valid_optimizers(head):
    """optax's, optax.contrib's and ft.optim's optimizers, and chains that apply a rate to
    every parameter (a mask around a smaller rate, a decay mask, partitions, groups)."""
    rate, contrib = 0.05, optax.contrib
    plain = ("adabelief", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw", "adan", "amsgrad",
             "fromage", "lamb", "lars", "lbfgs", "lion", "novograd", "optimistic_adam_v2", "optimistic_gradient_descent",
             "radam", "rmsprop", "rprop", "sgd", "sign_sgd", "signum", "sm3", "yogi")
    contribs = ("acprop", "ademamix", "adopt", "cocob", "dadapt_adamw", "dog", "dowg", "galore", "madgrad", "momo",
                "momo_adam", "muon", "prodigy", "schedule_free_adamw", "schedule_free_sgd", "simplified_ademamix",
                "sophia")
    functree = ("sgd", "rmsprop", "adagrad", "adadelta", "adam", "adamw", "adamax", "amsgrad", "radam", "lion", "nadam",
                "rprop", "asgd")
    labels = jax.tree.map(lambda m: "b" if m else "a", head)
    return ([getattr(optax, n)(rate) for n in plain] + [getattr(contrib, n)(rate) for n in contribs]
            + [getattr(fo, n)(rate) for n in functree]
            + [optax.noisy_sgd(rate, key=0), optax.polyak_sgd(), contrib.mechanize(optax.sgd(rate)),
               contrib.sam(optax.sgd(rate), optax.sgd(rate)), optax.chain(contrib.differentially_private_aggregate(1.0, 0.1, key=jax.random.key(0)), optax.sgd(rate)),
               optax.chain(optax.adam(rate), contrib.reduce_on_plateau()),
               optax.chain(optax.adam(rate), fo.reduce_on_plateau()),
               optax.chain(optax.scale_by_adam(), optax.masked(optax.scale(0.1), head), optax.scale(-rate)),
               optax.chain(optax.adamw(rate, mask=head), optax.masked(optax.scale(0.1), head)),
               optax.chain(optax.adam(rate), optax.masked(optax.scale(0.1), lambda p: jax.tree.map(jnp.ndim, p))),
               optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(rate)),
               optax.partition({"a": optax.adam(rate), "b": optax.sgd(rate)}, labels),
               optax.multi_transform({"a": optax.adam(rate), "b": optax.set_to_zero()}, labels),
               optax.selective_transform(optax.adam(rate), freeze_mask=head),
               optax.chain(optax.conditionally_transform(optax.scale_by_adam(), lambda step: step >= 2),
                           optax.scale(-rate)),
               fo.groups({"head.*": optax.adam(rate)}, default=fo.freeze()), fo.freeze(),
               optax.chain(optax.clip_by_global_norm(1.0), optax.adam(rate)),
               optax.chain(fo.masked(optax.add_decayed_weights(0.1), "head.*"), optax.sgd(rate)),
               optax.chain(fo.weight_decay(0.1), optax.sgd(rate)),
               optax.inject_hyperparams(optax.adam)(learning_rate=rate),
               optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(rate, 0.0, 10), momentum=0.9),
               optax.inject_hyperparams(optax.adamw, static_args="mask")(learning_rate=rate, mask=head),
               fo.adam(fo.warmup_cosine_decay(0.0, rate, 2, 10)), fo.sgd(fo.per_samples(rate, 32)),
               # sign-keeping scalers before the rate; sam's documented (ascending) adversary
               optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale_by_learning_rate(rate)),
               optax.normalize_by_update_norm(scale_factor=-rate),
               optax.chain(optax.trace(0.9), optax.scale_by_sign(), optax.scale(-rate)),
               contrib.sam(optax.sgd(rate), optax.chain(contrib.normalize(), optax.sgd(rate))),
               contrib.sam(optax.adam(rate), optax.chain(contrib.normalize(), optax.sgd(rate)), opaque_mode=True),
               contrib.scale_by_galore(base_optimizer=optax.adam(rate)), contrib.scale_by_galore(scale=-rate),
               optax.conditionally_transform(optax.adam(rate), lambda step: step >= 0)])  # (never skips)


@pytest.mark.parametrize("wrap", [lambda tx: tx, *WRAPPERS.values(), optax.flatten],
                         ids=["unwrapped", *WRAPPERS, "optax.flatten"])
def test_no_valid_optimizer_is_refused_for_want_of_a_learning_rate_wrapped_or_not(wrap):
    """No false refusal: each of 89 optimizers that apply a rate to every parameter passes
    the check as it is and inside each wrapper the check reads through (and optax.flatten)."""
    model = _body_and_head()[0]
    params = ft.parameters(model)
    grads = jax.tree.map(jnp.ones_like, params)
    valid = _valid_optimizers(ft.mask(model, "head.*"))
    assert len(valid) == 89
    for tx in valid:
        check_rate_applied(wrap(tx), grads, None)


def test_a_conditionally_transform_that_forwards_the_gradient_unscaled_is_refused():
    """optax.conditionally_transform forwards the updates unchanged on the steps it skips:
    around a whole optimizer (adam, to start it at step 100), steps 0-99 added the raw
    gradient, p + g, a step up the loss at rate 1 (the loss 4.06 -> 195 in one skipped step,
    4e8 in two, with no error: the update is lax.cond's output, not the gradient object).
    Refused while the step traces; before the rate in a chain (the skipped steps take
    -lr * g) and conditionally_mask (no update on them) are not."""
    model, loss, _ = _body_and_head()
    late = lambda step: step >= 100  # noqa: E731
    wrong = (r"(?s)optax.conditionally_transform passes the updates through unchanged on the steps it skips.*"
             r"to body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4 parameters\).*p \+ g.*conditionally_mask")
    head_only = optax.chain(optax.scale_by_adam(), optax.masked(  # the head rated only when it transforms
        optax.conditionally_transform(optax.scale(-1e-3), late), ft.mask(model, "head.*")))
    for tx, message in ((optax.conditionally_transform(optax.adam(1e-3), late), wrong),
                        (optax.chain(optax.clip_by_global_norm(1.0), optax.conditionally_transform(optax.sgd(1e-3), late)),
                         wrong),
                        (optax.inject_hyperparams(lambda learning_rate: optax.conditionally_transform(
                            optax.adam(learning_rate), late))(learning_rate=1e-3), wrong),
                        (head_only, r"applies no learning rate to body\.weight, body\.bias \(2 of 4")):
        opt = ft.optim.Optimizer(tx)
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))  # noqa: B023
    for tx in (optax.chain(optax.conditionally_transform(optax.scale_by_adam(), late), optax.scale(-1e-3)),
               optax.conditionally_mask(optax.adam(1e-3), late),
               optax.chain(optax.conditionally_transform(optax.clip_by_global_norm(1.0), late), optax.adam(1e-3))):
        opt = ft.optim.Optimizer(tx)
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))  # noqa: B023  (no error)


def test_two_conditionally_transforms_are_read_one_skipping_at_a_time():
    """Each conditionally_transform skips on its own condition: a rate in one of two that
    skip on alternate steps is read with the other transforming, so the pair trains; the
    one left unrated on its skipped step is named."""
    grads = {"w": jnp.ones(2)}
    even, odd = (lambda step: step % 2 == 0), (lambda step: step % 2 == 1)
    check_rate_applied(optax.chain(optax.conditionally_transform(optax.scale(-0.1), even),
                                   optax.conditionally_transform(optax.scale(-0.1), odd)), grads, None)
    with pytest.raises(ValueError, match=r"steps it skips.*to w \(1 of 1 parameters\)"):
        check_rate_applied(optax.chain(optax.conditionally_transform(optax.scale_by_adam(), even),
                                       optax.conditionally_transform(optax.scale(-0.1), odd)), grads, None)


# --- transforms that keep the direction's sign and apply no rate --------------------------------
_Q = {"w": jnp.array([[1.0, -2.0], [0.5, 0.3], [0.7, -1.1]]), "v": jnp.array([[0.4, -0.9], [1.5, 0.2]])}


def _quadratic(p):
    return 0.5 * sum(jnp.sum((x - 0.25) ** 2) for x in jax.tree.leaves(p))


def _two_raw_steps(tx, count=2):
    """The loss before and after two plain optax steps of ``tx`` on the quadratic (two: adopt's
    first update is zero; sam's second is its outer step, its first the adversarial one), or ``count``."""
    tx = optax.with_extra_args_support(tx)  # (sam's opaque mode takes the gradient function)
    grad = jax.grad(_quadratic)

    @jax.jit  # one program (eager: one per op)
    def steps(p):
        state = tx.init(p)
        for _ in range(count):
            with jax.numpy_dtype_promotion("standard"):  # optax mixes float literals and int counts
                updates, state = tx.update(grad(p), state, p, grad_fn=lambda q, _: grad(q))
            p = optax.apply_updates(p, updates)
        return _quadratic(p)

    return float(_quadratic(_Q)), float(steps(_Q))


def _sam(outer, **kwargs):
    """optax's documented SAM: an adversarial normalized sgd step (sam negates it: it ascends)."""
    return optax.contrib.sam(outer, optax.chain(optax.contrib.normalize(), optax.sgd(0.05)), sync_period=2, **kwargs)


_SIGN_KEEPING = {  # each on its own, or with others of its kind: no rate, no minus sign
    "chain(scale_by_adam, scale_by_trust_ratio)": lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio()),
    "scale_by_trust_ratio(trust_coefficient=1e-3)": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_trust_ratio(trust_coefficient=1e-3)),
    "normalize_by_update_norm": optax.normalize_by_update_norm,
    "chain(trace, scale_by_sign)": lambda: optax.chain(optax.trace(0.9), optax.scale_by_sign()),
    "scale_by_adadelta": optax.scale_by_adadelta, "scale_by_adan": optax.scale_by_adan,
    "scale_by_novograd": optax.scale_by_novograd, "scale_by_sm3": optax.scale_by_sm3,
    "scale_by_factored_rms": lambda: optax.scale_by_factored_rms(min_dim_size_to_factor=1),
    "scale_by_lbfgs": lambda: optax.scale_by_lbfgs(memory_size=2), "scale_by_param_block_norm": optax.scale_by_param_block_norm,
    "scale_by_param_block_rms": optax.scale_by_param_block_rms, "centralize": optax.centralize,
    "zero_nans": optax.zero_nans, "clip_by_block_rms": lambda: optax.clip_by_block_rms(1.0),
    "adaptive_grad_clip": lambda: optax.adaptive_grad_clip(0.1), "contrib.normalize": optax.contrib.normalize,
    "contrib.scale_by_acprop": optax.contrib.scale_by_acprop, "contrib.scale_by_ademamix": optax.contrib.scale_by_ademamix,
    "contrib.scale_by_simplified_ademamix": optax.contrib.scale_by_simplified_ademamix,
    "contrib.scale_by_adopt": optax.contrib.scale_by_adopt,
    "contrib.scale_by_muon": lambda: optax.contrib.scale_by_muon(  # (each leaf a matrix, as muon's partition makes it)
        ns_steps=1, weight_dimension_numbers=lambda p: jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(), p)),
    "contrib.scale_by_galore": lambda: optax.contrib.scale_by_galore(rank=1),  # (its default base: scale_by_adam)
    "sam(outer without a rate)": lambda: _sam(optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio())),
    "sam(outer without a rate, opaque_mode)": lambda: _sam(optax.normalize_by_update_norm(), opaque_mode=True),
}


@pytest.mark.parametrize("make", list(_SIGN_KEEPING.values()), ids=list(_SIGN_KEEPING))
def test_a_sign_keeping_scaler_without_a_rate_is_refused(make):
    """scale_by_trust_ratio, normalize_by_update_norm, scale_by_sign, optax's other moment
    scalers (adadelta, adan, novograd, sm3, factored rms, lbfgs ...) and optax.contrib's
    (normalize, acprop, ademamix, adopt, muon) were taken for transforms applying a rate:
    chain(scale_by_adam(), scale_by_trust_ratio()) (lamb without its rate), and sam around
    it, trained up the loss with no error. Each is a direction now; its climb is measured."""
    tx = make()
    before, after = _two_raw_steps(tx)
    assert after > before  # optax's own steps: up the loss
    with pytest.raises(ValueError, match=r"(?s)applies no learning rate to v, w \(2 of 2 parameters\).*"
                                         r"optax.scale_by_learning_rate\(1e-3\)\)"):
        check_rate_applied(tx, _Q, None)  # (what Optimizer.update calls while the step traces)


_RATED_AFTER = {
    "lamb": lambda: optax.lamb(0.05), "lars": lambda: optax.lars(0.05),
    "chain(scale_by_adam, scale_by_trust_ratio, scale_by_learning_rate)": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale_by_learning_rate(0.05)),
    "normalize_by_update_norm(scale_factor=-0.05)": lambda: optax.normalize_by_update_norm(scale_factor=-0.05),
    "chain(trace, scale_by_sign, scale_by_learning_rate)": lambda: optax.chain(
        optax.trace(0.9), optax.scale_by_sign(), optax.scale_by_learning_rate(0.05)),
    "contrib.scale_by_galore(base_optimizer=adam)": lambda: optax.contrib.scale_by_galore(
        rank=1, base_optimizer=optax.adam(0.05)),
    "contrib.scale_by_galore(scale=-0.05)": lambda: optax.contrib.scale_by_galore(rank=1, scale=-0.05),
    "contrib.scale_by_galore(a mask read on the low-rank updates)": lambda: optax.contrib.scale_by_galore(
        rank=1, base_optimizer=optax.chain(optax.scale_by_adam(), optax.masked(
            optax.scale(-0.05), lambda u: jax.tree.map(lambda x: x.shape[0] == 1, u)))),  # (1, 2) each: all
    "sam": lambda: _sam(optax.sgd(0.05)), "sam(opaque_mode)": lambda: _sam(optax.sgd(0.05), opaque_mode=True),
}


@pytest.mark.parametrize("make", list(_RATED_AFTER.values()), ids=list(_RATED_AFTER))
def test_a_sign_keeping_scaler_with_a_rate_and_sam_s_ascending_adversary_train(make):
    """The rate after the sign-keeping scalers (lamb, lars, their chain, normalize_by_update_norm
    with a negative factor) passes, and so does sam's adversarial optimizer, which ascends by
    design (not read: only the outer optimizer is), and GaLore with a rate in its base or its
    scale (a mask in its base read on the low-rank updates, as the base gets them: on the
    full (3, 2) and (2, 2) gradients it would select neither); each goes down the loss."""
    tx = make()
    before, after = _two_raw_steps(tx)
    assert after < before
    check_rate_applied(tx, _Q, None)  # no error


_NEVER_SKIPS = {"step >= 0": lambda step: step >= 0, "True": lambda step: True, "step > -1": lambda step: step > -1,
                "~(step < 0)": lambda step: ~(step < 0), "step >= 0.0": lambda step: step >= 0.0,
                "(step >= 0) | (step < 3)": lambda step: (step >= 0) | (step < 3)}
_MAY_SKIP = {"step >= 1": lambda step: step >= 1, "step % 2 == 0": lambda step: step % 2 == 0,
             "step < 2**31 - 1": lambda step: step < 2**31 - 1,  # (the count saturates there: skips for good)
             "(step >= 5) | (step < 5)": lambda step: (step >= 5) | (step < 5)}  # (never skips; read apart: may)


@pytest.mark.parametrize("condition", list(_NEVER_SKIPS.values()), ids=list(_NEVER_SKIPS))
def test_a_conditionally_transform_whose_condition_never_skips_trains(condition):
    """conditionally_transform(adam, lambda step: step >= 0) never skips, yet was refused with
    SKIPPED_UNSCALED: the walk read every conditionally_transform as skipping. The condition
    is read from its jaxpr on the count's range (0 to int32's largest): a constant, a
    comparison with a constant, and/or/not of those; one true throughout passes, and trains."""
    tx = optax.conditionally_transform(optax.adam(0.05), condition)
    before, after = _two_raw_steps(tx)
    assert after < before
    with jax.numpy_dtype_promotion("standard"):  # (JAX's default: step >= 0.0 compares an int32 with a float)
        check_rate_applied(tx, _Q, None)  # no error


@pytest.mark.parametrize("condition", list(_MAY_SKIP.values()), ids=list(_MAY_SKIP))
def test_a_conditionally_transform_whose_condition_may_skip_is_still_refused(condition):
    """A condition false at some count, or one the check cannot read (arithmetic, a correlated
    pair), is still taken to skip; the message gives the fix for one that never does."""
    tx = optax.conditionally_transform(optax.adam(0.05), condition)
    with pytest.raises(ValueError, match=r"(?s)steps it skips.*to v, w \(2 of 2 parameters\).*"
                                         r"use its inner optimizer alone.*or:  optax.adam\(1e-3\)"):
        check_rate_applied(tx, _Q, None)
    forwarded = optax.conditionally_transform(optax.adam(0.05), lambda step, **_: step >= 0, forward_extra_args=True)
    with pytest.raises(ValueError, match=r"steps it skips"):  # (a condition on the extra arguments: not read)
        check_rate_applied(forwarded, _Q, None)


def test_a_skipped_first_step_climbs_on_the_real_numbers():
    """What SKIPPED_UNSCALED refuses: step >= 1 forwards the gradient at step 0, p + g."""
    before, after = _two_raw_steps(optax.conditionally_transform(optax.adam(0.05), lambda step: step >= 1))
    assert after > before


# --- rates whose signs multiply to a plus ---------------------------------------------------------
_ASCENDING = {  # each scales the direction by a positive factor: p + lr * direction
    "galore(1.0, base_optimizer=adam)": lambda: optax.contrib.galore(1.0, rank=1, base_optimizer=optax.adam(0.05)),
    "chain(adam, scale(-1))": lambda: optax.chain(optax.adam(0.05), optax.scale(-1.0)),
    "chain(sgd, scale_by_learning_rate(1))": lambda: optax.chain(optax.sgd(0.05), optax.scale_by_learning_rate(1.0)),
    "chain(scale_by_adam, scale(0.05))": lambda: optax.chain(optax.scale_by_adam(), optax.scale(0.05)),
    "scale_by_learning_rate(flip_sign=False)": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_learning_rate(0.05, flip_sign=False)),
    "normalize_by_update_norm(scale_factor=0.05)": lambda: optax.normalize_by_update_norm(scale_factor=0.05),
    "scale_by_galore(scale=0.05)": lambda: optax.contrib.scale_by_galore(rank=1, scale=0.05),
    "flatten(chain(sgd, scale(-1)))": lambda: optax.flatten(optax.chain(optax.sgd(0.05), optax.scale(-1.0))),
    # ft.optim's: the learning rate a traced hyperparameter, checked >= 0 (a number or functree's schedule)
    "chain(ft.optim.adam, scale(-1))": lambda: optax.chain(fo.adam(0.05), optax.scale(-1.0)),
    "chain(ft.optim.sgd(schedule), scale_by_learning_rate(1))": lambda: optax.chain(
        fo.sgd(fo.linear_warmup(0.05, 2)), optax.scale_by_learning_rate(1.0)),
}


@pytest.mark.parametrize("make", list(_ASCENDING.values()), ids=list(_ASCENDING))
def test_rates_whose_signs_multiply_to_a_plus_are_refused(make):
    """The check took a rate of either sign for a rate: galore(1.0, base_optimizer=adam(lr))
    (as optax's docstring advises: -lr, then galore's -1.0), a chain of a whole optimizer and
    scale(-1), and scale_by_adam then scale(lr) (the minus sign forgotten) trained up the loss
    with no error. The factors' signs are multiplied (ft.optim's learning rate, a traced
    hyperparameter kept >= 0, read from the build): a plus is refused, its climb measured."""
    tx = make()
    before, after = _two_raw_steps(tx)
    assert after > before  # optax's own steps: up the loss
    with pytest.raises(ValueError, match=r"(?s)moves v, w \(2 of 2 parameters\) up the loss.*"
                                         r"right:  optax.contrib.galore\(1e-3, base_optimizer=optax.scale_by_adam\(\)\)"
                                         r".*maximize=True"):
        check_rate_applied(tx, _Q, None)


def test_an_ascending_chain_is_refused_by_the_optimizer_naming_its_parameters():
    """Through ft.optim.Optimizer's step (while it traces): only the parameters whose factors
    multiply to a plus are named (the head's extra scale(-1) undoes its rate)."""
    model, loss, _ = _body_and_head()
    tx = optax.chain(optax.adam(1e-3), optax.masked(optax.scale(-1.0), ft.mask(model, "head.*")))
    opt = ft.optim.Optimizer(tx)
    with pytest.raises(ValueError, match=r"moves head\.weight, head\.bias \(2 of 4 parameters\) up the loss"):
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))


_DESCENDING = {  # double negatives that end up descending, a rate of unknown sign, deliberate ascent
    "chain(scale_by_adam, scale_by_learning_rate(-0.05), scale(-1))": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_learning_rate(-0.05), optax.scale(-1.0)),
    "chain(scale(-1), sgd, scale(-1))": lambda: optax.chain(optax.scale(-1.0), optax.sgd(0.05), optax.scale(-1.0)),
    "galore(0.05, base_optimizer=scale_by_adam)": lambda: optax.contrib.galore(
        0.05, rank=1, base_optimizer=optax.scale_by_adam()),
    "galore(-1.0, base_optimizer=adam)": lambda: optax.contrib.galore(-1.0, rank=1, base_optimizer=optax.adam(0.05)),
    "chain(adam, scale_by_schedule)": lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(
        optax.linear_schedule(0.05, 0.01, 10))),
    "chain(ft.optim.adam, scale(2))": lambda: optax.chain(fo.adam(0.025), optax.scale(2.0)),
}


@pytest.mark.parametrize("make", list(_DESCENDING.values()), ids=list(_DESCENDING))
def test_rates_whose_signs_multiply_to_a_minus_train(make):
    """A double negative that descends, galore with a base without a rate (or a negative
    learning_rate after adam's) and a scheduled rate pass, and go down the loss."""
    tx = make()
    before, after = _two_raw_steps(tx)
    assert after < before
    check_rate_applied(tx, _Q, None)  # no error


def test_deliberate_ascent_with_maximize_is_not_refused():
    """ft.optim's maximize=True negates the gradient before the optimizer (two minus signs, on
    purpose): the check reads it as deliberate; the step climbs, as asked."""
    tx = fo.adam(0.05, maximize=True)
    before, after = _two_raw_steps(tx)
    assert after > before
    check_rate_applied(tx, _Q, None)  # no error
    model, loss, _ = _body_and_head()
    opt = ft.optim.Optimizer(fo.sgd(0.05, maximize=True))
    jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))  # no error


def test_a_negative_rate_given_to_inject_hyperparams_is_refused():
    """optax.inject_hyperparams keeps its numbers in the state, which starts from the values
    given: inject_hyperparams(optax.adam)(learning_rate=-0.05) and (optax.sgd)(learning_rate=-0.1)
    scale by -(-lr) and climbed (the loss 5.3 -> 9.2 and 24 in 8 steps) with no error, the
    walk building the factory from abstract values of either sign. The number given is read
    (the first step's value), in a chain too and through the Optimizer's traced step; a
    positive one, and a negative one that a flipped sign makes a descent, pass."""
    for tx, given in ((optax.inject_hyperparams(optax.adam)(learning_rate=-0.05), r"adam\)\(learning_rate=-0\.05\)"),
                      (optax.inject_hyperparams(optax.sgd)(learning_rate=-0.1, momentum=0.9),
                       r"sgd\)\(learning_rate=-0\.1\)"),
                      (optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.sgd)(
                          learning_rate=jnp.asarray(-0.1))), r"sgd\)\(learning_rate=-0\.1")):
        with pytest.raises(ValueError, match=rf"(?s)moves v, w \(2 of 2 parameters\) up the loss.*Given: "
                                             rf"optax.inject_hyperparams\(optax.{given}"):
            check_rate_applied(tx, _Q, None)
    before, after = _two_raw_steps(optax.inject_hyperparams(optax.sgd)(learning_rate=-0.1, momentum=0.9))
    assert after > before  # optax's own steps: up the loss
    model, loss, _ = _body_and_head()
    opt = ft.optim.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=-0.05))
    with pytest.raises(ValueError, match=r"moves body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4"):
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))
    flipped = optax.inject_hyperparams(lambda learning_rate: optax.chain(optax.scale_by_adam(), optax.scale(
        learning_rate)))(learning_rate=-0.05)
    before, after = _two_raw_steps(flipped)
    assert after < before
    for tx in (optax.inject_hyperparams(optax.adam)(learning_rate=0.05), flipped):
        check_rate_applied(tx, _Q, None)  # no error


def test_a_learning_rate_schedule_negative_at_step_0_is_refused():
    """A schedule is a function of the step count, and the walk took it for a rate of either
    sign: optax.sgd(lambda step: -0.1), sgd(constant_schedule(-0.1)) and inject_hyperparams(sgd)
    with such a schedule scale by -(-0.1) and climbed from the first step (the loss 5.3 -> 24 in
    8 steps) with no error. The schedule is evaluated at the step counts (once, concretely,
    while the step traces too): negative at step 0 is refused with ASCENDING_UPDATE, naming it."""
    for tx, given in ((optax.sgd(lambda step: -0.1), r"the learning rate <lambda> is -0\.1 at step 0"),
                      (optax.sgd(optax.constant_schedule(-0.1)),
                       r"the learning rate optax\.constant_schedule is -0\.1 at step 0"),
                      (optax.inject_hyperparams(optax.sgd)(learning_rate=lambda step: -0.1),
                       r"optax\.inject_hyperparams\(optax\.sgd\)\(learning_rate=schedule\) is -0\.1 at step 0")):
        with pytest.raises(ValueError, match=rf"(?s)moves v, w \(2 of 2 parameters\) up the loss.*Given: {given}\..*"
                                             r"optax.sgd\(optax.constant_schedule\(0\.1\)\)"):
            check_rate_applied(tx, _Q, None)
    before, after = _two_raw_steps(optax.sgd(lambda step: -0.1))
    assert after > before  # optax's own steps: up the loss
    model, loss, _ = _body_and_head()
    opt = ft.optim.Optimizer(optax.sgd(optax.constant_schedule(-0.1)))
    with pytest.raises(ValueError, match=r"moves body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4.*at step 0"):
        jax.jit(lambda m, s: opt.minimize(loss, m, s)).lower(model, opt.init(model))


def test_a_schedule_that_turns_and_holds_the_wrong_sign_is_refused_from_that_step():
    """optax.adam(optax.linear_schedule(0.05, -0.05, 4)) descends for two steps, then holds -0.05
    (optax's schedules hold their last value): adam's -lr climbs at every step after (the loss
    5.3 -> 6.5 in 8 steps), with no error. A schedule whose held end has another sign than its
    step 0 is read there too: refused with ASCENDING_LATER, naming the step it turns at."""
    for tx, given in ((optax.adam(optax.linear_schedule(0.05, -0.05, 4)),
                       r"the learning rate optax\.polynomial_schedule is negative from step 3 on, -0\.05 at its end"),
                      (optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(0.05, -0.05, 4)),
                       r"optax\.inject_hyperparams\(optax\.adam\)\(learning_rate=schedule\) is negative from step 3 on, -0\.05 at its end"),
                      (optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(  # a ramp up to a plus
                          optax.linear_schedule(-0.05, 0.05, 4))), r"optax\.scale_by_schedule\(optax\.polynomial_schedule\) is positive from step 3 on, 0\.05 at its end")):
        with pytest.raises(ValueError, match=rf"(?s)moves v, w \(2 of 2 parameters\) up the loss from the step its "
                                             rf"schedule turns: {given}.*right:  optax.adam\(optax.linear_schedule\(1e-3, 0.0, 100\)\)"):
            check_rate_applied(tx, _Q, None)
    tx = optax.adam(optax.linear_schedule(0.05, -0.05, 4))
    before, after = _two_raw_steps(tx, 8)
    assert after > before  # optax's own steps: up the loss
    assert _two_raw_steps(tx, 2)[1] < before  # (down at first)


@pytest.mark.parametrize("make", [
    lambda: optax.adam(optax.linear_schedule(0.05, 0.0, 4)),  # (its end: -1.5e-10 in float32, read as 0)
    lambda: optax.sgd(lambda step: 0.05 * (1 - step / 1000)),  # negative past its end: still falling, not read
    lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 0.05, 2, 10)),
    lambda: optax.sgd(optax.sgdr_schedule([dict(init_value=0.0, peak_value=0.05, warmup_steps=2, decay_steps=4)] * 2)),
    lambda: optax.inject_hyperparams(optax.adam)(learning_rate=optax.exponential_decay(0.05, 2, 0.5)),
    lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(lambda step: -0.05)),  # by hand, descends
    lambda: fo.sgd(fo.linear_warmup(0.05, 2), maximize=True),
], ids=["linear to 0", "a line falling past its end", "warmup_cosine_decay", "sgdr", "inject exponential_decay",
        "scale_by_schedule(-lr)", "ft.optim maximize"])
def test_schedules_that_stay_of_their_sign_pass(make):
    """Schedules of the right sign at every step pass (a warmup from 0 too), as does a user's
    line that turns negative only past the step its user stops at (it is not held there:
    not read), and ft.optim's deliberate ascent."""
    check_rate_applied(make(), _Q, None)  # no error


def test_a_conditionally_transform_that_climbs_on_its_transforming_steps_is_refused():
    """chain(conditionally_transform(adam(lr), fn), scale(-1)) climbs on the steps fn is True
    (-lr, then -1) and descends on those it skips: the check refused an ascent only where every
    reading of its skipping climbed, so it trained up the loss (5.3 -> 6.1 in 2 steps) with no
    error. With one conditionally_transform both readings happen: an ascent in either is
    refused, naming its steps (those it skips too: the updates passed through as they came)."""
    late = lambda step: step < 1000  # noqa: E731
    climbs = optax.chain(optax.conditionally_transform(optax.adam(0.05), late), optax.scale(-1.0))
    before, after = _two_raw_steps(climbs)
    assert after > before  # optax's own steps: up the loss
    for tx, when in ((climbs, r"transforms \(its should_transform_fn True\)"),
                     (optax.chain(optax.conditionally_transform(optax.scale(-1.0), lambda step: step % 2 == 0),
                                  optax.adam(0.05)), r"transforms"),
                     (optax.chain(optax.conditionally_transform(optax.scale(-1.0), late), optax.sgd(0.05),
                                  optax.scale(-1.0)), r"skips \(its should_transform_fn False")):
        with pytest.raises(ValueError, match=rf"(?s)moves v, w \(2 of 2 parameters\) up the loss on the steps "
                                             rf"optax.conditionally_transform {when}.*optax.conditionally_mask"):
            check_rate_applied(tx, _Q, None)
    model, loss, _ = _body_and_head()
    opt = ft.optim.Optimizer(climbs)
    with pytest.raises(ValueError, match=r"moves body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4"):
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))
    rated_after = optax.chain(optax.conditionally_transform(optax.scale_by_adam(), late), optax.scale(-0.05))
    before, after = _two_raw_steps(rated_after)
    assert after < before
    check_rate_applied(rated_after, _Q, None)  # no error


_OPTAX_SCHEDULES = {  # optax's constructors (those this optax has), each >= 0 at every step
    "constant_schedule": lambda: optax.constant_schedule(1e-3),
    "linear_schedule": lambda: optax.linear_schedule(1e-3, 0.0, 100),
    "polynomial_schedule": lambda: optax.polynomial_schedule(1e-3, 1e-5, 2, 100, 10),
    "cosine_decay_schedule": lambda: optax.cosine_decay_schedule(1e-3, 100, 0.1),
    "warmup_cosine_decay_schedule": lambda: optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000),
    "warmup_constant_schedule": lambda: optax.warmup_constant_schedule(0.0, 1e-3, 10),
    "warmup_exponential_decay_schedule": lambda: optax.warmup_exponential_decay_schedule(0.0, 1e-3, 10, 100, 0.5,
                                                                                         end_value=1e-4),
    "exponential_decay": lambda: optax.exponential_decay(1e-3, 100, 0.9, staircase=True),
    "piecewise_constant_schedule": lambda: optax.piecewise_constant_schedule(1e-3, {100: 0.1, 200: 0.1}),
    "piecewise_interpolate_schedule": lambda: optax.piecewise_interpolate_schedule("linear", 1e-3, {10: 2.0, 20: 0.0}),
    "cosine_onecycle_schedule": lambda: optax.cosine_onecycle_schedule(1000, 1e-3),
    "linear_onecycle_schedule": lambda: optax.linear_onecycle_schedule(1000, 1e-3),
    "sgdr_schedule": lambda: optax.sgdr_schedule([dict(init_value=0.0, peak_value=0.05, warmup_steps=2,
                                                       decay_steps=4)] * 2),
    "join_schedules": lambda: optax.join_schedules([optax.constant_schedule(0.0),
                                                    optax.linear_schedule(1e-3, 1e-4, 10)], [5]),
}


@pytest.mark.parametrize("name", sorted(_OPTAX_SCHEDULES))
def test_optax_schedule_constructors_are_read_without_compiling(name, caplog):
    """The rate check evaluated every schedule over the step counts: one program compiled per
    schedule, 0.15-0.45 s added to the first step of optax.adam(warmup_cosine_decay_schedule(
    ...)). optax's constructors are read from the numbers their closures hold: nothing is
    compiled, and what is read (the value at step 0, the one held at the end) is what the
    evaluation gives."""
    if not hasattr(optax, name):
        pytest.skip(f"optax {optax.__version__} has no {name}")
    schedule = _OPTAX_SCHEDULES[name]()
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        for tx in (optax.adam(schedule), optax.inject_hyperparams(optax.adam)(learning_rate=schedule)):
            check_rate_applied(tx, _Q, None)  # no error
    assert not [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    from functree.optim._schedule_reads import HELD, evaluated, schedule_read

    read, values = schedule_read(schedule), evaluated(schedule)
    assert read is not None and read.values is None and values is not None  # (derived, not evaluated)
    np.testing.assert_allclose(read.start, values[0], rtol=1e-5, atol=0)
    held = bool(np.all(values[-HELD:] == values[-1])) and values[-1] != 0
    assert (read.end is not None) == held
    np.testing.assert_allclose(read.end or 0.0, values[-1] if held else 0.0, rtol=1e-5, atol=0)


def test_a_schedule_read_from_its_numbers_that_turns_names_the_step_it_turns_at():
    """A schedule read from its numbers (none compiled) that is 0 at step 0 and holds a value
    of the sign that climbs: refused with ASCENDING_LATER, the step it turns at evaluated for
    the message (only then)."""
    tx = optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(optax.linear_schedule(0.0, 0.05, 4)))
    with pytest.raises(ValueError, match=r"schedule turns: optax\.scale_by_schedule\(optax\.polynomial_schedule\) "
                                         r"is positive from step 1 on, 0\.05 at its end"):
        check_rate_applied(tx, _Q, None)


def test_an_ft_optim_rate_that_is_a_negative_function_of_the_learning_context_is_refused():
    """ft.optim's learning rate may be a function of the learning context: the walk read a
    number or functree's own schedules as >= 0 and any other function as a rate of either
    sign, so ft.optim.sgd(lambda ctx: -0.1) and sgd(ft.optim.schedule(optax.constant_schedule(
    -0.1))) climbed (the loss 5.3 -> 24 in 8 steps) with no error. Refused by the Optimizer's
    step, naming the parameters."""
    before, after = _two_raw_steps(fo.sgd(lambda ctx: -0.1))
    assert after > before  # its own steps: up the loss
    model, loss, _ = _body_and_head()
    opt = ft.optim.Optimizer(fo.sgd(lambda ctx: -0.1))
    with pytest.raises(ValueError, match=r"moves body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4"):
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))


@pytest.mark.parametrize("make, given", [
    (lambda: fo.sgd(lambda ctx: -0.1), r"Given: ft\.optim\.sgd\(learning_rate=<lambda>\) is -0\.1 at step 0"),
    (lambda: fo.sgd(fo.schedule(optax.constant_schedule(-0.1))),
     r"Given: ft\.optim\.sgd\(learning_rate=ft\.optim\.schedule\(optax\.constant_schedule\)\) is -0\.1 at step 0"),
    (lambda: fo.adam(fo.schedule(optax.linear_schedule(0.05, -0.05, 4), unit="sweeps")),
     r"turns: ft\.optim\.adam\(learning_rate=ft\.optim\.schedule\(optax\.polynomial_schedule, unit='sweeps'\)\) "
     r"is negative from sweep 3 on, -0\.05 at its end"),
    (lambda: fo.sgd(lambda ctx: jnp.where(ctx.step < 10, 0.1, -0.1)), r"turns: .*from step 10 on"),
], ids=["lambda ctx", "schedule(constant)", "schedule turning, sweeps", "lambda turning"])
def test_ft_optim_rates_of_the_learning_context_are_read_as_schedules(make, given):
    """The function is read as a schedule (ft.optim.schedule's optax one from its numbers, in
    its unit; another at the step count): negative at step 0 refused with ASCENDING_UPDATE,
    one that turns and holds a negative value with ASCENDING_LATER, naming where it turns."""
    with pytest.raises(ValueError, match=rf"(?s)moves v, w \(2 of 2 parameters\) up the loss.*{given}.*maximize=True"):
        check_rate_applied(make(), _Q, None)


@pytest.mark.parametrize("make", [
    lambda: fo.sgd(lambda ctx: 0.1),
    lambda: fo.sgd(fo.schedule(optax.linear_schedule(0.1, 0.0, 4))),
    lambda: fo.sgd(lambda ctx: 0.1 if ctx is not None else -0.1),  # Python on the context: read as it is
    lambda: fo.adam(lambda ctx: 0.05 * (1 - ctx.step / 1000)),  # negative past its end: still falling, not read
    lambda: fo.sgd(lambda ctx: 0.1, maximize=True),  # (deliberate: not opened)
], ids=["positive", "schedule to 0", "python", "falling line", "maximize"])
def test_ft_optim_rates_of_the_learning_context_that_descend_pass(make):
    check_rate_applied(make(), _Q, None)  # no error


def test_a_trainer_run_that_stops_before_its_schedule_turns_trains_and_a_longer_one_is_refused_up_front():
    """optax.sgd(linear_schedule(0.1, -0.1, 8)) is >= 0 up to step 4 and negative from 5: the
    rate check refused it at the first step whatever the run's length, so a Trainer fit of 5
    steps, which never reaches the turn, was refused. ft.train.Trainer.fit reads the run's
    steps: one that stops before the turn trains (down the loss); one that reaches it is refused
    up front with ASCENDING_LATER naming step 5 (a new Trainer sharing the compiled step too,
    and the same one continued past it); a loop of one's own is refused as before."""
    model, loss, batch = _body_and_head()
    make = lambda: ft.optim.Optimizer(optax.sgd(optax.linear_schedule(0.1, -0.1, 8)))  # noqa: E731
    trainer = ft.train.Trainer(model, make(), lambda m, b: loss(m, *b))
    trainer.fit([batch], steps=5, progress=False)  # steps 0-4: the rate reaches 0, no lower
    assert float(loss(trainer.model)) < float(loss(model))
    turned = r"(?s)moves body\.weight, .* up the loss from the step its schedule turns: .* from step 5 on.*steps=N"
    for again in (ft.train.Trainer(model, make(), lambda m, b: loss(m, *b)), trainer):
        with pytest.raises(ValueError, match=turned):
            again.fit([batch], steps=6, progress=False)
    assert trainer.steps_run == 5  # (refused before any step)
    opt = make()
    with pytest.raises(ValueError, match=turned):
        jax.eval_shape(lambda m, s: opt.minimize(loss, m, s), model, opt.init(model))


def test_a_negative_rate_written_into_an_inject_hyperparams_state_is_refused_at_the_next_eager_step():
    """A notebook changes optax.inject_hyperparams' rate by writing the state's dict
    (state.inner.hyperparams["learning_rate"] = -0.1): the check read the number the transform
    was built with (0.1), and the loop climbed (5.0 -> 7.2 -> 10.4) with no error. A host number
    in that dict (optax keeps arrays there: written by hand) is read with no device read, and a
    negative one refused at the next step with ASCENDING_UPDATE, named as written; one that a
    flipped factory makes a descent passes, and set_hyperparameters refuses it as it always did."""
    model, loss = {"w": jnp.array([1.0, 2.0])}, lambda m: jnp.sum(m["w"] ** 2)
    opt = ft.optim.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    state = opt.init(model)
    model, state, _ = opt.minimize(loss, model, state)  # (0.1: down)
    state.inner.hyperparams["learning_rate"] = -0.1
    with pytest.raises(ValueError, match=r"(?s)moves w \(1 of 1 parameters\) up the loss.*Given: optax\.inject_hyperparams"
                                         r"\(optax\.sgd\)\(learning_rate=-0\.1, written into its state's hyperparams\)"
                                         r".*set_hyperparameters\(state, learning_rate=1e-3\)"):
        opt.minimize(loss, model, state)
    with pytest.raises(ValueError, match=r"learning_rate=-0\.1 is out of range"):
        ft.optim.set_hyperparameters(opt.init(model), learning_rate=-0.1)
    flipped = ft.optim.Optimizer(optax.inject_hyperparams(lambda learning_rate: optax.chain(
        optax.scale_by_adam(), optax.scale(learning_rate)))(learning_rate=-0.05))
    state = flipped.init(model)
    state.inner.hyperparams["learning_rate"] = -0.1
    moved, _, _ = flipped.minimize(loss, model, state)  # no error: -0.1 after adam descends
    assert float(loss(moved)) < float(loss(model))


@pytest.mark.parametrize("rate", [lambda ctx: -0.1, fo.schedule(optax.constant_schedule(-0.1))],
                         ids=["lambda ctx", "schedule(constant)"])
def test_a_negative_ft_optim_rate_function_is_refused_by_the_gated_step_and_the_trainer(rate):
    """ft.optim's own transforms take the gated step's per-parameter path (train_step's default
    on_nan="stop", every Trainer), which did not read the rate: sgd(lambda ctx: -0.1) was
    refused by opt.minimize but trained up the loss in train_step and Trainer.fit. Refused
    while the step traces, as the plain update refuses it."""
    model, loss, batch = _body_and_head()
    opt = ft.optim.Optimizer(fo.sgd(rate))
    step = ft.train.train_step(lambda m, b: loss(m, *b), opt)
    with pytest.raises(ValueError, match=r"moves body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4"):
        step(model, opt.init(model), batch)
    with pytest.raises(ValueError, match=r"moves body\.weight, body\.bias, head\.weight, head\.bias \(4 of 4"):
        ft.train.Trainer(model, fo.sgd(rate), lambda m, b: loss(m, *b)).fit(batch, epochs=1, batch_size=4,
                                                                            progress=False)
