"""A sparse mixture of experts: each token's ``top_k`` experts of ``num_experts`` SwiGLU MLPs,
weighted by its router's probabilities (Mixtral's block; Qwen2-MoE's and OLMoE's without
the renormalization).

For a token ``x`` (``[d]``), with ``W_r`` the router (``gate``, ``[d, E]``, no bias)::

    p       = softmax(x W_r)                       # in float32 (float64 for float64 weights)
    S       = the top_k experts of p               # jax.lax.top_k: on a tie the lower index
    w_e     = p_e / sum_{j in S} p_j   (renormalize=True, Mixtral's)  or  p_e  (False)
    y       = sum_{e in S} w_e * ((act(x G_e) * (x U_e)) D_e)

``G_e | U_e`` is expert ``e``'s slice ``gate_up_proj[e]`` (``[d, 2 * hidden]``: the gate's
columns, then the up projection's), ``D_e`` is ``down_proj[e]`` (``[hidden, d]``). Only the
selected experts are computed: the ``N * top_k`` (token, expert) pairs are sorted by expert
and each expert's rows multiply its weights in one grouped matmul (``jax.lax.ragged_dot``),
``2 * N * top_k * 3 * d * hidden`` flops, ``top_k / E`` of the dense form's (every expert for
every token, masked; ``implementation="dense"``, the same numbers). An expert no token chose
is an empty group: its output and its weights' gradient are zero.

``implementation="auto"`` (the default) is the sorted form where JAX's default backend is a
TPU and the dense one elsewhere: XLA's CPU backend lowers ``ragged_dot`` to every group for
every row, masked (``E`` times the work), so there the dense form's ``E / top_k`` is the
faster (8 experts, top-2, d 256, hidden 512, 512 tokens, float32: forward 58 ms dense, 75 ms
sorted; gradient 115 ms and 222 ms); upstream XLA's CUDA backend does the same unless a cuDNN
grouped-matmul fusion applies (reported for jaxlib 0.9-0.10: the rows times every expert
materialized, and its memory), so "sorted" on a GPU is for a stack measured to take the
grouped path (not measured here: no GPU was lent). Where the rows times ``top_k`` are fewer
than the experts (a decoding step: one token per row), "auto" is ``"gathered"``: each row's
``top_k`` experts' weights gathered (``[N, top_k, d, 2 * hidden]``) and applied to it alone,
``N * top_k`` experts read instead of every one, with no sort. JAX (0.9.2 to 0.10.2) has no second derivative of
``ragged_dot`` with respect to its weights: a Hessian of the sorted form fails
(NotImplementedError); ``implementation="dense"`` has them. Nor has it a batching rule for
``ragged_dot`` with a batch of group sizes: the sorted form under ``jax.vmap`` is refused
(:data:`SORTED_VMAP`; the layer takes ``[batch, T, d]`` whole). The dense form holds every
expert's ``[E, N, 2 * hidden]`` activations: for long inputs at a large model's sizes on the
CPU, ``implementation="sorted"`` keeps ``[N * top_k, 2 * hidden]``.

In training mode (``ft.nn.training``) with ``jitter > 0`` and a ``key``, the input is first
multiplied by noise uniform in ``[1 - jitter, 1 + jitter]`` (Mixtral's ``router_jitter_noise``:
both the router and the experts read the noisy input, as Hugging Face's block).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._activations import silu
from functree._module import field
from functree._random import TRAINER_KEY, flat_key, one_key
from functree._repr import short_array
from functree.nn._abstract import initialized
from functree.nn._check import (
    LayerInputError,
    check_input,
    check_unbatched,
    concrete,
    size_argument,
    size_arguments,
)
from functree.nn._linear import Dense
from functree.nn._mode import Layer
from functree.nn._precision import statistics_dtype
from functree.nn._state import record_intermediate

__all__ = ["SparseMoE", "Experts", "load_balancing_loss", "TOP_K", "IMPLEMENTATION", "JITTER_KEY", "SORTED_VMAP",
           "ROUTER_LOGITS_SHAPE", "ROUTER_TOP_K", "ROUTER_MASK_SHAPE", "GROUP_SIZES"]

TOP_K = """\
ft.nn.SparseMoE: top_k={top_k} of num_experts={experts}; each token is sent to top_k distinct \
experts, so 1 <= top_k <= num_experts.

    wrong:  ft.nn.SparseMoE(d, hidden, num_experts={experts}, top_k={top_k}, key=key)
    right:  ft.nn.SparseMoE(d, hidden, num_experts={experts}, top_k={fix}, key=key)
