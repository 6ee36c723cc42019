"""JAX's own transformations over functree models, written as an Equinox / plain-JAX user
writes them, each against the same computation in plain JAX (on the model, or on a dict of
its arrays) or against torch, in float64.

The programs: ensembles (a ``jax.vmap``'ed constructor, trained by the mean of the members'
losses, with layer state collected per member), ``lax.scan`` / ``cond`` / ``switch`` with a
model as value, ``jax.checkpoint``, ``jax.jvp`` / ``jax.linearize`` / ``jax.hessian`` against
functree's operators, pullbacks at a model with no-derivative fields, JAX's key paths
against functree's, ``jax.eval_shape`` and ``jax.device_put``, complex parameters.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

MEMBERS = 3


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _mlp(key):
    return ft.nn.MLP(3, 2, width_size=4, depth=1, activation=jnp.tanh, key=key, dtype=jnp.float64)


# The models a test takes as given (inputs, references), each built by one compiled program:
# eagerly, a constructor runs its random draws and scalings op by op (a program each). The
# constructors the tests are about (jax.vmap'ed, eval_shape'd, Stack) still run as written.
_mlp_jit = jax.jit(_mlp)


def _bn_net(key):
    k1, k2 = jax.random.split(key)
    return ft.nn.Sequential([
        ft.nn.Dense(3, 4, key=k1, dtype=jnp.float64),
        ft.nn.BatchNorm(4, momentum=0.5, training=True, dtype=jnp.float64),
        ft.nn.Dense(4, 1, key=k2, dtype=jnp.float64),
    ])


_bn_net_jit = jax.jit(_bn_net)


def _batch(out=2):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(6, 3))), jnp.asarray(rng.normal(size=(6, out)))


def _member_loss(m, batch):
    return jnp.mean((m(batch[0]) - batch[1]) ** 2)


def _keys():
    return jax.random.split(jax.random.key(0), MEMBERS)


def _flat(tree):
    """``{jax keystr: leaf}`` of the non-None leaves."""
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_trees_close(actual, expected, scale=1e-12):
    """Every leaf of ``actual`` (None leaves absent) against the same key path of
    ``expected``, atol scaled to the leaf's magnitude."""
    a, e = _flat(actual), _flat(expected)
    assert a and set(a) <= set(e), (sorted(a), sorted(e))
    for path, value in a.items():
        atol = scale * max(1.0, float(np.abs(e[path]).max()))
        np.testing.assert_allclose(value, e[path], rtol=0, atol=atol, err_msg=path)


def _assert_each_member_trained_alone(ensemble, make, opt, step, batch, *, steps):
    """Member ``i`` of ``ensemble`` is ``make(key i)`` after ``steps`` of ``step`` on its own."""
    for i, k in enumerate(_keys()):
        member = make(k)
        state = opt.init(member)
        for _ in range(steps):
            member, state, _ = step(member, state, batch)
        assert_trees_close(_member(ensemble, i), member)


def _member(ensemble, i):
    """Member ``i`` of a stacked ensemble (indexed in numpy: the same numbers, no program)."""
    return jax.tree.map(lambda a: np.asarray(a)[i], ensemble)


# ---------------------------------------------------------------------------------------
# ensembles


def test_vmapped_constructor_is_the_stacked_members_and_calls_like_them():
    ensemble = jax.vmap(_mlp)(_keys())
    x, _ = _batch()
    ys = jax.vmap(lambda m: m(x))(ensemble)
    alone = jax.jit(lambda k: (lambda m: (m, m(x)))(_mlp(k)))  # each member built and called alone
    for i, k in enumerate(_keys()):
        member, y = alone(k)
        assert_trees_close(_member(ensemble, i), member, scale=0)
        np.testing.assert_allclose(ys[i], y, rtol=0, atol=1e-12)


def test_ensemble_trained_by_the_mean_of_losses_is_each_member_trained_alone():
    # adam is per element: the ensemble's step on mean(losses) is each member's step on loss / n
    import optax

    batch = _batch()

    def ensemble_loss(e, b):
        return jnp.mean(jax.vmap(lambda m: _member_loss(m, b))(e))

    opt = ft.optim.Optimizer(ft.optim.adam(0.01))
    step = ft.train.train_step(ensemble_loss, opt, donate=False)
    ensemble = jax.vmap(_mlp)(_keys())
    state = opt.init(ensemble)
    for _ in range(4):
        ensemble, state, _ = step(ensemble, state, batch)
    @jax.jit  # the plain-optax reference, its 4 steps in one program
    def alone(k):
        member: Any = _mlp(k)  # optax's Params annotation names no Module
        tx = optax.adam(0.01)
        opt_state = tx.init(member)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its float rate and int count
            for _ in range(4):
                g = jax.grad(lambda m: _member_loss(m, batch) / MEMBERS)(member)
                updates, opt_state = tx.update(g, opt_state, member)
                member = optax.apply_updates(member, updates)
        return member

    for i, k in enumerate(_keys()):
        assert_trees_close(_member(ensemble, i), alone(k))


