"""record_state / collect_state / apply_state: pure layer state through grad and jit."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_named

import functree as ft
from functree.nn import _state
from functree.nn import _state_messages as messages


class Counter(ft.Module):
    count: jax.Array = ft.field(no_derivative=True)

    def __call__(self, x):
        ft.nn.record_state(self, count=self.count + 1)
        return x


def _model(key):
    k1, k2 = jax.random.split(key)
    return ft.nn.Sequential(
        ft.nn.Dense(2, 3, key=k1), ft.nn.BatchNorm(3, momentum=0.5), ft.nn.Dense(3, 1, key=k2)
    )


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which layers already warned (the warning is shown once per process)."""
    monkeypatch.setattr(_state, "_WARNED", set())
    monkeypatch.setattr(_state, "_SEARCHES", {})


def test_outside_collect_state_nothing_is_recorded_and_it_warns(fresh_warnings):
    c = Counter(jnp.zeros(()))
    with pytest.warns(ft.nn.UncollectedStateWarning, match=r"(?s)Counter ran in training mode and recorded new count.*"
                      r"right:  loss, grads, state = ft.nn.value_with_gradient_and_state"):
        assert c(1.0) == 1.0  # no effect
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c(1.0) == 1.0  # once per process


class Net(ft.Module):
    body: ft.nn.Sequential
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.body(x))


def _net(key):
    return ft.nn.training(Net(_model(key), ft.nn.Dense(1, 1, key=key)))


