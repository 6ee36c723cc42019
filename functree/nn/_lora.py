"""LoRA (Hu et al. 2021): low-rank adapters on ``Dense`` layers, merged back, saved as PEFT files.

``ft.nn.lora(model, pattern, rank=r, alpha=a, key=k)`` replaces each ``Dense`` layer the
pattern selects by a :class:`LoraDense`, which keeps the layer's weight and bias and adds
``lora_a [in, r]`` (random) and ``lora_b [r, out]`` (zero, so the model's outputs are
unchanged until it trains):

    y = activation(x W + b + (alpha / r) * (dropout(x) A) B)

Training only the adapters is ``ft.optim.Optimizer(transform, wrt="*.lora_*")``;
:func:`merge_lora` folds them into the weights (``W + (alpha / r) A B``: the original
structure back, plain ``Dense`` layers); :func:`save_lora` writes the directory
``peft.PeftModel.from_pretrained`` reads (``adapter_model.safetensors`` and
``adapter_config.json``) and :func:`load_lora` reads one back.

Hugging Face names: for a model of :func:`ft.nn.from_hf`, patterns may name layers as HF
does (``model.layers.*.self_attn.[qv]_proj``), and the PEFT files use those names. They
come from :func:`ft.nn.to_hf_state_dict` itself: a copy of the model whose leaves are
small arrays holding a code per ``Dense`` member (no copy of the weights) goes through it,
and the code found in each HF tensor names its layer; computed once per tree definition.
Other models use :func:`ft.nn.torch_state_dict`'s names in the files.

Dropout on the adapter's input (training mode only, as ``ft.nn.Dropout``) draws its mask
from ``key=`` when the layer is called with one, and otherwise from the layer's own
``dropout_key`` (a ``no_derivative`` field), which it advances as layer state
(``ft.nn.record_state``: ``Optimizer.step``, ``ft.train`` and
``ft.nn.value_with_gradient_and_state`` write it back), so layers deep inside a model,
called without a key, draw a fresh mask every step.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree import _naming
from functree._activations import identity
from functree._module import Module, field, from_fields
from functree._tree import bounded_put, cached, dotted_name, is_none
from functree.nn._check import check_input
from functree.nn._linear import Dense
from functree.nn._mode import Layer
from functree.nn._state import record_state

__all__ = ["LoraDense", "lora", "merge_lora", "save_lora", "load_lora"]

NOTHING_SELECTED = """\
ft.nn.lora: the pattern {pattern!r} selects no Dense layer. Closest layer names: {close}.
Patterns are globs over dotted layer names (ft.to_flat_dict(model, unstack=True) lists \
the leaves; a from_hf model's layers answer to Hugging Face's names too).
    wrong:  ft.nn.lora(model, {pattern!r}, ...)
    right:  ft.nn.lora(model, {right!r}, ...)"""

NOT_DENSE = """\
ft.nn.lora wraps Dense layers, but the pattern {pattern!r} also selects {name!r}, {what}.
    wrong:  ft.nn.lora(model, {pattern!r}, ...)
    right:  ft.nn.lora(model, {right!r}, ...)   # only Dense layers"""

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

BAD_RANK = """\
ft.nn.lora: rank must be a positive int (the adapters' inner size), got {rank!r}.
    right:  ft.nn.lora(model, pattern, rank=8, alpha=16, key=key)"""

BAD_ALPHA = """\
ft.nn.lora: alpha must be a positive number (the adapters' output is scaled by alpha / rank), \
got {alpha!r}.
    right:  ft.nn.lora(model, pattern, rank=8, alpha=16, key=key)"""

BAD_DROPOUT = """\
ft.nn.lora: dropout must be in [0, 1) (the probability of zeroing an adapter input), got \
{dropout!r}.
    right:  ft.nn.lora(model, pattern, rank=8, alpha=16, dropout=0.05, key=key)"""

NO_KEY = """\
ft.nn.lora needs a PRNG key (lora_a is drawn at random; lora_b starts at zero).
    wrong:  ft.nn.lora(model, {pattern!r}, rank={rank})
    right:  ft.nn.lora(model, {pattern!r}, rank={rank}, key=jax.random.key(0))"""

NOT_A_DENSE = """\
ft.nn.LoraDense wraps an ft.nn.Dense, got {given}.
    right:  ft.nn.LoraDense(ft.nn.Dense(64, 64, key=k1), rank=8, key=k2)   # or ft.nn.lora(model, pattern, ...)"""

