"""An optax user's own transforms over functree models, each program run twice: (a) a functree
Module with ``ft.optim.Optimizer(tx)`` and ``minimize``, (b) plain JAX + optax on a dict of
the same arrays. The trajectories agree to float64 rounding (1e-13 of the values' magnitude):
a difference would be functree's tree (None leaves, ties, stacked leaves, the learning
context's extra arguments) changing optax's numbers.

The model's fields are declared in the dict's sorted key order, so that transforms drawing
random numbers per leaf (``noisy_sgd``) draw them for the same leaves in both programs.
"""

import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.optim._masked import MEMBER_MASK_IN_OPTAX
from functree.optim._state import OPTAX_STATE_FIELD
from tests._errors import raises_named

STEPS = 6  # (functree's steps run eagerly, op by op; a change "at i == 5" is the last step)
ATOL = 1e-13  # float64 rounding, scaled by max(1, |values|)
# optax's warmup schedule (schedule_free_adamw's) computes the rate in float32 even under x64
# (its count is int32), and XLA rounds the jitted plain program's schedule another way than
# functree's eager operations on jax 0.12 (the rate at step 1: 0.0033333336 against
# 0.0033333339, one float32 ulp): trajectories 1.66e-10 apart there (0 on jax 0.10), a rounding
# of optax's own rate, not functree's tree. Measured 1.66e-10 over 6 steps: 6x margin.
SCHEDULE_ATOL = 1e-9


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        yield


class MLP(ft.Module):
    b1: jax.Array
    b2: jax.Array
    w1: jax.Array
    w2: jax.Array
    seen: jax.Array = ft.field(no_derivative=True, default=0)  # a no-derivative leaf: None in the view

    def __call__(self, x):
        return jnp.tanh(x @ self.w1 + self.b1[None, :]) @ self.w2 + self.b2[None, :]


@functools.cache
def _drawn():
    """The initial arrays and the data, drawn once (in one compiled program) as NumPy values."""

    @jax.jit
    def draw():
        k = jax.random.split(jax.random.key(0), 4)
        return ({"b1": 0.1 * jax.random.normal(k[0], (4,), jnp.float64), "b2": jnp.zeros(2, jnp.float64),
                 "w1": jax.random.normal(k[1], (3, 4), jnp.float64), "w2": jax.random.normal(k[2], (4, 2), jnp.float64)},
                (jax.random.normal(jax.random.key(1), (16, 3), jnp.float64),
                 jax.random.normal(jax.random.key(2), (16, 2), jnp.float64)))

    with jax.enable_x64(True):
        return jax.tree.map(np.asarray, draw())


def arrays():  # (device_put: jnp.asarray compiles a `stage` program a shape; the same float64 arrays)
    return {k: jax.device_put(v) for k, v in _drawn()[0].items()}


def data():
    return tuple(jax.device_put(v) for v in _drawn()[1])


def plain_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"][None, :]) @ p["w2"] + p["b2"][None, :] - y) ** 2)


def ft_loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def model():
    return MLP(**arrays(), seen=jax.device_put(np.zeros((), np.int64)))  # pyright: ignore[reportCallIssue]


def flat(tree):
    return {k: np.asarray(v) for k, v in ft.to_flat_dict(ft.parameters(tree)).items()}


