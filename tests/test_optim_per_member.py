"""ft.optim.per_member: optax's per-tensor transforms on an ft.nn.Stack give the unrolled
blocks' numbers; ft.optim.Optimizer refuses them on a Stack unwrapped (PER_TENSOR_ON_STACK)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close_trained, scaled_error

import functree as ft
from functree._stacked import expand, is_stacked
from functree._tree import dotted_name
from functree.optim._per_member import ENSEMBLE_MEMBERS
from functree.optim._per_tensor import PER_TENSOR_ON_STACK


class Block(ft.nn.Layer):
    up: ft.nn.Dense
    down: ft.nn.Dense

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.up = ft.nn.Dense(4, 6, jnp.tanh, key=k1)
        self.down = ft.nn.Dense(6, 4, key=k2)

    def __call__(self, x):
        return x + self.down(self.up(x))


def _model(block):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"blocks": ft.nn.Stack(lambda k: block(key=k), 3, key=k1), "head": ft.nn.Dense(4, 4, key=k2)}


MODEL = _model(lambda key: ft.nn.Dense(4, 4, jnp.tanh, key=key))  # few shapes: few programs run eagerly
BLOCKS = _model(Block)


def _gradients(params, steps=3):
    """``steps`` gradient trees, member i of the Stack scaled by 4**i: the members' norms and
    RMS differ, as do their statistics over the stacked leaf."""
    scale = 4.0 ** np.arange(3)
    out = []
    for s in range(steps):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        keys = jax.random.split(jax.random.key(100 + s), len(leaves))
        gs = []
        for (path, x), k in zip(leaves, keys):
            g = jax.random.normal(k, x.shape, x.dtype)
            if dotted_name(path).startswith("blocks"):
                g = g * jnp.asarray(scale, x.dtype).reshape((3,) + (1,) * (x.ndim - 1))
            gs.append(g)
        out.append(jax.tree.unflatten(treedef, gs))
    return out


def _unrolled(tree):
    return {**tree, "blocks": tree["blocks"].unstack()}


def _restacked(tree):
    return {**tree, "blocks": ft.nn.Stack.from_layers(list(tree["blocks"].layers))}


def _train(tx, params, grads):
    """Eagerly (each op's program is shared by every test on these few shapes: a jitted
    loop compiled three programs a case, 4 CPU-s)."""
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its int counts and float rates
        state = tx.init(params)
        for g in grads:
            u, state = tx.update(g, state, params)
            params = optax.apply_updates(params, u)
    return params, state


def _ids(cases):
    return [name for name, _ in cases]


PER_TENSOR = [
    ("lamb", lambda: optax.lamb(0.05, weight_decay=0.01)),
    ("lars after a global norm", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.lars(0.05))),
    ("adafactor", lambda: optax.adafactor(0.05, min_dim_size_to_factor=2)),
    ("clip_by_block_rms", lambda: optax.chain(optax.clip_by_block_rms(0.5), optax.sgd(0.05))),
    ("scale_by_trust_ratio", lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale(-0.05))),
    ("muon", lambda: optax.contrib.muon(0.05)),
]


@pytest.mark.parametrize("make", [m for _, m in PER_TENSOR], ids=_ids(PER_TENSOR))
def test_per_member_trains_a_stack_as_its_blocks_unrolled(make):
    """3 steps of per_member(tx) on a Stack equal tx's on stack.unstack(), restacked; tx on
    the Stack itself (one statistic over each stacked leaf) is far from both (measured, in
    units of each leaf's largest value: LARS 1.9e-4, LAMB and scale_by_trust_ratio 3.6e-2,
    clip_by_block_rms 0.43, Adafactor 0.59, Muon 0.70). A global norm (clip_by_global_norm)
    stays one over all parameters."""
    grads = _gradients(MODEL)
    got, state = _train(ft.optim.per_member(make()), MODEL, grads)
    want, _ = _train(make(), _unrolled(MODEL), [_unrolled(g) for g in grads])
    want = _restacked(want)
    assert_close_trained(got, want, spread=0.0)  # measured 0 (default, AVX, SSE4_2): one float32 rounding
    plain, _ = _train(make(), MODEL, grads)
    assert scaled_error(plain, want) > 1e-5  # ten times the tolerance: the wrapper makes them equal
    # the state keeps the parameters' structure: stacked moments, counts as they are
    assert isinstance(state, ft.optim.PerMemberState)
    stacked = [x for x in jax.tree.leaves(state, is_leaf=is_stacked) if is_stacked(x)]
    assert all(leaf.shape[0] == 3 for s in stacked for leaf in jax.tree.leaves(s))


def test_the_state_is_stacked_as_the_parameters():
    """One key path reads the parameters, the gradients and the moments; adafactor's
    factored rows are stacked too (one row statistic per member), the count stays a scalar."""
    state = ft.optim.Optimizer(ft.optim.per_member(optax.adafactor(0.1, min_dim_size_to_factor=2))).init(BLOCKS)
    factored = state.inner.inner[0]
    assert type(factored).__name__ == "FactoredState" and factored.count.shape == ()
    assert ft.get(factored.v_row, "blocks.layers.up.weight").shape == (3, 4)   # member (4, 6): rows
    assert ft.get(factored.v_col, "blocks.layers.up.weight").shape == (3, 6)
    assert ft.get(factored.v_row, "blocks.1.up.weight").shape == (4,)          # member 1's
    assert ft.get(factored.v_row, "head.weight").shape == (4,)
    adam = ft.optim.Optimizer(ft.optim.per_member(optax.lamb(0.1))).init(BLOCKS).inner.inner[0]
    assert ft.get(adam.mu, "blocks.layers.up.weight").shape == BLOCKS["blocks"].layers.up.weight.shape


def test_without_a_stack_the_transform_runs_as_it_is(monkeypatch):
    """No Stack: init and update are the transform's own, nothing expanded."""
    import functree.optim._per_member as per_member_module

    def refuse(tree):
        raise AssertionError("expanded a tree without a Stack")

    monkeypatch.setattr(per_member_module, "expand", refuse)
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    g = {"w": jnp.full((2, 3), 0.5), "b": jnp.full(3, -0.25)}
    tx, ref = ft.optim.per_member(optax.lamb(0.1)), optax.lamb(0.1)
    with jax.numpy_dtype_promotion("standard"):
        u, state = tx.update(g, tx.init(params), params)
        u_ref, state_ref = ref.update(g, ref.init(params), params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), (u, state.inner), (u_ref, state_ref)))


