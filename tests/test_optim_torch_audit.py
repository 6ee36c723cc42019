"""ft.optim against torch.optim, torch's lr_schedulers, torch.nn.utils' clipping and CNTK's
momentum, in float64 with non-default options (the float32 100-step comparisons with
default options are tests/test_optim_aliases.py's)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
import functree.optim as fo
from functree.optim._average import keeps_average

torch = pytest.importorskip("torch")

STEPS = 20
RNG = np.random.default_rng(0)
W0, B0 = RNG.normal(size=(4, 3)), RNG.normal(size=3)
GW, GB = RNG.normal(size=(STEPS, 4, 3)), RNG.normal(size=(STEPS, 3))


def _gradient(gw, gb, w, b, tanh):
    """The gradient of a step: a fixed draw (``gw``, ``gb``) plus a term of the parameters
    (so the coupled weight decay, the moments and the parameters interact as in training)."""
    return gw + 0.5 * tanh(w), gb + 0.5 * tanh(b)


# name: (ours, torch's); every option that is not torch's default where functree has it
CASES = {
    "sgd_nesterov_l2": (lambda: fo.sgd(0.05, 0.8, nesterov=True, weight_decay=0.1),
                        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1)),
    "rmsprop_centered_momentum_l2": (
        lambda: fo.rmsprop(0.01, rho=0.95, epsilon=1e-3, momentum=0.7, weight_decay=0.1, centered=True),
        lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.95, eps=1e-3, momentum=0.7, weight_decay=0.1,
                                      centered=True)),
    "adagrad_accumulator_l2": (
        lambda: fo.adagrad(0.1, initial_accumulator_value=0.5, epsilon=1e-3, weight_decay=0.2),
        lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.5, eps=1e-3, weight_decay=0.2)),
    "adagrad_lr_decay": (  # adagrad's docstring: torch's lr_decay as a schedule
        lambda: fo.adagrad(fo.schedule(lambda c: 0.1 / (1 + 0.05 * c)), initial_accumulator_value=0.0,
                           epsilon=1e-10),
        lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.05)),
    "adadelta_l2": (lambda: fo.adadelta(0.5, rho=0.8, epsilon=1e-4, weight_decay=0.1),
                    lambda p: torch.optim.Adadelta(p, lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.1)),
    "adam_l2": (lambda: fo.adam(0.01, 0.8, 0.95, 1e-4, weight_decay=0.1),
                lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1)),
    "amsgrad_l2": (lambda: fo.amsgrad(0.01, 0.8, 0.95, 1e-4, weight_decay=0.1),
                   lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1,
                                              amsgrad=True)),
    "adamw_decoupled": (lambda: fo.adamw(0.01, 0.8, 0.95, 1e-4, weight_decay=0.3, exclude=()),
                        lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.3)),
    "adamax_l2": (lambda: fo.adamax(0.01, 0.8, 0.95, 1e-3, weight_decay=0.1),
                  lambda p: torch.optim.Adamax(p, lr=0.01, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1)),
    "adamw_amsgrad": (  # amsgrad's docstring
        lambda: optax.chain(fo.amsgrad(0.01, 0.8, 0.95, 1e-4), fo.weight_decay(0.01 * 0.3, exclude=())),
        lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.3, amsgrad=True)),
    "radam": (lambda: fo.radam(0.01), lambda p: torch.optim.RAdam(p, lr=0.01)),
    "radam_decoupled": (  # radam's docstring
        lambda: optax.chain(fo.radam(0.01), fo.weight_decay(0.01 * 0.3, exclude=())),
        lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=0.3, decoupled_weight_decay=True)),
    "radam_l2": (lambda: fo.radam(0.01, 0.8, 0.95, 1e-4, weight_decay=0.1),
                 lambda p: torch.optim.RAdam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1)),
    # torch's NAdam, Rprop, ASGD (its average ax too), SGD's dampening: no attribute until 2026-12-05
    "nadam_l2_maximize": (
        lambda: fo.nadam(0.02, 0.8, 0.95, 1e-4, weight_decay=0.1, momentum_decay=0.01, maximize=True),
        lambda p: torch.optim.NAdam(p, lr=0.02, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1, momentum_decay=0.01,
                                    maximize=True)),
    "nadam_decoupled_scheduled": (
        lambda: fo.nadam(fo.exponential_decay(0.02, 1, 0.8), weight_decay=0.2, decoupled_weight_decay=True),
        lambda p: torch.optim.NAdam(p, lr=0.02, weight_decay=0.2, decoupled_weight_decay=True)),
    "rprop_maximize": (
        lambda: fo.rprop(0.05, etas=(0.4, 1.5), step_sizes=(1e-3, 0.2), maximize=True),
        lambda p: torch.optim.Rprop(p, lr=0.05, etas=(0.4, 1.5), step_sizes=(1e-3, 0.2), maximize=True)),
    "asgd_l2_maximize": (
        lambda: fo.asgd(0.05, lambd=0.1, alpha=0.6, t0=4, weight_decay=0.2, maximize=True),
        lambda p: torch.optim.ASGD(p, lr=0.05, lambd=0.1, alpha=0.6, t0=4, weight_decay=0.2, maximize=True)),
    "asgd_scheduled": (lambda: fo.asgd(fo.exponential_decay(0.05, 1, 0.8), lambd=0.3, t0=2.5),
                       lambda p: torch.optim.ASGD(p, lr=0.05, lambd=0.3, t0=2.5)),
    "sgd_dampening_l2_maximize": (
        lambda: fo.sgd(0.05, 0.8, weight_decay=0.1, dampening=0.3, maximize=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.1, maximize=True)),
    "sgd_dampening_scheduled": (lambda: fo.sgd(fo.exponential_decay(0.05, 1, 0.8), 0.9, dampening=0.5),
                                lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.5)),
    # maximize=True wherever torch has it: the gradient negated before the weight decay adds λw
    **{f"{name}_maximize": (lambda ours=ours: ours(maximize=True), lambda p, theirs=theirs: theirs(p, maximize=True))
       for name, (ours, theirs) in {
           "sgd_nesterov": (lambda **k: fo.sgd(0.05, 0.8, True, weight_decay=0.1, **k),
                            lambda p, **k: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1, **k)),
           "adam": (lambda **k: fo.adam(0.01, weight_decay=0.1, **k),
                    lambda p, **k: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, **k)),
           "amsgrad": (lambda **k: fo.amsgrad(0.01, weight_decay=0.1, **k),
                       lambda p, **k: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, amsgrad=True, **k)),
           "adamw": (lambda **k: fo.adamw(0.01, weight_decay=0.3, exclude=(), **k),
                     lambda p, **k: torch.optim.AdamW(p, lr=0.01, weight_decay=0.3, **k)),
           "adamax": (lambda **k: fo.adamax(0.01, weight_decay=0.1, **k),
                      lambda p, **k: torch.optim.Adamax(p, lr=0.01, weight_decay=0.1, **k)),
           "adagrad": (lambda **k: fo.adagrad(0.1, weight_decay=0.1, **k),
                       lambda p, **k: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=1e-8,
                                                          weight_decay=0.1, **k)),
           "adadelta": (lambda **k: fo.adadelta(0.5, weight_decay=0.1, **k),
                        lambda p, **k: torch.optim.Adadelta(p, lr=0.5, rho=0.95, weight_decay=0.1, **k)),
           "rmsprop": (lambda **k: fo.rmsprop(0.01, 0.95, momentum=0.5, weight_decay=0.1, centered=True, **k),
                       lambda p, **k: torch.optim.RMSprop(p, lr=0.01, alpha=0.95, momentum=0.5, weight_decay=0.1,
                                                          centered=True, **k)),
           "radam": (lambda **k: fo.radam(0.01, weight_decay=0.1, **k),
                     lambda p, **k: torch.optim.RAdam(p, lr=0.01, weight_decay=0.1, **k)),
       }.items()},
}
SCHEDULED = {"nadam_decoupled_scheduled", "asgd_scheduled", "sgd_dampening_scheduled"}  # ExponentialLR(0.8)


def _ours(make, gw, gb):
    tx = make()

    def step(t, carry):
        p, s = carry
        g = dict(zip(("weight", "bias"), _gradient(gw[t], gb[t], p["weight"], p["bias"], jnp.tanh)))
        u, s = tx.update(g, s, p)
        return jax.tree.map(jnp.add, p, u), s

    p = {"weight": jnp.asarray(W0), "bias": jnp.asarray(B0)}
    p, s = jax.lax.fori_loop(0, STEPS, step, (p, tx.init(p)))
    return p, (fo.averaged(s, p) if keeps_average(s) else p)  # ASGD's ax


def _torch(make, scheduled=False):
    """torch's parameters after STEPS and ASGD's ``ax`` (else the parameters again), with
    ExponentialLR(0.8) where ``scheduled``. Run under torch's default dtype float64: torch
    keeps NAdam's ``mu_product`` and ASGD's ``eta`` and ``mu`` in the default dtype (float32:
    1e-9 off in float64 after one step)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        w, b = torch.tensor(W0, requires_grad=True), torch.tensor(B0, requires_grad=True)
        opt = make([w, b])
        decay = torch.optim.lr_scheduler.ExponentialLR(opt, 0.8) if scheduled else None
        for t in range(STEPS):
            with torch.no_grad():
                w.grad, b.grad = _gradient(torch.tensor(GW[t]), torch.tensor(GB[t]), w, b, torch.tanh)
            opt.step()
            if decay is not None:
                decay.step()
    finally:
        torch.set_default_dtype(before)
    ax = [opt.state[x].get("ax", x).detach().numpy() for x in (w, b)]
    return {"weight": w.detach().numpy(), "bias": b.detach().numpy()}, dict(zip(["weight", "bias"], ax))