def test_hand_written_loop_without_state_warns_with_the_key_path(key, fresh_warnings):
    """The issue's loop: value_with_gradient + update + move drops BatchNorm statistics."""
    net, x = _net(key), jnp.ones((4, 2))

    def loss_fn(m, x):
        return jnp.mean(m(x) ** 2)

    with pytest.warns(ft.nn.UncollectedStateWarning, match=r"BatchNorm at \.body\.layers\[1\] ran in training mode"):
        jax.jit(ft.value_with_gradient(loss_fn, wrt=0))(net, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(ft.value_with_gradient(loss_fn, wrt=0))(net, x + 1)  # that path already warned
        jax.jit(lambda m, x: ft.nn.value_with_gradient_and_state(loss_fn, m, x))(net, x)  # collected
        jax.jit(lambda m, x: m(x))(ft.nn.inference(net), x)  # inference records nothing


def test_value_with_gradient_and_state_matches_collect_state(key):
    net, x = _net(key), jax.random.normal(jax.random.key(1), (8, 2))

    def loss_fn(m, x, *, scale):
        return scale * jnp.mean(m(x) ** 2)

    def by_hand(m):
        out, state = ft.nn.collect_state(lambda mm: loss_fn(mm, x, scale=2.0), m)
        return out, state

    (loss, state), grads = ft.value_with_gradient(by_hand, at=net, has_aux=True)
    loss2, grads2, state2 = ft.nn.value_with_gradient_and_state(loss_fn, net, x, scale=2.0)
    np.testing.assert_allclose(loss2, loss, rtol=1e-5, atol=1e-6)
    assert sorted(map(str, state2)) == [".body.layers[1].running_mean", ".body.layers[1].running_variance"]
    for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    (_loss3, aux), _g, state3 = ft.nn.value_with_gradient_and_state(
        lambda m, x: (jnp.mean(m(x) ** 2), "aux"), net, x, has_aux=True)
    assert aux == "aux" and set(state3) == set(state)


def test_hand_written_loop_updates_batch_norm_statistics(key):
    """The issue's numbers: data with mean 5 left running_mean at 0 and inference loss 3322."""
    x = jax.random.normal(jax.random.key(1), (64, 4)) + 5.0
    y = jnp.sum(x, -1, keepdims=True)
    model = ft.nn.training(ft.nn.Sequential(ft.nn.BatchNorm(4, momentum=0.9), ft.nn.Dense(4, 1, key=key)))
    optimizer = ft.optim.adam(0.05)
    opt_state = optimizer.init(model)

    def loss_fn(m, x, y):
        return ft.losses.mean_squared_error(m(x), y)

    @jax.jit
    def step(model, opt_state):
        loss, grads, state = ft.nn.value_with_gradient_and_state(loss_fn, model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return ft.nn.apply_state(ft.move(model, along=updates), state), opt_state, loss

    for _ in range(300):
        model, opt_state, loss = step(model, opt_state)
    np.testing.assert_allclose(model.layers[0].running_mean, jnp.mean(x, 0), rtol=1e-3)
    assert float(loss_fn(ft.nn.inference(model), x, y)) < 10 * float(loss) + 1e-3


def test_updates_are_keyed_by_path_and_applied(key):
    model = ft.nn.training(_model(key))
    x = jax.random.normal(jax.random.key(1), (8, 2))
    _y, updates = ft.nn.collect_state(lambda m: m(x), model)
    assert sorted(map(str, updates)) == [".layers[1].running_mean", ".layers[1].running_variance"]
    h = model.layers[0](x)
    new = ft.nn.apply_state(model, updates)
    np.testing.assert_allclose(new.layers[1].running_mean, 0.5 * jnp.mean(h, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new.layers[0].weight, model.layers[0].weight)


def test_training_step_under_grad_and_jit(key):
    """The train engineer's pattern: (loss, updates) as aux of a gradient, then apply_state."""
    model = ft.nn.training(_model(key))
    x = jax.random.normal(jax.random.key(1), (8, 2))
    target = jnp.ones((8, 1))

    def loss(m, x):
        y, updates = ft.nn.collect_state(lambda m: m(x), m)
        return jnp.mean((y - target) ** 2), updates

    @jax.jit
    def step(m, x):
        (value, updates), grads = ft.value_with_gradient(loss, wrt=0, has_aux=True)(m, x)
        m = ft.move(m, along=jax.tree.map(lambda g: -0.1 * g, grads))
        return ft.nn.apply_state(m, updates), value

    m1, v1 = step(model, x)
    m2, v2 = step(m1, x)
    eager_value, eager_updates = loss(model, x)
    np.testing.assert_allclose(v1, eager_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1.layers[1].running_mean, eager_updates[ft.key_path(model, ".layers[1].running_mean")], rtol=1e-5, atol=1e-6)
    assert not jnp.allclose(m1.layers[1].running_mean, m2.layers[1].running_mean)
    assert float(v2) < float(v1)
    grads = jax.grad(lambda m: loss(m, x)[0])(model)
    assert grads.layers[1].running_mean is not None  # jax.grad differentiates every float leaf
    assert ft.gradient(lambda m: loss(m, x)[0], at=model).layers[1].running_mean is None


def test_shared_layer_updates_every_path():
    c = Counter(jnp.zeros(()))
    model = ft.nn.Sequential(c, c)
    _, updates = ft.nn.collect_state(lambda m: m(1.0), model)
    assert sorted(map(str, updates)) == [".layers[0].count", ".layers[1].count"]


def test_recording_a_non_state_field_is_an_error():
    class Bad(ft.Module):
        weight: jax.Array

        def __call__(self, x):
            ft.nn.record_state(self, weight=self.weight)
            return x

    with pytest.raises(TypeError, match=r"(?s)Bad.weight is not a no_derivative field.*ft.field\(no_derivative=True\)"):
        ft.nn.collect_state(lambda m: m(1.0), Bad(jnp.ones(2)))


def test_layer_outside_the_model_is_an_error():
    other = Counter(jnp.zeros(()))
    with pytest.raises(ValueError, match=r"(?s)Counter recorded state.*not part of the model"):
        ft.nn.collect_state(lambda m: other(1.0), Counter(jnp.zeros(())))


def test_jit_inside_collect_state_is_an_error_with_the_fix():
    with pytest.raises(ValueError, match=r"(?s)fn is jit-compiled.*right:  jax.jit\(lambda model: ft.nn.collect_state"):
        ft.nn.collect_state(jax.jit(lambda m: m(1.0)), Counter(jnp.zeros(())))


def test_input_errors_get_the_key_path_from_collect_state(key):
    class Net(ft.Module):
        encoder: ft.nn.Dense
        head: ft.nn.Dense

        def __call__(self, x):
            return self.head(self.encoder(x))

    net = Net(ft.nn.Dense(2, 3, key=key), ft.nn.Dense(4, 1, key=key))
    with pytest.raises(ft.nn.LayerInputError, match=r"Dense at \.head expects inputs \[\.\.\., 4\] \(float\), got f32\[5,3\]"):
        ft.nn.collect_state(lambda m: m(jnp.ones((5, 2))), net)


def test_apply_state_checks_shapes():
    with pytest.raises(ValueError, match=r"expected shape \(\)"):
        ft.nn.apply_state(Counter(jnp.zeros(())), {ft.key_path(None, ".count"): jnp.ones(3)})


def test_the_warning_points_at_the_users_line_not_at_functree(fresh_warnings):
    model = ft.nn.training(ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2)))
    with pytest.warns(ft.nn.UncollectedStateWarning) as caught:
        line = __import__("inspect").currentframe().f_lineno + 1
        model(jnp.ones((4, 2)))
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


# --- state recorded inside a transformation of the loss (jax.vmap, lax.scan, lax.cond) -----

_X4 = jnp.arange(8.0).reshape(4, 2)


def _per_example_loss(m):
    """The per-example style (a vmapped loss): BatchNorm sees one example per call."""
    return jnp.sum(jax.vmap(lambda xi: m(xi[None])[0])(_X4) ** 2)


_IN_VMAP = r"(?s)layer state at \.running_mean was recorded inside jax\.vmap.*right:  loss = lambda m: jnp\.sum\(m\(x\) \*\* 2\)"


def test_state_recorded_in_a_per_example_vmap_is_an_error_not_a_leaked_tracer():
    # Before: state values were BatchTracers; minimize returned running_mean =
    # VmapTracer(...) and the next forward raised JAX's UnexpectedTracerError.
    bn = ft.nn.training(ft.nn.BatchNorm(2, momentum=0.5))
    with pytest.raises(ValueError, match=_IN_VMAP):
        ft.nn.value_with_gradient_and_state(_per_example_loss, bn)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match=_IN_VMAP):
        opt.minimize(_per_example_loss, bn, opt.init(bn))
    with pytest.raises(ValueError, match=_IN_VMAP):
        jax.jit(lambda m: ft.nn.collect_state(_per_example_loss, m))(bn)
    step = ft.train.train_step(lambda m, x: _per_example_loss(m), opt, donate=False)
    with pytest.raises(ValueError, match=_IN_VMAP):
        step(bn, opt.init(bn), _X4)


def test_state_recorded_deeper_in_the_model_names_its_key_path():
    net = ft.nn.training(ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2)))
    with pytest.raises(ValueError, match=r"state at \.layers\[1\]\.running_mean was recorded inside jax\.vmap"):
        ft.nn.value_with_gradient_and_state(_per_example_loss, net)


@pytest.mark.parametrize("transform, call", [
    ("jax.lax.scan", lambda m: jax.lax.scan(lambda c, _: (c, m(_X4)), 0.0, None, length=1)[1][0]),
    ("jax.lax.cond", lambda m: jax.lax.cond(True, lambda: m(_X4), lambda: _X4)),
    ("jax.lax.while_loop", lambda m: jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, m(_X4)), (0, _X4))[1]),
    ("jax.lax.fori_loop", lambda m: jax.lax.fori_loop(0, 2, lambda i, y: m(y), _X4)),
])
def test_state_recorded_in_control_flow_of_the_loss_is_an_error_naming_it(transform, call):
    bn = ft.nn.training(ft.nn.BatchNorm(2, momentum=0.5))
    match = rf"(?s)state at \.running_mean was recorded inside {transform}.*ft\.nn\.Stack.*ft\.nn\.collect_state\(lambda mm: mm\(xb\), m\)  # inside the scan"
    with pytest.raises(ValueError, match=match):
        ft.nn.value_with_gradient_and_state(lambda m: jnp.sum(call(m) ** 2), bn)