"""

IMPLEMENTATION = """\
ft.nn.SparseMoE: implementation={given!r}; it is "auto" (gathered where the rows times top_k \
are fewer than the experts, else sorted on a TPU and dense elsewhere), "sorted" (the selected \
experts only: pairs sorted by expert, jax.lax.ragged_dot), "gathered" (each row's own experts' \
weights gathered) or "dense" (every expert for every token, masked: the same numbers, \
num_experts / top_k times the work).

    wrong:  ft.nn.SparseMoE(..., implementation={given!r})
    right:  ft.nn.SparseMoE(..., implementation="sorted")
"""

JITTER_KEY = """\
ft.nn.SparseMoE (jitter={jitter}) is in training mode and needs a PRNG key for its router \
jitter noise.

    wrong:  model(x)
    right:  model(x, key=jax.random.key(step))       # a fresh key every step
""" + TRAINER_KEY


SORTED_VMAP = """\
ft.nn.SparseMoE(implementation={given!r}) was called under jax.vmap: its sorted form groups the \
rows by expert with jax.lax.ragged_dot, which has no batching rule for a batch of group sizes \
(JAX: {error!r}); each vmapped call would sort its own rows.

    wrong:  jax.vmap(moe)(x)                                       # x [batch, T, d]
    right:  moe(x)                                                 # every example's rows sorted together
       or:  jax.vmap(moe.replace(implementation="gathered"))(x)    # or "dense": the same numbers
"""

ROUTER_LOGITS_SHAPE = """\
ft.nn.load_balancing_loss: router_logits are every layer's router logits stacked, [layers, \
rows, experts] (rows: batch * T); got {given}.

    wrong:  ft.nn.load_balancing_loss(logits, top_k)            # logits {given}: one SparseMoE's [rows, experts]
    right:  ft.nn.load_balancing_loss(logits[None], top_k)      # one layer
       or:  ft.nn.load_balancing_loss(jnp.stack(per_layer), top_k)   # HF's tuple of [rows, experts] per layer
"""

ROUTER_TOP_K = """\
ft.nn.load_balancing_loss: top_k={top_k}, where each token is routed to 1 to {experts} of the \
router logits' {experts} experts (an int: the model's num_experts_per_tok).

    wrong:  ft.nn.load_balancing_loss(logits, top_k={top_k})
    right:  ft.nn.load_balancing_loss(logits, top_k=model.sparse_moe().top_k)