def test_masks_outside_per_member_select_stacked_leaves_and_members():
    """optax.masked and ft.optim.masked (a member pattern) around per_member: the selected
    members train as the same masks on the unrolled blocks; the others keep their update."""
    grads = _gradients(MODEL, steps=2)
    members = ft.optim.masked(ft.optim.per_member(optax.lamb(0.05)), ft.mask(MODEL, "blocks.1.*"))
    got, _ = _train(members, MODEL, grads)
    unrolled = _unrolled(MODEL)
    want, _ = _train(ft.optim.masked(optax.lamb(0.05), ft.mask(unrolled, "blocks.layers.1.*")), unrolled,
                     [_unrolled(g) for g in grads])
    assert_close_trained(got, _restacked(want), spread=0.0)  # measured 0: one float32 rounding
    whole = optax.masked(ft.optim.per_member(optax.lars(0.05)), {"blocks": True, "head": False})
    got, _ = _train(whole, MODEL, grads)
    want, _ = _train(optax.masked(optax.lars(0.05), {"blocks": True, "head": False}), unrolled,
                     [_unrolled(g) for g in grads])
    assert_close_trained(got, _restacked(want), spread=0.0)  # measured 0: one float32 rounding


class Outer(ft.nn.Layer):
    inner: ft.nn.Stack

    def __init__(self, *, key):
        self.inner = ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, key=k), 2, key=key)

    def __call__(self, x):
        return self.inner(x)


