"""ft.optim's schedules against torch.optim.lr_scheduler: the rate (and the momentum) each
update takes, read from a tiny model trained in float64 by both libraries. The schedulers
torch has and functree builds (OneCycleLR, CyclicLR, CosineAnnealingWarmRestarts) and the
recipes docs/migration/pytorch.md gives for the others (StepLR, ExponentialLR, LinearLR,
CosineAnnealingLR: tests/test_optim_torch_audit.py)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
import functree.optim as fo

torch = pytest.importorskip("torch")
LS = torch.optim.lr_scheduler

STEPS = 24
RNG = np.random.default_rng(41)
X, Y = RNG.normal(size=(8, 4)), RNG.normal(size=(8, 3))
W0, B0 = RNG.normal(size=(4, 3)), RNG.normal(size=3)
SGDR: dict[str, Any] = {"init_value": 0.2, "peak_value": 0.2, "warmup_steps": 0, "decay_steps": 5, "end_value": 0.0}
TABLE = 0.1 * np.cumprod([1.0] + [0.5 if e % 3 == 0 else 0.9 for e in range(1, STEPS)])  # MultiplicativeLR's

# name: (ours, torch's optimizer, torch's scheduler); torch's cycle_momentum is on by default,
# so torch's SGD(lr) of momentum 0 trains with the cycled momentum.
CASES = {
    "OneCycleLR_sgd": (
        lambda: fo.sgd(fo.one_cycle(0.5, STEPS), momentum=fo.one_cycle_momentum(STEPS)),
        lambda p: torch.optim.SGD(p, lr=0.1), lambda o: LS.OneCycleLR(o, 0.5, total_steps=STEPS)),
    "OneCycleLR_three_phase_linear_nesterov": (
        lambda: fo.sgd(fo.one_cycle(0.3, STEPS, pct_start=0.35, anneal_strategy="linear", div_factor=10.0,
                                    final_div_factor=100.0, three_phase=True),
                       momentum=fo.one_cycle_momentum(STEPS, 0.8, 0.9, pct_start=0.35, anneal_strategy="linear",
                                                      three_phase=True), nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda o: LS.OneCycleLR(o, 0.3, total_steps=STEPS, pct_start=0.35, anneal_strategy="linear", div_factor=10.0,
                                final_div_factor=100.0, three_phase=True, base_momentum=0.8, max_momentum=0.9)),
    "OneCycleLR_adam_beta1": (
        lambda: fo.adam(fo.one_cycle(0.05, STEPS, pct_start=0.25), beta1=fo.one_cycle_momentum(STEPS, pct_start=0.25)),
        lambda p: torch.optim.Adam(p), lambda o: LS.OneCycleLR(o, 0.05, total_steps=STEPS, pct_start=0.25)),
    "OneCycleLR_no_momentum": (
        lambda: fo.adamw(fo.one_cycle(0.05, STEPS, three_phase=True), exclude=()),
        lambda p: torch.optim.AdamW(p), lambda o: LS.OneCycleLR(o, 0.05, total_steps=STEPS, three_phase=True,
                                                               cycle_momentum=False)),
    "CyclicLR_triangular2_sgd": (
        lambda: fo.sgd(fo.cyclic(0.01, 0.2, 3, 5, "triangular2"),
                       momentum=fo.cyclic_momentum(0.7, 0.9, 3, 5, "triangular2")),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda o: LS.CyclicLR(o, 0.01, 0.2, 3, 5, "triangular2", base_momentum=0.7)),
    "CyclicLR_exp_range_adam": (
        lambda: fo.adam(fo.cyclic(1e-3, 0.05, 4, mode="exp_range", gamma=0.95),
                        beta1=fo.cyclic_momentum(step_size_up=4, mode="exp_range", gamma=0.95)),
        lambda p: torch.optim.Adam(p), lambda o: LS.CyclicLR(o, 1e-3, 0.05, 4, mode="exp_range", gamma=0.95)),
    "CyclicLR_triangular_no_momentum": (
        lambda: fo.sgd(fo.cyclic(0.01, 0.2, 2.5), momentum=0.5),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5), lambda o: LS.CyclicLR(o, 0.01, 0.2, 2.5,
                                                                                  cycle_momentum=False)),
    "CosineAnnealingWarmRestarts_T_mult": (
        lambda: fo.sgd(fo.cosine_warm_restarts(0.2, 3, period_mult=2, end_value=0.01), momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), lambda o: LS.CosineAnnealingWarmRestarts(o, 3, 2, 0.01)),
    "CosineAnnealingWarmRestarts_sgdr": (  # cosine_decay's docstring: T_mult=1 as optax's sgdr_schedule
        lambda: fo.sgd(fo.schedule(optax.sgdr_schedule([SGDR] * 5))),
        lambda p: torch.optim.SGD(p, lr=0.2), lambda o: LS.CosineAnnealingWarmRestarts(o, 5)),
    # docs/migration/pytorch.md's recipes
    "PolynomialLR": (lambda: fo.sgd(fo.schedule(optax.polynomial_schedule(0.2, 0.0, 2.0, 15))),
                     lambda p: torch.optim.SGD(p, lr=0.2), lambda o: LS.PolynomialLR(o, 15, 2.0)),
    "ConstantLR": (lambda: fo.sgd(fo.piecewise([(5, 0.2 * 0.25), (1, 0.2)])),
                   lambda p: torch.optim.SGD(p, lr=0.2), lambda o: LS.ConstantLR(o, 0.25, 5)),
    "LinearLR_decay": (lambda: fo.sgd(fo.schedule(optax.linear_schedule(0.2, 0.2 * 0.1, 10))),
                       lambda p: torch.optim.SGD(p, lr=0.2), lambda o: LS.LinearLR(o, 1.0, 0.1, 10)),
    "LambdaLR": (lambda: fo.sgd(fo.schedule(lambda c: 0.2 * 0.9 ** c)),
                 lambda p: torch.optim.SGD(p, lr=0.2), lambda o: LS.LambdaLR(o, lambda e: 0.9 ** e)),
    "MultiplicativeLR": (lambda: fo.sgd(fo.schedule(lambda c: jnp.asarray(TABLE)[jnp.minimum(c, STEPS - 1)])),
                         lambda p: torch.optim.SGD(p, lr=0.1),
                         lambda o: LS.MultiplicativeLR(o, lambda e: 0.5 if e % 3 == 0 else 0.9)),
    "SequentialLR": (
        lambda: fo.sgd(fo.schedule(optax.join_schedules(
            [optax.linear_schedule(0.2 * 0.1, 0.2, 5), optax.cosine_decay_schedule(0.2, 19, 0.05)], [5]))),
        lambda p: torch.optim.SGD(p, lr=0.2),
        lambda o: LS.SequentialLR(o, [LS.LinearLR(o, 0.1, 1.0, 5), LS.CosineAnnealingLR(o, 19, 0.2 * 0.05)], [5])),
    "ChainedScheduler": (
        lambda: fo.sgd(fo.schedule(lambda c: 0.2 * jnp.where(c < 4, 0.1, 1.0) * 0.9 ** c)),
        lambda p: torch.optim.SGD(p, lr=0.2),
        lambda o: LS.ChainedScheduler([LS.ConstantLR(o, 0.1, 4), LS.ExponentialLR(o, 0.9)])),
}


def _loss(w, b, x, y):
    return ((x @ w + b - y) ** 2).mean()


def _jax_loss(w, b, x, y):  # (_loss's bias add, broadcast by hand: the suite raises on rank promotion)
    return ((x @ w + jax.lax.broadcast_to_rank(b, x.ndim) - y) ** 2).mean()


def _ours(make, x, y):
    tx = make()

    def step(_, carry):
        p, s = carry
        g = dict(zip(("w", "b"), jax.grad(_jax_loss, (0, 1))(p["w"], p["b"], x, y)))
        u, s = tx.update(g, s, p)
        return jax.tree.map(jnp.add, p, u), s

    p = {"w": jnp.asarray(W0), "b": jnp.asarray(B0)}
    return jax.lax.fori_loop(0, STEPS, step, (p, tx.init(p)))[0]


@pytest.fixture(scope="module")
def ours():
    """Every case's parameters after STEPS, in float64, all compiled in one program."""
    with jax.enable_x64(True):
        run = jax.jit(lambda x, y: {name: _ours(make, x, y) for name, (make, _, _) in CASES.items()})
        return jax.tree.map(np.asarray, run(jnp.asarray(X), jnp.asarray(Y)))  # arguments: not folded