NO_DROPOUT_KEY = """\
LoraDense (dropout={rate}) is in training mode and needs a PRNG key for its dropout mask: \
call it with key=, or give the adapters a key of their own (ft.nn.lora(..., key=k) does; \
ft.nn.load_lora(model, directory) without key= does not).
    wrong:  ft.nn.load_lora(model, directory)                          # then training
    right:  ft.nn.load_lora(model, directory, key=jax.random.key(0))
       or:  ft.nn.inference(model)                                     # no dropout"""

NO_ADAPTERS = """\
{what}: the model holds no LoraDense layer (no adapters to {verb}).
    right:  model = ft.nn.lora(model, "model.layers.*.self_attn.[qv]_proj", rank=8, alpha=16, key=key)"""

FUSED = """\
ft.nn.save_lora: the adapters of {layers} all belong to the one {torch} tensor {module!r} \
(a fused projection, as GPT-2's c_attn): PEFT holds one adapter per module, so these \
cannot be written as PEFT's. Adapt the layers that have a module of their own.
    wrong:  ft.nn.lora(model, "*.attn.*", ...)
    right:  ft.nn.lora(model, "*.attn.c_proj", ...)   # or "*.mlp.*\""""

NO_NAME = """\
ft.nn.save_lora: the adapted layer {layer!r} has no {torch} weight name (its weight is not \
written as a Linear's "<module>.weight"), so PEFT has no module to put its adapter on."""

NOT_PEFT = """\
ft.nn.load_lora: {directory!r} is not a PEFT LoRA adapter directory: {problem}.
    right:  ft.nn.load_lora(model, "path/to/adapter")   # adapter_config.json (peft_type "LORA") and
                                                        # adapter_model.safetensors, as PeftModel.save_pretrained writes"""

UNSUPPORTED_PEFT = """\
ft.nn.load_lora: the adapter sets {option}={value!r}; ft.nn.load_lora reads plain LoRA \
({covered}). Loading it anyway would give a different model."""

UNKNOWN_MODULE = """\
ft.nn.load_lora: the adapter holds tensors for {modules}, which name no Dense layer of \
this model (its {torch} names: {known} ...). Load it into the model it was trained on."""

ADAPTER_SHAPE = """\
ft.nn.load_lora: {name!r} has shape {given}; the layer {layer!r} ({inputs} inputs, {outputs} \
outputs) takes lora_A [r, {inputs}] and lora_B [{outputs}, r] with the same r."""

NO_SAFETENSORS = """\
ft.nn.save_lora / load_lora read and write .safetensors files with the safetensors package.
    right:  pip install safetensors"""