def run_plain(tx, steps=STEPS, between=None):
    """The plain program, its step one compiled program (eagerly, each of its operations compiled one)."""
    p, (x, y) = arrays(), data()
    s = tx.init(p)

    @jax.jit
    def step(p, s):
        u, s = tx.update(jax.grad(plain_loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    out = []
    for i in range(steps):
        if between is not None:
            s = between(i, s)
        p, s = step(p, s)
        out.append(flat(p))
    return out, p, s


def run_ft(tx, steps=STEPS, between=None):
    m, (x, y) = model(), data()
    opt = ft.optim.Optimizer(tx)
    s = opt.init(m)
    out = []
    for i in range(steps):
        if between is not None:
            s = between(i, s)
        m, s, _ = opt.minimize(ft_loss, m, s, x, y)
        out.append(flat(m))
    return out, m, s


def assert_same(actual, expected, atol=ATOL):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.keys() == e.keys()
        for k in e:
            np.testing.assert_allclose(a[k], e[k], rtol=0, atol=atol * max(1.0, np.abs(e[k]).max()), err_msg=k)


def decays(p):
    return jax.tree.map(lambda a: a.ndim > 1, p)


def labels(p):
    return jax.tree.map(lambda a: "adam" if a.ndim > 1 else "sgd", p)


MASK = {"b1": False, "b2": False, "w1": True, "w2": True}
LABELS = {"b1": "sgd", "b2": "sgd", "w1": "adam", "w2": "adam"}


def model_shaped(values):
    """A mask or label tree shaped like the model (built inside the x64 fixture)."""
    return ft.parameters(model()).replace(**values)


def two(labels_):
    return optax.multi_transform({"adam": optax.adam(0.01), "sgd": optax.sgd(0.1)}, labels_)


def warmed_schedule_free():  # (a transform maker, as the lambdas below)
    return optax.contrib.schedule_free_adamw(0.01, warmup_steps=3)


# (name, the plain program's transform, functree's (None: the same))
PROGRAMS = [
    ("clip_by_global_norm + adamw", lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(0.01, weight_decay=0.1)), None),
    ("adamw mask callable", lambda: optax.adamw(0.01, weight_decay=0.5, mask=decays), None),
    ("adamw mask tree", lambda: optax.adamw(0.01, weight_decay=0.5, mask=MASK),
     lambda: optax.adamw(0.01, weight_decay=0.5, mask=model_shaped(MASK))),
    ("masked add_decayed_weights", lambda: optax.chain(optax.masked(optax.add_decayed_weights(0.5), decays), optax.sgd(0.1)), None),
    ("multi_transform label tree", lambda: two(LABELS), lambda: two(model_shaped(LABELS))),
    ("multi_transform label function", lambda: two(labels), None),
    ("MultiSteps", lambda: optax.MultiSteps(optax.adam(0.01), 3), None),
    ("apply_if_finite", lambda: optax.apply_if_finite(optax.adam(0.01), 3), None),
    ("schedule_free_adamw", warmed_schedule_free, None),
    ("ema", lambda: optax.chain(optax.sgd(0.1), optax.ema(0.9)), None),
    ("noisy_sgd", lambda: optax.noisy_sgd(0.01, key=0), None),
    ("sam", lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2, opaque_mode=False), None),
]


@pytest.mark.parametrize(("plain", "functree"), [p[1:] for p in PROGRAMS], ids=[p[0] for p in PROGRAMS])
def test_trajectory_as_plain_optax(plain, functree):
    expected, _, _ = run_plain(plain())
    actual, _, _ = run_ft((functree or plain)())
    assert_same(actual, expected, SCHEDULE_ATOL if plain is warmed_schedule_free else ATOL)


LBFGS_STEPS = 3  # each eager step compiles the line search's while and scans anew


def test_lbfgs_as_optax_value_and_grad_from_state():
    """optax's own L-BFGS loop (value_and_grad_from_state reuses the line search's value)."""
    tx = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(plain_loss)

    @jax.jit  # one program, one step's body (eagerly, the line search's while and scans compile anew each step)
    def trajectory(p, x, y):
        def step(carry, _):
            p, s = carry
            v, g = value_and_grad(p, x, y, state=s)
            u, s = tx.update(g, s, p, value=v, grad=g, value_fn=lambda q: plain_loss(q, x, y))
            p = optax.apply_updates(p, u)
            return (p, s), p
        return jax.lax.scan(step, (p, tx.init(p)), length=LBFGS_STEPS)[1]

    out = jax.tree.map(np.asarray, trajectory(arrays(), *data()))
    assert_same(run_ft(optax.lbfgs(), steps=LBFGS_STEPS)[0], [{k: v[i] for k, v in out.items()} for i in range(LBFGS_STEPS)])


