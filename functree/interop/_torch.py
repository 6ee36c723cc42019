"""Torch state dicts onto ``ft.nn`` layers and back, with names and layouts converted.

torch and ``ft.nn`` layers hold the same numbers under other names and in other layouts::

    torch                                    ft.nn
    Linear  weight [out, in], bias           Dense  weight [in, out] (transposed), bias
    Conv{1,2,3}d  weight [out, in/g, *k]     Conv{1,2,3}D  weight [*k, in/g, out]
    ConvTranspose{1,2,3}d  weight [in, out/g, *k]  Conv{1,2,3}DTranspose  weight [*k, in, out/g]
    LayerNorm, GroupNorm, RMSNorm  weight, bias  scale, offset
    BatchNorm{1,2}d  weight, bias, running_mean, running_var (track_running_stats=True), num_batches_tracked
                                             BatchNorm  scale, offset, running_mean, running_variance,
                                             batches_tracked (momentum=None; else num_batches_tracked dropped)
    InstanceNorm{1,2,3}d  weight, bias (affine=True), running_mean, running_var (track_running_stats=True)
                                             InstanceNorm{1,2,3}D  scale, offset, running_mean, running_variance
    Embedding, EmbeddingBag  weight          Embedding, EmbeddingBag  embeddings
    PReLU  weight                            PReLU  slope
    Bilinear  weight [out, in1, in2], bias   Bilinear  weight [in1, in2, out], bias
    (transformers' MoE experts) gate_up_proj [E, 2h, d], down_proj [E, d, h]
                                             Experts  gate_up_proj [E, d, 2h], down_proj [E, h, d]
    MultiheadAttention  in_proj_weight [3E, E] (or q/k/v_proj_weight), in_proj_bias, out_proj
                                             query/key/value/output_projection (split, transposed)
    Transformer, TransformerEncoder/Decoder(Layer)  torch's names (layers.0.self_attn, linear1, norm1,
                                             the stacks' norm): the fields carry them
    GRUCell, GRU  weight_ih[_l0], weight_hh[_l0], bias_ih[_l0], bias_hh[_l0]
                                             GRUCell / RNN(GRUCell)  input_weight, hidden_weight,
                                             input_bias, hidden_bias (transposed weights)
    RNNCell, RNN  the same four              SimpleRNNCell / RNN(SimpleRNNCell), as GRU's
                                             (nonlinearity="relu" → activation=ft.nn.relu)
    LSTMCell, LSTM  the same four            LSTMCell / RNN(LSTMCell)  input_weight, hidden_weight,
                                             bias = bias_ih + bias_hh

A layer's torch name is its key path with ``Sequential``'s ``layers``, ``Remat``'s
``layer`` and ``Shared``'s ``model`` left out (``features.layers.0`` is torch's
``features.0``); any other array leaf is matched by that name as it is (a torch
``nn.Parameter``). A ``Stack``'s member ``i`` is torch's ``h.i`` (a ``ModuleList``), its
slice of every stacked leaf converted as its layer is. A ``Shared`` tie's value is torch's
tensor under each of its names (torch's tied parameters). ``rename=`` maps torch name
prefixes onto the model's where they differ; ``layouts=`` reads Hugging Face's ``Conv1D``
and attention held as separate ``Linear`` layers. ``RNN(cell)`` is a single-layer ``GRU`` /
``LSTM`` / ``RNN`` (``_l0``); ``RNN(cell, reverse=True)`` is a bidirectional layer's reverse direction
(``_l0_reverse``: torch has no reverse-only layer); ``Bidirectional`` is torch's one-layer
``bidirectional=True`` module, and ``StackedRNN`` (``ft.nn.LSTM`` / ``GRU`` / ``SimpleRNN``) its
``num_layers=`` ones, layer ``k``'s tensors ``_l{k}`` and ``_l{k}_reverse``. torch's further
layers loaded into one RNN stay unmatched, reported with the constructor that fits them.

Where ``ft.nn``'s defaults differ from torch's, the torch numbers are one argument away:

* ``BatchNorm``: ``epsilon=1e-3`` (torch ``eps=1e-5``) → ``ft.nn.BatchNorm(n, epsilon=1e-5)``;
  ``momentum`` weighs the old statistics (``0.99``; torch's ``0.1`` weighs the new ones) →
  ``momentum=0.9``. In training torch updates ``running_var`` with the unbiased batch
  variance, ``ft.nn`` with the biased one (the one both normalize with) →
  ``unbiased_running_variance=True``.
* ``ft.nn.gelu`` is the tanh approximation (torch's ``GELU(approximate="tanh")``); torch's
  default ``nn.GELU()`` is ``ft.nn.gelu_exact``.
* Convolutions are channels-last (``x.permute(0, 2, 3, 1)`` for an NCHW input) and pad
  ``"SAME"`` by default (torch's ``padding=0`` is ``"VALID"``, its ``padding=p`` is
  ``padding=p``: ``"SAME"`` at stride 2 on an even size pads the end alone, torch's
  ``padding=1`` both sides, same shapes, other numbers); a ``Linear`` after
  ``Flatten`` of NCHW feature maps needs ``flattened={name: (C, H, W)}`` (below). torch's
  ``padding_mode="reflect"`` / ``"circular"`` / ``"replicate"`` is no tensor of the state
  dict: give it, ``Conv2D(..., padding=p, padding_mode="reflect")``.
* ``RMSNorm``: ``epsilon=1e-6``; torch's ``RMSNorm(eps=None)`` uses the input dtype's machine
  epsilon (``torch.finfo(x.dtype).eps``: 1.19e-7 for float32) → ``ft.nn.RMSNorm(n, epsilon=None)``
  (or torch's ``eps=`` where set).
* ``RNN`` is batch-first (torch's ``batch_first=True``).
* ``InstanceNorm{1,2,3}d``: the defaults are torch's (``affine=False``, ``epsilon=1e-5``); its
  ``momentum=m`` is ``momentum=1 - m`` here (a keyword; default 0.9, torch's 0.1).
* Layers without tensors, channels last, one class per rank (the rank is the layer's: the
  input's leading axes are any): torch's ``ZeroPad2d((left, right, top, bottom))`` (and the
  other pads) is ``ZeroPad2D(((top, bottom), (left, right)))``, pairs in the input's axis order
  (torch's flat tuple is refused, a 1-D pad takes ``(left, right)``); ``nn.Upsample(scale_factor=2,
  mode="bilinear")`` on ``[N, C, H, W]`` is ``Upsample2D(scale_factor=2, mode="bilinear")``
  (``Upsample1D`` / ``Upsample3D``: ``"linear"`` / ``"trilinear"``; ``"area"``,
  ``recompute_scale_factor`` and 2-D ``antialias`` as torch's; ``F.interpolate`` is
  ``ft.nn.interpolate`` on ``[N, *spatial, C]``); ``Unfold``'s ``[N, C kh kw, L]`` is ``[..., L, C kh kw]``
  (``Fold`` the same way back) and ``stride=`` is ``strides=``; ``Dropout1d/2d/3d``,
  ``PixelShuffle``, ``ChannelShuffle``, ``LPPool*d``, ``LocalResponseNorm``, ``AlphaDropout``
  take torch's arguments (``LPPool``'s ``kernel_size, stride`` are ``pool_size, strides``).
  ``Unflatten(1, (C, H, W))`` after a ported ``Linear`` orders the features channel first:
  ``ft.nn.Unflatten(-1, (C, H, W))`` then ``jnp.moveaxis(x, -3, -1)``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._alias import check_stale
from functree._files import read_path
from functree._module import Module
from functree._naming import fill_stars, rename_pattern
from functree._parameters import floats_as_arrays, parameters, with_parameters
from functree._stacked import is_stacked
from functree._state_dict import (
    TORCH_CAST_HINT,
    TORCH_FLOAT_RANGE_HINT,
    TORCH_INT_RANGE_HINT,
    FlatDictReport,
    _both_floating,
    _wraps,
    castable,
    check_no_meta,
    from_flat_dict,
    int_range_hint,
    range_hint,
    to_flat_dict,
    to_numpy,
)
from functree._tree import dotted_name, join_names
from functree._where import committed_sharding
from functree.interop._host import copied, copy_all, empty
from functree.interop._layouts import Local, Options, absent, gradient_to_torch, layer_rules, same
from functree.interop._mismatch import mismatch_error
from functree.interop._options import check_options, torch_module
from functree.interop._ports import (
    Found,
    check_placement,
    hint,
    load_ports,
    merged,
    port_of,
    prefixed,
    renamed_report,
    replaced,
    unused_layouts,
)
from functree.interop._processes import host_array
from functree.interop._recurrent_hint import recurrent_hint
from functree.interop._safetensors import load_checkpoint
from functree.nn._conv import Conv
from functree.nn._linear import Dense
from functree.nn._normalization import BatchNorm, GroupNorm, LayerNorm, RMSNorm
from functree.nn._pooling import Flatten
from functree.nn._remat import Remat
from functree.nn._sequential import Sequential
from functree.nn._shared import Shared
from functree.nn._weight_norm import SpectralNorm

__all__ = ["load_torch_state_dict", "torch_state_dict"]

FLATTENED_UNKNOWN = """\
ft.nn: flattened= names {names}, which are not Dense layers of the model. Name a Dense layer \
by its torch name or key path: {dense}

    right:  flattened={{{first!r}: (channels, height, width)}}"""

FLATTENED_UNNAMED = """\
ft.nn: {name} (ft: {ft}) is a Dense layer after Flatten of the {channels}-channel feature maps of the Conv \
{conv}: torch's Flatten of channels-first maps orders its {inputs} inputs ({channels}, {spatial}), \
ft.nn's of channels-last maps ({spatial}, {channels}), so its weight's rows are permuted between the \
two, by the maps' shape, which no tensor holds (taken as they are, a silently different model). \
Give torch's map shape before Flatten:

    wrong:  ft.nn.{fn}(model{rest})
    right:  ft.nn.{fn}(model{rest}, flattened={{{name!r}: ({channels}, {spatial})}})   # {spatial}: {size} positions
       or:  flattened={{{name!r}: None}}   # torch's model flattened channels-last maps too (x.permute(0, 2, 3, 1).flatten(1))"""

