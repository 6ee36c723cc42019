"""Each known layer's torch tensors ↔ its own leaves: the per-layer rules of
:mod:`functree.interop._torch` (whose docstring tables the layouts), and ``layouts=`` /
``flattened=``, which pick another torch layout for a ``Dense`` or ``MultiheadAttention``.

A rule is :data:`Local`: torch names and ft leaf names local to the layer, and the two
conversions between them (``to_ft(*torch_tensors) -> ft leaves``, ``to_torch`` back), each a
pure NumPy relayout (a transpose, a split, a concatenation); :func:`layer_rules` gives a
layer's rules, or None for a node that is no known layer (walked into by the plan).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree._naming import matches
from functree.nn._attention import MultiheadAttention
from functree.nn._bilinear import Bilinear
from functree.nn._conv import Conv, torch_weight_axes
from functree.nn._embedding import Embedding
from functree.nn._embedding_bag import EmbeddingBag
from functree.nn._linear import Dense
from functree.nn._moe import Experts
from functree.nn._normalization import BatchNorm, GroupNorm, LayerNorm, RMSNorm, _InstanceNorm
from functree.nn._prelu import PReLU
from functree.nn._recurrent import RNN, GRUCell, LSTMCell, SimpleRNNCell
from functree.nn._recurrent_layers import Bidirectional, StackedRNN
from functree.nn._weight_norm import SpectralNorm, WeightNorm

FLATTENED_SIZE = """\
ft.nn: flattened={{{name!r}: {shape}}} has {size} values per example; the Dense layer takes \
{inputs}. Give torch's feature-map shape before Flatten, (channels, *spatial)."""

BAD_LAYOUT = """\
ft.nn: layouts= gives {name} the layout {layout!r}; this layer knows {known}.

    wrong:  layouts={{{pattern!r}: {layout!r}}}
    right:  layouts={{{pattern!r}: "conv1d"}}   # Hugging Face's Conv1D (GPT-2)
       or:  layouts={{{pattern!r}: {other}}}   # {why}"""

PER_HEAD_GROUPED = """\
ft.nn: layouts= gives {name} the per-head layout {layout!r} (GPT-NeoX's: rows holding each \
head's query, key and value in turn, one key and value head per query head), but it has \
num_kv_heads={kv} for num_heads={heads} (grouped-query attention): its key and value rows \
cannot be laid out per query head. A grouped-query attention's fused Linear holds [q | k | v]:

    wrong:  layouts={{{pattern!r}: {layout!r}}}
    right:  layouts={{{pattern!r}: {fused!r}}}   # rows [q | k | v] (Phi-3)
       or:  layouts={{{pattern!r}: ('q_proj', 'k_proj', 'v_proj', 'o_proj')}}   # four Linears"""

# A layer's rules in local names: (torch names, ft leaf names, to_ft, to_torch).
Local = tuple[tuple[str, ...], tuple[str, ...], Callable[..., Any], Callable[..., Any]]


def _xp(a: Any) -> Any:
    """The array module of ``a``: NumPy for a host array, jax.numpy for a JAX array or tracer
    (a rule's ``to_torch`` is traced by ``jax.eval_shape`` to give the torch shapes a model
    implies without building them: concatenating placeholders of a config's sizes would)."""
    return jnp if isinstance(a, jax.Array) else np


# The rule factories are memoized: a Stack's members get the same conversion functions, so
# the torch shapes each implies are traced once (interop._torch caches them by function).
@functools.lru_cache(maxsize=1024)
def same(torch: str, ft: str) -> Local:
    """One tensor as it is, torch's name ``torch`` ↔ the leaf ``ft``."""
    return (torch,), (ft,), lambda a: (a,), lambda a: (a,)


@functools.lru_cache(maxsize=1024)
def _permuted(torch: str, ft: str, perm: tuple[int, ...]) -> Local:
    inverse = tuple(int(i) for i in np.argsort(perm))
    return (torch,), (ft,), lambda a: (a.transpose(perm),), lambda a: (a.transpose(inverse),)