def test_the_fixes_the_errors_show_work():
    bn = ft.nn.training(ft.nn.BatchNorm(2, momentum=0.5))
    # vmap: the whole batch at once records the batch statistics (momentum 0.5: half the mean).
    _, _, state = ft.nn.value_with_gradient_and_state(lambda m: jnp.sum(m(_X4) ** 2), bn)
    np.testing.assert_allclose(ft.nn.apply_state(bn, state).running_mean, [1.5, 2.0], rtol=0, atol=1e-6)
    # vmap over ft.nn.inference(m): running statistics, nothing recorded, gradients flow.
    loss, grads, state = ft.nn.value_with_gradient_and_state(
        lambda m: jnp.sum(jax.vmap(lambda xi: ft.nn.inference(m)(xi[None])[0])(_X4) ** 2), bn)
    assert state == {} and np.isfinite(float(loss)) and float(jnp.abs(grads.scale).sum()) > 0
    # scan: collected inside the scan, the last step's record returned as aux.
    xs = jnp.arange(12.0).reshape(3, 2, 2)

    def loss_fn(m):
        def body(c, xb):
            y, state = ft.nn.collect_state(lambda mm: mm(xb), m)  # inside the scan
            return c, (y, state)
        _, (ys, states) = jax.lax.scan(body, None, xs)
        return jnp.sum(ys ** 2), {p: v[-1] for p, v in states.items()}  # the last step's

    (_, state), _ = ft.value_with_gradient(loss_fn, at=bn, has_aux=True)
    # last step: 0.5 * 0 + 0.5 * mean of [[8, 9], [10, 11]]
    np.testing.assert_allclose(ft.nn.apply_state(bn, state).running_mean, [4.5, 5.0], rtol=0, atol=1e-6)


def test_transformations_that_keep_the_state_at_the_collecting_trace_are_not_refused(key):
    bn = ft.nn.training(ft.nn.BatchNorm(2, momentum=0.5))
    ref = ft.nn.collect_state(lambda m: m(_X4), bn)[1]
    # A gradient inside fn (here with respect to the input, the model closed over): the
    # recorded (stop_gradient) value is the primal, at fn's trace.
    _, inside_grad = ft.nn.collect_state(lambda m: jax.grad(lambda x: jnp.sum(m(x) ** 2))(_X4), bn)
    # A vmap around collect_state (an ensemble): state per member, as collected alone.
    members = jax.vmap(lambda r: bn.replace(running_mean=r))(jnp.array([[0.0, 0.0], [2.0, 2.0]]))
    _, per_member = jax.vmap(lambda m: ft.nn.collect_state(lambda mm: mm(_X4), m))(members)
    # A jit around it, and ft.nn.Remat / ft.nn.Stack (they collect inside their transform).
    _, jitted = jax.jit(lambda m: ft.nn.collect_state(lambda mm: mm(_X4), m))(bn)
    _, remat = ft.nn.collect_state(lambda m: m(_X4), ft.nn.training(ft.nn.Remat(bn)))
    for got in (inside_grad, jitted):
        for p in ref:
            np.testing.assert_allclose(got[p], ref[p], rtol=0, atol=1e-6)
    np.testing.assert_allclose(remat[ft.key_path(None, ".layer.running_mean")], ref[ft.key_path(None, ".running_mean")],
                               rtol=0, atol=1e-6)
    mean = per_member[ft.key_path(None, ".running_mean")]
    np.testing.assert_allclose(mean, [[1.5, 2.0], [2.5, 3.0]], rtol=0, atol=1e-6)  # 0.5 r + 0.5 [3, 4]


def test_state_filed_by_a_stack_inside_the_users_vmap_and_a_closed_over_checkpoint_is_refused():
    # ft.nn.Stack files its members' state itself (record_under): checked all the same.
    x = jnp.ones((4, 3))
    stack = ft.nn.training(ft.nn.Stack(lambda k: ft.nn.BatchNorm(3), 2, key=jax.random.key(0)))
    with pytest.raises(ValueError, match=r"state at \.layers\.running_mean was recorded inside jax\.vmap"):
        ft.nn.value_with_gradient_and_state(lambda m: jnp.sum(jax.vmap(lambda xi: m(xi[None])[0])(x) ** 2), stack)
    bn = ft.nn.training(ft.nn.BatchNorm(3))
    with pytest.raises(ValueError, match=r"(?s)state at \.running_mean was recorded inside jax\.checkpoint.*ft\.nn\.Remat"):
        ft.nn.value_with_gradient_and_state(lambda m: jnp.sum(jax.checkpoint(lambda y: m(y))(x) ** 2), bn)


class _Holder(ft.Module):
    layers: dict

    def __call__(self, x):
        return self.layers["d"](self.layers["bn"](x))


_ROOTS = {  # (model from the two layers, the BatchNorm's key path in it, the model's call)
    "dict": (lambda bn, d: {"bn": bn, "d": d}, "['bn']", lambda m, x: m["d"](m["bn"](x))),
    "list": (lambda bn, d: [bn, d], "[0]", lambda m, x: m[1](m[0](x))),
    "tuple": (lambda bn, d: (bn, d), "[0]", lambda m, x: m[1](m[0](x))),
    "dict in a Module": (lambda bn, d: _Holder({"bn": bn, "d": d}), ".layers['bn']", lambda m, x: m(x)),
}


def _bn_and_dense():
    bn = ft.nn.training(ft.nn.BatchNorm(4, momentum=0.9))
    return bn, ft.nn.training(ft.nn.Dense(4, 2, key=jax.random.key(0)))