@pytest.fixture(scope="module")
def ours():
    """Every case's parameters after STEPS, in float64, all compiled in one program."""
    with jax.enable_x64(True):
        run = jax.jit(lambda gw, gb: {name: _ours(make, gw, gb) for name, (make, _) in CASES.items()})
        return jax.tree.map(np.asarray, run(jnp.asarray(GW), jnp.asarray(GB)))  # arguments: not folded


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_trajectories_with_non_default_options_are_torchs(name, ours):
    """Measured: at most 1.8e-15 on parameters of magnitude 2.3, but RAdam at β₂ = 0.95
    (1.3e-13: torch computes ρₜ with the cancellation _radam.py avoids). RAdam's ρₜ and bias
    corrections were computed in float32 whatever the parameters: 9.5e-8 off in float64.
    NAdam, Rprop, ASGD (its average too), dampening and ``maximize`` (all 1e-15) did not
    exist; optax.nadam is 2.8η from torch's NAdam after ten steps, optax.rprop 0.26 (its
    steps lag one behind torch's)."""
    expected, average = _torch(CASES[name][1], name in SCHEDULED)
    params, averaged = ours[name]
    for k in expected:
        assert params[k].dtype == np.float64
        np.testing.assert_allclose(params[k], expected[k], rtol=0, atol=1e-11, err_msg=f"{name}.{k}")
        np.testing.assert_allclose(averaged[k], average[k], rtol=0, atol=1e-11, err_msg=f"{name}.{k} average")


