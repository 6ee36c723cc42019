"""The forty-fifth session's recipes audit: torch training recipes ported step by step.

Each test runs a torch recipe and its functree port on the same random weights and data and
compares every step: ``torch.amp.GradScaler(growth_factor=, backoff_factor=)`` (refused as
unexpected keywords before: the torch scale sequence could not be ported) with
``unscale_`` then ``clip_grad_norm_`` over two AdamW parameter groups and overflows forced
at chosen steps; ``ReduceLROnPlateau(cooldown=)`` driven by a chosen validation-loss
sequence (the documented mapping ``patience=p + 1`` gave torch's rates without a cooldown,
and reduced one epoch early after each cooldown)."""

from __future__ import annotations

import itertools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from _errors import raises_named

import functree as ft
from functree.optim._loss_scale import BAD_FACTOR, TORCH_KEYWORD
from functree.optim._signature import TORCH_OPTION
from functree.optim._transforms import BAD_NORM_TYPE

# ---- torch.amp.GradScaler's growth_factor and backoff_factor ------------------------------

_W0 = np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)
_B0 = np.random.default_rng(2).normal(size=2).astype(np.float32)
_X = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
_OVERFLOW = (2, 3, 6)  # steps whose input makes scale * loss overflow float32
_STEPS = 8


def _batch(i: int) -> np.ndarray:
    return _X * np.float32(1e30 if i in _OVERFLOW else 1.0)