def _bn_input():
    return jnp.asarray(np.random.default_rng(3).standard_normal((8, 4)) * 2.0 + 1.0, jnp.float32)


@pytest.mark.parametrize("root", list(_ROOTS))
def test_cast_of_a_dict_list_or_tuple_model_records_at_the_models_key_paths(root):
    # The audit: ft.cast of a model whose root is a dict or list (or of a Module's dict
    # field) under collect_state raised "BatchNorm recorded state ... not part of the model":
    # only a Module root was registered, so the cast copy's layers had no key path.
    build, at, call = _ROOTS[root]
    bn, d = _bn_and_dense()
    model, x = build(bn, d), _bn_input()
    out, updates = ft.nn.collect_state(lambda m: call(ft.cast(m, jnp.bfloat16), x.astype(jnp.bfloat16)), model)
    # the reference: the float32 layers cast by hand, each called on its own
    y, by_hand = ft.nn.collect_state(lambda b: ft.cast(b, jnp.bfloat16)(x.astype(jnp.bfloat16)), bn)
    expected_out = ft.cast(d, jnp.bfloat16)(y)
    assert sorted(map(str, updates)) == [f"{at}.running_mean", f"{at}.running_variance"]
    for name in ("running_mean", "running_variance"):
        np.testing.assert_array_equal(np.asarray(updates[ft.key_path(model, f"{at}.{name}")]),
                                      np.asarray(by_hand[ft.key_path(bn, f".{name}")]))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected_out, np.float32))
    xs = np.asarray(x.astype(jnp.bfloat16), np.float64)  # and the statistics by the formula
    np.testing.assert_allclose(np.asarray(updates[ft.key_path(model, f"{at}.running_mean")]),
                               0.1 * xs.mean(0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(updates[ft.key_path(model, f"{at}.running_variance")]),
                               0.9 + 0.1 * xs.var(0), rtol=0, atol=1e-5 * float(xs.var(0).max()))


def test_cast_of_a_modules_list_field_records_at_the_field_s_key_paths():
    class Net(ft.Module):
        layers: list

    bn, d = _bn_and_dense()
    model, x = Net([bn, d]), _bn_input()
    _, updates = ft.nn.collect_state(lambda m: ft.cast(m.layers, jnp.bfloat16)[0](x), model)
    _, by_hand = ft.nn.collect_state(lambda b: ft.cast(b, jnp.bfloat16)(x), bn)
    assert sorted(map(str, updates)) == [".layers[0].running_mean", ".layers[0].running_variance"]
    np.testing.assert_array_equal(np.asarray(updates[ft.key_path(model, ".layers[0].running_mean")]),
                                  np.asarray(by_hand[ft.key_path(bn, ".running_mean")]))


@pytest.mark.parametrize("root", list(_ROOTS))
def test_train_step_with_a_compute_dtype_trains_a_dict_or_list_model_with_batch_norm(root):
    # The audit: train_step / Trainer with compute_dtype=bfloat16 raised on every step for a
    # dict or list model holding a BatchNorm. Now it equals the step of a Module holding
    # the same layers (whose root was registered before).
    build, at, call = _ROOTS[root]
    x, y = _bn_input(), jnp.ones((8, 2))
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))

    def loss_fn(m, b):
        return ft.losses.mean_squared_error(call(m, b[0]), b[1])

    model = build(*_bn_and_dense())
    new, _, metrics = ft.train.train_step(loss_fn, opt, compute_dtype=jnp.bfloat16, donate=False)(
        model, opt.init(model), (x, y))
    reference = _Holder(dict(zip(("bn", "d"), _bn_and_dense(), strict=True)))
    ref_new, _, ref_metrics = ft.train.train_step(
        lambda m, b: ft.losses.mean_squared_error(m(b[0]), b[1]), opt, compute_dtype=jnp.bfloat16,
        donate=False)(reference, opt.init(reference), (x, y))
    np.testing.assert_array_equal(np.asarray(metrics["loss"]), np.asarray(ref_metrics["loss"]))
    for name in ("running_mean", "running_variance", "scale"):
        np.testing.assert_array_equal(np.asarray(ft.get(new, f"{at}.{name}")),
                                      np.asarray(ft.get(ref_new, f".layers['bn'].{name}")))
    assert float(np.abs(np.asarray(ft.get(new, f"{at}.running_mean"))).max()) > 0.01  # it moved


# --- a layer called twice in one forward updates its state in turn, as torch does

class _Twice(ft.Module):
    bn: ft.nn.BatchNorm

    def __call__(self, x):
        return self.bn(self.bn(x) * 2 + 1)


def _torch_twice(x, momentum, eps):
    """torch's running_mean after ``bn(bn(x) * 2 + 1)`` and the biased running variance
    (functree's, documented) from torch's own batch statistics."""
    import torch

    bn = torch.nn.BatchNorm1d(x.shape[-1], momentum=1 - momentum, eps=eps).train()
    seen = []
    bn.register_forward_pre_hook(lambda _, inp: seen.append(inp[0].numpy().copy()))
    with torch.no_grad():
        bn(bn(torch.tensor(x)) * 2 + 1)
    var = np.ones(x.shape[-1], np.float32)
    for a in seen:
        var = momentum * var + (1 - momentum) * a.var(0)
    return bn.running_mean.numpy(), var


@pytest.mark.parametrize("jit", [False, True])
def test_a_layer_called_twice_updates_its_state_twice_as_torch(jit):
    x = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32) * 3 + 2
    model = ft.nn.training(_Twice(ft.nn.BatchNorm(4, momentum=0.9, epsilon=1e-3)))
    run = lambda m: ft.nn.collect_state(lambda mm: mm(jnp.asarray(x)), m)  # noqa: E731
    _, state = (jax.jit(run) if jit else run)(model)
    mean, var = _torch_twice(x, 0.9, 1e-3)
    np.testing.assert_allclose(state[ft.key_path(model, ".bn.running_mean")], mean, rtol=0, atol=1e-5)
    np.testing.assert_allclose(state[ft.key_path(model, ".bn.running_variance")], var, rtol=0, atol=1e-5)
    assert float(model.bn.running_mean[0]) == 0.0  # the model itself is unchanged afterwards