@pytest.mark.parametrize("how", ["ft.optim.set_hyperparameters", "opt_state.hyperparams"])
def test_inject_hyperparams_changed_between_steps(how):
    make = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.01)  # noqa: E731

    def plain_change(i, s):
        if i == 5:
            s.hyperparams["learning_rate"] = jnp.asarray(0.05)
        return s

    def ft_change(i, s):
        if i == 5:
            if how == "ft.optim.set_hyperparameters":
                return ft.optim.set_hyperparameters(s, learning_rate=0.05)
            optax.tree_utils.tree_get(s, "hyperparams")["learning_rate"] = jnp.asarray(0.05)  # optax's way, on our state
        return s

    assert_same(run_ft(make(), between=ft_change)[0], run_plain(make(), between=plain_change)[0])


def test_lookahead_fast_weights_as_optax():
    tx, (x, y) = optax.lookahead(optax.adam(0.01), 3, 0.5), data()
    p = optax.LookaheadParams.init_synced(arrays())
    s, expected = tx.init(p), []

    @jax.jit  # the plain program's step, compiled whole
    def step(p, s):
        u, s = tx.update(jax.grad(plain_loss)(p.fast, x, y), s, p)
        return cast(optax.LookaheadParams, optax.apply_updates(p, u)), s

    for _ in range(STEPS):
        p, s = step(p, s)
        expected.append(flat(p.fast))
    assert_same(run_ft(optax.lookahead(optax.adam(0.01), 3, 0.5))[0], expected)


def test_state_reads_by_name_as_optax():
    """optax.tree_utils.tree_get on the functree state reads what it reads on optax's."""
    _, _, s_plain = run_plain(optax.adam(0.01))
    _, _, s_ft = run_ft(optax.adam(0.01))
    assert int(optax.tree_utils.tree_get(s_ft, "count")) == int(optax.tree_utils.tree_get(s_plain, "count")) == STEPS
    mu_ft, mu_plain = optax.tree_utils.tree_get(s_ft, "mu"), optax.tree_utils.tree_get(s_plain, "mu")
    np.testing.assert_allclose(optax.tree_utils.tree_norm(mu_ft), optax.tree_utils.tree_norm(mu_plain), rtol=0, atol=1e-15)


def test_schedule_free_eval_params_as_optax():
    _, p, s_plain = run_plain(warmed_schedule_free())
    _, m, s_ft = run_ft(warmed_schedule_free())
    params = optax.contrib.schedule_free_eval_params(s_ft.inner, cast(Any, ft.parameters(m)))
    evaluated = ft.with_parameters(m, params)
    assert_same([flat(evaluated)], [flat(optax.contrib.schedule_free_eval_params(s_plain, p))], SCHEDULE_ATOL)
    assert evaluated.seen.dtype == jnp.int64  # the no-derivative leaf kept


def test_schedule_free_eval_params_of_the_whole_state_is_named():
    """Before: AttributeError "'OptimizerState' object has no attribute 'b1'", no fix."""
    _, m, s = run_ft(optax.contrib.schedule_free_adamw(0.01), steps=1)
    raises_named(lambda: optax.contrib.schedule_free_eval_params(s, cast(Any, m)), AttributeError, OPTAX_STATE_FIELD,
                 "schedule_free_eval_params(opt_state.inner, ft.parameters(model))")
    assert not hasattr(s, "b1") and not hasattr(s, "_fields")  # still an AttributeError for probes