def test_a_vmapped_train_step_trains_each_member_alone_with_global_norm_clipping():
    # clipping by the global norm couples the members of a summed loss; vmap the step instead
    import optax

    batch = _batch()
    opt = ft.optim.Optimizer(optax.chain(ft.optim.clip_by_global_norm(0.05), ft.optim.sgd(0.1)))
    step = ft.train.train_step(_member_loss, opt, donate=False)
    ensemble = jax.vmap(_mlp)(_keys())
    states = jax.vmap(opt.init)(ensemble)
    for _ in range(3):
        ensemble, states, metrics = jax.vmap(step, in_axes=(0, 0, None))(ensemble, states, batch)
    assert metrics["loss"].shape == (MEMBERS,)
    _assert_each_member_trained_alone(ensemble, _mlp_jit, opt, step, batch, steps=3)
    summed = ft.train.train_step(lambda e, b: jnp.sum(jax.vmap(lambda m: _member_loss(m, b))(e)), opt, donate=False)
    coupled, _, _ = summed(jax.vmap(_mlp)(_keys()), opt.init(jax.vmap(_mlp)(_keys())), batch)
    first = _mlp_jit(_keys()[0])
    one = step(first, opt.init(first), batch)[0]
    assert float(np.abs(coupled.layers[0].weight[0] - one.layers[0].weight).max()) > 1e-4


def test_ensemble_gradients_inside_vmap_are_jax_grads():
    ensemble = jax.vmap(_mlp)(_keys())
    batch = _batch()
    got = jax.jit(jax.vmap(ft.gradient(_member_loss), in_axes=(0, None)))(ensemble, batch)
    want = jax.jit(jax.vmap(jax.grad(_member_loss), in_axes=(0, None)))(ensemble, batch)
    assert_trees_close(got, want)
    # (jitted: eagerly, a Hessian's jacfwd-of-jacrev runs op by op, seconds)
    hess = jax.jit(jax.vmap(ft.hessian(_member_loss), in_axes=(0, None)))(ensemble, batch)
    assert_trees_close(hess, jax.jit(jax.vmap(jax.hessian(_member_loss), in_axes=(0, None)))(ensemble, batch))


def test_ensemble_with_batchnorm_collects_each_members_state_inside_the_vmap():
    # the recipe of the error a vmap'ed ensemble with a training BatchNorm meets
    batch = _batch(out=1)

    def ensemble_loss(e):
        losses, state = jax.vmap(lambda m: ft.nn.collect_state(lambda mm: _member_loss(mm, batch), m))(e)
        return jnp.sum(losses), state

    @jax.jit
    def sgd(e):
        (_, state), g = ft.value_with_gradient(ensemble_loss, has_aux=True)(e)
        return ft.nn.apply_state(ft.move(e, along=ft.tangent_scale(g, -0.1)), state)

    ensemble = jax.vmap(_bn_net)(_keys())
    for _ in range(2):
        ensemble = sgd(ensemble)
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1))
    step = ft.train.train_step(_member_loss, opt, donate=False)
    _assert_each_member_trained_alone(ensemble, _bn_net_jit, opt, step, batch, steps=2)


def test_stack_is_the_vmapped_constructor_scanned():
    make = lambda k: ft.nn.Dense(3, 3, activation=jnp.tanh, key=k, dtype=jnp.float64)  # noqa: E731
    stack = ft.nn.Stack(make, MEMBERS, key=jax.random.key(0))
    ensemble = jax.vmap(make)(_keys())
    assert_trees_close(stack.layers, ensemble, scale=0)
    x, _ = _batch()
    scanned = jax.lax.scan(lambda h, m: (m(h), None), x, ensemble)[0]
    np.testing.assert_allclose(stack(x), scanned, rtol=0, atol=1e-12)