class _Discriminator(ft.Module):
    net: ft.nn.Sequential

    def __call__(self, real, fake):
        return jnp.mean(self.net(real)) - jnp.mean(self.net(fake))


def test_two_calls_in_one_loss_under_value_with_gradient_and_state_match_torch():
    import torch

    rng = np.random.default_rng(0)
    real = rng.normal(size=(8, 3)).astype(np.float32) * 2 + 1
    fake = rng.normal(size=(8, 3)).astype(np.float32) * 0.1 - 3
    d = ft.nn.training(_Discriminator(ft.nn.Sequential(
        ft.nn.Dense(3, 4, key=jax.random.key(0)), ft.nn.BatchNorm(4, momentum=0.9, epsilon=1e-5))))
    _, _, state = jax.jit(lambda m: ft.nn.value_with_gradient_and_state(
        lambda mm, a, b: mm(a, b), m, jnp.asarray(real), jnp.asarray(fake)))(d)
    t = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, eps=1e-5, momentum=0.1)).train()
    with torch.no_grad():
        t[0].weight.copy_(torch.tensor(np.asarray(d.net.layers[0].weight).T))
        t[0].bias.copy_(torch.tensor(np.asarray(d.net.layers[0].bias)))
        t(torch.tensor(real)), t(torch.tensor(fake))
    got = state[ft.key_path(d, ".net.layers[1].running_mean")]
    np.testing.assert_allclose(got, t[1].running_mean.numpy(), rtol=0, atol=1e-5)  # 0.1 * mean(fake) before: off by 0.1


class _Block(ft.Module):
    bn: ft.nn.BatchNorm

    def __call__(self, x):
        return jnp.tanh(self.bn(x))


@pytest.mark.parametrize("wrap", ["stack", "remat"])
def test_a_stack_or_remat_called_twice_updates_in_turn(wrap):
    """Stack and Remat collect their layers' state inside their scan / checkpoint: a second
    call reads the first call's record, as the same layers called twice in a loop would."""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32) + 1)
    blocks = [ft.nn.training(_Block(ft.nn.BatchNorm(4, momentum=0.8))) for _ in range(2)]
    if wrap == "stack":
        layer = ft.nn.Stack.from_layers(blocks)
    else:
        layer = ft.nn.Remat(ft.nn.Sequential(*blocks))
    twice = lambda m: m(m(x) * 3)  # noqa: E731
    _, state = jax.jit(lambda m: ft.nn.collect_state(twice, m))(ft.nn.training(layer))
    # the reference: the plain blocks, called in a Python loop, states threaded by hand
    y = x
    bns = [b.bn for b in blocks]
    for call in range(2):
        for i, bn in enumerate(bns):
            y_next, s = ft.nn.collect_state(lambda m, y=y: m(y), bn)
            bns[i] = ft.nn.apply_state(bn, s)
            y = jnp.tanh(y_next)
        y = y * 3 if call == 0 else y
    means = np.stack([np.asarray(bn.running_mean) for bn in bns])
    got = [v for p, v in state.items() if str(p).endswith("running_mean")]
    got = np.asarray(got[0]) if wrap == "stack" else np.stack([np.asarray(v) for v in got])
    np.testing.assert_allclose(got, means, rtol=0, atol=1e-5)


# --- recorded intermediates (record_intermediate / collect_intermediates) ---------------


class Tanh(ft.Module):
    """``tanh(w x)``, recording its pre-activation ``w x``."""

    w: jax.Array

    def __call__(self, x):
        h = self.w * x
        ft.nn.record_intermediate(self, pre_activation=h)
        return jnp.tanh(h)


def test_intermediates_are_collected_at_their_key_paths_with_gradients():
    """Each record is filed at the layer's path plus its name, and differentiates as the
    value it is: d/dw Σ (w x)² = 2 w Σ x² (ft.gradient of a loss of the record)."""
    model = {"a": Tanh(jnp.array(0.5)), "b": [Tanh(jnp.array(2.0))]}
    x = jnp.array([1.0, -3.0])

    def fn(m):
        return m["b"][0](m["a"](x))

    y, sown = ft.nn.collect_intermediates(fn, model)
    assert sorted(map(str, sown)) == ["['a'].pre_activation", "['b'][0].pre_activation"]
    np.testing.assert_allclose(sown[ft.KeyPath.parse("['a'].pre_activation")], 0.5 * x, rtol=0, atol=1e-7)
    np.testing.assert_allclose(y, jnp.tanh(2.0 * jnp.tanh(0.5 * x)), rtol=0, atol=1e-7)

    def loss(m):
        _, s = ft.nn.collect_intermediates(fn, m)
        return jnp.sum(s[ft.KeyPath.parse("['a'].pre_activation")] ** 2)

    grads = ft.gradient(loss, at=model, wrt="a")  # (b's record is after a's: no derivative reaches it)
    np.testing.assert_allclose(grads["a"].w, 2 * 0.5 * jnp.sum(x ** 2), rtol=0, atol=1e-6)