LR = 0.1
SCHEDULES = {  # name: (ours, torch's scheduler of an SGD at LR)
    "StepLR": (fo.exponential_decay(LR, 3, 0.5, staircase=True), lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)),
    "MultiStepLR": (fo.piecewise([(3, LR), (4, LR * 0.1), (1, LR * 0.01)]),
                    lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [3, 7], 0.1)),
    "ExponentialLR": (fo.exponential_decay(LR, 1, 0.8), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.8)),
    "CosineAnnealingLR": (fo.cosine_decay(LR, STEPS, alpha=0.1),
                          lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, STEPS, eta_min=0.1 * LR)),
    "LinearLR": (fo.linear_warmup(LR, 4, init_value=0.25 * LR),
                 lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.25, 1.0, total_iters=4)),
    "warmup_cosine": (fo.warmup_cosine_decay(0.0, LR, 4, STEPS),  # transformers' get_cosine_schedule_with_warmup
                      lambda o: torch.optim.lr_scheduler.LambdaLR(
                          o, lambda e: e / 4 if e < 4 else 0.5 * (1 + np.cos(np.pi * (e - 4) / (STEPS - 4))))),
    "inverse_time": (fo.inverse_time_decay(LR, 0.5), lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda e: 1 / (1 + 0.5 * (e + 1)))),
    "constant": (fo.constant(LR), lambda o: torch.optim.lr_scheduler.ConstantLR(o, 1.0, 0)),
}