def _torch_amp_recipe(init: float, growth: float, backoff: float, interval: int):
    """AdamW over a decay and a no-decay group, GradScaler, unscale_ then clip_grad_norm_."""
    w, b = torch.tensor(_W0, requires_grad=True), torch.tensor(_B0, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.05},
                             {"params": [b], "weight_decay": 0.0, "lr": 0.02}], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth, backoff_factor=backoff,
                                  growth_interval=interval)
    scales, ws, bs = [], [], []
    for i in range(_STEPS):
        opt.zero_grad()
        scaler.scale(((torch.from_numpy(_batch(i)) @ w + b) ** 2).mean()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([w, b], 0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        ws.append(w.detach().numpy().copy())
        bs.append(b.detach().numpy().copy())
    return scales, np.stack(ws), np.stack(bs)


def _ours_amp_recipe(init: float, growth: float, backoff: float, interval: int):
    groups = ft.optim.groups({"w": ft.optim.adamw(0.01, weight_decay=0.05, exclude=()),
                              "b": ft.optim.adamw(0.02, weight_decay=0.0, exclude=())})
    clip = optax.clip_by_global_norm(0.5)  # a transform_gradients hook: after the unscaling, as unscale_
    inner = ft.optim.Optimizer(groups, transform_gradients=lambda g: clip.update(g, clip.init(g))[0])
    opt = ft.optim.LossScaleOptimizer(inner, initial_scale=init, growth_factor=growth, backoff_factor=backoff,
                                      growth_interval=interval)
    loss = lambda p, x: jnp.mean((x @ p["w"] + p["b"][None, :]) ** 2)  # noqa: E731

    def run(p, xs):
        def one(carry, x):
            p, s = opt.minimize(loss, *carry, x)[:2]
            return (p, s), (s.scale, p["w"], p["b"], s.skipped)
        return jax.lax.scan(one, (p, opt.init(p)), xs)[1]

    p = {"w": jnp.asarray(_W0), "b": jnp.asarray(_B0)}
    xs = jnp.asarray(np.stack([_batch(i) for i in range(_STEPS)]))
    return jax.device_get(jax.jit(run)(p, xs))


@pytest.mark.parametrize("init, growth, backoff, interval", [(1024.0, 1.5, 0.25, 2), (3000.0, 3.0, 0.1, 1)])
def test_grad_scaler_growth_and_backoff_factors_are_torchs_scale_for_scale(init, growth, backoff, interval):
    """Before: ``growth_factor=``/``backoff_factor=`` were unexpected keywords, and the port
    with the defaults had scales 1024, 2048, 1024, 512, ... where torch's (1.5, 0.25) has
    1024, 1536, 384, 96, ...: every later overflow came at another step."""
    scales, ws, bs = _torch_amp_recipe(init, growth, backoff, interval)
    ours, w, b, skipped = _ours_amp_recipe(init, growth, backoff, interval)
    assert ours.tolist() == scales  # float32 products, the same in both
    assert skipped.tolist() == np.cumsum([i in _OVERFLOW for i in range(_STEPS)]).tolist()
    # Values about 1 in float32, measured apart by 2.4e-7 (clip_grad_norm_'s 1e-6 in the
    # norm, float32 sums in another order): 10 times it.
    np.testing.assert_allclose(w, ws, rtol=0, atol=3e-6)
    np.testing.assert_allclose(b, bs, rtol=0, atol=3e-6)


@pytest.mark.parametrize("name, value", [("growth_factor", 1.0), ("growth_factor", float("inf")),
                                         ("backoff_factor", 1.0), ("backoff_factor", 0.0),
                                         ("backoff_factor", float("nan")), ("growth_factor", True)])
def test_a_growth_or_backoff_factor_that_would_stall_the_scale_is_refused(name, value):
    sgd = ft.optim.sgd(0.1)
    factor: dict[str, Any] = {name: value}
    raises_named(lambda: ft.optim.LossScaleOptimizer(sgd, **factor), ValueError, BAD_FACTOR,
                 "right:  ft.optim.LossScaleOptimizer(opt, growth_factor=2.0, backoff_factor=0.5)")
    ft.optim.LossScaleOptimizer(sgd, growth_factor=2.0, backoff_factor=0.5)  # the fix builds


@pytest.mark.parametrize("name, fix", [("init_scale", "right:  ft.optim.LossScaleOptimizer(opt, initial_scale=4.0)"),
                                       ("enabled", "right:  opt "),
                                       ("scale", "right:  ft.optim.LossScaleOptimizer(opt, initial_scale=2.0**16)")])
def test_torchs_grad_scaler_keywords_name_functrees(name, fix):
    """Before: Python's bare "unexpected keyword argument 'init_scale'"."""
    torch_keywords: dict[str, Any] = {name: 4.0}
    raises_named(lambda: ft.optim.LossScaleOptimizer(ft.optim.sgd(0.1), **torch_keywords), TypeError,
                 TORCH_KEYWORD, fix)
    assert ft.optim.LossScaleOptimizer(ft.optim.sgd(0.1), initial_scale=4.0).initial_scale == 4.0


# ---- ReduceLROnPlateau's cooldown ---------------------------------------------------------

_VAL_LOSSES = [5, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 3, 3, 3, 3, 3, 3, 3, 2, 3]


def _torch_plateau(patience, cooldown, mode):
    w = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode=mode, factor=0.5, patience=patience,
                                                       threshold=0.0, cooldown=cooldown)
    rates = []
    for v in _VAL_LOSSES:
        sched.step(v if mode == "min" else -v)
        rates.append(opt.param_groups[0]["lr"])
    return rates


def _ours_plateau(patience, cooldown, mode, opt_state):
    trainer: Any = types.SimpleNamespace(opt_state=opt_state)  # the callback reads and sets opt_state
    callback = ft.train.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=patience, cooldown=cooldown,
                                          mode=mode)
    rates = []
    for v in _VAL_LOSSES:
        context: Any = types.SimpleNamespace(metrics={"val_loss": v if mode == "min" else -v})
        callback.on_epoch_end(trainer, context)
        rates.append(float(ft.optim.hyperparameters(trainer.opt_state)["learning_rate"]))
    return rates


def test_torchs_reduce_lr_on_plateau_cooldown_is_one_more_epoch_of_the_callbacks():
    """torch's ``ReduceLROnPlateau(patience=p, cooldown=c)`` is the callback's
    ``patience=p + 1, cooldown=c + 1`` (c > 0): torch does not count the epoch that ends the
    cooldown as a bad epoch, Keras's order (the callback's) does. The mapping documented
    before, ``patience=p + 1`` with the same cooldown, reduced one epoch early after each
    cooldown (p=0, c=1: rate 0.25 at the 4th epoch, torch's at the 5th)."""
    state = ft.optim.Optimizer(ft.optim.sgd(1.0)).init({"w": jnp.ones(())})
    for p, c, mode in itertools.product((0, 1, 2), (0, 1, 3), ("min", "max")):
        torch_rates = _torch_plateau(p, c, mode)
        assert _ours_plateau(p + 1, c + 1 if c else 0, mode, state) == torch_rates, (p, c, mode)
        if c:  # the old mapping differs
            assert _ours_plateau(p + 1, c, mode, state) != torch_rates, (p, c, mode)


# ---- torch's optimizer options that are another optimizer here ----------------------------

