"""ft.nn.Shared: weight tying that stays tied; ft.AliasWarning for an accidental alias."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft

VOCAB, WIDTH = 6, 3
TOKENS = jnp.array([[0, 1, 2, 3], [4, 5, 0, 2]])
TARGETS = jnp.array([[1, 2, 3, 4], [5, 0, 2, 1]])


class LM(ft.Module):
    embed: ft.nn.Embedding
    head: ft.nn.Dense

    def __call__(self, tokens):
        return self.head(jnp.tanh(self.embed(tokens)))


def tied_lm(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    model = LM(ft.nn.Embedding(VOCAB, WIDTH, key=k1), ft.nn.Dense(WIDTH, VOCAB, key=k2))
    return ft.nn.Shared(model, {"head.weight": ("embed.embeddings", jnp.transpose)})


def lm_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


def loss_of_matrix(e, bias, batch):
    """The same loss written by hand with one matrix ``e`` used at both places."""
    tokens, targets = batch
    logits = jnp.tanh(e[tokens]) @ e.T
    logits = logits + jax.lax.broadcast_to_rank(bias, logits.ndim)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


def test_one_leaf_and_the_gradient_is_the_sum_of_both_uses():
    lm = tied_lm()
    assert sorted(ft.to_flat_dict(lm)) == ["model.embed.embeddings", "model.head.bias"]
    grad = ft.gradient(lambda m: lm_loss(m, (TOKENS, TARGETS)), at=lm)
    # by hand: the untied model's two gradients, summed through the transpose
    full = lm.resolve()
    g = ft.gradient(lambda m: lm_loss(m, (TOKENS, TARGETS)), at=full)
    expected = g.embed.embeddings + g.head.weight.T
    np.testing.assert_allclose(grad.model.embed.embeddings, expected, rtol=1e-5, atol=1e-7)
    assert grad.model.head.weight is None
    # and against one matrix used twice in float64
    e = np.asarray(lm.model.embed.embeddings, np.float64)
    b = np.asarray(lm.model.head.bias, np.float64)
    with jax.enable_x64(True):
        ref = jax.grad(loss_of_matrix)(jnp.asarray(e), jnp.asarray(b), (TOKENS, TARGETS))
    np.testing.assert_allclose(grad.model.embed.embeddings, ref, rtol=1e-5, atol=1e-6)


def test_adam_steps_keep_the_tie_and_match_one_matrix():
    lm = tied_lm()
    e0, b0 = jnp.copy(lm.model.embed.embeddings), jnp.copy(lm.model.head.bias)
    opt = ft.optim.Optimizer(ft.optim.adam(0.05))
    step = ft.train.train_step(lm_loss, opt)
    state = opt.init(lm)
    for _ in range(4):
        lm, state, _ = step(lm, state, (TOKENS, TARGETS))
    full = lm.resolve()
    np.testing.assert_array_equal(full.head.weight, full.embed.embeddings.T)
    # reference: Adam by hand (float64 moments) on the single matrix and the bias
    params = [np.asarray(e0, np.float64), np.asarray(b0, np.float64)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    grad_fn = jax.grad(lambda e, b: loss_of_matrix(e, b, (TOKENS, TARGETS)), argnums=(0, 1))
    for t in range(1, 5):
        grads = grad_fn(jnp.asarray(params[0], jnp.float32), jnp.asarray(params[1], jnp.float32))
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            params[i] = params[i] - 0.05 * (m[i] / (1 - 0.9**t)) / (np.sqrt(v[i] / (1 - 0.999**t)) + 1e-8)
    np.testing.assert_allclose(lm.model.embed.embeddings, params[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lm.model.head.bias, params[1], rtol=1e-5, atol=1e-5)


def test_checkpoint_round_trip_keeps_one_array(tmp_path):
    lm = tied_lm()
    ft.train.save(tmp_path / "lm", lm)
    loaded = ft.train.load(tmp_path / "lm", template=tied_lm(seed=1))
    assert len(jax.tree.leaves(loaded)) == 2
    np.testing.assert_array_equal(loaded.model.embed.embeddings, lm.model.embed.embeddings)
    full = loaded.resolve()
    np.testing.assert_array_equal(full.head.weight, full.embed.embeddings.T)


def test_trainer_fits_a_tied_model():
    trainer = ft.train.Trainer(tied_lm(), ft.optim.adam(0.05), lm_loss)
    history = trainer.fit([(TOKENS, TARGETS)] * 4, epochs=5, progress=False)
    assert history.epochs["loss"][-1] < history.epochs["loss"][0]
    full = trainer.inference_model.resolve()
    np.testing.assert_array_equal(full.head.weight, full.embed.embeddings.T)
    assert trainer.predict([(TOKENS, TARGETS)]).shape == (2, 4, VOCAB)


class Pair(ft.Module):
    a: ft.nn.Dense
    b: ft.nn.Dense

    def __call__(self, x):
        return self.b(self.a(x))


def test_one_layer_at_two_fields_pytorch_style():
    layer = ft.nn.Dense(2, 2, key=jax.random.key(0))
    tied = ft.nn.Shared(Pair(layer, layer), {"b": "a"})
    assert tied.model.b is None and len(jax.tree.leaves(tied)) == 2
    assert "ties=((KeyPath('.b'), KeyPath('.a'), None),)" in repr(tied)
    x = jnp.ones((1, 2))
    np.testing.assert_allclose(tied(x), layer(layer(x)), rtol=1e-6)
    assert ft.nn.is_training(ft.nn.training(tied).resolve().b) is False  # Dense has no mode
    np.testing.assert_array_equal(tied.resolve().b.weight, layer.weight)


def test_accidental_alias_warns_naming_both_paths_and_unties():
    layer = ft.nn.Dense(2, 2, key=jax.random.key(0))
    with pytest.warns(ft.AliasWarning, match=r"'a.weight' and 'b.weight', 'a.bias' and 'b.bias'") as info:
        trainer = ft.train.Trainer(Pair(layer, layer), ft.optim.sgd(0.1),
                                   lambda m, batch: jnp.mean(m(batch) ** 2))
    assert "ft.nn.Shared(Model(a=layer, b=layer), {\"b.weight\": \"a.weight\"})" in str(info[0].message)
    trainer.fit([jnp.ones((4, 2))], steps=2, progress=False)  # donation works: copies apart
    assert not np.array_equal(trainer.model.a.weight, trainer.model.b.weight)


def test_no_warning_for_distinct_arrays():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.train.Trainer(Pair(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.Dense(2, 2, key=jax.random.key(1))),
                         ft.optim.sgd(0.1), lambda m, batch: jnp.mean(m(batch) ** 2))


def _pair_loss(m, x):
    return jnp.mean(m(x) ** 2)


@pytest.mark.parametrize("make", [lambda: ft.optim.adam(1e-3), lambda: ft.optim.Optimizer(optax.adam(1e-3))],
                         ids=["adam", "Optimizer"])
def test_a_hand_loop_is_told_of_an_accidental_alias_at_init_once(make, request):
    # The hand loop (init, gradient, update, ft.move) untied the two fields at its first
    # move without a word; only the train step and the Trainer warned.
    first, second = f"init_{request.node.callspec.id}_a", f"init_{request.node.callspec.id}_b"  # (new to ft.move)
    layer = ft.nn.Dense(2, 2, key=jax.random.key(0))
    model, opt, x = {first: layer, second: layer}, make(), jnp.ones((4, 2))
    with pytest.warns(ft.AliasWarning, match=rf"\.init holds one array object at several leaves: "
                                             rf"'{first}.weight' and '{second}.weight'") as caught:
        state = opt.init(model)
    assert len(caught) == 1 and caught[0].filename == __file__  # the user's init line, named once
    message = str(caught[0].message)
    assert "copied now" not in message and f'{{"{second}.weight": "{first}.weight"}}' in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop's first (eager) move, its alias check, says nothing more
        updates, state = jax.jit(lambda m, s: opt.update(
            ft.gradient(lambda m: _pair_loss(lambda v: m[second](m[first](v)), x), at=m), s, m))(model, state)
        model = ft.move(model, along=updates)
    assert not np.array_equal(model[first].weight, model[second].weight)  # what the warning is about


def test_a_train_step_after_init_does_not_warn_again_and_still_copies_apart():
    layer = ft.nn.Dense(2, 2, key=jax.random.key(0))
    model, opt = Pair(layer, layer), ft.optim.Optimizer(ft.optim.sgd(0.1))
    with pytest.warns(ft.AliasWarning, match=r"ft\.optim\.Optimizer\.init holds") as caught:
        state = opt.init(model)
    assert len(caught) == 1  # (the Optimizer's init, not again by the sgd inside it)
    step = ft.train.train_step(_pair_loss, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, state, _ = step(model, state, jnp.ones((4, 2)))  # donated: copied apart, no second warning
    assert model.a.weight is not model.b.weight


def test_a_plain_optax_hand_loop_is_told_at_its_first_move():
    layer = ft.nn.Dense(2, 2, key=jax.random.key(0))
    model = {"tied_move_a": layer, "tied_move_b": layer}  # (a structure ft.move has not seen)
    tx = optax.sgd(0.1)
    state = tx.init(ft.parameters(model))
    grads = {"tied_move_a": jax.tree.map(jnp.ones_like, ft.parameters(layer)),  # the two uses' gradients differ
             "tied_move_b": jax.tree.map(lambda v: -jnp.ones_like(v), ft.parameters(layer))}
    updates, state = tx.update(grads, state)
    with pytest.warns(ft.AliasWarning, match=r"The model given to ft\.move holds one array object at several "
                                             r"leaves: 'tied_move_a.weight' and 'tied_move_b.weight'") as caught:
        moved = ft.move(model, along=updates)
    assert len(caught) == 1 and caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.move(moved, along=updates)  # the moved model's tie is gone: nothing more to say


def test_a_second_model_of_the_same_structure_is_told_at_its_first_move():
    # The alias check ran at the first ft.move of each tree structure in the process: a
    # second model of that structure with its own tie (a notebook's new cell) was untied by
    # its first move without a word. Each model's first move holding a tie warns; its later
    # moves (and a repeated tie already named) do not.
    def fresh(seed):
        layer = ft.nn.Dense(2, 2, key=jax.random.key(seed))
        return {"cell_move_a": layer, "cell_move_b": layer}

    layer = ft.parameters(fresh(0)["cell_move_a"])  # the two uses' updates differ
    updates = {"cell_move_a": jax.tree.map(jnp.ones_like, layer), "cell_move_b": jax.tree.map(jnp.zeros_like, layer)}
    for seed in (0, 1):
        model = fresh(seed)
        with pytest.warns(ft.AliasWarning, match=r"The model given to ft\.move holds one array object at several "
                                                 r"leaves: 'cell_move_a.weight' and 'cell_move_b.weight'") as caught:
            moved = ft.move(model, along=updates)
        assert len(caught) == 1 and caught[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ft.move(moved, along=updates)
            ft.move(model, along=updates)  # (its tie named above)


def test_a_tie_moved_alike_stays_tied_and_warns_only_when_its_updates_differ():
    """A hand loop (opt.minimize, or opt.update and ft.move) whose tied layer is in a frozen
    group (ft.optim.freeze() or optax.set_to_zero()) was warned by ft.move that the tie is
    trained apart (AliasWarning), though both paths got zero updates: a tie whose paths get
    the same update stays one array; paths given different updates are warned of."""
    def loss(m, x):
        return jnp.mean(m["head"](m["tie_zero_b"](m["tie_zero_a"](x))) ** 2)

    def model():
        tied = ft.nn.Dense(2, 2, key=jax.random.key(0))
        return {"tie_zero_a": tied, "tie_zero_b": tied, "head": ft.nn.Dense(2, 2, key=jax.random.key(1))}

    x = jnp.ones((3, 2))
    for frozen in (ft.optim.freeze(), optax.set_to_zero()):
        opt = ft.optim.Optimizer(ft.optim.groups({"head.*": ft.optim.sgd(0.1)}, default=frozen))
        start = model()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ft.AliasWarning)
            state = opt.init(start)
            trained, state, _ = opt.minimize(loss, start, state, x)
            updates, _ = opt.update(ft.gradient(lambda m: loss(m, x), at=trained), state, trained)
            moved = ft.move(trained, along=updates)
        assert moved["tie_zero_a"].weight is moved["tie_zero_b"].weight  # still one array
        np.testing.assert_array_equal(moved["tie_zero_a"].weight, start["tie_zero_a"].weight)
        assert not np.array_equal(moved["head"].weight, start["head"].weight)
    untied = model()  # trained at both paths (a plain optax loop): different gradients, untied
    updates = jax.tree.map(lambda g: -0.1 * g, ft.gradient(lambda m: loss(m, x), at=untied))
    with pytest.warns(ft.AliasWarning, match=r"ft\.move .*'tie_zero_a.weight' and 'tie_zero_b.weight'"):
        moved = ft.move(untied, along=updates)
    assert moved["tie_zero_a"].weight is not moved["tie_zero_b"].weight


def test_no_hand_loop_warning_for_shared_or_for_equal_distinct_arrays():
    layer = ft.nn.Dense(2, 2, key=jax.random.key(0))
    tied = ft.nn.Shared(Pair(layer, layer), {"b": "a"})
    equal = {"equal_move_a": layer, "equal_move_b": jax.tree.map(jnp.copy, layer)}  # (new to ft.move)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model in (tied, equal):
            ft.optim.adam(1e-3).init(model)
            ft.optim.Optimizer(optax.sgd(0.1)).init(model)
            ft.move(model, along=jax.tree.map(jnp.zeros_like, ft.parameters(model)))


class _Block(ft.Module):
    weight: jax.Array
    table: jax.Array = ft.field(no_derivative=True)  # a buffer (torch's register_buffer)

    def __call__(self, x):
        return jnp.tanh(x @ self.weight) * jnp.cos(self.table).sum()


def test_one_buffer_shared_by_every_block_is_no_alias_to_warn_of():
    # The train step, the Trainer and a donating ft.jit warned of a no_derivative table (a
    # rotary table) or a bool mask given to every block as "trained as independent copies":
    # nothing trains them, so they stay equal. Only a parameter's repeat warns.
    def model():
        table, mask = jnp.linspace(0.0, 1.0, 2), jnp.tril(jnp.ones((2, 2), bool))
        return {"a": _Block(jnp.eye(2), table), "b": _Block(2 * jnp.eye(2), table), "m1": mask, "m2": mask}

    def loss(m, x):
        return jnp.mean(m["b"](m["a"](x)) ** 2)

    x = jnp.ones((4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ft.AliasWarning)
        step = ft.train.train_step(loss, ft.optim.sgd(0.1))
        trained, _, _ = step(model(), step.optimizer.init(model()), x)  # donated: copied apart silently
        ft.train.Trainer(model(), ft.optim.sgd(0.1), loss).fit([x], steps=1, progress=False)
        ft.jit(lambda m, x: (m, loss(m, x)), donate=0)(model(), x)
    np.testing.assert_array_equal(trained["a"].table, trained["b"].table)
    mixed = model()
    mixed["b"] = _Block(mixed["a"].table, mixed["a"].table)  # a parameter holding the buffer: trained apart
    with pytest.warns(ft.AliasWarning, match=r"'a.table' and 'b.weight'"):
        step(mixed, step.optimizer.init(mixed), x)


def test_a_layer_at_two_fields_that_wrt_leaves_frozen_is_no_alias_to_warn_of():
    # Optimizer(wrt="head.*").init, its train step and the Trainer warned of a frozen
    # encoder placed at two fields as "trained as independent copies": nothing moves it, so
    # the two stay one value. A tie of which wrt= trains a leaf still warns.
    def model():
        encoder = ft.nn.Dense(2, 2, key=jax.random.key(0))
        return {"enc_a": encoder, "enc_b": encoder, "head": ft.nn.Dense(2, 2, key=jax.random.key(1))}

    def loss(m, x):
        return jnp.mean(m["head"](m["enc_b"](m["enc_a"](x))) ** 2)

    x, head_only = jnp.ones((4, 2)), ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="head.*")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ft.AliasWarning)
        step = ft.train.train_step(loss, head_only)
        trained, _, _ = step(model(), head_only.init(model()), x)
        ft.train.Trainer(model(), ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="head.*"), loss).fit(
            [x], steps=1, progress=False)
    np.testing.assert_array_equal(trained["enc_a"].weight, trained["enc_b"].weight)
    with pytest.warns(ft.AliasWarning, match=r"'enc_a.weight' and 'enc_b.weight'"):
        ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="enc_a.*").init(model())


def test_a_layer_at_two_fields_that_a_freeze_group_leaves_frozen_is_no_alias_to_warn_of():
    # A tie frozen through ft.optim.groups(..., default=ft.optim.freeze()) (or a freeze()
    # group per field, or ft.optim.masked around freeze()) was warned of by Optimizer.init,
    # the train step and the Trainer, although nothing unties it; wrt= was already not.
    # Read from the groups' labels by key path: a tie of which a group trains a leaf warns.
    def model():
        encoder = ft.nn.Dense(2, 2, key=jax.random.key(0))
        return {"enc_a": encoder, "enc_b": encoder, "head": ft.nn.Dense(2, 2, key=jax.random.key(1))}

    def loss(m, x):
        return jnp.mean(m["head"](m["enc_b"](m["enc_a"](x))) ** 2)

    x, head = jnp.ones((4, 2)), {"head.*": ft.optim.sgd(0.1)}
    frozen_by = [ft.optim.groups(head, default=ft.optim.freeze()),
                 ft.optim.groups({**head, "enc_a.*": ft.optim.freeze(), "enc_b.*": ft.optim.freeze()}),
                 ft.optim.groups(head, default=ft.optim.freeze("enc_a.*", "enc_b.*")),
                 ft.optim.masked(ft.optim.freeze(), ("enc_a.*", "enc_b.*"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ft.AliasWarning)
        for tx in frozen_by:
            ft.optim.Optimizer(tx).init(model())
        step = ft.train.train_step(loss, frozen_by[0])
        trained, _, _ = step(model(), step.optimizer.init(model()), x)
        ft.train.Trainer(model(), frozen_by[0], loss).fit([x], steps=1, progress=False)
    np.testing.assert_array_equal(trained["enc_a"].weight, trained["enc_b"].weight)
    moved_by = [ft.optim.groups({**head, "enc_a.*": ft.optim.freeze()}, default=ft.optim.sgd(0.1)),
                ft.optim.groups(head, default=ft.optim.freeze("enc_a.*")),  # enc_b: freeze's pass-through
                ft.optim.masked(ft.optim.freeze(), "enc_a.*")]
    for tx in moved_by:
        with pytest.warns(ft.AliasWarning, match=r"'enc_a.weight' and 'enc_b.weight'"):
            ft.optim.Optimizer(tx).init(model())


def _right_code(message):
    """The code of an error message's ``right:`` line, as the user would paste it."""
    return next(line for line in message.splitlines() if "right:" in line).split("right:", 1)[1].strip()