def _torch_rates(make):
    opt = torch.optim.SGD([torch.zeros((), requires_grad=True)], lr=LR)
    scheduler, rates = make(opt), []
    for _ in range(STEPS):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return np.asarray(rates)


def test_float64_schedules_give_torchs_rates_to_the_last_bit():
    """The rate of each update (the context's step 0 is torch's first ``opt.step()``).
    Under x64 the schedules were float32 wherever the count or the values were: StepLR's
    0.1 · 0.5 came out 0.05000000074 (1.5e-9 off; ExponentialLR's 5.7e-9), which the
    optimizer then applied to float64 parameters."""
    with jax.enable_x64(True):
        ctx = fo.initial_context()
        at = jax.jit(jax.vmap(lambda s: {n: f(ctx.replace(step=s)) for n, (f, _) in SCHEDULES.items()}))
        ours = at(jnp.arange(STEPS))
    for name, (_, make) in SCHEDULES.items():
        assert ours[name].dtype == jnp.float64, name
        np.testing.assert_allclose(np.asarray(ours[name]), _torch_rates(make), rtol=0, atol=1e-16, err_msg=name)


def test_exponential_decay_refuses_a_negative_decay_rate():
    # optax took it: 0.1 · (-0.5)^(c/10) is NaN from the second step on (without staircase).
    with pytest.raises(ValueError, match=r"decay_rate=-0.5; it must be finite and >= 0: a negative base") as info:
        fo.exponential_decay(0.1, 10, -0.5)
    assert "right:  ft.optim.exponential_decay(0.1, 10, decay_rate=0.5)" in str(info.value)
    assert np.isfinite(float(fo.exponential_decay(0.1, 10, 0.0)(fo.initial_context())))


@pytest.mark.parametrize("code, value", [
    ("ft.optim.sgd(learning_rate=ft.optim.piecewise([(3, 0.1), (1, -0.01)]))", "-0.01"),
    ("ft.optim.sgd(learning_rate=ft.optim.exponential_decay(-0.1, 4, 0.5, unit='sweeps'))", "-0.1"),
    ("ft.optim.adamw(learning_rate=ft.optim.warmup_cosine_decay(0.0, 0.001, 10, 100, -1e-05))", "-1e-05"),
    ("ft.optim.sgd(learning_rate=ft.optim.per_samples(ft.optim.linear_warmup(-0.1, 4), 2))", "-0.1"),
    ("ft.optim.adam(beta1=ft.optim.piecewise([(3, 0.9), (1, 1.5)]))", "1.5"),
    # torch's SGD/NAdam/ASGD hyperparameters: a number out of range was refused, a schedule not
    ("ft.optim.sgd(dampening=ft.optim.piecewise([(3, 0.1), (1, 1.5)]))", "1.5"),
    ("ft.optim.nadam(momentum_decay=ft.optim.piecewise([(3, 0.004), (1, -1.0)]))", "-1.0"),
    ("ft.optim.asgd(lambd=ft.optim.exponential_decay(-0.1, 4, 0.5))", "-0.1"),
    ("ft.optim.asgd(t0=ft.optim.piecewise([(3, 4.0), (1, -2.0)]))", "-2.0"),
], ids=["piecewise", "exponential", "warmup_cosine", "per_samples", "beta1", "dampening", "momentum_decay", "lambd",
        "t0"])