class LoraDense(Layer):
    """A ``Dense`` layer with a low-rank adapter: ``activation(x W + b + (alpha/r) (drop(x) A) B)``.

    ``weight [in, out]`` and ``bias`` are the wrapped layer's (kept as parameters: train only
    the adapters with ``wrt="*.lora_*"``); ``lora_a [in, r]`` is drawn uniformly from
    ``±1/sqrt(in)`` (PEFT's default) and ``lora_b [r, out]`` is zero, so the layer computes
    what the wrapped one did until ``lora_b`` trains. The adapter runs in the input's dtype
    (``ft.cast(model, jnp.bfloat16)`` casts all of them; float32 adapters on a bfloat16
    base are cast to it). ``alpha``, ``dropout`` and ``activation`` are static.

    ``dropout`` zeroes adapter inputs with that probability in training mode
    (``ft.nn.training``), scaling the rest by ``1/(1 - dropout)``; the mask comes from
    ``key=`` or, without one, from ``dropout_key`` (raw key data, advanced as layer state).
    Weights of a ``Stack``'s member carry the stack axes in front (``lora_a [n, in, r]``).

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
    # mark (functree/nn/_torch.py cannot import this module: it imports the converters).
    __ft_adapter__: ClassVar[str] = "ft.nn.merge_lora(model)"

    weight: jax.Array
    bias: jax.Array | None = field(decay=False)
    lora_a: jax.Array
    lora_b: jax.Array
    dropout_key: jax.Array | None = field(no_derivative=True)
    activation: Any = field(static=True, default=identity)
    alpha: float = field(static=True, default=8.0)
    dropout: float = field(static=True, default=0.0)
    training: bool = field(static=True, default=False)

    def __init__(self, dense: Dense, rank: int = 8, alpha: float = 8.0, dropout: float = 0.0, *,
                 key: jax.Array, dtype: Any = None):
        if not isinstance(dense, Dense):
            raise TypeError(NOT_A_DENSE.format(given=type(dense).__name__))
        _check_options(rank, alpha, dropout, key, "*")
        weight = dense.weight
        lead, (n_in, n_out) = weight.shape[:-2], weight.shape[-2:]
        dtype = weight.dtype if dtype is None else dtype
        bound = 1.0 / math.sqrt(n_in)
        a_key, drop_key = jax.random.split(key)
        self.weight, self.bias, self.activation = weight, dense.bias, dense.activation
        self.lora_a = jax.random.uniform(a_key, (*lead, n_in, rank), dtype, -bound, bound)
        self.lora_b = jnp.zeros((*lead, rank, n_out), dtype)
        self.alpha, self.dropout, self.training = float(alpha), float(dropout), False
        self.dropout_key = None
        if dropout > 0.0:
            count = math.prod(lead)
            keys = jax.random.split(drop_key, count) if count > 1 else drop_key[None]
            if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
                keys = jax.random.key_data(keys)
            self.dropout_key = keys.reshape((*lead, -1))

    @property
    def rank(self) -> int:
        """The adapters' inner size ``r``."""
        return int(self.lora_a.shape[-1])

    @property
    def scale(self) -> float:
        """``alpha / r``: the factor of the adapter's output."""
        return self.alpha / self.rank

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        check_input(self, x, (self.weight.shape[-2],))
        y = x @ self.weight
        if self.bias is not None:
            y = y + self.bias
        h = x
        if self.training and self.dropout > 0.0:
            if key is None:
                if self.dropout_key is None:
                    raise ValueError(NO_DROPOUT_KEY.format(rate=self.dropout))
                drawn, following = jax.random.split(jax.random.wrap_key_data(self.dropout_key))
                record_state(self, dropout_key=jax.random.key_data(following))
            else:
                drawn = key
            keep = jax.random.bernoulli(drawn, 1.0 - self.dropout, jnp.shape(x))
            h = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), jnp.zeros((), x.dtype))
        a, b = self.lora_a.astype(y.dtype), self.lora_b.astype(y.dtype)
        return self.activation(y + ((h @ a) * self.scale) @ b)


def _check_options(rank: Any, alpha: Any, dropout: Any, key: Any, pattern: Any) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(BAD_RANK.format(rank=rank))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(BAD_ALPHA.format(alpha=alpha))
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(BAD_DROPOUT.format(dropout=dropout))
    if key is None:
        raise ValueError(NO_KEY.format(pattern=pattern, rank=rank))


# ---- the Dense layers of a model and their names ----------------------------------------------

class _Layer(NamedTuple):
    """One Dense (or LoraDense) node: its key path, its dotted name (a Stack's members' stacked
    name), the index of its weight among the model's leaves and that leaf's names."""

    path: tuple[Any, ...]
    name: str
    node: Any
    weight: int
    info: _naming.LeafInfo


def _is_dense(x: Any) -> bool:
    return isinstance(x, (Dense, LoraDense))


def _layers(model: Any) -> list[_Layer]:
    """Every Dense and LoraDense node of ``model``, in flatten order."""
    infos = _naming.leaf_infos(model)
    pairs, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is None or _is_dense(x))
    out, offset = [], 0
    for path, node in pairs:
        if _is_dense(node):
            out.append(_Layer(path, dotted_name(path), node, offset, infos[offset]))
        offset += len(jax.tree.leaves(node, is_leaf=is_none)) if node is not None else 1
    return out


def _layer_name(leaf_name: str) -> str:
    return leaf_name[: -len(".weight")] if leaf_name.endswith(".weight") else leaf_name


def _member_layer_names(layer: _Layer) -> list[str]:
    """The layer's name per member (C order over its stack axes), or its one name."""
    members = _naming.member_names(layer.info)
    return [_layer_name(m) for m in members] if members else [_layer_name(layer.info.name)]


