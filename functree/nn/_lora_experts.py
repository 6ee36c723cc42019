"""LoRA on a sparse MoE's stacked expert weights (PEFT's ``target_parameters``).

``ft.nn.lora(model, "*.experts.gate_up_proj", ...)`` (or ``down_proj``) puts an adapter on an
:class:`~functree.nn.Experts` weight ``W [E, in, out]``: the selected field becomes a
:class:`LoraParameter` holding ``weight`` (W), ``lora_a [E, in, r]`` (random) and
``lora_b [E, r, out]`` (zero), every expert an adapter of its own, and the Experts a
:class:`LoraExperts`, which computes with the effective weights

    W_e + (alpha / r) A_e B_e          (each expert e)

as PEFT's ``lora.ParamWrapper`` does (it parametrizes the weight with ``W + delta`` and runs
the base layer): the sparse MoE's grouped, dense and gathered forms read them. Key paths
follow ``LoraDense``'s: ``mlp.experts.gate_up_proj.weight`` / ``.lora_a`` / ``.lora_b``;
``wrt="*.lora_*"`` trains the adapters alone; :func:`ft.nn.merge_lora` folds them back
(plain ``Experts``). PEFT's ParamWrapper has no dropout (it cannot factor ``x`` out of the
weight), so neither has this (:data:`EXPERTS_DROPOUT`).

PEFT's tensors for a Hugging Face weight ``[E, out, in]`` (transformers 5.25's fused
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) are ``lora_A [E r, in]`` (expert-major
rows: ``lora_A.reshape(E, r, in)[e]`` is expert e's ``A``) and ``lora_B [out, r E]``
(rank-major columns: ``lora_B.reshape(out, r, E)[..., e]``): :func:`peft_tensors` and
:func:`from_peft_tensors` convert (``functree/hf/_peft_params.py`` reads and writes the files).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree import _naming
from functree._module import Module, field, from_fields
from functree._random import flat_key
from functree._repr import short_array
from functree._tree import dotted_name, has_shape_and_dtype, is_none
from functree._where import placed_like
from functree.nn._check import check_unbatched
from functree.nn._lora_options import check_dtype, check_options
from functree.nn._moe import Experts
from functree.nn._precision import statistics_dtype

__all__ = ["LoraParameter", "LoraExperts", "EXPERT_FIELDS", "EXPERTS_DROPOUT", "merge_experts",
           "peft_tensors", "from_peft_tensors", "ExpertWeight", "expert_weights", "is_experts",
           "base_experts"]

# The Experts fields an adapter may go on, in the order Hugging Face's experts modules register
# their parameters (PEFT nests one ParamWrapper per targeted parameter in that order).
EXPERT_FIELDS = ("gate_up_proj", "down_proj")

EXPERTS_DROPOUT = """\
ft.nn.lora: the pattern {pattern!r} selects the expert weights {name!r}, and dropout={dropout}: \
an adapter on a stacked weight changes the weight (W + (alpha/r) A B), not a layer's output, so \
it has no input of its own to drop (PEFT's lora.ParamWrapper refuses lora_dropout != 0 too). \
Adapt the expert weights without dropout, in a call of their own:
    wrong:  ft.nn.lora(model, {pattern!r}, ..., dropout={dropout})
    right:  model = ft.nn.lora(model, "*.self_attn.[qv]_proj", ..., dropout={dropout}, key=k1)
            model = ft.nn.lora(model, "*.experts.gate_up_proj", ..., key=k2)   # dropout=0"""


NOT_AN_EXPERT_WEIGHT = """\
ft.nn.LoraParameter adapts a stacked expert weight [..., experts, in, out] of a floating \
dtype (an ft.nn.Experts' gate_up_proj or down_proj), got {given}.
    wrong:  ft.nn.LoraParameter(dense.weight, rank=8, key=key)        # [in, out]: ft.nn.LoraDense(dense, ...)
    right:  ft.nn.LoraParameter(experts.gate_up_proj, rank=8, key=key)"""

NOT_EXPERTS = """\
ft.nn.LoraExperts adapts an ft.nn.Experts (a SparseMoE's .experts, plain or with adapters on \
other fields), got a {given}.
    wrong:  ft.nn.LoraExperts(moe, rank=8, key=key)
    right:  ft.nn.LoraExperts(moe.experts, rank=8, key=key)    # or ft.nn.lora(model, "*.experts.*", ...)"""

FIELD_ADAPTED = """\
ft.nn.LoraExperts: {name!r} holds an adapter already (a LoraParameter). Merge it first, or \
adapt the other field:
    right:  ft.nn.LoraExperts(ft.nn.merge_lora(experts), fields=({name!r},), key=key)"""

BAD_EXPERT_FIELDS = """\
ft.nn.LoraExperts: fields must name some of {allowed} (each once), got {given!r}.
    wrong:  ft.nn.LoraExperts(experts, fields=("up_proj",), key=key)
    right:  ft.nn.LoraExperts(experts, fields=("gate_up_proj",), key=key)"""