def test_nested_stacks_train_as_every_block_unrolled():
    """A Stack of blocks holding a Stack ([2, 2, ...] leaves): every inner member its own
    tensor, as the per-member flat dict (ft.to_flat_dict(unstack=True)) trained leaf by leaf."""
    params = {"outer": ft.nn.Stack(lambda k: Outer(key=k), 2, key=jax.random.key(3))}
    grads = [jax.tree.map(lambda x, s=s: jnp.cos(x * (3.0 + s)) * (1.0 + jnp.arange(x.size, dtype=x.dtype)
                                                                     .reshape(x.shape)), params) for s in range(2)]
    got, _ = _train(ft.optim.per_member(optax.lamb(0.05)), params, grads)
    flat = ft.to_flat_dict(params, unstack=True)
    assert "outer.1.inner.0.weight" in flat
    want, _ = _train(optax.lamb(0.05), flat, [ft.to_flat_dict(g, unstack=True) for g in grads])
    assert_close_trained(ft.to_flat_dict(got, unstack=True), want, spread=0.0)  # measured 0: one float32 rounding


def test_an_ensemble_trains_inside_vmap_and_is_refused_outside():
    """A batch of models (jax.vmap): inside jax.vmap each model's Stack has [n, ...] leaves
    and per_member takes each member's statistic; given the ensemble whole, per_member cannot
    tell the batch axis from the members' and refuses, naming jax.vmap."""
    ensemble = jax.vmap(lambda k: ft.nn.Stack(lambda kk: ft.nn.Dense(3, 3, key=kk), 2, key=k))(
        jax.random.split(jax.random.key(5), 2))
    tx = ft.optim.per_member(optax.lamb(0.05))
    with pytest.raises(ValueError) as e:
        tx.init(ensemble)
    assert str(e.value) == ENSEMBLE_MEMBERS.format(path="<root>", n=2, leaf="layers.weight", shape=(2, 2, 3, 3))
    g = jax.tree.map(lambda x: jnp.sin(3.0 * x), ensemble)
    with jax.numpy_dtype_promotion("standard"):
        u, _ = jax.vmap(lambda p, g: tx.update(g, tx.init(p), p))(ensemble, g)
        model1 = jax.tree.map(lambda x: x[1], ensemble)
        members = list(model1)
        ref = optax.lamb(0.05)
        want, _ = ref.update(list(jax.tree.map(lambda x: x[1], g)), ref.init(members), members)
    assert_close_trained(u.layers.weight[1, 0], want[0].weight, spread=0.0)  # measured 0


def test_extra_arguments_pass_through_expanded():
    """Optax's extra arguments reach the transform: a tree shaped like the updates (L-BFGS'
    grad=) expanded as they are, value_fn given the parameters stacked, others as given."""
    seen = {}

    def update(updates, state, params=None, **extra):
        seen.update(extra)
        return updates, state

    probe = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = ft.optim.per_member(probe)
    grads = _gradients(MODEL, steps=1)[0]
    tx.update(grads, tx.init(MODEL), MODEL, grad=grads, value_fn=lambda p: p["blocks"].n, loss=1.5)
    assert seen["loss"] == 1.5
    assert isinstance(seen["grad"]["blocks"], tuple) and len(seen["grad"]["blocks"]) == 3
    assert seen["value_fn"](expand(MODEL)) == 3


