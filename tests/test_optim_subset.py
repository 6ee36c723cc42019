"""Training a subset of the parameters: Optimizer(wrt=) and Trainer(wrt=)."""

import fnmatch

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close_trained

import functree as ft


class Net(ft.Module):
    encoder: ft.nn.Dense
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(jnp.tanh(self.encoder(x)))


def net():
    k1, k2 = jax.random.split(jax.random.key(0))
    return Net(ft.nn.Dense(3, 4, key=k1), ft.nn.Dense(4, 1, key=k2))


X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
Y = np.random.default_rng(1).normal(size=(16, 1)).astype(np.float32)


def mse(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def test_frozen_parameters_get_no_state_and_stay_bit_identical():
    model = net()
    opt = ft.optim.Optimizer(ft.optim.adam(1e-2), wrt="encoder.*")
    state = opt.init(model)
    mu = ft.optim.moments(state)["mu"]
    assert mu.head.weight is None and mu.head.bias is None  # absent, not zeros
    assert mu.encoder.weight.shape == (3, 4)
    full = ft.optim.Optimizer(ft.optim.adam(1e-2)).init(model)
    size = lambda s: sum(x.size for x in jax.tree.leaves(s))  # noqa: E731
    assert size(full) - size(state) == 2 * (4 * 1 + 1)  # head's mu and nu
    step = ft.jit(lambda m, s: opt.minimize(mse, m, s, X, Y), donate=(0, 1))
    trained = net()  # the same values in buffers of its own, donated (net() is deterministic)
    for _ in range(5):
        trained, state, _ = step(trained, state)
    np.testing.assert_array_equal(trained.head.weight, model.head.weight)
    np.testing.assert_array_equal(trained.head.bias, model.head.bias)
    assert not np.array_equal(trained.encoder.weight, model.encoder.weight)
    assert ft.optim.moments(state)["mu"].head.weight is None


def test_equal_to_gradient_wrt_and_a_manual_optax_loop():
    params = jax.device_put({"encoder": {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)},
                             "head": {"w": np.full((2, 1), 0.5, np.float32)}})

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["encoder"]["w"] + p["encoder"]["b"][None, :]) @ p["head"]["w"] - y) ** 2)

    tx = optax.adam(1e-2)

    # each loop's 4 steps in one program (eagerly, each of their ~45 operations compiled apart)
    @jax.jit
    def manual_loop(manual):
        s = tx.init(manual["encoder"])
        for _ in range(4):
            g = ft.gradient(loss, wrt="encoder.*")(manual, X, Y)
            assert g["head"]["w"] is None
            with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int counts
                u, s = tx.update(g["encoder"], s, manual["encoder"])
            manual = {**manual, "encoder": optax.apply_updates(manual["encoder"], u)}
        return manual

    opt = ft.optim.Optimizer(tx, wrt="encoder.*")

    @jax.jit
    def optimizer_loop(p):
        state = opt.init(p)
        for _ in range(4):
            p, state, _ = opt.minimize(loss, p, state, X, Y)
        return p

    p, manual = optimizer_loop(params), manual_loop(params)
    # the same operations in the same order: equal to float32 rounding of O(1) values
    # (measured: bit for bit under every XLA CPU instruction set, jitted or both eager)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), p, manual)
    np.testing.assert_array_equal(p["head"]["w"], params["head"]["w"])


def test_full_gradients_from_a_custom_hook_leave_frozen_parameters_alone():
    model = net()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="head")
    grads = jax.tree.map(jnp.ones_like, ft.parameters(model))  # every parameter
    updates, _ = opt.update(grads, opt.init(model), model)
    assert updates.encoder.weight is None
    np.testing.assert_allclose(updates.head.weight, -0.1)


