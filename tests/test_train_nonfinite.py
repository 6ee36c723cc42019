"""functree.train._nonfinite: the error of a step that was not finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import needs_float16_conversions

import functree as ft

pytestmark = needs_float16_conversions  # every test here computes in float16


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


def test_a_float16_forward_overflow_under_a_loss_scale_stops_naming_the_loss():
    # It blamed the gradient of 'weight' and advised on_nan="skip" alone; the loss was not
    # finite before it was scaled, which no loss scale can make finite.
    trainer = _trainer("stop")
    with pytest.raises(ft.train.NonFiniteError, match=r"(?s)step 3: the loss was not finite.*"
                       r"LossScaleOptimizer.*no scale makes it finite.*compute_dtype=jnp.bfloat16") as info:
        trainer.fit(_overflow_data(), epochs=1, progress=False, log_every=1)
    assert info.value.step == 3 and info.value.parameter is None
    assert trainer.steps_run == 2 and float(trainer.opt_state.scale) == 2.0**8


def test_on_nan_skip_skips_the_overflowed_loss_and_keeps_the_scale():
    # torch's GradScaler skips this step too (it halves the scale: 256 -> 128); here the
    # scale was not the cause, so it is kept.
    trainer = _trainer("skip")
    trainer.fit(_overflow_data(), epochs=1, progress=False, log_every=1)
    losses = trainer.history.steps["loss"]
    assert trainer.steps_run == 4 and np.isnan(losses[2]) and np.all(np.isfinite(np.delete(losses, 2)))
    assert float(trainer.opt_state.scale) == 2.0**8 and int(trainer.opt_state.skipped) == 0


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
