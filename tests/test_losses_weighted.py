"""``reduction="weighted"`` (``ft.losses.WeightedMean``): a masked token loss's mean kept as
its parts, so that ``Optimizer(accumulate=k)`` takes the whole minibatch's gradient and the
Trainer's means are per kept token, whatever the microbatches' and minibatches' counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.losses._weighted import WEIGHTED_MEAN_NOT_SCALAR
from functree.train._metrics import AUX_WEIGHTED_MEAN

V, T, B = 7, 5, 8
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, V, size=(B, T)).astype(np.int32)
LABELS = RNG.integers(0, V, size=(B, T)).astype(np.int32)
LABELS[:2, 1:] = -100   # rows 0-1: 1 kept token each; rows 4-5: none kept; the others 5
LABELS[4:6] = -100


@functools.cache
def _model():
    """The tests' model, built once (a frozen pytree: no test can change it)."""
    return ft.nn.Sequential(ft.nn.Embedding(V, 8, key=jax.random.key(0)), ft.nn.Dense(8, V, key=jax.random.key(1)))


def _loss(reduction):
    def loss_fn(m, x, y):
        return ft.losses.softmax_cross_entropy(m(x), y, reduction=reduction)
    return loss_fn


def _leaves(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _sgd():
    return ft.optim.sgd(1.0)


def _adam():
    return ft.optim.adam(0.1)


@functools.cache
def _update(k, reduction, make=_sgd):
    """One minimize step from _model(), in one jit (one program, not dozens of eager ones);
    computed once per (k, reduction, make) for the file (the update read-only)."""
    model = _model()
    opt = ft.optim.Optimizer(make(), accumulate=k)
    new, _, loss = jax.jit(lambda m: opt.minimize(_loss(reduction), m, opt.init(m), IDS, LABELS))(model)
    update = _leaves(new) - _leaves(model)
    update.flags.writeable = False
    return update, loss


def test_weighted_is_the_mean_as_its_parts():
    logits = RNG.normal(size=(B, T, V)).astype(np.float32)
    w = ft.losses.softmax_cross_entropy(logits, LABELS, reduction="weighted")
    assert isinstance(w, ft.losses.WeightedMean) and float(w.count) == float(np.sum(LABELS != -100))
    # bit for bit: the same division (compared in NumPy)
    assert np.asarray(w.value) == np.asarray(ft.losses.softmax_cross_entropy(logits, LABELS))
    assert float(w.total) == pytest.approx(float(ft.losses.softmax_cross_entropy(logits, LABELS, reduction="sum")))
    weight = np.array([1.0, 2.0, 0.5, 1.0, 3.0, 1.0, 1.0], np.float32)  # with class weights: their summed weights
    wc = ft.losses.softmax_cross_entropy(logits, LABELS, weight=weight, reduction="weighted")
    assert np.asarray(wc.value) == np.asarray(ft.losses.softmax_cross_entropy(logits, LABELS, weight=weight))
    empty = ft.losses.softmax_cross_entropy(logits, np.full((B, T), -100, np.int32), reduction="weighted")
    assert float(empty.count) == 0 and float(empty.value) == 0  # every label ignored: 0, as the mean's
    mse = ft.losses.mean_squared_error(np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32), reduction="weighted")
    assert (float(mse.total), float(mse.count), float(mse.value)) == (6.0, 6.0, 1.0)
    assert "weighted" in ft.losses.REDUCTIONS