class LoraParameter(Module):
    """A stacked expert weight with a low-rank adapter per expert: ``weight [E, in, out]``,
    ``lora_a [E, in, r]``, ``lora_b [E, r, out]``; :meth:`merged` is ``W + scale · A B``
    expert by expert (formed in float32 or wider, cast to the weight's dtype). Indexing it
    (``p[experts]``) indexes the merged weight: the sparse MoE's gathered form reads it so.
    ``member_scale``: a Stack member's own scale (PEFT's ``rank_pattern`` / ``alpha_pattern``
    per layer), as :class:`~functree.nn.LoraDense`'s."""

    __ft_adapter__: ClassVar[str] = "ft.nn.merge_lora(model)"

    weight: jax.Array
    lora_a: jax.Array
    lora_b: jax.Array
    member_scale: jax.Array | None = field(no_derivative=True, default=None)
    alpha: float = field(static=True, default=8.0)

    def __init__(self, weight: jax.Array, rank: int = 8, alpha: float = 8.0, *, key: jax.Array, dtype: Any = None):
        """A fresh adapter on ``weight [..., E, in, out]``: ``lora_a`` uniform in
        ``±1/sqrt(in)`` (PEFT's ``lora_A`` default), ``lora_b`` zero, so the merged weight
        starts as ``weight``. ``dtype``: the adapters' (default: the weight's).

        Example:
          >>> import jax, jax.numpy as jnp, functree as ft
          >>> p = ft.nn.LoraParameter(jnp.ones((4, 3, 5)), rank=2, key=jax.random.key(0))
          >>> p.lora_a.shape, p.lora_b.shape, bool((p.merged() == 1).all())
          ((4, 3, 2), (4, 2, 5), True)
        """
        check_options(rank, alpha, 0.0, key, "*.experts.gate_up_proj")
        dtype = check_dtype(dtype, "ft.nn.LoraParameter")
        if not has_shape_and_dtype(weight) or len(weight.shape) < 3 or not jnp.issubdtype(weight.dtype, jnp.floating):
            raise ValueError(NOT_AN_EXPERT_WEIGHT.format(given=short_array(weight)))
        lead, (n_in, n_out) = tuple(weight.shape[:-2]), tuple(weight.shape[-2:])
        kind = weight.dtype if dtype is None else dtype
        bound = 1.0 / math.sqrt(n_in)
        a = jax.random.uniform(flat_key(key), (*lead, n_in, rank), kind, -bound, bound)
        self.lora_a, self.lora_b = placed_like((a, jnp.zeros((*lead, rank, n_out), kind)), weight)
        self.weight, self.member_scale, self.alpha = weight, None, float(alpha)

    @property
    def rank(self) -> int:
        """The adapters' inner size ``r`` (per expert)."""
        return int(self.lora_a.shape[-1])

    @property
    def scale(self) -> float | jax.Array:
        """``alpha / r``, or each Stack member's own (:attr:`member_scale`)."""
        return self.alpha / self.rank if self.member_scale is None else self.member_scale

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def dtype(self) -> Any:
        return self.weight.dtype

    def merged(self) -> jax.Array:
        """The effective weight ``W + scale · A B`` (``[E, in, out]``), in the weight's dtype."""
        wide = statistics_dtype(self.weight.dtype)  # float32, float64 for float64 weights
        scale = jnp.asarray(self.scale, wide)[..., None, None, None]  # a Stack's members' own scales: theirs
        delta = jnp.matmul(self.lora_a.astype(wide), self.lora_b.astype(wide))
        delta = delta * jax.lax.broadcast_to_rank(scale, delta.ndim)
        return (self.weight.astype(wide) + delta).astype(self.weight.dtype)

    def __getitem__(self, index: Any) -> jax.Array:
        return self.merged()[index]