def test_target_network_on_the_parameter_view():
    """A target network by optax.incremental_update / periodic_update over the parameter view
    (docs/guides/training.md): the trajectory of the plain program; the no-derivative leaf
    keeps its dtype (optax's update of the whole model would average it into a float)."""
    (x, y), tx = data(), optax.sgd(0.1)
    p, target = arrays(), arrays()
    s, expected = tx.init(p), []
    m, target_m = model(), model()
    opt = ft.optim.Optimizer(optax.sgd(0.1))
    state, actual = opt.init(m), []

    @jax.jit  # the plain program's step, compiled whole
    def step(p, s, target, i):
        u, s = tx.update(jax.grad(plain_loss)(p, x, y), s, p)
        p = optax.apply_updates(p, u)
        target = optax.incremental_update(p, target, 0.1)
        return p, s, optax.periodic_update(p, target, i, 5)

    for i in range(STEPS):
        p, s, target = step(p, s, target, jnp.asarray(i))
        expected.append(flat(target))
        m, state, _ = opt.minimize(ft_loss, m, state, x, y)
        view = optax.incremental_update(ft.parameters(m), ft.parameters(target_m), 0.1)
        view = optax.periodic_update(ft.parameters(m), view, jnp.asarray(i), 5)
        target_m = ft.with_parameters(target_m, view)
        actual.append(flat(target_m))
    assert_same(actual, expected)
    assert target_m.seen.dtype == jnp.int64


# --- models whose trees are not one array per parameter ---------------------------------------


def run_structural(m, loss, make, make_plain=None, steps=6, wrt=None):
    """functree's updates against optax's on the flat dict of the same trained arrays and
    gradients: None leaves (no-derivative fields, frozen parameters) and ties (stored once)
    must reach the transform as the plain program's dict has them."""
    opt = ft.optim.Optimizer(make(m), wrt=wrt)
    state = opt.init(m)
    trained = ft.select(m, *wrt) if wrt else None
    names = [k for k, v in ft.to_flat_dict(trained).items() if v] if wrt else list(flat(m))
    pv = {k: jax.device_put(v) for k, v in flat(m).items() if k in names}  # (flat's NumPy arrays)
    tx = (make_plain or make)(pv)
    s = tx.init(pv)

    @jax.jit  # the plain program's step, compiled whole
    def plain_step(pv, s, g):
        up, s = tx.update(g, s, pv)
        return optax.apply_updates(pv, up), s

    for _ in range(steps):
        _, g, layer_state = ft.nn.value_with_gradient_and_state(loss, m)  # BatchNorm's statistics
        u, state = opt.update(g, state, m)
        m = ft.nn.apply_state(ft.move(m, along=u), layer_state)
        pv, s = plain_step(pv, s, {k: v for k, v in ft.to_flat_dict(g).items() if k in names})
        assert_same([{k: v for k, v in flat(m).items() if k in names}], [flat(pv)])
    return m


def clip_adam(_):
    return optax.chain(optax.clip_by_global_norm(0.01), optax.adam(0.01))


def bn_model():
    k = jax.random.split(jax.random.key(3), 2)
    return ft.nn.training(ft.nn.Sequential(ft.nn.Dense(3, 4, key=k[0], dtype=jnp.float64),
                                           ft.nn.BatchNorm(4), ft.nn.Dense(4, 2, key=k[1], dtype=jnp.float64)))


def bn_loss(m):
    return jnp.mean(m(data()[0]) ** 2)


@pytest.mark.parametrize("wrt", [None, ("layers.0.*",)])
def test_batchnorm_global_norm_skips_running_statistics(wrt):
    run_structural(bn_model(), bn_loss, clip_adam, wrt=wrt)


def test_batchnorm_labels_of_the_training_model():
    run_structural(bn_model(), bn_loss, lambda m: two(labels(m)), lambda pv: two(labels(pv)))


class LM(ft.Module):
    embed: ft.nn.Embedding
    head: ft.nn.Dense

    def __call__(self, t):
        return self.head(self.embed(t))


def tied_lm():
    k = jax.random.split(jax.random.key(4), 2)
    lm = LM(ft.nn.Embedding(10, 4, key=k[0], dtype=jnp.float64),  # pyright: ignore[reportCallIssue]
            ft.nn.Dense(4, 10, key=k[1], dtype=jnp.float64))
    return ft.nn.Shared(lm, {"head.weight": ("embed.embeddings", jnp.transpose)})


def lm_loss(m):
    return jnp.mean(m(jnp.array([1, 2, 3, 4])) ** 2)


def test_tied_weight_counted_once_by_global_norm():
    run_structural(tied_lm(), lm_loss, clip_adam)