@pytest.mark.parametrize("call, right", [
    ("ft.optim.adam(0.01, amsgrad=True, betas=(0.8, 0.95))", "ft.optim.amsgrad(0.01, beta1=0.8, beta2=0.95)"),
    ("ft.optim.adam(0.01, weight_decay=0.3, decoupled_weight_decay=True)",
     "ft.optim.adamw(0.01, weight_decay=0.3, exclude=())"),
    ("ft.optim.adamw(0.01, weight_decay=0.3, amsgrad=True)",
     "optax.chain(ft.optim.amsgrad(0.01), ft.optim.weight_decay(0.01 * 0.3, exclude=()))"),
    ("ft.optim.radam(0.01, weight_decay=0.3, decoupled_weight_decay=True)",
     "optax.chain(ft.optim.radam(0.01), ft.optim.weight_decay(0.01 * 0.3, exclude=()))"),
    ("ft.optim.adagrad(0.1, lr_decay=0.05)",
     "ft.optim.adagrad(ft.optim.schedule(lambda c: 0.1 / (1 + 0.05 * c)), initial_accumulator_value=0.0, "
     "epsilon=1e-10)"),
    ("ft.optim.adamw(0.01, amsgrad=False, betas=(0.8, 0.9))", "ft.optim.adamw(0.01, beta1=0.8, beta2=0.9)"),
    ("ft.optim.sgd(0.1, momentum=0.9, foreach=True)", "ft.optim.sgd(0.1, momentum=0.9)"),
    ("ft.optim.adam(0.1, fused=True, eps=1e-6)", "ft.optim.adam(0.1, epsilon=1e-06)"),
])
def test_torchs_optimizer_options_name_functrees_optimizer_and_the_fix_runs(call, right):
    """Before: "unexpected keyword argument 'amsgrad'. Its arguments: ..." and nothing on
    AMSGrad being its own optimizer, AdamW's amsgrad a chain, Adagrad's lr_decay a schedule,
    or foreach/fused being torch's kernel choices. The right code is each optimizer's
    docstring's torch mapping (trained against torch in test_optim_torch_audit.py)."""
    names = {"ft": ft, "optax": optax}
    raises_named(lambda: eval(call, names), TypeError, TORCH_OPTION, f"right:  {right}\n")
    tx = eval(right, names)
    w = {"w": jnp.ones(2)}
    tx.update(w, tx.init(w), w)  # builds and steps


# ---- clip_grad_norm_(norm_type=) over several parameter groups ----------------------------

_GRADS = {"decay": np.random.default_rng(3).normal(size=(3, 4)) * 2.0,
          "no_decay": {"bias": np.random.default_rng(4).normal(size=4), "scale": np.array([-7.5, 0.25])}}


@pytest.mark.parametrize("norm_type", [float("inf"), "inf", 1.0, 3.0, 2.0])
def test_float64_clip_by_global_norm_of_any_norm_type_is_torchs_clip_grad_norm(norm_type):
    """Before: ``norm_type=`` was an unexpected keyword (torch's ``norm_type=inf`` recipe
    had no port). torch divides by ``‖g‖ + 1e-6``: its result times ``(‖g‖ + 1e-6) / ‖g‖``
    is ours, to float64's rounding."""
    tensors = [torch.tensor(g) for g in jax.tree.leaves(_GRADS)]
    for t in tensors:
        t.grad = t.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(tensors, 1.5, norm_type=norm_type, foreach=True))
    expected = [np.asarray(t.grad) * (norm + 1e-6) / norm for t in tensors]
    with jax.enable_x64(True):
        tx = ft.optim.clip_by_global_norm(1.5, norm_type=norm_type)
        grads = jax.tree.map(jnp.asarray, _GRADS)
        got = jax.jit(lambda g: tx.update(g, tx.init(g))[0])(grads)
        for actual, want in zip(jax.tree.leaves(got), expected):
            assert actual.dtype == jnp.float64
            np.testing.assert_allclose(actual, want, rtol=0, atol=1e-15 * 8)  # values up to 1.5


@pytest.mark.parametrize("given", [0.0, -2.0, float("nan"), "two", True, None])
def test_a_norm_type_that_is_no_norm_is_refused_naming_the_fix(given):
    raises_named(lambda: ft.optim.clip_by_global_norm(1.0, norm_type=given), ValueError, BAD_NORM_TYPE,
                 'right:  ft.optim.clip_by_global_norm(1.0, norm_type=float("inf"))')