"""

ROUTER_MASK_SHAPE = """\
ft.nn.load_balancing_loss: the mask {mask} has {count} entries, one per row of the router \
logits {logits} ({rows} rows: batch * T of the call that made them); a mask of another batch \
or length would weigh other tokens (Hugging Face's load_balancing_loss_func fails on it).

    wrong:  model.aux_loss(attention_mask=labels_mask[:, 1:], router_logits=routed)
    right:  model.aux_loss(attention_mask=attention_mask, router_logits=routed)   # the mask the forward took
"""


GROUP_SIZES = """\
Experts.grouped takes rows sorted by expert and group_sizes[e], the count of expert e's rows: \
counts >= 0 that sum to the rows. Others describe other rows: jax.lax.ragged_dot gives zeros \
for rows past their sum, and a negative count mixes the experts' weights, silently. Where the \
sizes are concrete they are refused; under jax.jit, where their values are not seen, every \
output row is NaN. Count each expert's rows from the same assignment the rows were sorted by:
    wrong:  experts.grouped(rows[order], jnp.asarray(planned_counts))
    right:  experts.grouped(rows[order], jnp.zeros(num_experts, jnp.int32).at[chosen].add(1))"""


def _normal(std: float) -> Any:
    return jax.nn.initializers.normal(std)


class Experts(Layer):
    """``num_experts`` SwiGLU MLPs as stacked weights: ``gate_up_proj`` ``[E, d, 2 * hidden]``
    (each expert's gate columns, then its up columns) and ``down_proj`` ``[E, hidden, d]``;
    expert ``e`` maps ``x`` to ``(act(x G_e) * (x U_e)) D_e``. Called by :class:`SparseMoE`
    with the rows sorted by expert (:meth:`grouped`)."""

    gate_up_proj: jax.Array
    down_proj: jax.Array
    activation: Any = field(static=True, default=silu)

    def __init__(self, d: int, hidden: int, num_experts: int, activation: Any = silu, *, key: jax.Array,
                 dtype: Any = jnp.float32, std: float = 0.02):
        d, hidden, num_experts = _checked_sizes("Experts", d, hidden, num_experts)
        k1, k2 = jax.random.split(one_key(key))
        self.gate_up_proj = initialized(_normal(std), k1, (num_experts, d, 2 * hidden), dtype)
        self.down_proj = initialized(_normal(std), k2, (num_experts, hidden, d), dtype)
        self.activation = activation

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Rows ``[M, d]`` sorted by expert, ``group_sizes[e]`` of them expert ``e``'s: each
        row through its expert (``[M, d]``). The sizes are integers ``[E]``, each ``>= 0``,
        summing to ``M``: others are refused where they are concrete, and under ``jax.jit``
        (their values unseen) make every output row NaN (:data:`GROUP_SIZES`), never the
        zeros or mixed weights ``jax.lax.ragged_dot`` gives for them.

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp
          >>> experts = ft.nn.Experts(4, 6, 3, key=jax.random.key(0))
          >>> rows = jnp.ones((5, 4))
          >>> experts.grouped(rows, jnp.array([2, 0, 3])).shape      # rows 0-1: expert 0, 2-4: expert 2
          (5, 4)
          >>> bool(jnp.isnan(jax.jit(experts.grouped)(rows, jnp.array([2, 0, 2]))).all())  # sum 4, not 5
          True
        """
        self._check_unbatched()
        bad = _check_group_sizes(self, rows, group_sizes)
        out = self._ragged(rows, group_sizes)
        return out if bad is None else jnp.where(bad, jnp.asarray(jnp.nan, out.dtype), out)

    def _check_unbatched(self) -> None:
        """:class:`BatchedLayerError` for an ensemble's experts (``jax.vmap``-built, ``[models, E,
        d, 2 * hidden]``) outside ``jax.vmap``: the models' count was read as the experts'
        (JAX's dot_general and einsum errors, a SparseMoE's "expects inputs [..., models]")."""
        check_unbatched(self, gate_up_proj=3, down_proj=3)

    def _ragged(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """:meth:`grouped` unchecked: the sparse MoE's sizes, counted from its own routing."""
        h = jax.lax.ragged_dot(rows, self.gate_up_proj, group_sizes)
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.lax.ragged_dot(self.activation(gate) * up, self.down_proj, group_sizes)

    def every(self, x: jax.Array) -> jax.Array:
        """Every expert on every row ``[N, d]``: ``[E, N, d]`` (the dense form)."""
        self._check_unbatched()
        h = jnp.einsum("nd,edf->enf", x, self.gate_up_proj)
        gate, up = jnp.split(h, 2, axis=-1)
        return jnp.einsum("enf,efd->end", self.activation(gate) * up, self.down_proj)


def _checked_sizes(cls: str, d: Any, hidden: Any, num_experts: Any) -> tuple[int, int, int]:
    """The sizes as Python ints, each named at the call when it is none (:data:`BAD_SIZE_ARGUMENT`)."""
    d, hidden = size_arguments(cls, d=d, hidden=hidden)
    return d, hidden, size_argument(cls, "num_experts", num_experts, 1)


def _check_group_sizes(experts: Experts, rows: jax.Array, group_sizes: Any) -> jax.Array | None:
    """Raise :class:`LayerInputError` for ``group_sizes`` that are not integers ``[E]`` or,
    concrete, not counts ``>= 0`` summing to the rows (:data:`GROUP_SIZES`); traced, the
    scalar that is True where they are not (the caller's one select), else None."""
    num = experts.gate_up_proj.shape[0]
    sizes = group_sizes if isinstance(group_sizes, jax.Array) else np.asarray(group_sizes)
    count = rows.shape[0] if rows.ndim == 2 else None
    expected = f"group_sizes [{num}] (int) counting the rows, >= 0, summing to {count}"
    if sizes.shape != (num,) or not jnp.issubdtype(sizes.dtype, jnp.integer) or count is None:
        raise LayerInputError(experts, expected, f"group_sizes {short_array(sizes)} for rows {short_array(rows)}",
                              GROUP_SIZES)
    host = concrete(sizes)
    if host is None:
        wide = sizes.astype(jnp.int32) if sizes.dtype.itemsize < 4 else sizes  # uint8 sums past 255
        return (jnp.sum(wide) != count) | jnp.any(wide < 0)
    total = int(host.astype(np.int64).sum())
    if (host < 0).any() or total != count:
        raise LayerInputError(experts, expected, f"group_sizes {host.tolist()} (sum {total})", GROUP_SIZES)
    return None


class SparseMoE(Layer):
    """A sparse mixture-of-experts MLP (module docstring for the math): ``gate`` the router
    (a Dense without bias, ``[d, num_experts]``), ``experts`` the stacked SwiGLU experts,
    each token through its ``top_k`` experts only. ``renormalize`` (Mixtral's, the default)
    divides the selected probabilities by their sum; False keeps them as the softmax gave
    them (Qwen2-MoE's ``norm_topk_prob: false``, OLMoE's). ``jitter``: Mixtral's
    ``router_jitter_noise``, in training mode only. :meth:`route` gives the router's logits,
    the selected experts and their weights; ``__call__(x, return_logits=True)`` returns
    ``(y, logits)`` for an auxiliary loss (:func:`load_balancing_loss`).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> moe = ft.nn.SparseMoE(16, 32, num_experts=4, top_k=2, key=jax.random.key(0))
      >>> moe.experts.gate_up_proj.shape, moe.experts.down_proj.shape, moe.gate.weight.shape
      ((4, 16, 64), (4, 32, 16), (16, 4))
      >>> x = jax.random.normal(jax.random.key(1), (2, 5, 16))
      >>> y, logits = moe(x, return_logits=True)
      >>> y.shape, logits.shape
      ((2, 5, 16), (10, 4))
      >>> sparse = moe.replace(implementation="sorted")        # the selected experts only: the same numbers
      >>> bool(jnp.allclose(sparse(x), y, atol=1e-6))
      True
      >>> ft.nn.load_balancing_loss(logits[None], top_k=2).shape     # a scalar; 2 (top_k) where balanced
      ()
    """

    gate: Dense
    experts: Experts
    top_k: int = field(static=True, default=2)
    renormalize: bool = field(static=True, default=True)
    jitter: float = field(static=True, default=0.0)
    implementation: str = field(static=True, default="auto")
    training: bool = field(static=True, default=False)

    def __init__(self, d: int, hidden: int, *, num_experts: int, top_k: int = 2, activation: Any = silu,
                 renormalize: bool = True, jitter: float = 0.0, implementation: str = "auto", key: jax.Array,
                 dtype: Any = jnp.float32, std: float = 0.02):
        d, hidden, num_experts = _checked_sizes("SparseMoE", d, hidden, num_experts)
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= num_experts:
            raise ValueError(TOP_K.format(top_k=top_k, experts=num_experts, fix=min(2, num_experts)))
        top_k = int(top_k)  # (a NumPy integer, e.g. read from an array, as the int it is)
        if implementation not in ("auto", "sorted", "dense", "gathered"):
            raise ValueError(IMPLEMENTATION.format(given=implementation))
        k1, k2 = jax.random.split(one_key(key))
        self.gate = Dense(d, num_experts, use_bias=False, key=k1, dtype=dtype, weight_initializer=_normal(std))
        self.experts = Experts(d, hidden, num_experts, activation, key=k2, dtype=dtype, std=std)
        self.top_k, self.renormalize, self.jitter = top_k, bool(renormalize), float(jitter)
        self.implementation, self.training = implementation, False

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Rows ``x`` ``[N, d]``: ``(logits [N, E] in x's dtype, weights [N, top_k] in float32
        (float64 for float64 x), experts [N, top_k] int32)``, the experts by decreasing
        probability (a tie: the lower index first)."""
        logits = self.gate(x)
        probs = jax.nn.softmax(logits.astype(statistics_dtype(x.dtype)), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return logits, weights, experts.astype(jnp.int32)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None, return_logits: bool = False) -> Any:
        check_unbatched(self.gate, weight=2, bias=1)  # an ensemble's layer outside jax.vmap
        self.experts._check_unbatched()
        check_input(self, x, (self.gate.weight.shape[0],))
        if self.training and self.jitter > 0:
            if key is None:
                raise ValueError(JITTER_KEY.format(jitter=self.jitter))
            noise = jax.random.uniform(flat_key(key), x.shape, statistics_dtype(x.dtype), 1.0 - self.jitter,
                                       1.0 + self.jitter)
            x = (x.astype(noise.dtype) * noise).astype(x.dtype)  # in float32 for bf16 (strict promotion)
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        logits, weights, experts = self.route(rows)
        record_intermediate(self, router_logits=logits)  # for an auxiliary loss (ft.nn.collect_intermediates)
        implementation = self.implementation
        if implementation == "auto":  # (a decoding step's few rows: their experts' weights read alone)
            implementation = "gathered" if rows.shape[0] * self.top_k < self.experts.gate_up_proj.shape[0] \
                else "sorted" if jax.default_backend() == "tpu" else "dense"
        if implementation == "dense":
            y = _dense(self.experts, rows, weights, experts)
        elif implementation == "gathered":
            y = _gathered(self.experts, rows, weights, experts)
        else:
            y = _sorted(self.experts, rows, weights, experts, self.implementation)
        y = y.reshape(shape)
        return (y, logits) if return_logits else y


def _sorted(experts: Experts, rows: jax.Array, weights: jax.Array, chosen: jax.Array,
            implementation: str = "sorted") -> jax.Array:
    """The selected experts only: the ``N * k`` (row, expert) pairs sorted by expert (stable:
    a row's pairs keep their order), one grouped matmul per projection, each pair's output
    times its weight, the pairs put back in row order and summed over ``k``."""
    n, k = chosen.shape
    num_experts = experts.gate_up_proj.shape[0]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    try:
        out = experts._ragged(rows[order // k], sizes)  # pair i of the sorted order is row order[i] // k's
    except NotImplementedError as error:  # (JAX's own, deep in its batching: named here)
        if "vmap" not in str(error):
            raise
        raise NotImplementedError(SORTED_VMAP.format(given=implementation, error=str(error))) from None
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    wide = weights.dtype
    pairs = out[inverse].reshape(n, k, out.shape[-1]).astype(wide) * weights[..., None]  # (n may be 0)
    return jnp.sum(pairs, axis=1).astype(rows.dtype)


def _gathered(experts: Experts, rows: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
    """Each row through its own ``k`` experts, their weights gathered per row (``[N, k, d,
    2 * hidden]``): ``N * k`` experts' weights read, fewer than the dense form's ``E`` where
    ``N * k < E`` (a decoding step's rows), and no sort."""
    h = jnp.einsum("nd,nkdf->nkf", rows, experts.gate_up_proj[chosen])
    gate, up = jnp.split(h, 2, axis=-1)
    out = jnp.einsum("nkf,nkfd->nkd", experts.activation(gate) * up, experts.down_proj[chosen])
    return jnp.sum(out.astype(weights.dtype) * weights[..., None], axis=1).astype(rows.dtype)


def _dense(experts: Experts, rows: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
    """Every expert on every row, weighted by each row's weights of its selected experts (0 elsewhere)."""
    num_experts = experts.gate_up_proj.shape[0]
    full = jnp.sum(jax.nn.one_hot(chosen, num_experts, dtype=weights.dtype) * weights[..., None], axis=1)  # [N, E]
    out = experts.every(rows).astype(weights.dtype)  # [E, N, d]
    return jnp.einsum("end,ne->nd", out, full).astype(rows.dtype)


def load_balancing_loss(router_logits: jax.Array, top_k: int, mask: Any = None) -> jax.Array:
    """The Switch Transformer's auxiliary load-balancing loss as Hugging Face's
    ``load_balancing_loss_func`` computes it (Mixtral's ``aux_loss``).

    ``router_logits`` ``[L, N, E]`` (each layer's router logits over the same ``N`` rows:
    ``[batch * T]``, batch major), ``mask`` ``[batch, T]`` (or ``[N]``; 1: a real token) or
    None. With ``f_e`` the share of the ``L * k * N'`` top-k choices that went to expert
    ``e`` times ``k`` and ``P_e`` the mean router probability of expert ``e``, both over the
    layers and the real rows (``N'`` of them)::

        loss = E * sum_e f_e * P_e       (top_k where the routing is balanced)

    The counts have no gradient; the probabilities do. Computed in float32 (float64 for
    float64 logits). Mixtral's training loss adds ``router_aux_loss_coef * loss``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> float(ft.nn.load_balancing_loss(jnp.zeros((2, 6, 4)), top_k=2))  # uniform: each expert 1/4
      2.0
    """
    # (one layer's [rows, experts], HF's tuple per layer, a mask of another call: named here,
    # not an unpacking or einsum error deep inside)
    shape = getattr(router_logits, "shape", None)
    if shape is None or len(shape) != 3:
        given = short_array(router_logits) if shape is not None else \
            f"a {type(router_logits).__name__} of {len(router_logits)}" if isinstance(router_logits, (tuple, list)) \
            else type(router_logits).__name__
        raise ValueError(ROUTER_LOGITS_SHAPE.format(given=given))
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= shape[-1]:
        raise ValueError(ROUTER_TOP_K.format(top_k=top_k, experts=shape[-1]))
    count = math.prod(jnp.shape(mask)) if mask is not None else shape[1]
    if count != shape[1]:
        raise ValueError(ROUTER_MASK_SHAPE.format(mask=short_array(jnp.asarray(mask)), count=count,
                                                  logits=short_array(router_logits), rows=shape[1]))
    wide = statistics_dtype(router_logits.dtype)
    num_layers, rows, num_experts = router_logits.shape
    probs = jax.nn.softmax(router_logits.astype(wide), axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    weight = jnp.ones((rows,), wide) if mask is None else jnp.reshape(mask, (-1,)).astype(wide)
    counts = jnp.einsum("lnke,n->e", jax.nn.one_hot(chosen, num_experts, dtype=wide), weight)
    total = num_layers * jnp.sum(weight)
    tokens = jax.lax.stop_gradient(counts) / total
    probability = jnp.einsum("lne,n->e", probs, weight) / total
    return num_experts * jnp.sum(tokens * probability)