def test_the_count_holds_no_derivative():
    g = jax.jit(lambda x: ft.gradient(lambda s: ft.losses.WeightedMean(3.0 * s, s).value, at=x))(np.float32(2.0))
    assert float(g) == 1.5  # d(3s / stop_gradient(s)) = 3 / 2


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("make", [_sgd, _adam], ids=["sgd", "adam"])
def test_accumulate_k_is_the_whole_minibatchs_update_with_uneven_kept_tokens(k, make):
    """Microbatches of 2 / 10 / 0 / 10 kept tokens (k=4): the mean of their means is another
    update (measured: 0.15 apart on sgd updates of 0.19 at k=4, 0.015 at k=2; adam's 0.2);
    the weighted one is the whole minibatch's (measured: at most 1.2e-7 on 0.19, 6e-7 of
    the scale: atol 1e-5 of it)."""
    whole, loss1 = _update(1, "weighted", make)
    mean, _ = _update(k, "mean", make)
    weighted, loss_k = _update(k, "weighted", make)
    scale = np.abs(whole).max()
    assert np.abs(mean - whole).max() > 0.05 * scale  # the defect this fixes
    np.testing.assert_allclose(weighted, whole, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(float(loss_k), float(loss1), rtol=0, atol=1e-6 * abs(float(loss1)))
    assert not isinstance(loss_k, ft.losses.WeightedMean)  # minimize reports its value


def test_a_plain_loss_accumulates_as_before_bit_for_bit():
    whole, _ = _update(1, "mean")
    assert np.array_equal(_update(1, "weighted")[0], whole)  # one microbatch: the same update
    logits = jax.jit(lambda m: m(IDS))(_model())  # one program (the model is not the subject)
    w = ft.losses.softmax_cross_entropy(logits, LABELS, reduction="weighted")
    assert np.array_equal(np.asarray(w.value), np.asarray(ft.losses.softmax_cross_entropy(logits, LABELS)))


def test_accumulate_with_aux_and_every_microbatch_ignored():
    model = _model()
    opt = ft.optim.Optimizer(ft.optim.sgd(1.0), accumulate=2)
    labels = np.full((B, T), -100, np.int32)

    def loss_fn(m, x, y):
        return ft.losses.softmax_cross_entropy(m(x), y, reduction="weighted"), jnp.sum(x)

    new, _, (loss, aux) = jax.jit(lambda m: opt.minimize(loss_fn, m, opt.init(m), IDS, labels, has_aux=True))(model)
    assert float(loss) == 0 and aux.shape == (2,) and np.array_equal(_leaves(new), _leaves(model))  # no NaN


def test_matches_transformers_num_items_in_batch():
    """Hugging Face's fix: ForCausalLMLoss(num_items_in_batch=N) sums each microbatch's token
    losses over the whole minibatch's N; the sum of the microbatches' gradients is this
    library's accumulate=2 gradient (measured: 3.7e-9 on gradients of 0.06; the loss equal)."""
    torch = pytest.importorskip("torch")
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    logits = RNG.normal(size=(B, T, V)).astype(np.float32)
    labels = LABELS.copy()
    n = int(np.sum(labels[:, 1:] != -100))  # HF shifts: the labels of positions 1..T-1
    total = None
    grads = []
    for half in (slice(0, B // 2), slice(B // 2, B)):
        t = torch.tensor(logits[half], requires_grad=True)
        loss = loss_utils.ForCausalLMLoss(t, torch.tensor(labels[half], dtype=torch.long), V,
                                          num_items_in_batch=torch.tensor(n))
        loss.backward()
        grads.append(t.grad.numpy())
        total = loss.item() if total is None else total + loss.item()
    hf = np.concatenate(grads)

    opt = ft.optim.Optimizer(ft.optim.sgd(1.0), accumulate=2)
    shifted = np.concatenate([labels[:, 1:], np.full((B, 1), -100, np.int32)], axis=1)  # HF's shift, as labels

    def loss_fn(p, rows, y):  # the "model" is the logits; each microbatch reads its rows
        return ft.losses.softmax_cross_entropy(p[rows], y, reduction="weighted"), None

    (loss, _), ours = jax.jit(lambda x: opt.compute_gradients(loss_fn, x, jnp.arange(B), shifted, has_aux=True))(
        jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(ours), hf, rtol=0, atol=1e-6 * np.abs(hf).max())
    assert isinstance(loss, ft.losses.WeightedMean)
    np.testing.assert_allclose(float(loss.value), total, rtol=0, atol=1e-6 * abs(total))


def _fit(reduction, **kw):
    model = _model()

    def loss_fn(m, b):
        return ft.losses.softmax_cross_entropy(m(b[0]), b[1], reduction=reduction)

    fit_kw = {k: kw.pop(k) for k in ("steps_per_call", "log_every") if k in kw}
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, **kw)  # lr 0: the model stays put
    data = ft.train.batches((IDS, LABELS), 2, shuffle=False)
    history = trainer.fit(data, epochs=1, progress=False, **fit_kw)
    return model, trainer, history, data


@jax.jit
def _token_mean(model, ids, labels):
    """The plain mean loss of model(ids), one program per shape (the reference, not the subject)."""
    return ft.losses.softmax_cross_entropy(model(ids), labels)


@pytest.mark.parametrize("kw", [{}, {"steps_per_call": 3}, {"log_every": 3}], ids=["plain", "steps_per_call", "log"])
def test_trainer_means_are_the_whole_datas_token_mean(kw):
    """Minibatches of 2, 10, 0, 10 kept tokens: the epoch's (and evaluate's) mean of a
    weighted loss is the token mean over all the data (measured: 1.3e-7 on 2.37); a plain
    mean's is the size-weighted mean of minibatch means, as before (another number)."""
    model, trainer, history, data = _fit("weighted", **kw)
    token_mean = float(_token_mean(model, IDS, LABELS))
    np.testing.assert_allclose(history.epochs["loss"][0], token_mean, rtol=0, atol=1e-6 * token_mean)
    np.testing.assert_allclose(trainer.evaluate(data)["loss"], token_mean, rtol=0, atol=1e-6 * token_mean)
    per_step = [float(_token_mean(model, IDS[i:i + 2], LABELS[i:i + 2])) for i in range(0, B, 2)]
    np.testing.assert_allclose(history.steps["loss"], per_step, rtol=0, atol=1e-6 * max(per_step))  # step values
    _, _, plain, _ = _fit("mean", **kw)
    assert plain.steps["loss"] == history.steps["loss"]
    assert abs(plain.epochs["loss"][0] - token_mean) > 1e-2  # size-weighted: the documented other number
    np.testing.assert_allclose(plain.epochs["loss"][0], np.mean(per_step), rtol=0, atol=1e-6 * token_mean)


def test_a_metric_returning_a_weighted_mean_has_the_whole_datas_token_mean():
    """A metric may return ``WeightedMean(total, count)`` (a token-level metric beside a
    plain loss): its epoch mean, evaluate's and a step's value are token means (minibatches
    of 2, 10, 0, 10 kept tokens; measured 1.3e-7 on 2.37), where the loss, a plain mean,
    stays size-weighted. Before, every step refused it ("needs a scalar"), and its
    ``.value`` gave the size-weighted 1.67."""
    model = _model()

    def loss_fn(m, b):
        logits = m(b[0])
        return ft.losses.softmax_cross_entropy(logits, b[1]), logits

    def token_ce(out):
        return ft.losses.softmax_cross_entropy(out.aux, out.batch[1], reduction="weighted")

    metrics = {"token_ce": token_ce, "by_mean": ft.train.mean(token_ce)}  # ft.train.mean passes it on
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn, metrics=metrics)
    data = ft.train.batches((IDS, LABELS), 2, shuffle=False)
    history = trainer.fit(data, epochs=1, progress=False)
    token_mean = float(_token_mean(model, IDS, LABELS))
    np.testing.assert_allclose(history.epochs["token_ce"][0], token_mean, rtol=0, atol=1e-6 * token_mean)
    evaluated = trainer.evaluate(data)
    np.testing.assert_allclose(evaluated["token_ce"], token_mean, rtol=0, atol=1e-6 * token_mean)
    assert evaluated["by_mean"] == evaluated["token_ce"] and history.epochs["by_mean"] == history.epochs["token_ce"]
    assert history.steps["loss"] == history.steps["token_ce"]  # a step's: its minibatch's token mean
    assert abs(history.epochs["loss"][0] - token_mean) > 1e-2  # the plain loss: size-weighted


def test_a_weighted_mean_in_aux_named_to_ft_train_mean_is_refused_with_the_fix():
    """``ft.train.mean("tok")`` of an aux ``WeightedMean`` (a plain mean: no columns for
    its parts) names the fix, a function returning it, which gives the token mean, as a
    ``compute_metrics`` override returning it does (unjitted or abstract steps: nothing compiled)."""
    def loss_fn(m, b):
        logits = m(b[0])
        return ft.losses.softmax_cross_entropy(logits, b[1]), {"tok": ft.losses.softmax_cross_entropy(
            logits, b[1], reduction="weighted")}

    with pytest.raises(TypeError) as e:
        ft.train.eval_step(loss_fn, metrics={"tok": ft.train.mean("tok")}).step(_model(), (IDS, LABELS))
    assert str(e.value) == AUX_WEIGHTED_MEAN.format(key="tok")
    right = ft.train.eval_step(loss_fn, metrics={"tok": lambda out: out.aux["tok"]}).step(_model(), (IDS, LABELS))
    token_mean = float(_token_mean(_model(), IDS, LABELS))
    np.testing.assert_allclose(float(right["tok"]), token_mean, rtol=0, atol=1e-6 * token_mean)
    assert float(right["tok#count"]) * B == np.sum(LABELS != -100)  # its parts: the kept tokens

    class Step(ft.train.TrainStep):  # an override's WeightedMean gets its parts too (was "needs a scalar")
        def compute_metrics(self, out):
            return {**super().compute_metrics(out), "tok": out.aux["tok"]}

    step = Step(loss_fn, ft.optim.sgd(0.0))
    metrics = jax.eval_shape(step.step, _model(), step.optimizer.init(_model()), (IDS, LABELS))[2]
    assert {"tok", "tok#sum", "tok#count"} <= set(metrics)  # the means' parts: Σ total / Σ count


def test_a_weighted_mean_where_a_scalar_is_needed_is_refused_by_name():
    logits = jnp.asarray(RNG.normal(size=(B, T, V)).astype(np.float32))
    w = ft.losses.softmax_cross_entropy(logits, LABELS, reduction="weighted")
    first = WEIGHTED_MEAN_NOT_SCALAR.splitlines()[0][:40]
    with pytest.raises(TypeError, match="WeightedMean"):
        ft.gradient(lambda x: ft.losses.softmax_cross_entropy(x, LABELS, reduction="weighted"), at=logits)
    for misuse in (lambda: w + 1.0, lambda: 0.01 * w, lambda: float(w), lambda: np.asarray(w), lambda: w < 1):
        with pytest.raises(TypeError) as e:
            misuse()
        assert "right:" in str(e.value) and ".value" in str(e.value) and first[13:] in str(e.value)
    with pytest.raises(TypeError, match=r"total must be a floating scalar"):
        ft.losses.WeightedMean(jnp.ones(3), 3.0)
    with pytest.raises(TypeError, match=r"count must be a scalar"):
        ft.losses.WeightedMean(jnp.float32(1.0), jnp.ones(3))
    with pytest.raises(AttributeError, match="immutable"):
        w.total = jnp.float32(0.0)  # type: ignore[misc]


def test_a_loss_scale_and_compute_dtype_keep_the_weighting():
    whole, _ = _update(1, "weighted")
    model = _model()
    opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(1.0), accumulate=2))
    new, _, _ = jax.jit(lambda m: opt.minimize(_loss("weighted"), m, opt.init(m), IDS, LABELS))(model)
    np.testing.assert_allclose(_leaves(new) - _leaves(model), whole, rtol=0, atol=1e-5 * np.abs(whole).max())
    model, _, history, _ = _fit("weighted", compute_dtype=jnp.bfloat16)
    token_mean = float(jax.jit(lambda m: _token_mean(ft.cast(m, jnp.bfloat16), IDS, LABELS))(model))
    np.testing.assert_allclose(history.epochs["loss"][0], token_mean, rtol=0, atol=1e-6 * token_mean)