def test_tied_weight_mask_by_its_torch_name():
    """``ft.select(lm, "head.weight")`` selects the one stored matrix (the tie's source)."""
    run_structural(tied_lm(), lm_loss, lambda m: optax.adamw(0.01, weight_decay=0.3, mask=ft.select(m, "head.weight")),
                   lambda pv: optax.adamw(0.01, weight_decay=0.3, mask={k: k == "model.embed.embeddings" for k in pv}))


def stack():
    return ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, jnp.tanh, key=k, dtype=jnp.float64), 3, key=jax.random.key(5))


def stack_loss(m):
    return jnp.mean(m(data()[0]) ** 2)


STACK_STEPS = 3  # each eager ft.nn.value_with_gradient_and_state of a Stack compiles two scans anew (0.4 CPU-s)


def test_stack_global_norm_as_the_stacked_arrays():
    run_structural(stack(), stack_loss, clip_adam, steps=STACK_STEPS)


def test_stack_member_mask_in_optax_masked_is_named():
    """Before: numpy's "The truth value of an array with more than one element is
    ambiguous" from inside optax.masked."""
    s = stack()
    raises_named(lambda: ft.optim.Optimizer(optax.adamw(0.01, weight_decay=0.3, mask=ft.select(s, "[0-1].*"))).init(s),
                 ValueError, MEMBER_MASK_IN_OPTAX, "ft.optim.masked(optax.add_decayed_weights(0.1)")


def test_stack_member_mask_fix_decays_the_members_selected():
    """The error's fix: the selected members decay as a plain program's per-member mask."""
    s = stack()
    member = np.array([True, True, False])
    weight_mask = lambda pv: {k: (member[:, None, None] if k.endswith("weight") else member[:, None]) for k in pv}  # noqa: E731

    def plain(pv):
        decay = optax.stateless(lambda u, p: jax.tree.map(lambda g, w, mk: g + 0.3 * w * mk, u, p, weight_mask(pv)))
        return optax.chain(optax.scale_by_adam(), decay, optax.scale(-0.01))

    run_structural(s, stack_loss, lambda m: optax.chain(
        optax.scale_by_adam(), ft.optim.masked(optax.add_decayed_weights(0.3), ft.select(m, "[0-1].*")), optax.scale(-0.01)),
        plain, steps=STACK_STEPS)


@pytest.mark.parametrize("how", ["minimize", "train_step"])
def test_sam_opaque_mode_gets_grad_fn(how):
    """optax.contrib.sam(opaque_mode=True) needs grad_fn(params, i): minimize and the train
    step pass the gradient of the step's loss. Before: optax's "grad_fn must be provided
    when opaque_mode=True." (no way to give it through minimize)."""
    make = lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=3, opaque_mode=True)  # noqa: E731
    tx, p, (x, y) = make(), arrays(), data()
    s, expected = tx.init(p), []

    @jax.jit  # the plain program's step, compiled whole
    def plain_step(p, s):
        u, s = tx.update(jax.grad(plain_loss)(p, x, y), s, p, grad_fn=lambda q, i: jax.grad(plain_loss)(q, x, y))
        return optax.apply_updates(p, u), s

    for _ in range(STEPS):
        p, s = plain_step(p, s)
        expected.append(flat(p))
    if how == "minimize":
        actual = run_ft(make())[0]
    else:
        m, opt, actual = model(), ft.optim.Optimizer(make()), []
        step, s = ft.train.train_step(lambda mm, b: ft_loss(mm, *b), opt), opt.init(m)
        for _ in range(STEPS):
            m, s, _ = step(m, s, (x, y))
            actual.append(flat(m))
    atol = 1e-14 if how == "minimize" else 1e-12  # the compiled step sums in another order than eager optax
    assert_same(actual, expected) if how == "minimize" else [
        np.testing.assert_allclose(a[k], e[k], rtol=0, atol=atol * max(1.0, np.abs(e[k]).max()))
        for a, e in zip(actual, expected) for k in e]


