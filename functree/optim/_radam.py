"""Rectified Adam as torch.optim.RAdam (and the paper's reference code) computes it, with the
length of the approximated moving average ρₜ computed without cancellation in float32 (in
float64 where the hyperparameters are, for float64 parameters: torch's numbers to 1e-16).

Liu et al. 2020::

    ρ∞ = 2/(1 − β₂) − 1;   ρₜ = ρ∞ − 2t β₂ᵗ / (1 − β₂ᵗ)

Written this way, ρₜ is the difference of two numbers near 2/(1 − β₂), both rounded in
float32: at β₂ = 0.999 the sixth step's ρ₆ came out 5.975 for 5.994 (its rectification
factor 0.5% off), and at β₂ = 0.99999 every step was 50-100% off. With ``d = 1 − β₂``,
``L = −log(1 − d)`` and ``u = tL`` (so ``β₂ᵗ = e⁻ᵘ``) the same quantity is::

    ρₜ = ρ∞ − (2/L) · u/(eᵘ − 1)                                  (u ≥ 1: no cancellation)
    ρₜ = (2/d − 2/L − 1) + t − (2/L) · (u/(eᵘ − 1) − 1 + u/2)      (u < 1)

where both brackets of the second line are small and taken from their series: ``u/(eᵘ−1)
− 1 + u/2 = u²/12 − u⁴/720 + u⁶/30240 − …`` (Bernoulli numbers) and ``2/d − 2/L − 1 =
(1/L) Σₖ≥₃ dᵏ⁻¹ (k−2)/(k(k−1))``. So ρₜ ≈ t − t²L/6 for the early steps, exact to float32's
precision of t, and the bias corrections ``1 − βᵗ = −expm1(t log(1 − (1 − β)))`` likewise.

torch's step also places ε before the bias correction of the second moment
(``m̂ · √(1 − β₂ᵗ) / (√v + ε)``, as the paper's code; optax's ``radam`` divides by
``√v̂ + ε``): the two differ where ``√v`` is near ε (gradients of order 1e-8).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["scale_by_radam", "rho"]

# u/(e^u - 1) - 1 + u/2 = Σ B_2k u^2k / (2k)!  for |u| < 1: terms to u^12 leave < 1e-10.
_BERNOULLI = (1 / 12, -1 / 720, 1 / 30240, -1 / 1209600, 1 / 47900160, -691 / 1307674368000)
_C_TERMS = 40  # 2/d - 2/L - 1 for d <= 1/2: the k-th term is below 2^-k


def _bernoulli_tail(u: jax.Array) -> jax.Array:
    """``u/(eᵘ − 1) − 1 + u/2`` for ``|u| < 1``, by its series (Horner in u²)."""
    u2 = u * u
    total = jnp.zeros_like(u)
    for b in reversed(_BERNOULLI):
        total = total * u2 + b
    return total * u2


def _offset(d: jax.Array, log: jax.Array) -> jax.Array:
    """``2/d − 2/L − 1`` with ``L = −log(1 − d)`` (about d/6), by its series for d ≤ 1/2."""
    total = jnp.zeros_like(d)
    for k in range(_C_TERMS + 2, 2, -1):  # Horner: Σ_{k≥3} d^(k−1) (k−2)/(k(k−1))
        total = total * d + (k - 2) / (k * (k - 1))
    series = total * d * d / log
    return jnp.where(d <= 0.5, series, 2 / d - 2 / log - 1)


def _dtype(beta: Any) -> Any:
    """The dtype RAdam's scalars are computed in: ``beta``'s (float64 where the optimizer's
    hyperparameters are, for float64 parameters), float32 at least."""
    return jnp.promote_types(jnp.float32, jnp.asarray(beta).dtype)


def rho(beta2: Any, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(ρ∞, ρₜ)`` of RAdam at step ``t`` (a count ≥ 1), without cancellation, in
    ``beta2``'s dtype (float32 at least).

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.optim._radam import rho
      >>> [round(float(x), 2) for x in rho(0.999, jnp.float32(6.0))]   # β₂ held as float32 0.99900001
      [1999.03, 5.99]
    """
    dtype = _dtype(beta2)
    d = 1 - jnp.asarray(beta2, dtype)
    log = -jnp.log1p(-d)
    u = jnp.asarray(t, dtype) * log
    rho_inf = 2 / d - 1
    small = u < 1
    safe_u = jnp.where(small, 1.0, u)  # each branch only where it is taken (no inf * 0)
    late = rho_inf - (2 / log) * safe_u / jnp.expm1(safe_u)
    early = _offset(d, log) + jnp.asarray(t, dtype) - (2 / log) * _bernoulli_tail(jnp.where(small, u, 0.0))
    return rho_inf, jnp.where(small, early, late)


def _one_minus_power(beta: Any, t: jax.Array) -> jax.Array:
    """``1 − βᵗ`` without cancellation: ``−expm1(t · log(1 − (1 − β)))``."""
    dtype = _dtype(beta)
    return -jnp.expm1(jnp.asarray(t, dtype) * jnp.log1p(-(1 - jnp.asarray(beta, dtype))))


def scale_by_radam(b1: Any, b2: Any, eps: Any, threshold: float = 5.0) -> optax.GradientTransformation:
    """torch.optim.RAdam's direction (before the learning rate)::

        m ← β₁m + (1−β₁)g;   v ← β₂v + (1−β₂)g²;   m̂ = m/(1 − β₁ᵗ)
        ρₜ > 5:  m̂ · rₜ · √(1 − β₂ᵗ)/(√v + ε),  rₜ = √((ρₜ−4)(ρₜ−2)ρ∞ / ((ρ∞−4)(ρ∞−2)ρₜ))
        else:    m̂

    State: ``optax.ScaleByAdamState`` (``count``, ``mu``, ``nu``), as ``optax.scale_by_radam``.
    """

    def init(params: Any) -> optax.ScaleByAdamState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, optax.ScaleByAdamState]:
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        t = jnp.asarray(count, jnp.float32)  # exact to 2²⁴ steps; widened where β₂ is float64
        rho_inf, rho_t = rho(b2, t)
        rectified = rho_t > threshold
        safe = jnp.where(rectified, rho_t, threshold + 1.0)  # r's root only where it is taken
        r = jnp.sqrt((safe - 4) * (safe - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * safe))
        # 1 − β₁ᵗ as written (β₁ far from 1: no cancellation, and at t = 1 exactly the
        # moment's 1 − β₁, so m̂ = g); 1 − β₂ᵗ from expm1 (β₂ near 1: 2e-3 at t = 2).
        first = 1 - jnp.asarray(b1, _dtype(b1)) ** jnp.asarray(t, _dtype(b1))
        second = jnp.sqrt(_one_minus_power(b2, t))

        def direction(m: jax.Array, v: jax.Array) -> jax.Array:
            m_hat = m / first.astype(m.dtype)
            adapted = m_hat * (r * second).astype(m.dtype) / (jnp.sqrt(v) + eps)
            return jnp.where(rectified, adapted, m_hat)

        return jax.tree.map(direction, mu, nu), optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)