def test_an_untransposed_tie_suggests_the_transpose_and_the_fix_matches_the_hand_written_model():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = LM(ft.nn.Embedding(VOCAB, WIDTH, key=k1), ft.nn.Dense(WIDTH, VOCAB, key=k2))
    with pytest.raises(ValueError) as info:
        ft.nn.Shared(model, {"head.weight": "embed.embeddings"})
    message = str(info.value)
    assert message.startswith("ft.nn.Shared: the tie") and "ft.set" not in message
    assert "jnp.transpose" in _right_code(message) and "reshape" not in _right_code(message)
    tied = eval(_right_code(message))  # the message's right: line, pasted
    e = np.asarray(model.embed.embeddings, np.float32)
    expected = np.tanh(e[np.asarray(TOKENS)]) @ e.T + np.asarray(model.head.bias)
    np.testing.assert_allclose(np.asarray(tied(TOKENS)), expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_a_tie_of_another_dtype_suggests_the_cast():
    model = {"e": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(3, 2), "f": jnp.zeros((2, 3))}
    with pytest.raises(ValueError) as info:
        ft.nn.Shared(model, {"f": "e"})
    tied = eval(_right_code(str(info.value)))  # ("e", lambda w: w.T.astype(jnp.float32))
    np.testing.assert_array_equal(tied.resolve()["f"], np.arange(6.0, dtype=np.float32).reshape(3, 2).T)


def test_a_tie_of_another_shape_is_refused_by_shared_naming_the_leaf():
    pair = Pair(ft.nn.Dense(4, 4, key=jax.random.key(0)), ft.nn.Dense(4, 5, key=jax.random.key(1)))
    with pytest.raises(ValueError, match=r"puts shape \(4, 4\) .* at b\.weight, which holds shape \(4, 5\)"):
        ft.nn.Shared(pair, {"b": "a"})  # the whole layer: once silently a Dense(4, 4) at b
    with pytest.raises(ValueError, match=r'right:  ft\.nn\.Shared\(model, \{"b\.weight": \("a\.weight", transform\)\}\)'):
        ft.nn.Shared(pair, {"b.weight": ("a.weight", jnp.sin)})


def test_bad_ties_explain_the_fix():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = LM(ft.nn.Embedding(VOCAB, WIDTH, key=k1), ft.nn.Dense(WIDTH, VOCAB, key=k2))
    with pytest.raises(ValueError, match=r"ft\.nn\.Shared: the tie .* holds shape \(3, 6\)"):  # no transpose
        ft.nn.Shared(model, {"head.weight": "embed.embeddings"})
    with pytest.raises(ValueError, match=r"ties \{target: source\}"):
        ft.nn.Shared(model, {"head.weight": 3})
    with pytest.raises(ValueError, match=r"ties \{target: source\}"):
        ft.nn.Shared(model, ["head.weight"])
    with pytest.raises(ValueError, match=r"at least one tie"):
        ft.nn.Shared(model, {})
    layer = ft.nn.Dense(2, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lies inside the tied target"):
        ft.nn.Shared(Pair(layer, layer), {"b": "a", "a.bias": "b.bias"})
    with pytest.raises(KeyError):
        ft.nn.Shared(model, {"head.kernel": "embed.embeddings"})


# ------------------------------------------------------------------ every name of a tie (functree/_naming.py)
def test_a_tie_answers_to_its_names_in_wrt_and_state_dicts():
    lm = tied_lm()
    opt = ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="head.weight")  # the tied matrix, by its head name
    state = opt.init(lm)
    batch = (TOKENS, TARGETS)
    new, state, _ = opt.minimize(lm_loss, lm, state, batch)
    assert not np.array_equal(new.model.embed.embeddings, lm.model.embed.embeddings)
    np.testing.assert_array_equal(new.model.head.bias, lm.model.head.bias)
    e = np.asarray(new.model.embed.embeddings)
    for flat in ({"head.weight": e.T, "head.bias": np.zeros(VOCAB, np.float32)},
                 {"embed.embeddings": e, "head.weight": e.T, "head.bias": np.zeros(VOCAB, np.float32)}):
        np.testing.assert_array_equal(ft.from_flat_dict(lm, flat).model.embed.embeddings, e)
    with pytest.raises(ValueError, match=r"'embed\.embeddings' and 'head\.weight' name one tied parameter"):
        ft.from_flat_dict(lm, {"embed.embeddings": e, "head.weight": e.T + 1.0, "head.bias": np.zeros(VOCAB)})


def ensemble_of_tied_lms(size, vocab=VOCAB, width=WIDTH):
    """``size`` tied LMs built by jax.vmap: every stored leaf has a leading model axis."""
    def make(k):
        k1, k2 = jax.random.split(k)
        model = LM(ft.nn.Embedding(vocab, width, key=k1), ft.nn.Dense(width, vocab, key=k2))
        return ft.nn.Shared(model, {"head.weight": ("embed.embeddings", jnp.transpose)})

    return jax.vmap(make)(jax.random.split(jax.random.key(5), size))


@pytest.mark.parametrize("size, vocab, width", [(2, VOCAB, WIDTH), (4, 4, 4)])  # (4, 4, 4): every axis alike
def test_a_tie_target_of_a_vmapped_ensemble_is_each_models_transform(size, vocab, width):
    # The transform applies to each model's source (jax.vmap over the leading model axis); on
    # the whole (size, vocab, width) array jnp.transpose mixed models with rows (silently,
    # with the right shape, when all three sizes agree).
    ens = ensemble_of_tied_lms(size, vocab, width)
    e = ens.model.embed.embeddings
    np.testing.assert_array_equal(ft.get(ens, "head.weight"), jnp.swapaxes(e, 1, 2))
    assert ens.ranks == (2,)
    np.testing.assert_array_equal(ft.get(ens, "embed.embeddings"), e)
    np.testing.assert_array_equal(ens.resolve().head.weight, jnp.swapaxes(e, 1, 2))
    new = jnp.arange(size * width * vocab, dtype=jnp.float32).reshape(size, width, vocab)
    np.testing.assert_array_equal(ft.set(ens, "head.weight", new).model.embed.embeddings, jnp.swapaxes(new, 1, 2))
    tokens = jnp.array([0, 1, 3])
    for i in range(size):
        one = jax.tree.map(lambda a, i=i: a[i], ens)
        np.testing.assert_allclose(jax.vmap(lambda m: m(tokens))(ens)[i], one(tokens), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(ft.get(one, "head.weight"), e[i].T)


def test_a_shared_pickled_before_ranks_existed_reads_and_keeps_working():
    import pickle

    lm = tied_lm()
    older = pickle.loads(pickle.dumps(lm))
    older.__dict__.pop("ranks")  # what an earlier functree's pickle holds
    back = pickle.loads(pickle.dumps(older))
    assert back.ranks == lm.ranks and jax.tree.structure(back) == jax.tree.structure(lm)  # derived: as built now
    np.testing.assert_array_equal(ft.get(back, "head.weight"), lm.model.embed.embeddings.T)


HOST = np.arange(6, dtype=np.float64).reshape(2, 3) / 3  # thirds: 0.1 * a is inexact in every width


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_a_host_tie_is_resolved_and_exported_in_the_dtype_torch_computes_it(dtype):
    # x64 off. A float64 NumPy source gave a float32 target (the dtype of JAX without x64,
    # 7e-9 off torch's float64 0.1 * a.T) where the source itself is exported float64; a
    # bfloat16 one must still not widen to NumPy's float32.
    torch = pytest.importorskip("torch")
    a = torch.from_numpy(HOST).to(getattr(torch, dtype))
    host = a.float().numpy().astype(jnp.bfloat16) if dtype == "bfloat16" else a.numpy()  # exact
    tied = ft.nn.Shared({"a": host, "b": np.zeros((3, 2), host.dtype)}, {"b": ("a", lambda w: 0.1 * w.T)})
    resolved = tied.resolve()
    assert resolved["b"].dtype == host.dtype
    sd = ft.interop.torch_state_dict(tied)
    assert sd["a"].dtype == sd["b"].dtype == a.dtype
    np.testing.assert_array_equal(sd["b"].double().numpy(), (0.1 * a.T).double().numpy())  # bit for bit
    np.testing.assert_array_equal(np.asarray(resolved["b"], np.float64), (0.1 * a.T).double().numpy())


def test_a_host_tie_through_a_numpy_only_transform_resolves():
    # jax.eval_shape cannot trace np.ascontiguousarray: resolve() raised
    # TracerArrayConversionError; the transform runs on the host and its result stands.
    host = HOST.astype(np.float32)
    tied = ft.nn.Shared({"a": host, "b": np.zeros((3, 2), np.float32)}, {"b": ("a", lambda w: np.ascontiguousarray(w.T))})
    b = tied.resolve()["b"]
    assert b.dtype == np.float32 and b.flags.c_contiguous
    np.testing.assert_array_equal(b, host.T)
    half = ft.nn.Shared({"a": host.astype(np.float16), "b": np.zeros((3, 2), np.float16)},
                        {"b": ("a", lambda w: np.ascontiguousarray(w.T))})
    np.testing.assert_array_equal(half.resolve()["b"], host.astype(np.float16).T)
