"""functree.train._evaluation: Trainer.evaluate / Trainer.predict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft


def test_predict_computes_in_the_trainers_compute_dtype_as_evaluate_does():
    # predict ran the float32 model (0.0117 off the bfloat16 outputs) while evaluate ran in
    # bfloat16; Keras predicts in its policy's dtype.
    rng = np.random.default_rng(10)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int32)
    model = ft.nn.Dense(6, 5, key=jax.random.key(0))
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0),
                               lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1]),
                               compute_dtype=jnp.bfloat16)
    # by hand: one compiled program as predict's (an eager add after the matmul would round
    # the matmul's output to bfloat16 before the bias, a fused one need not)
    hand = jax.jit(lambda m, x: ft.cast(m, jnp.bfloat16)(x.astype(jnp.bfloat16)))(model, jnp.asarray(x))
    out = trainer.predict(x, batch_size=8)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(hand, np.float32))
    given = trainer.predict(ft.train.batches((x, y), 8, shuffle=False), lambda m, b: m(b[0]))
    np.testing.assert_array_equal(np.asarray(given, np.float32), np.asarray(hand, np.float32))
    assert trainer.predict(x, lambda m, b: jnp.zeros(len(b), m.weight.dtype)).dtype == jnp.bfloat16  # fn sees the cast model
    loss = trainer.evaluate(ft.train.batches((x, y), 32, shuffle=False))["loss"]
    np.testing.assert_allclose(loss, float(ft.losses.softmax_cross_entropy(hand, jnp.asarray(y))),
                               rtol=0, atol=1e-6)


def test_empty_or_used_up_evaluation_data_is_named_as_the_callers_not_as_training_data():
    """A generator as validation_data ran epoch 1 and then failed with "The training data
    gave no minibatch to evaluate" and the training data's fixes; evaluate([]) the same.
    Several epochs with an iterator as validation_data are refused before the first step;
    used-up validation or evaluation data is named as what it is, with a re-iterable fix."""
    import pytest

    from functree.train._epochs import ONE_SHOT_VALIDATION
    from functree.train._evaluation import _EMPTY_EVAL, EMPTY_EVAL_DATA

    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0], np.float32)).astype(np.float32)
    trainer = ft.train.Trainer({"w": jnp.zeros(2)}, ft.optim.sgd(0.1), lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2))
    val = ((x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4))
    with pytest.raises(ValueError) as info:
        trainer.fit((x, y), epochs=3, batch_size=4, validation_data=val, progress=False)
    assert str(info.value) == ONE_SHOT_VALIDATION.format(count="epochs=3", kind="generator")
    assert trainer.steps_run == 0
    trainer.fit((x, y), epochs=1, batch_size=4, validation_data=val, progress=False)  # one epoch: allowed
    np.testing.assert_allclose(trainer.history.epochs["val_loss"][0],  # numpy reference: the 12 rows
                               np.mean((x @ np.asarray(trainer.model["w"]) - y) ** 2), rtol=0, atol=1e-6)

    def message(which, kind):
        name, why, wrong, right, other = _EMPTY_EVAL[which]
        return EMPTY_EVAL_DATA.format(which=name, what="predict" if which == "predict" else "evaluate", kind=kind,
                                      why=why, wrong=wrong, right=right, other=other)

    with pytest.raises(ValueError) as info:  # the generator, used up by epoch 1's validation
        trainer.fit((x, y), epochs=2, batch_size=4, validation_data=val, progress=False)
    assert str(info.value) == message("validation", "generator")
    assert str(info.value).startswith("The validation data (fit's validation_data=) gave no minibatch")
    for call, which in ((trainer.evaluate, "evaluate"), (trainer.predict, "predict")):
        with pytest.raises(ValueError) as info:
            call([])
        assert str(info.value) == message(which, "list")


def test_predict_of_a_function_without_an_example_axis_names_the_output():
    """A scalar per minibatch was 'Zero-dimensional arrays cannot be concatenated.'"""
    import pytest

    trainer = ft.train.Trainer({"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * b.sum())
    with pytest.raises(ValueError, match=r"(?s)returned f32\[\] at \['total'\].*right:  jnp\.sum\(trainer\.predict"):
        trainer.predict(np.ones((5, 2), np.float32), lambda m, b: {"total": jnp.sum(b), "rows": b}, batch_size=2)


def test_predict_of_a_function_whose_first_axis_is_not_the_examples_names_the_output():
    """A per-minibatch mean (2 columns, minibatches of 3) was concatenated silently: 4 rows for
    5 examples; a transposed output was JAX's "Cannot concatenate arrays" at the short last one."""
    import pytest

    from functree.train._evaluation import PREDICT_NOT_PER_EXAMPLE

    trainer = ft.train.Trainer({"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * b.sum())
    x = np.ones((5, 2), np.float32)

    def col_mean(m, b):
        return {"rows": b, "mean": jnp.mean(b, axis=0)}

    with pytest.raises(ValueError) as info:
        trainer.predict(x, col_mean, batch_size=3)
    assert str(info.value).endswith(PREDICT_NOT_PER_EXAMPLE.format(
        fn="col_mean", output="f32[2]", path="['mean']", rows=3, where="the leading axis its leaves share"))
    with pytest.raises(ValueError, match=r"returned f32\[2,3\] at its root"):
        trainer.predict(x, lambda m, b: b.T, batch_size=3)


def test_evaluating_sharded_batches_whose_last_minibatch_the_shares_cannot_split_names_the_cut():
    """Training batches (drop_last=True, shard=) whose dropped last minibatch of 5 does not
    split into 2 shares: evaluate/predict/validation (which read it) raised the shard error
    "use ... drop_last=True", which the batches had. Now named, with the cut that splits."""
    import pytest

    from functree.train._data import IN_ORDER_SHARD_TAIL

    data = (np.arange(29.0, dtype=np.float32), np.arange(29, dtype=np.int32))
    trainer = ft.train.Trainer({"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * b[0].sum())
    with pytest.raises(ValueError) as info:
        trainer.evaluate(ft.train.batches(data, 8, drop_last=True, shard=(1, 2)))
    assert str(info.value) == IN_ORDER_SHARD_TAIL.format(tail=5, n=29, size=8, count=2, cut=28, left=1)
    with pytest.raises(ValueError) as info:  # as validation data: before the first step
        trainer.fit(data, validation_data=ft.train.batches(data, 8, drop_last=True, shard=(1, 2)), progress=False)
    assert str(info.value) == IN_ORDER_SHARD_TAIL.format(tail=5, n=29, size=8, count=2, cut=28, left=1)
    assert trainer.history.steps["step"] == []
    right = ft.train.batches(jax.tree.map(lambda a: a[:28], data), 8, shuffle=False, shard=(1, 2))  # the fix shown
    assert [b[1].tolist() for b in right.in_order()] == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 23], [26, 27]]


def test_predict_reads_the_examples_from_the_inputs_where_the_batchs_leaves_differ():
    """A per-minibatch mean of as many columns (2) as another leaf's rows (``prototypes``,
    one per class) passed the check, which took any leaf's leading axis: 4 rows for 5
    examples, silently. The examples are the axis the leaves share, else the inputs'
    (``batch["x"]``, ``batch[0]``); a batch that says neither is refused before running fn."""
    import pytest

    from functree.train._evaluation import PREDICT_EXAMPLES_UNKNOWN, PREDICT_NOT_PER_EXAMPLE

    trainer = ft.train.Trainer({"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * b.sum())
    x, prototypes = np.arange(10, dtype=np.float32).reshape(5, 2), np.ones((2, 2), np.float32)
    data = [{"x": x[:3], "prototypes": prototypes}, {"x": x[3:], "prototypes": prototypes}]

    def col_mean(m, b):
        return jnp.mean(b["x"] if isinstance(b, dict) else b[0], axis=0)

    for given, where in [(data, "['x']"), ([(b["x"], b["prototypes"]) for b in data], "[0]")]:
        with pytest.raises(ValueError) as info:
            trainer.predict(given, col_mean)
        assert str(info.value).endswith(PREDICT_NOT_PER_EXAMPLE.format(
            fn="col_mean", output="f32[2]", path="its root", rows=3, where=f"the leading axis of its inputs, batch{where}"))
    # one row per example: concatenated as before
    np.testing.assert_array_equal(trainer.predict(data, lambda m, b: b["x"] @ b["prototypes"]), x @ prototypes)

    def ids(m, b):
        raise AssertionError("fn ran")

    with pytest.raises(ValueError) as info:
        trainer.predict([{"ids": x[:3], "prototypes": prototypes}], ids)
    assert str(info.value).endswith(PREDICT_EXAMPLES_UNKNOWN.format(first="['ids']", rows=3, other="['prototypes']",
                                                                    given=2))


def test_every_mean_over_a_short_last_minibatch_is_the_whole_datas():
    """100 examples in minibatches of 7 (a last one of 2) at learning rate 0, with
    steps_per_call=3 (a remainder of 2 single steps an epoch): the epoch means, validation,
    evaluate and predict give the whole data's numbers computed at once, in NumPy
    (measured: 2e-7 on a loss of 1.87; accuracy exact), as Keras's size-weighted trackers."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 3)).astype(np.float32)
    y = rng.integers(0, 4, size=100).astype(np.int32)
    model = ft.nn.Dense(3, 4, key=jax.random.key(0))
    logits = np.asarray(model(x), np.float64)
    top = logits.max(1)
    loss = np.mean(np.log(np.exp(logits - top[:, None]).sum(1)) + top - logits[np.arange(100), y])
    accuracy = np.mean(logits.argmax(1) == y)

    def loss_fn(m, b):
        out = m(b[0])
        return ft.losses.softmax_cross_entropy(out, b[1]), out

    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics=[ft.train.accuracy], steps_per_call=3)
    history = trainer.fit(ft.train.batches((x, y), 7, key=jax.random.key(1)), epochs=2, progress=False,
                          validation_data=(x, y), batch_size=7)
    assert len(history.steps["loss"]) == 30
    for name, want in (("loss", loss), ("accuracy", accuracy), ("val_loss", loss), ("val_accuracy", accuracy)):
        np.testing.assert_allclose(history.epochs[name], [want, want], rtol=0, atol=2e-6, err_msg=name)
    got = trainer.evaluate((x, y), batch_size=7)
    np.testing.assert_allclose([got["loss"], got["accuracy"]], [loss, accuracy], rtol=0, atol=2e-6)
    out = trainer.predict(ft.train.batches(x, 7, key=jax.random.key(2)))  # shuffled data: read in order
    np.testing.assert_allclose(np.asarray(out), logits, rtol=0, atol=2e-6)


def test_evaluation_sums_stay_exact_past_float32s_integers():
    """The evaluation's sums are added on device, minibatch by minibatch, in float32: past
    2²⁴ an add rounds to the sum's spacing, and a count that is the same every minibatch
    rounds the same way every time. A causal LM's 16 rows of 2047 labels (32752 a
    minibatch) added to a count past 2²⁸ (268M tokens) added 32768: 20000 such minibatches
    (6.5e8 tokens) gave an accuracy (or a WeightedMean loss) 2.9e-4 too low, 0.59984 for
    0.60001. Here the sums start past 2³⁰ (as after 33000 minibatches) and 64 more are added:
    the count read is the exact one (Neumaier's compensated sum, read in float64)."""
    from functree.train._evaluation import evaluate

    rows, labels = 16, 2047
    step = ft.train.eval_step(lambda m, b: ft.losses.WeightedMean(jnp.sum(b[0]), jnp.sum(b[1])))
    summing = step.summing()
    hits = np.zeros((rows, labels), np.float32)
    hits[:, :1535] = 1.0  # 24560 hits of 32752 counted a minibatch
    data = [(hits, np.ones((rows, labels), np.float32))] * 64
    before_hits, before_counted = 2.0**29, 2.0**30  # the minibatches before: a mean of 0.5

    def from_the_edge(model, sums, batch, key):
        if not int(sums["count"]):  # the first minibatch: the sums of those before it
            values = dict(sums["values"], **{"loss#sum": jnp.float32(before_hits), "loss#count": jnp.float32(before_counted)})
            sums = dict(sums, values=values, weight=jnp.float32(2.0**25))
        return summing(model, sums, batch, key)

    got = evaluate(step, from_the_edge, {}, data, None)["loss"]
    want = (before_hits + 64 * 24560) / (before_counted + 64 * rows * labels)
    assert abs(got / want - 1) < 1e-12, (got, want)  # plain float32 sums: 9.5e-7 off
    # an infinite or NaN minibatch is the mean's, as in a plain sum (its rounding error is none)
    ones, inf = np.ones(4, np.float32), np.full(4, np.inf, np.float32)
    assert evaluate(step, summing, {}, [(ones, ones), (inf, ones), (ones, ones)], None)["loss"] == np.inf
    assert np.isnan(evaluate(step, summing, {}, [(ones, ones), (np.full(4, np.nan, np.float32), ones)], None)["loss"])


def test_a_weighted_loss_that_scored_no_label_is_nan_with_a_warning_and_never_the_best(tmp_path):
    """Validation data whose every label is -100 (a collator that truncated each response
    away): each minibatch's WeightedMean loss is 0/0, given as 0 (training takes no
    gradient there), and the mean of those 0s was a perfect val_loss of 0.0 that
    ModelCheckpoint kept as the best. It is NaN (torch's and HF's eval_loss), with a
    NoLabelWarning naming the data; one scored label anywhere gives the mean over it alone."""
    from functree.train._evaluation import NO_LABEL

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=16).astype(np.int32)
    ignored = np.full(8, -100, np.int32)
    model = ft.nn.Dense(4, 3, key=jax.random.key(0))

    def loss_fn(m, b):
        out = m(b[0])
        return ft.losses.softmax_cross_entropy(out, b[1], reduction="weighted"), out

    trainer = ft.train.Trainer(model, ft.optim.sgd(0.1), loss_fn, metrics=[ft.train.accuracy])
    with pytest.warns(ft.train.NoLabelWarning) as caught:
        got = trainer.evaluate((x[:8], ignored), batch_size=4)
    assert str(caught[0].message) == NO_LABEL.format(what="evaluate")
    assert caught[0].filename == __file__  # the user's line
    assert np.isnan(got["loss"]) and got["accuracy"] == 0.0  # (a ratio over nothing: 0, as torchmetrics')
    one = ignored.copy()
    one[5] = y[5]
    logits = np.asarray(model(x[5]), np.float64)
    want = np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[y[5]]
    np.testing.assert_allclose(trainer.evaluate((x[:8], one), batch_size=4)["loss"], want, rtol=0, atol=2e-6)

    manager = ft.train.CheckpointManager(str(tmp_path / "best"), best_metric="val_loss")
    with pytest.warns(ft.train.NoLabelWarning, match=r"^validation \(fit's validation_data=\)"):
        history = trainer.fit((x, y), epochs=2, batch_size=8, progress=False, validation_data=(x[:8], ignored),
                              callbacks=[ft.train.ModelCheckpoint(manager)])
    assert np.isnan(history.epochs["val_loss"]).all()
    assert manager.all_steps() == [2, 4] and manager.best_step() is None  # no epoch was the best


def test_a_weighted_mean_metric_that_scored_no_label_is_nan_with_a_warning_naming_it():
    """A metric returning a ft.losses.WeightedMean over data whose every label is -100: each
    minibatch's value is 0/0, given as 0, and the mean of those 0s was a perfect 0.0 in
    evaluate and validation. It is NaN with a NoLabelWarning naming the metric and the data;
    one scored label gives the mean over it alone, and an accuracy over nothing stays 0."""
    from functree.train._evaluation import NO_METRIC_LABEL

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=8).astype(np.int32)
    ignored = np.full(8, -100, np.int32)
    model = ft.nn.Dense(4, 3, key=jax.random.key(0))

    def loss_fn(m, b):
        out = m(b[0])
        return jnp.mean(out ** 2), out

    def tok(out):
        return ft.losses.softmax_cross_entropy(out.aux, out.batch[1], reduction="weighted")

    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics={"tok": tok, "acc": ft.train.accuracy})
    with pytest.warns(ft.train.NoLabelWarning) as caught:
        got = trainer.evaluate((x, ignored), batch_size=4)
    assert [str(w.message) for w in caught] == [NO_METRIC_LABEL.format(what="evaluate", name="tok")]
    assert caught[0].filename == __file__  # the user's line
    assert np.isnan(got["tok"]) and got["acc"] == 0.0 and np.isfinite(got["loss"])
    one = ignored.copy()
    one[5] = y[5]
    logits = np.asarray(model(x[5]), np.float64)
    want = np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[y[5]]
    np.testing.assert_allclose(trainer.evaluate((x, one), batch_size=4)["tok"], want, rtol=0, atol=2e-6)
    with pytest.warns(ft.train.NoLabelWarning, match=r"^validation \(fit's validation_data=\): the metric 'tok'"):
        history = trainer.fit((x, y), epochs=1, batch_size=8, progress=False, validation_data=(x, ignored))
    assert np.isnan(history.epochs["val_tok"][0]) and np.isfinite(history.epochs["tok"][0])


def test_evaluate_and_predict_of_data_known_never_to_end_are_refused_with_the_islice_fix():
    """trainer.evaluate(itertools.cycle(loader)) (or grain's MapDataset.repeat(), a
    DataLoader whose sampler has num_epochs=None) read forever: they take no step count.
    Refused (ENDLESS_EVAL_DATA, fit's ENDLESS_DATA test's `endless`); the printed fix,
    itertools.islice(data, n), reads those minibatches."""
    import itertools

    grain = pytest.importorskip("grain")
    from functree.train._epochs import endless
    from functree.train._evaluation import ENDLESS_EVAL_DATA

    x = np.arange(16, dtype=np.float32).reshape(8, 2) / 8
    minibatches = [(x[:4], x[:4, :1]), (x[4:], x[4:, :1])]
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    sampler = grain.samplers.IndexSampler(2, shard_options=grain.sharding.NoSharding(), num_epochs=None)
    kinds = {"cycle": itertools.cycle(minibatches), "repeat": itertools.repeat(minibatches[0]),
             "RepeatMapDataset": grain.MapDataset.source(minibatches).repeat(),
             "DataLoader": grain.DataLoader(data_source=minibatches, sampler=sampler)}
    for kind, data in kinds.items():
        why, fix = endless(data)
        finite, _, note = fix.partition("  # ")
        for method in ("evaluate", "predict"):
            with pytest.raises(ValueError) as e:
                getattr(trainer, method)(data)
            assert str(e.value) == ENDLESS_EVAL_DATA.format(method=method, kind=kind, why=why, finite=finite,
                                                            note=note)
    whole = trainer.evaluate(minibatches)["loss"]  # the fix: two minibatches of the cycle, the data once
    np.testing.assert_allclose(trainer.evaluate(itertools.islice(itertools.cycle(minibatches), 2))["loss"],
                               whole, rtol=1e-6, atol=1e-6 * abs(whole))
    out = trainer.predict(itertools.islice(itertools.cycle(minibatches), 3), lambda m, b: m(b[0]))
    assert out.shape == (12, 1)
    np.testing.assert_array_equal(out[8:], out[:4])


def test_an_evaluation_after_the_first_sends_no_host_value_and_compiles_nothing():
    # trainer.evaluate (and each epoch's validation) made its first sums with eager jnp.zeros:
    # an implicit host-to-device transfer each, refused under jax.transfer_guard("disallow")
    # around a loop of fits and evaluations. They come from the host in one explicit put.
    from _compiles import compiled

    model = ft.nn.Dense(3, 1, key=jax.random.key(0))
    batches = [(jnp.full((4, 3), float(i)), jnp.ones((4, 1))) for i in range(3)]
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.1), lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
                               metrics={"mae": ft.train.mean(lambda out: jnp.mean(jnp.abs(out.model(out.batch[0]) - 1)))})
    first = trainer.evaluate(batches)
    with compiled(clear=False) as names, jax.transfer_guard("disallow"):
        again = trainer.evaluate(batches)
    assert names == [] and again == first
    np.testing.assert_allclose(first["loss"], np.mean([float(np.mean((model(x) - y) ** 2)) for x, y in batches]),
                               rtol=1e-6)


