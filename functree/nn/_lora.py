"""LoRA (Hu et al. 2021): low-rank adapters on ``Dense`` layers, and merged back.

``ft.nn.lora(model, pattern, rank=r, alpha=a, key=k)`` replaces each ``Dense`` layer the
pattern selects by a :class:`LoraDense`, which keeps the layer's weight and bias and adds
``lora_a [in, r]`` (random) and ``lora_b [r, out]`` (zero, so the model's outputs are
unchanged until it trains):

    y = activation(x W + b + (alpha / r) * (dropout(x) A) B)

Training only the adapters is ``ft.optim.Optimizer(transform, wrt="*.lora_*")``;
:func:`merge_lora` folds them into the weights (``W + (alpha / r) A B``: the original
structure back, plain ``Dense`` layers); ``ft.hf.save_lora`` writes the directory
``peft.PeftModel.from_pretrained`` reads and ``ft.hf.load_lora`` reads one back
(``functree/hf/_peft.py``; also ``ft.nn.save_lora``/``load_lora``).

Foreign names: for a model of ``ft.hf.from_hf``, patterns may also name layers as Hugging
Face does (``model.layers.*.self_attn.[qv]_proj``). This module reads such names through
:data:`functree._naming.FOREIGN_NAMES`, where ``functree.hf`` registers its reader (``functree/hf/_names.py``
finds them through ``to_hf_state_dict`` itself): ``ft.nn`` sits below the packages that
convert models.

Dropout on the adapter's input (training mode only, as ``ft.nn.Dropout``) draws its mask
from ``key=`` when the layer is called with one, and otherwise from the layer's own
``dropout_key`` (a ``no_derivative`` field), which it advances as layer state
(``ft.nn.record_state``: ``Optimizer.step``, ``ft.train`` and
``ft.nn.value_with_gradient_and_state`` write it back), so layers deep inside a model,
called without a key, draw a fresh mask every step (and each microbatch of
``accumulate=k``, each device of a mesh, a mask of its own: ``_salt.salted_keys``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree import _naming
from functree._activations import identity
from functree._module import Module, field, from_fields
from functree._naming import foreign_names
from functree._random import flat_key, one_key
from functree._tree import dotted_name, is_none
from functree._where import placed_like
from functree.nn._check import check_input, check_unbatched
from functree.nn._linear import Dense, add_bias
from functree.nn._lora_experts import (
    EXPERT_FIELDS,
    EXPERTS_DROPOUT,
    ExpertWeight,
    LoraExperts,
    LoraParameter,
    expert_weights,
    is_experts,
    merge_experts,
)
from functree.nn._lora_options import check_dtype, check_options
from functree.nn._mode import Layer
from functree.nn._precision import statistics_dtype
from functree.nn._salt import salted
from functree.nn._state import record_state

__all__ = ["LoraDense", "LoraBaseWarning", "lora", "merge_lora", "check_base_untrained", "ADDED_FIELDS"]

NOTHING_SELECTED = """\
ft.nn.lora: the pattern {pattern!r} selects no {what}. Closest layer names: {close}.
Patterns are globs over dotted layer names (ft.to_flat_dict(model, unstack=True) lists \
the leaves; a from_hf model's layers answer to Hugging Face's names too).
    wrong:  ft.nn.lora(model, {pattern!r}, ...)
    right:  ft.nn.lora(model, {right!r}, ...)"""

BASE_TRAINED = """\
{call}: the model holds LoRA adapters ({adapters}) and no wrt= says what trains, so the \
optimizer differentiates and updates every parameter, the adapted layers' own weights too \
({base}), unless its transform zeroes their updates. ft.hf.save_lora writes the adapters \
alone: a PEFT model read from it adds them to the untrained base, and its outputs are not \
the trained model's. Train the adapters alone, as PEFT does (no gradient of a frozen weight \
is computed; a task model's head whole beside them: wrt=["*.lora_*", "score.*"]), or say \
that everything trains (then fold the adapters in with ft.nn.merge_lora and write the whole \
model with ft.nn.save_hf).
    wrong:  {call}(tx)
    right:  {call}(tx, wrt="*.lora_*")
    or:     {call}(tx, wrt="*")"""


class LoraBaseWarning(UserWarning):
    """An optimizer without ``wrt=`` trains the weights under LoRA adapters (:data:`BASE_TRAINED`)."""


ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head

ALL_LINEAR_DROPOUT = """\
ft.nn.lora: "all-linear" adapts this model's stacked expert weights ({name!r}) as PEFT's \
"all-linear" does here (its MoE conversion puts them and the router in target_parameters), and \
an adapter on a weight (W + (alpha/r) A B) has no input of its own to drop: PEFT refuses \
lora_dropout={dropout} there too (lora.ParamWrapper). Take no dropout, or name the layers that \
get it:
    wrong:  ft.nn.lora(model, "all-linear", ..., dropout={dropout})
    right:  ft.nn.lora(model, "all-linear", ...)                               # dropout=0, as PEFT
       or:  ft.nn.lora(model, "*.self_attn.*_proj", ..., dropout={dropout})     # Dense layers alone"""

NOT_DENSE = """\
ft.nn.lora wraps Dense layers, but the pattern {pattern!r} also selects {name!r}, {what}.
    wrong:  ft.nn.lora(model, {pattern!r}, ...)
    right:  ft.nn.lora(model, {right!r}, ...)   # only Dense layers"""

DENSE_SUBCLASS = """\
ft.nn.lora: the pattern {pattern!r} selects {name!r}, a {cls}: a subclass of ft.nn.Dense. A \
LoraDense computes a plain Dense's x W + b, so it would drop what {cls} adds (its own \
__call__, its fields) and the adapted model would not compute what this one does. Leave \
the layer out of the pattern (or build it as a plain ft.nn.Dense):
    wrong:  ft.nn.lora(model, {pattern!r}, ...)
    right:  ft.nn.lora(model, {right}, ...)   # {what}"""

ALREADY_ADAPTED = """\
ft.nn.lora: the pattern {pattern!r} selects {name!r}, a LoraDense already (ft.nn.lora was \
applied to it before). Merge its adapters first, or leave it out of the pattern:
    right:  ft.nn.lora(ft.nn.merge_lora(model), {pattern!r}, ...)"""

PART_OF_STACK = """\
ft.nn.lora: the pattern {pattern!r} selects members {members} of the {n} members of the \
Stack layer {layer!r}. A Stack's members share one structure, so all of them get \
adapters or none does.
    wrong:  ft.nn.lora(model, {pattern!r}, ...)
    right:  ft.nn.lora(model, {right!r}, ...)   # every member"""

NOT_A_DENSE = """\
ft.nn.LoraDense wraps an ft.nn.Dense, got {given}.
    right:  ft.nn.LoraDense(ft.nn.Dense(64, 64, key=k1), rank=8, key=k2)   # or ft.nn.lora(model, pattern, ...)"""

SUBCLASS_WRAPPED = """\
ft.nn.LoraDense wraps a plain ft.nn.Dense, got a {given}, a subclass: a LoraDense computes \
x W + b, so it would drop what {given} adds (its own __call__, its fields).
    wrong:  ft.nn.LoraDense({given}(...), rank=8, key=k)
    right:  ft.nn.LoraDense(ft.nn.Dense(64, 64, key=k1), rank=8, key=k2)   # or no adapter on it"""

NO_DROPOUT_KEY = """\
LoraDense (dropout={rate}) is in training mode and needs a PRNG key for its dropout mask: \
call it with key=, or give the adapters a key of their own (ft.nn.lora(..., key=k) does; \
ft.nn.load_lora(model, directory) without key= does not).
    wrong:  ft.nn.load_lora(model, directory)                          # then training
    right:  ft.nn.load_lora(model, directory, key=jax.random.key(0))
       or:  ft.nn.inference(model)                                     # no dropout"""

class LoraDense(Layer):
    """A ``Dense`` layer with a low-rank adapter: ``activation(x W + b + (alpha/r) (drop(x) A) B)``.

    ``weight [in, out]`` and ``bias`` are the wrapped layer's (kept as parameters: train only
    the adapters with ``wrt="*.lora_*"``); ``lora_a [in, r]`` is drawn uniformly from
    ``±1/sqrt(in)`` (PEFT's default) and ``lora_b [r, out]`` is zero, so the layer computes
    what the wrapped one did until ``lora_b`` trains. The adapter runs in the input's dtype
    (``ft.cast(model, jnp.bfloat16)`` casts all of them; float32 adapters on a bfloat16
    base are cast to it); in bfloat16 and float16 the bias is added in float32, as ``Dense`` adds it
    (``add_bias``: its gradient sums every row). ``alpha``, ``dropout`` and ``activation`` are static.

    ``dropout`` zeroes adapter inputs with that probability in training mode
    (``ft.nn.training``), scaling the rest by ``1/(1 - dropout)``; the mask comes from
    ``key=`` or, without one, from ``dropout_key`` (raw key data, advanced as layer state).
    Weights of a ``Stack``'s member carry the stack axes in front (``lora_a [n, in, r]``).
    ``member_scale`` (a ``no_derivative`` field, None unless set) gives each member a scale
    of its own in place of ``alpha / r``: ``ft.nn.load_lora`` sets it where PEFT's
    ``alpha_pattern`` / ``rank_pattern`` give a Stack's layers different scales, so each
    member trains PEFT's own ``A`` and ``B``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> dense = ft.nn.Dense(4, 3, key=jax.random.key(0))
      >>> layer = ft.nn.LoraDense(dense, rank=2, alpha=4.0, key=jax.random.key(1))
      >>> layer.lora_a.shape, layer.lora_b.shape, layer.scale          # scale: alpha / rank
      ((4, 2), (2, 3), 2.0)
      >>> x = jnp.ones((5, 4))
      >>> bool(jnp.all(layer(x) == dense(x)))           # lora_b = 0: the same outputs
      True
    """

    # Converters to plain state dicts (torch, Hugging Face) refuse an adapted layer by this
    # mark, the fix its value: any adapter class carries one, so they need not know each.
    __ft_adapter__: ClassVar[str] = "ft.nn.merge_lora(model)"
    # Static fields added after checkpoints were written without them: those read at their
    # default (functree/train/checkpoint/_treespec.py); any other missing field is refused.
    # (member_scale is a data field read the same way: None, every member at alpha / r.)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("saved_modules", "member_scale")
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("dropout", "saved_modules")  # a restore's template decides them (how it trains, what save_lora writes)

    weight: jax.Array
    bias: jax.Array | None = field(decay=False)
    lora_a: jax.Array
    lora_b: jax.Array
    dropout_key: jax.Array | None = field(no_derivative=True)
    # Each Stack member's own scale where the members' differ (PEFT's alpha_pattern or
    # rank_pattern on some layers, read by ft.nn.load_lora): float32, shape = the stack axes
    # (a scalar in a member's call). None: every member's scale is alpha / r. Kept apart from
    # lora_b so that training moves PEFT's A and B, not a rescaled B.
    member_scale: jax.Array | None = field(no_derivative=True, default=None)
    activation: Any = field(static=True, default=identity)
    alpha: float = field(static=True, default=8.0)
    dropout: float = field(static=True, default=0.0)
    training: bool = field(static=True, default=False)
    # PEFT's modules_to_save of the adapter this one was loaded from (ft.nn.load_lora): the
    # layers trained whole beside the adapters, which ft.nn.save_lora writes again unless told
    # otherwise (a head dropped silently would give PEFT the base's head back).
    saved_modules: tuple[str, ...] = field(static=True, default=())

    def __init__(self, dense: Dense, rank: int = 8, alpha: float = 8.0, dropout: float = 0.0, *,
                 key: jax.Array, dtype: Any = None):
        if not isinstance(dense, Dense):
            raise TypeError(NOT_A_DENSE.format(given=type(dense).__name__))
        if type(dense) is not Dense:
            raise TypeError(SUBCLASS_WRAPPED.format(given=type(dense).__name__))
        check_options(rank, alpha, dropout, key, "*")
        dtype = check_dtype(dtype, "ft.nn.LoraDense")
        weight = dense.weight
        lead, (n_in, n_out) = weight.shape[:-2], weight.shape[-2:]
        dtype = weight.dtype if dtype is None else dtype
        bound = 1.0 / math.sqrt(n_in)
        a_key, drop_key = jax.random.split(one_key(key))
        self.weight, self.bias, self.activation = weight, dense.bias, dense.activation
        self.lora_a = jax.random.uniform(flat_key(a_key), (*lead, n_in, rank), dtype, -bound, bound)
        self.lora_b = jnp.zeros((*lead, rank, n_out), dtype)
        self.alpha, self.dropout, self.training = float(alpha), float(dropout), False
        self.dropout_key, self.member_scale = None, None
        if dropout > 0.0:
            count = math.prod(lead)
            keys = jax.random.split(drop_key, count) if count > 1 else drop_key[None]
            if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
                keys = jax.random.key_data(keys)
            self.dropout_key = keys.reshape((*lead, -1))
        # Where the weight lives (a model put on device 3, or on a mesh), not on the default device.
        self.lora_a, self.lora_b, self.dropout_key = placed_like((self.lora_a, self.lora_b, self.dropout_key), weight)

    @property
    def rank(self) -> int:
        """The adapters' inner size ``r``."""
        return int(self.lora_a.shape[-1])

    @property
    def scale(self) -> float | jax.Array:
        """``alpha / r``: the factor of the adapter's output; where a Stack's members have
        scales of their own (:attr:`member_scale`), that array (one per member)."""
        return self.alpha / self.rank if self.member_scale is None else self.member_scale

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        # an ensemble's layer outside jax.vmap (a Stack's members are called one at a time)
        check_unbatched(self, weight=2, bias=1, lora_a=2, lora_b=2, dropout_key=1, member_scale=0)
        check_input(self, x, (self.weight.shape[-2],))
        y = x @ self.weight
        if self.bias is not None:  # in float32 below float32, as Dense adds it (its gradient sums every row)
            y = add_bias(y, self.bias)
        h = x
        if self.training and self.dropout > 0.0:
            if key is None:
                if self.dropout_key is None:
                    raise ValueError(NO_DROPOUT_KEY.format(rate=self.dropout))
                drawn, following = jax.random.split(jax.random.wrap_key_data(self.dropout_key))
                record_state(self, dropout_key=jax.random.key_data(following))
                drawn = salted(drawn)  # a microbatch's / device's own masks; the next key unsalted
            else:
                drawn = key
            keep = jax.random.bernoulli(flat_key(drawn), 1.0 - self.dropout, jnp.shape(x))
            h = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), jnp.zeros((), x.dtype))
        a, b = self.lora_a.astype(y.dtype), self.lora_b.astype(y.dtype)
        scale = self.alpha / self.rank if self.member_scale is None else self.member_scale.astype(y.dtype)
        return self.activation(y + ((h @ a) * scale) @ b)