def test_get_and_set_on_a_vmapped_model_take_the_stacked_shapes():
    ensemble = jax.vmap(_mlp)(_keys())
    assert ft.get(ensemble, "layers.0.weight").shape == (MEMBERS, 3, 4)
    doubled = jax.vmap(lambda m: ft.set(m, "layers.0.weight", 2 * ft.get(m, "layers.0.weight")))(ensemble)
    np.testing.assert_array_equal(doubled.layers[0].weight, 2 * ensemble.layers[0].weight)
    with pytest.raises(ValueError, match=r"expected shape \(3, 3, 4\)"):
        ft.set(ensemble, "layers.0.weight", jnp.zeros((3, 4)))  # one member's shape


# ---------------------------------------------------------------------------------------
# control flow with models as values


def _flat_params(model):
    return {k: jnp.asarray(v) for k, v in ft.to_flat_dict(model).items()}


def _dict_loss(p, batch):
    """The MLP's loss written on a dict of its arrays (the reference)."""
    h = jnp.tanh(batch[0] @ p["layers.0.weight"] + p["layers.0.bias"][None, :])
    return jnp.mean((h @ p["layers.1.weight"] + p["layers.1.bias"][None, :] - batch[1]) ** 2)


def test_k_sgd_steps_in_one_scan_are_k_python_steps_and_the_dict_program():
    model, batch, k = _mlp_jit(jax.random.key(0)), _batch(), 5

    def sgd(m):
        return ft.move(m, along=ft.tangent_scale(ft.gradient(_member_loss)(m, batch), -0.1))

    scanned = jax.jit(lambda m: jax.lax.scan(lambda m, _: (sgd(m), None), m, None, length=k)[0])(model)
    looped = model
    for _ in range(k):
        looped = sgd(looped)

    @jax.jit  # the dict program: its loss, then k steps, in one program
    def dict_program(p):
        loss = _dict_loss(p, batch)
        for _ in range(k):
            g = jax.grad(_dict_loss)(p, batch)
            p = {name: p[name] - 0.1 * g[name] for name in p}
        return loss, p

    dict_loss, p = dict_program(_flat_params(model))
    np.testing.assert_allclose(dict_loss, jax.jit(_member_loss)(model, batch), rtol=0, atol=1e-15)
    for got in (scanned, looped):
        for name, value in ft.to_flat_dict(got).items():
            np.testing.assert_allclose(value, p[name], rtol=0, atol=1e-14, err_msg=name)


def test_optimizer_steps_in_a_scan_carry_are_the_train_steps():
    model, batch = _mlp_jit(jax.random.key(0)), _batch()
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))

    def body(carry, _):
        m, s = carry
        updates, s = opt.update(ft.gradient(_member_loss)(m, batch), s, m)
        return (ft.move(m, along=updates), s), None

    (scanned, _), _ = jax.lax.scan(body, (model, opt.init(model)), None, length=3)
    step = ft.train.train_step(_member_loss, opt, donate=False)
    m, s = model, opt.init(model)
    for _ in range(3):
        m, s, _ = step(m, s, batch)
    assert_trees_close(scanned, m)


def test_a_hand_written_rnn_scan_is_differentiated_as_the_dict_program():
    cell = jax.jit(lambda k: ft.nn.Dense(5, 2, activation=jnp.tanh, key=k, dtype=jnp.float64))(jax.random.key(3))
    xs = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)))

    def run(m):
        h, hs = jax.lax.scan(lambda h, x: (m(jnp.concatenate([x, h])),) * 2, jnp.zeros(2), xs)
        return jnp.sum(hs ** 2) + jnp.sum(h)

    def run_dict(p):
        def body(h, x):
            h = jnp.tanh(jnp.concatenate([x, h]) @ p["weight"] + p["bias"])
            return h, h
        h, hs = jax.lax.scan(body, jnp.zeros(2), xs)
        return jnp.sum(hs ** 2) + jnp.sum(h)

    got = ft.gradient(run, at=cell)
    want = jax.jit(jax.grad(run_dict))(_flat_params(cell))
    for name in want:
        np.testing.assert_allclose(ft.get(got, name), want[name], rtol=0, atol=1e-14, err_msg=name)


def test_cond_and_switch_return_models():
    a, b = _mlp_jit(jax.random.key(0)), _mlp_jit(jax.random.key(1))
    for pick, want in ((True, a), (False, b)):
        assert_trees_close(jax.jit(lambda p: jax.lax.cond(p, lambda: a, lambda: b))(pick), want, scale=0)
    branches = [lambda m: m, lambda m: ft.tangent_scale(ft.parameters(m), 2.0)]
    assert_trees_close(jax.lax.switch(1, branches, a), jax.tree.map(lambda v: 2 * v, a), scale=0)