@functools.lru_cache(maxsize=256)
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


def _dense(layer: Dense, flattened: tuple[int, ...] | None = None, torch: str = "", ft: str = "",
           layout: str | None = None) -> list[Local]:
    if layout == "conv1d":  # Hugging Face's Conv1D stores [in, out], as ft.nn does
        weight = same("weight", "weight")
    else:
        weight = _permuted("weight", "weight", (1, 0)) if flattened is None else _flattened_linear(flattened)
    rules = [weight] + ([same("bias", "bias")] if layer.bias is not None else [])
    return [_prefixed(rule, torch, ft) for rule in rules]


def _prefixed(rule: Local, torch: str, ft: str) -> Local:
    join = lambda p, n: f"{p}.{n}" if p else n  # noqa: E731
    return tuple(join(torch, n) for n in rule[0]), tuple(join(ft, n) for n in rule[1]), rule[2], rule[3]


def _conv(layer: Conv) -> list[Local]:
    perm = torch_weight_axes(layer)  # torch [out, in, *k] (transposes: [in, out, *k]) -> ft [*k, in, out]
    assert perm is not None
    return [_permuted("weight", "weight", perm)] + ([same("bias", "bias")] if layer.bias is not None else [])


def _reparametrized(layer: WeightNorm | SpectralNorm) -> list[Local]:
    """torch's ``parametrizations`` of a Linear or conv weight (torch >= 2.1's
    ``nn.utils.parametrizations.weight_norm`` / ``spectral_norm``): weight norm's
    ``original0`` (g, the weight's layout with size one on the other axes, or a scalar) and
    ``original1`` (v); spectral norm's ``original`` (the weight) and its power iteration's
    ``0._u``, ``0._v`` (torch's matrix vectors, as they are); a ``legacy=True`` spectral norm's
    are the deprecated ``torch.nn.utils.spectral_norm``'s ``weight_orig``, ``weight_u``,
    ``weight_v`` (what torch's hook form loads). The bias is the wrapped layer's."""
    perm = torch_weight_axes(layer.layer)
    assert perm is not None  # (the wrappers take a Dense or a convolution)
    if isinstance(layer, WeightNorm):
        g = same("parametrizations.weight.original0", "g") if layer.dim is None else _permuted(
            "parametrizations.weight.original0", "g", perm)
        rules = [g, _permuted("parametrizations.weight.original1", "v", perm)]
    else:
        weight, u, v = (("weight_orig", "weight_u", "weight_v") if layer.legacy else
                        ("parametrizations.weight.original", "parametrizations.weight.0._u",
                         "parametrizations.weight.0._v"))
        rules = [_permuted(weight, "weight", perm), same(u, "u"), same(v, "v")]
    return rules + ([same("bias", "layer.bias")] if layer.layer.bias is not None else [])


def _norm(layer: LayerNorm | GroupNorm | RMSNorm | BatchNorm | _InstanceNorm) -> list[Local]:
    rules = [] if layer.scale is None else [same("weight", "scale")]
    if getattr(layer, "offset", None) is not None:
        rules.append(same("bias", "offset"))
    if isinstance(layer, (BatchNorm, _InstanceNorm)) and layer.track_running_stats:
        rules += [same("running_mean", "running_mean"), same("running_var", "running_variance")]
    if isinstance(layer, BatchNorm) and layer.batches_tracked is not None:  # momentum=None's count: it weighs batches
        rules.append(_COUNT)
    return rules


def _as_long(a: Any) -> Any:
    """A count as torch holds it, int64 (``torch.long``), whatever the leaf's integer dtype (an
    int32 ``batches_tracked``): torch's ``load_state_dict(assign=True)`` keeps the tensor given,
    and an int32 count went on as int32. A tracer (the torch shapes traced) is left as it is."""
    return a if isinstance(a, Tracer) else np.asarray(a).astype(np.int64)