def _unwrapped(model: Any) -> Any:
    """``model`` with each LoraDense replaced by a Dense of its weight and bias (no merge)."""
    def one(x: Any) -> Any:
        if isinstance(x, LoraDense):
            return from_fields(Dense, {"weight": x.weight, "bias": x.bias, "activation": x.activation})
        return x

    return jax.tree.map(one, model, is_leaf=lambda x: isinstance(x, LoraDense))


class _TorchName(NamedTuple):
    module: str  # the torch module holding the layer's weight ("model.layers.0.self_attn.q_proj")
    transposed: bool  # stored [out, in] (a Linear), else [in, out] (Hugging Face's Conv1D)
    shared_with: tuple[str, ...]  # other ft layer members in the same tensor (a fused projection)
    weight_param: bool  # the tensor is "<module>.weight"


_TORCH_NAMES: dict[Any, tuple[bool, dict[str, _TorchName]]] = {}


def _torch_names(model: Any, torch_too: bool = True) -> tuple[bool, dict[str, _TorchName]]:
    """``(is a from_hf model, {ft layer member name: its torch module})`` for every Dense
    member of ``model``: Hugging Face's names (``to_hf_state_dict``) for a from_hf model,
    ``torch_state_dict``'s for others (none without ``torch_too``). Found by sending a copy of the model whose leaves are
    small arrays through the converter: every leaf keeps its stack axes and its last axis (the
    sizes a converter splits heads and fused projections by) and has size 1 on the others; a
    Dense weight ``[1, out]`` holds its member's code, every other leaf NaN (no code, whatever
    a conversion does to it). A Linear's weight comes back ``[out, 1]``, a Conv1D's ``[1, out]``.
    Cached per tree definition."""
    from functree.nn._hf import to_hf_state_dict
    from functree.nn._torch import torch_state_dict

    base = _unwrapped(model)
    treedef = jax.tree.structure(base, is_leaf=is_none)
    key, found = cached(_TORCH_NAMES, treedef)
    if found is not None and (found[0] or torch_too):
        return found
    layers = _layers(base)
    infos = _naming.leaf_infos(base)
    leaves = jax.tree.leaves(base, is_leaf=is_none)
    weights = {layer.weight: layer for layer in layers}
    names: dict[int, str] = {}
    markers: list[Any] = []
    for i, (leaf, info) in enumerate(zip(leaves, infos)):
        if leaf is None:
            markers.append(None)
            continue
        shape, k = tuple(np.shape(leaf)), len(info.sizes)
        if i in weights:
            first = len(names) + 1
            members = _member_layer_names(weights[i])
            names.update((first + j, name) for j, name in enumerate(members))
            codes = np.arange(first, first + len(members), dtype=np.float64).reshape((*info.sizes, 1, 1))
            markers.append(np.broadcast_to(codes, (*info.sizes, 1, shape[-1])))
        else:
            kept = shape[:k] + (1,) * (len(shape) - k - 1) + shape[-1:] if len(shape) > k else shape
            markers.append(np.full(kept, np.nan))
    marked = jax.tree.unflatten(treedef, markers)
    try:
        converted, is_hf = to_hf_state_dict(marked, numpy=True), True
    except ValueError:  # not a from_hf model: torch's names of the ft.nn layers
        if not torch_too:
            return False, {}
        converted, is_hf = torch_state_dict(marked, numpy=True), False
    out: dict[str, _TorchName] = {}
    for tensor_name, array in converted.items():
        codes = [int(c) for c in np.unique(np.asarray(array)) if c >= 1]
        module, _, param = tensor_name.rpartition(".")
        members = [names[c] for c in codes if c in names]
        for member in members:
            transposed = np.ndim(array) != 2 or np.shape(array)[-1] == 1  # [out, 1]; [1, 1]: a Linear's
            out.setdefault(member, _TorchName(module, transposed,
                                              tuple(m for m in members if m != member), param == "weight"))
    result = (is_hf, out)
    if key is not None:
        bounded_put(_TORCH_NAMES, key, result)
    return result


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