def test_a_schedule_built_with_an_out_of_range_value_is_refused_and_the_fix_runs(code, value):
    """The raw list ``sgd([(3, 0.1), (1, -0.01)])`` was refused, the same schedule as
    ``ft.optim.piecewise(...)`` (or any of functree's schedules from a negative rate) was
    taken: from step 3 on the rate was negative and the loss climbed."""
    with pytest.raises(ValueError, match="follows a schedule that takes the value " + value) as info:
        eval(code, {"ft": ft})
    assert f"wrong:  {code}" in str(info.value)
    eval(str(info.value).split("right:  ")[1].strip(), {"ft": ft})  # the printed fix is taken


def test_cntk_unit_gain_keeps_the_rates_its_velocity_was_taken_at_as_cntk():
    """CNTK's dense NormalGrad: v ← γᴹ v + (1 − γᴹ) η Σg; w ← w − v, with η and γ per sample
    and Σg the minibatch's summed gradient. The rate η·M is inside the velocity, so minibatches
    of other sizes (and a schedule's step) leave the velocity as it was. The old form
    (c ← γc + (1−γ)ḡ; w ← w − ηM c) scaled the whole momentum by the current minibatch and
    rate: after these steps its weights were 0.0056, 0.0079, 0.0043 for CNTK's 0.0157,
    0.0288, 0.0113."""
    sizes = (4, 8, 2, 5, 8, 3)
    rng = np.random.default_rng(1)
    xs, ys = [rng.normal(size=(m, 3)) for m in sizes], [rng.normal(size=m) for m in sizes]
    with jax.enable_x64(True):
        rate = fo.per_samples(fo.piecewise([(12, 0.01), (1, 0.002)], unit="samples"), 1)
        opt = fo.Optimizer(fo.sgd(rate, momentum=fo.per_samples(0.99, 1), momentum_form="cntk_unit_gain"))
        update = jax.jit(lambda g, s, p, m: opt.update(g, s, p, minibatch_size=m))
        p = {"w": jnp.zeros(3)}
        state = opt.init(p)
        w, v, seen = np.zeros(3), np.zeros(3), 0
        for x, y in zip(xs, ys):
            ours = np.asarray(p["w"])  # the gradient of the mean loss at our parameters
            updates, state = update({"w": jnp.asarray(2 * x.T @ (x @ ours - y) / len(y))}, state, p, len(y))
            p = ft.move(p, along=updates)
            gamma, summed = 0.99 ** len(y), 2 * x.T @ (x @ w - y)
            v = gamma * v + (1 - gamma) * (0.01 if seen < 12 else 0.002) * summed
            w, seen = w - v, seen + len(y)
        np.testing.assert_allclose(np.asarray(p["w"]), w, rtol=0, atol=1e-15)  # measured 7e-18, |w| 0.03