def _torch(name):
    _, optimizer, scheduler = CASES[name]
    w, b = torch.tensor(W0, requires_grad=True), torch.tensor(B0, requires_grad=True)
    opt = optimizer([w, b])
    sched = scheduler(opt)
    x, y = torch.tensor(X), torch.tensor(Y)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(w, b, x, y).backward()
        opt.step()
        sched.step()
    return {"w": w.detach().numpy(), "b": b.detach().numpy()}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_training_under_a_schedule_is_torchs(ours, name):
    """Measured: at most 5.6e-16 on weights of magnitude 1.5 (the cyclic triangles: XLA's
    rewriting of ``1 + c/T − k`` moves a rate by 7e-16); an update at a rate one step off
    torch's moves them by 1e-3 or more."""
    expected = _torch(name)
    for k in expected:
        assert ours[name][k].dtype == np.float64
        np.testing.assert_allclose(ours[name][k], expected[k], rtol=0, atol=5e-15, err_msg=f"{name}.{k}")


def test_one_cycle_holds_its_last_rate_and_counts_sweeps():
    """torch raises after ``total_steps`` calls of ``step()``; the schedule holds its end.
    ``unit="sweeps"`` is torch's scheduler stepped once an epoch."""
    lr = fo.one_cycle(1.0, 10, pct_start=0.3, div_factor=4.0, final_div_factor=2.0)
    momentum = fo.cyclic_momentum(step_size_up=2, unit="sweeps")
    restarts = fo.cosine_warm_restarts(1.0, 4, unit="sweeps")
    ctx = fo.initial_context()
    at = jax.jit(jax.vmap(lambda step, sweep: [f(ctx.replace(step=step, sweep=sweep)) for f in (lr, momentum, restarts)]))
    got = at(jnp.asarray([0, 2, 9, 10, 1000]), jnp.asarray([0, 1, 2, 4, 8]))
    np.testing.assert_allclose(got[0], [0.25, 1.0, 0.125, 0.125, 0.125], rtol=1e-6)
    np.testing.assert_allclose(got[1], [0.9, 0.85, 0.8, 0.9, 0.9], rtol=1e-6)
    np.testing.assert_allclose(got[2], [1.0, 0.5 + 0.5 * np.cos(np.pi / 4), 0.5, 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("call, match", [
    ("ft.optim.one_cycle(0.1, 10, pct_start=0.1)", "pct_start=0.1; it must be not 1 / total_steps"),
    ("ft.optim.one_cycle(0.1, 10, pct_start=1.5)", "pct_start=1.5; it must be in \\[0, 1\\]"),
    ("ft.optim.one_cycle(0.1, 10.0)", "total_steps=10.0; it must be a whole number > 0"),
    ("ft.optim.one_cycle_momentum(100, anneal_strategy='cosine')", "anneal_strategy='cosine'; it must be one of"),
    ("ft.optim.one_cycle(0.1, 100, div_factor=0.0)", "div_factor=0.0; it must be finite and > 0"),
    ("ft.optim.cyclic(0.01, 0.1, 0)", "step_size_up=0; it must be > 0"),
    ("ft.optim.cyclic(0.01, 0.1, 4, 0)", "step_size_down=0; it must be > 0 or None"),
    ("ft.optim.cyclic_momentum(mode='triangle')", "mode='triangle'; it must be one of"),
    ("ft.optim.cosine_warm_restarts(0.1, 0)", "period=0; it must be a whole number > 0"),
    ("ft.optim.cosine_warm_restarts(0.1, 10, 1.5)", "period_mult=1.5; it must be a whole number >= 1"),
])
def test_cycle_arguments_that_torch_refuses_or_divides_by_zero_are_refused(call, match):
    """0 / 0 rates (a rise of no step, a fall of no step), a fractional restart period
    (torch's T_mult must be an int)."""
    with pytest.raises(ValueError, match=match) as info:
        eval(call, {"ft": ft})
    eval(str(info.value).split("right:  ")[1].strip(), {"ft": ft})  # the printed fix is taken


@pytest.mark.parametrize("code, value", [
    ("ft.optim.sgd(learning_rate=ft.optim.one_cycle(-0.1, 100))", "-0.1"),
    ("ft.optim.sgd(momentum=ft.optim.one_cycle_momentum(100, 0.85, 1.2, pct_start=0.25))",
     "1.2"),
    ("ft.optim.adam(beta1=ft.optim.cyclic_momentum(0.8, 1.0, step_size_up=4, mode='exp_range'))", "1.0"),
    ("ft.optim.sgd(learning_rate=ft.optim.cosine_warm_restarts(0.1, 10, end_value=-0.01))", "-0.01"),
], ids=["one_cycle", "one_cycle_momentum", "cyclic_momentum_beta1", "cosine_warm_restarts"])
def test_a_cycle_out_of_the_hyperparameters_range_is_refused(code, value):
    """A momentum cycling up to 1.2 (β₁ up to 1: no bias correction at all), a negative rate."""
    with pytest.raises(ValueError, match="follows a schedule that takes the value " + value) as info:
        eval(code, {"ft": ft})
    assert f"wrong:  {code}" in str(info.value)
    eval(str(info.value).split("right:  ")[1].strip(), {"ft": ft})


def test_cyclic_keeps_its_place_in_the_cycle_past_two_to_the_24_counts():
    """The cycle and the position in it were count / total in float32: past 2**24 counts
    (unit="samples" gets there within an epoch of a medium data set) the rate was off
    CyclicLR's by up to 4e-4 of its value. Whole step sizes count in integers now."""
    def torch_triangular(c, low, high, up):  # CyclicLR("triangular")'s formula, in float64
        cycle = np.floor(1 + c / (2.0 * up))
        x = np.abs(c / up - 2 * cycle + 1)
        return low + (high - low) * np.maximum(0.0, 1 - x)

    counts = np.arange(30_000_000, 30_002_000, 7, dtype=np.int32)
    rate = fo.cyclic(0.001, 0.01, step_size_up=50_000, unit="samples")
    context = fo.initial_context()
    ours = jax.jit(jax.vmap(lambda c: rate(context.replace(samples_seen=c))))(counts)
    np.testing.assert_allclose(np.asarray(ours), torch_triangular(counts.astype(np.float64), 0.001, 0.01, 50_000),
                               rtol=0, atol=1e-9)  # float32's rounding of a rate below 0.01 (was 4.4e-7 off)