def _selected(model: Any, patterns: tuple[str, ...], what: str) -> dict[int, bool]:
    """``{index into _layers(model): True}`` for the Dense layers the patterns select (every
    member of a Stack's layer, or an error); errors for patterns selecting nothing or a
    leaf of another kind."""
    layers = _layers(model)
    infos = _naming.leaf_infos(model)
    is_hf, torch = _torch_names(model, torch_too=False)
    chosen: dict[int, bool] = {}
    for pattern in patterns:
        picks = _naming.selection(model, (pattern,), strict=False, what=what)
        owned: set[int] = set()
        hit = False
        for j, layer in enumerate(layers):
            members = _member_layer_names(layer)
            by_ft = np.broadcast_to(np.asarray(picks[layer.weight]), layer.info.sizes).reshape(-1)
            by_hf = np.array([is_hf and m in torch and _naming.matches(torch[m].module + ".weight", pattern)
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
            chosen[j] = hit = True
        for i, p in enumerate(picks):
            if np.any(p) and i not in owned:
                if any(layer.weight <= i < layer.weight + len(jax.tree.leaves(layer.node, is_leaf=is_none))
                       and isinstance(layer.node, LoraDense) for layer in layers):
                    raise ValueError(ALREADY_ADAPTED.format(pattern=pattern, name=infos[i].name))
                right = _suggested(pattern, layers)
                raise ValueError(NOT_DENSE.format(pattern=pattern, name=infos[i].name,
                                                  what=_leaf_owner(model, i), right=right))
        if not hit:
            raise _nothing(pattern, layers, torch if is_hf else {})
    return chosen


def _stacked_pattern(layer: _Layer) -> str:
    """A pattern selecting every member of a Stack's layer: its member name with ``*`` for the member numbers."""
    first = _member_layer_names(layer)[0]
    parts = first.split(".")
    stacks = _naming._stack_prefixes(layer.info)
    for prefix in stacks:
        k = len(prefix.split(".")) if prefix else 0
        parts[k] = "*"
    return ".".join(parts)


def _layer_infos(layers: list[_Layer], torch: dict[str, _TorchName]) -> list[_naming.LeafInfo]:
    """LeafInfos of the layers (their names without ``.weight``; a Stack's with member names),
    and of their Hugging Face names: what a NothingSelected error searches."""
    out = []
    for layer in layers:
        i = layer.info
        out.append(_naming.LeafInfo(_layer_name(i.name), (*i.segments[:-1], _layer_name(i.segments[-1])), i.sizes))
    out += [_naming.LeafInfo(n.module, (n.module,), ()) for n in torch.values()]
    return out


def _nothing(pattern: str, layers: list[_Layer], torch: dict[str, _TorchName]) -> ValueError:
    infos = _layer_infos(layers, torch)
    error = _naming.nothing_selected(pattern, "ft.nn.lora", "Dense layer", infos)
    if error.out_of_range is not None:
        return ValueError(error.out_of_range)
    right = error.suggestion or (error.close[0] if error.close else "*.query_projection")
    return ValueError(NOTHING_SELECTED.format(pattern=pattern, close=", ".join(map(repr, error.close)) or "none",
                                              right=right))


def _suggested(pattern: str, layers: list[_Layer]) -> str:
    """A pattern for the Dense layers ``pattern`` was probably after (their last name part)."""
    ends = sorted({_layer_name(layer.info.name).rsplit(".", 1)[-1] for layer in layers})
    close = [e for e in ends if _naming.matches(e, pattern.rsplit(".", 1)[-1])] or ends[:1]
    return f"*.{close[0]}" if close else "*.query_projection"


def lora(model: Any, pattern: str | Sequence[str], *, rank: int = 8, alpha: float = 8.0, dropout: float = 0.0,
         key: jax.Array | None = None, dtype: Any = None) -> Any:
    """``model`` with LoRA adapters on the ``Dense`` layers that ``pattern`` selects.

    Each selected ``Dense`` becomes a :class:`LoraDense` holding its weight and bias and
    ``lora_a [in, rank]`` (random), ``lora_b [rank, out]`` (zero: the model's outputs do not
    change until training moves ``lora_b``), computing ``x W + b + (alpha/rank) (drop(x) A) B``.
    ``pattern`` (a glob or a sequence of them) selects layers by their key paths, as
    ``wrt=`` does (``"*.query_projection"``, ``"blocks.*.mlp.*"``); for a model of
    :func:`ft.nn.from_hf` also by Hugging Face's module names
    (``"model.layers.*.self_attn.[qv]_proj"``). Inside a ``Stack`` every member gets
    adapters (stacked with the members). ``dropout`` drops the adapters' input in training
    mode; ``dtype`` is the adapters' (default: the weight's). A pattern selecting no Dense
    layer, a leaf of another layer, a Dense already adapted or only some members of a Stack
    raises, naming it.

    Train the adapters alone with ``ft.optim.Optimizer(transform, wrt="*.lora_*")``; fold
    them in with :func:`merge_lora`; write PEFT files with :func:`save_lora`.

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
    _check_options(rank, alpha, dropout, key, patterns[0] if patterns else "*")
    assert key is not None
    chosen = _selected(model, patterns, "ft.nn.lora")
    layers = _layers(model)
    wrapped = {layer.path: LoraDense(layer.node, rank, alpha, dropout, key=jax.random.fold_in(key, j), dtype=dtype)
               for j, layer in enumerate(layers) if j in chosen}

    def one(path: Any, x: Any) -> Any:
        return wrapped.get(tuple(path), x)

    return jax.tree_util.tree_map_with_path(one, model, is_leaf=lambda x: x is None or _is_dense(x))


def merge_lora(model: Any) -> Any:
    """``model`` with every :class:`LoraDense` folded into a ``Dense``: ``W + (alpha/r) A B``.

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
        if not isinstance(x, LoraDense):
            return x
        wide = jnp.promote_types(x.weight.dtype, jnp.float32)
        delta = jnp.matmul(x.lora_a.astype(wide), x.lora_b.astype(wide)) * jnp.asarray(x.scale, wide)
        merged = (x.weight.astype(wide) + delta).astype(x.weight.dtype)
        return from_fields(Dense, {"weight": merged, "bias": x.bias, "activation": x.activation})

    return jax.tree.map(one, model, is_leaf=lambda x: isinstance(x, LoraDense))


# ---- PEFT files -------------------------------------------------------------------------------

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def _safetensors() -> Any:
    try:
        import safetensors.numpy
    except ImportError as e:
        raise ImportError(NO_SAFETENSORS) from e
    return safetensors.numpy


def _members(a: Any, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """A stacked array's members in C order over its stack axes (itself when not stacked)."""
    array = np.asarray(a)
    return list(array.reshape((-1, *array.shape[len(sizes):]))) if sizes else [array]


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def save_lora(model: Any, directory: str | os.PathLike[str], *, base_model_name_or_path: str | None = None,
              task_type: str | None = "auto") -> None:
    """Write ``model``'s adapters as a PEFT LoRA adapter: ``directory/adapter_model.safetensors``
    and ``directory/adapter_config.json``, which ``peft.PeftModel.from_pretrained(hf_model,
    directory)`` loads onto the Hugging Face model.

    Tensors are named as PEFT names them, ``base_model.model.<module>.lora_A.weight``
    (``[r, in]``) and ``lora_B.weight`` (``[out, r]``), ``<module>`` the layer's Hugging Face
    module (:func:`ft.nn.from_hf` models; other models: :func:`ft.nn.torch_state_dict`'s
    names), one per Stack member, in the adapters' dtype. The config lists the adapted
    modules by full name in ``target_modules``, with ``r``, ``lora_alpha`` and
    ``lora_dropout`` (the first adapter's; others in ``rank_pattern`` / ``alpha_pattern``),
    ``bias="none"``; ``task_type`` ``"auto"`` is ``"CAUSAL_LM"`` for a model with an
    ``lm_head`` (GPT-2, Llama), else none. Adapters on a fused projection (GPT-2's
    ``c_attn``) have no PEFT module of their own and raise.

    Example:
      >>> import functree as ft, jax, json, os, pathlib, tempfile
      >>> model = ft.nn.Sequential(ft.nn.Dense(4, 4, key=jax.random.key(0)), ft.nn.Dense(4, 2, key=jax.random.key(1)))
      >>> adapted = ft.nn.lora(model, "layers.1", rank=2, alpha=4, key=jax.random.key(2))
      >>> directory = tempfile.mkdtemp()
      >>> ft.nn.save_lora(adapted, directory)
      >>> sorted(os.listdir(directory))
      ['adapter_config.json', 'adapter_model.safetensors']
      >>> config = json.loads(pathlib.Path(directory, "adapter_config.json").read_text())
      >>> config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]
      ('LORA', 2, 4.0, ['1'])
    """
    layers = [layer for layer in _layers(model) if isinstance(layer.node, LoraDense)]
    if not layers:
        raise ValueError(NO_ADAPTERS.format(what="ft.nn.save_lora", verb="save"))
    is_hf, torch = _torch_names(model)
    kind = "Hugging Face" if is_hf else "torch"
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    dropouts: list[float] = []
    conv1d = False
    for layer in layers:
        node = layer.node
        names = _member_layer_names(layer)
        for name, a, b in zip(names, _members(node.lora_a, layer.info.sizes), _members(node.lora_b, layer.info.sizes)):
            found = torch.get(name)
            if found is None or not found.weight_param:
                raise ValueError(NO_NAME.format(layer=name, torch=kind))
            if found.shared_with:
                raise ValueError(FUSED.format(layers=", ".join(repr(n) for n in (name, *found.shared_with)),
                                              torch=kind, module=found.module))
            conv1d |= not found.transposed
            tensors[f"{PREFIX}{found.module}.lora_A.weight"] = np.ascontiguousarray(a.T)
            tensors[f"{PREFIX}{found.module}.lora_B.weight"] = np.ascontiguousarray(b.T)
            ranks[found.module], alphas[found.module] = node.rank, node.alpha
        dropouts.append(node.dropout)
    modules = list(ranks)
    r, alpha = ranks[modules[0]], alphas[modules[0]]
    if task_type == "auto":
        task_type = "CAUSAL_LM" if getattr(model, "lm_head", False) is not False and is_hf else None
    config = {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model_name_or_path,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropouts[0], "target_modules": sorted(modules),
        "rank_pattern": {re.escape(m): v for m, v in ranks.items() if v != r},
        "alpha_pattern": {re.escape(m): v for m, v in alphas.items() if v != alpha},
        "bias": "none", "fan_in_fan_out": conv1d, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "use_rslora": False,
        "use_dora": False, "lora_bias": False, "revision": None,
    }
    os.makedirs(directory, exist_ok=True)
    _safetensors().save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


_COVERED_OPTIONS = (("use_dora", False), ("lora_bias", False), ("bias", "none"))


def _read_adapter(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    config_path, weights_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise ValueError(NOT_PEFT.format(directory=str(directory), problem=f"no {os.path.basename(path)}"))
    with open(config_path) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(NOT_PEFT.format(directory=str(directory),
                                         problem=f"peft_type is {config.get('peft_type')!r}, not 'LORA'"))
    for option, covered in _COVERED_OPTIONS:
        value = config.get(option, covered)
        if value not in (covered, None):
            raise ValueError(UNSUPPORTED_PEFT.format(option=option, value=value,
                                                     covered=", ".join(f"{o}={c!r}" for o, c in _COVERED_OPTIONS)))
    return config, _safetensors().load_file(weights_path)


def load_lora(model: Any, directory: str | os.PathLike[str], *, key: jax.Array | None = None) -> Any:
    """``model`` with the LoRA adapter a PEFT directory holds (``save_pretrained``'s, or
    :func:`save_lora`'s) put on its ``Dense`` layers: the inverse of :func:`save_lora`.

    Each ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` pair goes to the
    Dense layer whose Hugging Face (or torch) module is ``<module>``, as a
    :class:`LoraDense` with ``alpha`` from ``lora_alpha`` / ``alpha_pattern``
    (``use_rslora``: ``alpha * sqrt(r)``, the same scale) and ``dropout`` from
    ``lora_dropout``. A Stack member the file leaves out gets zero adapters (its layer
    computes what it did). ``key`` seeds the adapters' dropout masks (needed only to train
    with dropout). DoRA, adapter biases and modules not in the model raise.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, tempfile
      >>> model = ft.nn.Sequential(ft.nn.Dense(4, 4, key=jax.random.key(0)), ft.nn.Dense(4, 2, key=jax.random.key(1)))
      >>> adapted = ft.nn.lora(model, "*", rank=2, key=jax.random.key(2))
      >>> adapted = ft.set(adapted, "layers.1.lora_b", jnp.ones((2, 2)))
      >>> directory = tempfile.mkdtemp()
      >>> ft.nn.save_lora(adapted, directory)
      >>> loaded = ft.nn.load_lora(model, directory)
      >>> bool(jnp.all(loaded(jnp.ones((1, 4))) == adapted(jnp.ones((1, 4)))))
      True
    """
    config, tensors = _read_adapter(directory)
    layers = _layers(model)
    is_hf, torch = _torch_names(model)
    kind = "Hugging Face" if is_hf else "torch"
    by_module = {n.module: member for member, n in torch.items() if not n.shared_with and n.weight_param}
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        match = re.fullmatch(rf"{re.escape(PREFIX)}(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        if match is None:
            raise ValueError(NOT_PEFT.format(directory=str(directory), problem=f"an unexpected tensor {name!r}"))
        pairs.setdefault(match[1], {})[match[2]] = value
    unknown = sorted(m for m in pairs if m not in by_module)
    if unknown:
        raise ValueError(UNKNOWN_MODULE.format(modules=unknown[:4], torch=kind, known=sorted(by_module)[:4]))
    members = {by_module[m]: m for m in pairs}
    wrapped: dict[Any, LoraDense] = {}
    for j, layer in enumerate(layers):
        names = _member_layer_names(layer)
        given = [(i, members[n]) for i, n in enumerate(names) if n in members]
        if not given:
            continue
        if isinstance(layer.node, LoraDense):
            raise ValueError(ALREADY_ADAPTED.format(pattern=given[0][1], name=layer.name))
        wrapped[layer.path] = _loaded(layer, names, given, pairs, config, str(directory),
                                      None if key is None else jax.random.fold_in(key, j))

    def one(path: Any, x: Any) -> Any:
        return wrapped.get(tuple(path), x)

    return jax.tree_util.tree_map_with_path(one, model, is_leaf=lambda x: x is None or _is_dense(x))


def _loaded(layer: _Layer, names: list[str], given: list[tuple[int, str]], pairs: dict[str, dict[str, np.ndarray]],
            config: dict[str, Any], directory: str, key: jax.Array | None) -> LoraDense:
    """The LoraDense of one layer from a PEFT file's tensors (``given``: member index, module).

    Members may differ in rank and scale (PEFT's rank_pattern, alpha_pattern): the layer
    takes the largest rank (the others padded with zeros, which add nothing) and member 0's
    scale ``alpha / r``; each other member's ``lora_b`` is multiplied by its own scale over
    that one, so every member computes PEFT's ``(alpha_i / r_i) x A_i B_i``."""
    n_in, n_out = layer.node.weight.shape[-2:]
    alpha_pattern = config.get("alpha_pattern") or {}  # the tensors' shapes give each rank
    scales = []
    for _, module in given:
        a, b = pairs[module].get("lora_A"), pairs[module].get("lora_B")
        for which, array in (("lora_A", a), ("lora_B", b)):
            if array is None:
                raise ValueError(NOT_PEFT.format(directory=directory, problem=f"{module!r} has no {which}"))
        assert a is not None and b is not None
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            wrong = "lora_A" if a.ndim != 2 or a.shape[1] != n_in else "lora_B"
            raise ValueError(ADAPTER_SHAPE.format(name=f"{PREFIX}{module}.{wrong}.weight",
                                                  given=(a.shape, b.shape), layer=names[given[0][0]],
                                                  inputs=n_in, outputs=n_out))
        r = int(a.shape[0])
        alpha = float(_pattern_value(alpha_pattern, module, config.get("lora_alpha", r)))
        scales.append(alpha / (math.sqrt(r) if config.get("use_rslora") else r))
    rank = max(int(pairs[m]["lora_A"].shape[0]) for _, m in given)
    sizes = layer.info.sizes
    dtype = np.result_type(*(pairs[m]["lora_A"].dtype for _, m in given))
    a_all = np.zeros((math.prod(sizes), n_in, rank), dtype)
    b_all = np.zeros((math.prod(sizes), rank, n_out), dtype)
    for (i, module), scale in zip(given, scales):
        a, b = pairs[module]["lora_A"], pairs[module]["lora_B"]
        a_all[i, :, : a.shape[0]] = a.T
        b_all[i, : b.shape[1], :] = b.T if scale == scales[0] else (b.T * (scale / scales[0])).astype(dtype)
    dropout = float(config.get("lora_dropout") or 0.0)
    node = LoraDense(layer.node, rank, 1.0, dropout, key=jax.random.key(0) if key is None else key)
    return node.replace(lora_a=jnp.asarray(a_all.reshape((*sizes, n_in, rank))),
                        lora_b=jnp.asarray(b_all.reshape((*sizes, rank, n_out))),
                        alpha=scales[0] * rank, dropout_key=None if key is None else node.dropout_key)