def test_outside_collect_intermediates_nothing_is_recorded():
    """A plain call, and a call under collect_state alone: no record, no warning, and the
    state collector returns state only."""
    t = Tanh(jnp.array(0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(t(jnp.array(1.0))) == pytest.approx(np.tanh(0.5))
        _, state = ft.nn.collect_state(lambda m: m(jnp.array(1.0)), t)
    assert state == {}


def test_a_stacks_members_records_are_stacked_and_remat_passes_them_on():
    """``ft.nn.Stack``: ``[n, ...]`` at ``.layers.<name>`` (member i's record in row i);
    ``ft.nn.Remat`` around a layer: its record under ``.layer``; jit around it all."""
    stack = ft.nn.Stack(lambda k: Tanh(jax.random.uniform(k, (), minval=0.5, maxval=1.5)), 3,
                        key=jax.random.key(0))
    x = jnp.array([0.3, -0.7])
    y, sown = jax.jit(lambda m: ft.nn.collect_intermediates(lambda mm: mm(x), m))(stack)
    h, expected = x, []
    for member in stack:
        expected.append(member.w * h)
        h = member(h)
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".layers.pre_activation")], jnp.stack(expected), rtol=0,
                               atol=1e-6)
    np.testing.assert_allclose(y, h, rtol=0, atol=1e-6)

    remat = ft.nn.Remat(Tanh(jnp.array(0.5)))
    _, sown = ft.nn.collect_intermediates(lambda m: m(x), remat)
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".layer.pre_activation")], 0.5 * x, rtol=0, atol=1e-7)


def test_each_collector_hands_the_other_kind_to_the_one_around_it(fresh_warnings):
    """A BatchNorm's statistics recorded inside collect_intermediates reach the
    collect_state around it (as without it); an intermediate recorded inside an inner
    collect_state reaches the collect_intermediates around it. Without a state collector
    around, the statistics warn as uncollected state does."""
    model = ft.nn.training(ft.nn.Sequential(Tanh(jnp.array(0.5)), ft.nn.BatchNorm(2, momentum=0.5)))
    x = jnp.array([[1.0, 2.0], [3.0, 5.0]])

    def inner(m):
        return ft.nn.collect_intermediates(lambda mm: mm(x), m)

    (y, sown), state = ft.nn.collect_state(inner, model)
    plain, plain_state = ft.nn.collect_state(lambda m: m(x), model)
    assert sorted(map(str, state)) == [".layers[1].running_mean", ".layers[1].running_variance"]
    for path in state:
        np.testing.assert_array_equal(state[path], plain_state[path])
    assert list(map(str, sown)) == [".layers[0].pre_activation"]
    np.testing.assert_array_equal(y, plain)

    (_, state2), sown2 = ft.nn.collect_intermediates(lambda m: ft.nn.collect_state(lambda mm: mm(x), m), model)
    assert list(map(str, sown2)) == [".layers[0].pre_activation"]
    assert sorted(map(str, state2)) == [".layers[1].running_mean", ".layers[1].running_variance"]

    with pytest.warns(ft.nn.UncollectedStateWarning, match="running_mean"):
        ft.nn.collect_intermediates(lambda m: m(x), model)


class Recorder(ft.Module):
    w: jax.Array
    what: str = ft.field(static=True, default="field")

    def __call__(self, x):
        if self.what == "field":
            ft.nn.record_intermediate(self, w=x)
        elif self.what == "tuple":
            ft.nn.record_intermediate(self, pair=(x, x))
        return self.w * x


def test_bad_records_are_refused_by_name():
    """A record named as a field (its path would read the field), a record that is not one
    array, and a layer called twice in one pass (one path, two calls' values)."""
    x = jnp.ones(2)
    with pytest.raises(TypeError, match=r"'w' is a field of Recorder") as error:
        ft.nn.collect_intermediates(lambda m: m(x), Recorder(jnp.array(1.0)))
    assert "ft.nn.record_intermediate(self, w_out=value)" in str(error.value)
    with pytest.raises(TypeError, match=r"Recorder, pair=\.\.\.\) got a tuple") as error:
        ft.nn.collect_intermediates(lambda m: m(x), Recorder(jnp.array(1.0), "tuple"))
    assert "pair_a=a, pair_b=b" in str(error.value)
    with pytest.raises(ValueError, match=r"\.pre_activation was recorded twice") as error:
        ft.nn.collect_intermediates(lambda m: m(m(x)), Tanh(jnp.array(0.5)))
    assert "y, second = ft.nn.collect_intermediates(lambda m: m(h), model)" in str(error.value)
    with pytest.raises(ValueError, match=r"\.layers\.pre_activation was recorded twice"):
        stack = ft.nn.Stack(lambda k: Tanh(jnp.array(0.5)), 2, key=jax.random.key(0))
        ft.nn.collect_intermediates(lambda m: m(m(x)), stack)


def test_a_differentiated_function_recording_into_an_outer_collector():
    """ft.gradient's differentiation check traces the function once before running it: a
    record made there of values the derivative does not reach lands in both traces, and
    the second replaces the first (no 'recorded twice'). A record of the differentiated
    value would leak its tracer: refused by name (and how to collect inside), as is a model
    rebuilt inside (differentiated itself)."""
    t = Tanh(jnp.array(0.5))
    x = jnp.array([1.0, 2.0])

    grads, sown = ft.nn.collect_intermediates(lambda m: ft.gradient(lambda s: s * jnp.sum(m(x)), at=2.0), t)
    assert list(map(str, sown)) == [".pre_activation"]
    np.testing.assert_allclose(grads, jnp.sum(jnp.tanh(0.5 * x)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".pre_activation")], 0.5 * x, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"(?s)The intermediate \.pre_activation was recorded inside jax.grad.*"
                                         r"grads, sown = ft.gradient\(loss, at=x, has_aux=True\)"):
        ft.nn.collect_intermediates(lambda m: ft.gradient(lambda xx: jnp.sum(m(xx)), at=x), t)

    def loss(xx):
        y, s = ft.nn.collect_intermediates(lambda m: m(xx), t)
        return y.sum(), s

    grads, sown = ft.gradient(loss, at=x, has_aux=True)  # the message's right code runs
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".pre_activation")], 0.5 * x, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"(?s)A Tanh recorded an intermediate inside ft.nn.collect_intermediates.*"
                                         r"right:  jax.jit\(lambda model: ft.nn.collect_intermediates"):
        ft.nn.collect_intermediates(lambda m: ft.gradient(lambda mm: jnp.sum(mm(x)), at=m), t)