class LoraExperts(Experts):
    """:class:`~functree.nn.Experts` with adapters on ``gate_up_proj`` and/or ``down_proj``
    (each a :class:`LoraParameter`, or the plain array): every form of the sparse MoE computes
    with the merged weights, as PEFT's ParamWrapper does (module docstring)."""

    __ft_adapter__: ClassVar[str] = "ft.nn.merge_lora(model)"

    gate_up_proj: Any
    down_proj: Any

    def __init__(self, experts: Experts, rank: int = 8, alpha: float = 8.0, *, key: jax.Array,
                 fields: tuple[str, ...] = EXPERT_FIELDS, dtype: Any = None):
        """``experts`` with a fresh :class:`LoraParameter` on each of ``fields`` (its
        ``gate_up_proj`` and ``down_proj`` by default; an adapter already on another field
        kept), what ``ft.nn.lora(model, "*.experts.*", ...)`` puts in a model. Field ``j`` of
        ``(gate_up_proj, down_proj)`` draws its ``lora_a`` from ``fold_in(key, j)``.

        Example:
          >>> import jax, jax.numpy as jnp, functree as ft
          >>> experts = ft.nn.Experts(4, 6, 3, key=jax.random.key(0))
          >>> adapted = ft.nn.LoraExperts(experts, rank=2, key=jax.random.key(1), fields=("gate_up_proj",))
          >>> type(adapted.gate_up_proj).__name__, type(adapted.down_proj).__name__
          ('LoraParameter', 'ArrayImpl')
          >>> x = jnp.ones((5, 4))
          >>> bool(jnp.allclose(adapted.every(x), experts.every(x)))   # lora_b is zero: the same
          True
        """
        if not isinstance(experts, Experts):
            raise TypeError(NOT_EXPERTS.format(given=type(experts).__name__))
        names = (fields,) if isinstance(fields, str) else tuple(fields)
        if not names or any(n not in EXPERT_FIELDS for n in names) or len(set(names)) != len(names):
            raise ValueError(BAD_EXPERT_FIELDS.format(given=fields, allowed=EXPERT_FIELDS))
        for j, name in enumerate(EXPERT_FIELDS):  # a field's key: the fold of its place (an adapted one kept)
            value = getattr(experts, name)
            if name in names:
                if isinstance(value, LoraParameter):
                    raise ValueError(FIELD_ADAPTED.format(name=name))
                value = LoraParameter(value, rank, alpha, key=jax.random.fold_in(key, j), dtype=dtype)
            setattr(self, name, value)
        self.activation = experts.activation

    def merged(self) -> Experts:
        """The plain :class:`Experts` of the effective weights."""
        return merge_experts(self)

    def _check_unbatched(self) -> None:
        """Experts' check, an adapted field's by its :class:`LoraParameter`'s leaves (its own
        ``ndim`` is not its weight's)."""
        for name in EXPERT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, LoraParameter):
                check_unbatched(value, weight=3, lora_a=3, lora_b=3, member_scale=0)
            else:
                check_unbatched(self, **{name: 3})

    def _ragged(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return self.merged()._ragged(rows, group_sizes)  # (grouped, inherited, checks the sizes first)

    def every(self, x: jax.Array) -> jax.Array:
        self._check_unbatched()
        return self.merged().every(x)


def merge_experts(experts: Experts) -> Experts:
    """``experts`` with each :class:`LoraParameter` folded into its weight: plain ``Experts``."""
    values = {name: getattr(experts, name) for name in EXPERT_FIELDS}
    values = {name: v.merged() if isinstance(v, LoraParameter) else v for name, v in values.items()}
    return from_fields(Experts, {**values, "activation": experts.activation})


def base_experts(experts: Experts) -> Experts:
    """``experts`` without its adapters (each :class:`LoraParameter`'s base weight): plain ``Experts``."""
    values = {name: getattr(experts, name) for name in EXPERT_FIELDS}
    values = {name: v.weight if isinstance(v, LoraParameter) else v for name, v in values.items()}
    return from_fields(Experts, {**values, "activation": experts.activation})


def peft_tensors(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's ``(lora_A [E r, in], lora_B [out, r E])`` of one weight's ``a [E, in, r]`` and
    ``b [E, r, out]`` (a Hugging Face weight ``[E, out, in]``, transformers' not-transposed
    experts)."""
    experts, n_in, r = a.shape
    n_out = b.shape[-1]
    lora_a = np.ascontiguousarray(np.transpose(a, (0, 2, 1)).reshape(experts * r, n_in))
    lora_b = np.ascontiguousarray(np.transpose(b, (2, 1, 0)).reshape(n_out, r * experts))
    return lora_a, lora_b


def from_peft_tensors(lora_a: np.ndarray, lora_b: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`peft_tensors`: ``(a [E, in, r], b [E, r, out])``."""
    n_in, n_out = lora_a.shape[1], lora_b.shape[0]
    r = lora_a.shape[0] // experts
    a = np.transpose(lora_a.reshape(experts, r, n_in), (0, 2, 1))
    b = np.transpose(lora_b.reshape(n_out, r, experts), (2, 1, 0))
    return np.ascontiguousarray(a), np.ascontiguousarray(b)


class ExpertWeight(NamedTuple):
    """One adaptable weight of an Experts node: the node's key path and dotted name, the
    node, the field, the index of the weight among the model's leaves and that leaf's names."""

    path: tuple[Any, ...]
    name: str
    node: Experts
    field: str
    leaf: int
    info: _naming.LeafInfo
    count: int  # the field's leaves (a LoraParameter's: weight, lora_a, lora_b, member_scale)


def is_experts(x: Any) -> bool:
    return isinstance(x, Experts)


def expert_weights(model: Any) -> list[ExpertWeight]:
    """Every ``gate_up_proj`` / ``down_proj`` of every Experts node of ``model`` (adapted or
    not), in flatten order."""
    infos = _naming.leaf_infos(model)
    pairs, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is None or is_experts(x))
    out, offset = [], 0
    for path, node in pairs:
        if not is_experts(node):
            offset += 1
            continue
        inner, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=is_none)
        for name in EXPERT_FIELDS:
            at = [i for i, (p, _) in enumerate(inner) if getattr(p[0], "name", None) == name]
            out.append(ExpertWeight(path, dotted_name(path), node, name, offset + at[0], infos[offset + at[0]],
                                    len(at)))
        offset += len(inner)
    return out