FLATTENED_UNSEEN = """\
ft.nn: {name} (ft: {ft}) is a Dense layer of {inputs} inputs, {size} x the {channels} channels \
of the Conv {conv} {where}, in a model without ft.nn.Flatten: if its __call__ flattens the \
Conv's feature maps (x.reshape(len(x), -1)), torch's Flatten of channels-first maps orders \
them ({channels}, {spatial}) and ft.nn's of channels-last maps ({spatial}, {channels}), so \
the weight's rows are permuted between the two by the maps' shape, which no tensor holds \
(taken as they are, a silently different model). Say what the Dense takes:

    wrong:  ft.nn.{fn}(model{rest})
    right:  ft.nn.{fn}(model{rest}, flattened={{{name!r}: ({channels}, {spatial})}})   # {spatial}: {size} positions
       or:  flattened={{{name!r}: None}}   # its inputs are not flattened maps (or channels-last in torch too)"""

FLATTENED_NOT_DENSE = """\
ft.nn: {name} (ft: {ft}) is a {kind} after Flatten of the {channels}-channel feature maps of the Conv \
{conv}: its {inputs} features are ({spatial}, {channels}) in ft.nn's channels-last order, torch's \
({channels}, {spatial}), and flattened= permutes only a Dense's rows (taken as they are, a silently \
different model). Flatten in torch's order instead, and the layers after it take torch's tensors as \
they are:

    wrong:  ft.nn.Flatten()
    right:  lambda x: jnp.moveaxis(x, -1, 1).reshape(x.shape[0], -1)   # torch's Flatten of [N, C, {spatial}]"""

NO_TORCH = """\
ft.nn.torch_state_dict returns torch tensors and needs torch: pip install torch. For NumPy \
arrays in torch's layout pass numpy=True."""

NO_TORCH_DTYPE = """\
ft.nn.torch_state_dict: {name!r} is {dtype}, which no torch dtype holds. Return NumPy arrays \
(ml_dtypes' {dtype}), or cast the model to a dtype torch has first:

    wrong:  ft.nn.torch_state_dict(model)
    right:  ft.nn.torch_state_dict(model, numpy=True)
       or:  ft.nn.torch_state_dict(jax.tree.map(lambda a: a.astype(jnp.bfloat16), model))"""

LAYOUT_UNUSED = """\
ft.nn: layouts= patterns {patterns} match no Dense or MultiheadAttention layer of the model. \
Patterns (ft's globs: a pattern picks a layer whose name or a dotted prefix of it it matches) \
are matched against the model's torch names and key paths, after rename=: \
{names}

    wrong:  layouts={{{pattern!r}: ...}}
    right:  layouts={{{first!r}: "conv1d"}}   # a name above"""

RENAME_STARS = """\
ft.nn: rename={{{old!r}: {new!r}}} has a different number of * on each side; each * of the \
torch name goes to the * of the model's name in order.

    right:  rename={{"transformer.h.*": "blocks.*"}}"""

TIES_DISAGREE = """\
ft.nn.load_torch_state_dict: the state dict gives a tied parameter two different values: \
{target} (ft: {ft_target}) differs from {source} (ft: {ft_source}) by up to {difference:.3g} \
after the tie's transform. The model stores one value (ft.nn.Shared). Load the one you mean:

    right:  sd = dict(sd); del sd[{target0!r}]   # the tie then follows {source0!r}
       or:  untie the model (no ft.nn.Shared) to keep both"""

TIE_NOT_INVERTIBLE = """\
ft.nn.load_torch_state_dict: the state dict gives the tied {target} but not its source \
{source}, and the source cannot be recovered from it: {why}. A tie's transform is undone \
where it is linear and its adjoint inverts it up to a constant (A Aᵀ = c I: a transpose, \
reshape or permutation, times a nonzero c), checked by applying it. Give the source's tensors:

    wrong:  ft.nn.load_torch_state_dict(model, sd)   # sd holds {target_torch} only
    right:  sd[{torch0!r}] = source_tensor           # the source's tensors: {torch}"""

# TIE_NOT_INVERTIBLE's {why}: what the transform is.
NOT_LINEAR = "its transform is not a linear map of one array (jax.linear_transpose refuses it)"
NOT_SCALED_ORTHOGONAL = ("its transform is linear, but applying it to the adjoint's answer (scaled) does not "
                         "give the target back: A Aᵀ is no multiple of the identity (or A is singular)")
NOT_INJECTIVE = ("its transform is linear but drops entries of the source (a slice, a sum): the target "
                 "does not hold the whole source, and the rest cannot be known")
NOT_AN_ARRAY_SOURCE = "the tie's source is a subtree, and only an array source's transform is undone"

NOT_A_STATE_DICT = """\
ft.nn.load_torch_state_dict: state_dict is a {kind}, not a mapping of names to tensors (a torch \
module's state_dict(), a dict of arrays) nor a checkpoint's path.{fix}"""

# NOT_A_STATE_DICT's {fix}: what was given instead.
MODULE_GIVEN = """

    wrong:  ft.nn.load_torch_state_dict(model, module)
    right:  ft.nn.load_torch_state_dict(model, module.state_dict())"""
PAIRS_GIVEN = """

    wrong:  ft.nn.load_torch_state_dict(model, pairs)   # [(name, tensor), ...]
    right:  ft.nn.load_torch_state_dict(model, dict(pairs))"""

NESTED_CHECKPOINT = """\
ft.nn.load_torch_state_dict: state_dict[{key!r}] holds a mapping ({kind}), not a tensor: a training \
checkpoint around a state dict (torch.save({{"epoch": ..., "state_dict": model.state_dict(), ...}}); \
Lightning's and timm's "state_dict", "model", "ema"), not a state dict itself. Pass the state \
dict it holds:

    wrong:  ft.nn.load_torch_state_dict(model, checkpoint)           # keys {keys}
    right:  ft.nn.load_torch_state_dict(model, checkpoint[{inner!r}])"""

# META_TENSORS' {strict} here: unlike a missing key, a meta tensor left out would leave the
# model's initial values where the caller meant weights.
META_STRICT = " (with strict=False too, as torch's load_state_dict refuses them)"

RENAMED_TOGETHER = """\
ft.nn.load_torch_state_dict: rename= maps the state dict's {first!r} and {second!r} both to \
{name!r}, and they differ ({why}): one would load and the other be dropped \
without an error. Give each tensor a name of its own, or drop the one you do not mean:

    wrong:  ft.nn.load_torch_state_dict(model, sd, rename=...)   # {first!r}, {second!r} -> {name!r}
    right:  sd = {{k: v for k, v in sd.items() if k != {second!r}}}   # {first!r} loads
       or:  ft.nn.Shared(model, ...)   # a tie: both names read and checked to agree"""

Rename = Mapping[str, str] | Callable[[str], str] | None


@dataclasses.dataclass(frozen=True)
class _Rule:
    """Torch tensors ``torch`` (full names) ↔ model parameters ``ft`` (their ``_Plan`` names)."""

    torch: tuple[str, ...]
    ft: tuple[str, ...]
    to_ft: Callable[..., tuple[np.ndarray, ...]]
    to_torch: Callable[..., tuple[np.ndarray, ...]]


def _children(node: Any) -> list[tuple[str, Any]]:
    """The direct children of a pytree node with their dotted names (None children skipped)."""
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(dotted_name(p), child) for p, child in path_leaves if p and child is not None]


def _under(stored: str | None, name: str) -> str | None:
    return None if stored is None else join_names(stored, name)


def _get(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):  # a tuple's member by number (a StackedRNN's layers.0)
        node = node[int(part)] if isinstance(node, (tuple, list)) else getattr(node, part)
    return node


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One parameter as torch sees it: a Stack member's slice, or a tie's target value."""

    stored: str | None  # the stored leaf's ``to_flat_dict`` name; None for a tie's target
    index: tuple[int, ...]  # member numbers into the stored leaf (one per enclosing Stack)
    value: Any  # an array; while loading, a placeholder (_placeholder: no memory)


@dataclasses.dataclass(frozen=True)
class _Tie:
    """``target`` holds ``transform(source)`` (names with member numbers, as in ``_Plan``)."""

    target: str
    source: str
    transform: Callable[[Any], Any] | None
    template: Any  # the source's value: shapes and dtypes to invert the transform on


@dataclasses.dataclass
class _Plan:
    """Every rule of a model and the leaves they convert, named as ``ft.get`` names them:
    Stack members by number (``h.0.attn...``), a Shared tie's target by its own name."""

    rules: list[_Rule]
    leaves: dict[str, _Leaf]
    ties: list[_Tie]
    attentions: list[str] = dataclasses.field(default_factory=list)  # MultiheadAttention layers' torch names
    ports: list[Found] = dataclasses.field(default_factory=list)  # subtrees named by their own converter
    layers: dict[str, Any] = dataclasses.field(default_factory=dict)  # each known layer by its torch name
    # each Stack member's torch name (h.1): its Stack's torch name and member count
    stacks: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    # every module by its torch name, with its key path (the innermost: a Remat's layer, a Shared's model)
    nodes: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)


SPECTRAL_FORMS_MIXED = """\
ft.nn.load_torch_state_dict: the Stack of SpectralNorm at {path!r} reads members in both of \
torch's spectral norm forms: {legacy} in the deprecated torch.nn.utils.spectral_norm's \
(weight_orig, weight_u, weight_v), {current} in torch.nn.utils.parametrizations.spectral_norm's \
(parametrizations.weight.original, ...). Their power iterations train to other numbers, and a \
Stack's members share one form (SpectralNorm's static legacy=). Hold the members apart:

    wrong:  ft.nn.Stack.from_layers(blocks)
    right:  ft.nn.Sequential(*blocks)     # each SpectralNorm takes the form its tensors are in"""

ADAPTED_LAYER = """\
{what}: {path} is an adapted layer ({kind}); a torch or Hugging Face state dict holds plain \
weights, and its base weight alone would drop the adapters (a silently different model).
Merge the adapters into the weights first (or save the adapters alone in their own format):

    wrong:  {what}(model{rest})
    right:  {what}({merge}{rest})
       or:  ft.nn.save_lora(model, "adapter/")      # PEFT's adapter files
"""


def _refuse_adapters(model: Any, what: str, rest: str = "") -> None:
    """An error naming the first adapted layer (``ft.nn.lora``'s ``LoraDense``) in ``model``."""
    def adapted(x: Any) -> bool:
        return getattr(type(x), "__ft_adapter__", None) is not None

    for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=adapted)[0]:
        if adapted(node):
            raise ValueError(ADAPTED_LAYER.format(what=what, path=dotted_name(path) or "the model",
                                                  kind=type(node).__name__, merge=type(node).__ft_adapter__,
                                                  rest=rest))