def test_predict_of_a_function_not_taking_the_model_and_the_minibatch_shows_the_call():
    # session 60: trainer.predict(data, lambda batch: ...) (Keras's predict(x) habit) failed at
    # the first minibatch with Python's "takes 1 positional argument but 2 were given"
    from functree.train._trainer import PREDICT_FN_ARGUMENTS

    model = ft.nn.Dense(2, 3, key=jax.random.key(0))
    x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), lambda m, b: jnp.mean(m(b[0])))

    def probabilities(batch):
        return jax.nn.softmax(model(batch[0]))

    with pytest.raises(TypeError) as info:
        trainer.predict([(x, x)], probabilities)
    assert str(info.value) == PREDICT_FN_ARGUMENTS.format(fn="probabilities", signature="(batch)",
                                                          problem="too many positional arguments")
    out = trainer.predict([(x, x)], lambda model, batch: jax.nn.softmax(model(batch[0])))  # the right line
    np.testing.assert_allclose(out, jax.nn.softmax(model(x)), rtol=0, atol=1e-6)
    keyed = trainer.predict([(x, x)], lambda model, batch, *, key: model(batch[0]))  # key= as before
    np.testing.assert_allclose(keyed, model(x), rtol=0, atol=1e-6)


def test_predict_s_default_call_of_a_model_taking_the_whole_minibatch_is_named_with_the_fn_that_calls_it():
    # session 60: trainer.predict(dict minibatches) of a model(batch) (an HF-style dict) failed
    # with JAX's "does not support string indexing; got idx='x'", naming neither the call
    # predict made, model(batch['x']), nor the fn that calls the model with the whole minibatch
    from functree.train._evaluation import DEFAULT_PREDICT_CALL

    assert "called model(batch{entry})" in DEFAULT_PREDICT_CALL

    class Reads(ft.Module):
        dense: ft.nn.Dense

        def __call__(self, batch):
            return self.dense(batch["x"])

    x = np.arange(12.0, dtype=np.float32).reshape(6, 2)
    model = Reads(ft.nn.Dense(2, 3, key=jax.random.key(0)))
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), lambda m, b: jnp.mean(m(b) ** 2))
    data = [{"x": x[:4]}, {"x": x[4:]}]
    with pytest.raises(TypeError) as e:
        trainer.predict(data)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "trainer.predict(data) without fn called model(batch['x'])" in notes
    assert "right:  trainer.predict(data, lambda model, batch: model(batch))" in notes
    out = trainer.predict(data, lambda model, batch: model(batch))  # the right line runs
    np.testing.assert_allclose(np.asarray(out), np.asarray(model({"x": x})), rtol=0, atol=1e-6)