def test_per_tensor_clipping_of_a_complex_parameter_is_torchs_clip_grad_norm():
    """A complex parameter is one tensor to torch's ``clip_grad_norm_([p], t)``: one norm
    √Σ|g|². Inside an Optimizer each part (a RealPair) was clipped by its own norm (3 + 4i
    at t = 1 stepped 1 + 1i, of norm √2); as a bare transform the norm was the real
    part's (a factor 1/3 for 1/5)."""
    grad = np.array([3.0 + 4.0j, 0.0, 1e-3j], np.complex64)  # torch's gradient (the descent direction)
    z = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    z.grad = torch.tensor(grad)
    torch.nn.utils.clip_grad_norm_([z], 1.0)
    expected = z.grad.numpy() * (np.linalg.norm(grad) + 1e-6) / np.linalg.norm(grad)  # without torch's 1e-6
    params = {"z": jnp.zeros(3, jnp.complex64), "w": jnp.ones(2)}
    grads = {"z": jnp.conj(jnp.asarray(grad)), "w": jnp.array([0.3, 0.4])}  # JAX's gradient: the conjugate
    opts = [fo.Optimizer(fo.clip_by_norm(1.0)), fo.Optimizer(fo.clip_per_sample(1.0, truncation=False))]
    clipped = jax.jit(lambda g, p: [opt.update(g, opt.init(p), p, minibatch_size=4)[0] for opt in opts])(grads, params)
    for updates in clipped:
        np.testing.assert_allclose(np.asarray(updates["z"]), expected, rtol=0, atol=1e-7)
        np.testing.assert_allclose(np.asarray(updates["w"]), [0.3, 0.4], rtol=0, atol=1e-7)
    bare = fo.clip_by_norm(1.0)  # optax's convention: the descent direction given as it is
    with pytest.warns(fo.ComplexGradientWarning):
        alone: Any = bare.update({"z": jnp.asarray(grad)}, bare.init({"z": jnp.asarray(grad)}))[0]
    np.testing.assert_allclose(np.asarray(alone["z"]), expected, rtol=0, atol=1e-7)


def test_float64_per_tensor_clipping_takes_its_norm_in_float64():
    # The norm was summed in float32: 1e-8 relative off torch's float64 clip_grad_norm_.
    g = np.random.default_rng(2).normal(size=(5, 4)) * 3
    t = torch.tensor(g)
    t.grad = t.clone()
    torch.nn.utils.clip_grad_norm_([t], 1.0)
    expected = t.grad.numpy() * (np.linalg.norm(g) + 1e-6) / np.linalg.norm(g)
    with jax.enable_x64(True):
        tx = fo.clip_by_norm(1.0)
        out: Any = tx.update({"g": jnp.asarray(g)}, tx.init({"g": jnp.asarray(g)}))[0]
        got = out["g"]
        assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-15)