def _plan(model: Any, flattened: Mapping[str, tuple[int, ...] | None], layouts: Mapping[str, Any] | None = None,
          *, values: bool = True, ports: bool = True, complete: Collection[str] | None = None) -> _Plan:
    """Every rule of the model, in full names; each parameter (member) is covered by exactly one.

    Stacks are walked member by member (torch's ``h.0``, ``h.1``, ...), a Shared's tied
    places under each of their names, Sequential's ``layers``, Remat's ``layer`` and
    Shared's ``model`` left out of torch's names. ``values=False`` plans on zero-stride
    placeholders of the leaves' shapes and dtypes (loading needs no copy of the model).
    A port (:mod:`functree.interop._ports`: a Hugging Face model) is recorded whole, not
    walked into (``ports=False``: walked as any model, its converter's own plan).
    ``complete``: the given torch names (model-side), every member of each Stack required:
    a Stack longer than the members they hold raises :class:`ShortStack` before its members
    are walked (a config claiming 10**7 layers beside a 2-layer file never answered).
    """
    if not values:
        _refuse_adapters(model, "ft.nn.load_torch_state_dict", ", state_dict")
    else:  # a port's own converter (ports=False) is to_hf_state_dict
        _refuse_adapters(model, "ft.nn.torch_state_dict" if ports else "ft.nn.to_hf_state_dict")
    plan = _Plan([], {}, [])
    options = Options(flattened, layouts or {})
    derived: list[str] = []

    def tied(name: str) -> bool:
        return any(name == d or name.startswith(d + ".") for d in derived)

    def add(local: list[Local], node: Any, ft: str, stored: str | None, index: tuple[int, ...], torch: str) -> None:
        for t, f, a, b in local:
            names = tuple(join_names(ft, n) for n in f)
            for n, full in zip(f, names):
                where = None if stored is None or tied(full) else join_names(stored, n)
                value = _get(node, n) if n else node
                plan.leaves[full] = _Leaf(where, index, value if isinstance(value, _Abstract) else np.asarray(value))
            plan.rules.append(_Rule(tuple(join_names(torch, n) for n in t), names, a, b))

    def walk(node: Any, ft: str, stored: str | None, index: tuple[int, ...], torch: str) -> None:
        _record(plan, node, ft, torch)
        port = port_of(node) if ports else None
        if port is not None:  # named by its own converter: Hugging Face's names under its torch prefix
            check_placement(ft, index, port)
            return plan.ports.append(Found(ft, torch, node, port))
        local = layer_rules(node, ft, torch, options)
        if local is not None:
            plan.layers.setdefault(torch, node)  # an option it lacks, named by a mismatch's error
            add(local, node, ft, stored, index, torch)
            return uncovered({n for _, f, _, _ in local for n in f}, node, ft, stored, index, torch)
        if is_stacked(node):
            ((field_name, _),) = _children(node)
            if complete is not None:
                _check_members(complete, ft, torch, len(node))
            for i in range(len(node)):
                plan.stacks[join_names(torch, str(i))] = (torch, len(node))
                walk(node._member(i), join_names(ft, str(i)), _under(stored, field_name), (*index, i), join_names(torch, str(i)))
            return
        if isinstance(node, Shared):
            resolved, base = node.resolve(), join_names(ft, "model")
            for target, source, transform in node.ties:
                derived.append(join_names(base, target.name))
                plan.ties.append(_Tie(join_names(base, target.name), join_names(base, source.name), transform, source.get(resolved)))
            return walk(resolved, base, _under(stored, "model"), index, torch)
        children = _children(node)
        if isinstance(node, Sequential) or any(isinstance(child, Flatten) for _, child in children):
            _check_flattened(_steps(node), ft, torch, options, loading=not values)
        elif isinstance(node, Module) and len(children) > 1:  # fields in order, a __call__ of its own
            _check_unflattened(_steps(node), ft, torch, options, loading=not values)
        if not children and jax.tree.leaves(node):  # a leaf outside known layers: its name, as is
            return add([same("", "")], node, ft, stored, index, torch)
        for name, child in children:
            hidden = isinstance(node, (Sequential, Remat)) and name in ("layers", "layer")
            walk(child, join_names(ft, name), _under(stored, name), index, torch if hidden else join_names(torch, name))

    def uncovered(covered: set[str], node: Any, ft: str, stored: str | None, index: tuple[int, ...], torch: str) -> None:
        """A user's layer subclass's own leaves (``class MyDense(Dense)`` adding a trained
        ``scale``; also a user's cell inside an RNN): the rule covers the base's (``covered``,
        local names); each child it leaves out is walked (its own name, its own rules), so
        none is dropped. functree's own layers' other leaves are no weights (a port's dropout
        key): skipped."""
        for name, child in _children(node):
            inside = {n[len(name) + 1:] for n in covered if n.startswith(name + ".")}
            if name in covered:
                continue
            if inside:  # a layer the rule reaches into (an RNN's cell): its leaves the rule leaves out
                uncovered(inside, child, join_names(ft, name), _under(stored, name), index, join_names(torch, name))
            elif not _declared_in_functree(type(node), name):
                walk(child, join_names(ft, name), _under(stored, name), index, join_names(torch, name))

    # host_array: a leaf spread over several processes' devices is gathered (a collective)
    walk(jax.tree.map(host_array if values else _placeholder, model), "", "", (), "")
    unknown = [name for name in options.flattened if not any(name in pair for pair in options.dense)]
    if unknown:
        names = [t for t, _ in options.dense]
        raise ValueError(FLATTENED_UNKNOWN.format(names=unknown, dense=names, first=names[0] if names else "fc"))
    unused = [pattern for pattern in options.layouts if pattern not in options.used]
    if unused:
        names = [t for t, _ in options.layered][:8]
        raise unused_layouts(unused, plan.ports) or ValueError(LAYOUT_UNUSED.format(
            patterns=unused, names=names, pattern=unused[0], first=names[0] if names else "h.*.attn"))
    plan.attentions = options.attentions
    return plan


def _record(plan: _Plan, node: Any, ft: str, torch: str) -> None:
    """``node`` by its torch name, a module's options compared with a torch module's
    (:mod:`functree.interop._options`); the innermost of a name (a Remat's layer) last."""
    if isinstance(node, Module):
        plan.nodes[torch] = (ft, node)


def _check_flattened(steps: list[tuple[str, str, Any]], ft: str, torch: str, options: Options, *,
                     loading: bool) -> None:
    """Raise where ``Flatten`` of a ``Conv``'s maps of more than one position (pooling,
    normalization, activations between) feeds a layer whose arrays are per flattened
    feature (layers without arrays between: activations, ``Dropout``): torch's features are
    ``[C, *S]``, ft's ``[*S, C]``, a permutation only the maps' shape decides. A ``Dense``
    that ``flattened=`` does not name: :data:`FLATTENED_UNNAMED`; another layer (a
    ``BatchNorm`` over the flattened features): :data:`FLATTENED_NOT_DENSE`.

    ``steps``: the layers in the order they apply, ``(torch name, key path, layer)`` under
    ``torch`` / ``ft``: a ``Sequential``'s, or the fields of a model that holds a ``Flatten``
    (in field order). The ``Conv`` and the ``Dense`` are found inside any block (a user's
    module holding a ``Conv``: its last ``Conv`` or ``Dense`` in field order)."""
    layers = [layer for _, _, layer in steps]
    for i, flatten in enumerate(layers):
        if not isinstance(flatten, Flatten):
            continue
        found = next(((j, last) for j in range(i - 1, -1, -1) for last in [_last_weighted(layers[j])]
                      if last is not None), None)
        after = next((k for k in range(i + 1, len(layers)) if jax.tree.leaves(layers[k])), None)
        if found is None or after is None:
            continue
        j, (inner, conv) = found
        first = _first_weighted(layers[after])
        if not isinstance(conv, Conv) or first is None:
            continue
        torch_inner, ft_inner, layer = first
        channels = int(conv.out_channels)
        inputs = (int(layer.weight.shape[0]) if isinstance(layer, Dense)
                  else max(int(np.prod(np.shape(a))) for a in jax.tree.leaves(layer)))
        name = join_names(torch, join_names(steps[after][0], torch_inner))
        path = join_names(ft, join_names(steps[after][1], ft_inner))
        if inputs <= channels or inputs % channels or name in options.flattened or path in options.flattened:
            continue
        spatial = "length" if conv._rank == 1 else "height, width"
        fields = dict(name=name, ft=path, channels=channels, conv=join_names(torch, join_names(steps[j][0], inner)),
                      inputs=inputs, spatial=spatial, size=inputs // channels, kind=type(layer).__name__,
                      fn="load_torch_state_dict" if loading else "torch_state_dict",
                      rest=", state_dict" if loading else "")
        raise ValueError((FLATTENED_UNNAMED if isinstance(layer, Dense) else FLATTENED_NOT_DENSE).format(**fields))


def _check_unflattened(steps: list[tuple[str, str, Any]], ft: str, torch: str, options: Options, *,
                       loading: bool) -> None:
    """Raise (:data:`FLATTENED_UNSEEN`) where a model without an ``ft.nn.Flatten`` holds, in
    field order, a ``Conv`` and then a ``Dense`` whose inputs are a multiple (> 1) of the
    Conv's channels: its ``__call__`` most likely flattens the maps by hand (torchvision's
    VGG, AlexNet), and torch's rows are then ``[C, *S]`` where ft's are ``[*S, C]``. Another
    layout (two pooled branches joined) says so with ``flattened={name: None}``. Field order
    need not be the call's, so a Dense is checked alike against the nearest Conv before it
    (else the first after it) where the weighted field before it cannot feed it: none
    precedes it (``fc`` declared before ``features``), or a Dense whose outputs are not its
    inputs does (``out`` declared before ``fc``, called after it)."""
    weighted = [(k, *found) for k, (_, _, layer) in enumerate(steps) for found in [_last_weighted(layer)]
                if found is not None]
    for k, (_, _, layer) in enumerate(steps):
        first = _first_weighted(layer)
        if first is None or not isinstance(first[2], Dense):
            continue
        before = [w for w in weighted if w[0] < k]
        if before and isinstance(before[-1][2], Conv):  # in field order, right after the Conv
            _refuse_unseen(steps, k, first, before[-1], ft, torch, options, loading=loading, where="before it")
            continue
        conv = next((w for w in reversed(before) if isinstance(w[2], Conv)), None)
        conv = conv or next((w for w in weighted if w[0] > k and isinstance(w[2], Conv)), None)
        inputs = _features(first[2], 0)
        if conv is None or inputs is None or (before and _features(before[-1][2], -1) in (inputs, None)):
            continue  # no Conv here; a partial model's Dense; or the Dense before it feeds it: in call order
        # No weighted field precedes it, or a Dense that cannot feed it: fields out of call
        # order (or inputs joined), so it may be the one applied to a Conv's flattened maps.
        _refuse_unseen(steps, k, first, conv, ft, torch, options, loading=loading,
                       where=_out_of_order(steps, torch, conv[0] < k, before[-1] if before else None, inputs))