@pytest.mark.parametrize("inside", ["jax.grad", "jax.vmap", "ft.gradient"])
def test_a_layer_called_again_inside_a_transformation_is_recorded_twice(inside):
    """The layer called before and again inside a transformation of a value its record
    does not depend on (a scale): the second record is no tracer of the transformation,
    and replaced the first call's silently (one call's values dropped). Refused as
    recorded twice; only the differentiation check's trace of ft.gradient, which runs
    the function once more, is replaced by the run that follows it."""
    t = Tanh(jnp.array(0.5))
    x, x2 = jnp.array([1.0, 2.0]), jnp.array([10.0, 20.0])
    again = {
        "jax.grad": lambda m: jax.grad(lambda s: s * jnp.sum(m(x2)))(1.0),
        "jax.vmap": lambda m: jax.vmap(lambda s: s * jnp.sum(m(x2)))(jnp.ones(3)),
        "ft.gradient": lambda m: ft.gradient(lambda s: s * jnp.sum(m(x2)), at=1.0),
    }[inside]
    with pytest.raises(ValueError, match=r"\.pre_activation was recorded twice"):
        ft.nn.collect_intermediates(lambda m: (m(x), again(m)), t)
    _, sown = ft.nn.collect_intermediates(again, t)  # called once, inside: its record
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".pre_activation")], 0.5 * x2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("second", ["plain", "jax.vmap"])
def test_a_layer_called_twice_in_a_jitted_gradients_loss_is_refused(second):
    """collect_intermediates inside the loss of a jitted ft.gradient runs inside the
    differentiation check's trace, whose jaxpr is then replayed (the loss's Python runs
    once): a second record there is a second call, refused as in an eager loss."""
    t = Tanh(jnp.array(0.5))
    x = jnp.array([1.0, 2.0])
    twice = {"plain": lambda m: m(m(x)), "jax.vmap": lambda m: (m(x), jax.vmap(lambda s: s * m(x))(jnp.ones(2)))[1]}

    def loss(m):
        y, sown = ft.nn.collect_intermediates(twice[second], m)
        return jnp.sum(y), sown

    with pytest.raises(ValueError, match=r"\.pre_activation was recorded twice"):
        jax.jit(lambda m: ft.gradient(loss, at=m, has_aux=True))(t)


@pytest.mark.parametrize("transform", ["jax.vmap", "jax.lax.scan", "jax.checkpoint", "jax.jit"])
def test_a_record_leaking_out_of_a_transformation_names_its_way_out(transform):
    """INTERMEDIATE_INSIDE_TRANSFORM shows the way out for the transformation it names (the
    gradient's example fitted none of these), and that right code runs and collects
    ``w x`` for every input."""
    t = Tanh(jnp.array(0.5))
    xs = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.0]])
    x = xs[0]
    wrong = {
        "jax.vmap": lambda m: jax.vmap(m)(xs),
        "jax.lax.scan": lambda m: jax.lax.scan(lambda c, xi: (c, m(xi)), None, xs)[1],
        "jax.checkpoint": lambda m: jax.checkpoint(lambda xi: m(xi))(x),
        "jax.jit": lambda m: jax.jit(lambda xi: m(xi))(x),
    }[transform]
    fix = {"jax.vmap": messages.FIX_INTERMEDIATE_IN_VMAP, "jax.lax.scan": messages.FIX_INTERMEDIATE_IN_LOOP,
           "jax.checkpoint": messages.FIX_INTERMEDIATE_IN_CHECKPOINT, "jax.jit": messages.FIX_INTERMEDIATE_IN_JIT}[transform]
    with pytest.raises(ValueError, match=rf"\.pre_activation was recorded inside {re.escape(transform)}") as error:
        ft.nn.collect_intermediates(wrong, t)
    assert fix in str(error.value)

    model = t  # the right code, as the message writes it
    if transform == "jax.vmap":
        _, sown = jax.vmap(lambda x: ft.nn.collect_intermediates(lambda m: m(x), model))(xs)
        expected = 0.5 * xs
    elif transform == "jax.lax.scan":
        def body(c, x):
            y, sown = ft.nn.collect_intermediates(lambda m: m(x), model)
            return c, (y, sown)

        _, (_, sown) = jax.lax.scan(body, None, xs)
        expected = 0.5 * xs
    elif transform == "jax.checkpoint":
        _, sown = ft.nn.collect_intermediates(
            lambda m: ft.with_recomputation_in_pullbacks(lambda mm, x: mm(x))(m, x), model)
        expected = 0.5 * x
    else:
        _, sown = jax.jit(lambda model: ft.nn.collect_intermediates(lambda m: m(x), model))(model)
        expected = 0.5 * x
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".pre_activation")], expected, rtol=0, atol=1e-7)


def test_a_model_rebuilt_inside_by_a_gradient_is_named_with_its_way_out():
    """INTERMEDIATE_NOT_IN_MODEL names ft.gradient(..., at=m) among the transformations that
    rebuild the model (it named jit alone) and its right code runs: the gradient of a loss
    of the record, d/dw Σ (w x)² = 2 w Σ x²."""
    model = Tanh(jnp.array(0.5))
    x = jnp.array([1.0, 2.0])
    with pytest.raises(ValueError, match=r"(?s)A Tanh recorded an intermediate.*ft\.gradient\(\.\.\., at=m\)") as error:
        ft.nn.collect_intermediates(lambda m: ft.gradient(lambda mm: mm(x).sum(), at=m), model)
    assert "grads, sown = ft.gradient(loss, at=model, has_aux=True)" in str(error.value)

    def loss(m):
        y, sown = ft.nn.collect_intermediates(lambda mm: mm(x), m)
        return y.sum(), sown

    grads, sown = ft.gradient(loss, at=model, has_aux=True)
    np.testing.assert_allclose(grads.w, jnp.sum(x * (1 - jnp.tanh(0.5 * x) ** 2)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".pre_activation")], 0.5 * x, rtol=0, atol=1e-7)