def test_trainer_trains_the_subset():
    data = ft.train.batches((X, Y), batch_size=8, shuffle=False)
    loss_fn = lambda m, b: mse(m, *b)  # noqa: E731
    by_trainer = ft.train.Trainer(net(), ft.optim.adam(1e-2), loss_fn, wrt="encoder.*")
    by_optimizer = ft.train.Trainer(net(), ft.optim.Optimizer(ft.optim.adam(1e-2), wrt="encoder.*"), loss_fn)
    for t in (by_trainer, by_optimizer):
        t.fit(data, epochs=2, progress=False)
        np.testing.assert_array_equal(t.model.head.weight, net().head.weight)
        assert not np.array_equal(t.model.encoder.weight, net().encoder.weight)
    assert by_trainer.optimizer.wrt == ("encoder.*",)
    np.testing.assert_array_equal(by_trainer.model.encoder.weight, by_optimizer.model.encoder.weight)
    wrapped = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(0.1)))
    t = ft.train.Trainer(net(), wrapped, loss_fn, wrt="head.*")
    assert t.optimizer.wrt == ("head.*",) and wrapped.wrt is None  # the given optimizer is not changed


def test_wrt_errors():
    with pytest.raises(TypeError, match=r"wrt= takes key-path patterns"):
        ft.optim.Optimizer(ft.optim.adam(), wrt=3)
    with pytest.raises(ValueError, match=r"wrt='decoder\.\*'\) selects no parameter") as info:
        ft.optim.Optimizer(ft.optim.adam(), wrt="decoder.*").init(net())
    assert "encoder.weight" in str(info.value)
    with pytest.raises(ValueError, match=r"already trains wrt=\('a\.\*',\)"):
        ft.train.Trainer(net(), ft.optim.Optimizer(ft.optim.adam(), wrt="a.*"), lambda m, b: 0.0, wrt="b.*")
    step = ft.train.TrainStep(lambda m, b: 0.0, ft.optim.adam())
    with pytest.raises(ValueError, match=r"cannot change a TrainStep instance's optimizer") as info:
        ft.train.Trainer(net(), ft.optim.adam(), lambda m, b: 0.0, train_step=step, wrt="encoder.*")
    assert "ft.optim.Optimizer(ft.optim.adam(1e-3), wrt='encoder.*')" in str(info.value)  # the user's patterns


def test_data_parallel_trainer_trains_the_subset_with_an_average():
    from _devices import run

    out = run("""
        import jax.numpy as jnp, numpy as np, functree as ft
        class Net(ft.Module):
            encoder: ft.nn.Dense
            head: ft.nn.Dense
            def __call__(self, x):
                return self.head(jnp.tanh(self.encoder(x)))
        net = Net(ft.nn.Dense(2, 4, key=jax.random.key(0)), ft.nn.Dense(4, 1, key=jax.random.key(1)))
        x = np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32)
        mesh = jax.make_mesh((2,), ("data",))
        opt = ft.optim.Optimizer(ft.optim.adam(1e-2), average=ft.optim.ema(0.9))
        t = ft.train.Trainer(net, opt, lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), mesh=mesh, wrt="head.*")
        t.fit(ft.train.batches((x, x[:, :1]), batch_size=8), epochs=2, progress=False)
        report({"frozen": bool((t.model.encoder.weight == net.encoder.weight).all()),
                "trained": bool((t.model.head.weight != net.head.weight).any()),
                "averaged": bool((t.averaged_model.head.weight != t.model.head.weight).any())})
    """, devices=2)
    assert out == {"frozen": True, "trained": True, "averaged": True}


@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_a_non_finite_gradient_is_named_among_the_trained_parameters(on_nan):
    # The gradients of Optimizer(wrt=) hold the trained parameters only: the first
    # non-finite one is named from those, not from the whole model.
    def loss_fn(m, b):
        return mse(m, *b) + jnp.sqrt(0.0 * m.head.bias[0])  # finite loss, NaN gradient of head.bias

    trainer = ft.train.Trainer(net(), ft.optim.adam(1e-2), loss_fn, wrt="head.*", on_nan=on_nan)
    data = ft.train.batches((X, Y), batch_size=8, shuffle=False)
    if on_nan == "stop":
        with pytest.raises(ft.train.NonFiniteError, match=r"the gradient of parameter 'head\.bias'"):
            trainer.fit(data, progress=False)
    else:
        trainer.fit(data, progress=False)
        assert trainer.skipped and {what for _, what in trainer.skipped} == {"the gradient of parameter 'head.bias'"}


