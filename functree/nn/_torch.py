"""Torch state dicts onto ``ft.nn`` layers and back, with names and layouts converted.

torch and ``ft.nn`` layers hold the same numbers under other names and in other layouts::

    torch                                    ft.nn
    Linear  weight [out, in], bias           Dense  weight [in, out] (transposed), bias
    Conv{1,2}d  weight [out, in/g, *k]       Conv{1,2}D  weight [*k, in/g, out]
    ConvTranspose{1,2}d  weight [in, out, *k]  Conv{1,2}DTranspose  weight [*k, in, out]
    LayerNorm, GroupNorm, RMSNorm  weight, bias  scale, offset
    BatchNorm{1,2}d  weight, bias, running_mean, running_var (num_batches_tracked dropped)
                                             BatchNorm  scale, offset, running_mean, running_variance
    Embedding  weight                        Embedding  embeddings
    MultiheadAttention  in_proj_weight [3E, E] (or q/k/v_proj_weight), in_proj_bias, out_proj
                                             query/key/value/output_projection (split, transposed)
    GRUCell, GRU  weight_ih[_l0], weight_hh[_l0], bias_ih[_l0], bias_hh[_l0]
                                             GRUCell / RNN(GRUCell)  input_weight, hidden_weight,
                                             input_bias, hidden_bias (transposed weights)
    LSTMCell, LSTM  the same four            LSTMCell / RNN(LSTMCell)  input_weight, hidden_weight,
                                             bias = bias_ih + bias_hh

A layer's torch name is its key path with ``Sequential``'s ``layers`` and ``Shared``'s
``model`` left out (``features.layers.0`` is torch's ``features.0``); any other array leaf
is matched by that name as it is (a torch ``nn.Parameter``). ``rename=`` maps torch name
prefixes onto the model's where they differ. Only single-layer, unidirectional ``GRU`` /
``LSTM`` map onto ``RNN`` (torch's other layers and directions stay unmatched, reported).

Where ``ft.nn``'s defaults differ from torch's, the torch numbers are one argument away:

* ``BatchNorm``: ``epsilon=1e-3`` (torch ``eps=1e-5``) → ``ft.nn.BatchNorm(n, epsilon=1e-5)``;
  ``momentum`` weighs the old statistics (``0.99``; torch's ``0.1`` weighs the new ones) →
  ``momentum=0.9``. In training torch updates ``running_var`` with the unbiased batch
  variance, ``ft.nn`` with the biased one (the one both normalize with).
* ``ft.nn.gelu`` is the tanh approximation (torch's ``GELU(approximate="tanh")``); torch's
  default ``nn.GELU()`` is ``ft.nn.gelu_exact``.
* Convolutions are channels-last (``x.permute(0, 2, 3, 1)`` for an NCHW input) and pad
  ``"SAME"`` by default (torch's ``padding=0`` is ``"VALID"``); a ``Linear`` after
  ``Flatten`` of NCHW feature maps needs ``flattened={name: (C, H, W)}`` (below).
* ``RNN`` is batch-first (torch's ``batch_first=True``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._state_dict import FlatDictReport, _to_numpy, from_flat_dict, to_flat_dict
from functree._tree import dotted_name
from functree.nn._attention import MultiheadAttention
from functree.nn._conv import _Conv, _ConvTranspose
from functree.nn._embedding import Embedding
from functree.nn._linear import Dense
from functree.nn._normalization import BatchNorm, GroupNorm, LayerNorm, RMSNorm
from functree.nn._recurrent import RNN, GRUCell, LSTMCell
from functree.nn._sequential import Sequential
from functree.nn._shared import Shared

__all__ = ["load_torch_state_dict", "torch_state_dict"]

TORCH_MISMATCH = """\
ft.nn.load_torch_state_dict: the state dict does not fit the model (names as torch spells them).
{report}
The model's torch names are its key paths without Sequential's "layers", e.g. {example}.
Map differing prefixes with rename={{"torch.prefix": "model.prefix"}}, or pass strict=False \
to load what fits and get this report back: model, report = ft.nn.load_torch_state_dict(model, sd, strict=False)"""

FLATTENED_UNKNOWN = """\
ft.nn: flattened= names {names}, which are not Dense layers of the model. Name a Dense layer \
by its torch name or key path: {dense}

    right:  flattened={{{first!r}: (channels, height, width)}}"""

FLATTENED_SIZE = """\
ft.nn: flattened={{{name!r}: {shape}}} has {size} values per example; the Dense layer takes \
{inputs}. Give torch's feature-map shape before Flatten, (channels, *spatial)."""