def test_through_the_optimizer_with_its_context():
    """In an ft.optim.Optimizer (context=, loss= extra arguments; a jitted minimize), per_member
    with an ft.optim schedule inside trains as the unrolled blocks."""
    x = jax.random.normal(jax.random.key(7), (5, 4))

    def loss_fn(m, x):
        return jnp.mean(m["head"](m["blocks"](x)) ** 2)

    def fit(opt, model):
        state = opt.init(model)
        step = jax.jit(lambda m, s: opt.minimize(loss_fn, m, s, x))
        for _ in range(2):
            model, state, _ = step(model, state)
        return model

    rate = ft.optim.piecewise([(1, 0.05), (1, 0.02)])  # (lars(-1.0): its direction, sgd's -rate after it;
    # lars(1.0)'s -1.0 times sgd's -rate climbed, refused now)
    got = fit(ft.optim.Optimizer(optax.chain(ft.optim.per_member(optax.lars(-1.0)), ft.optim.sgd(rate))), MODEL)
    want = fit(ft.optim.Optimizer(optax.chain(optax.lars(-1.0), ft.optim.sgd(rate))), _unrolled(MODEL))
    assert_close_trained(got, _restacked(want), spread=0.0)  # measured 0 (jitted): one float32 rounding


REFUSED = [
    ("optax.lamb", lambda: optax.lamb(1e-3), "trust ratio"),
    ("optax.lars in a chain", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.lars(1e-3)), "trust ratio"),
    ("inject_hyperparams(optax.lamb)", lambda: optax.inject_hyperparams(optax.lamb)(learning_rate=0.1), "trust ratio"),
    ("MultiSteps(optax.adafactor)", lambda: optax.MultiSteps(optax.adafactor(1e-3), 2), "Adafactor"),
    ("clip_by_block_rms", lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-3)), "clip_by_block_rms"),
    ("a group", lambda: ft.optim.groups({"*.weight": optax.lamb(1e-3)}, default=ft.optim.adam(1e-3)), "trust ratio"),
    ("muon", lambda: optax.contrib.muon(1e-3), "Muon"),
    ("novograd", lambda: optax.novograd(1e-3), "NovoGrad"),
]


@pytest.mark.parametrize("make, what", [(m, w) for _, m, w in REFUSED], ids=[n for n, _, _ in REFUSED])
def test_the_optimizer_refuses_a_per_tensor_transform_on_a_stack(make, what):
    params = {"encoder": MODEL}
    with pytest.raises(ValueError, match="takes a statistic per tensor") as e:
        ft.optim.Optimizer(make()).init(params)
    message = str(e.value)
    assert what in message and "'encoder.blocks'" in message and "3 members" in message
    assert "ft.optim.per_member(" in message and "ft.optim.whole_stack(" in message
    assert "model = ft.set(model, 'encoder.blocks', ft.get(model, 'encoder.blocks').unstack())" in message


def test_the_refusal_names_the_fixes():
    with pytest.raises(ValueError) as e:
        ft.optim.Optimizer(optax.lamb(1e-3)).init(MODEL)
    what = ("the trust ratio ‖w‖ / ‖u‖ of optax.scale_by_trust_ratio (in optax.lamb, optax.lars, "
            "optax.fromage)")
    assert str(e.value) == PER_TENSOR_ON_STACK.format(
        found=what, path="blocks", n=3, example="optax.lamb(1e-3)",
        unroll="model = ft.set(model, 'blocks', ft.get(model, 'blocks').unstack())")


def test_a_per_tensor_state_is_refused_where_the_update_is_opaque():
    """adafactor behind a jitted update (no closure to walk): its FactoredState shows it."""
    ada = optax.adafactor(1e-3)
    with pytest.raises(ValueError, match="Adafactor's second moments"):
        ft.optim.Optimizer(optax.GradientTransformation(ada.init, jax.jit(ada.update))).init(MODEL)