# ------------------------------------------------------------------ members of a Stack
class Deep(ft.Module):
    embed: ft.nn.Dense
    h: ft.nn.Stack
    head: ft.nn.Dense

    def __call__(self, x):
        return self.head(self.h(self.embed(x)))


def deep(n=4):
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    return Deep(ft.nn.Dense(3, 4, key=k1), ft.nn.Stack(lambda k: ft.nn.Dense(4, 4, jnp.tanh, key=k), n, key=k2),
                ft.nn.Dense(4, 1, key=k3))


SELECTED = np.array([False, True, True, False])  # wrt="h.[1-2].*"


@pytest.mark.parametrize("tx", [lambda: ft.optim.adamw(1e-2, weight_decay=0.1),
                                lambda: ft.optim.sgd(0.05, momentum=0.9, weight_decay=0.01)],
                         ids=["adamw", "sgd-momentum-l2"])
def test_members_not_selected_stay_bit_identical_and_their_moments_do_not_move(tx):
    model = deep()
    opt = ft.optim.Optimizer(tx(), wrt="h.[1-2].*")
    state = opt.init(model)
    first = jax.tree.map(np.array, ft.optim.moments(state))  # host copies
    step = ft.jit(lambda m, s: opt.minimize(mse, m, s, X, Y))
    trained = model
    for _ in range(20):
        trained, state, _ = step(trained, state)
    for name in ("weight", "bias"):  # (NumPy's indexing: no gather compiled per shape)
        before, after = np.asarray(getattr(model.h.layers, name)), np.asarray(getattr(trained.h.layers, name))
        np.testing.assert_array_equal(after[~SELECTED], before[~SELECTED])
        assert not np.array_equal(after[SELECTED], before[SELECTED])
        for moment, tree in ft.optim.moments(state).items():
            old, new = getattr(first[moment].h.layers, name), np.asarray(getattr(tree.h.layers, name))
            np.testing.assert_array_equal(new[~SELECTED], old[~SELECTED])
    np.testing.assert_array_equal(trained.embed.weight, model.embed.weight)
    np.testing.assert_array_equal(trained.head.weight, model.head.weight)
    assert ft.optim.moments(state)["mu" if "mu" in ft.optim.moments(state) else "trace"].head.weight is None


SPREAD = 8e-8  # measured 7.9e-8 under AVX2 and AVX512, 0 under SSE4_2 and AVX


def test_selected_members_train_as_a_hand_masked_optax_update():
    model = deep()
    opt = ft.optim.Optimizer(ft.optim.adamw(1e-2, weight_decay=0.1), wrt="h.[1-2].*")
    state = opt.init(model)
    tx = ft.optim.adamw(1e-2, weight_decay=0.1)  # the same transform, on the stack alone, by hand
    stack = model.h
    hand_state = tx.init(stack)
    keep = jnp.asarray(SELECTED)

    def masked(tree):
        return jax.tree.map(lambda x: jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0), tree)

    def step(_, carry):
        model, state, stack, hand_state = carry
        grads = ft.gradient(lambda h: mse(model.replace(h=h), X, Y), at=stack)
        updates, hand_state = tx.update(masked(grads), hand_state, stack)
        stack = ft.move(stack, along=masked(updates))
        model, state, _ = opt.minimize(mse, model, state, X, Y)
        return model, state, stack, hand_state

    # both loops' 10 steps in one compiled program (eager, the Stack's scan compiled anew at
    # every call: 40 compiles)
    model, _, stack, _ = jax.jit(lambda *c: jax.lax.fori_loop(0, 10, step, c))(model, state, stack, hand_state)
    # The same operations, but compiled in one program XLA fuses each path its own way: equal
    # to float32 rounding, not bit for bit (measured scaled error SPREAD under every XLA CPU
    # instruction set). A wrong mask or moment differs by ~1e-3 (steps of lr 1e-2).
    assert_close_trained(model.h.layers, stack.layers, spread=SPREAD)