NO_TORCH = """\
ft.nn.torch_state_dict returns torch tensors and needs torch: pip install torch. For NumPy \
arrays in torch's layout pass numpy=True."""

Rename = Mapping[str, str] | Callable[[str], str] | None


@dataclasses.dataclass(frozen=True)
class _Rule:
    """Torch tensors ``torch`` (full names) ↔ model leaves ``ft`` (dotted key paths)."""

    torch: tuple[str, ...]
    ft: tuple[str, ...]
    to_ft: Callable[..., tuple[np.ndarray, ...]]
    to_torch: Callable[..., tuple[np.ndarray, ...]]


# A layer's rules in local names: (torch names, ft leaf names, to_ft, to_torch).
Local = tuple[tuple[str, ...], tuple[str, ...], Callable[..., Any], Callable[..., Any]]


def _same(torch: str, ft: str) -> Local:
    return (torch,), (ft,), lambda a: (a,), lambda a: (a,)


def _permuted(torch: str, ft: str, perm: Sequence[int]) -> Local:
    inverse = tuple(int(i) for i in np.argsort(perm))
    return (torch,), (ft,), lambda a: (a.transpose(perm),), lambda a: (a.transpose(inverse),)


def _flattened_linear(shape: tuple[int, ...]) -> Local:
    """Linear after torch's Flatten of ``[C, *S]`` maps ↔ Dense after ft's of ``[*S, C]``."""
    n = len(shape)
    to_ft_axes = (*range(2, n + 1), 1, 0)  # [out, C, *S] -> [*S, C, out]
    to_torch_axes = tuple(int(i) for i in np.argsort(to_ft_axes))
    spatial_first = (*shape[1:], shape[0])

    def to_ft(w: np.ndarray) -> tuple[np.ndarray]:
        return (w.reshape((w.shape[0], *shape)).transpose(to_ft_axes).reshape((-1, w.shape[0])),)

    def to_torch(w: np.ndarray) -> tuple[np.ndarray]:
        return (w.reshape((*spatial_first, w.shape[1])).transpose(to_torch_axes).reshape((w.shape[1], -1)),)

    return ("weight",), ("weight",), to_ft, to_torch


def _dense(layer: Dense, flattened: tuple[int, ...] | None = None, torch: str = "", ft: str = "") -> list[Local]:
    weight = _permuted("weight", "weight", (1, 0)) if flattened is None else _flattened_linear(flattened)
    rules = [weight] + ([_same("bias", "bias")] if layer.bias is not None else [])
    return [_prefixed(rule, torch, ft) for rule in rules]


def _prefixed(rule: Local, torch: str, ft: str) -> Local:
    join = lambda p, n: f"{p}.{n}" if p else n  # noqa: E731
    return tuple(join(torch, n) for n in rule[0]), tuple(join(ft, n) for n in rule[1]), rule[2], rule[3]


def _conv(layer: _Conv) -> list[Local]:
    n = layer._rank
    # torch [out, in, *k] (transposes: [in, out, *k]) -> ft [*k, in, out]
    perm = (*range(2, n + 2), 0, 1) if isinstance(layer, _ConvTranspose) else (*range(2, n + 2), 1, 0)
    return [_permuted("weight", "weight", perm)] + ([_same("bias", "bias")] if layer.bias is not None else [])