def test_a_transform_reading_the_loss_gets_its_value():
    """A transform that reads the loss (``value=``: L-BFGS's line search) gets the scalar value."""
    model = _model()
    opt = ft.optim.Optimizer(optax.lbfgs())
    new, _, loss = jax.jit(lambda m: opt.minimize(_loss("weighted"), m, opt.init(m), IDS, LABELS))(model)
    assert np.isfinite(float(loss)) and np.isfinite(_leaves(new)).all()


def test_a_mesh_weighs_each_device_by_its_count():
    """TrainStep(mesh=) over 4 devices holding 2, 10, 0 and 10 kept tokens (and 2 of them
    accumulating 2 microbatches each): the update and the loss are the whole minibatch's
    (measured: 1.2e-7 on 0.19, the loss equal; the mean over devices of their means is
    0.15 apart), and so is the epoch mean (1.1e-7 on 2.37). The whole minibatch's update and
    token mean are this process's (_update, _token_mean: the same model, bit for bit a
    TrainStep's without a mesh there), so the subprocess compiles only the mesh programs."""
    from _devices import run

    result = run("""
import functree as ft, jax, jax.numpy as jnp, numpy as np
V, T, B = 7, 5, 8
rng = np.random.default_rng(0)
ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
labels = rng.integers(0, V, size=(B, T)).astype(np.int32)
labels[:2, 1:] = -100
labels[4:6] = -100
model = ft.nn.Sequential(ft.nn.Embedding(V, 8, key=jax.random.key(0)), ft.nn.Dense(8, V, key=jax.random.key(1)))
leaves = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
def loss_fn(reduction):
    return lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1], reduction=reduction)
out = {"data": [ids.tolist(), labels.tolist()]}
for name, reduction, k, mesh in [("mesh", "weighted", 1, (4,)), ("mesh_k2", "weighted", 2, (2,)),
                                 ("mesh_mean", "mean", 1, (4,))]:
    opt = ft.optim.Optimizer(ft.optim.sgd(1.0), accumulate=k)
    step = ft.train.TrainStep(loss_fn(reduction), opt, donate=False,
                              mesh=jax.make_mesh(mesh, ("data",), devices=jax.devices()[:mesh[0]]))
    new, _, metrics = step(model, opt.init(model), (ids, labels))
    out[name] = [(leaves(new) - leaves(model)).tolist(), float(metrics["loss"])]
trainer = ft.train.Trainer(model, ft.optim.sgd(0.0), loss_fn("weighted"), mesh=jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]))
out["epoch"] = trainer.fit(ft.train.batches((ids, labels), 4, shuffle=False), epochs=1, progress=False).epochs["loss"][0]
report(out)
""", devices=4)
    assert result["data"] == [IDS.tolist(), LABELS.tolist()]  # the data of _update and _token_mean
    whole, loss = _update(1, "weighted")
    loss, scale, token_mean = float(loss), np.abs(whole).max(), float(_token_mean(_model(), IDS, LABELS))
    for name in ("mesh", "mesh_k2"):
        np.testing.assert_allclose(result[name][0], whole, rtol=0, atol=1e-5 * scale)
        np.testing.assert_allclose(result[name][1], loss, rtol=0, atol=1e-6 * loss)
    assert np.abs(np.asarray(result["mesh_mean"][0]) - whole).max() > 0.05 * scale
    np.testing.assert_allclose(result["epoch"], token_mean, rtol=0, atol=1e-6 * token_mean)


def test_a_records_repr_shows_an_array_a_step_donated_as_deleted():
    # JAX's repr of a deleted array raised "Array has been deleted" from inside the record's
    w = ft.losses.WeightedMean(jnp.float32(3.0), 2)
    assert repr(w) == "WeightedMean(total=Array(3., dtype=float32), count=Array(2., dtype=float32))"
    jax.tree.map(lambda x: x.delete(), w)
    assert repr(w) == "WeightedMean(total=<deleted f32[]>, count=<deleted f32[]>)"