def test_trainer_and_gradients_with_member_patterns():
    model = deep()
    grads = ft.gradient(lambda m: mse(m, X, Y), wrt="h.[1-2].*")(model)
    np.testing.assert_array_equal(np.asarray(grads.h.layers.weight)[~SELECTED], np.zeros((2, 4, 4)))
    assert grads.embed.weight is None
    trainer = ft.train.Trainer(model, ft.optim.adam(1e-2), lambda m, b: mse(m, *b), wrt="h.3")
    trainer.fit(ft.train.batches((X, Y), batch_size=8, shuffle=False), epochs=1, progress=False)
    after, before = np.asarray(trainer.model.h.layers.weight), np.asarray(model.h.layers.weight)
    np.testing.assert_array_equal(after[:3], before[:3])
    assert not np.array_equal(after[3], before[3])


def test_member_pattern_errors():
    with pytest.raises(ValueError, match=r"'h\.9\.\*' names member 9 of 'h', which holds 4 members \(0 to 3\)"):
        ft.optim.Optimizer(ft.optim.adam(), wrt="h.9.*").init(deep())
    with pytest.raises(ValueError, match=r"wrt='hx\.1\.\*'\) selects no parameter(.|\n)*'h\.1\.weight'"):
        ft.optim.Optimizer(ft.optim.adam(), wrt="hx.1.*").init(deep())


@pytest.fixture(scope="module")
def bert():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    return ft.nn.from_hf(transformers.BertModel(config).eval())


@pytest.mark.parametrize(("written", "right"), [
    ("*.attention.self.value.*", "encoder.layer.*.attention.value_projection.*"),
    ("encoder.layer.*.attention.self.query.weight", "encoder.layer.*.attention.query_projection.weight"),
    ("encoder.layer.1.output.dense.*", "encoder.layer.1.output.*"),
    ("pooler.dense.*", "pooler.*"),
])
def test_a_pattern_in_hugging_faces_names_gets_functrees_pattern_of_the_same_parameters(bert, written, right):
    """A from_hf BERT's wrt= written with HF's module names: the fix is the functree pattern
    selecting the very parameters HF's names do. Before, a fuzzy match of one part at a time:
    'encoder.layer.1.attention_norm.scale' for '*.attention.self.value.*', layer 1 alone for
    'encoder.layer.*...', 'pooler.bias' (the weight dropped) for 'pooler.dense.*'."""
    model = bert
    with pytest.raises(ValueError) as error:
        ft.optim.Optimizer(optax.sgd(0.1), wrt=written).init(model)
    assert f'right:  ft.optim.Optimizer(tx, wrt="{right}")  # Hugging Face\'s {written!r}' in str(error.value)
    with pytest.raises(ValueError) as by_gradient:  # the naming layer's fix: every wrt= and selection's
        ft.gradient(lambda m: 0.0, at=model, wrt=written)
    assert f"right:  wrt={right!r}" in str(by_gradient.value)
    # the fix trains what HF's names select: one step, read back in HF's names
    opt = ft.optim.Optimizer(optax.sgd(1e4), wrt=right)  # (HF's 0.02-scale weights: tiny query gradients)
    ids = np.asarray([[1, 5, 7, 2]], np.int32)

    def loss(m, x):
        hidden = m(x)
        return jnp.sum(jnp.square(hidden)) + jnp.sum(jnp.square(m.pooler(hidden[:, 0])))

    # one program (eagerly, each operation of BERT's forward and backward compiled apart)
    stepped = ft.jit(lambda m, s: opt.minimize(loss, m, s, ids)[0])(model, opt.init(model))
    before, after = ft.hf.to_hf_state_dict(model, numpy=True), ft.hf.to_hf_state_dict(stepped, numpy=True)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == {k for k in before if fnmatch.fnmatchcase(k, written)} != set()


def test_a_pattern_close_to_no_name_says_its_example_is_one_to_choose_from():
    with pytest.raises(ValueError, match=r'wrt="[a-z.]+"\)  # a name above \(no parameter\'s name is close\)'):
        ft.optim.Optimizer(optax.sgd(0.1), wrt="zzz.qqq").init(net())