def _norm(layer: LayerNorm | GroupNorm | RMSNorm | BatchNorm) -> list[Local]:
    rules = [] if layer.scale is None else [_same("weight", "scale")]
    if getattr(layer, "offset", None) is not None:
        rules.append(_same("bias", "offset"))
    if isinstance(layer, BatchNorm):
        rules += [_same("running_mean", "running_mean"), _same("running_var", "running_variance")]
    return rules


def _split(sizes: Sequence[int], transpose: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """One stacked torch tensor ↔ several ft leaves (MultiheadAttention's in_proj)."""
    cuts = np.cumsum(sizes)[:-1]
    t = (lambda a: a.T) if transpose else (lambda a: a)
    return (lambda w: tuple(t(p) for p in np.split(w, cuts))), (lambda *ps: (np.concatenate([t(p) for p in ps]),))


def _attention(layer: MultiheadAttention) -> list[Local]:
    projections = (layer.query_projection, layer.key_projection, layer.value_projection)
    names = ("query_projection", "key_projection", "value_projection")
    inputs = {p.weight.shape[0] for p in projections}
    sizes = [p.weight.shape[1] for p in projections]
    if len(inputs) == 1:  # torch's _qkv_same_embed_dim: one stacked in_proj_weight
        rules: list[Local] = [(("in_proj_weight",), tuple(f"{n}.weight" for n in names), *_split(sizes, True))]
    else:
        rules = [_permuted(f"{t}_proj_weight", f"{n}.weight", (1, 0)) for t, n in zip("qkv", names)]
    if layer.query_projection.bias is not None:
        rules.append((("in_proj_bias",), tuple(f"{n}.bias" for n in names), *_split(sizes, False)))
    return rules + _dense(layer.output_projection, torch="out_proj", ft="output_projection")


def _cell(layer: GRUCell | LSTMCell, suffix: str = "", ft: str = "") -> list[Local]:
    rules = [_permuted("weight_ih", "input_weight", (1, 0)), _permuted("weight_hh", "hidden_weight", (1, 0))]
    if isinstance(layer, GRUCell):
        rules += [_same("bias_ih", "input_bias"), _same("bias_hh", "hidden_bias")]
    else:  # torch adds two biases where the LSTM has one: loaded summed, saved as (bias, 0)
        rules.append((("bias_ih", "bias_hh"), ("bias",), lambda a, b: (a + b,), lambda b: (b, np.zeros_like(b))))
    return [(tuple(n + suffix for n in t), tuple(f"{ft}.{n}" if ft else n for n in f), a, b) for t, f, a, b in rules]


def _rnn(layer: RNN) -> list[Local] | None:
    if isinstance(layer.cell, (GRUCell, LSTMCell)):
        return _cell(layer.cell, suffix="_l0", ft="cell")
    return None  # another cell: walked into, its leaves matched by name


_LAYERS: tuple[tuple[type | tuple[type, ...], Callable[[Any], list[Local] | None]], ...] = (
    (_Conv, _conv),
    ((LayerNorm, GroupNorm, RMSNorm, BatchNorm), _norm),
    (Embedding, lambda layer: [_same("weight", "embeddings")]),
    (MultiheadAttention, _attention),
    ((GRUCell, LSTMCell), _cell),
    (RNN, _rnn),
)


def _children(node: Any) -> list[tuple[str, Any]]:
    """The direct children of a pytree node with their dotted names (None children skipped)."""
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(dotted_name(p), child) for p, child in path_leaves if p and child is not None]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _plan(model: Any, flattened: Mapping[str, tuple[int, ...]]) -> list[_Rule]:
    """Every rule of the model, in full names; each array leaf is covered by exactly one."""
    rules: list[_Rule] = []
    dense: list[tuple[str, str]] = []

    def walk(node: Any, ft: str, torch: str) -> None:
        local = _layer_rules(node, ft, torch, flattened, dense)
        if local is not None:
            rules.extend(_Rule(tuple(_join(torch, n) for n in t), tuple(_join(ft, n) for n in f), a, b)
                         for t, f, a, b in local)
            return
        children = _children(node)
        if not children and jax.tree.leaves(node):  # a leaf outside known layers: its name, as is
            rules.append(_Rule((torch,), (ft,), lambda a: (a,), lambda a: (a,)))
            return
        for name, child in children:
            hidden = (isinstance(node, Sequential) and name == "layers") or (isinstance(node, Shared) and name == "model")
            walk(child, _join(ft, name), torch if hidden else _join(torch, name))

    walk(model, "", "")
    unknown = [name for name in flattened if not any(name in pair for pair in dense)]
    if unknown:
        names = [t for t, _ in dense]
        raise ValueError(FLATTENED_UNKNOWN.format(names=unknown, dense=names, first=names[0] if names else "fc"))
    return rules