def test_float64_weight_averages_are_torchs_averaged_model():
    """``ema(d, debias=False)`` and ``uniform_average()`` against torch's ``AveragedModel``
    (``get_ema_multi_avg_fn(d)`` and its default, the running mean) after each SGD step.
    The averaging weight was float32 (1/k, d^k): SWA's mean came out 1.1e-8 off in float64."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    grads = np.random.default_rng(3).normal(size=(STEPS, 3))
    averages = {"ema": (fo.ema(0.9, debias=False), get_ema_multi_avg_fn(0.9)), "swa": (fo.uniform_average(), None)}
    with jax.enable_x64(True):
        def run(gs):
            out = {}
            for name, (average, _) in averages.items():
                opt = fo.Optimizer(fo.sgd(0.1, momentum=0.5), average=average)

                def step(t, carry, opt=opt):
                    p, s = carry
                    u, s = opt.update({"w": gs[t] + p["w"]}, s, p)
                    return ft.move(p, along=u), s

                p = {"w": jnp.asarray(W0[0])}
                p, s = jax.lax.fori_loop(0, STEPS, step, (p, opt.init(p)))
                out[name] = fo.averaged(s, p)["w"]
            return out

        ours = jax.jit(run)(jnp.asarray(grads))
    for name, (_, multi_avg_fn) in averages.items():
        w = torch.tensor(W0[0], requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.5)
        model = torch.nn.ParameterList([w])
        average = AveragedModel(model, multi_avg_fn=multi_avg_fn)
        for t in range(STEPS):
            w.grad = torch.tensor(grads[t]) + w.detach()
            opt.step()
            average.update_parameters(model)
        assert ours[name].dtype == jnp.float64
        expected = next(average.module.parameters()).detach().numpy()
        np.testing.assert_allclose(np.asarray(ours[name]), expected, rtol=0, atol=1e-14,
                                   err_msg=name)  # measured 1e-16 on averages of magnitude 1


def test_nesterov_without_momentum_is_refused_as_torchs_sgd_refuses_it():
    """sgd(nesterov=True) at momentum 0 would be plain SGD, silently; torch.optim.SGD raises."""
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        torch.optim.SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"(?s)nesterov=True with momentum=0.0 is plain SGD.*right:  ft\.optim\.sgd\(0\.1, momentum=0\.9, nesterov=True\)"):
        ft.optim.sgd(0.1, nesterov=True)
    ft.optim.sgd(0.1, momentum=0.9, nesterov=True)  # the fix
    ft.optim.sgd(0.1, momentum=ft.optim.constant(0.9), nesterov=True)  # a schedule: its values are its own


@pytest.mark.parametrize("code, match", [
    ("fo.sgd(0.1, momentum=0.9, nesterov=True, dampening=0.1)",
     r"(?s)nesterov=True with dampening=0.1.*right:  ft\.optim\.sgd\(0\.1, momentum=0\.9, nesterov=True\)"),
    ("fo.sgd(0.1, momentum=0.9, momentum_form='additive', dampening=0.1)",
     r"(?s)the\n'additive' form has none.*right:  ft\.optim\.sgd\(0\.1, momentum=0\.9, dampening=0\.1\)"),
    ("fo.sgd(0.1, momentum=0.9, dampening=1.5)", r"dampening=1.5 is out of range; dampening must be finite and in \[0, 1\]"),
    ("fo.rprop(1e-2, etas=(1.2, 0.5))", r"(?s)etas=\(1.2, 0.5\).*0 < η₋ < 1 < η₊.*right:  ft\.optim\.rprop\(1e-2, etas=\(0\.5, 1\.2\)\)"),
    ("fo.rprop(1e-2, etas=0.5)", r"etas=0.5; torch's Rprop takes"),
    ("fo.rprop(1e-2, step_sizes=(1.0, 1e-6))", r"(?s)step_sizes=\(1.0, 1e-06\).*0 <= smallest <= largest"),
    ("fo.rprop(fo.exponential_decay(1e-2, 1, 0.9))", r"(?s)only the initial step size.*right:  ft\.optim\.rprop\(1e-2\)"),
    ("fo.rprop(-1.0)", r"learning_rate=-1.0 is out of range"),
    ("fo.nadam(momentum_decay=-1e-3)", r"(?s)ft\.optim\.nadam: momentum_decay=-0.001 is out of range.*momentum_decay=4e-3"),
    ("fo.nadam(beta1=1.0)", r"beta1=1.0 is out of range"),
    ("fo.asgd(lambd=-1.0)", r"ft\.optim\.asgd: lambd=-1.0 is out of range"),
    ("fo.asgd(alpha=float('nan'))", r"alpha=nan is out of range"),
    ("fo.asgd(t0=-1)", r"t0=-1 is out of range"),
])
def test_bad_options_are_refused_with_the_fix(code, match):
    with pytest.raises(ValueError, match=match):
        eval(code)


@pytest.mark.parametrize("make, name, value", [
    (lambda: fo.nadam(), "momentum_decay", -1e-3), (lambda: fo.asgd(), "lambd", -1.0),
    (lambda: fo.asgd(), "alpha", float("nan")), (lambda: fo.asgd(), "t0", -1.0),
    (lambda: fo.sgd(0.1, 0.9, dampening=0.2), "dampening", 1.5),
])
def test_set_hyperparameters_checks_torchs_hyperparameters_as_construction_does(make, name, value):
    """Their ranges were checked at construction only (a table of _torch_optimizers, and
    sgd's own check): set_hyperparameters took momentum_decay=-1e-3, t0=-1, dampening=1.5."""
    state = make().init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=rf"set_hyperparameters: {name}={value!r} is out of range"):
        fo.set_hyperparameters(state, **{name: value})


