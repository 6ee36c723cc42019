"""functree.train._nonfinite: the error of a step that was not finite."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import needs_float16_conversions

import functree as ft


def _overflow_data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8, 4)).astype(np.float32)
    y = rng.standard_normal((4, 8, 2)).astype(np.float32)
    x[2, 0] = 1e5  # above float16's largest (65504): the float16 forward of minibatch 3 overflows
    return [(x[i], y[i]) for i in range(4)]


def _trainer(on_nan):
    model = ft.nn.Dense(4, 2, key=jax.random.key(0))
    opt = ft.optim.LossScaleOptimizer(ft.optim.Optimizer(ft.optim.sgd(1e-2)), initial_scale=2.0**8)
    return ft.train.Trainer(model, opt, lambda m, b: ft.losses.mean_squared_error(m(b[0]), b[1]),
                            compute_dtype=jnp.float16, on_nan=on_nan)


@needs_float16_conversions  # computes in float16
def test_a_float16_forward_overflow_under_a_loss_scale_stops_naming_the_loss():
    # It blamed the gradient of 'weight' and advised on_nan="skip" alone; the loss was not
    # finite before it was scaled, which no loss scale can make finite.
    trainer = _trainer("stop")
    with pytest.raises(ft.train.NonFiniteError, match=r"(?s)step 3: the loss was not finite.*"
                       r"LossScaleOptimizer.*no scale makes it finite.*compute_dtype=jnp.bfloat16") as info:
        trainer.fit(_overflow_data(), epochs=1, progress=False, log_every=1)
    assert info.value.step == 3 and info.value.parameter is None
    assert trainer.steps_run == 2 and float(trainer.opt_state.scale) == 2.0**8


@needs_float16_conversions  # computes in float16
def test_on_nan_skip_skips_the_overflowed_loss_and_keeps_the_scale():
    # torch's GradScaler skips this step too (it halves the scale: 256 -> 128); here the
    # scale was not the cause, so it is kept.
    trainer = _trainer("skip")
    trainer.fit(_overflow_data(), epochs=1, progress=False, log_every=1)
    losses = trainer.history.steps["loss"]
    assert trainer.steps_run == 4 and np.isnan(losses[2]) and np.all(np.isfinite(np.delete(losses, 2)))
    assert float(trainer.opt_state.scale) == 2.0**8 and int(trainer.opt_state.skipped) == 0


@needs_float16_conversions  # computes in float16
def test_the_skipped_trajectory_matches_torchs_grad_scaler():
    torch = pytest.importorskip("torch")
    data = _overflow_data()
    trainer = _trainer("skip")
    w0 = np.asarray(trainer.model.weight)
    trainer.fit(data, epochs=1, progress=False, log_every=1)
    w = torch.nn.Parameter(torch.tensor(w0.T.copy()))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w, b], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    losses = []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.nn.functional.linear(torch.tensor(x), w, b)
        loss = torch.nn.functional.mse_loss(out.float(), torch.tensor(y))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert np.isnan(losses[2]) and scaler.get_scale() == 2.0**7  # torch skips step 3 too
    # float16 forwards (losses ~2, float16's spacing there 2e-3): the same steps applied
    np.testing.assert_allclose(trainer.history.steps["loss"], losses, rtol=0, atol=2e-3)
    np.testing.assert_allclose(trainer.model.weight, w.detach().numpy().T, rtol=0, atol=2e-3)
    np.testing.assert_allclose(trainer.model.bias, b.detach().numpy(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("name", ["optax.apply_if_finite", "ft.optim.skip_non_finite"])
def test_an_optimizer_that_skips_by_itself_is_named_with_on_nan_ignore(name):
    # Before: the stop advised lower learning rates and on_nan="skip" alone; the optimizer's
    # own skipping never ran, and nothing said the step's check came first.
    x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)
    x[5, 0] = np.nan  # one minibatch an epoch
    make = {"optax.apply_if_finite": lambda: optax.apply_if_finite(ft.optim.sgd(0.1), 3),
            "ft.optim.skip_non_finite": lambda: ft.optim.skip_non_finite(ft.optim.sgd(0.1))}[name]
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    loss_fn = lambda m, b: ft.losses.mean_squared_error(m(b[0]), b[1])  # noqa: E731
    with pytest.raises(ft.train.NonFiniteError, match=rf"(?s)skips non-finite steps itself \({name}\).*"
                                                      r'on_nan="ignore"\)   # ' + name.replace(".", r"\.") + " skips"):
        ft.train.Trainer(model, make(), loss_fn).fit((x, y), batch_size=4, progress=False)
    trainer = ft.train.Trainer(model, make(), loss_fn, on_nan="ignore")  # the advised fix
    trainer.fit((x, y), batch_size=4, epochs=2, progress=False)
    assert trainer.steps_run == 4 and bool(jnp.isfinite(trainer.model.weight).all())
    skipped = next(x for x in jax.tree.leaves(trainer.opt_state, is_leaf=lambda x: hasattr(x, "_fields"))
               if type(x).__name__ in ("ApplyIfFiniteState", "SkipState"))
    total = getattr(skipped, "total_notfinite", getattr(skipped, "skipped", None))
    assert int(total) == 2  # one NaN minibatch an epoch, skipped by the optimizer


def test_a_plain_optimizer_s_stop_does_not_name_on_nan_ignore():
    x = np.full((4, 2), np.nan, np.float32)
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: ft.losses.mean_squared_error(m(b), jnp.zeros((4, 1))))
    with pytest.raises(ft.train.NonFiniteError) as info:
        trainer.fit(x, batch_size=4, progress=False)
    assert "itself" not in str(info.value) and 'on_nan="ignore"' not in str(info.value)