def _layer_rules(node: Any, ft: str, torch: str, flattened: Mapping[str, tuple[int, ...]],
                 dense: list[tuple[str, str]]) -> list[Local] | None:
    if isinstance(node, Dense):
        dense.append((torch, ft))
        shape = flattened.get(torch, flattened.get(ft))
        if shape is not None and int(np.prod(shape)) != node.weight.shape[0]:
            raise ValueError(FLATTENED_SIZE.format(name=torch, shape=tuple(shape), size=int(np.prod(shape)),
                                                   inputs=node.weight.shape[0]))
        return _dense(node, None if shape is None else tuple(shape))
    for cls, make in _LAYERS:
        if isinstance(node, cls):
            return make(node)
    return None


def _renamer(rename: Rename, to_model: bool) -> Callable[[str], str]:
    """Torch names → the model's (``to_model``) or back; a mapping renames prefixes, longest first."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    pairs = [(t, m) if to_model else (m, t) for t, m in rename.items()]
    pairs.sort(key=lambda pair: -len(pair[0]))

    def renamed(name: str) -> str:
        for old, new in pairs:
            if not old or name == old or name.startswith(old + "."):
                return _join(new, name[len(old):].lstrip("."))
        return name

    return renamed


def load_torch_state_dict(
    model: Any,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    rename: Rename = None,
    flattened: Mapping[str, Sequence[int]] | None = None,
) -> Any:
    """``model`` with a torch ``state_dict``'s tensors in it, renamed and re-laid-out.

    Each known layer (module docstring) takes its torch tensors converted to its own
    layout; any other array leaf takes the tensor of its name as it is. Values are cast
    to the model's floating dtypes and every shape is checked. ``strict=True`` raises one
    error listing missing, unexpected and mis-shaped torch names; ``strict=False`` keeps
    the model's value wherever the state dict does not fit and returns ``(model, report)``
    (an ``ft.FlatDictReport`` in torch's names). ``num_batches_tracked`` is dropped.

    ``rename`` maps torch name prefixes onto the model's, ``{"backbone.features":
    "encoder"}`` (longest first; ``{"module": ""}`` strips DataParallel's prefix), or is a
    function of the torch name. ``flattened={"classifier.0": (C, H, W)}`` names Dense
    layers fed by torch's ``Flatten`` of ``[C, H, W]`` feature maps: their weight rows
    are permuted to ft's channels-last ``[H, W, C]`` order.

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
    """
    shapes = {k: tuple(int(d) for d in v) for k, v in (flattened or {}).items()}
    plan = _plan(model, shapes)
    to_model = _renamer(rename, to_model=True)
    given = {to_model(k): v for k, v in state_dict.items() if not k.endswith("num_batches_tracked")}
    template = to_flat_dict(model)
    flat: dict[str, Any] = {}
    missing: list[str] = []
    mismatched: list[tuple[str, str, str]] = []
    for rule in plan:
        expected = rule.to_torch(*(_zeros_like(template[n]) for n in rule.ft))
        absent = [n for n in rule.torch if n not in given]
        wrong = [(n, e.shape, tuple(np.shape(given[n]))) for n, e in zip(rule.torch, expected)
                 if n in given and tuple(np.shape(given[n])) != e.shape]
        missing += absent
        mismatched += [(n, f"shape {e}", f"shape {g}") for n, e, g in wrong]
        if not absent and not wrong:
            values = rule.to_ft(*(_to_numpy(given[n]) for n in rule.torch))
            flat.update((n, _as_leaf(template[n], v)) for n, v in zip(rule.ft, values))
    claimed = {n for rule in plan for n in rule.torch}
    tree, fitted = from_flat_dict(model, flat, strict=False, cast=True)
    report = FlatDictReport(
        tuple(missing), tuple(k for k in given if k not in claimed),
        (*mismatched, *fitted.mismatched), fitted.hints,
    )
    if strict and not report.ok:
        example = next((f"{r.ft[0]} -> {r.torch[0]}" for r in plan if "layers" in r.ft[0]), plan[0].ft[0] if plan else "")
        raise ValueError(TORCH_MISMATCH.format(report=report, example=example))
    return tree if strict else (tree, report)


def _as_leaf(old: Any, value: np.ndarray) -> Any:
    """A converted value as a JAX array of the model leaf's floating dtype (else left to check)."""
    if not isinstance(old, jax.Array) or value.dtype.kind != "f" or not jnp.issubdtype(old.dtype, jnp.floating):
        return value
    return jnp.asarray(value.astype(old.dtype))


def _zeros_like(leaf: Any) -> np.ndarray:
    """Zeros of a leaf's shape: the torch layout's shapes come from the same conversions."""
    return np.zeros(np.shape(leaf), np.float32)


def torch_state_dict(
    model: Any,
    *,
    rename: Rename = None,
    flattened: Mapping[str, Sequence[int]] | None = None,
    numpy: bool = False,
) -> dict[str, Any]:
    """The inverse of :func:`load_torch_state_dict`: ``model``'s leaves as a torch state dict.

    Names and layouts are torch's (module docstring); ``torch_module.load_state_dict(sd)``
    takes it. ``rename`` is the same mapping as for loading (``{torch_prefix:
    model_prefix}``, applied backwards) or a function of the model's torch name;
    ``flattened`` as for loading. An LSTM's one bias is saved as ``bias_ih`` with a zero
    ``bias_hh``. Tensors are torch's (bfloat16 stays bfloat16); ``numpy=True`` returns
    NumPy arrays instead and does not import torch.

    Example:
      >>> import functree as ft, jax
      >>> model = ft.nn.Sequential(ft.nn.Dense(3, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2))
      >>> sd = ft.nn.torch_state_dict(model, numpy=True)
      >>> {k: v.shape for k, v in sd.items()}
      {'0.weight': (2, 3), '0.bias': (2,), '1.weight': (2,), '1.bias': (2,), '1.running_mean': (2,), '1.running_var': (2,)}
    """
    shapes = {k: tuple(int(d) for d in v) for k, v in (flattened or {}).items()}
    to_torch = _renamer(rename, to_model=False)
    leaves = to_flat_dict(model)
    out: dict[str, Any] = {}
    for rule in _plan(model, shapes):
        values = rule.to_torch(*(np.asarray(leaves[n]) for n in rule.ft))
        out.update((to_torch(n), np.ascontiguousarray(v)) for n, v in zip(rule.torch, values))
    return out if numpy else _as_tensors(out)


def _as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        import torch
    except ImportError as e:  # torch is optional: only this conversion needs it
        raise ImportError(NO_TORCH) from e

    def tensor(a: np.ndarray) -> Any:
        if a.dtype.name == "bfloat16":  # no NumPy bfloat16 in torch: through float32
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(a))

    return {k: tensor(v) for k, v in arrays.items()}