def _features(layer: Any, axis: int) -> int | None:
    """A ``Dense``'s inputs (``axis`` 0) or a ``Dense``'s or ``Conv``'s outputs (-1); None
    without a weight (a partial model's, ``to_hf_state_dict`` of a ``jax.tree.map`` that
    dropped leaves)."""
    shape = getattr(layer.weight, "shape", None)
    if shape is not None and axis == -1 and isinstance(layer, Conv):
        return int(layer.out_channels)  # a grouped transpose's weight holds out // groups
    return None if shape is None else int(shape[axis])


def _out_of_order(steps: list[tuple[str, str, Any]], torch: str, conv_before: bool, previous: Any,
                  inputs: int) -> str:
    """Where :data:`FLATTENED_UNSEEN`'s Conv is for a Dense that field order does not put
    right after it, with the Dense before it (``previous``) that cannot feed it."""
    order = "before" if conv_before else "after"
    if previous is None:
        return f"{order} it in field order (which need not be the call's)"
    j, inner, dense = previous
    name, outputs = join_names(torch, join_names(steps[j][0], inner)), int(dense.weight.shape[-1])
    return (f"{order} it in field order (which need not be the call's: the Dense {name} "
            f"{'between them' if conv_before else 'before it'} gives {outputs} outputs, not its {inputs} inputs)")


def _refuse_unseen(steps: list[tuple[str, str, Any]], k: int, first: tuple[str, str, Any],
                   last: tuple[int, str, Any], ft: str, torch: str, options: Options, *, loading: bool,
                   where: str) -> None:
    """Raise :data:`FLATTENED_UNSEEN` for the Dense ``first`` (of step ``k``) after the Conv
    ``last`` where its inputs are a multiple (> 1) of the Conv's channels and neither of its
    names is in ``flattened=``."""
    j, inner, conv = last
    torch_inner, ft_inner, dense = first
    channels, inputs = _features(conv, -1), _features(dense, 0)
    if channels is None or inputs is None:  # a partial model's layer: no rows to permute
        return
    name = join_names(torch, join_names(steps[k][0], torch_inner))
    path = join_names(ft, join_names(steps[k][1], ft_inner))
    if inputs > channels and not inputs % channels and name not in options.flattened \
            and path not in options.flattened:
        spatial = "length" if conv._rank == 1 else "height, width"
        raise ValueError(FLATTENED_UNSEEN.format(
            name=name, ft=path, channels=channels, conv=join_names(torch, join_names(steps[j][0], inner)),
            where=where, inputs=inputs, spatial=spatial, size=inputs // channels,
            fn="load_torch_state_dict" if loading else "torch_state_dict", rest=", state_dict" if loading else ""))


def _steps(node: Any) -> list[tuple[str, str, Any]]:
    """The parts of ``node`` in the order they (presumably) apply, ``(torch name, key path,
    part)``: a ``Sequential``'s layers; a ``Stack``'s first and last members; a ``Remat``'s
    or ``Shared``'s model (no torch name of its own); another node's children in field order."""
    if isinstance(node, Sequential):
        return [(str(k), f"layers.{k}", layer) for k, layer in enumerate(node.layers)]
    if is_stacked(node):
        return [(str(i), str(i), node._member(i)) for i in sorted({0, len(node) - 1})] if len(node) else []
    if isinstance(node, Remat):
        return [("", "layer", node.layer)]
    if isinstance(node, Shared):
        return [("", "model", node.resolve())]
    return [(name, name, child) for name, child in _children(node)]


def _first_weighted(layer: Any) -> tuple[str, str, Any] | None:
    """The first layer with arrays ``layer`` applies, when it is a ``Dense`` or a per-feature
    normalization (itself, or inside a block), with its torch name and key path under
    ``layer``'s; None for another."""
    if isinstance(layer, (Dense, BatchNorm, LayerNorm, RMSNorm, GroupNorm)):
        return "", "", layer
    if isinstance(layer, (Conv, Flatten)) or not jax.tree.leaves(layer):
        return None
    step = next(((t, f, inner) for t, f, inner in _steps(layer) if jax.tree.leaves(inner)), None)
    found = None if step is None or step[2] is layer else _first_weighted(step[2])
    if step is None or found is None:
        return None
    return join_names(step[0], found[0]), join_names(step[1], found[1]), found[2]


def _last_weighted(layer: Any) -> tuple[str, Conv | Dense] | None:
    """The last ``Conv`` or ``Dense`` ``layer`` applies (itself, or inside a block: a
    ``Sequential``'s last, a user's module's last in field order), with its torch name under
    ``layer``'s; None for a layer holding neither."""
    if isinstance(layer, (Conv, Dense)):
        return "", layer
    if isinstance(layer, Flatten) or not jax.tree.leaves(layer):
        return None
    for t, _, inner in reversed(_steps(layer)):
        found = None if inner is layer else _last_weighted(inner)
        if found is not None:
            return join_names(t, found[0]), found[1]
    return None


class ShortStack(ValueError):
    """A Stack of ``length`` members at ``ft`` (torch's ``torch.0`` ...) whose given tensors
    end at member ``held - 1``: the state dict describes a model of fewer members."""

    def __init__(self, ft: str, torch: str, length: int, held: list[int]):
        self.ft, self.torch, self.length, self.held = ft, torch, length, held
        super().__init__(f"{ft}: a Stack of {length} members; the state dict holds {torch}.* members {held[:8]}")


def _check_members(given: Collection[str], ft: str, torch: str, length: int) -> None:
    """Raise :class:`ShortStack` where the ``given`` names hold none of the Stack's last
    members (``torch.{i}.*`` up to some ``i < length - 1``): looked up in the given names
    alone, never by walking the ``length`` members."""
    start = f"{torch}." if torch else ""
    held = sorted({int(number) for name in given if name.startswith(start)
                   for number in [name[len(start):].split(".", 1)[0]] if number.isdigit()})
    if max(held, default=-1) + 1 < length:
        raise ShortStack(ft, torch, length, held)


def _declared_in_functree(cls: type, name: str) -> bool:
    """Whether field ``name`` of ``cls`` is declared by one of functree's classes (not a user's)."""
    owner = next((c for c in cls.__mro__ if name in vars(c).get("__annotations__", {})), cls)
    return owner.__module__.startswith("functree.")