# ---- the Dense layers of a model and their names ----------------------------------------------

# What ft.nn.lora adds to a Dense (a base's checkpoint read into an adapted model lacks
# exactly these: functree/train/checkpoint/_template.py names them).
ADDED_FIELDS = tuple(sorted({f.name for f in dataclasses.fields(LoraDense)}  # type: ignore[arg-type]
                            - {f.name for f in dataclasses.fields(Dense)}))  # type: ignore[arg-type]


class DenseLayer(NamedTuple):
    """One Dense (or LoraDense) node: its key path, its dotted name (a Stack's members' stacked
    name), the index of its weight among the model's leaves and that leaf's names."""

    path: tuple[Any, ...]
    name: str
    node: Any
    weight: int
    info: _naming.LeafInfo


def is_dense(x: Any) -> bool:
    return isinstance(x, (Dense, LoraDense))


def dense_layers(model: Any) -> list[DenseLayer]:
    """Every Dense and LoraDense node of ``model``, in flatten order."""
    infos = _naming.leaf_infos(model)
    pairs, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is None or is_dense(x))
    out, offset = [], 0
    for path, node in pairs:
        if is_dense(node):
            out.append(DenseLayer(path, dotted_name(path), node, offset, infos[offset]))
        offset += len(jax.tree.leaves(node, is_leaf=is_none)) if node is not None else 1
    return out