def test_dampening_set_on_an_sgd_built_without_it_names_why_and_the_fixes_run():
    """``sgd(dampening=0.0)`` keeps no dampening (torch's buffer without it): setting one got
    the generic "no hyperparameter 'dampening'"; now the weight-decay message's reasons,
    with sgd's code. Each printed way to build it takes the value set (or the schedule's)."""
    p, g = {"w": jnp.ones(2)}, {"w": jnp.array([1.0, -2.0])}
    with pytest.raises(KeyError, match=r"no hyperparameter 'dampening'(?s:.*)given dampening=0 \(the number\) is "
                                       r"built without that term \(torch's momentum buffer without dampening\)") as info:
        fo.set_hyperparameters(fo.sgd(0.1, momentum=0.9).init(p), dampening=0.5)
    fixes = [line.split("tx = ")[1].split("   #")[0].strip() for line in info.value.args[0].splitlines()
             if line.strip().startswith(("right:", "or:"))]
    assert len(fixes) == 3, fixes

    def steps(tx, state, n=3) -> Any:
        for _ in range(n):
            u, state = tx.update(g, state)
        return u["w"]

    expected = steps(fo.sgd(0.1, momentum=0.9, dampening=0.5), fo.sgd(0.1, momentum=0.9, dampening=0.5).init(p))
    for fix in fixes[:2]:  # a nonzero number, a zero array: stored, settable
        tx = eval(fix, {"ft": ft, "jnp": jnp})
        np.testing.assert_allclose(steps(tx, fo.set_hyperparameters(tx.init(p), dampening=0.5)), expected, atol=1e-6)
    tx = eval(fixes[2], {"ft": ft, "jnp": jnp})  # a schedule: 0 until step 1000
    np.testing.assert_allclose(steps(tx, tx.init(p)), steps(fo.sgd(0.1, momentum=0.9), fo.sgd(0.1, momentum=0.9).init(p)),
                               atol=1e-6)


def test_rprop_state_of_another_shape_is_refused_and_its_state_is_its_moments():
    """Rprop's ``step_sizes`` and ``previous`` were no moments to the state checks: a state made
    for a (1,) parameter broadcast into a (3,) one silently (all three stepped by the one
    size); ``ft.optim.moments`` listed nothing."""
    opt = fo.Optimizer(fo.rprop(0.1))
    state = opt.init({"w": jnp.ones(1)})
    with pytest.raises(ValueError, match=r"its moment step_sizes differs from the gradients at w: the gradient has "
                                         r"shape \(3,\), the moment \(1,\)"):
        opt.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3)})
    moments = fo.moments(state)
    assert sorted(moments) == ["previous", "step_sizes"]
    np.testing.assert_array_equal(moments["step_sizes"]["w"], np.array([0.1], np.float32))


def test_asgd_needs_the_parameters():
    tx, g = fo.asgd(), {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"(?s)ft\.optim\.asgd decays and averages the parameters.*tx\.update\(grads, state, model\)"):
        tx.update(g, tx.init(g))


@pytest.mark.parametrize("name", ["NAdam", "Rprop", "ASGD", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop",
                                  "LBFGS", "lbfgs"])
def test_torch_class_names_name_functrees_way_and_it_runs(name):
    with pytest.raises(AttributeError, match=f"has no attribute '{name}': torch's torch.optim") as info:
        getattr(fo, name)
    right = str(info.value).split("right:  ")[1]
    model = ft.nn.Dense(2, 1, key=jax.random.key(0))
    loss_fn, x, y = (lambda m, x, y: ((m(x) - y) ** 2).mean()), jnp.ones((3, 2)), jnp.zeros((3, 1))
    scope = {"ft": ft, "optax": optax, "model": model, "loss_fn": loss_fn, "x": x, "y": y}
    if name.lower() == "lbfgs":  # its minimize: tests/test_optim_optimizer.py's L-BFGS test (1.4 s here)
        right = right.split(";")[0] + ";  opt_state = opt.init(model)"
    exec(right, scope)