# BatchNorm(momentum=None)'s count: torch's int64 num_batches_tracked ↔ the layer's batches_tracked
# (loading casts it to the leaf's integer dtype where it holds the value, else refuses it)
_COUNT: Local = ("num_batches_tracked",), ("batches_tracked",), lambda a: (a,), lambda a: (_as_long(a),)


@functools.lru_cache(maxsize=1024)
def _split(sizes: tuple[int, ...], transpose: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """One stacked torch tensor ↔ several ft leaves (MultiheadAttention's in_proj)."""
    cuts = np.cumsum(sizes)[:-1]
    t = (lambda a: a.T) if transpose else (lambda a: a)
    return (lambda w: tuple(t(p) for p in np.split(w, cuts))), (
        lambda *ps: (_xp(ps[0]).concatenate([t(p) for p in ps]),))


def _attention(layer: MultiheadAttention, layout: Any = None) -> list[Local]:
    """The projections' rules in ``layout``, and the query/key norms' (Qwen3's and OLMo2's
    ``q_norm`` / ``k_norm``: under their own names, as HF's attention holds them; a port's own
    norm, Gemma 3's ``GemmaRMSNorm``, its ``weight`` as it is)."""
    norms = [_prefixed(rule, name, name) for name in ("q_norm", "k_norm") if getattr(layer, name, None) is not None
             for rule in _qk_norm(getattr(layer, name))]
    return _projections(layer, layout) + norms


def _qk_norm(layer: Any) -> list[Local]:
    if isinstance(layer, (LayerNorm, GroupNorm, RMSNorm, BatchNorm)):
        return _norm(layer)
    return [same("weight", "weight")] if getattr(layer, "weight", None) is not None else []


def _projections(layer: MultiheadAttention, layout: Any = None) -> list[Local]:
    projections = (layer.query_projection, layer.key_projection, layer.value_projection)
    names = ("query_projection", "key_projection", "value_projection")
    # A partial tree (a gradient with wrt=) may lack the projections' weights: a fused
    # tensor's rule is then skipped (it is written only whole), and its sizes never used.
    held = [p.weight for p in projections if not absent(p.weight)]
    sizes = tuple(int(p.weight.shape[1]) for p in projections) if len(held) == 3 else (0, 0, 0)
    if isinstance(layout, (tuple, list)) and len(layout) in (2, 3):  # one Linear for q|k|v, one output Linear
        fused, output = layout[0], layout[1]
        if len(layout) == 3:  # GPT-NeoX: rows [q_h | k_h | v_h] head after head
            weights, biases = _per_head(layer.num_heads, True), _per_head(layer.num_heads, False)
        else:  # Phi-3: rows [q | k | v]
            weights, biases = _split(sizes, True), _split(sizes, False)
        rules = [((f"{fused}.weight",), tuple(f"{n}.weight" for n in names), *weights)]
        if layer.query_projection.bias is not None:
            rules.append(((f"{fused}.bias",), tuple(f"{n}.bias" for n in names), *biases))
        return rules + _dense(layer.output_projection, torch=output, ft="output_projection")
    if isinstance(layout, (tuple, list)):  # separate Linear layers: q_proj, k_proj, v_proj, o_proj
        return [rule for p, t, n in zip((*projections, layer.output_projection), layout, (*names, "output_projection"))
                for rule in _dense(p, torch=t, ft=n)]
    inputs = {w.shape[0] for w in held}
    if layout == "conv1d":  # GPT-2: c_attn [in, q|k|v], c_proj [in, out]
        rules: list[Local] = [(("c_attn.weight",), tuple(f"{n}.weight" for n in names), *_split_columns(sizes))]
        if layer.query_projection.bias is not None:
            rules.append((("c_attn.bias",), tuple(f"{n}.bias" for n in names), *_split(sizes, False)))
        return rules + _dense(layer.output_projection, torch="c_proj", ft="output_projection", layout="conv1d")
    if len(inputs) == 1:  # torch's _qkv_same_embed_dim: one stacked in_proj_weight
        rules = [(("in_proj_weight",), tuple(f"{n}.weight" for n in names), *_split(sizes, True))]
    else:
        rules = [_permuted(f"{t}_proj_weight", f"{n}.weight", (1, 0)) for t, n in zip("qkv", names)]
    if layer.query_projection.bias is not None:
        rules.append((("in_proj_bias",), tuple(f"{n}.bias" for n in names), *_split(sizes, False)))
    return rules + _dense(layer.output_projection, torch="out_proj", ft="output_projection")


def absent(leaf: Any) -> bool:
    """A leaf a partial tree does not hold: None (a parameter outside ``wrt=``), as the plan
    reads it (a bare None, or a stacked None as an object array)."""
    return leaf is None or (isinstance(leaf, np.ndarray) and leaf.dtype == object)


@functools.lru_cache(maxsize=256)
def _per_head(heads: int, transpose: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """One torch tensor whose rows hold each head's query, key and value in turn (GPT-NeoX's
    ``query_key_value``: ``[heads, 3, head_size, ...]``) ↔ the three projections."""
    t = (lambda a: a.T) if transpose else (lambda a: a)

    def to_ft(w: np.ndarray) -> tuple[np.ndarray, ...]:
        parts = w.reshape((heads, 3, -1, *w.shape[1:]))
        return tuple(t(parts[:, i].reshape((-1, *w.shape[1:]))) for i in range(3))

    def to_torch(*ps: np.ndarray) -> tuple[np.ndarray]:
        rows = [t(p) for p in ps]
        stacked = _xp(rows[0]).stack([r.reshape((heads, -1, *r.shape[1:])) for r in rows], axis=1)
        return (stacked.reshape((-1, *rows[0].shape[1:])),)

    return to_ft, to_torch


@functools.lru_cache(maxsize=1024)
def _split_columns(sizes: tuple[int, ...]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """One ``[in, q|k|v]`` matrix ↔ the three ``[in, size]`` projection weights."""
    cuts = np.cumsum(sizes)[:-1]
    return (lambda w: tuple(np.split(w, cuts, axis=1))), (lambda *ps: (_xp(ps[0]).concatenate(ps, axis=1),))


def _cell(layer: SimpleRNNCell | GRUCell | LSTMCell, suffix: str = "", ft: str = "") -> list[Local]:
    rules = [_permuted("weight_ih", "input_weight", (1, 0)), _permuted("weight_hh", "hidden_weight", (1, 0))]
    if isinstance(layer, (SimpleRNNCell, GRUCell)):  # torch's two biases, held as they are
        if layer.input_bias is not None:  # use_bias=False: torch's bias=False, no bias tensors
            rules.append(same("bias_ih", "input_bias"))
        if layer.hidden_bias is not None:
            rules.append(same("bias_hh", "hidden_bias"))
    elif layer.hidden_bias is not None:  # two_biases=True: torch's two, held as they are
        rules += [same("bias_ih", "bias"), same("bias_hh", "hidden_bias")]
    elif layer.bias is not None:  # torch adds two biases where the LSTM has one: loaded summed, saved as (bias, 0)
        rules.append((("bias_ih", "bias_hh"), ("bias",), _summed, _with_zeros))
    if isinstance(layer, LSTMCell) and layer.projection is not None:  # proj_size: torch's weight_hr [p, hidden]
        rules.append(_permuted("weight_hr", "projection", (1, 0)))
    return [(tuple(n + suffix for n in t), tuple(f"{ft}.{n}" if ft else n for n in f), a, b) for t, f, a, b in rules]


def _summed(a: Any, b: Any) -> tuple[Any]:
    """``b_ih + b_hh`` in float64, exact for two floats of 32 bits or fewer, rounded once to
    the model's dtype as it is copied: summed in their own dtype, a bfloat16 file's biases
    were rounded to bfloat16 (6.8e-3 off, outputs 1.2e-3, for a float32 model, whose torch
    LSTM of the same tensors adds them exactly)."""
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.issubdtype(b.dtype, jnp.floating):
        return (a.astype(np.float64) + b.astype(np.float64),)
    return (a + b,)


def _with_zeros(b: Any) -> tuple[Any, Any]:
    return b, _xp(b).zeros_like(b)


def _repeated(g: Any) -> tuple[Any, Any]:
    return g, g


# A gradient's torch layout where it differs from the values'. Every other rule moves entries
# (a transpose, a split, a concatenation: a permutation P), and a gradient moves with them
# (d/d(P x) of f = P d/dx of f, P orthogonal). The LSTM's summed bias does not: with
# b = b_ih + b_hh, d/d b_ih of f(b_ih + b_hh) = d/d b_hh = g, so each torch bias gets g, the
# .grad torch gives both, where the values' (b, 0) would give bias_hh a zero gradient.
_GRADIENT_TO_TORCH: dict[Callable[..., Any], Callable[..., Any]] = {_with_zeros: _repeated}


def gradient_to_torch(to_torch: Callable[..., Any]) -> Callable[..., Any]:
    """A rule's ``to_torch`` for a gradient of its leaves (:data:`_GRADIENT_TO_TORCH`)."""
    return _GRADIENT_TO_TORCH.get(to_torch, to_torch)


def _rnn(layer: RNN) -> list[Local] | None:  # another cell: None, walked into, its leaves matched by name
    """torch's first layer's tensors: ``_l0`` forward; ``reverse=True`` reads the sequence from
    its end as a bidirectional layer's second direction does, whose tensors are ``_l0_reverse``
    (a forward layer's names would load it into a layer computing another function)."""
    if not isinstance(layer.cell, (SimpleRNNCell, GRUCell, LSTMCell)):
        return None
    return _cell(layer.cell, suffix="_l0_reverse" if layer.reverse else "_l0", ft="cell")


_CELLS = (SimpleRNNCell, GRUCell, LSTMCell)


def _directions(layer: Any, k: int, ft: str) -> list[tuple[Any, str, str]] | None:
    """Layer ``k`` of torch's stack: its cells with their torch suffixes (``_l{k}``,
    ``_l{k}_reverse``) and ft names; None where a cell is not functree's."""
    if isinstance(layer, Bidirectional):
        pairs = [(layer.forward, "forward."), (layer.backward, "backward.")]
    else:
        pairs = [(layer, "")]
    found = []
    for rnn, name in pairs:
        if not isinstance(rnn, RNN) or not isinstance(rnn.cell, _CELLS):
            return None
        found.append((rnn.cell, f"_l{k}_reverse" if rnn.reverse else f"_l{k}", f"{ft}{name}cell"))
    return found


def _stacked(layer: StackedRNN | Bidirectional) -> list[Local] | None:
    """torch's ``nn.LSTM/GRU/RNN(num_layers=n, bidirectional=...)``: layer ``k``'s tensors
    ``weight_ih_l{k}`` (forward) and ``weight_ih_l{k}_reverse`` (backward); a Bidirectional
    alone is torch's one-layer bidirectional module (``_l0``, ``_l0_reverse``). A user's cell
    anywhere: None (walked into, its leaves matched by key path)."""
    layers = [(layer, "")] if isinstance(layer, Bidirectional) else [
        (sub, f"layers.{k}.") for k, sub in enumerate(layer.layers)]
    rules: list[Local] = []
    for k, (sub, ft) in enumerate(layers):
        found = _directions(sub, k, ft)
        if found is None:
            return None
        for cell, suffix, name in found:
            rules += _cell(cell, suffix=suffix, ft=name)
    return rules


_LAYERS: tuple[tuple[type | tuple[type, ...], Callable[[Any], list[Local] | None]], ...] = (
    ((WeightNorm, SpectralNorm), _reparametrized),
    (Conv, _conv),
    ((LayerNorm, GroupNorm, RMSNorm, BatchNorm, _InstanceNorm), _norm),
    ((Embedding, EmbeddingBag), lambda layer: [same("weight", "embeddings")]),
    (PReLU, lambda layer: [same("weight", "slope")]),
    (Bilinear, lambda layer: [_permuted("weight", "weight", (1, 2, 0))]  # torch [out, in1, in2]
     + ([same("bias", "bias")] if layer.bias is not None else [])),
    ((SimpleRNNCell, GRUCell, LSTMCell), _cell),
    (RNN, _rnn),
    ((StackedRNN, Bidirectional), _stacked),
    # torch's stacked experts are [E, out, in] (transformers' MixtralExperts), ft's [E, in, out] as Dense
    (Experts, lambda layer: [_permuted("gate_up_proj", "gate_up_proj", (0, 2, 1)),
                             _permuted("down_proj", "down_proj", (0, 2, 1))]),
)


@dataclasses.dataclass
class Options:
    """``flattened=`` and ``layouts=`` as the plan reads them, and what it met on the way (the
    Dense and attention layers' names, the patterns used): an option naming no layer is an
    error once the whole model is walked."""

    flattened: Mapping[str, tuple[int, ...] | None]
    layouts: Mapping[str, Any]
    dense: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    layered: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # Dense, attention
    attentions: list[str] = dataclasses.field(default_factory=list)
    used: set[str] = dataclasses.field(default_factory=set)
    pattern: str = ""  # the layouts= pattern that matched last

    def layout(self, ft: str, torch: str) -> Any:
        self.layered.append((torch, ft))
        for pattern, layout in self.layouts.items():
            if matches(torch, pattern) or matches(ft, pattern):
                self.used.add(pattern)
                self.pattern = pattern  # the one a bad layout's error shows
                return layout
        return None


def layer_rules(node: Any, ft: str, torch: str, options: Options) -> list[Local] | None:
    """``node``'s rules (local names) if it is a known layer, in the layout ``options`` pick
    for it (checked), else None."""
    if isinstance(node, Dense):
        options.dense.append((torch, ft))
        layout = options.layout(ft, torch)
        shape = options.flattened.get(torch, options.flattened.get(ft))
        if shape is not None and int(np.prod(shape)) != node.weight.shape[0]:
            raise ValueError(FLATTENED_SIZE.format(name=torch, shape=tuple(shape), size=int(np.prod(shape)),
                                                   inputs=node.weight.shape[0]))
        return _dense(node, None if shape is None else tuple(shape), layout=_checked_layout(layout, torch, DENSE_LAYOUTS, options))
    if isinstance(node, MultiheadAttention):
        options.attentions.append(torch)
        layout = options.layout(ft, torch)
        named = isinstance(layout, (tuple, list)) and all(isinstance(n, str) for n in layout) and (
            len(layout) in (2, 4) or (len(layout) == 3 and layout[2] == "per_head"))
        if named and len(layout) == 3 and node.num_kv_heads != node.num_heads:  # no [q_h | k_h | v_h] rows
            raise ValueError(PER_HEAD_GROUPED.format(name=torch, layout=tuple(layout), pattern=options.pattern,
                                                     heads=node.num_heads, kv=node.num_kv_heads,
                                                     fused=tuple(layout[:2])))
        if not named:
            layout = _checked_layout(layout, torch, ATTENTION_LAYOUTS, options)
        return _attention(node, layout)
    for cls, make in _LAYERS:
        if isinstance(node, cls):
            return make(node)
    return None


DENSE_LAYOUTS = ("linear", "conv1d")
ATTENTION_LAYOUTS = ("torch", "conv1d", "(q, k, v, output) Linear names", "(qkv, output) names of a fused q|k|v "
                     "Linear and the output Linear", "(qkv, output, 'per_head') with q, k, v rows per head (GPT-NeoX)")


def _checked_layout(layout: Any, torch: str, known: tuple[str, ...], options: Options) -> Any:
    if layout is None or layout in known[:2]:
        return layout
    other, why = (("'linear'", "torch's Linear (the default)") if known is DENSE_LAYOUTS
                  else ("('q_proj', 'k_proj', 'v_proj', 'o_proj')", "its four Linears' names"))
    raise ValueError(BAD_LAYOUT.format(layout=layout, name=torch, known=", ".join(known), other=other, why=why,
                                       pattern=options.pattern))