def _layer_name(leaf_name: str) -> str:
    return leaf_name[: -len(".weight")] if leaf_name.endswith(".weight") else leaf_name


def member_layer_names(layer: DenseLayer) -> list[str]:
    """The layer's name per member (C order over its stack axes), or its one name."""
    members = _naming.member_names(layer.info)
    return [_layer_name(m) for m in members] if members else [_layer_name(layer.info.name)]


# ---- ft.nn.lora -------------------------------------------------------------------------------

def _leaf_owner(model: Any, index: int) -> str:
    """What holds leaf ``index`` of ``model``: 'a leaf of RMSNorm' and the like."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_none)
    path = pairs[index][0]
    node, owner = model, None
    for entry in path[:-1]:
        if isinstance(node, Module):
            owner = node
        node = _child(node, entry)
    if isinstance(node, Module):
        owner = node
    if isinstance(owner, Dense) and path and getattr(path[-1], "name", None) == "bias":
        return "the bias of a Dense layer (select the layer: its name, without .bias)"
    return f"a leaf of {type(owner).__name__}" if owner is not None else "a leaf outside any layer"


def _child(node: Any, entry: Any) -> Any:
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return getattr(node, entry.name)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return node[entry.idx]
    if isinstance(entry, jax.tree_util.DictKey):
        return node[entry.key]
    return node


def _selected(model: Any, patterns: tuple[str, ...], what: str,
              experts: dict[tuple[Any, ...], set[str]] | None = None) -> dict[int, bool]:
    """``{index into dense_layers(model): True}`` for the Dense layers the patterns select (every
    member of a Stack's layer, or an error); errors for patterns selecting nothing or a
    leaf of another kind. ``experts`` (given: filled) collects the expert weights selected
    (``{Experts key path: {"gate_up_proj", ...}}``: :mod:`functree.nn._lora_experts`)."""
    layers = dense_layers(model)
    weights = expert_weights(model) if experts is not None else []
    infos = _naming.leaf_infos(model)
    torch = foreign_names(model).modules
    chosen: dict[int, bool] = {}
    subclassed: dict[int, bool] = {}  # Dense subclasses selected: refused once every pattern is read
    for pattern in patterns:
        picks = _naming.selection(model, (pattern,), strict=False, what=what)
        owned: set[int] = set()
        hit = False
        for j, layer in enumerate(layers):
            members = member_layer_names(layer)
            by_ft = np.broadcast_to(np.asarray(picks[layer.weight]), layer.info.sizes).reshape(-1)
            by_hf = np.array([m in torch and _naming.matches(torch[m] + ".weight", pattern)
                              for m in members])
            both = by_ft | by_hf
            count = len(jax.tree.leaves(layer.node, is_leaf=is_none))
            if not both.any():
                continue
            if isinstance(layer.node, LoraDense):
                raise ValueError(ALREADY_ADAPTED.format(pattern=pattern, name=layer.name))
            if not both.all():
                picked = [i for i, b in enumerate(both) if b]
                right = _stacked_pattern(layer)
                raise ValueError(PART_OF_STACK.format(pattern=pattern, members=picked, n=len(members),
                                                      layer=layer.name, right=right))
            owned.update(range(layer.weight, layer.weight + count))
            target = chosen if type(layer.node) is Dense else subclassed  # a subclass: LoraDense would drop its __call__
            target[j] = hit = True
        for w in weights:  # a sparse MoE's stacked expert weights (PEFT's target_parameters)
            span = range(w.leaf, w.leaf + w.count)
            picked = np.any([np.broadcast_to(np.asarray(picks[i]), w.info.sizes).reshape(-1) for i in span], axis=0)
            if not np.any(picked):
                continue
            if isinstance(getattr(w.node, w.field), LoraParameter):
                raise ValueError(ALREADY_ADAPTED.format(pattern=pattern, name=w.info.name))
            if not np.all(picked):
                members = _naming.member_names(w.info)
                right = ".".join("*" if part.isdigit() else part for part in members[0].split("."))
                raise ValueError(PART_OF_STACK.format(pattern=pattern, members=list(np.flatnonzero(picked)),
                                                      n=len(members), layer=w.info.name, right=right))
            owned.update(span)
            assert experts is not None
            experts.setdefault(w.path, set()).add(w.field)
            hit = True
        for i, p in enumerate(picks):
            if np.any(p) and i not in owned:
                if any(layer.weight <= i < layer.weight + len(jax.tree.leaves(layer.node, is_leaf=is_none))
                       and isinstance(layer.node, LoraDense) for layer in layers):
                    raise ValueError(ALREADY_ADAPTED.format(pattern=pattern, name=infos[i].name))
                right = _suggested(pattern, layers)
                raise ValueError(NOT_DENSE.format(pattern=pattern, name=infos[i].name,
                                                  what=_leaf_owner(model, i), right=right))
        if not hit:
            raise _nothing(pattern, layers, torch, weights)
    if subclassed:
        given = patterns[0] if len(patterns) == 1 else list(patterns)
        raise _subclass_error(given, layers[min(subclassed)], [layers[j] for j in sorted(chosen)])
    return chosen


def _inside(module: str | None, head: str) -> bool:
    """Whether the torch ``module`` is the head or inside it (RoBERTa's ``classifier.dense``
    and ``classifier.out_proj``: PEFT keeps the whole ``classifier`` in ``modules_to_save``)."""
    return module is not None and (module == head or module.startswith(head + "."))


def _all_linear(model: Any) -> tuple[dict[int, bool], dict[tuple[Any, ...], dict[str, int]]]:
    """PEFT's ``"all-linear"``: ``(Dense layers chosen, {Experts key path: {field: rank
    multiple}})``. Every Dense layer but a Hugging Face model's output head (its
    ``get_output_embeddings()``, which PEFT leaves out) or a task model's classifier and the
    Dense layers inside it (``score``, ``classifier``; RoBERTa's ``classifier.dense`` and
    ``classifier.out_proj``: PEFT's ``SEQ_CLS`` leaves it out and keeps it whole in
    ``modules_to_save``, as ``ft.hf.save_lora`` writes it; its ``TOKEN_CLS`` puts it there
    too; DistilBERT's ``pre_classifier``, which PEFT's ``"classifier"`` entry keeps whole with
    it), and but a Dense whose Hugging Face module is no Linear (a sparse MoE's router); these two
    are ``ForeignNames.left_out``; and the stacked expert weights PEFT's MoE conversion adds
    (``ForeignNames.parameters``: Mixtral's, Qwen3-MoE's and OLMoE's, ``gate_up_proj`` at
    twice the rank and alpha); every Dense layer of other models."""
    names = foreign_names(model)
    chosen: dict[int, bool] = {}
    layers = dense_layers(model)
    for j, layer in enumerate(layers):
        members = member_layer_names(layer)
        if names.head is not None and any(_inside(names.modules.get(m), names.head) for m in members):
            continue
        if any(m in names.left_out for m in members):
            continue
        if isinstance(layer.node, LoraDense):
            raise ValueError(ALREADY_ADAPTED.format(pattern=ALL_LINEAR, name=layer.name))
        chosen[j] = True
    experts: dict[tuple[Any, ...], dict[str, int]] = {}
    for w in expert_weights(model):
        multiple = names.parameters.get(f"{w.name}.{w.field}")
        if multiple is None:
            continue
        if isinstance(getattr(w.node, w.field), LoraParameter):
            raise ValueError(ALREADY_ADAPTED.format(pattern=ALL_LINEAR, name=w.info.name))
        experts.setdefault(w.path, {})[w.field] = multiple
    subclassed = [layers[j] for j in chosen if type(layers[j].node) is not Dense]
    if subclassed:
        raise _subclass_error(ALL_LINEAR, subclassed[0], [layers[j] for j in chosen if layers[j] not in subclassed])
    if not chosen and not experts:
        raise ValueError(NOTHING_SELECTED.format(pattern=ALL_LINEAR, close="none", right="*", what="Dense layer"))
    return chosen, experts


def _subclass_error(pattern: str | list[str], layer: DenseLayer, plain: list[DenseLayer]) -> ValueError:
    """A pattern selecting a Dense subclass's layer: the fix names the plain Dense layers it selects."""
    names = [_stacked_pattern(p) if p.info.sizes else _layer_name(p.info.name) for p in plain]
    right, what = (repr(names), f"the plain Dense layers it selects, without {_layer_name(layer.info.name)!r}") \
        if names else ("'<a pattern without it>'", "it selects no plain Dense layer")
    return ValueError(DENSE_SUBCLASS.format(pattern=pattern, name=_layer_name(layer.info.name),
                                            cls=type(layer.node).__name__, right=right, what=what))


def _stacked_pattern(layer: DenseLayer) -> str:
    """A pattern selecting every member of a Stack's layer: its member name with ``*`` for the member numbers."""
    first = member_layer_names(layer)[0]
    parts = first.split(".")
    stacks = _naming._stack_prefixes(layer.info)
    for prefix in stacks:
        k = len(prefix.split(".")) if prefix else 0
        parts[k] = "*"
    return ".".join(parts)


def _layer_infos(layers: list[DenseLayer], torch: dict[str, str],
                 weights: Sequence[ExpertWeight] = ()) -> list[_naming.LeafInfo]:
    """LeafInfos of the layers (their names without ``.weight``; a Stack's with member names),
    of their Hugging Face names and of a sparse MoE's expert weights (``...experts.gate_up_proj``):
    what a NothingSelected error searches."""
    out = []
    for info in [layer.info for layer in layers] + [w.info for w in weights]:
        out.append(_naming.LeafInfo(_layer_name(info.name), (*info.segments[:-1], _layer_name(info.segments[-1])),
                                    info.sizes))
    out += [_naming.LeafInfo(module, (module,), ()) for module in torch.values()]
    return out


def _nothing(pattern: str, layers: list[DenseLayer], torch: dict[str, str],
             weights: Sequence[ExpertWeight] = ()) -> ValueError:
    what = "Dense layer or expert weight" if weights else "Dense layer"
    infos = _layer_infos(layers, torch, weights)
    error = _naming.nothing_selected(pattern, "ft.nn.lora", what, infos)
    if error.out_of_range is not None:
        return ValueError(error.out_of_range)
    right = error.suggestion or (error.close[0] if error.close else "*.query_projection")
    return ValueError(NOTHING_SELECTED.format(pattern=pattern, close=", ".join(map(repr, error.close)) or "none",
                                              right=right, what=what))


def _suggested(pattern: str, layers: list[DenseLayer]) -> str:
    """A pattern for the Dense layers ``pattern`` was probably after (their last name part)."""
    ends = sorted({_layer_name(layer.info.name).rsplit(".", 1)[-1] for layer in layers})
    close = [e for e in ends if _naming.matches(e, pattern.rsplit(".", 1)[-1])] or ends[:1]
    return f"*.{close[0]}" if close else "*.query_projection"


COMPUTED_WEIGHT = """\
ft.nn.lora: {name!r} is the Dense inside a WeightNorm or SpectralNorm: its weight is None, computed \
by the wrapper at each call (g · v / ||v||, weight / σ), so there is no stored weight for an \
adapter to add to. Leave it out, and train the wrapper's own tensors instead:

    wrong:  ft.nn.lora(model, {pattern!r}, ...)
    right:  ft.nn.lora(model, <patterns of the other Dense layers>, ...)
       or:  ft.train.Trainer(model, opt, loss_fn, wrt="{owner}.*")   # the wrapper's g and v (weight)"""


def lora(model: Any, pattern: str | Sequence[str], *, rank: int = 8, alpha: float = 8.0, dropout: float = 0.0,
         key: jax.Array | None = None, dtype: Any = None) -> Any:
    """``model`` with LoRA adapters on the ``Dense`` layers that ``pattern`` selects.

    Each selected ``Dense`` becomes a :class:`LoraDense` holding its weight and bias and
    ``lora_a [in, rank]`` (random), ``lora_b [rank, out]`` (zero: the model's outputs do not
    change until training moves ``lora_b``), computing ``x W + b + (alpha/rank) (drop(x) A) B``.
    ``pattern`` (a glob or a sequence of them) selects layers by their key paths, as
    ``wrt=`` does (``"*.query_projection"``, ``"blocks.*.mlp.*"``); for a model of
    :func:`ft.nn.from_hf` also by Hugging Face's module names
    (``"model.layers.*.self_attn.[qv]_proj"``); ``"all-linear"`` (PEFT's shorthand) selects
    every Dense layer but the output head of a from_hf model at the root (a tied head, ``x
    wte^T``, is no Dense layer: PEFT adapts it inside a model of your own, this does not;
    docs/guides/lora.md), or its classifier for a task model (``score`` of
    ``LlamaForSequenceClassification``, BERT's ``classifier``: PEFT's ``task_type="SEQ_CLS"``
    selection; train the head whole, ``wrt=["*.lora_*", "score.*"]``, and ``ft.hf.save_lora``
    writes it in ``modules_to_save``); on a sparse MoE of ``from_hf`` what PEFT 0.21's selects
    there (a router is no torch Linear in transformers 5: left out, unless the family's
    ``hf_all_linear`` lists it with the stacked expert weights, Mixtral's, Qwen3-MoE's and
    OLMoE's, ``gate_up_proj`` at twice ``rank`` and ``alpha``). Inside a ``Stack`` every member gets
    adapters (stacked with the members). ``dropout`` drops the adapters' input in training
    mode; ``dtype`` is the adapters' (default: the weight's). A sparse MoE's stacked expert
    weights (``"*.experts.gate_up_proj"``, ``"*.experts.down_proj"``) take an adapter per
    expert, as PEFT's ``target_parameters`` (a :class:`~functree.nn._lora_experts.LoraExperts`;
    no dropout: PEFT's ParamWrapper has none). A pattern selecting no Dense
    layer, a leaf of another layer, a Dense already adapted or only some members of a Stack
    raises, naming it.

    Train the adapters alone with ``ft.optim.Optimizer(transform, wrt="*.lora_*")``; fold
    them in with :func:`merge_lora`; write PEFT files with ``ft.hf.save_lora``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Sequential(ft.nn.Dense(4, 8, jax.nn.relu, key=jax.random.key(0)),
      ...                          ft.nn.Dense(8, 2, key=jax.random.key(1)))
      >>> adapted = ft.nn.lora(model, "layers.0", rank=2, alpha=4, key=jax.random.key(2))
      >>> adapted.layers[0].lora_a.shape, adapted.layers[0].lora_b.shape, type(adapted.layers[1]).__name__
      ((4, 2), (2, 8), 'Dense')
      >>> x = jnp.ones((3, 4))
      >>> bool(jnp.all(adapted(x) == model(x)))
      True
      >>> [name for name in ft.to_flat_dict(adapted) if "lora" in name]   # what wrt="*.lora_*" trains
      ['layers.0.lora_a', 'layers.0.lora_b']
    """
    patterns = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    _naming.check_patterns(patterns)
    check_options(rank, alpha, dropout, key, patterns[0] if patterns else "*")
    dtype = check_dtype(dtype, "ft.nn.lora")
    assert key is not None
    all_linear = isinstance(pattern, str) and pattern.lower() == ALL_LINEAR
    experts: dict[tuple[Any, ...], dict[str, int]] = {}  # Experts key path -> {field: rank and alpha multiple}
    if all_linear:
        chosen, experts = _all_linear(model)
    else:
        selected: dict[tuple[Any, ...], set[str]] = {}
        chosen = _selected(model, patterns, "ft.nn.lora", selected)
        experts = {path: dict.fromkeys(fields, 1) for path, fields in selected.items()}
    layers = dense_layers(model)
    computed = [layer.name for j, layer in enumerate(layers)
                if j in chosen and isinstance(layer.node, Dense) and layer.node.weight is None]
    if computed:
        raise ValueError(COMPUTED_WEIGHT.format(name=computed[0], owner=computed[0].rpartition(".")[0] or "*",
                                                pattern=patterns[0] if patterns else "*"))
    wrapped: dict[Any, Any] = {
        layer.path: LoraDense(layer.node, rank, alpha, dropout, key=jax.random.fold_in(key, j), dtype=dtype)
        for j, layer in enumerate(layers) if j in chosen}
    if experts and dropout > 0.0:
        name = next(w.info.name for w in expert_weights(model) if w.field in experts.get(w.path, ()))
        message = ALL_LINEAR_DROPOUT if all_linear else EXPERTS_DROPOUT
        raise ValueError(message.format(pattern=pattern, name=name, dropout=dropout))
    for j, (path, fields) in enumerate(experts.items()):
        node = next(w.node for w in expert_weights(model) if w.path == path)
        k = jax.random.fold_in(key, len(layers) + j)  # each field's adapter: fold_in(k, its place) (LoraExperts)
        for name in (f for f in EXPERT_FIELDS if f in fields):
            node = LoraExperts(node, rank * fields[name], alpha * fields[name], key=k, fields=(name,), dtype=dtype)
        wrapped[path] = node

    def one(path: Any, x: Any) -> Any:
        return wrapped.get(tuple(path), x)

    return jax.tree_util.tree_map_with_path(one, model, is_leaf=lambda x: x is None or is_dense(x) or is_experts(x))


def check_base_untrained(model: Any, wrt: Any, call: str = "ft.optim.Optimizer",
                         trained: Callable[[], Any] | None = None) -> None:
    """Warn (:class:`LoraBaseWarning`) when ``wrt`` is None and ``model`` holds LoRA
    adapters: the optimizer would train their base weights too, which ``save_lora`` does not
    write (PEFT's adapters train alone). Any ``wrt`` given, ``"*"`` too, is the user's choice.
    ``trained`` gives what the optimizer moves (its ``moved_view``: ``ft.optim.groups``'
    ``freeze()`` or ``optax.set_to_zero()`` groups, an ``optax.partition``'s frozen labels):
    an adapted layer whose base arrays it leaves all frozen trains as PEFT's does."""
    if wrt is not None:
        return
    adapted = [(layer.info.name, layer.node) for layer in dense_layers(model) if isinstance(layer.node, LoraDense)]
    adapted += [(w.info.name, getattr(w.node, w.field)) for w in expert_weights(model)
                if isinstance(getattr(w.node, w.field), LoraParameter)]
    if adapted and trained is not None:  # the same arrays as the model's, None where nothing moves them
        moved = {id(x) for x in jax.tree.leaves(trained())}
        adapted = [(name, node) for name, node in adapted if any(id(x) in moved for x in _base_arrays(node))]
    names = [name for name, _ in adapted]
    if not names:
        return
    shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    layer = _layer_name(names[0])
    warnings.warn(BASE_TRAINED.format(call=call, adapters=f"{layer}.lora_a, {layer}.lora_b ...",
                                      base=shown), LoraBaseWarning, stacklevel=3)


def _base_arrays(node: Any) -> list[Any]:
    """The arrays of an adapted node (a LoraDense, a LoraParameter) that are not its adapters'."""
    return [x for path, x in jax.tree_util.tree_flatten_with_path(node)[0]
            if not str(getattr(path[0], "name", "")).startswith("lora_")]


def merge_lora(model: Any) -> Any:
    """``model`` with every :class:`LoraDense` folded into a ``Dense``: ``W + (alpha/r) A B``
    (a Stack's members with scales of their own, ``member_scale``: each member's).

    The result has the structure ``ft.nn.lora`` was given (plain ``Dense`` layers; a
    ``Stack``'s members merged member by member) and computes the same outputs, to
    rounding; the sum is formed in float32 (or wider) and cast to the weight's dtype.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(4, 3, key=jax.random.key(0))
      >>> adapted = ft.nn.lora(model, "*", rank=2, key=jax.random.key(1))
      >>> adapted = adapted.replace(lora_b=jnp.ones((2, 3)))        # as if trained
      >>> merged = ft.nn.merge_lora(adapted)
      >>> type(merged).__name__, jax.tree.structure(merged) == jax.tree.structure(model)
      ('Dense', True)
      >>> bool(jnp.allclose(merged(jnp.ones((1, 4))), adapted(jnp.ones((1, 4))), atol=1e-5))
      True
    """
    def one(x: Any) -> Any:
        if isinstance(x, LoraExperts):
            return merge_experts(x)
        if not isinstance(x, LoraDense):
            return x
        wide = statistics_dtype(x.weight.dtype)  # float32, float64 for float64 weights (strict promotion)
        scale = jnp.asarray(x.scale, wide)[..., None, None]  # a Stack's members' own scales: theirs
        delta = jnp.matmul(x.lora_a.astype(wide), x.lora_b.astype(wide))
        delta = delta * jax.lax.broadcast_to_rank(scale, delta.ndim)
        merged = (x.weight.astype(wide) + delta).astype(x.weight.dtype)
        return from_fields(Dense, {"weight": merged, "bias": x.bias, "activation": x.activation})

    return jax.tree.map(one, model, is_leaf=lambda x: isinstance(x, (LoraDense, LoraExperts)))

