"""torch.optim's NAdam, Rprop and ASGD with torch's numbers (optax's ``nadam`` and ``rprop``
compute other things; optax has no ASGD).

Each is an optimizer of :mod:`functree.optim._aliases` (hyperparameters annotated ``Hyper``,
``maximize=`` as torch's, ``weight_decay`` torch's coupled L2 term unless said otherwise).
The scalars of a step (NAdam's momentum schedule and its running product, ASGD's rate) are
computed in the hyperparameters' dtype: float64 for float64 parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from functree.optim._aliases import _decayed, _optimizer, _tree_zeros
from functree.optim._average import _averaging
from functree.optim._hyper import _is_number, hyper_dtype
from functree.optim._signature import Hyper

__all__ = ["nadam", "rprop", "asgd", "NAdamState", "RpropState", "ASGDState"]


class NAdamState(NamedTuple):
    """NAdam's step count, the running product of its momentum schedule ``μ₁ ⋯ μₜ`` and the
    moments ``mu`` and ``nu`` (parameter view; :func:`ft.optim.moments` reads them)."""

    count: jax.Array
    mu_product: jax.Array
    mu: Any
    nu: Any


def _scale_by_nadam(b1: Any, b2: Any, eps: Any, momentum_decay: Any) -> optax.GradientTransformation:
    def init(params: Any) -> NAdamState:
        return NAdamState(jnp.zeros((), jnp.int32), jnp.ones((), hyper_dtype(params)), _tree_zeros(params),
                          _tree_zeros(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, NAdamState]:
        count = jnp.asarray(optax.safe_increment(state.count))
        t = count.astype(state.mu_product.dtype)
        schedule = lambda s: b1 * (1 - 0.5 * 0.96 ** (s * momentum_decay))  # noqa: E731
        mu_t, mu_next = schedule(t), schedule(t + 1)
        product = state.mu_product * mu_t
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        correction2 = 1 - b2**t
        now, ahead = (1 - mu_t) / (1 - product), mu_next / (1 - product * mu_next)

        def direction(g: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
            denominator = jnp.sqrt(v / correction2.astype(v.dtype)) + eps
            return (now.astype(g.dtype) * g + ahead.astype(m.dtype) * m) / denominator

        return jax.tree.map(direction, updates, mu, nu), NAdamState(count, product, mu, nu)

    return optax.GradientTransformation(init, update)


@_optimizer("ft.optim.nadam")
def nadam(
    learning_rate: Hyper = 2e-3,
    beta1: Hyper = 0.9,
    beta2: Hyper = 0.999,
    epsilon: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    momentum_decay: Hyper = 4e-3,
    *,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """NAdam (torch.optim.NAdam's numbers; Dozat 2016 with its momentum schedule)::

        μₜ = β₁ (1 − ½ · 0.96^(t ψ));   Πₜ = μ₁ ⋯ μₜ          (ψ = momentum_decay)
        m ← β₁ m + (1 − β₁) g;   v ← β₂ v + (1 − β₂) g²;   d = √(v / (1 − β₂ᵗ)) + ε
        w ← w − η ((1 − μₜ)/(1 − Πₜ) · g/d + μₜ₊₁/(1 − Πₜ μₜ₊₁) · m/d)

    ``optax.nadam`` is another formula (constant β₁, Adam's bias corrections): for a constant
    gradient its first step is 1.47η for torch's 1.06η, its tenth 1.01η for 0.84η (10.9η in
    all after ten steps, for torch's 8.1η). ``weight_decay=λ``
    adds ``λw`` to the gradient (torch's default), or with ``decoupled_weight_decay=True``
    (torch's NAdamW) shrinks ``w`` by ``ηλw`` apart from the step, every parameter as torch.
    State: ``NAdamState`` (``count``, ``mu_product``, ``mu``, ``nu``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.nadam(0.1)
      >>> updates, state = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
      >>> updates["w"]     # −η (1 + μ₂/(1 − μ₁μ₂) · m), m = 0.1, μ₁ ≈ μ₂ ≈ 0.450
      Array([-0.10564...], dtype=float32)
      >>> sorted(ft.optim.moments(state))
      ['mu', 'nu']
    """
    scale = _scale_by_nadam(beta1, beta2, epsilon, momentum_decay)
    if decoupled_weight_decay and weight_decay is not None:
        return optax.chain(scale, optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
    return _decayed(weight_decay, scale, optax.scale_by_learning_rate(learning_rate))


class RpropState(NamedTuple):
    """Rprop's per-element step sizes and the previous step's gradient (zero where its sign
    flipped), in the parameter view (:func:`ft.optim.moments` reads both)."""

    step_sizes: Any
    previous: Any


RPROP_ETAS = """\
ft.optim.rprop: etas={etas!r}; torch's Rprop takes (η₋, η₊) with 0 < η₋ < 1 < η₊ (the step shrinks
by η₋ where the gradient's sign flips and grows by η₊ where it holds):

    wrong:  ft.optim.rprop(1e-2, etas={etas!r})
    right:  ft.optim.rprop(1e-2, etas=(0.5, 1.2))"""

RPROP_STEP_SIZES = """\
ft.optim.rprop: step_sizes={step_sizes!r}; it takes (smallest, largest) step with
0 <= smallest <= largest:

    wrong:  ft.optim.rprop(1e-2, step_sizes={step_sizes!r})
    right:  ft.optim.rprop(1e-2, step_sizes=(1e-6, 50))"""

RPROP_RATE = """\
ft.optim.rprop: learning_rate={given!r}; Rprop's learning rate is only the initial step size
(each element's step then grows and shrinks by etas), so a schedule would be read once, at
init, and change nothing after, as torch's Rprop ignores a scheduler. Give a number:

    wrong:  ft.optim.rprop(ft.optim.cosine_decay(1e-2, 1000))
    right:  ft.optim.rprop(1e-2)"""


def _pair(value: Any) -> tuple[float, float] | None:
    """``value`` as two finite-or-infinite floats, else None."""
    try:
        low, high = value
        return float(low), float(high)
    except (TypeError, ValueError):
        return None


def _check_rprop(learning_rate: Any, etas: Any, step_sizes: Any) -> None:
    if not _is_number(learning_rate):
        raise ValueError(RPROP_RATE.format(given=learning_rate))
    pair = _pair(etas)
    if pair is None or not 0 < pair[0] < 1 < pair[1] < float("inf"):
        raise ValueError(RPROP_ETAS.format(etas=etas))
    sizes = _pair(step_sizes)
    if sizes is None or not 0 <= sizes[0] <= sizes[1]:
        raise ValueError(RPROP_STEP_SIZES.format(step_sizes=step_sizes))


def _scale_by_rprop(learning_rate: Any, etas: tuple[float, float],
                    step_sizes: tuple[float, float]) -> optax.GradientTransformation:
    (shrink, grow), (smallest, largest) = etas, step_sizes

    def init(params: Any) -> RpropState:
        return RpropState(jax.tree.map(lambda p: jnp.full_like(p, learning_rate), params), _tree_zeros(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, RpropState]:
        agree = jax.tree.map(lambda g, h: jnp.sign(g * h), updates, state.previous)
        sizes = jax.tree.map(
            lambda s, a: jnp.clip(s * jnp.where(a > 0, grow, jnp.where(a < 0, shrink, 1.0)).astype(s.dtype),
                                  smallest, largest), state.step_sizes, agree)
        kept = jax.tree.map(lambda g, a: jnp.where(a < 0, jnp.zeros_like(g), g), updates, agree)
        steps = jax.tree.map(lambda g, s: -jnp.sign(g) * s, kept, sizes)
        return steps, RpropState(sizes, kept)

    return optax.GradientTransformation(init, update)


@_optimizer("ft.optim.rprop", check=_check_rprop, off_at_zero=())
def rprop(
    learning_rate: Hyper = 1e-2,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50),
    *,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Resilient backpropagation (torch.optim.Rprop's numbers)::

        a = sign(g · gₜ₋₁);   s ← clip(s · (η₊ if a > 0, η₋ if a < 0, else 1), smallest, largest)
        g ← 0 where a < 0;   w ← w − sign(g) s;   gₜ₋₁ ← g

    with ``s`` starting at ``learning_rate`` (only the initial step size: a number), ``etas =
    (η₋, η₊)`` and ``step_sizes = (smallest, largest)``. ``optax.rprop`` returns, at a step
    where the sign holds, the previous step's ``sign · s`` (so its first step is 0 and every
    step lags one behind torch's) and leaves ``s`` unclipped where ``a = 0``.
    State: ``RpropState`` (``step_sizes``, ``previous``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> tx = ft.optim.rprop(0.1)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for g in ([1.0, 1.0], [1.0, -1.0]):
      ...     updates, state = tx.update({"w": jnp.array(g)}, state)
      >>> updates["w"]       # the sign held: 0.1 · 1.2; it flipped: no step
      Array([-0.12, -0.  ], dtype=float32)
    """
    return optax.with_extra_args_support(_scale_by_rprop(learning_rate, etas, step_sizes))


class ASGDState(NamedTuple):
    """ASGD's step count and the rate ``eta`` of the next step (as torch keeps it)."""

    count: jax.Array
    eta: jax.Array


def _scale_by_asgd(learning_rate: Any, lambd: Any, alpha: Any) -> optax.GradientTransformation:
    def init(params: Any) -> ASGDState:
        return ASGDState(jnp.zeros((), jnp.int32), jnp.zeros((), hyper_dtype(params)))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, ASGDState]:
        if params is None:
            raise ValueError(ASGD_NEEDS_PARAMS)
        eta = jnp.where(state.count == 0, jnp.asarray(learning_rate, state.eta.dtype), state.eta)
        count = jnp.asarray(optax.safe_increment(state.count))
        step = jax.tree.map(lambda g, p: -eta.astype(g.dtype) * (g + (lambd * p).astype(g.dtype)), updates, params)
        rate = jnp.asarray(learning_rate, state.eta.dtype)
        following = rate / (1 + lambd * rate * count.astype(rate.dtype)) ** alpha
        return step, ASGDState(count, following)

    return optax.GradientTransformation(init, update)


ASGD_NEEDS_PARAMS = """\
ft.optim.asgd decays and averages the parameters, so update needs them: pass the model.

    wrong:  updates, state = tx.update(grads, state)
    right:  updates, state = tx.update(grads, state, model)"""


@_optimizer("ft.optim.asgd")
def asgd(
    learning_rate: Hyper = 1e-2,
    lambd: Hyper = 1e-4,
    alpha: Hyper = 0.75,
    t0: Hyper = 1e6,
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Averaged SGD (torch.optim.ASGD's numbers, its averaged parameters ``ax`` included)::

        w ← w (1 − λ ηₜ) − ηₜ (g + κ w);   ηₜ₊₁ = η / (1 + λ η t)^α    (η₁ = η, κ = weight_decay)
        w̄ ← w̄ + μₜ (w − w̄),   μₜ = 1 / max(1, t − 1 − t₀)

    ``w̄`` (torch's ``ax``) is kept in the state as an :class:`ft.optim.AverageState`: read the
    model with the averaged parameters with :func:`ft.optim.averaged` (so give no other
    ``average=`` to the Optimizer). Each ``ηₜ₊₁`` is taken from the learning rate of step
    ``t``, as torch takes it from the group's ``lr`` (a schedule's change shows one step
    later); ``t₀`` is read at the step it is used. State: ``(ASGDState, AverageState)``.
    ``w̄`` is float32 for float32 parameters, as torch's: past about 10⁴ averaged steps
    (``t − t₀``) a step's share rounds away (:func:`ft.optim.uniform_average`'s limit: 5e-4
    off over 10⁵ steps, stuck near its early value over 10⁶).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> opt = ft.optim.Optimizer(ft.optim.asgd(0.1, lambd=0.0, t0=0))
      >>> w = {"w": jnp.zeros(())}
      >>> state = opt.init(w)
      >>> for _ in range(3):     # w = −0.1, −0.2, −0.3; averaged from step 2: −0.25
      ...     w, state, _ = opt.minimize(lambda p: p["w"], w, state)
      >>> ft.optim.averaged(state, w)["w"]
      Array(-0.25, dtype=float32)
    """
    average = _averaging("ft.optim.asgd", lambda k, dtype: 1 / jnp.maximum(1, k - 1 - t0).astype(dtype), 0, 1)
    return _decayed(weight_decay, _scale_by_asgd(learning_rate, lambd, alpha), average)