def test_checkpoint_of_a_module_call_has_the_plain_gradient():
    model, batch = _mlp_jit(jax.random.key(0)), _batch()
    want = jax.jit(jax.grad(_member_loss))(model, batch)
    remat = lambda m, b: jnp.mean((jax.checkpoint(lambda m, x: m(x))(m, b[0]) - b[1]) ** 2)  # noqa: E731
    assert_trees_close(ft.gradient(remat)(model, batch), want)
    assert_trees_close(jax.grad(remat)(model, batch), want)


# ---------------------------------------------------------------------------------------
# forward mode and second order


def _tangent(model, seed=2):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), model)


def test_jvp_and_linearize_of_a_module_call_are_the_differential():
    model, (x, _) = _mlp_jit(jax.random.key(0)), _batch()
    t = _tangent(model)
    want = jax.jit(lambda m, t: jax.jvp(lambda m: m(x), (m,), (t,))[1])(model, t)
    got = ft.differential(lambda m: m(x), at=model)(ft.parameters(t))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-13 * float(np.abs(want).max()))
    _, linear = jax.linearize(lambda m: m(x), model)
    np.testing.assert_allclose(linear(t), got, rtol=0, atol=1e-13 * float(np.abs(want).max()))


def test_hessian_of_a_loss_wrt_a_model_is_jax_hessian_and_composed_gradients():
    model, batch = _mlp_jit(jax.random.key(0)), _batch()
    # each jitted: eagerly, a Hessian runs op by op (seconds)
    want = jax.jit(jax.hessian(_member_loss))(model, batch)
    got = jax.jit(ft.hessian(_member_loss))(model, batch)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_trees_close(got, want)
    assert_trees_close(jax.jit(jax.jacfwd(jax.jacrev(_member_loss)))(model, batch), want)
    composed = jax.jit(lambda m: ft.jacobian(lambda m: ft.gradient(_member_loss)(m, batch), at=m))(model)
    assert_trees_close(composed, want)
    t = _tangent(model)
    hvp = jax.jit(lambda m, t: ft.differential(lambda m: ft.gradient(_member_loss)(m, batch), at=m)(
        ft.parameters(t)))(model, t)
    assert_trees_close(hvp, jax.jit(lambda m, t: jax.jvp(lambda m: jax.grad(_member_loss)(m, batch), (m,), (t,))[1])(
        model, t))


# ---------------------------------------------------------------------------------------
# pullbacks at a model with no-derivative fields


@pytest.mark.parametrize("training", [False, True])
def test_pullback_at_batchnorm_is_jax_vjp_with_none_at_its_statistics(training):
    bn = ft.nn.BatchNorm(3, training=training, dtype=jnp.float64)
    bn = bn.replace(running_mean=jnp.array([0.1, 0.2, 0.3]), running_variance=jnp.array([1.5, 2.0, 3.0]),
                    scale=jnp.array([1.0, 2.0, 3.0]))
    x, cot = (jnp.asarray(np.random.default_rng(s).normal(size=(4, 3))) for s in (0, 1))
    f = (lambda m: m(x)) if not training else (lambda m: ft.nn.collect_state(lambda mm: mm(x), m)[0])
    _, pb = ft.value_with_pullback(f, at=bn)
    got = pb(cot)
    assert got.running_mean is None and got.running_variance is None  # the docs: no cotangent there
    assert_trees_close(got, jax.jit(lambda bn: jax.vjp(f, bn)[1](cot)[0])(bn))


def test_pullback_of_a_model_valued_function_takes_the_parameter_view():
    bn = ft.nn.BatchNorm(3, dtype=jnp.float64).replace(scale=jnp.array([1.0, 2.0, 3.0]))

    def f(m):
        return m.replace(scale=2 * m.scale * jnp.sum(m.offset + 1), running_mean=3 * m.running_mean)

    y, pb = ft.value_with_pullback(f, at=bn)
    cot = ft.parameters(jax.tree.map(lambda a: a + 1.5, y))
    full = jax.tree.map(lambda a: a + 1.5, y).replace(running_mean=jnp.zeros(3), running_variance=jnp.zeros(3))
    assert_trees_close(pb(cot), jax.vjp(f, bn)[1](full)[0])
    with pytest.raises(ValueError, match=r"\.running_mean, which is a no_derivative field"):
        pb(jax.tree.map(jnp.ones_like, y))


# ---------------------------------------------------------------------------------------
# key paths


class Net(ft.Module):
    blocks: ft.nn.Stack
    table: dict
    items: list
    bn: ft.nn.BatchNorm
    count: jax.Array = ft.field(no_derivative=True, default=0)


