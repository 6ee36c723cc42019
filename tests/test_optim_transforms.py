"""Clipping, regularization, weight-decay masks, noise, skipping, freezing, plateau."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _references import torch_mlp
from _tolerance import assert_close_trained, needs_float16_conversions

import functree as ft
import functree.optim as fo


def _update(tx, grads, params=None, **extra):
    state = tx.init(grads if params is None else params)
    return tx.update(grads, state, params, **extra)


def test_elementwise_clip():
    u, _ = _update(fo.clip(1.0), {"w": jnp.array([-3.0, 0.5, 2.0])})
    np.testing.assert_allclose(u["w"], [-1.0, 0.5, 1.0])


def test_per_tensor_and_global_norm_clipping():
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 0.5])}
    u, _ = _update(fo.clip_by_norm(1.0), g)
    np.testing.assert_allclose(u["a"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(u["b"], [0.0, 0.5])
    u, _ = _update(fo.clip_by_global_norm(1.0), g)
    total = np.sqrt(25.25)
    np.testing.assert_allclose(u["a"], np.array([3.0, 4.0]) / total, rtol=1e-6)
    np.testing.assert_allclose(u["b"], np.array([0.0, 0.5]) / total, rtol=1e-6)


def test_cntk_per_sample_clipping_scales_threshold_by_minibatch():
    g = {"w": jnp.array([0.3, -2.0])}
    u, _ = _update(fo.clip_per_sample(0.5), g, minibatch_size=8)
    np.testing.assert_allclose(u["w"], [0.3, -0.5])
    g = {"w": jnp.array([3.0, 4.0])}  # summed: [24, 32], norm 40 > 0.5 * 8 = 4 → [2.4, 3.2] / 8
    u, _ = _update(fo.clip_per_sample(0.5, truncation=False), g, minibatch_size=8)
    np.testing.assert_allclose(u["w"], [0.3, 0.4], rtol=1e-6)


def test_true_per_example_clipping():
    x = jnp.array([[1.0, 0.0], [0.0, 10.0], [3.0, 4.0]])

    def loss_fn(p, x):
        return jnp.mean(x @ p["w"])

    opt = fo.Optimizer(fo.sgd(1.0), get_gradients=fo.per_example_clipping(1.0))
    p = {"w": jnp.zeros(2)}
    _, grads = opt.compute_gradients(loss_fn, p, x)
    # example gradients are the rows; clipped to norm 1 and averaged
    expected = (np.array([1.0, 0.0]) + np.array([0.0, 1.0]) + np.array([0.6, 0.8])) / 3
    np.testing.assert_allclose(grads["w"], expected, rtol=1e-6)
    (_, aux), grads2 = opt.compute_gradients(lambda p, x: (loss_fn(p, x), x.sum()), p, x, has_aux=True)
    np.testing.assert_allclose(grads2["w"], expected, rtol=1e-6)
    assert aux.shape == (3,)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        fo.per_example_clipping(0.0)


def test_l1_and_l2_regularization_follow_seed_003():
    p = {"w": jnp.array([2.0, -3.0, 0.0])}
    g = {"w": jnp.array([1.0, 1.0, 1.0])}
    u, _ = _update(fo.l1_regularization(0.1), g, p)
    np.testing.assert_allclose(u["w"], [1.1, 0.9, 1.0])
    u, _ = _update(fo.l2_regularization(0.1), g, p)
    np.testing.assert_allclose(u["w"], [1.2, 0.7, 1.0], rtol=1e-6)
    # through SGD: w ← w − η (g + λ w)
    tx = optax.chain(fo.l2_regularization(0.1), fo.sgd(0.5))
    u, _ = _update(tx, g, p)
    np.testing.assert_allclose(u["w"], -0.5 * np.array([1.2, 0.7, 1.0]), rtol=1e-6)


def test_regularization_needs_params():
    tx = fo.l1_regularization(0.1)
    g = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="l1_regularization needs the parameters") as info:
        tx.update(g, tx.init(g))
    assert "tx.update(grads, state, model)" in str(info.value)


class Block(ft.Module):
    dense: ft.nn.Dense
    scale: jax.Array


def _block():
    return Block(ft.nn.Dense(2, 2, key=jax.random.key(0)), jnp.ones(2))


def test_decoupled_weight_decay_masks_biases_and_scales_by_default():
    model = _block()
    zeros = jax.tree.map(jnp.zeros_like, ft.parameters(model))
    u, _ = _update(fo.weight_decay(0.1), zeros, model)
    np.testing.assert_allclose(u.dense.weight, -0.1 * model.dense.weight, rtol=1e-6)
    np.testing.assert_array_equal(u.dense.bias, 0.0)
    np.testing.assert_array_equal(u.scale, 0.0)
    u, _ = _update(fo.weight_decay(0.1, exclude=("dense.*",)), zeros, model)
    np.testing.assert_array_equal(u.dense.weight, 0.0)
    np.testing.assert_allclose(u.scale, -0.1)
    u, _ = _update(fo.adamw(0.1, weight_decay=0.5), zeros, model)
    np.testing.assert_allclose(u.dense.weight, -0.05 * model.dense.weight, rtol=1e-6)
    np.testing.assert_array_equal(u.dense.bias, 0.0)
    u, _ = _update(fo.adamw(0.1, weight_decay=0.5, exclude=()), zeros, model)
    np.testing.assert_allclose(u.scale, -0.05, rtol=1e-6)


def test_parameter_noise_after_the_update():
    tx = optax.chain(fo.sgd(0.0), fo.add_parameter_noise(0.5, seed=1))
    p = {"w": jnp.zeros(20000)}
    state = tx.init(p)
    u1, state = tx.update(p, state, p)
    u2, state = tx.update(p, state, p)
    assert float(jnp.std(u1["w"])) == pytest.approx(0.5, rel=0.03)
    assert abs(float(jnp.mean(u1["w"]))) < 0.02
    assert not np.allclose(u1["w"], u2["w"])  # fresh noise every step
    state = fo.set_hyperparameters(state, std=0.0)
    u3, _ = tx.update(p, state, p)
    np.testing.assert_array_equal(u3["w"], 0.0)


def test_parameter_noise_of_a_float64_parameter_is_float64_under_x64():
    """add_parameter_noise drew every leaf's noise in float32 and cast it: under x64 a float64
    parameter's noise had float32's digits. It is drawn in the leaf's real dtype (float32 at
    least): float64's digits at the same std; a bfloat16 leaf's still drawn in float32."""
    tx = optax.chain(fo.sgd(0.0), fo.add_parameter_noise(0.5, seed=1))
    with jax.enable_x64(True):
        p = {"w": jnp.zeros(2000, jnp.float64), "h": jnp.zeros(4, jnp.bfloat16)}
        u, _ = jax.jit(tx.update)(p, tx.init(p), p)  # (one program, not one an operation)
    w = np.asarray(u["w"])
    assert w.dtype == np.float64 and np.any(w != w.astype(np.float32).astype(np.float64))
    assert abs(w.std() / 0.5 - 1) < 0.1 and u["h"].dtype == jnp.bfloat16  # 2000 draws: 5 sigma is 8%


def test_gradient_noise_is_annealed():
    tx = fo.add_gradient_noise(1.0, gamma=0.55, seed=0)
    g = {"w": jnp.zeros(20000)}
    state = tx.init(g)
    stds = []
    for _ in range(3):
        u, state = tx.update(g, state)
        stds.append(float(jnp.std(u["w"])))
    expected = [np.sqrt(1.0 / (1 + t) ** 0.55) for t in (0, 1, 2)]
    np.testing.assert_allclose(stds, expected, rtol=0.05)


def test_skip_non_finite_counts_and_keeps_parameters():
    opt = fo.Optimizer(fo.skip_non_finite(fo.adam(0.1)))
    p = {"w": jnp.array([1.0, 2.0])}
    state = opt.init(p)
    p1, state = opt.apply_gradients({"w": jnp.array([1.0, 1.0])}, p, state)
    p2, state2 = opt.apply_gradients({"w": jnp.array([jnp.nan, 1.0])}, p1, state)
    np.testing.assert_array_equal(p2["w"], p1["w"])
    assert int(state2.inner.skipped) == 1 and not bool(state2.inner.applied)
    assert int(fo.context(state2).step) == 1  # the skipped step is not counted as a step
    np.testing.assert_array_equal(fo.moments(state2)["mu"]["w"], fo.moments(state)["mu"]["w"])


def test_non_finite_gradients_propagate_without_skipping():
    opt = fo.Optimizer(fo.sgd(0.1))
    p = {"w": jnp.array([1.0, 2.0])}
    p2, _ = opt.apply_gradients({"w": jnp.array([jnp.inf, 1.0])}, p, opt.init(p))
    assert not np.isfinite(p2["w"][0]) and p2["w"][1] == pytest.approx(1.9)


def test_freeze_by_pattern_and_in_groups():
    model = _block()
    grads = jax.tree.map(jnp.ones_like, ft.parameters(model))
    tx = optax.chain(fo.sgd(1.0), fo.freeze("dense.*"))
    u, _ = _update(tx, grads, model)
    np.testing.assert_array_equal(u.dense.weight, 0.0)
    np.testing.assert_array_equal(u.scale, -1.0)
    tx = fo.groups({"dense": fo.freeze(), "scale": fo.sgd(1.0)})
    u, _ = _update(tx, grads, model)
    np.testing.assert_array_equal(u.dense.bias, 0.0)
    np.testing.assert_array_equal(u.scale, -1.0)


def test_reduce_on_plateau_reads_the_loss():
    tx = optax.chain(fo.sgd(1.0), fo.reduce_on_plateau(factor=0.5, patience=2))
    g = {"w": jnp.ones(())}
    state = tx.init(g)
    scales = []
    for loss in [3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]:
        u, state = tx.update(g, state, g, loss=loss)
        scales.append(-float(u["w"]))
    assert scales[:3] == [1.0, 1.0, 1.0]
    assert scales[-1] < 1.0
    with pytest.raises(ValueError, match="reduce_on_plateau needs the loss"):
        tx.update(g, state, g)


@pytest.mark.parametrize("arg, given", [("patience", 0), ("patience", -1), ("cooldown", -1), ("accumulation_size", 0)])
def test_reduce_on_plateau_refuses_what_optax_takes_unchecked(arg, given):
    # patience=0 (torch's patience=0 ported as it is) halved the rate at every step, the loss
    # falling or not (0.5, 0.25, 0.125 on losses 3, 2, 1); a negative one never reduced.
    with pytest.raises(ValueError, match=f"{arg}={given}; it must be an int >= "):
        fo.reduce_on_plateau(**{arg: given})

def test_reduce_on_plateau_through_minimize():
    opt = fo.Optimizer(optax.chain(fo.sgd(0.1), fo.reduce_on_plateau(0.5, patience=1)))
    p = {"w": jnp.zeros(())}
    state = opt.init(p)
    for _ in range(4):  # constant loss: a plateau
        p, state, _ = opt.minimize(lambda p: 1.0 + 1e-3 * p["w"], p, state)
    assert float(state.inner[1].inner.scale) < 1.0


def test_gradient_accumulation_in_one_step_matches_the_full_batch():
    x = jax.random.normal(jax.random.key(0), (12, 3))
    y = jnp.arange(12.0)[:, None]
    model = ft.nn.Dense(3, 1, key=jax.random.key(1))
    loss_fn = lambda m, x, y: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    full = fo.Optimizer(fo.adam(0.1))
    acc = fo.Optimizer(fo.adam(0.1), accumulate=3)
    s_full, s_acc = full.init(model), acc.init(model)
    m_full, s_full, l_full = ft.jit(lambda m, s: full.minimize(loss_fn, m, s, x, y))(model, s_full)
    m_acc, s_acc, l_acc = ft.jit(lambda m, s: acc.minimize(loss_fn, m, s, x, y))(model, s_acc)
    assert_close_trained(m_acc, m_full, spread=2e-7)  # 3 micro-batches vs the full batch: measured max 1.5e-7
    assert_close_trained(l_acc, l_full, spread=2e-7)
    ctx = fo.context(s_acc)
    assert (int(ctx.step), int(ctx.samples_seen), int(ctx.minibatch_size)) == (1, 12, 12)
    aux_fn = lambda m, x, y: (loss_fn(m, x, y), y.sum())  # noqa: E731
    (_, aux), _ = ft.jit(lambda m: acc.compute_gradients(aux_fn, m, x, y, has_aux=True))(model)
    np.testing.assert_allclose(aux, [6.0, 22.0, 38.0])


def test_accumulation_errors():
    with pytest.raises(ValueError, match="accumulate must be a positive int"):
        fo.Optimizer(fo.sgd(), accumulate=0)
    opt = fo.Optimizer(fo.sgd(), accumulate=4)
    p = {"w": jnp.zeros(())}
    with pytest.raises(ValueError, match=r"accumulate=4 needs the batch's leading dimension.*shape \(6,\)"):
        opt.minimize(lambda p, x: jnp.mean(x) * p["w"], p, opt.init(p), jnp.ones(6))
    # The fix the error shows trims every batch argument (not x alone, then y blamed next).
    loss = lambda p, x, y: jnp.mean(x[None, :] * y) * p["w"]  # noqa: E731
    x, y = jnp.ones(6), jnp.ones((6, 1))
    with pytest.raises(ValueError, match=r"(?s)right:  x, y = jax.tree.map\(lambda a: a\[: 4 \* \(len\(a\) // 4\)\], "
                                         r"\(x, y\)\)"):
        opt.minimize(loss, p, opt.init(p), x, y)
    x, y = jax.tree.map(lambda a: a[: 4 * (len(a) // 4)], (x, y))
    opt.minimize(loss, p, opt.init(p), x, y)


@pytest.mark.parametrize("compute_dtype", [None, jnp.bfloat16])
def test_accumulation_threads_batch_norm_statistics_through_the_microbatches_as_torch(compute_dtype):
    # The audit: with accumulate=k the running statistics came from the last microbatch
    # alone (running_mean = 0.1 * its mean, 0.099 from torch's). torch's k microbatch
    # forwards update them k times; now microbatch i starts from microbatch i - 1's.
    # functree's momentum m is torch's 1 - m; its running variance takes the biased batch
    # variance where torch's takes the unbiased one.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((32, 8)) * 3.0 + 2.0).astype(np.float32)
    y = rng.standard_normal((32, 3)).astype(np.float32)
    k, m = 4, 0.9
    model = ft.nn.training(ft.nn.Sequential([ft.nn.BatchNorm(8, momentum=m), ft.nn.Dense(8, 3, key=jax.random.key(0))]))
    loss_fn = lambda mm, b: ft.losses.mean_squared_error(mm(b[0]), b[1])  # noqa: E731
    opt = fo.Optimizer(fo.sgd(0.5), accumulate=k)
    new, _, _ = ft.train.train_step(loss_fn, opt, compute_dtype=compute_dtype, donate=False)(
        model, opt.init(model), (jnp.asarray(x), jnp.asarray(y)))
    bn = new.layers[0]
    parts = [x[i * 8:(i + 1) * 8] for i in range(k)]
    if compute_dtype is not None:  # the step's batch is cast: the statistics are the cast rows'
        parts = [np.asarray(jnp.asarray(p, compute_dtype), np.float32) for p in parts]
    tbn = torch.nn.BatchNorm1d(8, momentum=1 - m)
    for p in parts:  # torch: k forwards, k updates
        tbn(torch.tensor(p))
    scale = float(np.abs(tbn.running_mean.numpy()).max())
    np.testing.assert_allclose(np.asarray(bn.running_mean), tbn.running_mean.numpy(), rtol=0, atol=2e-6 * scale)
    var, torch_var = 1.0, 1.0  # the same recursion with each convention's batch variance
    for p in parts:
        var = m * var + (1 - m) * np.var(p.astype(np.float64), axis=0)
        torch_var = m * torch_var + (1 - m) * np.var(p.astype(np.float64), axis=0, ddof=1)
    np.testing.assert_allclose(tbn.running_var.numpy(), torch_var, rtol=0, atol=2e-6 * float(torch_var.max()))
    np.testing.assert_allclose(np.asarray(bn.running_variance), var, rtol=0, atol=2e-6 * float(var.max()))
    # the gradients are unchanged: training mode normalises with each microbatch's statistics
    def by_hand(i):
        b = (jnp.asarray(x[i * 8:(i + 1) * 8]), jnp.asarray(y[i * 8:(i + 1) * 8]))
        if compute_dtype is not None:
            b = jax.tree.map(lambda a: a.astype(compute_dtype), b)
            f = lambda mm, b: loss_fn(ft.cast(mm, compute_dtype), b).astype(jnp.float32)  # noqa: E731
        else:
            f = loss_fn
        return ft.nn.value_with_gradient_and_state(f, model, b)[1]
    grads = [by_hand(i) for i in range(k)]
    weight = model.layers[1].weight - 0.5 * sum(g.layers[1].weight for g in grads) / k
    np.testing.assert_allclose(np.asarray(new.layers[1].weight), np.asarray(weight), rtol=0,
                               atol=1e-6 * float(np.abs(np.asarray(weight)).max()))


def test_one_microbatch_records_the_batch_norm_statistics_as_the_plain_step():
    # accumulate=1 has no loop: the step's statistics are one update, bit for bit as before
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32)
    model = ft.nn.training(ft.nn.BatchNorm(4, momentum=0.9))
    opt = fo.Optimizer(fo.sgd(0.0), accumulate=1)
    new, _, _ = opt.minimize(lambda mm, x: jnp.mean(mm(x) ** 2), model, opt.init(model), x)
    _, state = ft.nn.collect_state(lambda mm: mm(x), model)
    np.testing.assert_array_equal(np.asarray(new.running_mean), np.asarray(state[ft.key_path(model, ".running_mean")]))


def test_per_example_clipping_norms_only_the_trained_parameters_as_opacus():
    # Opacus clips the per-example gradients of the parameters that require grad: with
    # wrt="layers.2.*" a frozen first layer's gradients must not count in the norm (the
    # old hook took every parameter's: 6.5e-4 off after one step).
    torch, net, model, xs, ys = torch_mlp()
    x, y = xs[0], ys[0]
    threshold, lr = 0.3, 0.1

    opt = fo.Optimizer(fo.sgd(lr), get_gradients=fo.per_example_clipping(threshold), wrt="layers.2.*")
    _, grads = opt.compute_gradients(lambda m, x, y: jnp.mean((m(x) - y) ** 2), model, x, y)
    assert grads.layers[0].weight is None  # a frozen parameter's gradient is never computed
    new, _, _ = opt.minimize(lambda m, x, y: jnp.mean((m(x) - y) ** 2), model, opt.init(model), x, y)

    net[0].requires_grad_(False)
    clipped = []
    for j in range(16):  # Opacus' rule, one example at a time
        net.zero_grad()
        ((net(torch.tensor(x[j:j + 1])) - torch.tensor(y[j:j + 1])) ** 2).mean().backward()
        g = [net[2].weight.grad.clone(), net[2].bias.grad.clone()]
        norm = float(torch.sqrt(sum((t ** 2).sum() for t in g)))
        clipped.append([t * min(1.0, threshold / norm) for t in g])
    weight = net[2].weight.detach().numpy() - lr * sum(c[0] for c in clipped).numpy() / 16
    bias = net[2].bias.detach().numpy() - lr * sum(c[1] for c in clipped).numpy() / 16
    # measured 1.5e-8 on weights ~0.35
    np.testing.assert_allclose(new.layers[2].weight, weight.T, rtol=0, atol=2e-7)
    np.testing.assert_allclose(new.layers[2].bias, bias, rtol=0, atol=2e-7)
    np.testing.assert_array_equal(new.layers[0].weight, model.layers[0].weight)


def test_reduce_on_plateau_in_an_optimizer_needs_the_loss_of_the_step():
    # apply_gradients/update without loss= read context.loss (NaN, or an earlier step's):
    # the rate halved every `patience` steps silently (scale 0.0625 after 8 steps).
    plateau = optax.chain(fo.sgd(1.0), fo.reduce_on_plateau(factor=0.5, patience=2))
    opt = fo.Optimizer(plateau)
    p = {"w": jnp.zeros(())}
    g = {"w": jnp.ones(())}
    state = opt.init(p)
    with pytest.raises(ValueError, match=r"reduce_on_plateau needs the loss(.|\n)*"
                                         r"opt\.apply_gradients\(grads, model, state, loss=loss\)"):
        opt.apply_gradients(g, p, state)
    with pytest.raises(ValueError, match="reduce_on_plateau needs the loss"):
        opt.update(g, state, p)
    # given: optax.contrib's own rule on the same losses
    ref = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=2))
    ref_state = ref.init(p)
    losses = [3.0, 2.0, 2.5, 2.5, 1.0, 1.0, 1.0, 1.0]
    for loss in losses:
        p, state = opt.apply_gradients(g, p, state, loss=loss)
        with jax.numpy_dtype_promotion("standard"):
            _, ref_state = ref.update(g, ref_state, p, value=jnp.float32(loss))
    scale = float(state.inner[1].inner.scale)
    assert scale == float(ref_state[1].scale) == 0.25
    p_ref = {"w": jnp.zeros(())}
    ref_state = ref.init(p_ref)
    for loss in losses:
        with jax.numpy_dtype_promotion("standard"):
            u, ref_state = ref.update(g, ref_state, p_ref, value=jnp.float32(loss))
        p_ref = optax.apply_updates(p_ref, u)
    np.testing.assert_allclose(p["w"], p_ref["w"], rtol=0, atol=1e-6)  # measured 0 on w ~5


def _member_gradients(stack, scale=1.0):
    """Gradients at a Stack of three Dense(1, 2): member norms 5, 0.5 and 10 (times scale)
    in the weight, 5 in each bias."""
    weight = scale * np.array([[[3.0, 4.0]], [[0.3, 0.4]], [[6.0, 8.0]]], np.float32)
    bias = np.full((3, 2), np.sqrt(12.5), np.float32)
    return jax.tree.map(lambda x: jnp.asarray(np.broadcast_to(weight if x.ndim == weight.ndim else bias, x.shape)), stack)


def test_per_tensor_clipping_clips_each_member_of_a_stack_as_the_unrolled_layers():
    """A Stack's leaf holds one tensor per member: clip_by_norm (and clip_per_sample by
    norm) clip each member by its own norm, as the blocks unrolled would be (the stacked
    leaf's one norm, 11.2, clipped member 1's [0.3, 0.4] to [0.027, 0.036])."""
    stack = ft.nn.Stack(lambda k: ft.nn.Dense(1, 2, key=k), 3, key=jax.random.key(0))
    g = _member_gradients(stack)
    want = np.array([[[0.6, 0.8]], [[0.3, 0.4]], [[0.6, 0.8]]])
    for tx, extra in [(fo.clip_by_norm(1.0), {}), (fo.clip_per_sample(1.0, truncation=False), {"minibatch_size": 4})]:
        u, _ = _update(tx, {"blocks": g}, **extra)
        np.testing.assert_allclose(u["blocks"].layers.weight, want, rtol=0, atol=1e-7)
        np.testing.assert_allclose(np.linalg.norm(u["blocks"].layers.bias, axis=-1), [1.0] * 3, rtol=0, atol=1e-6)
        unrolled, _ = _update(tx, {"blocks": g.unstack()}, **extra)
        for i, member in enumerate(unrolled["blocks"].layers):
            np.testing.assert_allclose(u["blocks"].layers.weight[i], member.weight, rtol=0, atol=1e-7)
    # a batch of models (jax.vmap): one norm per model and member
    ensemble = jax.vmap(lambda k: ft.nn.Stack(lambda kk: ft.nn.Dense(1, 2, key=kk), 3, key=k))(
        jax.random.split(jax.random.key(1), 2))
    g = jax.tree.map(lambda a, b: jnp.stack([a, b]), _member_gradients(stack), _member_gradients(stack, 2.0))
    g = jax.tree.unflatten(jax.tree.structure(ensemble), jax.tree.leaves(g))
    u, _ = _update(fo.clip_by_norm(1.0), g)
    np.testing.assert_allclose(u.layers.weight, [want, [[[0.6, 0.8]]] * 3], rtol=0, atol=1e-7)


def test_per_example_clipping_takes_a_complex_gradients_whole_norm_and_float64s_own():
    """Each example's norm was taken of g.astype(float32): a complex gradient lost its
    imaginary part (clipped by the wrong factor: 1.6e-2 off torch's step, only JAX's
    ComplexWarning said so) and a float64 one was normed in float32 (5e-10 off)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    w0 = (rng.normal(size=3) + 1j * rng.normal(size=3)).astype(np.complex64)
    xs = (rng.normal(size=(4, 3)) + 1j * rng.normal(size=(4, 3))).astype(np.complex64)
    ys = rng.normal(size=4).astype(np.complex64)  # (real targets; complex for strict promotion)

    def loss(p, x, y):
        return jnp.mean(jnp.abs(x @ p["w"] - y) ** 2)

    def step(p, x, y, threshold):
        opt = fo.Optimizer(fo.sgd(0.1), get_gradients=fo.per_example_clipping(threshold))
        return opt.minimize(loss, p, opt.init(p), x, y)[0]["w"]

    tw, clipped = torch.tensor(w0, requires_grad=True), []
    for i in range(4):  # torch's complex norm: sqrt(sum |g|^2)
        g, = torch.autograd.grad((torch.abs(torch.tensor(xs[i:i + 1]) @ tw - torch.tensor(ys[i:i + 1])) ** 2).mean(), tw)
        clipped.append(g * min(1.0, 0.5 / float(torch.linalg.vector_norm(g))))
    expected = w0 - 0.1 * (sum(clipped) / 4).numpy()
    np.testing.assert_allclose(np.asarray(step({"w": jnp.asarray(w0)}, xs, ys, 0.5)), expected, rtol=0, atol=1e-6)
    with jax.enable_x64(True):
        p = {"w": jnp.asarray(rng.normal(size=3))}
        x, y = rng.normal(size=(12, 3)) * 2, rng.normal(size=12)
        gs = [jax.grad(loss)(p, x[i:i + 1], y[i:i + 1])["w"] for i in range(12)]
        expected64 = p["w"] - 0.1 * sum(g * jnp.minimum(1, 0.7 / jnp.linalg.norm(g)) for g in gs) / 12
        np.testing.assert_allclose(np.asarray(step(p, x, y, 0.7)), np.asarray(expected64), rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=needs_float16_conversions)])
def test_clip_by_global_norm_clips_half_precision_gradients(dtype):
    """The default 2-norm ran optax.clip_by_global_norm, whose lax.select of a bfloat16
    gradient and the float32 threshold raised a TypeError inside JAX (norm_type=3 worked)."""
    grads = {"w": jnp.full(4, 3.0, dtype), "b": jnp.full(2, 4.0, dtype)}
    tx = fo.clip_by_global_norm(1.0)
    out = tx.update(grads, tx.init(grads))[0]
    norm = float(np.sqrt(4 * 9.0 + 2 * 16.0))
    for name in grads:
        assert out[name].dtype == dtype
        np.testing.assert_allclose(np.asarray(out[name], np.float32), np.asarray(grads[name], np.float32) / norm,
                                   rtol=0, atol=4e-3)  # half precision's rounding of values below 1
    f32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    ours, theirs = tx.update(f32, tx.init(f32))[0], optax.clip_by_global_norm(1.0).update(f32, None)[0]
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)  # float32: optax's numbers, bit for bit