@pytest.mark.parametrize("tx", [
    ft.optim.per_member(optax.lamb(1e-3)),
    optax.chain(optax.clip_by_global_norm(1.0), ft.optim.per_member(optax.adafactor(1e-3))),
    ft.optim.whole_stack(optax.lamb(1e-3)),
    ft.optim.whole_stack(optax.adafactor(1e-3)),
    optax.adamw(1e-3),
], ids=["per_member", "per_member in a chain", "whole_stack", "whole_stack state", "elementwise"])
def test_the_optimizer_takes_what_trains_a_stack_as_meant(tx):
    ft.optim.Optimizer(tx).init(MODEL)


def test_a_model_without_a_trained_stack_is_not_refused():
    """Per-tensor statistics without a Stack, or with the Stack left out by wrt=, are the
    unrolled numbers already."""
    ft.optim.Optimizer(optax.lamb(1e-3)).init({"head": MODEL["head"]})
    ft.optim.Optimizer(optax.lamb(1e-3), wrt="head.*").init(MODEL)


def test_whole_stack_changes_no_number():
    grads = _gradients(MODEL, steps=2)
    got, state = _train(ft.optim.whole_stack(optax.lamb(0.05)), MODEL, grads)
    want, _ = _train(optax.lamb(0.05), MODEL, grads)
    assert isinstance(state, ft.optim.WholeStackState)
    assert_close_trained(got, want, spread=0.0, margin=0.0)  # the same program


def test_a_mask_tree_of_the_stacked_model_inside_is_refused_naming_the_fix():
    """Inside per_member a Stack is a tuple of members: a mask tree of the stacked model does
    not fit, and the Optimizer's own reading (a model in training mode) would mislead."""
    inside = ft.optim.per_member(optax.masked(optax.lamb(1e-3), ft.mask(MODEL, "blocks.*")))
    with pytest.raises(ValueError, match=r"inside ft\.optim\.per_member refused") as e:
        ft.optim.Optimizer(inside).init(MODEL)
    assert "training mode" not in str(e.value)
    assert "right:  ft.optim.masked(ft.optim.per_member(tx), ft.mask(model, \"blocks.*\"))" in str(e.value)
    by_function = ft.optim.per_member(optax.masked(optax.lamb(0.05), lambda params: ft.mask(params, "blocks.*")))
    grads = _gradients(MODEL, steps=1)
    got, _ = _train(by_function, MODEL, grads)
    want, _ = _train(optax.masked(optax.lamb(0.05), {"blocks": True, "head": False}), _unrolled(MODEL),
                     [_unrolled(g) for g in grads])
    assert_close_trained(got, _restacked(want), spread=0.0)  # measured 0: one float32 rounding


def test_masked_takes_key_path_patterns_as_freeze_and_wrt_do():
    """masked(tx, "head.*") read the string as one truthy mask leaf, a prefix selecting every
    parameter: the clip below clipped ``body`` too, over both norms, silently; a tuple of
    patterns failed inside JAX. A pattern (or several) is ft.mask of the parameters now,
    and one that names nothing is refused by ft.mask's error."""
    params = {"head": {"w": jnp.ones(2)}, "body": {"w": jnp.ones(2)}, "tail": {"w": jnp.ones(2)}}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 10.0), params)

    def clipped(mask):
        tx = ft.optim.masked(ft.optim.clip_by_global_norm(1.0), mask)
        return tx.update(grads, tx.init(params), params)[0]

    one = clipped("head.*")
    np.testing.assert_allclose(one["head"]["w"], np.full(2, 0.5 ** 0.5), rtol=0, atol=1e-7)
    np.testing.assert_array_equal(one["body"]["w"], np.full(2, 10.0))  # (was clipped to 0.5)
    for mask in (("head.*", "tail.*"), ["head.*", "tail.*"]):
        two = clipped(mask)
        np.testing.assert_allclose(two["tail"]["w"], np.full(2, 0.5), rtol=0, atol=1e-7)  # the norm over both
        np.testing.assert_array_equal(two["body"]["w"], np.full(2, 10.0))
    reference = clipped(ft.mask(params, "head.*"))
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="neck"):
        clipped("neck.*")