def _placeholder(leaf: Any) -> Any:
    """Zeros of ``leaf``'s shape and dtype that take no memory (a broadcast view); an
    :class:`_Abstract` where NumPy cannot describe the shape (2**63 elements or more: a
    config's absurd sizes, refused later by the shape check, not here by NumPy)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        try:
            return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
        except ValueError:  # "iterator is too large"
            return _Abstract(tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype))
    return np.asarray(leaf)


@dataclasses.dataclass(frozen=True)
class _Abstract:
    """An array leaf's shape and dtype alone, for a plan that only compares shapes; a Stack
    takes its members by index (``[i]``: one member's shape)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: int) -> _Abstract:
        return _Abstract(self.shape[1:], self.dtype)


def _torch_shapes(rule: _Rule, leaves: Sequence[Any]) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``rule.to_torch(*leaves)`` without computing it (``leaves``: arrays or
    placeholders; only their shapes are read): concatenating a fused
    projection's zero-stride placeholders built the whole tensor (48 GiB for a config.json
    claiming n_embd=65536 beside a 30 KB file) before any shape was compared."""
    return _traced_shapes(rule.to_torch, tuple(tuple(int(d) for d in np.shape(v)) for v in leaves))


# Traced once per conversion function and signature: the rule factories of interop._layouts
# are memoized, so a Stack's members share one entry.
@functools.lru_cache(maxsize=4096)
def _traced_shapes(to_torch: Callable[..., Any], shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    # traced in float32 whatever the dtypes: a relayout's shapes do not depend on them, and
    # JAX holds no NumPy object or string array (nor float64 without x64)
    structs = [jax.ShapeDtypeStruct(shape, np.float32) for shape in shapes]
    return tuple(tuple(out.shape) for out in jax.eval_shape(to_torch, *structs))


def _shapes(flattened: Mapping[str, Sequence[int] | None] | None) -> dict[str, tuple[int, ...] | None]:
    """``flattened=`` as tuples of ints; None (torch flattened channels-last maps) kept."""
    return {k: None if v is None else tuple(int(d) for d in v) for k, v in (flattened or {}).items()}


def _renamer(rename: Rename, to_model: bool) -> Callable[[str], str]:
    """Torch names → the model's (``to_model``) or back.

    A mapping renames prefixes (whole dotted parts), the longest first, one rename per
    name; ``*`` in a prefix matches one name part (``h.*``: ``h.0``) and each ``*`` of the
    other side takes what it matched, in order (``_naming``'s rename patterns).
    """
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    for old, new in rename.items():
        if old.count("*") != new.count("*"):
            raise ValueError(RENAME_STARS.format(old=old, new=new))
    pairs = [(t, m) if to_model else (m, t) for t, m in rename.items()]
    pairs.sort(key=lambda pair: -len(pair[0]))
    compiled = [(rename_pattern(old), new) for old, new in pairs if old]
    strip = next((new for old, new in pairs if not old), None)

    def renamed(name: str) -> str:
        for pattern, new in compiled:
            found = pattern(name)
            if found is not None:
                return join_names(fill_stars(new, found[0]), found[1])
        return name if strip is None else join_names(strip, name)

    return renamed


def load_torch_state_dict(
    model: Any,
    state_dict: Mapping[str, Any] | str | os.PathLike[str],
    *,
    strict: bool = True,
    rename: Rename = None,
    flattened: Mapping[str, Sequence[int] | None] | None = None,
    layouts: Mapping[str, Any] | None = None,
) -> Any:
    """``model`` with a torch ``state_dict``'s tensors in it, renamed and re-laid-out.

    Each known layer (module docstring) takes its torch tensors converted to its own
    layout; any other array leaf takes the tensor of its name as it is. Values are cast
    to the model's floating dtypes and every shape is checked. ``strict=True`` raises one
    error listing missing, unexpected and mis-shaped torch names, and naming where it can the
    torch option behind them: a layer's bias, affine or running statistics its ``ft.nn``
    layer was built without (or with: the option that leaves them out), an LSTM's
    ``proj_size``, ``MultiheadAttention(add_bias_kv=True)`` (no port), a weight stored as a
    parametrization (``weight_norm``: ``weight_g``, ``parametrizations.weight.original0``) and
    a wrapper's prefix (DataParallel's ``module.``); ``strict=False`` keeps
    the model's value wherever the state dict does not fit and returns ``(model, report)``
    (an ``ft.FlatDictReport`` in torch's names). ``num_batches_tracked`` is read into a
    ``momentum=None`` BatchNorm's ``batches_tracked`` (its cumulative average weighs batch
    ``n`` by ``1/n``) and dropped for any other layer (an exponential average reads no count). A
    ``WeightNorm`` / ``SpectralNorm`` also reads the deprecated ``torch.nn.utils.weight_norm`` /
    ``spectral_norm``'s names (``weight_g``, ``weight_v``; ``weight_orig``, ``weight_u``, ``weight_v``);
    a ``SpectralNorm`` comes back with ``legacy=`` the form read (the deprecated one's power
    iteration trains to other numbers), and ``torch_state_dict`` writes that form's names.
    ``state_dict`` may be the path of a ``.safetensors`` file, of a sharded checkpoint's
    ``model.safetensors.index.json`` or of a directory holding either (read without torch,
    one tensor at a time from memory maps).

    ``state_dict`` may also be the torch ``nn.Module`` itself: its ``state_dict()`` is loaded
    as above, and the options no tensor holds are compared for every ``ft.nn`` layer at the
    torch name of one of its submodules (a user's own module is walked through; a
    ``from_hf`` port inside reads its tensors as always): a ``TransformerEncoderLayer``'s
    ``norm_first``, activation, ``nhead``, ``layer_norm_eps``, ``batch_first`` and ``dropout``;
    a convolution's ``stride``, ``padding`` (a transpose's with ``output_padding``),
    ``dilation``, ``groups`` and ``padding_mode``; the norms' ``eps``, ``num_groups``,
    ``normalized_shape`` and a ``BatchNorm``'s or tracking ``InstanceNorm``'s ``momentum``
    (and torch's unbiased running variance); ``Embedding(Bag)``'s ``padding_idx``, ``mode``,
    ``include_last_offset``; an RNN's ``batch_first``, ``nonlinearity`` and ``dropout``; an
    attention's ``num_heads`` and ``dropout``; pools' windows, ``Dropout``'s ``p``, and an
    activation module against the function at its place in a ``Sequential`` (checked on sample
    values: ``nn.GELU()`` is ``ft.nn.gelu_exact``). Any difference is refused, ``strict=False``
    too, by one error (:data:`~functree.interop._options.OPTIONS_DIFFER`) that lists each by
    torch name and key path with the argument that gives torch's; options no ``ft.nn`` layer
    has (``max_norm``, ``scale_grad_by_freq``, ``add_zero_attn``, a sequence-first standalone
    ``MultiheadAttention``) are named alike. ``module.state_dict()`` loads the tensors alone.

    Structural layers nest freely: a ``Stack``'s members are torch's ``h.0``, ``h.1``, ...
    (each converted as its layer is); ``Sequential``'s ``layers``, ``Remat``'s ``layer``
    and ``Shared``'s ``model`` are not part of torch's names. A ``Shared`` tie answers to
    both its names, as torch's tied ``state_dict()`` writes them: given both, they must be
    equal (after the tie's transform); given one, it fills the tie.

    ``rename`` maps torch name prefixes onto the model's, ``{"backbone.features":
    "encoder"}`` (longest first; ``{"module": ""}`` strips DataParallel's prefix; ``*``
    matches one name part, ``{"transformer.h.*.ln_1": "blocks.*.norm"}``; one rename per name), or is a function of the
    torch name (rename patterns of ``functree._naming``). ``layouts`` maps name patterns
    (ft's globs on the model's torch names or key paths: a pattern picks a layer whose
    name or a dotted prefix of it it matches) to other torch layouts: ``"conv1d"`` for Hugging Face's ``Conv1D``
    (``Dense`` weight stored ``[in, out]``; a ``MultiheadAttention`` as GPT-2's fused
    ``c_attn`` and ``c_proj``), or four names for a ``MultiheadAttention`` held as
    separate ``Linear`` layers, ``("q_proj", "k_proj", "v_proj", "o_proj")``; two names for one
    ``Linear`` whose rows are ``[q | k | v]`` and the output ``Linear``, ``("qkv_proj", "o_proj")``
    (Phi-3); ``("query_key_value", "dense", "per_head")`` for rows holding each head's query, key
    and value in turn (GPT-NeoX).
    ``flattened={"classifier.0": (C, H, W)}`` names Dense layers fed by torch's ``Flatten``
    of ``[C, H, W]`` feature maps: their weight rows are permuted to ft's channels-last
    ``[H, W, C]`` order. A ``Dense`` after ``Flatten`` of a ``Conv``'s maps in a ``Sequential``
    (or fields of a model, in field order; the ``Conv`` inside any block before it)
    must be named (:data:`FLATTENED_UNNAMED`; ``None``: torch's rows are channels-last too).
    A model without an ``ft.nn.Flatten`` whose fields hold a ``Conv`` and then a ``Dense`` of a
    multiple (> 1) of its channels (a ``__call__`` that flattens by hand) is refused too
    (:data:`FLATTENED_UNSEEN`), and so is one the field before it cannot feed (nothing, or a
    ``Dense`` of other outputs: fields in another order than the call's) with a ``Conv`` in
    another field.

    A model of :func:`ft.nn.from_hf`, at the root or held anywhere inside the model
    (``Classifier(bert=ft.nn.from_hf(...), head=Dense)``), reads Hugging Face's names under
    its torch name (``bert.encoder.layer.0.attention.self.query.weight``), as torch's
    ``state_dict()`` of the torch model holding the HF model writes them, and as ``from_hf``
    reads them: its family's layouts (``layouts=`` does not reach inside it), older checkpoint
    names, a tied head's copy of the embedding taken when equal to it and refused when not.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> model = ft.nn.Sequential(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.nn.LayerNorm(2))
      >>> state = {"0.weight": np.ones((2, 3), np.float32), "0.bias": np.zeros(2, np.float32),
      ...          "1.weight": np.full(2, 2.0, np.float32), "1.bias": np.zeros(2, np.float32)}
      >>> model = ft.nn.load_torch_state_dict(model, state)
      >>> model.layers[0].weight.shape, model.layers[1].scale
      ((3, 2), Array([2., 2.], dtype=float32))
      >>> _, report = ft.nn.load_torch_state_dict(model, {"0.weight": np.ones((2, 3))}, strict=False)
      >>> report.missing
      ('0.bias', '1.weight', '1.bias')
      >>> import torch
      >>> norm = torch.nn.LayerNorm(2, eps=1e-6)
      >>> ft.nn.load_torch_state_dict(ft.nn.LayerNorm(2, 1e-6), norm).epsilon     # the module: options compared too
      1e-06
      >>> ft.nn.load_torch_state_dict(ft.nn.LayerNorm(2), norm)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: ft.nn.load_torch_state_dict: the torch module's options that no tensor holds differ ...
        (the module) (LayerNorm; ft: (the model), LayerNorm): torch's eps=1e-06, the model's epsilon=1e-05
      Build each layer with the argument shown:
          right:  ft.nn.LayerNorm(..., epsilon=1e-06)   # at (the model)
             or:  ft.nn.load_torch_state_dict(model, module.state_dict())   # the tensors alone, options unchecked
    """
    module = torch_module(state_dict)
    return load_by_rules(model, state_dict if module is None else module.state_dict(), strict=strict, rename=rename,
                         flattened=flattened, layouts=layouts, ports=True, module=module)


def load_by_rules(model: Any, state_dict: Mapping[str, Any] | str | os.PathLike[str], *, strict: bool = True,
                  rename: Rename = None, flattened: Mapping[str, Sequence[int] | None] | None = None,
                  layouts: Mapping[str, Any] | None = None, ports: bool = False, given_names: bool = False,
                  complete: bool = False, module: Any = None) -> Any:
    """:func:`load_torch_state_dict`; ``ports=False`` (a port's own converter: ``from_hf``)
    reads every layer by the rules above, a port's root included. ``given_names``: the
    report names tensors as the state dict does (a port's: Hugging Face's names), not as
    ``rename=`` maps them onto the model. ``complete``: every Stack member is required
    (:class:`ShortStack` where the state dict ends before a Stack does). ``module``: the torch
    module the state dict is of, whose options the model's layers must have
    (:func:`~functree.interop._options.check_options`)."""
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = load_checkpoint(read_path(state_dict, "ft.nn.load_torch_state_dict"))  # "~/m.safetensors": the home's
    else:  # a checkpoint's tensors are read lazily, and never meta
        _check_given(state_dict)
    shapes = _shapes(flattened)
    to_model = _renamer(rename, to_model=True)
    given = _renamed(state_dict, to_model)
    model = _spectral_forms(model, given, shapes, layouts, ports)
    counts = {k for k in given if k.rsplit(".", 1)[-1] == "num_batches_tracked"}
    plan = _plan(model, shapes, layouts, values=False, ports=ports, complete=set(given) - counts if complete else None)
    read = {n for rule in plan.rules for n in rule.torch}  # a momentum=None BatchNorm's count; the others dropped
    given = {k: v for k, v in given.items() if k not in counts or k in read}
    given = _legacy_parametrizations(plan.rules, given)
    if module is not None:  # strict=False too: the report lists tensors, and every one may load into other numbers
        check_options(module, plan.nodes, to_model, [found.torch for found in plan.ports])
    loaded, ported, taken = load_ports(model, plan.ports, given) if plan.ports else ({}, FlatDictReport(), set())
    given = {k: v for k, v in given.items() if k not in taken}
    values, absent, mismatched = _converted(plan, given)
    _fill_ties(plan, values)
    missing = [n for rule, names in absent if not all(f in values for f in rule.ft) for n in names]
    template = to_flat_dict(model)
    flat, wrong_dtypes = _stored(plan, values, template)
    tree, fitted = from_flat_dict(model, flat, strict=False, cast=True)
    tree = replaced(tree, loaded)
    if any(any(n in values for n in _under_name(plan, tie.target)) for tie in plan.ties):
        _check_ties(plan, _plan(tree, shapes, layouts, ports=ports), values)
    claimed = {n for rule in plan.rules for n in rule.torch}
    # each one-to-one rule's torch name, by the leaf's key path (a Stack member's own) and by its stored leaf
    members: dict[str, str] = {r.ft[0]: r.torch[0] for r in plan.rules if len(r.ft) == len(r.torch) == 1}
    torch_names = {stored: name for leaf, name in members.items()
                   for stored in [plan.leaves[leaf].stored] if stored is not None}
    refused = tuple(_in_torch_layout(torch_names.get(str(n), str(n)), str(want), str(got), given)
                    for n, want, got in fitted.mismatched)
    ranged = {torch_names.get(str(n), str(n)): template[str(n)].dtype
              for kind, names in fitted.hinted if kind == "range" for n in names}
    ranged |= {members.get(n, n): dtype for n, _, _, dtype in wrong_dtypes if _floating(dtype)}
    # int64 past int32's range: (torch name, the leaf's dtype, its stored leaf), plain leaves' then Stack members'
    wraps = [(torch_names.get(n, n), template[n].dtype, n) for kind, names in fitted.hinted if kind == "wraps"
             for n in map(str, names)]
    wraps += [(members.get(n, n), dtype, str(plan.leaves[n].stored)) for n, _, _, dtype in wrong_dtypes
              if dtype is not None and not _floating(dtype)]
    wrapped = {name: dtype for name, dtype, _ in wraps}
    # another kind (an int64 tensor for a float leaf): plain leaves' where from_flat_dict hints, then Stack members'
    cast = [n for n, _, _ in refused if n not in ranged and n not in wrapped] if fitted.hints else []
    cast += [members.get(n, n) for n, _, _, dtype in wrong_dtypes if dtype is None]
    wrong_dtypes = [(members.get(n, n), want, got) for n, want, got, _ in wrong_dtypes]
    hints = ((TORCH_CAST_HINT.format(names=", ".join(cast)),) if cast else ()) + (
        (range_hint(TORCH_FLOAT_RANGE_HINT, dict(sorted(ranged.items()))),) if ranged else ()) + (
        (int_range_hint(TORCH_INT_RANGE_HINT, wrapped, wraps[0][2]),) if wraps else ())
    report = merged(ported, FlatDictReport(
        tuple(missing), tuple(k for k in given if k not in claimed), (*mismatched, *wrong_dtypes, *refused), hints,
    ))
    if given_names:
        report = _as_given(report, state_dict, rename)
    if strict and not report.ok:
        # layers' options are named for a model of ft.nn layers, not a port's own (from_hf: its config builds them)
        raise mismatch_error(plan.rules, plan.attentions, report, recurrent_hint(report, given) + hint(plan.ports),
                             plan.layers if ports else {}, _stacked_names(plan) if ports else {})
    return tree if strict else (tree, report)


def _stacked_names(plan: _Plan) -> dict[str, tuple[str, int, str]]:
    """Each Stack member's one-to-one torch name (``h.1.weight``): its innermost Stack's torch
    name, member count and stacked leaf (``h.layers.weight``), for a mismatch's fix: a member
    is built by its Stack, never alone."""
    out: dict[str, tuple[str, int, str]] = {}
    for rule in plan.rules:
        leaf = plan.leaves[rule.ft[0]]
        if len(rule.ft) == len(rule.torch) == 1 and leaf.index and leaf.stored is not None:
            member = max((m for m in plan.stacks if rule.torch[0].startswith(m + ".")), key=len, default=None)
            if member is not None:
                out[rule.torch[0]] = (*plan.stacks[member], leaf.stored)
    return out


def _in_torch_layout(name: str, want: str, got: str, given: Mapping[str, Any]) -> tuple[str, str, str]:
    """A dtype refusal (``shape (4, 3) dtype float32``, in ft's layout: the shapes agreed) under
    torch's name with the shape of the tensor given (``(3, 4)``, a ``Linear``'s weight), not its
    transpose."""
    if name not in given:
        return name, want, got
    shape = f"shape {_shape(name, given[name])}"
    return name, re.sub(r"^shape \([^)]*\)", shape, want), re.sub(r"^shape \([^)]*\)", shape, got)


def _renamed(state_dict: Mapping[str, Any], to_model: Callable[[str], str]) -> dict[str, Any]:
    """``state_dict`` under the model's names; two tensors renamed to one name must hold the
    same values (a tie's two copies, either read), else :data:`RENAMED_TOGETHER` (a dict would
    keep the last silently, neither loaded nor reported)."""
    given: dict[str, Any] = {}
    first: dict[str, str] = {}
    for k, v in state_dict.items():
        name = to_model(k)
        if name in given:
            a, b = _array(first[name], given[name]), _array(k, v)
            why = (f"shape {list(a.shape)} against {list(b.shape)}" if a.shape != b.shape
                   else f"dtype {a.dtype} against {b.dtype}" if a.dtype != b.dtype
                   else "in their values" if a.tobytes() != b.tobytes() else None)
            if why is not None:
                raise ValueError(RENAMED_TOGETHER.format(first=first[name], second=k, name=name, why=why))
            continue
        given[name], first[name] = v, k
    return given


_PARAMETRIZED_NAME = re.compile(r"(?P<prefix>(?:.*\.)?)parametrizations\.(?P<w>\w+)\.(?P<part>original[01]?|0\._[uv])")
# torch >= 2.1's parametrization tensors -> the deprecated torch.nn.utils.weight_norm /
# spectral_norm's names of the same tensor (the same layout: g is [out, 1, ...] in both)
_LEGACY_PART = {"original0": "{w}_g", "original1": "{w}_v", "original": "{w}_orig", "0._u": "{w}_u", "0._v": "{w}_v"}


def _legacy_parametrizations(rules: Sequence[Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the deprecated ``torch.nn.utils.weight_norm`` / ``spectral_norm``'s
    tensors (``weight_g``, ``weight_v``; ``weight_orig``, ``weight_u``, ``weight_v``: older
    checkpoints, HiFi-GAN's and wav2vec 2's among them) under the names a ``WeightNorm`` or
    ``SpectralNorm`` reads (``parametrizations.weight.original0`` ...), where those are absent:
    which parametrization ``weight_v`` belongs to is the model's layer's."""
    renamed: dict[str, str] = {}
    for rule in rules:
        for name in rule.torch:
            found = _PARAMETRIZED_NAME.fullmatch(name) if "parametrizations." in name else None
            if found is None or name in given:
                continue
            legacy = found["prefix"] + _LEGACY_PART[found["part"]].format(w=found["w"])
            if legacy in given:
                renamed[legacy] = name
    if not renamed:
        return given
    return {renamed.get(k, k): v for k, v in given.items()}


# a spectral norm's weight under each of torch's forms: SpectralNorm.legacy for it
_SPECTRAL_WEIGHT = {"weight_orig": True, "parametrizations.weight.original": False}


def _spectral_forms(model: Any, given: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...] | None],
                    layouts: Mapping[str, Any] | None, ports: bool) -> Any:
    """``model`` with each ``SpectralNorm``'s ``legacy`` the form ``given`` holds under its torch
    name: the deprecated ``torch.nn.utils.spectral_norm``'s ``weight_orig`` (its power
    iteration's order) or the parametrization's; one not given keeps its own. A Stack of them
    read in both forms: :data:`SPECTRAL_FORMS_MIXED`."""
    if not any(k.endswith(tuple(_SPECTRAL_WEIGHT)) for k in given):
        return model
    plan = _plan(model, shapes, layouts, values=False, ports=ports)
    forms: dict[str, list[bool]] = {}  # by the stored node's name: every member's form
    for torch, (ft, node) in plan.nodes.items():
        found = [legacy for name, legacy in _SPECTRAL_WEIGHT.items() if join_names(torch, name) in given]
        stored = plan.leaves[join_names(ft, "weight")].stored if isinstance(node, SpectralNorm) else None
        if len(found) == 1 and stored is not None:
            forms.setdefault(stored.removesuffix("weight").removesuffix("."), []).extend(found)
    for path, found in forms.items():
        if len(set(found)) > 1:
            raise ValueError(SPECTRAL_FORMS_MIXED.format(path=path, legacy=found.count(True),
                                                         current=found.count(False)))

    def set_form(path: Any, node: Any) -> Any:
        found = forms.get(dotted_name(path)) if isinstance(node, SpectralNorm) else None
        return node if not found else node.replace(legacy=found[0])

    return jax.tree_util.tree_map_with_path(set_form, model, is_leaf=lambda x: isinstance(x, SpectralNorm))


def _check_given(state_dict: Any) -> None:
    """Raise :data:`NOT_A_STATE_DICT` for what is no mapping (a torch module, a list of pairs),
    :data:`~functree._state_dict.META_TENSORS` for tensors without values (strict or not: unlike a missing key,
    loading them would leave the model's initial values where the caller meant weights)."""
    if not callable(getattr(state_dict, "items", None)):
        fix = (MODULE_GIVEN if callable(getattr(state_dict, "state_dict", None))
               else PAIRS_GIVEN if isinstance(state_dict, (list, tuple)) else "")
        kind = f"{type(state_dict).__module__}.{type(state_dict).__qualname__}"
        raise TypeError(NOT_A_STATE_DICT.format(kind=kind.removeprefix("builtins."), fix=fix))
    nested = [k for k, v in state_dict.items() if isinstance(v, Mapping)]
    if nested:  # a checkpoint around the state dict: the one that holds arrays is the one to pass
        inner = next((k for k in nested if state_dict[k] and all(hasattr(v, "shape") for v in state_dict[k].values())),
                     nested[0])
        shown = list(state_dict)[:6]
        raise TypeError(NESTED_CHECKPOINT.format(key=nested[0], kind=type(state_dict[nested[0]]).__name__,
                                                 keys=shown if len(state_dict) <= 6 else [*shown, "..."],
                                                 inner=inner))
    check_no_meta(state_dict, "ft.nn.load_torch_state_dict", "model", strict=META_STRICT)


def _as_given(report: FlatDictReport, state_dict: Mapping[str, Any], rename: Rename) -> FlatDictReport:
    """``report`` in the state dict's names: a given tensor's own, another renamed back."""
    to_model, to_torch = _renamer(rename, to_model=True), _renamer(rename, to_model=False)
    given = {to_model(k): k for k in state_dict}
    return renamed_report(report, lambda name: given.get(name) or to_torch(name))


def _under_name(plan: _Plan, prefix: str) -> list[str]:
    return [n for n in plan.leaves if n == prefix or n.startswith(prefix + ".")]


def _member_of(name: str, leaf: _Leaf) -> str:
    return f"Stack member {name}" if leaf.index else name


def _converted(plan: _Plan, given: Mapping[str, Any]
               ) -> tuple[dict[str, np.ndarray], list[tuple[_Rule, list[str]]], list[tuple[str, str, str]]]:
    """The given torch tensors in ft's layout by ft name; absent (by rule) and mis-shaped torch names."""
    values: dict[str, np.ndarray] = {}
    missing: list[tuple[_Rule, list[str]]] = []
    mismatched: list[tuple[str, str, str]] = []
    for rule in plan.rules:
        leaves = [plan.leaves[n] for n in rule.ft]
        expected = _torch_shapes(rule, [leaf.value for leaf in leaves])
        absent = [n for n in rule.torch if n not in given]
        wrong = [(n, e, _shape(n, given[n])) for n, e in zip(rule.torch, expected)
                 if n in given and _shape(n, given[n]) != e]
        if absent and all(leaf.stored is not None for leaf in leaves):  # a tie's target may be absent
            missing.append((rule, absent))
        where = _member_of(rule.ft[0], leaves[0]) + (" ..." if len(rule.ft) > 1 else "")
        mismatched += [(n, f"shape {e} (for {where})", f"shape {g}") for n, e, g in wrong]
        if not absent and not wrong:
            values.update(zip(rule.ft, rule.to_ft(*(_array(n, given[n]) for n in rule.torch))))
    return values, missing, mismatched


NOT_AN_ARRAY = """\
ft.nn.load_torch_state_dict: the state dict's {name!r} is a {kind}, not a tensor or an array.
    right:  state_dict[{name!r}] = np.asarray(value, np.float32)     # numbers, one shape"""


def _shape(name: str, value: Any) -> tuple[int, ...]:
    try:
        return tuple(np.shape(value))
    except ValueError:  # a ragged list
        raise TypeError(NOT_AN_ARRAY.format(name=name, kind=f"ragged {type(value).__name__}")) from None


NOT_A_PLAIN_TENSOR = """\
ft.nn.load_torch_state_dict: the state dict's {name!r} is a {kind} tensor, which holds no plain \
array of values. Convert it first:
    right:  state_dict[{name!r}] = state_dict[{name!r}].{fix}"""


def _array(name: str, value: Any) -> np.ndarray:
    """A state dict's value as NumPy (a tensor, an array, nested lists of numbers), or an
    error naming it (an object, a ragged list, strings; a quantized or sparse torch tensor,
    whose conversion failed deep in torch: :data:`NOT_A_PLAIN_TENSOR`)."""
    quantized = getattr(value, "is_quantized", None)  # a torch tensor's (torch is not imported)
    if quantized is True:
        raise TypeError(NOT_A_PLAIN_TENSOR.format(name=name, kind="quantized", fix="dequantize()   # its float values"))
    layout = str(getattr(value, "layout", "")) if quantized is False else "torch.strided"
    if layout != "torch.strided":
        raise TypeError(NOT_A_PLAIN_TENSOR.format(name=name, kind=layout.removeprefix("torch."), fix="to_dense()"))
    array = to_numpy(value)
    if array is None:
        raise TypeError(NOT_AN_ARRAY.format(name=name, kind=type(value).__name__))
    return array


def _fill_ties(plan: _Plan, values: dict[str, np.ndarray]) -> None:
    """A tie given only under its target's name fills its source (the stored value)."""
    for tie in plan.ties:
        targets, sources = _under_name(plan, tie.target), _under_name(plan, tie.source)
        if not targets or any(n not in values for n in targets) or all(n in values for n in sources):
            continue
        if tie.transform is None:
            filled = {tie.source + n[len(tie.target):]: values[n] for n in targets}
        elif isinstance(tie.template, (np.ndarray, jax.Array)):
            filled = {tie.source: _inverted(tie, values[tie.target], plan)}
        else:
            raise _not_invertible(tie, plan, NOT_AN_ARRAY_SOURCE)
        for n, v in filled.items():
            values.setdefault(n, v)


def _inverted(tie: _Tie, target: np.ndarray, plan: _Plan) -> np.ndarray:
    """The source ``s`` whose transform ``A s`` is ``target`` ``t``, for a linear ``A`` with
    ``A Aᵀ = c I`` (a transpose, reshape or permutation, times a constant ``c``): ``s = Aᵀ t / c``.

    ``Aᵀ`` (``jax.linear_transpose``) is the adjoint, the inverse itself only where ``c = 1``
    (``lambda w: 2 * w.T`` has ``c = 4``); ``c = <A Aᵀ t, t> / <t, t>``. Checked by applying
    the transform: ``A s`` equals ``t`` within 4 ulp of ``max |t|`` (the rounding of ``/ c``),
    else :data:`TIE_NOT_INVERTIBLE` naming why."""
    assert tie.transform is not None
    template = np.asarray(tie.template)
    wanted = np.asarray(target).astype(template.dtype)
    try:
        adjoint_of = jax.linear_transpose(tie.transform, template)
        (adjoint,) = adjoint_of(jnp.asarray(wanted))
    except Exception:  # not linear, or not of one array of this shape
        raise _not_invertible(tie, plan, NOT_LINEAR) from None
    t = wanted.astype(np.float64)
    # A Aᵀ t in the widest float on the host: c t can exceed the dtype's range (float16's
    # 65504 for w.T * 64: c = 4096), and the check would call a valid tie overflowed.
    again = np.asarray(tie.transform(_widened(adjoint)), np.float64)
    scale = float(np.vdot(again, t) / np.vdot(t, t)) if t.any() else 1.0
    source = (np.asarray(adjoint, np.float64) / scale).astype(template.dtype) if scale else adjoint
    reached = np.asarray(tie.transform(jnp.asarray(source)), np.float64)
    tolerance = 4 * _eps(wanted) * float(np.abs(t).max(initial=0))
    if not (scale and reached.shape == t.shape and float(np.abs(reached - t).max(initial=0)) <= tolerance):
        raise _not_invertible(tie, plan, NOT_SCALED_ORTHOGONAL)
    if not _injective(tie.transform, adjoint_of, template):
        raise _not_invertible(tie, plan, NOT_INJECTIVE)
    return np.asarray(source)


def _injective(transform: Callable[[Any], Any], adjoint_of: Callable[[Any], Any], template: np.ndarray) -> bool:
    """Whether the linear ``A`` keeps every entry of its source: ``Aᵀ A r = c r`` for a
    random probe ``r`` (``c > 0``). A map that drops entries (a slice: ``A Aᵀ = I`` but
    ``Aᵀ A`` zeroes what it dropped) passes the target-side check alone, and its inverse
    would silently fill the dropped entries with zeros."""
    probe = _widened(np.random.default_rng(0).normal(size=template.shape))
    try:  # on a float copy whatever the dtype: an integer slice drops entries too (they would
        # load as zeros), and Aᵀ A r can leave float16's range (w.T * 64: c = 4096)
        (back,) = jax.linear_transpose(transform, probe)(transform(probe))
    except Exception:  # a transform of the template's dtype only: its own adjoint, in that dtype
        probe = jnp.asarray(probe, template.dtype)
        (back,) = adjoint_of(transform(probe))
    back, r = np.asarray(back, np.float64), np.asarray(probe, np.float64)
    c = float(np.vdot(back, r) / np.vdot(r, r)) if r.size else 1.0
    tolerance = 8 * _eps(np.asarray(probe)) * max(abs(c), 1.0) * float(np.abs(r).max(initial=0))
    return c > 0 and float(np.abs(back - c * r).max(initial=0)) <= tolerance


def _widened(a: Any) -> jax.Array:
    """``a`` in the widest float JAX computes in: float64 with ``jax_enable_x64``, else float32."""
    return jnp.asarray(np.asarray(a, np.float64))


def _not_invertible(tie: _Tie, plan: _Plan, why: str) -> ValueError:
    torch = _torch_names(plan, tie.source)
    return ValueError(TIE_NOT_INVERTIBLE.format(target=tie.target, source=tie.source, why=why, torch=torch,
                                                torch0=torch[0] if torch else tie.source,
                                                target_torch=_torch_names(plan, tie.target)))


def _torch_names(plan: _Plan, ft: str) -> list[str]:
    """The torch names of the rules converting the parameters at or under ``ft``."""
    under = set(_under_name(plan, ft))
    return [t for rule in plan.rules if under.intersection(rule.ft) for t in rule.torch]


def _stored(plan: _Plan, values: Mapping[str, np.ndarray], template: Mapping[str, Any]
            ) -> tuple[dict[str, Any], list[tuple[str, str, str, Any]]]:
    """The stored leaves (``to_flat_dict`` names) with the given values put in (a Stack member's
    into its slice): fresh aligned host arrays (:mod:`functree.interop._host`) written by one
    parallel pass over the files' bytes, cast as copied, put on the device as they are. The
    Stack members' values that do not cast: ``(name, expected, given, dtype)``, ``dtype`` the
    leaf's for floating values beyond its range or integers beyond its integer range
    (:func:`~functree._state_dict._wraps`), else None (another kind)."""
    members: dict[str, list[tuple[tuple[int, ...], np.ndarray, str]]] = {}
    for name, leaf in plan.leaves.items():
        if leaf.stored is not None and name in values:
            members.setdefault(leaf.stored, []).append((leaf.index, values[name], name))
    flat: dict[str, Any] = {}
    filled: dict[str, np.ndarray] = {}  # ours: put on the device after the copies
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    wrong: list[tuple[str, str, str, Any]] = []
    for stored, items in members.items():
        old = template[stored]
        if items[0][0] == ():
            value = items[0][1]
            if _castable(old, value):
                array = empty(value.shape, old.dtype)
                copies.append((array, value))
                (flat if isinstance(old, np.ndarray) else filled)[stored] = array  # a NumPy leaf stays NumPy
            else:
                flat[stored] = value  # left to from_flat_dict, which reports it
            continue
        abstract = isinstance(old, jax.ShapeDtypeStruct)  # a template of jax.eval_shape: filled whole or kept
        if abstract and len({index for index, _, _ in items}) < int(np.prod(old.shape[:len(items[0][0])])):
            continue  # some members not given: reported missing, the leaf stays abstract
        array = empty(old.shape, old.dtype) if abstract else copied(np.asarray(old), old.dtype)
        for index, value, name in items:
            if _castable(array, value):
                copies.append((array[(*index, ...)], value))  # a view (a 0-d member's array[index]: a scalar copy)
            else:
                ranged = array.dtype if _both_floating(array.dtype, value.dtype) or _wraps(array.dtype, value) else None
                wrong.append((name, f"dtype {array.dtype}", f"dtype {value.dtype}", ranged))
                if abstract:
                    array[index] = 0  # reported; never uninitialized memory
        filled[stored] = array
    copy_all(copies)  # then each on the device as it is: aligned, a CPU's own buffer (jnp.asarray: a compile per shape)
    # ... where the model's leaf lives (a model on device 3 or sharded on a mesh: each device
    # gets its part from the host), else on the default device.
    flat.update((stored, jax.device_put(array, committed_sharding(template[stored]), may_alias=True))
                for stored, array in filled.items())
    return flat, wrong


def _floating(dtype: Any) -> bool:
    """A refused Stack member's range dtype (:func:`_stored`) that is a float's (else an integer's)."""
    return dtype is not None and np.dtype(dtype).kind not in "iu"


def _castable(old: Any, value: np.ndarray) -> bool:
    """``value`` goes into the array leaf ``old`` (:func:`functree._state_dict.castable`)."""
    return isinstance(old, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) and castable(np.dtype(old.dtype), value)


def _check_ties(plan: _Plan, loaded: _Plan, values: Mapping[str, np.ndarray]) -> None:
    """Each tie's given target equals the loaded model's (the source's, transformed)."""
    for tie in plan.ties:
        for name in _under_name(plan, tie.target):
            if name not in values:
                continue
            held, raw = np.asarray(loaded.leaves[name].value), np.asarray(values[name])
            given = raw.astype(held.dtype)
            tolerance = 0.0 if tie.transform is None else _tie_tolerance(plan, tie, held, raw)
            difference = float(np.abs(given.astype(np.float64) - held.astype(np.float64)).max(initial=0))
            if not difference <= tolerance:  # NaN disagrees too
                source = tie.source + name[len(tie.target):] if tie.transform is None else tie.source
                target, given_source = _torch_names(plan, name), _torch_names(plan, source) or [source]
                raise ValueError(TIES_DISAGREE.format(
                    target=target, source=given_source, target0=target[0], source0=given_source[0],
                    ft_target=name, ft_source=source, difference=difference))


def _tie_tolerance(plan: _Plan, tie: _Tie, held: np.ndarray, given: np.ndarray) -> float:
    """How far a transformed tie's given target ``t`` may be from ``A s`` (the loaded source,
    transformed): ``4 eps max|t|``, ``eps`` the coarsest of the dtypes the numbers went
    through: the given tensor's, the stored source's and the resolved target's.

    A source held in bfloat16 is ``A⁻¹ t`` rounded to 8 bits (or torch's own bfloat16 copy
    under both names), so ``A s`` differs from ``t`` by up to ``eps_bf16 / 2 max|t|``
    (``0.0078`` for ``|t| ≈ 2``); the host resolves ``A s`` in float32 (NumPy promotes
    ``0.1 * bfloat16``), whose eps alone would call that rounding a disagreement."""
    sources = [plan.leaves[n].value for n in _under_name(plan, tie.source)]
    eps = max(_eps(a) for a in (held, given, *sources))
    return 4 * eps * float(np.abs(given.astype(np.float64)).max(initial=0))


def _eps(a: np.ndarray) -> float:
    return float(jnp.finfo(a.dtype).eps) if jnp.issubdtype(a.dtype, jnp.floating) else 0.0


def torch_state_dict(
    model: Any,
    *,
    rename: Rename = None,
    flattened: Mapping[str, Sequence[int] | None] | None = None,
    layouts: Mapping[str, Any] | None = None,
    numpy: bool = False,
    gradient: bool = False,
) -> dict[str, Any]:
    """The inverse of :func:`load_torch_state_dict`: ``model``'s leaves as a torch state dict.

    Names and layouts are torch's (module docstring); ``torch_module.load_state_dict(sd)``
    takes it. A Stack's members are written as ``h.0``, ``h.1``, ...; a ``Shared`` tie's
    value under each of its names (as torch's tied ``state_dict()``). ``rename`` is the
    same mapping as for loading (``{torch_prefix: model_prefix}``, applied backwards) or a
    function of the model's torch name; ``flattened`` and ``layouts`` as for loading. An
    LSTM's one bias is saved as ``bias_ih`` with a zero ``bias_hh``.

    A partial tree (a gradient with ``wrt=``: ``None`` leaves) gives the tensors it holds.
    ``gradient=True`` writes ``model`` as a gradient, torch's ``.grad`` of each parameter:
    layouts that move entries (transposes, splits) move a gradient alike, but torch's two
    LSTM biases are summed, ``b = b_ih + b_hh``, so d/d b_ih of f(b_ih + b_hh) = d/d b_hh
    = g: both get the bias's gradient ``g`` (the values' ``(b, 0)`` would give ``bias_hh``
    a zero gradient).

    A model of
    :func:`ft.nn.from_hf` (at the root or inside) is written as its Hugging Face model's
    ``state_dict()`` under its torch name (:func:`ft.nn.to_hf_state_dict`'s tensors: a tied
    head under both names). Tensors are torch's (bfloat16 and float8 stay bfloat16 and
    float8, bit for bit, NaN payloads too; a Python float field, ``scale: float = 1.0``, in the
    parameter view's dtype: float32 unless x64, as after a step); ``numpy=True`` returns NumPy arrays instead and
    does not import torch. In a multi-process job every process calls it: leaves sharded over other
    processes' devices are gathered, and each process gets the whole state dict.

    Example:
      >>> import functree as ft, jax
      >>> model = ft.nn.Sequential(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2))
      >>> sd = ft.nn.torch_state_dict(model, numpy=True)
      >>> {k: v.shape for k, v in sd.items()}
      {'0.weight': (2, 3), '0.bias': (2,), '1.weight': (2,), '1.bias': (2,), '1.running_mean': (2,), '1.running_var': (2,)}
    """
    check_stale([("model", model)], "ft.nn.torch_state_dict(model)")  # donated by a step
    out = state_dict_by_rules(model, rename=rename, flattened=flattened, layouts=layouts, ports=True,
                              gradient=gradient)
    return out if numpy else as_tensors(out)


def state_dict_by_rules(model: Any, *, rename: Rename = None, flattened: Mapping[str, Sequence[int] | None] | None = None,
                        layouts: Mapping[str, Any] | None = None, ports: bool = False,
                        gradient: bool = False, where: str = "ft.nn.torch_state_dict") -> dict[str, np.ndarray]:
    """:func:`torch_state_dict` as NumPy arrays; ``ports=False`` (a port's own converter:
    ``to_hf_state_dict``) writes every layer by the rules above, a port's root included.
    ``gradient``: each rule's gradient layout (:func:`~functree.interop._layouts.gradient_to_torch`).
    ``where``: the public function, for :data:`FLAG_LEAF`."""
    _check_no_flags(model, where)
    shapes = _shapes(flattened)
    to_torch = _renamer(rename, to_model=False)
    plan = _plan(_float_fields_as_arrays(model), shapes, layouts, ports=ports)
    out: dict[str, Any] = {}
    for rule in plan.rules:
        leaves = [plan.leaves[n].value for n in rule.ft]
        if any(absent(leaf) for leaf in leaves):
            continue  # a partial tree (a gradient with wrt=): only the tensors it holds whole
        values = (gradient_to_torch(rule.to_torch) if gradient else rule.to_torch)(*leaves)
        out.update((to_torch(n), _contiguous(v)) for n, v in zip(rule.torch, values))
    for found in plan.ports:  # Hugging Face's names under the port's torch prefix
        ported = prefixed(found.torch, found.port.state_dict(found.node))
        out.update((to_torch(n), _contiguous(v)) for n, v in ported.items())
    return out


def _float_fields_as_arrays(model: Any) -> Any:
    """``model`` with its Python float parameters (``scale: float = 1.0``) as the parameter view
    holds them (:func:`~functree._parameters.floats_as_arrays`: float32 unless x64): NumPy read
    1.0 as float64, so a model wrote float64 before its first step and float32 after it."""
    view = parameters(model)
    arrays = floats_as_arrays(view)
    return model if arrays is view else with_parameters(model, arrays)


def _contiguous(value: Any) -> np.ndarray:
    """``value`` as a C-contiguous NumPy array of its own shape: ``np.ascontiguousarray``
    makes a 0-d array 1-d (a scalar parameter, a BatchNorm's count, was written as shape
    ``(1,)``, and torch's ``load_state_dict`` refused it: "size mismatch ... torch.Size([])")."""
    return np.asarray(value, order="C")


FLAG_LEAF = """\
{where} writes tensors, but leaf {path} is a Python bool ({value!r}): one flag for a whole \
parameter (a mask, as ft.optim.decay_mask gives), which has no tensor to write in torch's \
layout (a fused or transposed weight). Broadcast each flag to its parameter's shape first:

    wrong:  {where}(ft.optim.decay_mask(model))
    right:  {where}(jax.tree.map(lambda m, w: np.full(np.shape(w), m), ft.optim.decay_mask(model), model))"""


def _check_no_flags(tree: Any, where: str) -> None:
    """:data:`FLAG_LEAF` for a Python/NumPy bool leaf (a per-parameter mask): the layouts'
    rules read a weight's shape, and crashed inside on a flag's."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, (bool, np.bool_)):
            raise ValueError(FLAG_LEAF.format(where=where, path=dotted_name(path) or "(the tree itself)",
                                              value=bool(leaf)))


def as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        import torch
    except ImportError as e:  # torch is optional: only this conversion needs it
        raise ImportError(NO_TORCH) from e

    def tensor(name: str, a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":  # torch takes no NumPy bfloat16: the bits, reinterpreted
            # (through float32, .to(torch.bfloat16) turns every NaN into 0xffff)
            return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16)
        float8 = getattr(torch, a.dtype.name, None) if a.dtype.name.startswith("float8_") else None
        if float8 is not None:  # ml_dtypes' float8 bits are torch's (same names): the bytes, reinterpreted
            return torch.from_numpy(np.array(a).view(np.uint8)).view(float8)
        try:
            return torch.from_numpy(np.array(a))
        except TypeError:  # ml_dtypes' others (float4, int4): no torch dtype holds them
            raise TypeError(NO_TORCH_DTYPE.format(name=name, dtype=a.dtype.name)) from None

    return {k: tensor(k, v) for k, v in arrays.items()}