def test_stack_members_trained_by_wrt_global_norm_as_a_plain_program():
    """wrt= selecting members 0 and 1 of a stacked leaf: clip_by_global_norm counts their
    gradients only, as a plain program holding those members as its parameters."""
    s, x = stack(), data()[0]
    members = ft.to_flat_dict(s, unstack=True)
    fixed = {k: v for k, v in members.items() if k.startswith("2.")}
    p = {k: v for k, v in members.items() if k not in fixed}

    def plain(q):
        h, w = x, {**q, **fixed}
        for i in range(3):
            h = jnp.tanh(h @ w[f"{i}.weight"] + jax.lax.broadcast_to_rank(w[f"{i}.bias"], h.ndim))
        return jnp.mean(h ** 2)

    opt = ft.optim.Optimizer(clip_adam(None), wrt=("[0-1].*",))
    state, tx = opt.init(s), clip_adam(None)
    sp = tx.init(p)

    @jax.jit  # the plain program's step, compiled whole
    def plain_step(p, sp):
        u, sp = tx.update(jax.grad(plain)(p), sp, p)
        return cast(dict[str, Any], optax.apply_updates(p, u)), sp

    for _ in range(6):
        s, state, _ = opt.minimize(stack_loss, s, state)
        p, sp = plain_step(p, sp)
        got = {k: np.asarray(v) for k, v in ft.to_flat_dict(s, unstack=True).items()}
        assert_same([got], [flat({**p, **fixed})])


def test_complex_parameter_is_a_real_pair_to_optax_adam():
    """optax.adam inside the Optimizer trains z = x + iy as the real pair (x, y) (torch's
    numbers, docs/guides/training.md), not as plain optax on the complex array."""
    # the inputs put on the device from NumPy (the same complex128 / float64 arrays; jnp.array and
    # jnp.zeros compiled a program each)
    a = jax.device_put(np.array([1.5 + 2.0j, -0.3 + 0.1j], np.complex128))
    weights = jax.device_put(np.array([1.0, 30.0]))
    opt = ft.optim.Optimizer(optax.adam(0.1))
    z = {"z": jax.device_put(np.zeros(2, np.complex128))}
    state = opt.init(z)
    pair = {"x": jax.device_put(np.zeros(2)), "y": jax.device_put(np.zeros(2))}
    tx = optax.adam(0.1)
    s = tx.init(pair)

    @jax.jit  # the plain program's step, compiled whole
    def plain_step(pair, s):
        g = jax.grad(lambda q: jnp.sum(((q["x"] - a.real) ** 2 + (q["y"] - a.imag) ** 2) * weights))(pair)
        u, s = tx.update(g, s, pair)
        return cast(dict[str, Any], optax.apply_updates(pair, u)), s

    for _ in range(STEPS):
        z, state, _ = opt.minimize(lambda p: jnp.sum(jnp.abs(p["z"] - a) ** 2 * weights), z, state)
        pair, s = plain_step(pair, s)
    np.testing.assert_allclose(z["z"].real, pair["x"], rtol=0, atol=1e-14)
    np.testing.assert_allclose(z["z"].imag, pair["y"], rtol=0, atol=1e-14)


def test_inject_hyperparams_per_group_changed_by_qualified_name():
    """multi_transform of two inject_hyperparams(adam): ``"adam/learning_rate"`` changes that
    group's alone, as writing optax's ``inner_states["adam"]...hyperparams`` does."""
    inject = lambda lr: optax.inject_hyperparams(optax.adam)(learning_rate=lr)  # noqa: E731
    make = lambda: optax.multi_transform({"adam": inject(0.01), "sgd": inject(0.1)}, labels)  # noqa: E731

    def plain_change(i, s):
        if i == 5:
            s.inner_states["adam"].inner_state.hyperparams["learning_rate"] = jnp.asarray(0.05)
        return s

    def ft_change(i, s):
        return ft.optim.set_hyperparameters(s, {"adam/learning_rate": 0.05}) if i == 5 else s

    assert_same(run_ft(make(), between=ft_change)[0], run_plain(make(), between=plain_change)[0])