def test_a_numpy_array_or_a_number_is_recorded_as_an_array():
    """A record of a NumPy array or a Python number is that array (INTERMEDIATE_NOT_ARRAY
    refused "a ndarray" saying a record must be one array); a tuple or a string is still
    refused by name."""

    class Host(ft.Module):
        w: jax.Array

        def __call__(self, x):
            ft.nn.record_intermediate(self, counts=np.array([1, 2]), scale=0.5)
            return self.w * x

    _, sown = ft.nn.collect_intermediates(lambda m: m(jnp.ones(2)), Host(jnp.array(2.0)))
    assert all(isinstance(v, jax.Array) for v in sown.values())
    np.testing.assert_array_equal(sown[ft.KeyPath.parse(".counts")], [1, 2])
    assert float(sown[ft.KeyPath.parse(".scale")]) == 0.5
    with pytest.raises(TypeError, match=r"Recorder, pair=\.\.\.\) got a tuple"):
        ft.nn.collect_intermediates(lambda m: m(jnp.ones(2)), Recorder(jnp.array(1.0), "tuple"))


def test_a_wrapper_built_inside_fn_passing_records_on_is_named_as_such():
    """A Remat (or Stack, or a list given to with_recomputation_in_pullbacks) built inside
    fn passes its layer's records on to a node the collector does not know: refused as
    intermediates under collect_intermediates (the message spoke of layer state and
    collect_state), with the wrapper built outside, whose right code runs."""
    model = Tanh(jnp.array(0.5))
    x = jnp.array([1.0, 2.0])
    with pytest.raises(ValueError, match=r"(?s)A Remat passed on the intermediates \.layer\.pre_activation inside "
                                         r"ft\.nn\.collect_intermediates.*right:  y, sown = ft\.nn\.collect_intermediates"
                                         r"\(lambda m: m\(x\), ft\.nn\.Remat\(model\)\)") as error:
        ft.nn.collect_intermediates(lambda m: ft.nn.Remat(m)(x), model)
    assert "collect_state" not in str(error.value)
    y, sown = ft.nn.collect_intermediates(lambda m: m(x), ft.nn.Remat(model))
    np.testing.assert_allclose(sown[ft.KeyPath.parse(".layer.pre_activation")], 0.5 * x, rtol=0, atol=1e-7)
    np.testing.assert_allclose(y, jnp.tanh(0.5 * x), rtol=0, atol=1e-7)


def _rebuilt_bn_net(key):
    k1, k2 = jax.random.split(key)
    return ft.nn.Sequential([ft.nn.Dense(3, 4, key=k1), ft.nn.BatchNorm(4, training=True), ft.nn.Dense(4, 1, key=k2)])


def _rebuilt_loss(m, b):
    return jnp.mean((m(b[0]) - b[1]) ** 2)


_rebuilt_BATCH = (jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32), jnp.zeros((6, 1)))
_rebuilt_KEYS = jax.random.split(jax.random.key(0), 3)


@pytest.mark.parametrize(("name", "model", "loss", "fix", "right"), [
    ("checkpoint", _rebuilt_bn_net(_rebuilt_KEYS[0]), lambda m, b: jnp.mean((jax.checkpoint(lambda m, x: m(x))(m, b[0]) - b[1]) ** 2),
     messages.FIX_REBUILT_CHECKPOINT, "ft.with_recomputation_in_pullbacks(lambda m, x: m(x))(model, x)"),
    ("ensemble", jax.vmap(_rebuilt_bn_net)(_rebuilt_KEYS), lambda e, b: jnp.sum(jax.vmap(lambda m: _rebuilt_loss(m, b))(e)),
     messages.FIX_REBUILT_ENSEMBLE, "jax.vmap(lambda m: ft.nn.collect_state("),
    ("per-example", _rebuilt_bn_net(_rebuilt_KEYS[0]),
     lambda m, b: jnp.sum(jax.vmap(lambda m, x: m(x[None])[0], in_axes=(None, 0))(m, b[0])),
     messages.FIX_STATE_IN_VMAP, "ft.nn.inference(m)"),
    ("cond", _rebuilt_bn_net(_rebuilt_KEYS[0]), lambda m, b: jnp.sum(jax.lax.cond(True, lambda m: m(b[0]), lambda m: 2 * m(b[0]), m)),
     messages.FIX_REBUILT_OTHER, "ft.nn.collect_state(lambda mm: mm(x), m)"),
])
def test_a_model_passed_through_a_transformation_in_the_loss_names_it_and_its_fix(name, model, loss, fix, right):
    assert right in fix
    # was NOT_IN_MODEL, which named only jit and "not part of the model"
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(loss, opt, donate=False)
    raises_named(lambda: step(model, opt.init(model), _rebuilt_BATCH), ValueError, messages.REBUILT_BY_TRANSFORM, right)


@pytest.mark.parametrize("loss", [
    lambda m, b: _rebuilt_loss(_rebuilt_bn_net(_rebuilt_KEYS[1]), b),  # another model's layers
    lambda m, b: jnp.sum(jax.jit(lambda m, x: m(x))(m, b[0])),  # a jit inside the loss
])
def test_another_models_layer_or_a_jit_keeps_not_in_model(loss):
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(loss, opt, donate=False)
    model = _rebuilt_bn_net(_rebuilt_KEYS[0])
    raises_named(lambda: step(model, opt.init(model), _rebuilt_BATCH), ValueError, messages.NOT_IN_MODEL,
                 "jax.jit(lambda model: ft.nn.collect_state(lambda m: m(x), model))(model)")