def test_jax_key_paths_name_the_leaves_functree_names():
    key = jax.random.key(0)
    fields: dict[str, Any] = {
        "blocks": ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 3, key=key),
        "table": {"b": jnp.ones(2), "a": jnp.zeros(3), "c": (jnp.ones(1), None)},
        "items": [jnp.ones(5), {"q": jnp.ones(6)}], "bn": ft.nn.BatchNorm(2), "count": jnp.array(3),
    }
    net = Net(**fields)
    jax_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(net)[0]]
    ft_paths = [str(kp) for kp in ft.recursively_all_writable_key_paths(net, to=jax.Array)]
    # the same leaves; a dict's order differs: JAX sorts its keys, key paths keep insertion order
    assert sorted(jax_paths) == sorted(ft_paths)
    assert ft_paths.index(".table['b']") < ft_paths.index(".table['a']")
    assert jax_paths.index(".table['a']") < jax_paths.index(".table['b']")
    for path, leaf in jax.tree_util.tree_flatten_with_path(net)[0]:
        assert ft.get(net, jax.tree_util.keystr(path)) is leaf
    # to_flat_dict's names follow JAX's leaf order
    assert [v for v in ft.to_flat_dict(net).values()] == jax.tree.leaves(net)
    # a model without dicts: the same order
    model = _bn_net_jit(key)
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]] == [
        str(kp) for kp in ft.recursively_all_writable_key_paths(model, to=jax.Array)]


def test_tree_map_with_path_over_a_model_and_its_gradient():
    model, batch = _bn_net_jit(jax.random.key(0)), _batch(out=1)
    grads = jax.jit(lambda m: ft.nn.value_with_gradient_and_state(_member_loss, m, batch)[1])(model)
    # the gradient first: its None leaves (the running statistics) are skipped
    moved = jax.tree.map(lambda g, p: p if g is None else p - 0.1 * g, grads, model,
                         is_leaf=lambda v: v is None)
    assert_trees_close(moved, ft.move(model, along=ft.tangent_scale(grads, -0.1)), scale=0)
    named = jax.tree_util.tree_map_with_path(lambda p, g: ft.get(model, jax.tree_util.keystr(p)).shape == g.shape,
                                             grads)
    assert all(jax.tree.leaves(named))


# ---------------------------------------------------------------------------------------
# abstract evaluation, placement, complex parameters


def test_eval_shape_of_a_constructor_then_the_optimizer_init():
    abstract = jax.eval_shape(_mlp, jax.random.key(0))
    concrete = _mlp_jit(jax.random.key(0))
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(abstract)] == [
        (c.shape, c.dtype) for c in jax.tree.leaves(concrete)]
    opt = ft.optim.Optimizer(ft.optim.adam(0.1))
    shapes = jax.eval_shape(opt.init, abstract)
    assert jax.tree.structure(shapes) == jax.tree.structure(opt.init(concrete))


def test_device_put_of_a_model_to_a_sharding():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    model = _mlp_jit(jax.random.key(0))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    placed = jax.device_put(model, NamedSharding(mesh, PartitionSpec()))
    assert type(placed) is type(model)
    assert all(isinstance(a.sharding, NamedSharding) for a in jax.tree.leaves(placed))
    assert_trees_close(placed, model, scale=0)


def test_complex_parameters_train_as_torch_does():
    torch = pytest.importorskip("torch")
    z0, target = np.array([0.3 + 0.1j, -0.2 + 0.5j]), np.array([1 + 2j, -1 - 1j])
    a = np.array([[1.0, 0.5j], [0.2, 1 - 1j]])

    def loss(m, _):
        return jnp.sum(jnp.abs(a @ m["z"] - target) ** 2)

    np.testing.assert_array_equal(ft.gradient(loss)({"z": jnp.asarray(z0)}, None)["z"],
                                  jax.grad(loss)({"z": jnp.asarray(z0)}, None)["z"])
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    step = ft.train.train_step(loss, opt, donate=False)
    model = {"z": jnp.asarray(z0)}
    state = opt.init(model)
    zt = torch.tensor(z0, requires_grad=True)
    reference = torch.optim.Adam([zt], lr=0.05)
    for _ in range(5):
        model, state, _ = step(model, state, None)
        reference.zero_grad()
        (torch.tensor(a) @ zt - torch.tensor(target)).abs().pow(2).sum().backward()
        reference.step()
    np.testing.assert_allclose(model["z"], zt.detach().numpy(), rtol=0, atol=1e-14)
